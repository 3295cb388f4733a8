"""The trigger form of a post-training DAG: its Params, each validated as the operators validate it."""

from __future__ import annotations

from airflow.sdk import Param

from airflow_tpu_posttrain.pipelines.registry import PipelineConfig
from airflow_tpu_posttrain.recipes import compute, validation
from airflow_tpu_posttrain.recipes import quality_gate as gate
from airflow_tpu_posttrain.recipes.accelerators import TPU_ACCELERATORS

# Param patterns are checked with re.search (and by the UI in JavaScript), where "$" also matches before a final
# newline: END matches only at the very end, in both. The bodies are the operators' own validation's.
END = r"(?![\s\S])"


def _anchored(*parts: str, empty_ok: bool = False) -> str:
    pattern = "^" + "".join(parts) + END
    return f"^{END}|{pattern}" if empty_ok else pattern


ZONE_PATTERN = _anchored(validation.ZONE_RE)
OVERRIDE_PATTERN = _anchored(validation.OVERRIDE_KEY_RE, "=", validation.OVERRIDE_VALUE_RE)

def trigger_form(cfg: PipelineConfig) -> dict[str, Param]:
    """The trigger form: every field can be left as it opens and triggered.

    Optional values are nullable (empty: the model's default); each says what it expects, with an example,
    under the field and in a refusal."""
    accelerators = ["cpu"] if cfg.local else list(TPU_ACCELERATORS)
    accelerator_help = (
        "The local CPU 'VM' (the only choice here)."
        if cfg.local
        else "TPU slice, e.g. v6e-8 (8 chips); the machine type is derived from it (v6e-8 → ct6e-standard-8t)."
    )
    params: dict[str, Param] = {
        "model": Param(
            cfg.model,
            type="string",
            enum=[cfg.model],
            title="Model",
            description=f"Fixed: this DAG post-trains {cfg.model} (one DAG per model and recipe).",
        ),
        "accelerator_type": Param(
            cfg.accelerator_type,
            type="string",
            enum=accelerators,
            title="Accelerator",
            description=accelerator_help,
        ),
        "zones": Param(
            list(cfg.zones),
            type="array",
            minItems=1,
            items={"type": "string", "pattern": ZONE_PATTERN, "description_md": "A zone such as us-east5-b."},
            title="Zones (in order)",
            description="One Compute Engine zone per line, e.g. us-east5-b; at least one. Tried in order: a "
            "stock-out moves on to the next.",
        ),
        "provisioning_model": Param(
            cfg.provisioning_model,
            type="string",
            enum=list(compute.PROVISIONING_MODELS),
            title="Provisioning model",
            description="RESERVATION_BOUND needs a Reservation; STANDARD is on-demand; SPOT can be preempted; "
            "FLEX_START waits up to 2 h for capacity.",
        ),
        "reservation": Param(
            cfg.reservation,
            type=["null", "string"],
            pattern=_anchored(f"({validation.RESERVATIONS_RE})"),
            title="Reservation",
            description="The specific reservation to consume (RESERVATION_BOUND: a calendar-mode or AI "
            "Hypercomputer one; STANDARD: any), e.g. my-v6e-reservation, projects/P/reservations/R or "
            "projects/P/reservations/R/reservationBlocks/B. A reservation is zonal: with several zones, one per "
            "zone, e.g. us-east5-a=res-a,us-east5-b=res-b. Empty: none.",
        ),
        "max_wait_for_capacity": Param(
            cfg.max_wait_for_capacity_minutes,
            type="integer",
            minimum=0,
            maximum=cfg.max_wait_for_capacity_minutes,
            title="Max wait for TPU capacity (minutes)",
            description=f"How long the run may wait, holding no VM, for a place under the cap of "
            f"{cfg.max_tpu_vms or 'no'} TPU VM(s) of its reservation or zones, or in a fully used reservation; "
            f"e.g. 30. 0 to {cfg.max_wait_for_capacity_minutes}; then the run fails having created nothing.",
        ),
        "max_recoveries": Param(
            3,
            type="integer",
            minimum=0,
            maximum=10,
            title="Max recoveries",
            description="How many times training may create its TPU VM again after losing it (a SPOT or "
            "FLEX_START preemption, a host error) and resume from its newest checkpoint in storage, e.g. 3. 0 to "
            "10; 0: a lost VM fails the task."
            + (
                ""
                if cfg.layout == "split"
                else " The seeds' layout keeps its checkpoints on the VM: it cannot."
            ),
        ),
        "maxtext_version": Param(
            cfg.maxtext_version,
            type=["null", "string"],
            pattern=_anchored(validation.VERSION_RE),
            examples=["0.2.2", "0.2.3"],
            title="MaxText version",
            description="An exact MaxText release X.Y.Z, e.g. 0.2.3. Empty: the model's (the tutorials: 0.2.2 "
            "for SFT, 0.2.3 for RL).",
        ),
        "hub_repo_id": Param(
            cfg.hub_repo_id,
            type=["null", "string"],
            pattern=_anchored(validation.SAFE_NAME_RE, "/", validation.SAFE_NAME_RE),
            title="Hub repo",
            description="Hugging Face repo owner/name, e.g. my-org/gemma3-4b-sft; the model goes to branch "
            "run-<run name> (private). Empty: no upload (then set a Storage URI).",
        ),
        # On Google Cloud the VM that writes the copy is deleted afterwards: a directory there keeps nothing.
        "storage_uri": Param(
            cfg.storage_uri,
            type=["null", "string"],
            pattern=r"^(?!.*\.\.)(gs://[a-z0-9][a-z0-9._-]+"
            + (r"|file:///?|/" if cfg.local else "")
            + r")[A-Za-z0-9._/=-]*"
            + END,
            title="Storage URI",
            description="Where to copy the model too, one folder per run: gs://bucket/prefix (e.g. "
            "gs://my-bucket/models)"
            + (" or an absolute directory shared with the local VMs" if cfg.local else "")
            + ". Empty: no copy.",
        ),
        "force": Param(
            False,
            type="boolean",
            title="Train even if nothing changed",
            description="A run whose base model and dataset revisions, MaxText version and settings are those of "
            "the last model this DAG published is skipped before any VM is created; tick to train anyway.",
        ),
        "quality_gate": Param(
            cfg.quality_gate,
            type="string",
            enum=list(gate.RULES),
            title="Quality gate",
            description="Publish only a model at least as good as its base on held-out data: no_regression; "
            "off publishes anyway; min_improvement asks for the improvement below. The numbers: SFT eval loss "
            "(MaxText evaluates before the first step and after the last), GRPO test accuracy.",
        ),
        "min_improvement_pct": Param(
            cfg.min_improvement_pct,
            type="number",
            minimum=0,
            maximum=100,
            title="Minimum improvement",
            description="For min_improvement: SFT, how many percent lower the eval loss must be; GRPO, how many "
            "points higher the accuracy must be; e.g. 1. 0 to 100.",
        ),
        "overrides": Param(
            list(cfg.overrides),
            type=["null", "array"],
            items={
                "type": "string",
                "pattern": OVERRIDE_PATTERN,
                "description_md": "key=value, e.g. learning_rate=1e-5.",
            },
            title="MaxText overrides",
            description="Extra trainer settings, one key=value per line, e.g. learning_rate=1e-5; keys the "
            "pipeline sets (steps, run_name, ...) are refused. Empty: none.",
        ),
    }
    if cfg.recipe == "sft":
        params |= {
            "dataset": Param(
                cfg.dataset,
                type=["null", "string"],
                pattern=_anchored(validation.SAFE_NAME_RE, f"(/{validation.SAFE_NAME_RE})?", empty_ok=True),
                examples=["HuggingFaceH4/ultrachat_200k"],
                title="Dataset",
                description="Hugging Face dataset id owner/name, e.g. HuggingFaceH4/ultrachat_200k. Empty: the "
                "model's (the tutorial's UltraChat 200k).",
            ),
            "train_split": Param(
                cfg.train_split,
                type=["null", "string"],
                pattern=_anchored(validation.SAFE_NAME_RE, empty_ok=True),
                title="Split",
                description="The dataset split to train on: letters, digits, '.', '_', '-', e.g. train_sft. "
                "Empty: the model's.",
            ),
            "eval_split": Param(
                cfg.eval_split,
                type=["null", "string"],
                pattern=_anchored(validation.SAFE_NAME_RE, empty_ok=True),
                title="Held-out split",
                description="The dataset split the quality gate's evaluation reads (not trained on), e.g. "
                "test_sft. Empty: the model's (UltraChat's test_sft; with another dataset, test_sft too). A "
                "dataset without one: set the quality gate off.",
            ),
            "train_data_columns": Param(
                cfg.train_data_columns,
                type=["null", "string"],
                pattern=_anchored(validation.COLUMN_LIST_RE, empty_ok=True),
                examples=["['messages']"],
                title="Columns",
                description="The columns holding the conversations, as a list: ['messages']. Empty: the model's.",
            ),
            "steps": Param(
                cfg.steps,
                type=["null", "integer"],
                minimum=1,
                maximum=1_000_000,
                title="Steps",
                description="Training steps, a whole number from 1 to 1000000, e.g. 1000. Empty: the model's "
                "(the tutorial: 1000).",
            ),
        }
    else:
        params |= {
            "num_batches": Param(
                cfg.num_batches,
                type=["null", "integer"],
                minimum=1,
                maximum=100_000,
                title="Batches",
                description="GRPO training batches, a whole number from 1 to 100000, e.g. 50. Empty: the "
                "model's (the tutorial: 50).",
            ),
            "num_test_batches": Param(
                cfg.num_test_batches,
                type=["null", "integer"],
                minimum=1,
                maximum=10_000,
                title="Test batches",
                description="Batches of the evaluation before and after training, 1 to 10000, e.g. 10. Empty: "
                "the model's (the tutorial: 10).",
            ),
        }
    # A refused value's message quotes the Param's schema, not its description: the description goes into the
    # schema too (as Airflow's description_md), so the refusal says what is expected, with an example.
    for param in params.values():
        param.schema["description_md"] = param.description
    return params
