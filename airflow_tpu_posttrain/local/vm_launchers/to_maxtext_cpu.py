"""Local-only launcher: `maxtext.checkpoint_conversion.to_maxtext` for a shrunk model given by --hf_model_path.

Takes exactly to_maxtext's argv. to_maxtext maps weights using a hard-coded Hugging Face config per
model_name (HF_MODEL_CONFIGS), so a model whose dims are overridden (the tiny local model) fails or is
silently mis-mapped. This replaces that entry with the config of the --hf_model_path directory, then
runs to_maxtext unchanged. Without --hf_model_path it changes nothing.
"""

import runpy
import sys

from hf_model_config import use_local_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_maxtext"

if __name__ == "__main__":
    use_local_config(sys.argv[1:], "to_maxtext_cpu")
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
