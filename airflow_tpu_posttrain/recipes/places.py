"""Places under the TPU cap: one line per pool of capacity, kept in one storage object, taken before any insert.

Pure: what a line holds and how a request, a release or the reaper changes it. ``hooks/stored_records.py`` reads the
object and writes it back only if nobody wrote it in between (a generation precondition), so of two creates
that ask at once one wins the write and the other asks again on what the winner wrote: a place is taken by
exactly one create, before it inserts, across triggerers and Airflow deployments sharing the bucket.

A line is a pool of capacity, however a run writes it: a zone's own reservation (its owner project and name; a
block of it is the reservation), else the zone and the machine series, in one project. A run whose zones are
``[b, a]`` asks in b's line; after a stock-out in b it gives b's place back and asks in a's.

The cap counts TPU chips, as quota and reservations count them: a request takes its size (a v6e-8 VM 8 chips, a
slice of 16 VMs of 4 chips 64), never one place per slice. The line keeps its cap: a request that brings another
while others are in it is refused (two caps on one pool would each admit more than the other meant).

Order: strict first come, first served, a run coming when it started (to the second), then by its logical date
(a backfill's runs, started together, go oldest date first), then by run id. A request is granted when it and every
request ahead of it fit under the cap: a large request is never overtaken by smaller ones behind it, and never
starves. Nobody's wait in line is bounded here: a line whose holders are live runs moves; a place whose holder is
gone or expired is given back on evidence (:func:`stale_holders`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow_tpu_posttrain.recipes import reaper
from airflow_tpu_posttrain.recipes.compute import DEPLOYMENT_LABEL, MANAGED_BY, reservation_owner_and_name
from airflow_tpu_posttrain.recipes.validation import SpecError, positive_int, storage_uri

# A waiting request refreshes its entry at least this often; one not refreshed for WAITING_STALE_S is dropped
# (its create is gone without leaving the line: a triggerer killed with its trigger).
REFRESH_S = 60.0
WAITING_STALE_S = 600.0


def line_key(project: str, zone: str, reservation: str | None, machine_type: str) -> str:
    """The line a VM of ``machine_type`` made in ``zone`` (consuming ``reservation``) waits in.

    ``reservation`` as the run gives it (one, or ``ZONE=RESERVATION,...``): the zone's own is the pool. Readable,
    and a valid object name: ``OWNER-PROJECT/reservation-NAME`` or ``PROJECT/ZONE-SERIES``."""
    if reservation:
        refs = dict(pair.split("=", 1) for pair in reservation.split(",")) if "=" in reservation else {zone: reservation}
        owner, name = reservation_owner_and_name(refs[zone], project)
        return f"{owner}/reservation-{name}"
    return f"{project}/{zone}-{machine_type.split('-', 1)[0]}"


def line_uri(capacity_claims: str, key: str) -> str:
    """The object of the line ``key`` under ``capacity_claims`` (``gs://bucket/prefix``)."""
    return f"{capacity_claims.rstrip('/')}/{key}.json"


@dataclass(frozen=True)
class Cap:
    """A create's cap: ``chips`` a line's VMs may hold at once, the ``size`` this create takes, where lines are."""

    chips: int
    size: int
    claims: str


def cap_of(
    max_tpu_chips: int | None, max_tpu_vms: int | None, capacity_claims: str | None, chips_per_vm: int, vms: int
) -> Cap | None:
    """The cap a create of ``vms`` VMs of ``chips_per_vm`` chips asks under; None: no cap.

    ``max_tpu_chips``, else (deprecated) ``max_tpu_vms`` VMs of this create's size. Refused before anything is
    made: both given, no ``capacity_claims``, or a create larger than the cap (it would wait for ever)."""
    if max_tpu_chips is not None and max_tpu_vms is not None:
        raise SpecError(
            "max_tpu_vms", max_tpu_vms, f"is given with max_tpu_chips={max_tpu_chips}",
            "give max_tpu_chips only (max_tpu_vms is deprecated: it counts VMs of one size)",
        )
    field, value = ("max_tpu_chips", max_tpu_chips) if max_tpu_vms is None else ("max_tpu_vms", max_tpu_vms)
    if value is None:
        return None
    positive_int(field, value)
    if not capacity_claims or not str(capacity_claims).startswith("gs://"):
        raise SpecError(
            "capacity_claims", capacity_claims, f"is needed with {field}={value}: the places under the cap are taken "
            "there", "give a gs://<bucket>/<prefix> every deployment sharing the cap can write (the pipelines use "
            f"<checkpoint bucket>/tpu-capacity), or set {field} to None",
        )
    chips = value if field == "max_tpu_chips" else value * chips_per_vm
    size = vms * chips_per_vm
    if size > chips:
        raise SpecError(
            field, value, f"admits {chips} TPU chips at once, fewer than the {size} of this create's {vms} VM(s)",
            f"raise {field} to at least {size if field == 'max_tpu_chips' else vms}, or use a smaller accelerator_type",
        )
    return Cap(chips, size, storage_uri("capacity_claims", capacity_claims))


def request_of(dag_run: Any, claim: str, deployment: str, size: int) -> dict[str, Any]:
    """The fields of a :class:`Request` for ``claim`` by ``dag_run`` (the task context's DAG run), but its expiry.

    The expiry is the create's to set when the place is granted (the VM's life counts from its insert)."""
    started = dag_run.start_date or dag_run.run_after
    dated = dag_run.logical_date or dag_run.run_after
    return {
        "claim": claim, "run": f"{dag_run.dag_id}/{dag_run.run_id}", "deployment": deployment,
        "started": started.isoformat() if started else "", "logical_date": dated.isoformat() if dated else "",
        "size": size,
    }


@dataclass(frozen=True)
class Request:
    """A create's request for a place.

    :param claim: the VM's name, or the slice's group name (deterministic per run and deployment).
    :param run: ``dag_id/run_id`` of the run that asks, for the log lines of the others.
    :param deployment: the Airflow deployment that asks.
    :param started: when the run started (ISO 8601), its place in line.
    :param logical_date: the run's logical date (ISO 8601, or its run_after), then its place in line.
    :param expires_at: when the VM expires if it is granted now (epoch seconds): a place held past it (plus the
        reaper's grace) is given back whatever the run's state, as the VM is deleted then.
    :param size: the TPU chips the VM (or every VM of the slice) holds, what it takes of the cap.
    """

    claim: str
    run: str
    deployment: str
    started: str
    logical_date: str
    expires_at: int
    size: int = 1

    def as_entry(self, now: str) -> dict[str, Any]:
        return {
            "run": self.run, "deployment": self.deployment, "started": self.started, "size": self.size,
            "logical_date": self.logical_date, "expires_at": self.expires_at, "asked": now, "seen": now,
        }


@dataclass(frozen=True)
class Answer:
    """Where a request stands after asking.

    ``granted``: the place is the request's (insert now). Else its ``position`` in line (1: next). ``holders``
    and ``ahead``: the runs (and VMs) holding places and those ahead in line, for the log; ``in_use``: the chips
    they hold. ``refused``: why the request can never be granted in this line (its cap is another, or the request
    is larger than the cap); it is then not in line."""

    granted: bool
    position: int
    holders: list[str]
    ahead: list[str]
    in_use: int = 0
    refused: str = ""

    def describe(self, cap: int) -> str:
        held = "; ".join(self.holders) or "nobody"
        line = f"{self.in_use} of {cap} TPU chips in use by {held}"
        if self.ahead:
            line += f"; {len(self.ahead)} ahead in line: " + "; ".join(self.ahead)
        return line


def order_of(entry: Mapping[str, Any]) -> tuple[str, str, str]:
    """First come (the run's start, to the second), then the oldest logical date, then the run id.

    By instant, not by text: in the hour the clocks go back, 01:50-07:00 comes before 01:10-08:00."""
    return (_utc(entry.get("started"))[:19], _utc(entry.get("logical_date")), str(entry.get("run", "")))


def _utc(stamp: object) -> str:
    if not stamp:
        return ""
    return datetime.fromisoformat(str(stamp)).astimezone(UTC).isoformat()


def _seconds_between(earlier: str, later: str) -> float:
    return (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()


def _size(entry: Mapping[str, Any]) -> int:
    return int(entry.get("size", 1))


def ask(
    line: Mapping[str, Any], request: Request, cap: int, now: str, unclaimed: Mapping[str, int] | None = None
) -> tuple[dict[str, Any], Answer]:
    """The line after ``request`` asked for ``request.size`` chips under a cap of ``cap`` chips, and its answer.

    ``unclaimed``: live VMs (or slices) of the line's key that hold no place in it, with their chips (made by a
    release of this provider that did not take places): each counts as held. A request already holding its place
    is granted again (a retried create, a recovery making the VM again). The line keeps the cap its first request
    brought; one that brings another while anyone else is in the line is refused, as is one larger than the cap."""
    holders = dict(line.get("holders") or {})
    waiting = {
        claim: entry for claim, entry in (line.get("waiting") or {}).items()
        if claim == request.claim or _seconds_between(entry.get("seen", now), now) <= WAITING_STALE_S
    }
    extra = {name: size for name, size in (unclaimed or {}).items() if name not in holders and name != request.claim}
    describe_holders = [f"{entry['run']} ({claim}, {_size(entry)} chips)" for claim, entry in holders.items()] + [
        f"a VM that holds no place ({name}, {size} chips)" for name, size in sorted(extra.items())
    ]
    in_use = sum(_size(entry) for entry in holders.values()) + sum(extra.values())
    if request.claim in holders:
        return _line(holders, waiting, line.get("cap", cap)), Answer(True, 0, describe_holders, [], in_use)
    others = (set(holders) | set(waiting)) - {request.claim}
    kept = line.get("cap")
    if kept is not None and kept != cap and others:
        refusal = (
            f"the line keeps a cap of {kept} TPU chips, set by the runs in it, and this run brings {cap}: give every "
            "DAG and deployment sharing this pool the same cap"
        )
        return dict(line), Answer(False, 0, describe_holders, [], in_use, refusal)
    if request.size > cap:
        refusal = f"it needs {request.size} TPU chips, more than the cap of {cap}: raise the cap or use fewer chips"
        return dict(line), Answer(False, 0, describe_holders, [], in_use, refusal)
    earlier = waiting.get(request.claim)
    mine = dict(earlier) if earlier else request.as_entry(now)
    if _seconds_between(mine["seen"], now) >= REFRESH_S:  # a write per REFRESH_S, not per poll
        mine["seen"] = now
    waiting[request.claim] = mine
    in_line = sorted(waiting, key=lambda claim: order_of(waiting[claim]))
    index = in_line.index(request.claim)
    if in_use + sum(_size(waiting[claim]) for claim in in_line[: index + 1]) <= cap:
        del waiting[request.claim]
        holders[request.claim] = {
            **{k: v for k, v in mine.items() if k != "seen"}, "expires_at": request.expires_at, "since": now,
        }
        return _line(holders, waiting, cap), Answer(True, 0, describe_holders, [], in_use)
    ahead = [f"{waiting[claim]['run']} ({claim}, {_size(waiting[claim])} chips)" for claim in in_line[:index]]
    return _line(holders, waiting, cap), Answer(False, index + 1, describe_holders, ahead, in_use)


def release(line: Mapping[str, Any], claim: str) -> tuple[dict[str, Any], bool]:
    """The line without ``claim`` (held or waiting), and whether it held a place."""
    holders = {c: e for c, e in (line.get("holders") or {}).items() if c != claim}
    waiting = {c: e for c, e in (line.get("waiting") or {}).items() if c != claim}
    return _line(holders, waiting, line.get("cap")), len(holders) != len(line.get("holders") or {})


def leave_waiting(line: Mapping[str, Any], claim: str) -> tuple[dict[str, Any], bool]:
    """The line without ``claim``'s wait (a place it holds stays: its VM gives it back), and whether it waited."""
    waiting = {c: e for c, e in (line.get("waiting") or {}).items() if c != claim}
    left = len(waiting) != len(line.get("waiting") or {})
    return (_line(dict(line.get("holders") or {}), waiting, line.get("cap")) if left else dict(line)), left


def _line(holders: dict[str, Any], waiting: dict[str, Any], cap: int | None) -> dict[str, Any]:
    """A line keeps its cap while anyone is in it; an empty line takes the next request's."""
    kept = cap is not None and bool(holders or waiting)
    return {"holders": holders, "waiting": waiting, **({"cap": cap} if kept else {})}


def stale_holders(
    line: Mapping[str, Any],
    exists: Mapping[str, bool | None],
    run_states: Mapping[str, str | None],
    now: datetime,
    grace_s: int,
    deployment: str,
) -> dict[str, str]:
    """The places the reaper gives back, with why: the reaper's evidence rule for VMs, applied to places.

    A place whose VM (or slice) exists is never given back here: the reaper deletes that VM by its own rule,
    and the delete gives the place back. Else, given back when it expired (plus ``grace_s``), or when its run
    is over or absent in Airflow (asked of this deployment's places only, ``run_states`` by ``dag_id/run_id``)
    and it was taken more than ``grace_s`` ago. ``exists`` None (Compute could not be read) keeps it."""
    reasons = {}
    for claim, entry in (line.get("holders") or {}).items():
        if exists.get(claim) is not False:
            continue
        pseudo = {
            "labels": {
                "managed-by": MANAGED_BY, "expires-at": str(entry.get("expires_at", "")),
                DEPLOYMENT_LABEL: entry.get("deployment", ""),
            },
            "creationTimestamp": entry.get("since"),
        }
        decision = reaper.decide(pseudo, run_states.get(entry.get("run", "")), now, grace_s, deployment)
        if decision.delete:
            reasons[claim] = decision.reason
    return reasons
