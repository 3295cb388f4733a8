"""publish_model.py (the VM-side publish step) against the local Hub server and a GCS emulator.

The script runs as a subprocess, as on the VM. It gets the Hub token only through HF_TOKEN_FILE; each test
uses a unique marker token so that any leak (output, result file, request path/body, stored data) shows up.
"""

from __future__ import annotations

import json
import math
import os
import random
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from airflow_tpu_posttrain.local.hub_server import REDACTED, HubServer

SCRIPT = Path(__file__).resolve().parents[1] / "airflow_tpu_posttrain" / "vm_scripts" / "publish_model.py"
REPO_ID = "acme/tiny-llama-sft"
BRANCH = "run/2026-11-10"

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
    "vocab_size": 256, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def tiny_llama_shapes() -> dict[str, tuple[int, ...]]:
    """Written out by hand (not derived like the script does) so that the test checks the script."""
    hidden, q_out, kv_out, intermediate, vocab = 64, 4 * 16, 2 * 16, 128, 256
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (q_out, hidden),
            prefix + "self_attn.k_proj.weight": (kv_out, hidden),
            prefix + "self_attn.v_proj.weight": (kv_out, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_out),
            prefix + "mlp.gate_proj.weight": (intermediate, hidden),
            prefix + "mlp.up_proj.weight": (intermediate, hidden),
            prefix + "mlp.down_proj.weight": (hidden, intermediate),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """The safetensors format by hand: u64 little-endian header length, JSON header, raw F32 data."""
    rng = random.Random(path.name)
    header, data, offset = {}, [], 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        data.append(rng.randbytes(size))
        offset += size
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(data))


def make_export(folder: Path, *, drop_tensor: str | None = None, reshape: dict | None = None,
                drop_file: str | None = None) -> Path:
    """A tiny HF-format Llama export, optionally broken in one way."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    shapes = tiny_llama_shapes() | (reshape or {})
    shapes.pop(drop_tensor, None)
    write_safetensors(folder / "model.safetensors", shapes)
    if drop_file:
        (folder / drop_file).unlink()
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def folder_contents(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def hub_args(hub: HubServer) -> list[str]:
    return ["--hub-repo", REPO_ID, "--hub-revision", BRANCH, "--hub-private", "true",
            "--commit-message", "SFT run 42", "--hub-endpoint", hub.url]


@pytest.fixture(scope="session")
def bytecode_cache(tmp_path_factory) -> str:
    """A bytecode cache shared by all script runs.

    With PYTHONDONTWRITEBYTECODE set, each run would otherwise recompile huggingface_hub (~1 s). Kept outside
    the venv, which stays untouched."""
    return str(tmp_path_factory.mktemp("pycache"))


@pytest.fixture
def run_publish(tmp_path, bytecode_cache):
    """Run publish_model.py as the VM would: a fresh process that sees only the HF_* variables given."""

    def run(*args: str, token_file: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60):
        child_env = {key: value for key, value in os.environ.items()
                     if not key.startswith(("HF_", "HUGGINGFACE_")) and key != "PYTHONDONTWRITEBYTECODE"}
        child_env |= {"HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "vm-hf-home"),
                      "PYTHONPYCACHEPREFIX": bytecode_cache, **(env or {})}
        if token_file is not None:
            child_env["HF_TOKEN_FILE"] = str(token_file)
        return subprocess.run([sys.executable, str(SCRIPT), *args], env=child_env, capture_output=True,
                              text=True, timeout=timeout)

    return run


@pytest.fixture
def hub(tmp_path):
    with HubServer(tmp_path / "hub") as server:
        yield server


@pytest.fixture
def token() -> str:
    return f"hf_marker_{uuid.uuid4().hex}"


@pytest.fixture
def token_file(tmp_path, token) -> Path:
    path = tmp_path / "secrets" / "hf_token"
    path.parent.mkdir()
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return path


@pytest.fixture
def export(tmp_path) -> Path:
    return make_export(tmp_path / "export")


def test_publishes_to_private_branch_and_never_leaks_the_token(
    tmp_path, run_publish, hub, token, token_file, export
):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    result_file = tmp_path / "result.json"
    proc = run_publish("--model-dir", str(export), "--result-file", str(result_file),
                       "--expect-tensors-from", str(export / "config.json"), *hub_args(hub),
                       token_file=token_file)
    assert proc.returncode == 0, proc.stderr

    result = json.loads(result_file.read_text())
    sha = result["hub"]["commit_sha"]
    expected_files = sorted(p.name for p in export.iterdir())
    assert result["validated"] == {
        "model_type": "llama", "n_tensors": 21, "files": expected_files,
        "params": sum(math.prod(s) for s in tiny_llama_shapes().values()),
    }
    assert result["hub"] == {"repo_id": REPO_ID, "revision": BRANCH, "commit_sha": sha,
                             "url": f"{hub.url}/{REPO_ID}/tree/run%2F2026-11-10"}
    assert result["storage_uri"] is None
    assert f"commit {sha}" in proc.stdout

    api = HfApi(endpoint=hub.url, token=token)
    assert api.model_info(REPO_ID).private is True
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info(REPO_ID)
    branches = {ref.name: ref.target_commit for ref in api.list_repo_refs(REPO_ID).branches}
    assert branches[BRANCH] == sha and branches["main"] != sha
    assert api.list_repo_files(REPO_ID, revision=BRANCH) == sorted([".gitattributes", *expected_files])
    for name in expected_files:
        downloaded = api.hf_hub_download(REPO_ID, name, revision=BRANCH, cache_dir=tmp_path / "hf-cache")
        assert Path(downloaded).read_bytes() == (export / name).read_bytes(), name
    latest = api.list_repo_commits(REPO_ID, revision=BRANCH)[0]
    assert (latest.commit_id, latest.title) == (sha, "SFT run 42")
    lfs_files = {s.rfilename for s in api.model_info(REPO_ID, revision=BRANCH, files_metadata=True).siblings
                 if s.lfs}
    assert lfs_files == {"model.safetensors"}

    # The token travelled only in Authorization headers (recorded redacted) and nowhere else.
    assert token not in proc.stdout + proc.stderr
    assert token not in result_file.read_text()
    for request in hub.requests:
        assert token not in request.path
        assert token.encode() not in request.body and request.body_size == len(request.body)
        assert all(token not in value for value in request.headers.values())
    writes = [r for r in hub.requests if r.method == "POST"]
    assert writes and all(r.headers.get("authorization") == REDACTED for r in writes)
    for stored in (tmp_path / "hub").rglob("*"):
        assert not stored.is_file() or token.encode() not in stored.read_bytes(), stored


def test_rerun_is_idempotent_and_a_changed_export_makes_a_new_commit(
    tmp_path, run_publish, hub, token, token_file, export
):
    from huggingface_hub import HfApi

    storage = tmp_path / "bucket" / "run-42"
    args = ["--model-dir", str(export), "--result-file", str(tmp_path / "result.json"), *hub_args(hub),
            "--storage-uri", f"file://{storage}"]
    first = run_publish(*args, token_file=token_file)
    assert first.returncode == 0, first.stderr
    first_sha = json.loads((tmp_path / "result.json").read_text())["hub"]["commit_sha"]
    api = HfApi(endpoint=hub.url, token=token)
    n_commits = len(api.list_repo_commits(REPO_ID, revision=BRANCH))

    again = run_publish(*args, token_file=token_file)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "result.json").read_text())["hub"]["commit_sha"] == first_sha
    assert len(api.list_repo_commits(REPO_ID, revision=BRANCH)) == n_commits
    assert f"storage file://{storage} (unchanged)" in again.stdout

    (export / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 3}))
    changed = run_publish(*args, token_file=token_file)
    assert changed.returncode == 0, changed.stderr
    new_sha = json.loads((tmp_path / "result.json").read_text())["hub"]["commit_sha"]
    assert new_sha != first_sha
    assert [c.commit_id for c in api.list_repo_commits(REPO_ID, revision=BRANCH)][:2] == [new_sha, first_sha]
    assert folder_contents(storage) == folder_contents(export)
    assert sorted(p.name for p in storage.parent.iterdir()) == ["run-42"]  # no staging leftovers


def test_refuses_to_publish_a_private_model_into_an_existing_public_repo(
    tmp_path, run_publish, hub, token, token_file, export
):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=token)
    api.create_repo(REPO_ID, private=False)
    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r.json"), *hub_args(hub),
                       token_file=token_file)
    assert proc.returncode == 1
    assert f"{REPO_ID} already exists and is public" in proc.stderr
    assert [ref.name for ref in api.list_repo_refs(REPO_ID).branches] == ["main"]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ({"drop_tensor": "model.layers.1.mlp.down_proj.weight"},
         "missing tensor model.layers.1.mlp.down_proj.weight [64, 128]"),
        ({"reshape": {"model.layers.0.self_attn.k_proj.weight": (64, 64)}},
         "tensor model.layers.0.self_attn.k_proj.weight has shape [64, 64], expected [32, 64]"),
        ({"drop_file": "tokenizer.json"}, "missing tokenizer file tokenizer.json"),
        ({"drop_file": "model.safetensors"}, "no *.safetensors weight files"),
    ],
    ids=["missing-tensor", "wrong-shape", "missing-tokenizer", "no-weights"],
)
def test_broken_export_fails_clearly_and_publishes_nothing(
    tmp_path, run_publish, hub, token_file, breakage, message
):
    export = make_export(tmp_path / "broken", **breakage)
    result_file = tmp_path / "result.json"
    result_file.write_text("{}")  # left by an earlier run: must not survive a failed one
    proc = run_publish("--model-dir", str(export), "--result-file", str(result_file),
                       *hub_args(hub), "--storage-uri", str(tmp_path / "copy"), token_file=token_file)
    assert proc.returncode == 1
    assert "is not publishable" in proc.stderr and message in proc.stderr
    assert hub.requests == []
    assert not (tmp_path / "copy").exists() and not result_file.exists()


def test_export_must_match_the_expected_config(tmp_path, run_publish, export):
    base_config = tmp_path / "base_config.json"
    base_config.write_text(json.dumps(TINY_LLAMA_CONFIG | {"hidden_size": 128, "head_dim": 32}))
    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r.json"),
                       "--expect-tensors-from", str(base_config))
    assert proc.returncode == 1
    assert "config.json has hidden_size=64, expected 128" in proc.stderr
    assert "tensor model.embed_tokens.weight has shape [256, 64], expected [256, 128]" in proc.stderr


@pytest.mark.parametrize("token_file_content", [None, "  \n"], ids=["no-token-file", "empty-token-file"])
def test_hub_publish_needs_a_token_file(tmp_path, run_publish, hub, export, token_file_content):
    token_file = None
    if token_file_content is not None:
        token_file = tmp_path / "hf_token"
        token_file.write_text(token_file_content)
    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r.json"),
                       *hub_args(hub), token_file=token_file)
    assert proc.returncode == 1
    assert "HF_TOKEN_FILE" in proc.stderr
    assert hub.requests == []


@pytest.mark.parametrize("scheme", ["file://", ""], ids=["file-uri", "plain-path"])
def test_copies_to_a_local_directory(tmp_path, run_publish, export, scheme):
    destination = tmp_path / "models" / "run-42"
    result_file = tmp_path / "result.json"
    proc = run_publish("--model-dir", str(export), "--result-file", str(result_file),
                       "--storage-uri", f"{scheme}{destination}/")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(result_file.read_text())
    assert result["hub"] is None and result["storage_uri"] == f"{scheme}{destination}"
    assert folder_contents(destination) == folder_contents(export)
    assert "(copied)" in proc.stdout


@pytest.fixture
def gcs_emulator(monkeypatch):
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="models")
    server.start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}"
    server.stop()


def test_uploads_to_gcs(tmp_path, run_publish, export, gcs_emulator):
    from google.cloud import storage

    args = ["--model-dir", str(export), "--result-file", str(tmp_path / "result.json"),
            "--storage-uri", "gs://models/runs/42"]
    emulator_env = {"STORAGE_EMULATOR_HOST": gcs_emulator}
    proc = run_publish(*args, env=emulator_env)
    assert proc.returncode == 0, proc.stderr
    assert "(uploaded 5 object(s))" in proc.stdout
    bucket = storage.Client().bucket("models")
    blobs = {blob.name: blob for blob in bucket.list_blobs(prefix="runs/42/")}
    assert sorted(blobs) == [f"runs/42/{p.name}" for p in sorted(export.iterdir())]
    for name, blob in blobs.items():
        assert blob.download_as_bytes() == (export / name.removeprefix("runs/42/")).read_bytes()

    again = run_publish(*args, env=emulator_env)
    assert again.returncode == 0, again.stderr
    assert "(unchanged)" in again.stdout


def test_keeps_the_checked_export_before_a_publish_that_fails(tmp_path, run_publish, export, token_file):
    """The Hub unreachable: the export is already kept (marked complete) in checkpoint storage."""
    kept = tmp_path / "storage" / "exports" / "run-42"
    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r.json"),
                       "--keep-uri", str(kept), "--hub-repo", "me/m", "--hub-endpoint", f"http://127.0.0.1:{free_port()}",
                       token_file=token_file)
    assert proc.returncode == 1 and "publish_model: error:" in proc.stderr
    assert f"the checked export is kept at {kept} (copied)" in proc.stdout
    assert folder_contents(kept) == folder_contents(export) and Path(f"{kept}.complete").is_file()


def test_keeps_the_checked_export_in_gcs(tmp_path, run_publish, export, gcs_emulator):
    from google.cloud import storage

    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r.json"),
                       "--keep-uri", "gs://models/exports/run-42", env={"STORAGE_EMULATOR_HOST": gcs_emulator})
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["kept_uri"] == "gs://models/exports/run-42"
    names = {blob.name for blob in storage.Client().bucket("models").list_blobs(prefix="exports/")}
    assert "exports/run-42.complete" in names and "exports/run-42/config.json" in names


def test_hub_server_rejects_writes_without_a_valid_token(tmp_path):
    with HubServer(tmp_path / "hub", tokens=["the-token"]) as server:
        def create(headers: dict[str, str]) -> int:
            request = urllib.request.Request(f"{server.url}/api/repos/create", method="POST", headers=headers,
                                             data=json.dumps({"organization": "acme", "name": "m"}).encode())
            try:
                with urllib.request.urlopen(request) as response:
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code

        assert create({}) == 401
        assert create({"Authorization": "Bearer wrong"}) == 401
        assert create({"Authorization": "Bearer the-token"}) == 200
        assert create({"Authorization": "Bearer the-token"}) == 409
        recorded = [request.headers.get("authorization") for request in server.requests]
        assert recorded == [None, REDACTED, REDACTED, REDACTED]


# The MaxText venv's python: what runs publish_model.py on the VM, with matplotlib (a MaxText dependency).
VM_PYTHON = Path(__file__).resolve().parents[1] / ".local" / "maxtext-venv" / "bin" / "python"
GRPO_CARD = {
    "base_model": "meta-llama/Llama-3.1-8B-Instruct",
    "base_revision": "0e9e39f249a16976918f6564b8830bc894c89659",
    "dataset": "openai/gsm8k",
    "recipe": "GRPO",
    "steps": 2,
    "accelerator": "v6e-8",
    "maxtext_version": "0.2.5",
    "dag_id": "posttrain_rl__llama3.1-8b-Instruct",
    "run_id": "scheduled__2026-11-30T00:00:00+00:00",
    "metrics": {
        "first_loss": 0.0,
        "last_loss": 8e-06,
        "loss_curve": [[1, 0.0], [2, 8e-06]],
        "pre_rl": {"accuracy": 0.0, "mean_reward": 0.0},
        "post_rl": {"accuracy": 50.0, "mean_reward": 1.25},
    },
}


def test_publishes_a_model_card_with_its_training_curve(tmp_path, hub, token, token_file, export):
    """The card is huggingface_hub's (its metadata reads back as ModelCardData).

    It names the base model at its revision, the dataset, the run and the numbers, and shows the curve the Hub
    serves beside it; a re-run draws the same picture, so it commits nothing new."""
    from huggingface_hub import HfApi, ModelCard, hf_hub_download

    HfApi(endpoint=hub.url, token=token).create_repo(GRPO_CARD["base_model"])  # the Hub checks it exists
    card_facts = tmp_path / "card.json"
    card_facts.write_text(json.dumps(GRPO_CARD))
    args = ["--model-dir", str(export), "--result-file", str(tmp_path / "result.json"), *hub_args(hub),
            "--card", str(card_facts)]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_TOKEN_FILE": str(token_file), "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "hf-home")}

    def publish() -> str:
        ran = subprocess.run([str(VM_PYTHON), str(SCRIPT), *args], env=env, capture_output=True, text=True,
                             timeout=120)
        assert ran.returncode == 0, ran.stderr
        return json.loads((tmp_path / "result.json").read_text())["hub"]["commit_sha"]

    first = publish()
    download = {"repo_id": REPO_ID, "revision": BRANCH, "endpoint": hub.url, "token": token,
                "cache_dir": tmp_path / "cache"}
    card = ModelCard.load(hf_hub_download(filename="README.md", **download))
    assert card.data.base_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert card.data.datasets == ["openai/gsm8k"] and "grpo" in card.data.tags
    for shown in ("at revision `0e9e39f249a16976918f6564b8830bc894c89659`", "GRPO, 2 steps", "v6e-8",
                  "`posttrain_rl__llama3.1-8b-Instruct` / `scheduled__2026-11-30T00:00:00+00:00`",
                  "| accuracy (before → after) | 0.0% → 50.0% |", "| mean reward (before → after) | 0.0 → 1.25 |",
                  "![Training curve](training_curve.png)"):
        assert shown in card.text, (shown, card.text)
    curve = Path(hf_hub_download(filename="training_curve.png", **download)).read_bytes()
    assert curve.startswith(b"\x89PNG\r\n\x1a\n") and len(curve) > 10_000

    assert publish() == first
    assert len(HfApi(endpoint=hub.url, token=token).list_repo_commits(REPO_ID, revision=BRANCH)) >= 1


# MaxText 0.2.2's to_huggingface for gemma3-4b (``use_multimodal=False``): the Gemma3Config of its
# hf_model_configs.py (sizes under text_config, a vision_config kept), tensors under model.language_model,
# the output head tied to the embeddings (no lm_head). Tiny sizes, same keys.
TINY_GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 6, "vocab_size": 512,
        "sliding_window": 32, "sliding_window_pattern": 6,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "num_hidden_layers": 1},
}


def tiny_gemma3_shapes() -> dict[str, tuple[int, ...]]:
    hidden, q_out, kv_out, intermediate, vocab, head_dim = 64, 4 * 16, 16, 128, 512, 16
    shapes = {"model.language_model.embed_tokens.weight": (vocab, hidden),
              "model.language_model.norm.weight": (hidden,)}
    for layer in range(6):
        prefix = f"model.language_model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (q_out, hidden),
            prefix + "self_attn.k_proj.weight": (kv_out, hidden),
            prefix + "self_attn.v_proj.weight": (kv_out, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q_out),
            prefix + "self_attn.q_norm.weight": (head_dim,),
            prefix + "self_attn.k_norm.weight": (head_dim,),
            prefix + "mlp.gate_proj.weight": (intermediate, hidden),
            prefix + "mlp.up_proj.weight": (intermediate, hidden),
            prefix + "mlp.down_proj.weight": (hidden, intermediate),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "pre_feedforward_layernorm.weight": (hidden,),
            prefix + "post_feedforward_layernorm.weight": (hidden,),
        }
    return shapes


def make_gemma3_export(folder: Path, *, drop_tensor: str | None = None) -> Path:
    make_export(folder)
    (folder / "config.json").write_text(json.dumps(TINY_GEMMA3_CONFIG, indent=2))
    shapes = tiny_gemma3_shapes()
    shapes.pop(drop_tensor, None)
    write_safetensors(folder / "model.safetensors", shapes)
    return folder


def test_publishes_a_gemma3_export_in_maxtexts_shape(tmp_path, run_publish):
    """The SFT seed model's export: Gemma3ForConditionalGeneration, language model under text_config."""
    export = make_gemma3_export(tmp_path / "gemma3")
    base_config = tmp_path / "base_config.json"
    base_config.write_text(json.dumps(TINY_GEMMA3_CONFIG))
    result_file = tmp_path / "r.json"
    proc = run_publish("--model-dir", str(export), "--result-file", str(result_file),
                       "--expect-tensors-from", str(base_config), "--storage-uri", str(tmp_path / "kept"))
    assert proc.returncode == 0, proc.stderr
    validated = json.loads(result_file.read_text())["validated"]
    assert validated["model_type"] == "gemma3" and validated["n_tensors"] == len(tiny_gemma3_shapes())
    assert (tmp_path / "kept" / "model.safetensors").is_file()

    broken = make_gemma3_export(tmp_path / "broken", drop_tensor="model.language_model.layers.5.self_attn.k_norm.weight")
    proc = run_publish("--model-dir", str(broken), "--result-file", str(tmp_path / "r2.json"),
                       "--expect-tensors-from", str(base_config))
    assert proc.returncode == 1
    assert "missing tensor model.language_model.layers.5.self_attn.k_norm.weight [16]" in proc.stderr

    bigger = tmp_path / "bigger_config.json"
    bigger.write_text(json.dumps(TINY_GEMMA3_CONFIG | {"text_config": TINY_GEMMA3_CONFIG["text_config"] | {"hidden_size": 128}}))
    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "r3.json"),
                       "--expect-tensors-from", str(bigger))
    assert proc.returncode == 1
    assert "config.json has hidden_size=64, expected 128" in proc.stderr


def test_an_export_without_generation_config_gets_the_base_models(tmp_path, run_publish, hub, token, token_file):
    """MaxText writes no generation_config.json: the published model stops where its base stops.

    The base model is gated and read with the run's token (as the export step's environment holds it)."""
    from huggingface_hub import HfApi

    base = tmp_path / "base"
    base.mkdir()
    base_generation = {"bos_token_id": 1, "eos_token_id": [2, 9, 10], "do_sample": True, "temperature": 0.6}
    (base / "generation_config.json").write_text(json.dumps(base_generation))
    (base / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    revision = hub.store.seed_repo("acme/tiny-llama-instruct", base, gated="manual")
    hub.grant(token, "acme/tiny-llama-instruct")
    export = make_export(tmp_path / "export", drop_file="generation_config.json")
    proc = run_publish(
        "--model-dir", str(export), "--result-file", str(tmp_path / "result.json"), *hub_args(hub),
        "--base-model", "acme/tiny-llama-instruct", "--base-revision", revision,
        token_file=token_file, env={"HF_TOKEN": token},
    )
    assert proc.returncode == 0, proc.stderr
    assert f"generation_config.json of acme/tiny-llama-instruct@{revision} added" in proc.stdout
    assert f"config.json agrees with acme/tiny-llama-instruct@{revision}'s" in proc.stdout
    published = HfApi(endpoint=hub.url, token=token).hf_hub_download(
        REPO_ID, "generation_config.json", revision=BRANCH, cache_dir=tmp_path / "hf-cache"
    )
    assert json.loads(Path(published).read_text()) == base_generation

    own = make_export(tmp_path / "export-own")  # an export with its own generation config keeps it
    proc = run_publish(
        "--model-dir", str(own), "--result-file", str(tmp_path / "result-own.json"), *hub_args(hub),
        "--base-model", "acme/tiny-llama-instruct", token_file=token_file, env={"HF_TOKEN": token},
    )
    assert proc.returncode == 0 and "the export's own generation_config.json kept" in proc.stdout
    assert json.loads((own / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    bare = tmp_path / "bare"  # a base without one: the export is published without, and says so
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    hub.store.seed_repo("acme/bare-base", bare, gated="manual")
    hub.grant(token, "acme/bare-base")
    without = make_export(tmp_path / "export-without", drop_file="generation_config.json")
    proc = run_publish(
        "--model-dir", str(without), "--result-file", str(tmp_path / "result-without.json"), *hub_args(hub),
        "--base-model", "acme/bare-base", token_file=token_file, env={"HF_TOKEN": token},
    )
    assert proc.returncode == 0, proc.stderr
    assert "acme/bare-base has no generation_config.json: none added" in proc.stdout


def test_a_gemma3_export_is_published_with_its_base_models_settings(tmp_path, run_publish, hub, token, token_file):
    """A Gemma 3 export is published with its base model's config.json, not MaxText's table's.

    MaxText 0.2.2 writes gemma3-4b's config from its own table: the global layers' RoPE base 10000 (transformers
    5 writes it as ``rope_parameters``), 163840 positions. The model trained with 1,000,000 (gemma3-4b.yml
    ``rope_max_timescale``) and the Hub's config says so: the published config is the base model's, with the
    export's vocabulary (MaxText's embedding rows), and an export of another shape is refused."""
    from huggingface_hub import HfApi

    text = TINY_GEMMA3_CONFIG["text_config"]
    hub_text = {key: value for key, value in text.items() if key != "vocab_size"}
    base_config = TINY_GEMMA3_CONFIG | {
        "text_config": hub_text | {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                                   "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                   "max_position_embeddings": 131072, "vocab_size": 576},
        "transformers_version": "4.50.0.dev0",
    }
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(base_config))
    revision = hub.store.seed_repo("google/tiny-gemma-3-it", base, gated="manual")
    hub.grant(token, "google/tiny-gemma-3-it")
    export = make_gemma3_export(tmp_path / "export")
    maxtext_table = TINY_GEMMA3_CONFIG | {
        "text_config": text | {"max_position_embeddings": 163840, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}},
        "transformers_version": "5.12.1",
    }
    (export / "config.json").write_text(json.dumps(maxtext_table))
    proc = run_publish(
        "--model-dir", str(export), "--result-file", str(tmp_path / "result.json"), *hub_args(hub),
        "--base-model", "google/tiny-gemma-3-it", "--base-revision", revision,
        token_file=token_file, env={"HF_TOKEN": token},
    )
    assert proc.returncode == 0, proc.stderr
    assert (f"config.json is google/tiny-gemma-3-it@{revision}'s; MaxText's export differed in: "
            "max_position_embeddings, rope_local_base_freq, rope_parameters, rope_scaling, rope_theta") in proc.stdout
    published = json.loads(Path(HfApi(endpoint=hub.url, token=token).hf_hub_download(
        REPO_ID, "config.json", revision=BRANCH, cache_dir=tmp_path / "hf-cache")).read_text())
    assert published["text_config"] == base_config["text_config"] | {"vocab_size": 512}
    assert published["transformers_version"] == "5.12.1"  # the export's: it wrote the files
    assert published["vision_config"] == base_config["vision_config"]

    other = make_gemma3_export(tmp_path / "other")
    (other / "config.json").write_text(json.dumps(TINY_GEMMA3_CONFIG | {"text_config": text | {"num_hidden_layers": 4}}))
    proc = run_publish(
        "--model-dir", str(other), "--result-file", str(tmp_path / "other.json"),
        "--storage-uri", str(tmp_path / "kept"), "--base-model", "google/tiny-gemma-3-it", "--base-revision", revision,
        "--hub-endpoint", hub.url, env={"HF_TOKEN": token},
    )
    assert proc.returncode == 1 and not (tmp_path / "kept").exists()
    assert (f"the export is not shaped as its base model google/tiny-gemma-3-it@{revision}: "
            "num_hidden_layers=4 (base 6)") in proc.stderr


# ---- a LoRA run's PEFT adapter ----------------------------------------------------------------------------------


def make_adapter(folder: Path, rank: int = 4, alpha: float = 8.0, transpose: str | None = None) -> Path:
    """A PEFT adapter of the tiny Llama's q_proj and v_proj as MaxText writes it (its table's base id)."""
    folder.mkdir(parents=True)
    config = {"base_model_name_or_path": "meta-llama/Llama-3.1-8B", "peft_type": "LORA", "task_type": "CAUSAL_LM",
              "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    shapes = {}
    for layer in range(2):
        for module, out_features in (("q_proj", 64), ("v_proj", 32)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            shapes[f"{name}.lora_A.weight"] = (rank, 64)
            shapes[f"{name}.lora_B.weight"] = (out_features, rank) if module != transpose else (rank, out_features)
    write_safetensors(folder / "adapter_model.safetensors", shapes)
    return folder


def _publish_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import publish_model
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return publish_model


def test_an_adapter_is_checked_against_its_base_and_pointed_at_it(tmp_path):
    publish_model = _publish_module()
    adapter = make_adapter(tmp_path / "adapter")
    validated = publish_model.validate_adapter(adapter, TINY_LLAMA_CONFIG, 4, 8.0)
    assert validated["adapter"] == {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "modules": 4}
    assert validated["params"] == 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)
    said = publish_model.point_adapter_at_base(adapter, "meta-llama/Llama-3.1-8B-Instruct", "0123abc")
    assert said.endswith("(MaxText wrote 'meta-llama/Llama-3.1-8B')")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("meta-llama/Llama-3.1-8B-Instruct", "0123abc")


@pytest.mark.parametrize(
    ("rank", "transpose", "trained_rank", "refusal"),
    [
        (4, None, 8, "has r=4, lora_alpha=8.0; trained with rank 8"),
        (4, "v_proj", 4, r"v_proj: lora_A \[4, 64\], lora_B \[4, 32\]; its base weight \[32, 64\] at rank 4 needs"),
    ],
    ids=["rank", "shape"],
)
def test_an_adapter_unlike_what_was_trained_is_refused(tmp_path, rank, transpose, trained_rank, refusal):
    make_adapter(tmp_path / "adapter", rank=rank, transpose=transpose)
    publish_model = _publish_module()
    with pytest.raises(publish_model.PublishError, match=refusal):
        publish_model.validate_adapter(tmp_path / "adapter", TINY_LLAMA_CONFIG, trained_rank, 8.0)


def test_an_adapter_is_loaded_onto_its_base_with_peft_and_generates_before_it_is_published(
    tmp_path, bytecode_cache, hub, token, token_file
):
    """Where PEFT and torch are installed (MaxText's TPU environment): the adapter must load onto its base and generate.

    Run with the check venv's Python (torch, transformers, PEFT), the tiny Gemma 3 on a Hub as the base; where they
    are missing, the publish says it checked the shapes only (the local twin's CPU venv: tests/test_approval.py)."""
    hfcheck = Path(__file__).resolve().parents[1] / ".local" / "hfcheck-venv" / "bin" / "python"
    base_dir = Path(__file__).resolve().parents[1] / ".local" / "tiny" / "tiny-gemma3"
    revision = hub.store.seed_repo("google/gemma-3-4b-it", base_dir)
    text = json.loads((base_dir / "config.json").read_text())["text_config"]
    rank, q_out, kv_out = 4, text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "base_model_name_or_path": "google/gemma-3-4b-it", "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0,
    }))
    shapes = {}
    for layer in range(text["num_hidden_layers"]):
        for module, out_features in (("q_proj", q_out), ("v_proj", kv_out)):
            name = f"base_model.model.model.language_model.layers.{layer}.self_attn.{module}"
            shapes |= {f"{name}.lora_A.weight": (rank, text["hidden_size"]), f"{name}.lora_B.weight": (out_features, rank)}
    write_safetensors(adapter / "adapter_model.safetensors", shapes)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_HOME": str(tmp_path / "vm-hf-home"), "HF_TOKEN": token, "HF_TOKEN_FILE": str(token_file),
            "HF_HUB_DISABLE_XET": "1", "PYTHONPYCACHEPREFIX": bytecode_cache}
    proc = subprocess.run(
        [str(hfcheck), str(SCRIPT), "--model-dir", str(adapter), "--result-file", str(tmp_path / "result.json"),
         "--base-model", "google/gemma-3-4b-it", "--base-revision", revision, "--adapter-rank", str(rank),
         "--adapter-alpha", "8.0", "--hub-endpoint", hub.url],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"the adapter loads onto google/gemma-3-4b-it@{revision} with PEFT " in proc.stdout
    assert json.loads((tmp_path / "result.json").read_text())["validated"]["adapter"]["modules"] == 28
