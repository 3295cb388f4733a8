"""The script that installs MaxText on the VM: the tutorials' steps, made idempotent and cached.

A marker file in the venv records what was installed (runtime, packages, version). When it matches, the
script prints that it reuses the environment and exits 0 in well under a second; otherwise it (re)runs every
step, each of which is safe to repeat, and writes the marker last, so an interrupted install is completed by
the next run.

With an environment cache (a ``gs://`` prefix or a directory, in checkpoint storage) a new VM restores the
environment from an archive keyed by what the marker records instead of installing it (a minute instead of
the tutorials' install), and the VM told to ``save`` it uploads the archive after a fresh install. Only venvs
under ``$HOME`` (the tutorials' ``maxtext_venv``) are cached, with uv's interpreters, which they link to. A
``gs://`` cache is read and written through ``vm_scripts/gcs_tool.py`` (google-cloud-storage).
"""

from __future__ import annotations

import hashlib
import shlex

from airflow_tpu_posttrain.recipes import storage, validation
from airflow_tpu_posttrain.recipes.runtime import Runtime
from airflow_tpu_posttrain.recipes.shell import remote_path

MARKER_NAME = ".airflow-tpu-posttrain-install"
# google-tunix 0.1.7 pins safetensors<0.8 while maxtext[tpu] 0.2.5 needs >=0.8; both work with 0.8.
# jax 0.12.1 (December 2026) removed jax.experimental.pallas.ops.gpu.attention, which MaxText 0.2.2 to 0.2.5 import
# at start-up, and their requirements leave jax unbounded. (The TPU install resolves the lowest versions, as the
# tutorials do, and is not affected.)
CPU_OVERRIDES = ("safetensors>=0.8.0", "jax<0.12.1", "jaxlib<0.12.1")
CPU_TUNIX = "google-tunix==0.1.7"
_GCS_CLIENT = "google-cloud-storage>=2.18"  # what gcs_tool.py needs before MaxText's venv exists
_ENSURE_UV = "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh"


def _tpu_steps(runtime: Runtime, maxtext: str) -> list[str]:
    """The tutorials' install, unattended: apt may not prompt, uv is installed only when missing."""
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt"
    return [
        f"{apt} update && {apt} upgrade -y --fix-missing",
        f"{apt} install -y build-essential cmake ninja-build",
        'export PATH="$HOME/.local/bin:$PATH"',
        _ENSURE_UV,
        f"uv python install {shlex.quote(runtime.base_python)}",
        f'[[ -x "$venv/bin/python" ]] || uv venv --python {shlex.quote(runtime.base_python)} --seed "$venv"',
        'source "$venv/bin/activate"',
        f"UV_TORCH_BACKEND=cpu uv pip install {shlex.quote(maxtext)} --resolution=lowest",
        "install_tpu_post_train_extra_deps",
    ]


def _cpu_steps(runtime: Runtime, maxtext: str) -> list[str]:
    """The packages that run the four steps on a CPU: maxtext[tpu] plus tunix.

    maxtext[tpu-post-train] cannot install without PyTorch's index and GitHub (maxtext-on-cpu.md)."""
    return [
        f'[[ -x "$venv/bin/python" ]] || uv venv --python {shlex.quote(runtime.base_python)} "$venv"',
        f'printf "%s\\n" {shlex.join(CPU_OVERRIDES)} >"$venv/overrides.txt"',
        f'uv pip install --python "$venv/bin/python" --overrides "$venv/overrides.txt" '
        f"{shlex.quote(maxtext)} {shlex.quote(CPU_TUNIX)}",
    ]


def restore_tool(script: str) -> storage.GcsTool:
    """The storage tool before MaxText's venv exists: google-cloud-storage in a uv-made environment.

    uv's cache keeps it for the next use; the install needs uv and the package index anyway. Not
    ``gcloud storage``: the Google Cloud CLI is not on every image (nor installable from PyPI or Debian), and
    one client for every storage step is one behaviour to test."""
    return storage.GcsTool(
        script=script, launcher=f"uv run --no-project --quiet --with {shlex.quote(_GCS_CLIENT)} python"
    )


def _restore_lines(archive: str, tool_script: str | None) -> list[str]:
    ensure_uv: list[str] = []
    tool = None
    if storage.is_gcs(archive):
        if not tool_script:
            raise ValueError("a gs:// environment cache needs the storage tool's path on the VM")
        tool = restore_tool(tool_script)
        ensure_uv = ['export PATH="$HOME/.local/bin:$PATH"', _ENSURE_UV]
    return [
        *ensure_uv,
        f"if {storage.exists_command(archive, tool)}; then",
        f"  echo {shlex.quote('Restoring the MaxText environment from ' + archive)}",
        f'  {storage.read_command(archive, tool)} | tar -xz -C "$HOME" || echo "Restoring failed; installing instead"',
        '  if [[ -f "$marker" && "$(<"$marker")" == "$wanted" ]]; then',
        '    echo "Restored the MaxText environment in $venv"',
        "    exit 0",
        "  fi",
        "fi",
    ]


def _save_lines(archive: str, venv: str, tool_script: str | None) -> list[str]:
    members = f'{shlex.quote(venv)} $(cd "$HOME" && ls -d .local/share/uv/python 2>/dev/null || true)'
    tar = f'tar -cz -C "$HOME" {members}'
    tool = None
    if storage.is_gcs(archive):
        if not tool_script:
            raise ValueError("a gs:// environment cache needs the storage tool's path on the VM")
        # After the install: the venv's python has google-cloud-storage (a MaxText dependency).
        tool = storage.GcsTool(script=tool_script, python=f"{venv}/bin/python")
    # An upload finalizes whatever the stream held at its end, a tar that failed midway included: the archive is
    # written under a temporary name and moved into place only when tar succeeded (pipefail).
    partial = archive + ".partial"
    save = f"{tar} | {storage.write_command(partial, tool)} && {storage.move_command(partial, archive, tool)}"
    return [
        f"echo {shlex.quote('Saving the MaxText environment to ' + archive)}",
        f"{{ {save}; }} || echo 'Could not save the environment archive; the next VM installs again'",
    ]


def _wanted(runtime: Runtime, maxtext_version: str) -> tuple[str, list[str]]:
    """The MaxText requirement, and what the venv's marker records of an install of it."""
    version = validation.package_version("maxtext_version", maxtext_version)
    extra = "tpu" if runtime.is_cpu else "tpu-post-train"
    maxtext = f"maxtext[{extra}]=={version}"
    wanted = [f"runtime={runtime.name}", maxtext]
    if runtime.is_cpu:
        wanted += [CPU_TUNIX, *(f"override:{o}" for o in CPU_OVERRIDES)]
    return maxtext, wanted


def _reuse_lines(runtime: Runtime, wanted: list[str]) -> list[str]:
    """Exit 0, saying so, when the venv's marker records this install."""
    return [
        f"venv={remote_path(runtime.venv)}",
        f'marker="$venv"/{MARKER_NAME}',
        f"wanted={shlex.quote(chr(10).join(wanted))}",
        'if [[ -f "$marker" && "$(<"$marker")" == "$wanted" ]]; then',
        "  echo \"Reusing the MaxText environment in $venv (installed: ${wanted//$'\\n'/, })\"",
        "  exit 0",
        "fi",
    ]


def installed_check(runtime: Runtime, maxtext_version: str) -> str:
    """A command that exits 0 (saying so) when ``runtime.venv`` holds this install already, 1 otherwise.

    The install task asks it before starting a job: a re-run or retry on a VM that has MaxText ends without a
    deferral, and a fresh VM's install defers at once instead of holding the worker while it waits."""
    _, wanted = _wanted(runtime, maxtext_version)
    return f"bash -c {shlex.quote(chr(10).join([*_reuse_lines(runtime, wanted), 'exit 1']))}"


def install_script(
    runtime: Runtime,
    maxtext_version: str,
    cache_uri: str | None = None,
    save: bool = False,
    storage_tool_script: str | None = None,
) -> str:
    """The install script for ``runtime.venv``; ``maxtext_version`` is usually the model profile's.

    ``cache_uri``: where environment archives are kept (restored from before installing); ``save``: upload the
    archive after a fresh install (one VM of a run does, so two do not upload the same archive);
    ``storage_tool_script``: where ``vm_scripts/gcs_tool.py`` is on the VM (a ``gs://`` cache).
    """
    maxtext, wanted = _wanted(runtime, maxtext_version)
    steps = _cpu_steps(runtime, maxtext) if runtime.is_cpu else _tpu_steps(runtime, maxtext)
    archive = None
    if cache_uri and not runtime.venv.startswith("/"):
        key = hashlib.sha256("\n".join([runtime.base_python, *wanted]).encode()).hexdigest()[:16]
        archive = f"{storage.checkpoint_uri('environment cache', cache_uri)}/maxtext-env-{runtime.name}-{key}.tar.gz"
    return (
        "\n".join(
            [
                "#!/usr/bin/env bash",
                "set -euo pipefail",
                *_reuse_lines(runtime, wanted),
                *(_restore_lines(archive, storage_tool_script) if archive else []),
                f'echo {shlex.quote("Installing " + " ".join(wanted[1:]) + " into")} "$venv"',
                *steps,
                'printf "%s\\n" "$wanted" >"$marker"',
                "echo \"Installed MaxText in $venv (${wanted//$'\\n'/, })\"",
                *(_save_lines(archive, runtime.venv, storage_tool_script) if archive and save else []),
            ]
        )
        + "\n"
    )
