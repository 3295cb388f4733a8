"""Places under the TPU cap: one line per capacity key, kept in one storage object, taken before any insert.

Pure: what a line holds and how a request, a release or the reaper changes it. ``hooks/stored_records.py`` reads the
object and writes it back only if nobody wrote it in between (a generation precondition), so of two creates
that ask at once one wins the write and the other asks again on what the winner wrote: a place is taken by
exactly one create, before it inserts, across triggerers and Airflow deployments sharing the bucket.

A line's key is where the VMs compete: the reservation (by name, however it is written), else the zone and the
machine series, in one project. A run whose zones are ``[b, a]`` asks in b's line; after a stock-out in b it
gives b's place back and asks in a's. A multi-host slice holds one place.

Order: first come, first served, a run coming when it started (to the second), then by its logical date (a
backfill's runs, started together, go oldest date first), then by run id. The wait's bound counts only while
the request is first in line: a line that moves is not a reason to fail, a place that never frees is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow_tpu_posttrain.recipes import reaper
from airflow_tpu_posttrain.recipes.capacity import reservation_names
from airflow_tpu_posttrain.recipes.compute import DEPLOYMENT_LABEL, MANAGED_BY

# A waiting request refreshes its entry at least this often; one not refreshed for WAITING_STALE_S is dropped
# (its create is gone: a failed task, a triggerer killed with its trigger, a run marked failed).
REFRESH_S = 60.0
WAITING_STALE_S = 600.0


def line_key(project: str, zone: str, reservation: str | None, machine_type: str) -> str:
    """The line a VM of ``machine_type`` made in ``zone`` (consuming ``reservation``) waits in.

    Readable, and a valid object name: ``PROJECT/reservation-NAMES`` or ``PROJECT/ZONE-SERIES``."""
    if reservation:
        names = reservation_names(reservation)
        key = "reservation-" + "+".join(names)
        if len(key) > 200:  # many blocks of one reservation: a digest keeps the object name short
            key = "reservation-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    else:
        key = f"{zone}-{machine_type.split('-', 1)[0]}"
    return f"{project}/{key}"


def line_uri(capacity_claims: str, key: str) -> str:
    """The object of the line ``key`` under ``capacity_claims`` (``gs://bucket/prefix``)."""
    return f"{capacity_claims.rstrip('/')}/{key}.json"


def request_of(dag_run: Any, claim: str, deployment: str, expires_at: int) -> dict[str, Any]:
    """The fields of a :class:`Request` for ``claim`` by ``dag_run`` (the task context's DAG run)."""
    started = dag_run.start_date or dag_run.run_after
    dated = dag_run.logical_date or dag_run.run_after
    return {
        "claim": claim, "run": f"{dag_run.dag_id}/{dag_run.run_id}", "deployment": deployment,
        "started": started.isoformat() if started else "", "logical_date": dated.isoformat() if dated else "",
        "expires_at": expires_at,
    }


@dataclass(frozen=True)
class Request:
    """A create's request for a place.

    :param claim: the VM's name, or the slice's group name (deterministic per run and deployment).
    :param run: ``dag_id/run_id`` of the run that asks, for the log lines of the others.
    :param deployment: the Airflow deployment that asks.
    :param started: when the run started (ISO 8601), its place in line.
    :param logical_date: the run's logical date (ISO 8601, or its run_after), then its place in line.
    :param expires_at: when the VM expires (epoch seconds): a place held past it (plus the reaper's grace) is
        given back whatever the run's state, as the VM is deleted then.
    """

    claim: str
    run: str
    deployment: str
    started: str
    logical_date: str
    expires_at: int

    def as_entry(self, now: str) -> dict[str, Any]:
        return {
            "run": self.run, "deployment": self.deployment, "started": self.started,
            "logical_date": self.logical_date, "expires_at": self.expires_at, "asked": now, "seen": now,
        }


@dataclass(frozen=True)
class Answer:
    """Where a request stands after asking.

    ``granted``: the place is the request's (insert now). Else its ``position`` in line (1: next), and
    ``first_since``: when it became first in line (None: not first), what the wait's bound counts from.
    ``holders`` and ``ahead``: the runs (and VMs) holding places and those ahead in line, for the log."""

    granted: bool
    position: int
    holders: list[str]
    ahead: list[str]
    first_since: str | None

    def describe(self, cap: int) -> str:
        held = "; ".join(self.holders) or "nobody"
        line = f"{len(self.holders)} of {cap} in use by {held}"
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


def ask(
    line: Mapping[str, Any], request: Request, cap: int, now: str, unclaimed: Iterable[str] = ()
) -> tuple[dict[str, Any], Answer]:
    """The line after ``request`` asked for a place among ``cap``, and its answer.

    ``unclaimed``: live VMs (or slices) of the line's key that hold no place in it (made by a release of this
    provider that did not take places): each counts as a place held. A request already holding its place is
    granted again (a retried create, a recovery making the VM again)."""
    holders = dict(line.get("holders") or {})
    waiting = {
        claim: entry for claim, entry in (line.get("waiting") or {}).items()
        if claim == request.claim or _seconds_between(entry.get("seen", now), now) <= WAITING_STALE_S
    }
    extra = sorted(set(unclaimed) - set(holders) - {request.claim})
    describe_holders = [f"{entry['run']} ({claim})" for claim, entry in holders.items()] + [
        f"a VM that holds no place ({name})" for name in extra
    ]
    if request.claim in holders:
        return _line(holders, waiting), Answer(True, 0, describe_holders, [], None)
    earlier = waiting.get(request.claim)
    mine = dict(earlier) if earlier else request.as_entry(now)
    if _seconds_between(mine["seen"], now) >= REFRESH_S:  # a write per REFRESH_S, not per poll
        mine["seen"] = now
    waiting[request.claim] = mine
    in_line = sorted(waiting, key=lambda claim: order_of(waiting[claim]))
    index = in_line.index(request.claim)
    free = max(0, cap - len(holders) - len(extra))
    if index < free:
        del waiting[request.claim]
        holders[request.claim] = {**{k: v for k, v in mine.items() if k not in ("seen", "first_since")}, "since": now}
        return _line(holders, waiting), Answer(True, 0, describe_holders, [], None)
    if index == 0:
        mine.setdefault("first_since", now)
    else:
        mine.pop("first_since", None)
    ahead = [f"{waiting[claim]['run']} ({claim})" for claim in in_line[:index]]
    return _line(holders, waiting), Answer(False, index + 1, describe_holders, ahead, mine.get("first_since"))


def release(line: Mapping[str, Any], claim: str) -> tuple[dict[str, Any], bool]:
    """The line without ``claim`` (held or waiting), and whether it held a place."""
    holders = {c: e for c, e in (line.get("holders") or {}).items() if c != claim}
    waiting = {c: e for c, e in (line.get("waiting") or {}).items() if c != claim}
    return _line(holders, waiting), len(holders) != len(line.get("holders") or {})


def _line(holders: dict[str, Any], waiting: dict[str, Any]) -> dict[str, Any]:
    return {"holders": holders, "waiting": waiting}


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
