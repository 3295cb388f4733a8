"""Waiting in line for a place under the TPU cap, from the triggerer: what the VM and slice creates share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from airflow_tpu_posttrain.recipes import places

if TYPE_CHECKING:
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook


async def take_place(
    lines: StoredRecordAsyncHook,
    uri: str,
    request: places.Request,
    cap: int,
    capacity_wait: float,
    live_places: Callable[[], Awaitable[list[str]]],
    poll_interval: float,
    log: logging.Logger,
) -> str | None:
    """Wait in the line at ``uri`` until a place is ``request``'s: None then.

    ``live_places``: the places the line's live VMs hold (by label), the request's own left out. The wait's bound
    (``capacity_wait``) counts from when the request became first in line: a line that moves never fails it.
    Timed out, the request leaves the line and the wait's last description is returned."""
    said = ""
    while True:
        unclaimed = await live_places()
        now = datetime.now(UTC)
        answer = await lines.change(
            uri, lambda line, now=now, unclaimed=unclaimed: places.ask(line, request, cap, now.isoformat(), unclaimed)
        )
        described = answer.describe(cap)
        if answer.granted:
            log.info("Took a place under the cap of %s TPU VMs in %s: %s", cap, uri, described)
            return None
        first_for = (now - datetime.fromisoformat(answer.first_since)).total_seconds() if answer.first_since else 0.0
        if first_for >= capacity_wait:
            await give_place_back(lines, uri, request.claim, log)
            return described
        if described != said:
            log.info(
                "Waiting for TPU capacity, #%s in line %s (the wait's bound of %s s counts while first): %s",
                answer.position, uri, int(capacity_wait), described,
            )
            said = described
        await asyncio.sleep(poll_interval)


async def give_place_back(lines: StoredRecordAsyncHook, uri: str, claim: str, log: logging.Logger) -> None:
    """Leave the line at ``uri``: the place ``claim`` holds there, or its wait."""
    if await lines.change(uri, lambda line: places.release(line, claim)):
        log.info("Gave back the place of %s in %s", claim, uri)
