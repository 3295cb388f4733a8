"""Create and delete the TPU VM (a Compute Engine instance) of one DAG run, deferrably and idempotently."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.exceptions import (
    CapacityTimeoutError,
    CapacityUnavailableError,
    InvalidInputError,
    QuotaExceededError,
    ReservationError,
    VmAccessError,
    VmCreateError,
    VmDeleteError,
    VmNotReadyError,
)
from airflow_tpu_posttrain.recipes import access, capacity, compute, cost, create_phases, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR
from airflow_tpu_posttrain.recipes.create_phases import Action, Phase
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

# Without a DAG-level timeout to derive it from, the cloud-side backstop deletes the VM after this long.
DEFAULT_MAX_RUN_DURATION = timedelta(hours=12)
# Added to the DAG's dagrun_timeout so teardown normally wins the race against the backstop.
BACKSTOP_MARGIN = timedelta(minutes=30)
_REQUEST_NAMESPACE = uuid.UUID("6f1c1e0a-5b7d-4f0e-9d55-2f6c7a3b9e10")


def _expires_at(spec: compute.TpuVmSpec) -> int:
    """When the VM (and the key that lets Airflow in) expires."""
    return compute.expiry(spec.max_run_duration_s, int(DEFAULT_MAX_RUN_DURATION.total_seconds()))


def _request_id(context: Context, *parts: object) -> str:
    """A requestId stable within one try of one task instance (the same call repeated by the client's retries,
    or after a deferral, is recognised by Compute as a repeat) and new for every try and every re-run: the task
    instance's id changes with each try, so a re-run never replays an earlier run's finished operations."""
    return str(uuid.uuid5(_REQUEST_NAMESPACE, "/".join(str(p) for p in (context["ti"].id, *parts))))


def _as_list(value: Sequence[str] | str | None) -> list[str]:
    """Zones from Python, a rendered template or a Param: a list, or a comma-separated string."""
    if value is None:
        return []
    if isinstance(value, str):
        return [
            part.strip()
            for part in value.strip("[]").replace("'", "").replace('"', "").split(",")
            if part.strip()
        ]
    return list(value)


class _Progress(NamedTuple):
    """Where a create stands across deferrals (the triggers echo it back as their event's ``state``)."""

    zone_index: int = 0
    stockouts: tuple[str, ...] = ()
    attempt: int = 0  # a new insert requestId after each replacement or yielded place
    deadline: float | None = None  # Unix time the wait for capacity ends
    without_max_run_duration: bool = False  # Compute refused scheduling.maxRunDuration for this model


def _ssh_answers(address: str | None, port: int, proxy_command: str | None = None) -> bool:
    """Whether an SSH server answers on ``address:port``, or at the other end of ``proxy_command`` (an IAP
    tunnel); its banner read, not only the TCP handshake."""
    if proxy_command:
        with subprocess.Popen(
            proxy_command,
            shell=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        ) as tunnel:
            try:
                readable, _, _ = select.select([tunnel.stdout], [], [], 5)
                return bool(readable) and os.read(tunnel.stdout.fileno(), 4).startswith(b"SSH-")
            finally:
                tunnel.kill()
    if not address:
        return False
    try:
        with socket.create_connection((address, port), timeout=2) as conn:
            conn.settimeout(2)
            return conn.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _seconds(value: timedelta | int | float | str | None) -> int | None:
    """Seconds from a timedelta, a number, or a rendered template (a string when not rendered natively)."""
    if value is None:
        return None
    return int(value.total_seconds() if isinstance(value, timedelta) else float(value))


class _ComputeOperator(BaseOperator):
    """What create and delete share: the connection, the endpoint and how they build the hook."""

    request_id_salt = ""  # set when the task's work runs again within one try (a VM recovery)

    def __init__(
        self,
        *,
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        poll_interval: float = 10.0,
        inline_wait: float = 5.0,
        name_prefix: str = "tpu",
        wait_timeout: timedelta = timedelta(hours=3),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.wait_timeout = wait_timeout
        self.project_id = project_id
        self.gcp_conn_id = gcp_conn_id
        self.api_endpoint = api_endpoint
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.inline_wait = inline_wait
        self.name_prefix = name_prefix

    def _request_id(self, context: Context, *parts: object) -> str:
        return _request_id(context, *([self.request_id_salt] if self.request_id_salt else []), *parts)

    @cached_property
    def hook(self) -> TpuVmHook:
        from airflow_tpu_posttrain.hooks.compute import TpuVmHook

        return TpuVmHook(
            gcp_conn_id=self.gcp_conn_id,
            api_endpoint=self.api_endpoint,
            impersonation_chain=self.impersonation_chain,
        )

    @property
    def project(self) -> str:
        project = self.project_id or self.hook.project_id
        if not project:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "project_id",
                    None,
                    "is not set",
                    "pass project_id or set 'project' in the Google Cloud connection",
                ),
            )
        return project

    def _trigger_arguments(self) -> dict[str, Any]:
        return {
            "project_id": self.project,
            "gcp_conn_id": self.gcp_conn_id,
            "api_endpoint": self.api_endpoint,
            "impersonation_chain": self.impersonation_chain,
            "poll_interval": self.poll_interval,
        }


class TpuVmCreateOperator(_ComputeOperator):
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
    ssh_proxy_command, host_keys, machine_type, accelerator_type, firewall``; a partial record with the name is pushed before the first API
    call so a teardown can find the VM even if this task dies half-way.

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
    )
    ui_color = "#d5e8f7"
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

    def _max_run_duration_s(self, context: Context) -> int:
        explicit = _seconds(self.max_run_duration)
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
                zones=tuple(_as_list(self.zones)),
                accelerator_type=self.accelerator_type,
                provisioning_model=self.provisioning_model,
                reservation=self.reservation or None,
                network=self.network,
                subnetwork=self.subnetwork or None,
                network_path=self.network_path,
                ssh_source_ranges=tuple(_as_list(self.ssh_source_ranges)),
                ssh_key_mode=self.ssh_key_mode,
                tags=tuple(_as_list(self.tags)),
                boot_disk_size_gb=self.boot_disk_size_gb,
                image_project=self.image_project,
                image_family=self.image_family,
                max_run_duration_s=self._max_run_duration_s(context),
                capacity_wait_s=(
                    _seconds(self.max_wait_for_capacity) if self.provisioning_model == "FLEX_START" else None
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
        return compute.instance_name(context["dag"].dag_id, context["run_id"], self.name_prefix)

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
        """What the insert would refuse after minutes of waiting, refused now: a missing network, or a
        custom-mode one (its subnets are not made for you) without ``subnetwork``."""
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

    def execute(self, context: Context) -> Any:
        spec = self._spec(context)
        name = self._name(context)
        self._check_network(spec)
        self._record(context, spec, name, None, status="CREATING")
        for zone in spec.zones:
            existing = self.hook.get_instance(spec.project_id, zone, name)
            if existing is None:
                continue
            status = existing.get("status")
            progress = _Progress(zone_index=spec.zones.index(zone))
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
                    context, [{"name": operation, "zone": zone}], None, Phase.REPLACE, _Progress(attempt=1)
                )
        return self._insert_when_capacity(context, spec, name, _Progress())

    def _capacity_group(self, spec: compute.TpuVmSpec) -> list[dict]:
        """The live instances of this VM's capacity group, from Compute (the group's label, in its zones)."""
        label_filter = f"labels.{capacity.GROUP_LABEL} = {self._group(spec)}"
        return [
            i for zone in spec.zones for i in self.hook.list_instances(spec.project_id, zone, label_filter)
        ]

    def _group(self, spec: compute.TpuVmSpec) -> str:
        return capacity.group_label(
            spec.project_id, spec.reservation, spec.zones, spec.machine_type, self.name_prefix
        )

    def _insert_when_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress
    ) -> Any:
        """Insert now if the capacity group has room (``max_tpu_vms``), else wait for it in the triggerer."""
        if self.max_tpu_vms is None:
            return self._insert(context, spec, name, progress)
        others = [i for i in self._capacity_group(spec) if i.get("name") != name]
        if len(capacity.holders(others)) < self.max_tpu_vms:
            return self._insert(context, spec, name, progress)
        return self._wait_for_capacity(
            context, spec, name, progress, capacity.describe(others, self.max_tpu_vms)
        )

    def _wait_for_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress, in_use: str
    ) -> None:
        """Defer until the group has room (or, ``in_use`` empty, a full reservation is worth trying again)."""
        from airflow_tpu_posttrain.triggers.capacity import TpuCapacityTrigger

        deadline = progress.deadline or time.time() + _seconds(self.max_wait_for_capacity)
        progress = progress._replace(deadline=deadline)
        if time.time() >= deadline:
            raise self._no_capacity(spec, name, in_use)
        self.log.info(
            "Waiting for TPU capacity (up to %s s): %s",
            int(deadline - time.time()),
            in_use or f"reservation {spec.reservation} is fully used",
        )
        self.defer(
            trigger=TpuCapacityTrigger(
                zones=list(spec.zones),
                group=self._group(spec),
                cap=self.max_tpu_vms if in_use else None,
                own_name=name,
                deadline=deadline,
                retry_after=max(3 * self.poll_interval, 1.0),
                state={"phase": Phase.CAPACITY.value, **progress._asdict()},
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=max(0.0, deadline - time.time()) + 300),
        )

    def _no_capacity(self, spec: compute.TpuVmSpec, name: str, in_use: str) -> CapacityTimeoutError:
        held = in_use or f"reservation {spec.reservation} fully used"
        return CapacityTimeoutError(
            f"No TPU capacity for {name} within {_seconds(self.max_wait_for_capacity)} s ({held}). Nothing was "
            "created. Raise max_wait_for_capacity or max_tpu_vms, or trigger the run later."
        )

    def _insert(self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress) -> Any:
        """Insert in ``zones[zone_index]`` and defer. The requestId is stable for this try and this attempt, so
        the client's own retries never create twice; a later attempt (after a replacement, or after yielding
        capacity) gets a new one, or Compute would answer with the old, finished insert."""
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
        expires_at = _expires_at(spec)
        labels = compute.ownership_labels(context["dag"].dag_id, context["run_id"], self.task_id, expires_at)
        labels[capacity.GROUP_LABEL] = self._group(spec)
        metadata = {"airflow-dag-id": context["dag"].dag_id, "airflow-run-id": context["run_id"]}
        ssh_keys, _ = self._authorize_key(spec, expires_at)
        body = compute.instance_body(spec, name, zone, labels, metadata, ssh_keys)
        if progress.without_max_run_duration:
            body["scheduling"].pop("maxRunDuration", None)
        self.log.info("Creating %s (%s, %s) in %s", name, spec.machine_type, spec.provisioning_model, zone)
        self._record(context, spec, name, zone, status="CREATING")
        request_id = self._request_id(context, name, zone, "insert", progress.attempt)
        from google.api_core.exceptions import BadRequest

        try:
            operation = self.hook.insert_instance(spec.project_id, zone, body, request_id)
        except BadRequest as err:
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
        if self._lost_the_race(spec, name):
            return self._yield_capacity(context, spec, name, progress)
        return self._complete_or_defer(
            context, operations, {"name": name, "zone": zone}, Phase.CREATE, progress
        )

    def _lost_the_race(self, spec: compute.TpuVmSpec, name: str) -> bool:
        """Right after the insert, before the VM runs: whether another create took the last place first (both
        saw room and inserted; the later by creation time yields). Checked again once RUNNING, in case Compute
        listed the new instance late."""
        return self.max_tpu_vms is not None and capacity.over_cap(
            name, self._capacity_group(spec), self.max_tpu_vms
        )

    def _authorize_key(self, spec: compute.TpuVmSpec, expires_at: int) -> tuple[str | None, str]:
        """Let the SSH connection's key in until the VM expires: the ``ssh-keys`` line to put in the metadata
        (None in ``oslogin`` mode, where the key goes into the OS Login profile now), and the login to use."""
        from airflow_tpu_posttrain.hooks.vm import client_identity

        try:
            client = client_identity(self.ssh_conn_id)
            if spec.ssh_key_mode == "metadata":
                return access.ssh_keys_metadata(client.login, client.public_key, expires_at), client.login
            public_key = access.public_key("ssh public key", client.public_key)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        return None, self._import_oslogin_key(spec, public_key, expires_at)

    def _import_oslogin_key(self, spec: compute.TpuVmSpec, public_key: str, expires_at: int) -> str:
        from google.api_core.exceptions import PermissionDenied, Unauthenticated

        from airflow_tpu_posttrain.hooks.oslogin import OsLoginKeyHook

        hook = OsLoginKeyHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
        user = self.oslogin_user or hook.account_email()
        try:
            login = hook.import_key(
                access.oslogin_user("oslogin_user", user), public_key, expires_at, spec.project_id
            )
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        except (PermissionDenied, Unauthenticated) as err:
            raise VmAccessError(
                f"OS Login refused to add the SSH key to {user}'s profile: {err.message}. Use the account's own "
                "credentials (or set oslogin_user to it) and grant it roles/compute.osAdminLogin on the project."
            ) from err
        self.log.info("SSH key added to %s's OS Login profile until the VM expires; login %s", user, login)
        return login

    def _complete_or_defer(
        self,
        context: Context,
        operations: list[dict],
        instance: dict | None,
        phase: Phase,
        progress: _Progress,
    ) -> Any:
        """Wait up to ``inline_wait`` seconds here (a reused VM, a quick operation), else in the triggerer."""
        from airflow_tpu_posttrain.triggers.compute import ComputeOperationsTrigger

        state = {"phase": phase.value, **progress._asdict()}
        event = self._wait_briefly(operations, instance)
        if event is None:
            self.defer(
                trigger=ComputeOperationsTrigger(
                    operations=operations, instance=instance, state=state, **self._trigger_arguments()
                ),
                method_name="execute_complete",
                timeout=self.wait_timeout,
            )
        return self.execute_complete(context, {**event, "state": state})

    def _wait_briefly(self, operations: list[dict], instance: dict | None) -> dict | None:
        """``ComputeOperationsTrigger``'s event, when the operations and the instance settle within
        ``inline_wait``; else None."""
        deadline = time.monotonic() + self.inline_wait
        pending = list(operations)
        while True:
            while pending:
                operation = self.hook.get_operation(self.project, pending[0]["name"], pending[0].get("zone"))
                if operation.get("status") != "DONE":
                    break
                errors = operation.get("error", {}).get("errors", [])
                if errors:
                    return {"status": "error", "instance": None, "errors": errors}
                pending.pop(0)
            if not pending:
                if not instance:
                    return {"status": "success", "instance": None, "errors": []}
                found = self.hook.get_instance(self.project, instance["zone"], instance["name"])
                if found and found.get("status") == "RUNNING":
                    return {"status": "success", "instance": found, "errors": []}
            if time.monotonic() + 0.5 > deadline:
                return None
            time.sleep(0.5)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        """Where the wait of one phase (``create_phases``) ended: take the next action."""
        state = dict(event["state"])
        phase, vm = Phase(state.pop("phase")), state.pop("vm", None)
        progress = _Progress(**{**state, "stockouts": tuple(state.get("stockouts") or ())})
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
            record = self._record(context, spec, name, zone, **vm, host_keys=event["host_keys"])
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
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress, detail: str
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

    def _yield_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress
    ) -> Any:
        """Another run's VM of the group was created first and the group is over its cap: delete ours, wait."""
        zone = spec.zones[progress.zone_index]
        self.log.warning(
            "%s is over the cap of %s TPU VMs (another run created its VM first): deleting it and waiting",
            name,
            self.max_tpu_vms,
        )
        operation = self.hook.delete_instance(
            spec.project_id, zone, name, self._request_id(context, name, zone, "yield", progress.attempt)
        )
        progress = progress._replace(attempt=progress.attempt + 1)
        operations = [{"name": operation, "zone": zone}] if operation else []
        return self._complete_or_defer(context, operations, None, Phase.YIELD, progress)

    def _ready_or_defer(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: _Progress, instance: dict
    ) -> Any:
        """Wait until the RUNNING VM can be logged into: briefly here, else in the triggerer."""
        from airflow_tpu_posttrain.hooks.vm import client_identity

        zone = spec.zones[progress.zone_index]
        interface = (instance.get("networkInterfaces") or [{}])[0]
        vm = {
            "status": instance.get("status"),
            "internal_ip": interface.get("networkIP"),
            "external_ip": ((interface.get("accessConfigs") or [{}])[0]).get("natIP"),
            "ssh_address": access.ssh_address(instance, spec.network_path),
            "ssh_port": client_identity(self.ssh_conn_id).port,
            "ssh_login": self._authorize_key(spec, _expires_at(spec))[1],
            "ssh_proxy_command": (
                access.iap_proxy_command(spec.project_id, zone, name) if spec.network_path == "iap" else None
            ),
            "network_path": spec.network_path,
            "self_link": instance.get("selfLink"),
            # The cloud-side backstop the VM has (None: Compute refused it; the reaper is the backstop).
            "max_run_duration_s": None if progress.without_max_run_duration else spec.max_run_duration_s,
        }
        self.log.info("VM %s is RUNNING in %s; waiting for its host keys and its SSH port", name, zone)
        self._record(context, spec, name, zone, **vm)
        deadline = time.monotonic() + self.inline_wait
        while time.monotonic() < deadline:
            host_keys = self.hook.get_host_keys(spec.project_id, zone, name)
            if host_keys and _ssh_answers(vm["ssh_address"], vm["ssh_port"], vm["ssh_proxy_command"]):
                event = {"status": "ready", "host_keys": host_keys}
                return self.execute_complete(
                    context, {**event, "state": {"phase": Phase.READY.value, **progress._asdict(), "vm": vm}}
                )
            time.sleep(0.5)
        from airflow_tpu_posttrain.triggers.compute import VmReadyTrigger

        self.defer(
            trigger=VmReadyTrigger(
                zone=zone,
                name=name,
                address=vm["ssh_address"],
                port=vm["ssh_port"],
                proxy_command=vm["ssh_proxy_command"],
                timeout=self.ready_timeout.total_seconds(),
                state={"phase": Phase.READY.value, **progress._asdict(), "vm": vm},
                **{**self._trigger_arguments(), "poll_interval": min(self.poll_interval, 5.0)},
            ),
            method_name="execute_complete",
            timeout=self.ready_timeout + timedelta(minutes=1),
        )

    def _delete_leftover(self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str) -> None:
        """Delete-on-error: a teardown does not run when its setup failed, so a failing create cleans up (its
        firewall rule too)."""
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


class TpuDeleteOperator(_ComputeOperator):
    """Delete the TPU VM (or CPU VM) of this DAG run and its SSH firewall rule, from the triggerer. Built to be the
    teardown: the worker only works out what to delete and defers at once.

    It finds the VM from the create task's XCom (also the partial record a failed create leaves), in each of the
    create's zones (a recovery may have made it again in another), and, when there is no XCom, by its
    deterministic name in each of ``zones``. A VM that is already gone counts as
    success. Returns (XCom) ``{"deleted": bool, "name", "zone", "firewall_deleted": bool}``, and for a VM it
    deleted what the VM cost: ``machine_type``, ``provisioning_model``, ``vm_seconds`` (creation to deletion,
    Compute's timestamps), ``usd_per_hour`` and ``cost_usd`` (None when ``prices`` has no price for it).

    :param create_task_id: the task id of the :class:`TpuVmCreateOperator` whose VM to delete.
    :param zones: where to look when there is no XCom (a list, or a comma-separated string).
    :param instance_name: delete this instance instead of the deterministic name.
    :param firewall: also delete the deterministic SSH firewall rule when there is no XCom.
    :param prices: USD per hour by machine type and provisioning model (``recipes.cost.price_table``); None:
        the defaults, ``recipes.cost.DEFAULT_PRICES``.
    """

    template_fields: Sequence[str] = ("project_id", "zones", "instance_name", "api_endpoint")
    ui_color = "#f7d5d5"

    def __init__(
        self,
        *,
        create_task_id: str | None = "create_tpu_vm",
        zones: Sequence[str] | str | None = None,
        instance_name: str | None = None,
        firewall: bool = False,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.create_task_id = create_task_id
        self.zones = zones
        self.instance_name = instance_name
        self.firewall = firewall
        self.prices = prices

    def _target(self, context: Context) -> tuple[str, list[str], str | None]:
        record = None
        if self.create_task_id:
            record = context["ti"].xcom_pull(task_ids=self.create_task_id)
        if record and record.get("name"):
            self.project_id = self.project_id or record.get("project")
            # The recorded zone first, then the others: a recovery may have created the VM again elsewhere.
            zones = list(dict.fromkeys(filter(None, [record.get("zone"), *(record.get("zones") or [])])))
            return record["name"], zones or _as_list(self.zones), record.get("firewall")
        name = self.instance_name or compute.instance_name(
            context["dag"].dag_id, context["run_id"], self.name_prefix
        )
        self.log.info("No XCom from %s: looking for %s by its deterministic name", self.create_task_id, name)
        return name, _as_list(self.zones), compute.firewall_name(name) if self.firewall else None

    def execute(self, context: Context) -> Any:
        name, zones, firewall = self._target(context)
        deletes = [
            {"name": name, "zone": zone, "request_id": self._request_id(context, name, zone, "delete")}
            for zone in zones
        ]
        if firewall:
            deletes.append(
                {"name": firewall, "zone": None, "request_id": self._request_id(context, firewall, "delete")}
            )
        self.log.info(
            "Deleting %s (looking in %s)%s", name, zones, f" and firewall rule {firewall}" if firewall else ""
        )
        from airflow_tpu_posttrain.triggers.compute import ComputeDeleteTrigger

        self.defer(
            trigger=ComputeDeleteTrigger(
                deletes=deletes,
                state={"name": name, "zones": zones, "firewall": firewall},
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            timeout=self.wait_timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        state = event["state"]
        if event["status"] != "success":
            raise VmDeleteError(
                f"Deleting {state['name']} failed: {compute.describe_errors(event.get('errors', []))}"
            )
        deleted = event["deleted"]
        vm = next((d for d in deleted if d["zone"]), None)
        result = {
            "deleted": vm is not None,
            "name": state["name"],
            "zone": vm and vm["zone"],
            "firewall_deleted": any(d["zone"] is None for d in deleted),
        }
        if vm is None:
            self.log.info("Nothing to delete: %s was not found in %s", state["name"], state["zones"])
            return result
        self.log.info(
            "Deleted %s in %s%s",
            state["name"],
            vm["zone"],
            " and its firewall rule" if result["firewall_deleted"] else "",
        )
        if vm.get("instance") and vm.get("ended"):  # not when an earlier try's delete already ended
            spent = cost.vm_cost(state["name"], vm["instance"], vm["ended"], self.prices)
            self.log.info("Cost: %s", spent.describe())
            result.update(spent.as_dict())
        return result
