"""Waiting, in the triggerer, for the moment a run's TPU VM is to be requested (``operators/just_in_time.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_tpu_posttrain.triggers.settle import not_before_settled

ENDED = frozenset({"success", "skipped"})
FAILED = frozenset({"failed", "upstream_failed", "removed"})


class ConversionScheduleTrigger(BaseTrigger):
    """Wait until ``request_at``, or until the run's conversion task has ended, whichever comes first.

    The wait is bounded by ``request_at`` alone, never by the conversion: a runner that runs one task at a time
    (``dag.test``) still goes on.

    Fires once with fixed keys: ``{"status": "due" | "converted" | "failed", "conversion_state",
    "conversion_ends_at", "state"}``, never sooner than ``settle.MIN_DEFERRAL_SECONDS`` after the deferral.

    :param dag_id: the run's DAG.
    :param run_id: the run.
    :param task_id: the run's conversion task.
    :param request_at: Unix time the VM is to be requested at the latest.
    :param conversion_ends_at: Unix time the conversion is expected to end (for the log), or None.
    :param poll_interval: seconds between looks at the conversion task's state.
    :param state: the deferring operator's state, returned unchanged in the event.
    """

    def __init__(
        self,
        dag_id: str,
        run_id: str,
        task_id: str,
        request_at: float,
        conversion_ends_at: float | None = None,
        poll_interval: float = 10.0,
        state: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.dag_id = dag_id
        self.run_id = run_id
        self.task_id = task_id
        self.request_at = request_at
        self.conversion_ends_at = conversion_ends_at
        self.poll_interval = poll_interval
        self.state = state or {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "request_at": self.request_at,
            "conversion_ends_at": self.conversion_ends_at,
            "poll_interval": self.poll_interval,
            "state": self.state,
        }

    async def _conversion_state(self) -> str | None:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
        from asgiref.sync import sync_to_async

        states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
            dag_id=self.dag_id, task_ids=[self.task_id], run_ids=[self.run_id]
        )
        return (states.get(self.run_id) or {}).get(self.task_id)

    def _event(self, status: str, conversion_state: str | None) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status,
                "conversion_state": conversion_state,
                "conversion_ends_at": self.conversion_ends_at,
                "state": self.state,
            }
        )

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        while True:
            state = await self._conversion_state()
            if state in ENDED:
                yield self._event("converted", state)
                return
            if state in FAILED:
                yield self._event("failed", state)
                return
            left = self.request_at - time.time()
            if left <= 0:
                yield self._event("due", state)
                return
            await asyncio.sleep(min(self.poll_interval, left))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(self._events(), time.monotonic()):
            yield event
