"""The slice's create and teardown operators in a DAG: every VM reachable, or none left; one teardown.

``dag.test()`` with the Compute emulator, whose instances are local machines with their own sshds."""

from __future__ import annotations

import time

import pytest
from conftest import PROJECT, compute_clients, log_excerpt
from test_capacity import hold_place, release_when_waiting
from test_tpu_vm_operators import task_states, xcom

from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
from airflow_tpu_posttrain.recipes import capacity, places, slices

SLICE_DAG = """
from datetime import datetime
from airflow.sdk import DAG, TriggerRule, task
from airflow_tpu_posttrain.operators.tpu_slice import TpuSliceCreateOperator, TpuSliceDeleteOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    create = TpuSliceCreateOperator(
        task_id="create_tpu_vm", zone="us-east5-b", accelerator_type={accelerator!r},
        reservation="slice-reservation", poll_interval=0.2, max_wait_for_capacity={wait}, {cap_key}={cap!r},
        capacity_claims={claims!r}, network={network!r}, subnetwork={subnetwork!r},
    )

    @task
    def on_every_vm(record):
        from airflow_tpu_posttrain.hooks.vm import VmHook

        said = {{}}
        for vm in record["vms"]:
            with VmHook(
                "tpu_vm_ssh", remote_host=vm["ssh_address"], username=vm["ssh_login"], host_keys=vm["host_keys"]
            ) as hook:
                said[vm["name"]] = hook.run("hostname").strip()
        return said

    delete = TpuSliceDeleteOperator(task_id="delete_tpu_vm", zone="us-east5-b", poll_interval=0.2)
    create >> on_every_vm(create.output) >> delete.as_teardown(setups=create)
    delete.trigger_rule = TriggerRule.NONE_SKIPPED  # as the pipelines wire it: also after a failed create
"""


def slice_dag(
    dag_id: str, accelerator: str = "v6e-16", wait: int = 60, cap: int | None = None, claims: str | None = None,
    network: str = "default", subnetwork: str | None = None, cap_key: str = "max_tpu_chips",
) -> str:
    return SLICE_DAG.format(
        dag_id=dag_id, accelerator=accelerator, wait=wait, cap=cap, claims=claims, network=network,
        subnetwork=subnetwork, cap_key=cap_key,
    )


@pytest.fixture
def sliced(emulator):
    emulator.add_reservation("slice-reservation", "us-east5-b", 4, machine_type="ct6e-standard-4t")
    return emulator


def _nothing_left(emulator) -> bool:
    """No VM, group, template, workload policy or firewall rule, as Compute lists them."""
    gce = compute_clients(emulator)
    return (
        emulator.instances() == []
        and emulator.firewalls() == []
        and list(gce.migs.list(project=PROJECT, zone="us-east5-b")) == []
        and list(gce.templates.list(project=PROJECT)) == []
        and list(gce.policies.list(project=PROJECT, region="us-east5")) == []
    )


def test_a_slice_is_made_whole_each_vm_logged_into_and_the_teardown_deletes_it_all(sliced, run_dag):
    dr = run_dag("slice_ok", slice_dag("slice_ok"))
    assert dr.state == "success", task_states(dr)
    record = xcom(dr, "create_tpu_vm")
    names = slices.slice_names(record["name"])
    assert [vm["worker_id"] for vm in record["vms"]] == [0, 1, 2, 3]
    assert {vm["status"] for vm in record["vms"]} == {"RUNNING"}
    assert sorted(vm["name"] for vm in record["vms"]) == [names.member(i) for i in range(4)]
    assert record["slice"] == {"group": names.group, "template": names.template, "policy": names.policy}
    assert sorted(xcom(dr, "on_every_vm")) == [names.member(i) for i in range(4)]  # each VM answered
    deleted = xcom(dr, "delete_tpu_vm")
    assert deleted["deleted"] and deleted["vms"] == 4
    assert deleted["cost_usd"] is not None and deleted["vm_seconds"] > 0  # every VM counted
    assert _nothing_left(sliced)


def test_a_slice_without_capacity_fails_having_left_nothing_and_the_teardown_finds_nothing(sliced, run_dag, capfd):
    sliced.set_faults(stockout_zones=["us-east5-b"])
    dr = run_dag("slice_stockout", slice_dag("slice_stockout", wait=2))
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "No capacity for slice" in logs and "ZONE_RESOURCE_POOL_EXHAUSTED" in logs
    assert task_states(dr)["delete_tpu_vm"] == "success" and xcom(dr, "delete_tpu_vm")["deleted"] is False
    assert _nothing_left(sliced)


def test_one_vm_is_not_a_slice_and_is_refused_before_anything_is_made(sliced, run_dag, capfd):
    dr = run_dag("slice_single", slice_dag("slice_single", accelerator="v6e-8"))
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "accelerator_type='v6e-8': is one VM, not a slice" in "".join(capfd.readouterr())
    assert [r for r in sliced.requests if r["method"] == "POST"] == []


def test_a_slice_whose_host_keys_are_not_its_vms_is_deleted_whole(sliced, run_dag, capfd):
    """The published keys are not the ones the VMs' sshds show: nothing is trusted, and nothing is kept."""
    sliced.set_faults(impostor_host_keys=True)
    dr = run_dag("slice_impostor", slice_dag("slice_impostor"))
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "Deleting slice" in logs and "VmHostKeyMismatchError" in logs
    assert _nothing_left(sliced)


def test_a_slice_whose_vms_are_told_no_worker_id_is_never_handed_on(sliced, run_dag, capfd):
    """Each VM is asked its worker id over SSH, from its metadata server (the API's view shows none).

    A slice whose metadata servers tell none fails its create, naming the keys asked, and the teardown deletes it
    whole: every training command on it would fail, on a billed slice."""
    sliced.set_faults(no_worker_id_metadata=True)
    dr = run_dag("slice_no_ids", slice_dag("slice_no_ids"))
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed" and task_states(dr)["on_every_vm"] == "upstream_failed"
    assert "the worker ids its VMs' metadata servers tell (agent-worker-number or worker-id) are not 0 to 3" in logs
    assert "metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number" in logs
    assert task_states(dr)["delete_tpu_vm"] == "success" and xcom(dr, "delete_tpu_vm")["deleted"] is True
    assert _nothing_left(sliced)


def test_the_reaper_ends_a_slice_left_behind_whole_then_its_template_and_policy(sliced, run_dag):
    """A run whose teardown never ran: its slice's group goes once, ending every VM; then its template and policy.

    Each stale VM is of the group: the group is deleted once, and each VM counted (its cost logged)."""
    from test_reaper import REAPER, reap_counts

    create_only = slice_dag("slice_left").split("    @task")[0]
    assert run_dag("slice_left", create_only).state == "success" and len(sliced.instances()) == 4

    first = reap_counts(run_dag("reaper_slice_1", REAPER.format(mode="slice_1", dry_run=False)))
    assert (first["seen"], first["deleted"], first["slices_deleted"]) == (4, 4, 1)
    gce = compute_clients(sliced)
    deadline = time.monotonic() + 30
    while list(gce.migs.list(project=PROJECT, zone="us-east5-b")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Compute calls the template and policy in use a while after their group is gone: a later pass deletes them,
    # and the slice's firewall rule once no group or VM of its name is left.
    parts = rules = 0
    for attempt in range(2, 12):
        later = reap_counts(run_dag(f"reaper_slice_{attempt}", REAPER.format(mode=f"slice_{attempt}", dry_run=False)))
        assert later["seen"] == 0
        parts, rules = parts + later["slice_parts_deleted"], rules + later["firewalls_deleted"]
        if (parts, rules) == (2, 1):
            break
    assert (parts, rules) == (2, 1)
    deadline = time.monotonic() + 30
    while not _nothing_left(sliced):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_slice_larger_than_the_cap_is_refused_before_anything_is_made(
    sliced, capacity_claims, run_dag, capfd, fault_matrix
):
    """max_tpu_vms=1 (deprecated: VMs of 4 chips) admits 4 chips: a slice of 4 VMs (16 chips) is refused, naming it."""
    dr = run_dag("slice_over", slice_dag("slice_over", cap=1, claims=capacity_claims, cap_key="max_tpu_vms"))
    assert task_states(dr)["create_tpu_vm"] == "failed"
    logs = "".join(capfd.readouterr())
    assert "max_tpu_vms=1: admits 4 TPU chips at once, fewer than the 16 of this create's 4 VM(s)" in logs
    assert "Fix: raise max_tpu_vms to at least 4" in logs
    assert not [r for r in sliced.requests if r["method"] == "POST"]  # nothing made, nothing asked of Compute
    assert StoredRecordHook().lines(capacity_claims) == []  # not in any line
    fault_matrix.record(
        "capacity: a slice of 16 chips (4 VMs) under max_tpu_vms=1 -> refused before anything is made, naming the cap",
        None, dr.state, None, log_excerpt(logs, "admits 4 TPU chips"),
    )


def test_a_slice_waits_in_line_for_its_place_having_made_nothing(sliced, capacity_claims, run_dag, capfd):
    """Another run's VM holds the line's one place: the slice's create waits, then makes the slice.

    Its delete gives the place back. The VM and the slice count in one line (a reservation's), whatever their
    shapes."""
    sliced.add_reservation("other-reservation", "us-east5-b", 1)
    key = places.line_key(PROJECT, "us-east5-b", "slice-reservation", "ct6e-standard-4t")
    line = places.line_uri(capacity_claims, key)
    hold_place(sliced, "tpu-other-run", reservation="other-reservation", claims=capacity_claims, key=key, cap=16)
    release_when_waiting(sliced, "tpu-other-run", 3, f"labels.{capacity.GROUP_LABEL} =", line)
    dr = run_dag("slice_cap", slice_dag("slice_cap", cap=16, claims=capacity_claims))
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Waiting for TPU capacity, #1 in line" in logs and "for 16 TPU chips" in logs  # its 4 VMs' chips
    assert "8 of 16 TPU chips in use by posttrain_rl__other/scheduled__other (tpu-other-run, 8 chips)" in logs
    # Nothing of the slice was made while the other run's VM lived: its VM's delete came before the slice's policy.
    paths = [(r["method"], r["path"]) for r in sliced.requests]
    released = paths.index(("DELETE", f"/compute/v1/projects/{PROJECT}/zones/us-east5-b/instances/tpu-other-run"))
    first_insert = next(i for i, (method, path) in enumerate(paths) if method == "POST" and path.endswith("/resourcePolicies"))
    assert released < first_insert
    assert xcom(dr, "delete_tpu_vm")["vms"] == 4
    assert _nothing_left(sliced)
    assert StoredRecordHook().read(line) == {"holders": {}, "waiting": {}}
