"""LocalVm: a local VM that behaves like a fresh Compute Engine instance (own sshd, keys, disk, processes)."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import paramiko
import pytest
from conftest import PROJECT, emulator_credentials

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.vm import LocalVm, authorized_keys
from airflow_tpu_posttrain.recipes import remote_job

LOGIN = "posttrain"
# The image's Python 3.12 (pyenv's, under /root), as the venv's interpreter resolves to it.
PYTHON312 = Path(sys.executable).resolve()


def _keypair(directory: Path, name: str) -> tuple[paramiko.PKey, str]:
    path = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    key_type, data = path.with_suffix(".pub").read_text().split()[:2]
    return paramiko.Ed25519Key(filename=str(path)), f"{key_type} {data}"


def _expiring(login: str, public_key: str, expire_on: datetime) -> str:
    """A metadata line in Google's format for expiring keys."""
    expiry = {"userName": login, "expireOn": expire_on.strftime("%Y-%m-%dT%H:%M:%S+0000")}
    return f"{login}:{public_key} google-ssh {json.dumps(expiry)}"


def _connect(vm: LocalVm, key: paramiko.PKey, user: str = LOGIN, host_keys: dict[str, str] | None = None):
    """A client that accepts only the published host keys (or ``host_keys``) of the VM's address."""
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    for key_type, data in (vm.host_keys if host_keys is None else host_keys).items():
        client.get_host_keys().add(
            vm.address, key_type, paramiko.PKey.from_type_string(key_type, base64.b64decode(data))
        )
    try:
        client.connect(
            vm.address,
            port=vm.port,
            username=user,
            pkey=key,
            look_for_keys=False,
            allow_agent=False,
            # Bounds, not a pace: on a loaded machine the VM's keys command (a process asking the metadata server)
            # has taken over 10 s to answer.
            timeout=30,
            banner_timeout=30,
            auth_timeout=30,
        )
    except BaseException:
        client.close()
        raise
    return client


def _run(client: paramiko.SSHClient, command: str) -> str:
    _, stdout, stderr = client.exec_command(command, timeout=30)
    output = stdout.read().decode()
    assert stdout.channel.recv_exit_status() == 0, (command, output, stderr.read().decode())
    return output


def _wait_for(condition: Callable[[], object], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _unanswered(address: str, port: int = 22) -> bool:
    """Nothing answers: refused, or (before its interface is up, as on Google Cloud) no route or a timeout."""
    try:
        socket.create_connection((address, port), timeout=0.5).close()
    except OSError:
        return True
    return False


def _processes_in(mount_ns: str) -> dict[int, list[str]]:
    """``{pid: argv}`` of the live processes in the mount namespace ``mnt:[N]``."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(entry / "ns" / "mnt") == mount_ns:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[paramiko.PKey, str]]:
    directory = tmp_path_factory.mktemp("keys")
    return {name: _keypair(directory, name) for name in ("user", "expiring", "expired", "stranger", "root")}


@pytest.fixture
def make_vm(tmp_path, keys):
    """Boots VMs (``boot_delay=0`` unless given) whose metadata holds the "user" key; destroys them after."""
    vms: list[LocalVm] = []

    def make(name: str, ssh_keys: str | None = None, boot: bool = True, **kwargs) -> LocalVm:
        kwargs.setdefault("boot_delay", 0)
        ssh_keys = f"{LOGIN}:{keys['user'][1]}\n" if ssh_keys is None else ssh_keys
        address = vpc.allocate_vm_address()
        vm = LocalVm(name, tmp_path / "disks" / name, address, ssh_keys, **kwargs)
        vms.append(vm)
        if boot:
            vm.boot()
            vm.wait_until_booted(timeout=30)
        return vm

    yield make
    errors = []
    for vm in vms:  # every VM, even if one fails to go
        try:
            vm.destroy()
        except Exception as error:  # noqa: BLE001 - raised below
            errors.append(error)
    if errors:
        raise errors[0]


def test_metadata_key_logs_in_to_the_image(make_vm, keys, tmp_path):
    now = datetime.now(UTC)
    metadata = "\n".join(
        [
            f"{LOGIN}:{keys['user'][1]} laptop",
            _expiring(LOGIN, keys["expiring"][1], now + timedelta(days=1)),
            "not a key line",
            f"{LOGIN}:ssh-ed25519",
        ]
    )
    package = "archive-v0/k3y/pkg/mirrored"  # where uv keeps an unpacked wheel's files
    (tmp_path / "uv-cache" / package).parent.mkdir(parents=True)
    (tmp_path / "uv-cache" / package).write_text("a package from the mirror")
    vm = make_vm("vm-login", metadata, package_cache=tmp_path / "uv-cache")
    assert vm.address.startswith("10.77.") and vm.address != vpc.GATEWAY
    assert set(vm.host_keys) == {"ssh-ed25519", "ecdsa-sha2-nistp256"}
    assert vm.guest_attributes == [
        {"namespace": "hostkeys", "key": key_type, "value": value} for key_type, value in vm.host_keys.items()
    ]
    for key in ("user", "expiring"):
        with _connect(vm, keys[key][0]) as client:
            assert _run(client, "id -un; echo ~").split() == [LOGIN, f"/home/{LOGIN}"]
            assert _run(client, f"{PYTHON312} -V").startswith("Python 3.12")
            assert _run(client, "uv --version").startswith("uv ")
            cache = _run(client, 'touch "$UV_CACHE_DIR/written" && echo "$UV_CACHE_DIR"').strip()
            # uv links a package from its cache into a venv on the same disk. The kernel refuses a link to
            # another user's file (fs.protected_hardlinks): uv then copies every file.
            link = f'mkdir -p /var/tmp/venv && ln -f "$UV_CACHE_DIR/{package}" /var/tmp/venv/ && echo ok'
            assert _run(client, link) == "ok\n"
    # uv's cache is on the VM's disk, warmed from the mirror; what the VM writes there stays on its disk.
    assert cache == "/var/tmp/uv-cache" and (vm.disk_dir / "var-tmp/uv-cache" / package).exists()
    assert (vm.disk_dir / "var-tmp/uv-cache/written").exists() and not (tmp_path / "uv-cache/written").exists()
    assert (tmp_path / "uv-cache" / package).stat().st_uid == 0  # the mirror stays root's
    # No copy of the mirror per login (6.6 GB at a login's first boot): the VM's cache links the mirror's files.
    assert (vm.disk_dir / "var-tmp/uv-cache" / package).stat().st_ino == (tmp_path / "uv-cache" / package).stat().st_ino


def test_only_valid_metadata_keys_and_no_root(make_vm, keys):
    past = datetime.now(UTC) - timedelta(minutes=1)
    metadata = "\n".join(
        [
            f"{LOGIN}:{keys['user'][1]}",
            _expiring(LOGIN, keys["expired"][1], past),
            f"root:{keys['root'][1]}",
        ]
    )
    vm = make_vm("vm-refuse", metadata)
    for user, key in [(LOGIN, "stranger"), (LOGIN, "expired"), ("root", "root"), ("root", "user")]:
        with pytest.raises(paramiko.AuthenticationException):
            _connect(vm, keys[key][0], user=user)
    _connect(vm, keys["user"][0]).close()


def test_expiry_is_checked_at_login(make_vm, keys):
    expire_on = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=6)
    vm = make_vm("vm-expiry", _expiring(LOGIN, keys["expiring"][1], expire_on))
    _connect(vm, keys["expiring"][0]).close()
    assert _wait_for(lambda: datetime.now(UTC) > expire_on, timeout=10)
    with pytest.raises(paramiko.AuthenticationException):
        _connect(vm, keys["expiring"][0])


def test_oslogin_vm_takes_only_the_oslogin_profiles_current_keys(make_vm, keys):
    """With OS Login on, the VM's sshd asks the metadata server for the login's keys.

    Keys imported through the real OS Login client log in as the POSIX name it answered, until they expire;
    metadata keys do not."""
    from google.cloud.oslogin_v1 import OsLoginServiceClient

    from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
    from airflow_tpu_posttrain.local.iam import OS_LOGIN

    with ComputeEmulator() as emulator:
        user = "runner@my-project.iam.gserviceaccount.com"
        client = OsLoginServiceClient(
            transport="rest",
            credentials=emulator_credentials(emulator, user, (OS_LOGIN,)),
            client_options={"api_endpoint": emulator.url},
        )
        expire_on = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=8)
        answers = [
            client.import_ssh_public_key(
                request={"parent": f"users/{user}", "ssh_public_key": {"key": key, "expiration_time_usec": usec}}
            )
            for key, usec in [
                (keys["user"][1], int((time.time() + 3600) * 1e6)),
                (keys["expiring"][1], int(expire_on.timestamp() * 1e6)),
            ]
        ]
        login = answers[-1].login_profile.posix_accounts[0].username
        assert login.startswith("sa_") and len(answers[-1].login_profile.ssh_public_keys) == 2
        vm = make_vm(
            "vm-oslogin",
            f"{LOGIN}:{keys['stranger'][1]}\n",  # metadata keys: ignored under OS Login
            oslogin_url=emulator.guest_oslogin_url(PROJECT),
            oslogin_logins=[login],
        )
        with _connect(vm, keys["user"][0], user=login) as session:
            assert _run(session, "id -un").strip() == login
        _connect(vm, keys["expiring"][0], user=login).close()
        for user_, key in [(LOGIN, "stranger"), (login, "stranger"), (LOGIN, "user")]:
            with pytest.raises(paramiko.AuthenticationException):
                _connect(vm, keys[key][0], user=user_)
        assert _wait_for(lambda: datetime.now(UTC) > expire_on, timeout=12)
        with pytest.raises(paramiko.AuthenticationException):
            _connect(vm, keys["expiring"][0], user=login)
        _connect(vm, keys["user"][0], user=login).close()


def test_no_keys_no_login(make_vm, keys):
    vm = make_vm("vm-nokeys", "")
    with pytest.raises(paramiko.AuthenticationException):
        _connect(vm, keys["user"][0])


def test_vms_have_own_address_host_keys_and_disk(make_vm, keys, tmp_path):
    shared = tmp_path / "shared-checkpoints"  # under the host's /tmp, which each VM hides behind its own
    shared.mkdir()
    shared.chmod(0o1777)  # writable by the VMs' login user
    vm_a = make_vm("vm-a", shared_paths=[shared])
    vm_b = make_vm("vm-b", shared_paths=[shared])
    assert vm_a.address != vm_b.address
    assert not set(vm_a.host_keys.values()) & set(vm_b.host_keys.values())
    marker = f"marker-{uuid.uuid4().hex}"
    private_files = [f"/home/{LOGIN}/{marker}", f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}"]
    present = f"for f in {' '.join(private_files)}; do test -e $f && echo $f; done; true"
    with _connect(vm_a, keys["user"][0]) as client:
        _run(client, f"touch ~/{marker} {' '.join(private_files[1:])} && echo from-a > {shared}/{marker}")
        assert _run(client, present).split() == private_files
    with _connect(vm_b, keys["user"][0]) as client:
        assert _run(client, f"cat {shared}/{marker}") == "from-a\n"
        assert _run(client, present) == ""
    assert (shared / marker).read_text() == "from-a\n"
    assert not any(Path(path).exists() for path in private_files)
    # A client that pinned VM A's host keys refuses VM B.
    with pytest.raises(paramiko.BadHostKeyException):
        _connect(vm_b, keys["user"][0], host_keys=vm_a.host_keys)


def test_an_image_path_under_a_private_dir_is_seen_read_only_at_its_path(make_vm, keys, tmp_path):
    """The local stack's torch venv, from a checkout under /tmp (the VM's own /tmp): there, and not writable."""
    venv = tmp_path / "checkout" / ".local" / "hfcheck-venv"
    (venv / "bin").mkdir(parents=True)
    (tmp_path / "checkout" / "README.md").write_text("this machine's, not the VM's")
    (venv / "bin" / "python").write_text("#!/bin/sh\necho from the image\n")
    (venv / "bin" / "python").chmod(0o755)
    with _connect(make_vm("vm-image", image_paths=[venv]), keys["user"][0]) as client:
        assert _run(client, f"{venv}/bin/python") == "from the image\n"
        assert _run(client, f"touch {venv}/written 2>&1 || echo refused").strip().endswith("refused")
        assert _run(client, f"ls -A {venv.parent.parent}") == ".local\n"  # the rest of the checkout stays hidden
    assert not (venv / "written").exists()


def test_what_one_vm_compiled_the_next_finds_in_its_jax_cache(make_vm, keys, tmp_path):
    """MaxText's ``~/jax_cache`` is this machine's one cache on every local VM (a declared stand-in difference)."""
    from airflow_tpu_posttrain.local.stack import compile_cache

    cache = compile_cache(tmp_path)
    entry = f"jit_train_step-{uuid.uuid4().hex}-cache"
    with _connect(make_vm("vm-compiles", compile_cache=cache), keys["user"][0]) as client:
        _run(client, f"echo compiled > ~/jax_cache/{entry}")
    with _connect(make_vm("vm-reuses", compile_cache=cache), keys["user"][0]) as client:
        assert _run(client, f"cat ~/jax_cache/{entry}") == "compiled\n"
    assert (cache / entry).read_text() == "compiled\n"


def test_the_vms_published_host_keys_beat_known_hosts(make_vm, tmp_path, monkeypatch, fault_matrix):
    """A step trusts the keys the VM it created published, and nothing else.

    A recycled address has a stale ``~/.ssh/known_hosts`` entry on the workers, or a planted one."""
    from airflow_tpu_posttrain.exceptions import VmHostKeyMismatchError
    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes.access import known_hosts

    _, public_key = _keypair(tmp_path, "worker")
    vm, other = (make_vm(name, f"{LOGIN}:{public_key}\n") for name in ("vm-now-at-address", "vm-before"))
    connection = {"conn_type": "ssh", "login": LOGIN, "port": vm.port, "extra": {"key_file": str(tmp_path / "worker")}}
    monkeypatch.setenv("AIRFLOW_CONN_PINNED_VM", json.dumps(connection))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    worker_known_hosts = tmp_path / ".ssh" / "known_hosts"

    # Stale: the address's earlier machine. The VM there now published its own keys, and is reached.
    worker_known_hosts.write_text(known_hosts(vm.address, vm.port, other.host_keys))
    with VmHook("pinned_vm", remote_host=vm.address, host_keys=vm.host_keys) as hook:
        assert hook.run("hostname; echo reached").split()[-1] == "reached"
    # Planted: known_hosts vouches for the machine at the address; the VM published other keys: refused.
    worker_known_hosts.write_text(known_hosts(vm.address, vm.port, vm.host_keys))
    with pytest.raises(VmHostKeyMismatchError, match="not the one the VM published"):
        with VmHook("pinned_vm", remote_host=vm.address, host_keys=other.host_keys):
            pass
    fault_matrix.record(
        "access: a stale or planted ~/.ssh/known_hosts entry for the VM's address -> only the published keys count",
        None, "n/a", None, "stale entry: VM reached; planted entry for other keys: refused (host key mismatch)",
    )


def test_a_short_commands_output_is_read_to_its_end_even_after_its_exit_status(make_vm, tmp_path, monkeypatch):
    """The SSH server sends the exit status when the shell exits; output still on its way comes after it.

    Here a child outlives the shell and writes twice after the status came: the answer holds both lines, and the
    shell's status. (Reading stopped at the first line after the status: a check's ``echo reached`` was lost.)"""
    from airflow_tpu_posttrain.hooks.vm import VmHook

    _, public_key = _keypair(tmp_path, "worker")
    vm = make_vm("vm-late-output", f"{LOGIN}:{public_key}\n")
    connection = {"conn_type": "ssh", "login": LOGIN, "port": vm.port, "extra": {"key_file": str(tmp_path / "worker")}}
    monkeypatch.setenv("AIRFLOW_CONN_LATE_VM", json.dumps(connection))
    with VmHook("late_vm", remote_host=vm.address, host_keys=vm.host_keys) as hook:
        late = "(sleep 1; echo late; sleep 1; echo last) &"
        assert hook.run(f"{late} echo early").split() == ["early", "late", "last"]
        assert hook.run_status(f"{late} exit 3") == (3, "late\nlast\n")


def test_sshd_answers_only_after_boot_delay(make_vm, keys):
    boot_delay = 1.5
    vm = make_vm("vm-slow", boot=False, boot_delay=boot_delay, guest_attributes=False)
    started = time.monotonic()
    vm.boot()
    assert not vm.is_running
    assert _unanswered(vm.address)
    assert _wait_for(lambda: not _unanswered(vm.address), timeout=30)
    assert time.monotonic() - started >= boot_delay
    vm.wait_until_booted(timeout=30)
    _connect(vm, keys["user"][0]).close()
    assert vm.is_running
    assert vm.guest_attributes == []


def _host_mounts(but_vms_other_than: str = "") -> str:
    """The mounts of this machine, without the network namespace names of VMs other than the one at the address.

    Other tests' VMs (another test worker's) come and go meanwhile, each with such a mount (local/vpc.py)."""
    own = f" /run/netns/{vpc.namespace_of(but_vms_other_than)} " if but_vms_other_than else None
    any_vm = f" /run/netns/{vpc.namespace_of('')}"
    lines = Path("/proc/self/mountinfo").read_text().splitlines(keepends=True)
    return "".join(line for line in lines if any_vm not in line or (own and own in line))


def test_destroy_kills_detached_jobs_and_leaves_nothing(make_vm, keys):
    host_mounts = _host_mounts()
    vm = make_vm("vm-jobs")
    # The one mount the VM adds on this machine: its network namespace's name (local/vpc.py), gone with it.
    namespace_mount = f" /run/netns/{vpc.namespace_of(vm.address)} "
    with_it = _host_mounts(but_vms_other_than=vm.address)
    assert namespace_mount in with_it
    assert "".join(line for line in with_it.splitlines(keepends=True) if namespace_mount not in line) == host_mounts
    job = ["sleep", f"1000.{uuid.uuid4().int % 10**6}"]
    client = _connect(vm, keys["user"][0])
    try:
        mount_ns = _run(client, "readlink /proc/self/ns/mnt").strip()
        _run(client, f"setsid nohup {' '.join(job)} >/dev/null 2>&1 </dev/null &")
        assert _wait_for(lambda: job in _processes_in(mount_ns).values())
        assert vm.drop_sessions()
        assert _wait_for(lambda: not client.get_transport().is_active())
    finally:
        client.close()
    assert job in _processes_in(mount_ns).values()
    with _connect(vm, keys["user"][0]) as again:
        assert _run(again, "echo still listening") == "still listening\n"

    started = time.monotonic()
    vm.destroy()
    print(f"destroy() took {time.monotonic() - started:.3f} s")
    assert _processes_in(mount_ns) == {}  # the detached job included
    assert _unanswered(vm.address)
    assert not vm.disk_dir.exists()
    assert not vm.is_running
    assert _host_mounts(but_vms_other_than=vm.address) == host_mounts
    vm.destroy()  # idempotent


def test_first_command_after_boot(make_vm, keys):
    vm = make_vm("vm-timed", boot=False)
    started = time.monotonic()
    vm.boot()
    assert _wait_for(lambda: not _unanswered(vm.address), timeout=30)
    with _connect(vm, keys["user"][0]) as client:
        assert _run(client, "true") == ""
    print(f"boot() to first SSH command: {time.monotonic() - started:.3f} s")


def test_authorized_keys_follows_the_guest_agent():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    lines = [
        "alice:ssh-ed25519 AAAA1 comment with spaces",
        'alice:ssh-ed25519 AAAA2 google-ssh {"userName":"alice","expireOn":"2026-12-01T10:00:00+0000"}',
        'alice:ssh-ed25519 AAAA3 google-ssh {"userName":"alice","expireOn":"2026-01-01T10:00:00+0000"}',
        'alice:ssh-ed25519 AAAA4 google-ssh {"userName":"alice","expireOn":"2026-12-01T10:00:00Z"}',
        "alice:ssh-ed25519 AAAA5 google-ssh not-json",
        'alice:ssh-ed25519 AAAA6 google-ssh {"userName":"alice","expireOn":"tomorrow"}',
        "bob:ssh-ed25519 BBBB1",
        "alice ssh-ed25519 AAAA7",
        "Alice:ssh-ed25519 AAAA8",
        "alice:ssh-ed25519",
        "",
    ]
    assert authorized_keys(lines, "alice", now) == [
        "ssh-ed25519 AAAA1",
        "ssh-ed25519 AAAA2",
        "ssh-ed25519 AAAA4",
    ]
    assert authorized_keys(lines, "bob", now) == ["ssh-ed25519 BBBB1"]


def test_a_vm_address_is_held_until_released():
    addresses = [vpc.allocate_vm_address() for _ in range(20)]
    try:
        assert len(set(addresses)) == 20 and all(address.startswith("10.77.") for address in addresses)
        assert all(Path(f"/run/netns/{vpc.namespace_of(address)}").exists() for address in addresses)
    finally:
        for address in addresses:
            vpc.release_vm_address(address)
    assert not any(Path(f"/run/netns/{vpc.namespace_of(address)}").exists() for address in addresses)


@pytest.mark.parametrize(
    ("egress", "reaches_google", "reaches_internet"),
    [(vpc.Egress.NONE, False, False), (vpc.Egress.GOOGLE_APIS, True, False), (vpc.Egress.INTERNET, True, True)],
)
def test_a_vm_reaches_what_its_network_interface_allows(make_vm, keys, egress, reaches_google, reaches_internet):
    """Google's APIs with Private Google Access; the internet (and Google's APIs) with an external IP or NAT.

    The metadata server (the VPC's gateway) always."""
    servers = {
        "metadata": socket.create_server((vpc.GATEWAY, 0)),
        "google": socket.create_server((vpc.service_address(vpc.GOOGLE_APIS_RANGE, 443), 0)),
        "internet": socket.create_server((vpc.INTERNET_ADDRESS, 0)),
    }
    try:
        vm = make_vm(f"vm-{egress.value}", egress=egress)
        probe = "; ".join(
            f"timeout 5 bash -c '</dev/tcp/{host}/{port}' 2>/dev/null && echo {name}=yes || echo {name}=no"
            for name, server in servers.items()
            for host, port in [server.getsockname()[:2]]
        )
        with _connect(vm, keys["user"][0]) as client:
            reached = dict(line.split("=") for line in _run(client, probe).split())
    finally:
        for server in servers.values():
            server.close()
    assert reached == {
        "metadata": "yes",
        "google": "yes" if reaches_google else "no",
        "internet": "yes" if reaches_internet else "no",
    }


def test_googles_storage_host_reaches_the_local_gcs_server_over_https(make_vm, keys, tmp_path):
    """A client with no endpoint setting (TSL's GCS client: JAX's profiler, TensorFlow) calls Google's host.

    The VM resolves it to the local server's HTTPS front and trusts the front's CA besides the system's. The
    upload is sent as TSL sends it, ``Transfer-Encoding: identity``, which the server behind refuses (501); the
    read back is TSL's too: the XML API's path-style URL on storage.googleapis.com with the object name's slashes
    percent-encoded (orbax 0.12.8 reads its array metadata back so through tf.io.gfile)."""
    from google.cloud import storage as gcs_client

    from airflow_tpu_posttrain.local.gcs_server import SYSTEM_CA_BUNDLE, GcsServer, client_environment

    with GcsServer(tmp_path / "gcs", buckets=("bucket",), tls_dir=tmp_path / "tls") as gcs:
        assert gcs.ca_bundle.read_bytes().startswith(SYSTEM_CA_BUNDLE.read_bytes())  # real servers still trusted
        vm = make_vm(
            "vm-tls", environment=client_environment(gcs.url), hosts=gcs.google_hosts, ca_bundle=gcs.ca_bundle
        )
        api = "https://www.googleapis.com"
        with _connect(vm, keys["user"][0]) as client:
            assert json.loads(_run(client, f"curl -sSf {api}/storage/v1/b/bucket"))["name"] == "bucket"
            _run(
                client,
                "echo via-google-host | curl -sSf -X POST -H 'Transfer-Encoding: identity' --data-binary @- "
                f"'{api}/upload/storage/v1/b/bucket/o?uploadType=media&name=from-vm/tsl-marker'",
            )
            session = _run(
                client,
                f"curl -sSf -o /dev/null -D - -X POST '{api}/upload/storage/v1/b/bucket/o?uploadType=resumable&name=x'",
            )
            location = next(line for line in session.splitlines() if line.lower().startswith("location:"))
            assert location.split(None, 1)[1].startswith(f"{api}/upload/storage/v1/b/bucket/o?"), location
            read_back = "curl -sSf -H 'Range: bytes=4-9' https://storage.googleapis.com/bucket/from-vm%2Ftsl-marker"
            assert _run(client, read_back) == "google"
        os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
        try:
            blob = gcs_client.Client().bucket("bucket").blob("from-vm/tsl-marker")
            assert blob.download_as_bytes() == b"via-google-host\n"
        finally:
            del os.environ["STORAGE_EMULATOR_HOST"]


def test_sessions_reach_the_local_gcs_server_without_credentials(make_vm, keys, tmp_path):
    """The image's environment names the local GCS server to the storage clients.

    A VM on Google Cloud reaches storage.googleapis.com the same way, with its service account. Nothing is
    copied onto the VM: the pipeline's storage tool writes into the bucket from a session, and this machine
    reads it back."""
    from google.cloud import storage as gcs_client

    from airflow_tpu_posttrain.local.gcs_server import GcsServer, client_environment

    with GcsServer(tmp_path / "gcs", buckets=("bucket",)) as gcs:
        vm = make_vm("vm-storage", environment=client_environment(gcs.url))
        tool = Path(__file__).resolve().parents[1] / "airflow_tpu_posttrain" / "vm_scripts" / "gcs_tool.py"
        with _connect(vm, keys["user"][0]) as client:
            assert _run(client, "echo $STORAGE_EMULATOR_HOST $TENSORSTORE_GCS_HTTP_URL").split() == [gcs.url] * 2
            assert _run(client, "ls ~/.config/gcloud 2>/dev/null; echo ${GOOGLE_APPLICATION_CREDENTIALS:-none}") == "none\n"
            _run(client, f"echo written-on-the-vm | {sys.executable} {tool} write gs://bucket/from-vm/marker")
        os.environ["STORAGE_EMULATOR_HOST"] = gcs.url
        try:
            blob = gcs_client.Client().bucket("bucket").blob("from-vm/marker")
            assert blob.download_as_bytes() == b"written-on-the-vm\n"
        finally:
            del os.environ["STORAGE_EMULATOR_HOST"]


def _start_job(vm: LocalVm, job_id: str, script: str):
    """A detached job on a VM as the MaxText steps start theirs (providers-ssh's wrapper); its paths."""
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook

    paths = RemoteJobPaths(job_id=job_id, remote_os="posix", base_dir="/tmp/jobs")
    with VmHook("slice_vm", remote_host=vm.address, host_keys=vm.host_keys) as hook:
        hook.put_text(f"{paths.job_dir}.sh", script, 0o700)
        hook.run(build_posix_wrapper_command(f"bash {paths.job_dir}.sh", paths))
    return paths


def _slice_watch(vms, paths, login_conn: str):
    import asyncio

    from airflow_tpu_posttrain.triggers.slice_job import SliceJobTrigger

    trigger = SliceJobTrigger(
        ssh_conn_id=login_conn, remote_host=vms[0].address, host_keys=vms[0].host_keys, job_id=paths.job_id,
        job_dir=paths.job_dir, log_file=paths.log_file, exit_code_file=paths.exit_code_file, remote_os="posix",
        poll_interval=0.2, command_timeout=30,
        peers=[{"worker_id": i, "remote_host": vm.address, "host_keys": vm.host_keys} for i, vm in enumerate(vms) if i],
    )
    _, kwargs = trigger.serialize()  # what the triggerer runs: the trigger made again from its serialized form
    trigger = SliceJobTrigger(**kwargs)

    async def first_event():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(first_event(), timeout=120))


def test_a_slice_job_ends_when_every_worker_ended_and_one_failure_stops_the_others(make_vm, tmp_path, monkeypatch):
    """The same job on two VMs, watched as one: it succeeds when both did.

    When worker 1 fails, worker 0's still running job is stopped (its processes gone) and the event carries each
    worker's exit code and log tail."""
    from airflow_tpu_posttrain.hooks.vm import VmHook

    _, public_key = _keypair(tmp_path, "worker")
    vms = [make_vm(f"vm-slice-{i}", f"{LOGIN}:{public_key}\n") for i in range(2)]
    connection = {"conn_type": "ssh", "login": LOGIN, "extra": {"key_file": str(tmp_path / "worker")}}
    monkeypatch.setenv("AIRFLOW_CONN_SLICE_VM", json.dumps({**connection, "port": vms[0].port}))
    for vm in vms:
        paths = _start_job(vm, "both-succeed", "echo step on $(hostname); sleep 1")
    done = _slice_watch(vms, paths, "slice_vm")
    assert (done["status"], done["exit_code"], done.get("workers")) == ("success", 0, None)

    hanging = _start_job(vms[0], "one-fails", "echo worker 0 waits for its peer; sleep 300")
    _start_job(vms[1], "one-fails", "echo worker 1 lost its peer; exit 134")
    failed = _slice_watch(vms, hanging, "slice_vm")
    assert failed["exit_code"] == 134 and failed["failed_worker"] == 1
    assert failed["workers"]["1"] == {"exit_code": 134, "tail": "worker 1 lost its peer\n"}
    assert failed["workers"]["0"]["exit_code"] is None  # it was running: stopped, not waited for
    assert "worker 0 waits for its peer" in failed["workers"]["0"]["tail"]
    with VmHook("slice_vm", remote_host=vms[0].address, host_keys=vms[0].host_keys) as hook:
        assert hook.run(remote_job.completion_command(hanging.pid_file, hanging.exit_code_file)).strip() in (
            "died", "143",
        )
