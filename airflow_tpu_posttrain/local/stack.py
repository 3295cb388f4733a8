"""The local stand-ins, together: the Compute emulator (Google Cloud), an sshd on 127.0.0.1 (the TPU VM), the
Hub server (huggingface.co), the MaxText CPU venv and the tiny model (the VM's software and the HF checkpoint).

``LocalStack(local_dir).start()`` returns the environment (Airflow connections, ``TPU_POSTTRAIN_LOCAL_DIR``)
under which the DAGs of models.yaml marked ``local: true`` run end to end. The VM's disk (``vm_dir``, default
``<local_dir>/vm``) starts empty each time, as a new VM's does; the venv and the tiny model in ``local_dir`` are
kept, as a VM image would be. Stacks with different ``vm_dir`` can run side by side.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
from airflow_tpu_posttrain.local.hub_server import HubServer
from airflow_tpu_posttrain.local.sshd import LocalSshd
from airflow_tpu_posttrain.recipes.install import install_script
from airflow_tpu_posttrain.recipes.models import model_profile
from airflow_tpu_posttrain.recipes.runtime import cpu_runtime

LOCAL_PROJECT = "local-project"
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")


def find_python312() -> str:
    """An interpreter uv can build the venv from without downloading one (pyenv's shims may not resolve)."""
    candidates = [os.environ.get("TPU_POSTTRAIN_PYTHON312", ""), shutil.which("python3.12") or ""]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
            capture_output=True,
            text=True,
        )
        if probe.stdout.strip() == "True":
            return candidate
    raise RuntimeError(
        "Python 3.12 not found: install it (e.g. pyenv install 3.12) or set TPU_POSTTRAIN_PYTHON312"
    )


def prepare_vm_image(local_dir: Path, python312: str) -> None:
    """The MaxText venv (the same idempotent script the install step runs) and the tiny model and data."""
    venv = local_dir / "maxtext-venv"
    runtime = cpu_runtime(str(local_dir / "vm" / "work" / "launchers"), str(venv), python312)
    script = install_script(runtime, model_profile("tiny-llama").maxtext_version)
    subprocess.run(["bash", "-c", script], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), str(TINY_MODEL_SCRIPT), "--out", str(local_dir / "tiny")],
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "TRANSFORMERS_VERBOSITY": "error"},
    )


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
        self.python312 = find_python312()
        self.compute = ComputeEmulator(operation_seconds=operation_seconds)
        self.sshd = LocalSshd(self.vm_dir / "sshd")
        self.hub = HubServer(self.vm_dir / "hub", tokens=[self.hf_token])

    def start(self) -> dict[str, str]:
        prepare_vm_image(self.local_dir, self.python312)
        for stale in ("work", "runs", "hub"):
            shutil.rmtree(self.vm_dir / stale, ignore_errors=True)
        (self.vm_dir / "hub").mkdir(parents=True)
        self.compute.start()
        self.sshd.start()
        self.hub.start()
        return self.environment()

    def stop(self) -> None:
        for part in (self.hub, self.sshd, self.compute):
            part.stop()

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        compute = {
            "conn_type": "google_cloud_platform",
            "extra": {
                "is_anonymous": True,
                "project": LOCAL_PROJECT,
                "compute_api_endpoint": self.compute.url,
            },
        }
        hub = {"conn_type": "generic", "host": self.hub.url, "password": self.hf_token}
        return {
            "AIRFLOW_CONN_LOCAL_COMPUTE": json.dumps(compute),
            "AIRFLOW_CONN_LOCAL_VM": json.dumps(self.sshd.airflow_connection(verify_host_key=True)),
            "AIRFLOW_CONN_LOCAL_HUB": json.dumps(hub),
            "TPU_POSTTRAIN_LOCAL_DIR": str(self.local_dir),
            "TPU_POSTTRAIN_VM_DIR": str(self.vm_dir),
            "TPU_POSTTRAIN_PYTHON312": self.python312,
        }


def main() -> None:
    """``python -m airflow_tpu_posttrain.local.stack prepare [DIR]``: build the VM image (venv + tiny model)."""
    local_dir = Path(sys.argv[2] if len(sys.argv) > 2 else ".local")
    if sys.argv[1:2] != ["prepare"]:
        raise SystemExit("usage: python -m airflow_tpu_posttrain.local.stack prepare [DIR]")
    prepare_vm_image(local_dir.absolute(), find_python312())


if __name__ == "__main__":
    main()
