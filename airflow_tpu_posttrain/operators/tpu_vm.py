"""Create the TPU VM (a Compute Engine instance) of one DAG run, deferrably and idempotently."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import (
    CapacityUnavailableError,
    InvalidInputError,
    QuotaExceededError,
    ReservationError,
    VmCreateError,
    VmNotReadyError,
)
from airflow_tpu_posttrain.links import VmConsoleLink
from airflow_tpu_posttrain.operators.capacity_cap import CapacityCapMixin
from airflow_tpu_posttrain.operators.compute_base import (
    DEFAULT_MAX_RUN_DURATION,
    ComputeOperator,
    as_list,
    deployment_id,
    seconds,
    vm_expires_at,
)
from airflow_tpu_posttrain.operators.just_in_time import JustInTimeMixin
from airflow_tpu_posttrain.operators.vm_login import VmLoginMixin
from airflow_tpu_posttrain.recipes import access, capacity, compute, create_phases, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR
from airflow_tpu_posttrain.recipes.create_phases import Action, Phase, Progress
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context


# Added to the DAG's dagrun_timeout so teardown normally wins the race against the backstop.
BACKSTOP_MARGIN = timedelta(minutes=30)


class TpuVmCreateOperator(JustInTimeMixin, CapacityCapMixin, VmLoginMixin, ComputeOperator):
    """Create the TPU VM of this DAG run (or, with a CPU ``accelerator_type``, its CPU VM), or find and reuse it.

    The instance name is deterministic per (dag_id, run_id), so a retry or a re-run finds the instance of an
    earlier try: a live one is reused, a TERMINATED/STOPPED one is replaced, and no second one is created.
    Zones are tried in order; a stock-out moves on to the next zone, quota and reservation errors fail at once.

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
    has ended. Never measured: at once. A conversion that fails before then skips this task: no VM is created.

    :param zones: zones to try, in order (a list, or a comma-separated string).
    :param accelerator_type: ``v6e-1``, ``v6e-4`` or ``v6e-8`` (the machine type is derived from it), or
        ``cpu`` for a CPU VM.
    :param provisioning_model: RESERVATION_BOUND (the tutorials'; needs ``reservation``), STANDARD, SPOT or
        FLEX_START.
    :param reservation: the specific reservation to consume (RESERVATION_BOUND, or optionally STANDARD): a name,
        ``projects/P/reservations/R``, ``projects/P/reservations/R/reservationBlocks/B``, or with several zones
        one per zone, ``ZONE=RESERVATION,...`` (a reservation is zonal).
    :param network: VPC network name.
    :param subnetwork: subnetwork name (in each zone's region) or path; required on a custom-mode network.
    :param network_path: how Airflow reaches the VM: ``internal`` (its internal IP: Airflow inside the VPC, no
        external IP), ``external`` (its external IP) or ``iap`` (IAP's TCP forwarding, ``gcloud compute
        start-iap-tunnel`` as the SSH ProxyCommand; no external IP; a rule admitting IAP's range).
    :param ssh_source_ranges: CIDR ranges (the Airflow workers' and triggerer's egress) admitted to tcp:22 by a
        firewall rule created and deleted with the VM; empty: no rule (the network already admits them).
    :param ssh_conn_id: the SSH connection the MaxText steps use; its login and public key go into the VM's
        ``ssh-keys`` metadata (``metadata`` mode), or its public key into OS Login (``oslogin`` mode).
    :param ssh_key_mode: ``metadata`` (instance ``ssh-keys``, ``enable-oslogin: FALSE``) or ``oslogin``
        (``enable-oslogin: TRUE``; needed where the organization enforces OS Login); the SSH steps then log in
        as the POSIX login OS Login answers, from this task's XCom ``ssh_login``.
    :param oslogin_user: the account whose OS Login profile gets the key (default: the Google Cloud
        connection's account, as ``gcloud compute ssh`` does).
    :param ready_timeout: how long a RUNNING VM may take to publish its host keys and answer on its SSH port.
    :param max_tpu_vms: how many of the pipeline's VMs of this capacity group (the reservation, else the zones and
        machine series, in the project) may live at once, counted from Compute by label across DAGs and Airflow
        deployments; the create waits in the triggerer, holding no VM, until one ends. None: no cap.
    :param prices: USD per hour by machine type and provisioning model, for the log line that says what a VM
        deleted for being over the cap had cost (``recipes.cost.price_table``); None: the defaults.
    :param max_wait_for_capacity: how long to wait for a place under ``max_tpu_vms`` or in a fully used
        reservation (a timedelta or seconds); then the task fails, having created nothing. With FLEX_START it is
        also how long Compute keeps the VM PENDING in its queue (``params.requestValidForDuration``, at most 2 h).
    :param tags: network tags.
    :param max_run_duration: cloud-side backstop (``scheduling.maxRunDuration``, termination action DELETE).
        Default: the DAG's ``dagrun_timeout`` plus 30 minutes, else 12 hours.
    :param service_account: the VM's service account (``default``: the project's Compute Engine default); what
        the VM may do (gs:// checkpoints, logs) is granted to it in IAM.
    :param service_account_scopes: its OAuth scopes (default ``cloud-platform``, as Google's TPU examples).
    :param instance_name: override the deterministic name (rarely needed).
    :param labels: extra labels; the ownership labels (managed-by, dag, run, task, expires-at) are always set.
    :param metadata: extra instance metadata items (e.g. ``enable-oslogin: "TRUE"``).
    :param api_endpoint: Compute API endpoint override (a local emulator); default from the connection.
    :param conversion_task_id: the run's conversion task, which the VM's training waits for; None: request at once.
    :param conversion_accelerator_type: the accelerator type of the VM that converts (its measurements' key).
    :param inputs: the inputs check's record (its XComArg): the model, its Hub revision and the MaxText version,
        which say whether the conversion is cached.
    """

    template_fields: Sequence[str] = (
        "project_id",
        "zones",
        "accelerator_type",
        "provisioning_model",
        "reservation",
        "network",
        "subnetwork",
        "network_path",
        "ssh_source_ranges",
        "ssh_conn_id",
        "ssh_key_mode",
        "oslogin_user",
        "max_wait_for_capacity",
        "tags",
        "instance_name",
        "labels",
        "metadata",
        "api_endpoint",
        "inputs",
        *ComputeOperator.connection_template_fields,
    )
    ui_color = "#d5e8f7"
    operator_extra_links = (VmConsoleLink(),)
    record_xcom_key = "return_value"  # a recovery (run inside the training task) records under its own key

    def __init__(
        self,
        *,
        zones: Sequence[str] | str,
        accelerator_type: str = DEFAULT_ACCELERATOR,
        provisioning_model: str = "RESERVATION_BOUND",
        reservation: str | None = None,
        network: str = "default",
        subnetwork: str | None = None,
        network_path: str = "external",
        ssh_source_ranges: Sequence[str] | str | None = None,
        ssh_conn_id: str = "tpu_vm_ssh",
        ssh_key_mode: str = "metadata",
        oslogin_user: str | None = None,
        ready_timeout: timedelta = timedelta(minutes=10),
        max_tpu_vms: int | None = None,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        max_wait_for_capacity: timedelta | int = timedelta(hours=1),
        tags: Sequence[str] | None = None,
        boot_disk_size_gb: int = 200,
        image_project: str = compute.DEFAULT_IMAGE_PROJECT,
        image_family: str = compute.DEFAULT_IMAGE_FAMILY,
        max_run_duration: timedelta | int | None = None,
        service_account: str = "default",
        service_account_scopes: Sequence[str] = (compute.CLOUD_PLATFORM_SCOPE,),
        instance_name: str | None = None,
        labels: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        conversion_task_id: str | None = None,
        conversion_accelerator_type: str = "cpu-highmem-16",
        inputs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.zones = zones
        self.accelerator_type = accelerator_type
        self.provisioning_model = provisioning_model
        self.reservation = reservation
        self.network = network
        self.subnetwork = subnetwork
        self.network_path = network_path
        self.ssh_source_ranges = ssh_source_ranges
        self.ssh_conn_id = ssh_conn_id
        self.ssh_key_mode = ssh_key_mode
        self.oslogin_user = oslogin_user
        self.ready_timeout = ready_timeout
        self.max_tpu_vms = max_tpu_vms
        self.prices = prices
        self.max_wait_for_capacity = max_wait_for_capacity
        self.tags = tags
        self.boot_disk_size_gb = boot_disk_size_gb
        self.image_project = image_project
        self.image_family = image_family
        self.max_run_duration = max_run_duration
        self.service_account = service_account
        self.service_account_scopes = service_account_scopes
        self.instance_name = instance_name
        self.labels = labels
        self.metadata = metadata
        self.conversion_task_id = conversion_task_id
        self.conversion_accelerator_type = conversion_accelerator_type
        self.inputs = inputs

    def _max_run_duration_s(self, context: Context) -> int:
        explicit = seconds(self.max_run_duration)
        if explicit is not None:
            return explicit
        dagrun_timeout = getattr(context["dag"], "dagrun_timeout", None)
        if dagrun_timeout:
            return int((dagrun_timeout + BACKSTOP_MARGIN).total_seconds())
        return int(DEFAULT_MAX_RUN_DURATION.total_seconds())

    def _spec(self, context: Context) -> compute.TpuVmSpec:
        """Validate everything the user gave before any API call; bad input fails without a retry."""
        try:
            spec = compute.TpuVmSpec(
                project_id=self.project,
                zones=tuple(as_list(self.zones)),
                accelerator_type=self.accelerator_type,
                provisioning_model=self.provisioning_model,
                reservation=self.reservation or None,
                network=self.network,
                subnetwork=self.subnetwork or None,
                network_path=self.network_path,
                ssh_source_ranges=tuple(as_list(self.ssh_source_ranges)),
                ssh_key_mode=self.ssh_key_mode,
                tags=tuple(as_list(self.tags)),
                boot_disk_size_gb=self.boot_disk_size_gb,
                image_project=self.image_project,
                image_family=self.image_family,
                max_run_duration_s=self._max_run_duration_s(context),
                capacity_wait_s=(
                    seconds(self.max_wait_for_capacity) if self.provisioning_model == "FLEX_START" else None
                ),
                service_account=self.service_account,
                service_account_scopes=tuple(self.service_account_scopes),
                labels=dict(self.labels or {}),
                metadata=dict(self.metadata or {}),
            )
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

    def _check_network(self, spec: compute.TpuVmSpec) -> None:
        """What the insert would refuse after minutes of waiting, refused now.

        A missing network, or a custom-mode one (its subnets are not made for you) without ``subnetwork``."""
        network = self.hook.get_network(spec.project_id, spec.network)
        if network is None:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "network", spec.network, f"does not exist in {spec.project_id}", "name a VPC network"
                ),
            )
        custom_mode = network.get("autoCreateSubnetworks") is False and not network.get("IPv4Range")
        if custom_mode and not spec.subnetwork:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "subnetwork",
                    None,
                    f"is required: network {spec.network!r} is a custom-mode VPC",
                    "name the subnetwork of the zones' region the VMs go in",
                ),
            )
        if spec.network_path != "external":
            self._check_egress(spec)

    def _check_egress(self, spec: compute.TpuVmSpec) -> None:
        """Refuses VMs without an external IP where their network gives them no way out.

        Such a VM reaches the internet only through Cloud NAT and Google's APIs only with Private Google Access
        (cloud.google.com/nat/docs/overview, cloud.google.com/vpc/docs/private-google-access).

        Without NAT the install (apt, PyPI, uv) and the Hub download fail on the VM, without Private Google Access
        every ``gs://`` read and write: refused here, for each zone's region, before anything is created."""
        problems = []
        for region, subnetwork in sorted({compute.subnetwork_of(spec, zone) for zone in spec.zones}):
            found = self.hook.get_subnetwork(spec.project_id, region, subnetwork)
            if found is None:
                problems.append(f"subnetwork {subnetwork!r} does not exist in region {region}")
                continue
            if not found.get("privateIpGoogleAccess"):
                problems.append(
                    f"subnetwork {subnetwork!r} in {region} has no Private Google Access, so the VMs reach no "
                    f"Cloud Storage: gcloud compute networks subnets update {subnetwork} --region={region} "
                    "--enable-private-ip-google-access"
                )
            routers = self.hook.list_routers(spec.project_id, region)
            if not compute.nat_covers(routers, spec.network, region, subnetwork):
                problems.append(
                    f"no Cloud NAT covers subnetwork {subnetwork!r} in {region}, so the VMs reach no package index "
                    f"and no Hugging Face Hub: gcloud compute routers create posttrain-nat --network={spec.network} "
                    f"--region={region} && gcloud compute routers nats create posttrain-nat --router=posttrain-nat "
                    f"--region={region} --auto-allocate-nat-external-ips --nat-all-subnet-ip-ranges"
                )
        if problems:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "network_path",
                    spec.network_path,
                    "gives the VMs no external IP, and their network lacks what they need instead: "
                    + "; ".join(problems),
                    "run the gcloud commands above (README: Google Cloud, the VMs' network), or use "
                    "network_path external",
                ),
            )

    def execute(self, context: Context) -> Any:
        spec = self._spec(context)
        name = self._name(context)
        self._check_network(spec)
        if self.conversion_task_id:
            self._wait_for_conversion(context, spec)
        return self._start(context, spec, name)

    def _start(self, context: Context, spec: compute.TpuVmSpec, name: str) -> Any:
        """Request the VM: reuse an earlier try's live instance, replace a dead one, else insert."""
        start = Progress(requested_at=time.time())
        self._record(context, spec, name, None, status="CREATING")
        for zone in spec.zones:
            existing = self.hook.get_instance(spec.project_id, zone, name)
            if existing is None:
                continue
            owner, ours = (existing.get("labels") or {}).get(compute.DEPLOYMENT_LABEL), deployment_id()
            if owner != ours:
                raise VmCreateError(
                    f"Instance {name} in {zone} exists but was made by Airflow deployment {owner!r}, not this one "
                    f"({ours!r}): refusing to use or delete it. Give each deployment sharing project "
                    f"{spec.project_id} its own [tpu_posttrain] deployment_id."
                )
            status = existing.get("status")
            progress = start._replace(zone_index=spec.zones.index(zone))
            if status in compute.LIVE_STATES:
                self.log.info("Reusing instance %s in %s (status %s) from an earlier try", name, zone, status)
                self._record(context, spec, name, zone, status=status)
                return self._complete_or_defer(
                    context, [], {"name": name, "zone": zone}, Phase.WAIT, progress
                )
            self.log.info(
                "Instance %s in %s is %s: deleting it before creating a fresh one", name, zone, status
            )
            operation = self.hook.delete_instance(
                spec.project_id, zone, name, self._request_id(context, name, zone, "replace")
            )
            if operation:
                return self._complete_or_defer(
                    context, [{"name": operation, "zone": zone}], None, Phase.REPLACE, start._replace(attempt=1)
                )
        return self._insert_when_capacity(context, spec, name, start)

    def _insert(self, context: Context, spec: compute.TpuVmSpec, name: str, progress: Progress) -> Any:
        """Insert in ``zones[zone_index]`` and defer.

        The requestId is stable for this try and this attempt, so the client's own retries never create twice;
        a later attempt (after a replacement, or after yielding capacity) gets a new one, or Compute would
        answer with the old, finished insert."""
        if progress.zone_index >= len(spec.zones):
            raise CapacityUnavailableError(
                f"No {spec.accelerator_type} capacity in any zone ({'; '.join(progress.stockouts)}). No "
                "instance was left behind. Add zones, use a reservation or FLEX_START, or let the task retry later."
            )
        zone = spec.zones[progress.zone_index]
        operations = []
        if spec.opens_firewall:
            firewall_op = self.hook.insert_firewall(
                spec.project_id,
                compute.ssh_firewall_body(spec, name),
                self._request_id(context, name, "firewall"),
            )
            if firewall_op:
                operations.append({"name": firewall_op, "zone": None})
        expires_at = vm_expires_at(spec)
        labels = compute.ownership_labels(
            context["dag"].dag_id, context["run_id"], self.task_id, expires_at, deployment_id()
        )
        labels[capacity.GROUP_LABEL] = self._group(spec)
        metadata = {"airflow-dag-id": context["dag"].dag_id, "airflow-run-id": context["run_id"]}
        ssh_keys, _ = self._authorize_key(spec, expires_at)
        body = compute.instance_body(spec, name, zone, labels, metadata, ssh_keys)
        if progress.without_max_run_duration:
            body["scheduling"].pop("maxRunDuration", None)
        self.log.info("Creating %s (%s, %s) in %s", name, spec.machine_type, spec.provisioning_model, zone)
        self._record(context, spec, name, zone, status="CREATING")
        VmConsoleLink().push(context, VmConsoleLink.url(spec.project_id, zone, name))
        request_id = self._request_id(context, name, zone, "insert", progress.attempt)
        from google.api_core.exceptions import BadRequest, Forbidden

        try:
            operation = self.hook.insert_instance(spec.project_id, zone, body, request_id)
        except Forbidden as err:
            if "quotaExceeded" not in str(err) and "Quota" not in err.message:
                raise
            self._delete_leftover(context, spec, name, zone)  # the firewall rule made just before
            raise QuotaExceededError(  # refused at once: Compute checks some quotas before it accepts an insert
                f"Quota exceeded creating {name} in {zone}: {err.message}. Request a quota increase for "
                f"{spec.accelerator_type} in that region (IAM & Admin > Quotas) or choose another region."
            ) from None
        except BadRequest as err:
            if "does not exist in zone" in err.message:
                self._delete_leftover(context, spec, name, zone)  # the firewall rule made just before
                raise InvalidInputError(  # a retry would be refused the same way
                    f"zones: {zone} does not sell {spec.machine_type} ({spec.accelerator_type}): {err.message} "
                    "Nothing was created. Give zones that offer it (for TPU v6e: "
                    "cloud.google.com/tpu/docs/regions-zones)."
                ) from None
            if "The referenced image resource cannot be found" in err.message:
                self._delete_leftover(context, spec, name, zone)
                raise InvalidInputError(
                    f"image_family: projects/{spec.image_project}/global/images/family/{spec.image_family} does "
                    f"not exist: {err.message} Nothing was created. Give an image family that exists (gcloud "
                    "compute images describe-from-family)."
                ) from None
            if "maxRunDuration" not in str(err) or progress.without_max_run_duration:
                raise
            self.log.warning(
                "Compute refused scheduling.maxRunDuration for a %s VM: creating %s once more without it; its "
                "backstop is then the reaper, which deletes it after its expires-at label. (%s)",
                spec.provisioning_model,
                name,
                err.message,
            )
            progress = progress._replace(attempt=progress.attempt + 1, without_max_run_duration=True)
            return self._insert(context, spec, name, progress)
        if operation:
            operations.append({"name": operation, "zone": zone})
        else:
            self.log.info("Instance %s already exists in %s: waiting for it instead", name, zone)
        # A race for the group's last place is decided once the insert has finished (``execute_complete``):
        # Compute refuses to delete an instance whose insert is unfinished (400 resourceNotReady).
        return self._complete_or_defer(
            context, operations, {"name": name, "zone": zone}, Phase.CREATE, progress
        )

    def _complete_or_defer(
        self,
        context: Context,
        operations: list[dict],
        instance: dict | None,
        phase: Phase,
        progress: Progress,
    ) -> Any:
        """Wait up to ``inline_wait`` seconds here (a reused VM, a quick operation), else in the triggerer."""
        from airflow_tpu_posttrain.triggers.compute import ComputeOperationsTrigger

        state = {"phase": phase.value, **progress._asdict()}
        event = self.hook.settle_within(self.project, operations, instance, self.inline_wait)
        if event is None:
            self.defer(
                trigger=ComputeOperationsTrigger(
                    operations=operations, instance=instance, state=state, **self._trigger_arguments()
                ),
                method_name="execute_complete",
                timeout=self.wait_timeout,
            )
        return self.execute_complete(context, {**event, "state": state})

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        """Where the wait of one phase (``create_phases``) ended: take the next action."""
        state = dict(event["state"])
        phase, vm = Phase(state.pop("phase")), state.pop("vm", None)
        progress = Progress(**{**state, "stockouts": tuple(state.get("stockouts") or ())})
        spec = self._spec(context)
        name = self._name(context)
        errors = event.get("errors") or []
        lost_race = (
            event["status"] == "success"
            and phase in create_phases.RUNNING_PHASES
            and self._lost_the_race(spec, name)
        )
        action = create_phases.next_action(
            phase, event["status"], compute.classify_errors(errors) if errors else None, lost_race
        )
        if action is Action.SKIP or action is Action.START:
            self._conversion_waited(context, event)
            return self._start(context, spec, name)
        if action is Action.FAIL_NO_CAPACITY:
            raise self._no_capacity(spec, name, event.get("in_use", ""))
        if action is Action.INSERT:
            return self._insert_when_capacity(context, spec, name, progress)
        if action is Action.YIELD_PLACE:
            return self._yield_capacity(context, spec, name, progress)
        zone = spec.zones[progress.zone_index]
        if action is Action.AWAIT_LOGIN:
            return self._ready_or_defer(context, spec, name, progress, event["instance"])
        if action is Action.DONE:
            self._check_login(context, spec, name, zone, vm, event["host_keys"])
            record = self._record(
                context, spec, name, zone, **vm, host_keys=event["host_keys"], requested_at=progress.requested_at
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
        detail = compute.describe_errors(errors)
        if action is Action.NEXT_ZONE:
            return self._next_zone(context, spec, name, progress, detail)
        if action in create_phases.DELETES_FIRST:
            self._delete_leftover(context, spec, name, zone)
        if action is Action.WAIT_FOR_RESERVATION:
            self.log.warning("Reservation %s is fully used: %s", spec.reservation, detail)
            return self._wait_for_capacity(
                context, spec, name, progress._replace(attempt=progress.attempt + 1), ""
            )
        if action is Action.FAIL_NOT_READY:
            raise VmNotReadyError(f"{detail}. The VM was deleted; a retry creates a new one.")
        if action is Action.FAIL_QUOTA:
            raise QuotaExceededError(
                f"Quota exceeded creating {name} in {zone}: {detail}. Request a quota increase for "
                f"{spec.accelerator_type} in that region (IAM & Admin > Quotas) or choose another region."
            )
        if action is Action.FAIL_RESERVATION:
            raise ReservationError(
                f"Reservation problem creating {name} in {zone}: {detail}. Check that reservation "
                f"'{spec.reservation}' exists in {zone}, is of {spec.machine_type} and is shared with this "
                "project, or choose another provisioning_model."
            )
        raise VmCreateError(f"{phase} of {name} in {zone} failed: {detail}")

    def _next_zone(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: Progress, detail: str
    ) -> Any:
        """A stock-out: delete what the zone left behind (if anything), then insert in the next zone."""
        zone = spec.zones[progress.zone_index]
        self.log.warning("Zone %s is out of %s capacity: %s", zone, spec.accelerator_type, detail)
        progress = progress._replace(
            zone_index=progress.zone_index + 1, stockouts=(*progress.stockouts, f"{zone}: {detail}")
        )
        if self.hook.get_instance(spec.project_id, zone, name):
            operation = self.hook.delete_instance(
                spec.project_id, zone, name, self._request_id(context, name, zone, "stockout")
            )
            if operation:
                return self._complete_or_defer(
                    context, [{"name": operation, "zone": zone}], None, Phase.REPLACE, progress
                )
        return self._insert(context, spec, name, progress)

    def _delete_leftover(self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str) -> None:
        """Delete-on-error: a failing create cleans up (its firewall rule too).

        A teardown does not run when its setup failed."""
        if spec.opens_firewall:
            self.hook.delete_firewall(
                spec.project_id,
                compute.firewall_name(name),
                self._request_id(context, name, "firewall-on-error"),
            )
        if self.hook.get_instance(spec.project_id, zone, name) is None:
            return
        self.log.warning(
            "Deleting %s in %s: the create failed and the instance must not outlive it", name, zone
        )
        self.hook.delete_instance(
            spec.project_id, zone, name, self._request_id(context, name, zone, "on-error")
        )
