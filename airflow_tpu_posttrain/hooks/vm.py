"""SSH and SFTP on the TPU VM: short commands, files in, files out.

Long jobs go through providers-ssh's remote-job protocol (``SSHRemoteJobOperator``/``SSHRemoteJobTrigger``);
this hook does the rest.

Every VM is new, with new host keys: both hooks pin the host keys the VM published as guest attributes
(``host_keys``, from the create task's XCom) instead of anything in the connection or ``known_hosts``.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import posixpath
import selectors
import shlex
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow.providers.ssh.hooks.ssh import SSHHook, SSHHookAsync
from airflow.sdk import BaseHook

from airflow_tpu_posttrain.exceptions import StorageError, VmHostKeyMismatchError
from airflow_tpu_posttrain.recipes import access, remote_job
from airflow_tpu_posttrain.recipes.access import HOST_KEY_TYPES, SSH_PORT, known_hosts

if TYPE_CHECKING:
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths

    from airflow_tpu_posttrain.recipes.storage import GcsTool


class ClientIdentity(NamedTuple):
    """Who Airflow logs in as: the connection's login, its key's public half (``KEYTYPE BASE64``), its port."""

    login: str
    public_key: str
    port: int


def client_identity(ssh_conn_id: str) -> ClientIdentity:
    """What the VM must be told about the SSH connection.

    The private key is only read here, to derive its public half; it stays in the connection."""
    import paramiko

    from airflow_tpu_posttrain.recipes.validation import SpecError

    hook = SSHHook(ssh_conn_id=ssh_conn_id, remote_host="vm")
    key = hook.pkey
    if key is None and hook.key_file:
        passphrase = hook.get_connection(ssh_conn_id).extra_dejson.get("private_key_passphrase")
        key = paramiko.PKey.from_path(hook.key_file, password=passphrase)
    if key is None:
        raise SpecError(
            "ssh_conn_id",
            ssh_conn_id,
            "has no private key",
            "set the connection's private_key (or key_file) extra; its public half is installed on each VM",
        )
    return ClientIdentity(hook.username, f"{key.get_name()} {key.get_base64()}", hook.port)


_KEY_FILES: dict[str, str] = {}  # a Google connection's keyfile_dict -> the private file it was written to


def _google_key_file(conn: Any) -> str | None:
    """A Google connection's service account key as a file gcloud can read; None without one (ADC).

    Its ``key_path``; or its ``keyfile_dict`` written once per process to a file only this user can read (as
    providers-google's ``provide_gcp_credential_file_as_context`` does), removed when the process ends."""
    extras = conn.extra_dejson

    def field(name: str) -> Any:
        return extras.get(name) or extras.get(f"extra__google_cloud_platform__{name}")

    if field("key_path"):
        return str(field("key_path"))
    keyfile = field("keyfile_dict")
    if not keyfile:
        return None
    content = keyfile if isinstance(keyfile, str) else json.dumps(keyfile)
    if content not in _KEY_FILES:
        directory = tempfile.mkdtemp(prefix="tpu-posttrain-gcloud-")  # mode 0700
        path = os.path.join(directory, "key.json")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as key_file:
            key_file.write(content)
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        _KEY_FILES[content] = path
    return _KEY_FILES[content]


def _chain(impersonation_chain: str | Sequence[str] | None) -> list[str]:
    if not impersonation_chain:
        return []
    return [impersonation_chain] if isinstance(impersonation_chain, str) else list(impersonation_chain)


def proxy_command_as(proxy_command: str | None, proxy_account: dict | None) -> str | None:
    """``proxy_command`` run as ``proxy_account``; unchanged without one.

    ``proxy_account``: ``{gcp_conn_id, impersonation_chain}``, the Google connection that made the VM."""
    if not proxy_command or not proxy_account:
        return proxy_command
    conn = BaseHook.get_connection(proxy_account["gcp_conn_id"])
    chain = _chain(proxy_account.get("impersonation_chain"))
    return access.iap_proxy_command_as(proxy_command, _google_key_file(conn), chain)


async def proxy_command_as_async(proxy_command: str | None, proxy_account: dict | None) -> str | None:
    """:func:`proxy_command_as` for the triggerer (the connection read without blocking its loop)."""
    if not proxy_command or not proxy_account:
        return proxy_command
    from airflow.providers.common.compat.connection import get_async_connection

    conn = await get_async_connection(proxy_account["gcp_conn_id"])
    chain = _chain(proxy_account.get("impersonation_chain"))
    return access.iap_proxy_command_as(proxy_command, _google_key_file(conn), chain)


class VmHook(SSHHook):
    """An :class:`SSHHook` with one open connection reused for a task's small remote operations.

    :param host_keys: ``{key type: base64}`` the VM published; the connection's own host key settings are then
        ignored and the VM must present one of these keys.
    :param proxy_command: reach the VM through this command's stdin/stdout (an IAP tunnel).
    :param proxy_account: ``{gcp_conn_id, impersonation_chain}``: the Google connection ``proxy_command``'s
        gcloud runs as (:func:`proxy_command_as`); None: gcloud's own account.
    """

    def __init__(
        self,
        ssh_conn_id: str,
        remote_host: str | None = None,
        host_keys: dict[str, str] | None = None,
        proxy_command: str | None = None,
        proxy_account: dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            ssh_conn_id=ssh_conn_id,
            remote_host=remote_host or "",
            host_proxy_cmd=proxy_command_as(proxy_command, proxy_account),
            **kwargs,
        )
        self._client: Any = None
        self.pinned_host_keys = dict(host_keys or {})
        if host_keys:
            self.no_host_key_check = False
            self.allow_host_key_change = False

    def get_conn(self) -> Any:
        """SSHHook's connection; with ``host_keys``, verified against those keys alone.

        SSHHook loads ``~/.ssh/known_hosts``, which paramiko consults before any key added to the client: a
        stale entry for a recycled address would refuse the new VM, and a planted one would be trusted."""
        if not self.pinned_host_keys:
            return super().get_conn()
        if self.client is not None and (transport := self.client.get_transport()) and transport.is_active():
            return self.client
        import paramiko
        from tenacity import Retrying, retry_if_not_exception_type, stop_after_attempt, wait_fixed

        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        known = client.get_host_keys()
        name = self.remote_host if self.port == SSH_PORT else f"[{self.remote_host}]:{self.port}"
        for key_type in HOST_KEY_TYPES:
            if key_type in self.pinned_host_keys:
                data = base64.b64decode(self.pinned_host_keys[key_type])
                known.add(name, key_type, paramiko.PKey.from_type_string(key_type, data))
        options: dict[str, Any] = {
            "hostname": self.remote_host, "port": self.port, "username": self.username, "sock": self.host_proxy,
            "timeout": self.conn_timeout, "banner_timeout": self.banner_timeout, "auth_timeout": self.auth_timeout,
            "look_for_keys": self.look_for_keys, "compress": self.compress, "pkey": self.pkey,
            "key_filename": self.key_file, "password": self.password.strip() if self.password else None,
            "disabled_algorithms": self.disabled_algorithms,
        }
        for attempt in Retrying(
            reraise=True,
            retry=retry_if_not_exception_type(paramiko.BadHostKeyException),
            stop=stop_after_attempt(self.conn_retry_attempts),
            wait=wait_fixed(3),
        ):
            with attempt:
                client.connect(**options)
        if self.keepalive_interval:
            client.get_transport().set_keepalive(self.keepalive_interval)
        self.client = client
        return client

    def __enter__(self) -> VmHook:
        import paramiko

        try:
            self._client = self.get_conn()
        except paramiko.BadHostKeyException as err:
            raise VmHostKeyMismatchError(
                f"The machine at {self.remote_host}:{self.port} presented the {err.key.get_name()} host key "
                f"SHA256:{err.key.fingerprint.split(':', 1)[-1]}, which is not the one the VM published "
                f"(SHA256:{err.expected_key.fingerprint.split(':', 1)[-1]}): refusing to connect"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def run(self, command: str, timeout: int = 60, check: bool = True) -> str:
        """Run a short command; its stdout. No secrets may be part of ``command`` (it is visible in ``ps``)."""
        status, stdout, stderr = self._execute(command, timeout)
        if check and status != 0:
            raise RuntimeError(f"remote command failed ({status}): {stderr.decode(errors='replace').strip()}")
        return stdout.decode(errors="replace")

    def _execute(self, command: str, timeout: float) -> tuple[int, bytes, bytes]:
        """Run ``command``; its exit status, stdout and stderr, each read to its end.

        Not providers-ssh's ``exec_ssh_client_command``: it stops reading once the exit status has come and its
        buffers are empty for a moment, but sshd may send the exit status before the last of the output (SSH
        orders a channel's data and its EOF, not its requests), and the last line was then lost: ``hostname;
        echo reached`` answered ``vm``. The end of the output is the channel's EOF (or its close)."""
        self.log.info("Running command: %s", command)
        stdin, stdout, _ = self._client.exec_command(command, timeout=timeout)
        stdin.close()
        channel = stdout.channel
        channel.shutdown_write()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(channel, selectors.EVENT_READ)
            while True:
                if channel.recv_ready():
                    out += channel.recv(65536)
                elif channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                elif channel.closed or (channel.eof_received and channel.exit_status_ready()):
                    break
                elif time.monotonic() > deadline:
                    channel.close()
                    raise TimeoutError(f"remote command still running after {timeout} s: {command[:200]}")
                else:
                    # The exit status wakes no selector: poll for it at least once a second.
                    selector.select(min(1.0, max(deadline - time.monotonic(), 0.0)))
        return channel.recv_exit_status(), bytes(out), bytes(err)

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

    def job_state(self, paths: RemoteJobPaths) -> tuple[str, int]:
        """A detached job's state and its log's size.

        The state is ``succeeded``, ``failed with exit code N``, ``running``, ``died`` or ``absent``."""
        command = remote_job.state_command(paths.job_dir, paths.pid_file, paths.exit_code_file, paths.log_file)
        return remote_job.parse_state(self.run(command))

    def run_status(self, command: str, timeout: int = 60) -> tuple[int, str]:
        """Run a short command that answers with its exit status: ``(status, stdout)``."""
        status, stdout, _ = self._execute(command, timeout)
        return status, stdout.decode(errors="replace")

    def exists(self, uri: str, tool: GcsTool | None = None, timeout: int = 300) -> bool:
        """Whether a path on the VM, or a ``gs://`` object or prefix, exists.

        A ``gs://`` object or prefix is read with the VM's credentials through ``tool``. :class:`StorageError`
        when storage could not be asked: "could not look" is never taken for "not there" (which would redo a
        finished step, or fail a finished training)."""
        from airflow_tpu_posttrain.recipes.storage import exists_command

        status, _, stderr = self._execute(exists_command(uri, tool), timeout)
        return exists_answer(uri, status, stderr.decode(errors="replace"))


def exists_answer(uri: str, status: int, stderr: str) -> bool:
    """What ``storage.exists_command``'s exit status says of ``uri``; :class:`StorageError` when it could not look."""
    from airflow_tpu_posttrain.recipes.storage import EXISTS_NO

    if status == 0:
        return True
    if status == EXISTS_NO:
        return False
    raise StorageError(f"could not check {uri} from the VM (exit status {status}): {stderr.strip()[-2000:]}")


class VmHookAsync(SSHHookAsync):
    """The triggerer's connection to the VM, pinned to the VM's published ``host_keys``.

    Reached through ``proxy_command`` (an IAP tunnel) as ``proxy_account``, like :class:`VmHook`."""

    def __init__(
        self,
        *args: Any,
        host_keys: dict[str, str] | None = None,
        proxy_command: str | None = None,
        proxy_account: dict | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.host_keys = host_keys or {}
        self.proxy_command = proxy_command
        self.proxy_account = proxy_account

    async def _get_conn(self) -> Any:
        """SSHHookAsync's connection, plus asyncssh's ``proxy_command`` (which SSHHookAsync does not pass)."""
        if not self.proxy_command:
            return await super()._get_conn()
        import asyncssh
        from airflow.providers.common.compat.connection import get_async_connection

        conn = await get_async_connection(self.ssh_conn_id)
        self._parse_extras(conn)
        if not self.host_keys:
            raise ValueError(
                "a VM reached through a proxy command is verified against its published host keys"
            )
        options: dict[str, Any] = {
            "host": self.host or conn.host,
            "port": self.port or conn.port or SSH_PORT,
            "username": self.username or conn.login,
            "known_hosts": self.known_hosts,
            "proxy_command": await proxy_command_as_async(self.proxy_command, self.proxy_account),
        }
        if self.key_file:
            options["client_keys"] = self.key_file
        if self.private_key:
            options["client_keys"] = [asyncssh.import_private_key(self.private_key, self.passphrase)]
        if self.passphrase:
            options["passphrase"] = self.passphrase
        if self.keepalive_interval:
            options["keepalive_interval"] = self.keepalive_interval
        return await asyncssh.connect(**options)

    def _parse_extras(self, conn: Any) -> None:
        super()._parse_extras(conn)
        if self.host_keys:
            address, port = self.host or conn.host, self.port or conn.port or SSH_PORT
            self.known_hosts = known_hosts(address, port, self.host_keys).encode()
