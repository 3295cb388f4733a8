"""The tiny local model, tokenizer and data (airflow_tpu_posttrain/local/tiny_model.py) are well-formed.

tiny_model.py runs in the MaxText venv ($TPU_POSTTRAIN_MAXTEXT_VENV, default .local/maxtext-venv;
created by scripts/bootstrap.sh), so the build and the inspection run
there as subprocesses; the tests only compare the facts they report.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.maxtext

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "airflow_tpu_posttrain" / "local" / "tiny_model.py"
MAXTEXT_PYTHON = (
    Path(os.environ.get("TPU_POSTTRAIN_MAXTEXT_VENV", REPO / ".local" / "maxtext-venv")) / "bin" / "python"
)
ARTIFACTS = [
    "tiny-llama/config.json",
    "tiny-llama/generation_config.json",
    "tiny-llama/model.safetensors",
    "tiny-llama/tokenizer.json",
    "tiny-llama/tokenizer_config.json",
    "tiny-llama/chat_template.jinja",
    "tiny-gemma3/config.json",
    "tiny-gemma3/generation_config.json",
    "tiny-gemma3/model.safetensors",
    "tiny-gemma3/tokenizer.json",
    "tiny-gemma3/tokenizer_config.json",
    "datasets/tiny-chats/README.md",
    "datasets/tiny-chats/data/train_sft-00000-of-00001.parquet",
    "datasets/tiny-chats/data/test_sft-00000-of-00001.parquet",
    "datasets/tiny-gsm8k/README.md",
    "datasets/tiny-gsm8k/main/train-00000-of-00001.parquet",
    "datasets/tiny-gsm8k/main/test-00000-of-00001.parquet",
]

# Runs in the MaxText venv: loads everything the way MaxText and transformers would, prints JSON facts.
INSPECT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from datasets import load_dataset
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    sys.path.insert(0, sys.argv[2])
    import tiny_model

    out = sys.argv[1]
    model_dir = f"{out}/tiny-llama"
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights = load_file(f"{model_dir}/model.safetensors")
    # As MaxText reads a run's copy of the repos: SFT by the copy's path and split names (hf_path, train_split,
    # hf_eval_split), GRPO by file patterns (hf_train_files, hf_eval_files) with the parquet builder.
    chats, held_out = (
        load_dataset(f"{out}/datasets/tiny-chats", split=split, streaming=True) for split in ("train_sft", "test_sft")
    )
    chats, held_out = [dict(chat) for chat in chats], [dict(chat) for chat in held_out]
    messages = chats[0]["messages"]
    full_ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    prompt_ids = tokenizer.apply_chat_template(
        messages[:-1], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    gsm8k = {
        split: load_dataset(
            "parquet", data_files={split: f"{out}/datasets/tiny-gsm8k/main/{split}-*.parquet"}, split=split
        ).to_list()
        for split in ("train", "test")
    }
    sample = "Ana has 12 apples and gets 7 more."
    print(json.dumps({
        "config": config.to_dict(),
        "weight_shapes": {name: list(array.shape) for name, array in weights.items()},
        "weight_dtypes": sorted({str(array.dtype) for array in weights.values()}),
        "weights_finite": all(bool(np.isfinite(array).all()) for array in weights.values()),
        "vocab_size": len(tokenizer),
        "special_ids": {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id},
        "encoded_sample": tokenizer.encode(sample),
        "decoded_sample": tokenizer.decode(tokenizer.encode(sample), skip_special_tokens=True),
        "chat_text": tokenizer.apply_chat_template(messages, tokenize=False),
        "chat_full_ids": full_ids,
        "chat_prompt_ids": prompt_ids,
        # As train_rl builds its prompts: MaxText's RL template, inside the tokenizer's chat template.
        "max_rl_prompt_tokens": max(
            len(tokenizer.apply_chat_template(
                [{"role": "user", "content": tiny_model.RL_PROMPT_TEXT.format(question=row["question"])}],
                add_generation_prompt=True, tokenize=True, return_dict=True,
            )["input_ids"])
            for rows in gsm8k.values() for row in rows
        ),
        "chats": chats,
        "held_out": held_out,
        "gsm8k": gsm8k,
    }))
    """
)


def _maxtext_python(*args: str) -> str:
    if not MAXTEXT_PYTHON.exists():
        pytest.skip(f"no MaxText venv at {MAXTEXT_PYTHON.parent.parent} (run scripts/bootstrap.sh)")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(
        [str(MAXTEXT_PYTHON), *args], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _build(out: Path) -> str:
    return _maxtext_python(str(TINY_MODEL), "--out", str(out))


def _digests(out: Path) -> dict[str, str]:
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ARTIFACTS}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    _build(out)
    return out


@pytest.fixture(scope="module")
def facts(built) -> dict:
    return json.loads(_maxtext_python("-c", INSPECT, str(built), str(TINY_MODEL.parent)))


def test_build_writes_every_artifact(built):
    missing = [name for name in ARTIFACTS if not (built / name).is_file()]
    assert not missing
    leftovers = [path.name for path in built.rglob(".*")]
    assert not leftovers, "temporary build directories left behind"


def test_rebuild_skips_existing_artifacts(built):
    before = _digests(built)
    output = _build(built)
    assert "built:" not in output and output.count("exists:") == 4
    assert _digests(built) == before


def test_build_is_deterministic(built, tmp_path):
    _build(tmp_path)
    assert _digests(tmp_path) == _digests(built)


def test_partial_output_is_completed(built, tmp_path):
    _build(tmp_path)
    shutil.rmtree(tmp_path / "datasets" / "tiny-gsm8k")
    output = _build(tmp_path)
    assert output.count("exists:") == 3 and "built:" in output and "tiny-gsm8k" in output
    assert _digests(tmp_path) == _digests(built)


def test_the_sft_evaluation_chats_are_held_out(facts):
    """The quality gate's SFT evaluation reads chats the training never sees (UltraChat's test_sft split)."""
    train, held_out = facts["chats"], facts["held_out"]
    assert len(held_out) == 8 and all(chat["messages"][-1]["role"] == "assistant" for chat in held_out)
    assert not [chat for chat in held_out if chat in train]


def test_config_has_the_dims_maxtext_runs_use(facts):
    config = facts["config"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["vocab_size"] == 512
    assert config["tie_word_embeddings"] is False
    rope = config.get("rope_parameters") or {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    special = facts["special_ids"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        special["bos"],
        special["eos"],
        special["pad"],
    )


def test_weights_have_llama_names_and_shapes(facts):
    shapes = facts["weight_shapes"]
    assert shapes["model.embed_tokens.weight"] == [512, 64]
    assert shapes["lm_head.weight"] == [512, 64]
    assert shapes["model.norm.weight"] == [64]
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        assert shapes[f"{prefix}.self_attn.q_proj.weight"] == [4 * 16, 64]
        assert shapes[f"{prefix}.self_attn.k_proj.weight"] == [2 * 16, 64]
        assert shapes[f"{prefix}.self_attn.v_proj.weight"] == [2 * 16, 64]
        assert shapes[f"{prefix}.self_attn.o_proj.weight"] == [64, 4 * 16]
        assert shapes[f"{prefix}.mlp.gate_proj.weight"] == [128, 64]
        assert shapes[f"{prefix}.mlp.up_proj.weight"] == [128, 64]
        assert shapes[f"{prefix}.mlp.down_proj.weight"] == [64, 128]
    assert len(shapes) == 3 + 2 * 9
    assert sum(_product(shape) for shape in shapes.values()) == 139_584
    assert facts["weight_dtypes"] == ["float32"] and facts["weights_finite"]


def _product(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def test_tokenizer_is_byte_level_bpe_with_llama3_specials(facts):
    assert facts["vocab_size"] == 512
    special = facts["special_ids"]
    assert len(set(special.values())) == 3 and all(0 <= token < 512 for token in special.values())
    assert facts["encoded_sample"][0] == special["bos"]
    assert facts["decoded_sample"] == "Ana has 12 apples and gets 7 more."


def test_chat_template_is_llama3_like_and_splits_prompt_from_completion(facts):
    text = facts["chat_text"]
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert text.endswith("<|eot_id|>") and text.count("<|eot_id|>") == 3
    # MaxText's SFT masking needs the generation prompt to be a strict prefix of the whole chat.
    full, prompt = facts["chat_full_ids"], facts["chat_prompt_ids"]
    assert len(prompt) < len(full) and full[: len(prompt)] == prompt
    assert full[-1] == facts["special_ids"]["eos"]


def test_rl_prompts_fit_max_prefill_predict_length(facts):
    assert facts["max_rl_prompt_tokens"] <= 128


def test_sft_chats(facts):
    chats = facts["chats"]
    assert len(chats) >= 32
    for chat in chats:
        assert [message["role"] for message in chat["messages"]] == ["system", "user", "assistant"]
        assert all(message["content"].strip() for message in chat["messages"])


def test_gsm8k_shaped_parquet(facts):
    train, test = facts["gsm8k"]["train"], facts["gsm8k"]["test"]
    assert len(train) >= 8 and len(test) >= 4
    for row in train + test:
        assert set(row) == {"question", "answer"}
        assert row["question"].endswith("?")
        reasoning, final = row["answer"].rsplit("\n#### ", 1)
        assert reasoning and final.isdigit()
        assert f">>{final}." in reasoning, "the worked answer should end in the final number"


# Runs in the MaxText venv: the tiny Gemma 3's config, tensors and tokenizer as the SFT twin reads them.
INSPECT_GEMMA3 = textwrap.dedent(
    """
    import json, struct, sys
    from transformers import AutoConfig, AutoTokenizer

    model_dir = f"{sys.argv[1]}/tiny-gemma3"
    config = json.load(open(f"{model_dir}/config.json"))
    with open(f"{model_dir}/model.safetensors", "rb") as f:  # bf16 tensors: numpy has no such dtype
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    print(json.dumps({
        "config": config,
        "loaded_type": AutoConfig.from_pretrained(model_dir).model_type,
        "generation": json.load(open(f"{model_dir}/generation_config.json")),
        "shapes": {name: entry["shape"] for name, entry in header.items()},
        "dtypes": sorted({entry["dtype"] for entry in header.values()}),
        "tokens": len(tokenizer),
        "ids": {t: tokenizer.convert_tokens_to_ids(t) for t in ("<bos>", "<eos>", "<end_of_turn>", "<image_soft_token>")},
        "chat": tokenizer.apply_chat_template(chat, tokenize=False),
    }))
    """
)


@pytest.fixture(scope="module")
def gemma3(built) -> dict:
    return json.loads(_maxtext_python("-c", INSPECT_GEMMA3, str(built)))


def test_the_tiny_gemma3_is_shaped_as_gemma_3_4b_it(gemma3):
    """What the SFT twin converts: google/gemma-3-4b-it's layout, shrunk.

    A multimodal checkpoint, its text model under text_config, the Hub file's tensor names, tied embeddings padded
    past the vocabulary."""
    from airflow_tpu_posttrain.recipes.models import TINY_GEMMA3_DIMS

    config, text = gemma3["config"], gemma3["config"]["text_config"]
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"] and gemma3["loaded_type"] == "gemma3"
    assert config["vision_config"]["model_type"] == "siglip_vision_model"
    dims = TINY_GEMMA3_DIMS  # what the twin's MaxText commands say the model is
    assert (text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]) == (
        int(dims["base_emb_dim"]), int(dims["base_mlp_dim"]), int(dims["base_num_decoder_layers"])
    )
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (
        int(dims["base_num_query_heads"]), int(dims["base_num_kv_heads"]), int(dims["head_dim"])
    )
    assert text["sliding_window"] == int(dims["sliding_window_size"])
    shapes = gemma3["shapes"]
    assert shapes["language_model.model.embed_tokens.weight"] == [int(dims["vocab_size"]) + 64, 64]
    assert not [name for name in shapes if "lm_head" in name]
    assert {name.split(".")[0] for name in shapes} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert len([n for n in shapes if n.startswith("language_model.model.layers.")]) == 14 * 13
    assert gemma3["dtypes"] == ["BF16"]  # as the Hub's file
    # Gemma's chat turns, and its answers end at <end_of_turn>: the generation config stops there.
    assert gemma3["chat"] == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    ids = gemma3["ids"]
    assert ids["<image_soft_token>"] == int(dims["vocab_size"]) and gemma3["tokens"] == int(dims["vocab_size"]) + 1
    assert sorted(gemma3["generation"]["eos_token_id"]) == sorted([ids["<eos>"], ids["<end_of_turn>"]])
