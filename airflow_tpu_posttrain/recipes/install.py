"""The script that installs MaxText on the VM: the tutorials' steps, made idempotent.

A marker file in the venv records what was installed (runtime, packages, version). When it matches, the
script prints that it reuses the environment and exits 0 in well under a second; otherwise it (re)runs every
step, each of which is safe to repeat, and writes the marker last, so an interrupted install is completed by
the next run.
"""

from __future__ import annotations

import shlex

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.runtime import Runtime
from airflow_tpu_posttrain.recipes.shell import remote_path

MARKER_NAME = ".airflow-tpu-posttrain-install"
# google-tunix 0.1.7 pins safetensors<0.8 while maxtext[tpu] 0.2.5 needs >=0.8; both work with 0.8.
CPU_OVERRIDES = ("safetensors>=0.8.0",)
CPU_TUNIX = "google-tunix==0.1.7"


def _tpu_steps(runtime: Runtime, maxtext: str) -> list[str]:
    """The tutorials' install, unattended: apt may not prompt, uv is installed only when missing."""
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt"
    return [
        f"{apt} update && {apt} upgrade -y --fix-missing",
        f"{apt} install -y build-essential cmake ninja-build",
        'export PATH="$HOME/.local/bin:$PATH"',
        "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh",
        f"uv python install {shlex.quote(runtime.base_python)}",
        f'[[ -x "$venv/bin/python" ]] || uv venv --python {shlex.quote(runtime.base_python)} --seed "$venv"',
        'source "$venv/bin/activate"',
        f"UV_TORCH_BACKEND=cpu uv pip install {shlex.quote(maxtext)} --resolution=lowest",
        "install_tpu_post_train_extra_deps",
    ]


def _cpu_steps(runtime: Runtime, maxtext: str) -> list[str]:
    """maxtext[tpu-post-train] cannot install without PyTorch's index and GitHub (maxtext-on-cpu.md);
    maxtext[tpu] plus tunix is what runs the four steps on a CPU."""
    return [
        f'[[ -x "$venv/bin/python" ]] || uv venv --python {shlex.quote(runtime.base_python)} "$venv"',
        f'printf "%s\\n" {shlex.join(CPU_OVERRIDES)} >"$venv/overrides.txt"',
        f'uv pip install --python "$venv/bin/python" --overrides "$venv/overrides.txt" '
        f"{shlex.quote(maxtext)} {shlex.quote(CPU_TUNIX)}",
    ]


def install_script(runtime: Runtime, maxtext_version: str) -> str:
    """The install script for ``runtime.venv``; ``maxtext_version`` is usually the model profile's."""
    version = validation.package_version("maxtext_version", maxtext_version)
    extra = "tpu" if runtime.is_cpu else "tpu-post-train"
    maxtext = f"maxtext[{extra}]=={version}"
    wanted = [f"runtime={runtime.name}", maxtext]
    if runtime.is_cpu:
        wanted += [CPU_TUNIX, *(f"override:{o}" for o in CPU_OVERRIDES)]
    steps = _cpu_steps(runtime, maxtext) if runtime.is_cpu else _tpu_steps(runtime, maxtext)
    return (
        "\n".join(
            [
                "#!/usr/bin/env bash",
                "set -euo pipefail",
                f"venv={remote_path(runtime.venv)}",
                f'marker="$venv"/{MARKER_NAME}',
                f"wanted={shlex.quote(chr(10).join(wanted))}",
                'if [[ -f "$marker" && "$(<"$marker")" == "$wanted" ]]; then',
                "  echo \"Reusing the MaxText environment in $venv (installed: ${wanted//$'\\n'/, })\"",
                "  exit 0",
                "fi",
                f'echo {shlex.quote("Installing " + " ".join(wanted[1:]) + " into")} "$venv"',
                *steps,
                'printf "%s\\n" "$wanted" >"$marker"',
                "echo \"Installed MaxText in $venv (${wanted//$'\\n'/, })\"",
            ]
        )
        + "\n"
    )
