"""The TPU capacity cap's labels: which live VMs compete for the same places.

Pure. Places under the cap are taken in a line per pool of capacity (a zone's reservation, else the zone and
machine series: ``recipes/places.py``), before any insert. Every VM carries its line's label (and its role: a
run's CPU VM never counts against TPU chips), so the live VMs of a line are also found in Compute by that label: a
VM there that holds no place in the line (made by a create that took none) counts as its chips held. A multi-host
slice is one place of all its VMs' chips: its VMs are counted together, by the managed instance group that made
them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from airflow_tpu_posttrain.recipes.compute import CAPACITY_GROUP_LABEL, LIVE_STATES, slice_group_of

GROUP_LABEL = CAPACITY_GROUP_LABEL
# A VM that holds (or is about to hold) capacity: the live states, PENDING (queued for capacity) included.
HOLDING_STATES = LIVE_STATES


def group_label(line_key: str, role: str = "tpu") -> str:
    """The label value of the VMs of one line (``places.line_key``) and one role of VM."""
    return hashlib.sha256(f"{line_key}\0{role}".encode()).hexdigest()[:16]


def chips_of_machine_type(machine_type: str) -> int:
    """The TPU chips of one VM of ``machine_type`` (a name or its URL): ``ct6e-standard-8t`` has 8."""
    found = re.search(r"-(\d+)t$", machine_type)
    return int(found.group(1)) if found else 1


def live_places(instances: Iterable[dict]) -> dict[str, int]:
    """The places the line's live instances hold, by name, with their TPU chips: a VM, or a slice's VMs as one."""
    held: dict[str, int] = {}
    for instance in instances:
        if instance.get("status") in HOLDING_STATES:
            place = slice_group_of(instance) or instance.get("name", "")
            held[place] = held.get(place, 0) + chips_of_machine_type(instance.get("machineType", ""))
    return dict(sorted(held.items()))
