"""Builds a tiny Llama-3-shaped model and tiny SFT/GSM8K data, so MaxText's pipeline runs on CPU offline.

Run inside the MaxText venv (it imports tokenizers, transformers, safetensors, numpy, pyarrow):

    python tiny_model.py --out DIR

writes
    DIR/tiny-llama/          save_pretrained-style: config.json, model.safetensors, tokenizer files
    DIR/data/sft.jsonl       {"messages": [...]} chats
    DIR/data/sft_eval.jsonl  held-out chats of the same kind (the quality gate's SFT evaluation)
    DIR/data/gsm8k/{train,test}.parquet   GSM8K-shaped: question, answer ending in "#### N"

Everything is deterministic (fixed seeds). Each artifact is written under a temporary name and renamed
into place, so an existing one is complete and is skipped on re-runs.

Imports of the heavy libraries stay inside functions: Airflow code may import this module for its
constants without having them installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

MODEL_DIR_NAME = "tiny-llama"
SFT_FILE = Path("data") / "sft.jsonl"
SFT_EVAL_FILE = Path("data") / "sft_eval.jsonl"
GSM8K_TRAIN_FILE = Path("data") / "gsm8k" / "train.parquet"
GSM8K_TEST_FILE = Path("data") / "gsm8k" / "test.parquet"

SEED = 1234
NUM_SFT_CHATS = 64
NUM_SFT_EVAL_CHATS = 8
NUM_GSM8K_TRAIN = 64
NUM_GSM8K_TEST = 16

# Model shape: the MaxText runs override llama3.1-8b's dims with exactly these.
VOCAB_SIZE = 512
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
# llama3.1-8b's RoPE, which MaxText's llama3.1-8b config uses whatever the dims.
ROPE_THETA = 500000.0
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
INITIALIZER_RANGE = 0.02

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"
SPECIAL_TOKENS = [
    BOS_TOKEN,
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOS_TOKEN,
    PAD_TOKEN,
]

# Llama 3's chat format, without its date/tool preamble.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# The text MaxText's RL recipe wraps around each GSM8K question (configs/post_train/rl.yml and
# examples/chat_templates/gsm8k_rl.json). Training the tokenizer on it too keeps RL prompts (at most
# 120 tokens once inside the chat template) within max_prefill_predict_length=128 despite the
# 512-token vocabulary.
RL_PROMPT_TEXT = (
    "<start_of_turn>user\nYou are given a problem. Think about the problem and provide your reasoning. "
    "Place it between <reasoning> and </reasoning>. Then, provide the final answer (i.e., just one "
    "numerical value) between <answer> and </answer>.\n\n{question}<end_of_turn>\n<start_of_turn>model"
)

_NAMES = ["Ana", "Ben", "Carla", "Dev", "Ema", "Felix", "Gina", "Hugo"]
_ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cookies", "cards"]
_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange"]


def _sft_chat(rng: random.Random) -> dict:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.randrange(3)
    if kind == 0:
        user, assistant = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    elif kind == 1:
        colour = rng.choice(_COLOURS)
        user = f"Write one sentence about {name} and the {colour} {item}."
        assistant = f"{name} keeps the {colour} {item} in a small box."
    else:
        user = f"{name} has {a} {item}. Say the number of {item} in words or digits."
        assistant = f"{name} has {a} {item}."
    messages = [
        {"role": "system", "content": "You are a short, helpful assistant."},
        {"role": "user", "content": user},
        {"role": "assistant", "content": assistant},
    ]
    return {"messages": messages}


def _gsm8k_row(rng: random.Random) -> dict:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    if rng.random() < 0.5:
        total = a + b
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        steps = f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = <<{a}+{b}={total}>>{total}."
    else:
        total = a * b
        question = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"
        steps = f"Each of the {a} bags has {b} {item}, so {a} * {b} = <<{a}*{b}={total}>>{total}."
    return {"question": question, "answer": f"{steps}\n#### {total}"}


def make_sft_chats() -> list[dict]:
    rng = random.Random(SEED)
    return [_sft_chat(rng) for _ in range(NUM_SFT_CHATS)]


def make_sft_eval_chats() -> list[dict]:
    """Held-out chats: a draw of its own, not in the training file."""
    rng = random.Random(SEED + 2)
    return [_sft_chat(rng) for _ in range(NUM_SFT_EVAL_CHATS)]


def make_gsm8k_rows() -> tuple[list[dict], list[dict]]:
    """Returns (train, test) rows; disjoint draws from one seeded generator."""
    rng = random.Random(SEED + 1)
    rows = [_gsm8k_row(rng) for _ in range(NUM_GSM8K_TRAIN + NUM_GSM8K_TEST)]
    return rows[:NUM_GSM8K_TRAIN], rows[NUM_GSM8K_TRAIN:]


def _tokenizer_corpus(chats: list[dict], gsm8k_rows: list[dict]) -> list[str]:
    corpus = [message["content"] for chat in chats for message in chat["messages"]]
    for row in gsm8k_rows:
        corpus.append(RL_PROMPT_TEXT.format(question=row["question"]))
        corpus.append(
            f"<reasoning>{row['answer']}</reasoning><answer>{row['answer'].split('#### ')[-1]}</answer>"
        )
    return corpus


def _build_tokenizer(corpus: list[str]):
    """A byte-level BPE (like Llama 3's) with exactly VOCAB_SIZE entries, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Llama 3 prepends BOS on plain encode; its chat template writes BOS itself.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def _build_config(bos_token_id: int, eos_token_id: int, pad_token_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        rope_scaling=dict(ROPE_SCALING),
        initializer_range=INITIALIZER_RANGE,
        tie_word_embeddings=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        dtype="float32",
    )


def random_llama_weights(seed: int = SEED) -> dict:
    """Llama-layout float32 weights (HF names and [out, in] shapes), normal(0, 0.02); norms are ones."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape: int):
        return rng.normal(0.0, INITIALIZER_RANGE, size=shape).astype(np.float32)

    ones = np.ones(HIDDEN_SIZE, dtype=np.float32)
    weights = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        weights.update(
            {
                f"{prefix}.input_layernorm.weight": ones.copy(),
                f"{prefix}.self_attn.q_proj.weight": normal(NUM_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{prefix}.self_attn.k_proj.weight": normal(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{prefix}.self_attn.v_proj.weight": normal(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE),
                f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN_SIZE, NUM_HEADS * HEAD_DIM),
                f"{prefix}.post_attention_layernorm.weight": ones.copy(),
                f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
                f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE_SIZE, HIDDEN_SIZE),
                f"{prefix}.mlp.down_proj.weight": normal(HIDDEN_SIZE, INTERMEDIATE_SIZE),
            }
        )
    weights["model.norm.weight"] = ones.copy()
    weights["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return weights


def _write_model_dir(target: Path, corpus: list[str]) -> None:
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    tokenizer = _build_tokenizer(corpus)
    config = _build_config(tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    tokenizer.save_pretrained(target)
    config.save_pretrained(target)
    # As the Hub's Llama 3.1 Instruct has one: the published model must stop where its base stops.
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=True, temperature=0.6, top_p=0.9
    ).save_pretrained(target)
    # transformers refuses safetensors files whose metadata lacks a framework format.
    save_file(random_llama_weights(), str(target / "model.safetensors"), metadata={"format": "pt"})


def _write_jsonl(target: Path, records: list[dict]) -> None:
    target.write_text("".join(json.dumps(record) + "\n" for record in records))


def _write_parquet(target: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), target)


def _build_atomically(target: Path, write, *, is_dir: bool = False) -> bool:
    """Calls write(tmp) and renames tmp to target; returns False (and writes nothing) if target exists."""
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        result = tmp if is_dir else tmp / target.name
        write(result)
        # mkdtemp (and safetensors) create owner-only files; the artifacts are meant to be shared.
        for path in [result, *result.rglob("*")] if is_dir else [result]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(result, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def build_all(out_dir: Path) -> dict[str, bool]:
    """Builds whatever is missing under out_dir; returns {relative path: built (False = existed)}."""
    chats = make_sft_chats()
    train_rows, test_rows = make_gsm8k_rows()
    corpus = _tokenizer_corpus(chats, train_rows + test_rows)
    return {
        MODEL_DIR_NAME: _build_atomically(
            out_dir / MODEL_DIR_NAME, lambda tmp: _write_model_dir(tmp, corpus), is_dir=True
        ),
        str(SFT_FILE): _build_atomically(out_dir / SFT_FILE, lambda tmp: _write_jsonl(tmp, chats)),
        str(SFT_EVAL_FILE): _build_atomically(
            out_dir / SFT_EVAL_FILE, lambda tmp: _write_jsonl(tmp, make_sft_eval_chats())
        ),
        str(GSM8K_TRAIN_FILE): _build_atomically(
            out_dir / GSM8K_TRAIN_FILE, lambda tmp: _write_parquet(tmp, train_rows)
        ),
        str(GSM8K_TEST_FILE): _build_atomically(
            out_dir / GSM8K_TEST_FILE, lambda tmp: _write_parquet(tmp, test_rows)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory to build into")
    args = parser.parse_args()
    for path, built in build_all(args.out).items():
        print(f"{'built' if built else 'exists'}: {args.out / path}")


if __name__ == "__main__":
    main()
