"""Local-only launcher: `maxtext.checkpoint_conversion.to_huggingface` for a shrunk model, on a CPU.

Takes exactly to_huggingface's argv. to_huggingface starts from a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS): the export would get the big model's dims (gemma3-4b: --override_model_architecture
changes nothing, its config has no top-level dims), or, where the flag works, the big model's other fields
(bos/eos ids, rope, dtype). This replaces the entry with the model's real config (--hf_model_path if given,
else HF_IDS[model_name] on the Hub named by HF_ENDPOINT, read with HF_TOKEN: the repo to_huggingface takes
the tokenizer from), then runs to_huggingface unchanged.
"""

import runpy
import sys

from hf_model_config import use_model_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_huggingface"

if __name__ == "__main__":
    use_model_config(sys.argv[1:], "to_huggingface_cpu")
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
