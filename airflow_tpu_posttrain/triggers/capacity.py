"""Waiting for TPU capacity in the triggerer: no VM exists and no worker slot is held while a run waits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import TriggerEvent

from airflow_tpu_posttrain.hooks.compute import TpuVmAsyncHook
from airflow_tpu_posttrain.recipes import capacity
from airflow_tpu_posttrain.triggers.compute import ComputeTrigger


class TpuCapacityTrigger(ComputeTrigger):
    """Poll the capacity group's live TPU VMs until fewer than ``cap`` are held by others.

    The VMs are found by label, in ``zones``; the poll also ends at ``deadline`` (Unix time). With ``cap``
    None, only wait ``retry_after`` seconds (a reservation that was full: the insert is simply tried again).

    Fires once with fixed keys: ``{"status": "available" | "timeout", "in_use": str, "state"}``.

    :param project_id: the VMs' project.
    :param zones: where the group's VMs live.
    :param group: the group's label value (``recipes.capacity.group_label``).
    :param cap: how many VMs the group may hold at once; None: no count, just ``retry_after``.
    :param own_name: this run's instance name, never counted against itself.
    :param deadline: Unix time after which the wait ends with ``timeout``.
    :param retry_after: seconds to wait when ``cap`` is None.
    """

    def __init__(
        self,
        project_id: str,
        zones: list[str],
        group: str,
        cap: int | None,
        own_name: str,
        deadline: float,
        retry_after: float = 60.0,
        **common: Any,
    ) -> None:
        super().__init__(project_id, **common)
        self.zones = zones
        self.group = group
        self.cap = cap
        self.own_name = own_name
        self.deadline = deadline
        self.retry_after = retry_after

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "zones": self.zones,
            "group": self.group,
            "cap": self.cap,
            "own_name": self.own_name,
            "deadline": self.deadline,
            "retry_after": self.retry_after,
        }

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        if self.cap is None:
            await asyncio.sleep(min(self.retry_after, max(0.0, self.deadline - time.time())))
            status = "available" if time.time() < self.deadline else "timeout"
            yield self._event({"status": status, "in_use": ""})
            return
        hook = self._hook()
        last_said = ""
        while True:
            others = [i for i in await self._group(hook) if i.get("name") != self.own_name]
            in_use = capacity.describe(others, self.cap)
            if len(capacity.holders(others)) < self.cap:
                yield self._event({"status": "available", "in_use": in_use})
                return
            if time.time() >= self.deadline:
                yield self._event({"status": "timeout", "in_use": in_use})
                return
            if in_use != last_said:
                self.log.info("Waiting for TPU capacity: %s", in_use)
                last_said = in_use
            await asyncio.sleep(self.poll_interval)

    async def _group(self, hook: TpuVmAsyncHook) -> list[dict]:
        label_filter = f"labels.{capacity.GROUP_LABEL} = {self.group}"
        found: list[dict] = []
        for zone in self.zones:
            found += await hook.list_instances(self.project_id, zone, label_filter)
        return found
