"""Shared by the conversion launchers: MaxText's Hugging Face config table entry replaced by a local model's."""

import sys


def _arg_value(argv: list[str], name: str) -> str | None:
    """Value of `name=V`, `--name=V` or `--name V` in argv (the forms MaxText's converters accept)."""
    for i, arg in enumerate(argv):
        for prefix in (f"{name}=", f"--{name}="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def use_local_config(argv: list[str], launcher: str) -> None:
    """``HF_MODEL_CONFIGS[model_name]`` becomes the config of the ``--hf_model_path`` directory, if given."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from transformers import AutoConfig

    model_name, hf_model_path = _arg_value(argv, "model_name"), _arg_value(argv, "hf_model_path")
    if not model_name or not hf_model_path:
        return
    local_config = AutoConfig.from_pretrained(hf_model_path)
    # to_maxtext looks the table up under the name without "-Instruct", to_huggingface under the name itself.
    for key in {model_name, model_name.replace("-Instruct", "")}:
        HF_MODEL_CONFIGS[key] = local_config
    print(
        f"[{launcher}] HF_MODEL_CONFIGS[{model_name!r}] <- {hf_model_path}/config.json",
        file=sys.stdout,
        flush=True,
    )
