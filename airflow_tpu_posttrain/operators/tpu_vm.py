"""Create the TPU VM (a Compute Engine instance) of one DAG run, deferrably and idempotently."""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.defaults import MAX_WAIT_IN_LINE_HOURS
from airflow_tpu_posttrain.exceptions import (
    CapacityTimeoutError,
    CapacityUnavailableError,
    InvalidInputError,
    QuotaExceededError,
    ReservationError,
    VmAccessError,
    VmCreateError,
    VmNotReadyError,
)
from airflow_tpu_posttrain.links import VmConsoleLink
from airflow_tpu_posttrain.operators.compute_base import (
    as_list,
    deployment_id,
    seconds,
    vm_expires_at,
    vm_lifetime_s,
)
from airflow_tpu_posttrain.operators.just_in_time import JustInTimeMixin
from airflow_tpu_posttrain.operators.vm_login import VmLoginMixin
from airflow_tpu_posttrain.operators.vm_shape import VmShapeOperator
from airflow_tpu_posttrain.recipes import access, capacity, compute, create_phases, places, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR, accelerator, single_host
from airflow_tpu_posttrain.recipes.create_phases import Action, Phase
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context



class TpuVmCreateOperator(JustInTimeMixin, VmLoginMixin, VmShapeOperator):
    """Create the TPU VM of this DAG run (or, with a CPU ``accelerator_type``, its CPU VM), or find and reuse it.

    The instance name is deterministic per (dag_id, run_id), so a retry or a re-run finds the instance of an
    earlier try: a live one is reused, a TERMINATED/STOPPED one is replaced, and no second one is created.
    Zones are tried in order; a stock-out moves on to the next zone, quota and reservation errors fail at once.
    Every Compute call is made from the triggerer (``triggers/create.py``): the worker validates, pushes the XCom
    and defers, then resumes once to log in to the ready VM and record it.

    The VM is made reachable the way ``gcloud compute ssh`` reaches one: the public half of the SSH connection's
    key goes into the instance's ``ssh-keys`` metadata, or with ``ssh_key_mode="oslogin"`` into the OS Login
    profile of the Google Cloud connection's account (either way expiring with the VM), the guest environment
    publishes the VM's host keys as guest attributes, and the task succeeds only once those are published and the VM's
    sshd answers (in the triggerer). Every SSH step then pins those host keys.

    Returns (XCom) ``name, project, zone, status, internal_ip, external_ip, ssh_address, ssh_port, ssh_login,
    ssh_proxy_command, host_keys, machine_type, accelerator_type, firewall, requested_at``; a partial record with the
    name is pushed before the first API call so a teardown can find the VM even if this task dies half-way.

    With ``conversion_task_id`` (the split layout) the VM is requested just in time: when the run's conversion is
    cached (as far as earlier runs know), at once; else, deferred, once the conversion is expected to end within the
    VM's ready time, both as measured by earlier runs (``operators/just_in_time.py``), or once the conversion task
    has ended. Never measured: at once. A conversion that fails before then fails this task without retries
    (``ConversionFailedError``): this try creates nothing, and the teardown runs, deleting a VM an earlier try
    made (a skip would skip the teardown with it).

    The VM's shape (accelerator, provisioning, network, disk, service account, expiry, labels, metadata) and its
    cap take the parameters of :class:`~airflow_tpu_posttrain.operators.vm_shape.VmShapeOperator`, the slice's too.

    :param zones: zones to try, in order (a list, or a comma-separated string).
    :param accelerator_type: ``v6e-1``, ``v6e-4`` or ``v6e-8``, or ``cpu`` for a CPU VM (default ``v6e-8``).
    :param ssh_source_ranges: CIDR ranges (the Airflow workers' and triggerer's egress) admitted to tcp:22 by a
        firewall rule created and deleted with the VM; empty: no rule (the network already admits them).
    :param ssh_key_mode: ``metadata`` (instance ``ssh-keys``, ``enable-oslogin: FALSE``) or ``oslogin``
        (``enable-oslogin: TRUE``; needed where the organization enforces OS Login); the SSH steps then log in
        as the POSIX login OS Login answers, from this task's XCom ``ssh_login``.
    :param oslogin_user: the account whose OS Login profile gets the key (default: the Google Cloud
        connection's account, as ``gcloud compute ssh`` does).
    :param conversion_task_id: the run's conversion task, which the VM's training waits for; None: request at once.
    :param conversion_accelerator_type: the accelerator type of the VM that converts (its measurements' key).
    :param inputs: the inputs check's record (its XComArg): the model, its Hub revision and the MaxText version,
        which say whether the conversion is cached.
    """

    template_fields: Sequence[str] = (
        *VmShapeOperator.shape_template_fields,
        "zones",
        "ssh_source_ranges",
        "ssh_key_mode",
        "oslogin_user",
        "inputs",
    )
    ui_color = "#d5e8f7"
    operator_extra_links = (VmConsoleLink(),)
    record_xcom_key = "return_value"  # a recovery (run inside the training task) records under its own key

    def __init__(
        self,
        *,
        zones: Sequence[str] | str,
        accelerator_type: str = DEFAULT_ACCELERATOR,
        ssh_source_ranges: Sequence[str] | str | None = None,
        ssh_key_mode: str = "metadata",
        oslogin_user: str | None = None,
        conversion_task_id: str | None = None,
        conversion_accelerator_type: str = "cpu-highmem-16",
        inputs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(accelerator_type=accelerator_type, **kwargs)
        self.zones = zones
        self.ssh_source_ranges = ssh_source_ranges
        self.ssh_key_mode = ssh_key_mode
        self.oslogin_user = oslogin_user
        self.conversion_task_id = conversion_task_id
        self.conversion_accelerator_type = conversion_accelerator_type
        self.inputs = inputs

    def _spec(self, context: Context) -> compute.TpuVmSpec:
        """Validate everything the user gave before any API call; bad input fails without a retry."""
        try:
            spec = self._shape(
                context,
                as_list(self.zones),
                ssh_source_ranges=tuple(as_list(self.ssh_source_ranges)),
                ssh_key_mode=self.ssh_key_mode,
                capacity_wait_s=(
                    seconds(self.max_wait_for_capacity) if self.provisioning_model == "FLEX_START" else None
                ),
            )
            single_host("accelerator_type", spec.accelerator_type)
            self._cap(spec)
            if self.oslogin_user:
                access.oslogin_user("oslogin_user", self.oslogin_user)
            return spec
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def _name(self, context: Context) -> str:
        if self.instance_name:
            try:
                return validation.gce_name("instance_name", self.instance_name)
            except SpecError as err:
                raise InvalidInputError.of(self.task_id, err) from err
        return compute.instance_name(context["dag"].dag_id, context["run_id"], self.name_prefix, deployment_id())

    def _record(
        self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str | None, **more: Any
    ) -> dict:
        record = {
            "name": name,
            "project": spec.project_id,
            "zone": zone,
            "zones": list(spec.zones),
            "machine_type": spec.machine_type,
            "accelerator_type": spec.accelerator_type,
            "firewall": compute.firewall_name(name) if spec.opens_firewall else None,
            **more,
        }
        context["ti"].xcom_push(key=self.record_xcom_key, value=record)
        return record

    def _lines(self, spec: compute.TpuVmSpec) -> dict[str, str]:
        """Each zone's line of places (``recipes/places.py``): its key, whatever the cap."""
        return {zone: places.line_key(spec.project_id, zone, spec.reservation, spec.machine_type) for zone in spec.zones}

    def _cap(self, spec: compute.TpuVmSpec) -> places.Cap | None:
        """The cap this create asks under, and its size (the VM's chips); None: no cap."""
        return places.cap_of(
            self.max_tpu_chips, self.max_tpu_vms, self.capacity_claims, accelerator(spec.accelerator_type).chips, 1
        )

    def _place_lines(self, spec: compute.TpuVmSpec) -> dict[str, str] | None:
        """Each zone's line object under ``capacity_claims``, where the create takes its place; None: no cap."""
        cap = self._cap(spec)
        return {zone: places.line_uri(cap.claims, key) for zone, key in self._lines(spec).items()} if cap else None

    def execute(self, context: Context) -> Any:
        spec = self._spec(context)
        name = self._name(context)
        if self.conversion_task_id:
            self._wait_for_conversion(context, spec)
        return self._request(context, spec, name)

    def _request(self, context: Context, spec: compute.TpuVmSpec, name: str) -> None:
        """Request the VM: build what Compute is to be sent, and defer the create to the triggerer.

        Every Google API call of the create (the network checks, the OS Login key import, the lookup of an
        earlier try's instance, the capacity count, the insert, the zone fallback) runs there
        (``triggers/create.py``): the worker pays neither the Google clients' import nor any API round trip."""
        from airflow_tpu_posttrain.hooks.vm import client_identity
        from airflow_tpu_posttrain.triggers.create import TpuVmCreateTrigger

        requested_at = time.time()
        cap = self._cap(spec)
        if self.max_tpu_vms is not None:
            self.log.warning(
                "max_tpu_vms is deprecated: give max_tpu_chips=%s (the TPU chips of %s VM(s) of %s)",
                cap.chips, self.max_tpu_vms, spec.accelerator_type,
            )
        place_lines = self._place_lines(spec)
        self._record(context, spec, name, None, status="CREATING", place_lines=place_lines)
        expires_at = vm_expires_at(spec)  # were it made now: the trigger sets it when the VM's place is granted
        labels = compute.ownership_labels(
            context["dag"].dag_id, context["run_id"], self.task_id, expires_at, deployment_id()
        )
        lines = self._lines(spec)
        groups = {zone: capacity.group_label(key, self.name_prefix) for zone, key in lines.items()}
        metadata = {"airflow-dag-id": context["dag"].dag_id, "airflow-run-id": context["run_id"]}
        ssh_keys, oslogin, login = self._authorize_key(spec, expires_at)
        VmConsoleLink().push(context, VmConsoleLink.url(spec.project_id, spec.zones[0], name))
        self.log.info("Requesting %s (%s, %s) in %s, from the triggerer", name, spec.machine_type,
                      spec.provisioning_model, ", ".join(spec.zones))
        self.defer(
            trigger=TpuVmCreateTrigger(
                name=name,
                zones=list(spec.zones),
                bodies={
                    zone: compute.instance_body(
                        spec, name, zone, {**labels, capacity.GROUP_LABEL: groups[zone]}, metadata, ssh_keys
                    )
                    for zone in spec.zones
                },
                firewall=compute.ssh_firewall_body(spec, name) if spec.opens_firewall else None,
                deployment=deployment_id(),
                network_check={
                    "network": spec.network,
                    "subnetwork_given": bool(spec.subnetwork),
                    "network_path": spec.network_path,
                    "egress": [list(pair) for pair in compute.egress_subnetworks(spec)],
                },
                groups=groups,
                cap=cap.chips if cap else None,
                lines=place_lines,
                request=places.request_of(context["dag_run"], name, deployment_id(), cap.size) if cap else None,
                lifetime_s=vm_lifetime_s(spec),
                capacity_wait=float(seconds(self.max_wait_for_capacity)),
                oslogin=oslogin,
                ssh_port=client_identity(self.ssh_conn_id).port,
                ready_timeout=self.ready_timeout.total_seconds(),
                request_id_base=self._request_id(context, name),
                accelerator_type=spec.accelerator_type,
                reservation=spec.reservation,
                state={"phase": Phase.CREATE.value, "requested_at": requested_at, "ssh_login": login, "name": name},
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            # The trigger ends its own waits; this only backs them up.
            timeout=self.wait_timeout
            + timedelta(seconds=seconds(self.max_wait_for_capacity))
            + (timedelta(hours=MAX_WAIT_IN_LINE_HOURS) if cap is not None else timedelta(0))
            + self.ready_timeout
            + timedelta(minutes=5),
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        """The conversion wait ended (request the VM now), or the create's trigger did (record the VM)."""
        state = event["state"]
        spec = self._spec(context)
        # The name the trigger created, never one computed again: the deployment id in it may have been drawn anew
        # meanwhile (the first creates of a fresh deployment), and a renamed VM would be left to run unrecorded.
        name = state.get("name") or self._name(context)
        if state["phase"] == Phase.CONVERSION.value:
            action = create_phases.next_action(Phase.CONVERSION, event["status"])
            if action is Action.FAIL_CONVERSION or action is Action.START:
                self._conversion_waited(context, event)  # raises if the conversion failed: nothing is created
                return self._request(context, spec, name)
        zone = event["zone"]
        if event["status"] != "ready":
            raise self._failure(spec, name, event)
        login = event["ssh_login"] or state["ssh_login"]  # OS Login's answer, else the connection's login
        vm = self._vm(spec, name, zone, event["instance"], login, event["without_max_run_duration"])
        VmConsoleLink().push(context, VmConsoleLink.url(spec.project_id, zone, name))
        self._check_login(context, spec, name, zone, vm, event["host_keys"])
        record = self._record(
            context, spec, name, zone, **vm, host_keys=event["host_keys"], requested_at=state["requested_at"],
            place_lines=self._place_lines(spec),
        )
        self.log.info(
            "VM %s is ready in %s: %s:%s answers with the host keys it published (%s)",
            name,
            zone,
            record["ssh_address"],
            record["ssh_port"],
            ", ".join(sorted(record["host_keys"])),
        )
        return record

    def _failure(self, spec: compute.TpuVmSpec, name: str, event: dict[str, Any]) -> Exception:
        """The error a failed create raises; the trigger deleted what the attempt left before it fired."""
        action, zone, detail = Action(event["action"]), event["zone"], event["detail"]
        if action is Action.FAIL_INVALID_INPUT:
            return InvalidInputError(f"{self.task_id}: invalid input: {detail}")
        if action is Action.FAIL_ACCESS:
            return VmAccessError(detail)
        if action is Action.FAIL_FOREIGN:
            return VmCreateError(
                f"Instance {name} in {zone} exists but was made by Airflow deployment {(detail or None)!r}, not this one "
                f"({deployment_id()!r}): refusing to use or delete it. Give each deployment sharing project "
                f"{spec.project_id} its own [tpu_posttrain] deployment_id."
            )
        if action is Action.FAIL_NO_CAPACITY:
            return CapacityTimeoutError(
                f"No TPU capacity for {name} within {seconds(self.max_wait_for_capacity)} s ({detail}). Nothing was "
                "created. Raise max_wait_for_capacity, or trigger the run later."
            )
        if action is Action.FAIL_NO_ZONE_LEFT:
            return CapacityUnavailableError(
                f"No {spec.accelerator_type} capacity in any zone ({detail}). No instance was left behind. Add "
                "zones, use a reservation or FLEX_START, or let the task retry later."
            )
        if action is Action.FAIL_ZONE_UNSOLD:
            return InvalidInputError(  # a retry would be refused the same way
                f"zones: {zone} does not sell {spec.machine_type} ({spec.accelerator_type}): {detail} Nothing was "
                "created. Give zones that offer it (for TPU v6e: cloud.google.com/tpu/docs/regions-zones)."
            )
        if action is Action.FAIL_NO_IMAGE:
            return InvalidInputError(
                f"image_family: projects/{spec.image_project}/global/images/family/{spec.image_family} does not "
                f"exist: {detail} Nothing was created. Give an image family that exists (gcloud compute images "
                "describe-from-family)."
            )
        if action is Action.FAIL_NOT_READY:
            return VmNotReadyError(f"{detail}. The VM was deleted; a retry creates a new one.")
        if action is Action.FAIL_QUOTA:
            return QuotaExceededError(
                f"Quota exceeded creating {name} in {zone}: {detail}. Request a quota increase for "
                f"{spec.accelerator_type} in that region (IAM & Admin > Quotas) or choose another region."
            )
        if action is Action.FAIL_RESERVATION:
            return ReservationError(
                f"Reservation problem creating {name} in {zone}: {detail}. Check that reservation "
                f"'{spec.reservation}' exists in {zone}, is of {spec.machine_type} and is shared with this "
                "project, or choose another provisioning_model."
            )
        return VmCreateError(f"{event['phase']} of {name} in {zone} failed: {detail}")
