"""Model profiles: how MaxText names a model, where its weights come from, and its recipes' defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.validation import SpecError


@dataclass(frozen=True)
class SftDataset:
    """The MaxText dataset keys of an SFT run (``hf_*`` keys of MaxText's Hugging Face input pipeline)."""

    hf_path: str  # a Hub dataset id, or a `datasets` builder name such as 'json' for local files
    train_split: str
    train_data_columns: str = "['messages']"
    train_files: str | None = None  # hf_train_files: a local file for builders such as 'json'
    eval_split: str | None = None  # hf_eval_split; None keeps MaxText's default (UltraChat's test_sft)
    eval_files: str | None = None  # hf_eval_files: a local file of held-out rows for builders such as 'json'
    eval_steps: int = 50  # batches each evaluation reads (the quality gate's, before the first and after the last step)
    source_repo: str | None = None  # the Hub dataset local files were taken from (watched by schedule: on_change)

    def __post_init__(self) -> None:
        validation.safe_relative_path("hf_path", self.hf_path)
        validation.safe_name("train_split", self.train_split)
        validation.column_list("train_data_columns", self.train_data_columns)
        if self.train_files is not None:
            validation.safe_absolute_path("hf_train_files", self.train_files)
        if self.eval_split:
            validation.safe_name("hf_eval_split", self.eval_split)
        if self.eval_files is not None:
            validation.safe_absolute_path("hf_eval_files", self.eval_files)
        validation.positive_int("eval_steps", self.eval_steps)


@dataclass(frozen=True)
class RlDataset:
    """Local parquet files in GSM8K's shape; ``None`` keeps MaxText's default (GSM8K from the Hub)."""

    train_files: str | None = None
    eval_files: str | None = None
    source_repo: str | None = None  # the Hub dataset the files were taken from (watched by schedule: on_change)

    def __post_init__(self) -> None:
        if self.train_files is not None:
            validation.safe_absolute_path("hf_train_files", self.train_files)
        if self.eval_files is not None:
            validation.safe_absolute_path("hf_eval_files", self.eval_files)


ULTRACHAT_200K = SftDataset(hf_path="HuggingFaceH4/ultrachat_200k", train_split="train_sft")
GSM8K = RlDataset()
GSM8K_REPO = "openai/gsm8k"  # what MaxText's GRPO recipe reads when no files are given


@dataclass(frozen=True)
class ModelProfile:
    key: str
    maxtext_model_name: str
    hf_source: str  # the Hub id the conversion, the trainers' tokenizer and the export read
    maxtext_version: str  # the MaxText release the recipe was written for
    sft_dataset: SftDataset = ULTRACHAT_200K
    rl_dataset: RlDataset = GSM8K
    sft_steps: int = 1000
    rl_num_batches: int = 50
    rl_num_test_batches: int = 10
    # MaxText keys that reshape `maxtext_model_name`, for models MaxText has no config of its own for.
    maxtext_overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # The local CPU model: served by the local Hub, its datasets local files (``model_source_dir``).
    is_local: bool = False

    def __post_init__(self) -> None:
        validation.safe_name("model", self.key)
        validation.safe_name("maxtext_model_name", self.maxtext_model_name)
        validation.hf_repo_id("hf_source", self.hf_source)
        validation.package_version("maxtext_version", self.maxtext_version)
        validation.positive_int("steps", self.sft_steps)
        validation.positive_int("num_batches", self.rl_num_batches)
        validation.positive_int("num_test_batches", self.rl_num_test_batches)


# A 2-layer Llama with Llama 3.1 8B's architecture, shrunk (maxtext-on-cpu.md).
TINY_LLAMA_DIMS: Mapping[str, str] = MappingProxyType(
    {
        "override_model_config": "true",
        "base_emb_dim": "64",
        "base_num_query_heads": "4",
        "base_num_kv_heads": "2",
        "base_num_decoder_layers": "2",
        "base_mlp_dim": "128",
        "head_dim": "16",
        "vocab_size": "512",
    }
)
DEFAULT_TINY_LLAMA_ROOT = "/dev/shm/tiny-llama/source"
# The tiny model's repo on the local Hub: gated, as Gemma and Llama are, so every step reads it with the token.
TINY_LLAMA_REPO = "local/tiny-llama"
# The tiny model's SFT chats as a dataset repo on the local Hub, uploaded with them: what on_change watches.
TINY_CHATS_REPO = "local/tiny-chats"


def tiny_llama_profile(root: str = DEFAULT_TINY_LLAMA_ROOT) -> ModelProfile:
    """The local CPU model: its weights and tokenizer on the local Hub, its datasets under ``root``.

    The weights and tokenizer are ``TINY_LLAMA_REPO``, uploaded from ``<root>/tiny-llama`` by the local stack.

    Expected files, as ``local/tiny_model.py --out <root>`` writes them: ``<root>/tiny-llama`` (a
    save_pretrained-style directory with its tokenizer), ``<root>/data/sft.jsonl`` (``{"messages": [...]}``
    chats) and ``<root>/data/sft_eval.jsonl`` (held-out ones), ``<root>/data/gsm8k/{train,test}.parquet`` (GSM8K's ``question``/``answer`` columns).
    """
    root = validation.safe_absolute_path("tiny_llama_root", root)
    return ModelProfile(
        key="tiny-llama",
        maxtext_model_name="llama3.1-8b",
        hf_source=TINY_LLAMA_REPO,
        maxtext_version="0.2.5",
        # A JSON file loads as the split "train"; the held-out chats are a file of their own.
        sft_dataset=SftDataset(
            hf_path="json",
            train_split="train",
            train_files=f"{root}/data/sft.jsonl",
            eval_split="train",
            eval_files=f"{root}/data/sft_eval.jsonl",
            eval_steps=2,
            source_repo=TINY_CHATS_REPO,
        ),
        rl_dataset=RlDataset(
            train_files=f"{root}/data/gsm8k/train.parquet", eval_files=f"{root}/data/gsm8k/test.parquet"
        ),
        sft_steps=5,
        rl_num_batches=2,
        rl_num_test_batches=2,
        maxtext_overrides=TINY_LLAMA_DIMS,
        is_local=True,
    )


MODELS: Mapping[str, ModelProfile] = MappingProxyType(
    {
        profile.key: profile
        for profile in (
            ModelProfile(
                key="gemma3-4b",
                maxtext_model_name="gemma3-4b",
                hf_source="google/gemma-3-4b-it",
                maxtext_version="0.2.2",
            ),
            ModelProfile(
                key="llama3.1-8b-Instruct",
                maxtext_model_name="llama3.1-8b-Instruct",
                hf_source="meta-llama/Llama-3.1-8B-Instruct",
                maxtext_version="0.2.3",
            ),
            tiny_llama_profile(),
        )
    }
)


def model_profile(key: str) -> ModelProfile:
    try:
        return MODELS[key]
    except (KeyError, TypeError):
        raise SpecError("model", key, "is not a known model", f"use one of: {', '.join(MODELS)}") from None


def input_repos(profile: ModelProfile, recipe: str, dataset: str | None = None) -> list[tuple[str, str]]:
    """``(repo_id, repo_type)`` of a run's inputs on the Hub: the base model, and the dataset if it is one.

    ``dataset``: the run's SFT dataset, when not the model's."""
    repos = [(profile.hf_source, "model")]
    if recipe == "sft":
        data = profile.sft_dataset
        dataset = dataset or data.source_repo or data.hf_path
    else:
        data = profile.rl_dataset
        dataset = data.source_repo or (None if data.train_files else GSM8K_REPO)
    if dataset and "/" in dataset:
        repos.append((dataset, "dataset"))
    return repos
