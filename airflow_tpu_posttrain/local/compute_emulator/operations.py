"""Compute Engine operations: what every insert and delete answers, and a client polls or waits on until DONE.

Google's behaviour: zonal, regional and global ``Operation`` resources with ``get`` and ``wait`` (``wait`` answers
once DONE, or with the operation as it is when its deadline comes):
https://cloud.google.com/compute/docs/reference/rest/v1/zoneOperations, .../regionOperations, .../globalOperations;
PENDING -> RUNNING -> DONE, a failure as DONE with ``error`` and ``httpErrorStatusCode`` ("Handling API responses":
https://cloud.google.com/compute/docs/api/how-tos/api-requests-responses); a repeated ``requestId`` answered with the
first request's operation (the ``requestId`` parameter of each insert and delete, e.g.
https://cloud.google.com/compute/docs/reference/rest/v1/instances/insert).

Operations finish after ``operation_seconds``: PENDING for the first half (at most a second), then RUNNING, then
DONE. State is advanced lazily from the clock whenever the emulator is asked anything (``_advance``), so no timer
threads are needed. Note that ``ExtendedOperation.result()`` of google-cloud-compute polls ``compute.googleapis.com``
whatever the endpoint; wait with a ``ZoneOperationsClient`` built with the same client options instead.
"""

from __future__ import annotations

import copy
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from airflow_tpu_posttrain.local.compute_emulator import api

WAIT_TIMEOUT_SECONDS = 2.0
"""How long ``operations/{op}/wait`` blocks before returning a not-yet-DONE operation."""
MAX_PENDING_SECONDS = 1.0
"""An operation is PENDING for half its time, but at most this long, then RUNNING until DONE."""


class OperationError(NamedTuple):
    """Why an operation ends DONE with an ``error`` (the request itself was accepted)."""

    code: str
    message: str
    http_status: int
    http_message: str


@dataclasses.dataclass
class Operation:
    resource: dict[str, Any]
    start_at: float
    done_at: float
    failure: OperationError | None
    on_running: Callable[[], None]
    on_done: Callable[[bool], None]
    """Applies the operation's effect; receives whether the operation failed."""


class OperationsMixin:
    """Operations (``_operations``, ``_operations_by_request_id``), and the clock every resource follows."""

    def _start_operation(
        self,
        project: str,
        zone: str | None,
        operation_type: str,
        target: dict[str, Any],
        query: dict[str, str],
        failure: OperationError | None = None,
        on_running: Callable[[], None] = lambda: None,
        on_done: Callable[[bool], None] = lambda failed: None,
        queued_s: float | None = None,
        region: str | None = None,
    ) -> dict[str, Any]:
        """Start an operation on ``target`` (call with the lock held); ``on_*`` apply its effects.

        ``queued_s``: the operation waits that long (for capacity) before it runs. A zonal operation names its
        ``zone``, a regional one its ``region``, a global one neither."""
        now = time.time()
        name = f"operation-{int(now * 1000)}-{secrets.token_hex(6)}"
        path = api.resource_path(project, zone, "operations", name, region)
        resource = {
            "kind": "compute#operation",
            "id": api.numeric_id(),
            "name": name,
            "operationType": operation_type,
            "targetLink": target["selfLink"],
            "targetId": target["id"],
            "status": "PENDING",
            "user": "emulator@example.com",
            "progress": 0,
            "insertTime": api.timestamp(now),
            "selfLink": f"{api.API_ROOT}/{path}",
        }
        if zone:
            resource["zone"] = f"{api.API_ROOT}/projects/{project}/zones/{zone}"
        if region:
            resource["region"] = f"{api.API_ROOT}/projects/{project}/regions/{region}"
        seconds = self._faults.operation_seconds
        start_at = now + min(seconds / 2, MAX_PENDING_SECONDS)
        done_at = now + seconds
        if queued_s is not None:
            start_at, done_at = now + queued_s, now + queued_s + seconds
        operation = Operation(resource, start_at, done_at, failure, on_running, on_done)
        self._operations[(project, api.scope_of(zone, region), name)] = operation
        if "requestId" in query:
            self._operations_by_request_id[(project, query["requestId"])] = operation
        self._advance()
        return copy.deepcopy(resource)

    def _replayed_operation(self, project: str, query: dict[str, str]) -> dict[str, Any] | None:
        """The operation an earlier request with the same ``requestId`` started, as the real API does.

        Brings the emulator up to now first, as every request does (call with the lock held)."""
        self._advance()
        operation = self._operations_by_request_id.get((project, query.get("requestId", "")))
        return copy.deepcopy(operation.resource) if operation else None

    def _advance(self) -> None:
        """Bring operations, instances and groups up to the current time (call with the lock held)."""
        now = time.time()
        for operation in self._operations.values():
            resource = operation.resource
            if resource["status"] == "DONE":
                continue
            if now >= operation.start_at and resource["status"] == "PENDING":
                resource.update(status="RUNNING", progress=50, startTime=api.timestamp(now))
                operation.on_running()
            if now >= operation.done_at:
                resource.update(status="DONE", progress=100, endTime=api.timestamp(now))
                if operation.failure:
                    failure = operation.failure
                    resource["error"] = {"errors": [{"code": failure.code, "message": failure.message}]}
                    resource["httpErrorStatusCode"] = failure.http_status
                    resource["httpErrorMessage"] = failure.http_message
                operation.on_done(operation.failure is not None)
        self._advance_instances(now)
        self._advance_groups(now)
        self._sync_firewalls()

    def _get_operation(
        self, query: dict, body: dict, project: str, name: str, zone: str | None = None, region: str | None = None
    ):
        with self._lock:
            self._advance()
            operation = self._operations.get((project, api.scope_of(zone, region), name))
            if operation is None:
                raise api.not_found(api.resource_path(project, zone, "operations", name, region))
            return 200, copy.deepcopy(operation.resource)

    def _wait_operation(
        self, query: dict, body: dict, project: str, name: str, zone: str | None = None, region: str | None = None
    ):
        """Block until the operation is DONE or ``WAIT_TIMEOUT_SECONDS`` pass, like the real ``wait``."""
        give_up_at = time.time() + WAIT_TIMEOUT_SECONDS
        while True:
            status, resource = self._get_operation(query, body, project, name, zone, region)
            remaining = give_up_at - time.time()
            if resource["status"] == "DONE" or remaining <= 0:
                return status, resource
            time.sleep(min(remaining, 0.02))
