"""The reaper deletes our VMs whose run is over or expired, and nothing else."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest

from airflow_tpu_posttrain.recipes import reaper

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)


def instance(age_s=3600, expires_in_s=3600, ours=True):
    labels = {"expires-at": str(int(NOW.timestamp() + expires_in_s))}
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
        (instance(), None, True, "no longer exists"),  # a deleted DAG
        (instance(age_s=60), None, False, "grace"),
        (instance(expires_in_s=-7200), "running", True, "expired"),  # the run hangs past its deadline
        (instance(expires_in_s=-60), "running", False, "is running"),  # expired by less than the grace
    ],
)
def test_decisions(vm, run_state, delete, reason):
    decision = reaper.decide(vm, run_state, NOW, grace_s=900)
    assert decision.delete is delete and reason in decision.reason


def test_run_of_reads_exact_ids_from_metadata():
    assert reaper.run_of(instance()) == ("d", "r")


CREATE_ONLY = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("reaper_victim", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    TpuVmCreateOperator(task_id="create_tpu_vm", zones=["us-east5-b"], reservation="r", poll_interval=0.2)
"""

REAPER = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.reaper import TpuVmReaperOperator

with DAG("reaper_{mode}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    TpuVmReaperOperator(task_id="reap", zones=["us-east5-b"], grace_period_s=0, dry_run={dry_run})
"""


def reap_counts(dr):
    [ti] = dr.get_task_instances()
    return ti.xcom_pull(task_ids="reap")


def test_reaper_deletes_a_finished_runs_vm_and_spares_others(emulator, run_dag, fault_matrix):
    # A run whose teardown never ran (e.g. marked failed): its VM outlives it.
    victim = run_dag("reaper_victim", CREATE_ONLY)
    assert victim.state == "success" and len(emulator.instances()) == 1
    # Someone else's instance in the same zone, without our label.
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=AnonymousCredentials()
    )
    client.insert(project="test-project", zone="us-east5-b", instance_resource=compute_v1.Instance(name="not-ours"))

    dry = run_dag("reaper_dry", REAPER.format(mode="dry", dry_run=True))
    assert reap_counts(dry) == {"seen": 1, "deleted": 0, "kept": 0, "dry_run": True}
    assert len(emulator.instances()) == 2

    wet = run_dag("reaper_wet", REAPER.format(mode="wet", dry_run=False))
    assert reap_counts(wet) == {"seen": 1, "deleted": 1, "kept": 0, "dry_run": False}
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
