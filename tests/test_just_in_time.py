"""The TPU VM requested just in time: the create waits for the conversion, as earlier runs measured it.

The operator runs deferred inside real Airflow (dag.test) against the Compute emulator; the measurements are the
Airflow Variable the conversion and install tasks write (``operators/just_in_time.py``)."""

from __future__ import annotations

import json
import re

import pytest
from conftest import emulator_credentials
from test_tpu_vm_operators import PROJECT, _client, inserts, task_states, this_deployment, xcom

from airflow_tpu_posttrain.recipes import timings

REVISION = "0123456789abcdef0123456789abcdef01234567"
INPUTS = {"model": "tiny-llama", "revisions": {"model:local/tiny-llama": REVISION}, "maxtext_version": "0.2.5"}

JIT_DAG = """
from datetime import datetime
from airflow.sdk import DAG, TriggerRule, task
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    @task
    def check_inputs():
        return {inputs!r}

    @task
    def convert():
        if {fails!r}:
            raise RuntimeError("the conversion failed")

    create = TpuVmCreateOperator(
        task_id="create_tpu_vm", zones=["us-east5-b"], reservation="my-reservation", poll_interval=0.2,
        max_tpu_vms=None, conversion_task_id="convert", conversion_accelerator_type="cpu", inputs=check_inputs(),
        trigger_rule="all_done",
    )
    if {fails!r}:
        convert() >> create  # the conversion fails before the create looks
        # The pipelines' teardown, wired as they wire it.
        delete = TpuDeleteOperator(task_id="delete_tpu_vm", zones=["us-east5-b"], poll_interval=0.2)
        create >> delete.as_teardown(setups=create)
        delete.trigger_rule = TriggerRule.NONE_SKIPPED
    else:
        create >> convert()  # the conversion has not started when the create looks
"""


@pytest.fixture
def measured():
    """Set the deployment's measurements for the test; the Variable is removed afterwards."""
    from airflow.models import Variable

    from airflow_tpu_posttrain.operators.just_in_time import TIMINGS_VARIABLE

    def _set(record: dict) -> None:
        Variable.set(TIMINGS_VARIABLE, record, serialize_json=True)

    yield _set
    Variable.delete(TIMINGS_VARIABLE)


def jit_dag(dag_id: str, fails: bool = False) -> str:
    return JIT_DAG.format(dag_id=dag_id, inputs=INPUTS, fails=fails)


def requested(logs: str) -> re.Match:
    match = re.search(r"TPU VM requested at t\+(\d+) s: ([^\[\n]*)", logs)
    assert match, logs[-3000:]
    return match


def test_a_conversion_miss_requests_the_vm_when_the_conversion_is_about_to_end(emulator, run_dag, capfd, measured):
    # Earlier runs: the conversion ended 45 s after the run's start; the TPU VM was ready 5 s after its request.
    # (The create must come to its decision before t+40 s, on a loaded machine too, for it to wait.)
    record = timings.with_conversion({}, "tiny-llama", "e2-standard-2", 45.0)
    measured(timings.with_ready(record, "ct6e-standard-8t", 5.0))
    dr = run_dag("jit_miss", jit_dag("jit_miss"))
    assert dr.state == "success", task_states(dr)
    created = xcom(dr, "create_tpu_vm")
    # Requested 45 - 5 = 40 s into the run, not at its start: the create waited, deferred.
    assert created["requested_at"] - dr.start_date.timestamp() >= 40.0
    assert len(inserts(emulator)) == 1
    logs = "".join(capfd.readouterr())
    assert re.search(r"TPU VM to be requested in \d+ s: conversion expected to end in \d+ s, the VM ready in 5 s", logs)
    match = requested(logs)
    assert int(match[1]) >= 40
    # Within the VM's ready time of the conversion's expected end (less the moment the task took to resume).
    assert re.fullmatch(r"conversion expected to end in [0-5] s", match[2].strip()), match[2]


def test_a_cached_conversion_requests_the_vm_at_once(emulator, run_dag, capfd, measured):
    # A conversion of this revision for this MaxText release is in storage; a fresh one took an hour.
    record = timings.with_conversion({}, "tiny-llama", "e2-standard-2", 3600.0)
    measured(timings.with_converted(record, "tiny-llama", REVISION, "0.2.5"))
    dr = run_dag("jit_hit", jit_dag("jit_hit"))
    assert dr.state == "success", task_states(dr)
    assert xcom(dr, "create_tpu_vm")["requested_at"] - dr.start_date.timestamp() < 60
    match = requested("".join(capfd.readouterr()))
    assert match[2].strip() == f"tiny-llama at {REVISION} is converted already (cached)"


def test_nothing_measured_requests_the_vm_at_once(emulator, run_dag, capfd, measured):
    measured({})
    dr = run_dag("jit_unknown", jit_dag("jit_unknown"))
    assert dr.state == "success", task_states(dr)
    match = requested("".join(capfd.readouterr()))
    assert match[2].strip() == "no conversion of tiny-llama on e2-standard-2 measured yet"


def test_a_failed_conversion_creates_no_vm(emulator, run_dag, capfd, measured):
    measured(timings.with_conversion({}, "tiny-llama", "e2-standard-2", 3600.0))
    dr = run_dag("jit_failed", jit_dag("jit_failed", fails=True))
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert inserts(emulator) == [] and emulator.instances() == []
    assert task_states(dr)["delete_tpu_vm"] == "success"  # ran, found nothing
    assert "The conversion (convert) ended failed: this try requested no TPU VM" in "".join(capfd.readouterr())


def test_a_failed_conversion_after_an_earlier_try_made_the_vm_deletes_that_vm(emulator, run_dag, capfd, measured):
    """Try 1 requested the VM just in time and failed after the insert; the conversion then failed.

    Try 2 of the create requests nothing and fails (a skip would skip the teardown too, leaving the v6e-8 to the
    reaper's grace); the teardown finds the earlier try's VM by its deterministic name and deletes it."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.recipes.access import ssh_keys_metadata
    from airflow_tpu_posttrain.recipes.compute import (
        TpuVmSpec,
        instance_body,
        instance_name,
        ownership_labels,
    )

    measured(timings.with_conversion({}, "tiny-llama", "e2-standard-2", 3600.0))
    dag_id, run_id = "jit_leftover", "manual__jit_leftover"
    name = instance_name(dag_id, run_id, "tpu", this_deployment())
    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation="my-reservation")
    labels = ownership_labels(dag_id, run_id, "create_tpu_vm", 2_000_000_000, this_deployment())
    body = instance_body(spec, name, "us-east5-b", labels, ssh_keys=ssh_keys_metadata(*_client(), 2_000_000_000))
    client = compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    client.insert(project=PROJECT, zone="us-east5-b", instance_resource=compute_v1.Instance.from_json(json.dumps(body)))
    assert [i["name"] for i in emulator.instances()] == [name]
    dr = run_dag(dag_id, jit_dag(dag_id, fails=True), run_id=run_id)
    states = task_states(dr)
    assert (states["create_tpu_vm"], states["delete_tpu_vm"]) == ("failed", "success")
    assert len(inserts(emulator)) == 1  # the earlier try's only
    assert emulator.instances() == []
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True


def test_the_request_goes_out_the_ready_time_before_the_conversion_ends():
    record = timings.with_conversion({}, "m", "n2-highmem-16", 600.0)
    record = timings.with_conversion(record, "m", "n2-highmem-16", 500.0)
    record = timings.with_ready(record, "ct6e-standard-8t", 150.0)
    # The shortest conversion and the longest ready time: the VM rather idles briefly than holds training back.
    assert timings.expected_conversion_end(record, "m", "n2-highmem-16") == 500.0
    assert timings.request_delay(500.0, timings.expected_ready(record, "ct6e-standard-8t"), 100.0) == 250.0
    assert timings.request_delay(500.0, 150.0, 400.0) == 0.0  # already due
    assert timings.request_delay(None, 150.0, 0.0) == 0.0  # never measured: at once
    assert timings.expected_ready({}, "ct6e-standard-8t") == timings.DEFAULT_READY_S
    for seconds in range(10):
        record = timings.with_conversion(record, "m", "n2-highmem-16", 1000.0 + seconds)
    assert len(record["conversions"]["m/n2-highmem-16"]) == timings.KEEP


def test_a_conversion_time_from_a_run_whose_start_is_not_its_start_is_not_kept():
    """A run dated months ago (dag.test with an old logical date, a cleared run) would hold back every later request."""
    record = timings.with_conversion({}, "m", "n2-highmem-16", 600.0)
    assert timings.with_conversion(record, "m", "n2-highmem-16", 242 * 86400.0) == record
    assert timings.expected_conversion_end(record, "m", "n2-highmem-16") == 600.0
