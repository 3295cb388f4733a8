"""Event-driven retraining: a trigger that fires when a Hugging Face Hub repo gets a new revision.

For ``AssetWatcher`` (Airflow's event-driven scheduling): a registry entry with ``schedule: on_change`` is
scheduled on its base model and its dataset as Assets, each watched by this trigger in the triggerer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

REVISION_KEY = "revision"  # in the watched asset's state store: the last revision seen


class HubRevisionTrigger(BaseEventTrigger):
    """Fires when the head of a Hub repo's default branch moves to a new commit.

    The first revision it sees is its baseline (a DAG newly scheduled on a repo does not run for what was
    already there). The last revision seen is kept in the watched asset's state store, so a restarted
    triggerer neither misses a change made meanwhile nor fires again for one it already reported. A Hub that
    cannot be reached is logged and asked again at the next poll.

    :param repo_id: ``owner/name`` on the Hub.
    :param repo_type: ``model`` or ``dataset``.
    :param hf_conn_id: connection whose password is the token (a gated or private repo) and whose host, if
        set, is the Hub's endpoint.
    :param poll_interval: seconds between two looks at the repo.
    """

    def __init__(
        self,
        repo_id: str,
        repo_type: str = "model",
        hf_conn_id: str | None = None,
        poll_interval: float = 600.0,
    ) -> None:
        super().__init__()
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.hf_conn_id = hf_conn_id
        self.poll_interval = poll_interval
        self._last_in_memory: str | None = None  # without a state store (run outside a watcher)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            "repo_id": self.repo_id,
            "repo_type": self.repo_type,
            "hf_conn_id": self.hf_conn_id,
            "poll_interval": self.poll_interval,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        last = await self._last_seen()
        while True:
            try:
                revision = await self._current_revision()
            except Exception as err:  # noqa: BLE001 - an unreachable Hub is asked again, not a failed watch
                self.log.warning("Could not read the revision of %s %s: %s", self.repo_type, self.repo_id, err)
            else:
                if last is not None and revision != last:
                    self.log.info("%s %s: new revision %s (was %s)", self.repo_type, self.repo_id, revision, last)
                    yield TriggerEvent({"repo_id": self.repo_id, "repo_type": self.repo_type, "revision": revision})
                if revision != last:
                    await self._remember(revision)
                    last = revision
            await asyncio.sleep(self.poll_interval)

    async def _current_revision(self) -> str:
        endpoint, token = await self._hub()
        return await asyncio.to_thread(self._repo_sha, endpoint, token)

    def _repo_sha(self, endpoint: str | None, token: str | None) -> str:
        from huggingface_hub import HfApi

        return HfApi(endpoint=endpoint, token=token).repo_info(self.repo_id, repo_type=self.repo_type).sha

    async def _hub(self) -> tuple[str | None, str | None]:
        if not self.hf_conn_id:
            return None, None
        from airflow.providers.common.compat.connection import get_async_connection

        conn = await get_async_connection(self.hf_conn_id)
        return conn.host or None, conn.password or None

    async def _last_seen(self) -> str | None:
        if self.asset_state_store is None:
            return self._last_in_memory
        return await self.asset_state_store.aget(REVISION_KEY)

    async def _remember(self, revision: str) -> None:
        self._last_in_memory = revision
        if self.asset_state_store is not None:
            await self.asset_state_store.aset(REVISION_KEY, revision)
