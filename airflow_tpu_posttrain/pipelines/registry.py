"""The model registry (``dags/models.yaml``): one :class:`PipelineConfig` per (recipe, model) entry.

Kept apart from the DAG factory so a DAG file that only needs the registry (the reaper) stays cheap to parse.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from airflow_tpu_posttrain.recipes import cost
from airflow_tpu_posttrain.recipes import quality_gate as gate
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR
from airflow_tpu_posttrain.recipes.models import model_profile
from airflow_tpu_posttrain.recipes.validation import SpecError

START_DATE = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class StepTimeouts:
    """Execution timeouts per step; the VM's cloud-side deadline derives from them.

    A run has no run-level timeout: when ``dagrun_timeout`` fires, Airflow marks every unfinished task SKIPPED,
    the teardowns included. Each step is bounded by its timeout and its retries, so the run is too."""

    create: timedelta = timedelta(hours=1)  # FLEX_START can wait for capacity
    install: timedelta = timedelta(minutes=45)
    convert: timedelta = timedelta(hours=1)
    train: timedelta = timedelta(hours=8)
    export: timedelta = timedelta(hours=1)
    delete: timedelta = timedelta(minutes=30)

    def vm_lifetime(self, retries: int, max_retry_delay: timedelta) -> timedelta:
        """The longest a run's VM may live, its ``maxRunDuration``: Google's deadline never ends a live try.

        Its create, every step at every try with the waits between tries, and its delete."""
        steps = (self.install, self.convert, self.train, self.export)
        return (
            self.create
            + sum(steps, timedelta()) * (retries + 1)
            + max_retry_delay * retries * len(steps)
            + self.delete
        )


LOCAL_TIMEOUTS = StepTimeouts(
    create=timedelta(minutes=5),
    install=timedelta(minutes=20),
    convert=timedelta(minutes=15),
    train=timedelta(minutes=30),
    export=timedelta(minutes=15),
    delete=timedelta(minutes=5),
)


LAYOUTS = ("split", "seeds")


@dataclass(frozen=True)
class PipelineConfig:
    """One registry entry: which model, which recipe, where it runs, and the trigger form's defaults.

    ``layout``: ``split`` converts and exports on a CPU VM (``cpu_accelerator_type``) while the TPU VM is
    created and installed, passes checkpoints through ``checkpoint_storage`` and deletes the TPU VM as soon as
    the final checkpoint is there; ``seeds`` runs every step on the TPU VM, as the tutorials do (DAG id suffix
    ``__seeds``).
    """

    model: str
    recipe: str
    layout: str = "split"
    checkpoint_storage: str | None = None
    cpu_accelerator_type: str = "cpu-highmem-16"
    # A cron expression or preset, None (manual runs only), or "on_change": a run when the Hub shows a new revision
    # of the base model or the dataset (pipelines/inputs.py), looked at every watch_interval_s seconds.
    schedule: str | None = None
    watch_interval_s: int = 600
    project_id: str | None = None
    zones: tuple[str, ...] = ("us-east5-b",)
    accelerator_type: str = DEFAULT_ACCELERATOR
    provisioning_model: str = "RESERVATION_BOUND"
    reservation: str | None = None
    network: str = "default"
    subnetwork: str | None = None
    network_path: str = "external"
    ssh_source_ranges: tuple[str, ...] = ()
    ssh_key_mode: str = "metadata"
    oslogin_user: str | None = None
    service_account: str = "default"
    # How many of the pipelines' TPU VMs may live at once per capacity group (the reservation, else the zones),
    # counted from Compute across DAGs; None: no cap. The wait for a place: the trigger form's default.
    max_tpu_vms: int | None = 1
    max_wait_for_capacity_minutes: int = 60
    maxtext_version: str | None = None
    dataset: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    train_data_columns: str | None = None
    steps: int | None = None
    num_batches: int | None = None
    num_test_batches: int | None = None
    hub_repo_id: str | None = None
    storage_uri: str | None = None
    overrides: tuple[str, ...] = ()
    gcp_conn_id: str = "google_cloud_default"
    ssh_conn_id: str = "tpu_vm_ssh"
    hf_conn_id: str = "hf_default"
    retries: int = 2
    retry_delay_s: int = 60  # the first retry's delay (then exponential backoff, at most 20 minutes)
    poll_interval_s: int | None = None  # between the triggers' polls; None: each step's own (10 to 30 s)
    checkpoint_period: int = 200  # SFT steps between checkpoints: what a retry or a recovery may repeat
    # A training silent this long is taken for hung and stopped, failing the try (a retry resumes): longer than
    # its quietest healthy stretch (compiling, a checkpoint save), far shorter than the step's timeout. Training
    # only: the install's environment upload and a large conversion are legitimately silent for long, and a
    # hang there costs the step's timeout on a CPU VM, not a TPU VM's.
    stall_timeout_s: int = 1800
    # Whether a trained model is published (recipes/quality_gate.py): the trigger form's defaults.
    quality_gate: str = gate.DEFAULT_RULE
    min_improvement_pct: float = gate.DEFAULT_MIN_IMPROVEMENT_PCT
    timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    local: dict[str, str] | None = None  # cpu runtime settings for the local CPU "VM" (see local_settings)
    tags: tuple[str, ...] = ()
    # USD per hour by machine type and provisioning model: recipes/cost.py's defaults with the registry's
    # top-level ``prices:`` laid over them (what the teardown and the reaper say each VM cost).
    prices: Mapping[str, Mapping[str, float]] = field(default_factory=cost.price_table)

    def __post_init__(self) -> None:
        try:
            model_profile(self.model)  # refused when the DAG file is parsed, not after its VMs are made
        except SpecError as err:
            raise ValueError(f"{self.model}: {err}") from err
        if self.quality_gate not in gate.RULES:
            raise ValueError(f"{self.model}: quality_gate={self.quality_gate!r}: use one of {gate.RULES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"{self.model}: layout={self.layout!r}: use one of {LAYOUTS}")
        if self.layout == "split" and not self.checkpoint_storage:
            raise ValueError(
                f"{self.model}: checkpoint_storage is required by the split layout: set it to a gs://bucket/prefix "
                "the VMs may write (or use layout: seeds)"
            )

    @property
    def dag_id(self) -> str:
        suffix = "__seeds" if self.layout == "seeds" else ""
        return f"posttrain_{self.recipe}__{self.model}{suffix}"


# The local runs' checkpoint storage: a bucket of the local GCS server (local/gcs_server.py), which each local
# stack starts on a port of its own and names to its VMs (STORAGE_EMULATOR_HOST...), as a VM on Google Cloud
# reaches storage.googleapis.com with its service account.
LOCAL_BUCKET = "local-posttrain"
LOCAL_CHECKPOINT_STORAGE = f"gs://{LOCAL_BUCKET}/airflow-tpu-posttrain"

# The local VMs' MaxText venv: on each VM's own disk, installed there from the package cache (an absolute path
# keeps it out of the environment archive, which for a CPU venv would cost more than installing it).
LOCAL_VENV = "/var/tmp/maxtext-venv"


# Where the local stack puts the cpu runtime's launcher scripts, under its local directory.
LOCAL_LAUNCHERS = "vm-launchers"


def local_settings(local_dir: str, python312: str) -> dict[str, str]:
    """How the local CPU "VM" differs from a TPU VM.

    The CPU runtime, its venv, the tiny model's directory, its launcher scripts. The jobs' files go where
    production puts them (``/tmp``, ``/dev/shm``), on each VM's own disk."""
    return {
        "runtime": "cpu",
        "maxtext_venv": LOCAL_VENV,
        "base_python": python312,
        "model_source_dir": f"{local_dir}/tiny",
        "launcher_source_dir": f"{local_dir}/{LOCAL_LAUNCHERS}",
    }


def load_registry(path: str | Path, local: bool | None = None) -> list[PipelineConfig]:
    """Read ``models.yaml``: ``defaults`` merged into each of ``pipelines``.

    ``local: true`` entries only when ``TPU_POSTTRAIN_LOCAL_DIR`` is set (the local CPU run;
    ``TPU_POSTTRAIN_VM_DIR`` is the "VM"'s disk). ``local``: only the local (True) or only the Google Cloud
    (False) entries; None: all."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    defaults = data.get("defaults", {})
    try:
        prices = cost.price_table(data.get("prices"))
    except SpecError as err:
        raise ValueError(f"{path}: {err}") from err
    local_dir = os.environ.get("TPU_POSTTRAIN_LOCAL_DIR")
    configs = []
    for entry in data["pipelines"]:
        merged: dict[str, Any] = {**defaults, **entry}
        is_local = merged.pop("local", False)
        if local is not None and is_local != local:
            continue
        if is_local:
            if not local_dir:
                continue
            merged.update(
                local=local_settings(local_dir, os.environ.get("TPU_POSTTRAIN_PYTHON312", "python3.12")),
                timeouts=LOCAL_TIMEOUTS,
                checkpoint_storage=LOCAL_CHECKPOINT_STORAGE,  # the local GCS server's bucket
                cpu_accelerator_type="cpu",
                # The local run's pace: steps of a second, so tighter polls, retries and checkpoints.
                retry_delay_s=5,
                poll_interval_s=2,
                checkpoint_period=2,
                stall_timeout_s=180,
                watch_interval_s=2,
            )
        for key in ("zones", "overrides", "tags", "ssh_source_ranges"):
            if key in merged:
                merged[key] = tuple(merged[key])
        configs.append(PipelineConfig(**merged, prices=prices))
    return configs
