"""The local stand-ins, together: the Compute emulator, the Hub server and the tiny model.

The Compute emulator (Google Cloud) makes every instance a machine of its own (``fleet.py``: an address, an
sshd with fresh host keys, a disk); the Hub server stands for huggingface.co; the tiny model (the HF
checkpoint) is put on the Hub server at each start as a gated repo, so that the steps read it with the token
as they read Gemma or Llama on the real Hub.

``LocalStack(local_dir).start()`` returns the environment (Airflow connections, ``TPU_POSTTRAIN_LOCAL_DIR``)
under which the DAGs of models.yaml marked ``local: true`` run end to end. The SSH connection is made as README
tells a production user to make it: a login and a private key, no host and no host key (the VMs publish theirs).
Under ``vm_dir`` (default ``<local_dir>/vm``, emptied at each start): the instances' disks, the local GCS
server's objects (``gcs/``: the checkpoint storage ``gs://local-posttrain/...``, reached by the VMs through the
storage clients' endpoint settings), a directory every VM sees (for storage a user configures as a directory)
and the Hub's files. In ``local_dir``, kept: the tiny model
and the client key; the package cache the VMs install MaxText from (standing in for a package mirror) is this
machine's (``package_cache``).
Stacks with different ``vm_dir`` can run side by side.

A slice twin (a multi-host slice on CPU) is made in ``LOCAL_SLICE_ZONE`` on the reservation
``LOCAL_SLICE_RESERVATION``, its region networked as the local entries' is; the emulator makes each slice of
``LOCAL_SLICE_VMS`` local VMs, standing for the topology's VM count (a declared stand-in difference: CPU cost).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
from airflow_tpu_posttrain.local.fleet import LocalFleet
from airflow_tpu_posttrain.local.gcs_server import GcsServer, client_environment
from airflow_tpu_posttrain.local.hub_server import HubServer
from airflow_tpu_posttrain.local.iam import IAP_TUNNEL_USER, OS_ADMIN_LOGIN
from airflow_tpu_posttrain.local.iap_tunnel import ENDPOINT_VARIABLE as IAP_ENDPOINT_VARIABLE
from airflow_tpu_posttrain.local.tiny_model import CHATS_DIR, GSM8K_DIR
from airflow_tpu_posttrain.pipelines.registry import LOCAL_BUCKET
from airflow_tpu_posttrain.recipes.accelerators import ACCELERATORS, SLICE_MACHINE_TYPE
from airflow_tpu_posttrain.recipes.install import install_script
from airflow_tpu_posttrain.recipes.models import (
    LOCAL_HUB_SOURCES,
    MODELS,
    TINY_CHATS_REPO,
    TINY_GSM8K_REPO,
    model_profile,
)
from airflow_tpu_posttrain.recipes.runtime import (
    LOCAL_DIR_VARIABLE,
    LOCAL_LAUNCHERS,
    LOCAL_MODELS,
    LOCAL_PYTHON_VARIABLE,
    LOCAL_TORCH_VENV,
    cpu_runtime,
)

LOCAL_PROJECT = "local-project"
LOCAL_REGION = "local-cpu1"  # the region of the local entries' zones (dags/models.yaml)
# A slice twin's zone: a multi-host slice is ct6e-standard-4t VMs, which Compute (and its emulator) sells only in
# v6e zones; and the reservation its VMs are bound to (bulk mode takes reservation-bound or flex-start VMs only),
# which holds a whole v6e-16 (4 VMs) though the local slice makes LOCAL_SLICE_VMS of them.
LOCAL_SLICE_ZONE = "us-east5-b"
LOCAL_SLICE_REGION = LOCAL_SLICE_ZONE.rsplit("-", 1)[0]
LOCAL_SLICE_RESERVATION = "local-slice-reservation"
LOCAL_SLICE_RESERVATION_VMS = ACCELERATORS["v6e-16"].vms
# A local slice is this many local VMs standing for its topology's VM count (a declared stand-in difference: CPU cost).
LOCAL_SLICE_VMS = 2
# The service account the local runs call Google's APIs as (its key in the Google connection and gcloud's
# configuration), with the roles README's Google Cloud section grants.
LOCAL_RUNNER = f"posttrain-runner@{LOCAL_PROJECT}.iam.gserviceaccount.com"
LOCAL_RUNNER_ROLES = ("roles/compute.instanceAdmin.v1", OS_ADMIN_LOGIN, IAP_TUNNEL_USER)
LOCAL_LOGIN = "posttrain"  # the VMs' guest agent creates this account from the ssh-keys metadata
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


def find_python312() -> str:
    """An interpreter uv can build the venv from without downloading one (pyenv's shims may not resolve)."""
    candidates = [os.environ.get("TPU_POSTTRAIN_PYTHON312", ""), shutil.which("python3.12") or ""]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
            check=False,
            capture_output=True,
            text=True,
        )
        if probe.stdout.strip() == "True":
            return candidate
    raise RuntimeError(
        "Python 3.12 not found: install it (e.g. pyenv install 3.12) or set TPU_POSTTRAIN_PYTHON312"
    )


CLIENT_KEY = Path("ssh") / "id_ed25519"


def package_cache() -> Path:
    """Uv's cache the local VMs install from, standing in for a package mirror: one for this machine.

    In the user's cache directory, as uv's own cache is, not in the checkout: a fresh clone (CI's) installs the
    releases it names from it without downloading them again or compiling their bytecode again."""
    return _machine_cache_dir() / "vm-packages"


def _machine_cache_dir() -> Path:
    """The local stack's caches on this machine, in the user's cache directory (kept across clones)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-tpu-posttrain"


def compile_cache(cache_dir: Path | None = None) -> Path:
    """JAX's compilation cache of every local VM (each login's ``~/jax_cache``): one for this machine's CPU.

    A real VM starts with an empty one and compiles its first training step; the local VMs, all this machine,
    compile a program once. Beside the package mirror (``cache_dir`` unless given): a fresh clone (CI's) compiles
    none of what an earlier clone on this machine compiled (the SFT twin's training on a quiet machine: 224 s with
    an empty cache, 133 s with this one). Open to every login (sticky, as /tmp is): the VMs' logins differ."""
    cache = (cache_dir or _machine_cache_dir()) / "jax-cache"
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o1777)
    return cache


def compile_package_bytecode(cache: Path, python312: str) -> None:
    """Python's bytecode beside every module of the package cache's unpacked wheels, once per new package.

    uv links a wheel's whole unpacked directory into a venv, ``__pycache__`` included, so every local VM's MaxText
    venv starts with its modules compiled. A fresh VM on Google Cloud has none: its first MaxText process
    compiles what it imports (measured here: importing the SFT trainer took 54 s of CPU without bytecode, 18 s
    with), once per VM. Locally that was every run's VMs, the largest cost after training itself; it is a
    difference of speed only (docs/local-stand-ins.md). A stamp at the top of the cache records the compile, so
    the VMs share the cache again with it (``local/vm._share_mirror``)."""
    archives = cache / "archive-v0"
    stamp = cache / ".bytecode-compiled"
    if not archives.is_dir() or (stamp.exists() and stamp.stat().st_mtime_ns >= archives.stat().st_mtime_ns):
        return
    # Not a wheel's ``.data/`` (its scripts directory may hold no directory: uv refuses such a wheel). Not checked:
    # a few packages ship files that are not Python 3 (templates, test data); they stay uncompiled.
    compile_all = [python312, "-m", "compileall", "-q", "-q", "-j", "0", "-x", r"\.data/", str(archives)]
    subprocess.run(compile_all, check=False)
    stamp.write_text(f"{python312}\n")


def prepare_vm_image(local_dir: Path, python312: str) -> None:
    """A MaxText venv on this machine per release a local entry runs, and the cpu runtime's launcher scripts.

    Each venv is made by the same idempotent script the install step runs; installing it also fills the package
    cache the VMs install from (the twins' releases too: 0.2.2, 0.2.3). The tiny-llama release's venv builds the
    tiny models and data. The launcher scripts go under ``LOCAL_LAUNCHERS``, where the install step takes them from."""
    shutil.copytree(Path(__file__).with_name("vm_launchers"), local_dir / LOCAL_LAUNCHERS, dirs_exist_ok=True)
    cache = package_cache()
    venv = local_dir / "maxtext-venv"
    if not cache.exists():  # a venv from before the cache existed: built again, to fill the cache
        shutil.rmtree(venv, ignore_errors=True)
    tiny_release = model_profile("tiny-llama").maxtext_version
    twin_releases = sorted({profile.maxtext_version for profile in MODELS.values() if profile.twin_of} - {tiny_release})
    for release in (tiny_release, *twin_releases):
        release_venv = venv if release == tiny_release else local_dir / f"maxtext-venv-{release}"
        script = install_script(cpu_runtime(str(local_dir / "launchers"), str(release_venv), python312), release)
        subprocess.run(["bash", "-c", script], check=True, env={**os.environ, "UV_CACHE_DIR": str(cache)})
    compile_package_bytecode(cache, python312)
    subprocess.run(
        [str(venv / "bin" / "python"), str(TINY_MODEL_SCRIPT), "--out", str(local_dir / LOCAL_MODELS)],
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error"},
    )


def write_gcloud_stand_in(bin_dir: Path) -> Path:
    """``bin_dir/gcloud``: runs ``local/iap_tunnel.py``, which serves ``gcloud compute start-iap-tunnel`` only."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m airflow_tpu_posttrain.local.iap_tunnel "$@"\n'
    )
    gcloud.chmod(0o755)
    return gcloud


HUB_USER = "local"  # the local Hub's user whose tokens the pipelines hold
# When the tiny models and chats were uploaded to the local Hub: before every logical date the local runs and tests
# give, so that a run's inputs as of its date (check_inputs) are these.
SEEDED_AT = datetime(2025, 6, 1, tzinfo=UTC)


class LocalStack:
    """Start and stop the local pieces; ``hf_token`` is what the Hub server accepts (a secret in tests)."""

    def __init__(
        self,
        local_dir: Path,
        vm_dir: Path | None = None,
        hf_token: str | None = None,
        operation_seconds: float = 0.5,
    ) -> None:
        self.local_dir = Path(local_dir).absolute()
        self.vm_dir = Path(vm_dir or self.local_dir / "vm").absolute()
        self.hf_token = hf_token or secrets.token_hex(16)
        self.hf_read_only_token = secrets.token_hex(16)  # a user's mistake to reproduce: it cannot publish
        self.python312 = find_python312()
        self.client_key = self.local_dir / CLIENT_KEY
        self.fleet = LocalFleet(
            self.vm_dir / "instances",
            shared_paths=(self.storage_dir, self.published_dir),
            image_paths=(self.local_dir / LOCAL_TORCH_VENV,),  # the export's check runs it on the export's VM
            package_cache=package_cache(),
            compile_cache=compile_cache(),
        )
        self.compute = ComputeEmulator(
            operation_seconds=operation_seconds, fleet=self.fleet, local_slice_vms=LOCAL_SLICE_VMS
        )
        self.gcs = GcsServer(
            self.vm_dir / "gcs",
            buckets=(LOCAL_BUCKET,),
            project=LOCAL_PROJECT,
            tls_dir=self.local_dir / "google-storage-tls",
        )
        self.hub = HubServer(
            self.vm_dir / "hub",
            tokens=[self.hf_token],
            read_only_tokens=[self.hf_read_only_token],
            # The pipeline's user "local" publishes under its own name (the registry's local/... repos).
            namespaces={self.hf_token: [HUB_USER], self.hf_read_only_token: [HUB_USER]},
        )

    @property
    def storage_dir(self) -> Path:
        """A directory every local VM sees, for checkpoint storage a user configures as a directory.

        The local default is the local GCS server's bucket, ``LOCAL_CHECKPOINT_STORAGE``."""
        return self.vm_dir / "storage"

    @property
    def published_dir(self) -> Path:
        """Where runs publish a storage copy of their model (the ``storage_uri`` Param), seen by every VM."""
        return self.vm_dir / "published"

    def start(self) -> dict[str, str]:
        prepare_vm_image(self.local_dir, self.python312)
        for stale in ("instances", "storage", "published", "hub", "hub-seed", "gcs"):
            shutil.rmtree(self.vm_dir / stale, ignore_errors=True)
        for part in (self.storage_dir, self.published_dir, self.vm_dir / "hub"):
            part.mkdir(parents=True)
        for shared in (self.storage_dir, self.published_dir):
            # A bucket every VM's service account may write, whatever the login (metadata or OS Login) that
            # wrote before: the default ACL makes everything created below it writable by every login.
            shared.chmod(0o777)
            subprocess.run(["setfacl", "-d", "-m", "u::rwx,g::rwx,o::rwx", str(shared)], check=True)
        ensure_client_key(self.client_key)
        write_gcloud_stand_in(self.bin_dir)
        self.gcs.start()
        self.fleet.vm_environment = client_environment(self.gcs.url)
        self.fleet.vm_hosts, self.fleet.vm_ca_bundle = self.gcs.google_hosts, self.gcs.ca_bundle
        self.compute.start()
        self.google_key_file.write_text(
            json.dumps(self.compute.service_account_key(LOCAL_RUNNER, *LOCAL_RUNNER_ROLES, project=LOCAL_PROJECT))
        )
        self.google_key_file.chmod(0o600)
        # What README asks of a network whose VMs have no external IP (network_path internal or iap), done for the
        # local entries' region and the slice twins': Private Google Access on its subnetwork and a Cloud NAT.
        for region in (LOCAL_REGION, LOCAL_SLICE_REGION):
            self.compute.add_subnetwork("default", region, private_google_access=True)
            self.compute.add_router("posttrain-nat", region)
        self.compute.add_reservation(
            LOCAL_SLICE_RESERVATION, LOCAL_SLICE_ZONE, LOCAL_SLICE_RESERVATION_VMS, machine_type=SLICE_MACHINE_TYPE,
            project=LOCAL_PROJECT,
        )
        self.hub.start()
        # The tiny models, gated as Gemma and Llama are, each under the repo id its model reads: the twins' under
        # the tutorials' ids (MaxText's converters look those up by model name).
        for repo, source in LOCAL_HUB_SOURCES.items():
            self.hub.store.seed_repo(repo, self.local_dir / LOCAL_MODELS / source, gated="manual", date=SEEDED_AT)
            for token in (self.hf_token, self.hf_read_only_token):  # the pipeline's user asked and was granted
                self.hub.grant(token, repo)
        self.seed_tiny_chats(SEEDED_AT)
        self.hub.datasets.seed_repo(TINY_GSM8K_REPO, self.local_dir / LOCAL_MODELS / GSM8K_DIR, date=SEEDED_AT)
        return self.environment()

    def seed_tiny_chats(self, date: datetime | None = None) -> str:
        """The local models' SFT chats as their dataset repo on the local Hub (what SFT reads, ``on_change`` watches).

        Returns the new revision; seeding again is a new commit by their owner, dated ``date`` (default now)."""
        return self.hub.datasets.seed_repo(TINY_CHATS_REPO, self.local_dir / LOCAL_MODELS / CHATS_DIR, date=date)

    @property
    def google_key_file(self) -> Path:
        """The key file of ``LOCAL_RUNNER``, made at each start (the emulator knows the keys it made)."""
        return self.vm_dir / "google-key.json"

    @property
    def bin_dir(self) -> Path:
        """On the PATH of the local runs: ``gcloud``, standing in for ``gcloud compute start-iap-tunnel``."""
        return self.vm_dir / "bin"

    def stop(self) -> None:
        for part in (self.hub, self.compute, self.gcs):
            part.stop()

    def vms(self) -> list:
        """The machines of the live instances (:class:`~airflow_tpu_posttrain.local.vm.LocalVm`)."""
        return [vm for instance in self.compute.instances() if (vm := self.fleet.vm(_key(instance)))]

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        compute = {
            "conn_type": "google_cloud_platform",
            "extra": {
                "key_path": str(self.google_key_file),
                "project": LOCAL_PROJECT,
                "compute_api_endpoint": self.compute.url,
                "oslogin_api_endpoint": self.compute.url,  # the emulator also serves OS Login
            },
        }
        hub = {"conn_type": "tpu_posttrain_huggingface", "host": self.hub.url, "password": self.hf_token}
        # As README's "Running on Google Cloud" makes tpu_vm_ssh: a login and a key; no host, no host key.
        vm = {"conn_type": "ssh", "login": LOCAL_LOGIN, "extra": {"key_file": str(self.client_key)}}
        return {
            "AIRFLOW_CONN_LOCAL_COMPUTE": json.dumps(compute),
            "AIRFLOW_CONN_LOCAL_VM": json.dumps(vm),
            "AIRFLOW_CONN_LOCAL_HUB": json.dumps(hub),
            LOCAL_DIR_VARIABLE: str(self.local_dir),
            "TPU_POSTTRAIN_VM_DIR": str(self.vm_dir),
            LOCAL_PYTHON_VARIABLE: self.python312,
            # The iap network path's ProxyCommand: the stand-in gcloud, reading Compute where gcloud would.
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            # No gcloud account of its own: the pipeline runs the tunnel as the local_compute connection's.
            IAP_ENDPOINT_VARIABLE: f"{self.compute.url}/compute/v1/",
            # The worker's and the tests' storage clients (google-cloud-storage) reach the local GCS server.
            **client_environment(self.gcs.url),
        }


def _key(instance: dict) -> tuple[str, str, str]:
    """(project, zone, name) of an instance as the emulator lists it."""
    parts = instance["selfLink"].split("/")
    return parts[parts.index("projects") + 1], parts[parts.index("zones") + 1], instance["name"]


def ensure_client_key(key: Path) -> None:
    """The local SSH connection's key (ed25519), made once.

    ``stack prepare`` makes it before any test runs. Made aside and linked into place: of stacks started at
    once, one wins and moves its public half."""
    if key.exists():
        return
    key.parent.mkdir(parents=True, exist_ok=True)
    made = Path(tempfile.mkdtemp(dir=key.parent)) / "key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "airflow", "-f", str(made)], check=True
    )
    with contextlib.suppress(FileExistsError):
        os.link(made.with_suffix(".pub"), key.with_suffix(".pub"))
        os.link(made, key)
    shutil.rmtree(made.parent)


def main() -> None:
    """``python -m airflow_tpu_posttrain.local.stack prepare [DIR]``: build the VM image (venv + tiny model)."""
    local_dir = Path(sys.argv[2] if len(sys.argv) > 2 else ".local")
    if sys.argv[1:2] != ["prepare"]:
        raise SystemExit("usage: python -m airflow_tpu_posttrain.local.stack prepare [DIR]")
    prepare_vm_image(local_dir.absolute(), find_python312())
    ensure_client_key(local_dir.absolute() / CLIENT_KEY)


if __name__ == "__main__":
    main()
