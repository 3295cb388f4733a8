#!/usr/bin/env python3
"""Export fidelity: the exported model must compute what MaxText's trained checkpoint computes.

Runs on the VM that exported (the pipeline copies it there, beside publish_model.py), after ``to_huggingface`` and
before anything is kept or published. Standalone: the standard library, plus what each half needs.

``reference`` (MaxText's venv: JAX, MaxText, transformers' tokenizers, pyarrow): reads the run's dataset's held-out
files from the Hub (only those) and tokenizes their first ``--rows`` rows with the base model's tokenizer and chat
template (SFT: the eval split's ``messages``; GRPO: the eval files' ``question`` and ``answer`` as a user turn and an
assistant turn), cut at ``--max-length`` tokens; it then loads the
trained checkpoint with MaxText's own model code (``model_creation_utils.from_pretrained``; for a LoRA run the base
with MaxText's LoRA applied and the trained adapter restored, as ``train_sft`` does), rounds its weights to the
dtype the export stored (the export is written in ``weight_dtype``, bfloat16: that rounding is the export's
intended loss, not a fault), and writes the rows' token ids and MaxText's next-token losses (float32, on the CPU).

``check`` (a Python with torch and transformers, and PEFT for an adapter): scores the same token ids with the
exported model (an adapter: loaded with PEFT onto its base model) and compares. It fails, naming both numbers, when
the mean loss differs by more than ``--tolerance`` or a token's loss by more than ``--token-tolerance``. For an
adapter also: every module PEFT adapts (its ``target_modules``) has its weights in the file and the file has no
other, and merged, the adapter changes exactly the target modules' weights of the base, each by a non-zero amount.

Exit 0: the export is faithful (the result JSON says by how much); 1: it is not, or the check could not run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import struct
import sys
import time
from pathlib import Path

# The default bounds, in nats, from the local twins' untouched exports (docs/local-stand-ins.md gives the gaps):
# a faithful export differs from MaxText by float32 arithmetic only, once MaxText's weights are rounded as the export's.
DEFAULT_TOLERANCE = 1e-3  # |mean loss (MaxText) - mean loss (transformers)|
DEFAULT_TOKEN_TOLERANCE = 1e-2  # the largest |difference| of one token's loss
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.jinja", "*.txt", "*.tiktoken")  # the base model's files, no weights
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight")


class FidelityError(Exception):
    """The export is not what MaxText trained (or cannot be checked); the script exits 1 with this message."""


# ---- the rows -------------------------------------------------------------------------------------------------


def download(repo_id: str, revision: str | None, patterns: list[str], repo_type: str | None = None) -> str:
    """A folder with the repo's files that match ``patterns``, read from the Hub with $HF_TOKEN (a folder: itself)."""
    if os.path.isdir(repo_id):
        return repo_id
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision or None, repo_type=repo_type, allow_patterns=patterns)


def held_out_chats(dataset_dir: str, files: str, count: int) -> list[list[dict]]:
    """The first ``count`` held-out rows as chats: ``messages`` (SFT), or ``question`` and ``answer`` (GRPO)."""
    import pyarrow.parquet as pq

    paths = sorted(glob.glob(os.path.join(dataset_dir, files), recursive=True))
    if not paths:
        raise FidelityError(f"the dataset has no held-out files {files}")
    chats: list[list[dict]] = []
    for path in paths:
        for row in pq.read_table(path).slice(0, count - len(chats)).to_pylist():
            if "messages" in row:
                chats.append([{"role": m["role"], "content": m["content"]} for m in row["messages"]])
            else:
                chats.append([{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}])
        if len(chats) >= count:
            break
    if not chats:
        raise FidelityError(f"the held-out files {files} have no rows")
    return chats


def tokenized(tokenizer_dir: str, chats: list[list[dict]], max_length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, tokenize=False) if tokenizer.chat_template else chat[-1]["content"]
        ids = tokenizer.encode(text, add_special_tokens=not tokenizer.chat_template)[:max_length]
        if len(ids) >= 2:
            rows.append(ids)
    if not rows:
        raise FidelityError("no held-out row has two tokens")
    return rows


def padded(rows: list[list[int]]) -> tuple[list[list[int]], int]:
    length = max(len(row) for row in rows)
    return [row + [0] * (length - len(row)) for row in rows], length


def token_losses(log_probs, rows: list[list[int]]) -> list[list[float]]:
    """Each row's next-token losses from ``log_probs`` [rows, positions, vocab] (numpy), its real tokens only."""
    return [
        [-float(log_probs[r, t, row[t + 1]]) for t in range(len(row) - 1)] for r, row in enumerate(rows)
    ]


# ---- MaxText's half -------------------------------------------------------------------------------------------


def export_dtype(model_dir: Path) -> str:
    """The dtype the export stored its weights in (the largest share of its safetensors' tensors)."""
    counts: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as file:
            (size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(size))
        header.pop("__metadata__", None)
        for info in header.values():
            counts[info["dtype"]] = counts.get(info["dtype"], 0) + math.prod(info["shape"])
    if not counts:
        raise FidelityError(f"no safetensors weights in {model_dir}")
    dtype = max(counts, key=counts.get)
    if dtype not in _SAFETENSORS_DTYPES:
        raise FidelityError(f"the export stores {dtype} weights; the check knows {sorted(_SAFETENSORS_DTYPES)}")
    return _SAFETENSORS_DTYPES[dtype]


def maxtext_token_losses(
    maxtext_args: list[str], rows: list[list[int]], round_to: str, lora: bool
) -> tuple[list[list[float]], int]:
    """MaxText's next-token losses of the checkpoint ``maxtext_args`` load, its weights rounded to ``round_to``.

    And the size of the vocabulary they are over (MaxText's ``vocab_size``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    batch, length = padded(rows)
    configs = Path(pyconfig.__file__).parent
    config_file = configs / ("post_train/sft.yml" if lora else "base.yml")
    args = [*maxtext_args, f"per_device_batch_size={len(rows)}", f"max_target_length={length}"]
    config = pyconfig.initialize([sys.argv[0], str(config_file), *args])
    loaded = model_creation_utils.from_pretrained(config)
    model, mesh = loaded if isinstance(loaded, tuple) else (loaded, None)
    if lora:
        from maxtext.utils import lora_utils

        model = lora_utils.apply_lora_to_model(model, mesh, config)
        lora_utils.restore_lora_from_path(model, config)
    params = nnx.state(model, nnx.Param)
    dtype = jnp.dtype(round_to)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype).astype(jnp.float32) if x.dtype == jnp.float32 else x, params))
    ids = np.asarray(batch, dtype=np.int32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), ids.shape)
    logits = model(ids, positions, decoder_segment_ids=np.ones_like(ids), enable_dropout=False)
    logits = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
    return token_losses(logits, rows), logits.shape[-1]


def reference(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    dataset_dir = download(args.dataset, args.dataset_revision, [args.files], "dataset")
    chats = held_out_chats(dataset_dir, args.files, args.rows)
    tokenizer = download(args.tokenizer, args.tokenizer_revision, list(TOKENIZER_PATTERNS))
    rows = tokenized(tokenizer, chats, args.max_length)
    round_to = export_dtype(args.model_dir)
    os.environ.pop("HF_TOKEN", None)  # MaxText's config would copy it into hf_access_token
    losses, vocab = maxtext_token_losses(args.maxtext_args, rows, round_to, args.lora)
    return {
        "rows": rows, "maxtext": losses, "vocab_size": vocab, "rounded_to": round_to,
        "seconds": round(time.monotonic() - started, 1),
    }


# ---- transformers' half ---------------------------------------------------------------------------------------


def _weights(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def adapter_problems(model, model_dir: Path, base_weights: dict) -> tuple[list[str], dict]:
    """What is wrong with the adapter PEFT loaded (keys, and what merging it changes); and what it changed."""
    import torch
    from safetensors import safe_open

    with safe_open(str(model_dir / "adapter_model.safetensors"), "pt") as file:
        in_file = {}
        for key in file.keys():
            match = _LORA_KEY.fullmatch(key)
            in_file.setdefault(match[1] if match else key, set()).add(match[2] if match else "?")
    adapted = {
        name.removeprefix("base_model.model.")
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {})
    }
    problems = [
        _listed("missing adapter weights (PEFT adapts the module; the file has no lora_A/lora_B) for", adapted - in_file.keys()),
        _listed("unexpected adapter weights (not a module PEFT adapts) for", in_file.keys() - adapted),
        _listed("a lora_A or lora_B only for", {name for name, pair in in_file.items() if name in adapted and pair != {"A", "B"}}),
    ]
    merged = model.merge_and_unload().state_dict()
    changed = {}
    for name, before in base_weights.items():
        after = merged.get(name)
        if after is not None and not torch.equal(before, after):
            changed[name.removesuffix(".weight")] = float((after - before).abs().max())
    problems += [
        _listed(f"merged, the adapter leaves unchanged {len(adapted - changed.keys())} of its {len(adapted)} target weights:",
                adapted - changed.keys()),
        _listed("merged, the adapter changes weights of no target module:", changed.keys() - adapted),
    ]
    return [problem for problem in problems if problem], changed


def _listed(what: str, names: set[str], shown: int = 4) -> str:
    """``what`` and the first ``shown`` names (and how many more); empty when there are none."""
    if not names:
        return ""
    listed = sorted(names)
    more = f" and {len(listed) - shown} more" if len(listed) > shown else ""
    return f"{what} {', '.join(listed[:shown])}{more}"


def transformers_token_losses(model, rows: list[list[int]], vocab_size: int | None = None) -> list[list[float]]:
    """The export's next-token losses, over its first ``vocab_size`` rows when given (MaxText's vocabulary).

    Gemma 3's checkpoints hold more embedding rows than MaxText's model has (the Hub's 262208, MaxText's 262144; the
    tiny twin's 576 and 512): MaxText's losses are over its own, and so are the export's that are compared with them."""
    import torch

    batch, _ = padded(rows)
    ids = torch.tensor(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    if vocab_size is not None:
        if logits.shape[-1] < vocab_size:
            raise FidelityError(f"the export has {logits.shape[-1]} vocabulary rows, MaxText's model {vocab_size}")
        logits = logits[..., :vocab_size]
    return token_losses(torch.log_softmax(logits, dim=-1).numpy(), rows)


def load_export(model_dir: Path, base_dir: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    if base_dir is None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(), None
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base_weights = _weights(base)
    return PeftModel.from_pretrained(base, str(model_dir)).eval(), base_weights


def base_model_dir(repo_id: str, revision: str | None, endpoint: str | None) -> str:
    """The adapter's base on the Hub (its weights too), read with $HF_TOKEN (a folder: itself)."""
    if os.path.isdir(repo_id):
        return repo_id
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision or None, endpoint=endpoint or None)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def check(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    ref = json.loads(args.reference.read_text())
    rows, expected = ref["rows"], ref["maxtext"]
    base_dir = base_model_dir(args.base_model, args.base_revision, args.hub_endpoint) if args.base_model else None
    model, base_weights = load_export(args.model_dir, base_dir)
    got = transformers_token_losses(model, rows, ref.get("vocab_size"))
    flat_expected = [value for row in expected for value in row]
    flat_got = [value for row in got for value in row]
    loss_maxtext, loss_export = mean(flat_expected), mean(flat_got)
    gap = abs(loss_maxtext - loss_export)
    token_gap = max(abs(a - b) for a, b in zip(flat_expected, flat_got, strict=True))
    problems = []
    if not (gap <= args.tolerance and token_gap <= args.token_tolerance):
        problems.append(
            f"on {len(rows)} held-out rows ({len(flat_got)} tokens) the export's loss is {loss_export:.6f}, MaxText's "
            f"of the trained checkpoint {loss_maxtext:.6f} (weights rounded to {ref['rounded_to']}): they differ by "
            f"{gap:.2e} (tolerance {args.tolerance:.0e}), one token's loss by up to {token_gap:.2e} (tolerance "
            f"{args.token_tolerance:.0e})"
        )
    changed = None
    if base_weights is not None:
        adapter, changed = adapter_problems(model, args.model_dir, base_weights)
        problems += adapter
    result = {
        "faithful": not problems,
        "rows": len(rows),
        "tokens": len(flat_got),
        "loss_maxtext": loss_maxtext,
        "loss_export": loss_export,
        "loss_gap": gap,
        "max_token_gap": token_gap,
        "tolerance": args.tolerance,
        "token_tolerance": args.token_tolerance,
        "rounded_to": ref["rounded_to"],
        "seconds": {"maxtext": ref.get("seconds"), "transformers": round(time.monotonic() - started, 1)},
    }
    if changed is not None:
        result["adapter_changes"] = len(changed)
    if problems:
        result["problems"] = problems
    return result


# ---- command line ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ref = commands.add_parser("reference", help="MaxText's losses of the trained checkpoint (MaxText's venv)")
    ref.add_argument("--model-dir", required=True, type=Path, help="the export (for the dtype it stored)")
    ref.add_argument("--out", required=True, type=Path)
    ref.add_argument("--tokenizer", required=True, metavar="REPO_ID", help="the base model (its tokenizer and chat template)")
    ref.add_argument("--tokenizer-revision")
    ref.add_argument("--dataset", required=True, metavar="REPO_ID", help="the run's dataset on the Hub")
    ref.add_argument("--dataset-revision")
    ref.add_argument("--files", required=True, help="its held-out parquet files (a glob in the repo)")
    ref.add_argument("--rows", type=int, default=4)
    ref.add_argument("--max-length", type=int, default=128)
    ref.add_argument("--lora", action="store_true", help="the checkpoint holds LoRA adapters (MaxText's lora.* keys)")
    ref.add_argument("maxtext_args", nargs="*", help="MaxText's key=value settings that load the trained checkpoint")
    chk = commands.add_parser("check", help="score the export with transformers and compare (torch's venv)")
    chk.add_argument("--model-dir", required=True, type=Path)
    chk.add_argument("--reference", required=True, type=Path)
    chk.add_argument("--out", required=True, type=Path)
    chk.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    chk.add_argument("--token-tolerance", type=float, default=DEFAULT_TOKEN_TOLERANCE)
    chk.add_argument("--base-model", help="an adapter's base model on the Hub (its weights are read with $HF_TOKEN)")
    chk.add_argument("--base-revision")
    chk.add_argument("--hub-endpoint")
    return parser.parse_args(argv)


def write_json(path: Path, data: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(data) + "\n")
    os.replace(staging, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.unlink(missing_ok=True)
    try:
        if args.command == "reference":
            result = reference(args)
            print(f"export_fidelity: MaxText scored {len(result['rows'])} held-out rows in {result['seconds']} s")
        else:
            result = check(args)
            print(f"export_fidelity: {json.dumps({k: v for k, v in result.items() if k != 'problems'})}", flush=True)
        write_json(args.out, result)
    except FidelityError as error:
        print(f"export_fidelity: error: {error}", file=sys.stderr, flush=True)
        return 1
    if not result.get("faithful", True):
        listed = "\n  - ".join(result["problems"])
        print(
            f"export_fidelity: error: the export in {args.model_dir} is not the model MaxText trained; it is left "
            f"there for a look:\n  - {listed}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
