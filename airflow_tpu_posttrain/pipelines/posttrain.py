"""The DAG factory: one post-training DAG per (recipe, model) entry of the model registry.

Shape (split layout, the default): a CPU VM converts (cached in checkpoint storage) and is deleted at once, while
the TPU VM is created (just in time for the conversion's end), installed and trains; the TPU VM's teardown follows
the training directly, and a CPU VM of its own, made once the training passed the quality gate, exports. No VM
idles while the run waits in line for its TPU VM or while it trains. Seeds' layout: create VM (setup) →
install → convert → train → export + publish → delete VM (teardown). Teardowns run whatever happened; a
watcher fails the run when a body step failed (teardowns do not count toward the run's state). Every value a
user can change per run is a Param, validated by the trigger form and the REST API, and again by the operators
before anything is created.

A DAG is built from tables: ``STEPS`` (each task: its operator, its arguments, the VM it runs on), ``WIRING``
(what runs after what, per layout) and ``TEARDOWNS`` (each VM's delete and its setups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, BaseOperator, TriggerRule, chain

from airflow_tpu_posttrain.defaults import MAX_WAIT_IN_LINE_HOURS
from airflow_tpu_posttrain.exceptions import StepFailedError
from airflow_tpu_posttrain.operators.approval import PublishApprovalOperator
from airflow_tpu_posttrain.operators.export import HfExportOperator
from airflow_tpu_posttrain.operators.inputs_check import TRAINING_CLAIM_KEY, InputsCheckOperator
from airflow_tpu_posttrain.operators.maxtext import (
    GrpoTrainOperator,
    MaxTextConvertOperator,
    MaxTextInstallOperator,
    SftTrainOperator,
)
from airflow_tpu_posttrain.operators.quality_gate import QualityGateOperator
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_slice import TpuSliceCreateOperator, TpuSliceDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator
from airflow_tpu_posttrain.pipelines.inputs import ON_CHANGE, input_assets
from airflow_tpu_posttrain.pipelines.params import trigger_form
from airflow_tpu_posttrain.pipelines.registry import START_DATE, PipelineConfig
from airflow_tpu_posttrain.recipes import compute, lora

MAX_RETRY_DELAY = timedelta(minutes=20)
FIVE_MINUTES = timedelta(minutes=5)  # the timeout of the tasks that use no VM
WATCHER = "fail_run_if_a_step_failed"


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
        "CPU VM: create → install MaxText → convert HF → MaxText (cached in checkpoint storage) → delete.  \n"
        "TPU VM, meanwhile (requested as the conversion nears its end, at once when it is cached): "
        "create → install MaxText → {train} (checkpoints to storage) → "
        "delete as soon as the final checkpoint is in storage.  \n"
        "Export VM (a CPU VM), once the training passed the quality gate: create → restore MaxText → "
        "export to HF + publish → delete."
    ),
    "seeds": "create VM → install MaxText → convert HF → MaxText → {train} → export to HF + publish → delete VM",
}


@dataclass(frozen=True)
class Output:
    """An argument that is an earlier task's result (its XComArg): Airflow runs that task first."""

    task_id: str
    key: str | None = None  # an XCom of that task other than its return value


@dataclass(frozen=True)
class Step:
    """One task of the DAG: its operator and the operator's arguments for a registry entry.

    ``vm``: the VM the step runs on ("tpu", or a CPU VM: "cpu" the conversion's, "export" the export's, "pub" an
    approved publish's); the step gets that VM (its create's result) and the connections to it, and a step on the
    TPU VM a slot of the registry's ``tpu_pool``, if any. The seeds layout has no CPU VM: its steps all run on the
    TPU VM. ``layout``, ``recipe``: the step is only in that layout's or that recipe's DAGs.
    """

    task_id: str
    operator: type[BaseOperator]
    arguments: Callable[[PipelineConfig], dict[str, Any]]
    vm: str | None = None
    layout: str | None = None
    recipe: str | None = None
    slice: bool | None = None  # only in the DAGs of multi-host slices (True) or of one TPU VM (False)
    approval: bool | None = None  # only in the DAGs whose entry asks a person before publishing (True)


# The Params each recipe's training reads. The inputs check records them, with the accelerator and the
# destinations, as the settings a published model was trained with.
TRAINING_PARAMS = {
    "sft": ("steps", "dataset", "train_split", "eval_split", "train_data_columns", "overrides"),
    "rl": ("num_batches", "num_test_batches", "overrides"),
}


# Every task, in the order it is added to the DAG (the serialized DAG keeps that order: another is a new DAG
# version).
STEPS = (
    Step(
        "check_inputs",
        InputsCheckOperator,
        lambda cfg: {
            "model": "{{ params.model }}",
            "recipe": cfg.recipe,
            "dataset": "{{ params.dataset }}" if cfg.recipe == "sft" else None,
            "maxtext_version": "{{ params.maxtext_version }}",
            "settings": _params(
                ("accelerator_type", *TRAINING_PARAMS[cfg.recipe], *_lora_params(cfg), "hub_repo_id", "storage_uri")
            ),
            "lora": _lora(cfg),
            "hf_conn_id": cfg.hf_conn_id,
            "hub_repo_id": "{{ params.hub_repo_id }}",
            "force": "{{ params.force }}",
            "inputs_as_of": "{{ params.inputs_as_of }}",
            "poll_interval": _poll(cfg, 15),
            # The buckets and the reservation the run names, looked up before any VM.
            "gcp_conn_id": cfg.gcp_conn_id,
            "project_id": cfg.project_id,
            "zones": "{{ params.zones }}",
            "reservation": "{{ params.reservation }}",
            "accelerator_type": "{{ params.accelerator_type }}",
            "checkpoint_storage": cfg.checkpoint_storage,
            "storage_uri": "{{ params.storage_uri }}",
            # Following a run that trains the same inputs lasts as long as that run may.
            "execution_timeout": FIVE_MINUTES + _whole_run(cfg),
        },
    ),
    Step(
        "create_tpu_vm",
        TpuVmCreateOperator,
        lambda cfg: {
            "accelerator_type": "{{ params.accelerator_type }}",
            "provisioning_model": "{{ params.provisioning_model }}",
            "reservation": "{{ params.reservation }}",
            # Caps the VMs themselves; the pool caps the TPU VM's steps (a waiting create holds no VM or
            # slot).
            "max_tpu_chips": cfg.tpu_cap_chips,
            "capacity_claims": cfg.places_location,
            "max_wait_for_capacity": "{{ params.max_wait_for_capacity * 60 }}",
            **_creating_vm(cfg),
            **_just_in_time(cfg),
            "execution_timeout": cfg.timeouts.create + _place_wait(cfg) + _conversion_wait(cfg),
        },
        slice=False,
    ),
    # A multi-host slice's VMs, made together (requested at once: no just-in-time request); one place of the cap.
    Step(
        "create_tpu_vm",
        TpuSliceCreateOperator,
        lambda cfg: {
            "zone": "{{ params.zones[0] }}",
            "accelerator_type": "{{ params.accelerator_type }}",
            "provisioning_model": "{{ params.provisioning_model }}",
            "reservation": "{{ params.reservation }}",
            "max_tpu_chips": cfg.tpu_cap_chips,
            "capacity_claims": cfg.places_location,
            "max_wait_for_capacity": "{{ params.max_wait_for_capacity * 60 }}",
            **{key: value for key, value in _creating_vm(cfg).items() if key in SLICE_CREATE_ARGUMENTS},
            "execution_timeout": cfg.timeouts.create + _place_wait(cfg),
        },
        slice=True,
    ),
    # The split layout's CPU VM for the conversion, outside the TPU pool; deleted once the conversion is stored.
    Step("create_cpu_vm", TpuVmCreateOperator, lambda cfg: _creating_cpu_vm(cfg, "cpu"), layout="split"),
    Step(
        "install_maxtext",
        MaxTextInstallOperator,
        lambda cfg: {
            "maxtext_version": "{{ params.maxtext_version }}",
            "execution_timeout": cfg.timeouts.install,
            "poll_interval": _poll(cfg, 15),
        },
        vm="tpu",
    ),
    Step(
        "convert_to_maxtext",
        MaxTextConvertOperator,
        lambda cfg: {
            "maxtext_version": "{{ params.maxtext_version }}",
            "inputs": Output("check_inputs"),
            "execution_timeout": cfg.timeouts.convert,
            "poll_interval": _poll(cfg, 15),
        },
        vm="cpu",
    ),
    Step(
        "train",
        SftTrainOperator,
        lambda cfg: {
            **_params(TRAINING_PARAMS["sft"]),
            "lora": _lora(cfg),
            "conversion": Output("convert_to_maxtext"),
            "inputs": Output("check_inputs"),
            "checkpoint_period": cfg.checkpoint_period,
            "evaluate": "{{ params.quality_gate != 'off' }}",
            "max_recoveries": "{{ params.max_recoveries }}",
            "stall_timeout_s": cfg.stall_timeout_s,
            "execution_timeout": cfg.timeouts.train,
            "poll_interval": _poll(cfg, 30),
        },
        vm="tpu",
        recipe="sft",
    ),
    Step(
        "train",
        GrpoTrainOperator,
        lambda cfg: {
            **_params(TRAINING_PARAMS["rl"]),
            "conversion": Output("convert_to_maxtext"),
            "inputs": Output("check_inputs"),
            "max_recoveries": "{{ params.max_recoveries }}",
            "stall_timeout_s": cfg.stall_timeout_s,
            "execution_timeout": cfg.timeouts.train,
            "poll_interval": _poll(cfg, 30),
        },
        vm="tpu",
        recipe="rl",
    ),
    Step(
        "quality_gate",
        QualityGateOperator,
        lambda cfg: {
            "trained": Output("train"),
            "rule": "{{ params.quality_gate }}",
            "min_improvement_pct": "{{ params.min_improvement_pct }}",
            "training_claim": Output("check_inputs", TRAINING_CLAIM_KEY),
            "gcp_conn_id": cfg.gcp_conn_id,
            "execution_timeout": FIVE_MINUTES,
        },
    ),
    # The split layout's export VM (a CPU VM), made once the training passed the gate: none idles through the
    # TPU VM's wait in line or its training. It restores the environment the conversion's VM saved.
    Step("create_export_vm", TpuVmCreateOperator, lambda cfg: _creating_cpu_vm(cfg, "export"), layout="split"),
    Step(
        "install_maxtext_export",
        MaxTextInstallOperator,
        lambda cfg: {
            "maxtext_version": "{{ params.maxtext_version }}",
            "execution_timeout": cfg.timeouts.install,
            "poll_interval": _poll(cfg, 15),
        },
        vm="export",
        layout="split",
    ),
    # With approval: the export checked and kept in storage (published nowhere), then a person's answer.
    Step(
        "export_and_keep",
        HfExportOperator,
        lambda cfg: {
            "trained": Output("train"),
            "lora": _lora(cfg),
            "maxtext_version": "{{ params.maxtext_version }}",
            "publish": False,
            "prices": cfg.prices,
            "execution_timeout": cfg.timeouts.export,
            "poll_interval": _poll(cfg, 15),
        },
        vm="export",
        approval=True,
    ),
    Step(
        "approve_publish",
        PublishApprovalOperator,
        lambda cfg: {
            "approvers": cfg.approvers,
            "notify": cfg.approval_notify,
            "verdict": Output("quality_gate"),
            "export": Output("export_and_keep"),
            "on_reject": cfg.approval_on_reject,
            "response_timeout": _approval_wait(cfg),
            "training_claim": Output("check_inputs", TRAINING_CLAIM_KEY),
            "gcp_conn_id": cfg.gcp_conn_id,
        },
        approval=True,
    ),
    Step("export_and_publish", HfExportOperator, lambda cfg: _publishing(cfg), vm="export", approval=False),
    # Once approved, a CPU VM of its own publishes the kept export: none is held while a person decides.
    Step("create_pub_vm", TpuVmCreateOperator, lambda cfg: _creating_cpu_vm(cfg, "pub"), approval=True),
    Step(
        "install_maxtext_pub",
        MaxTextInstallOperator,
        lambda cfg: {
            "maxtext_version": "{{ params.maxtext_version }}",
            "execution_timeout": cfg.timeouts.install,
            "poll_interval": _poll(cfg, 15),
        },
        vm="pub",
        approval=True,
    ),
    Step("export_and_publish", HfExportOperator, lambda cfg: _publishing(cfg), vm="pub", approval=True),
    Step("delete_tpu_vm", TpuDeleteOperator, lambda cfg: _deleting_vm(cfg, "tpu"), slice=False),
    Step(
        "delete_tpu_vm",
        TpuSliceDeleteOperator,
        lambda cfg: {
            "zone": "{{ params.zones[0] }}",
            **{key: value for key, value in _deleting_vm(cfg, "tpu").items() if key not in ("zones", "firewall")},
        },
        slice=True,
    ),
    Step(
        WATCHER,
        FailRunOperator,
        lambda cfg: {"trigger_rule": TriggerRule.ONE_FAILED, "retries": 0, "execution_timeout": FIVE_MINUTES},
    ),
    Step(
        "install_maxtext_cpu",
        MaxTextInstallOperator,
        lambda cfg: {
            "maxtext_version": "{{ params.maxtext_version }}",
            "save_environment": True,  # the TPU VM only restores: its time is the expensive one
            "execution_timeout": cfg.timeouts.install,
            "poll_interval": _poll(cfg, 15),
        },
        vm="cpu",
        layout="split",
    ),
    Step("delete_cpu_vm", TpuDeleteOperator, lambda cfg: _deleting_vm(cfg, "cpu"), layout="split"),
    Step("delete_pub_vm", TpuDeleteOperator, lambda cfg: _deleting_vm(cfg, "pub"), approval=True),
    Step("delete_export_vm", TpuDeleteOperator, lambda cfg: _deleting_vm(cfg, "export"), layout="split"),
)

# The steps whose failure fails the run, through the watcher (those of its DAG).
BODY = ("convert_to_maxtext", "train", "quality_gate", "export_and_keep", "approve_publish", "export_and_publish")

# What runs after what, per layout: each line a chain, left to right (a tuple in it: tasks side by side). An
# Output argument runs its task first too.
WIRING = {
    "split": (
        ("check_inputs", "create_tpu_vm", "install_maxtext", "train", "delete_tpu_vm"),
        ("check_inputs", "create_cpu_vm", "install_maxtext_cpu", "convert_to_maxtext", "train"),
        # The conversion is in checkpoint storage: its VM goes at once, before the TPU VM's wait and training.
        ("convert_to_maxtext", "delete_cpu_vm"),
        ("train", "quality_gate", "create_export_vm", "install_maxtext_export"),
        ("body", WATCHER),
    ),
    "seeds": (
        (
            "check_inputs",
            "create_tpu_vm",
            "install_maxtext",
            "convert_to_maxtext",
            "train",
            "quality_gate",
            "export_and_publish",
            "delete_tpu_vm",
        ),
        ("body", WATCHER),
    ),
}
# The split layout's export VM exports, then goes: the model published, or kept for a person's answer.
EXPORT_VM = {
    False: (("install_maxtext_export", "export_and_publish", "delete_export_vm"),),
    True: (("install_maxtext_export", "export_and_keep", "delete_export_vm"),),
}
# With approval (split layout only): the export kept, then the answer, asked once every VM of the run is gone;
# once approved, the publish VM publishes the kept export.
APPROVAL_WIRING = (
    ("export_and_keep", "approve_publish", "create_pub_vm", "install_maxtext_pub", "export_and_publish",
     "delete_pub_vm"),
    (("delete_tpu_vm", "delete_cpu_vm", "delete_export_vm"), "approve_publish"),
)

# Each VM's teardown (its delete) and its setups (its create and its install): clearing a step (a re-run of
# train or of the export) clears the setups in its scope, so the fresh VMs get MaxText too (clearing the export
# re-creates the export VM only: the conversion's VM is out of its scope). A setup is
# followed by all_success tasks only: a failed install reaches the watcher as its steps' upstream_failed. A
# teardown runs unless its run was skipped (nothing changed, no VM made), a failed create included: it may
# have inserted its VM.
TEARDOWNS = {
    "delete_tpu_vm": ("create_tpu_vm", "install_maxtext"),
    "delete_cpu_vm": ("create_cpu_vm", "install_maxtext_cpu"),
    "delete_export_vm": ("create_export_vm", "install_maxtext_export"),
    "delete_pub_vm": ("create_pub_vm", "install_maxtext_pub"),
}


def build_dag(cfg: PipelineConfig) -> DAG:
    """The DAG of one registry entry: the ``STEPS`` of its layout and recipe, wired as its layout says."""
    with _dag(cfg) as dag:
        tasks: dict[str, BaseOperator] = {}
        for step in STEPS:
            if (
                step.layout in (None, cfg.layout)
                and step.recipe in (None, cfg.recipe)
                and step.slice in (None, cfg.is_slice)
                and step.approval in (None, cfg.approval)
            ):
                tasks[step.task_id] = _operator(step, cfg, tasks)
        _wire(tasks, cfg)
    return dag


def _dag(cfg: PipelineConfig) -> DAG:
    """The entry's DAG without its tasks: schedule, trigger form, every task's defaults, tags and doc."""
    return DAG(
        dag_id=cfg.dag_id,
        schedule=input_assets(cfg) if cfg.schedule == ON_CHANGE else cfg.schedule,
        start_date=None if cfg.schedule is None else START_DATE,
        catchup=False,
        max_active_runs=1,
        default_args={
            "retries": cfg.retries,
            "retry_delay": timedelta(seconds=cfg.retry_delay_s),
            "retry_exponential_backoff": True,
            "max_retry_delay": MAX_RETRY_DELAY,
            # Later steps first. A deferred training that resumes needs a tpu_pool slot again; by the default
            # rule ("downstream") another run's install outranks it, and its VM idled for that run's whole
            # training (tests/test_deployment.py).
            "weight_rule": "upstream",
        },
        params=trigger_form(cfg),
        render_template_as_native_obj=True,
        tags=["tpu", "maxtext", cfg.recipe, cfg.model, *cfg.tags],
        doc_md=DOC.format(
            recipe=cfg.recipe.upper(),
            model=cfg.model,
            layout=cfg.layout,
            shape=SHAPES[cfg.layout].format(train="SFT" if cfg.recipe == "sft" else "GRPO"),
        ),
    )


def _operator(step: Step, cfg: PipelineConfig, tasks: dict[str, BaseOperator]) -> BaseOperator:
    """The step's task; an ``Output`` argument becomes the result of that task, made before it."""
    arguments = step.arguments(cfg)
    if step.vm:
        arguments |= _on_vm(cfg, step.vm)
    for name, value in arguments.items():
        if isinstance(value, Output):
            output = tasks[value.task_id].output
            arguments[name] = output[value.key] if value.key else output
    return step.operator(task_id=step.task_id, **arguments)


def _wire(tasks: dict[str, BaseOperator], cfg: PipelineConfig) -> None:
    """What runs after what (the layout's ``WIRING``), then each VM's teardown and setups (``TEARDOWNS``)."""
    body = [tasks[t] for t in BODY if t in tasks]
    lines = WIRING[cfg.layout]
    if cfg.layout == "split":
        lines += EXPORT_VM[cfg.approval] + (APPROVAL_WIRING if cfg.approval else ())
    for line in lines:
        chain(*(body if link == "body" else _linked(tasks, link) for link in line))
    for teardown_id, setup_ids in TEARDOWNS.items():
        if teardown_id in tasks:
            teardown = tasks[teardown_id]
            teardown.as_teardown(setups=[tasks[t] for t in setup_ids], on_failure_fail_dagrun=True)
            teardown.trigger_rule = TriggerRule.NONE_SKIPPED  # after as_teardown, which sets its own


def _linked(tasks: dict[str, BaseOperator], link: str | tuple[str, ...]) -> BaseOperator | list[BaseOperator]:
    return [tasks[t] for t in link] if isinstance(link, tuple) else tasks[link]


# The arguments several steps share.


def _params(names: Iterable[str]) -> dict[str, str]:
    """Each named Param as a template the task renders when it runs: ``{"steps": "{{ params.steps }}"}``."""
    return {name: f"{{{{ params.{name} }}}}" for name in names}


def _lora_params(cfg: PipelineConfig) -> tuple[str, ...]:
    """The trigger form's LoRA fields, in a LoRA entry's DAG (none elsewhere)."""
    return tuple(lora.PARAM_KEYS) if cfg.lora is not None else ()


def _lora(cfg: PipelineConfig) -> dict[str, str] | None:
    """A LoRA DAG's settings as the run's LoRA fields give them (rendered when its task runs); None: full SFT."""
    return _params(_lora_params(cfg)) if cfg.lora is not None else None


def _poll(cfg: PipelineConfig, seconds: int) -> int:
    """Seconds between a step's trigger polls: the entry's ``poll_interval_s``, else the step's own."""
    return cfg.poll_interval_s or seconds


def _capacity_wait(cfg: PipelineConfig) -> timedelta:
    return timedelta(minutes=cfg.max_wait_for_capacity_minutes)


def _place_wait(cfg: PipelineConfig) -> timedelta:
    """A create's time to get its place: in line behind others (under a cap), then first in line.

    Not the VM's: it exists only once the place is taken."""
    in_line = timedelta(hours=MAX_WAIT_IN_LINE_HOURS) if cfg.tpu_cap_chips is not None else timedelta(0)
    return in_line + _capacity_wait(cfg)


def _on_compute(cfg: PipelineConfig) -> dict[str, Any]:
    """The Compute API's arguments, for every create and delete of a VM."""
    return {
        "project_id": cfg.project_id,
        "gcp_conn_id": cfg.gcp_conn_id,
        "poll_interval": _poll(cfg, 10),
        "zones": "{{ params.zones }}",
    }


def _creating_vm(cfg: PipelineConfig) -> dict[str, Any]:
    """Every VM's create: its network and SSH access, its service account, its deadline on Google's side."""
    return {
        **_on_compute(cfg),
        "network": cfg.network,
        "subnetwork": cfg.subnetwork,
        "network_path": cfg.network_path,
        "ssh_source_ranges": cfg.ssh_source_ranges,
        "ssh_conn_id": cfg.ssh_conn_id,
        "ssh_key_mode": cfg.ssh_key_mode,
        "oslogin_user": cfg.oslogin_user,
        "service_account": cfg.service_account,
        "max_run_duration": cfg.timeouts.vm_lifetime(cfg.retries, MAX_RETRY_DELAY)
        + _capacity_wait(cfg)
        + timedelta(minutes=30),
        "execution_timeout": cfg.timeouts.create,
    }


# What a slice's create takes of ``_creating_vm`` (its zone is one; its VMs take the key from its template).
SLICE_CREATE_ARGUMENTS = (
    "project_id", "gcp_conn_id", "poll_interval", "network", "subnetwork", "network_path", "ssh_conn_id",
    "service_account", "max_run_duration",
)


def _creating_cpu_vm(cfg: PipelineConfig, kind: str) -> dict[str, Any]:
    """The create of a CPU VM (``kind``: ``cpu`` the conversion's, ``export``, ``pub`` an approved publish's)."""
    return {
        "name_prefix": kind,
        "max_tpu_chips": None,  # a CPU VM: not under the TPU cap
        "accelerator_type": cfg.cpu_accelerator_type,
        "provisioning_model": "STANDARD",
        "image_project": compute.CPU_IMAGE_PROJECT,
        "image_family": compute.CPU_IMAGE_FAMILY,
        **_creating_vm(cfg),
    }


def _publishing(cfg: PipelineConfig) -> dict[str, Any]:
    """The export's publish: the trained checkpoint (or the export kept for approval) to the run's targets."""
    return {
        "trained": Output("train"),
        "lora": _lora(cfg),
        "maxtext_version": "{{ params.maxtext_version }}",
        "inputs": Output("check_inputs"),
        "training_claim": Output("check_inputs", TRAINING_CLAIM_KEY),
        "gcp_conn_id": cfg.gcp_conn_id,
        "prices": cfg.prices,
        "hub_repo_id": "{{ params.hub_repo_id }}",
        "storage_uri": "{{ params.storage_uri }}",
        "execution_timeout": cfg.timeouts.export,
        "poll_interval": _poll(cfg, 15),
    }


def _whole_run(cfg: PipelineConfig) -> timedelta:
    """The longest a run may take: its place's wait, the conversion's, its VMs' lifetime and a person's answer."""
    return (
        _place_wait(cfg)
        + _conversion_wait(cfg)
        + cfg.timeouts.vm_lifetime(cfg.retries, MAX_RETRY_DELAY)
        + _later_vms_wait(cfg)
        + _approval_wait(cfg)
    )


def _later_vms_wait(cfg: PipelineConfig) -> timedelta:
    """The making of the CPU VMs after the training: the export's (and with approval the publish's) create and install.

    Their steps are counted in ``vm_lifetime``."""
    if cfg.layout != "split":
        return timedelta(0)
    return (cfg.timeouts.create + cfg.timeouts.install) * (2 if cfg.approval else 1)


def _approval_wait(cfg: PipelineConfig) -> timedelta:
    """How long a run waits for a person's answer to publish (none without approval)."""
    return timedelta(hours=cfg.approval_timeout_hours) if cfg.approval else timedelta(0)


def _conversion_wait(cfg: PipelineConfig) -> timedelta:
    """The longest the TPU VM's create waits for the conversion: the CPU VM's create, install and conversion."""
    if cfg.layout != "split":
        return timedelta(0)
    return cfg.timeouts.create + cfg.timeouts.install + cfg.timeouts.convert


def _just_in_time(cfg: PipelineConfig) -> dict[str, Any]:
    """The split layout's TPU VM is requested when the CPU VM's conversion is about to end (or is cached)."""
    if cfg.layout != "split":
        return {}
    return {
        "conversion_task_id": "convert_to_maxtext",
        "conversion_accelerator_type": cfg.cpu_accelerator_type,
        "inputs": Output("check_inputs"),
    }


def _deleting_vm(cfg: PipelineConfig, kind: str) -> dict[str, Any]:
    """The teardown of ``create_<kind>_vm``; it retries at least 3 times and never waits for a pool slot."""
    return {
        "create_task_id": f"create_{kind}_vm",
        "name_prefix": kind,
        "firewall": bool(cfg.ssh_source_ranges),
        "prices": cfg.prices,
        "execution_timeout": cfg.timeouts.delete,
        "retries": max(cfg.retries, 3),
        **_on_compute(cfg),
    }


def _on_vm(cfg: PipelineConfig, vm: str) -> dict[str, Any]:
    """A step on a VM: the VM (its create's result), the connections, the model and the checkpoint storage."""
    split = cfg.layout == "split"
    vm = vm if split else "tpu"
    arguments = {
        "ssh_conn_id": cfg.ssh_conn_id,
        "hf_conn_id": cfg.hf_conn_id,
        "model": "{{ params.model }}",
        "checkpoint_storage": cfg.checkpoint_storage if split else None,
        **(cfg.local or {}),
        "vm": Output(f"create_{vm}_vm"),
    }
    if vm == "tpu" and cfg.tpu_pool:
        arguments["pool"] = cfg.tpu_pool
    return arguments
