"""Asynchronous Compute Engine work: deletes started from the triggerer, waits for operations and, optionally,
for an instance to be RUNNING."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_tpu_posttrain.hooks.compute import _TRANSIENT_NAMES, TpuVmAsyncHook
from airflow_tpu_posttrain.recipes.compute import DEAD_STATES
from airflow_tpu_posttrain.triggers.settle import not_before_settled


class ComputeOperationsTrigger(BaseTrigger):
    """
    Start ``deletes``, then poll their and the given operations until DONE, reading ``operation.error``; then,
    if ``instance`` is given, poll it to RUNNING.

    Deleting from here keeps ``google-cloud-compute`` (seconds to import) out of the worker that runs the
    teardown: the triggerer has it loaded, so the VM's deletion starts as soon as the teardown is scheduled.
    The event never comes sooner than ``settle.MIN_DEFERRAL_SECONDS`` after the deferral.

    :param project_id: the project of the operations and the instance.
    :param operations: ``[{"name": op, "zone": zone-or-None}]``; zone None means a global operation.
    :param deletes: ``[{"name", "zone", "request_id"}]`` to delete first; zone None means a firewall rule.
        The event's ``deleted`` lists those that existed.
    :param instance: ``{"name", "zone"}`` of an instance that must reach RUNNING, or None.
    :param max_transient_failures: consecutive 429/5xx answers tolerated while polling.
    :param state: the deferring operator's state, returned unchanged in the event as ``state``.
    """

    def __init__(
        self,
        project_id: str,
        operations: list[dict[str, str | None]],
        instance: dict[str, str] | None = None,
        deletes: list[dict[str, str | None]] | None = None,
        gcp_conn_id: str = "google_cloud_default",
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        poll_interval: float = 10.0,
        max_transient_failures: int = 10,
        state: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.project_id = project_id
        self.operations = operations
        self.instance = instance
        self.deletes = deletes or []
        self.gcp_conn_id = gcp_conn_id
        self.api_endpoint = api_endpoint
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.max_transient_failures = max_transient_failures
        self.state = state or {}

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "project_id": self.project_id,
                "operations": self.operations,
                "instance": self.instance,
                "deletes": self.deletes,
                "gcp_conn_id": self.gcp_conn_id,
                "api_endpoint": self.api_endpoint,
                "impersonation_chain": self.impersonation_chain,
                "poll_interval": self.poll_interval,
                "max_transient_failures": self.max_transient_failures,
                "state": self.state,
            },
        )

    async def _poll(self, call) -> Any:
        """Run ``call`` until it answers, sleeping between transient API failures."""
        from google.api_core import exceptions

        transient = tuple(getattr(exceptions, name) for name in _TRANSIENT_NAMES)
        failures = 0
        while True:
            try:
                return await call()
            except transient as err:
                failures += 1
                if failures > self.max_transient_failures:
                    raise
                self.log.warning(
                    "Compute API answered %s; retrying (%d/%d)", err, failures, self.max_transient_failures
                )
                await asyncio.sleep(min(self.poll_interval * failures, 60))

    async def _delete(self, hook: TpuVmAsyncHook, target: dict[str, str | None]) -> str | None:
        """Start deleting an instance (``zone`` set) or a firewall rule; the operation, or None if it is gone."""
        if target.get("zone"):
            return await hook.delete_instance(
                self.project_id, target["zone"], target["name"], target["request_id"]
            )
        return await hook.delete_firewall(self.project_id, target["name"], target["request_id"])

    def _event(self, payload: dict[str, Any]) -> TriggerEvent:
        return TriggerEvent({**payload, "state": self.state})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(self._events(), time.monotonic()):
            yield event

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        hook = TpuVmAsyncHook(
            gcp_conn_id=self.gcp_conn_id,
            api_endpoint=self.api_endpoint,
            impersonation_chain=self.impersonation_chain,
        )
        try:
            operations, deleted = list(self.operations), []
            for target in self.deletes:
                zone, name = target.get("zone"), target["name"]
                operation = await self._poll(lambda target=target: self._delete(hook, target))
                if operation:
                    operations.append({"name": operation, "zone": zone})
                    deleted.append({"name": name, "zone": zone})
            for op in operations:
                while True:
                    operation = await self._poll(
                        lambda op=op: hook.get_operation(self.project_id, op["name"], op.get("zone"))
                    )
                    if operation.get("status") == "DONE":
                        break
                    await asyncio.sleep(self.poll_interval)
                errors = operation.get("error", {}).get("errors", [])
                if errors:
                    yield self._event({"status": "error", "operation": op["name"], "errors": errors})
                    return
                self.log.info("Operation %s is DONE", op["name"])
            if not self.instance:
                yield self._event({"status": "success", "deleted": deleted})
                return
            zone, name = self.instance["zone"], self.instance["name"]
            while True:
                found = await self._poll(lambda: hook.get_instance(self.project_id, zone, name))
                status = found.get("status") if found else None
                if status == "RUNNING":
                    yield self._event({"status": "success", "instance": found})
                    return
                if status is None or status in DEAD_STATES:
                    message = f"instance {name} in {zone} is {status or 'gone'} instead of RUNNING"
                    yield self._event(
                        {"status": "error", "errors": [{"code": "INSTANCE_NOT_RUNNING", "message": message}]}
                    )
                    return
                self.log.info("Instance %s is %s; waiting for RUNNING", name, status)
                await asyncio.sleep(self.poll_interval)
        except Exception as err:
            yield self._event(
                {"status": "error", "errors": [{"code": type(err).__name__, "message": str(err)}]}
            )
