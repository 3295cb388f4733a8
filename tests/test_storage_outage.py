"""Checkpoint storage unreachable in the middle of training, in real Airflow (dag.test) against the local stack.

MaxText's trainer does not fail soon when its checkpoint storage goes away: the training loop waits for a save
whose writes retry for minutes (measured with the tiny model: silent for 15 minutes, exit code 1 after 18;
docs/storage.md). The job watch stops a job whose log has not grown for ``stall_timeout_s`` (180 s locally; this
test's run STALL_TIMEOUT_S), the try fails, and the retry, with storage back, resumes from the newest checkpoint
that was committed (orbax's ``commit_success.txt``) before the outage.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import FOCUSED_RUN, log_excerpt, storage_has, storage_objects
from test_maxtext_faults import _COMPLETED, JOBS, _dag, _fixed_run_id, _return_value, _tis, _vm_session

from airflow_tpu_posttrain.local.gcs_server import START_TIMEOUT_S

DAG_ID = "posttrain_sft__tiny-llama"
RUN_ID = "manual__storage-outage"
LOGICAL_DATE = datetime(2026, 4, 5, 6, 7, 8, tzinfo=UTC)
STEPS = 20  # room for the outage to land while training still runs
OUTAGE_AFTER_STEP = 3
# The run's train task is stopped after STALL_TIMEOUT_S of silence, not the local entries' 180 s
# (pipelines/registry.py): the silence after the outage was most of this test's time. The trainer's longest healthy
# silence here (MaxText's start before its config dump, quality gate off) measured 24 s, and a resumed try's 9 s:
# 90 s leaves over 3x that. This run's steps outside the outage took as long in a full run (-n 2) as alone.
STALL_TIMEOUT_S = 90
# The retry starts once storage is back: the outage thread restarts the server within a second or two of the
# trainer's end, and the local entries' 5-s retry delay left a loaded machine too little room for that.
RETRY_DELAY = timedelta(seconds=20)

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


class _Outage(threading.Thread):
    """Stops the local GCS server mid-training, and starts it again once the job's processes are gone.

    It stops it once the train job on the TPU VM has logged step OUTAGE_AFTER_STEP and a step is committed in
    storage, and starts it again once none of the job's processes is left (the job watch stopped them)."""

    def __init__(self, stack, job_name: str) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.job_name = job_name
        self.stop = threading.Event()
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.try1_steps: list[int] = []
        self.committed_at_restart: list[int] = []
        self.outliving: list[str] = []  # the job's processes at the last look while storage was down
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as err:  # reported by the test
            self.error = err
            if self.down_at is not None and self.up_at is None:
                self.stack.gcs.start()

    def _job(self):
        for vm in self.stack.vms():
            try:
                job_dir = vm.guest_path(JOBS) / self.job_name
                if job_dir.is_dir():
                    return vm, job_dir
            except Exception:  # noqa: BLE001 - a VM not booted yet, or ending
                continue
        return None, None

    def _run(self) -> None:
        vm = job_dir = leader = None
        while not self.stop.is_set() and self.down_at is None:
            if job_dir is None:
                vm, job_dir = self._job()
            else:
                log = (job_dir / "stdout.log").read_bytes() if (job_dir / "stdout.log").exists() else b""
                steps = [int(s) for s in _COMPLETED.findall(log)]
                if steps and max(steps) >= OUTAGE_AFTER_STEP and _committed_steps():
                    leader = int((job_dir / "pid").read_text())
                    self.stack.gcs.stop()
                    self.down_at = time.monotonic()
                    self.try1_steps = steps
            time.sleep(0.05)
        while not self.stop.is_set() and self.up_at is None:
            members = _vm_session(vm, leader)
            self.outliving = [_describe(pid) for pid in members]
            if not members:
                self.stack.gcs.start()
                self.up_at = time.monotonic()
                self.committed_at_restart = _committed_steps()  # before the retry writes any
            time.sleep(0.5)


@pytest.mark.timeout(1800)
def test_storage_outage_mid_training_is_stopped_and_the_retry_resumes(stack, capfd, fault_matrix):
    from airflow_tpu_posttrain.recipes.compute import run_hash

    outage = _Outage(stack, f"train-{run_hash(DAG_ID, RUN_ID)}")
    capfd.readouterr()
    outage.start()
    dag = _dag()
    train_task = dag.get_task("train")  # dag.test() runs the tasks of this DAG object
    train_task.stall_timeout_s, train_task.retry_delay = STALL_TIMEOUT_S, RETRY_DELAY
    try:
        with _fixed_run_id(RUN_ID):
            dag_run = dag.test(run_conf={"steps": STEPS, **FOCUSED_RUN}, logical_date=LOGICAL_DATE)
    finally:
        outage.stop.set()
        outage.join(2 * START_TIMEOUT_S + 10)  # a restart that does not serve is reported as itself
    logs = "".join(capfd.readouterr())
    assert outage.error is None, outage.error
    assert outage.down_at is not None, "training ended before the outage"
    assert outage.up_at is not None, f"the trainer's processes outlived the run: {outage.outliving}"
    tis = _tis(dag_run)
    assert dag_run.state == "success", {task_id: ti.state for task_id, ti in tis.items()}
    assert tis["train"].try_number == 2
    assert max(outage.try1_steps) < STEPS, outage.try1_steps

    # Try 1 ended while storage was down: mostly the trainer goes silent and the watch stops it; when the outage
    # catches a checkpoint save at another moment, its log keeps growing and it fails on its own (exit code 1) before
    # a stall's silence (runs of 2026-12-01: 2 of 4 each way). The watch's stop itself is tested in test_reattach.py.
    stalled = f"no output from the job on the VM for {STALL_TIMEOUT_S} s"
    failed = re.search(r"SFT failed on the VM with exit code \d+", logs)
    assert stalled in logs or failed, logs[-3000:]
    if stalled in logs:
        # The clock ran from the trainer's last line (its clients' errors came after the outage began), not before.
        assert outage.up_at - outage.down_at >= STALL_TIMEOUT_S
    how = log_excerpt(logs, stalled if stalled in logs else failed[0], width=68)

    # The retry resumed from the newest step committed before the outage and trained to the end.
    train = _return_value(dag_run, "train")
    resumed = train["metrics"].get("resumed_from_step")
    committed = outage.committed_at_restart
    assert committed and resumed == max(committed), (resumed, committed, outage.try1_steps)
    assert train["metrics"]["steps_completed"] == STEPS
    assert train["checkpoint"].endswith(f"/checkpoints/{STEPS}/model_params") and storage_has(train["checkpoint"])
    assert _return_value(dag_run, "delete_tpu_vm")["deleted"] is True
    assert stack.compute.instances() == []
    ended = f"stopped after {STALL_TIMEOUT_S} s silent" if stalled in logs else "the trainer failed"
    fault_matrix.record(
        f"storage: GCS unreachable after step {max(outage.try1_steps)} -> {ended}, retry resumes from step "
        f"{resumed}",
        stack.compute.instances() == [],
        dag_run.state,
        storage_has(train["checkpoint"]),
        f"down {outage.up_at - outage.down_at:.0f} s; {how}",
    )
