"""LocalSshd: a real sshd on 127.0.0.1 that providers-ssh's SSHHook reaches with host-key verification."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import paramiko
import pytest
from airflow.providers.ssh.hooks.ssh import SSHHook

from airflow_tpu_posttrain.local.sshd import LocalSshd


@pytest.fixture
def sshd(tmp_path):
    with LocalSshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def hook(sshd, monkeypatch) -> SSHHook:
    monkeypatch.setenv("AIRFLOW_CONN_LOCAL_VM", json.dumps(sshd.airflow_connection()))
    return SSHHook(ssh_conn_id="local_vm")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = stat_path.read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(stat_path.parent.name))
    return found


def _wait_for(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_hook_runs_command_with_host_key_verified(sshd, hook):
    assert hook.no_host_key_check is False
    assert hook.host_key.get_base64() == sshd.host_public_key.split()[1]
    with hook.get_conn() as client:
        exit_status, stdout, _ = hook.exec_ssh_client_command(client, "echo hi", get_pty=False, environment=None)
    assert (exit_status, stdout) == (0, b"hi\n")


def test_known_hosts_file_verifies_host(sshd):
    client = paramiko.SSHClient()
    client.load_host_keys(str(sshd.known_hosts_path))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect("127.0.0.1", port=sshd.port, username=sshd.login, key_filename=str(sshd.client_key_path),
                   look_for_keys=False, allow_agent=False)
    with client:
        _, stdout, _ = client.exec_command("whoami")
        assert stdout.read().decode().strip() == sshd.login


def test_wrong_host_key_is_refused(sshd, tmp_path, monkeypatch):
    other_key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    connection = sshd.airflow_connection()
    connection["extra"]["host_key"] = other_key.with_suffix(".pub").read_text()
    monkeypatch.setenv("AIRFLOW_CONN_LOCAL_VM", json.dumps(connection))
    with pytest.raises(paramiko.BadHostKeyException):
        SSHHook(ssh_conn_id="local_vm", conn_retry_attempts=1).get_conn()


def test_unverified_connection_is_explicit(sshd):
    extra = sshd.airflow_connection(verify_host_key=False)["extra"]
    assert extra["no_host_key_check"] is True
    assert "host_key" not in extra


def test_sftp_put_and_get(hook, tmp_path):
    local = tmp_path / "local.bin"
    local.write_bytes(os.urandom(100_000))
    remote = tmp_path / "remote" / "copy.bin"
    remote.parent.mkdir()
    with hook.get_conn() as client, client.open_sftp() as sftp:
        sftp.put(str(local), str(remote))
        sftp.get(str(remote), str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()


def test_drop_sessions_keeps_detached_job_and_listener(sshd, hook):
    client = hook.get_conn()
    _, stdout, _ = client.exec_command("setsid nohup sleep 60 >/dev/null 2>&1 </dev/null & echo $!")
    detached_pid = int(stdout.read())
    _, stdout, _ = client.exec_command("echo $$; exec sleep 60")
    attached_pid = int(stdout.readline())
    try:
        assert sshd.drop_sessions()
        assert _wait_for(lambda: not client.get_transport().is_active())
        assert _alive(detached_pid)
        with SSHHook(ssh_conn_id="local_vm").get_conn() as new_client:
            _, stdout, _ = new_client.exec_command("echo still listening")
            assert stdout.read() == b"still listening\n"
    finally:
        client.close()
        for pid in (detached_pid, attached_pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_stop_leaves_no_sshd_and_keys_are_reused(tmp_path, monkeypatch):
    state_dir = tmp_path / "sshd"
    server = LocalSshd(state_dir).start()
    try:
        host_key = server.host_public_key
        listener_pid = int((state_dir / "sshd.pid").read_text())
        monkeypatch.setenv("AIRFLOW_CONN_LOCAL_VM", json.dumps(server.airflow_connection()))
        client = SSHHook(ssh_conn_id="local_vm").get_conn()
        sessions = _children(listener_pid)
        assert sessions
    finally:
        server.stop()
    client.close()
    assert not any(_alive(pid) for pid in [listener_pid, *sessions])
    with LocalSshd(state_dir) as restarted:
        assert restarted.host_public_key == host_key


def test_cli_prints_connection_and_stops_on_sigterm(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "airflow_tpu_posttrain.local.sshd", "--state-dir", str(tmp_path / "sshd")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(process.stdout.readline())
        assert info["airflow_connection"]["port"] == info["port"]
        assert info["airflow_connection"]["extra"]["host_key"] == info["host_public_key"]
        socket.create_connection(("127.0.0.1", info["port"]), timeout=2).close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", info["port"]), timeout=2)


def test_start_reports_sshd_error(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = LocalSshd(tmp_path / "sshd", port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="sshd exited .*Bind to port"):
            server.start()
        assert not server.is_running
