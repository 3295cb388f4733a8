"""Local-only launcher: `maxtext.checkpoint_conversion.to_huggingface` for a shrunk model, on a CPU.

Takes exactly to_huggingface's argv. to_huggingface starts from a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS): the export would get the big model's dims (gemma3-4b: --override_model_architecture
changes nothing, its config has no top-level dims), or, where the flag works, the big model's other fields
(bos/eos ids, rope, dtype). This replaces the entry with the model's real config (--hf_model_path if given,
else HF_IDS[model_name] on the Hub named by HF_ENDPOINT, read with HF_TOKEN: the repo to_huggingface takes
the tokenizer from), then runs to_huggingface unchanged.

A LoRA adapter's export (``lora.lora_restore_path``) hands safetensors' numpy writer JAX arrays. The TPU install
(maxtext[tpu-post-train] at its lowest versions) has safetensors 0.7.0, whose writer takes them (``tobytes``);
the CPU venv needs maxtext[tpu]'s safetensors>=0.8.0, whose writer reads ``.ctypes`` and fails on them. So they
are made numpy arrays first. And MaxText's own table gives the exported config MaxText's vocab_size (gemma3-4b:
262144, where the Hub's config says 262208 rows), which 0.2.5's to_huggingface checks against MaxText's config
(``_validate_or_update_architecture``): the real config put in its place gets MaxText's vocab_size too (the
adapter holds no embedding).
"""

import runpy
import sys

from hf_model_config import use_model_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_huggingface"


def use_maxtext_vocab_size(argv: list[str]) -> None:
    """The table's config (now the model's real one) says MaxText's vocab_size, as MaxText's own table does."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS

    args = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    if "vocab_size" in args and args.get("model_name") in HF_MODEL_CONFIGS:
        config = HF_MODEL_CONFIGS[args["model_name"]]
        getattr(config, "text_config", config).vocab_size = int(args["vocab_size"])


def write_numpy_arrays() -> None:
    """MaxText's adapter writer hands safetensors numpy arrays, as safetensors 0.8's writer needs."""
    import numpy as np
    from maxtext.checkpoint_conversion.utils import utils

    save_file = utils.numpy_save_file

    def numpy_save_file(tensors, *args, **kwargs):
        return save_file({name: np.ascontiguousarray(value) for name, value in tensors.items()}, *args, **kwargs)

    utils.numpy_save_file = numpy_save_file


if __name__ == "__main__":
    use_model_config(sys.argv[1:], "to_huggingface_cpu")
    if any(arg.startswith("lora.lora_restore_path=") for arg in sys.argv[1:]):
        use_maxtext_vocab_size(sys.argv[1:])
        write_numpy_arrays()
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
