"""One DAG run in the local Airflow, watched.

Task-instance states sampled from the metadata DB, the VMs' lives read from the Compute emulator, and
optionally the trainer SIGKILLed at a given step (P5) on the run's TPU VM (a machine of the local stack's
fleet).

``watch_run(...)`` triggers the run, samples every ``SAMPLE_S`` until it ends and returns a ``RunRecord``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR
from airflow_tpu_posttrain.recipes.compute import DEPLOYMENT_LABEL, run_hash

SAMPLE_S = 0.5
RUN_TIMEOUT_S = 1800
FINISHED = ("success", "failed")
COMPLETED_STEP = re.compile(rb"completed step: (\d+),")
JOBS_DIR = f"{DEFAULT_WORKDIR}/jobs"  # on each VM, where production puts the jobs
VM_END_WAIT_S = 120  # after the run: until its TPU VM's end was seen (the deletion ends it in the background)


def epoch(value: str | None) -> float | None:
    """A DB or emulator timestamp as epoch seconds (SQLite stores naive UTC)."""
    if not value:
        return None
    moment = datetime.fromisoformat(value)
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


@dataclass
class Vm:
    created: float
    deleted: float | None = None


@dataclass
class TaskTry:
    state: str
    try_number: int
    start: float | None
    end: float | None

    @property
    def seconds(self) -> float | None:
        return self.end - self.start if self.start and self.end else None


@dataclass
class RunRecord:
    dag_id: str
    run_id: str
    state: str = "unknown"
    queued: float | None = None
    start: float | None = None
    end: float | None = None
    tasks: dict[str, TaskTry] = field(default_factory=dict)
    xcom: dict[str, object] = field(default_factory=dict)  # task_id -> return value
    vms: dict[str, Vm] = field(default_factory=dict)  # the create task's id -> the VM it made
    seconds_in: dict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )  # (task, state)
    peak_busy: int = 0  # most task instances running or deferred at one sample
    load_samples: list[float] = field(default_factory=list)  # the 1-minute load average at each sample
    killed: list[str] = field(default_factory=list)  # P5: the trainer processes SIGKILLed
    killed_at_step: int | None = None  # P5: the last step the killed try logged

    @property
    def wall(self) -> float | None:
        return self.end - self.start if self.start and self.end else None

    @property
    def latency(self) -> float | None:
        """Triggered (queued) → started by the scheduler."""
        return self.start - self.queued if self.start and self.queued else None

    def state_seconds(self, state: str) -> float:
        """Seconds the run's task instances spent in ``state``, summed."""
        return sum(seconds for (_, in_state), seconds in self.seconds_in.items() if in_state == state)

    @property
    def mean_load(self) -> float | None:
        return sum(self.load_samples) / len(self.load_samples) if self.load_samples else None

    def vm_held(self, create_task: str) -> float | None:
        vm = self.vms.get(create_task)
        return vm.deleted - vm.created if vm and vm.deleted else None


class _Sampler(threading.Thread):
    """Every SAMPLE_S: the run's task-instance states (one SELECT on SQLite) and the emulator's instances.

    The time between two samples is credited to each task instance's state at the first of them."""

    def __init__(self, db, compute, record: RunRecord) -> None:
        super().__init__(daemon=True)
        self.db, self.compute, self.record = db, compute, record
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            previous: list[tuple[str, str]] = []
            last = time.monotonic()
            while True:
                states = self.db.execute(
                    "SELECT task_id, state FROM task_instance WHERE dag_id = ? AND run_id = ?",
                    (self.record.dag_id, self.record.run_id),
                ).fetchall()
                now = time.monotonic()
                for task_state in previous:
                    self.record.seconds_in[task_state] += now - last
                previous, last = states, now
                busy = sum(state in ("running", "deferred") for _, state in states)
                self.record.peak_busy = max(self.record.peak_busy, busy)
                self.record.load_samples.append(os.getloadavg()[0])
                self._observe_vms()
                if self.stop.wait(SAMPLE_S):
                    return
        except Exception as err:  # noqa: BLE001 (any error ends the sampling; watch_run reports it)
            self.error = err

    def _observe_vms(self) -> None:
        """A VM's life: from the emulator's ``creationTimestamp`` to the first sample that no longer finds it.

        ``creationTimestamp`` is the insert; the emulator removes the VM when its delete operation is done (so
        within SAMPLE_S)."""
        now = time.time()
        live = {}
        for instance in self.compute.instances():
            labels = instance.get("labels", {})
            # The hash keeps deployments apart too: the label's deployment is the one to hash with.
            if labels.get("airflow-run-hash") == run_hash(self.record.dag_id, self.record.run_id, labels.get(DEPLOYMENT_LABEL, "")):
                live[labels["airflow-task"].replace("-", "_")] = epoch(instance["creationTimestamp"])
        for task, created in live.items():
            self.record.vms.setdefault(task, Vm(created))
        for task, vm in self.record.vms.items():
            if task not in live and vm.deleted is None:
                vm.deleted = now


class TrainerKiller(threading.Thread):
    """P5: SIGKILLs the SFT trainer of one DAG run once its log shows step ``at_step``.

    The trainer runs on the run's TPU VM, a machine of the local stack with a pid namespace of its own: it is
    a process of the train job's session (the job's pid file names the session leader, a pid as the VM sees
    it) whose command line holds ``train_sft``; other processes are never touched. The killed try's log, set aside
    on the VM by the retry, is read just before the VM is deleted (``stack.fleet.before_end``, set from
    ``start()`` until ``killed_at_step()``)."""

    def __init__(self, stack, dag_id: str, run_id: str, at_step: int) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.job_name = f"train-{run_hash(dag_id, run_id)}"
        self.at_step = at_step
        self.stop = threading.Event()
        self.killed: list[str] = []
        self.vm = None  # the LocalVm the train job runs on, once seen
        self._job_dir_path: Path | None = None
        self._killed_log: bytes | None = None
        self._vm_ended = threading.Event()

    def start(self) -> None:
        self.stack.fleet.before_end = self._before_end
        super().start()

    def _job_dir(self) -> Path | None:
        """The train job's directory on its VM, read through the VM's root; None until it exists."""
        if self._job_dir_path is None:
            for vm in self.stack.vms():
                with contextlib.suppress(Exception):  # not booted yet, or ending
                    job_dir = vm.guest_path(JOBS_DIR) / self.job_name  # through /proc/<its init>/root
                    if job_dir.is_dir():
                        self.vm, self._job_dir_path = vm, job_dir
                        break
        return self._job_dir_path

    def run(self) -> None:
        while not self.stop.wait(0.2) and not self.killed:
            try:
                job_dir = self._job_dir()
                if job_dir is None:
                    continue
                leader = int((job_dir / "pid").read_text())
                log = (job_dir / "stdout.log").read_bytes()
            except Exception:  # noqa: BLE001, S112 (not written yet, or the VM is ending: the next sample)
                continue
            if max(map(int, COMPLETED_STEP.findall(log)), default=0) >= self.at_step:
                self.killed = kill_session(self.vm, leader, b"train_sft")

    def _before_end(self, vm) -> None:
        """Just before a VM of the stack is destroyed: on the train job's VM, keep the killed try's log."""
        if self.vm is None or vm.name != self.vm.name:
            return
        try:
            logs = sorted(vm.guest_path(JOBS_DIR).glob(f"{self.job_name}.*/stdout.log"))
            self._killed_log = logs[0].read_bytes() if logs else None
        finally:
            self._vm_ended.set()

    def killed_at_step(self) -> int | None:
        """The last step the killed try logged, once the VM's end was seen (bounded).

        The retry set its job dir aside as ``<dir>.<time>``. The stack's ``before_end`` is released."""
        try:
            if self.killed:
                self._vm_ended.wait(VM_END_WAIT_S)
        finally:
            self.stack.fleet.before_end = None
        if not self._killed_log:
            return None
        return max(map(int, COMPLETED_STEP.findall(self._killed_log)), default=None)


def _vm_processes(vm) -> dict[int, int]:
    """``{pid on this machine: session id as the VM sees it}`` of the VM's processes.

    The session id is the one in its pid namespace: the ``NSsid`` line of /proc/PID/status lists the session
    id in each nested namespace, the VM's last."""
    namespace = os.readlink(vm.guest_path("/").parent / "ns" / "pid")
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(entry / "ns" / "pid") != namespace:
                continue
            status = (entry / "status").read_text()
            lines = status.splitlines()
            sessions = next((line.split()[1:] for line in lines if line.startswith("NSsid:")), [])
            if sessions:
                processes[int(entry.name)] = int(sessions[-1])
    return processes


def kill_session(vm, leader: int, needle: bytes = b"") -> list[str]:
    """SIGKILL the VM's processes of session ``leader`` whose command line holds ``needle``.

    ``leader`` is a pid as the VM sees it. Returns their command lines."""
    killed = []
    for pid, session in _vm_processes(vm).items():
        if session != leader:
            continue
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if needle in cmdline:
                os.kill(pid, signal.SIGKILL)
                killed.append(cmdline.replace(b"\0", b" ").decode(errors="replace")[:160])
    return killed


def _finish(db, record: RunRecord) -> None:
    """Fill the record from the DB once the run is over."""
    record.state, queued, start, end = db.execute(
        "SELECT state, queued_at, start_date, end_date FROM dag_run WHERE dag_id = ? AND run_id = ?",
        (record.dag_id, record.run_id),
    ).fetchone()
    record.queued, record.start, record.end = epoch(queued), epoch(start), epoch(end)
    for task_id, state, try_number, start, end in db.execute(
        "SELECT task_id, state, try_number, start_date, end_date FROM task_instance "
        "WHERE dag_id = ? AND run_id = ?",
        (record.dag_id, record.run_id),
    ):
        record.tasks[task_id] = TaskTry(state, try_number, epoch(start), epoch(end))
    for task_id, value in db.execute(
        "SELECT task_id, value FROM xcom WHERE dag_id = ? AND run_id = ? AND key = 'return_value'",
        (record.dag_id, record.run_id),
    ):
        record.xcom[task_id] = json.loads(value) if isinstance(value, str | bytes) else value


def watch_run(
    airflow, compute, dag_id: str, run_id: str, conf: dict, killer: TrainerKiller | None = None
) -> RunRecord:
    """Trigger ``dag_id`` as ``run_id`` and sample it until it ends (or RUN_TIMEOUT_S, then it is failed)."""
    record = RunRecord(dag_id, run_id)
    db = airflow.db()
    sampler = _Sampler(airflow.db(), compute, record)  # a connection per thread
    airflow.trigger(dag_id, run_id, conf)
    sampler.start()
    if killer:
        killer.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            (state,) = db.execute(
                "SELECT state FROM dag_run WHERE dag_id = ? AND run_id = ?", (dag_id, run_id)
            ).fetchone()
            if state in FINISHED:
                break
            if time.monotonic() > deadline or sampler.error:
                airflow.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
                break
            time.sleep(2)
    finally:
        sampler.stop.set()
        sampler.join()
        if killer:
            killer.stop.set()
            killer.join()
            record.killed = killer.killed
            record.killed_at_step = killer.killed_at_step()
    if sampler.error:
        raise RuntimeError(f"sampling {dag_id}/{run_id} failed") from sampler.error
    _finish(db, record)
    db.close()
    return record
