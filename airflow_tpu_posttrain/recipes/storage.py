"""Checkpoint storage shared by the run's VMs: a ``gs://`` prefix, or a directory.

A ``gs://`` prefix on Google Cloud, and locally through the local GCS server; a directory when a user
configures one.

MaxText reads and writes ``gs://`` paths itself (orbax); what the pipeline adds are small marker files that
say an output is complete, the metric lines kept beside them, the kept export and the environment archive.
These helpers render the shell commands that test for, write, read and copy them on a VM. For ``gs://`` they run
``vm_scripts/gcs_tool.py`` (google-cloud-storage, the VM's own credentials) through a :class:`GcsTool`: the
same client MaxText's own storage code uses, so nothing depends on the Google Cloud CLI being on the image.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass

from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.shell import remote_path

GCS_TOOL_NAME = "gcs_tool.py"  # in airflow_tpu_posttrain/vm_scripts, copied to the VM
# gcs_tool.py's exit status for "no" (``exists``); anything else but 0 is an error (storage unreachable...).
EXISTS_NO = 1
CLAIM_HELD = 3  # gcs_tool.py's (and claim_command's) exit status for "another owner holds the claim"
ORBAX_COMMIT_MARKER = "commit_success.txt"  # orbax's "this step is complete" on storage without atomic rename


@dataclass(frozen=True)
class GcsTool:
    """How a VM runs ``gcs_tool.py``: ``python`` and ``script``, or ``launcher``.

    ``python`` is a path on the VM, relative ones under ``$HOME``: an interpreter with google-cloud-storage.
    ``script`` is where the tool was copied. ``launcher`` is a command line fragment that runs a python with
    google-cloud-storage, e.g. ``uv run --with ...``."""

    script: str
    python: str = ""
    launcher: str = ""

    def __post_init__(self) -> None:
        validation.safe_absolute_path("gcs_tool", self.script)
        if bool(self.python) == bool(self.launcher):
            raise ValueError("GcsTool: give python or launcher, not both")
        if self.python:
            validation.safe_path("gcs_tool python", self.python)

    def command(self, *args: str) -> str:
        runner = remote_path(self.python) if self.python else self.launcher
        return f"{runner} {shlex.quote(self.script)} {shlex.join(args)}"


def checkpoint_uri(field: str, value: str) -> str:
    """A ``gs://bucket/prefix`` or an absolute directory, normalised without a trailing '/'.

    ``file://`` is accepted and dropped: MaxText takes plain paths."""
    uri = validation.storage_uri(field, value)
    return uri.removeprefix("file://")


def is_gcs(uri: str) -> bool:
    return uri.startswith("gs://")


def _tool(uri: str, tool: GcsTool | None) -> GcsTool:
    if tool is None:
        raise ValueError(f"{uri}: gs:// storage needs the VM's storage tool (GcsTool)")
    return tool


def exists_command(uri: str, tool: GcsTool | None = None) -> str:
    """Exit status 0 when ``uri`` (an object, a prefix or a path) exists, ``EXISTS_NO`` when it does not.

    With ``gs://``, any other status when storage could not be asked (the error on stderr)."""
    if is_gcs(uri):
        return _tool(uri, tool).command("exists", uri)
    return f"test -e {shlex.quote(uri)}"


def write_command(uri: str, tool: GcsTool | None = None) -> str:
    """Write standard input to the file ``uri``; one command, so it can end a pipeline.

    Its parent directory is created when local."""
    if is_gcs(uri):
        return _tool(uri, tool).command("write", uri)
    return f"{{ mkdir -p {shlex.quote(posixpath.dirname(uri))} && cat > {shlex.quote(uri)}; }}"


def move_command(source: str, destination: str, tool: GcsTool | None = None) -> str:
    """Rename the file (object) ``source`` to ``destination``, both in the same storage."""
    if is_gcs(source) != is_gcs(destination):
        raise ValueError(f"a move stays in one storage: {source} -> {destination}")
    if is_gcs(source):
        return _tool(source, tool).command("move", source, destination)
    return f"mv {shlex.quote(source)} {shlex.quote(destination)}"


def read_command(uri: str, tool: GcsTool | None = None) -> str:
    """Print the file ``uri``."""
    if is_gcs(uri):
        return _tool(uri, tool).command("cat", uri)
    return f"cat {shlex.quote(uri)}"


def copy_tree_command(source: str, destination: str, tool: GcsTool | None = None) -> str:
    """Copy the contents of the directory ``source`` into ``destination`` (one of them may be ``gs://``)."""
    mkdir = "" if is_gcs(destination) else f"mkdir -p {shlex.quote(destination)} && "
    if is_gcs(source) or is_gcs(destination):
        return f"{mkdir}{_tool(source, tool).command('sync', source, destination)}"
    return f"{mkdir}cp -a {shlex.quote(source + '/.')} {shlex.quote(destination + '/')}"


def committed_checkpoint(params_uri: str) -> str:
    """What must exist for the orbax checkpoint item ``<step dir>/<item>`` to be complete.

    For example ``.../checkpoints/5/model_params``. In a directory orbax writes a step under a temporary name
    and renames it into place, so the item's path is enough. On GCS there is no rename: orbax writes the step
    in place and ``<step dir>/commit_success.txt`` last (orbax-checkpoint 0.12.8: a trainer SIGKILLed while
    saving step 4 left ``checkpoints/4/model_params/...`` without ``checkpoints/4/commit_success.txt``), so a
    half-written step already has objects under the item's prefix."""
    if is_gcs(params_uri):
        return f"{posixpath.dirname(params_uri)}/{ORBAX_COMMIT_MARKER}"
    return params_uri


def drop_uncommitted_command(checkpoints_uri: str, tool: GcsTool | None = None) -> str | None:
    """Delete the steps orbax never committed under a run's ``gs://`` checkpoint directory (``gcs_tool``).

    Run before a trainer resumes: a step half-written by a trainer killed while saving (see
    :func:`committed_checkpoint`) would stop it with ``FileExistsError`` when it saves that step again. None
    for a directory, where orbax renames a finished step into place and a half-written one has a temporary
    name."""
    if not is_gcs(checkpoints_uri):
        return None
    return _tool(checkpoints_uri, tool).command("drop-uncommitted", checkpoints_uri)


def metrics_uri(done_marker: str) -> str:
    """Where a step keeps its metric lines, next to its done marker.

    Kept there so that a re-run on a new VM (whose job log went with the old VM's disk) still reports what the
    finished step measured."""
    return f"{done_marker}.metrics"


def mark_command(uri: str, tool: GcsTool | None = None) -> str:
    """Write the empty marker ``uri`` (its parent directory is created when local)."""
    if is_gcs(uri):
        return f"printf '' | {write_command(uri, tool)}"
    return f"mkdir -p {shlex.quote(posixpath.dirname(uri))} && touch {shlex.quote(uri)}"


def claim_command(uri: str, owner: str, stale_s: int, tool: GcsTool | None = None) -> str:
    """Take the claim ``uri`` for ``owner``: exit 0 if ``owner`` holds it now, ``CLAIM_HELD`` if another does.

    Created only if absent (a ``gs://`` generation-match precondition; locally ``set -C``, an exclusive
    create), kept by the same owner's next try, taken over from an owner whose claim is ``stale_s`` old."""
    if is_gcs(uri):
        return _tool(uri, tool).command("claim", uri, owner, str(stale_s))
    path, line = shlex.quote(uri), shlex.quote(owner)
    stale_minutes = max(1, stale_s // 60)
    return (
        f"{{ mkdir -p {shlex.quote(posixpath.dirname(uri))} && "
        f"{{ (set -C; printf '%s\\n' {line} > {path}) 2>/dev/null || grep -qxF -- {line} {path} || "
        f'{{ test -n "$(find {path} -mmin +{stale_minutes})" && printf \'%s\\n\' {line} > {path}; }} '
        f"|| (exit {CLAIM_HELD}); }}; }}"
    )


def release_command(uri: str, owner: str, tool: GcsTool | None = None) -> str:
    """Delete the claim ``uri`` if ``owner`` holds it (a failed step lets the next run go at once)."""
    if is_gcs(uri):
        return _tool(uri, tool).command("release", uri, owner)
    return f"{{ ! grep -qxF -- {shlex.quote(owner)} {shlex.quote(uri)} || rm -f {shlex.quote(uri)}; }}"
