"""providers-ssh's remote-job trigger, plus one case it does not end on: a job that died without an exit code."""

from __future__ import annotations

import posixpath
import shlex
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.providers.ssh.triggers.ssh_remote_job import SSHRemoteJobTrigger
from airflow.triggers.base import TriggerEvent

from airflow_tpu_posttrain.hooks.vm import VmHookAsync
from airflow_tpu_posttrain.triggers.settle import not_before_settled

if TYPE_CHECKING:
    from asyncssh import SSHClientConnection

JOB_DIED = -1  # the event's exit_code when the job's process group was killed before it wrote one


class MaxTextJobTrigger(SSHRemoteJobTrigger):
    """
    Like :class:`SSHRemoteJobTrigger`, and also ends the wait when the job is gone without an exit code (its whole
    process group was killed, e.g. by the OOM killer): otherwise the task would stay deferred until its timeout.
    Its event never comes sooner than ``settle.MIN_DEFERRAL_SECONDS`` after the deferral.

    :param host_keys: ``{key type: base64}`` the VM published; the connection to the VM is pinned to them.
    :param login: the login on the VM, instead of the connection's (an OS Login POSIX name).
    :param proxy_command: reach the VM through this command's stdin/stdout (an IAP tunnel).
    """

    def __init__(
        self,
        *args: Any,
        host_keys: dict[str, str] | None = None,
        login: str | None = None,
        proxy_command: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.host_keys = host_keys or {}
        self.login = login
        self.proxy_command = proxy_command

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async for event in not_before_settled(super().run(), time.monotonic()):
            yield event

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            **kwargs,
            "host_keys": self.host_keys,
            "login": self.login,
            "proxy_command": self.proxy_command,
        }

    def _get_hook(self) -> VmHookAsync:
        return VmHookAsync(
            ssh_conn_id=self.ssh_conn_id,
            host=self.remote_host,
            username=self.login,
            host_keys=self.host_keys,
            proxy_command=self.proxy_command,
        )

    async def _check_completion(self, conn: SSHClientConnection) -> int | None:
        exit_code = shlex.quote(self.exit_code_file)
        pid = shlex.quote(posixpath.join(self.job_dir, "pid"))
        # The second look at the exit code covers a job that wrote it between the two tests.
        command = (
            f"if test -s {exit_code}; then cat {exit_code}; "
            f'elif test -s {pid} && ! kill -0 "$(cat {pid})" 2>/dev/null; then '
            f"sleep 1; if test -s {exit_code}; then cat {exit_code}; else echo died; fi; fi"
        )
        _, stdout, _ = await self._run_command(conn, command)
        answer = stdout.strip()
        if answer == "died":
            return JOB_DIED
        return int(answer) if answer.isdigit() else None
