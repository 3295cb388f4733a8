"""No trigger event sooner than a few seconds after the deferral.

Airflow 3.3 can fail a task that resumes a second or two after it deferred: the executor's report that the
deferring half of the task finished arrives after the task is running again, and the scheduler takes it for
the new half (apache/airflow#71580). Waiting this long before the event avoids the race; work inside the
trigger (deletes, polls) still starts at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

MIN_DEFERRAL_SECONDS = 5.0

T = TypeVar("T")


async def not_before_settled(events: AsyncIterator[T], started: float) -> AsyncIterator[T]:
    """``events``, none earlier than ``MIN_DEFERRAL_SECONDS`` after ``started`` (a ``time.monotonic()``)."""
    async for event in events:
        await asyncio.sleep(max(0.0, started + MIN_DEFERRAL_SECONDS - time.monotonic()))
        yield event
