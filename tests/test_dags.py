"""The post-training DAGs as the DAG processor sees them: loading, shape, setup/teardown, timeouts, Params.

No servers and no metadata DB: the DAG file is parsed with a DagBag (``TPU_POSTTRAIN_LOCAL_DIR`` set, so the
local CPU DAGs appear too) and everything is checked on the parsed objects.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shlex
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_tpu_posttrain.defaults import MAX_WAIT_IN_LINE_HOURS
from airflow_tpu_posttrain.operators.recovery import create_task_id

REPO = Path(__file__).resolve().parents[1]
DAGS_DIR = REPO / "dags"

SFT_GEMMA = "posttrain_sft__gemma3-4b"
RL_LLAMA = "posttrain_rl__llama3.1-8b-Instruct"
SFT_TINY = "posttrain_sft__tiny-llama"
RL_TINY = "posttrain_rl__tiny-llama"
SEEDS_TINY = "posttrain_sft__tiny-llama__seeds"  # the tutorials' layout: every step on the TPU VM
SFT_SLICE = "posttrain_sft__gemma3-4b__slice"  # its TPU VMs a multi-host slice (v6e-16)
SFT_LORA = "posttrain_sft__gemma3-4b__lora"  # LoRA adapters on MaxText 0.2.5, published as a PEFT adapter
CLOUD_DAGS = (SFT_GEMMA, RL_LLAMA, SFT_SLICE, SFT_LORA)
# The local twins of the cloud DAGs: their commands on a tiny Gemma 3 / Llama 3.1 Instruct (tests/test_twins.py).
SFT_TWIN, RL_TWIN = "posttrain_sft__tiny-gemma3-4b", "posttrain_rl__tiny-llama3.1-8b-Instruct"
SLICE_TWIN = "posttrain_sft__tiny-gemma3-4b__slice"  # the SFT twin on a local slice
LORA_TWIN = "posttrain_sft__tiny-gemma3-4b__lora"
LOCAL_DAGS = (SFT_TINY, RL_TINY, SEEDS_TINY, SFT_TWIN, RL_TWIN, SLICE_TWIN, LORA_TWIN)
ALL_DAGS = CLOUD_DAGS + LOCAL_DAGS
BY_HAND = "sft_tutorial_by_hand"  # the operators wired by hand (dags/sft_tutorial_by_hand.py), the wheel's example
SPLIT_DAGS = (SFT_GEMMA, RL_LLAMA, SFT_SLICE, SFT_LORA, SFT_TINY, RL_TINY, SFT_TWIN, RL_TWIN, SLICE_TWIN, LORA_TWIN)

CREATE, DELETE, WATCHER = "create_tpu_vm", "delete_tpu_vm", "fail_run_if_a_step_failed"
CREATE_CPU, DELETE_CPU, INSTALL_CPU = "create_cpu_vm", "delete_cpu_vm", "install_maxtext_cpu"  # the conversion's
CREATE_EXPORT, DELETE_EXPORT, INSTALL_EXPORT = "create_export_vm", "delete_export_vm", "install_maxtext_export"
# The split layout's VMs: (create, install, delete) of the TPU VM, the conversion's CPU VM and the export's.
SPLIT_VMS = ((CREATE, "install_maxtext", DELETE), (CREATE_CPU, INSTALL_CPU, DELETE_CPU),
             (CREATE_EXPORT, INSTALL_EXPORT, DELETE_EXPORT))
INSTALL = "install_maxtext"
BODY = ("install_maxtext", "convert_to_maxtext", "train", "export_and_publish")
CHECK = "check_inputs"  # first: a run with the inputs of the last published model creates nothing
GATE = "quality_gate"  # between the training and the export: needs no VM, and takes no time worth a timeout's share
ON_TPU = ("install_maxtext", "train")  # split layout: the steps on the TPU VM; the others run on a CPU VM
POOL = "tpu_vms"

# Modules that must never be imported while the DAG file is parsed (the DAG processor re-parses it often).
HEAVY_MODULES = ("google.cloud.compute_v1", "jax", "huggingface_hub", "googleapiclient")


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    from airflow.dag_processing.dagbag import DagBag

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_POSTTRAIN_LOCAL_DIR", str(tmp_path_factory.mktemp("local")))
        mp.delenv("TPU_POSTTRAIN_VM_DIR", raising=False)
        bag = DagBag(dag_folder=str(DAGS_DIR))
    return bag


@pytest.fixture(scope="module")
def dags(dagbag):
    # bag.dags, not bag.get_dag(): get_dag() looks the DAG up in the metadata DB first.
    return dagbag.dags


@pytest.fixture(autouse=True)
def _deployment(configured_deployment):
    """The tasks rendered here run outside a task process."""


def _task_ids(tasks) -> set[str]:
    return {t.task_id for t in tasks}


# -- loading -------------------------------------------------------------------------------------------------


def test_all_dags_load_without_import_errors(dagbag):
    assert not dagbag.import_errors, dagbag.import_errors
    assert set(dagbag.dags) == {*ALL_DAGS, BY_HAND, "tpu_vm_reaper"}


def test_reaper_sweeps_each_connection_and_project_once(dagbag):
    """Over every zone (aggregatedList): a run's zones are a Param, not the registry's defaults."""
    reaper = dagbag.dags["tpu_vm_reaper"]
    sweeps = {(t.gcp_conn_id, t.project_id) for t in reaper.tasks}
    assert sweeps == {("google_cloud_default", None), ("local_compute", "local-project")}
    assert reaper.schedule == timedelta(minutes=10) and reaper.catchup is False


def test_local_dags_only_with_local_dir(monkeypatch):
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    monkeypatch.delenv("TPU_POSTTRAIN_LOCAL_DIR", raising=False)
    assert {c.dag_id for c in load_registry(DAGS_DIR / "models.yaml")} == set(CLOUD_DAGS)


def test_registry_refuses_a_split_layout_without_checkpoint_storage():
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    with pytest.raises(ValueError, match="checkpoint_storage=None: is required by the split layout"):
        PipelineConfig(model="gemma3-4b", recipe="sft")
    with pytest.raises(ValueError, match="layout='tpu-only'"):
        PipelineConfig(model="gemma3-4b", recipe="sft", layout="tpu-only", checkpoint_storage="gs://bkt/x")
    # The tutorials' layout needs no storage, but the cap takes its places in one: no cap, or a place to take them.
    with pytest.raises(ValueError, match="capacity_claims=None: is needed with max_tpu_vms=1 and no checkpoint_storage"):
        PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds")
    seeds = PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", max_tpu_vms=None)
    assert seeds.dag_id == "posttrain_sft__gemma3-4b__seeds"
    capped = PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", capacity_claims="gs://bkt/places")
    assert capped.places_location == "gs://bkt/places"
    split = PipelineConfig(model="gemma3-4b", recipe="sft", checkpoint_storage="gs://bkt/x/y")
    assert split.places_location == "gs://bkt/tpu-capacity"  # the bucket's, whatever the deployment's prefix


def test_registry_names_no_pool_unless_told():
    """No pool by default: Airflow never runs a task of a pool that does not exist, and says so only in a log."""
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    assert PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", max_tpu_vms=None).tpu_pool is None
    with pytest.raises(ValueError, match="tpu_pool='tpu vms'"):
        PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", max_tpu_vms=None, tpu_pool="tpu vms")


def test_registry_refuses_a_model_without_a_profile():
    """Refused when the DAG file is parsed: else both VMs of a split run would be made before a step fails."""
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    with pytest.raises(ValueError, match="model='gemma-4b': is not a known model"):
        PipelineConfig(model="gemma-4b", recipe="sft", layout="seeds")


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_tags_and_doc(dags, dag_id):
    dag = dags[dag_id]
    recipe, model = dag_id.removeprefix("posttrain_").split("__")[:2]
    assert {"tpu", "maxtext", recipe, model} <= set(dag.tags)
    assert ("local" in dag.tags) == (dag_id in LOCAL_DAGS)
    assert dag.doc_md and model in dag.doc_md and "delete" in dag.doc_md
    assert ("CPU VM" in dag.doc_md) == (dag_id in SPLIT_DAGS)


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_serializes_like_the_dag_processor(dags, dag_id):
    """What the API server and the scheduler get: the serialized DAG keeps the tasks and the Params' schemas."""
    from airflow.serialization.serialized_objects import DagSerialization

    dag = dags[dag_id]
    restored = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    assert set(restored.task_ids) == set(dag.task_ids)
    assert restored.get_task(CREATE).is_setup and restored.get_task(DELETE).is_teardown
    for key in dag.params:
        assert restored.params.get_param(key).schema == dag.params.get_param(key).schema, key


# -- structure -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_setup_teardown_pair(dags, dag_id):
    dag = dags[dag_id]
    pairs = SPLIT_VMS if dag_id in SPLIT_DAGS else [(CREATE, INSTALL, DELETE)]
    for setup_id, install_id, teardown_id in pairs:
        create, delete = dag.get_task(setup_id), dag.get_task(teardown_id)
        assert create.is_setup and not create.is_teardown
        assert delete.is_teardown and not delete.is_setup
        assert delete.on_failure_fail_dagrun  # a VM that could not be deleted makes the run FAILED, not green
        # The pairing: the teardown's setups are its VM's create and install, and it deletes the create's VM.
        assert sorted(t.task_id for t in delete.upstream_list if t.is_setup) == sorted([setup_id, install_id])
        assert delete.create_task_id == setup_id and delete.name_prefix == create.name_prefix
        # Also after a failed create (Airflow's default for teardowns wants a setup's success): it may have
        # inserted its VM. Only a skipped run (inputs unchanged: no create ran) has nothing to delete.
        assert delete.trigger_rule == "none_skipped"
    assert sorted(t.task_id for t in dag.tasks if t.is_setup) == sorted(s for p in pairs for s in p[:2])
    assert sorted(t.task_id for t in dag.tasks if t.is_teardown) == sorted(d for *_, d in pairs)
    # Every step that uses the TPU VM is in its setup's scope: downstream of create, upstream of delete.
    create, delete = dag.get_task(CREATE), dag.get_task(DELETE)
    for task_id in ON_TPU if dag_id in SPLIT_DAGS else BODY:
        assert task_id in create.get_flat_relative_ids(upstream=False)
        assert task_id in delete.get_flat_relative_ids(upstream=True)


def _cleared_vms(dags, dag_id: str, step: str) -> list[tuple[str, str]]:
    """The (create, install) pairs the UI's "Clear" of ``step`` re-runs, asserted to include each install."""
    cleared = set(dags[dag_id].partial_subset([step], include_downstream=True, include_upstream=False).task_ids)
    vms = SPLIT_VMS if dag_id in SPLIT_DAGS else [(CREATE, INSTALL, DELETE)]
    recreated = [(create, install) for create, install, _ in vms if create in cleared]
    assert recreated, cleared  # the step runs on a VM that the clear re-creates
    for create, install in recreated:
        assert install in cleared, f"clearing {step} re-creates {create} without {install}: {sorted(cleared)}"
    assert {delete for create, _, delete in vms if create in cleared} <= cleared  # and deletes them again
    return recreated


@pytest.mark.parametrize("dag_id", ALL_DAGS)
@pytest.mark.parametrize("step", ["train", "export_and_publish"])
def test_clearing_a_step_recreates_its_vms_with_maxtext(dags, dag_id, step):
    """Each VM that the UI's "Clear" of one step re-creates gets MaxText again.

    The clear re-runs the step's downstream and the setups in its scope; without the install among them the
    fresh VM has no MaxText and every try fails."""
    _cleared_vms(dags, dag_id, step)


@pytest.mark.parametrize("dag_id", SPLIT_DAGS)
def test_clearing_the_export_makes_an_export_vm_and_no_conversion_vm(dags, dag_id):
    """The UI's Clear of the export re-runs it on a fresh export VM; the conversion (in storage) stays done."""
    recreated = _cleared_vms(dags, dag_id, "export_and_publish")
    assert recreated == [(CREATE_EXPORT, INSTALL_EXPORT)]
    assert (CREATE_CPU, INSTALL_CPU) not in _cleared_vms(dags, dag_id, "train")


@pytest.mark.parametrize("dag_id", [d for d in ALL_DAGS if d not in SPLIT_DAGS])
def test_seeds_layout_chain(dags, dag_id):
    dag = dags[dag_id]
    chain = (CHECK, CREATE, *BODY[:3], GATE, BODY[3], DELETE)
    for up, down in itertools.pairwise(chain):
        assert up in dag.get_task(down).upstream_task_ids, f"{up} >> {down} is missing"
    assert dag.get_task(CHECK).upstream_task_ids == set() and dag.get_task(CREATE).upstream_task_ids == {CHECK}
    assert dag.get_task(BODY[0]).upstream_task_ids == {CREATE}
    assert set(dag.task_ids) == {*chain, WATCHER}
    assert all(dag.get_task(t).checkpoint_storage is None for t in BODY)


@pytest.mark.parametrize("dag_id", SPLIT_DAGS)
def test_split_layout_frees_the_tpu_right_after_training(dags, dag_id):
    dag = dags[dag_id]
    upstream = {t.task_id: t.upstream_task_ids for t in dag.tasks}
    assert set(dag.task_ids) == {CHECK, *(t for vm in SPLIT_VMS for t in vm), *BODY, GATE, WATCHER}
    # The CPU VM converts while the TPU VM is created and installed; training needs both. Neither is created
    # when the inputs are those of the last published model.
    assert upstream[CHECK] == set() and upstream[CREATE] == upstream[CREATE_CPU] == {CHECK}
    # Each step is wired to its VM by the create's XComArg (``vm=create.output``): the create is its upstream.
    assert upstream[INSTALL_CPU] == {CREATE_CPU} and upstream["convert_to_maxtext"] == {INSTALL_CPU, CREATE_CPU, CHECK}
    assert upstream["install_maxtext"] == {CREATE}
    # The conversion's VM goes as soon as the conversion is in storage: its teardown follows the conversion
    # directly, no TPU VM task between (it idles neither through the TPU VM's wait in line nor its training).
    assert upstream[DELETE_CPU] == {CREATE_CPU, INSTALL_CPU, "convert_to_maxtext"}
    assert not set(dag.get_task(DELETE_CPU).get_flat_relative_ids(upstream=True)) & {CREATE, INSTALL, "train"}
    # The training reads the dataset at the revision the check recorded (wired as the check's XComArg).
    assert upstream["train"] == {"install_maxtext", "convert_to_maxtext", CREATE, CHECK}
    assert dag.get_task("train").inputs.operator.task_id == CHECK
    # The TPU VM's teardown follows the training directly; the export runs on a VM of its own meanwhile.
    assert upstream[DELETE] == {CREATE, INSTALL, "train"}
    # The quality gate judges the training before anything is exported or published; the export's VM is made
    # once the gate passed (after the training: none idles through it), and goes once the export is done.
    assert "train" in upstream[GATE] and not {CREATE_EXPORT, INSTALL_EXPORT} & upstream[GATE]
    assert upstream[CREATE_EXPORT] == {GATE} and upstream[INSTALL_EXPORT] == {CREATE_EXPORT}
    # The export records the inputs it published (wired as the check's XComArg).
    assert upstream["export_and_publish"] == {INSTALL_EXPORT, "train", CREATE_EXPORT, CHECK}
    assert dag.get_task("export_and_publish").inputs.operator.task_id == CHECK
    assert upstream[DELETE_EXPORT] == {CREATE_EXPORT, INSTALL_EXPORT, "export_and_publish"}
    for task_id in (INSTALL_CPU, "convert_to_maxtext"):
        assert create_task_id(dag.get_task(task_id)) == CREATE_CPU, task_id
    for task_id in (INSTALL_EXPORT, "export_and_publish"):
        assert create_task_id(dag.get_task(task_id)) == CREATE_EXPORT, task_id
    # The export VM restores the environment the conversion's VM saved; the TPU VM too.
    assert dag.get_task(INSTALL_CPU).save_environment
    assert not dag.get_task(INSTALL_EXPORT).save_environment and not dag.get_task(INSTALL).save_environment
    for task_id in ON_TPU:
        assert create_task_id(dag.get_task(task_id)) == CREATE, task_id
    # The training starts from the conversion's output, the export from the training's.
    assert dag.get_task("train").conversion.operator.task_id == "convert_to_maxtext"
    assert dag.get_task("export_and_publish").trained.operator.task_id == "train"
    # Checkpoints pass through gs:// storage: on Google Cloud (the VMs get the storage scope), and locally the local
    # GCS server's bucket.
    storage = {dag.get_task(t).checkpoint_storage for t in BODY}
    assert len(storage) == 1
    [uri] = storage
    cpu, export, tpu = dag.get_task(CREATE_CPU), dag.get_task(CREATE_EXPORT), dag.get_task(CREATE)
    for vm in (cpu, export):
        if dag_id in CLOUD_DAGS:
            assert uri.startswith("gs://")
            assert vm.accelerator_type == "cpu-highmem-16" and vm.provisioning_model == "STANDARD"
            assert vm.service_account_scopes == tpu.service_account_scopes != ()
        else:
            assert uri == "gs://local-posttrain/airflow-tpu-posttrain"
            assert vm.accelerator_type == "cpu"
        assert vm.max_tpu_chips is None and vm.max_tpu_vms is None  # a CPU VM: not under the TPU cap
    # Each VM its own deterministic name (a retry or a re-run finds it again).
    assert (cpu.name_prefix, export.name_prefix, tpu.name_prefix) == ("cpu", "export", "tpu")
    assert dag.get_task(DELETE_EXPORT).name_prefix == "export"


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_only_the_training_is_stopped_when_silent(dags, dag_id):
    """A trainer that stops writing is hung (its storage unreachable) and holds the TPU VM.

    An environment upload or a large conversion writes nothing for long stretches, and is not stopped."""
    dag = dags[dag_id]
    assert dag.get_task("train").stall_timeout_s > 0
    for task_id in {*BODY, INSTALL_CPU, INSTALL_EXPORT} - {"train"} if dag_id in SPLIT_DAGS else set(BODY) - {"train"}:
        assert dag.get_task(task_id).stall_timeout_s == 0, task_id


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_watcher_fails_the_run_when_a_body_step_fails(dags, dag_id):
    dag = dags[dag_id]
    watcher = dag.get_task(WATCHER)
    assert watcher.trigger_rule == "one_failed"
    assert watcher.retries == 0
    # Every body step is upstream; the installs (setups) through the steps that follow them.
    assert {*BODY, GATE} - {INSTALL} <= watcher.upstream_task_ids
    vms = SPLIT_VMS if dag_id in SPLIT_DAGS else [(CREATE, INSTALL, DELETE)]
    for _, install, _ in vms:
        assert set(dag.get_task(install).downstream_task_ids) & watcher.upstream_task_ids
    assert watcher.downstream_task_ids == set()
    # Teardowns do not count toward the run's state: the watcher must not wait for (or depend on) a teardown,
    assert not {delete for *_, delete in vms} & set(watcher.get_flat_relative_ids(upstream=True))
    # and a non-ALL_SUCCESS task may not follow a setup directly.
    assert not {setup for *setups, _ in vms for setup in setups} & watcher.upstream_task_ids


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_retries_and_pools(dags, dag_id):
    dag = dags[dag_id]
    on_tpu = ON_TPU if dag_id in SPLIT_DAGS else BODY
    for task in dag.tasks:
        if task.task_id != WATCHER:
            assert task.retries > 0, task.task_id
        # The TPU pool counts the TPU VM's steps only: a teardown never queues for a slot behind other runs, and a
        # create waiting for a place under the VM cap holds no slot that the running VM's steps need. The cloud
        # entries name no pool (a pool that does not exist would hold every run in "scheduled"); the local ones
        # name tpu_vms, which the local stack makes.
        pool = POOL if dag_id not in CLOUD_DAGS else "default_pool"
        assert task.pool == (pool if task.task_id in on_tpu else "default_pool"), task.task_id
    if getattr(dag.get_task(CREATE), "max_tpu_chips", None) is not None:
        assert dag.get_task(CREATE).execution_timeout > dag.params["max_wait_for_capacity"] * timedelta(minutes=1)
    assert dag.get_task(DELETE).retries >= 3


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_execution_timeout_on_every_step(dags, dag_id):
    dag = dags[dag_id]
    for task_id in (CREATE, *BODY, DELETE):
        timeout = dag.get_task(task_id).execution_timeout
        assert isinstance(timeout, timedelta) and timeout > timedelta(0), task_id


@pytest.mark.parametrize("dag_id", [SFT_GEMMA])
def test_execution_timeout_on_every_task(dags, dag_id):
    missing = [t.task_id for t in dags[dag_id].tasks if not t.execution_timeout]
    assert not missing, f"tasks without execution_timeout: {missing}"


def _bounded_without_a_run_timeout(dags, dag_id: str) -> tuple[timedelta, int]:
    """Asserts no run-level timeout and a VM deadline beyond every try; returns (maxRunDuration, tries)."""
    dag = dags[dag_id]
    assert dag.dagrun_timeout is None
    assert all(task.execution_timeout for task in dag.tasks)
    # The VM's cloud-side deadline (maxRunDuration, action DELETE) outlives every try of every step on it, from
    # its create on; the create's wait in line behind other runs comes before its VM exists.
    tries = dag.get_task("train").retries + 1
    on_vm = sum((dag.get_task(t).execution_timeout for t in BODY), timedelta(0)) * tries
    create = dag.get_task(CREATE)
    in_line = timedelta(hours=MAX_WAIT_IN_LINE_HOURS) if create.max_tpu_chips is not None else timedelta(0)
    assert create.max_run_duration > on_vm + create.execution_timeout - in_line
    # A CPU VM's deadline outlives every try of its own steps: none lives through the TPU VM's wait in line (the
    # conversion's is deleted once the conversion is stored, the export's made after the training).
    for create_id, steps in ((CREATE_CPU, (INSTALL_CPU, "convert_to_maxtext")),
                             (CREATE_EXPORT, (INSTALL_EXPORT, "export_and_publish"))):
        if create_id in dag.task_ids:
            cpu = dag.get_task(create_id)
            own = sum((dag.get_task(t).execution_timeout for t in steps), timedelta(0)) * tries
            assert cpu.max_run_duration > own + cpu.execution_timeout
    return dag.get_task(CREATE).max_run_duration, tries


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_no_run_timeout_and_a_cloud_backstop_beyond_every_retry(dags, dag_id):
    """A run-level timeout would mark the teardowns SKIPPED when it fires; each step is bounded instead."""
    _bounded_without_a_run_timeout(dags, dag_id)


def test_the_seed_models_dag_survives_a_cleared_step_and_has_no_run_timeout(dags, fault_matrix):
    """The fault-matrix rows of the two checks above, for the SFT seed model's DAG."""
    for step in ("train", "export_and_publish"):
        recreated = _cleared_vms(dags, SFT_GEMMA, step)
        fault_matrix.record(
            f"DAG: the UI's Clear of {step} -> its VMs are re-created with MaxText installed, and deleted again",
            None, "n/a", None, f"cleared with it: {', '.join(sorted(c for pair in recreated for c in pair))}"[:80],
        )
    deadline, tries = _bounded_without_a_run_timeout(dags, SFT_GEMMA)
    fault_matrix.record(
        "DAG: a run-level timeout would skip the teardowns -> none; every step bounded, VM deadline beyond all tries",
        None, "n/a", None, f"maxRunDuration {deadline} > {tries} tries of every step",
    )


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_schedule_catchup_and_concurrency(dags, dag_id):
    """The example registry starts no run by itself: its cloud entries name a reservation and a bucket to edit."""
    dag = dags[dag_id]
    assert dag.schedule is None
    assert dag.catchup is False
    assert dag.max_active_runs == 1


def test_a_scheduled_entry_gets_its_cron_and_a_start_date():
    from airflow_tpu_posttrain.pipelines.posttrain import build_dag
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    dag = build_dag(PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", max_tpu_vms=None, schedule="@weekly"))
    assert dag.schedule == "@weekly" and dag.timetable.expression == "0 0 * * 0"
    assert dag.start_date is not None and dag.catchup is False


# -- bad input fails without retries (AirflowFailException) ------------------------------------------------


def _context(dag):
    dag_run = SimpleNamespace(dag_id=dag.dag_id, run_id="manual__2026-01-01T00:00:00+00:00", logical_date=None)
    return {"dag": dag, "dag_run": dag_run, "run_id": dag_run.run_id, "ti": SimpleNamespace(try_number=1)}


def test_create_fails_without_retry_on_bad_zone(dags):
    from airflow.sdk.exceptions import AirflowFailException

    dag = dags[SFT_TINY]  # has a project_id, so no Google hook is built
    create = copy.copy(dag.get_task(CREATE))
    create.zones, create.accelerator_type = ["us-east5-b; rm -rf /"], "cpu"
    create.provisioning_model, create.reservation = "STANDARD", None
    with pytest.raises(AirflowFailException, match="zone"):
        create._spec(_context(dag))


def test_train_fails_without_retry_on_bad_override(dags):
    from airflow.sdk.exceptions import AirflowFailException

    dag = dags[SFT_GEMMA]
    train = copy.copy(dag.get_task("train"))
    # What the templates would render to, with one bad override.
    train.accelerator_type, train.model, train.steps = "v6e-8", "gemma3-4b", None
    train.dataset = train.train_split = train.eval_split = train.train_data_columns = ""
    train.converted_params = "/dev/shm/gemma3-4b/mt-format/0/items"
    train.evaluate = True
    train.overrides = ["learning_rate=1e-5", "steps=1 && id"]
    with pytest.raises(AirflowFailException, match="overrides"):
        train.execute(_context(dag))  # fails before any SSH connection is attempted


def _rendered(dag, task_id: str, **values):
    """A copy of the task with its templates replaced by what they render to (the run's values)."""
    task = copy.copy(dag.get_task(task_id))
    task.accelerator_type, task.model = "v6e-8", dag.params["model"]
    if hasattr(task, "converted_params"):
        task.converted_params = "/dev/shm/model/mt-format/0/items"
    if hasattr(task, "trained_checkpoint"):
        task.trained_checkpoint = "/dev/shm/model/run/checkpoints/9/model_params"
    if hasattr(task, "evaluate"):
        task.evaluate = True  # the default quality gate, no_regression, asks for the evaluations
    for key, value in values.items():
        setattr(task, key, value)
    return task


def _job(task, dag):
    context = _context(dag)
    return task._job(task.run_spec(context), context)


def _script(task, dag) -> str:
    return _job(task, dag).script


# An empty form field arrives as None (or, through a string template or REST conf, as "None" or ""): all mean
# "the model's default", exactly as if the field were not there.
BLANKS = [None, "", "None"]


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
def test_sft_blank_values_mean_the_models_defaults(dags, blank):
    dag = dags[SFT_GEMMA]
    fields = ("steps", "dataset", "train_split", "eval_split", "train_data_columns", "overrides")
    job = _job(_rendered(dag, "train", **dict.fromkeys(fields, blank)), dag)
    script = job.script
    assert script == _script(_rendered(dag, "train", **dict.fromkeys(fields, None)), dag)
    # UltraChat, read from the VM's copy of it (at the run's revision: without the inputs check's record, main).
    assert "steps=1000" in script and "hf_path=/dev/shm/gemma3-4b/dataset" in script
    assert '"repo_id":"HuggingFaceH4/ultrachat_200k","repo_type":"dataset","revision":null' in job.prefetch
    assert "train_split=train_sft" in script
    install = _rendered(dag, "install_maxtext", maxtext_version=blank)
    assert install._job(install.run_spec(_context(dag)), _context(dag)).outputs["maxtext_version"] == "0.2.2"


@pytest.mark.parametrize(("dag_id", "dataset"), [(SFT_GEMMA, "HuggingFaceH4/ultrachat_200k"), (RL_LLAMA, "openai/gsm8k")])
def test_training_reads_the_dataset_revision_the_inputs_check_recorded(dags, dag_id, dataset):
    dag = dags[dag_id]
    sha, model_sha = "1" * 40, "2" * 40
    inputs = {"revisions": {f"dataset:{dataset}": sha, "model:elsewhere/model": "3" * 40}}
    conversion = {"converted_params": "gs://b/converted/0/items", "source_revision": model_sha}
    fields = dict.fromkeys(
        ("steps", "dataset", "train_split", "eval_split", "train_data_columns", "num_batches", "num_test_batches", "overrides")
    )
    task = _rendered(dag, "train", inputs=inputs, conversion=conversion, **fields)
    job = _job(task, dag)
    fetches = [json.loads(arg) for arg in shlex.split(job.prefetch)[3:]]
    assert [(f["repo_id"], f.get("repo_type"), f["revision"]) for f in fetches] == [
        (task._profile().hf_source, None, model_sha),
        (dataset, "dataset", sha),
    ]
    # The trainer reads only that copy.
    dataset_dir = fetches[1]["local_dir"]
    assert f"hf_path={dataset_dir}" in job.script or f"hf_train_files={dataset_dir}/main/train-*.parquet" in job.script


@pytest.mark.parametrize("rule", ["off", "no_regression", "min_improvement"])
def test_sft_evaluates_only_for_a_quality_gate(dags, rule):
    dag = dags[SFT_GEMMA]
    train = dag.get_task("train")
    evaluate = train.render_template(train.evaluate, {"params": {"quality_gate": rule}}, dag.get_template_env())
    fields = ("steps", "dataset", "train_split", "eval_split", "train_data_columns", "overrides")
    script = _script(_rendered(dag, "train", evaluate=evaluate, **dict.fromkeys(fields)), dag)
    # MaxText evaluates before the first step and after the last: on UltraChat's held-out split (its default).
    assert ("eval_interval=1000" in script and "eval_steps=50" in script) == (rule != "off")
    assert "hf_eval_split" not in script
    # Another dataset's held-out split, named in the form.
    other = {**dict.fromkeys(fields), "dataset": "my-org/chats", "eval_split": "validation"}
    job = _job(_rendered(dag, "train", evaluate=evaluate, **other), dag)
    assert '"repo_id":"my-org/chats","repo_type":"dataset"' in job.prefetch
    assert ("hf_eval_split=validation" in job.script) == (rule != "off")


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
def test_rl_blank_values_mean_the_models_defaults(dags, blank):
    dag = dags[RL_LLAMA]
    fields = ("num_batches", "num_test_batches", "overrides")
    script = _script(_rendered(dag, "train", **dict.fromkeys(fields, blank)), dag)
    assert "num_batches=50" in script and "num_test_batches=10" in script


@pytest.mark.parametrize("blank", BLANKS, ids=repr)
def test_export_blank_storage_uri_publishes_to_the_hub_only(dags, blank, monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW_CONN_HF_DEFAULT", json.dumps({"conn_type": "generic", "password": "hf_x"}))
    dag = dags[SFT_GEMMA]
    export = _rendered(dag, "export_and_publish", hub_repo_id="my-org/m", storage_uri=blank)
    script = _script(export, dag)
    assert "--hub-repo my-org/m" in script and "--storage-uri" not in script
    nothing = _rendered(dag, "export_and_publish", hub_repo_id=blank, storage_uri=blank)
    with pytest.raises(AirflowFailException, match="publish target=None: is missing. Fix: set hub_repo_id"):
        _script(nothing, dag)


@pytest.mark.parametrize(("field", "value"), [("steps", "7; id"), ("steps", "0"), ("num_batches", "x")])
def test_operators_refuse_bad_counts_naming_field_and_fix(dags, field, value):
    from airflow.sdk.exceptions import AirflowFailException

    dag = dags[SFT_GEMMA if field == "steps" else RL_LLAMA]
    message = rf"train: invalid input: {field}=.+Fix: give a positive integer"
    with pytest.raises(AirflowFailException, match=message):
        _script(_rendered(dag, "train", **{field: value}), dag)


# -- Params --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dag_id", [*ALL_DAGS, BY_HAND, "tpu_vm_reaper"])
def test_every_param_is_documented_and_defaults_validate(dags, dag_id):
    params = dags[dag_id].params
    for key, param in params.items():
        schema = param.schema
        assert schema.get("title") and param.description, f"param {key} needs a title and a description"
        # What is expected, with an example: a dropdown lists its choices, a switch has two.
        if "enum" not in schema and schema.get("type") != "boolean":
            assert "e.g." in param.description or schema.get("examples"), f"param {key} has no example"
    copy.deepcopy(params).validate()


@pytest.mark.parametrize("dag_id", [*ALL_DAGS, BY_HAND, "tpu_vm_reaper"])
def test_a_form_left_as_it_opens_can_be_triggered(dags, dag_id):
    """Every required field must open filled in, every optional one must accept None.

    Airflow's UI marks a Param required unless its type includes "null", and then refuses an empty value
    (None, "")."""
    for key, param in dags[dag_id].params.items():
        types = param.schema["type"] if isinstance(param.schema["type"], list) else [param.schema["type"]]
        if "null" not in types:
            assert param.value not in (None, ""), f"required param {key} opens empty"
        else:
            _validate_with(dags[dag_id], key, None)


def test_sft_defaults_reproduce_the_tutorial(dags):
    from airflow_tpu_posttrain.recipes.models import model_profile

    params = dags[SFT_GEMMA].params.validate()
    assert params["model"] == "gemma3-4b"
    assert params["accelerator_type"] == "v6e-8"
    assert params["provisioning_model"] == "RESERVATION_BOUND"
    assert params["zones"] == ["us-east5-b"]
    assert params["reservation"] == "my-v6e-reservation"
    assert params["hub_repo_id"] == "my-org/gemma3-4b-ultrachat-sft"
    assert params["overrides"] == []
    # None (an empty field) means "the model's": steps 1000, UltraChat 200k's train_sft split, MaxText 0.2.2.
    assert params["steps"] is None and params["maxtext_version"] is None
    assert params["dataset"] is params["train_split"] is params["train_data_columns"] is None
    profile = model_profile("gemma3-4b")
    assert profile.sft_steps == 1000
    assert profile.maxtext_version == "0.2.2"
    assert profile.sft_dataset.hf_path == "HuggingFaceH4/ultrachat_200k"
    assert profile.sft_dataset.train_split == "train_sft"


def test_rl_defaults_reproduce_the_tutorial(dags):
    from airflow_tpu_posttrain.recipes.models import model_profile

    params = dags[RL_LLAMA].params.validate()
    assert params["model"] == "llama3.1-8b-Instruct"
    assert params["accelerator_type"] == "v6e-8"
    assert params["provisioning_model"] == "RESERVATION_BOUND"
    assert params["num_batches"] is None and params["num_test_batches"] is None
    assert "steps" not in params and "dataset" not in params
    profile = model_profile("llama3.1-8b-Instruct")
    assert (profile.rl_num_batches, profile.rl_num_test_batches, profile.maxtext_version) == (50, 10, "0.2.3")


def test_local_defaults(dags):
    params = dags[SFT_TINY].params.validate()
    assert params["accelerator_type"] == "cpu"
    assert params["zones"] == ["local-cpu1-a", "local-cpu1-b"]
    assert params["provisioning_model"] == "STANDARD"
    assert params["reservation"] is None
    assert dags[SFT_TINY].params.get_param("accelerator_type").schema["enum"] == ["cpu"]
    assert "cpu" not in dags[SFT_GEMMA].params.get_param("accelerator_type").schema["enum"]


def _validate_with(dag, key, value):
    """Validate the DAG's Params with one value replaced, as a trigger does (on a copy)."""
    params = copy.deepcopy(dag.params)
    params.get_param(key).value = value
    return params.validate()


BAD_VALUES = [
    ("zones", ["us-east5-b; rm -rf /"]),
    ("zones", []),
    ("overrides", ["steps=1 && id"]),
    ("overrides", ["x=1; rm -rf /"]),
    ("dataset", "../x"),
    ("hub_repo_id", "a/b$(id)"),
    ("steps", 0),
    ("steps", "3"),
    ("accelerator_type", "v9-8"),
    ("provisioning_model", "ON_DEMAND"),
    ("maxtext_version", "0.2.3; id"),
    ("storage_uri", "gs://b/$(id)"),
    ("train_split", "train\nrm -rf /"),
    ("train_data_columns", "['messages']; id"),
    ("reservation", "Res;id"),
    ("reservation", "us-east5-a=r,us-east5-b=r;id"),
    ("reservation", "projects/p/reservations/r"),
    ("max_recoveries", 11),
    ("model", "llama3.1-8b-Instruct"),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v in BAD_VALUES])
def test_params_reject_bad_values(dags, key, value):
    from airflow.sdk.exceptions import ParamValidationError

    dag = dags[SFT_GEMMA]
    with pytest.raises(ParamValidationError) as err:
        _validate_with(dag, key, value)
    assert f"Invalid input for param {key}:" in str(err.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_batches", 0), ("num_test_batches", -1), ("overrides", ["a=$(id)"]), ("accelerator_type", "cpu")],
)
def test_rl_params_reject_bad_values(dags, key, value):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=f"Invalid input for param {key}:"):
        _validate_with(dags[RL_LLAMA], key, value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("steps", 3),
        ("overrides", ["learning_rate=1e-5", "per_device_batch_size=2", "dtype='bfloat16'"]),
        ("zones", ["us-east5-b", "us-central1-a"]),
        ("dataset", "HuggingFaceH4/ultrachat_200k"),
        ("storage_uri", "gs://my-bucket/models"),
        ("maxtext_version", "0.2.3"),
        ("provisioning_model", "FLEX_START"),
        ("reservation", "projects/host-project/reservations/v6e/reservationBlocks/block-1"),
        ("reservation", "us-east5-a=v6e-a,us-east5-b=projects/host-project/reservations/v6e-b"),
        ("max_recoveries", 0),
    ],
)
def test_params_accept_good_values(dags, key, value):
    assert _validate_with(dags[SFT_GEMMA], key, value)[key] == value


# Python's `$` also matches before a trailing newline, and jsonschema's `pattern` uses re.search: a value
# that ends in "\n" passes every `^...$` pattern of the Params (the trigger form, REST `conf`). The operators'
# own validation still rejects "\n", so the run fails at its first task instead of at trigger time.
TRAILING_NEWLINE = [
    ("train_split", "train_sft\n"),
    ("zones", ["us-east5-b\n"]),
    ("maxtext_version", "0.2.3\n"),
    ("hub_repo_id", "a/b\n"),
    ("overrides", ["learning_rate=1e-5\n"]),
]


@pytest.mark.parametrize(("key", "value"), TRAILING_NEWLINE, ids=[k for k, _ in TRAILING_NEWLINE])
def test_params_reject_trailing_newline(dags, key, value):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match=f"Invalid input for param {key}:"):
        _validate_with(dags[SFT_GEMMA], key, value)


@pytest.mark.parametrize("value", ["/../../etc", "gs://bucket/../other", "/etc/passwd", "file:///srv/models"])
def test_params_reject_storage_uri_traversal_and_vm_directories(dags, value):
    """On Google Cloud, only gs://: a directory on the VM goes with the VM."""
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError, match="Invalid input for param storage_uri:"):
        _validate_with(dags[SFT_GEMMA], "storage_uri", value)


# -- parse cost ----------------------------------------------------------------------------------------------

_PARSE_PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys, time
    t0 = time.perf_counter()
    import airflow
    t1 = time.perf_counter()
    spec = importlib.util.spec_from_file_location("posttrain_dags", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    t2 = time.perf_counter()
    print(json.dumps({
        "import_airflow_s": round(t1 - t0, 2),
        "parse_dag_file_s": round(t2 - t1, 2),
        "dag_ids": sorted(k for k, v in vars(module).items() if type(v).__name__ == "DAG"),
        "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                          ("google", "jax", "huggingface_hub", "googleapiclient", "paramiko", "asyncssh")),
    }))
    """
)


@pytest.fixture(
    scope="module",
    params=[
        ("posttrain_dags.py", CLOUD_DAGS),
        ("local_dags.py", LOCAL_DAGS),
        ("sft_tutorial_by_hand.py", (BY_HAND,)),
    ],
)
def parse_probe(request, tmp_path_factory):
    """Parse a DAG file in a fresh interpreter (after ``import airflow``), as the DAG processor does.

    Each file builds its own DAGs only."""
    name, expected = request.param
    env = {**os.environ, "TPU_POSTTRAIN_LOCAL_DIR": str(tmp_path_factory.mktemp("probe"))}
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_PROBE, str(DAGS_DIR / name)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Timings belong in bench/; they are only reported here (pytest -s).
    print(f"\nparse cost: import airflow {result['import_airflow_s']} s, {name} {result['parse_dag_file_s']} s")
    return {**result, "expected": sorted(expected)}


def test_parsing_imports_no_heavy_cloud_client(parse_probe):
    assert parse_probe["dag_ids"] == parse_probe["expected"]
    heavy = sorted(m for m in parse_probe["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY_MODULES))
    assert not heavy, f"parsing the DAG file imports heavy clients: {heavy}"


def test_parsing_imports_no_ssh_library(parse_probe):
    """The operators must only import paramiko and asyncssh when they run.

    providers-ssh's operator/trigger modules import them at their top."""
    ssh = sorted({m.split(".")[0] for m in parse_probe["modules"]} & {"paramiko", "asyncssh"})
    assert not ssh, f"parsing the DAG file imports {ssh}"


def test_the_dag_wired_by_hand_builds_what_the_operators_doc_describes(dags):
    """dags/sft_tutorial_by_hand.py (its core shown in docs/operators.md): each step finds its VM and input."""
    import airflow_tpu_posttrain.operators as operators

    dag = dags[BY_HAND]
    doc = (REPO / "docs" / "operators.md").read_text()
    core = doc.split("Steps are wired to each other by XComArgs", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    for task in dag.tasks:  # the doc's core names the file's tasks, by the operators the package exports
        assert f'task_id="{task.task_id}"' in core and f"{type(task).__name__}(task_id=" in core, task.task_id
        assert getattr(operators, type(task).__name__) is type(task)
    assert [create_task_id(dag.get_task(t)) for t in BODY] == [CREATE] * 4
    assert dag.get_task("train").conversion.operator.task_id == "convert_to_maxtext"
    assert dag.get_task("export_and_publish").trained.operator.task_id == "train"
    assert dag.get_task(DELETE).is_teardown and CREATE in dag.get_task(DELETE).upstream_task_ids


def test_a_new_model_is_a_models_entry_and_a_pipelines_line(tmp_path, monkeypatch):
    """A model the package does not know: its profile is data in models.yaml, no package edit.

    The DAG it makes renders that model's commands, and the task's process (which parses the DAG file before
    it runs the task) knows the model by its key."""
    import yaml

    from airflow_tpu_posttrain.pipelines.posttrain import build_dag
    from airflow_tpu_posttrain.pipelines.registry import load_registry
    from airflow_tpu_posttrain.recipes import maxtext, models
    from airflow_tpu_posttrain.recipes.accelerators import accelerator
    from airflow_tpu_posttrain.recipes.layout import RunLayout
    from airflow_tpu_posttrain.recipes.runtime import tpu_runtime

    registry = yaml.safe_load((DAGS_DIR / "models.yaml").read_text())
    registry["models"] = {
        "qwen3-8b": {"hf_source": "Qwen/Qwen3-8B", "maxtext_model_name": "qwen3-8b", "maxtext_version": "0.2.5",
                     "sft_steps": 300},
        "gemma3-4b": {"maxtext_version": "0.2.3"},  # a built-in model's field, laid over its profile
    }
    registry["pipelines"] = [{"model": "qwen3-8b", "recipe": "sft", "hub_repo_id": "my-org/qwen3-8b-sft"}]
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(registry))

    [config] = load_registry(tmp_path / "models.yaml", local=False)
    dag = build_dag(config)
    assert dag.dag_id == "posttrain_sft__qwen3-8b"
    params = dag.params.validate()
    assert params["model"] == "qwen3-8b" and params["hub_repo_id"] == "my-org/qwen3-8b-sft"
    qwen = models.model_profile("qwen3-8b")
    assert (qwen.hf_source, qwen.sft_dataset.hf_path) == ("Qwen/Qwen3-8B", "HuggingFaceH4/ultrachat_200k")
    spec = maxtext.RunSpec(qwen, accelerator("v6e-8"), tpu_runtime(), RunLayout("qwen3-8b", "run-1"))
    assert "model_name=qwen3-8b" in maxtext.to_maxtext(spec).argv
    assert "steps=300" in maxtext.train_sft(spec).argv
    gemma = models.model_profile("gemma3-4b")
    assert (gemma.maxtext_version, gemma.hf_source) == ("0.2.3", "google/gemma-3-4b-it")


def test_a_malformed_registry_fails_with_every_problem_and_its_place(tmp_path):
    """Every problem at once, each with its entry and key and the fix, before any DAG is built."""
    import yaml

    from airflow_tpu_posttrain.pipelines.registry import RegistryError, load_registry

    registry = yaml.safe_load((DAGS_DIR / "models.yaml").read_text())
    registry["defaults"].update(retries="two", accelerator_type="v6e-9")
    registry["pipelines"][0]["zone"] = "us-east5-b"
    registry["pipelines"][1].update(network_path="vpn", zones="us-east5-b")
    registry["models"] = {
        "qwen3-8b": {"hf_source": "Qwen/Qwen3-8B", "maxtext_model_name": "qwen3-8b"},
        "gemma3-4b": {"steps": 3},
    }
    registry["pipeline"] = []
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(registry))

    with pytest.raises(RegistryError) as raised:
        load_registry(path)
    problems = raised.value.problems
    sft, rl = "pipelines[0] (model gemma3-4b, recipe sft)", "pipelines[1] (model llama3.1-8b-Instruct, recipe rl)"
    expected = [
        "pipeline: not a key of the registry; did you mean 'pipelines'?",
        "models.qwen3-8b.maxtext_version: required for a model the package does not know",
        "models.gemma3-4b.steps: not a field of a model; did you mean 'sft_steps'?",
        f"{sft}: zone: not a key of the registry; did you mean 'zones'?",
        "defaults: retries='two': Input should be a valid integer",
        "defaults: accelerator_type='v6e-9': is not a supported accelerator. Fix: use one of: v6e-1",
        f"{rl}: zones='us-east5-b': Input should be a valid tuple",
        f"{rl}: network_path='vpn': is not a supported value. Fix: use one of: 'internal', 'external', 'iap'",
    ]
    for text in expected:
        assert sum(problem.startswith(text) for problem in problems) == 1, (text, problems)
    assert len(problems) == len(expected), problems
    assert str(raised.value).startswith(f"{path}: {len(expected)} problem(s), no DAG built from it:")


def test_two_registries_may_not_define_one_model_differently(tmp_path):
    import yaml

    from airflow_tpu_posttrain.pipelines.registry import RegistryError, load_registry

    for name, version in (("a.yaml", "0.2.5"), ("b.yaml", "0.2.3")):
        registry = yaml.safe_load((DAGS_DIR / "models.yaml").read_text())
        registry["models"] = {
            "qwen3-8b": {"hf_source": "Qwen/Qwen3-8B", "maxtext_model_name": "qwen3-8b", "maxtext_version": version}
        }
        (tmp_path / name).write_text(yaml.safe_dump(registry))
    load_registry(tmp_path / "a.yaml")
    load_registry(tmp_path / "a.yaml")  # the same definition again: a DAG file parsed twice
    with pytest.raises(RegistryError, match="model='qwen3-8b': is defined differently by another registry"):
        load_registry(tmp_path / "b.yaml")


def test_on_change_schedules_a_pipeline_on_its_inputs_on_the_hub(tmp_path):
    """``schedule: on_change``: the base model and the dataset as Assets, each watched on the Hub."""
    import yaml

    from airflow_tpu_posttrain.pipelines.posttrain import build_dag
    from airflow_tpu_posttrain.pipelines.registry import load_registry
    from airflow_tpu_posttrain.triggers.hub_revision import HubRevisionTrigger

    registry = yaml.safe_load((DAGS_DIR / "models.yaml").read_text())
    for entry in registry["pipelines"]:
        entry["schedule"] = "on_change"
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(registry))
    dags = {config.dag_id: build_dag(config) for config in load_registry(tmp_path / "models.yaml", local=False)}

    def watched(dag_id: str) -> dict[str, tuple]:
        assets = dags[dag_id].timetable.asset_condition.objects
        found = {}
        for asset in assets:
            [watcher] = asset.watchers
            assert isinstance(watcher.trigger, HubRevisionTrigger)
            path, kwargs = watcher.trigger.serialize()
            assert path == "airflow_tpu_posttrain.triggers.hub_revision.HubRevisionTrigger"
            found[asset.uri] = (kwargs["repo_id"], kwargs["repo_type"], kwargs["hf_conn_id"], kwargs["poll_interval"])
        return found

    assert watched(SFT_GEMMA) == {
        "hf://models/google/gemma-3-4b-it": ("google/gemma-3-4b-it", "model", "hf_default", 600),
        "hf://datasets/HuggingFaceH4/ultrachat_200k": ("HuggingFaceH4/ultrachat_200k", "dataset", "hf_default", 600),
    }
    assert set(watched(RL_LLAMA).values()) == {
        ("meta-llama/Llama-3.1-8B-Instruct", "model", "hf_default", 600),
        ("openai/gsm8k", "dataset", "hf_default", 600),
    }
    # Any of them starts a run; the DAG has a start date to be scheduled from.
    assert type(dags[SFT_GEMMA].timetable.asset_condition).__name__ == "AssetAny"
    assert dags[SFT_GEMMA].start_date is not None


def test_the_registry_reference_is_rendered_from_the_code_that_reads_the_registry():
    """docs/registry.md is what registry_reference renders: every key of an entry, with a description, once."""
    from dataclasses import fields

    from airflow_tpu_posttrain.pipelines import registry, registry_reference

    page = registry_reference.render()
    assert (REPO / "docs" / "registry.md").read_text() == page, (
        "docs/registry.md is stale: run python -m airflow_tpu_posttrain.pipelines.registry_reference"
    )
    keys = [f.name for f in fields(registry.PipelineConfig) if f.name not in registry._LOADER_KEYS] + ["local"]
    entry_section = page.split("## Keys of `defaults`")[1].split("\n## ")[0]
    rows = [line.split("|")[1].strip().strip("`") for line in entry_section.splitlines() if line.startswith("| `")]
    assert rows == keys


def test_two_deployments_share_a_conversion_and_nothing_of_a_run(dags, monkeypatch):
    """Staging and production run the same DAG run id on one bucket: they share the conversion and no run path.

    Each run's checkpoints, done markers, export and Hub branch (all named from the run name) are its deployment's
    own, and so is its claim on the conversion; the conversion itself (keyed by content) is shared by design."""
    dag = dags[SFT_GEMMA]
    fields = dict.fromkeys(("steps", "dataset", "train_split", "eval_split", "train_data_columns", "overrides"))
    task = _rendered(dag, "train", checkpoint_storage="gs://shared-bucket/posttrain", **fields)
    jobs, layouts = {}, {}
    for deployment in ("airflow-staging", "airflow-production"):
        monkeypatch.setenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", deployment)
        spec = task.run_spec(_context(dag), conversion_key="same-content")
        layouts[deployment], jobs[deployment] = spec.layout, task._job(spec, _context(dag))
    staging, production = layouts.values()
    assert staging.converted_dir == production.converted_dir
    assert staging.run_name != production.run_name
    assert {staging.checkpoints_dir, production.checkpoints_dir} == {
        f"gs://shared-bucket/posttrain/post-train/{layout.run_name}/checkpoints" for layout in (staging, production)
    }
    assert staging.kept_export_dir != production.kept_export_dir
    done = [job.done_marker for job in jobs.values()]
    assert done[0] != done[1]
    convert = _rendered(
        dag, "convert_to_maxtext", checkpoint_storage="gs://shared-bucket/posttrain", inputs=None, maxtext_version=None
    )
    claims = {}
    for deployment in ("airflow-staging", "airflow-production"):
        monkeypatch.setenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", deployment)
        spec = convert.run_spec(_context(dag), conversion_key="same-content")
        claims[deployment] = convert._claim(spec, _context(dag))
    assert all(f"{deployment}/{SFT_GEMMA}/" in claim[0] for deployment, claim in claims.items())
    # The same deployment names the same run again: a retry resumes it.
    monkeypatch.setenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", "airflow-staging")
    assert task.run_spec(_context(dag), conversion_key="same-content").layout == staging


def test_an_entry_with_approval_asks_once_every_vm_is_gone_and_publishes_from_a_vm_of_its_own():
    """The export is kept, then the answer asked once every VM's teardown ran; approved, a VM of its own publishes.

    Nothing but the kept export is held while a person decides, for up to ``approval_timeout_hours``."""
    from airflow_tpu_posttrain.pipelines.posttrain import build_dag
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    entry = {"model": "gemma3-4b", "recipe": "sft", "checkpoint_storage": "gs://bkt/x"}
    plain = build_dag(PipelineConfig(**entry))
    dag = build_dag(
        PipelineConfig(
            **entry, approval=True, approvers=["alice"], approval_timeout_hours=24, approval_on_reject="fail"
        )
    )
    assert set(dag.task_ids) - set(plain.task_ids) == {
        "export_and_keep", "approve_publish", "create_pub_vm", "install_maxtext_pub", "delete_pub_vm"
    }
    upstream = {t.task_id: t.upstream_task_ids for t in dag.tasks}
    assert {INSTALL_EXPORT, "train", CREATE_EXPORT} <= upstream["export_and_keep"]
    assert upstream[DELETE_EXPORT] == {"export_and_keep", CREATE_EXPORT, INSTALL_EXPORT}
    assert upstream[DELETE_CPU] == {"convert_to_maxtext", CREATE_CPU, INSTALL_CPU}
    assert {GATE, "export_and_keep", DELETE, DELETE_CPU, DELETE_EXPORT} <= upstream["approve_publish"]
    assert not {CREATE, CREATE_CPU, CREATE_EXPORT, "create_pub_vm"} & upstream["approve_publish"]
    assert upstream["create_pub_vm"] == {"approve_publish"}
    assert {"install_maxtext_pub", "create_pub_vm"} <= upstream["export_and_publish"]
    assert upstream["delete_pub_vm"] == {"export_and_publish", "create_pub_vm", "install_maxtext_pub"}
    keep, approve, publish = (dag.get_task(t) for t in ("export_and_keep", "approve_publish", "export_and_publish"))
    assert keep.publish is False and publish.publish is True
    assert create_task_id(keep) == CREATE_EXPORT and create_task_id(publish) == "create_pub_vm"
    assert approve.response_timeout == timedelta(hours=24) and approve.defaults == ["Reject"]
    assert approve.fail_on_reject is True and approve.assigned_users == [{"id": "alice", "name": "alice"}]
    for teardown in (DELETE_CPU, DELETE_EXPORT, "delete_pub_vm"):
        assert dag.get_task(teardown).is_teardown and dag.get_task(teardown).trigger_rule == "none_skipped"
    assert dag.get_task("delete_pub_vm").name_prefix == "pub"
    # No VM waits for the answer: no CPU VM's cloud-side deadline grows with it.
    for create in (CREATE_CPU, CREATE_EXPORT, "create_pub_vm"):
        assert dag.get_task(create).max_run_duration == plain.get_task(CREATE_CPU).max_run_duration, create
    assert {"export_and_keep", "approve_publish"} <= dag.get_task(WATCHER).upstream_task_ids
    # Only the registry turns the approval off: the trigger form has no field for it.
    assert "approval" not in dag.params and "approval" not in plain.params


def test_approval_is_refused_where_it_would_hold_the_tpu_vm():
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    with pytest.raises(ValueError, match="approval=True: needs the split layout"):
        PipelineConfig(model="gemma3-4b", recipe="sft", layout="seeds", max_tpu_vms=None, approval=True, approvers=["a"])
    with pytest.raises(ValueError, match="approval_on_reject='warn'"):
        PipelineConfig(model="gemma3-4b", recipe="sft", checkpoint_storage="gs://b/x", approval_on_reject="warn")


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"maxtext_version": None}, r"maxtext_version='0.2.2': has no LoRA \(MaxText's LoRA came with 0.2.4\)"),
        ({"model": "llama3.1-8b-Instruct"}, "model='llama3.1-8b-Instruct': runs as MaxText's llama3.1-8b-Instruct, "
         "whose LoRA adapter MaxText does not export as trained"),
        ({"recipe": "rl"}, "recipe='rl': is not served with lora"),
        ({"accelerator_type": "v6e-16", "reservation": "r16"}, "accelerator_type='v6e-16': is a multi-host slice"),
        ({"lora": {"rank": 16, "alpha": 0}}, "lora.alpha=0.0: is not a positive number"),
        ({"lora": {"rank": 16, "weight_qtype": "fp8"}}, "lora.weight_qtype='fp8'"),
        ({"lora": {"target_modules": "decoder/.*(query"}}, "lora.target_modules='decoder/.*\\(query': does not compile"),
        ({"lora": {"target_modules": "$(reboot)"}}, "lora.target_modules='\\$\\(reboot\\)': is not a module-path regex"),
    ],
    ids=["release", "llama", "rl", "slice", "alpha", "qtype", "regex", "shell"],
)
def test_a_lora_entry_is_refused_where_lora_cannot_train_or_publish(tmp_path, changes, refusal):
    """Refused when the registry is read, naming the field and the fix: no VM is made for what cannot work."""
    import yaml

    from airflow_tpu_posttrain.pipelines.registry import RegistryError, load_registry

    entry = {"model": "gemma3-4b", "recipe": "sft", "maxtext_version": "0.2.5", "lora": {"rank": 16, "alpha": 32},
             "checkpoint_storage": "gs://b/x", **changes}
    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"pipelines": [entry]}))
    with pytest.raises(RegistryError, match=refusal):
        load_registry(registry)


def test_a_lora_dag_asks_for_the_adapters_settings_and_hands_them_to_its_steps(dags):
    dag, plain = dags[SFT_LORA], dags[SFT_GEMMA]
    params = dag.params.dump()
    assert (params["lora_rank"], params["lora_alpha"], params["lora_target_modules"], params["lora_weight_qtype"]) == (
        16, 32.0, None, None
    )
    assert params["maxtext_version"] == "0.2.5" and not {k for k in plain.params if k.startswith("lora_")}
    for task_id in ("check_inputs", "train", "export_and_publish"):
        assert dag.get_task(task_id).lora == {name: f"{{{{ params.{name} }}}}" for name in
                                              ("lora_rank", "lora_alpha", "lora_target_modules", "lora_weight_qtype")}
        assert plain.get_task(task_id).lora is None
    # A run trained with other LoRA settings trained another model: the settings are part of its inputs.
    assert {"lora_rank", "lora_weight_qtype"} <= set(dag.get_task("check_inputs").settings)


def test_a_lora_run_on_a_release_without_lora_fails_before_any_vm(dags):
    """A run may name another MaxText release in its form: one without LoRA fails the inputs check."""
    from airflow_tpu_posttrain.exceptions import InvalidInputError

    task = copy.deepcopy(dags[SFT_LORA].get_task("check_inputs"))
    task.model, task.maxtext_version = "gemma3-4b", "0.2.3"
    task.lora = {"lora_rank": 16, "lora_alpha": 32.0, "lora_target_modules": None, "lora_weight_qtype": None}
    task.settings = {"overrides": []}
    with pytest.raises(InvalidInputError, match="maxtext_version='0.2.3': has no LoRA.*No VM was created"):
        task.execute({"dag_run": None})
