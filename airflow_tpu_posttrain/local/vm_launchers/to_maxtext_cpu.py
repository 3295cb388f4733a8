"""Local-only launcher: `maxtext.checkpoint_conversion.to_maxtext` for a shrunk model, on a CPU.

Takes exactly to_maxtext's argv, patches in-process (hf_model_config.py says why, with MaxText file:line),
then runs to_maxtext unchanged:
- HF_MODEL_CONFIGS[model_name] <- the model's real config (--hf_model_path if given, else HF_IDS[model_name]
  on the Hub named by HF_ENDPOINT, read with HF_TOKEN);
- MaxText 0.2.2 without torch: an empty `torch` module for its unused module-level imports;
- safe_open falls back to the Hub files' pre-transformers-4.52 tensor names (Gemma 3, --lazy_load_tensors=True).
"""

import runpy
import sys

from hf_model_config import legacy_tensor_names, stub_torch_if_missing, use_model_config  # beside this file

MODULE = "maxtext.checkpoint_conversion.to_maxtext"

if __name__ == "__main__":
    use_model_config(sys.argv[1:], "to_maxtext_cpu")
    stub_torch_if_missing("to_maxtext_cpu")
    legacy_tensor_names("to_maxtext_cpu")
    runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
