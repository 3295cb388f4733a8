"""Recovery of a training step whose VM was lost: preempted (SPOT, FLEX_START), stopped by a host error, deleted.

SkyPilot's managed-job recovery is the model: the loss is told apart from an SSH error by asking Compute, the VM
is created again (same name, same zones in order, same provisioning model) and training resumes from the newest
checkpoint in storage. The DAG's own tasks do the work, inside the training task: its create task makes the VM
(capacity, keys, firewall, readiness) and its install task installs MaxText, each run as a locked copy of the
task with their deferrals routed back through the training task (``recovery_complete``). No new task, and no
retry is spent: a recovery is part of the try it interrupts.

Only the split layout recovers: there the converted checkpoint and the training checkpoints are in storage. In
the tutorials' layout they were on the lost VM's disk, so the step fails with :class:`VmLostError`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import TaskDeferred

from airflow_tpu_posttrain.exceptions import VmLostError
from airflow_tpu_posttrain.recipes import access
from airflow_tpu_posttrain.recipes.compute import DEAD_STATES

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator, Context

    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

RECOVERED_VM = "recovered_vm"  # XCom key (of the training task): the VM the last recovery made
RECOVERIES = "recoveries"  # XCom key: recoveries so far in this try
RECOVERY_RESUME = "recovery_resume"  # XCom key: the recovery's deferred task (phase) and its method to resume
VM_FIELDS = (
    "name", "zone", "ssh_address", "ssh_login", "ssh_proxy_command", "ssh_proxy_account", "host_keys",
    "machine_type", "provisioning_model", "created_at", "started_at",  # what its cost is counted from
)
LOST_VMS = "lost_vms"  # XCom key (of the training task): the VMs lost in this try, for the run's cost


class Lost:
    """What Compute says of a lost VM, and how long it had run."""

    def __init__(self, name: str, zone: str | None, instance: dict | None) -> None:
        self.name = name
        self.zone = zone
        self.status = instance.get("status") if instance else None
        created = (instance or {}).get("creationTimestamp")
        self.ran_s = (
            int((datetime.now(UTC) - datetime.fromisoformat(created)).total_seconds()) if created else None
        )

    def __str__(self) -> str:
        where = f" in {self.zone}" if self.zone else ""
        what = f"is {self.status}{where}" if self.status else f"no longer exists{where}"
        ran = f", after {self.ran_s} s of VM time" if self.ran_s is not None else ""
        return f"VM {self.name} {what} (preempted, a host error or deleted{ran})"


class LostSlice(Lost):
    """A multi-host slice that lost a VM: what its group says (a slice is trained on whole or not at all)."""

    def __init__(self, name: str, zone: str | None, detail: str) -> None:
        super().__init__(name, zone, None)
        self.detail = detail

    def __str__(self) -> str:
        return f"Slice {self.name} in {self.zone} lost a VM ({self.detail})"


def create_task_id(task: Any) -> str | None:
    """The create task a step's ``vm`` is wired to (``vm=create.output``).

    Read from the DAG's own, unrendered task; None when the step was given its VM otherwise."""
    from airflow.sdk.definitions.xcom_arg import PlainXComArg

    vm = getattr(task, "vm", None)
    return vm.operator.task_id if isinstance(vm, PlainXComArg) else None


class VmRecoveryMixin:
    """For :class:`MaxTextJobOperator` steps that recover their VM (``vm``: its create task's XComArg)."""

    max_recoveries: int | str
    vm: Any
    checkpoint_storage: str | None
    task_id: str
    log: Any

    def _creator(self, context: Context) -> str | None:
        """The create task this step's ``vm`` is wired to; None outside a DAG.

        Read from the DAG's unrendered copy of this task (in the running copy, ``vm`` is already the
        record)."""
        dag = context.get("dag")
        return create_task_id(dag.get_task(self.task_id)) if dag is not None else None

    # -- the VM as Compute sees it now --------------------------------------------------------------
    def _vm_record(self, context: Context) -> dict | None:
        return self.vm if isinstance(self.vm, dict) else None

    def _create_task(self, context: Context) -> BaseOperator:
        return self._task_copy(context, self._creator(context))

    def _compute(self, context: Context) -> tuple[TpuVmHook, str]:
        creator = self._create_task(context)
        record = self._vm_record(context) or {}
        return creator.hook, record.get("project") or creator.project

    def _find_vm(self, context: Context) -> tuple[str | None, dict | None]:
        """(zone, instance) of the run's VM: in the zone the create recorded, else in its other zones."""
        record = self._vm_record(context) or {}
        hook, project = self._compute(context)
        zones = [record.get("zone"), *(record.get("zones") or [])]
        for zone in dict.fromkeys(z for z in zones if z):
            instance = hook.get_instance(project, zone, record["name"])
            if instance is not None:
                return zone, instance
        return record.get("zone"), None

    def vm_lost(self, context: Context) -> Lost | None:
        """The loss, when Compute says the VM is gone; None while it lives (or when no create task is named)."""
        record = self._vm_record(context)
        if not record or not record.get("name"):
            return None
        if record.get("slice"):
            return self._slice_lost(context, record)
        zone, instance = self._find_vm(context)
        if instance is not None and instance.get("status") not in DEAD_STATES:
            return None
        return Lost(record["name"], zone, instance)

    def _slice_lost(self, context: Context, record: dict) -> LostSlice | None:
        """The loss, when the slice's group says a VM of it is gone or stopped (or the group itself is gone)."""
        from airflow_tpu_posttrain.recipes import slices

        hook, project = self._compute(context)
        group = hook.get_instance_group(project, record["zone"], record["slice"]["group"])
        if group is None:
            return LostSlice(record["name"], record["zone"], "its instance group no longer exists")
        state = slices.slice_state(group)
        if state.state in (slices.WHOLE, slices.CREATING):
            return None
        return LostSlice(record["name"], record["zone"], state.detail or state.state)

    def vm_watch(self, context: Context) -> dict | None:
        """What the job trigger needs to ask Compute whether the VM is gone (None: no create task to ask about)."""
        if not self._creator(context):
            return None
        record = self._recovered(context) or self._vm_record(context)
        if not record or not record.get("zone"):
            return None
        creator = self._create_task(context)
        return {
            "project": (self._vm_record(context) or {}).get("project") or creator.project,
            "zone": record["zone"],
            "name": record["vms"][0]["name"] if record.get("vms") else record["name"],  # a slice's worker 0
            "gcp_conn_id": creator.gcp_conn_id,
            "api_endpoint": creator.api_endpoint,
            "impersonation_chain": creator.impersonation_chain,
        }

    # -- using the VM a recovery made ----------------------------------------------------------------
    def _recovered(self, context: Context) -> dict | None:
        vm = context["ti"].xcom_pull(task_ids=self.task_id, key=RECOVERED_VM)
        return vm if vm and (vm.get("host_keys") or vm.get("vms")) else None

    def adopt_recovered_vm(self, context: Context) -> None:
        """After a recovery (in this try), the steps' templates still name the lost VM: use the new one."""
        vm = self._recovered(context)
        if vm:
            self._point_at(self, vm)

    def adopt_current_vm(self, context: Context) -> dict | None:
        """On a later try the VM an earlier try's recovery made is known to Compute only: use it.

        The VM Compute has under the run's name is compared with the create's record by its published host
        keys, not only its zone and address: a new VM can get the lost one's internal or IAP address, never its
        host keys. Returns the adopted VM (then MaxText must be made sure of on it: the recovery that made it
        may have failed before its install ended), or None when the recorded VM is still the one."""
        record = self._vm_record(context)
        if record and record.get("slice"):
            return self._changed_slice(context, record)
        if not record or not record.get("host_keys"):
            return None
        zone, instance = self._find_vm(context)
        if instance is None or instance.get("status") != "RUNNING":
            return None
        network_path = record.get("network_path") or "external"
        address = access.ssh_address(instance, network_path)
        hook, project = self._compute(context)
        host_keys = hook.get_host_keys(project, zone, record["name"])
        if not host_keys or (zone, address, host_keys) == (
            record.get("zone"), record.get("ssh_address"), record["host_keys"]
        ):
            return None
        self.log.info(
            "The VM was created again by an earlier recovery: using %s in %s (%s), with the host keys it published",
            record["name"],
            zone,
            address,
        )
        proxy = access.iap_proxy_command(project, zone, record["name"]) if network_path == "iap" else ""
        vm = {
            **record, "zone": zone, "ssh_address": address, "host_keys": host_keys, "ssh_proxy_command": proxy,
            "created_at": instance.get("creationTimestamp"),
            "started_at": instance.get("lastStartTimestamp") or instance.get("creationTimestamp"),
        }
        self._point_at(self, vm)
        return vm

    def _changed_slice(self, context: Context, record: dict) -> dict | None:
        """The slice's record when an earlier try's recovery made it again (its worker 0 has new host keys)."""
        hook, project = self._compute(context)
        worker = record["vms"][0]
        if hook.get_host_keys(project, record["zone"], worker["name"]) in (None, {}, worker["host_keys"]):
            return None
        self.log.info("Slice %s was made again by an earlier recovery: reading its VMs", record["name"])
        return record

    def train_on_adopted_vm(self, context: Context, vm: dict) -> Any:
        """Install MaxText on an adopted VM (a no-op where the recovery's install finished), then start.

        A slice made again is read through its create (which reuses a whole slice) first."""
        if vm.get("slice"):
            return self._delegate(context, "create", "execute", None)
        context["ti"].xcom_push(key=RECOVERED_VM, value={key: vm.get(key) for key in VM_FIELDS})
        return self._delegate(context, "install", "execute", None)

    @staticmethod
    def _point_at(task: Any, vm: dict) -> None:
        if vm.get("vms"):  # a slice made again: every VM of it, and worker 0's connection
            task.vm = vm
            vm = vm["vms"][0]
        task.remote_host = vm["ssh_address"]
        task.host_keys = vm["host_keys"]
        task.ssh_login = vm.get("ssh_login") or task.ssh_login
        task.ssh_proxy_command = vm.get("ssh_proxy_command") or ""
        task.ssh_proxy_account = vm.get("ssh_proxy_account")

    # -- the recovery ------------------------------------------------------------------------------------
    def on_vm_lost(self, context: Context, lost: Lost) -> Any:
        """A step that does not recover fails with the loss; the teardown deletes what is left."""
        raise VmLostError(f"{lost}. The teardown deletes what is left; a re-run creates the VM again.")

    def recover(self, context: Context, lost: Lost) -> Any:
        """Create the VM again, install MaxText on it, and start training again (it resumes from storage)."""
        if not self.checkpoint_storage:
            raise VmLostError(
                f"{lost}. Its checkpoints were on that VM (the tutorials' layout), so there is nothing to resume "
                "from; the teardown deletes what is left. The split layout (checkpoint storage) recovers."
            )
        done = context["ti"].xcom_pull(task_ids=self.task_id, key=RECOVERIES) or 0
        limit = int(self.max_recoveries)
        if done >= limit:
            raise VmLostError(f"{lost}. Not recovering: max_recoveries={limit} reached in this try.")
        context["ti"].xcom_push(key=RECOVERIES, value=done + 1)
        self._count_lost_vm(context)
        creator = self._create_task(context)
        self.log.warning(
            "Recovery %d/%d: %s. Creating it again (zones %s, %s); training then resumes from its newest "
            "checkpoint in %s",
            done + 1,
            limit,
            lost,
            getattr(creator, "zones", None) or [creator.zone],  # a slice's create has its one zone
            creator.provisioning_model,
            self.checkpoint_storage,
        )
        return self._delegate(context, "create", "execute", None)

    def serving_vm(self, context: Context) -> dict:
        """The VM the step runs on now: the one a recovery (or an adoption) made, else the create's."""
        vm = self._recovered(context) or self._vm_record(context) or {}
        return {key: vm.get(key) for key in VM_FIELDS if key not in ("host_keys", "ssh_proxy_command")}

    def lost_vms(self, context: Context) -> list[dict]:
        """The VMs lost in this try, each with when it was found lost (its time counts toward the cost)."""
        return context["ti"].xcom_pull(task_ids=self.task_id, key=LOST_VMS) or []

    def _count_lost_vm(self, context: Context) -> None:
        lost = {**self.serving_vm(context), "lost_at": datetime.now(UTC).isoformat()}
        context["ti"].xcom_push(key=LOST_VMS, value=[*self.lost_vms(context), lost])

    def recovery_complete(self, context: Context, event: dict | None = None) -> Any:
        """A recovery's task (create or install) resumed from its trigger.

        Which task, and which of its methods, is in XCom: ``dag.test()`` resumes a task with the event alone,
        dropping the deferral's kwargs."""
        resume = context["ti"].xcom_pull(task_ids=self.task_id, key=RECOVERY_RESUME)
        return self._delegate(context, resume["phase"], resume["method"], event)

    def _delegate(self, context: Context, phase: str, method: str, event: dict | None) -> Any:
        task = self._create_task(context) if phase == "create" else self._install_task(context)
        if phase == "create":
            task.record_xcom_key = RECOVERED_VM
            task.request_id_salt = (
                f"recovery-{context['ti'].xcom_pull(task_ids=self.task_id, key=RECOVERIES)}"
            )
        else:
            self._point_at(task, self._recovered(context))
        call = getattr(task, method)
        try:
            result = call(context) if event is None else call(context, event)
        except TaskDeferred as deferred:
            context["ti"].xcom_push(
                key=RECOVERY_RESUME, value={"phase": phase, "method": deferred.method_name}
            )
            raise TaskDeferred(
                trigger=deferred.trigger, method_name="recovery_complete", timeout=deferred.timeout
            ) from None
        if phase == "create":
            vm = result if result.get("vms") else {key: result.get(key) for key in VM_FIELDS}
            context["ti"].xcom_push(key=RECOVERED_VM, value=vm)
            self.log.info("Recovered VM %s is ready in %s; installing MaxText on it", vm["name"], vm["zone"])
            return self._delegate(context, "install", "execute", None)
        self.adopt_recovered_vm(context)
        self.log.info("MaxText is ready on the recovered VM; starting training again")
        return self.start_on_vm(context)

    def start_on_vm(self, context: Context) -> Any:
        raise NotImplementedError

    def _install_task(self, context: Context) -> BaseOperator:
        """The DAG's install task for this step's VM (an operator marked ``installs_maxtext``)."""
        creator = self._creator(context)
        installs = [
            task.task_id
            for task in context["dag"].tasks
            if getattr(task, "installs_maxtext", False) and create_task_id(task) == creator
        ]
        if not installs:
            raise VmLostError(f"No install task for {creator}'s VM in this DAG: cannot recover")
        return self._task_copy(context, installs[0])

    @staticmethod
    def _task_copy(context: Context, task_id: str) -> Any:
        """The DAG's task ``task_id``, its templates rendered for this run, ready to run inside this task."""
        task = context["dag"].get_task(task_id).prepare_for_execution()
        task.render_template_fields(context)
        return task
