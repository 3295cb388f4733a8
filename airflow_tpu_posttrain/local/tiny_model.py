"""Builds tiny Llama-3- and Gemma-3-shaped models and tiny SFT/GSM8K data, so MaxText's pipeline runs on CPU offline.

Run inside the MaxText venv (it imports tokenizers, transformers, safetensors, numpy, pyarrow):

    python tiny_model.py --out DIR

writes
    DIR/tiny-llama/          save_pretrained-style: config.json, model.safetensors, tokenizer files
    DIR/tiny-gemma3/         shaped like the Hub's google/gemma-3-4b-it (Gemma3ForConditionalGeneration, text +
                             vision tower, the Hub file's tensor names, Gemma's specials and chat template)
    DIR/datasets/tiny-chats/ laid out as the Hub's HuggingFaceH4/ultrachat_200k: {"messages": [...]} chats in
                             data/train_sft-*.parquet, held-out ones (the quality gate's) in data/test_sft-*.parquet
    DIR/datasets/tiny-gsm8k/ laid out as the Hub's openai/gsm8k: main/{train,test}-*.parquet, GSM8K-shaped
                             (question, answer ending in "#### N")

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
GEMMA3_DIR_NAME = "tiny-gemma3"
# The dataset repos, in their Hub originals' layouts: the twins' commands name the same splits and files.
CHATS_DIR = Path("datasets") / "tiny-chats"
GSM8K_DIR = Path("datasets") / "tiny-gsm8k"
CHATS_FILES = {"train_sft": "data/train_sft-00000-of-00001.parquet", "test_sft": "data/test_sft-00000-of-00001.parquet"}
GSM8K_FILES = {"train": "main/train-00000-of-00001.parquet", "test": "main/test-00000-of-00001.parquet"}

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


def _byte_level_bpe(corpus: list[str], vocab_size: int, special_tokens: list[str], bos_token: str):
    """A byte-level BPE of exactly ``vocab_size`` entries that prepends ``bos_token`` on a plain encode.

    Llama 3 and Gemma both do; their chat templates write the BOS themselves."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} entries, expected {vocab_size}")
    bos_id = tokenizer.token_to_id(bos_token)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
    )
    return tokenizer


def _build_tokenizer(corpus: list[str]):
    """A byte-level BPE (like Llama 3's) with exactly VOCAB_SIZE entries, wrapped for transformers."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = _byte_level_bpe(corpus, VOCAB_SIZE, SPECIAL_TOKENS, BOS_TOKEN)
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
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        do_sample=True,
        temperature=0.6,
        top_p=0.9,
    ).save_pretrained(target)
    # transformers refuses safetensors files whose metadata lacks a framework format.
    save_file(random_llama_weights(), str(target / "model.safetensors"), metadata={"format": "pt"})


# --- tiny Gemma 3, shaped like google/gemma-3-4b-it -------------------------------------------------------------
#
# The MaxText runs override gemma3-4b's dims with exactly these (configs/models/gemma3-4b.yml keys in brackets):
# hidden 64 [base_emb_dim], intermediate 128 [base_mlp_dim], 14 layers [base_num_decoder_layers; gemma3's
# 5-local:1-global pattern scans as 2 blocks of 6 plus 2 remainder layers, as 34 = 5 x 6 + 4 does],
# 4 query / 2 kv heads, head_dim 32, sliding window 32 [sliding_window_size], vocabulary 512 [vocab_size].
# Everything else (RoPE, norms, activations, query scaling) is gemma3-4b's.
GEMMA3_VOCAB_SIZE = (
    512  # MaxText's vocab_size (gemma3-4b: 262144): the tokenizer's tokens before <image_soft_token>
)
GEMMA3_EMBEDDING_ROWS = GEMMA3_VOCAB_SIZE + 64  # the Hub's checkpoint pads 262145 tokens to 262208 rows
GEMMA3_HIDDEN_SIZE = 64
GEMMA3_INTERMEDIATE_SIZE = 128
GEMMA3_NUM_LAYERS = 14
GEMMA3_NUM_HEADS = 4
GEMMA3_NUM_KV_HEADS = 2
GEMMA3_HEAD_DIM = 32
GEMMA3_SLIDING_WINDOW = 32
# Vision tower (unused by the text-only pipeline, present because the Hub's checkpoint has one): 28 px images
# in 14 px patches, i.e. 4 patches, pooled to 4 soft tokens.
GEMMA3_VISION_HIDDEN = 32
GEMMA3_VISION_INTERMEDIATE = 64
GEMMA3_VISION_LAYERS = 2
GEMMA3_VISION_HEADS = 2
GEMMA3_IMAGE_SIZE = 28
GEMMA3_PATCH_SIZE = 14
GEMMA3_MM_TOKENS_PER_IMAGE = 4

# Gemma's specials, in the Hub tokenizer's order (pad 0, eos 1, bos 2, unk 3, mask 4; the turn and image markers
# follow at their own ids there). <image_soft_token> comes last, past the vocabulary, as on the Hub (id 262144).
GEMMA3_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "[@BOS@]",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
]
GEMMA3_IMAGE_SOFT_TOKEN = "<image_soft_token>"

# google/gemma-3-4b-it's chat_template (a system message is folded into the first user turn).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def _gemma3_corpus(chats: list[dict], corpus: list[str]) -> list[str]:
    """The shared corpus plus the chats in Gemma's turn format, so turn headers tokenize compactly."""
    turns = [
        f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{m['content']}<end_of_turn>\n"
        for chat in chats
        for m in chat["messages"]
    ]
    return corpus + turns


def _build_gemma3_tokenizer(corpus: list[str]):
    """A byte-level BPE with GEMMA3_VOCAB_SIZE entries plus <image_soft_token>; <bos> prepended, as Gemma's.

    (The Hub's is a SentencePiece BPE with byte fallback; a byte-level BPE is the same kind of thing that trains
    to a tiny vocabulary without unknown tokens.)"""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tokenizer = _byte_level_bpe(corpus, GEMMA3_VOCAB_SIZE, GEMMA3_SPECIAL_TOKENS, "<bos>")
    tokenizer.add_special_tokens([AddedToken(GEMMA3_IMAGE_SOFT_TOKEN, normalized=False, special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=1000000000000000019884624838656,  # the Hub's (no limit)
    )


def gemma3_config(token_ids: dict[str, int]) -> dict:
    """config.json as google/gemma-3-4b-it's, with the tiny dims (every text field spelled out)."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": token_ids["<start_of_image>"],
        "eoi_token_index": token_ids["<end_of_image>"],
        "eos_token_id": [token_ids["<eos>"], token_ids["<end_of_turn>"]],
        "image_token_index": token_ids[GEMMA3_IMAGE_SOFT_TOKEN],
        "initializer_range": INITIALIZER_RANGE,
        "mm_tokens_per_image": GEMMA3_MM_TOKENS_PER_IMAGE,
        "model_type": "gemma3",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_logit_softcapping": None,
            "bos_token_id": token_ids["<bos>"],
            "eos_token_id": token_ids["<eos>"],
            "final_logit_softcapping": None,
            "head_dim": GEMMA3_HEAD_DIM,
            "hidden_activation": "gelu_pytorch_tanh",
            "hidden_size": GEMMA3_HIDDEN_SIZE,
            "initializer_range": INITIALIZER_RANGE,
            "intermediate_size": GEMMA3_INTERMEDIATE_SIZE,
            "max_position_embeddings": 131072,
            "model_type": "gemma3_text",
            "num_attention_heads": GEMMA3_NUM_HEADS,
            "num_hidden_layers": GEMMA3_NUM_LAYERS,
            "num_key_value_heads": GEMMA3_NUM_KV_HEADS,
            "pad_token_id": token_ids["<pad>"],
            # gemma3-4b (and MaxText's gemma3.py for gemma3-4b): queries scaled by head_dim ** -0.5.
            "query_pre_attn_scalar": GEMMA3_HEAD_DIM,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "rope_theta": 1000000.0,
            "sliding_window": GEMMA3_SLIDING_WINDOW,
            "sliding_window_pattern": 6,
            "use_cache": True,
            "vocab_size": GEMMA3_EMBEDDING_ROWS,
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "attention_dropout": 0.0,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": GEMMA3_VISION_HIDDEN,
            "image_size": GEMMA3_IMAGE_SIZE,
            "intermediate_size": GEMMA3_VISION_INTERMEDIATE,
            "layer_norm_eps": 1e-06,
            "model_type": "siglip_vision_model",
            "num_attention_heads": GEMMA3_VISION_HEADS,
            "num_channels": 3,
            "num_hidden_layers": GEMMA3_VISION_LAYERS,
            "patch_size": GEMMA3_PATCH_SIZE,
            "vision_use_head": False,
        },
    }


def random_gemma3_weights(seed: int = SEED) -> dict:
    """Gemma3ForConditionalGeneration weights under the Hub file's (pre-transformers-4.52) names, bfloat16.

    ``language_model.model.*`` (no lm_head: tied embeddings), ``vision_tower.vision_model.*``,
    ``multi_modal_projector.*``; [out, in] shapes; normal(0, 0.02), norms too (Gemma's RMSNorm scales by 1 + w)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape: int):
        return rng.normal(0.0, INITIALIZER_RANGE, size=shape).astype(ml_dtypes.bfloat16)

    hidden, q_dim, kv_dim = (
        GEMMA3_HIDDEN_SIZE,
        GEMMA3_NUM_HEADS * GEMMA3_HEAD_DIM,
        GEMMA3_NUM_KV_HEADS * GEMMA3_HEAD_DIM,
    )
    text = "language_model.model"
    weights = {f"{text}.embed_tokens.weight": normal(GEMMA3_EMBEDDING_ROWS, hidden)}
    for layer in range(GEMMA3_NUM_LAYERS):
        prefix = f"{text}.layers.{layer}"
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            weights[f"{prefix}.{norm}.weight"] = normal(hidden)
        weights.update(
            {
                f"{prefix}.self_attn.q_proj.weight": normal(q_dim, hidden),
                f"{prefix}.self_attn.k_proj.weight": normal(kv_dim, hidden),
                f"{prefix}.self_attn.v_proj.weight": normal(kv_dim, hidden),
                f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_dim),
                f"{prefix}.self_attn.q_norm.weight": normal(GEMMA3_HEAD_DIM),
                f"{prefix}.self_attn.k_norm.weight": normal(GEMMA3_HEAD_DIM),
                f"{prefix}.mlp.gate_proj.weight": normal(GEMMA3_INTERMEDIATE_SIZE, hidden),
                f"{prefix}.mlp.up_proj.weight": normal(GEMMA3_INTERMEDIATE_SIZE, hidden),
                f"{prefix}.mlp.down_proj.weight": normal(hidden, GEMMA3_INTERMEDIATE_SIZE),
            }
        )
    weights[f"{text}.norm.weight"] = normal(hidden)

    vis, vis_mlp = GEMMA3_VISION_HIDDEN, GEMMA3_VISION_INTERMEDIATE
    vision = "vision_tower.vision_model"
    num_patches = (GEMMA3_IMAGE_SIZE // GEMMA3_PATCH_SIZE) ** 2
    weights.update(
        {
            f"{vision}.embeddings.patch_embedding.weight": normal(
                vis, 3, GEMMA3_PATCH_SIZE, GEMMA3_PATCH_SIZE
            ),
            f"{vision}.embeddings.patch_embedding.bias": normal(vis),
            f"{vision}.embeddings.position_embedding.weight": normal(num_patches, vis),
        }
    )
    for layer in range(GEMMA3_VISION_LAYERS):
        prefix = f"{vision}.encoder.layers.{layer}"
        for name, shape in (
            ("layer_norm1", (vis,)),
            ("layer_norm2", (vis,)),
            ("self_attn.q_proj", (vis, vis)),
            ("self_attn.k_proj", (vis, vis)),
            ("self_attn.v_proj", (vis, vis)),
            ("self_attn.out_proj", (vis, vis)),
            ("mlp.fc1", (vis_mlp, vis)),
            ("mlp.fc2", (vis, vis_mlp)),
        ):
            weights[f"{prefix}.{name}.weight"] = normal(*shape)
            weights[f"{prefix}.{name}.bias"] = normal(shape[0])
    weights[f"{vision}.post_layernorm.weight"] = normal(vis)
    weights[f"{vision}.post_layernorm.bias"] = normal(vis)
    weights["multi_modal_projector.mm_input_projection_weight"] = normal(vis, hidden)
    weights["multi_modal_projector.mm_soft_emb_norm.weight"] = normal(vis)
    return weights


def _write_json(target: Path, value: dict) -> None:
    target.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def _write_gemma3_dir(target: Path, corpus: list[str]) -> None:
    """The Hub repo's files, minus tokenizer.model (SentencePiece) and with one safetensors file, not two shards.

    One file: MaxText's lazy loader resolves a name through the shard index before it opens a file, so the
    to_maxtext launcher's fallback to the Hub file's tensor names works at safe_open only for a single file."""
    from safetensors.numpy import save_file

    tokenizer = _build_gemma3_tokenizer(corpus)
    tokenizer.save_pretrained(target)
    # The Hub's tokenizer_config names Gemma's tokenizer class and its boi/eoi/image tokens.
    config_path = target / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": GEMMA3_IMAGE_SOFT_TOKEN,
            "spaces_between_special_tokens": False,
        }
    )
    _write_json(config_path, tokenizer_config)
    vocab = tokenizer.get_vocab()
    token_ids = {token: vocab[token] for token in [*GEMMA3_SPECIAL_TOKENS, GEMMA3_IMAGE_SOFT_TOKEN]}
    config = gemma3_config(token_ids)
    _write_json(target / "config.json", config)
    # As the Hub's: generation stops at <eos> or <end_of_turn>.
    _write_json(
        target / "generation_config.json",
        {
            "bos_token_id": token_ids["<bos>"],
            "cache_implementation": "hybrid",
            "do_sample": True,
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": token_ids["<pad>"],
            "top_k": 64,
            "top_p": 0.95,
            "transformers_version": "4.50.0.dev0",
        },
    )
    _write_json(
        target / "preprocessor_config.json",
        {
            "do_convert_rgb": None,
            "do_normalize": True,
            "do_pan_and_scan": None,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Gemma3ImageProcessor",
            "image_seq_length": GEMMA3_MM_TOKENS_PER_IMAGE,
            "image_std": [0.5, 0.5, 0.5],
            "pan_and_scan_max_num_crops": None,
            "pan_and_scan_min_crop_size": None,
            "pan_and_scan_min_ratio_to_activate": None,
            "processor_class": "Gemma3Processor",
            "resample": 2,
            "rescale_factor": 0.00392156862745098,
            "size": {"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE},
        },
    )
    _write_json(
        target / "processor_config.json",
        {"image_seq_length": GEMMA3_MM_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"},
    )
    save_file(random_gemma3_weights(), str(target / "model.safetensors"), metadata={"format": "pt"})


def _write_dataset_repo(target: Path, config_name: str, splits: dict[str, tuple[str, list[dict]]]) -> None:
    """A dataset repo as the Hub holds one: a parquet file per split and a README whose ``configs`` name them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    card = ["---", "configs:", f"- config_name: {config_name}", "  data_files:"]
    for split, (path, rows) in splits.items():
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), target / path)
        card += [f"  - split: {split}", f"    path: {path.split('-00000-of-')[0]}-*"]
    (target / "README.md").write_text("\n".join([*card, "---", "", "Tiny data for the local runs.", ""]))


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
        GEMMA3_DIR_NAME: _build_atomically(
            out_dir / GEMMA3_DIR_NAME,
            lambda tmp: _write_gemma3_dir(tmp, _gemma3_corpus(chats, corpus)),
            is_dir=True,
        ),
        str(CHATS_DIR): _build_atomically(
            out_dir / CHATS_DIR,
            lambda tmp: _write_dataset_repo(
                tmp,
                "default",
                {
                    "train_sft": (CHATS_FILES["train_sft"], chats),
                    "test_sft": (CHATS_FILES["test_sft"], make_sft_eval_chats()),
                },
            ),
            is_dir=True,
        ),
        str(GSM8K_DIR): _build_atomically(
            out_dir / GSM8K_DIR,
            lambda tmp: _write_dataset_repo(
                tmp, "main", {"train": (GSM8K_FILES["train"], train_rows), "test": (GSM8K_FILES["test"], test_rows)}
            ),
            is_dir=True,
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
