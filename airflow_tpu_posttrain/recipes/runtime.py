"""Where MaxText runs: the tutorials' TPU VM, or this machine's CPU. The ONE place for local-only adaptations.

The ``tpu`` runtime changes nothing: commands are the tutorials'. The ``cpu`` runtime runs the same four steps
on a tiny local model (maxtext-on-cpu.md): a local twin of a cloud model runs the cloud entry's commands, on its
MaxText release, from its Hub repo id (served by the local Hub), differing by ``LOCAL_DIFFERENCES`` only: JAX on
the CPU, MaxText's CPU settings, short sequences, and three steps started through launcher scripts (kept in
``local/``) that take exactly the wrapped module's argv and patch what cannot run on a CPU.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.accelerators import CPU_CONVERSION_ARGS, CPU_JAX_ENV, Accelerator
from airflow_tpu_posttrain.recipes.models import ModelProfile, twin_key
from airflow_tpu_posttrain.recipes.validation import SpecError

DEFAULT_TPU_VENV = "maxtext_venv"  # the tutorials' name, relative to the SSH user's home

# The local stack's environment (local/stack.py sets it for Airflow's processes, which also parse the local DAGs
# only when it is set): the directory of its tiny models, their data and the CPU launchers, and the Python its
# CPU "VMs" build MaxText's venv from. A local model runs on the cpu runtime, a cloud model on the tpu runtime:
# nothing of the local run is an operator's argument.
LOCAL_DIR_VARIABLE = "TPU_POSTTRAIN_LOCAL_DIR"
LOCAL_PYTHON_VARIABLE = "TPU_POSTTRAIN_PYTHON312"
LOCAL_LAUNCHERS = "vm-launchers"  # the launchers' folder under the local stack's directory
LOCAL_MODELS = "tiny"  # the tiny models' and their data's folder under it
# The local stack's torch venv (local/setup_hfcheck.sh), under its directory: the local VMs' MaxText venv (maxtext[tpu])
# has no torch, where a Google Cloud VM's (maxtext[tpu-post-train]) has torch, transformers and PEFT.
LOCAL_TORCH_VENV = "hfcheck-venv"
# The local VMs' MaxText venv: on each VM's own disk, installed there from the package cache (an absolute path
# keeps it out of the environment archive, which for a CPU venv would cost more than installing it).
LOCAL_VENV = "/var/tmp/maxtext-venv"


def local_stack_dir() -> str | None:
    """The local stack's directory, from its environment; None outside the local stack."""
    return os.environ.get(LOCAL_DIR_VARIABLE) or None


def local_python() -> str:
    """The interpreter the local CPU "VM" builds MaxText's venv from."""
    return os.environ.get(LOCAL_PYTHON_VARIABLE) or "python3.12"
_PYTHON = "python3"  # the venv's interpreter once the venv is activated, as in the tutorials


class Step(enum.Enum):
    """A MaxText step, by the module the tutorials run."""

    TO_MAXTEXT = "maxtext.checkpoint_conversion.to_maxtext"
    TRAIN_SFT = "maxtext.trainers.post_train.sft.train_sft"
    TRAIN_RL = "maxtext.trainers.post_train.rl.train_rl"
    TO_HUGGINGFACE = "maxtext.checkpoint_conversion.to_huggingface"


# Launchers for the steps that do not run unmodified on a CPU; SFT does.
_CPU_LAUNCHERS: Mapping[Step, str] = MappingProxyType(
    {
        Step.TO_MAXTEXT: "to_maxtext_cpu.py",  # reads the local model's config instead of MaxText's table
        Step.TRAIN_RL: "train_rl_cpu.py",  # replaces the vLLM (TPU-only) rollout engine
        Step.TO_HUGGINGFACE: "to_huggingface_cpu.py",  # writes the local model's config
    }
)
# What each step adds on a CPU, on top of the cloud command (the conversions already carry MaxText's CPU
# settings: they run on a CPU on Google Cloud too).
_CPU_STEP_ARGS: Mapping[Step, Mapping[str, str]] = MappingProxyType(
    {
        # False (the tutorials') loads through torch, which the CPU environment does not have.
        Step.TO_MAXTEXT: {"--lazy_load_tensors": "True"},
        # attention=dot_product: at short lengths MaxText 0.2.2's autoselect takes the flash kernel's branch.
        Step.TRAIN_SFT: {**CPU_CONVERSION_ARGS, "attention": "dot_product", "max_target_length": "128"},
        # rl.yml already sets skip_jax_distributed_system and dot_product attention (0.2.3 and 0.2.5).
        Step.TRAIN_RL: {"max_prefill_predict_length": "128", "max_target_length": "160"},
        Step.TO_HUGGINGFACE: {},
    }
)

# What a LoRA training adds on a CPU (LOCAL_DIFFERENCES says why).
_CPU_LORA_TRAINING_ARGS: Mapping[str, str] = MappingProxyType({"weight_dtype": "bfloat16"})

# The MaxText releases whose to_maxtext saves from one simulated CPU device; 0.2.5's fails to save then (orbax's
# NoEntryError for the TrainState, local/vm_launchers/README.md) and keeps to_maxtext's default of 16.
_ONE_CPU_DEVICE_RELEASES = frozenset({"0.2.2", "0.2.3"})


@dataclass(frozen=True)
class LocalDifference:
    """One way a local twin's command differs from its cloud entry's, and why."""

    item: str  # 'entry point', 'venv', 'env', or 'argv <key>'
    steps: frozenset[Step]
    reason: str


_ALL = frozenset(Step)
_TRAINING = frozenset({Step.TRAIN_SFT, Step.TRAIN_RL})


def _argv(keys: str, steps: frozenset[Step], reason: str) -> list[LocalDifference]:
    return [LocalDifference(f"argv {key}", steps, reason) for key in keys.split()]


# Every difference between the commands of a local twin (split layout, its "TPU" VM a CPU) and of its cloud entry;
# tests/test_twins.py renders both DAGs' commands and asserts they differ by exactly this list.
LOCAL_DIFFERENCES: tuple[LocalDifference, ...] = (
    *_argv(
        "override_model_config base_emb_dim base_num_query_heads base_num_kv_heads base_num_decoder_layers "
        "base_mlp_dim head_dim vocab_size",
        _ALL,
        "the tiny model's shape (recipes/models.TWIN_DIMS): the real one neither fits a CPU's memory nor its time",
    ),
    *_argv(
        "sliding_window_size",
        frozenset({Step.TO_MAXTEXT, Step.TRAIN_SFT, Step.TO_HUGGINGFACE}),
        "Gemma 3's local attention window (the SFT twin), shrunk with the model",
    ),
    *_argv("steps", frozenset({Step.TRAIN_SFT}), "a few steps on a CPU: enough to checkpoint, resume and evaluate"),
    *_argv(
        "eval_interval eval_steps",
        frozenset({Step.TRAIN_SFT}),
        "the quality gate's evaluations: after the last of the few steps, over the local held-out chats",
    ),
    *_argv(
        "checkpoint_period",
        frozenset({Step.TRAIN_SFT}),
        "a checkpoint every 2 of the 5 steps (the local entries' setting), so a retried try resumes from one",
    ),
    *_argv("chips_per_vm", frozenset({Step.TRAIN_RL}), "the CPU is one JAX device, a v6e-8 eight"),
    *_argv(
        "hardware skip_jax_distributed_system",
        frozenset({Step.TRAIN_SFT}),
        "the trainer runs on a CPU: without them MaxText's pyconfig calls jax.distributed.initialize(), which "
        "off a TPU raises 'coordinator_address should be defined' (the conversions carry them on Google Cloud too; "
        "rl.yml sets skip_jax_distributed_system itself)",
    ),
    *_argv(
        "attention",
        frozenset({Step.TRAIN_SFT}),
        "at 128 tokens MaxText 0.2.2's autoselect takes the flash kernel's branch, which a CPU has not (rl.yml "
        "sets dot_product itself)",
    ),
    *_argv(
        "max_target_length",
        _TRAINING,
        "short sequences for a CPU's time (the CPU sampler standing in for vLLM has no KV cache: at rl.yml's "
        "lengths a GRPO batch takes a minute)",
    ),
    *_argv("max_prefill_predict_length", frozenset({Step.TRAIN_RL}), "short prompts, as above"),
    *_argv(
        "weight_dtype",
        frozenset({Step.TRAIN_SFT}),
        "LoRA only: on the CPU, MaxText 0.2.5's LoRA (qwix) turns the float32 weights' scanned layers' bfloat16 "
        "carry into float32 and the scan fails ('carry input and carry output must have equal types'); bfloat16 "
        "weights keep one type. Google's LoRA tutorial runs on a TPU without it, and a TPU's run is not checked here",
    ),
    *_argv(
        "--simulated_cpu_devices_count",
        frozenset({Step.TO_MAXTEXT}),
        "one simulated CPU device instead of to_maxtext's 16: the tiny model's weights sharded 16 ways only cost a "
        "CPU time (the tiny Gemma 3's conversion: 90 s, 38.5 s with one); MaxText 0.2.2 and 0.2.3 only (0.2.5 "
        "fails to save with one)",
    ),
    *_argv(
        "--lazy_load_tensors",
        frozenset({Step.TO_MAXTEXT}),
        "the eager load goes through torch, which the CPU environment has not (maxtext[tpu-post-train] pins "
        "torch from PyTorch's own index, unreachable here)",
    ),
    LocalDifference(
        "entry point",
        frozenset(_CPU_LAUNCHERS),
        "launchers (local/vm_launchers/README.md) that run the MaxText module unchanged after a patch: the "
        "conversions read the tiny model's config where MaxText reads its table's, train_rl samples on the CPU "
        "where it would start vLLM on the TPU, and a LoRA adapter's export hands safetensors numpy arrays (the "
        "CPU venv's safetensors 0.8 refuses JAX arrays; the TPU install's 0.7.0 takes them)",
    ),
    LocalDifference(
        "venv",
        _ALL,
        "MaxText's CPU environment on the local VM's own disk (maxtext[tpu] and google-tunix, installed from "
        "the local package cache: the tutorials' tpu-post-train extra needs PyTorch's index and GitHub)",
    ),
    LocalDifference(
        "env", _TRAINING, "the accelerator is the CPU: JAX_PLATFORMS=cpu instead of the TPU slice's environment"
    ),
)


@dataclass(frozen=True)
class Runtime:
    name: str  # 'tpu' or 'cpu'
    venv: str  # MaxText's virtual environment; a relative path is under the remote $HOME
    base_python: str  # the interpreter `uv venv --python` is given
    launcher_dir: str | None = None  # cpu only: the directory holding the launcher scripts

    def __post_init__(self) -> None:
        validation.one_of("runtime", self.name, ("tpu", "cpu"))
        validation.safe_path("venv", self.venv)
        validation.safe_path("base_python", self.base_python)
        if self.is_cpu != (self.launcher_dir is not None):
            raise SpecError(
                "launcher_dir", self.launcher_dir, "is needed by the cpu runtime only", "use cpu_runtime()"
            )
        if self.launcher_dir is not None:
            validation.safe_absolute_path("launcher_dir", self.launcher_dir)

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def env(self) -> dict[str, str]:
        """Environment for every step (training steps add the accelerator's)."""
        return dict(CPU_JAX_ENV) if self.is_cpu else {}

    def check_model(self, model: ModelProfile) -> None:
        """The cpu runtime runs the local tiny models only (a real model does not fit a CPU's time or memory)."""
        if self.is_cpu and not model.is_local:
            raise SpecError(
                "model", model.key, "is not a local model; the cpu runtime runs those only",
                f"use its local twin {twin_key(model.key)!r}, or 'tiny-llama'",
            )

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """Training needs the runtime's accelerator: a TPU on ``tpu``, the CPU on ``cpu``.

        A multi-host slice trains on ``cpu`` too: the local slice, each of its VMs' CPUs one JAX process where a
        VM's chips would be. Conversions run on any host's CPU, so they may run on a CPU VM with the ``tpu``
        runtime's environment."""
        if accelerator.is_tpu == self.is_cpu and not (self.is_cpu and accelerator.is_multi_host):
            raise SpecError(
                "accelerator_type",
                accelerator.type,
                f"does not train on the {self.name} runtime",
                "use a TPU (v6e-*) on Google Cloud, 'cpu' locally",
            )

    def entry_point(self, step: Step) -> tuple[str, ...]:
        launcher = _CPU_LAUNCHERS.get(step) if self.is_cpu else None
        if launcher:
            return (_PYTHON, f"{self.launcher_dir}/{launcher}")
        return (_PYTHON, "-m", step.value)

    def step_args(
        self, step: Step, model: ModelProfile, *, multi_process: bool = False, lora: bool = False
    ) -> dict[str, str]:
        """Arguments set on top of the cloud command's, replacing its value where both set a key.

        ``multi_process``: the training of a multi-host slice, one JAX process per VM: MaxText's CPU path then
        joins the processes (``jax.distributed.initialize``), so it is not skipped. ``lora``: a LoRA run's step."""
        if not self.is_cpu:
            return {}
        args = dict(_CPU_STEP_ARGS[step])
        if lora and step is Step.TRAIN_SFT:
            args.update(_CPU_LORA_TRAINING_ARGS)
        if multi_process:
            args.pop("skip_jax_distributed_system", None)
        if step is Step.TO_MAXTEXT and model.maxtext_version in _ONE_CPU_DEVICE_RELEASES:
            args["--simulated_cpu_devices_count"] = "1"
        if not model.hf_source_in_maxtext_table and step in (Step.TO_MAXTEXT, Step.TO_HUGGINGFACE):
            # A model MaxText's table does not name (the fault tests' tiny-llama, MaxText 0.2.5): given by repo,
            # and the export's config written with the repo's dims.
            if step is Step.TO_HUGGINGFACE:
                args["--override_model_architecture"] = "true"
            args["--hf_model_path"] = model.hf_source
        return args


def tpu_runtime(venv: str = DEFAULT_TPU_VENV) -> Runtime:
    return Runtime(name="tpu", venv=venv, base_python="3.12")


def cpu_runtime(launcher_dir: str, venv: str, base_python: str = "python3.12") -> Runtime:
    """``base_python``: an interpreter path where uv may not download one (e.g. a pyenv install's binary)."""
    return Runtime(name="cpu", venv=venv, base_python=base_python, launcher_dir=launcher_dir)
