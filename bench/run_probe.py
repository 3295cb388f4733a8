"""One DAG run in the local Airflow, watched.

Task-instance states sampled from the metadata DB, the VMs' lives read from the Compute emulator, and
optionally the trainer SIGKILLed at a given step (P5) on the run's TPU VM (a machine of the local stack's
fleet).

``watch_run(...)`` triggers the run, samples every ``SAMPLE_S`` until it ends and returns a ``RunRecord``;
``watch_runs(...)`` watches every run of some DAGs that something else starts (a backfill, runs side by side).
After the runs, the API server's access log says what each run's tasks asked of it (``api_calls``) and how
often a task came back into a worker after a deferral (``resumes``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
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
TPU_CREATE = "create_tpu_vm"
# The API server's access log (Airflow's HttpAccessLogMiddleware): one line per request, its client and path.
REQUEST = re.compile(r"request finished.*?\bclient_addr=(\S+).*?\bpath=(\S+)")
# The execution API's requests about one task instance (a try); ``/run``, its start in a worker: the first, and
# each resume after a deferral.
TI_PATH = re.compile(r"^/execution/task-instances/([0-9a-f-]{36})/(\w+)")


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


@dataclass(frozen=True)
class Sample:
    """What one sample saw of a run, credited with the seconds until the next sample."""

    seconds: float
    states: dict[str, str]  # task id -> state
    vms: frozenset[str]  # the create tasks whose VM exists
    other_tpu_vms: int  # TPU VMs of other runs (of any DAG) that exist


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
    timeline: list[Sample] = field(default_factory=list)
    logical_date: float | None = None
    api_calls: int | None = None  # requests of the run's tasks to the API server (``calls_of``)
    state_reads: int | None = None  # of which reads of a run's state (``get_dagrun_state``: a claim's look)
    resumes: dict[str, int] = field(default_factory=dict)  # task id -> starts in a worker after its first

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
    """Every SAMPLE_S: the task-instance states of the watched runs (one SELECT on SQLite) and the emulator's instances.

    ``records``: the runs watched, by (dag id, run id); every run of ``dag_ids`` that appears is watched too. The
    time between two samples is credited to what the first of them saw."""

    def __init__(self, db, compute, records: dict[tuple[str, str], RunRecord], dag_ids: tuple[str, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.db, self.compute, self.records, self.dag_ids = db, compute, records, dag_ids
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            previous: dict[tuple[str, str], tuple[dict[str, str], frozenset[str], int]] = {}
            last = time.monotonic()
            while True:
                self._discover()
                states = self._states()
                live, tpu_vms = self._observe_vms()
                now = time.monotonic()
                for key, (was, vms, others) in previous.items():
                    record = self.records[key]
                    record.timeline.append(Sample(now - last, was, vms, others))
                    for task_state in was.items():
                        record.seconds_in[task_state] += now - last
                last = now
                previous = {}
                for key, record in self.records.items():
                    found, mine = states.get(key, {}), live.get(key, frozenset())
                    previous[key] = (found, mine, tpu_vms - (TPU_CREATE in mine))
                    busy = sum(state in ("running", "deferred") for state in found.values())
                    record.peak_busy = max(record.peak_busy, busy)
                    record.load_samples.append(os.getloadavg()[0])
                if self.stop.wait(SAMPLE_S):
                    return
        except Exception as err:  # noqa: BLE001 (any error ends the sampling; watch_runs reports it)
            self.error = err

    def _discover(self) -> None:
        for dag_id in self.dag_ids:
            for (run_id,) in self.db.execute("SELECT run_id FROM dag_run WHERE dag_id = ?", (dag_id,)).fetchall():
                self.records.setdefault((dag_id, run_id), RunRecord(dag_id, run_id))

    def _states(self) -> dict[tuple[str, str], dict[str, str]]:
        dag_ids = sorted({dag_id for dag_id, _ in self.records})
        marks = ", ".join("?" * len(dag_ids))
        states: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
        if not dag_ids:  # no run yet (a backfill's are still being made)
            return states
        for dag_id, run_id, task_id, state in self.db.execute(
            f"SELECT dag_id, run_id, task_id, state FROM task_instance WHERE dag_id IN ({marks})", dag_ids
        ).fetchall():
            if (dag_id, run_id) in self.records:
                states[(dag_id, run_id)][task_id] = state
        return states

    def _observe_vms(self) -> tuple[dict[tuple[str, str], frozenset[str]], int]:
        """Each watched run's VMs (by their create task), and how many TPU VMs exist in all.

        A VM's life: from the emulator's ``creationTimestamp`` (the insert) to the first sample that no longer
        finds it (the emulator removes the VM when its delete operation is done, so within SAMPLE_S)."""
        now = time.time()
        live: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        tpu_vms = 0
        for instance in self.compute.instances():
            labels = instance.get("labels", {})
            task = labels.get("airflow-task", "").replace("-", "_")
            tpu_vms += task == TPU_CREATE
            # The hash keeps deployments apart too: the label's deployment is the one to hash with.
            deployment, found = labels.get(DEPLOYMENT_LABEL, ""), labels.get("airflow-run-hash")
            for key in self.records:
                if run_hash(*key, deployment) == found:
                    live[key][task] = epoch(instance["creationTimestamp"])
        for key, record in self.records.items():
            for task, created in live[key].items():
                record.vms.setdefault(task, Vm(created))
            for task, vm in record.vms.items():
                if task not in live[key] and vm.deleted is None:
                    vm.deleted = now
        return {key: frozenset(found) for key, found in live.items()}, tpu_vms


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


class Approver(threading.Thread):
    """The person of an approval: answers Approve once the run's ``approve_publish`` has asked for ``hold_s``.

    Asking: the task waits for its answer (``awaiting_input``) and the scheduler has taken that in (its log says
    so): an answer given before is lost in Airflow 3.3.2 (the resumed try fails to start; tests/test_approval.py)."""

    TASK = "approve_publish"

    def __init__(self, airflow, dag_id: str, run_id: str, hold_s: float) -> None:
        super().__init__(daemon=True)
        self.airflow, self.dag_id, self.run_id, self.hold_s = airflow, dag_id, run_id, hold_s
        self.stop = threading.Event()
        self.answered = False

    def run(self) -> None:
        db = self.airflow.db()
        asked = None
        while not self.stop.wait(1) and not self.answered:
            row = db.execute(
                "SELECT state FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = ?",
                (self.dag_id, self.run_id, self.TASK),
            ).fetchone()
            if not row or row[0] != "awaiting_input" or not self._parked():
                continue
            asked = asked or time.monotonic()
            if time.monotonic() - asked >= self.hold_s:
                self.airflow.api(
                    "PATCH", f"/dags/{self.dag_id}/dagRuns/{self.run_id}/taskInstances/{self.TASK}/-1/hitlDetails",
                    json={"chosen_options": ["Approve"], "params_input": {}},
                )
                self.answered = True
        db.close()

    def _parked(self) -> bool:
        scheduler = self.airflow.log_tail("scheduler", chars=10**7)
        return any(
            "TaskInstance Finished" in line and f"task_id={self.TASK}" in line and "state=awaiting_input" in line
            for line in scheduler.splitlines()
        )


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


def api_requests(airflow) -> list[tuple[str, str]]:
    """The requests the API server has answered, in order: (client address, path)."""
    return REQUEST.findall((airflow.home / "logs" / "api-server.log").read_text(errors="replace"))


def calls_of(requests: list[tuple[str, str]], dag_id: str, run_id: str, tries: set[str]) -> list[str]:
    """The paths of the requests made for the run whose task instances' tries are ``tries`` (32 hex digits).

    A task's supervisor keeps one connection to the API server and names its task instance first (``/run``): a
    connection that named one of ``tries`` last is the run's, whatever it asks next (a Variable, another run's
    state); one that named no try yet is the run's for requests naming the run."""
    owners: dict[str, bool] = {}
    named = f"/{dag_id}/{run_id}/"
    mine = []
    for client, path in requests:
        about = TI_PATH.match(path)
        if about:
            owners[client] = about[1].replace("-", "") in tries
        if owners.get(client, named in f"{path}/"):
            mine.append(path)
    return mine


def _finish(db, record: RunRecord, requests: list[tuple[str, str]]) -> None:
    """Fill the record from the DB and the API server's ``requests`` once the run is over."""
    record.state, queued, start, end, logical = db.execute(
        "SELECT state, queued_at, start_date, end_date, logical_date FROM dag_run WHERE dag_id = ? AND run_id = ?",
        (record.dag_id, record.run_id),
    ).fetchone()
    record.queued, record.start, record.end = epoch(queued), epoch(start), epoch(end)
    record.logical_date = epoch(logical)
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
    # Every try's id (the DB writes a UUID as 32 hex digits; a path, with dashes).
    tries = dict(
        db.execute(
            "SELECT id, task_id FROM task_instance WHERE dag_id = ? AND run_id = ? UNION "
            "SELECT task_instance_id, task_id FROM task_instance_history WHERE dag_id = ? AND run_id = ?",
            (record.dag_id, record.run_id) * 2,
        ).fetchall()
    )
    mine = calls_of(requests, record.dag_id, record.run_id, set(tries))
    record.api_calls = len(mine)
    record.state_reads = sum(path.startswith("/execution/dag-runs/") and path.endswith("/state") for path in mine)
    starts = Counter(about[1].replace("-", "") for about in map(TI_PATH.match, mine) if about and about[2] == "run")
    resumes: Counter[str] = Counter()
    for ti, count in starts.items():
        resumes[tries[ti]] += count - 1
    record.resumes = {task: count for task, count in resumes.items() if count}


def watch_run(
    airflow, compute, dag_id: str, run_id: str, conf: dict, helper: threading.Thread | None = None
) -> RunRecord:
    """Trigger ``dag_id`` as ``run_id`` and sample it until it ends (or RUN_TIMEOUT_S, then it is failed).

    ``helper``: acts on the run meanwhile (:class:`TrainerKiller`, :class:`Approver`)."""
    start = functools.partial(airflow.trigger, dag_id, run_id, conf)
    records = watch_runs(airflow, compute, start, {(dag_id, run_id): RunRecord(dag_id, run_id)}, (), 1, helper)
    record = records[(dag_id, run_id)]
    if isinstance(helper, TrainerKiller):
        record.killed = helper.killed
        record.killed_at_step = helper.killed_at_step()
    return record


def watch_runs(
    airflow,
    compute,
    start: Callable[[], object],
    records: dict[tuple[str, str], RunRecord],
    dag_ids: tuple[str, ...],
    runs: int,
    helper: threading.Thread | None = None,
) -> dict[tuple[str, str], RunRecord]:
    """Call ``start`` and sample ``records`` and every run of ``dag_ids`` until ``runs`` runs exist and all ended.

    ``start`` triggers the runs (or a backfill makes them); ``helper`` (a thread with a ``stop`` event, e.g. a
    :class:`TrainerKiller`) acts on them meanwhile. After RUN_TIMEOUT_S, the runs not ended are marked failed."""
    db = airflow.db()
    sampler = _Sampler(airflow.db(), compute, records, dag_ids)  # a connection per thread
    start()
    sampler.start()
    if helper:
        helper.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            states = {
                key: (db.execute("SELECT state FROM dag_run WHERE dag_id = ? AND run_id = ?", key).fetchone() or ("",))[0]
                for key in list(records)
            }
            if len(states) >= runs and all(state in FINISHED for state in states.values()):
                break
            if time.monotonic() > deadline or sampler.error:
                for (dag_id, run_id), state in states.items():
                    if state not in FINISHED:
                        airflow.api("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
                break
            time.sleep(2)
    finally:
        sampler.stop.set()
        sampler.join()
        if helper:
            helper.stop.set()
            helper.join()
    if sampler.error:
        raise RuntimeError(f"sampling {sorted(records)} failed") from sampler.error
    requests = api_requests(airflow)
    for record in records.values():
        _finish(db, record, requests)
    db.close()
    return records
