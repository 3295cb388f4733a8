"""The TPU VM as a Compute Engine instance: deterministic names, the insert body, labels, error kinds.

Pure: builds the REST JSON (camelCase, as in the Compute API v1 reference) that the hook sends with
``google-cloud-compute``. Defaults reproduce the tutorials' ``gcloud compute instances create`` flags.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.accelerators import accelerator
from airflow_tpu_posttrain.recipes.validation import SpecError

MANAGED_BY = "airflow-tpu-posttrain"
PROVISIONING_MODELS = ("RESERVATION_BOUND", "STANDARD", "SPOT", "FLEX_START")
DEFAULT_IMAGE_PROJECT = "ubuntu-os-accelerator-images"
DEFAULT_IMAGE_FAMILY = "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"
# The CPU VM (split layout): a plain Ubuntu 22.04, as the TPU image's base.
CPU_IMAGE_PROJECT = "ubuntu-os-cloud"
CPU_IMAGE_FAMILY = "ubuntu-2204-lts"
# What a VM needs to read and write gs:// checkpoints (the default scopes only read storage).
STORAGE_SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
IAP_SOURCE_RANGE = "35.235.240.0/20"
# Compute accepts 30 s .. 120 days for scheduling.maxRunDuration.
MIN_RUN_DURATION_S = 30
MAX_RUN_DURATION_S = 120 * 24 * 3600

# Instance states from which the VM can still become (or is) usable, and those that must be replaced.
LIVE_STATES = frozenset({"PROVISIONING", "STAGING", "RUNNING", "REPAIRING"})
DEAD_STATES = frozenset({"STOPPING", "STOPPED", "SUSPENDING", "SUSPENDED", "TERMINATED"})


def _slug(value: str, max_len: int) -> str:
    """Lowercase ``[a-z0-9-]`` form of ``value`` for names and label values."""
    slug = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    return slug[:max_len].rstrip("-")


def run_hash(dag_id: str, run_id: str) -> str:
    """Short stable hash of a DAG run: the part of every id that keeps two runs apart."""
    return hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:10]


def instance_name(dag_id: str, run_id: str, prefix: str = "tpu") -> str:
    """Deterministic Compute name for the VM of one DAG run: ``<prefix>-<dag slug>-<hash>`` (<= 63 chars)."""
    validation.gce_name("name_prefix", prefix)
    digest = run_hash(dag_id, run_id)
    room = 63 - len(prefix) - len(digest) - 2
    middle = _slug(dag_id, room)
    return "-".join(part for part in (prefix, middle, digest) if part)


def firewall_name(instance: str) -> str:
    return f"{instance[:54]}-iap-ssh"


def ownership_labels(dag_id: str, run_id: str, task_id: str, expires_at: int) -> dict[str, str]:
    """Labels that say the VM is ours, which DAG run and task made it, and when it may be reaped."""
    return {
        "managed-by": MANAGED_BY,
        "airflow-dag": _slug(dag_id, 63),
        "airflow-run": _slug(run_id, 63),
        "airflow-run-hash": run_hash(dag_id, run_id),
        "airflow-task": _slug(task_id, 63),
        "expires-at": str(int(expires_at)),
    }


@dataclass(frozen=True)
class TpuVmSpec:
    """What to create. Validated on construction, before any API call."""

    project_id: str
    zones: tuple[str, ...]
    accelerator_type: str = "v6e-8"
    provisioning_model: str = "RESERVATION_BOUND"
    reservation: str | None = None
    network: str = "default"
    tags: tuple[str, ...] = ()
    iap_firewall: bool = False
    boot_disk_size_gb: int = 200
    image_project: str = DEFAULT_IMAGE_PROJECT
    image_family: str = DEFAULT_IMAGE_FAMILY
    max_run_duration_s: int | None = None
    service_account_scopes: tuple[str, ...] = ()  # empty: Compute's defaults, as the tutorials' gcloud
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
        if self.provisioning_model == "RESERVATION_BOUND":
            if not self.reservation:
                raise SpecError(
                    "reservation",
                    self.reservation,
                    "is required when provisioning_model is RESERVATION_BOUND",
                    "name your capacity reservation, or choose STANDARD, SPOT or FLEX_START",
                )
            validation.gce_name("reservation", self.reservation)
        elif self.reservation:
            raise SpecError(
                "reservation",
                self.reservation,
                f"is only used with RESERVATION_BOUND, not {self.provisioning_model}",
                "drop it or set provisioning_model to RESERVATION_BOUND",
            )
        validation.gce_name("network", self.network)
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
        if self.provisioning_model == "FLEX_START" and self.max_run_duration_s is None:
            raise SpecError(
                "max_run_duration", None, "is required for FLEX_START VMs", "set it (10 minutes to 7 days)"
            )
        for i, scope in enumerate(self.service_account_scopes):
            if not re.fullmatch(r"https://www\.googleapis\.com/auth/[a-z0-9._-]+", scope):
                raise SpecError(
                    f"service_account_scopes[{i}]",
                    scope,
                    "is not an OAuth scope URL",
                    "use e.g. https://www.googleapis.com/auth/devstorage.read_write",
                )
        validation.labels("labels", self.labels)
        for key in self.metadata:
            validation.safe_name(f"metadata.{key}", key)

    @property
    def machine_type(self) -> str:
        return accelerator(self.accelerator_type).machine_type


def instance_body(
    spec: TpuVmSpec, name: str, zone: str, labels: dict[str, str], metadata: dict[str, str] | None = None
) -> dict:
    """The ``instances.insert`` body: the tutorials' gcloud flags mapped field by field (gce-tpu.md)."""
    scheduling: dict = {
        "onHostMaintenance": "TERMINATE",
        "instanceTerminationAction": "DELETE",
        "provisioningModel": spec.provisioning_model,
    }
    if spec.max_run_duration_s is not None:
        scheduling["maxRunDuration"] = {"seconds": str(spec.max_run_duration_s)}
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
        "networkInterfaces": [
            {
                "network": f"global/networks/{spec.network}",
                "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}],
            }
        ],
        "scheduling": scheduling,
        "labels": {**spec.labels, **labels},
    }
    if spec.provisioning_model == "RESERVATION_BOUND":
        body["reservationAffinity"] = {
            "consumeReservationType": "SPECIFIC_RESERVATION",
            "key": "compute.googleapis.com/reservation-name",
            "values": [spec.reservation],
        }
    elif spec.provisioning_model in ("SPOT", "FLEX_START"):
        body["reservationAffinity"] = {"consumeReservationType": "NO_RESERVATION"}
    if spec.service_account_scopes:
        body["serviceAccounts"] = [{"email": "default", "scopes": list(spec.service_account_scopes)}]
    tags = list(spec.tags) + ([name] if spec.iap_firewall and name not in spec.tags else [])
    if tags:
        body["tags"] = {"items": tags}
    items = {**spec.metadata, **(metadata or {})}
    if items:
        body["metadata"] = {"items": [{"key": k, "value": v} for k, v in items.items()]}
    return body


def iap_firewall_body(spec: TpuVmSpec, instance: str) -> dict:
    """The SFT tutorial's IAP SSH rule: tcp:22 from IAP's range to the instance's tag."""
    return {
        "name": firewall_name(instance),
        "network": f"global/networks/{spec.network}",
        "direction": "INGRESS",
        "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
        "sourceRanges": [IAP_SOURCE_RANGE],
        "targetTags": [instance],
    }


def expiry(max_run_duration_s: int | None, default_s: int, now: float | None = None) -> int:
    """Unix time after which a reaper may delete the VM."""
    return int((now if now is not None else time.time()) + (max_run_duration_s or default_s))


class ErrorKind:
    CAPACITY = "capacity"
    QUOTA = "quota"
    RESERVATION = "reservation"
    OTHER = "other"


_CAPACITY_CODES = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "STOCKOUT")


def classify_errors(errors: list[dict]) -> str:
    """Which kind of failure an operation's ``error.errors`` list describes."""
    codes = [str(e.get("code", "")).upper() for e in errors]
    if any(code in _CAPACITY_CODES or "RESOURCE_POOL_EXHAUSTED" in code for code in codes):
        return ErrorKind.CAPACITY
    if any("QUOTA" in code for code in codes):
        return ErrorKind.QUOTA
    if any("RESERVATION" in code for code in codes) or any(
        "reservation" in str(e.get("message", "")).lower() for e in errors
    ):
        return ErrorKind.RESERVATION
    return ErrorKind.OTHER


def describe_errors(errors: list[dict]) -> str:
    return (
        "; ".join(f"{e.get('code', '?')}: {e.get('message', '')}".strip() for e in errors) or "unknown error"
    )
