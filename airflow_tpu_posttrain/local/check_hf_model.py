"""Checks that an exported Hugging Face model directory loads with transformers and generates.

Standalone; run it with the torch venv's python (local/setup_hfcheck.sh):

    python check_hf_model.py DIR [--prompt TEXT] [--max-new-tokens N]

Prints the generated token ids and text; exits non-zero (with the error) if loading or generation
fails, or if nothing is generated.
"""

import argparse
import sys


def check(model_dir: str, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedily generates up to max_new_tokens after a one-message chat; returns the new token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    if tokenizer.chat_template:
        input_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=1,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
        )
    new_ids = output[0, input_ids.shape[1] :].tolist()
    print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters")
    print(f"prompt ids: {input_ids[0].tolist()}")
    print(f"generated ids: {new_ids}")
    print(f"generated text: {tokenizer.decode(new_ids)!r}")
    return new_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--prompt", default="What is 2 plus 3?")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    try:
        new_ids = check(args.model_dir, args.prompt, args.max_new_tokens)
    except Exception as error:  # noqa: BLE001 - any failure means "does not load or generate"
        print(f"check failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if not new_ids:
        print("check failed: no tokens generated", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
