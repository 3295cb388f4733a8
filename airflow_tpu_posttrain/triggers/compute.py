"""Asynchronous Compute Engine work, one trigger per kind of wait.

Each fires once with fixed event keys: deletes started from the triggerer here, the create in
``triggers/create.py``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_tpu_posttrain.triggers.settle import not_before_settled

if TYPE_CHECKING:
    # The hook (and the Google client libraries under it) is imported where a trigger runs: the operator that
    # builds one in a worker to defer never pays for it.
    from airflow_tpu_posttrain.hooks.compute import TpuVmAsyncHook


class ComputeTrigger(BaseTrigger):
    """What the Compute triggers share: the connection, the poll interval, and the operator's ``state``.

    The deferring operator's ``state`` is returned unchanged in every event; no event comes sooner than
    ``settle.MIN_DEFERRAL_SECONDS`` after the deferral. Subclasses yield from ``_events`` and add their own
    arguments to ``_kwargs``.

    :param project_id: the project the trigger works in.
    :param poll_interval: seconds between polls.
    :param state: the deferring operator's state, returned unchanged in the event as ``state``.
    """

    def __init__(
        self,
        project_id: str,
        gcp_conn_id: str = "google_cloud_default",
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        poll_interval: float = 10.0,
        state: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.project_id = project_id
        self.gcp_conn_id = gcp_conn_id
        self.api_endpoint = api_endpoint
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.state = state or {}

    def _kwargs(self) -> dict[str, Any]:
        return {
            "project_id": self.project_id,
            "gcp_conn_id": self.gcp_conn_id,
            "api_endpoint": self.api_endpoint,
            "impersonation_chain": self.impersonation_chain,
            "poll_interval": self.poll_interval,
            "state": self.state,
        }

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", self._kwargs()

    def _hook(self) -> TpuVmAsyncHook:
        from airflow_tpu_posttrain.hooks.compute import TpuVmAsyncHook

        return TpuVmAsyncHook(
            gcp_conn_id=self.gcp_conn_id,
            api_endpoint=self.api_endpoint,
            impersonation_chain=self.impersonation_chain,
        )

    def _event(self, payload: dict[str, Any]) -> TriggerEvent:
        return TriggerEvent({**payload, "state": self.state})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(self._events(), time.monotonic()):
            yield event

    def _events(self) -> AsyncIterator[TriggerEvent]:
        raise NotImplementedError


class _OperationsTrigger(ComputeTrigger):
    """A Compute trigger that polls operations, riding out transient API failures (429/5xx).

    :param max_transient_failures: consecutive 429/5xx answers tolerated while polling.
    """

    def __init__(self, project_id: str, max_transient_failures: int = 10, **common: Any) -> None:
        super().__init__(project_id, **common)
        self.max_transient_failures = max_transient_failures

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "max_transient_failures": self.max_transient_failures}

    async def _poll(self, call) -> Any:
        """Run ``call`` until it answers, sleeping between transient API failures.

        A delete refused because the instance is busy (400 resourceNotReady: its insert unfinished, a teardown
        after a create cut short) is asked again until the trigger's timeout: the insert ends, in minutes for
        a TPU VM, longer than the hook's own retries wait."""
        from google.api_core import exceptions

        from airflow_tpu_posttrain.hooks.compute import _TRANSIENT_NAMES, resource_not_ready

        transient = tuple(getattr(exceptions, name) for name in _TRANSIENT_NAMES)
        failures = 0
        while True:
            try:
                return await call()
            except exceptions.BadRequest as err:
                if not resource_not_ready(err):
                    raise
                self.log.info("The instance is busy (%s): asking again once its operation ends", err.message)
                await asyncio.sleep(self.poll_interval)
            except transient as err:
                failures += 1
                if failures > self.max_transient_failures:
                    raise
                self.log.warning(
                    "Compute API answered %s; retrying (%d/%d)", err, failures, self.max_transient_failures
                )
                await asyncio.sleep(min(self.poll_interval * failures, 60))

    async def _finished(self, hook: TpuVmAsyncHook, operations: list[dict[str, str | None]]) -> list[dict]:
        """Wait for each operation to be DONE; the DONE operations, in order."""
        finished = []
        for op in operations:
            while True:
                operation = await self._poll(
                    lambda op=op: hook.get_operation(self.project_id, op["name"], op.get("zone"), op.get("region"))
                )
                if operation.get("status") == "DONE":
                    break
                await asyncio.sleep(self.poll_interval)
            if not operation.get("error", {}).get("errors"):
                self.log.info("Operation %s is DONE", op["name"])
            finished.append(operation)
        return finished

    async def _operation_errors(self, hook: TpuVmAsyncHook, operations: list[dict[str, str | None]]) -> list:
        """Wait for each operation to be DONE; the first one's ``error.errors`` that failed, else []."""
        for operation in await self._finished(hook, operations):
            errors = operation.get("error", {}).get("errors", [])
            if errors:
                return errors
        return []

    @staticmethod
    def _raised(err: Exception) -> list[dict[str, str]]:
        return [{"code": type(err).__name__, "message": str(err)}]


def _billed(instance: dict | None) -> dict | None:
    """What an instance's cost needs, and nothing else of it (its metadata holds keys)."""
    if not instance:
        return None
    scheduling = {"provisioningModel": (instance.get("scheduling") or {}).get("provisioningModel")}
    return {key: instance.get(key) for key in ("creationTimestamp", "lastStartTimestamp", "machineType")} | {
        "scheduling": scheduling
    }


class ComputeDeleteTrigger(_OperationsTrigger):
    """Delete instances and firewall rules, then wait for the deletes to be DONE.

    Deleting from here keeps ``google-cloud-compute`` (seconds to import) out of the worker that runs the
    teardown: the triggerer has it loaded, so the VM's deletion starts as soon as the teardown is scheduled.
    Fires once with fixed keys: ``{"status": "success" | "error", "deleted": [{"name", "zone", "instance",
    "ended"}] of those that existed (an instance: what its cost needs of it, read before its delete, and the
    delete operation's ``endTime``), "errors": [{"code", "message"}], "state"}``, never sooner than
    ``settle.MIN_DEFERRAL_SECONDS`` after the deferral.

    :param project_id: the project of the instances and rules.
    :param deletes: ``[{"name", "zone", "request_id"}]``; zone None means a firewall rule.
    """

    def __init__(self, project_id: str, deletes: list[dict[str, str | None]], **common: Any) -> None:
        super().__init__(project_id, **common)
        self.deletes = deletes

    def _kwargs(self) -> dict[str, Any]:
        return {**super()._kwargs(), "deletes": self.deletes}

    async def _delete(self, hook: TpuVmAsyncHook, target: dict[str, str | None]) -> str | None:
        """Start deleting an instance (``zone`` set) or a firewall rule; the operation, or None if it is gone."""
        if target.get("zone"):
            return await hook.delete_instance(
                self.project_id, target["zone"], target["name"], target["request_id"]
            )
        return await hook.delete_firewall(self.project_id, target["name"], target["request_id"])

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        deleted: list[dict[str, Any]] = []
        try:
            operations = []
            for target in self.deletes:
                instance = None
                if target.get("zone"):
                    instance = await self._poll(
                        lambda target=target: hook.get_instance(
                            self.project_id, target["zone"], target["name"]
                        )
                    )
                operation = await self._poll(lambda target=target: self._delete(hook, target))
                if operation:
                    operations.append({"name": operation, "zone": target.get("zone")})
                    deleted.append(
                        {"name": target["name"], "zone": target.get("zone"), "instance": _billed(instance)}
                    )
            finished = await self._finished(hook, operations)
            errors = next((op["error"]["errors"] for op in finished if op.get("error", {}).get("errors")), [])
            for entry, operation in zip(deleted, finished, strict=False):
                entry["ended"] = operation.get("endTime")
        except Exception as err:
            errors = self._raised(err)
        status = "error" if errors else "success"
        yield self._event({"status": status, "deleted": deleted, "errors": errors})


# What an IAP tunnel answers that no wait mends: the caller lacks roles/iap.tunnelResourceAccessor (4033), or
# there is no gcloud to run it (the shell's 127).
_LASTING_TUNNEL_ERRORS = (
    "4033", "not authorized", "command not found", "do not currently have an active account", "Failed to impersonate"
)


async def ssh_port_check(
    address: str, port: int, timeout: float = 5.0, proxy_command: str | None = None
) -> tuple[bool, str]:
    """Whether an SSH server answers on ``address:port``, or at the other end of ``proxy_command``; and why not.

    ``proxy_command`` is an IAP tunnel: the second value is the last line it wrote to stderr (gcloud's error,
    e.g. ``4003: 'failed to connect to backend'``), "" otherwise. The server's banner is read, not only the
    TCP handshake. The tunnel runs in a process group of its own, ended whole: the shell and ``gcloud``'s
    wrapper may fork, and a tunnel left behind holds stderr open (and sshd's connection) until sshd gives up on
    the login, two minutes on."""
    if proxy_command:
        tunnel = await asyncio.create_subprocess_shell(
            proxy_command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            banner = await asyncio.wait_for(tunnel.stdout.read(4), timeout)
        except TimeoutError:
            banner = b""
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(tunnel.pid, signal.SIGKILL)
            said = await tunnel.stderr.read()
            await tunnel.wait()
        lines = said.decode(errors="replace").strip().splitlines()
        return banner.startswith(b"SSH-"), lines[-1] if lines else ""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address, port), timeout)
    except (OSError, TimeoutError):
        return False, ""
    try:
        banner = await asyncio.wait_for(reader.read(4), timeout)
    except (OSError, TimeoutError):
        banner = b""
    finally:
        writer.close()
    return banner.startswith(b"SSH-"), ""


def not_ready_message(
    name: str, status: str | None, host_keys: dict[str, str], timeout: float, tunnel_said: str = ""
) -> str:
    """Why a VM could not be logged into, and what to check (with what its IAP tunnel last said)."""
    if status != "RUNNING":
        return f"VM {name} is {status or 'gone'} while waiting to log in to it"
    if not host_keys:
        return (
            f"VM {name} published no SSH host keys within {timeout:.0f} s: its image must run Google's guest "
            "environment, and the instance needs metadata enable-guest-attributes=TRUE (set by this operator)"
        )
    said = f"; its IAP tunnel said: {tunnel_said}" if tunnel_said else ""
    return (
        f"VM {name} published its host keys but its SSH port did not answer within {timeout:.0f} s{said}: check "
        "the firewall (ssh_source_ranges / network_path; a deny rule of higher priority wins) and that Airflow "
        "can route to the VM's address"
    )
