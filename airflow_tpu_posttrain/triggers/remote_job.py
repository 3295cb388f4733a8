"""providers-ssh's remote-job trigger, plus what it does not end on.

A job that died without an exit code, a VM that is gone, and a job that hangs."""

from __future__ import annotations

import posixpath
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.providers.ssh.triggers.ssh_remote_job import SSHRemoteJobTrigger
from airflow.triggers.base import TriggerEvent

from airflow_tpu_posttrain.hooks.vm import VmHookAsync
from airflow_tpu_posttrain.recipes import remote_job
from airflow_tpu_posttrain.triggers.settle import not_before_settled

if TYPE_CHECKING:
    from asyncssh import SSHClientConnection

VM_LOST = "VM lost"  # starts the error event's message when Compute says the VM is gone


class _VmGone(Exception):
    """Raised out of the reconnect loop when Compute says the VM is gone."""


class MaxTextJobTrigger(SSHRemoteJobTrigger):
    """Like :class:`SSHRemoteJobTrigger`, and also ends the wait when the job is gone without an exit code.

    Such a job's whole process group was killed, e.g. by the OOM killer: otherwise the task would stay
    deferred until its timeout. Its event never comes sooner than ``settle.MIN_DEFERRAL_SECONDS`` after the
    deferral.

    :param host_keys: ``{key type: base64}`` the VM published; the connection to the VM is pinned to them.
    :param login: the login on the VM, instead of the connection's (an OS Login POSIX name).
    :param proxy_command: reach the VM through this command's stdin/stdout (an IAP tunnel).
    :param proxy_account: ``{gcp_conn_id, impersonation_chain}``: the Google connection the proxy command's gcloud
        runs as (the one that made the VM); None: gcloud's own account.
    :param vm: the VM as Compute knows it (``project``, ``zone``, ``name``, ``gcp_conn_id``, ``api_endpoint``,
        ``impersonation_chain``): when a reconnect fails, Compute is asked whether the VM is gone (preempted,
        TERMINATED, deleted); if so the wait ends at once with the error ``VM_LOST`` instead of riding out the
        remaining reconnect attempts.
    :param on_output: ``{"command", "description"}``: ``command`` runs on the VM at every poll until it prints
        ``remote_job.ACTED`` (``remote_job.when_logged_command``: once the log on the VM shows a marker; the
        training keeps the base model's evaluation where a resumed try finds it).
    :param stall_timeout: seconds without a new byte in the job's log after which the job is taken for hung (a
        trainer whose storage is unreachable is silent for minutes): its processes are stopped and the watch ends
        with the exit code ``remote_job.JOB_STALLED``. 0 or None: never. The clock starts with the watch.
    :param report_command: run on the VM once the job succeeded (``remote_job.report_command``: what the step's
        finish reads back); its output is the event's ``report``. Without it (not given, or the VM did not
        answer) the task's resumption asks the VM itself.
    """

    def __init__(
        self,
        *args: Any,
        host_keys: dict[str, str] | None = None,
        login: str | None = None,
        proxy_command: str | None = None,
        proxy_account: dict[str, Any] | None = None,
        vm: dict[str, Any] | None = None,
        stall_timeout: float | None = None,
        on_output: dict[str, str] | None = None,
        report_command: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.host_keys = host_keys or {}
        self.login = login
        self.proxy_command = proxy_command
        self.proxy_account = proxy_account
        self.vm = vm
        self.stall_timeout = stall_timeout
        self.on_output = on_output
        self.report_command = report_command
        self._progress: tuple[int, float] | None = None  # (log offset, when it last grew)
        self._stopped_stalled = False  # this watch began stopping the job for its silence

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(self._run_and_report(), time.monotonic()):
            yield event

    async def _run_and_report(self) -> AsyncIterator[TriggerEvent]:
        async for event in super().run():
            if self.report_command and event.payload.get("exit_code") == 0:
                report = await self._report()
                if report is not None:
                    event.payload["report"] = report
            yield event

    async def _report(self) -> str | None:
        """``report_command``'s output, on a connection of its own; None if it failed."""
        try:
            conn = await self._connect()
            try:
                result = await conn.run(self.report_command, timeout=remote_job.REPORT_TIMEOUT_S, check=False)
            finally:
                await self._close(conn)
        except Exception as err:  # noqa: BLE001 - the task's resumption asks the VM itself
            self.log.warning("Could not read the finished job's report from the VM: %s", err)
            return None
        if result.exit_status:
            self.log.warning("The finished job's report ended with status %s: %s", result.exit_status, result.stderr)
            return None
        return result.stdout

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            **kwargs,
            "host_keys": self.host_keys,
            "login": self.login,
            "proxy_command": self.proxy_command,
            "proxy_account": self.proxy_account,
            "vm": self.vm,
            "stall_timeout": self.stall_timeout,
            "on_output": self.on_output,
            "report_command": self.report_command,
        }

    def _get_hook(self) -> VmHookAsync:
        return VmHookAsync(
            ssh_conn_id=self.ssh_conn_id,
            host=self.remote_host,
            username=self.login,
            host_keys=self.host_keys,
            proxy_command=self.proxy_command,
            proxy_account=self.proxy_account,
        )

    async def _connect(self) -> SSHClientConnection:
        try:
            return await super()._connect()
        except Exception:
            lost = await self._vm_lost()
            if lost:
                # Not a connection error: the base trigger's run() ends with an error event carrying this.
                raise _VmGone(f"{VM_LOST}: {lost}") from None
            raise

    async def _vm_lost(self, name: str | None = None) -> str | None:
        """What Compute says of the VM (or of the VM ``name`` in the same zone) when it is gone.

        Gone: absent, or in a stopped state. None while it lives or when Compute cannot be asked (the SSH
        reconnects go on)."""
        if not self.vm:
            return None
        name = name or self.vm["name"]
        from airflow_tpu_posttrain.hooks.compute import TpuVmAsyncHook
        from airflow_tpu_posttrain.recipes.compute import DEAD_STATES

        hook = TpuVmAsyncHook(
            gcp_conn_id=self.vm.get("gcp_conn_id") or "google_cloud_default",
            api_endpoint=self.vm.get("api_endpoint"),
            impersonation_chain=self.vm.get("impersonation_chain"),
        )
        try:
            instance = await hook.get_instance(self.vm["project"], self.vm["zone"], name)
        except Exception as err:  # noqa: BLE001 - an unanswered question keeps the reconnects going
            self.log.warning("Could not ask Compute about %s: %s", name, err)
            return None
        if instance is None:
            return f"{name} no longer exists in {self.vm['zone']}"
        if instance.get("status") in DEAD_STATES:
            return f"{name} is {instance['status']} in {self.vm['zone']}"
        return None

    async def _read_log_chunk(self, conn: SSHClientConnection) -> tuple[str, int]:
        chunk, offset = await super()._read_log_chunk(conn)
        if self.on_output:
            _, stdout, stderr = await self._run_command(conn, self.on_output["command"])
            if stderr.strip():
                self.log.warning("%s: %s", self.on_output["description"], stderr.strip())
            if remote_job.ACTED in stdout:
                self.log.info("Done: %s", self.on_output["description"])
                self.on_output = None  # once
        return chunk, offset

    async def _check_completion(self, conn: SSHClientConnection) -> int | None:
        pid_file = posixpath.join(self.job_dir, "pid")
        _, stdout, _ = await self._run_command(conn, remote_job.completion_command(pid_file, self.exit_code_file))
        exit_code = remote_job.parse_completion(stdout)
        if self._stopped_stalled or (exit_code is None and self._stalled()):
            # Stopped again when an earlier poll's stop outlived its command's timeout (a loaded VM; the base
            # trigger then reconnects): its job is then gone without an exit code, still a stalled one.
            if not self._stopped_stalled:
                self.log.warning("No output from job %s for %.0f s: stopping it", self.job_id, self.stall_timeout)
            self._stopped_stalled = True
            await self._run_command(conn, remote_job.stop_command(pid_file))
            return remote_job.JOB_STALLED
        return exit_code

    def _stalled(self) -> bool:
        """Whether the log has not grown for ``stall_timeout`` s.

        The base trigger advances ``log_offset`` as it reads each new chunk."""
        now = time.monotonic()
        if self._progress is None or self._progress[0] != self.log_offset:
            self._progress = (self.log_offset, now)
            return False
        return bool(self.stall_timeout) and now - self._progress[1] >= self.stall_timeout
