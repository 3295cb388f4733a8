"""A real OpenSSH server on 127.0.0.1 that plays the TPU VM in tests and local runs.

``LocalSshd`` runs ``/usr/sbin/sshd`` in the foreground as a child process, with its own config,
host key and client key pair under a state directory::

    STATE_DIR/ssh_host_ed25519_key(.pub)   host key, generated once and reused
    STATE_DIR/client_ed25519_key(.pub)     client key pair, generated once and reused
    STATE_DIR/authorized_keys              the client public key
    STATE_DIR/known_hosts                  ``[127.0.0.1]:PORT <host key>``, for verifying clients
    STATE_DIR/sshd_config, sshd.pid, sshd.log

Clients verify the host key (as in production); ``airflow_connection()`` gives the matching Airflow
SSH connection. ``drop_sessions()`` kills the per-connection sshd processes, so a test can cut the
SSH connection while a detached remote job keeps running.

Run ``python -m airflow_tpu_posttrain.local.sshd --state-dir DIR [--port N]`` for a local demo.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
HOST = "127.0.0.1"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0


# Environment the "VM"'s sessions share with this machine.
_VM_ENV = (
    "PATH",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "UV_NATIVE_TLS",
    "UV_INDEX_URL",
    "UV_DEFAULT_INDEX",
    "PIP_INDEX_URL",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
)


class LocalSshd:
    """An sshd listening on 127.0.0.1 that accepts only the generated client key."""

    def __init__(self, state_dir: Path, port: int = 0) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.port = port
        self.login = getpass.getuser()
        self.host_key_path = self.state_dir / "ssh_host_ed25519_key"
        self.client_key_path = self.state_dir / "client_ed25519_key"
        self.known_hosts_path = self.state_dir / "known_hosts"
        self.config_path = self.state_dir / "sshd_config"
        self.log_path = self.state_dir / "sshd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def host_public_key(self) -> str:
        """The host key as ``ssh-ed25519 AAAA...``, without the comment."""
        key_type, key_data = self.host_key_path.with_suffix(".pub").read_text().split()[:2]
        return f"{key_type} {key_data}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> LocalSshd:
        if self._process is not None:
            raise RuntimeError("sshd is already running")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        _ensure_key(self.host_key_path)
        _ensure_key(self.client_key_path)
        if not self.port:
            self.port = _free_port()
        self._write_files()
        with self.log_path.open("wb") as log:
            # An absolute -f path: sshd re-executes itself, and a relative one breaks on SIGHUP.
            self._process = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_until_listening(self._process)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the listener and kill every session; sshd leaves sessions running on SIGTERM.

        Returns once the sessions are gone: SIGKILL takes effect asynchronously.
        """
        if self._process is None:
            return
        sessions = self.drop_sessions()
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while alive := [pid for pid in sessions if _alive(pid)]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"sshd sessions {alive} still alive {STOP_TIMEOUT_S} s after SIGKILL")
            time.sleep(0.02)

    def __enter__(self) -> LocalSshd:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def drop_sessions(self) -> list[int]:
        """SIGKILL the per-connection sshd processes (not the listener); returns their pids.

        The client sees its connection drop. Commands started in a session lose their sshd
        but are not killed, so a detached job (``setsid nohup ...``) keeps running.
        """
        if self._process is None or self._process.poll() is not None:
            return []
        # Collect the whole tree first: once a parent dies its children are re-parented away.
        pids = _sshd_descendants(self._process.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def airflow_connection(self, verify_host_key: bool = True) -> dict[str, Any]:
        """The Airflow SSH connection, as JSON for ``AIRFLOW_CONN_<ID>``.

        With ``host_key`` set, SSHHook pins that key for ``[127.0.0.1]:PORT`` and rejects any
        other (paramiko's default RejectPolicy). It carries the key type: SSHHook reads a bare
        base64 key as RSA. ``verify_host_key=False`` is for local mode only.
        """
        extra: dict[str, Any] = {"key_file": str(self.client_key_path)}
        if verify_host_key:
            extra["no_host_key_check"] = False
            extra["host_key"] = self.host_public_key
        else:
            extra["no_host_key_check"] = True
        return {"conn_type": "ssh", "host": HOST, "port": self.port, "login": self.login, "extra": extra}

    def _write_files(self) -> None:
        client_public_key = self.client_key_path.with_suffix(".pub").read_text()
        authorized_keys = self.state_dir / "authorized_keys"
        authorized_keys.write_text(client_public_key)
        self.known_hosts_path.write_text(f"[{HOST}]:{self.port} {self.host_public_key}\n")
        settings = {
            "Port": self.port,
            "ListenAddress": HOST,
            "HostKey": self.host_key_path,
            "AuthorizedKeysFile": authorized_keys,
            "PasswordAuthentication": "no",
            "KbdInteractiveAuthentication": "no",
            "PermitRootLogin": "prohibit-password",
            # The state dir may be a world-writable temp dir, which StrictModes would refuse.
            "StrictModes": "no",
            "UsePAM": "no",
            "PidFile": self.state_dir / "sshd.pid",
            # Tests open many connections at once; the defaults (10:30:100, 10) would drop some.
            "MaxStartups": "50:30:100",
            "MaxSessions": 50,
            "Subsystem": "sftp internal-sftp",
            "LogLevel": "ERROR",
            # The "VM" has this machine's tools (uv, python3.12) and its way to PyPI (proxy, CA bundle, index).
            "SetEnv": " ".join(f'{name}="{os.environ[name]}"' for name in _VM_ENV if name in os.environ),
        }
        self.config_path.write_text("".join(f"{key} {value}\n" for key, value in settings.items()))

    def _wait_until_listening(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"sshd exited with code {process.returncode}: {self.log_path.read_text().strip()}"
                )
            # Read the banner too: a connection alone could reach another server on a reused port.
            try:
                with socket.create_connection((HOST, self.port), timeout=1) as conn:
                    if conn.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sshd did not accept connections on {HOST}:{self.port} within {START_TIMEOUT_S} s: "
                    f"{self.log_path.read_text().strip()}"
                )
            time.sleep(0.05)


def _ensure_key(path: Path) -> None:
    if not path.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"local-sshd-{path.name}", "-f", str(path)],
            check=True,
            capture_output=True,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _sshd_descendants(root_pid: int) -> list[int]:
    """Pids of the sshd processes below ``root_pid``, found through /proc."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process has exited meanwhile
            continue
        # Format: "pid (comm) state ppid ..."; comm may itself contain spaces or parentheses.
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append((int(entry.name), comm))
    found: list[int] = []
    pending = [root_pid]
    while pending:
        for pid, comm in children.get(pending.pop(), []):
            if comm.startswith("sshd"):
                found.append(pid)
                pending.append(pid)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="keys, config and logs")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    args = parser.parse_args(argv)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    with LocalSshd(args.state_dir, args.port) as sshd:
        info = {
            "port": sshd.port,
            "login": sshd.login,
            "client_key_path": str(sshd.client_key_path),
            "known_hosts_path": str(sshd.known_hosts_path),
            "host_public_key": sshd.host_public_key,
            "airflow_connection": sshd.airflow_connection(),
        }
        print(json.dumps(info), flush=True)
        while not stopping.wait(1.0):
            if not sshd.is_running:
                raise SystemExit(f"sshd exited unexpectedly: {sshd.log_path.read_text().strip()}")


if __name__ == "__main__":
    main()
