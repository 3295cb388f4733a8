"""The TPU capacity cap's labels: which live VMs compete for the same places.

Pure. Places under the cap are taken in a line per reservation, else per zone and machine series
(``recipes/places.py``), before any insert. Every VM carries its line's label (and its role: a run's CPU VM never
counts against TPU VMs), so the live VMs of a line are also found in Compute by that label: a VM there that holds
no place in the line (made by a create that took none) counts as a place held. A multi-host slice holds one
place, however many VMs it has: its VMs are counted together, by the managed instance group that made them.
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


def reservation_names(reservation: str) -> list[str]:
    """The names of the reservations ``reservation`` gives, in whatever form.

    A name, a shared reservation's path, one of its blocks, one per zone: a line is the same reservations
    however they are named."""
    refs = (pair.rsplit("=", 1)[-1] for pair in reservation.split(","))
    return sorted({re.sub(r"^projects/[^/]+/reservations/|/reservationBlocks/.*$", "", ref) for ref in refs})


def live_places(instances: Iterable[dict]) -> list[str]:
    """The places the line's live instances hold, by name: a VM, or a multi-host slice's VMs as one (its group)."""
    return sorted({slice_group_of(i) or i.get("name", "") for i in instances if i.get("status") in HOLDING_STATES})
