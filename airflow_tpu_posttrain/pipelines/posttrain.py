"""The DAG factory: one post-training DAG per (recipe, model) entry of the model registry.

Shape (split layout, the default): a CPU VM converts (cached) and later exports while the TPU VM is created,
installed and trains; the TPU VM's teardown follows the training directly. Seeds' layout: create VM (setup) →
install → convert → train → export + publish → delete VM (teardown). Teardowns run whatever happened; a
watcher fails the run when a body step failed (teardowns do not count toward the run's state). Every value a user can change per run is a Param, validated by the trigger form and the REST API, and
again by the operators before anything is created.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, BaseOperator, Param, TriggerRule

from airflow_tpu_posttrain.exceptions import StepFailedError
from airflow_tpu_posttrain.operators.export import HfExportOperator
from airflow_tpu_posttrain.operators.maxtext import (
    GrpoTrainOperator,
    MaxTextConvertOperator,
    MaxTextInstallOperator,
    SftTrainOperator,
)
from airflow_tpu_posttrain.operators.quality_gate import QualityGateOperator
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator
from airflow_tpu_posttrain.pipelines.inputs import ON_CHANGE, input_assets
from airflow_tpu_posttrain.pipelines.registry import START_DATE, PipelineConfig
from airflow_tpu_posttrain.recipes import compute, validation
from airflow_tpu_posttrain.recipes import quality_gate as gate
from airflow_tpu_posttrain.recipes.accelerators import TPU_ACCELERATORS

RECIPES = ("sft", "rl")
# Param patterns are checked with re.search (and by the UI in JavaScript), where "$" also matches before a final
# newline: END matches only at the very end, in both. The bodies are the operators' own validation's.
END = r"(?![\s\S])"


def _anchored(*parts: str, empty_ok: bool = False) -> str:
    pattern = "^" + "".join(parts) + END
    return f"^{END}|{pattern}" if empty_ok else pattern


ZONE_PATTERN = _anchored(validation.ZONE_RE)
OVERRIDE_PATTERN = _anchored(validation.OVERRIDE_KEY_RE, "=", validation.OVERRIDE_VALUE_RE)
POOL = "tpu_vms"


class FailRunOperator(BaseOperator):
    """The watcher: teardowns do not count toward a run's state, so this fails the run when a step failed."""

    ui_color = "#f7d5d5"

    def execute(self, context: Any) -> None:
        raise StepFailedError(
            "A post-training step failed (see the failed task's log); the VM is deleted by the teardown."
        )


def _params(cfg: PipelineConfig) -> dict[str, Param]:
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


DOC = """
### Post-training: {recipe} of `{model}` on a TPU VM ({layout} layout)

{shape}

- Every VM is deleted by its teardown whatever happens (and, as a backstop, by Google at its `maxRunDuration`).
- Each step is idempotent: a retry or re-run reuses the VMs, the MaxText install, a finished conversion, and
  resumes training from its newest checkpoint (run name derived from the DAG run and its logical date).
- Long steps run as detached jobs on the VM, watched from the triggerer: no worker slot is held while waiting.
"""
SHAPES = {
    "split": (
        "CPU VM: create → install MaxText → convert HF → MaxText (cached in checkpoint storage) ... export to HF + "
        "publish → delete.  \nTPU VM, meanwhile: create → install MaxText → {train} (checkpoints to storage) → "
        "delete as soon as the final checkpoint is in storage."
    ),
    "seeds": "create VM → install MaxText → convert HF → MaxText → {train} → export to HF + publish → delete VM",
}


def build_dag(cfg: PipelineConfig) -> DAG:
    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe={cfg.recipe!r}: use one of {RECIPES}")
    t = cfg.timeouts
    wait_for_capacity = timedelta(minutes=cfg.max_wait_for_capacity_minutes)
    split = cfg.layout == "split"
    train_title = "SFT" if cfg.recipe == "sft" else "GRPO"
    default_args = {
        "retries": cfg.retries,
        "retry_delay": timedelta(seconds=cfg.retry_delay_s),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=20),
    }
    dag = DAG(
        dag_id=cfg.dag_id,
        schedule=input_assets(cfg) if cfg.schedule == ON_CHANGE else cfg.schedule,
        start_date=None if cfg.schedule is None else START_DATE,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=t.run + wait_for_capacity,
        default_args=default_args,
        params=_params(cfg),
        render_template_as_native_obj=True,
        tags=["tpu", "maxtext", cfg.recipe, cfg.model, *cfg.tags],
        doc_md=DOC.format(
            recipe=cfg.recipe.upper(),
            model=cfg.model,
            layout=cfg.layout,
            shape=SHAPES[cfg.layout].format(train=train_title),
        ),
    )
    storage = cfg.checkpoint_storage if split else None

    def poll(seconds: int) -> int:
        return cfg.poll_interval_s or seconds

    on_vm = {
        "ssh_conn_id": cfg.ssh_conn_id,
        "hf_conn_id": cfg.hf_conn_id,
        "model": "{{ params.model }}",
        "checkpoint_storage": storage,
        "stall_timeout_s": cfg.stall_timeout_s,
        **(cfg.local or {}),
    }
    on_compute = {
        "project_id": cfg.project_id,
        "gcp_conn_id": cfg.gcp_conn_id,
        "poll_interval": poll(10),
        "zones": "{{ params.zones }}",
    }
    creating = {
        **on_compute,
        "network": cfg.network,
        "subnetwork": cfg.subnetwork,
        "network_path": cfg.network_path,
        "ssh_source_ranges": cfg.ssh_source_ranges,
        "ssh_conn_id": cfg.ssh_conn_id,
        "ssh_key_mode": cfg.ssh_key_mode,
        "oslogin_user": cfg.oslogin_user,
        "service_account": cfg.service_account,
        "max_run_duration": t.run + wait_for_capacity + timedelta(minutes=30),
        "execution_timeout": t.create,
    }

    def delete_vm(kind: str) -> TpuDeleteOperator:
        """The teardown of ``create_<kind>_vm``; it retries at least 3 times and never waits for a pool slot."""
        return TpuDeleteOperator(
            task_id=f"delete_{kind}_vm",
            create_task_id=f"create_{kind}_vm",
            name_prefix=kind,
            firewall=bool(cfg.ssh_source_ranges),
            prices=cfg.prices,
            execution_timeout=t.delete,
            retries=max(cfg.retries, 3),
            **on_compute,
        )

    with dag:
        create_tpu = TpuVmCreateOperator(
            task_id="create_tpu_vm",
            accelerator_type="{{ params.accelerator_type }}",
            provisioning_model="{{ params.provisioning_model }}",
            reservation="{{ params.reservation }}",
            # Caps the VMs themselves; the pool caps the TPU VM's steps (a waiting create holds no VM or slot).
            max_tpu_vms=cfg.max_tpu_vms,
            max_wait_for_capacity="{{ params.max_wait_for_capacity * 60 }}",
            **{**creating, "execution_timeout": t.create + wait_for_capacity},
        )
        on_tpu = {**on_vm, "vm": create_tpu.output, "pool": POOL}
        on_cpu = on_tpu
        if split:  # the conversion and the export run on the CPU VM, outside the TPU pool
            create_cpu = TpuVmCreateOperator(
                task_id="create_cpu_vm",
                name_prefix="cpu",
                accelerator_type=cfg.cpu_accelerator_type,
                provisioning_model="STANDARD",
                image_project=compute.CPU_IMAGE_PROJECT,
                image_family=compute.CPU_IMAGE_FAMILY,
                **creating,
            )
            on_cpu = {**on_vm, "vm": create_cpu.output}
        install_tpu = MaxTextInstallOperator(
            task_id="install_maxtext",
            maxtext_version="{{ params.maxtext_version }}",
            execution_timeout=t.install,
            poll_interval=poll(15),
            **on_tpu,
        )
        convert = MaxTextConvertOperator(
            task_id="convert_to_maxtext",
            maxtext_version="{{ params.maxtext_version }}",
            execution_timeout=t.convert,
            poll_interval=poll(15),
            **on_cpu,
        )
        if cfg.recipe == "sft":
            train = SftTrainOperator(
                task_id="train",
                steps="{{ params.steps }}",
                dataset="{{ params.dataset }}",
                train_split="{{ params.train_split }}",
                eval_split="{{ params.eval_split }}",
                train_data_columns="{{ params.train_data_columns }}",
                overrides="{{ params.overrides }}",
                conversion=convert.output,
                checkpoint_period=cfg.checkpoint_period,
                evaluate="{{ params.quality_gate != 'off' }}",
                max_recoveries="{{ params.max_recoveries }}",
                execution_timeout=t.train,
                poll_interval=poll(30),
                **on_tpu,
            )
        else:
            train = GrpoTrainOperator(
                task_id="train",
                num_batches="{{ params.num_batches }}",
                num_test_batches="{{ params.num_test_batches }}",
                overrides="{{ params.overrides }}",
                conversion=convert.output,
                max_recoveries="{{ params.max_recoveries }}",
                execution_timeout=t.train,
                poll_interval=poll(30),
                **on_tpu,
            )
        judge = QualityGateOperator(
            task_id="quality_gate",
            trained=train.output,
            rule="{{ params.quality_gate }}",
            min_improvement_pct="{{ params.min_improvement_pct }}",
            execution_timeout=timedelta(minutes=5),
        )
        export = HfExportOperator(
            task_id="export_and_publish",
            trained=train.output,
            hub_repo_id="{{ params.hub_repo_id }}",
            storage_uri="{{ params.storage_uri }}",
            execution_timeout=t.export,
            poll_interval=poll(15),
            **on_cpu,
        )
        delete_tpu = delete_vm("tpu")
        watcher = FailRunOperator(
            task_id="fail_run_if_a_step_failed",
            trigger_rule=TriggerRule.ONE_FAILED,
            retries=0,
            execution_timeout=timedelta(minutes=5),
        )
        teardown = {"on_failure_fail_dagrun": True}
        if not split:
            create_tpu >> install_tpu >> convert >> train >> judge >> export
            export >> delete_tpu.as_teardown(setups=create_tpu, **teardown)
            [install_tpu, convert, train, judge, export] >> watcher
            return dag

        install_cpu = MaxTextInstallOperator(
            task_id="install_maxtext_cpu",
            maxtext_version="{{ params.maxtext_version }}",
            save_environment=True,  # the TPU VM only restores: its time is the expensive one
            execution_timeout=t.install,
            poll_interval=poll(15),
            **on_cpu,
        )
        delete_cpu = delete_vm("cpu")
        create_cpu >> install_cpu >> convert >> train
        create_tpu >> install_tpu >> train
        train >> delete_tpu.as_teardown(setups=create_tpu, **teardown)
        train >> judge >> export >> delete_cpu.as_teardown(setups=create_cpu, **teardown)
        [install_cpu, install_tpu, convert, train, judge, export] >> watcher
    return dag
