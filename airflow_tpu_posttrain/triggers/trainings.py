"""Following another run that trains the same inputs: wait, in the triggerer, until its claim changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_tpu_posttrain.defaults import GCP_CONN_ID
from airflow_tpu_posttrain.triggers.settle import not_before_settled


class ClaimChangeTrigger(BaseTrigger):
    """Fires when the claim at ``uri`` is no longer ``seen``, or after ``recheck_s`` without a change.

    The event says which (``changed``); the task then decides again: a published model is reused, a claim
    whose run ended without publishing is taken over (the run's state is the task's to read, not the
    triggerer's), a claim still held is followed again. A claim that cannot be read is logged and read again.

    :param uri: the claim's ``gs://`` object (``recipes/trainings.claim_uri``).
    :param seen: the claim as the task last read it.
    :param recheck_s: seconds after which the task looks at the owner's run even though the claim is unchanged.
    :param poll_interval: seconds between two reads of the claim.
    :param gcp_conn_id: the Google connection that reads checkpoint storage.
    """

    def __init__(
        self,
        uri: str,
        seen: dict[str, Any],
        recheck_s: float,
        poll_interval: float = 15.0,
        gcp_conn_id: str = GCP_CONN_ID,
    ) -> None:
        super().__init__()
        self.uri = uri
        self.seen = seen
        self.recheck_s = recheck_s
        self.poll_interval = poll_interval
        self.gcp_conn_id = gcp_conn_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "uri": self.uri,
            "seen": self.seen,
            "recheck_s": self.recheck_s,
            "poll_interval": self.poll_interval,
            "gcp_conn_id": self.gcp_conn_id,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(self._events(), time.monotonic()):
            yield event

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

        records = StoredRecordAsyncHook(gcp_conn_id=self.gcp_conn_id)
        deadline = time.monotonic() + self.recheck_s
        while time.monotonic() < deadline:
            try:
                claim = await records.read(self.uri)
            except Exception as err:  # noqa: BLE001 - storage unreachable for a while: read again
                self.log.warning("Could not read the claim %s: %s", self.uri, err)
            else:
                if claim != self.seen:
                    yield TriggerEvent({"changed": True, "claim": claim})
                    return
            await asyncio.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        yield TriggerEvent({"changed": False})
