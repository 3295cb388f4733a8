"""The MaxText commands of the tutorials, as typed values that render to inert bash scripts.

With a seed's inputs each builder returns the tutorial's command, arguments in the tutorial's order; what the
pipeline adds (dataset files, checkpoint period, model shape, runtime adaptations, user overrides) follows.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from airflow_tpu_posttrain.recipes import storage, validation
from airflow_tpu_posttrain.recipes.accelerators import (
    CPU_CONVERSION_ARGS,
    CPU_JAX_ENV,
    Accelerator,
    slice_worker_env,
    tpu_env,
)
from airflow_tpu_posttrain.recipes.layout import RunLayout
from airflow_tpu_posttrain.recipes.lora import LoraSettings
from airflow_tpu_posttrain.recipes.models import ModelProfile, RlDataset, SftDataset
from airflow_tpu_posttrain.recipes.runtime import Runtime, Step
from airflow_tpu_posttrain.recipes.shell import EnvValue, export_line, remote_path
from airflow_tpu_posttrain.recipes.validation import SpecError

# The tutorials save SFT checkpoints only at step 1 and at the last step (MaxText's default period is
# 10,000), so a retried run would restart from scratch. Every 200 steps, a retry of the 1,000-step seed
# (~10 min on a v6e-8) loses at most ~2 minutes. Checkpoints live in /dev/shm, i.e. RAM: about 50 GB each for
# Gemma 3 4B with its float32 optimizer state; on a smaller host pass a larger period, or override
# max_num_checkpoints_to_keep.
DEFAULT_SFT_CHECKPOINT_PERIOD = 200
PROFILERS = ("xplane", "nsys", "")
# What the trainers read of the base model's Hub repo besides the converted weights: tokenizer, chat template and
# configs (train_rl also hands its tokenizer_path to vLLM as the model). Fetched with the token before training;
# the trainer itself runs without the token, because MaxText's pyconfig copies HF_TOKEN into hf_access_token and
# add_config_to_summary_writer writes every config key, that one included, to TensorBoard in checkpoint storage.
BASE_MODEL_FILES = ("*.json", "*.model", "*.jinja", "*.txt", "*.tiktoken")
# Each argument: one snapshot_download's keyword arguments, as JSON.
_FETCH_FILES = (
    "import json, sys; from huggingface_hub import snapshot_download\n"
    "for fetch in sys.argv[1:]: snapshot_download(**json.loads(fetch))"
)


@dataclass(frozen=True)
class RemoteCommand:
    argv: tuple[str, ...]
    env: Mapping[str, EnvValue] = field(default_factory=dict)
    venv: str | None = None  # activated before running, as in the tutorials

    def script(self) -> str:
        """A bash script that runs ``argv`` with ``env``; every value is a single quoted shell word."""
        lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
        if self.venv is not None:
            lines.append(f"source {remote_path(f'{self.venv}/bin/activate')}")
        lines += [export_line(name, value) for name, value in self.env.items()]
        lines.append(f"exec {shlex.join(self.argv)}")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SliceWorker:
    """One VM of a multi-host slice as the program on it sees the slice: its worker id, every worker's address."""

    worker_id: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class RunSpec:
    """What every step of one DAG run shares: which model, on what, where MaxText runs, where files go.

    ``worker``: on a multi-host slice, the VM a training command is for (each VM runs the same program)."""

    model: ModelProfile
    accelerator: Accelerator
    runtime: Runtime
    layout: RunLayout
    worker: SliceWorker | None = None

    def __post_init__(self) -> None:
        self.runtime.check_model(self.model)
        if self.layout.model_key != self.model.key:
            raise SpecError(
                "model",
                self.layout.model_key,
                f"differs from the profile's {self.model.key!r}",
                "build the layout from the same model",
            )


def _command(
    spec: RunSpec,
    step: Step,
    seed_args: Mapping[str, str],
    *,
    training: bool,
    overrides: Sequence[str] = (),
    lora: bool = False,
) -> RemoteCommand:
    """``seed_args`` (the tutorial's, in order), then the model's shape and the runtime's adaptations.

    These replace a seed value in place where they share a key. Then the user's overrides, which may not touch
    any key set before them."""
    multi_process = training and spec.accelerator.is_multi_host
    args = {
        **seed_args,
        **spec.model.maxtext_overrides,
        **spec.runtime.step_args(step, spec.model, multi_process=multi_process, lora=lora),
    }
    for pair in validation.override_pairs("overrides", overrides, reserved=frozenset(args)):
        key, value = pair.split("=", 1)
        args[key] = value
    if training:
        spec.runtime.check_accelerator(spec.accelerator)
    if multi_process:
        if spec.worker is None:
            raise SpecError(
                "accelerator_type", spec.accelerator.type, "is a multi-host slice; its training runs on every VM",
                "build the command for each VM of the slice (RunSpec.worker)",
            )
        cpu = spec.runtime.is_cpu
        env = {**slice_worker_env(spec.accelerator, spec.worker.worker_id, spec.worker.addresses, cpu=cpu)}
        env.update(spec.runtime.env)
    elif training or (step is Step.TO_HUGGINGFACE and spec.accelerator.is_tpu):
        # The export on the TPU VM (seeds layout) runs in the tutorial's shell, which still holds the
        # training's TPU environment: without it JAX would ask the metadata server what the TPU is.
        env = {**tpu_env(spec.accelerator), **spec.runtime.env}
    else:  # the conversion on the host CPU (as in the tutorials), or any step on a CPU VM
        env = {**({} if spec.accelerator.is_tpu else CPU_JAX_ENV), **spec.runtime.env}
    argv = spec.runtime.entry_point(step) + tuple(f"{key}={value}" for key, value in args.items())
    return RemoteCommand(argv=argv, env=env, venv=spec.runtime.venv)


def fetch_run_files(
    spec: RunSpec, *, model_revision: str | None = None, dataset: str, dataset_revision: str | None = None
) -> str:
    """The shell line that copies what the trainer reads from the Hub onto the VM, at the run's revisions.

    The base model's ``BASE_MODEL_FILES`` into ``layout.base_model_files_dir``, and the whole ``dataset`` repo into
    ``layout.dataset_dir``: MaxText's input pipelines take no revision, so they read that copy. A revision of
    None is the repo's main. Run with ``HF_TOKEN`` set, before the trainer, which gets no token (and reads a
    gated dataset from the copy)."""
    python = remote_path(f"{spec.runtime.venv}/bin/python")
    fetches = [
        {
            "repo_id": spec.model.hf_source,
            "revision": validation.hub_revision("revision", model_revision) if model_revision else None,
            "local_dir": spec.layout.base_model_files_dir,
            "allow_patterns": list(BASE_MODEL_FILES),
        },
        {
            "repo_id": validation.hf_repo_id("dataset", dataset),
            "repo_type": "dataset",
            "revision": validation.hub_revision("dataset_revision", dataset_revision) if dataset_revision else None,
            "local_dir": spec.layout.dataset_dir,
        },
    ]
    arguments = [json.dumps(fetch, separators=(",", ":")) for fetch in fetches]
    return f"{python} -c {shlex.quote(_FETCH_FILES)} {shlex.join(arguments)}"


def _checkpoint(path: str, field: str = "converted_params") -> str:
    """A checkpoint MaxText loads: a path on the VM or in ``gs://`` storage."""
    return storage.checkpoint_uri(field, path)


def _count(field: str, value: int | None, default: int) -> str:
    return str(validation.positive_int(field, default if value is None else value))


def to_maxtext(
    spec: RunSpec, *, use_pathways: bool = False, lazy_load_tensors: bool = False, revision: str | None = None
) -> RemoteCommand:
    """Converts the Hugging Face checkpoint to MaxText's format, into ``layout.converted_dir``.

    Deviation from the tutorials: no ``hf_access_token=$HF_TOKEN`` argument, which would put the token in the
    process list. MaxText reads ``HF_TOKEN`` from the environment when the argument is absent, so the job
    wrapper exports it (from a 0600 file) instead.

    ``revision``: the Hub commit to convert (``--revision``, which to_maxtext takes at 0.2.2 and 0.2.3), so
    a conversion cached under a revision holds that revision's weights, not whatever ``main`` became since.
    """
    storage_flag = str(1 - int(use_pathways))  # the tutorials' $((1 - USE_PATHWAYS))
    args = {
        "model_name": spec.model.maxtext_model_name,
        "base_output_directory": spec.layout.converted_dir,
        "scan_layers": "True",
        "use_multimodal": "False",
        **CPU_CONVERSION_ARGS,
        "checkpoint_storage_use_zarr3": storage_flag,
        "checkpoint_storage_use_ocdbt": storage_flag,
        "--lazy_load_tensors": str(lazy_load_tensors),
    }
    if revision is not None:
        args["--revision"] = validation.hub_revision("revision", revision)
    return _command(spec, Step.TO_MAXTEXT, args, training=False)


def train_sft(
    spec: RunSpec,
    *,
    steps: int | None = None,
    per_device_batch_size: int = 1,
    dataset: SftDataset | None = None,
    checkpoint_period: int = DEFAULT_SFT_CHECKPOINT_PERIOD,
    profiler: str = "xplane",
    overrides: Sequence[str] = (),
    converted_params: str | None = None,
    evaluate: bool = False,
    lora: LoraSettings | None = None,
) -> RemoteCommand:
    """Supervised fine-tuning from the converted checkpoint (default: ``layout.converted_params``).

    Deviations from the tutorial: ``tokenizer_path`` is the VM's copy of the base model's files, and
    ``hf_path`` the VM's copy of the dataset at the run's revision (:func:`fetch_run_files`), so the trainer needs
    no token and reads the revision the run recorded. Steps and dataset default to the model's.
    ``evaluate``: MaxText evaluates on the dataset's held-out rows
    (``eval_steps`` batches) before the first step and after the last (``eval_interval`` = the steps), for the
    quality gate; the tutorial does not."""
    data = dataset or spec.model.sft_dataset
    args = {
        "run_name": spec.layout.run_name,
        "base_output_directory": spec.layout.post_train_dir,
        "model_name": spec.model.maxtext_model_name,
        "load_parameters_path": _checkpoint(converted_params or spec.layout.converted_params),
        "per_device_batch_size": str(validation.positive_int("per_device_batch_size", per_device_batch_size)),
        "steps": _count("steps", steps, spec.model.sft_steps),
        "hf_path": spec.layout.dataset_dir,
        "train_split": data.train_split,
        "train_data_columns": data.train_data_columns,
    }
    # No profiler: the key is left out (MaxText's default is none). ``profiler=`` on the command line reaches
    # MaxText 0.2.5 as None, which its config refuses ("Input should be '', 'xplane' or 'nsys'").
    if validation.one_of("profiler", profiler, PROFILERS):
        args["profiler"] = profiler
    if evaluate:
        args["eval_interval"] = args["steps"]
        args["eval_steps"] = str(data.eval_steps)
        if data.eval_split is not None:
            args["hf_eval_split"] = data.eval_split
    args["checkpoint_period"] = str(validation.positive_int("checkpoint_period", checkpoint_period))
    args["tokenizer_path"] = spec.layout.base_model_files_dir
    if lora is not None:
        args.update(lora.train_args())
    return _command(spec, Step.TRAIN_SFT, args, training=True, overrides=overrides, lora=lora is not None)


def train_rl(
    spec: RunSpec,
    *,
    num_batches: int | None = None,
    num_test_batches: int | None = None,
    dataset: RlDataset | None = None,
    overrides: Sequence[str] = (),
    converted_params: str | None = None,
) -> RemoteCommand:
    """GRPO from the converted checkpoint (default: ``layout.converted_params``).

    The batch counts and dataset default to the model's. Deviations from the tutorial: ``tokenizer_path``, as for
    :func:`train_sft`, and ``hf_train_files`` / ``hf_eval_files``: the dataset's files in the VM's copy of it
    at the run's revision (the recipe would read GSM8K's main from the Hub)."""
    data = dataset or spec.model.rl_dataset
    args = {
        "model_name": spec.model.maxtext_model_name,
        "load_parameters_path": _checkpoint(converted_params or spec.layout.converted_params),
        "run_name": spec.layout.run_name,
        "base_output_directory": spec.layout.post_train_dir,
        "chips_per_vm": str(spec.accelerator.chips_per_vm),
        "num_batches": _count("num_batches", num_batches, spec.model.rl_num_batches),
        "num_test_batches": _count("num_test_batches", num_test_batches, spec.model.rl_num_test_batches),
        "rollout_data_parallelism": "1",
        "rollout_tensor_parallelism": "-1",  # -1: inferred from the rollout's chips
    }
    args["hf_train_files"] = f"{spec.layout.dataset_dir}/{data.train_files}"
    args["hf_eval_files"] = f"{spec.layout.dataset_dir}/{data.eval_files}"
    args["tokenizer_path"] = spec.layout.base_model_files_dir
    return _command(spec, Step.TRAIN_RL, args, training=True, overrides=overrides)


def to_huggingface(spec: RunSpec, trained_params: str, lora: LoraSettings | None = None) -> RemoteCommand:
    """Exports trained parameters to ``layout.export_dir`` in Hugging Face format.

    The parameters are ``layout.sft_params(...)`` or ``layout.rl_params(...)``. ``model_name`` is the trained
    model's: it picks the Hub repo to_huggingface takes the tokenizer and chat template from (MaxText's
    ``HF_IDS``), so the GRPO export of ``llama3.1-8b-Instruct`` gets the Instruct tokenizer (the RL tutorial's
    ``llama3.1-8b`` would fetch the base model's, from another gated repo).

    On a CPU VM (the split layout) it runs as MaxText's ``convert_checkpoint.md`` runs conversions on a CPU:
    with ``hardware=cpu skip_jax_distributed_system=true``. Without them MaxText's pyconfig calls a bare
    ``jax.distributed.initialize()`` (0.2.2 ``pyconfig.py`` → ``max_utils.py``), which off a TPU raises
    ``coordinator_address should be defined``.

    ``lora``: the parameters are a LoRA run's adapters, exported as the LoRA tutorial does: a PEFT adapter
    (``adapter_model.safetensors``, ``adapter_config.json``) from ``lora.lora_restore_path`` alone, with the
    training's rank and scale again; no base weights are read or written."""
    if lora is not None:
        args = {
            "model_name": spec.model.maxtext_model_name,
            **lora.export_args(_checkpoint(trained_params, "trained_params")),
            "base_output_directory": spec.layout.export_dir,
            "scan_layers": "True",
            "use_multimodal": "False",
        }
        if not spec.accelerator.is_tpu:
            args.update(CPU_CONVERSION_ARGS)
        return _command(spec, Step.TO_HUGGINGFACE, args, training=False, lora=True)
    args = {
        "model_name": spec.model.maxtext_model_name,
        "load_parameters_path": _checkpoint(trained_params, "trained_params"),
        "base_output_directory": spec.layout.export_dir,
        "scan_layers": "True",
        "use_multimodal": "False",
        "weight_dtype": "bfloat16",
    }
    if not spec.accelerator.is_tpu:
        args.update(CPU_CONVERSION_ARGS)
    return _command(spec, Step.TO_HUGGINGFACE, args, training=False)
