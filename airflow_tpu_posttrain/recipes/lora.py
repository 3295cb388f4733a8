"""LoRA and QLoRA on SFT: what a registry entry's ``lora:`` block and the trigger form's LoRA fields may say.

A LoRA run is an SFT run (``train_sft``: its dataset, checkpoints, resumption, evaluation and quality gate) that
trains only low-rank adapters on the frozen base (MaxText's ``lora.*`` keys, MaxText 0.2.4's LoRA tutorial) and
publishes them as a PEFT adapter (``to_huggingface`` with ``lora.lora_restore_path``). What a release or a model
cannot do is refused here, before any VM, naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.models import ModelProfile
from airflow_tpu_posttrain.recipes.validation import SpecError

# MaxText 0.2.4 is the first release with LoRA (its release notes; ``lora:`` in post_train/sft.yml). Of the
# releases this package pins, 0.2.5.
FIRST_RELEASE = (0, 2, 4)
# QLoRA: the frozen base's weights quantized (``lora.lora_weight_qtype``); None trains on the base as it is.
WEIGHT_QTYPES = ("nf4", "int8")
# The MaxText models whose exported adapter matches what MaxText trained. Gemma 3: checked on MaxText 0.2.5 against
# MaxText's own forward pass. Llama 3's query and key adapters are exported without the hooks MaxText's Llama
# checkpoints need (the RoPE de-interleave, and the query's 1/sqrt(head_dim) scaling), so a published Llama adapter
# would not be the one trained.
ADAPTER_EXPORT_MODELS = ("gemma3-",)
# A module-path regex passes to MaxText as one shell-quoted word: anything a regex over module paths needs, no
# whitespace, quotes or shell expansions.
MODULE_PATH_RE = r"[A-Za-z0-9_/().*|+?\[\]{},^-]{1,300}"
_MODULE_PATH = re.compile(MODULE_PATH_RE)
# The trigger form's LoRA fields, in the order the form shows them, and the block key each sets.
PARAM_KEYS: Mapping[str, str] = {
    "lora_rank": "rank",
    "lora_alpha": "alpha",
    "lora_target_modules": "target_modules",
    "lora_weight_qtype": "weight_qtype",
}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


@dataclass(frozen=True)
class LoraSettings:
    """A registry entry's ``lora:`` block: the adapters' rank and scale, the modules they adapt, QLoRA's type.

    ``target_modules``: MaxText's ``lora.lora_module_path``, a regex over its module paths (e.g.
    ``decoder/.*self_attention/(query|value)``); None takes MaxText's per-model default
    (``post_train/lora_module_path.yml``: for Gemma 3 every attention and MLP projection)."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: str | None = None
    weight_qtype: str | None = None

    def __post_init__(self) -> None:
        validation.positive_int("lora.rank", self.rank)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise SpecError("lora.alpha", self.alpha, "is not a positive number", "give the scale, e.g. 32 (2 x rank)")
        if self.target_modules is not None:
            module_path("lora.target_modules", self.target_modules)
        if self.weight_qtype is not None:
            validation.one_of("lora.weight_qtype", self.weight_qtype, WEIGHT_QTYPES)

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> LoraSettings:
        """The settings a run's rendered LoRA fields give (``PARAM_KEYS``; blank: the default)."""
        given = {
            key: validation.blank_to_none(values.get(name)) for name, key in PARAM_KEYS.items()
        }
        try:
            rank = int(given["rank"]) if given["rank"] is not None else cls.rank
            alpha = float(given["alpha"]) if given["alpha"] is not None else cls.alpha
        except (TypeError, ValueError):
            raise SpecError(
                "lora_rank / lora_alpha", (given["rank"], given["alpha"]), "are not numbers",
                "give a whole rank (e.g. 16) and a scale (e.g. 32)",
            ) from None
        return cls(rank=rank, alpha=alpha, target_modules=given["target_modules"], weight_qtype=given["weight_qtype"])

    def train_args(self) -> dict[str, str]:
        """MaxText's keys for training: the tutorial's three, then the module regex and QLoRA's type if set."""
        args = {"lora.enable_lora": "True", "lora.lora_rank": str(self.rank), "lora.lora_alpha": _number(self.alpha)}
        if self.target_modules:
            args["lora.lora_module_path"] = self.target_modules
        if self.weight_qtype:
            args["lora.lora_weight_qtype"] = self.weight_qtype
        return args

    def export_args(self, adapter_params: str) -> dict[str, str]:
        """MaxText's keys for the adapter's export: the trained adapter, with the rank and scale again.

        The tutorial: "lora.lora_rank / lora.lora_alpha must match the values used during the training phase to
        ensure the adapter_config.json is generated correctly" (without them it says ``r: 0``)."""
        return {
            "lora.lora_restore_path": adapter_params,
            "lora.lora_rank": str(self.rank),
            "lora.lora_alpha": _number(self.alpha),
        }


def _number(value: float) -> str:
    return repr(float(value))


def module_path(field: str, value: object) -> str:
    """A module-path regex: characters a regex over module paths needs, and one that compiles."""
    if not isinstance(value, str) or not _MODULE_PATH.fullmatch(value):
        raise SpecError(
            field, value, "is not a module-path regex of letters, digits and / _ . * | ( ) [ ] + ? -",
            "e.g. decoder/.*self_attention/(query|value), or leave it empty for MaxText's default",
        )
    try:
        re.compile(value)
    except re.error as err:
        raise SpecError(field, value, f"does not compile as a regex ({err})", "fix the regex") from None
    return value


def check_model(model: ModelProfile, release: str) -> None:
    """Refuse a model or release whose LoRA this package cannot train and publish correctly."""
    validation.package_version("maxtext_version", release)
    if _release(release) < FIRST_RELEASE:
        raise SpecError(
            "maxtext_version", release, "has no LoRA (MaxText's LoRA came with 0.2.4)",
            "set maxtext_version: 0.2.5 for this entry (the conversion is cached per release)",
        )
    if not model.maxtext_model_name.startswith(ADAPTER_EXPORT_MODELS):
        raise SpecError(
            "model", model.key,
            f"runs as MaxText's {model.maxtext_model_name}, whose LoRA adapter MaxText does not export as trained "
            "(of MaxText's models, this package publishes Gemma 3's adapters only)",
            "use a Gemma 3 model for LoRA, or full SFT (remove the lora block) for this one",
        )
