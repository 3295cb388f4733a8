"""One local stand-in for a fresh Compute Engine VM: its own sshd, host keys, accounts, disk and processes.

``LocalVm`` runs ``/usr/sbin/sshd`` on its VPC address inside a network, mount, pid and UTS namespace of its own
(its network: ``local/vpc.py``). Its host name is its instance name, which resolves to its VPC address (its
/etc/hosts), as a Compute Engine VM's does. Its disk ``disk_dir`` holds ``etc/`` (its /etc/ssh: fresh host keys,
sshd_config, the ssh-keys metadata, and a copy of this file as ``vm_agent.py``, its init and keys command, run by
the image's /usr/bin/python3 with the stdlib only), ``home/``, ``tmp/``, ``var-tmp/``, ``root/`` (its /home, /tmp,
/var/tmp, /root) and ``console.log``. The rest of this machine (OS, /usr, the repository) is the shared
boot image. ``destroy()`` kills every process of the VM (detached jobs die with the pid namespace).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this file runs on the VMs too, as their agent (stdlib only): local/vpc.py is imported lazily
    from airflow_tpu_posttrain.local.vpc import Egress

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
# The image's system Python: it runs as root before /root is replaced and as "nobody" for the keys command.
IMAGE_PYTHON = "/usr/bin/python3"
PYENV_ROOT = Path("/root/.pyenv")
VM_SSH_DIR = "/etc/ssh"
VM_CA_BUNDLE = f"{VM_SSH_DIR}/ca-bundle.crt"  # on the VM's disk: its etc/ is its /etc/ssh
_KEYS_COMMAND = f"{IMAGE_PYTHON} -I {VM_SSH_DIR}/vm_agent.py keys {VM_SSH_DIR}/ssh-keys %u"
_OSLOGIN_KEYS_COMMAND = f"{IMAGE_PYTHON} -I {VM_SSH_DIR}/vm_agent.py oslogin-keys {{url}} %u"
START_TIMEOUT_S = 60.0  # a loaded 2-core machine forks slowly; a bound, not a pace
DESTROY_TIMEOUT_S = 60.0  # SIGKILLed processes with GBs mapped take a while to go on a loaded machine
# A VM deleted while it boots waits for its disk to be ready first: the first boot after a new mirror shares it.
BOOT_PREPARE_TIMEOUT_S = 300.0
HOST_KEY_TYPES = {"ed25519": "ssh-ed25519", "ecdsa": "ecdsa-sha2-nistp256"}
# MaxText's default jax_cache_dir ("~/jax_cache", configs/base.yml), in the login's home.
JAX_CACHE_DIR = "jax_cache"
# The VM's writable places, each replaced by a directory of its disk.
PRIVATE_DIRS = {"/tmp": "tmp", "/var/tmp": "var-tmp", "/home": "home", "/root": "root"}
# Environment the VMs' sessions share with this machine: its tools (uv, Python) and its way to PyPI.
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
VM_UV_CACHE = "uv-cache"  # in the VM's /var/tmp: the package cache, as warmed from a mirror
PACKAGE_GROUP = "posttrain-packages"  # every VM login's: its members may link the package mirror's files
_LOGIN = re.compile(r"[a-z_][a-z0-9_.-]{0,31}")
_ACCOUNTS_LOCK = threading.Lock()


def _same_filesystem(a: Path, b: Path) -> bool:
    b.mkdir(parents=True, exist_ok=True)
    return a.stat().st_dev == b.stat().st_dev


def _key_fields(line: str) -> tuple[str, list[str]] | None:
    """``(LOGIN, [KEYTYPE, KEY, COMMENT...])`` of one ``LOGIN:KEYTYPE KEY [COMMENT]`` line, or None."""
    login, colon, key = line.strip().partition(":")
    fields = key.split(None, 2)
    if not colon or not _LOGIN.fullmatch(login) or len(fields) < 2:
        return None
    return login, fields


def authorized_keys(lines: Iterable[str], user: str, now: datetime) -> list[str]:
    """The ``KEYTYPE KEY`` entries of ``user`` in the ssh-keys metadata that are valid at ``now``.

    Format (cloud.google.com/compute/docs/connect/add-ssh-keys): one key per line, ``LOGIN:KEYTYPE KEY
    [COMMENT]``; an expiring key's comment is ``google-ssh {"userName":"LOGIN","expireOn":"..."}`` with
    expireOn like ``2026-12-01T10:00:00+0000``. As Google's guest agent does, an expired key, a
    google-ssh key whose JSON or expireOn does not parse, and a malformed line are dropped.
    """
    keys = []
    for line in lines:
        parsed = _key_fields(line)
        if parsed is None or parsed[0] != user:
            continue
        fields = parsed[1]
        if len(fields) == 3 and fields[2].startswith("google-ssh"):
            try:
                expire_on = json.loads(fields[2][len("google-ssh") :])["expireOn"]
                if datetime.strptime(expire_on, "%Y-%m-%dT%H:%M:%S%z") <= now:
                    continue
            except (ValueError, KeyError, TypeError):
                continue
        keys.append(f"{fields[0]} {fields[1]}")
    return keys


def oslogin_keys(url: str, user: str, now: datetime) -> list[str]:
    """The ``KEYTYPE KEY`` entries of OS Login user ``user`` valid at ``now``, if the account may log in.

    Read from the metadata server's ``oslogin/users?username=``, then ``oslogin/authorize?email=&policy=login``
    (what Google's ``google_authorized_keys`` asks: an account without roles/compute.osLogin or osAdminLogin
    gets no keys); none for an unknown user."""
    import urllib.error
    import urllib.parse
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the metadata server is local

    def ask(query: str) -> dict:
        request = urllib.request.Request(f"{url}{query}", headers={"Metadata-Flavor": "Google"})
        with opener.open(request, timeout=10) as answer:
            return json.load(answer)

    try:
        profiles = ask(f"users?username={urllib.parse.quote(user)}").get("loginProfiles", [])
        profiles = [
            profile
            for profile in profiles
            if ask(f"authorize?email={urllib.parse.quote(profile.get('name', ''))}&policy=login").get("success")
        ]
    except urllib.error.HTTPError:
        return []
    now_usec = int(now.timestamp() * 1_000_000)
    keys = []
    for profile in profiles:
        for entry in (profile.get("sshPublicKeys") or {}).values():
            if int(entry.get("expirationTimeUsec") or now_usec + 1) <= now_usec:
                continue
            fields = entry.get("key", "").split()
            if len(fields) >= 2:
                keys.append(f"{fields[0]} {fields[1]}")
    return keys


def _init(setup: list[list[str]], sshd_argv: list[str]) -> int:
    """PID 1 of the VM: its set-up (host name, mounts), then sshd; it reaps orphans (a zombie looks alive)."""
    for argv in setup:
        subprocess.run(argv, check=True)
    sshd = subprocess.Popen(sshd_argv)
    while True:
        pid, status = os.wait()
        if pid == sshd.pid:
            return os.waitstatus_to_exitcode(status)


def _namespace_members(mount_ns: str) -> dict[int, tuple[int, str]]:
    """``{pid: (ppid, comm)}`` of the live processes in the mount namespace ``mount_ns`` (``mnt:[N]``)."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # a zombie has no namespace link any more, and a process may exit meanwhile
            if os.readlink(entry / "ns" / "mnt") != mount_ns:
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Format: "pid (comm) state ppid ..."; comm may itself contain spaces or parentheses.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        members[int(entry.name)] = (ppid, stat[stat.index("(") + 1 : stat.rindex(")")])
    return members


def _started(pid: int) -> int | None:
    """When the live process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None: gone.

    With its pid, the process's identity: a pid, and a namespace's number, are reused once freed. A zombie counts
    as gone (dead, waiting for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _ensure_account(login: str) -> pwd.struct_passwd:
    """The host account of ``login``, created once (``useradd``, no home: homes are per VM), in ``PACKAGE_GROUP``.

    Password ``*`` as the guest agent sets it: no password login, yet not locked (``!``), sshd refuses it.
    """
    with _ACCOUNTS_LOCK:
        # No check of the tools: another process may have done it meanwhile, or hold /etc/passwd's or /etc/group's
        # lock (the tools then fail at once); the account database decides, a few times.
        for _ in range(20):
            try:
                account = pwd.getpwnam(login)
            except KeyError:
                _ensure_package_group()
                useradd = ["useradd", "-M", "-d", f"/home/{login}", "-s", "/bin/bash", "-p", "*", "-G", PACKAGE_GROUP]
                if subprocess.run([*useradd, login], check=False, capture_output=True).returncode != 0:
                    time.sleep(0.25)  # as after usermod below: the lock's holder gets time to finish
                continue
            with contextlib.suppress(KeyError):
                if login in grp.getgrnam(PACKAGE_GROUP).gr_mem:
                    return account
            _ensure_package_group()  # an account made before the group was
            subprocess.run(["usermod", "-a", "-G", PACKAGE_GROUP, login], check=False, capture_output=True)
            time.sleep(0.25)
        raise RuntimeError(f"could not make the account {login} in group {PACKAGE_GROUP}")


def _ensure_package_group() -> None:
    subprocess.run(["groupadd", "-f", PACKAGE_GROUP], check=False, capture_output=True)


def _share_mirror(mirror: Path) -> None:
    """The package mirror readable and writable by ``PACKAGE_GROUP``, which every VM login is in.

    A VM's cache is hard-linked from the mirror, and uv, running as the login, hard-links the packages into its
    venv, as on a real VM, whose cache is the login's own. With ``fs.protected_hardlinks``, Debian's default, the
    kernel refuses a link to a file its linker neither owns nor may write: uv then copied all 2.7 GB at every
    install. The group's write permission lets every login link; the files stay root's (a copy per login cost a
    login's first boot a 6.6 GB copy, in every fresh clone). Done again once the mirror has changed."""
    mirror.mkdir(parents=True, exist_ok=True)
    stamp = mirror.with_name(f"{mirror.name}.shared")
    version = ";".join(f"{path.name}:{path.stat().st_mtime_ns}" for path in sorted(mirror.iterdir()))
    with open(mirror.with_name(f"{mirror.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # VMs booting at once share it once
        if stamp.is_file() and stamp.read_text() == version:
            return
        _ensure_package_group()
        subprocess.run(["chgrp", "-R", "-h", PACKAGE_GROUP, str(mirror)], check=True)
        subprocess.run(["chmod", "-R", "g+rwX", str(mirror)], check=True)
        stamp.write_text(version)


def _unshare_written_files(cache: Path) -> None:
    """The files of a VM's cache that uv opens for writing, as the VM's own inodes.

    These are its lock files, and the markers it writes at the top of the cache and of each bucket
    (``CACHEDIR.TAG``, ``.gitignore``, ``sdists-v11/.git``): not links shared with the other VMs of its login;
    the packages stay hard links."""
    written = {*cache.rglob(".lock"), *cache.glob("*"), *cache.glob("*/*")}
    for path in written:
        if path.is_file() and not path.is_symlink():
            private = path.with_name(f".{path.name}.private")
            shutil.copy2(path, private)
            owner = path.stat()
            os.chown(private, owner.st_uid, owner.st_gid)
            os.replace(private, path)


def _chown(path: Path, account: pwd.struct_passwd) -> None:
    subprocess.run(["chown", "-R", f"{account.pw_uid}:{account.pw_gid}", str(path)], check=True)


class LocalVm:
    """One VM on ``address:port``; ``boot()`` starts it ``boot_delay`` s later, ``destroy()`` ends it.

    ``address`` is one :func:`~airflow_tpu_posttrain.local.vpc.allocate_vm_address` claimed; ``destroy()``
    releases it."""

    def __init__(
        self,
        name: str,
        disk_dir: Path,
        address: str,
        ssh_keys: str | None,
        *,
        port: int = 22,
        guest_attributes: bool = True,
        boot_delay: float = 2.0,
        shared_paths: Sequence[Path] = (),
        image_paths: Sequence[Path] = (),
        package_cache: Path | None = None,
        compile_cache: Path | None = None,
        oslogin_url: str | None = None,
        oslogin_logins: Sequence[str] = (),
        metadata_port: int | None = None,
        environment: dict[str, str] | None = None,
        hosts: dict[str, str] | None = None,
        ca_bundle: Path | None = None,
        egress: Egress | None = None,
        domain: str | None = None,
    ) -> None:
        from airflow_tpu_posttrain.local import vpc

        self.name = name
        # Its internal DNS name's domain (``ZONE.c.PROJECT.internal``): /etc/hosts names it ``name.domain`` too.
        self.domain = domain
        # What its network interface lets it reach (local/vpc.py), as Google's network would; None: the internet.
        self.egress = egress or vpc.Egress.INTERNET
        # Set in every session (sshd's SetEnv), as an image's /etc/environment would: the storage clients'
        # endpoint settings of the local GCS server. No credentials: the local server takes anonymous requests,
        # as Cloud Storage takes the VM's service account's, fetched from its metadata server.
        self.environment = dict(environment or {})
        # Names the VM resolves to local stand-ins (its /etc/hosts): Google's storage hosts for clients whose
        # endpoint cannot be set (local/google_front.py); on Google Cloud the VM's DNS resolves them.
        self.hosts = dict(hosts or {})
        # The CAs its TLS clients trust: the image's plus the front's (CURL_CA_BUNDLE, read by libcurl and TSL).
        self.ca_bundle = ca_bundle
        if ca_bundle is not None:
            self.environment["CURL_CA_BUNDLE"] = VM_CA_BUNDLE
        self.disk_dir = Path(disk_dir).absolute()
        self.address = address
        self.port = port
        self.ssh_keys = ssh_keys or ""
        self.boot_delay = boot_delay
        self.shared_paths = [Path(path).resolve() for path in shared_paths]
        # Read-only, at the same path, as part of its boot image (the local stack's torch venv), wherever the
        # checkout is: one under /tmp or /home would otherwise be hidden by the VM's own disk.
        self.image_paths = [Path(path).resolve() for path in image_paths]
        self.package_cache = Path(package_cache).resolve() if package_cache else None
        self.compile_cache = Path(compile_cache).resolve() if compile_cache else None
        # OS Login: sshd asks this metadata-server URL for a login's keys; these accounts exist from boot.
        self.oslogin_url = oslogin_url
        self.oslogin_logins = tuple(oslogin_logins)
        # Its metadata server (the Compute emulator's guest side, on this machine's end of the VPC): reached at
        # metadata.google.internal, as a Compute Engine VM reaches its own (local/vpc.py).
        self.metadata_port = metadata_port
        self.console_path = self.disk_dir / "console.log"
        self._etc = self.disk_dir / "etc"
        self._publish_guest_attributes = guest_attributes
        self._lock = threading.Lock()
        self._destroying = threading.Event()
        self._boot_done = threading.Event()
        self._booted = False
        self._boot_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._process: subprocess.Popen[bytes] | None = None  # `unshare`, the init's parent
        self._mount_ns = ""

    @property
    def host_keys(self) -> dict[str, str]:
        """``{key type: base64}``, as the guest agent publishes them; empty before ``boot()``."""
        keys = {}
        for name, key_type in HOST_KEY_TYPES.items():
            public = self._etc / f"ssh_host_{name}_key.pub"
            if public.exists():
                keys[key_type] = public.read_text().split()[1]
        return keys

    @property
    def guest_attributes(self) -> list[dict[str, str]]:
        """The ``hostkeys/`` guest attributes once booted.

        See cloud.google.com/compute/docs/metadata/manage-guest-attributes: the guest agent publishes each
        host key under namespace ``hostkeys``, key = key type."""
        if not (self._publish_guest_attributes and self.is_running):
            return []
        return [
            {"namespace": "hostkeys", "key": key, "value": value} for key, value in self.host_keys.items()
        ]

    @property
    def is_running(self) -> bool:
        return self._booted and self._process is not None and self._process.poll() is None

    def boot(self) -> None:
        """Generate fresh host keys and start the VM in the background: sshd answers ``boot_delay`` s on."""
        if self._thread is not None:
            raise RuntimeError(f"VM {self.name} was already booted")
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        if any(self.disk_dir.iterdir()):
            raise FileExistsError(f"{self.disk_dir} is not empty: a VM's disk is never reused")
        # The image's /etc/ssh, less its host keys and server config.
        shutil.copytree(VM_SSH_DIR, self._etc, ignore=shutil.ignore_patterns("ssh_host_*", "sshd_config*"))
        self._etc.chmod(0o755)
        for name in HOST_KEY_TYPES:
            key = self._etc / f"ssh_host_{name}_key"
            subprocess.run(
                ["ssh-keygen", "-q", "-t", name, "-N", "", "-C", f"root@{self.name}", "-f", str(key)],
                check=True,
            )
        start_at = time.monotonic() + self.boot_delay
        self._thread = threading.Thread(target=self._boot, args=(start_at,), daemon=True)
        self._thread.start()

    def wait_until_booted(self, timeout: float) -> None:
        if not self._boot_done.wait(timeout):
            raise TimeoutError(f"VM {self.name} did not boot within {timeout} s")
        if self._boot_error is not None:
            raise RuntimeError(f"VM {self.name} failed to boot") from self._boot_error
        if not self._booted:
            raise RuntimeError(f"VM {self.name} was destroyed before it booted")

    def guest_path(self, path: str) -> Path:
        """Where the host reads ``path`` as the running VM sees it, through its init's root.

        This covers its /tmp, /dev/shm and homes. For tests that look at a VM's files before it is deleted."""
        process = self._process
        if process is None or not self.is_running:
            raise RuntimeError(f"VM {self.name} is not running")
        members = _namespace_members(self._mount_ns)
        init = next(pid for pid, (ppid, _) in members.items() if ppid == process.pid)
        return Path(f"/proc/{init}/root") / path.lstrip("/")

    def drop_sessions(self) -> list[int]:
        """SIGKILL the per-connection sshd processes (not the listener); returns their pids.

        The client sees its connection drop; a detached job (``setsid nohup ...``) keeps running.
        """
        process = self._process
        if process is None or not self.is_running:
            return []
        members = _namespace_members(self._mount_ns)
        init = {pid for pid, (ppid, _) in members.items() if ppid == process.pid}
        # The listener is the init's sshd child; every other sshd serves a connection.
        sessions = [
            pid for pid, (ppid, comm) in members.items() if comm.startswith("sshd") and ppid not in init
        ]
        _kill(sessions)
        return sessions

    def destroy(self) -> None:
        """Kill every process of the VM, wait until none is left (bounded), delete the disk. Idempotent."""
        self._destroying.set()
        with self._lock:
            process, self._process = self._process, None
        if process is not None and self._mount_ns:
            deadline = time.monotonic() + DESTROY_TIMEOUT_S
            # The VM's processes, taken once: once they are gone the kernel frees the namespace's number, and
            # another VM booting meanwhile may get it; a scan by namespace then would kill that VM's processes
            # (seen as a VM that "stopped" with nothing on its console). Killing the init kills its pid namespace,
            # what it forked after this snapshot included; the snapshot also covers `unshare` itself.
            members = {pid: _started(pid) for pid in _namespace_members(self._mount_ns)}
            while alive := [pid for pid, started in members.items() if started is not None and _started(pid) == started]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"VM {self.name}: processes {sorted(alive)} outlived destroy()")
                _kill(alive)
                time.sleep(0.02)
        if process is not None:
            process.kill()
            process.wait(timeout=DESTROY_TIMEOUT_S)
        if self._thread is not None:
            self._thread.join(BOOT_PREPARE_TIMEOUT_S)
            if self._thread.is_alive():
                raise TimeoutError(f"VM {self.name}: the boot thread outlived destroy()")
        self._booted = False
        from airflow_tpu_posttrain.local import vpc

        vpc.release_vm_address(self.address)
        if self.disk_dir.exists():
            shutil.rmtree(self.disk_dir)

    def _boot(self, start_at: float) -> None:
        try:
            self._prepare_disk()
            if not self._destroying.wait(max(0.0, start_at - time.monotonic())) and self._start():
                self._booted = self._wait_until_listening()
        except Exception as error:  # noqa: BLE001 - reported by wait_until_booted, unless destroy() caused it
            if not self._destroying.is_set():
                self._boot_error = error
                # Compute's create only sees a VM that never publishes its host keys: say why, for the test's report.
                print(f"local VM {self.name} failed to boot: {error!r}", file=sys.stderr, flush=True)
        finally:
            self._boot_done.set()

    def _prepare_disk(self) -> None:
        """What the guest agent and the image do at first boot: accounts and homes, the sshd config."""
        from airflow_tpu_posttrain.local import vpc

        for private in PRIVATE_DIRS.values():
            (self.disk_dir / private).mkdir()
        for private in ("tmp", "var-tmp"):
            (self.disk_dir / private).chmod(0o1777)
        (self.disk_dir / "root").chmod(0o711)  # traversable, so the login user reaches /root/.pyenv
        # The guest agent creates an account per login named in a well-formed line (never root).
        parsed = (_key_fields(line) for line in self.ssh_keys.splitlines())
        named = [fields[0] for fields in parsed if fields] + list(self.oslogin_logins)
        logins = list(dict.fromkeys(login for login in named if login != "root"))
        for login in logins:
            home = self.disk_dir / "home" / login
            shutil.copytree("/etc/skel", home, symlinks=True)
            if self.compile_cache is not None:  # MaxText's jax_cache_dir, ~/jax_cache: one for this machine
                (home / JAX_CACHE_DIR).symlink_to(self.compile_cache)
            _chown(home, _ensure_account(login))
        if self.package_cache is not None and logins:
            mirror = self.package_cache
            _share_mirror(mirror)
            # The mirror, hard-linked onto the VM's disk (seconds, no bytes copied): uv then links the packages
            # into the venv, both on /var/tmp's mount (links cannot cross mounts). A copy if they cannot.
            copy = ["cp", "-a", "--link"] if _same_filesystem(mirror, self.disk_dir) else ["cp", "-a"]
            vm_cache = self.disk_dir / "var-tmp" / VM_UV_CACHE
            subprocess.run([*copy, str(mirror), str(vm_cache)], check=True)
            _unshare_written_files(vm_cache)
        (self._etc / "ssh-keys").write_text(self.ssh_keys)
        if self.ca_bundle is not None:
            shutil.copy(self.ca_bundle, self._etc / Path(VM_CA_BUNDLE).name)
        hosts = {**self.hosts, **({vpc.METADATA_HOST: vpc.METADATA_ADDRESS} if self.metadata_port else {})}
        extra = "".join(f"{address} {host}\n" for host, address in sorted(hosts.items()))
        (self.disk_dir / "hosts").write_text(self._own_hosts_line() + Path("/etc/hosts").read_text() + extra)
        shutil.copy(__file__, self._etc / "vm_agent.py")
        self._write_config()

    def _own_hosts_line(self) -> str:
        """Its own name at its VPC address, first (it wins over this machine's lines for its own name).

        On Compute Engine the guest environment writes ``IP NAME.ZONE.c.PROJECT.internal NAME  # Added by Google``
        into /etc/hosts, the instance's internal DNS name being its host name
        (cloud.google.com/compute/docs/instances/custom-hostname-vm, cloud.google.com/compute/docs/internal-dns).
        Programs that bind or announce "this host's address" (gloo in JAX's CPU collectives) then get the VM's
        internal IP, not a loopback one as this machine's name has."""
        names = f"{self.name}.{self.domain} {self.name}" if self.domain else self.name
        return f"{self.address} {names}  # Added by Google\n"

    def _write_config(self) -> None:
        env = {name: os.environ[name] for name in _VM_ENV if name in os.environ}
        env.update(self.environment)
        if self.package_cache is not None:
            env["UV_CACHE_DIR"] = f"/var/tmp/{VM_UV_CACHE}"
        settings = [
            ("ListenAddress", f"{self.address}:{self.port}"),
            *(("HostKey", f"{VM_SSH_DIR}/ssh_host_{name}_key") for name in HOST_KEY_TYPES),
            ("PidFile", "none"),  # /run is the image's, shared by every VM
            # Only the instance's ssh-keys metadata (or, with OS Login, the login's OS Login keys), checked at
            # each login (keys expire); sshd requires the
            # command to be root-owned in root-owned, not group/world-writable directories: /usr/bin/python3.
            ("AuthorizedKeysFile", "none"),
            (
                "AuthorizedKeysCommand",
                _OSLOGIN_KEYS_COMMAND.format(url=self.oslogin_url) if self.oslogin_url else _KEYS_COMMAND,
            ),
            ("AuthorizedKeysCommandUser", "nobody"),
            ("PermitRootLogin", "no"),
            ("PasswordAuthentication", "no"),
            ("KbdInteractiveAuthentication", "no"),
            ("UsePAM", "no"),
            # Tests open many connections at once; the defaults (10:30:100, 10) would drop some.
            ("MaxStartups", "50:30:100"),
            ("MaxSessions", "50"),
            ("Subsystem", "sftp internal-sftp"),
            ("LogLevel", "ERROR"),
            ("SetEnv", " ".join(f'{name}="{value}"' for name, value in env.items())),
        ]
        (self._etc / "sshd_config").write_text("".join(f"{key} {value}\n" for key, value in settings))

    def _mounts(self) -> list[list[str]]:
        """The init's mount commands.

        Paths to keep (shared, the compilation cache, pyenv) that a private dir would hide are bound into its disk
        copy at the same relative path, then carried by ``--rbind``."""
        disk = self.disk_dir.resolve()
        mounts = [
            ["mount", "--bind", str(disk / "etc"), VM_SSH_DIR],
            ["mount", "--bind", "-o", "ro", str(disk / "hosts"), "/etc/hosts"],
        ]
        keep = [(path, "rw") for path in (*self.shared_paths, *filter(None, [self.compile_cache]))]
        keep += [(path, "ro") for path in self.image_paths if path.exists()]
        if PYENV_ROOT.is_dir():
            keep.append((PYENV_ROOT, "ro"))
        for path, mode in keep:
            private = next((dir_ for dir_ in PRIVATE_DIRS if path.is_relative_to(dir_)), None)
            if private is not None:
                target = disk / PRIVATE_DIRS[private] / path.relative_to(private)
                target.mkdir(parents=True, exist_ok=True)
                mounts.append(["mount", "--bind", "-o", mode, str(path), str(target)])
        # The private dir that holds the disk goes last: binding over it hides the disk's other dirs.
        for private in sorted(PRIVATE_DIRS, key=disk.is_relative_to):
            mounts.append(["mount", "--rbind", str(disk / PRIVATE_DIRS[private]), private])
        mounts.append(["mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", "/dev/shm"])
        return mounts

    def _start(self) -> bool:
        """Start ``unshare`` and learn its mount namespace; False if destroy() came first."""
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        # The init's set-up: its host name (in its own UTS namespace), then its mounts.
        (self._etc / "mounts.json").write_text(json.dumps([["hostname", self.name], *self._mounts()]))
        from airflow_tpu_posttrain.local import vpc

        vpc.connect_vm(self.address, self.egress, self.metadata_port)
        argv = [
            "nsenter", f"--net=/run/netns/{vpc.namespace_of(self.address)}",
            "unshare", "--mount", "--pid", "--uts", "--fork", "--propagation", "private", "--mount-proc",
            IMAGE_PYTHON, "-I", str(self._etc / "vm_agent.py"), "init", str(self._etc / "mounts.json"),
            SSHD, "-D", "-e", "-f", f"{VM_SSH_DIR}/sshd_config",
        ]  # fmt: skip
        host_ns = os.readlink("/proc/self/ns/mnt")
        with self._lock:  # destroy() must see either no process or its namespace
            if self._destroying.is_set():
                return False
            with self.console_path.open("wb") as console:
                self._process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=console,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while self._process.poll() is None and time.monotonic() < deadline:
                # Never the host's namespace: destroy() kills every process in this one.
                try:
                    mount_ns = os.readlink(f"/proc/{self._process.pid}/ns/mnt")
                except OSError:  # exited: poll() tells
                    continue
                if mount_ns != host_ns:
                    self._mount_ns = mount_ns
                    return True
                time.sleep(0.001)
            exit_code = self._process.poll()
            state = f"exited with {exit_code}" if exit_code is not None else f"no new namespace in {START_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"unshare did not start ({state}): {self.console_path.read_text().strip()}")

    def _wait_until_listening(self) -> bool:
        """True once sshd answers; False if destroy() came first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        process = self._process
        while not self._destroying.is_set():
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise RuntimeError(f"VM {self.name} stopped (exit {code}): {self.console_path.read_text().strip()}")
            # Read the banner too: a connection alone could reach another server.
            try:
                with socket.create_connection((self.address, self.port), timeout=1) as conn:
                    if conn.recv(4).startswith(b"SSH-"):
                        return True
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"VM {self.name}: no sshd: {self.console_path.read_text().strip()}")
            time.sleep(0.02)
        return False


def _main(argv: list[str]) -> int:
    if argv[0] == "init":
        return _init(json.loads(Path(argv[1]).read_text()), argv[2:])
    if argv[0] == "keys":
        lines = Path(argv[1]).read_text().splitlines()
        print("\n".join(authorized_keys(lines, argv[2], datetime.now(UTC))))
        return 0
    if argv[0] == "oslogin-keys":
        print("\n".join(oslogin_keys(argv[1], argv[2], datetime.now(UTC))))
        return 0
    raise SystemExit(
        "usage: vm_agent.py init SETUP_JSON_FILE SSHD_ARGV... | keys KEYS_FILE USER | oslogin-keys URL USER"
    )


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
