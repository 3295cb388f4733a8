"""What a test can make the emulator fail, each the way Compute Engine fails.

Google's behaviour each fault stands for: a zone out of resources (``ZONE_RESOURCE_POOL_EXHAUSTED``:
https://cloud.google.com/compute/docs/troubleshooting/troubleshooting-resource-availability), a quota exceeded
(https://cloud.google.com/compute/resource-usage), a specific reservation missing or full
(https://cloud.google.com/compute/docs/instances/reservations-consume), the transient 503 ``backendError`` and 429
``rateLimitExceeded`` a client retries (https://cloud.google.com/compute/api-quota), ``maxRunDuration``
(https://cloud.google.com/compute/docs/instances/limit-vm-runtime), flex-start capacity
(https://cloud.google.com/compute/docs/instances/about-flex-start-vms), an image without Google's guest environment
(https://cloud.google.com/compute/docs/images/guest-environment) and a slice's accelerator topology states
(``InstanceGroupManager.status.appliedAcceleratorTopologies``:
https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers). Set from Python with
``ComputeEmulator.set_faults`` or over HTTP under ``/_emulator/faults``.
"""

from __future__ import annotations

import dataclasses

from airflow_tpu_posttrain.local.compute_emulator.operations import OperationError

TRANSIENT_KINDS = ("insert", "get", "delete", "list", "operation")


@dataclasses.dataclass
class Faults:
    """Failure injection settings; every field can be changed with ``set_faults``."""

    stockout_zones: list[str] = dataclasses.field(default_factory=list)
    quota_exceeded_zones: list[str] = dataclasses.field(default_factory=list)
    # Refused at the insert itself (HTTP 403 quotaExceeded), as Compute does for quotas it checks up front
    # ("googleapi: Error 403: Quota 'CPUS' exceeded.  Limit: 24.0 in region us-central1., quotaExceeded").
    quota_refused_zones: list[str] = dataclasses.field(default_factory=list)
    missing_reservations: list[str] = dataclasses.field(default_factory=list)
    transient_errors: dict[str, int] = dataclasses.field(default_factory=dict)
    """Per request kind (see ``TRANSIENT_KINDS``), how many instance, MIG and operation requests fail next."""
    fail_deletes: bool = False
    no_guest_environment: bool = False
    """Instances never publish host keys (an image without Google's guest environment)."""
    impostor_host_keys: bool = False
    """``getGuestAttributes`` serves host keys that are not the VM's (what a client must never accept)."""
    operation_seconds: float = 0.2
    max_run_duration_scale: float = 1.0
    refuse_max_run_duration: list[str] = dataclasses.field(default_factory=list)
    """Provisioning models whose inserts with ``scheduling.maxRunDuration`` are answered 400 (no Google document
    says whether RESERVATION_BOUND accepts it; the wording is modelled on the API's other field errors)."""
    references_linger_seconds: float | None = None
    """How long a deleted group's template and policy are still "in use" after its delete is DONE (None: three
    times ``operation_seconds``). No Google statement of how long; Google's cluster-toolkit expects the error and
    retries the delete on its next pass, and so must a client."""
    no_worker_id_metadata: bool = False
    """A slice's VMs are told no ``worker-id`` by their metadata server (the only place this emulator shows it:
    Google documents no worker id for MIG-made TPU VMs in the metadata ``instances.get`` shows)."""
    topology_activation_seconds: float | None = None
    """How long a slice's topology stays ACTIVATING, and its group unstable, once every VM is RUNNING (None:
    ``operation_seconds``). The v1 reference names ACTIVATING and ACTIVE and documents no order or timing; a
    client must not take "every VM running" for a usable slice, so here the two are apart."""
    settled_topology: tuple[str, str | None] | None = None
    """``(state, error message)``: what a slice's topology shows instead of ACTIVE once activated, one of the v1
    enum's other states for a slice whose VMs all run (``ACTIVE_DEGRADED``: "active but operating in degraded
    mode", ``REACTIVATING``, ``FAILED``), with ``stateDetails.error`` when a message is given. The v1 reference
    documents the states, not when Compute shows them: a client must judge each as it comes."""
    flex_start_capacity_after: float | None = None
    """Seconds until capacity comes for a FLEX_START VM with a wait time (``params.requestValidForDuration``):
    it is PENDING meanwhile, and its insert fails if the wait time ends first. None: at once."""


FAILED_DELETE = OperationError(
    code="INTERNAL_ERROR",
    message="Internal error. Please try again or contact Google Support.",
    http_status=500,
    http_message="INTERNAL SERVER ERROR",
)
"""How a delete's operation ends under ``fail_deletes``."""
