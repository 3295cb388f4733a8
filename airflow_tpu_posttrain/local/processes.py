"""Servers started as local processes (Airflow's services, the stand-ins): a free port, and a sure stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from typing import Self


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ends_with_its_starter() -> None:
    """A ``preexec_fn``: the process gets SIGTERM when the thread that started it ends (Linux's PR_SET_PDEATHSIG).

    So a process that was killed before its ``finally`` ran (a test's timeout, a second Ctrl-C) leaves no server
    running beside the next run. Only for processes started from a thread that lives as long as they should."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """TERM the process group of ``proc`` (started with ``start_new_session``), wait, then KILL what is left.

    The group, not the process: a server's workers and children end with it. KILL because a server can hang on
    TERM."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class StartedProcesses:
    """``with`` support for a set of servers: ``start()`` on entry, and ``stop()`` on exit or when starting fails.

    ``stop()`` must end whatever part ``start()`` got to."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
