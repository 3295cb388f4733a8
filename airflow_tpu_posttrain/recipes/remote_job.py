"""The remote-job protocol's shell, in one place.

The script a detached job runs, and what the operators and the job trigger ask a VM about it. The job's files
are providers-ssh's (``RemoteJobPaths``: the job directory with ``pid``, ``exit_code`` written atomically at
the end, and ``stdout.log``); the questions only read them.

Pure: strings in, strings out.
"""

from __future__ import annotations

import base64
import shlex
from dataclasses import dataclass

from airflow_tpu_posttrain.recipes import storage
from airflow_tpu_posttrain.recipes.metrics import LOG_FILTER
from airflow_tpu_posttrain.recipes.shell import export_line

JOB_DIED = -1  # the exit code reported for a job whose process group is gone without writing one
JOB_STALLED = -2  # the exit code reported for a job stopped by the watch for writing nothing for too long
STOP_GRACE_S = 10  # seconds a job's processes have to end on SIGTERM before SIGKILL


def state_command(job_dir: str, pid_file: str, exit_code_file: str, log_file: str) -> str:
    """Prints ``exit:<code> <log size>``, ``running <log size>``, ``died <log size>`` or ``absent 0``."""
    d, pid, code, log = (shlex.quote(p) for p in (job_dir, pid_file, exit_code_file, log_file))
    return (
        f"size=$(stat -c %s {log} 2>/dev/null || echo 0); "
        f'if [ -f {code} ]; then echo "exit:$(cat {code}) $size"; '
        f'elif [ -f {pid} ] && kill -0 "$(cat {pid})" 2>/dev/null; then echo "running $size"; '
        f'elif [ -d {d} ]; then echo "died $size"; else echo "absent 0"; fi'
    )


def parse_state(output: str) -> tuple[str, int]:
    """``(state, log size)`` from ``state_command``'s output.

    The state is ``succeeded``, ``failed with exit code N``, ``running``, ``died`` or ``absent``."""
    state, size = output.split()
    if state.startswith("exit:"):
        state = "succeeded" if state == "exit:0" else f"failed with exit code {state[5:]}"
    return state, int(size)


def completion_command(pid_file: str, exit_code_file: str) -> str:
    """Prints the exit code once the job has ended, ``died`` when it is gone without one, else nothing.

    ``died``: its process group is gone without an exit code. The second look at the exit code covers a job
    that wrote it between the two tests."""
    pid, code = shlex.quote(pid_file), shlex.quote(exit_code_file)
    return (
        f"if test -s {code}; then cat {code}; "
        f'elif test -s {pid} && ! kill -0 "$(cat {pid})" 2>/dev/null; then '
        f"sleep 1; if test -s {code}; then cat {code}; else echo died; fi; fi"
    )


def parse_completion(output: str) -> int | None:
    """The job's exit code from ``completion_command``'s output; None while it runs.

    ``JOB_DIED`` for a job gone without one."""
    answer = output.strip()
    if answer == "died":
        return JOB_DIED
    return int(answer) if answer.lstrip("-").isdigit() else None


def stop_command(pid_file: str, grace_s: int = STOP_GRACE_S) -> str:
    """Ends the job's process group: SIGTERM, then SIGKILL to whatever is left after ``grace_s``.

    The job runs under ``setsid``; its pid is the group's. The SIGKILL is for a process blocked in a system
    call, or whose SIGTERM handler hangs too. It returns once the group is gone (or ``grace_s`` after the
    SIGKILL): a retry's trainer must not start beside one still holding the TPU. A pid of 0 or 1 is never
    signalled."""
    pid = shlex.quote(pid_file)
    group_alive = 'kill -0 -"$p" 2>/dev/null'
    wait_while_alive = f"for _ in $(seq {2 * grace_s}); do {group_alive} || break; sleep 0.5; done"
    return (
        f'p="$(cat {pid} 2>/dev/null)"; if [ "$p" -gt 1 ] 2>/dev/null; then '
        f'kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null; {wait_while_alive}; '
        f'if {group_alive}; then kill -KILL -"$p" 2>/dev/null; {wait_while_alive}; fi; fi; true'
    )


def metric_lines_command(log_file: str) -> str:
    """The log's metric lines (``metrics.LOG_FILTER``); nothing, successfully, when there are none."""
    return f"grep -aE {shlex.quote(LOG_FILTER)} {shlex.quote(log_file)} || true"


def complete_metric_lines_command(log_file: str) -> str:
    """The metric lines of a log still being written: without its last line when that has no newline yet.

    One group, so that it can start a pipeline."""
    log = shlex.quote(log_file)
    whole_lines = f"if [ -n \"$(tail -c1 {log})\" ]; then sed '$d' {log}; else cat {log}; fi"
    return f"{{ {{ {whole_lines}; }} | grep -aE {shlex.quote(LOG_FILTER)} || true; }}"


ACTED = "[airflow-tpu-posttrain] acted"  # what a watch's on-output command prints once it acted (or had)


def when_logged_command(log_file: str, markers: list[str], command: str) -> str:
    """Runs ``command`` (given the log's whole metric lines on stdin) once they show one of ``markers``.

    Prints ``ACTED`` when ``command`` succeeded; prints nothing while no marker is logged. Reads the log on the VM
    itself, so it does not wait for a watch that forwards the log behind (chunk by chunk) to reach the marker."""
    found = " ".join(f"-e {shlex.quote(marker)}" for marker in markers)
    return (
        f"lines=$({complete_metric_lines_command(log_file)}); "
        f"if printf '%s\\n' \"$lines\" | grep -qaF {found}; then "
        f"printf '%s\\n' \"$lines\" | {{ {command}; }} && echo {shlex.quote(ACTED)}; fi"
    )


CLAIM_WAIT_LINE = "[airflow-tpu-posttrain] another run is writing this output; waiting for it to finish"
CLAIM_DONE_LINE = "[airflow-tpu-posttrain] the run holding the claim finished this output; nothing left to do"
CLAIM_POLL_S = 15


def wrapper_script(
    step_script: str,
    log_file: str,
    *,
    token_file: str | None = None,
    token_in_env: bool = False,
    keep_token_file: bool = False,
    prefetch: str | None = None,
    hub_endpoint: str | None = None,
    done_marker: str | None = None,
    storage_tool: storage.GcsTool | None = None,
    claim: tuple[str, str] | None = None,
    claim_poll_s: float = CLAIM_POLL_S,
    before_step: str | None = None,
) -> str:
    """The script the detached job runs: the token, the step, then the metric lines and the marker.

    The token goes from its 0600 file into ``HF_TOKEN`` (MaxText's config and huggingface_hub read it from the
    environment, never from argv) and/or is named by ``HF_TOKEN_FILE`` until the job ends, the file deleted as
    soon as it is not needed. A ``prefetch`` command gets the token in its environment alone, before the step
    (which then runs without it). Then the step; then, with a ``done_marker``, the log's metric lines kept in
    storage beside it (a later run on another VM reads them there) and the marker (``storage_tool``: how the
    VM writes a ``gs://`` marker).

    ``claim`` (with ``done_marker``): a :func:`storage.claim_command` taken before the step, and its
    :func:`storage.release_command`, run if the step fails. Runs writing the same output (two runs converting
    one model) then do it once: while another run holds the claim the job waits, and ends without running the
    step once that run's marker is there. ``before_step``: a command run just before the step, without the
    token."""
    lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
    if claim and done_marker:
        lines += [
            "while :; do",
            f"  claimed=0; {claim[0]} || claimed=$?",
            '  [ "$claimed" -eq 0 ] && break',
            f'  [ "$claimed" -eq {storage.CLAIM_HELD} ] || exit "$claimed"',
            f"  if {storage.exists_command(done_marker, storage_tool)}; then",
            f"    echo {shlex.quote(CLAIM_DONE_LINE)}; exit 0",
            "  fi",
            f"  echo {shlex.quote(CLAIM_WAIT_LINE)}; sleep {claim_poll_s}",
            "done",
        ]
    if token_file and token_in_env:
        lines.append(f'export HF_TOKEN="$(cat {shlex.quote(token_file)})"')
    if hub_endpoint:
        lines.append(export_line("HF_ENDPOINT", hub_endpoint))
    if token_file and prefetch:
        lines.append(f'HF_TOKEN="$(cat {shlex.quote(token_file)})" {prefetch}')
    if token_file and keep_token_file:
        lines += [
            f"export HF_TOKEN_FILE={shlex.quote(token_file)}",
            f"trap 'rm -f {shlex.quote(token_file)}' EXIT",
        ]
    elif token_file:
        lines.append(f"rm -f {shlex.quote(token_file)}")
    if before_step:
        lines.append(before_step)
    if claim and done_marker:
        lines.append(f'bash {shlex.quote(step_script)} || {{ failed=$?; {claim[1]} || true; exit "$failed"; }}')
    else:
        lines.append(f"bash {shlex.quote(step_script)}")
    if done_marker:
        keep_metrics = storage.write_command(storage.metrics_uri(done_marker), storage_tool)
        lines += [
            f"{{ {metric_lines_command(log_file)}; }} | {keep_metrics}",
            storage.mark_command(done_marker, storage_tool),
        ]
    return "\n".join(lines) + "\n"


_REPORT_STDERR_TAIL = 2000  # bytes of an item's stderr kept in the report
REPORT_TIMEOUT_S = 300  # seconds a report may take: it reads storage from the VM (as VmHook.exists may)


@dataclass(frozen=True)
class ReportItem:
    """One command's answer in a job's report: exit status, stdout and the end of stderr."""

    status: int
    stdout: str
    stderr: str


def report_command(commands: dict[str, str]) -> str:
    """Runs each command of ``{name: command}`` and prints one line per command: name, status, outputs.

    What a finished step reads back from the VM, in one SSH command: the job's watch runs it when the job
    succeeded, so the task's resumption in a worker opens no connection. The outputs are base64 (empty when
    empty), so any text survives the framing; ``parse_report`` reads it back."""
    item = (
        'r() { o=$(mktemp) e=$(mktemp); bash -c "$2" >"$o" 2>"$e"; s=$?; '
        f'printf "%s %d %s %s\\n" "$1" "$s" "$(base64 -w0 <"$o")" "$(tail -c {_REPORT_STDERR_TAIL} "$e" | base64 -w0)"; '
        'rm -f "$o" "$e"; }'
    )
    calls = "; ".join(f"r {shlex.quote(name)} {shlex.quote(command)}" for name, command in commands.items())
    return f"{item}; {calls}"


def parse_report(output: str) -> dict[str, ReportItem]:
    """``{name: ReportItem}`` from ``report_command``'s output."""
    items = {}
    for line in output.splitlines():
        fields = line.split(" ")
        if len(fields) != 4 or not fields[1].lstrip("-").isdigit():
            continue
        name, status, stdout, stderr = fields
        items[name] = ReportItem(int(status), *(_unbase64(text) for text in (stdout, stderr)))
    return items


def _unbase64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace") if text else ""
