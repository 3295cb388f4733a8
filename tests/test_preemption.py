"""A training that loses its checkpoint storage, then its SPOT TPU VM, in real Airflow (dag.test), one run.

1. Storage goes away mid-training. MaxText's trainer does not fail soon when its checkpoint storage goes away: the
   training loop waits for a save whose writes retry for minutes (measured with the tiny model: silent for 15
   minutes, exit code 1 after 18; docs/storage.md). The job watch stops a job whose log has not grown for
   ``stall_timeout_s`` (180 s locally; this run's STALL_TIMEOUT_S), the try fails, and the retry, with storage back,
   resumes from the newest checkpoint that was committed (orbax's ``commit_success.txt``) before the outage.
2. The retry's TPU VM is preempted: the emulator preempts the instance (STOPPING, its machine and every process on
   it gone, then TERMINATED) once the trainer has logged step PREEMPT_AT_STEP. The training task tells the loss
   from an SSH error by asking Compute, creates the VM again through the DAG's own create and install tasks, and
   training resumes from the newest checkpoint in storage, in the same try.

One training for both (they took 490 s and 410 s apart). Slow: real MaxText on CPU."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import log_excerpt, storage_has, storage_objects
from test_maxtext_faults import DAG_ID, JOBS, _dag, _fixed_run_id, _return_value, _tis, _vm_session

from airflow_tpu_posttrain.local.gcs_server import START_TIMEOUT_S

RUN_ID = "manual__training-losses"
LOGICAL_DATE = datetime(2026, 4, 5, 6, 7, 8, tzinfo=UTC)
STEPS = 20  # room for the outage to land in try 1, and the preemption in try 2, while training still runs
OUTAGE_AFTER_STEP = 3
PREEMPT_AT_STEP = 12  # of try 2, which resumed from a step committed before the outage (at most a few)
CHECKPOINT_PERIOD = 2  # the local DAGs' (registry.py: the local entries' checkpoint_period)
# The run's train task is stopped after STALL_TIMEOUT_S of silence, not the local entries' 180 s
# (pipelines/registry.py): the silence after the outage was most of this test's time. The trainer's longest healthy
# silence (MaxText's start before its config dump) measured 24 s, and a resumed try's 9 s: 90 s leaves over 3x that.
STALL_TIMEOUT_S = 90
# The retry starts once storage is back: the outage thread restarts the server within a second or two of the
# trainer's end, and the local entries' 5-s retry delay left a loaded machine too little room for that.
RETRY_DELAY = timedelta(seconds=20)
_COMPLETED = re.compile(rb"completed step: (\d+),")
_RESTORED = re.compile(rb"Restored params from step: (\d+)")

pytestmark = pytest.mark.maxtext


def _committed_steps() -> list[int]:
    """The training steps in the local checkpoint storage whose save orbax committed.

    Committed: with ``commit_success.txt``. This module's stack holds one run."""
    from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

    names = storage_objects(LOCAL_CHECKPOINT_STORAGE)
    return sorted({int(m[1]) for name in names if (m := re.search(r"/checkpoints/(\d+)/commit_success\.txt$", name))})


def _describe(pid: int) -> str:
    """A process as ``pid (state, process group pgid): argv`` (this machine's pids), for a failure message."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"
    state, _, pgid = stat.rsplit(")", 1)[1].split()[:3]
    return f"{pid} ({state}, process group {pgid}): {argv[:200]}"


def _job_log(vm, job_name: str) -> bytes:
    """The train job's log on ``vm`` (the current try's: an earlier try's job folder was renamed)."""
    with contextlib.suppress(Exception):  # not booted yet, or ending
        return (vm.guest_path(JOBS) / job_name / "stdout.log").read_bytes()
    return b""


def _tpu_vms(stack):
    return [vm for vm in stack.vms() if vm.name.startswith("tpu-")]


class _Losses(threading.Thread):
    """Stops storage mid-training (up again once try 1's processes are gone), then preempts try 2's TPU VM.

    The preemption comes once try 2 has logged PREEMPT_AT_STEP; the logs of every phase are kept."""

    def __init__(self, stack, job_name: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.job_name = stack, job_name
        self.stop = threading.Event()
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.preempted_at: float | None = None
        self.training_again_at: float | None = None
        self.committed_at_restart: list[int] = []
        self.outliving: list[str] = []  # try 1's processes at the last look while storage was down
        self.logs: dict[str, bytes] = {}  # "try 1", "lost" (try 2 on the preempted VM), "recovered"
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._outage()
            self._preemption()
        except BaseException as err:  # reported by the test
            self.error = err
            if self.down_at is not None and self.up_at is None:
                self.stack.gcs.start()

    def _waiting(self) -> bool:
        time.sleep(0.05)
        return not self.stop.is_set()

    def _outage(self) -> None:
        vm = leader = None
        while self._waiting() and self.down_at is None:
            for candidate in _tpu_vms(self.stack):
                log = _job_log(candidate, self.job_name)
                steps = [int(s) for s in _COMPLETED.findall(log)]
                if steps and max(steps) >= OUTAGE_AFTER_STEP and _committed_steps():
                    vm, leader = candidate, int((candidate.guest_path(JOBS) / self.job_name / "pid").read_text())
                    self.stack.gcs.stop()
                    self.down_at = time.monotonic()
        while self._waiting() and self.up_at is None:
            members = _vm_session(vm, leader)
            self.outliving = [_describe(pid) for pid in members]
            if not members:
                self.logs["try 1"] = _job_log(vm, self.job_name)
                self.stack.gcs.start()
                self.up_at = time.monotonic()
                self.committed_at_restart = _committed_steps()  # before the retry writes any
            time.sleep(0.5)

    def _preemption(self) -> None:
        lost = None
        while self._waiting() and self.preempted_at is None:
            for vm in _tpu_vms(self.stack):
                log = _job_log(vm, self.job_name)
                if _RESTORED.search(log) and any(int(s) >= PREEMPT_AT_STEP for s in _COMPLETED.findall(log)):
                    self.logs["lost"], lost = log, vm
                    [instance] = [i for i in self.stack.compute.instances() if i["name"] == vm.name]
                    self.stack.compute.preempt(instance["zone"].rsplit("/", 1)[-1], vm.name)
                    self.preempted_at = time.monotonic()
        while self._waiting():
            for vm in _tpu_vms(self.stack):
                log = _job_log(vm, self.job_name) if vm is not lost else b""
                if _COMPLETED.search(log):
                    self.training_again_at = self.training_again_at or time.monotonic()
                    self.logs["recovered"] = log


@pytest.mark.timeout(1800)
def test_a_training_resumes_after_a_storage_outage_and_again_after_its_tpu_vm_is_preempted(
    stack, capfd, tmp_path, fault_matrix
):
    from airflow_tpu_posttrain.recipes.compute import run_hash

    inserts_before = sum(1 for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances"))
    losses = _Losses(stack, f"train-{run_hash(DAG_ID, RUN_ID)}")
    capfd.readouterr()
    losses.start()
    dag = _dag()
    train_task = dag.get_task("train")  # dag.test() runs the tasks of this DAG object
    train_task.stall_timeout_s, train_task.retry_delay = STALL_TIMEOUT_S, RETRY_DELAY
    try:
        with _fixed_run_id(RUN_ID):
            dag_run = dag.test(
                run_conf={"steps": STEPS, "provisioning_model": "SPOT", "force": True}, logical_date=LOGICAL_DATE
            )
    finally:
        losses.stop.set()
        losses.join(2 * START_TIMEOUT_S + 10)  # a restart that does not serve is reported as itself
    logs = "".join(capfd.readouterr())
    (tmp_path / "run.log").write_text(logs)  # for a failure's diagnosis
    assert losses.error is None, losses.error
    assert losses.down_at is not None, "training ended before the outage"
    assert losses.up_at is not None, f"the trainer's processes outlived the run: {losses.outliving}"
    assert losses.preempted_at is not None, "the TPU VM was never preempted (training ended first?)"
    tis = _tis(dag_run)
    assert dag_run.state == "success", ({task_id: ti.state for task_id, ti in tis.items()}, f"log: {tmp_path / 'run.log'}")
    assert tis["train"].try_number == 2, "the outage failed try 1; the preemption's recovery is part of try 2"

    # 1. Try 1 ended while storage was down: mostly the trainer goes silent and the watch stops it; when the outage
    # catches a checkpoint save at another moment, its log keeps growing and it fails on its own (exit code 1) before
    # a stall's silence (runs of 2026-12-01: 2 of 4 each way). The watch's stop itself is tested in test_reattach.py.
    try1_steps = [int(s) for s in _COMPLETED.findall(losses.logs["try 1"])]
    assert max(try1_steps) < PREEMPT_AT_STEP, try1_steps
    stalled = f"no output from the job on the VM for {STALL_TIMEOUT_S} s"
    failed = re.search(r"SFT failed on the VM with exit code \d+", logs)
    assert stalled in logs or failed, logs[-3000:]
    if stalled in logs:
        # The clock ran from the trainer's last line (its clients' errors came after the outage began), not before.
        assert losses.up_at - losses.down_at >= STALL_TIMEOUT_S
    how = log_excerpt(logs, stalled if stalled in logs else failed[0], width=68)
    # Try 2 resumed from the newest step committed before the outage.
    committed = losses.committed_at_restart
    resumed_after_outage = int(_RESTORED.search(losses.logs["lost"])[1])
    assert committed and resumed_after_outage == max(committed), (resumed_after_outage, committed, try1_steps)

    # 2. The VM was made again (same name, SPOT), and MaxText installed on it, inside try 2.
    assert re.search(r"Recovery 1/3: VM tpu-\S+ (is (STOPPING|TERMINATED)|no longer exists)", logs), logs[-5000:]
    inserts = [r for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances")]
    tpu_inserts = [r["body"] for r in inserts[inserts_before:] if r["body"]["name"].startswith("tpu-")]
    assert len(tpu_inserts) == 2 and tpu_inserts[0]["name"] == tpu_inserts[1]["name"]
    assert all(body["scheduling"]["provisioningModel"] == "SPOT" for body in tpu_inserts)
    assert "Recovered VM" in logs and "MaxText is ready on the recovered VM" in logs
    # Training resumed from a checkpoint of the lost VM's try, written to storage before the preemption.
    lost_steps = [int(s) for s in _COMPLETED.findall(losses.logs["lost"])]
    recovered = losses.logs.get("recovered") or b""
    restored = [int(s) for s in _RESTORED.findall(recovered)]
    assert restored and resumed_after_outage + CHECKPOINT_PERIOD <= restored[0] <= max(lost_steps), (restored, lost_steps)
    assert min(int(s) for s in _COMPLETED.findall(recovered)) == restored[0] + 1
    repeated = max(lost_steps) - restored[0]
    train = _return_value(dag_run, "train")
    metrics = train["metrics"]
    assert metrics["resumed_from_step"] == restored[0] and metrics["steps_completed"] == STEPS
    assert train["checkpoint"].endswith(f"/checkpoints/{STEPS}/model_params") and storage_has(train["checkpoint"])
    # The quality gate's base numbers were measured before step 1 in try 1 and kept in storage as its log showed
    # them: each resumed process's first evaluation is of the checkpoint it resumed from, a trained model.
    evaluation = train["evaluation"]
    base = re.search(rb"Completed eval after train step 0, loss=([0-9.]+)", losses.logs["try 1"])
    assert base and evaluation["base"] == {"eval_loss": float(base[1])}, evaluation
    assert re.search(rb"Completed eval after train step %d, loss=" % restored[0], recovered)
    assert not re.search(rb"Completed eval after train step 0,", losses.logs["lost"] + recovered)
    assert f"The base model's evaluation {evaluation['base']}, kept at gs://" in logs
    assert [step for step, _ in metrics["eval_losses"]] == [restored[0], STEPS]
    verdict = _return_value(dag_run, "quality_gate")
    assert verdict["base"] == evaluation["base"]["eval_loss"] and verdict["trained"] == evaluation["trained"]["eval_loss"]

    # Nothing left: the teardown deleted the VM made again; no firewall rule either.
    assert _return_value(dag_run, "delete_tpu_vm")["deleted"] is True
    assert stack.compute.instances() == [] and stack.compute.firewalls() == []
    seconds = losses.training_again_at - losses.preempted_at
    print(f"outage after step {max(try1_steps)}: try 2 resumed from {resumed_after_outage}; preemption at step "
          f"{max(lost_steps)}: resumed from {restored[0]}, {repeated} steps repeated, {seconds:.1f} s from preemption "
          "to training again")
    ended = f"stopped after {STALL_TIMEOUT_S} s silent" if stalled in logs else "the trainer failed"
    fault_matrix.record(
        f"storage: GCS unreachable after step {max(try1_steps)} -> {ended}, retry resumes from step "
        f"{resumed_after_outage}",
        stack.compute.instances() == [], dag_run.state, storage_has(train["checkpoint"]),
        f"down {losses.up_at - losses.down_at:.0f} s; {how}",
    )
    fault_matrix.record(
        f"preemption: SPOT TPU VM preempted at step {max(lost_steps)} -> created again, training resumed",
        True, dag_run.state, storage_has(train["checkpoint"]),
        f"{log_excerpt(logs, 'Recovery 1/3', 50)}; resumed from step {restored[0]} ({repeated} steps "
        f"repeated), training again {seconds:.0f} s after the preemption",
    )
