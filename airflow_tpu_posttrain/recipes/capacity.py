"""The TPU capacity cap: how many of the pipeline's TPU VMs may live at once in one capacity group.

Pure. A capacity group is what the VMs compete for: a reservation (in a project), or, without one, the set of
zones they are created in. Every TPU VM carries its group's label, so the live VMs of a group are counted from
Compute by that label — across DAGs, schedulers and Airflow deployments. A multi-host slice holds one place,
however many VMs it has: its VMs are counted together, by the managed instance group that made them. Two
creates racing for the last place both insert; the later by creation time (then name) sees itself over the
cap, deletes its VM (or its slice) and waits again.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from datetime import UTC, datetime

from airflow_tpu_posttrain.recipes.compute import CAPACITY_GROUP_LABEL, LIVE_STATES, slice_group_of

GROUP_LABEL = CAPACITY_GROUP_LABEL
# A VM that holds (or is about to hold) capacity: the live states, PENDING (queued for capacity) included.
HOLDING_STATES = LIVE_STATES


def group_label(
    project: str, reservation: str | None, zones: Iterable[str], machine_type: str, role: str = "tpu"
) -> str:
    """The label value of a capacity group.

    The reservation's name, or else the zones and the machine series (``ct6e``), in one project, for one role
    of VM (a run's CPU VM never counts against TPU VMs)."""
    series = machine_type.split("-", 1)[0]
    key = (
        f"reservation:{','.join(reservation_names(reservation))}"
        if reservation
        else f"zones:{','.join(sorted(zones))}:{series}:{role}"
    )
    return hashlib.sha256(f"{project}\0{key}".encode()).hexdigest()[:16]


def reservation_names(reservation: str) -> list[str]:
    """The names of the reservations ``reservation`` gives, in whatever form.

    A name, a shared reservation's path, one of its blocks, one per zone: a group is the same reservations
    however they are named."""
    refs = (pair.rsplit("=", 1)[-1] for pair in reservation.split(","))
    return sorted({re.sub(r"^projects/[^/]+/reservations/|/reservationBlocks/.*$", "", ref) for ref in refs})


def holders(instances: Iterable[dict]) -> list[dict]:
    """The places the group's instances hold, first created first (ties broken by name).

    A place is a VM, or a multi-host slice: its live VMs as one, named as its group (which is the run's VM
    name), created when its first VM was. By instant, not by text: Compute writes ``creationTimestamp`` with a
    US-Pacific offset, so in the hour the clocks go back an earlier VM's text (``01:50-07:00``) sorts after a
    later one's (``01:10-08:00``)."""
    places: dict[str, dict] = {}
    for instance in instances:
        if instance.get("status") not in HOLDING_STATES:
            continue
        name = slice_group_of(instance) or instance.get("name", "")
        if name not in places or _created(instance) < _created(places[name]):
            places[name] = {**instance, "name": name}
    return sorted(places.values(), key=lambda i: (_created(i), i.get("name", "")))


def _created(instance: dict) -> datetime:
    """When the instance was created; one without a timestamp (not yet answered) counts as the newest."""
    stamp = instance.get("creationTimestamp")
    return datetime.fromisoformat(stamp) if stamp else datetime.max.replace(tzinfo=UTC)


def over_cap(name: str, instances: Iterable[dict], cap: int) -> bool:
    """Whether ``name`` (a VM, or a slice's group) is not among the ``cap`` first-created places (it must yield)."""
    names = [i.get("name") for i in holders(instances)]
    return name in names and names.index(name) >= cap


def describe(instances: Iterable[dict], cap: int) -> str:
    """``1 of 1 in use by posttrain_rl__llama3.1-8b-Instruct run scheduled__...`` for the wait's log line."""
    held = holders(instances)
    users = []
    for instance in held:
        metadata = {m["key"]: m.get("value") for m in (instance.get("metadata") or {}).get("items", [])}
        dag = metadata.get("airflow-dag-id") or (instance.get("labels") or {}).get("airflow-dag", "?")
        run = metadata.get("airflow-run-id") or (instance.get("labels") or {}).get("airflow-run", "?")
        users.append(f"{dag} run {run} ({instance.get('name')})")
    return f"{len(held)} of {cap} in use by " + ("; ".join(users) or "nobody")
