"""The TPU VM as a Compute Engine instance: deterministic names, the insert body, labels, error kinds.

Pure: builds the REST JSON (camelCase, as in the Compute API v1 reference) that the hook sends with
``google-cloud-compute``. Defaults reproduce the tutorials' ``gcloud compute instances create`` flags.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

from airflow_tpu_posttrain.recipes import access, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR, accelerator
from airflow_tpu_posttrain.recipes.validation import SpecError

MANAGED_BY = "airflow-tpu-posttrain"
PROVISIONING_MODELS = ("RESERVATION_BOUND", "STANDARD", "SPOT", "FLEX_START")
DEFAULT_IMAGE_PROJECT = "ubuntu-os-accelerator-images"
DEFAULT_IMAGE_FAMILY = "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
# The CPU VM (split layout): a plain Ubuntu 22.04, as the TPU image's base.
CPU_IMAGE_PROJECT = "ubuntu-os-cloud"
CPU_IMAGE_FAMILY = "ubuntu-2204-lts"
# Google's TPU examples attach the default service account with this scope; IAM then decides what it may do
# (gs:// checkpoints need roles/storage.objectUser on the bucket, logs roles/logging.logWriter).
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_SERVICE_ACCOUNT = re.compile(r"^(default|[a-z0-9._-]+@[a-z0-9.-]+\.gserviceaccount\.com)$")
# Compute accepts 30 s .. 120 days for scheduling.maxRunDuration.
MIN_RUN_DURATION_S = 30
MAX_RUN_DURATION_S = 120 * 24 * 3600
FLEX_START_RUN_DURATION_S = (10 * 60, 7 * 24 * 3600)  # a flex-start VM runs 10 min to 7 days
# A flex-start request waits in Dynamic Workload Scheduler's queue for up to two hours (gcloud's
# --request-valid-for-duration; Google Cloud blog "Introducing Flex-start VMs", 2025-09-25).
FLEX_START_MAX_WAIT_S = 2 * 3600

# Instance states from which the VM can still become (or is) usable, and those that must be replaced: every
# status of Compute v1's Instance.status enum is one or the other (tests/test_compute_schema.py).
# PENDING: a FLEX_START VM with a wait time (or a TPU VM) waiting for capacity; it will run, so it is reused.
# PENDING_STOP (a graceful shutdown) and DEPROVISIONING (halted, its resources being released) are on the way
# down. https://cloud.google.com/compute/docs/instances/instance-lifecycle
LIVE_STATES = frozenset({"PENDING", "PROVISIONING", "STAGING", "RUNNING", "REPAIRING"})
DEAD_STATES = frozenset(
    {"PENDING_STOP", "STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED", "DEPROVISIONING"}
)


def _slug(value: str, max_len: int) -> str:
    """Lowercase ``[a-z0-9-]`` form of ``value`` for names and label values."""
    slug = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    return slug[:max_len].rstrip("-")


def run_hash(dag_id: str, run_id: str, deployment: str = "") -> str:
    """Short stable hash of a DAG run: the part of every id that keeps two runs apart.

    With ``deployment``, also apart from the same DAG run of another Airflow deployment (the same DAG files on
    the same schedule give the same ids) sharing the project."""
    key = f"{deployment}\0{dag_id}\0{run_id}" if deployment else f"{dag_id}\0{run_id}"
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def instance_name(dag_id: str, run_id: str, prefix: str = "tpu", deployment: str = "") -> str:
    """Deterministic Compute name for the VM of one DAG run of one deployment (<= 63 chars).

    ``<prefix>-<dag slug>-<hash>``, the hash of the deployment and the run."""
    validation.gce_name("name_prefix", prefix)
    digest = run_hash(dag_id, run_id, deployment)
    room = 63 - len(prefix) - len(digest) - 2
    middle = _slug(dag_id, room)
    return "-".join(part for part in (prefix, middle, digest) if part)


def firewall_name(instance: str, suffix: str = "ssh") -> str:
    """A firewall rule of ``instance`` (<= 63 chars): its SSH rule, or a slice's rule ``suffix``.

    A long instance name is cut, never its tail alone: the run's hash at its end is what keeps two runs' rules
    (and two instances') apart, so a cut name carries a hash of the whole name."""
    if len(instance) + len(suffix) + 1 <= 63:
        return f"{instance}-{suffix}"
    digest = hashlib.sha256(instance.encode()).hexdigest()[:10]
    return f"{instance[:48].rstrip('-')}-{digest}-{suffix}"


_FIREWALL_DESCRIPTION = f"{MANAGED_BY}: SSH to instance "
_SLICE_FIREWALL_DESCRIPTION = f"{MANAGED_BY}: between the VMs of slice "


def firewall_instance(rule: dict) -> str | None:
    """The instance (or slice) a rule of ours was made for, or None for any other rule.

    Firewall rules carry no labels: the description says."""
    description = rule.get("description") or ""
    for prefix in (_FIREWALL_DESCRIPTION, _SLICE_FIREWALL_DESCRIPTION):
        if description.startswith(prefix):
            return description.removeprefix(prefix) or None
    return None


DEPLOYMENT_LABEL = "airflow-deployment"
CAPACITY_GROUP_LABEL = "tpu-capacity-group"
# The labels the pipeline puts on each VM (ownership_labels, the capacity group). Compute allows 64 labels per
# resource (cloud.google.com/compute/docs/labeling-resources, "Requirements for labels"): a user's share is the rest.
PIPELINE_LABELS = frozenset(
    {"managed-by", DEPLOYMENT_LABEL, "airflow-dag", "airflow-run", "airflow-run-hash", "airflow-task", "expires-at",
     CAPACITY_GROUP_LABEL}
)
MAX_LABELS = 64


def slice_group_of(instance: dict) -> str | None:
    """The managed instance group that made the instance (its ``created-by`` metadata), else None.

    A VM of a multi-host slice goes with its whole group: the group's delete ends every VM of it, and the
    slice holds one place under the capacity cap."""
    items = (instance.get("metadata") or {}).get("items") or []
    created_by = next((item.get("value") or "" for item in items if item.get("key") == "created-by"), "")
    return created_by.rsplit("/", 1)[-1] if "/instanceGroupManagers/" in created_by else None


def ownership_labels(
    dag_id: str, run_id: str, task_id: str, expires_at: int, deployment: str
) -> dict[str, str]:
    """Labels that say the VM is ours, which deployment, DAG run and task made it, and when it may be reaped."""
    return {
        "managed-by": MANAGED_BY,
        DEPLOYMENT_LABEL: deployment,
        "airflow-dag": _slug(dag_id, 63),
        "airflow-run": _slug(run_id, 63),
        "airflow-run-hash": run_hash(dag_id, run_id, deployment),
        "airflow-task": _slug(task_id, 63),
        "expires-at": str(int(expires_at)),
    }


@dataclass(frozen=True)
class TpuVmSpec:
    """What to create. Validated on construction, before any API call."""

    project_id: str
    zones: tuple[str, ...]
    accelerator_type: str = DEFAULT_ACCELERATOR
    provisioning_model: str = "RESERVATION_BOUND"
    reservation: str | None = None
    network: str = "default"
    subnetwork: str | None = None
    network_path: str = "external"
    ssh_source_ranges: tuple[str, ...] = ()
    ssh_key_mode: str = "metadata"
    tags: tuple[str, ...] = ()
    boot_disk_size_gb: int = 200
    image_project: str = DEFAULT_IMAGE_PROJECT
    image_family: str = DEFAULT_IMAGE_FAMILY
    max_run_duration_s: int | None = None
    capacity_wait_s: int | None = (
        None  # FLEX_START: how long Compute keeps the VM PENDING waiting for capacity
    )
    service_account: str = "default"
    service_account_scopes: tuple[str, ...] = (CLOUD_PLATFORM_SCOPE,)
    labels: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.project_id or not re.fullmatch(r"[a-z][a-z0-9-]{4,61}[a-z0-9]", self.project_id):
            raise SpecError(
                "project_id", self.project_id, "is not a Google Cloud project id", "use e.g. 'my-project'"
            )
        if not self.zones:
            raise SpecError("zones", self.zones, "is empty", "list at least one zone, e.g. ['us-east5-b']")
        for i, zone in enumerate(self.zones):
            validation.zone(f"zones[{i}]", zone)
        if len(set(self.zones)) != len(self.zones):
            raise SpecError("zones", list(self.zones), "lists a zone twice", "list each zone once, in order")
        accelerator(self.accelerator_type)
        if self.provisioning_model not in PROVISIONING_MODELS:
            raise SpecError(
                "provisioning_model",
                self.provisioning_model,
                "is unknown",
                f"use one of {list(PROVISIONING_MODELS)}",
            )
        if self.provisioning_model == "RESERVATION_BOUND" and not self.reservation:
            raise SpecError(
                "reservation",
                self.reservation,
                "is required when provisioning_model is RESERVATION_BOUND",
                "name your capacity reservation, or choose STANDARD, SPOT or FLEX_START",
            )
        if self.reservation and self.provisioning_model not in ("RESERVATION_BOUND", "STANDARD"):
            raise SpecError(
                "reservation",
                self.reservation,
                f"is not consumed by {self.provisioning_model} VMs",
                "drop it, or use RESERVATION_BOUND (calendar-mode / AI Hypercomputer reservations) or STANDARD "
                "(any specific reservation)",
            )
        if self.reservation:
            reservations_by_zone(self.reservation, self.zones)
        validation.gce_name("network", self.network)
        if self.subnetwork is not None and not re.fullmatch(
            r"(projects/[a-z][a-z0-9-]{4,61}[a-z0-9]/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?"
            + validation.GCE_NAME_RE,
            self.subnetwork,
        ):
            raise SpecError(
                "subnetwork",
                self.subnetwork,
                "is not a subnetwork name or path",
                "give its name (in each zone's region) or projects/P/regions/R/subnetworks/S",
            )
        validation.one_of("network_path", self.network_path, access.NETWORK_PATHS)
        validation.one_of("ssh_key_mode", self.ssh_key_mode, access.KEY_MODES)
        access.source_ranges("ssh_source_ranges", self.ssh_source_ranges)
        if self.network_path == "iap" and self.ssh_source_ranges:
            raise SpecError(
                "ssh_source_ranges",
                list(self.ssh_source_ranges),
                "is not used with network_path iap (the VM's rule admits IAP's range only)",
                f"leave it empty: the rule admits {access.IAP_SOURCE_RANGE}",
            )
        for i, tag in enumerate(self.tags):
            validation.gce_name(f"tags[{i}]", tag)
        if not 10 <= self.boot_disk_size_gb <= 65536:
            raise SpecError(
                "boot_disk_size_gb", self.boot_disk_size_gb, "is out of range", "use 10..65536 GB"
            )
        validation.gce_name("image_project", self.image_project)
        validation.gce_name("image_family", self.image_family)
        if self.max_run_duration_s is not None and not (
            MIN_RUN_DURATION_S <= self.max_run_duration_s <= MAX_RUN_DURATION_S
        ):
            raise SpecError(
                "max_run_duration",
                self.max_run_duration_s,
                "is outside what Compute accepts",
                "use between 30 seconds and 120 days",
            )
        if self.provisioning_model == "FLEX_START" and not (
            FLEX_START_RUN_DURATION_S[0] <= (self.max_run_duration_s or 0) <= FLEX_START_RUN_DURATION_S[1]
        ):
            raise SpecError(
                "max_run_duration",
                self.max_run_duration_s,
                "must be 10 minutes to 7 days for FLEX_START VMs (gce-tpu.md)",
                "set it within that range, e.g. the run's timeout",
            )
        if self.provisioning_model == "FLEX_START" and (self.capacity_wait_s or 0) > FLEX_START_MAX_WAIT_S:
            raise SpecError(
                "max_wait_for_capacity",
                self.capacity_wait_s,
                "is longer than a FLEX_START request may wait for capacity (2 hours)",
                "use at most 120 minutes",
            )
        if not _SERVICE_ACCOUNT.fullmatch(self.service_account or ""):
            raise SpecError(
                "service_account",
                self.service_account,
                "is not a service account",
                "use 'default' (the project's Compute Engine default) or NAME@PROJECT.iam.gserviceaccount.com",
            )
        if not self.service_account_scopes:
            raise SpecError(
                "service_account_scopes",
                [],
                "is empty",
                f"use [{CLOUD_PLATFORM_SCOPE!r}] and grant roles in IAM",
            )
        for i, scope in enumerate(self.service_account_scopes):
            if not re.fullmatch(r"https://www\.googleapis\.com/auth/[a-z0-9._-]+", scope):
                raise SpecError(
                    f"service_account_scopes[{i}]",
                    scope,
                    "is not an OAuth scope URL",
                    "use e.g. https://www.googleapis.com/auth/devstorage.read_write",
                )
        validation.labels("labels", self.labels, MAX_LABELS - len(PIPELINE_LABELS), PIPELINE_LABELS)
        for key in self.metadata:
            validation.safe_name(f"metadata.{key}", key)

    @property
    def machine_type(self) -> str:
        return accelerator(self.accelerator_type).machine_type

    @property
    def opens_firewall(self) -> bool:
        """Whether the VM gets its own SSH firewall rule (admitting the ranges the user gave, or IAP's)."""
        return bool(self.ssh_source_ranges) or self.network_path == "iap"

    def subnetwork_path(self, zone: str) -> str | None:
        if not self.subnetwork or "/" in self.subnetwork:
            return self.subnetwork
        return f"regions/{zone.rsplit('-', 1)[0]}/subnetworks/{self.subnetwork}"


def instance_body(
    spec: TpuVmSpec,
    name: str,
    zone: str,
    labels: dict[str, str],
    metadata: dict[str, str] | None = None,
    ssh_keys: str | None = None,
) -> dict:
    """The ``instances.insert`` body: the tutorials' gcloud flags mapped field by field (gce-tpu.md).

    Plus what gcloud does for them: the default service account, and the way in over SSH (``ssh_keys``: the
    ``ssh-keys`` metadata line, or OS Login when ``spec.ssh_key_mode`` says so; host keys published as guest
    attributes)."""
    scheduling: dict = {
        "onHostMaintenance": "TERMINATE",
        "instanceTerminationAction": "DELETE",
        "provisioningModel": spec.provisioning_model,
    }
    if spec.max_run_duration_s is not None:
        scheduling["maxRunDuration"] = {"seconds": str(spec.max_run_duration_s)}
    interface: dict = {"network": f"global/networks/{spec.network}"}
    if spec.subnetwork:
        interface["subnetwork"] = spec.subnetwork_path(zone)
    if spec.network_path == "external":  # no external IP otherwise, as `--no-address`
        interface["accessConfigs"] = [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]
    body: dict = {
        "name": name,
        "machineType": f"zones/{zone}/machineTypes/{spec.machine_type}",
        "disks": [
            {
                "boot": True,
                "autoDelete": True,
                "initializeParams": {
                    "sourceImage": f"projects/{spec.image_project}/global/images/family/{spec.image_family}",
                    "diskSizeGb": str(spec.boot_disk_size_gb),
                },
            }
        ],
        "networkInterfaces": [interface],
        "serviceAccounts": [{"email": spec.service_account, "scopes": list(spec.service_account_scopes)}],
        "scheduling": scheduling,
        "labels": {**spec.labels, **labels},
    }
    if spec.provisioning_model == "FLEX_START" and spec.capacity_wait_s:
        # The VM waits PENDING for capacity until then; the insert fails if none comes.
        body["params"] = {"requestValidForDuration": {"seconds": str(spec.capacity_wait_s)}}
    if spec.reservation:
        body["reservationAffinity"] = {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [reservations_by_zone(spec.reservation, spec.zones)[zone]],
        }
    elif spec.provisioning_model in ("SPOT", "FLEX_START"):
        body["reservationAffinity"] = {"consumeReservationType": "NO_RESERVATION"}
    tags = list(spec.tags) + ([name] if spec.opens_firewall and name not in spec.tags else [])
    if tags:
        body["tags"] = {"items": tags}
    oslogin = spec.ssh_key_mode == "oslogin"
    access_items = {"enable-guest-attributes": "TRUE", "enable-oslogin": "TRUE" if oslogin else "FALSE"}
    if ssh_keys and not oslogin:
        access_items["ssh-keys"] = ssh_keys
    items = {**spec.metadata, **(metadata or {}), **access_items}
    body["metadata"] = {"items": [{"key": k, "value": v} for k, v in items.items()]}
    return body


def reservation_owner_and_name(reference: str, project: str) -> tuple[str, str]:
    """(owner project, reservation name) of one zone's reservation.

    A name (in ``project``), a shared reservation's ``projects/P/reservations/R``, or one of its blocks
    ``.../reservationBlocks/B``."""
    found = re.fullmatch(r"(?:projects/([^/]+)/reservations/)?([^/]+)(?:/reservationBlocks/[^/]+)?", reference)
    if found is None:
        raise ValueError(f"not a reservation reference: {reference!r}")
    return found.group(1) or project, found.group(2)


def reservations_by_zone(reservation: str, zones: tuple[str, ...]) -> dict[str, str]:
    """``{zone: reservation}`` from ``reservation``.

    One reservation (a name, ``projects/P/reservations/R`` or
    ``projects/P/reservations/R/reservationBlocks/B``) for a single zone, or ``ZONE=RESERVATION,...`` naming
    one for each zone. A reservation is zonal: one cannot serve several zones."""
    if not re.fullmatch(validation.RESERVATIONS_RE, reservation):
        raise SpecError(
            "reservation",
            reservation,
            "is not a reservation",
            "give its name (e.g. my-v6e-reservation), projects/P/reservations/R[/reservationBlocks/B], or one "
            "per zone: us-east5-a=res-a,us-east5-b=res-b",
        )
    if "=" not in reservation:
        if len(zones) > 1:
            raise SpecError(
                "reservation",
                reservation,
                f"is in one zone, but {len(zones)} zones are listed ({', '.join(zones)})",
                "give one reservation per zone (us-east5-a=res-a,us-east5-b=res-b) or list one zone",
            )
        return {zone: reservation for zone in zones}
    pairs = [pair.split("=", 1) for pair in reservation.split(",")]
    by_zone = dict(pairs)
    if len(by_zone) != len(pairs) or set(by_zone) != set(zones):
        raise SpecError(
            "reservation",
            reservation,
            f"must name one reservation for each zone listed ({', '.join(zones)}), and no other zone",
            "give ZONE=RESERVATION for each zone, separated by commas",
        )
    return by_zone


def ssh_firewall_body(spec: TpuVmSpec, instance: str) -> dict:
    """tcp:22 to the instance's tag from the ranges given (the Airflow workers' and triggerer's egress)."""
    return {
        "name": firewall_name(instance),
        "description": _FIREWALL_DESCRIPTION + instance,
        "network": f"global/networks/{spec.network}",
        "direction": "INGRESS",
        "allowed": [{"IPProtocol": "tcp", "ports": [str(access.SSH_PORT)]}],
        "sourceRanges": [access.IAP_SOURCE_RANGE]
        if spec.network_path == "iap"
        else list(spec.ssh_source_ranges),
        "targetTags": [instance],
    }


def slice_firewall_body(spec: TpuVmSpec, instance: str) -> dict:
    """Every protocol between the VMs of the slice ``instance`` (their tag), and from nowhere else.

    The processes of one training talk over the VPC: JAX's coordinator on worker 0 (port 8482 since JAX 0.8.1,
    8476 before: jax-ml/jax#35905), libtpu's and the collectives' ports between hosts (8471 and others; no Google
    page lists them for Compute Engine TPU slices). Google's MaxText multislice recipe opens tcp, udp and icmp
    within its network; here only among the slice's own VMs, so the slice does not depend on a network's
    ``default-allow-internal`` (a custom-mode network has none)."""
    return {
        "name": firewall_name(instance, "int"),
        "description": _SLICE_FIREWALL_DESCRIPTION + instance,
        "network": f"global/networks/{spec.network}",
        "direction": "INGRESS",
        "allowed": [{"IPProtocol": "tcp"}, {"IPProtocol": "udp"}, {"IPProtocol": "icmp"}],
        "sourceTags": [instance],
        "targetTags": [instance],
    }


def expiring_at(body: dict, expires_at: int) -> dict:
    """``body`` (an instance's, or an instance template's ``properties``) expiring at ``expires_at`` (epoch s).

    Its ``expires-at`` label and the ``expireOn`` of each key in its ``ssh-keys``: set when the VM is made, so a
    VM granted after a wait in line gets its whole life."""
    items = []
    for item in (body.get("metadata") or {}).get("items") or []:
        if item.get("key") == "ssh-keys":
            keys = []
            for entry in str(item["value"]).splitlines():
                login, _, rest = entry.partition(":")
                keys.append(access.ssh_keys_metadata(login, rest.partition(" google-ssh ")[0], expires_at))
            item = {**item, "value": "\n".join(keys)}
        items.append(item)
    labels = {**(body.get("labels") or {}), "expires-at": str(int(expires_at))}
    return {**body, "labels": labels, **({"metadata": {**body["metadata"], "items": items}} if "metadata" in body else {})}


def expiry(max_run_duration_s: int | None, default_s: int, now: float | None = None) -> int:
    """Unix time after which a reaper may delete the VM."""
    return int((now if now is not None else time.time()) + (max_run_duration_s or default_s))


class ErrorKind:
    CAPACITY = "capacity"
    QUOTA = "quota"
    RESERVATION = "reservation"
    RESERVATION_FULL = "reservation fully used"
    OTHER = "other"


_CAPACITY_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "STOCKOUT")


def classify_errors(errors: list[dict]) -> str:
    """Which kind of failure an operation's ``error.errors`` list describes."""
    codes = [str(e.get("code", "")).upper() for e in errors]
    if any(code in _CAPACITY_CODES or "RESOURCE_POOL_EXHAUSTED" in code for code in codes):
        return ErrorKind.CAPACITY
    if any("QUOTA" in code for code in codes):
        return ErrorKind.QUOTA
    # The reservation exists and fits, but its VMs are all in use: it frees up when they end (the other reservation
    # errors — missing, another machine type, not shared — stay until someone changes it).
    if any("does not have available resources" in str(e.get("message", "")) for e in errors):
        return ErrorKind.RESERVATION_FULL
    if any("RESERVATION" in code for code in codes) or any(
        "reservation" in str(e.get("message", "")).lower() for e in errors
    ):
        return ErrorKind.RESERVATION
    return ErrorKind.OTHER


def still_in_use(errors: list[dict]) -> bool:
    """Compute's "resourceInUseByAnotherResource": 'The instance_template resource ... is already being used by ...'.

    A template or policy is refused so for a while after its group is gone too (``docs/research``, Q5)."""
    return any(
        "resourceInUseByAnotherResource" in f"{e.get('code')} {e.get('message')}"
        or "already being used by" in str(e.get("message"))
        for e in errors
    )


def describe_errors(errors: list[dict]) -> str:
    return (
        "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}".strip() for e in errors) or "unknown error"
    )


def subnetwork_of(spec: TpuVmSpec, zone: str) -> tuple[str, str]:
    """``(region, subnetwork name)`` of a VM in ``zone``: the one named, or an auto-mode network's own."""
    path = spec.subnetwork_path(zone)
    if path is None:
        return zone.rsplit("-", 1)[0], spec.network
    parts = path.split("/")
    return parts[parts.index("regions") + 1], parts[-1]


# Cloud NAT's settings that translate every subnetwork of the router's region (the API's
# sourceSubnetworkIpRangesToNat); LIST_OF_SUBNETWORKS names them.
_NAT_ALL_SUBNETWORKS = ("ALL_SUBNETWORKS_ALL_IP_RANGES", "ALL_SUBNETWORKS_ALL_PRIMARY_IP_RANGES")


def nat_covers(routers: list[dict], network: str, region: str, subnetwork: str) -> bool:
    """Whether a Cloud NAT of ``routers`` (``routers.list`` of ``region``) translates ``subnetwork``'s addresses."""
    for router in routers:
        if router.get("network", "").rsplit("/", 1)[-1] != network:
            continue
        for nat in router.get("nats", []):
            scope = nat.get("sourceSubnetworkIpRangesToNat")
            if scope in _NAT_ALL_SUBNETWORKS:
                return True
            listed = {item.get("name", "") for item in nat.get("subnetworks", [])}
            if scope == "LIST_OF_SUBNETWORKS" and any(
                name.endswith(f"/regions/{region}/subnetworks/{subnetwork}") for name in listed
            ):
                return True
    return False


def egress_subnetworks(spec: TpuVmSpec) -> list[tuple[str, str]]:
    """``(region, subnetwork)`` pairs whose egress a VM without an external IP depends on; none for ``external``."""
    if spec.network_path == "external":
        return []
    return sorted({subnetwork_of(spec, zone) for zone in spec.zones})


def network_problem(
    project: str,
    network_name: str,
    subnetwork_given: bool,
    network_path: str,
    network: dict | None,
    egress: list[tuple[str, str, dict | None, list[dict]]],
) -> SpecError | None:
    """What the insert would refuse after minutes of waiting, or what leaves the VMs without a way out; None: fine.

    ``network`` is the VPC network as Compute answers it (None: missing); ``egress`` holds, for each of
    :func:`egress_subnetworks`, ``(region, subnetwork, the subnetwork or None, the region's routers)``. A VM
    without an external IP reaches the internet only through Cloud NAT, and Google's APIs only with Private Google
    Access (cloud.google.com/nat/docs/overview, cloud.google.com/vpc/docs/private-google-access): without NAT the
    install (apt, PyPI, uv) and the Hub download fail on the VM, without Private Google Access every ``gs://`` read
    and write."""
    if network is None:
        return SpecError("network", network_name, f"does not exist in {project}", "name a VPC network")
    custom_mode = network.get("autoCreateSubnetworks") is False and not network.get("IPv4Range")
    if custom_mode and not subnetwork_given:
        return SpecError(
            "subnetwork",
            None,
            f"is required: network {network_name!r} is a custom-mode VPC",
            "name the subnetwork of the zones' region the VMs go in",
        )
    problems = []
    for region, subnetwork, found, routers in egress:
        if found is None:
            problems.append(f"subnetwork {subnetwork!r} does not exist in region {region}")
            continue
        if not found.get("privateIpGoogleAccess"):
            problems.append(
                f"subnetwork {subnetwork!r} in {region} has no Private Google Access, so the VMs reach no "
                f"Cloud Storage: gcloud compute networks subnets update {subnetwork} --region={region} "
                "--enable-private-ip-google-access"
            )
        if not nat_covers(routers, network_name, region, subnetwork):
            problems.append(
                f"no Cloud NAT covers subnetwork {subnetwork!r} in {region}, so the VMs reach no package index "
                f"and no Hugging Face Hub: gcloud compute routers create posttrain-nat --network={network_name} "
                f"--region={region} && gcloud compute routers nats create posttrain-nat --router=posttrain-nat "
                f"--region={region} --auto-allocate-nat-external-ips --nat-all-subnet-ip-ranges"
            )
    if not problems:
        return None
    return SpecError(
        "network_path",
        network_path,
        "gives the VMs no external IP, and their network lacks what they need instead: " + "; ".join(problems),
        "run the gcloud commands above (README: Google Cloud, the VMs' network), or use network_path external",
    )
