#!/usr/bin/env python3
"""Validate an exported Hugging Face model folder, then publish it to the Hub and/or to storage.

Runs ON the TPU VM: the pipeline copies this file there and runs it with the MaxText venv's python.
It is therefore standalone: standard library, plus huggingface_hub (only with --hub-repo) and
google-cloud-storage (only for gs:// URIs), both imported where needed.

The Hub token is read from the file named by $HF_TOKEN_FILE; it never comes from argv and is never
printed (error messages are scrubbed of it too).

With --base-model, the export takes its base model's settings from the Hub:
- ``generation_config.json``, when the export has none (MaxText's to_huggingface writes none, and its config.json
  carries MaxText's table's single eos id: Llama 3.1 Instruct's 128001, not its end of turn 128009, so
  ``generate()`` would run past the end of every answer);
- ``config.json``: to_huggingface writes the config of MaxText's own table, which can differ from the base
  model's in settings no tensor shape shows. MaxText 0.2.2's ``gemma3-4b`` entry says RoPE base 10000 for the
  global layers, which MaxText trains with 1,000,000 (its gemma3-4b.yml ``rope_max_timescale``), and 163840
  positions where the Hub's config allows 131072: published as written, every global layer would rotate with
  the wrong base. Post-training changes no setting, so the published config is the base model's; its shape keys
  must agree with the export's, and ``vocab_size`` stays the export's (MaxText's 262144 embedding rows for
  Gemma 3, the Hub's 262208).

With --adapter-rank (a LoRA run), the folder holds a PEFT adapter instead (MaxText's ``adapter_config.json`` and
``adapter_model.safetensors``): each ``lora_A`` / ``lora_B`` pair must have the rank trained and the shape of the
base model's weight it adapts (the base's config.json at --base-revision), and ``adapter_config.json`` is
pointed at that base: ``base_model_name_or_path`` is the base repo (MaxText writes its own table's id) and
``revision`` the revision converted, so ``PeftModel.from_pretrained`` loads the base it was trained on. Where PEFT
and torch are installed (MaxText's TPU environment has both), the adapter is then loaded onto that base with PEFT
and must generate.

With --fidelity-reference (MaxText's losses of the trained checkpoint on held-out rows, written by
export_fidelity.py's ``reference`` after the export), the folder as it will be published (its config the base
model's, an adapter pointed at its base) is scored by export_fidelity.py's ``check`` with --fidelity-python (a Python
with torch, transformers and PEFT): an export that does not compute what MaxText trained is refused before anything
is kept or published, naming both losses; the numbers go into the result and the model card. A reference that says
``restored_from`` is an export kept by an earlier try, checked then. With --keep-uri, a refused export is copied to
``<keep-uri>.unfaithful`` for a look (never marked complete: nothing publishes it); the script exits 3.

With --card, the folder first gets a model card (README.md, made with huggingface_hub's ModelCard and
ModelCardData) and the training curve it shows (training_curve.png, drawn with matplotlib, a MaxText
dependency), so the Hub page and the storage copy carry both.

Re-running with unchanged files changes nothing: huggingface_hub drops files whose remote oid equals
the local one and skips a commit that would be empty, so the branch head (and the reported
commit sha) stays the same; storage copies whose destination already holds identical files are skipped.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

from model_card import write_card  # beside this file, here and on the VM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
REQUIRED_CONFIG_KEYS = (
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "num_hidden_layers",
)
# Config keys that fix tensor shapes: an export must agree with the expected config on these.
SHAPE_CONFIG_KEYS = (*REQUIRED_CONFIG_KEYS, "num_key_value_heads", "head_dim", "tie_word_embeddings")
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
MAX_LISTED_PROBLEMS = 20
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_ADAPTER_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


class PublishError(Exception):
    """A failure explained to the operator; the script exits 1 with this message."""


class UnfaithfulExportError(PublishError):
    """The export does not compute what MaxText trained (export_fidelity.py); the script exits 3 with this message.

    The export job then drops its export marker, so the next try exports again."""


EXIT_UNFAITHFUL = 3


# ---- validation -------------------------------------------------------------------------------------


def read_json_file(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PublishError(f"{what} not found: {path}") from None
    except (OSError, ValueError) as error:
        raise PublishError(f"{what} is not readable JSON: {path}: {error}") from None
    if not isinstance(data, dict):
        raise PublishError(f"{what} must hold a JSON object: {path}")
    return data


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets}, checked against the file size (catches truncation)."""
    file_size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise PublishError(f"{path.name}: too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > file_size - 8:
            raise PublishError(f"{path.name}: header length {header_size} exceeds the file size")
        try:
            header = json.loads(file.read(header_size))
        except ValueError as error:
            raise PublishError(f"{path.name}: unreadable safetensors header: {error}") from None
    header.pop("__metadata__", None)
    data_size = file_size - 8 - header_size
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            expected_bytes = math.prod(info["shape"]) * DTYPE_SIZES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise PublishError(f"{path.name}: malformed header entry for tensor {name}: {info}") from None
        if not 0 <= begin <= end <= data_size or end - begin != expected_bytes:
            raise PublishError(
                f"{path.name}: tensor {name} has data offsets {info['data_offsets']} that do "
                f"not fit its shape/dtype or the file ({data_size} data bytes)"
            )
    return header


def language_model(config: dict) -> tuple[dict, str]:
    """The language model's config and the prefix of its tensors.

    A multimodal checkpoint (Gemma 3's ``Gemma3ForConditionalGeneration``, as MaxText's to_huggingface writes
    ``gemma3-4b`` even with ``use_multimodal=False``) keeps the sizes under ``text_config`` and the tensors
    under ``model.language_model.``; a text-only one (Llama) has both at the top."""
    text_config = config.get("text_config")
    if isinstance(text_config, dict):
        return text_config, "model.language_model."
    return config, "model."


def expected_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Weights a Llama/Gemma-style HF checkpoint must hold, with shapes, derived from config.json."""
    config, prefix = language_model(config)
    missing_keys = [key for key in REQUIRED_CONFIG_KEYS if not isinstance(config.get(key), int)]
    if missing_keys:
        raise PublishError(f"config.json lacks integer values for: {', '.join(missing_keys)}")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    intermediate, vocab = config["intermediate_size"], config["vocab_size"]
    model_type = config.get("model_type", "")
    # transformers' defaults: Gemma ties the output head to the embeddings, Llama does not.
    tied = config.get("tie_word_embeddings", model_type.startswith("gemma"))

    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}embed_tokens.weight": (vocab, hidden),
        f"{prefix}norm.weight": (hidden,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        layer_prefix = f"{prefix}layers.{layer}."
        shapes |= {
            f"{layer_prefix}self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer_prefix}self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer_prefix}self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer_prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer_prefix}mlp.gate_proj.weight": (intermediate, hidden),
            f"{layer_prefix}mlp.up_proj.weight": (intermediate, hidden),
            f"{layer_prefix}mlp.down_proj.weight": (hidden, intermediate),
            f"{layer_prefix}input_layernorm.weight": (hidden,),
            f"{layer_prefix}post_attention_layernorm.weight": (hidden,),
        }
        if model_type in ("gemma2", "gemma3_text"):
            shapes[f"{layer_prefix}pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"{layer_prefix}post_feedforward_layernorm.weight"] = (hidden,)
        if model_type == "gemma3_text":
            shapes[f"{layer_prefix}self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{layer_prefix}self_attn.k_norm.weight"] = (head_dim,)
    return shapes


def list_files(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


def validate_export(model_dir: Path, expected_config_path: Path | None) -> dict:
    """Check that ``model_dir`` is a complete HF export; return a summary or raise listing every problem."""
    if not model_dir.is_dir():
        raise PublishError(f"model directory not found: {model_dir}")
    config = read_json_file(model_dir / "config.json", "config.json")
    problems = [
        f"missing tokenizer file {name}" for name in TOKENIZER_FILES if not (model_dir / name).is_file()
    ]

    expected_config = config
    if expected_config_path is not None:
        expected_config = read_json_file(expected_config_path, "expected config")
        exported, _ = language_model(config)
        wanted, _ = language_model(expected_config)
        problems += [
            f"config.json has {key}={exported.get(key)!r}, expected {wanted[key]!r}"
            for key in SHAPE_CONFIG_KEYS
            if key in wanted and exported.get(key) != wanted[key]
        ]
    expected = expected_tensor_shapes(expected_config)

    shard_paths = sorted(model_dir.glob("*.safetensors"))
    if not shard_paths:
        problems.append("no *.safetensors weight files")
    found: dict[str, tuple[int, ...]] = {}
    shard_of: dict[str, str] = {}
    for shard in shard_paths:
        for name, info in read_safetensors_header(shard).items():
            if name in found:
                problems.append(f"tensor {name} appears in both {shard_of[name]} and {shard.name}")
            found[name], shard_of[name] = tuple(info["shape"]), shard.name
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists():
        weight_map = read_json_file(index_path, "safetensors index").get("weight_map", {})
        problems += [
            f"index maps {name} to {shard}, but it is in {shard_of.get(name, 'no shard')}"
            for name, shard in sorted(weight_map.items())
            if shard_of.get(name) != shard
        ]

    problems += [
        f"missing tensor {name} {list(shape)}" for name, shape in expected.items() if name not in found
    ]
    problems += [
        f"tensor {name} has shape {list(found[name])}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    if problems:
        raise _problems_listed(model_dir, problems)
    return {
        "model_type": config.get("model_type"),
        "n_tensors": len(found),
        "params": sum(math.prod(shape) for shape in found.values()),
        "files": list_files(model_dir),
    }


def _problems_listed(model_dir: Path, problems: list[str]) -> PublishError:
    listed = problems[:MAX_LISTED_PROBLEMS]
    if len(problems) > len(listed):
        listed.append(f"... and {len(problems) - len(listed)} more")
    return PublishError(f"export in {model_dir} is not publishable:\n  - " + "\n  - ".join(listed))


def validate_adapter(model_dir: Path, base_config: dict, rank: int, alpha: float) -> dict:
    """A PEFT LoRA adapter of ``base_config``'s model: the rank and scale trained, every pair shaped for its weight."""
    config = read_json_file(model_dir / ADAPTER_CONFIG, ADAPTER_CONFIG)
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"{ADAPTER_CONFIG} has peft_type={config.get('peft_type')!r}, expected 'LORA'")
    if config.get("r") != rank or config.get("lora_alpha") != alpha:
        problems.append(
            f"{ADAPTER_CONFIG} has r={config.get('r')!r}, lora_alpha={config.get('lora_alpha')!r}; trained with "
            f"rank {rank}, alpha {alpha}"
        )
    given = config.get("target_modules") or ()
    if isinstance(given, str):  # a regex over module paths (target_language_model_only wrote it: a kept export)
        targets, shown_targets = [given], repr(given)

        def targeted(module: str) -> bool:
            return re.fullmatch(given, module) is not None
    else:
        targets = sorted(set(given))
        shown_targets = str(targets)

        def targeted(module: str) -> bool:
            return module.rsplit(".", 1)[-1] in targets
    base_shapes = {
        name[name.index("layers.") :].removesuffix(".weight"): shape
        for name, shape in expected_tensor_shapes(base_config).items()
        if "layers." in name and len(shape) == 2
    }
    tensors = read_safetensors_header(model_dir / ADAPTER_WEIGHTS)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        match = _ADAPTER_TENSOR.fullmatch(name)
        if match is None:
            problems.append(f"tensor {name} is not a LoRA weight (base_model.model.<module>.lora_A/B.weight)")
            continue
        pairs.setdefault(match[1], {})[match[2]] = tuple(info["shape"])
    if not pairs:
        problems.append(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    for module, pair in sorted(pairs.items()):
        base_shape = base_shapes.get(module[module.find("layers.") :] if "layers." in module else module)
        if set(pair) != {"A", "B"}:
            problems.append(f"{module} has lora_{''.join(pair)} only")
        elif base_shape is None:
            problems.append(f"{module} adapts no weight of the base model")
        elif pair["A"] != (rank, base_shape[1]) or pair["B"] != (base_shape[0], rank):
            problems.append(
                f"{module}: lora_A {list(pair['A'])}, lora_B {list(pair['B'])}; its base weight "
                f"{list(base_shape)} at rank {rank} needs {[rank, base_shape[1]]} and {[base_shape[0], rank]}"
            )
        if not targeted(module):
            problems.append(f"{module} is not among {ADAPTER_CONFIG}'s target_modules {shown_targets}")
    if problems:
        raise _problems_listed(model_dir, problems)
    return {
        "adapter": {"r": rank, "lora_alpha": alpha, "target_modules": targets, "modules": len(pairs)},
        "n_tensors": len(tensors),
        "params": sum(math.prod(info["shape"]) for info in tensors.values()),
        "files": list_files(model_dir),
    }


def target_language_model_only(model_dir: Path, base_config: dict) -> str | None:
    """On a multimodal base, ``target_modules`` becomes a regex: the modules it names, in the language model only.

    MaxText writes module names (``q_proj``, ...); PEFT matches a list by name suffix, so on Gemma 3 (whose vision
    tower has ``q_proj``, ``k_proj``, ... too) it would adapt the vision tower as well, and warn of its missing adapter
    keys. A string is matched whole against each module path: ``model.language_model.<anything>.<name>``. Not derived
    from the file, so a module missing from it is still one PEFT adapts (the fidelity check names it). Says what it
    did; None for a text-only base, or a config already rewritten (a kept export)."""
    if not isinstance(base_config.get("text_config"), dict):
        return None
    path = model_dir / ADAPTER_CONFIG
    config = read_json_file(path, ADAPTER_CONFIG)
    names = config.get("target_modules")
    if not isinstance(names, list) or not names:
        return None
    _, prefix = language_model(base_config)
    regex = re.escape(prefix) + r"(?:.*\.)?(?:" + "|".join(re.escape(name) for name in sorted(names)) + ")"
    config["target_modules"] = regex
    write_json_atomically(path, config)
    return (
        f"{ADAPTER_CONFIG}: target_modules {regex!r}, the language model's modules MaxText named ({names!r} would also "
        "name modules of the vision tower)"
    )


def adapter_generates(model_dir: Path, repo_id: str, revision: str | None, endpoint: str | None) -> str:
    """Load the adapter onto its base with PEFT and generate a few tokens; say how it went.

    Where PEFT and torch are installed: MaxText's TPU environment (``maxtext[tpu-post-train]``) has both. Elsewhere
    (the local CPU stand-in's ``maxtext[tpu]``) it says the adapter was checked for its shapes only."""
    try:
        import peft
        import torch
        import transformers
    except ImportError as err:
        return f"the adapter was checked for its shapes only: {err.name} is not installed here"
    from huggingface_hub import snapshot_download

    base = snapshot_download(repo_id, revision=revision or None, endpoint=endpoint or None)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(model_dir))
    model.eval()
    input_ids = transformers.AutoTokenizer.from_pretrained(base)("Hello", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4, min_new_tokens=1, do_sample=False
        )
    generated = output.shape[1] - input_ids.shape[1]
    if generated < 1:
        raise PublishError(f"the adapter loaded onto {repo_id}@{revision or 'main'} generates nothing")
    return f"the adapter loads onto {repo_id}@{revision or 'main'} with PEFT {peft.__version__} and generates"


def point_adapter_at_base(model_dir: Path, repo_id: str, revision: str | None) -> str:
    """``adapter_config.json`` names the base repo at the revision trained from; say what it named before."""
    path = model_dir / ADAPTER_CONFIG
    config = read_json_file(path, ADAPTER_CONFIG)
    before = config.get("base_model_name_or_path")
    config["base_model_name_or_path"] = repo_id
    config["revision"] = revision
    write_json_atomically(path, config)
    return f"{ADAPTER_CONFIG}: base model {repo_id}@{revision or 'main'} (MaxText wrote {before!r})"


def describe_fidelity(fidelity: dict) -> str:
    """One line: the two losses and their gap, or when the check was made."""
    if "checked" in fidelity:
        return f"checked {fidelity['checked']}"
    line = (
        f"loss {fidelity['loss_export']:.6f} (exported, transformers) vs {fidelity['loss_maxtext']:.6f} (MaxText's "
        f"trained checkpoint) on {fidelity['rows']} held-out rows ({fidelity['tokens']} tokens): gap "
        f"{fidelity['loss_gap']:.1e} (tolerance {fidelity['tolerance']:.0e}), largest token gap "
        f"{fidelity['max_token_gap']:.1e} (tolerance {fidelity['token_tolerance']:.0e})"
    )
    if "adapter_changes" in fidelity:
        line += f"; merged, the adapter changes exactly its {fidelity['adapter_changes']} target weights"
    return line


def check_fidelity(args: argparse.Namespace) -> dict:
    """export_fidelity.py's ``check`` of the folder as it will be published; its result, or PublishError."""
    reference = read_json_file(args.fidelity_reference, "the export's fidelity reference")
    if reference.get("restored_from"):
        return {"checked": f"before it was kept at {reference['restored_from']}, by an earlier try"}
    result_file = args.fidelity_reference.with_name(f"{args.fidelity_reference.name}.check.json")
    command = [
        args.fidelity_python or sys.executable, str(Path(__file__).with_name("export_fidelity.py")), "check",
        "--model-dir", str(args.model_dir), "--reference", str(args.fidelity_reference), "--out", str(result_file),
    ]
    if args.adapter_rank is not None:
        command += ["--base-model", args.base_model]
        command += ["--base-revision", args.base_revision] if args.base_revision else []
        command += ["--hub-endpoint", args.hub_endpoint] if args.hub_endpoint else []
    checked = subprocess.run(command, capture_output=True, text=True, check=False)
    print(checked.stdout, end="", flush=True)
    if checked.returncode != 0:
        said = checked.stderr[checked.stderr.find("export_fidelity: error: ") :].removeprefix("export_fidelity: error: ")
        raise UnfaithfulExportError(said.strip() or f"the fidelity check failed (exit {checked.returncode}): {checked.stderr[-2000:]}")
    return read_json_file(result_file, "the fidelity check's result")


# ---- publishing -------------------------------------------------------------------------------------


def base_model_file(repo_id: str, filename: str, revision: str | None, endpoint: str | None) -> Path | None:
    """A file of the base model on the Hub, or None if it has none.

    Read with the token in $HF_TOKEN (the base model is gated; the export step's environment holds it)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision or None, endpoint=endpoint or None))
    except EntryNotFoundError:
        return None


def carry_generation_config(model_dir: Path, repo_id: str, revision: str | None, endpoint: str | None) -> str:
    """Put the base model's ``generation_config.json`` into an export that has none; say what was done."""
    target = model_dir / "generation_config.json"
    if target.exists():
        return "the export's own generation_config.json kept"
    downloaded = base_model_file(repo_id, "generation_config.json", revision, endpoint)
    if downloaded is None:
        return f"{repo_id} has no generation_config.json: none added"
    shutil.copyfile(downloaded, target)
    return f"generation_config.json of {repo_id}@{revision or 'main'} added"


# Keys that describe the files written, not the model: the export's own stay.
_EXPORT_OWN_KEYS = ("torch_dtype", "dtype", "transformers_version")


def carry_base_config(model_dir: Path, repo_id: str, revision: str | None, endpoint: str | None) -> str:
    """Make the export's config.json its base model's, keeping the export's shapes; say what changed.

    Raises PublishError when a shape key disagrees (the export is not of the base model's architecture)."""
    source = f"{repo_id}@{revision or 'main'}"
    downloaded = base_model_file(repo_id, "config.json", revision, endpoint)
    if downloaded is None:
        raise PublishError(f"{source} has no config.json: the export's settings cannot be checked")
    base = read_json_file(downloaded, f"config.json of {source}")
    exported = read_json_file(model_dir / "config.json", "config.json")
    base_model, _ = language_model(base)
    export_model, _ = language_model(exported)
    if (base_model is base) != (export_model is exported):
        raise PublishError(f"config.json and {source}'s differ in layout: one has text_config, the other not")
    mismatched = [
        f"{key}={export_model[key]!r} (base {base_model[key]!r})"
        for key in SHAPE_CONFIG_KEYS
        if key != "vocab_size" and key in base_model and key in export_model and base_model[key] != export_model[key]
    ]
    if mismatched:
        raise PublishError(f"the export is not shaped as its base model {source}: {', '.join(mismatched)}")
    published = copy.deepcopy(base)
    published_model, _ = language_model(published)
    published_model["vocab_size"] = export_model.get("vocab_size", base_model.get("vocab_size"))
    for key in _EXPORT_OWN_KEYS:
        if key in exported:
            published[key] = exported[key]
        else:
            published.pop(key, None)
    changed = sorted(
        key
        for key in set(export_model) | set(published_model)
        if key not in _EXPORT_OWN_KEYS and export_model.get(key) != published_model.get(key)
    )
    write_json_atomically(model_dir / "config.json", published)
    if not changed:
        return f"config.json agrees with {source}'s"
    return f"config.json is {source}'s; MaxText's export differed in: {', '.join(changed)}"


def read_hub_token() -> str:
    token_file = os.environ.get("HF_TOKEN_FILE")
    if not token_file:
        raise PublishError("--hub-repo needs a Hub token: set HF_TOKEN_FILE to a file holding it")
    try:
        token = Path(token_file).read_text().strip()
    except OSError as error:
        raise PublishError(
            f"cannot read the Hub token file named by HF_TOKEN_FILE: {error.strerror}"
        ) from None
    if not token:
        raise PublishError("the Hub token file named by HF_TOKEN_FILE is empty")
    return token


def publish_to_hub(
    model_dir: Path,
    repo_id: str,
    revision: str,
    private: bool,
    commit_message: str,
    endpoint: str | None,
    token: str,
) -> dict:
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # progress bars would flood the task log
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    # create_repo ignores `private` for an existing repo: never put a private model into a public repo.
    if private and not api.model_info(repo_id).private:
        raise PublishError(
            f"{repo_id} already exists and is public; refusing to publish a private model to it"
        )
    api.create_branch(repo_id, branch=revision, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id, folder_path=model_dir, revision=revision, commit_message=commit_message
    )
    return {
        "repo_id": repo_id,
        "revision": revision,
        "commit_sha": commit.oid,
        "url": f"{api.endpoint}/{repo_id}/tree/{quote(revision, safe='')}",
    }


def file_digest(path: Path, algorithm: str) -> bytes:
    with path.open("rb") as file:
        return hashlib.file_digest(file, algorithm).digest()


def file_digests(folder: Path) -> dict[str, bytes]:
    return {name: file_digest(folder / name, "sha256") for name in list_files(folder)}


def copy_to_directory(model_dir: Path, destination: Path) -> str:
    """Copy the folder to ``destination`` via a temp sibling and renames: readers never see half a copy."""
    if destination.is_dir() and file_digests(destination) == file_digests(model_dir):
        return "unchanged"
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.tmp-{os.getpid()}")
    retired = destination.with_name(f".{destination.name}.old-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(model_dir, staging)
        if destination.exists():
            destination.rename(retired)
        staging.rename(destination)
    except BaseException:
        if retired.exists() and not destination.exists():
            retired.rename(destination)  # put the previous copy back
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(retired, ignore_errors=True)
    return "copied"


def upload_to_gcs(model_dir: Path, uri: str) -> str:
    """Upload each file to gs://bucket/prefix/, skipping objects whose MD5 already matches.

    Each object appears atomically, the folder as a whole does not. STORAGE_EMULATOR_HOST is honoured
    by google-cloud-storage itself.
    """
    try:
        from google.cloud import storage
    except ImportError:
        raise PublishError("gs:// storage needs google-cloud-storage in this python environment") from None
    bucket_name, _, prefix = uri.removeprefix("gs://").partition("/")
    if not bucket_name:
        raise PublishError(f"storage URI has no bucket: {uri}")
    bucket = storage.Client().bucket(bucket_name)
    uploaded = 0
    for name in list_files(model_dir):
        object_name = f"{prefix.strip('/')}/{name}" if prefix.strip("/") else name
        md5 = base64.b64encode(file_digest(model_dir / name, "md5")).decode()
        existing = bucket.get_blob(object_name)
        if existing is None or existing.md5_hash != md5:
            bucket.blob(object_name).upload_from_filename(str(model_dir / name))
            uploaded += 1
    return f"uploaded {uploaded} object(s)" if uploaded else "unchanged"


def copy_to_storage(model_dir: Path, uri: str) -> str:
    if uri.startswith("gs://"):
        return upload_to_gcs(model_dir, uri)
    destination = Path(uri.removeprefix("file://"))
    if not destination.is_absolute() or "://" in uri.removeprefix("file://"):
        raise PublishError(f"storage URI must be gs://..., file:///abs/dir or /abs/dir, got {uri!r}")
    return copy_to_directory(model_dir, destination)


def mark_complete(uri: str) -> None:
    """Write the empty marker ``<uri>.complete`` once everything under ``uri`` is there."""
    if uri.startswith("gs://"):
        from google.cloud import storage

        bucket_name, _, prefix = uri.removeprefix("gs://").partition("/")
        storage.Client().bucket(bucket_name).blob(f"{prefix.strip('/')}.complete").upload_from_string(b"")
        return
    Path(uri.removeprefix("file://") + ".complete").touch()


def write_json_atomically(path: Path, data: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    staging.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(staging, path)


# ---- command line -----------------------------------------------------------------------------------


def parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="exported Hugging Face model folder")
    parser.add_argument("--result-file", required=True, type=Path, help="where to write the result JSON")
    parser.add_argument(
        "--expect-tensors-from",
        default="",
        metavar="HF_CONFIG_JSON",
        help="config.json to derive the expected tensors from (default: the export's own)",
    )
    hub = parser.add_argument_group("Hugging Face Hub (token: file named by $HF_TOKEN_FILE)")
    hub.add_argument("--hub-repo", help="owner/name; omit to skip the Hub")
    hub.add_argument("--hub-revision", default="main", help="branch to commit to (created if missing)")
    hub.add_argument("--hub-private", type=parse_bool, default=True, help="true|false (default true)")
    hub.add_argument("--commit-message", default="Upload model exported by airflow-tpu-posttrain")
    hub.add_argument("--hub-endpoint", help="Hub URL (default: $HF_ENDPOINT, else huggingface.co)")
    parser.add_argument("--storage-uri", help="gs://bucket/prefix, file:///abs/dir or /abs/dir")
    parser.add_argument(
        "--base-model",
        metavar="REPO_ID",
        help="the base model on the Hub whose config.json (and generation_config.json) the export takes",
    )
    parser.add_argument("--base-revision", help="its revision (default: main)")
    parser.add_argument(
        "--card", type=Path, help="JSON of what the model card says (base model, run, metrics)"
    )
    parser.add_argument(
        "--adapter-rank", type=int, help="a LoRA run's rank: the folder is a PEFT adapter of --base-model"
    )
    parser.add_argument("--adapter-alpha", type=float, help="that run's lora_alpha")
    parser.add_argument(
        "--fidelity-reference", type=Path, help="export_fidelity.py's reference: MaxText's losses on held-out rows"
    )
    parser.add_argument("--fidelity-python", help="the Python (torch, transformers, PEFT) that scores the export")
    parser.add_argument(
        "--keep-uri",
        help="checkpoint storage to keep the checked export in before publishing (marked <uri>.complete)",
    )
    args = parser.parse_args(argv)
    if args.adapter_rank is not None and (args.adapter_alpha is None or not args.base_model):
        parser.error("--adapter-rank needs --adapter-alpha and --base-model")
    if args.hub_repo is not None and args.hub_repo.count("/") != 1:
        parser.error(f"--hub-repo must look like owner/name, got {args.hub_repo!r}")
    return args


def run(args: argparse.Namespace, token: str | None) -> dict:
    expected_config = Path(args.expect_tensors_from) if args.expect_tensors_from else None
    if args.adapter_rank is not None:
        base = (args.base_model, args.base_revision)
        downloaded = base_model_file(args.base_model, "config.json", args.base_revision, args.hub_endpoint)
        if downloaded is None:
            raise PublishError(f"{args.base_model} has no config.json: the adapter's shapes cannot be checked")
        print(f"publish_model: {point_adapter_at_base(args.model_dir, *base)}", flush=True)
        base_config = read_json_file(downloaded, "the base model's config.json")
        validated = validate_adapter(args.model_dir, base_config, args.adapter_rank, args.adapter_alpha)
        targeted = target_language_model_only(args.model_dir, base_config)
        if targeted:
            print(f"publish_model: {targeted}", flush=True)
        print(f"publish_model: {adapter_generates(args.model_dir, *base, args.hub_endpoint)}", flush=True)
    elif args.base_model and args.model_dir.is_dir():
        # Without --hub-endpoint, huggingface_hub reads $HF_ENDPOINT itself.
        base = (args.model_dir, args.base_model, args.base_revision, args.hub_endpoint)
        for carried in (carry_base_config(*base), carry_generation_config(*base)):
            print(f"publish_model: {carried}", flush=True)
    if args.adapter_rank is None:
        validated = validate_export(args.model_dir, expected_config)
    try:
        fidelity = check_fidelity(args) if args.fidelity_reference else None
    except UnfaithfulExportError as error:
        if not args.keep_uri:
            raise
        # Kept for a look beside where a checked export is kept, never marked complete: nothing publishes it.
        rejected = f"{args.keep_uri.rstrip('/')}.unfaithful"
        copy_to_storage(args.model_dir, rejected)
        raise UnfaithfulExportError(f"{error}\nThe export is kept for a look at {rejected}") from None
    if fidelity is not None:
        validated["fidelity"] = fidelity
        print(f"publish_model: export fidelity: {describe_fidelity(fidelity)}", flush=True)
    if args.card:
        facts = read_json_file(args.card, "model card facts")
        if fidelity is not None:
            facts["fidelity"] = describe_fidelity(fidelity)
        if args.hub_repo:
            facts["hub"] = {"repo_id": args.hub_repo, "revision": args.hub_revision}
        write_card(args.model_dir, facts)
    kept = None
    if args.keep_uri:
        kept = args.keep_uri.rstrip("/")
        outcome = copy_to_storage(args.model_dir, kept)
        mark_complete(kept)
        print(f"publish_model: the checked export is kept at {kept} ({outcome})", flush=True)
    hub = None
    if args.hub_repo:
        hub = publish_to_hub(
            args.model_dir,
            args.hub_repo,
            args.hub_revision,
            args.hub_private,
            args.commit_message,
            args.hub_endpoint,
            token,
        )
    storage_uri, storage_outcome = None, None
    if args.storage_uri:
        storage_uri = args.storage_uri.rstrip("/")
        storage_outcome = copy_to_storage(args.model_dir, storage_uri)
    result = {"validated": validated, "kept_uri": kept, "hub": hub, "storage_uri": storage_uri}
    write_json_atomically(args.result_file, result)

    summary = f"publish_model: validated {validated['n_tensors']} tensors, {validated['params']} params"
    if hub:
        summary += f"; hub {hub['repo_id']}@{hub['revision']} commit {hub['commit_sha']}"
    if storage_uri:
        summary += f"; storage {storage_uri} ({storage_outcome})"
    print(summary, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.result_file.unlink(missing_ok=True)  # a failed run must not leave an earlier run's result behind
    token = None
    try:
        token = read_hub_token() if args.hub_repo else None
        run(args, token)
    except Exception as error:  # every failure ends in one clear line, scrubbed of the token
        message = str(error) if isinstance(error, PublishError) else f"{type(error).__name__}: {error}"
        if token:
            message = message.replace(token, "<redacted>")
        print(f"publish_model: error: {message}", file=sys.stderr, flush=True)
        return EXIT_UNFAITHFUL if isinstance(error, UnfaithfulExportError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
