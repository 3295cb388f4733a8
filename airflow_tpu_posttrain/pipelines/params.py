"""The trigger form of a post-training DAG: its Params, each validated as the operators validate it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from airflow.sdk import Param

from airflow_tpu_posttrain.defaults import INPUTS_AS_OF
from airflow_tpu_posttrain.pipelines.registry import PipelineConfig
from airflow_tpu_posttrain.recipes import compute, lora, validation
from airflow_tpu_posttrain.recipes import quality_gate as gate
from airflow_tpu_posttrain.recipes.accelerators import SLICE_ACCELERATORS, TPU_ACCELERATORS

# Param patterns are checked with re.search (and by the UI in JavaScript), where "$" also matches before a
# final newline: END matches only at the very end, in both. The bodies are the operators' own validation's.
END = r"(?![\s\S])"


def _anchored(*parts: str, empty_ok: bool = False) -> str:
    pattern = "^" + "".join(parts) + END
    return f"^{END}|{pattern}" if empty_ok else pattern


ZONE_PATTERN = _anchored(validation.ZONE_RE)
OVERRIDE_PATTERN = _anchored(validation.OVERRIDE_KEY_RE, "=", validation.OVERRIDE_VALUE_RE)

# A FormField's default unless it gives one: the registry entry's value of the field's name.
FROM_ENTRY: Any = object()


@dataclass(frozen=True)
class FormField:
    """One Param of the trigger form, in the form's order.

    ``default``, ``description`` and each value of ``schema`` (the JSON Schema keywords besides the type and
    the title) may be a function of the registry entry. ``recipe``: the field is only in that recipe's
    forms."""

    name: str
    type: str | list[str]
    title: str
    description: str | Callable[[PipelineConfig], str]
    schema: dict[str, Any] = field(default_factory=dict)
    default: Any = FROM_ENTRY
    recipe: str | None = None
    only_with_lora: bool = False  # the field is only in the forms of LoRA entries (``lora:``)


def _accelerators(cfg: PipelineConfig) -> list[str]:
    """What a run of the entry's DAG may train on: a slice's DAG makes slices, the others one VM."""
    if cfg.local:
        return [cfg.accelerator_type] if cfg.is_slice else ["cpu"]
    return list(SLICE_ACCELERATORS if cfg.is_slice else TPU_ACCELERATORS)


FORM = (
    FormField(
        "model",
        type="string",
        schema={"enum": lambda cfg: [cfg.model]},
        title="Model",
        description=lambda cfg: f"Fixed: this DAG post-trains {cfg.model} (one DAG per model and recipe).",
    ),
    FormField(
        "accelerator_type",
        type="string",
        schema={"enum": _accelerators},
        title="Accelerator",
        description=lambda cfg: (
            f"The local slice standing for {cfg.accelerator_type} (the only choice here)."
            if cfg.local and cfg.is_slice
            else "The local CPU 'VM' (the only choice here)."
            if cfg.local
            else "A multi-host slice: v6e-16 … v6e-256, VMs of 4 chips (ct6e-standard-4t) made together."
            if cfg.is_slice
            else "One TPU VM: v6e-1, v6e-4 or v6e-8 (8 chips); the machine type is derived from it "
            "(v6e-8 → ct6e-standard-8t). Multi-host slices (v6e-16 and up) have DAGs of their own (__slice)."
        ),
    ),
    FormField(
        "zones",
        default=lambda cfg: list(cfg.zones),
        type="array",
        schema={
            "minItems": 1,
            "items": {
                "type": "string",
                "pattern": ZONE_PATTERN,
                "description_md": "A zone such as us-east5-b.",
            },
        },
        title="Zones (in order)",
        description="One Compute Engine zone per line, e.g. us-east5-b; at least one. Tried in order: a "
        "stock-out moves on to the next.",
    ),
    FormField(
        "provisioning_model",
        type="string",
        schema={"enum": list(compute.PROVISIONING_MODELS)},
        title="Provisioning model",
        description="RESERVATION_BOUND needs a Reservation; STANDARD is on-demand; SPOT can be preempted; "
        "FLEX_START waits up to 2 h for capacity.",
    ),
    FormField(
        "reservation",
        type=["null", "string"],
        schema={"pattern": _anchored(f"({validation.RESERVATIONS_RE})")},
        title="Reservation",
        description="The specific reservation to consume (RESERVATION_BOUND: a calendar-mode or AI "
        "Hypercomputer one; STANDARD: any), e.g. my-v6e-reservation, projects/P/reservations/R or "
        "projects/P/reservations/R/reservationBlocks/B. A reservation is zonal: with several zones, one per "
        "zone, e.g. us-east5-a=res-a,us-east5-b=res-b. Empty: none.",
    ),
    FormField(
        "max_wait_for_capacity",
        default=lambda cfg: cfg.max_wait_for_capacity_minutes,
        type="integer",
        schema={"minimum": 0, "maximum": lambda cfg: cfg.max_wait_for_capacity_minutes},
        title="Max wait for TPU capacity (minutes)",
        description=lambda cfg: (
            "How long the run may wait, holding no VM, for a fully used reservation (or FLEX_START's queue); "
            f"e.g. 30. 0 to {cfg.max_wait_for_capacity_minutes}; then the run fails having created nothing. Its "
            f"wait in line under the cap of {cfg.tpu_cap_chips or 'no'} TPU chips of its reservation or zone is "
            "not bounded by it: the line moves as the runs ahead end."
        ),
    ),
    FormField(
        "max_recoveries",
        default=3,
        type="integer",
        schema={"minimum": 0, "maximum": 10},
        title="Max recoveries",
        description=lambda cfg: (
            "How many times training may create its TPU VM again after losing it (a SPOT or FLEX_START "
            "preemption, a host error) and resume from its newest checkpoint in storage, e.g. 3. 0 to 10; "
            "0: a lost VM fails the task."
            + (
                ""
                if cfg.layout == "split"
                else " The seeds' layout keeps its checkpoints on the VM: it cannot."
            )
        ),
    ),
    FormField(
        "maxtext_version",
        type=["null", "string"],
        schema={"pattern": _anchored(validation.VERSION_RE), "examples": ["0.2.2", "0.2.3"]},
        title="MaxText version",
        description="An exact MaxText release X.Y.Z, e.g. 0.2.3. Empty: the model's (the tutorials: 0.2.2 "
        "for SFT, 0.2.3 for RL).",
    ),
    FormField(
        "hub_repo_id",
        type=["null", "string"],
        schema={"pattern": _anchored(validation.SAFE_NAME_RE, "/", validation.SAFE_NAME_RE)},
        title="Hub repo",
        description="Hugging Face repo owner/name, e.g. my-org/gemma3-4b-sft; the model goes to branch "
        "run-<run name> (private). Empty: no upload (then set a Storage URI).",
    ),
    # On Google Cloud the VM that writes the copy is deleted afterwards: a directory there keeps nothing.
    FormField(
        "storage_uri",
        type=["null", "string"],
        schema={
            "pattern": lambda cfg: (
                r"^(?!.*\.\.)(gs://[a-z0-9][a-z0-9._-]+"
                + (r"|file:///?|/" if cfg.local else "")
                + r")[A-Za-z0-9._/=-]*"
                + END
            )
        },
        title="Storage URI",
        description=lambda cfg: (
            "Where to copy the model too, one folder per run: gs://bucket/prefix (e.g. "
            "gs://my-bucket/models)"
            + (" or an absolute directory shared with the local VMs" if cfg.local else "")
            + ". Empty: no copy."
        ),
    ),
    FormField(
        "force",
        default=False,
        type="boolean",
        title="Train even if nothing changed",
        description="A run whose base model and dataset revisions, MaxText version and settings are those of "
        "the last model this DAG published, or of a model another run published or is training, trains nothing "
        "(it reuses that model) and creates no VM; tick to train anyway.",
    ),
    FormField(
        "inputs_as_of",
        type="string",
        schema={"enum": list(INPUTS_AS_OF)},
        title="Inputs as of",
        description="run_date: the base model's and the dataset's revisions on the Hub at the run's logical date "
        "(a backfill date trains what the Hub held that day; a re-run trains what its first try did); latest: "
        "their revisions now.",
    ),
    FormField(
        "quality_gate",
        type="string",
        schema={"enum": list(gate.RULES)},
        title="Quality gate",
        description="Publish only a model at least as good as its base on held-out data: no_regression; "
        "off publishes anyway; min_improvement asks for the improvement below. The numbers: SFT eval loss "
        "(MaxText evaluates before the first step and after the last), GRPO test accuracy.",
    ),
    FormField(
        "min_improvement_pct",
        type="number",
        schema={"minimum": 0, "maximum": 100},
        title="Minimum improvement",
        description="For min_improvement: SFT, how many percent lower the eval loss must be; GRPO, how many "
        "points higher the accuracy must be; e.g. 1. 0 to 100.",
    ),
    FormField(
        "overrides",
        default=lambda cfg: list(cfg.overrides),
        type=["null", "array"],
        schema={
            "items": {
                "type": "string",
                "pattern": OVERRIDE_PATTERN,
                "description_md": "key=value, e.g. learning_rate=1e-5.",
            }
        },
        title="MaxText overrides",
        description="Extra trainer settings, one key=value per line, e.g. learning_rate=1e-5 (a nested key as "
        "MaxText writes it: rl.num_generations=4); keys the "
        "pipeline sets (steps, run_name, ...) are refused, and keys the run's MaxText release does not define are "
        "refused before any VM. Empty: none.",
    ),
    FormField(
        "dataset",
        recipe="sft",
        type=["null", "string"],
        schema={
            "pattern": _anchored(validation.SAFE_NAME_RE, f"/{validation.SAFE_NAME_RE}", empty_ok=True),
            "examples": ["HuggingFaceH4/ultrachat_200k"],
        },
        title="Dataset",
        description="Hugging Face dataset id owner/name, e.g. HuggingFaceH4/ultrachat_200k. Empty: the "
        "model's (the tutorial's UltraChat 200k).",
    ),
    FormField(
        "train_split",
        recipe="sft",
        type=["null", "string"],
        schema={"pattern": _anchored(validation.SAFE_NAME_RE, empty_ok=True)},
        title="Split",
        description="The dataset split to train on: letters, digits, '.', '_', '-', e.g. train_sft. "
        "Empty: the model's.",
    ),
    FormField(
        "eval_split",
        recipe="sft",
        type=["null", "string"],
        schema={"pattern": _anchored(validation.SAFE_NAME_RE, empty_ok=True)},
        title="Held-out split",
        description="The dataset split the quality gate's evaluation reads (not trained on), e.g. "
        "test_sft. Empty: the model's (UltraChat's test_sft; with another dataset, test_sft too). A "
        "dataset without one: set the quality gate off.",
    ),
    FormField(
        "train_data_columns",
        recipe="sft",
        type=["null", "string"],
        schema={"pattern": _anchored(validation.COLUMN_LIST_RE, empty_ok=True), "examples": ["['messages']"]},
        title="Columns",
        description="The columns holding the conversations, as a list: ['messages']. Empty: the model's.",
    ),
    FormField(
        "steps",
        recipe="sft",
        type=["null", "integer"],
        schema={"minimum": 1, "maximum": 1_000_000},
        title="Steps",
        description="Training steps, a whole number from 1 to 1000000, e.g. 1000. Empty: the model's "
        "(the tutorial: 1000).",
    ),
    FormField(
        "lora_rank",
        only_with_lora=True,
        default=lambda cfg: cfg.lora.rank,
        type="integer",
        schema={"minimum": 1, "maximum": 4096},
        title="LoRA rank",
        description="The adapters' rank, a whole number from 1 to 4096, e.g. 16 (MaxText's lora.lora_rank).",
    ),
    FormField(
        "lora_alpha",
        only_with_lora=True,
        default=lambda cfg: cfg.lora.alpha,
        type="number",
        schema={"exclusiveMinimum": 0},
        title="LoRA alpha",
        description="The adapters' scale (their update is multiplied by alpha / rank), a positive number, e.g. 32.",
    ),
    FormField(
        "lora_target_modules",
        only_with_lora=True,
        default=lambda cfg: cfg.lora.target_modules,
        type=["null", "string"],
        schema={
            "pattern": _anchored(lora.MODULE_PATH_RE, empty_ok=True),
            "examples": ["decoder/.*self_attention/(query|value)"],
        },
        title="LoRA modules",
        description="A regex over MaxText's module paths picking the layers that get adapters (lora.lora_module_path), "
        "e.g. decoder/.*self_attention/(query|value). Empty: MaxText's default for the model (Gemma 3: every "
        "attention and MLP projection).",
    ),
    FormField(
        "lora_weight_qtype",
        only_with_lora=True,
        default=lambda cfg: cfg.lora.weight_qtype,
        type=["null", "string"],
        schema={"enum": [None, *lora.WEIGHT_QTYPES]},
        title="QLoRA weights",
        description="QLoRA: the frozen base's weights quantized to nf4 or int8 while the adapters train. Empty: the "
        "base as it is (LoRA).",
    ),
    FormField(
        "num_batches",
        recipe="rl",
        type=["null", "integer"],
        schema={"minimum": 1, "maximum": 100_000},
        title="Batches",
        description="GRPO training batches, a whole number from 1 to 100000, e.g. 50. Empty: the "
        "model's (the tutorial: 50).",
    ),
    FormField(
        "num_test_batches",
        recipe="rl",
        type=["null", "integer"],
        schema={"minimum": 1, "maximum": 10_000},
        title="Test batches",
        description="Batches of the evaluation before and after training, 1 to 10000, e.g. 10. Empty: "
        "the model's (the tutorial: 10).",
    ),
)


def trigger_form(cfg: PipelineConfig) -> dict[str, Param]:
    """The trigger form: every field can be left as it opens and triggered.

    Optional values are nullable (empty: the model's default); each says what it expects, with an example,
    under the field and in a refusal."""
    return {
        form_field.name: _param(form_field, cfg)
        for form_field in FORM
        if form_field.recipe in (None, cfg.recipe)
        and (cfg.lora is not None or not form_field.only_with_lora)
    }


def _param(form_field: FormField, cfg: PipelineConfig) -> Param:
    """The field's Param in ``cfg``'s form."""

    def for_entry(value: Any) -> Any:
        return value(cfg) if callable(value) else value

    default = (
        getattr(cfg, form_field.name) if form_field.default is FROM_ENTRY else for_entry(form_field.default)
    )
    param = Param(
        default,
        type=form_field.type,
        **{keyword: for_entry(value) for keyword, value in form_field.schema.items()},
        title=form_field.title,
        description=for_entry(form_field.description),
    )
    # A refused value's message quotes the Param's schema, not its description: the description goes into the
    # schema too (as Airflow's description_md), so the refusal says what is expected, with an example.
    param.schema["description_md"] = param.description
    return param
