"""The remote-job protocol's shell, in one place: what the operators and the job trigger ask a VM about a detached
job. The job's files are providers-ssh's (``RemoteJobPaths``: the job directory with ``pid``, ``exit_code``
written atomically at the end, and ``stdout.log``); these commands only read them.

Pure: strings in, strings out.
"""

from __future__ import annotations

import shlex

JOB_DIED = -1  # the exit code reported for a job whose process group is gone without writing one


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
    """``(state, log size)`` from ``state_command``'s output: ``succeeded``, ``failed with exit code N``,
    ``running``, ``died`` or ``absent``."""
    state, size = output.split()
    if state.startswith("exit:"):
        state = "succeeded" if state == "exit:0" else f"failed with exit code {state[5:]}"
    return state, int(size)


def completion_command(pid_file: str, exit_code_file: str) -> str:
    """Prints the exit code once the job has ended, ``died`` when its process group is gone without one, else
    nothing. The second look at the exit code covers a job that wrote it between the two tests."""
    pid, code = shlex.quote(pid_file), shlex.quote(exit_code_file)
    return (
        f"if test -s {code}; then cat {code}; "
        f'elif test -s {pid} && ! kill -0 "$(cat {pid})" 2>/dev/null; then '
        f"sleep 1; if test -s {code}; then cat {code}; else echo died; fi; fi"
    )


def parse_completion(output: str) -> int | None:
    """The job's exit code (``JOB_DIED`` for a job gone without one) from ``completion_command``'s output;
    None while it runs."""
    answer = output.strip()
    if answer == "died":
        return JOB_DIED
    return int(answer) if answer.lstrip("-").isdigit() else None
