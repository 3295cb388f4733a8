"""TpuVmCreateOperator / TpuDeleteOperator running deferred inside real Airflow (dag.test) against the emulator."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
import uuid

import pytest
from conftest import emulator_credentials, log_excerpt


def _client():
    """The login and public key of the ``tpu_vm_ssh`` connection (the emulator fixture makes it)."""
    from airflow_tpu_posttrain.hooks.vm import client_identity

    identity = client_identity("tpu_vm_ssh")
    return identity.login, identity.public_key

PROJECT = "test-project"

LIFECYCLE_DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    if "create" in {tasks!r}:
        create = TpuVmCreateOperator(
            task_id="create_tpu_vm", zones={zones!r}, reservation={reservation!r}, poll_interval=0.2,
            ssh_source_ranges={ranges!r}, max_tpu_vms=None, {create_kwargs}
        )
    if "delete" in {tasks!r}:
        delete = TpuDeleteOperator(
            task_id="delete_tpu_vm", zones={zones!r}, firewall={firewall!r}, poll_interval=0.2
        )
    if {tasks!r} == "create+delete":
        create >> delete.as_teardown(setups=create, on_failure_fail_dagrun=True)  # as the pipelines do
"""


def lifecycle(
    dag_id, zones=("us-east5-b",), ranges=(), tasks="create+delete", create_kwargs="", reservation="my-reservation"
):
    """A create / teardown DAG.

    ``ranges``: SSH source ranges (a firewall rule made and deleted with the VM). A reservation is zonal: with
    several zones, the fixture's reservation of that name in each."""
    if reservation and len(zones) > 1 and "=" not in reservation:
        reservation = ",".join(f"{zone}={reservation}" for zone in zones)
    return LIFECYCLE_DAG.format(
        dag_id=dag_id, zones=list(zones), ranges=list(ranges), firewall=bool(ranges), tasks=tasks,
        create_kwargs=create_kwargs, reservation=reservation,
    )


def this_deployment() -> str:
    """The deployment id of the tests' Airflow (their metadata DB): the Variable its first create draws."""
    from airflow.models import Variable

    from airflow_tpu_posttrain.operators.compute_base import DEPLOYMENT_VARIABLE

    if Variable.get(DEPLOYMENT_VARIABLE, default_var=None) is None:
        Variable.set(DEPLOYMENT_VARIABLE, "airflow-tests")
    return Variable.get(DEPLOYMENT_VARIABLE)


def task_states(dag_run):
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def xcom(dag_run, task_id):
    [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == task_id]
    return ti.xcom_pull(task_ids=task_id)


def inserts(emulator):
    return [r for r in emulator.requests if r["method"] == "POST" and r["path"].endswith("/instances")]


def no_instances_within(emulator, seconds=3.0):
    """Deletes issued on an error path complete asynchronously, as they do in Compute."""
    deadline = time.monotonic() + seconds
    while emulator.instances() and time.monotonic() < deadline:
        time.sleep(0.1)
    return emulator.instances() == []


def test_a_deployment_id_drawn_anew_while_the_vm_is_made_renames_nothing(emulator, run_dag, monkeypatch):
    """The first creates of a fresh deployment race to draw its id; one written late changes it mid-create.

    The create records the VM its trigger made, under the name it requested, and the teardown deletes that VM:
    computing the name again at the end of the create named another VM, and left this one running (seen in CI,
    three DAGs' first runs on a loaded machine)."""
    from airflow_tpu_posttrain.operators import tpu_vm

    monkeypatch.setattr(tpu_vm, "deployment_id", lambda: "airflow-later" if emulator.instances() else "airflow-first")
    dr = run_dag("drawn_anew", lifecycle("drawn_anew"))
    assert dr.state == "success", task_states(dr)
    [insert] = inserts(emulator)
    assert xcom(dr, "create_tpu_vm")["name"] == insert["body"]["name"] and "airflow-first" in str(insert["body"])
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and emulator.instances() == []


def test_create_then_teardown_deletes(emulator, run_dag, fault_matrix):
    dr = run_dag("lifecycle_ok", lifecycle("lifecycle_ok", ranges=["203.0.113.0/24"]))
    assert dr.state == "success", task_states(dr)
    created = xcom(dr, "create_tpu_vm")
    assert created["status"] == "RUNNING" and created["zone"] == "us-east5-b"
    assert created["internal_ip"] == created["external_ip"] == created["ssh_address"] != "127.0.0.1"
    assert set(created["host_keys"]) >= {"ssh-ed25519"}
    assert created["machine_type"] == "ct6e-standard-8t" and created["accelerator_type"] == "v6e-8"
    # The task's button to the VM's console page (providers-google's ComputeInstanceDetailsLink URL).
    [create_ti] = [ti for ti in dr.get_task_instances() if ti.task_id == "create_tpu_vm"]
    assert create_ti.xcom_pull(task_ids="create_tpu_vm", key="_link_VmConsoleLink") == (
        "https://console.cloud.google.com/compute/instancesDetail/zones/us-east5-b/instances/"
        f"{created['name']}?project={PROJECT}"
    )
    [insert] = inserts(emulator)
    body = insert["body"]
    assert body["labels"]["managed-by"] == "airflow-tpu-posttrain"
    assert body["labels"]["airflow-dag"] == "lifecycle_ok".replace("_", "-")
    assert int(body["scheduling"]["maxRunDuration"]["seconds"]) == 12 * 3600
    assert insert["query"].get("requestId")
    deleted = xcom(dr, "delete_tpu_vm")
    cost_keys = ("machine_type", "provisioning_model", "vm_seconds", "usd_per_hour", "cost_usd")
    spent = {key: deleted.pop(key) for key in cost_keys}
    assert deleted == {"deleted": True, "name": created["name"], "zone": "us-east5-b", "firewall_deleted": True}
    # What the VM cost: its time from Compute's creationTimestamp to the delete operation's endTime, at the
    # price table's on-demand price of a v6e-8 (a reservation's VM is priced as on demand).
    assert spent["machine_type"] == "ct6e-standard-8t" and spent["provisioning_model"] == "RESERVATION_BOUND"
    assert spent["usd_per_hour"] == 21.6 and 0 < spent["vm_seconds"] < 120
    billed_s = max(spent["vm_seconds"], 60)  # Compute bills a minute at least
    assert spent["cost_usd"] == pytest.approx(billed_s / 3600 * 21.6, abs=0.001)
    assert emulator.instances() == [] and emulator.firewalls() == []
    fault_matrix.record(
        "compute: no fault, create then teardown", True, dr.state, None, "instance and SSH firewall rule deleted"
    )


def test_rerun_of_same_dag_run_reuses_the_instance(emulator, run_dag, fault_matrix):
    body = lifecycle("lifecycle_rerun", tasks="create")
    first = run_dag("lifecycle_rerun", body, run_id="manual__rerun")
    second = run_dag("lifecycle_rerun", body, run_id="manual__rerun")
    assert first.state == second.state == "success"
    assert first.run_id == second.run_id
    assert len(emulator.instances()) == 1
    assert len(inserts(emulator)) == 1
    fault_matrix.record(
        "compute: re-run of the same DAG run reuses its VM (create-only DAG)", None, second.state, None,
        "1 instance, 1 insert over both runs",
    )


def test_terminated_instance_is_replaced_not_duplicated(emulator, run_dag, fault_matrix):
    body = lifecycle("lifecycle_replace", tasks="create")
    first = run_dag("lifecycle_replace", body, run_id="manual__replace")
    name = xcom(first, "create_tpu_vm")["name"]
    emulator.set_instance_status("us-east5-b", name, "TERMINATED")
    second = run_dag("lifecycle_replace", body, run_id="manual__replace")
    assert second.state == "success"
    [instance] = emulator.instances()
    assert instance["name"] == name and instance["status"] == "RUNNING"
    assert len(inserts(emulator)) == 2
    fault_matrix.record(
        "compute: re-run finds its VM TERMINATED -> replaced, not duplicated", None, second.state, None,
        "1 instance (RUNNING, same name), 2 inserts",
    )


def test_stockout_moves_to_next_zone(emulator, run_dag, fault_matrix):
    emulator.set_faults(stockout_zones=["us-east5-a"])
    dr = run_dag("lifecycle_fallback", lifecycle("lifecycle_fallback", zones=("us-east5-a", "us-east5-b")))
    assert dr.state == "success", task_states(dr)
    assert xcom(dr, "create_tpu_vm")["zone"] == "us-east5-b"
    assert [r["path"].split("/zones/")[1].split("/")[0] for r in inserts(emulator)] == ["us-east5-a", "us-east5-b"]
    assert no_instances_within(emulator)
    fault_matrix.record(
        "compute: stock-out in the first zone -> next zone", True, dr.state, None,
        "inserts: us-east5-a (ZONE_RESOURCE_POOL_EXHAUSTED), then us-east5-b",
    )


def test_all_zones_out_fails_clearly_and_leaves_nothing(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(stockout_zones=["us-east5-a", "us-east5-b"])
    dr = run_dag("lifecycle_stockout", lifecycle("lifecycle_stockout", zones=("us-east5-a", "us-east5-b")))
    assert dr.state == "failed"
    assert task_states(dr)["create_tpu_vm"] == "failed"
    logs = "".join(capfd.readouterr())
    assert "No v6e-8 capacity in any zone" in logs
    assert no_instances_within(emulator)
    fault_matrix.record(
        "compute: every zone out of capacity", True, dr.state, None, log_excerpt(logs, "No v6e-8 capacity in any zone")
    )


@pytest.mark.parametrize("refused", ["in its operation", "at the insert"])
def test_quota_error_fails_once_with_a_clear_message(emulator, run_dag, capfd, fault_matrix, refused):
    """Compute refuses on quota in the insert's operation, or at once (HTTP 403 quotaExceeded)."""
    zone = {"quota_exceeded_zones" if refused == "in its operation" else "quota_refused_zones": ["us-east5-a"]}
    emulator.set_faults(**zone)
    body = lifecycle(
        "lifecycle_quota", zones=("us-east5-a", "us-east5-b"), ranges=("10.0.0.0/8",), create_kwargs="retries=3"
    )
    dr = run_dag("lifecycle_quota", body)
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "Quota exceeded" in logs and "TPU_V6E_CHIPS" in logs
    # No retry storm, no fallback: a quota error is not a stock-out.
    assert len(inserts(emulator)) == 1
    assert no_instances_within(emulator)
    deadline = time.monotonic() + 10  # the rule made for the VM goes with the failed create (its delete's operation)
    while emulator.firewalls() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert emulator.firewalls() == []
    fault_matrix.record(
        f"compute: quota exceeded {refused} -> fails at once (1 insert, no retry, no fallback)", True, dr.state,
        None, log_excerpt(logs, "Quota exceeded"),
    )


def test_a_zone_that_does_not_sell_the_tpu_fails_at_once_naming_zones(emulator, run_dag, capfd, fault_matrix):
    """us-central1-a sells TPU v5e and v5p, not v6e: Compute refuses the insert (400), for every retry alike."""
    body = lifecycle(
        "lifecycle_zone", zones=("us-central1-a", "us-east5-b"), ranges=("10.0.0.0/8",), create_kwargs="retries=3"
    )
    dr = run_dag("lifecycle_zone", body)
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "zones: us-central1-a does not sell ct6e-standard-8t (v6e-8)" in logs and "Nothing was created" in logs
    assert len(inserts(emulator)) == 1  # no retry, no fallback to the next zone: the list itself is wrong
    assert emulator.instances() == []
    deadline = time.monotonic() + 10  # the rule made for the VM goes with the failed create
    while emulator.firewalls() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert emulator.firewalls() == []
    fault_matrix.record(
        "compute: a zone that does not sell the TPU -> fails at once naming zones (1 insert, no retry)", True,
        dr.state, None, log_excerpt(logs, "does not sell"),
    )


def test_an_image_family_that_does_not_exist_fails_at_once_naming_it(emulator, run_dag, capfd):
    dr = run_dag("lifecycle_image", lifecycle("lifecycle_image", create_kwargs='image_family="ubuntu-accel-2204-typo"'))
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "image_family: projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2204-typo" in logs
    assert "The referenced image resource cannot be found." in logs and "Nothing was created" in logs
    assert len(inserts(emulator)) == 1 and emulator.instances() == []


def test_missing_reservation_fails_with_its_name(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(missing_reservations=["my-reservation"])
    dr = run_dag("lifecycle_resv", lifecycle("lifecycle_resv"))
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "my-reservation" in logs and "Reservation problem" in logs
    fault_matrix.record(
        "compute: reservation does not exist", None, dr.state, None, log_excerpt(logs, "Reservation problem")
    )


def test_a_failed_create_deletes_its_firewall_rule(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(missing_reservations=["my-reservation"])
    dr = run_dag("lifecycle_fw", lifecycle("lifecycle_fw", ranges=["10.0.0.0/8"], tasks="create"))
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert any(r["method"] == "POST" and r["path"].endswith("/firewalls") for r in emulator.requests)
    deadline = time.monotonic() + 5
    while emulator.firewalls() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert emulator.firewalls() == [] and no_instances_within(emulator)
    fault_matrix.record(
        "compute: a failed create (no teardown) deletes its SSH firewall rule", True, dr.state, None,
        log_excerpt(logs, "Reservation problem"),
    )


def test_bad_input_fails_before_any_api_call(emulator, run_dag, capfd, fault_matrix):
    body = lifecycle("lifecycle_badzone", zones=("us-east5-b; curl evil",), tasks="create")
    dr = run_dag("lifecycle_badzone", body)
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "zones[0]" in logs and "Fix:" in logs
    assert emulator.requests == []
    fault_matrix.record(
        "compute: hostile zone refused before any API call", None, dr.state, None, log_excerpt(logs, "zones[0]")
    )


def test_transient_errors_are_retried(emulator, run_dag, fault_matrix):
    emulator.set_faults(transient_errors={"insert": 2, "get": 2, "delete": 2, "operation": 2})
    dr = run_dag("lifecycle_transient", lifecycle("lifecycle_transient"))
    assert dr.state == "success", task_states(dr)
    assert no_instances_within(emulator)
    served = emulator.transient_errors_served
    assert served == {"insert": 2, "get": 2, "delete": 2, "operation": 2}, served  # each a 503 then a 429
    errors = lambda kinds: ", ".join(f"{kind} {served[kind]}" for kind in kinds)  # noqa: E731
    fault_matrix.record(
        "compute: 429/503 bursts on insert, get, operation -> retried", True, dr.state, None,
        f"errors served: {errors(('insert', 'get', 'operation'))} (503 backendError, then 429)",
    )
    fault_matrix.record(
        "compute: delete fails transiently (503, 429) -> retried", True, dr.state, None,
        f"errors served: {errors(('delete',))} (503 backendError, then 429)",
    )


def test_delete_of_missing_instance_succeeds_from_name_alone(emulator, run_dag):
    body = lifecycle("lifecycle_nothing", tasks="delete")
    dr = run_dag("lifecycle_nothing", body)
    assert dr.state == "success"
    assert xcom(dr, "delete_tpu_vm")["deleted"] is False


def test_teardown_after_half_done_create_finds_the_vm(emulator, run_dag, fault_matrix):
    """A run's VM exists but its create XCom is gone: the teardown finds it by the deterministic name."""
    body = lifecycle("lifecycle_half", tasks="create")
    run_dag("lifecycle_half", body, run_id="manual__half")
    [instance] = emulator.instances()
    # Teardown-only DAG run of the same run: no XCom from create in this DAG, found by deterministic name.
    teardown = lifecycle("lifecycle_half", tasks="delete")
    dr = run_dag("lifecycle_half", teardown, run_id="manual__half")
    assert dr.state == "success"
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True
    assert no_instances_within(emulator)
    fault_matrix.record(
        "compute: teardown without the create's XCom finds the VM by name", True, dr.state, None,
        "deleted by its deterministic name",
    )


def test_failed_delete_operation_is_reported_as_failed(emulator, run_dag, capfd, fault_matrix):
    body = lifecycle("lifecycle_faildelete")
    emulator.set_faults(fail_deletes=True)
    dr = run_dag("lifecycle_faildelete", body)
    assert task_states(dr)["delete_tpu_vm"] == "failed"
    assert dr.state == "failed"  # a VM that could not be deleted is never a green run
    assert len(emulator.instances()) == 1
    logs = "".join(capfd.readouterr())
    name = xcom(dr, "create_tpu_vm")["name"]
    assert f"Deleting {name} failed" in logs
    fault_matrix.record(
        "compute: delete operation fails -> run FAILED (VM left for the reaper)", False, dr.state, None, log_excerpt(logs, f"Deleting {name} failed"),
    )


def test_retry_after_a_half_done_insert_reuses_the_instance(emulator, run_dag, fault_matrix):
    """A try died after Compute accepted its insert (worker lost before deferring): the next try adopts that VM."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.recipes.access import ssh_keys_metadata
    from airflow_tpu_posttrain.recipes.compute import (
        TpuVmSpec,
        instance_body,
        instance_name,
        ownership_labels,
    )

    deployment = this_deployment()
    name = instance_name("lifecycle_half_insert", "manual__half_insert", "tpu", deployment)
    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation="my-reservation")
    labels = ownership_labels("lifecycle_half_insert", "manual__half_insert", "create_tpu_vm", 2_000_000_000, deployment)
    body = instance_body(spec, name, "us-east5-b", labels, ssh_keys=ssh_keys_metadata(*_client(), 2_000_000_000))
    client.insert(project=PROJECT, zone="us-east5-b", instance_resource=compute_v1.Instance.from_json(json.dumps(body)))
    dr = run_dag("lifecycle_half_insert", lifecycle("lifecycle_half_insert", tasks="create"), run_id="manual__half_insert")
    assert dr.state == "success"
    assert xcom(dr, "create_tpu_vm")["name"] == name
    assert len(inserts(emulator)) == 1  # only the earlier try's
    assert [i["name"] for i in emulator.instances()] == [name]
    fault_matrix.record(
        "compute: retry after a half-done insert adopts that VM", None, dr.state, None,
        "no second insert; 1 instance",
    )


def test_a_vm_of_the_same_name_from_another_deployment_is_neither_used_nor_deleted(emulator, run_dag, capfd):
    """Two Airflow deployments sharing a project: another deployment's VM of this run's name is left alone.

    (An id collision, or a copied id.) The create refuses it rather than adopt it, and nothing deletes it."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.recipes.access import ssh_keys_metadata
    from airflow_tpu_posttrain.recipes.compute import (
        TpuVmSpec,
        instance_body,
        instance_name,
        ownership_labels,
    )

    name = instance_name("lifecycle_foreign", "manual__foreign", "tpu", this_deployment())
    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation="my-reservation")
    labels = ownership_labels("lifecycle_foreign", "manual__foreign", "create_tpu_vm", 2_000_000_000, "otherdeploy")
    body = instance_body(spec, name, "us-east5-b", labels, ssh_keys=ssh_keys_metadata(*_client(), 2_000_000_000))
    client.insert(project=PROJECT, zone="us-east5-b", instance_resource=compute_v1.Instance.from_json(json.dumps(body)))
    dr = run_dag("lifecycle_foreign", lifecycle("lifecycle_foreign"), run_id="manual__foreign")
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "was made by Airflow deployment 'otherdeploy', not this one" in logs
    assert len(inserts(emulator)) == 1 and [i["name"] for i in emulator.instances()] == [name]  # still there
    assert not [r for r in emulator.requests if r["method"] == "DELETE"]


_CREATE_PROBE = """
import json, sys
from datetime import UTC, datetime
from types import SimpleNamespace
from airflow.sdk.exceptions import TaskDeferred
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

op = TpuVmCreateOperator(
    task_id="create_tpu_vm", zones=["us-east5-a", "us-east5-b"], reservation="us-east5-a=r,us-east5-b=r",
    ssh_source_ranges=["203.0.113.0/24"], poll_interval=0.1,
)
pushed = {}
ti = SimpleNamespace(id="0190-ti", xcom_push=lambda key, value: pushed.__setitem__(key, value))
dag_run = SimpleNamespace(dag_id="probe_dag", run_id="manual__probe", start_date=datetime.now(UTC))
context = {"ti": ti, "dag": SimpleNamespace(dag_id="probe_dag", dagrun_timeout=None), "run_id": "manual__probe",
           "dag_run": dag_run}
try:
    op.execute(context)
except TaskDeferred as deferred:
    print(json.dumps({
        "trigger": deferred.trigger.serialize(),
        "record": pushed["return_value"],
        "compute_client_loaded": "google.cloud.compute_v1" in sys.modules,
        "google_hook_loaded": "airflow.providers.google.common.hooks.base_google" in sys.modules,
    }))
"""


def _revive(trigger):
    """The trigger as another triggerer rebuilds it from its serialized form."""
    import importlib

    classpath, kwargs = trigger if isinstance(trigger, list | tuple) else trigger.serialize()
    module, cls = classpath.rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(**kwargs)


def _first_event(trigger):
    import asyncio

    async def first():
        return await anext(trigger.run())

    return asyncio.run(first()).payload


def test_create_defers_at_once_and_creates_from_the_triggerer(emulator):
    """The create's worker part calls no Compute API and loads no Google client: the triggerer creates the VM.

    Every call (the network check, the lookup of an earlier try's instance, the insert, the wait to RUNNING and to
    SSH) is the trigger's; it is rebuilt from its serialized form, and run again (as after a triggerer restart)
    it finds the VM it made instead of making a second."""
    import subprocess
    import sys

    env = {**os.environ, "AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID": "airflow-probe"}  # no task runner to ask
    proc = subprocess.run(
        [sys.executable, "-c", _CREATE_PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["compute_client_loaded"] is False and probe["google_hook_loaded"] is False
    assert emulator.requests == []  # not one API call from the worker
    # The record a teardown finds the VM by, pushed before anything is created.
    assert probe["record"]["status"] == "CREATING" and probe["record"]["zones"] == ["us-east5-a", "us-east5-b"]
    name = probe["record"]["name"]

    event = _first_event(_revive(probe["trigger"]))
    assert event["status"] == "ready", event
    assert event["zone"] == "us-east5-a" and event["instance"]["name"] == name
    assert event["instance"]["status"] == "RUNNING" and "ssh-ed25519" in event["host_keys"]
    assert event["state"]["phase"] == "create"  # the operator's state, returned unchanged
    again = _first_event(_revive(probe["trigger"]))
    assert again["status"] == "ready" and again["instance"]["id"] == event["instance"]["id"]
    assert len(inserts(emulator)) == 1 and [i["name"] for i in emulator.instances()] == [name]
    assert [f["name"] for f in emulator.firewalls()] == [probe["record"]["firewall"]]


def test_the_teardown_trigger_survives_a_triggerer_restart(emulator):
    """The teardown's trigger: the delete starts in the triggerer; a second one finds nothing to delete."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.triggers.compute import ComputeDeleteTrigger

    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    client.insert(project=PROJECT, zone="us-east5-b", instance_resource=compute_v1.Instance(
        name="tpu-r", machine_type="zones/us-east5-b/machineTypes/ct6e-standard-8t"))
    deletes = [{"name": "tpu-r", "zone": "us-east5-b", "request_id": "9b0c6f7e-2f1d-4a57-9c3e-0d1f2a3b4c5d"}]
    deleting = ComputeDeleteTrigger(project_id=PROJECT, deletes=deletes, poll_interval=0.1, state={"name": "tpu-r"})
    event = _first_event(_revive(deleting))
    [deleted] = event.pop("deleted")
    assert event == {"status": "success", "errors": [], "state": {"name": "tpu-r"}}
    # What its cost needs: the instance as read before the delete (nothing else of it), the delete's end.
    assert (deleted["name"], deleted["zone"], set(deleted["instance"])) == (
        "tpu-r", "us-east5-b", {"creationTimestamp", "lastStartTimestamp", "machineType", "scheduling"}
    )
    ended, created = deleted["ended"], deleted["instance"]["creationTimestamp"]
    assert dt.datetime.fromisoformat(ended) >= dt.datetime.fromisoformat(created)
    assert emulator.instances() == []
    again = ComputeDeleteTrigger(project_id=PROJECT, deletes=[{**deletes[0], "request_id": str(uuid.uuid4())}],
                                 poll_interval=0.1)
    assert _first_event(_revive(again))["deleted"] == []


_TEARDOWN_PROBE = """
import json, sys
from types import SimpleNamespace
from airflow.sdk.exceptions import TaskDeferred
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator

op = TpuDeleteOperator(task_id="delete_tpu_vm", project_id="test-project", zones=["us-east5-b"], firewall=True)
ti = SimpleNamespace(id="0190-ti", xcom_pull=lambda **_: None)
context = {"ti": ti, "dag": SimpleNamespace(dag_id="probe_dag"), "run_id": "manual__probe"}
try:
    op.execute(context)
except TaskDeferred as deferred:
    print(json.dumps({
        "deletes": deferred.trigger.deletes,
        "compute_client_loaded": "google.cloud.compute_v1" in sys.modules,
    }))
"""


def test_teardown_defers_at_once_and_deletes_from_the_triggerer():
    """The teardown's worker part only names what to delete: the API calls happen in the triggerer.

    The triggerer has the Compute client loaded, so the worker never pays its import (seconds) while the TPU
    VM is still billed."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID": "airflow-probe"}  # no task runner to ask
    proc = subprocess.run(
        [sys.executable, "-c", _TEARDOWN_PROBE], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    assert probe["compute_client_loaded"] is False
    [vm, firewall] = probe["deletes"]
    assert vm["name"].startswith("tpu-probe-dag-") and vm["zone"] == "us-east5-b"
    assert firewall == {"name": f"{vm['name'][:56]}-ssh", "zone": None, "request_id": firewall["request_id"]}
    assert vm["request_id"] != firewall["request_id"]


FLEX_START = 'provisioning_model="FLEX_START", max_run_duration=3600, max_wait_for_capacity={wait}'


class _StatusSampler:
    """The statuses the emulator's instances went through, sampled every 0.1 s while a DAG runs."""

    def __init__(self, emulator):
        import threading

        self.emulator, self.seen, self.stop = emulator, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(0.1):
            for instance in self.emulator.instances():
                if not self.seen or self.seen[-1] != instance["status"]:
                    self.seen.append(instance["status"])

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)


def test_flex_start_waits_pending_until_capacity_comes(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(flex_start_capacity_after=3)
    body = lifecycle("lifecycle_flex", reservation=None, create_kwargs=FLEX_START.format(wait=60))
    with _StatusSampler(emulator) as sampler:
        dr = run_dag("lifecycle_flex", body)
    assert dr.state == "success", task_states(dr)
    [insert] = inserts(emulator)  # the PENDING VM was waited for, not replaced
    assert insert["body"]["params"] == {"requestValidForDuration": {"seconds": "60"}}
    assert insert["body"]["scheduling"]["provisioningModel"] == "FLEX_START"
    assert sampler.seen[:1] == ["PENDING"] and "RUNNING" in sampler.seen, sampler.seen
    assert xcom(dr, "create_tpu_vm")["status"] == "RUNNING"
    assert no_instances_within(emulator)
    fault_matrix.record(
        "FLEX_START: VM PENDING in the capacity queue -> waited for, then RUNNING", True, dr.state, None,
        f"requestValidForDuration 60 s; statuses seen: {' -> '.join(sampler.seen)}",
    )


def test_flex_start_wait_time_ends_without_capacity(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(flex_start_capacity_after=600)
    body = lifecycle("lifecycle_flex_timeout", reservation=None, create_kwargs=FLEX_START.format(wait=2))
    dr = run_dag("lifecycle_flex_timeout", body)
    assert dr.state == "failed"
    assert task_states(dr)["create_tpu_vm"] == "failed"
    [insert] = inserts(emulator)
    assert insert["body"]["params"] == {"requestValidForDuration": {"seconds": "2"}}
    logs = "".join(capfd.readouterr())
    assert "No v6e-8 capacity in any zone" in logs
    assert no_instances_within(emulator)
    fault_matrix.record(
        "FLEX_START: wait time (requestValidForDuration) ends without capacity -> fails, nothing left", True,
        dr.state, None, log_excerpt(logs, "No v6e-8 capacity in any zone"),
    )


def test_flex_start_wait_longer_than_two_hours_is_refused(emulator, run_dag, capfd):
    body = lifecycle("lifecycle_flex_long", reservation=None, create_kwargs=FLEX_START.format(wait=3 * 3600))
    dr = run_dag("lifecycle_flex_long", body)
    assert dr.state == "failed"
    assert inserts(emulator) == []
    assert "max_wait_for_capacity" in "".join(capfd.readouterr())


def test_max_run_duration_refused_for_a_model_is_dropped_once(emulator, run_dag, capfd, fault_matrix):
    """When Compute refuses scheduling.maxRunDuration, the create tries once more without it.

    No Google document says whether every provisioning model takes it: when Compute answers 400 naming it, the
    create says so, and the VM keeps its expires-at label for the reaper."""
    emulator.set_faults(refuse_max_run_duration=["SPOT"])
    body = lifecycle("lifecycle_no_mrd", reservation=None, tasks="create", create_kwargs='provisioning_model="SPOT"')
    dr = run_dag("lifecycle_no_mrd", body)
    assert dr.state == "success", task_states(dr)
    first, second = inserts(emulator)
    assert "maxRunDuration" in first["body"]["scheduling"] and "maxRunDuration" not in second["body"]["scheduling"]
    record = xcom(dr, "create_tpu_vm")
    assert record["max_run_duration_s"] is None and record["status"] == "RUNNING"
    [instance] = emulator.instances()
    assert int(instance["labels"]["expires-at"]) > time.time()  # what the reaper deletes it by
    logs = "".join(capfd.readouterr())
    assert "Compute refused scheduling.maxRunDuration for a SPOT VM" in logs
    fault_matrix.record(
        "compute: maxRunDuration refused (400) for a model -> created without it, reaper is the backstop", None,
        dr.state, None, log_excerpt(logs, "Compute refused scheduling.maxRunDuration"),
    )


def test_reservation_forms_reach_the_insert_as_documented(emulator, run_dag):
    """A shared reservation's path and a block of it, one per zone: each zone's insert names its own."""
    emulator.set_faults(stockout_zones=["us-east5-a"])
    reservation = f"us-east5-a=my-reservation,us-east5-b=projects/{PROJECT}/reservations/r/reservationBlocks/b1"
    dr = run_dag("lifecycle_blocks", lifecycle("lifecycle_blocks", zones=("us-east5-a", "us-east5-b"),
                                               reservation=reservation))
    assert dr.state == "success", task_states(dr)
    affinities = [r["body"]["reservationAffinity"]["values"] for r in inserts(emulator)]
    assert affinities == [["my-reservation"], [f"projects/{PROJECT}/reservations/r/reservationBlocks/b1"]]
    assert no_instances_within(emulator)


def test_standard_vm_consumes_a_specific_reservation(emulator, run_dag):
    body = lifecycle("lifecycle_standard_resv", create_kwargs='provisioning_model="STANDARD"', reservation="r")
    dr = run_dag("lifecycle_standard_resv", body)
    assert dr.state == "success", task_states(dr)
    [insert] = inserts(emulator)
    assert insert["body"]["scheduling"]["provisioningModel"] == "STANDARD"
    assert insert["body"]["reservationAffinity"] == {
        "consumeReservationType": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name",
        "values": ["r"],
    }
