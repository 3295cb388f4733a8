"""Loads a published LoRA adapter with PEFT onto the base model it names, generates, and says which weights it changed.

Standalone; run it with the torch venv's python (local/setup_hfcheck.sh), the Hub named by HF_ENDPOINT, its token
in HF_TOKEN:

    python check_peft_adapter.py ADAPTER_REPO --revision BRANCH

The base is the one the adapter's config names (``base_model_name_or_path`` at ``revision``), as a user's
``AutoPeftModelForCausalLM.from_pretrained`` finds it. Prints JSON: the adapter's target modules, the base's
weights the merged adapter changed and those it left equal, and the generated token ids; exits non-zero if
loading or generation fails.
"""

import argparse
import json
import sys


def check(adapter: str, revision: str | None, max_new_tokens: int) -> dict:
    import torch
    from peft import AutoPeftModelForCausalLM, PeftConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = PeftConfig.from_pretrained(adapter, revision=revision)
    base_id, base_revision = config.base_model_name_or_path, config.revision
    base = AutoModelForCausalLM.from_pretrained(base_id, revision=base_revision, dtype=torch.float32)
    before = {name: tensor.clone() for name, tensor in base.state_dict().items()}
    model = AutoPeftModelForCausalLM.from_pretrained(adapter, revision=revision, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(base_id, revision=base_revision)
    input_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "How are you?"}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, min_new_tokens=1,
            do_sample=False,
        )
    after = model.merge_and_unload().state_dict()
    changed = sorted(name for name, tensor in before.items() if not torch.equal(tensor, after[name]))
    return {
        "base": f"{base_id}@{base_revision}",
        "target_modules": sorted(config.target_modules),
        "changed": changed,
        "unchanged": sorted(set(before) - set(changed)),
        "generated": output[0, input_ids.shape[1] :].tolist(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("adapter", help="the adapter's Hub repo (or folder)")
    parser.add_argument("--revision", help="its branch or commit")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    result = check(args.adapter, args.revision, args.max_new_tokens)
    print(json.dumps(result))
    return 0 if result["generated"] else 1


if __name__ == "__main__":
    sys.exit(main())
