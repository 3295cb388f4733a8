"""Local-only launcher: `maxtext.checkpoint_conversion.to_huggingface` for a shrunk model given by --hf_model_path.

Takes exactly to_huggingface's argv. to_huggingface starts from a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS); --override_model_architecture fixes the dims but the exported
config.json keeps that model's other fields (bos/eos ids, rope, dtype). This replaces the entry with
the config of the --hf_model_path directory (where the tokenizer comes from too), then runs
to_huggingface unchanged. Without --hf_model_path it changes nothing.
"""

import runpy
import sys

from hf_model_config import use_local_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_huggingface"

if __name__ == "__main__":
    use_local_config(sys.argv[1:], "to_huggingface_cpu")
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
