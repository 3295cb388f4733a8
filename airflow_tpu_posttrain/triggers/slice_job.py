"""One program on every VM of a multi-host slice, watched as one job from the triggerer."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.hooks.vm import VmHookAsync
from airflow_tpu_posttrain.recipes import remote_job
from airflow_tpu_posttrain.triggers.remote_job import VM_LOST, MaxTextJobTrigger, _VmGone

if TYPE_CHECKING:
    from airflow.triggers.base import TriggerEvent
    from asyncssh import SSHClientConnection

TAIL_BYTES = 3000  # of each worker's log, in the event of a failed slice job


class SliceJobTrigger(MaxTextJobTrigger):
    """:class:`MaxTextJobTrigger` on worker 0 (its log streamed), whose end is the whole slice's.

    Every worker runs the same job (same id, same files, on its own VM). The job succeeds when every worker's
    exited 0. When one fails or dies, the others are stopped at once: their JAX processes would otherwise wait
    for the lost peer until the coordination service's heartbeat timeout, holding the slice. The event then
    carries ``workers``: ``{worker id: {"exit_code", "tail"}}`` (the end of each worker's log) and
    ``failed_worker``.

    :param peers: the other workers: ``[{"worker_id", "name", "remote_host", "login", "host_keys"}]``; each is
        asked over a connection of its own, pinned to its host keys. When one cannot be reached and Compute says
        its VM (``name``, in ``vm``'s zone) is gone, the watch ends at once with the error ``VM_LOST``.
    """

    def __init__(self, *args: Any, peers: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peers = list(peers or [])
        self._outcome: dict[str, Any] | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        path, kwargs = super().serialize()
        return path, {**kwargs, "peers": self.peers}

    async def _run_and_report(self) -> AsyncIterator[TriggerEvent]:
        async for event in super()._run_and_report():
            if self._outcome:
                event.payload.update(self._outcome)
            yield event

    def _peer_hook(self, peer: dict[str, Any]) -> VmHookAsync:
        return VmHookAsync(
            ssh_conn_id=self.ssh_conn_id,
            host=peer["remote_host"],
            username=peer.get("login") or self.login,
            host_keys=peer.get("host_keys") or {},
            proxy_command=self.proxy_command,
            proxy_account=self.proxy_account,
        )

    async def _on_peer(self, peer: dict[str, Any], command: str) -> str:
        try:
            conn = await self._peer_hook(peer).get_conn()
            try:
                _, stdout, _ = await self._run_command(conn, command)
            finally:
                await self._close(conn)
        except Exception:
            lost = await self._vm_lost(peer.get("name")) if peer.get("name") else None
            if lost:
                raise _VmGone(f"{VM_LOST}: worker {peer['worker_id']}: {lost}") from None
            raise
        return stdout

    async def _check_completion(self, conn: SSHClientConnection) -> int | None:
        own = await super()._check_completion(conn)
        pid_file = posixpath.join(self.job_dir, "pid")
        asked = remote_job.completion_command(pid_file, self.exit_code_file)
        codes: dict[int, int | None] = {0: own}
        for peer in self.peers:
            codes[int(peer["worker_id"])] = remote_job.parse_completion(await self._on_peer(peer, asked))
        failed = [worker for worker, code in codes.items() if code not in (None, 0)]
        if failed:
            await self._stop_and_collect(conn, codes, failed[0])
            return codes[failed[0]]
        if all(code == 0 for code in codes.values()):
            return 0
        return None

    async def _stop_and_collect(self, conn: SSHClientConnection, codes: dict[int, int | None], failed: int) -> None:
        """Stop every worker's job still running; keep each worker's exit code and the end of its log."""
        pid_file = posixpath.join(self.job_dir, "pid")
        stop = remote_job.stop_command(pid_file)
        tail = f"tail -c {TAIL_BYTES} {shlex.quote(self.log_file)} 2>/dev/null || true"
        self.log.warning("Worker %d's job ended with %s: stopping the slice's other workers", failed, codes[failed])
        workers: dict[str, dict[str, Any]] = {}
        for peer in [{"worker_id": 0}, *self.peers]:
            worker = int(peer["worker_id"])
            command = f"{stop}; {tail}" if codes[worker] is None else tail
            if worker == 0:
                _, said, _ = await self._run_command(conn, command)
            else:
                said = await self._on_peer(peer, command)
            workers[str(worker)] = {"exit_code": codes[worker], "tail": said}
        self._outcome = {"workers": workers, "failed_worker": failed}
