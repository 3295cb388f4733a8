"""Create and delete the multi-host TPU slice of one DAG run: every VM of it, or none (``recipes/slices.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.defaults import MAX_WAIT_IN_LINE_HOURS
from airflow_tpu_posttrain.exceptions import (
    CapacityTimeoutError,
    InvalidInputError,
    QuotaExceededError,
    ReservationError,
    VmCreateError,
    VmDeleteError,
    VmLostError,
    VmNotReadyError,
)
from airflow_tpu_posttrain.operators.compute_base import (
    ComputeOperator,
    deployment_id,
    seconds,
    vm_expires_at,
    vm_lifetime_s,
)
from airflow_tpu_posttrain.operators.vm_login import VmLoginMixin
from airflow_tpu_posttrain.operators.vm_shape import VmShapeOperator
from airflow_tpu_posttrain.recipes import capacity, compute, cost, places, slices
from airflow_tpu_posttrain.recipes.accelerators import accelerator
from airflow_tpu_posttrain.recipes.slices import SLICE_PROVISIONING_MODELS
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context



class TpuSliceCreateOperator(VmLoginMixin, VmShapeOperator):
    """Create the multi-host TPU slice (v6e-16 … v6e-256) of this DAG run, or find and reuse it.

    The slice is a workload policy, an instance template and a managed instance group in bulk mode, all named
    after the run (deterministic, as a single VM's name is): Compute creates every VM at once or none. Every
    Compute call is made from the triggerer (``triggers/slice.py``), which hands on the slice only when every VM
    is RUNNING, has published its host keys and answers on its SSH port; a slice that cannot be completed (no
    capacity within ``max_wait_for_capacity``, a VM lost, a VM that never answers) is deleted whole before the
    task fails, and a retry's create replaces an earlier try's broken slice. The worker then logs in to worker 0
    once, as every SSH step will (every VM has the same key, from the template).

    Returns (XCom) ``name, project, zone, accelerator_type, machine_type, slice: {group, template, policy},
    vms: [{name, worker_id, status, internal_ip, external_ip, ssh_address, ssh_port, ssh_login, host_keys}] by
    worker id, requested_at``; a partial record with the slice's names is pushed before the first API call so
    the teardown finds the slice even if this task dies half-way.

    :param zone: the slice's zone (a slice's VMs share one zone's interconnect).
    :param accelerator_type: the slice, ``v6e-16`` … ``v6e-256`` (``recipes/accelerators.py``).

    The rest of its VMs' shape (provisioning, network, disk, service account, expiry, labels, metadata) and its cap
    take the parameters of :class:`~airflow_tpu_posttrain.operators.vm_shape.VmShapeOperator`, a single VM's too;
    a slice takes one place of all its chips in its zone's line, never one for each VM.
    """

    template_fields: Sequence[str] = (*VmShapeOperator.shape_template_fields, "zone")
    ui_color = "#d5e8f7"
    record_xcom_key = "return_value"  # a recovery (run inside the training task) records under its own key
    oslogin_user = None  # the template's ssh-keys let the connection in (``VmLoginMixin``)

    def __init__(self, *, zone: str, accelerator_type: str, **kwargs: Any) -> None:
        super().__init__(accelerator_type=accelerator_type, **kwargs)
        self.zone = zone

    def _spec(self, context: Context) -> compute.TpuVmSpec:
        """Validate everything the user gave before any API call; bad input fails without a retry."""
        try:
            if not accelerator(self.accelerator_type).is_multi_host:
                raise SpecError(
                    "accelerator_type", self.accelerator_type, "is one VM, not a slice",
                    "use TpuVmCreateOperator for it, or a slice: v6e-16, v6e-32, v6e-64, v6e-128 or v6e-256",
                )
            if self.provisioning_model not in SLICE_PROVISIONING_MODELS:
                raise SpecError(
                    "provisioning_model", self.provisioning_model, "cannot make a slice all at once",
                    f"use one of {list(SLICE_PROVISIONING_MODELS)} (Compute's bulk mode takes only these)",
                )
            if self.network_path not in ("internal", "external"):
                raise SpecError(
                    "network_path", self.network_path, "is not served for a slice", "use 'internal' or 'external'"
                )
            self._cap()
            return self._shape(context, [self.zone])
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def _cap(self) -> places.Cap | None:
        """The cap the slice asks under, and its size (all its VMs' chips); None: no cap."""
        shape = accelerator(self.accelerator_type)
        return places.cap_of(self.max_tpu_chips, self.max_tpu_vms, self.capacity_claims, shape.chips_per_vm, shape.vms)

    def _name(self, context: Context) -> str:
        return self.instance_name or compute.instance_name(
            context["dag"].dag_id, context["run_id"], self.name_prefix, deployment_id()
        )

    def _record(self, context: Context, name: str, **more: Any) -> dict:
        names = slices.slice_names(name)
        record = {
            "name": name,
            "project": self.project,
            "zone": self.zone,
            "accelerator_type": self.accelerator_type,
            "machine_type": accelerator(self.accelerator_type).machine_type,
            "slice": {"group": names.group, "template": names.template, "policy": names.policy},
            **more,
        }
        context["ti"].xcom_push(key=self.record_xcom_key, value=record)
        return record

    def execute(self, context: Context) -> None:
        import time

        from airflow_tpu_posttrain.triggers.slice import TpuSliceCreateTrigger

        spec = self._spec(context)
        name = self._name(context)
        requested_at = time.time()
        key = places.line_key(spec.project_id, self.zone, spec.reservation, spec.machine_type)
        cap = self._cap()
        if self.max_tpu_vms is not None:
            self.log.warning(
                "max_tpu_vms is deprecated: give max_tpu_chips=%s (the TPU chips of %s VM(s) of %s)",
                cap.chips, self.max_tpu_vms, spec.machine_type,
            )
        line = places.line_uri(cap.claims, key) if cap else None
        self._record(context, name, status="CREATING", place_lines={self.zone: line} if line else None)
        expires_at = vm_expires_at(spec)  # were it made now: the trigger sets it when the slice's place is granted
        labels = compute.ownership_labels(
            context["dag"].dag_id, context["run_id"], self.task_id, expires_at, deployment_id()
        )
        group = capacity.group_label(key, self.name_prefix)
        labels[capacity.GROUP_LABEL] = group
        metadata = {"airflow-dag-id": context["dag"].dag_id, "airflow-run-id": context["run_id"]}
        ssh_keys, _, login = self._authorize_key(spec, expires_at)
        bodies = slices.slice_bodies(spec, name, self.zone, labels, metadata, ssh_keys)
        self.log.info(
            "Requesting slice %s (%s: %d VMs of %s, %s) in %s, from the triggerer",
            name, spec.accelerator_type, accelerator(spec.accelerator_type).vms, spec.machine_type,
            spec.provisioning_model, self.zone,
        )
        self.defer(
            trigger=TpuSliceCreateTrigger(
                zone=self.zone,
                bodies={
                    "policy": bodies.policy, "template": bodies.template, "group": bodies.group,
                    "firewalls": list(bodies.firewalls),
                },
                network_path=self.network_path,
                ssh_port=self._ssh_port(),
                group=group,
                cap=cap.chips if cap else None,
                line=line,
                request=places.request_of(context["dag_run"], bodies.group["name"], deployment_id(), cap.size)
                if cap else None,
                lifetime_s=vm_lifetime_s(spec),
                capacity_wait=float(seconds(self.max_wait_for_capacity) or 0),
                ready_timeout=self.ready_timeout.total_seconds(),
                state={
                    "requested_at": requested_at, "ssh_login": login, "place_lines": {self.zone: line} if line else None,
                    "name": name,
                },
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            timeout=self.wait_timeout
            + timedelta(seconds=seconds(self.max_wait_for_capacity) or 0)
            + (timedelta(hours=MAX_WAIT_IN_LINE_HOURS) if cap is not None else timedelta(0))
            + self.ready_timeout
            + timedelta(minutes=5),
        )

    def _ssh_port(self) -> int:
        from airflow_tpu_posttrain.hooks.vm import client_identity

        return client_identity(self.ssh_conn_id).port

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        """The slice is whole (record it, log in to worker 0) or could not be made (deleted already: raise why)."""
        spec = self._spec(context)
        name = event["state"].get("name") or self._name(context)  # the slice made (see TpuVmCreateOperator's)
        if event["status"] != "ready":
            raise self._failure(name, event)
        state = event["state"]
        vms = []
        for made in event["vms"]:
            vm = self._vm(spec, made["name"], self.zone, made["instance"], state["ssh_login"], False)
            vms.append({"name": made["name"], **vm, "host_keys": made["host_keys"]})
        self._check_login(context, spec, name, self.zone, vms[0], vms[0]["host_keys"])
        vms = self._by_worker_id(name, vms)
        record = self._record(
            context, name, status="RUNNING", vms=vms, requested_at=state["requested_at"], place_lines=state["place_lines"]
        )
        self.log.info(
            "Slice %s is ready in %s: %s", name, self.zone,
            ", ".join(f"worker {vm['worker_id']} {vm['name']} at {vm['ssh_address']}" for vm in vms),
        )
        return record

    def _by_worker_id(self, name: str, vms: list[dict]) -> list[dict]:
        """The VMs with the worker id each one's metadata server tells it (asked over SSH), by worker id.

        Never handed on without them: every training command names its worker, and a slice whose ids are not
        0 to N-1 would be billed for nothing until its first MaxText step failed. The teardown deletes it."""
        told = []
        for vm in vms:
            with self._session(vm, vm["host_keys"]) as session:
                told.append({**vm, "worker_id": slices.worker_id_answer(*session.run_status(slices.worker_id_command()))})
        ids = sorted(vm["worker_id"] for vm in told if vm["worker_id"] is not None)
        if ids != list(range(len(told))):
            found = ", ".join(f"{vm['name']}: {vm['worker_id']}" for vm in told)
            raise VmNotReadyError(
                f"Slice {name}: the worker ids its VMs' metadata servers tell ({' or '.join(slices.WORKER_ID_KEYS)}) "
                f"are not 0 to {len(told) - 1} ({found}); it is not trained on, and the teardown deletes it."
            )
        return sorted(told, key=lambda vm: vm["worker_id"])

    def _failure(self, name: str, event: dict[str, Any]) -> Exception:
        reason, detail = event["reason"], event["detail"]
        if reason == "no-place":
            return InvalidInputError(f"{self.task_id}: invalid input: {detail}. Nothing was created.")
        if reason == "no-capacity":
            return CapacityTimeoutError(
                f"No capacity for slice {name} ({self.accelerator_type}) within "
                f"{seconds(self.max_wait_for_capacity)} s: {detail}. Nothing was left. Raise max_wait_for_capacity, "
                "use a reservation of the whole slice, or trigger the run later."
            )
        if reason == "broken":
            return VmLostError(f"Slice {name} lost a VM before it could be used ({detail}); it was deleted whole.")
        if reason == "not-ready":
            return VmNotReadyError(f"{detail}. The slice was deleted whole; a retry creates a new one.")
        kind = event.get("kind")
        if kind == compute.ErrorKind.QUOTA:
            return QuotaExceededError(f"Compute refused slice {name} for a quota: {detail}. Nothing was left.")
        if kind == compute.ErrorKind.RESERVATION:
            return ReservationError(f"The reservation cannot serve slice {name}: {detail}. Nothing was left.")
        return VmCreateError(f"Compute refused slice {name}: {detail}. Nothing was left.")

    def _refused(self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str, error: Exception) -> None:
        """A slice Airflow cannot log into is deleted whole from the triggerer; then ``error`` is raised."""
        from airflow_tpu_posttrain.triggers.slice import TpuSliceDeleteTrigger

        names = slices.slice_names(name)
        self.log.warning("Deleting slice %s: the create failed and its VMs must not outlive it", name)
        self.defer(
            trigger=TpuSliceDeleteTrigger(
                zone=zone,
                group=names.group,
                template=names.template,
                policy=names.policy,
                state={"error": type(error).__name__, "message": str(error)},
                **self._trigger_arguments(),
            ),
            method_name="refused_complete",
            timeout=self.wait_timeout,
        )


class TpuSliceDeleteOperator(ComputeOperator):
    """Delete the multi-host slice of this DAG run, from the triggerer: the teardown of a slice's pipeline.

    The group with every VM, then the template, the workload policy and the slice's firewall rules, named by the
    create task's XCom (the partial record a failed create leaves included), else by the run's deterministic name. What is already gone
    counts as deleted. Returns (XCom) ``{"deleted": bool, "name", "zone", "vms": n, "cost_usd", "vm_seconds"}``:
    the cost sums every VM's (None when ``prices`` has no price for it).

    :param create_task_id: the task id of the :class:`TpuSliceCreateOperator` whose slice to delete.
    :param zone: where the slice is when there is no XCom.
    :param instance_name: the slice's name instead of the deterministic one.
    :param prices: USD per hour by machine type and provisioning model; None: ``recipes.cost.DEFAULT_PRICES``.
    """

    template_fields: Sequence[str] = (
        "project_id",
        "zone",
        "instance_name",
        "api_endpoint",
        *ComputeOperator.connection_template_fields,
    )
    ui_color = "#f7d5d5"

    def __init__(
        self,
        *,
        create_task_id: str | None = "create_tpu_vm",
        zone: str | None = None,
        instance_name: str | None = None,
        prices: dict[str, dict[str, float]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.create_task_id = create_task_id
        self.zone = zone
        self.instance_name = instance_name
        self.prices = prices

    def execute(self, context: Context) -> None:
        from airflow_tpu_posttrain.triggers.slice import TpuSliceDeleteTrigger

        record = context["ti"].xcom_pull(task_ids=self.create_task_id) if self.create_task_id else None
        place_lines = None
        if record and record.get("slice"):
            self.project_id = self.project_id or record.get("project")
            name, zone, names = record["name"], record["zone"], record["slice"]
            place_lines = record.get("place_lines")
        else:
            name = self.instance_name or compute.instance_name(
                context["dag"].dag_id, context["run_id"], self.name_prefix, deployment_id()
            )
            zone, made = self.zone, slices.slice_names(name)
            names = {"group": made.group, "template": made.template, "policy": made.policy}
            self.log.info("No XCom from %s: looking for slice %s by its deterministic name", self.create_task_id, name)
        if not zone:
            raise InvalidInputError(f"{self.task_id}: zone: not set and no XCom names it. Fix: pass the slice's zone")
        self.log.info("Deleting slice %s in %s (group, template, workload policy)", name, zone)
        self.defer(
            trigger=TpuSliceDeleteTrigger(
                zone=zone, **names, state={"name": name, "zone": zone, "group": names["group"], "place_lines": place_lines},
                **self._trigger_arguments()
            ),
            method_name="execute_complete",
            timeout=self.wait_timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        state = event["state"]
        if event["status"] != "success":
            raise VmDeleteError(
                f"Deleting slice {state['name']} failed: {compute.describe_errors(event.get('errors', []))}"
            )
        deleted = event["deleted"]
        self._give_places_back(state["group"], state.get("place_lines"))
        result: dict[str, Any] = {"deleted": bool(deleted), "name": state["name"], "zone": state["zone"]}
        result["vms"] = len(deleted)
        if not deleted:
            self.log.info("Nothing to delete: slice %s was not found in %s", state["name"], state["zone"])
            return result
        if event.get("ended"):
            spent = [cost.vm_cost(vm["name"], vm["instance"], event["ended"], self.prices) for vm in deleted]
            known = [s.as_dict() for s in spent]
            total = [c["cost_usd"] for c in known]
            result["vm_seconds"] = sum(c["vm_seconds"] for c in known)
            result["cost_usd"] = None if None in total else round(sum(total), 2)
            self.log.info("Deleted slice %s: %d VMs, %s VM-seconds, cost %s USD", state["name"], len(deleted),
                          result["vm_seconds"], result["cost_usd"])
        return result
