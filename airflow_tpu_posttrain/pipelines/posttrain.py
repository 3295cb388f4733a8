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

from airflow.sdk import DAG, BaseOperator, TriggerRule

from airflow_tpu_posttrain.exceptions import StepFailedError
from airflow_tpu_posttrain.operators.export import HfExportOperator
from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator
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
from airflow_tpu_posttrain.pipelines.params import trigger_form
from airflow_tpu_posttrain.pipelines.registry import START_DATE, PipelineConfig
from airflow_tpu_posttrain.recipes import compute

POOL = "tpu_vms"


class FailRunOperator(BaseOperator):
    """The watcher: teardowns do not count toward a run's state, so this fails the run when a step failed."""

    ui_color = "#f7d5d5"

    def execute(self, context: Any) -> None:
        raise StepFailedError(
            "A post-training step failed (see the failed task's log); the VM is deleted by the teardown."
        )


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


MAX_RETRY_DELAY = timedelta(minutes=20)


def build_dag(cfg: PipelineConfig) -> DAG:
    t = cfg.timeouts
    wait_for_capacity = timedelta(minutes=cfg.max_wait_for_capacity_minutes)
    split = cfg.layout == "split"
    train_title = "SFT" if cfg.recipe == "sft" else "GRPO"
    default_args = {
        "retries": cfg.retries,
        "retry_delay": timedelta(seconds=cfg.retry_delay_s),
        "retry_exponential_backoff": True,
        "max_retry_delay": MAX_RETRY_DELAY,
        # Later steps first. A deferred training that resumes needs a tpu_vms slot again; by the default rule
        # ("downstream") another run's install outranks it, and its VM idled for that run's whole training
        # (tests/test_deployment.py).
        "weight_rule": "upstream",
    }
    dag = DAG(
        dag_id=cfg.dag_id,
        schedule=input_assets(cfg) if cfg.schedule == ON_CHANGE else cfg.schedule,
        start_date=None if cfg.schedule is None else START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args=default_args,
        params=trigger_form(cfg),
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
        "max_run_duration": t.vm_lifetime(cfg.retries, MAX_RETRY_DELAY) + wait_for_capacity + timedelta(minutes=30),
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

    if cfg.recipe == "sft":
        settings = ("steps", "dataset", "train_split", "eval_split", "train_data_columns", "overrides")
    else:
        settings = ("num_batches", "num_test_batches", "overrides")
    with dag:
        check = InputsCheckOperator(
            task_id="check_inputs",
            model="{{ params.model }}",
            recipe=cfg.recipe,
            dataset="{{ params.dataset }}" if cfg.recipe == "sft" else None,
            maxtext_version="{{ params.maxtext_version }}",
            settings={
                name: f"{{{{ params.{name} }}}}"
                for name in ("accelerator_type", *settings, "hub_repo_id", "storage_uri")
            },
            hf_conn_id=cfg.hf_conn_id,
            hub_repo_id="{{ params.hub_repo_id }}",
            force="{{ params.force }}",
            execution_timeout=timedelta(minutes=5),
        )
        create_tpu = TpuVmCreateOperator(
            task_id="create_tpu_vm",
            accelerator_type="{{ params.accelerator_type }}",
            provisioning_model="{{ params.provisioning_model }}",
            reservation="{{ params.reservation }}",
            # Caps the VMs themselves; the pool caps the TPU VM's steps (a waiting create holds no VM or slot).
            max_tpu_vms=cfg.max_tpu_vms,
            prices=cfg.prices,
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
                stall_timeout_s=cfg.stall_timeout_s,
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
                stall_timeout_s=cfg.stall_timeout_s,
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
            inputs=check.output,
            prices=cfg.prices,
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
        # Each VM's setups are its create and its install: clearing a step (a re-run of train or of the export)
        # clears the setups in its scope, so the fresh VMs get MaxText too. A setup is followed by all_success
        # tasks only: a failed install reaches the watcher as its steps' upstream_failed. A teardown runs unless
        # its run was skipped (nothing changed, no VM made), a failed create included: it may have inserted its VM.
        teardown = {"on_failure_fail_dagrun": True}
        check >> create_tpu
        if not split:
            create_tpu >> install_tpu >> convert >> train >> judge >> export
            export >> delete_tpu.as_teardown(setups=[create_tpu, install_tpu], **teardown)
            delete_tpu.trigger_rule = TriggerRule.NONE_SKIPPED
            [convert, train, judge, export] >> watcher
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
        check >> create_cpu >> install_cpu >> convert >> train
        create_tpu >> install_tpu >> train
        train >> delete_tpu.as_teardown(setups=[create_tpu, install_tpu], **teardown)
        train >> judge >> export >> delete_cpu.as_teardown(setups=[create_cpu, install_cpu], **teardown)
        delete_tpu.trigger_rule = delete_cpu.trigger_rule = TriggerRule.NONE_SKIPPED
        [convert, train, judge, export] >> watcher
    return dag
