"""The SFT twin on a local multi-host slice, end to end in real Airflow (dag.test) against the local stack.

A v6e-16 slice (its create and teardown exactly the cloud entry's) whose VMs are 2 local machines standing for its 4
(the emulator's ``local_slice_vms``, docs/local-stand-ins.md): the same MaxText command on both, each one JAX
process, joined through MaxText's CPU path (``jax.distributed``). Slow: real MaxText on CPU, twice at once."""

from __future__ import annotations

import re
import subprocess
import threading
import time

import pytest
from conftest import REPO, storage_objects
from test_pipeline_local import SFT_TWIN, WORKDIR, assert_succeeded, before_vm_end, run_pipeline, states, xcom

from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

SLICE_DAG = f"posttrain_sft__{SFT_TWIN}__slice"
STEPS = 5  # the local entries' SFT steps
# Each process holds its own rows of the global batch without packing: the rows one process with both would hold.
SAME_BATCHES = "packing=false"  # a MaxText override (the overrides Param is a list of them)
LOSS_TOLERANCE = 2e-3  # bfloat16 activations: the same batch on 2 devices of 2 processes or on 1 sums in another order
_LOSS = re.compile(r"completed step: (\d+), .*? loss: ([0-9.]+)")
_COMPLETED = re.compile(rb"completed step: (\d+),")


def _single_process_losses(tmp_path, converted_dir: str) -> dict[int, float]:
    """The twin's SFT steps in ONE process on this machine, with the slice's global batch (2 rows per step).

    Built by the same builder from the conversion the slice trained from (``converted_dir`` in checkpoint
    storage, copied here) and the seeded dataset, on the same MaxText release's venv (local/stack.py's ``maxtext-venv-0.2.2``), trained
    with ``per_device_batch_size=2``."""
    from google.cloud import storage

    from airflow_tpu_posttrain.recipes import maxtext
    from airflow_tpu_posttrain.recipes.accelerators import accelerator
    from airflow_tpu_posttrain.recipes.layout import RunLayout
    from airflow_tpu_posttrain.recipes.models import model_profile
    from airflow_tpu_posttrain.recipes.runtime import cpu_runtime

    bucket, _, prefix = converted_dir.removeprefix("gs://").partition("/")
    local_copy = tmp_path / "converted"
    for blob in storage.Client().list_blobs(bucket, prefix=f"{prefix}/0/"):
        target = local_copy / blob.name[len(prefix) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        blob.download_to_filename(target)
    local = REPO / ".local"
    model = model_profile(SFT_TWIN)
    spec = maxtext.RunSpec(
        model=model,
        accelerator=accelerator("cpu"),
        runtime=cpu_runtime(str(local / "vm-launchers"), str(local / f"maxtext-venv-{model.maxtext_version}")),
        layout=RunLayout(SFT_TWIN, "single-process", str(tmp_path)),
    )
    train = maxtext.train_sft(
        spec, steps=STEPS, per_device_batch_size=2, overrides=[SAME_BATCHES],
        converted_params=str(local_copy / "0" / "items"),
    )
    # The files the VM copied from the local Hub: the same repos' files as the local stack seeded them.
    script = train.script().replace(spec.layout.base_model_files_dir, str(local / "tiny" / "tiny-gemma3"))
    script = script.replace(spec.layout.dataset_dir, str(local / "tiny" / "datasets" / "tiny-chats"))
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    return {int(step): float(loss) for step, loss in _LOSS.findall(said)}


_COMMITTED = re.compile(r"^post-train/[^/]+/checkpoints/(\d+)/commit_success\.txt$")


def _committed_steps(skip: set[str]) -> list[int]:
    """The training steps whose checkpoint orbax committed to the local storage (objects in ``skip`` left out)."""
    return [
        int(m.group(1)) for o in storage_objects(LOCAL_CHECKPOINT_STORAGE) if o not in skip and (m := _COMMITTED.match(o))
    ]


class _SliceBreaker(threading.Thread):
    """Preempts worker 1 of the slice once worker 0 has logged step ``at_step`` and a checkpoint is committed.

    The committed training checkpoint in storage is what the resume must start from. Worker ids are what the instances' metadata servers tell (not their names' order). It looks twice a second, at
    worker 0's log only: the VMs' processes share this machine's two CPUs with it."""

    def __init__(self, stack, at_step: int) -> None:
        super().__init__(daemon=True)
        self.stack, self.at_step = stack, at_step
        self.stop = threading.Event()
        self.lost: str | None = None
        self.committed_at_loss = 0  # the newest committed training checkpoint when the VM was lost
        self._earlier = set(storage_objects(LOCAL_CHECKPOINT_STORAGE))  # earlier runs' objects
        self.log_at_loss = b""  # worker 0's training log when the VM was lost
        self.error: BaseException | None = None
        self._roots: dict[str, object] = {}  # VM name -> its root as this machine reads it

    def _workers(self) -> dict[int, dict]:
        """The slice's live instances by worker id."""
        workers = {}
        for instance in self.stack.compute.instances():
            _, project, _, zone, _, name = instance["selfLink"].rsplit("/", 5)
            told = self.stack.compute.guest_attributes((project, zone, name)).get("worker-id")  # its metadata server's
            if name.startswith("tpu-") and told is not None:
                workers[int(told)] = instance
        return workers

    def _train_log(self, name: str) -> bytes:
        try:
            if name not in self._roots:
                [vm] = [vm for vm in self.stack.vms() if vm.name == name]
                self._roots[name] = vm.guest_path("/")
            for job in (self._roots[name] / WORKDIR.lstrip("/") / "jobs").glob("train-*"):
                if job.is_dir():
                    return (job / "stdout.log").read_bytes()
        except (OSError, ValueError, RuntimeError):  # not booted yet, or ended: looked up again next time
            self._roots.pop(name, None)
        return b""

    def run(self) -> None:
        try:
            while not self.stop.wait(0.5):
                workers = self._workers()
                if 0 not in workers:
                    continue
                log = self._train_log(workers[0]["name"])
                if 1 in workers:
                    committed = any(int(s) >= self.at_step for s in _COMPLETED.findall(log)) and _committed_steps(
                        self._earlier
                    )
                    if committed:
                        self.committed_at_loss = max(committed)
                        self.log_at_loss = log
                        victim = workers[1]
                        self.stack.compute.preempt(victim["zone"].rsplit("/", 1)[-1], victim["name"])
                        self.lost = victim["name"]
                        return
        except BaseException as err:  # reported by the test
            self.error = err


@pytest.mark.timeout(1500)  # a slice of VMs trains, loses one, is made again and resumes; then export and check
def test_a_slice_trains_as_one_process_and_when_it_loses_a_vm_is_made_again_and_resumes(
    stack, capfd, tmp_path, fault_matrix
):
    """A slice made together, trained by one JAX process per VM, made again when it loses a VM, resumed.

    Then published and deleted whole. The loss of each step before the loss is a single process's on the same batches. One run for both: a slice
    training is the suite's costliest."""
    breaker = _SliceBreaker(stack, at_step=3)
    groups_before = sum(
        1 for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instanceGroupManagers")
    )
    capfd.readouterr()
    breaker.start()
    try:
        with before_vm_end(stack, lambda vm: None) as ends:
            dr = run_pipeline(
                SLICE_DAG, {"force": True, "storage_uri": str(stack.published_dir), "overrides": [SAME_BATCHES]}
            )
            logs = "".join(capfd.readouterr())
            (tmp_path / "run.log").write_text(logs)
            assert_succeeded(dr, logs)
            made = xcom(dr, "create_tpu_vm")
            cpu_vms = [xcom(dr, create)["name"] for create in ("create_cpu_vm", "create_export_vm")]
            ends.wait_gone([vm["name"] for vm in made["vms"]] + cpu_vms)
    finally:
        breaker.stop.set()
        breaker.join(10)
    assert breaker.error is None, breaker.error
    assert breaker.lost, "no VM of the slice was lost (training ended first?)"
    assert made["accelerator_type"] == "v6e-16" and made["machine_type"] == "ct6e-standard-4t"
    assert [vm["worker_id"] for vm in made["vms"]] == [0, 1]
    # One program over both VMs: MaxText's mesh spans the two processes' devices, gloo joined worker 0 to its peer.
    assert "Num_devices: 2" in logs and "Rank 0 is connected to 1 peer ranks" in logs
    [train] = [ti for ti in dr.get_task_instances() if ti.task_id == "train"]
    assert train.try_number == 1, "the recovery is part of the try the loss interrupted"
    assert re.search(r"Recovery 1/\d+: Slice tpu-\S+ in us-east5-b lost a VM", logs), logs[-5000:]
    # The slice was made again whole: a second group inserted under the same name, MaxText on both new VMs.
    groups = [
        r["body"] for r in stack.compute.requests
        if r["method"] == "POST" and r["path"].endswith("/instanceGroupManagers")
    ][groups_before:]
    assert len(groups) == 2 and groups[0]["name"] == groups[1]["name"]
    # Training resumed from a checkpoint the broken slice committed to storage.
    lost_steps = [int(s) for s in _COMPLETED.findall(breaker.log_at_loss)]
    trained = xcom(dr, "train")
    metrics = trained["metrics"]
    restored = metrics["resumed_from_step"]  # MaxText's "Restored params from step" of the slice made again
    assert breaker.committed_at_loss <= restored <= max(lost_steps), (restored, breaker.committed_at_loss, lost_steps)
    assert metrics["steps_completed"] == STEPS
    # Each process of the slice made again wrote its part of the final checkpoint; process 0 committed it.
    run = trained["run_name"]
    objects = storage_objects(LOCAL_CHECKPOINT_STORAGE)
    assert f"post-train/{run}/checkpoints/{STEPS}/commit_success.txt" in objects
    for process in (0, 1):
        assert any(f"checkpoints/{STEPS}/model_params/ocdbt.process_{process}/" in o for o in objects), process
    assert f"exports/{run}/model.safetensors" in objects
    # Nothing of either slice is left: no VM, group, template or workload policy.
    deleted = xcom(dr, "delete_tpu_vm")
    assert (deleted["deleted"], deleted["vms"]) == (True, 2)
    deadline = time.monotonic() + 120
    while stack.compute.instances() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stack.compute.instances() == []
    assert states(dr)["delete_tpu_vm"] == "success"
    # The steps the first slice trained are one process's on the same batches, from the same conversion.
    on_slice = {int(step): float(loss) for step, loss in _LOSS.findall(breaker.log_at_loss.decode())}
    converted = xcom(dr, "convert_to_maxtext")["converted_params"].removesuffix("/0/items")
    alone = _single_process_losses(tmp_path, converted)
    assert sorted(alone) == list(range(1, STEPS + 1)) and sorted(on_slice) == lost_steps, (on_slice, alone)
    assert all(abs(on_slice[step] - alone[step]) <= LOSS_TOLERANCE for step in on_slice), (on_slice, alone)
    fault_matrix.record(
        "Slice: one VM of a v6e-16 slice preempted mid-training -> the slice is made again, training resumes",
        True, dr.state, True,
        f"resumed from step {restored} of {max(lost_steps)} done; {len(groups)} groups made, none left; "
        f"steps 1-{max(lost_steps)} within {LOSS_TOLERANCE} of one process's loss",
    )
