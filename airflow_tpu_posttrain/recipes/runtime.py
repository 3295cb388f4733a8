"""Where MaxText runs: the tutorials' TPU VM, or this machine's CPU. The ONE place for local-only adaptations.

The ``tpu`` runtime changes nothing: commands are the tutorials'. The ``cpu`` runtime runs the same four steps
on a tiny local model (maxtext-on-cpu.md): JAX on the CPU, MaxText's CPU settings, the model read from its
repo on the local Hub (MaxText's table of Hub ids names the real models only), short sequences, and three steps
started through launcher scripts (kept in ``local/``) that take exactly the wrapped module's argv and patch what
cannot run on a CPU.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.accelerators import CPU_CONVERSION_ARGS, CPU_JAX_ENV, Accelerator
from airflow_tpu_posttrain.recipes.models import ModelProfile
from airflow_tpu_posttrain.recipes.validation import SpecError

DEFAULT_TPU_VENV = "maxtext_venv"  # the tutorials' name, relative to the SSH user's home
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
# attention=dot_product: MaxText 0.2.3's autoselect picks a GPU kernel on a CPU; safe on 0.2.5 too.
_CPU_ARGS: Mapping[str, str] = MappingProxyType({**CPU_CONVERSION_ARGS, "attention": "dot_product"})


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
        """The cpu runtime runs the local tiny model only (a real model does not fit a CPU's time or memory)."""
        if self.is_cpu and not model.is_local:
            raise SpecError(
                "model", model.key, "is not the local model; the cpu runtime runs it only", "use 'tiny-llama'"
            )

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """Training needs the runtime's accelerator: a TPU on ``tpu``, the CPU on ``cpu``.

        Conversions run on any host's CPU, so they may run on a CPU VM with the ``tpu`` runtime's
        environment."""
        if accelerator.is_tpu == self.is_cpu:
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

    def step_args(self, step: Step, model: ModelProfile) -> dict[str, str]:
        """Arguments set on top of the tutorial's, replacing the tutorial's value where both set a key."""
        if not self.is_cpu:
            return {}
        repo = model.hf_source
        per_step = {
            # False (the tutorials') loads through torch, which the CPU environment does not have.
            Step.TO_MAXTEXT: {"--hf_model_path": repo, "--lazy_load_tensors": "True"},
            Step.TRAIN_SFT: {"max_target_length": "128"},
            Step.TRAIN_RL: {
                "max_prefill_predict_length": "128",
                "max_target_length": "160",
                "use_pathways": "false",
            },
            # The tiny model's dims differ from the named model's Hub config.
            Step.TO_HUGGINGFACE: {"--override_model_architecture": "true", "--hf_model_path": repo},
        }
        return {**_CPU_ARGS, **per_step[step]}


def tpu_runtime(venv: str = DEFAULT_TPU_VENV) -> Runtime:
    return Runtime(name="tpu", venv=venv, base_python="3.12")


def cpu_runtime(launcher_dir: str, venv: str, base_python: str = "python3.12") -> Runtime:
    """``base_python``: an interpreter path where uv may not download one (e.g. a pyenv install's binary)."""
    return Runtime(name="cpu", venv=venv, base_python=base_python, launcher_dir=launcher_dir)
