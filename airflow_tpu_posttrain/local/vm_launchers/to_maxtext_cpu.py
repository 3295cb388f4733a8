"""Local-only launcher: `maxtext.checkpoint_conversion.to_maxtext` for a shrunk model given by --hf_model_path.

Takes exactly to_maxtext's argv. to_maxtext maps weights using a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS), so a model whose dims are overridden (the tiny local model) fails or is
silently mis-mapped. This replaces that entry with the config of the --hf_model_path directory, then
runs to_maxtext unchanged. Without --hf_model_path it changes nothing.
"""

import runpy
import sys

MODULE = "maxtext.checkpoint_conversion.to_maxtext"


def _arg_value(argv: list[str], name: str) -> str | None:
    """Value of `name=V`, `--name=V` or `--name V` in argv (the forms MaxText's converters accept)."""
    for i, arg in enumerate(argv):
        for prefix in (f"{name}=", f"--{name}="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def patch_hf_model_config(argv: list[str]) -> None:
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from transformers import AutoConfig

    model_name, hf_model_path = _arg_value(argv, "model_name"), _arg_value(argv, "hf_model_path")
    if not model_name or not hf_model_path:
        return
    local_config = AutoConfig.from_pretrained(hf_model_path)
    # to_maxtext looks the table up under the name without "-Instruct".
    for key in {model_name, model_name.replace("-Instruct", "")}:
        HF_MODEL_CONFIGS[key] = local_config
    print(f"[to_maxtext_cpu] HF_MODEL_CONFIGS[{model_name!r}] <- {hf_model_path}/config.json", flush=True)


if __name__ == "__main__":
    patch_hf_model_config(sys.argv[1:])
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
