"""Waiting in line for a place under the TPU cap, from the triggerer: what the VM and slice creates share.

The wait has no bound of its own: a line whose holders are live runs moves when they end, however long they train.
A place whose holder is gone is given back on the reaper's evidence (``places.stale_holders``): its VM (or slice)
is not live in the line's zone, and it expired, or its run (of this deployment) is over or absent. A cancelled wait
(the task marked failed or cleared, the deferral timed out) leaves the line at once; a triggerer that stops keeps
it, and the trigger run again asks in the same place (the run's start orders the line).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from airflow_tpu_posttrain.recipes import places, reaper

if TYPE_CHECKING:
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

# Where a waiting run stands goes to the log when it changes, and at least this often.
REPORT_S = 300.0
# A holder whose VM is gone is given back this long after it expired or its run ended (the reaper's default).
HOLDER_GRACE_S = 900


class PlaceRefused(Exception):  # noqa: N818 - the trigger's answer, turned into its event
    """The line can never grant the request (another cap, or a request larger than the cap): why, with the fix."""


async def run_state(run: str) -> str | None:
    """The state of the DAG run ``dag_id/run_id``, asked of Airflow from the triggerer.

    ``reaper.RUN_ABSENT`` when Airflow answers it does not exist; None when it cannot be read."""
    from asgiref.sync import sync_to_async

    from airflow_tpu_posttrain.operators.reaper import status_code

    dag_id, _, run_id = run.partition("/")
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        state = await sync_to_async(RuntimeTaskInstance.get_dagrun_state)(dag_id=dag_id, run_id=run_id)
    except Exception as err:  # noqa: BLE001 - any failure but a 404 leaves the state unknown: the place is kept
        return reaper.RUN_ABSENT if status_code(err) == 404 else None
    return str(getattr(state, "value", state))


async def take_place(
    lines: StoredRecordAsyncHook,
    uri: str,
    request: places.Request,
    lifetime_s: int,
    cap: int,
    live_places: Callable[[], Awaitable[dict[str, int]]],
    poll_interval: float,
    log: logging.Logger,
    run_state_of: Callable[[str], Awaitable[str | None]] = run_state,
) -> int:
    """Wait in the line at ``uri`` until a place is ``request``'s; when its VM expires, counted from the grant.

    ``lifetime_s``: the VM's life (its ``maxRunDuration``), from the moment the place is granted. ``live_places``:
    the places the line's live VMs hold (by label), with their chips, the request's own left out. Raises
    :class:`PlaceRefused` when the line can never grant it; the request is then not in line."""
    said, said_at, since = "", 0.0, time.monotonic()
    while True:
        live = await live_places()
        held = (await lines.read(uri)).get("holders") or {}
        exists = {claim: claim in live for claim in held if claim != request.claim}
        states = {
            entry.get("run", ""): await run_state_of(entry.get("run", ""))
            for claim, entry in held.items()
            if exists.get(claim) is False and entry.get("deployment") == request.deployment
        }
        now = datetime.now(UTC)
        asking = dataclasses.replace(request, expires_at=int(now.timestamp()) + lifetime_s)
        answer, freed = await lines.change(
            uri,
            lambda line, now=now, asking=asking, live=live, exists=exists, states=states: _sweep_and_ask(
                line, asking, cap, now, live, exists, states
            ),
        )
        for claim, reason in freed.items():
            log.warning("Gave back the place of %s in %s, whose holder is gone: %s", claim, uri, reason)
        described = answer.describe(cap)
        if answer.refused:
            raise PlaceRefused(f"{uri}: {answer.refused} ({described})")
        if answer.granted:
            log.info("Took a place of %s TPU chips under the cap of %s in %s: %s", request.size, cap, uri, described)
            return asking.expires_at
        if described != said or time.monotonic() - said_at >= REPORT_S:
            log.info(
                "Waiting for TPU capacity, #%s in line %s for %s TPU chips, %d min so far (the line moves as the "
                "runs holding it end): %s",
                answer.position, uri, request.size, (time.monotonic() - since) // 60, described,
            )
            said, said_at = described, time.monotonic()
        await asyncio.sleep(poll_interval)


def _sweep_and_ask(
    line: dict, request: places.Request, cap: int, now: datetime, live: dict[str, int],
    exists: dict[str, bool], states: dict[str, str | None],
) -> tuple[dict, tuple[places.Answer, dict[str, str]]]:
    """The places of gone holders given back (on the evidence gathered), then ``request`` asked: in one write."""
    freed = places.stale_holders(line, exists, states, now, HOLDER_GRACE_S, request.deployment)
    for claim in freed:
        line, _ = places.release(line, claim)
    line, answer = places.ask(line, request, cap, now.isoformat(), live)
    return line, (answer, freed)


async def give_place_back(lines: StoredRecordAsyncHook, uri: str, claim: str, log: logging.Logger) -> None:
    """Leave the line at ``uri``: the place ``claim`` holds there, or its wait."""
    if await lines.change(uri, lambda line: places.release(line, claim)):
        log.info("Gave back the place of %s in %s", claim, uri)


async def leave_line(lines: StoredRecordAsyncHook, uris: Iterable[str], claim: str, log: logging.Logger) -> None:
    """Leave the wait of ``claim`` in ``uris``, its place in none of them: a cancelled create's last step."""
    for uri in dict.fromkeys(uris):
        if await lines.change(uri, lambda line: places.leave_waiting(line, claim)):
            log.info("Left the line %s: the wait of %s was cancelled", uri, claim)


def lifetime_of(body: dict, state: dict) -> int:
    """The life of a VM whose create an earlier release deferred (no ``lifetime_s``; its expiry set at the request).

    Its body's ``expires-at`` less when it was requested: a wait in line across the upgrade keeps the VM's life."""
    expires = str((body.get("labels") or {}).get("expires-at", ""))
    return max(0, int(expires) - int(state.get("requested_at") or 0)) if expires.isdigit() else 0


def request_of(fields: dict) -> places.Request:
    """The :class:`places.Request` of a trigger's ``request``, its expiry set when the place is granted."""
    return places.Request(**{**fields, "expires_at": 0})


class LeavesLineWhenCancelled:
    """A create trigger that waits in line: its wait leaves the line when the task is killed or times out.

    The trigger says where it waits (``_waiting_in``: the lines' URIs and its claim) and has ``cap``,
    ``gcp_conn_id``, ``impersonation_chain`` and ``log``."""

    def _waiting_in(self) -> tuple[Iterable[str], str]:
        raise NotImplementedError

    async def on_kill(self) -> None:
        """The task was marked failed, cleared or succeeded while this create waited: its wait leaves the line."""
        await self._leave_line()

    async def cleanup(self) -> None:
        """The deferral timed out: the wait leaves the line. A triggerer that stops keeps it (asked again there)."""
        if timed_out(getattr(self, "timeout_after", None)):
            await self._leave_line()

    async def _leave_line(self) -> None:
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

        uris, claim = self._waiting_in()
        uris = [uri for uri in uris if uri]
        if self.cap is not None and uris:
            lines = StoredRecordAsyncHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
            await leave_line(lines, uris, claim, self.log)


def timed_out(timeout_after: datetime | None) -> bool:
    """Whether the deferral's timeout (the triggerer's ``timeout_after`` of the trigger) has passed."""
    if timeout_after is None:
        return False
    return (timeout_after if timeout_after.tzinfo else timeout_after.replace(tzinfo=UTC)) < datetime.now(UTC)
