"""The reaper deletes our VMs whose run is over or expired, and our SSH firewall rules whose VM is gone.

Nothing else, and nothing on doubt."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime, timedelta

import pytest
from conftest import emulator_credentials, log_excerpt

from airflow_tpu_posttrain.recipes import reaper

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


DEPLOYMENT = "airflow-prod"


def instance(age_s=3600, expires_in_s=3600, ours=True, deployment=DEPLOYMENT):
    labels = {"expires-at": str(int(NOW.timestamp() + expires_in_s)), "airflow-deployment": deployment}
    if ours:
        labels["managed-by"] = "airflow-tpu-posttrain"
    return {
        "name": "tpu-x",
        "labels": labels,
        "creationTimestamp": (NOW - timedelta(seconds=age_s)).isoformat(),
        "metadata": {"items": [{"key": "airflow-dag-id", "value": "d"}, {"key": "airflow-run-id", "value": "r"}]},
    }


@pytest.mark.parametrize(
    ("vm", "run_state", "delete", "reason"),
    [
        (instance(ours=False), "failed", False, "not ours"),
        (instance(), "running", False, "is running"),
        (instance(), "queued", False, "is queued"),
        (instance(), "failed", True, "is failed"),  # a user marked the run failed: teardown was skipped
        (instance(), "success", True, "is success"),
        (instance(), reaper.RUN_ABSENT, True, "no longer exists"),  # a deleted DAG
        (instance(age_s=60), reaper.RUN_ABSENT, False, "grace"),
        (instance(), None, False, "could not be read"),  # the Airflow API is down: maybe still training
        (instance(expires_in_s=-7200), None, True, "expired"),  # ... but not past its expiry
        (instance(expires_in_s=-7200), "running", True, "expired"),  # the run hangs past its deadline
        (instance(expires_in_s=-60), "running", False, "is running"),  # expired by less than the grace
        # Another deployment sharing the project (staging beside production): its runs are not this Airflow's,
        # whatever this Airflow says of a run with the same ids; its VM goes on its expiry only.
        (instance(deployment="airflow-staging"), reaper.RUN_ABSENT, False, "made by Airflow deployment"),
        (instance(deployment="airflow-staging"), "failed", False, "not this one ('airflow-prod')"),
        (instance(deployment="airflow-staging", expires_in_s=-7200), None, True, "expired"),
    ],
)
def test_decisions(vm, run_state, delete, reason):
    decision = reaper.decide(vm, run_state, NOW, grace_s=900, deployment=DEPLOYMENT)
    assert decision.delete is delete and reason in decision.reason


@pytest.mark.parametrize("state", ["running", "queued"])
def test_an_active_run_as_a_workers_task_sdk_answers_keeps_its_vm(state):
    """A worker's ``ti.get_dagrun_state`` answers the task SDK's DagRunState, whose str() is "DagRunState.RUNNING".

    Read as that string, an active run past the grace period looked finished: its VM was deleted mid-training
    (found by tests/test_deployment.py; ``dag.test()`` answers the core's DagRunState)."""
    from airflow.sdk.api.datamodels._generated import DagRunState

    from airflow_tpu_posttrain.operators.reaper import TpuVmReaperOperator

    class WorkerTi:
        @staticmethod
        def get_dagrun_state(dag_id, run_id):
            return DagRunState(state)

    operator = TpuVmReaperOperator(task_id="reap")
    run_state = operator._run_state({"ti": WorkerTi()}, instance())
    assert run_state == state
    decision = reaper.decide(instance(age_s=3600), run_state, NOW, grace_s=900, deployment=DEPLOYMENT)
    assert not decision.delete and decision.reason == f"its DAG run is {state}"


def rule(age_s=3600, description="airflow-tpu-posttrain: SSH to instance tpu-x"):
    return {
        "name": "tpu-x-ssh",
        "description": description,
        "creationTimestamp": (NOW - timedelta(seconds=age_s)).isoformat(),
    }


@pytest.mark.parametrize(
    ("firewall", "exists", "delete", "reason"),
    [
        (rule(), False, True, "tpu-x is gone"),
        (rule(), True, False, "tpu-x exists"),
        (rule(), None, False, "could not look up"),
        (rule(age_s=60), False, False, "grace"),  # the create makes the rule just before its VM
        (rule(description="allow ssh"), False, False, "not ours"),
    ],
)
def test_firewall_decisions(firewall, exists, delete, reason):
    decision = reaper.decide_firewall(firewall, exists, NOW, grace_s=900)
    assert decision.delete is delete and reason in decision.reason


def test_run_of_reads_exact_ids_from_metadata():
    assert reaper.run_of(instance()) == ("d", "r")


CREATE_ONLY = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("reaper_victim", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    TpuVmCreateOperator(
        task_id="create_tpu_vm", zones=["us-east5-b"], reservation="r", poll_interval=0.2, max_tpu_vms=None
    )
"""

REAPER = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.reaper import TpuVmReaperOperator

with DAG("reaper_{mode}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    TpuVmReaperOperator(task_id="reap", grace_period_s=0, dry_run={dry_run})
"""


NO_SLICES = {"slices_deleted": 0, "slice_parts_deleted": 0, "places_given_back": 0}


def reap_counts(dr):
    [ti] = dr.get_task_instances()
    return ti.xcom_pull(task_ids="reap")


def test_reaper_deletes_a_finished_runs_vm_and_spares_others(emulator, run_dag, fault_matrix):
    # A run whose teardown never ran (e.g. marked failed): its VM outlives it, in a zone the reaper is not told
    # of (a run's zones are a Param): every zone is swept.
    elsewhere = CREATE_ONLY.replace('zones=["us-east5-b"]', 'zones=["us-east5-a"]')
    victim = run_dag("reaper_victim", elsewhere)
    assert victim.state == "success" and [i["zone"].rsplit("/", 1)[-1] for i in emulator.instances()] == ["us-east5-a"]
    # Someone else's instance in the same zone, without our label.
    from google.cloud import compute_v1

    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    client.insert(project="test-project", zone="us-east5-b", instance_resource=compute_v1.Instance(
        name="not-ours", machine_type="zones/us-east5-b/machineTypes/e2-standard-2"))

    dry = run_dag("reaper_dry", REAPER.format(mode="dry", dry_run=True))
    assert reap_counts(dry) == {"seen": 1, "deleted": 0, "kept": 0, "firewalls_deleted": 0, **NO_SLICES, "dry_run": True}
    assert len(emulator.instances()) == 2

    wet = run_dag("reaper_wet", REAPER.format(mode="wet", dry_run=False))
    assert reap_counts(wet) == {"seen": 1, "deleted": 1, "kept": 0, "firewalls_deleted": 0, **NO_SLICES, "dry_run": False}
    deadline = datetime.now() + timedelta(seconds=3)
    while len(emulator.instances()) > 1 and datetime.now() < deadline:
        time.sleep(0.1)
    assert [i["name"] for i in emulator.instances()] == ["not-ours"]
    listed = [r for r in emulator.requests if r["method"] == "GET" and r["path"].endswith("/instances")]
    assert all("managed-by" in json.dumps(r["query"]) for r in listed)
    fault_matrix.record(
        "reaper: dry run deletes nothing", False, dry.state, None, f"counts {reap_counts(dry)}"[:80]
    )
    fault_matrix.record(
        "reaper: a finished run's VM (teardown skipped) is deleted", True, wet.state, None,
        f"counts {reap_counts(wet)}"[:80],
    )
    fault_matrix.record(
        "reaper: an instance without our label is spared", False, wet.state, None, "'not-ours' still there; list filtered by the managed-by label",
    )


def test_two_deployments_sharing_a_project_keep_to_their_own_vms(emulator, run_dag, monkeypatch, fault_matrix):
    """Staging and production: the same DAG file, the same run id, one project.

    Each deployment's create makes its own VM (never "reuses" the other's), and production's reaper, whose own
    run with those ids is over, deletes production's VM only."""
    run_id = "manual__2026-12-01T00:00:00+00:00"  # as a scheduled run's id is, the same in both deployments
    names = {}
    for deployment in ("airflow-staging", "airflow-production"):
        monkeypatch.setenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", deployment)
        created = run_dag("reaper_victim", CREATE_ONLY, run_id=run_id)
        assert created.state == "success"
        names[deployment] = created.get_task_instance("create_tpu_vm").xcom_pull(task_ids="create_tpu_vm")["name"]
    assert names["airflow-staging"] != names["airflow-production"]
    labels = {i["name"]: i["labels"]["airflow-deployment"] for i in emulator.instances()}
    assert labels == {name: deployment for deployment, name in names.items()}

    reaped = run_dag("reaper_wet", REAPER.format(mode="wet", dry_run=False))  # production's reaper
    assert reap_counts(reaped) == {"seen": 2, "deleted": 1, "kept": 1, "firewalls_deleted": 0, **NO_SLICES, "dry_run": False}
    assert _wait_until(lambda: [i["name"] for i in emulator.instances()] == [names["airflow-staging"]])
    fault_matrix.record(
        "reaper: two deployments share a project (same DAG, same run id): each keeps to its own VM",
        True, reaped.state, None, f"2 VMs made, 1 reaped (production's); staging's {names['airflow-staging']} kept"[:80],
    )


def _wait_until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_reaper_keeps_a_vm_whose_run_state_cannot_be_read(emulator, run_dag, monkeypatch, capfd, fault_matrix):
    from airflow.sdk.exceptions import AirflowRuntimeError, ErrorType
    from airflow.sdk.execution_time.comms import ErrorResponse
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    victim = run_dag("reaper_victim", CREATE_ONLY)
    assert victim.state == "success" and len(emulator.instances()) == 1

    def api_down(self, dag_id, run_id):
        detail = {"status_code": 503, "message": "Service Unavailable"}
        raise AirflowRuntimeError(ErrorResponse(error=ErrorType.API_SERVER_ERROR, detail=detail))

    monkeypatch.setattr(RuntimeTaskInstance, "get_dagrun_state", api_down)
    down = run_dag("reaper_down", REAPER.format(mode="down", dry_run=False))
    counts = reap_counts(down)
    logs = "".join(capfd.readouterr())
    assert counts["seen"] == 1 and counts["kept"] == 1 and counts["deleted"] == 0, counts
    assert "Cannot read the state of DAG run reaper_victim" in logs and "could not be read" in logs
    assert len(emulator.instances()) == 1 and not [r for r in emulator.requests if r["method"] == "DELETE"]
    fault_matrix.record(
        "reaper: Airflow API down -> the VM is kept (until it expires)", False, down.state, None,
        log_excerpt(logs, "could not be read"),
    )


def test_reaper_deletes_the_vm_of_a_deleted_run(emulator, run_dag, capfd):
    from airflow.models import DagRun
    from airflow.utils.session import create_session

    victim = run_dag("reaper_victim", CREATE_ONLY)
    assert victim.state == "success" and len(emulator.instances()) == 1
    with create_session() as session:
        session.query(DagRun).filter(DagRun.dag_id == "reaper_victim").delete()
    wet = run_dag("reaper_gone", REAPER.format(mode="gone", dry_run=False))
    assert reap_counts(wet)["deleted"] == 1
    logs = "".join(capfd.readouterr())
    assert "its DAG run no longer exists" in logs
    # What the orphan had cost until now: a v6e-8 reserved VM at the on-demand price.
    assert re.search(r"cost so far: \S+ \(ct6e-standard-8t, RESERVATION_BOUND\) ran \d+ min \d+ s: \$\d+\.\d\d at \$21\.6/h", logs)
    assert _wait_until(lambda: emulator.instances() == [])


def test_reaper_gives_back_the_place_of_a_finished_runs_vm_once_it_is_gone(
    emulator, capacity_claims, run_dag, capfd, fault_matrix
):
    """A run whose teardown never ran held a place under the cap: its VM goes first, then its place."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook

    capped = CREATE_ONLY.replace("max_tpu_vms=None", f"max_tpu_vms=1, capacity_claims={capacity_claims!r}")
    victim = run_dag("reaper_victim", capped)
    assert victim.state == "success"
    [line] = StoredRecordHook().lines(capacity_claims)
    [held] = StoredRecordHook().read(line)["holders"]
    reaping = REAPER.replace("grace_period_s=0,", f"grace_period_s=0, capacity_claims=[{capacity_claims!r}],")
    first = reap_counts(run_dag("reaper_places_1", reaping.format(mode="places_1", dry_run=False)))
    # The place goes back once the VM's delete has ended: in the same pass if it ended by the places' sweep, else
    # on the next one (kept meanwhile, the log says why).
    assert first["deleted"] == 1 and first["places_given_back"] in (0, 1)
    assert _wait_until(lambda: emulator.instances() == [])
    second = reap_counts(run_dag("reaper_places_2", reaping.format(mode="places_2", dry_run=False)))
    assert first["places_given_back"] + second["places_given_back"] == 1
    assert StoredRecordHook().read(line)["holders"] == {}
    logs = "".join(capfd.readouterr())
    assert f"give back the place of {held} in {line}: its DAG run is success" in logs
    fault_matrix.record(
        "reaper: a finished run's place under the cap (teardown skipped) -> given back once its VM is gone", True,
        "success", None, log_excerpt(logs, "give back the place of"),
    )


FIREWALLED = CREATE_ONLY.replace("max_tpu_vms=None", 'max_tpu_vms=None, ssh_source_ranges=["10.0.0.0/8"]')
assert FIREWALLED != CREATE_ONLY


def test_reaper_deletes_ssh_rules_whose_vm_is_gone_and_no_other(emulator, run_dag, capfd, fault_matrix):
    from google.cloud import compute_v1

    victim = run_dag("reaper_victim", FIREWALLED)
    assert victim.state == "success"
    [vm] = emulator.instances()
    [ours] = emulator.firewalls()
    assert ours["description"] == f"airflow-tpu-posttrain: SSH to instance {vm['name']}"
    options = {"transport": "rest", "client_options": {"api_endpoint": emulator.url}, "credentials": emulator_credentials(emulator)}
    rule = compute_v1.Firewall(name="allow-ssh", network="global/networks/default", source_ranges=["0.0.0.0/0"],
                               allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])])
    compute_v1.FirewallsClient(**options).insert(project="test-project", firewall_resource=rule)

    # The VM goes without its teardown (deleted by hand, or preempted and removed): its rule stays behind.
    compute_v1.InstancesClient(**options).delete(project="test-project", zone="us-east5-b", instance=vm["name"])
    assert _wait_until(lambda: emulator.instances() == [])
    swept = run_dag("reaper_sweep", REAPER.format(mode="sweep", dry_run=False))
    logs = "".join(capfd.readouterr())
    assert reap_counts(swept)["firewalls_deleted"] == 1
    assert _wait_until(lambda: [r["name"] for r in emulator.firewalls()] == ["allow-ssh"])
    fault_matrix.record(
        "reaper: an SSH rule whose VM is gone is deleted; other rules spared", True, swept.state, None,
        log_excerpt(logs, "delete firewall"),
    )


def test_first_creates_drawing_the_deployment_id_at_once_all_use_the_last_draw(monkeypatch):
    """Three first-ever creates of a new deployment find no id at the same moment and each writes its draw.

    The Variable keeps the last write; a create that went on with its own draw would name (and label) its VM
    with an id its later steps, and the teardown, no longer read: the VM would be inserted under one name and
    waited for, or deleted, under another."""
    import airflow.sdk

    from airflow_tpu_posttrain.operators import compute_base

    monkeypatch.delenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", raising=False)
    monkeypatch.setattr(compute_base, "_DEPLOYMENT_ID_POLL_S", 0.01)
    monkeypatch.setattr(compute_base, "DEPLOYMENT_ID_SETTLE_S", 0.05)
    store: dict[str, str] = {}
    other_draws = ["airflow-second", "airflow-third"]  # the racers' writes, landing after ours

    class RacedVariable:
        @staticmethod
        def get(key, default=None):
            if key in store and other_draws:
                store[key] = other_draws.pop(0)
            return store.get(key, default)

        @staticmethod
        def set(key, value, description=None):
            store[key] = value

    monkeypatch.setattr(airflow.sdk, "Variable", RacedVariable)
    first = compute_base.deployment_id()
    assert other_draws == []  # the racers did write while this create was reading
    assert first == "airflow-third" == compute_base.deployment_id() == store[compute_base.DEPLOYMENT_VARIABLE]


def test_a_slice_group_waiting_for_capacity_with_no_vm_is_reaped_when_its_run_is_gone(emulator, run_dag, fault_matrix):
    """A run marked failed while its bulk group waited for capacity: the group has no VM for the VM sweep to find.

    Left alone it would make the whole slice when capacity comes. The reaper judges it as its VMs would be (its
    template's labels and metadata): its run no longer exists, so the group goes, then its template and policy."""
    from test_slices import slice_spec
    from test_tpu_vm_operators import this_deployment

    from airflow_tpu_posttrain.hooks.compute import TpuVmHook
    from airflow_tpu_posttrain.recipes import compute, slices

    dag_id, run_id = "slice_marked_failed", "manual__slice_marked_failed"
    name = compute.instance_name(dag_id, run_id, "tpu", this_deployment())
    labels = compute.ownership_labels(dag_id, run_id, "create_tpu_vm", 2_000_000_000, this_deployment())
    emulator.add_reservation("slice-reservation", "us-east5-b", 4, machine_type="ct6e-standard-4t")
    emulator.set_faults(stockout_zones=["us-east5-b"])
    bodies = slices.slice_bodies(
        slice_spec(), name, "us-east5-b", labels, {"airflow-dag-id": dag_id, "airflow-run-id": run_id}
    )
    hook = TpuVmHook(api_endpoint=emulator.url, retry_initial_delay=0.2, retry_deadline=30)
    hook.insert_workload_policy("test-project", "us-east5", bodies.policy, "p-1")
    hook.insert_instance_template("test-project", bodies.template, "t-1")
    assert _wait_until(lambda: hook.list_instance_templates("test-project") != [])
    hook.insert_instance_group("test-project", "us-east5-b", bodies.group, "g-1")
    assert _wait_until(lambda: (hook.get_instance_group("test-project", "us-east5-b", name) or {}).get("status", {})
                       .get("bulkInstanceOperation", {}).get("lastProgressCheck"))
    assert emulator.instances() == []

    reaped = run_dag("reaper_group_1", REAPER.format(mode="group_1", dry_run=False))
    first = reap_counts(reaped)
    assert (first["seen"], first["slices_deleted"]) == (0, 1)
    assert _wait_until(lambda: hook.get_instance_group("test-project", "us-east5-b", name) is None, 30)
    emulator.set_faults(stockout_zones=[])  # capacity comes: nothing is made any more
    time.sleep(5 * emulator.faults["operation_seconds"])  # a group that still existed would have made its VMs by now
    assert emulator.instances() == []
    parts = 0
    for attempt in range(10):  # the template and policy stay "in use" a moment after the group is gone
        parts += reap_counts(run_dag(f"reaper_group_{attempt + 2}", REAPER.format(mode=f"group_{attempt + 2}", dry_run=False)))[
            "slice_parts_deleted"
        ]
        if parts == 2:
            break
    assert parts == 2
    assert _wait_until(lambda: hook.list_instance_templates("test-project") == [], 30)
    fault_matrix.record(
        "reaper: a slice group waiting for capacity with no VM, its run gone -> deleted, then its template and policy",
        True, reaped.state, None, f"first pass {first['slices_deleted']} group, 0 VMs; template and policy: {parts} on later passes"[:80],
    )
