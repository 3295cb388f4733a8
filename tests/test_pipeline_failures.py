"""Failures of each step of the tiny SFT DAG end to end in real Airflow (dag.test) against the local stack.

The stack: Compute emulator whose every instance is a machine of its own, real MaxText on CPU, the local Hub
server.

Every fault is injected through the environment the pipeline runs in, never by patching its code:

- create: every zone of the DAG out of capacity (the emulator's stock-out fault);
- install: a MaxText version that does not exist (``maxtext_version`` in the run's conf);
- convert: the checkpoint bucket missing (deleted from the local GCS server for the run, made again after);
- train: an override MaxText's config rejects (``overrides`` in the run's conf; unknown keys are an error);
- export and publish (in ``test_pipeline_reruns.py``, with the per-model backfill: a file of its own so that the
  test workers share the slow runs): a regular file where the exports' parent directory goes, then the Hub
  refusing the upload; each re-run goes on from what the last one kept.

The DAG has the split layout: a CPU VM converts, the TPU VM trains, another CPU VM (made after the training)
exports. Each failed run must end FAILED with the watcher failed, every VM it made deleted (by their teardowns, or,
when a create itself fails, by the create), nothing left in the emulator and nothing of the VMs on this machine;
the failed task's log must say what failed.
What is on a VM's disk is looked at just before the VM is destroyed (``stack.fleet.before_end``).

One stack for the module (its VMs' disks and checkpoint storage in a fresh temp dir); SFT runs with 2 steps.
Slow (minutes).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from conftest import FOCUSED_RUN, REPO, log_excerpt
from test_pipeline_local import SEEDS_ROOT, WORKDIR, VmEnds

from airflow_tpu_posttrain.local.stack import LOCAL_LOGIN

DAG_ID = "posttrain_sft__tiny-llama"
STEPS = 2
BODY_STEPS = (
    "install_maxtext_cpu", "install_maxtext", "convert_to_maxtext", "train", "install_maxtext_export", "export_and_publish"
)
# The run's VMs: the TPU VM and the conversion's CPU VM, made at its start; the export's, made after the training.
VMS = (("create_tpu_vm", "delete_tpu_vm"), ("create_cpu_vm", "delete_cpu_vm"), ("create_export_vm", "delete_export_vm"))
WATCHER = "fail_run_if_a_step_failed"


# ---------------------------------------------------------------------------------------------- helpers


def _dag():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag(DAG_ID)


def run_pipeline(conf: dict | None = None, logical_date: datetime | None = None, run_id: str | None = None):
    """One run of the SFT DAG with ``steps`` = STEPS.

    A ``run_id`` pins it, as conftest.run_dag does, so the same logical date and run_id is a re-run of that
    DAG run."""
    from airflow.models.dagrun import DagRun

    kwargs: dict = {"run_conf": {"steps": STEPS, **FOCUSED_RUN, **(conf or {})}}
    if logical_date is not None:
        kwargs["logical_date"] = logical_date
    with pytest.MonkeyPatch.context() as mp:
        if run_id:
            mp.setattr(DagRun, "generate_run_id", staticmethod(lambda **_: run_id))
        return _dag().test(**kwargs)


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def xcom(dag_run, task_id):
    [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == task_id]
    return ti.xcom_pull(task_ids=task_id)


def instance_inserts(stack, name: str | None = None) -> list[dict]:
    inserts = [r for r in stack.compute.requests if r["method"] == "POST" and r["path"].endswith("/instances")]
    return [r for r in inserts if name is None or (r["body"] or {}).get("name") == name]


def local_zones() -> list[str]:
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    [cfg] = [cfg for cfg in load_registry(REPO / "dags" / "models.yaml") if cfg.dag_id == DAG_ID]
    return list(cfg.zones)


def root() -> Path:
    """The run files' root on each VM (production's ``/dev/shm/<model>``): the export VM exports there."""
    return Path(SEEDS_ROOT)


def checkpoint_storage(stack) -> str:
    """The local DAGs' checkpoint storage: the local GCS server's bucket (registry: checkpoint_storage)."""
    from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

    return LOCAL_CHECKPOINT_STORAGE


def _vm_end_probe(vm) -> dict:
    """What the module needs of each VM's disk, read just before the VM is destroyed.

    Its jobs' exit codes and the exports under the root (``{export dir: its file names}``)."""
    jobs = vm.guest_path(f"{WORKDIR}/jobs")
    exit_codes = {f.parent.name: f.read_text().strip() for f in jobs.glob("*/exit_code")}
    exports_parent = vm.guest_path(str(root() / "hf-trained"))
    exports = {
        str(root() / "hf-trained" / d.name): sorted(p.name for p in d.iterdir())
        for d in (exports_parent.iterdir() if exports_parent.is_dir() else [])
        if d.is_dir()
    }
    return {"exit_codes": exit_codes, "exports": exports}


class _ModuleVmEnds(VmEnds):
    """Every VM of the module, probed at its end (a name can come back: the re-run's VM)."""

    def __init__(self, fleet) -> None:
        super().__init__(fleet, _vm_end_probe)
        self.history: list[tuple[str, dict]] = []

    def __call__(self, vm) -> None:
        errors = len(self.errors)
        super().__call__(vm)
        if len(self.errors) == errors:
            self.history.append((vm.name, self.seen[vm.name]))

    def forget(self) -> None:
        """Before a run whose VMs may have the names of earlier ones (a re-run)."""
        self.seen.clear()
        self.disks.clear()


@pytest.fixture(scope="module")
def vm_ends(stack):
    ends = _ModuleVmEnds(stack.fleet)
    stack.fleet.before_end = ends
    try:
        yield ends
    finally:
        stack.fleet.before_end = None


@pytest.fixture(autouse=True)
def _each_vm_probed(vm_ends):
    """Every test's VMs are probed at their end; none of the module's ending probes failed."""
    vm_ends.forget()
    yield
    assert vm_ends.errors == [], vm_ends.errors


def assert_vms_gone(vm_ends, dr) -> None:
    """The VMs the run made were probed just before their end, and nothing of them is left on this machine."""
    names = [xcom(dr, create)["name"] for create, _ in VMS if states(dr)[create] == "success"]
    vm_ends.wait_gone(names)


@contextlib.contextmanager
def file_in_place_of_on_export_vm(stack, guest_path: Path, timeout: float = 900.0):
    """As soon as the run's export VM is up, a regular file where ``guest_path`` goes.

    The file is the VM login's; ``guest_path`` is a directory the pipeline writes on that VM. Yields the names
    of the VMs it was put on (one, once the run is over)."""
    placed: list[str] = []
    stop = threading.Event()

    def place() -> None:
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            for vm in stack.vms():
                if not vm.name.startswith("export-"):
                    continue
                with contextlib.suppress(Exception):  # not booted yet
                    target = vm.guest_path(str(guest_path))
                    owner = pwd.getpwnam(LOCAL_LOGIN)
                    for parent in reversed(guest_path.parents[:-2]):  # below /dev/shm, as the login makes it
                        directory = vm.guest_path(str(parent))
                        directory.mkdir(exist_ok=True)
                        os.chown(directory, owner.pw_uid, owner.pw_gid)
                    target.write_text("not a directory: a fault injected by test_pipeline_failures\n")
                    os.chown(target, owner.pw_uid, owner.pw_gid)
                    placed.append(vm.name)
                    return
            stop.wait(0.2)

    placer = threading.Thread(target=place, daemon=True)
    placer.start()
    try:
        yield placed
    finally:
        stop.set()
        placer.join(10)


def _delete_bucket(name: str) -> None:
    """The bucket and its objects gone, as a user's deleted bucket (or a typo in its name) leaves it."""
    from google.cloud import storage

    bucket = storage.Client().bucket(name)
    for blob in list(bucket.list_blobs()):
        blob.delete()
    bucket.delete()


@contextlib.contextmanager
def bucket_missing(stack, after_the_check: bool = False):
    """The checkpoint storage's bucket deleted for the run, made again afterwards.

    ``after_the_check``: deleted once the run's inputs check has seen it, as a bucket deleted while the run
    starts (the VM-side steps must then fail naming it, never take it for "not cached")."""
    from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator
    from airflow_tpu_posttrain.pipelines.registry import LOCAL_BUCKET

    with pytest.MonkeyPatch.context() as mp:
        if after_the_check:
            check = InputsCheckOperator.execute

            def check_then_lose_the_bucket(self, context):
                inputs = check(self, context)
                _delete_bucket(LOCAL_BUCKET)
                return inputs

            mp.setattr(InputsCheckOperator, "execute", check_then_lose_the_bucket)
        else:
            _delete_bucket(LOCAL_BUCKET)
        try:
            yield f"gs://{LOCAL_BUCKET}"
        finally:
            stack.gcs.create_bucket(LOCAL_BUCKET)


def assert_failed_cleanly(stack, vm_ends, dr, failed_step: str) -> None:
    """The run failed at ``failed_step``, and cleanly.

    The steps after it did not run, the watcher failed the run, the teardowns deleted every VM it made (a VM made
    after the failed step was never made), the emulator holds nothing and nothing of the VMs is left on this
    machine."""
    st = states(dr)
    assert dr.state == "failed", st
    assert st[failed_step] == "failed", st
    after = set(_dag().get_task(failed_step).get_flat_relative_ids(upstream=False))
    assert all(st[step] == "upstream_failed" for step in after & set(BODY_STEPS)), st
    for create, delete in VMS:
        assert st[delete] == "success", st
        deleted = xcom(dr, delete)
        if create in after:
            assert st[create] == "upstream_failed" and deleted["deleted"] is False, (st, deleted)
        else:
            assert st[create] == "success", st
            assert deleted["deleted"] is True and deleted["name"] == xcom(dr, create)["name"]
    assert st[WATCHER] == "failed", st
    assert stack.compute.instances() == []
    assert_vms_gone(vm_ends, dr)


def successful_conversions(vm_ends) -> int:
    """Conversion jobs that finished with exit code 0 on a VM, over the whole module.

    Every VM's jobs, read just before the VM's end."""
    return sum(
        1
        for _, seen in vm_ends.history
        for job, code in seen["exit_codes"].items()
        if job.startswith("convert-to-maxtext-") and code == "0"
    )


# ------------------------------------------------------------------------------------- a fault per step


def test_create_fails_when_every_zone_is_out_of_capacity(stack, capfd, fault_matrix):
    zones = local_zones()
    inserts_before = len(instance_inserts(stack))
    stack.compute.set_faults(stockout_zones=zones)
    try:
        dr = run_pipeline()
    finally:
        stack.compute.set_faults(stockout_zones=[])
    logs = "".join(capfd.readouterr())
    st = states(dr)
    assert dr.state == "failed", st
    assert all(st[step] == "upstream_failed" for step in BODY_STEPS), st
    assert st["create_export_vm"] == "upstream_failed", st
    for create, delete in VMS[:2]:  # locally both VMs are the "cpu" shape: both are out of capacity
        assert st[create] == "failed", st
        # The create cleans up after itself; its teardown still runs (a failed create may have inserted its VM)
        # and finds nothing left to delete.
        assert st[delete] == "success", st
        assert xcom(dr, delete)["deleted"] is False
    tried: dict[str, list[str]] = {}  # each VM's inserts (by its name's prefix), their zones in order
    for request in instance_inserts(stack)[inserts_before:]:
        zone = request["path"].split("/zones/")[1].split("/")[0]
        tried.setdefault(request["body"]["name"].split("-", 1)[0], []).append(zone)
    # Each try went through every zone in order (retries=1: two tries) and left nothing behind: the CPU VM's both;
    # the TPU VM's (requested just in time) until a try found the conversion failed already, upstream of the CPU
    # VM's stock-out, and asked for nothing. How many of its tries came first is the two creates' race.
    assert tried["cpu"] == zones * 2
    assert tried.get("tpu", []) in ([], zones, zones * 2), tried
    if len(tried.get("tpu", [])) < 2 * len(zones):
        assert "this try requested no TPU VM" in logs
    inserts = sum(len(zones_tried) for zones_tried in tried.values())
    assert st[WATCHER] == "failed", st
    assert stack.compute.instances() == []
    assert "No cpu capacity in any zone" in logs and "No instance was left behind" in logs
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in logs
    fault_matrix.record(
        "pipeline: create, every zone out of capacity -> each zone tried per try, every insert rolled back",
        stack.compute.instances() == [], dr.state, None,
        (f"{inserts} inserts; " + log_excerpt(logs, "No cpu capacity in any zone"))[:80],
    )


def test_a_token_without_the_gated_models_grant_fails_before_any_vm(stack, capfd, fault_matrix):
    """A token without the grant of the gated base model: the run fails at its first task, before any VM.

    The model is gated as Gemma and Llama are: the Hub shows its card but refuses its files."""
    from airflow_tpu_posttrain.recipes.models import TINY_LLAMA_REPO

    inserts_before = len(instance_inserts(stack))
    stack.hub.revoke(stack.hf_token, TINY_LLAMA_REPO)
    try:
        dr = run_pipeline({"force": True})
    finally:
        stack.hub.grant(stack.hf_token, TINY_LLAMA_REPO)
    logs = "".join(capfd.readouterr())
    st = states(dr)
    assert dr.state == "failed", st
    assert st["check_inputs"] == "failed", st
    assert all(st[step] == "upstream_failed" for step in (*BODY_STEPS, *(create for create, _ in VMS))), st
    assert len(instance_inserts(stack)) == inserts_before and stack.compute.instances() == []
    assert f"The model {TINY_LLAMA_REPO} is gated and the token of connection 'local_hub' has no access" in logs
    assert "accept the licence at" in logs and "No VM was created" in logs
    assert stack.hf_token not in logs
    # One try: no retry can grant access.
    [check] = [ti for ti in dr.get_task_instances() if ti.task_id == "check_inputs"]
    assert check.try_number == 1
    fault_matrix.record(
        "pipeline: the token has no grant for the gated base model (no VM created)", None, dr.state, None,
        log_excerpt(logs, f"The model {TINY_LLAMA_REPO} is gated"),
    )


def test_a_hub_repo_the_token_cannot_write_fails_before_any_vm(stack, capfd, fault_matrix):
    """The export would find out after the training; check_inputs asks the Hub who the token is first."""
    inserts_before = len(instance_inserts(stack))
    dr = run_pipeline({"force": True, "hub_repo_id": "someone-else/tiny-llama-sft"})
    logs = "".join(capfd.readouterr())
    st = states(dr)
    assert dr.state == "failed" and st["check_inputs"] == "failed", st
    assert all(st[step] == "upstream_failed" for step in (*BODY_STEPS, *(create for create, _ in VMS))), st
    assert len(instance_inserts(stack)) == inserts_before and stack.compute.instances() == []
    assert (
        "The model cannot be published to someone-else/tiny-llama-sft: the token of connection 'local_hub' belongs "
        "to 'local', who may write in 'local' only" in logs
    )
    assert "No VM was created" in logs and stack.hf_token not in logs
    fault_matrix.record(
        "pipeline: the token cannot write the Hub repo to publish to (no VM created)", None, dr.state, None,
        log_excerpt(logs, "The model cannot be published to"),
    )


def test_install_fails_on_a_maxtext_version_that_does_not_exist(stack, vm_ends, capfd, fault_matrix):
    dr = run_pipeline({"maxtext_version": "9.9.9"})
    logs = "".join(capfd.readouterr())
    assert_failed_cleanly(stack, vm_ends, dr, "install_maxtext")
    assert "Install failed on the VM with exit code" in logs
    # The remote log says what was asked for and that uv refused it: streamed by the trigger while the job runs and
    # by the task ("[remote]") for its last chunk, so look at both. The reason is no such version, or, where the VM
    # cannot reach PyPI, the failed fetch of the index.
    assert "Installing maxtext[tpu]==9.9.9" in logs
    assert re.search(r"error: (No solution found|Failed to fetch)", logs), logs[-2000:]
    fault_matrix.record(
        "pipeline: install, MaxText version that does not exist", stack.compute.instances() == [], dr.state, None,
        log_excerpt(logs, "Install failed on the VM with exit code"),
    )


def test_a_run_whose_checkpoint_bucket_is_missing_fails_its_check_before_any_vm(stack, capfd, fault_matrix):
    inserts_before = len([r for r in stack.compute.requests if r["method"] == "POST"])
    with bucket_missing(stack) as bucket:
        dr = run_pipeline()
    logs = "".join(capfd.readouterr())
    st = states(dr)
    assert dr.state == "failed" and st["check_inputs"] == "failed", st
    assert {st[t] for t in (*(create for create, _ in VMS), "convert_to_maxtext", "train")} == {"upstream_failed"}
    assert f"checkpoint_storage: the bucket {bucket} does not exist" in logs and "No VM was created." in logs
    assert len([r for r in stack.compute.requests if r["method"] == "POST"]) == inserts_before  # no VM, no rule
    fault_matrix.record(
        "pipeline: checkpoint bucket missing at the start", stack.compute.instances() == [], dr.state, None,
        log_excerpt(logs, "checkpoint_storage: the bucket"),
    )


def test_convert_fails_when_the_checkpoint_bucket_is_missing(stack, vm_ends, capfd, fault_matrix):
    with bucket_missing(stack, after_the_check=True) as bucket:
        dr = run_pipeline()
    logs = "".join(capfd.readouterr())
    assert_failed_cleanly(stack, vm_ends, dr, "convert_to_maxtext")
    # Storage could not be asked whether the conversion is cached: an error naming the URI and the answer, never
    # "not cached" (which would convert into a bucket that is not there).
    assert f"StorageError: could not check {checkpoint_storage(stack)}/conversions/tiny-llama/" in logs
    assert "NotFound" in logs and bucket.removeprefix("gs://") in logs
    fault_matrix.record(
        "pipeline: convert, checkpoint bucket deleted after the check", stack.compute.instances() == [], dr.state, None,
        log_excerpt(logs, "StorageError: could not check"),
    )


def test_an_override_maxtext_does_not_define_fails_the_check_before_any_vm(stack, capfd, fault_matrix):
    """MaxText would refuse the key once its trainer started, after the VMs, the install and the conversion.

    check_inputs refuses it from the release's own key list, naming the field, the key and the closest keys."""
    inserts_before = len(instance_inserts(stack))
    dr = run_pipeline({"force": True, "overrides": ["learning_rate=1e-5", "learnin_rate=1e-5"]})
    logs = "".join(capfd.readouterr())
    st = states(dr)
    assert dr.state == "failed" and st["check_inputs"] == "failed", st
    assert all(st[step] == "upstream_failed" for step in (*BODY_STEPS, *(create for create, _ in VMS))), st
    assert len(instance_inserts(stack)) == inserts_before and stack.compute.instances() == []
    assert "overrides[1]='learnin_rate=1e-5': sets 'learnin_rate', which MaxText 0.2.5's SFT trainer does not " \
        "define" in logs
    assert "(closest: learning_rate" in logs and "No VM was created" in logs
    fault_matrix.record(
        "pipeline: an override MaxText does not define (no VM created)", None, dr.state, None,
        log_excerpt(logs, "sets 'learnin_rate'"),
    )
