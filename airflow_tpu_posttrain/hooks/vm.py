"""SSH and SFTP on the TPU VM: short commands, files in, files out. Long jobs go through providers-ssh's
remote-job protocol (``SSHRemoteJobOperator``/``SSHRemoteJobTrigger``); this hook does the rest."""

from __future__ import annotations

import io
import posixpath
import shlex
from typing import Any

from airflow.providers.ssh.hooks.ssh import SSHHook


class VmHook(SSHHook):
    """An :class:`SSHHook` with one open connection reused for a task's small remote operations."""

    def __init__(self, ssh_conn_id: str, remote_host: str | None = None, **kwargs: Any) -> None:
        super().__init__(ssh_conn_id=ssh_conn_id, remote_host=remote_host or "", **kwargs)
        self._client: Any = None

    def __enter__(self) -> VmHook:
        self._client = self.get_conn()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(self, command: str, timeout: int = 60, check: bool = True) -> str:
        """Run a short command; its stdout. No secrets may be part of ``command`` (it is visible in ``ps``)."""
        status, stdout, stderr = self.exec_ssh_client_command(
            self._client, command, get_pty=False, environment=None, timeout=timeout
        )
        if check and status != 0:
            raise RuntimeError(f"remote command failed ({status}): {stderr.decode(errors='replace').strip()}")
        return stdout.decode(errors="replace")

    def put_text(self, path: str, text: str, mode: int = 0o644) -> None:
        """Write ``text`` to ``path`` with ``mode``; the parent directory is created first (0700)."""
        self.put_bytes(path, text.encode(), mode)

    def put_bytes(self, path: str, data: bytes, mode: int = 0o644) -> None:
        parent = posixpath.dirname(path)
        self.run(f"mkdir -p -m 700 {shlex.quote(parent)}")
        with self._client.open_sftp() as sftp:
            # Create the file empty with its final mode before writing, so a secret is never readable by others.
            with sftp.open(path, "w") as handle:
                handle.chmod(mode)
            with sftp.open(path, "w") as handle:
                handle.write(data)

    def get_text(self, path: str) -> str | None:
        """The file's text, or None when it does not exist."""
        with self._client.open_sftp() as sftp:
            buffer = io.BytesIO()
            try:
                sftp.getfo(path, buffer)
            except FileNotFoundError:
                return None
            return buffer.getvalue().decode(errors="replace")

    def exists(self, uri: str) -> bool:
        """Whether a path on the VM, or a ``gs://`` object or prefix (read with the VM's credentials), exists."""
        from airflow_tpu_posttrain.recipes.storage import exists_command

        return self.run(f"{exists_command(uri)} && echo yes || echo no").strip() == "yes"
