"""What every create of the run's VMs takes, one VM or a slice of them: the VM's shape, its place under the cap."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.defaults import MAX_WAIT_FOR_CAPACITY_MINUTES, SSH_CONN_ID
from airflow_tpu_posttrain.operators.compute_base import ComputeOperator, as_list, max_run_duration_s
from airflow_tpu_posttrain.recipes import compute

if TYPE_CHECKING:
    from airflow.sdk import Context


class VmShapeOperator(ComputeOperator):
    """The VM's shape (machine, provisioning, network, disk, identity, expiry, labels, metadata) and its cap.

    :param accelerator_type: the TPU (``v6e-1`` … ``v6e-256``, ``recipes/accelerators.py``; the machine type is
        derived from it), or ``cpu`` for a CPU VM (a single VM only).
    :param provisioning_model: RESERVATION_BOUND (the tutorials'; needs ``reservation``), STANDARD, SPOT or
        FLEX_START; a slice takes RESERVATION_BOUND or FLEX_START, the two Compute's bulk mode takes.
    :param reservation: the specific reservation to consume (RESERVATION_BOUND, or optionally STANDARD): a name,
        ``projects/P/reservations/R``, ``projects/P/reservations/R/reservationBlocks/B``, or with several zones
        one per zone, ``ZONE=RESERVATION,...`` (a reservation is zonal).
    :param network: VPC network name.
    :param subnetwork: subnetwork name (in the zone's region) or path; required on a custom-mode network.
    :param network_path: how Airflow reaches the VMs: ``internal`` (their internal IPs: Airflow inside the VPC, no
        external IP), ``external`` (their external IPs) or, for a single VM, ``iap`` (IAP's TCP forwarding,
        ``gcloud compute start-iap-tunnel`` as the SSH ProxyCommand; no external IP; a rule admitting IAP's range).
    :param ssh_conn_id: the SSH connection the MaxText steps use; its login and public key go into the VMs'
        ``ssh-keys`` metadata (a slice's: its template's, so every VM takes it).
    :param ready_timeout: how long RUNNING VMs may take to publish their host keys and answer on their SSH port.
    :param max_tpu_chips: how many TPU chips (as quota and reservations count them: a v6e-8 VM holds 8, a v6e-16
        slice 16) the VMs of one line of places may hold at once (a zone's reservation, else the zone and machine
        series), across DAGs and Airflow deployments: a create takes one place of all its chips in its zone's line
        before it inserts, waiting in line in the triggerer, first come first served, holding no VM
        (``recipes/places.py``); a create larger than the cap is refused before anything is made. Every create
        sharing a line must give the same cap. None (the default): no cap. Needs ``capacity_claims``.
    :param max_tpu_vms: deprecated, use ``max_tpu_chips``: the cap in VMs of this create's size (``max_tpu_vms``
        times its chips per VM).
    :param capacity_claims: the ``gs://`` location of the lines of places (one object per line); every create
        under the same cap, in every deployment, must name the same location.
    :param max_wait_for_capacity: how long to wait for a fully used reservation (a timedelta or seconds); then the
        task fails, having created nothing (a slice made in part is deleted whole). A wait in line for a place
        under the cap is not bounded by it: the line moves as the runs holding it end. With FLEX_START it is also
        how long Compute keeps a single VM PENDING in its queue (``params.requestValidForDuration``, at most 2 h).
    :param tags: network tags.
    :param boot_disk_size_gb: each VM's boot disk.
    :param image_project: the boot image's project.
    :param image_family: the boot image's family.
    :param max_run_duration: cloud-side backstop of every VM (``scheduling.maxRunDuration``, termination action
        DELETE). Default: the DAG's ``dagrun_timeout`` plus 30 minutes, else 12 hours.
    :param service_account: the VMs' service account (``default``: the project's Compute Engine default); what
        the VMs may do (gs:// checkpoints, logs) is granted to it in IAM.
    :param service_account_scopes: its OAuth scopes (default ``cloud-platform``, as Google's TPU examples).
    :param instance_name: override the deterministic name (rarely needed).
    :param labels: extra labels; the ownership labels (managed-by, dag, run, task, expires-at) are always set.
    :param metadata: extra instance metadata items (e.g. ``enable-oslogin: "TRUE"``).
    :param api_endpoint: Compute API endpoint override (a local emulator); default from the connection.
    """

    shape_template_fields: tuple[str, ...] = (
        "project_id",
        "accelerator_type",
        "provisioning_model",
        "reservation",
        "network",
        "subnetwork",
        "network_path",
        "ssh_conn_id",
        "max_wait_for_capacity",
        "capacity_claims",
        "tags",
        "instance_name",
        "labels",
        "metadata",
        "api_endpoint",
        *ComputeOperator.connection_template_fields,
    )

    def __init__(
        self,
        *,
        accelerator_type: str,
        provisioning_model: str = "RESERVATION_BOUND",
        reservation: str | None = None,
        network: str = "default",
        subnetwork: str | None = None,
        network_path: str = "external",
        ssh_conn_id: str = SSH_CONN_ID,
        ready_timeout: timedelta = timedelta(minutes=10),
        max_tpu_chips: int | None = None,
        max_tpu_vms: int | None = None,
        capacity_claims: str | None = None,
        max_wait_for_capacity: timedelta | int = timedelta(minutes=MAX_WAIT_FOR_CAPACITY_MINUTES),
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
        self.accelerator_type = accelerator_type
        self.provisioning_model = provisioning_model
        self.reservation = reservation
        self.network = network
        self.subnetwork = subnetwork
        self.network_path = network_path
        self.ssh_conn_id = ssh_conn_id
        self.ready_timeout = ready_timeout
        self.max_tpu_chips = max_tpu_chips
        self.max_tpu_vms = max_tpu_vms
        self.capacity_claims = capacity_claims
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

    def _shape(self, context: Context, zones: Sequence[str], **more: Any) -> compute.TpuVmSpec:
        """The VM's shape in ``zones``, with what only this create gives (``more``); raises ``SpecError``."""
        return compute.TpuVmSpec(
            project_id=self.project,
            zones=tuple(zones),
            accelerator_type=self.accelerator_type,
            provisioning_model=self.provisioning_model,
            reservation=self.reservation or None,
            network=self.network,
            subnetwork=self.subnetwork or None,
            network_path=self.network_path,
            tags=tuple(as_list(self.tags)),
            boot_disk_size_gb=self.boot_disk_size_gb,
            image_project=self.image_project,
            image_family=self.image_family,
            max_run_duration_s=max_run_duration_s(self.max_run_duration, context),
            service_account=self.service_account,
            service_account_scopes=tuple(self.service_account_scopes),
            labels=dict(self.labels or {}),
            metadata=dict(self.metadata or {}),
            **more,
        )
