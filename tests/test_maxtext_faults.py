"""Faults around the MaxText remote jobs, in real Airflow (dag.test) against the local stack.

The stack: Compute emulator whose every instance is a machine of its own, real MaxText on CPU with the tiny
model, the local Hub server.

One DAG run of the tiny SFT DAG carries the faults (slow: real training), and the tests read what it left:

- the SSH sessions are dropped while ``train`` is deferred, once per try: the trigger reconnects, the task
  does not fail because of it (test 1);
- the trainer process is SIGKILLed after "completed step: 4" (a crash / OOM kill of the trainer; the job's
  wrapper survives and records the exit code): try 1 fails, the retry resumes from a checkpoint (test 2);
- the Hugging Face token (a marker) is looked for in the task logs, the rendered template fields, XCom,
  the process list sampled during the run and each VM's files just before the VM is destroyed (test 3);
- the export launcher breaks the first export (a tensor permuted: ``export_faults.py``, local/vm_launchers/
  to_huggingface_cpu.py): the fidelity check fails try 1 before anything is kept or published, naming both losses,
  and the retry exports again and publishes (test 6);

then invalid trigger input is refused before any API call (test 4) and the finished run is run again under the
same run_id (test 5). One stack for the module. What the tests read of a VM's disk is read while the VM
lives (through ``vm.guest_path``), or copied just before its end (``stack.fleet.before_end``): nothing of it
survives.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import FOCUSED_RUN, HF_TOKEN, log_excerpt, storage_has
from test_pipeline_local import SEEDS_ROOT, WORKDIR, before_vm_end, token_probe
from test_reattach import vm_of_its_own

from airflow_tpu_posttrain.local.hub_server import REDACTED

DAG_ID = "posttrain_sft__tiny-llama"
RUN_ID = "manual__faults-sft"
LOGICAL_DATE = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)
STEPS = 10  # a few more than the kill point, so the kill lands while training still runs
KILL_AFTER_STEP = 4
CHECKPOINT_PERIOD = 2  # what the local DAGs use (registry.py: the local entries' checkpoint_period)
_COMPLETED = re.compile(rb"completed step: (\d+),")
JOBS = f"{WORKDIR}/jobs"  # on each VM
VM_KINDS = ("tpu", "cpu", "export")  # the run's VMs: create_<kind>_vm, delete_<kind>_vm


# ---------------------------------------------------------------------------------------------- helpers


def _dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag(DAG_ID)


@contextlib.contextmanager
def _fixed_run_id(run_id: str):
    """dag.test() names its run with DagRun.generate_run_id; pin it, as conftest.run_dag does."""
    from airflow.models.dagrun import DagRun

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DagRun, "generate_run_id", staticmethod(lambda **_: run_id))
        yield


def _run_pipeline(conf: dict):
    """The faulted/reused run: always the same run_id and logical date, so the second call is a re-run."""
    with _fixed_run_id(RUN_ID):
        return _dag().test(run_conf={**FOCUSED_RUN, **conf}, logical_date=LOGICAL_DATE)


def _tis(dag_run):
    return {ti.task_id: ti for ti in dag_run.get_task_instances()}


def _states(dag_run):
    return {task_id: ti.state for task_id, ti in _tis(dag_run).items()}


def _return_value(dag_run, task_id):
    return _tis(dag_run)[task_id].xcom_pull(task_ids=task_id)


def all_xcom(run_id: str, dag_id: str = DAG_ID) -> list[tuple[str, str, object]]:
    """Every XCom of the run, not only return values: (task_id, key, value)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(XComModel).where(XComModel.dag_id == dag_id, XComModel.run_id == run_id))
        return [(row.task_id, row.key, row.value) for row in rows]


def rendered_fields(run_id: str, dag_id: str = DAG_ID) -> dict[str, object]:
    """The rendered template fields stored for the UI (RenderedTaskInstanceFields), per task of the run."""
    from airflow.models.renderedtifields import RenderedTaskInstanceFields as RTIF
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(select(RTIF).where(RTIF.dag_id == dag_id, RTIF.run_id == run_id))
        return {row.task_id: row.rendered_fields for row in rows}


def _instance_inserts(stack) -> int:
    return sum(1 for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances"))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _vm_session(vm, leader: int) -> list[int]:
    """The pids, on this machine, of the VM's processes in session ``leader``.

    ``leader`` is a pid as the VM sees it: a job's pid file. The VM has a pid namespace of its own;
    /proc/PID/status lists a process's session id in each namespace it belongs to (NSsid), the VM's last."""
    namespace = os.readlink(vm.guest_path("/").parent / "ns" / "pid")
    members = []
    for pid in _pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != namespace:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        sessions = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSsid:")), [])
        if sessions and int(sessions[-1]) == leader:
            members.append(pid)
    return members


class ProcessSampler(threading.Thread):
    """Samples every process's argv (/proc/*/cmdline) every 0.5 s; remembers those holding the marker."""

    def __init__(self, marker: bytes):
        super().__init__(daemon=True)
        self.marker = marker
        self.stop = threading.Event()
        self.samples = 0
        self.max_processes = 0
        self.leaks: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _pids()
            self.max_processes = max(self.max_processes, len(pids))
            for pid in pids:
                argv = _cmdline(pid)
                if self.marker in argv:
                    self.leaks.append(argv.replace(b"\0", b" ").decode(errors="replace"))
            self.samples += 1
            self.stop.wait(0.5)


def _forge_half_written_step(step: int) -> dict[str, int]:
    """What a save cut short leaves on GCS, for ``step`` of the run now training.

    The objects of its newest committed step copied under ``checkpoints/<step>/`` without orbax's
    ``commit_success.txt`` (orbax writes in place on GCS and the commit file last). Returns
    ``{object name: generation}`` of the forged objects."""
    from google.cloud import storage

    from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

    bucket_name, _, root = LOCAL_CHECKPOINT_STORAGE.removeprefix("gs://").partition("/")
    client = storage.Client()
    bucket = client.bucket(bucket_name)
    commits = [
        blob
        for blob in client.list_blobs(bucket_name, prefix=f"{root}/")
        if blob.name.endswith("/commit_success.txt") and "/checkpoints/" in blob.name
    ]
    newest = max(commits, key=lambda blob: blob.updated).name.rsplit("/", 1)[0]  # .../checkpoints/<n>
    target = f"{newest.rsplit('/', 1)[0]}/{step}"
    forged = {}
    for blob in client.list_blobs(bucket_name, prefix=f"{newest}/"):
        if not blob.name.endswith("/commit_success.txt"):
            copy = bucket.copy_blob(blob, bucket, target + blob.name[len(newest) :])
            forged[copy.name] = copy.generation
    return forged


def _generations(names: list[str]) -> dict[str, int | None]:
    """``{object name: generation}`` in the local checkpoint bucket, None for an object that is not there."""
    from google.cloud import storage

    from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

    bucket = storage.Client().bucket(LOCAL_CHECKPOINT_STORAGE.removeprefix("gs://").partition("/")[0])
    blobs = {name: bucket.get_blob(name) for name in names}
    return {name: blob.generation if blob else None for name, blob in blobs.items()}


class _TrainFaults(threading.Thread):
    """Watches the train job on the TPU VM, dropping its SSH sessions and killing its trainer.

    The TPU VM is the one whose jobs directory gets ``job_name``. It drops the VM's SSH sessions at try 1's
    first completed step, SIGKILLs the trainer (python processes of the job's session) after step
    KILL_AFTER_STEP and leaves a half-written final step in storage, then drops the sessions again at the
    first completed step of the retry (a new pid in the re-created job dir)."""

    def __init__(self, stack, job_name: str):
        super().__init__(daemon=True)
        self.stack = stack
        self.job_name = job_name
        self.vm = None
        self.job_dir: Path | None = None  # on this machine, through the VM's root
        self._last_find = 0.0
        self.stop = threading.Event()
        self.drops: list[tuple[str, list[int]]] = []
        self.killed: list[tuple[int, str]] = []
        self.try1_pid: int | None = None
        self.forged: dict[str, int] = {}
        self.error: BaseException | None = None

    def _find(self) -> None:
        for vm in self.stack.vms():
            with contextlib.suppress(Exception):  # not booted yet, or ending
                job_dir = vm.guest_path(JOBS) / self.job_name
                if job_dir.is_dir():
                    self.vm, self.job_dir = vm, job_dir
                    return

    def _read(self) -> tuple[int | None, bytes]:
        if self.job_dir is None:
            now = time.monotonic()
            if now - self._last_find < 1.0:  # each look scans /proc: not at the 50 ms pace of the rest
                return None, b""
            self._last_find = now
            self._find()
            if self.job_dir is None:
                return None, b""
        try:
            pid = int((self.job_dir / "pid").read_text() or 0) or None
            log = (self.job_dir / "stdout.log").read_bytes()
        except (OSError, ValueError):
            return None, b""
        return pid, log

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # reported by the fixture
            self.error = err

    def _run(self) -> None:
        phase = "try1"
        while not self.stop.is_set() and phase != "done":
            pid, log = self._read()
            steps = [int(s) for s in _COMPLETED.findall(log)]
            if phase == "try1" and pid and steps:
                if not self.drops:
                    self.drops.append(("try1", self.vm.drop_sessions()))
                if max(steps) >= KILL_AFTER_STEP:
                    for other in _vm_session(self.vm, pid):
                        cmd = _cmdline(other)
                        if b"python" in cmd.split(b"\0")[0]:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(other, signal.SIGKILL)
                            self.killed.append((other, cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
                    self.try1_pid = pid
                    self.forged = _forge_half_written_step(STEPS)
                    phase = "try2"
            elif phase == "try2" and pid and pid != self.try1_pid and steps:
                self.drops.append(("try2", self.vm.drop_sessions()))
                phase = "done"
            time.sleep(0.05)


def _vm_end_probe(stack, copies: Path):
    """Before each VM's end: what ``token_probe`` sees and the VM's train job dirs.

    The job dirs are copied to ``copies/<VM name>``; also whether the run's root was on it."""
    tokens = token_probe(stack)

    def probe(vm) -> dict:
        jobs = vm.guest_path(JOBS)
        train_dirs = sorted(p.name for p in jobs.glob("train-*") if p.is_dir()) if jobs.is_dir() else []
        for name in train_dirs:
            shutil.copytree(jobs / name, copies / vm.name / name, symlinks=True)
        return {**tokens(vm), "train_dirs": train_dirs, "root_on_vm": vm.guest_path(SEEDS_ROOT).is_dir()}

    return probe


def _checkpoint_files(checkpoint: str) -> dict[str, int]:
    """``{object name: generation}`` of every object of a run's checkpoints in the local GCS server.

    The checkpoints are ``.../checkpoints/<step>/model_params``. A rewritten object gets a new generation, as
    on Cloud Storage."""
    from google.cloud import storage

    bucket, _, name = checkpoint.removeprefix("gs://").partition("/")
    prefix = name.rsplit("/", 2)[0] + "/"
    return {b.name[len(prefix):]: b.generation for b in storage.Client().list_blobs(bucket, prefix=prefix)}


# ---------------------------------------------------------------------------------------------- fixtures


_FAULTED_RUN: dict = {}


@pytest.fixture
def faulted_run(stack, capfd):
    """The tiny SFT DAG with STEPS steps, hub publish on, faults injected into ``train``.

    Hub publish goes to the DAG's default hub_repo_id. Run once, by the first test that asks (under its
    ``capfd``: dag.test prints the task logs); everything the tests need is collected at once, before test 5
    re-runs the same run_id."""
    if not _FAULTED_RUN:
        _FAULTED_RUN.update(_faulted_run(stack, capfd))
    return _FAULTED_RUN


@contextlib.contextmanager
def _export_fault(stack, fault: str):
    """The local export launcher breaks this run's first export (``fault``), on the VM its install step copies it to."""
    from airflow_tpu_posttrain.recipes import layout
    from airflow_tpu_posttrain.recipes.runtime import LOCAL_LAUNCHERS

    switch = stack.local_dir / LOCAL_LAUNCHERS / "export_faults.py"
    # The run name less its hash (of the deployment too): the DAG's and this logical date's, this run's only.
    run_name = layout.run_name(DAG_ID, RUN_ID, LOGICAL_DATE).rsplit("-", 1)[0]
    switch.write_text(f"FAULTS = {{{run_name!r}: {fault!r}}}\n")
    try:
        yield
    finally:
        switch.unlink(missing_ok=True)


def _faulted_run(stack, capfd) -> dict:
    from airflow_tpu_posttrain.recipes.compute import run_hash

    train_name = f"train-{run_hash(DAG_ID, RUN_ID)}"
    faults = _TrainFaults(stack, train_name)
    sampler = ProcessSampler(HF_TOKEN.encode())
    inserts_before = _instance_inserts(stack)
    hub_requests_before = len(stack.hub.requests)
    scratch = Path(tempfile.mkdtemp(prefix="maxtext-faults-"))
    capfd.readouterr()
    faults.start()
    sampler.start()
    started = time.monotonic()
    with before_vm_end(stack, _vm_end_probe(stack, scratch / "vm-ends")) as ends:
        try:
            with _export_fault(stack, "permute"):
                dag_run = _run_pipeline({"steps": STEPS})
        finally:
            faults.stop.set()
            sampler.stop.set()
            faults.join(10)
            sampler.join(10)
        logs = "".join(capfd.readouterr())
        debug_log = scratch / "faulted_run.log"
        debug_log.write_text(logs)
        tis = _tis(dag_run)
        assert faults.error is None, faults.error
        returns = {task_id: _return_value(dag_run, task_id) for task_id in tis}
        vms = {kind: (returns.get(f"create_{kind}_vm") or {}).get("name") for kind in VM_KINDS}
        vm_end_error = _wait_gone(ends, vms)
    # The train job's files, as they were on the TPU VM at its end (copied then).
    train_dir = scratch / "vm-ends" / str(vms["tpu"]) / train_name
    return {
        "dag_run": dag_run,
        "state": dag_run.state,
        "states": _states(dag_run),
        "tries": {task_id: ti.try_number for task_id, ti in tis.items()},
        "returns": returns,
        "xcom": all_xcom(RUN_ID),
        "rendered": rendered_fields(RUN_ID),
        "logs": logs,
        "debug_log": debug_log,
        "faults": faults,
        "sampler": sampler,
        "vms": vms,
        "vm_ends": ends.seen,
        "vm_end_error": vm_end_error,
        "train_dir": train_dir,
        "earlier_train_dirs": sorted(p for p in train_dir.parent.glob(f"{train_name}.*") if p.is_dir()),
        "instance_inserts": _instance_inserts(stack) - inserts_before,
        "forged_after": _generations(list(faults.forged)),
        "hub_requests": stack.hub.requests[hub_requests_before:],
        "seconds": time.monotonic() - started,
    }


def _wait_gone(ends, vms: dict[str, str | None]) -> str | None:
    """Why the run's VMs were not all probed at their end and their disks deleted, or None.

    The tests assert it: an assertion here would make each test run the DAG again."""
    try:
        assert all(vms.values()), f"a create task gave no VM name: {vms}"
        ends.wait_gone(list(vms.values()))
    except AssertionError as err:
        return str(err)
    return None


def _assert_vms_deleted_and_checkpoint_kept(run: dict, stack) -> None:
    """The fault matrix's "VM deleted" and "model intact" cells of the faulted run."""
    assert run["returns"]["delete_tpu_vm"]["deleted"] is True
    assert run["returns"]["delete_cpu_vm"]["deleted"] is True and run["returns"]["delete_export_vm"]["deleted"] is True
    assert stack.compute.instances() == [], [i["name"] for i in stack.compute.instances()]
    assert run["vm_end_error"] is None, run["vm_end_error"]  # each VM probed at its end, its disk gone since
    assert storage_has(run["returns"]["train"]["checkpoint"])  # in checkpoint storage: it outlives the VMs


def _diagnose(run: dict) -> str:
    return f"states={run['states']} tries={run['tries']} (task logs: {run['debug_log']})"


# ---------------------------------------------------------------------------------------------- 1. SSH drops


def test_ssh_drops_while_training_do_not_fail_the_task(faulted_run, stack, fault_matrix):
    run = faulted_run
    faults: _TrainFaults = run["faults"]
    assert run["state"] == "success", _diagnose(run)
    assert run["states"]["train"] == "success" and run["states"]["fail_run_if_a_step_failed"] == "skipped"

    # Both drops happened while train was deferred and cut live sessions (the trigger's connection among them).
    assert [label for label, _ in faults.drops] == ["try1", "try2"], faults.drops
    assert all(pids for _, pids in faults.drops), f"nothing to drop: {faults.drops}"
    # The trigger noticed and reconnected (providers-ssh's SSHRemoteJobTrigger warning), at least once per try.
    lost = re.findall(r"Lost SSH connection while polling", run["logs"])
    assert len(lost) >= 2, f"no reconnect in the task logs ({run['debug_log']})"
    assert "Trigger error" not in run["logs"]
    # The only failure of train was the injected kill (try 1, exit 137), not the drops: 2 tries in all.
    assert run["tries"]["train"] == 2, _diagnose(run)
    assert re.search(r"failed .*exit code:? 137", run["logs"]), run["debug_log"]
    # After the drop, try 2 finished normally: the trainer's last step is in the log it streamed.
    assert f"completed step: {STEPS}," in run["logs"]
    _assert_vms_deleted_and_checkpoint_kept(run, stack)
    fault_matrix.record(
        f"MaxText: SSH sessions dropped while train is deferred ({len(lost)} reconnects)",
        run["returns"]["delete_tpu_vm"]["deleted"] is True and stack.compute.instances() == [], run["state"],
        storage_has(run["returns"]["train"]["checkpoint"]), log_excerpt(run["logs"], "Lost SSH connection while polling"),
    )


# ---------------------------------------------------------------------------------------------- 2. resume


def test_killed_training_resumes_from_checkpoint_on_retry(faulted_run, stack, fault_matrix):
    run = faulted_run
    faults: _TrainFaults = run["faults"]
    assert faults.killed, "the trainer was never killed (training finished before the kill?)"
    assert any("train_sft" in cmd for _, cmd in faults.killed), faults.killed
    assert run["states"]["train"] == "success", _diagnose(run)
    assert run["tries"]["train"] == 2, _diagnose(run)

    # Try 1's job dir was set aside by the retry (same VM), with the trainer's exit code and its last steps.
    [try1_dir] = run["earlier_train_dirs"]
    assert (try1_dir / "exit_code").read_text().strip() == "137"
    try1_steps = [int(s) for s in _COMPLETED.findall((try1_dir / "stdout.log").read_bytes())]
    assert KILL_AFTER_STEP <= max(try1_steps) < STEPS, try1_steps

    # Try 2 restored a checkpoint of the same run (>= the first period) and did not restart from step 1.
    try2_log = (run["train_dir"] / "stdout.log").read_bytes()
    restored = [int(s) for s in re.findall(rb"Restored params from step: (\d+)", try2_log)]
    assert restored and restored[0] >= CHECKPOINT_PERIOD, restored
    try2_steps = [int(s) for s in _COMPLETED.findall(try2_log)]
    assert try2_steps and min(try2_steps) == restored[0] + 1 and max(try2_steps) == STEPS, try2_steps

    # What Airflow reports: the task log and the train XCom.
    assert re.search(rf"Restored params from step: {restored[0]}\b", run["logs"])
    assert f"SFT: {STEPS} steps (resumed from {restored[0]})" in run["logs"]
    metrics = run["returns"]["train"]["metrics"]
    assert metrics["resumed_from_step"] == restored[0] >= CHECKPOINT_PERIOD
    assert metrics["steps_completed"] == STEPS
    assert run["returns"]["train"]["checkpoint"].endswith(f"/checkpoints/{STEPS}/model_params")
    assert storage_has(run["returns"]["train"]["checkpoint"])
    # The retry reused the run's VMs: one instance insert each (TPU VM, the conversion's and the export's CPU VMs)
    # for the whole run.
    assert run["instance_inserts"] == len(VM_KINDS)
    _assert_vms_deleted_and_checkpoint_kept(run, stack)
    fault_matrix.record(
        f"MaxText: trainer SIGKILLed after step {KILL_AFTER_STEP} -> retry resumes from checkpoint",
        run["returns"]["delete_tpu_vm"]["deleted"] is True and stack.compute.instances() == [], run["state"],
        storage_has(run["returns"]["train"]["checkpoint"]),
        log_excerpt(run["logs"], f"SFT: {STEPS} steps (resumed from {restored[0]})"),
    )


def test_half_written_checkpoint_is_not_taken_for_a_finished_one(faulted_run, stack, fault_matrix):
    """After the kill, storage holds a half-written step STEPS: its objects, no commit_success.txt.

    That is what a save cut short leaves on GCS. The retry resumes from a committed step below it, writes step
    STEPS anew, and the train task counts the final checkpoint only with its commit file."""
    from airflow_tpu_posttrain.recipes.storage import committed_checkpoint

    run = faulted_run
    forged = run["faults"].forged
    assert forged and all(f"/checkpoints/{STEPS}/" in name for name in forged), forged
    assert run["states"]["train"] == "success", _diagnose(run)
    try2_log = (run["train_dir"] / "stdout.log").read_bytes()
    restored = [int(s) for s in re.findall(rb"Restored params from step: (\d+)", try2_log)]
    assert restored and restored[0] < STEPS, restored
    # Every forged object was replaced by the retry's own save of step STEPS (a new generation) or removed.
    rewritten = {name: gen for name, gen in run["forged_after"].items() if gen == forged[name]}
    assert not rewritten, rewritten
    checkpoint = run["returns"]["train"]["checkpoint"]
    assert checkpoint.endswith(f"/checkpoints/{STEPS}/model_params")
    assert storage_has(committed_checkpoint(checkpoint))
    _assert_vms_deleted_and_checkpoint_kept(run, stack)
    fault_matrix.record(
        f"storage: a half-written step {STEPS} (objects, no commit_success.txt) -> resumed from step "
        f"{restored[0]}, step {STEPS} written again",
        run["returns"]["delete_tpu_vm"]["deleted"] is True and stack.compute.instances() == [], run["state"], storage_has(committed_checkpoint(checkpoint)),
        f"{len(forged)} forged objects, {sum(g is None for g in run['forged_after'].values())} removed and "
        f"{sum(g is not None for g in run['forged_after'].values())} rewritten by the retry",
    )


# ---------------------------------------------------------------------------------------------- 3. token


def test_hf_token_leaks_nowhere(faulted_run, stack, fault_matrix):
    run = faulted_run
    assert run["state"] == "success", _diagnose(run)
    hub = run["returns"]["export_and_publish"]["hub"]
    assert hub["repo_id"] == "local/tiny-llama-sft" and hub["commit_sha"], hub  # the token was used

    # Task logs (and the trigger's, printed alongside by dag.test).
    assert "Started job train-" in run["logs"] and "Published to the Hub" in run["logs"]
    assert HF_TOKEN not in run["logs"]

    # Rendered template fields, as stored for the UI (RenderedTaskInstanceFields), of every task that ran.
    ran = {t for t, s in run["states"].items() if s == "success"}
    assert ran <= set(run["rendered"]), f"no rendered fields stored for {ran - set(run['rendered'])}"
    assert HF_TOKEN not in json.dumps(run["rendered"], default=str)

    # Every XCom of the run, not only return values.
    assert run["xcom"]
    assert HF_TOKEN not in json.dumps(run["xcom"], default=str)

    # The process list while the DAG ran (every 0.5 s; argv only).
    sampler: ProcessSampler = run["sampler"]
    assert sampler.samples >= 0.5 * run["seconds"], (sampler.samples, run["seconds"])
    assert sampler.leaks == []

    # Each VM's disk at its end (the token file was the export VM's): the token files are gone, no file of the VM
    # holds the token. The scans saw the jobs' files on every VM and the export root on the export VM.
    for kind, name in run["vms"].items():
        on_vm = run["vm_ends"][name]
        assert on_vm["workdir_files"], f"{kind} VM {name}: no files under {WORKDIR}"
        assert on_vm["secrets_left"] == [], (kind, on_vm["secrets_left"])
        assert on_vm["token_in"] == [], (kind, on_vm["token_in"])
    export_vm = run["vm_ends"][run["vms"]["export"]]
    assert export_vm["root_on_vm"], f"no {SEEDS_ROOT} on the export VM: the export was not scanned"
    _assert_vms_deleted_and_checkpoint_kept(run, stack)
    fault_matrix.record(
        "MaxText: HF token absent from logs, XCom, rendered fields, argv, VM files",
        run["returns"]["delete_tpu_vm"]["deleted"] is True, run["state"], bool(hub["commit_sha"]),
        f"0 hits; {sampler.samples} process-list samples; published {hub['repo_id']}"[:80],
    )


def test_gated_base_model_is_read_with_the_token(faulted_run, stack, fault_matrix):
    """The tiny model is a gated repo on the local Hub, as Gemma and Llama are on the real one.

    The conversion (weights), training and export (tokenizer) download it on the VMs with the token, which a
    download without it lacks."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError

    from airflow_tpu_posttrain.recipes.models import TINY_LLAMA_REPO

    run = faulted_run
    assert run["state"] == "success", _diagnose(run)
    downloads = [
        r for r in run["hub_requests"] if r.method == "GET" and r.path.startswith(f"/{TINY_LLAMA_REPO}/resolve/")
    ]
    fetched = [r.path.rsplit("/", 1)[-1] for r in downloads]
    assert "model.safetensors" in fetched, fetched  # the conversion read the weights from the Hub
    # Training (TPU VM) and export (export VM) each took the tokenizer into their VM's own cache.
    assert fetched.count("tokenizer.json") >= 2, fetched
    assert all(r.headers.get("authorization") == REDACTED for r in downloads), [r.path for r in downloads]

    with pytest.raises(GatedRepoError) as refused:  # the same download without the token
        hf_hub_download(TINY_LLAMA_REPO, "config.json", endpoint=stack.hub.url, token=False,
                        cache_dir=tempfile.mkdtemp(prefix="no-token-"))
    assert refused.value.response.status_code == 401
    fault_matrix.record(
        "Hub: gated base model read with the token by convert, train and export; without it 401 GatedRepo",
        run["returns"]["delete_tpu_vm"]["deleted"] is True, run["state"], True,
        f"{len(downloads)} downloads, all with the token ({fetched.count('tokenizer.json')} tokenizer, "
        f"{fetched.count('model.safetensors')} weights)",
    )


# ---------------------------------------------------------------------------------------------- 4. input


# A value ending in a newline: "$" in a Python pattern (jsonschema uses re.search) also matches before it.
INVALID_CONF = [
    pytest.param({"overrides": ["steps=1; rm -rf /"]}, "overrides", id="override-semicolon"),
    pytest.param({"overrides": ["learning_rate=1e-5\nrm -rf /"]}, "overrides", id="override-inner-newline"),
    pytest.param({"overrides": ["learning_rate=$(id)"]}, "overrides", id="override-subshell"),
    pytest.param({"dataset": "../etc"}, "dataset", id="dataset-dotdot"),
    pytest.param({"zones": ["us-east5-b && curl x"]}, "zones", id="zones-and"),
    pytest.param({"hub_repo_id": "a/b$(id)"}, "hub_repo_id", id="hub-subshell"),
    pytest.param({"hub_repo_id": "../b"}, "hub_repo_id", id="hub-dotdot"),
    pytest.param({"storage_uri": "/tmp/x;reboot"}, "storage_uri", id="storage-semicolon"),
    pytest.param({"train_split": "train`id`"}, "train_split", id="split-backtick"),
    pytest.param({"overrides": ["learning_rate=1e-5\n"]}, "overrides", id="override-trailing-newline"),
    pytest.param({"zones": ["local-cpu1-a\n"]}, "zones", id="zones-trailing-newline"),
    pytest.param({"hub_repo_id": "local/tiny\n"}, "hub_repo_id", id="hub-trailing-newline"),
]


@pytest.mark.parametrize(("conf", "field"), INVALID_CONF)
def test_unsafe_trigger_input_is_refused_before_any_api_call(stack, conf, field, request, fault_matrix):
    requests_before = len(stack.compute.requests)
    dag = _dag()
    # A distinct logical date per case; if validation wrongly passed, every task is only marked success, so a
    # failing case costs seconds and touches no API (the assertion below still fails).
    date = LOGICAL_DATE + timedelta(days=1 + INVALID_CONF_IDS.index(json.dumps(conf, sort_keys=True)))
    with _fixed_run_id(f"manual__invalid-{date:%Y%m%d}"), pytest.raises(Exception) as raised:
        dag.test(run_conf=conf, logical_date=date, mark_success_pattern=".*")
    assert type(raised.value).__name__ == "ParamValidationError", repr(raised.value)
    assert f"param {field}" in str(raised.value), str(raised.value)
    assert len(stack.compute.requests) == requests_before
    fault_matrix.record(
        f"hostile conf refused before any API call ({request.node.callspec.id})", None, "not created", None,
        str(raised.value).splitlines()[0][:80],
    )


INVALID_CONF_IDS = [json.dumps(p.values[0], sort_keys=True) for p in INVALID_CONF]


@pytest.mark.parametrize("check", ["zone", "reservation", "override_key"])
def test_operator_validation_refuses_trailing_newline(check):
    from airflow_tpu_posttrain.recipes import validation
    from airflow_tpu_posttrain.recipes.validation import SpecError

    calls = {
        "zone": lambda: validation.zone("zones[0]", "us-east5-b\n"),
        "reservation": lambda: validation.gce_name("reservation", "my-reservation\n"),
        "override_key": lambda: validation.override_pairs("overrides", ["steps\n=5"], reserved=frozenset({"steps"})),
    }
    with pytest.raises(SpecError):
        calls[check]()


# ---------------------------------------------------------------------------------------------- 2b. dead job


def test_job_that_died_with_its_wrapper_ends_the_watch(stack, fault_matrix):
    import asyncio

    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes.remote_job import JOB_DIED
    from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

    paths = RemoteJobPaths(job_id="dead-wrapper", remote_os="posix", base_dir=JOBS)
    with vm_of_its_own(stack, "dead-wrapper-vm") as machine:
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            vm.run(build_posix_wrapper_command("sleep 300", paths))
        pid_file = machine.vm.guest_path(paths.pid_file)
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The job and its wrapper (its session), killed from outside the VM, as the OOM killer of a cgroup.
        session = _vm_session(machine.vm, int(pid_file.read_text()))
        assert len(session) >= 2, session  # the wrapper and `sleep`
        for pid in session:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

        trigger = MaxTextJobTrigger(
            ssh_conn_id="local_vm", remote_host=machine.address, host_keys=machine.host_keys,
            job_id=paths.job_id, job_dir=paths.job_dir, log_file=paths.log_file,
            exit_code_file=paths.exit_code_file, remote_os="posix", poll_interval=1,
        )

        async def first_event():
            events = trigger.run()
            try:
                return await asyncio.wait_for(anext(events), timeout=15)
            finally:
                await events.aclose()

        event = asyncio.run(first_event())
    assert event.payload["done"] and event.payload["exit_code"] == JOB_DIED, event.payload
    fault_matrix.record(
        "MaxText: job killed with its wrapper (cgroup OOM) -> the watch ends", None, "trigger event: job died",
        None, f"payload done={event.payload['done']}, exit_code={event.payload['exit_code']}"[:80],
    )


# ---------------------------------------------------------------------------------------------- 5. re-run


_RERUN: dict = {}


@pytest.fixture
def rerun(faulted_run, stack, capfd):
    """The faulted run, run again to the end under the same run_id and logical date (once)."""
    if not _RERUN:
        checkpoint = faulted_run["returns"]["train"]["checkpoint"]
        before = {
            "checkpoints": _checkpoint_files(checkpoint),
            "requests": len(stack.compute.requests),
        }
        capfd.readouterr()
        copies = Path(tempfile.mkdtemp(prefix="maxtext-rerun-"))
        with before_vm_end(stack, _vm_end_probe(stack, copies)) as ends:
            dag_run = _run_pipeline({"steps": STEPS})
            logs = "".join(capfd.readouterr())
            (copies / "rerun.log").write_text(logs)  # the task logs, to read when a test fails
            tis = _tis(dag_run)
            returns = {task_id: _return_value(dag_run, task_id) for task_id in tis}
            vms = {kind: (returns.get(f"create_{kind}_vm") or {}).get("name") for kind in VM_KINDS}
            vm_end_error = _wait_gone(ends, vms)
        _RERUN.update(
            debug_log=copies / "rerun.log",
            dag_run=dag_run,
            state=dag_run.state,
            states=_states(dag_run),
            tis=tis,
            tries={task_id: ti.try_number for task_id, ti in tis.items()},
            returns=returns,
            logs=logs,
            before=before,
            checkpoints_after=_checkpoint_files(checkpoint),
            vms=vms,
            vm_ends=ends.seen,
            vm_end_error=vm_end_error,
            requests=stack.compute.requests[before["requests"]:],
            instances_after=stack.compute.instances(),
        )
    return _RERUN


def test_rerun_of_finished_run_reuses_training_and_conversion(faulted_run, rerun, fault_matrix):
    first = faulted_run
    assert first["state"] == "success", _diagnose(first)
    assert rerun["dag_run"].run_id == RUN_ID
    assert rerun["state"] == "success", rerun["states"]

    train, convert = rerun["returns"]["train"], rerun["returns"]["convert_to_maxtext"]
    assert train["reused"] is True and convert["reused"] is True, (train, convert)
    assert rerun["tries"]["train"] == 1
    train_ti = rerun["tis"]["train"]
    assert (train_ti.end_date - train_ti.start_date).total_seconds() < 60
    assert train["checkpoint"] == first["returns"]["train"]["checkpoint"]
    assert train["metrics"].get("steps_completed") == STEPS, (train["metrics"], rerun["debug_log"])
    assert "output already complete" in rerun["logs"] and f"SFT: {STEPS} steps" in rerun["logs"]
    # No training job was started again: the re-run's TPU VM (a new one: the first run's was deleted) never
    # got a train job, and the run's checkpoints in storage are untouched (same files, same times).
    assert rerun["vm_ends"][rerun["vms"]["tpu"]]["train_dirs"] == []
    assert rerun["checkpoints_after"] == rerun["before"]["checkpoints"]
    assert HF_TOKEN not in rerun["logs"]
    assert rerun["returns"]["delete_tpu_vm"]["deleted"] is True and rerun["instances_after"] == []
    assert rerun["vm_end_error"] is None, rerun["vm_end_error"]
    assert storage_has(train["checkpoint"])
    fault_matrix.record(
        "MaxText: re-run of a finished run reuses conversion and training",
        rerun["returns"]["delete_tpu_vm"]["deleted"] is True and rerun["instances_after"] == [], rerun["state"],
        storage_has(train["checkpoint"]), log_excerpt(rerun["logs"], "output already complete"),
    )


def test_rerun_creates_one_vm_at_first_try_and_deletes_it(faulted_run, rerun, fault_matrix):
    assert rerun["state"] == "success", rerun["states"]
    inserts = [r for r in rerun["requests"] if r["method"] == "POST" and r["path"].endswith("/instances")]
    # The first run's teardowns deleted its VMs, so the re-run creates exactly one of each (the same
    # deterministic names): the TPU VM, the conversion's CPU VM and the export's.
    vms = [(f"create_{kind}_vm", f"delete_{kind}_vm") for kind in VM_KINDS]
    for create, delete in vms:
        assert rerun["returns"][create]["name"] == faulted_run["returns"][create]["name"]
        assert rerun["returns"][delete]["deleted"] is True
        assert rerun["tries"][create] == 1, rerun["tries"]
    assert rerun["instances_after"] == [], [i["name"] for i in rerun["instances_after"]]
    assert rerun["vm_end_error"] is None, rerun["vm_end_error"]  # every VM's disk is gone
    assert sorted(r["body"]["name"] for r in inserts) == sorted(rerun["returns"][c]["name"] for c, _ in vms)
    fault_matrix.record(
        "MaxText: re-run creates each VM once at the first try, deletes them",
        rerun["instances_after"] == [], rerun["state"], None,
        f"{len(inserts)} instance inserts (TPU + 2 CPU VMs), create tries=1",
    )


# ---------------------------------------------------------------------------------------------- 6. export fidelity


def test_an_export_that_is_not_the_trained_model_fails_before_publishing_and_the_retry_publishes(
    faulted_run, fault_matrix
):
    """The first export has a tensor permuted (the local launcher's fault): loads, generates, is not the model trained.

    Try 1 fails on the fidelity check, naming both losses, before the export is kept or published (it is copied to
    ``<kept>.unfaithful`` for a look): the Hub gets one commit, the retry's, which exported again (the check dropped the
    export's marker) and checked its export."""
    run = faulted_run
    assert run["state"] == "success", _diagnose(run)
    assert run["tries"]["export_and_publish"] == 2, _diagnose(run)
    logs = run["logs"]
    assert logs.count("FAULT INJECTED: permute") == 1, log_excerpt(logs, "FAULT INJECTED")
    refused = re.search(
        r"the export's loss is (\d+\.\d+), MaxText's of the trained checkpoint (\d+\.\d+) \(weights rounded to "
        r"bfloat16\): they differ by (\S+) \(tolerance 1e-03\)", logs,
    )
    assert refused and refused[1] != refused[2], log_excerpt(logs, "export_fidelity")
    kept = run["returns"]["export_and_publish"]["kept_uri"]
    assert storage_has(f"{kept}.unfaithful/model.safetensors")  # try 1's export, kept for a look, never published
    assert not storage_has(f"{kept}.unfaithful.complete")
    commits = [r for r in run["hub_requests"] if r.method == "POST" and "/commit/" in r.path]
    assert len(commits) == 1, [r.path for r in commits]
    fidelity = run["returns"]["export_and_publish"]["validated"]["fidelity"]
    assert fidelity["faithful"] and fidelity["loss_gap"] <= 1e-5 and fidelity["max_token_gap"] <= 1e-4, fidelity
    fault_matrix.record(
        "export: a tensor permuted in the pipeline's export -> try 1 refused before keeping or publishing, the retry "
        "exports again and publishes", run["returns"]["delete_export_vm"]["deleted"] is True, run["state"], True,
        f"loss {refused[1]} vs MaxText's {refused[2]} (gap {refused[3]}); retry gap {fidelity['loss_gap']:.1e}",
    )
