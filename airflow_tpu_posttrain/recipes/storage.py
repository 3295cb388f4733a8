"""Checkpoint storage shared by the run's VMs: a ``gs://`` prefix on Google Cloud, a directory locally.

MaxText reads and writes ``gs://`` paths itself (orbax); what the pipeline adds are small marker files that
say an output is complete. These helpers render the shell commands that test for and write them on a VM.
"""

from __future__ import annotations

import posixpath
import shlex

from airflow_tpu_posttrain.recipes import validation


def checkpoint_uri(field: str, value: str) -> str:
    """A ``gs://bucket/prefix`` or an absolute directory (``file://`` is accepted and dropped: MaxText takes
    plain paths); normalised without a trailing '/'."""
    uri = validation.storage_uri(field, value)
    return uri.removeprefix("file://")


def is_gcs(uri: str) -> bool:
    return uri.startswith("gs://")


def exists_command(uri: str) -> str:
    """Exit status 0 when ``uri`` (an object, a prefix or a path) exists."""
    if is_gcs(uri):
        return f"gcloud storage ls {shlex.quote(uri)} >/dev/null 2>&1"
    return f"test -e {shlex.quote(uri)}"


def write_command(uri: str) -> str:
    """Write standard input to the file ``uri`` (its parent directory is created when local); one command, so
    it can end a pipeline."""
    if is_gcs(uri):
        return f"gcloud storage cp - {shlex.quote(uri)}"
    return f"{{ mkdir -p {shlex.quote(posixpath.dirname(uri))} && cat > {shlex.quote(uri)}; }}"


def read_command(uri: str) -> str:
    """Print the file ``uri``."""
    if is_gcs(uri):
        return f"gcloud storage cat {shlex.quote(uri)}"
    return f"cat {shlex.quote(uri)}"


def copy_tree_command(source: str, destination: str) -> str:
    """Copy the contents of the directory ``source`` into ``destination`` (either may be ``gs://``)."""
    mkdir = "" if is_gcs(destination) else f"mkdir -p {shlex.quote(destination)} && "
    if is_gcs(source) or is_gcs(destination):
        return f"{mkdir}gcloud storage rsync --recursive {shlex.quote(source)} {shlex.quote(destination)}"
    return f"{mkdir}cp -a {shlex.quote(source + '/.')} {shlex.quote(destination + '/')}"


def metrics_uri(done_marker: str) -> str:
    """Where a step keeps its metric lines next to its done marker, so a re-run on a new VM (whose job log
    went with the old VM's disk) still reports what the finished step measured."""
    return f"{done_marker}.metrics"


def mark_command(uri: str) -> str:
    """Write the empty marker ``uri`` (its parent directory is created when local)."""
    if is_gcs(uri):
        return f"printf '' | gcloud storage cp - {shlex.quote(uri)}"
    return f"mkdir -p {shlex.quote(posixpath.dirname(uri))} && touch {shlex.quote(uri)}"
