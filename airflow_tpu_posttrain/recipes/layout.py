"""Where a run's files live: the tutorials' /dev/shm layout on one VM, or checkpoint storage shared by VMs.

Every path derives from (model, run name, root, storage, conversion key), so any task of a DAG run, or a retry
of one, computes the same paths without asking the VM. Training output is per run.

- Seeds' layout (``storage`` empty): everything under ``root`` on the TPU VM, as in the tutorials; the
  converted checkpoint is per model, so a later run on the same machine may reuse it.
- Split layout (``storage`` set, ``gs://`` or a shared directory): the converted checkpoint lives in a
  conversion cache keyed by what determines it (:func:`conversion_key`), training checkpoints next to it, so a
  conversion made on a CPU VM is read by the TPU VM, a retried training on a new VM resumes, and later runs
  (scheduled retraining, backfills) convert once. Only the export stays on the exporting VM's ``root``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from airflow_tpu_posttrain.recipes import storage as checkpoint_storage
from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.validation import SpecError

RUN_NAME_MAX_LEN = 64
_DAG_SLUG_MAX_LEN = 32
_HASH_LEN = 10


@dataclass(frozen=True)
class RunLayout:
    model_key: str
    run_name: str
    root: str = ""  # default: /dev/shm/<model_key>, as in the tutorials
    storage: str = ""  # checkpoint storage (split layout); empty: the seeds' layout, all under root
    conversion_key: str = ""  # split layout: which cached conversion (see conversion_key())

    def __post_init__(self) -> None:
        validation.safe_name("model", self.model_key)
        validation.safe_name("run_name", self.run_name, max_len=RUN_NAME_MAX_LEN)
        root = validation.safe_absolute_path("root", self.root or f"/dev/shm/{self.model_key}")
        object.__setattr__(self, "root", root)  # normalised (no trailing '/'), so paths join cleanly
        if self.storage:
            object.__setattr__(
                self, "storage", checkpoint_storage.checkpoint_uri("checkpoint_storage", self.storage)
            )
        if self.conversion_key:
            validation.safe_name("conversion_key", self.conversion_key)

    @property
    def converted_dir(self) -> str:
        """to_maxtext's output (the tutorials' MODEL_CHECKPOINT_DIRECTORY), or its place in the cache."""
        if not self.storage:
            return f"{self.root}/mt-format"
        if not self.conversion_key:
            raise SpecError(
                "conversion_key", "", "is needed to find a conversion in storage", "pass conversion_key()"
            )
        return f"{self.storage}/conversions/{self.model_key}/{self.conversion_key}"

    @property
    def converted_params(self) -> str:
        """The converted parameters the trainers load (MAXTEXT_CKPT_PATH)."""
        return f"{self.converted_dir}/0/items"

    @property
    def post_train_dir(self) -> str:
        """The trainers' base_output_directory (BASE_OUTPUT_DIRECTORY); a run writes ``<it>/<run_name>``."""
        return f"{self.storage or self.root}/post-train"

    @property
    def checkpoints_dir(self) -> str:
        return f"{self.post_train_dir}/{self.run_name}/checkpoints"

    def sft_params(self, step: int) -> str:
        """The SFT parameters saved at ``step`` (the SFT tutorial's POST_TRAIN_PATH with step = STEPS)."""
        return f"{self.checkpoints_dir}/{validation.positive_int('steps', step)}/model_params"

    def rl_params(self, step: int) -> str:
        """The GRPO policy saved at ``step`` (the RL tutorial's POST_TRAIN_PATH with step = NUM_BATCHES)."""
        return f"{self.checkpoints_dir}/actor/{validation.positive_int('num_batches', step)}/model_params"

    @property
    def kept_export_dir(self) -> str | None:
        """Where the validated export is kept in checkpoint storage (split layout).

        Marked complete by ``<dir>.complete``: it outlives the VM, so a failed publish loses nothing and a
        retry or a re-run publishes it without exporting again."""
        return f"{self.storage}/exports/{self.run_name}" if self.storage else None

    @property
    def base_model_files_dir(self) -> str:
        """The training VM's copy of the base model's tokenizer and configs (the trainers' ``tokenizer_path``)."""
        return f"{self.root}/base-model-files"

    @property
    def dataset_dir(self) -> str:
        """The training VM's copy of the dataset repo at the run's revision (what the trainer reads)."""
        return f"{self.root}/dataset"

    @property
    def export_dir(self) -> str:
        """to_huggingface's output (HF_EXPORT), one per run so runs sharing a root never mix exports."""
        return f"{self.root}/hf-trained/{self.run_name}"


def conversion_key(maxtext_version: str, source_revision: str, options: Sequence[str]) -> str:
    """``mt<version>-<digest>``: names a converted checkpoint by everything that determines it.

    That is the MaxText release, the source weights' revision (its Hub commit) and the conversion's arguments
    (model name, layer scan, storage format, ...; the output path excluded)."""
    version = validation.package_version("maxtext_version", maxtext_version)
    blob = json.dumps([version, source_revision, list(options)], separators=(",", ":"))
    return f"mt{version}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def run_name(dag_id: str, run_id: str, logical_date: datetime | None = None, deployment: str = "") -> str:
    """A MaxText run name for one DAG run: ``<dag>[-<logical date, UTC>]-<hash of deployment, dag_id and run_id>``.

    Deterministic, so a retried task resumes the same run directory; the hash keeps different runs apart even
    when the DAG id is cut short or two runs share a logical date, and the same run of two Airflow deployments
    sharing checkpoint storage (staging and production on one schedule) apart: every path of a run, its done
    markers, export and Hub branch derive from this name. The date is written as the tutorials'
    ``$(date +%Y-%m-%d-%H-%M-%S)`` run names, so a backfill's runs are readable; a naive date is taken
    as UTC. At most 64 characters.
    """
    for field, value in (("dag_id", dag_id), ("run_id", run_id)):
        if not isinstance(value, str) or not value:
            raise SpecError(field, value, "must be a non-empty string", "pass the DAG run's own value")
    slug = re.sub(r"[^a-z0-9]+", "-", dag_id.lower())[:_DAG_SLUG_MAX_LEN].strip("-") or "run"
    parts = [slug]
    if logical_date is not None:
        utc = logical_date.astimezone(UTC) if logical_date.tzinfo else logical_date
        parts.append(utc.strftime("%Y-%m-%d-%H-%M-%S"))
    key = f"{deployment}\0{dag_id}\0{run_id}" if deployment else f"{dag_id}\0{run_id}"
    parts.append(hashlib.sha256(key.encode()).hexdigest()[:_HASH_LEN])
    return "-".join(parts)
