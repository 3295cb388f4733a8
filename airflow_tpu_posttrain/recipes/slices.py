"""A multi-host TPU slice on Compute Engine: a workload policy, an instance template, a MIG in bulk mode.

Google's way (compute/docs/tpus/create-tpu-mig-multi-host-slice; compute/docs/instance-groups/about-bulk-mode):
a regional workload policy of type ``HIGH_THROUGHPUT`` names the slice's accelerator topology; a global
instance template holds what each VM is made from; a zonal managed instance group of the slice's VM count,
in bulk mode, names both and creates every VM at once or none. Created in that order and deleted in the
reverse one: Compute refuses to delete a template or a policy a group still uses.

Pure: names and REST bodies. A slice's VMs are made from exactly the body a single-host VM gets
(``compute.instance_body``): the same image, disk, scheduling, reservation, service account, labels, metadata
and SSH access; only what a template cannot hold is left out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

from airflow_tpu_posttrain.recipes import compute
from airflow_tpu_posttrain.recipes.accelerators import Accelerator, accelerator

BASE_NAME_ROOM = 52  # a MIG's baseInstanceName before its "-###": `[a-z][-a-z0-9]{0,51}-#{1,10}` (v1 reference)
# What an instances.insert body holds that an instance template's properties do not (InstanceProperties, v1):
# the instance's own name, and ``params`` (a single FLEX_START VM's ``requestValidForDuration``). A FLEX_START
# slice is a bulk MIG of ``targetSize`` VMs, as Google's bulk-mode sample makes one (terraform-docs-samples
# ``compute_bulk_per_instance_config``: a FLEX_START template with ``maxRunDuration``, ``targetSizePolicy`` BULK):
# bulk mode supports no resize request that creates VMs all at once (about-bulk-mode, limitations), and v1 has
# no validity for a MIG's wait; ``max_wait_for_capacity`` bounds the wait from the create instead.
NOT_IN_TEMPLATE = ("name", "params")

# What a slice is made with (compute/docs/instance-groups/about-bulk-mode: bulk mode takes these two only).
SLICE_PROVISIONING_MODELS = ("RESERVATION_BOUND", "FLEX_START")


@dataclass(frozen=True)
class SliceNames:
    """Deterministic names of one run's slice: one per resource type, so each type's name is the run's VM name."""

    policy: str
    template: str
    group: str
    base_instance_name: str
    firewalls: tuple[str, ...] = ()  # the rule between its VMs, and its SSH rule (when the run opens one)

    def member(self, index: int) -> str:
        """The name of the group's ``index``-th VM (from 0), as the group numbers them (``-001`` …)."""
        return self.base_instance_name.replace("###", f"{index + 1:03d}")


def slice_names(name: str) -> SliceNames:
    """The slice's names from the run's VM name (``compute.instance_name``).

    The VMs are ``<base>-001`` … ; a name too long for a base is cut with a hash of the whole name, never its
    tail alone (the run's hash at its end keeps two runs apart), as ``compute.firewall_name`` does."""
    base = name
    if len(base) > BASE_NAME_ROOM:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        base = f"{name[: BASE_NAME_ROOM - 11].rstrip('-')}-{digest}"
    firewalls = (compute.firewall_name(name, "int"), compute.firewall_name(name))
    return SliceNames(policy=name, template=name, group=name, base_instance_name=f"{base}-###", firewalls=firewalls)


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def workload_policy_body(names: SliceNames, acc: Accelerator) -> dict:
    """``resourcePolicies.insert``: the slice's topology, its VMs joined by ICI."""
    return {
        "name": names.policy,
        "description": f"{compute.MANAGED_BY}: the {acc.type} slice of group {names.group}",
        "workloadPolicy": {"type": "HIGH_THROUGHPUT", "acceleratorTopology": acc.topology},
    }


def instance_template_body(names: SliceNames, instance_body: dict) -> dict:
    """``instanceTemplates.insert``: ``instance_body`` (one VM of the slice) as a template's properties."""
    properties = {key: value for key, value in instance_body.items() if key not in NOT_IN_TEMPLATE}
    properties["machineType"] = instance_body["machineType"].rsplit("/", 1)[-1]  # a template's is a bare name
    return {
        "name": names.template,
        "description": f"{compute.MANAGED_BY}: the VMs of group {names.group}",
        "properties": properties,
    }


def group_body(project: str, zone: str, names: SliceNames, acc: Accelerator) -> dict:
    """``instanceGroupManagers.insert``: every VM of the slice at once, or none (bulk mode).

    A failed VM is not repaired (``DO_NOTHING``): a slice short of one VM cannot train, and the run re-creates
    the whole slice."""
    return {
        "name": names.group,
        "description": f"{compute.MANAGED_BY}: a {acc.type} slice",
        "baseInstanceName": names.base_instance_name,
        "instanceTemplate": f"projects/{project}/global/instanceTemplates/{names.template}",
        "targetSize": acc.vms,
        "targetSizePolicy": {"mode": "BULK"},
        "resourcePolicies": {
            "workloadPolicy": f"projects/{project}/regions/{region_of(zone)}/resourcePolicies/{names.policy}"
        },
        "instanceLifecyclePolicy": {"defaultActionOnFailure": "DO_NOTHING"},
    }


@dataclass(frozen=True)
class SliceBodies:
    """What a slice's create sends, in order: its firewall rules, the policy, the template, the group."""

    names: SliceNames
    policy: dict
    template: dict
    group: dict
    firewalls: tuple[dict, ...] = ()


def slice_bodies(
    spec: compute.TpuVmSpec,
    name: str,
    zone: str,
    labels: dict[str, str],
    metadata: dict[str, str] | None = None,
    ssh_keys: str | None = None,
) -> SliceBodies:
    """The three bodies of ``spec``'s slice in ``zone``, its VMs made as ``compute.instance_body`` makes one."""
    acc = accelerator(spec.accelerator_type)
    if not acc.is_multi_host:
        raise ValueError(f"{spec.accelerator_type} is one VM, not a slice")
    names = slice_names(name)
    # Named as the run's VM: the name itself is left out of the template, and the run's VM name is every VM's tag,
    # the target of its firewall rules (between the VMs, and SSH's when the run opens one).
    member = compute.instance_body(spec, name, zone, labels, metadata, ssh_keys)
    tags = (member.get("tags") or {}).get("items") or []
    member["tags"] = {"items": [*tags, name] if name not in tags else tags}
    firewalls = [compute.slice_firewall_body(spec, name)]
    if spec.opens_firewall:
        firewalls.append(compute.ssh_firewall_body(spec, name))
    return SliceBodies(
        names,
        workload_policy_body(names, acc),
        instance_template_body(names, member),
        group_body(spec.project_id, zone, names, acc),
        tuple(firewalls),
    )


class SliceState(NamedTuple):
    """Where a slice's group stands (``state``), and Compute's words for why (``detail``)."""

    state: str
    detail: str = ""


WHOLE = "whole"  # every VM RUNNING, the topology ACTIVE, the group stable: the slice can be trained on
CREATING = "creating"  # no evidence against it: the group creates its VMs, or its topology and actions settle
NO_CAPACITY = "no-capacity"  # bulk mode waits for the whole slice's capacity (a stock-out, a fully used reservation)
REFUSED = "refused"  # the bulk creation's last check names an error no wait mends (quota, a missing reservation)
BROKEN = "broken"  # evidence that a VM is gone or stopped for good (bulk mode creates once): never trained on

# Per-instance statuses (``currentInstanceStatuses``) of a VM that will not run again in a bulk group with
# ``defaultActionOnFailure: DO_NOTHING``: stopped, suspended, terminated, or on their way there.
_LOST_STATUSES = ("stopping", "stopped", "suspending", "suspended", "terminated", "deprovisioning", "pendingStop")
# Capacity that may come: a stock-out, or a reservation whose VMs are all in use.
_WAITED_FOR = (compute.ErrorKind.CAPACITY, compute.ErrorKind.RESERVATION_FULL)


def slice_state(group: dict) -> SliceState:
    """What a group (``instanceGroupManagers.get``, REST JSON) says of its slice, on evidence only.

    The fields Compute documents for TPU MIGs (v1 reference, ``InstanceGroupManagerStatus``): ``isStable``
    ("none of the instances ... is currently undergoing any type of change ... no future changes are scheduled"),
    ``appliedAcceleratorTopologies[].state`` (ACTIVATING, ACTIVE, ACTIVE_DEGRADED: "active but operating in
    degraded mode", DEACTIVATING, FAILED, INCOMPLETE: "cannot be activated due to insufficient number of running
    VMs", REACTIVATING; the discovery document's enum), ``bulkInstanceOperation`` (``inProgress``, and
    ``lastProgressCheck.error``, Compute's ``Error``) and ``currentInstanceStatuses`` (counts by instance status).
    The slice is broken only on evidence: its topology FAILED, a VM stopped, suspended or terminated, or the bulk
    creation over with VMs missing. Anything else short of whole (a topology still activating with every VM
    running, degraded, deactivating or reactivating, an unstable group, no bulk operation shown yet) is waited on,
    bounded by the create's deadline: no Google page says which of those states passes, so none is trained on and
    none deleted before that deadline. A bulk check's error is capacity to wait for, or a refusal no wait mends."""
    status = group.get("status") or {}
    topologies = status.get("appliedAcceleratorTopologies") or []
    topology = topologies[0].get("state") if topologies else None
    counts = status.get("currentInstanceStatuses") or {}
    running = counts.get("running", 0)
    target = int(group.get("targetSize", 0))
    bulk = status.get("bulkInstanceOperation")
    lost = {state: n for state, n in counts.items() if state in _LOST_STATUSES and n}
    missing = counts.get("nonExistent", 0)

    def broken(why: str) -> SliceState:
        others = {state: n for state, n in counts.items() if state != "running" and n}
        listed = ", ".join(f"{n} {state}" for state, n in sorted(others.items()))
        return SliceState(
            BROKEN, f"{running} of {target} VMs running ({listed or why}); topology {topology or 'not shown'}"
        )

    if topology == "FAILED":
        details = ((topologies[0].get("stateDetails") or {}).get("error") or {}).get("errors") or []
        return broken(compute.describe_errors(details) if details else "its topology failed")
    if lost:
        return broken("lost")
    if bulk is not None and not bulk.get("inProgress") and missing:
        return broken("the bulk creation is over")
    if status.get("isStable") and running == target and topology in (None, "ACTIVE"):
        return SliceState(WHOLE)
    errors = ((bulk or {}).get("lastProgressCheck") or {}).get("error", {}).get("errors") or []
    if bulk and bulk.get("inProgress") and errors:
        detail = compute.describe_errors(errors)
        return SliceState(NO_CAPACITY if compute.classify_errors(errors) in _WAITED_FOR else REFUSED, detail)
    return SliceState(
        CREATING, f"{running} of {target} VMs running, topology {topology or 'not shown'}"
        f"{'' if status.get('isStable') else ', the group not stable yet'}"
    )


# The keys a slice VM's metadata server may tell its worker id by (``instance/attributes/<key>``). Google documents
# none for MIG-made TPU VMs, and none in the metadata ``instances.get`` shows: JAX reads ``agent-worker-number``
# from the metadata server on Cloud TPU VMs (jax/_src/clusters/cloud_tpu_cluster.py, ``GceTpuCluster``); a public
# report of MIG-made TPU7x VMs shows ``worker-id``. Each VM is asked itself, over SSH, the first key it answers.
WORKER_ID_KEYS = ("agent-worker-number", "worker-id")
_METADATA_ATTRIBUTES = "http://metadata.google.internal/computeMetadata/v1/instance/attributes"


def worker_id_command() -> str:
    """The shell line a slice VM runs to print its worker id from its metadata server; exit 1 when none is told."""
    asks = " || ".join(
        f"curl -sf --noproxy '*' -H 'Metadata-Flavor: Google' {_METADATA_ATTRIBUTES}/{key}" for key in WORKER_ID_KEYS
    )
    return f"{asks} || exit 1"


def worker_id_answer(status: int, output: str) -> int | None:
    """The worker id :func:`worker_id_command` printed; None when the VM's metadata server told none."""
    text = output.strip()
    return int(text) if status == 0 and text.isdigit() else None
