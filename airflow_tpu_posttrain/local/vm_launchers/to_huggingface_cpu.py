"""Local-only launcher: `maxtext.checkpoint_conversion.to_huggingface` for a shrunk model given by --hf_model_path.

Takes exactly to_huggingface's argv. to_huggingface starts from a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS); --override_model_architecture fixes the dims but the exported
config.json keeps that model's other fields (bos/eos ids, rope, dtype). This replaces the entry with
the config of the --hf_model_path directory (where the tokenizer comes from too), then runs
to_huggingface unchanged. Without --hf_model_path it changes nothing.
"""

import runpy
import sys

MODULE = "maxtext.checkpoint_conversion.to_huggingface"


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
    HF_MODEL_CONFIGS[model_name] = AutoConfig.from_pretrained(hf_model_path)
    print(f"[to_huggingface_cpu] HF_MODEL_CONFIGS[{model_name!r}] <- {hf_model_path}/config.json", flush=True)


if __name__ == "__main__":
    patch_hf_model_config(sys.argv[1:])
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
