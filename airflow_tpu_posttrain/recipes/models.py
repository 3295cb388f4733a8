"""Model profiles: how MaxText names a model, where its weights come from, and its recipes' defaults."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.validation import SpecError


@dataclass(frozen=True)
class SftDataset:
    """An SFT dataset: a Hub dataset repo and the keys of MaxText's Hugging Face input pipeline that read it.

    MaxText's pipeline takes no revision, so the trainer reads the VM's copy of the repo at the run's revision
    (``hf_path`` = that copy, whose files and README resolve splits as the Hub's repo does)."""

    hf_path: str  # the Hub dataset id, e.g. HuggingFaceH4/ultrachat_200k
    train_split: str
    train_data_columns: str = "['messages']"
    eval_split: str | None = None  # hf_eval_split; None keeps MaxText's default (UltraChat's test_sft)
    eval_steps: int = 50  # batches each evaluation reads (the quality gate's, before the first and after the last step)

    def __post_init__(self) -> None:
        validation.hf_repo_id("hf_path", self.hf_path)
        validation.safe_name("train_split", self.train_split)
        validation.column_list("train_data_columns", self.train_data_columns)
        if self.eval_split:
            validation.safe_name("hf_eval_split", self.eval_split)
        validation.positive_int("eval_steps", self.eval_steps)


@dataclass(frozen=True)
class RlDataset:
    """GRPO's dataset: a Hub dataset repo in GSM8K's shape and its splits' files in it (globs).

    MaxText's GRPO recipe reads GSM8K by name unless ``hf_train_files`` names files; it gets the VM's copy of the
    repo at the run's revision, as SFT does."""

    repo: str
    train_files: str
    eval_files: str

    def __post_init__(self) -> None:
        validation.hf_repo_id("rl_dataset", self.repo)
        validation.file_glob("hf_train_files", self.train_files)
        validation.file_glob("hf_eval_files", self.eval_files)


ULTRACHAT_200K = SftDataset(hf_path="HuggingFaceH4/ultrachat_200k", train_split="train_sft")
# GSM8K's "main" subset (rl.yml's hf_subset) as the Hub lays it out.
GSM8K = RlDataset(repo="openai/gsm8k", train_files="main/train-*.parquet", eval_files="main/test-*.parquet")


@dataclass(frozen=True)
class ModelProfile:
    # The fields a registry's ``models:`` entry may set (MODEL_FIELDS) carry their description for docs/registry.md.
    key: str
    maxtext_model_name: str = field(metadata={"doc": "MaxText's name of the model (to_maxtext, the trainers, to_huggingface), e.g. `qwen3-8b`."})
    hf_source: str = field(metadata={"doc": "The Hub id the conversion, the trainers' tokenizer and the export read, e.g. `Qwen/Qwen3-8B`."})
    maxtext_version: str = field(metadata={"doc": "The MaxText release its recipes run on, e.g. `0.2.3`."})
    sft_dataset: SftDataset = field(
        default=ULTRACHAT_200K, metadata={"doc": "SFT's dataset (MaxText's `hf_*` keys); default: UltraChat 200k, as the SFT tutorial."}
    )
    rl_dataset: RlDataset = GSM8K
    sft_steps: int = field(default=1000, metadata={"doc": "SFT's training steps (the tutorial's 1000)."})
    rl_num_batches: int = field(default=50, metadata={"doc": "GRPO's training batches (the tutorial's 50)."})
    rl_num_test_batches: int = field(
        default=10, metadata={"doc": "GRPO's evaluation batches, before and after training (the tutorial's 10)."}
    )
    maxtext_overrides: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType({}),
        metadata={"doc": "MaxText keys that reshape `maxtext_model_name`, for a model MaxText has no config of its own for."},
    )
    # The local CPU model: served by the local Hub, its datasets local files (under the local stack's ``LOCAL_MODELS`` folder).
    is_local: bool = False
    # MaxText's own table of Hub ids (its converters' ``HF_IDS``) names ``hf_source`` for ``maxtext_model_name``:
    # the converters read it by name. Else the cpu runtime gives it as ``--hf_model_path``.
    hf_source_in_maxtext_table: bool = True
    # A local twin: the key of the cloud model whose commands it runs, shrunk (recipes/runtime.LOCAL_DIFFERENCES).
    twin_of: str | None = None

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
# The tiny model's repo on the local Hub: gated, as Gemma and Llama are, so every step reads it with the token.
TINY_LLAMA_REPO = "local/tiny-llama"
# The local models' datasets on the local Hub (local/tiny_model.py writes them in UltraChat's and GSM8K's layouts,
# the local stack uploads them): chats in the tiny tokenizer's vocabulary, and GSM8K-shaped problems.
TINY_CHATS_REPO = "local/tiny-chats"
TINY_GSM8K_REPO = "local/tiny-gsm8k"
# UltraChat's split names: the twins' SFT commands read the same splits as their cloud entries'.
TINY_CHATS = SftDataset(hf_path=TINY_CHATS_REPO, train_split="train_sft", eval_steps=2)
TINY_GSM8K = RlDataset(repo=TINY_GSM8K_REPO, train_files=GSM8K.train_files, eval_files=GSM8K.eval_files)

# What a local model trains for: a few steps, enough to checkpoint, resume and evaluate (the GRPO twin runs the
# tutorial's 50 batches: a tiny model's batch takes a fraction of a second).
_LOCAL_SFT_STEPS = 5


def tiny_llama_profile() -> ModelProfile:
    """The local CPU model of the fault tests: its weights, tokenizer and datasets on the local Hub.

    The weights and tokenizer are ``TINY_LLAMA_REPO``, the datasets ``TINY_CHATS_REPO`` and ``TINY_GSM8K_REPO``,
    uploaded by the local stack from what ``local/tiny_model.py`` builds."""
    return ModelProfile(
        key="tiny-llama",
        maxtext_model_name="llama3.1-8b",
        hf_source=TINY_LLAMA_REPO,
        maxtext_version="0.2.5",
        sft_dataset=TINY_CHATS,
        rl_dataset=TINY_GSM8K,
        maxtext_overrides=TINY_LLAMA_DIMS,
        is_local=True,
        hf_source_in_maxtext_table=False,
        sft_steps=_LOCAL_SFT_STEPS,
        rl_num_batches=2,
        rl_num_test_batches=2,
    )


# A Gemma 3 4B shrunk (local/tiny_model.py builds it): 14 layers are two scanned blocks of gemma3's six-layer
# pattern and a remainder of two, as 34 = 5 x 6 + 4; the sliding window must match the checkpoint's, or MaxText
# trains another model without a word.
TINY_GEMMA3_DIMS: Mapping[str, str] = MappingProxyType(
    {
        "override_model_config": "true",
        "base_emb_dim": "64",
        "base_num_query_heads": "4",
        "base_num_kv_heads": "2",
        "base_num_decoder_layers": "14",
        "base_mlp_dim": "128",
        "head_dim": "32",
        "vocab_size": "512",
        "sliding_window_size": "32",
    }
)
# The local twins: the cloud model's MaxText model, Hub repo (served by the local Hub under the same id, gated)
# and release, with the shape above and local data.
TWIN_DIMS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {"gemma3-4b": TINY_GEMMA3_DIMS, "llama3.1-8b-Instruct": TINY_LLAMA_DIMS}
)
# Which local/tiny_model.py directory the local Hub serves under each twin's repo id.
LOCAL_HUB_SOURCES: Mapping[str, str] = MappingProxyType(
    {
        TINY_LLAMA_REPO: "tiny-llama",
        "google/gemma-3-4b-it": "tiny-gemma3",
        "meta-llama/Llama-3.1-8B-Instruct": "tiny-llama",
    }
)


def twin_key(cloud_key: str) -> str:
    return f"tiny-{cloud_key}"


def twin_profile(cloud: ModelProfile) -> ModelProfile:
    """The local twin of the cloud model ``cloud``: its commands, shrunk to run on a CPU, on the local datasets."""
    return replace(
        cloud,
        key=twin_key(cloud.key),
        sft_dataset=TINY_CHATS,
        rl_dataset=TINY_GSM8K,
        maxtext_overrides=TWIN_DIMS[cloud.key],
        is_local=True,
        twin_of=cloud.key,
        sft_steps=_LOCAL_SFT_STEPS,
    )


# The tutorials' models.
CLOUD_MODELS: Mapping[str, ModelProfile] = MappingProxyType(
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
        )
    }
)
MODELS: Mapping[str, ModelProfile] = MappingProxyType(
    {
        **CLOUD_MODELS,
        **{twin_key(key): twin_profile(profile) for key, profile in CLOUD_MODELS.items()},
        "tiny-llama": tiny_llama_profile(),
    }
)


# Models defined by a registry's ``models:`` section, in this process (see define_models).
_DEFINED: dict[str, ModelProfile] = {}

# What a registry's ``models:`` entry may set: the fields a new model needs, over the built-in's if it has one.
MODEL_FIELDS = ("hf_source", "maxtext_model_name", "maxtext_version", "sft_dataset", "sft_steps", "rl_num_batches",
                "rl_num_test_batches", "maxtext_overrides")
SFT_DATASET_FIELDS = ("hf_path", "train_split", "train_data_columns", "eval_split", "eval_steps")
_NEW_MODEL_EXAMPLE = {
    "hf_source": "the Hub id, e.g. Qwen/Qwen3-8B",
    "maxtext_model_name": "MaxText's name of the model, e.g. qwen3-8b",
    "maxtext_version": "the MaxText release its recipes run on, e.g. 0.2.3",
}


def model_profile(key: str) -> ModelProfile:
    try:
        return _DEFINED.get(key) or MODELS[key]
    except (KeyError, TypeError):
        known = ", ".join(sorted({*MODELS, *_DEFINED}))
        raise SpecError(
            "model", key, "is not a known model", f"use one of: {known}, or define it under models: in models.yaml"
        ) from None


def model_definitions(section: object, problems: list[str]) -> list[ModelProfile]:
    """The profiles a registry's ``models:`` section defines, each over its built-in profile if there is one.

    Each problem, with its place (``models.<key>.<field>``) and fix, is added to ``problems``."""
    if section is None:
        return []
    if not isinstance(section, dict):
        problems.append("models: must be a mapping of model keys to their fields, e.g. qwen3-8b: {hf_source: ...}")
        return []
    profiles = []
    for key, entry in section.items():
        place = f"models.{key}"
        if not isinstance(entry, dict):
            problems.append(f"{place}: must be a mapping of {', '.join(MODEL_FIELDS)}")
            continue
        found = _unknown(place, entry, MODEL_FIELDS)
        dataset = entry.get("sft_dataset")
        if dataset is not None and not isinstance(dataset, dict):
            found.append(f"{place}.sft_dataset: must be a mapping of {', '.join(SFT_DATASET_FIELDS)}")
        elif dataset is not None:
            found += _unknown(f"{place}.sft_dataset", dataset, SFT_DATASET_FIELDS)
        base = MODELS.get(key)
        if base is None:
            found += [
                f"{place}.{name}: required for a model the package does not know; give {example}"
                for name, example in _NEW_MODEL_EXAMPLE.items()
                if name not in entry
            ]
        if found:
            problems += found
            continue
        fields = dict(entry)
        if dataset is not None:
            fields["sft_dataset"] = SftDataset(**dataset) if base is None else replace(base.sft_dataset, **dataset)
        if "maxtext_overrides" in fields:
            fields["maxtext_overrides"] = MappingProxyType({str(k): str(v) for k, v in fields["maxtext_overrides"].items()})
        try:
            profiles.append(replace(base, **fields) if base else ModelProfile(key=str(key), **fields))
        except (SpecError, TypeError) as err:
            field_name = getattr(err, "field", "")
            problems.append(f"{place}{'.' + field_name if field_name else ''}: {err}")
    return profiles


def _unknown(place: str, entry: dict, known: tuple[str, ...]) -> list[str]:
    return validation.unknown_keys(entry, known, "field of a model", "fields", prefix=f"{place}.")


def define_models(profiles: list[ModelProfile]) -> None:
    """Make ``profiles`` known to :func:`model_profile` in this process.

    The DAG file that loads a registry defines its models wherever it is parsed: the DAG processor, and each
    task's process, which parses the file before it runs the task. A key defined again differently is refused:
    two registries in one Airflow may not disagree on what a model is."""
    for profile in profiles:
        known = _DEFINED.get(profile.key)
        if known is not None and known != profile:
            raise SpecError(
                "model", profile.key, "is defined differently by another registry", "define each model once"
            )
        _DEFINED[profile.key] = profile


def input_repos(profile: ModelProfile, recipe: str, dataset: str | None = None) -> list[tuple[str, str]]:
    """``(repo_id, repo_type)`` of a run's inputs on the Hub: the base model and the dataset.

    ``dataset``: the run's SFT dataset, when not the model's."""
    dataset = (dataset or profile.sft_dataset.hf_path) if recipe == "sft" else profile.rl_dataset.repo
    return [(profile.hf_source, "model"), (dataset, "dataset")]
