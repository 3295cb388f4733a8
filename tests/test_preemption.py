"""A SPOT TPU VM preempted mid-training, in real Airflow (dag.test) against the local stack.

The emulator preempts the instance (STOPPING, its machine and every process on it gone, then TERMINATED) once
the trainer has logged step PREEMPT_AT_STEP. The training task tells the loss from an SSH error by asking
Compute, creates the VM again through the DAG's own create and install tasks, and training resumes from the
newest checkpoint in storage, in the same try. Slow: real MaxText on CPU."""

from __future__ import annotations

import contextlib
import re
import threading
import time

from conftest import log_excerpt, storage_has
from test_pipeline_local import WORKDIR, run_pipeline, states

DAG_ID = "posttrain_sft__tiny-llama"
STEPS = 10
PREEMPT_AT_STEP = 5
CHECKPOINT_PERIOD = 2  # the local DAGs' (registry.py: the local entries' checkpoint_period)
_COMPLETED = re.compile(rb"completed step: (\d+),")
_RESTORED = re.compile(rb"Restored params from step: (\d+)")


class _Preempter(threading.Thread):
    """Preempts the TPU VM when its train job has logged PREEMPT_AT_STEP.

    Then waits for training on the VM made again, and keeps both VMs' train logs."""

    def __init__(self, stack) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.stop = threading.Event()
        self.preempted_at: float | None = None
        self.training_again_at: float | None = None
        self.lost_vm = None
        self.logs: dict[str, bytes] = {}  # "lost" / "recovered" -> the train job's log
        self.error: BaseException | None = None

    def _train_log(self, vm) -> bytes:
        with contextlib.suppress(Exception):  # not booted yet, or ending
            for job in vm.guest_path(f"{WORKDIR}/jobs").glob("train-*"):
                if job.is_dir():  # not its scripts (train-<id>.sh, train-<id>.step.sh)
                    return (job / "stdout.log").read_bytes()
        return b""

    def _tpu_vms(self):
        return [vm for vm in self.stack.vms() if vm.name.startswith("tpu-")]

    def run(self) -> None:
        try:
            while not self.stop.wait(0.05):
                if self.preempted_at is None:
                    for vm in self._tpu_vms():
                        log = self._train_log(vm)
                        if any(int(s) >= PREEMPT_AT_STEP for s in _COMPLETED.findall(log)):
                            self.logs["lost"] = log
                            [instance] = [i for i in self.stack.compute.instances() if i["name"] == vm.name]
                            self.stack.compute.preempt(instance["zone"].rsplit("/", 1)[-1], vm.name)
                            self.preempted_at, self.lost_vm = time.monotonic(), vm
                else:
                    for vm in self._tpu_vms():
                        if vm is self.lost_vm:
                            continue
                        log = self._train_log(vm)
                        if _COMPLETED.search(log):
                            self.training_again_at = self.training_again_at or time.monotonic()
                            self.logs["recovered"] = log
        except BaseException as err:  # reported by the test
            self.error = err


def test_preempted_training_vm_is_created_again_and_training_resumes(stack, capfd, tmp_path, fault_matrix):

    inserts_before = sum(1 for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances"))
    preempter = _Preempter(stack)
    capfd.readouterr()
    preempter.start()
    try:
        dag_run = run_pipeline(DAG_ID, {"steps": STEPS, "provisioning_model": "SPOT"})
    finally:
        preempter.stop.set()
        preempter.join(10)
    logs = "".join(capfd.readouterr())
    (tmp_path / "run.log").write_text(logs)  # for a failure's diagnosis
    assert preempter.error is None, preempter.error
    assert preempter.preempted_at is not None, "the TPU VM was never preempted (training ended first?)"

    assert dag_run.state == "success", (states(dag_run), f"log: {tmp_path / 'run.log'}")
    [train] = [ti for ti in dag_run.get_task_instances() if ti.task_id == "train"]
    assert train.try_number == 1, "the recovery is part of the try the loss interrupted: no retry spent"
    assert re.search(r"Recovery 1/3: VM tpu-\S+ (is (STOPPING|TERMINATED)|no longer exists)", logs), logs[-5000:]

    # The VM was made again (same name, SPOT), and MaxText installed on it, inside the training task.
    inserts = [
        r for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances")
    ][inserts_before:]
    tpu_inserts = [r["body"] for r in inserts if r["body"]["name"].startswith("tpu-")]
    assert len(tpu_inserts) == 2 and tpu_inserts[0]["name"] == tpu_inserts[1]["name"]
    assert all(body["scheduling"]["provisioningModel"] == "SPOT" for body in tpu_inserts)
    assert "Recovered VM" in logs and "MaxText is ready on the recovered VM" in logs

    # Training resumed from a checkpoint of the lost VM's run, written to storage before the preemption.
    lost_steps = [int(s) for s in _COMPLETED.findall(preempter.logs["lost"])]
    recovered = preempter.logs.get("recovered") or b""
    restored = [int(s) for s in _RESTORED.findall(recovered)]
    assert restored and CHECKPOINT_PERIOD <= restored[0] <= max(lost_steps), (restored, lost_steps)
    assert min(int(s) for s in _COMPLETED.findall(recovered)) == restored[0] + 1
    repeated = max(lost_steps) - restored[0]
    metrics = train.xcom_pull(task_ids="train")["metrics"]
    assert metrics["resumed_from_step"] == restored[0] and metrics["steps_completed"] == STEPS
    checkpoint = train.xcom_pull(task_ids="train")["checkpoint"]
    assert storage_has(checkpoint)
    # The quality gate's base numbers were measured before step 1 on the lost VM and kept in storage as the log
    # showed them: the resumed process's first evaluation is of the checkpoint it resumed from, a trained model.
    evaluation = train.xcom_pull(task_ids="train")["evaluation"]
    base = re.search(rb"Completed eval after train step 0, loss=([0-9.]+)", preempter.logs["lost"])
    assert base and evaluation["base"] == {"eval_loss": float(base[1])}, evaluation
    assert re.search(rb"Completed eval after train step %d, loss=" % restored[0], recovered)
    assert not re.search(rb"Completed eval after train step 0,", recovered)
    assert "Done: keeping the base model's evaluation at gs://" in logs
    assert f"The base model's evaluation {evaluation['base']}, kept at gs://" in logs
    assert [step for step, _ in metrics["eval_losses"]] == [restored[0], STEPS]
    verdict = [ti for ti in dag_run.get_task_instances() if ti.task_id == "quality_gate"][0].xcom_pull(
        task_ids="quality_gate"
    )
    assert verdict["base"] == evaluation["base"]["eval_loss"] and verdict["trained"] == evaluation["trained"]["eval_loss"]

    # Nothing left: the teardown deleted the VM made again; no firewall rule either.
    assert stack.compute.instances() == [] and stack.compute.firewalls() == []
    seconds = preempter.training_again_at - preempter.preempted_at
    print(f"preemption at step {max(lost_steps)}: resumed from {restored[0]}, {repeated} steps repeated, "
          f"{seconds:.1f} s from preemption to training again")
    fault_matrix.record(
        f"preemption: SPOT TPU VM preempted at step {max(lost_steps)} -> created again, training resumed",
        True, dag_run.state, storage_has(checkpoint),
        f"{log_excerpt(logs, 'Recovery 1/3', 50)}; resumed from step {restored[0]} ({repeated} steps "
        f"repeated), training again {seconds:.0f} s after the preemption",
    )
