"""A multi-host slice's resources, built from what a single-host VM gets and made on the Compute emulator.

The policy, template and group bodies of ``recipes/slices.py``, sent through ``TpuVmHook`` with the official
client in the order Google's MIG how-to gives, and deleted in the reverse order."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from types import SimpleNamespace

import pytest
from conftest import PROJECT, RUNNER_ACCOUNT, RUNNER_ROLES

from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
from airflow_tpu_posttrain.recipes import compute, remote_job, slices
from airflow_tpu_posttrain.recipes.compute import TpuVmSpec

ZONE, REGION = "us-east5-b", "us-east5"
RUN_VM = compute.instance_name("posttrain_sft__gemma3-4b", "manual__2026-12-04T10:00:00", "tpu", "airflow-1")
LABELS = {"managed-by": "airflow-tpu-posttrain", "airflow-run-hash": RUN_VM.rsplit("-", 1)[-1]}
SSH_KEYS = 'posttrain:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG google-ssh {"userName":"posttrain"}'


def slice_spec(**fields) -> TpuVmSpec:
    return TpuVmSpec(
        project_id=PROJECT, zones=(ZONE,), accelerator_type="v6e-16", reservation="slice-reservation",
        max_run_duration_s=None, **fields,
    )


def test_a_slices_names_are_the_runs_and_its_vms_are_numbered_within_computes_limits():
    names = slices.slice_names(RUN_VM)
    assert names.policy == names.template == names.group == RUN_VM
    assert [names.member(i) for i in (0, 3)] == [f"{RUN_VM}-001", f"{RUN_VM}-004"]
    long_a, long_b = "tpu-" + "a" * 47 + "-0123456789", "tpu-" + "a" * 47 + "-9876543210"  # 62 chars, two runs
    a, b = slices.slice_names(long_a), slices.slice_names(long_b)
    assert a.base_instance_name != b.base_instance_name  # the cut keeps the runs apart
    assert all(len(n.base_instance_name.removesuffix("-###")) <= slices.BASE_NAME_ROOM for n in (a, b))
    assert len(a.member(63)) <= 63 and slices.slice_names(long_a) == a


def test_each_vm_of_a_slice_is_made_from_the_single_host_vms_body():
    spec = slice_spec()
    bodies = slices.slice_bodies(spec, RUN_VM, ZONE, LABELS, {"airflow-dag-id": "d"}, SSH_KEYS)
    single = compute.instance_body(spec, RUN_VM, ZONE, LABELS, {"airflow-dag-id": "d"}, SSH_KEYS)
    properties = bodies.template["properties"]
    assert properties.pop("machineType") == "ct6e-standard-4t"
    # And the run's VM name as every VM's tag: the target of the rule between them (a single VM gets it only with
    # an SSH rule of its own).
    assert properties.pop("tags") == {"items": [RUN_VM]} and "tags" not in single
    assert properties == {k: v for k, v in single.items() if k not in ("name", "machineType")}
    [between] = bodies.firewalls  # no SSH rule: the run opens none
    assert (between["sourceTags"], between["targetTags"]) == ([RUN_VM], [RUN_VM]) and "sourceRanges" not in between
    assert {a["IPProtocol"] for a in between["allowed"]} == {"tcp", "udp", "icmp"}
    assert compute.firewall_instance(between) == RUN_VM  # the reaper's: kept while the slice's group exists
    opened = slices.slice_bodies(slice_spec(ssh_source_ranges=("203.0.113.0/24",)), RUN_VM, ZONE, LABELS)
    assert [rule["name"] for rule in opened.firewalls] == list(opened.names.firewalls)
    assert opened.firewalls[1]["sourceRanges"] == ["203.0.113.0/24"]
    assert bodies.policy["workloadPolicy"] == {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "4x4"}
    group = bodies.group
    assert (group["targetSize"], group["targetSizePolicy"], group["baseInstanceName"]) == (
        4, {"mode": "BULK"}, f"{RUN_VM}-###"
    )
    assert group["resourcePolicies"]["workloadPolicy"].endswith(f"/regions/{REGION}/resourcePolicies/{RUN_VM}")
    with pytest.raises(ValueError, match="one VM, not a slice"):
        slices.slice_bodies(TpuVmSpec(project_id=PROJECT, zones=(ZONE,), reservation="r"), RUN_VM, ZONE, {})


def _group(*, stable: bool, topology: str | None, counts: dict[str, int], bulk: dict | None = None) -> dict:
    """A bulk v6e-16 group as ``instanceGroupManagers.get`` answers (v1 ``InstanceGroupManagerStatus``)."""
    status: dict = {"isStable": stable, "currentInstanceStatuses": counts}
    if topology is not None:
        status["appliedAcceleratorTopologies"] = [{"acceleratorTopology": "4x4", "state": topology}]
    if bulk is not None:
        status["bulkInstanceOperation"] = bulk
    return {"targetSize": 4, "status": status}


def _check(code: str, message: str) -> dict:
    return {"inProgress": True, "lastProgressCheck": {"error": {"errors": [{"code": code, "message": message}]}}}


STOCKOUT = "The zone 'projects/p/zones/us-east5-b' does not have enough resources available to fulfill the request."
ALL_RUNNING = {"running": 4}


@pytest.mark.parametrize(
    ("group", "state"),
    [
        pytest.param(_group(stable=True, topology="ACTIVE", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.WHOLE, id="whole"),
        # Not yet whole, and no evidence against it: waited on.
        pytest.param(_group(stable=False, topology=None, counts={"nonExistent": 4}), slices.CREATING,
                     id="just-inserted-no-bulk-operation-shown-yet"),
        pytest.param(_group(stable=False, topology="ACTIVATING", counts={"nonExistent": 4}, bulk={"inProgress": True}),
                     slices.CREATING, id="bulk-in-progress"),
        pytest.param(_group(stable=True, topology="ACTIVATING", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.CREATING, id="every-vm-running-topology-activating"),
        pytest.param(_group(stable=False, topology="ACTIVE", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.CREATING, id="active-while-actions-settle"),
        pytest.param(_group(stable=False, topology="REACTIVATING", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.CREATING, id="reactivating"),
        pytest.param(_group(stable=True, topology="ACTIVE_DEGRADED", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.CREATING, id="active-degraded"),
        pytest.param(_group(stable=False, topology="DEACTIVATING", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.CREATING, id="deactivating"),
        pytest.param(_group(stable=False, topology="INCOMPLETE", counts={"running": 2, "staging": 2},
                            bulk={"inProgress": True}), slices.CREATING, id="incomplete-while-vms-start"),
        # Capacity that may come, or a refusal no wait mends.
        pytest.param(_group(stable=False, topology=None, counts={"nonExistent": 4},
                            bulk=_check("ZONE_RESOURCE_POOL_EXHAUSTED", STOCKOUT)), slices.NO_CAPACITY, id="stock-out"),
        pytest.param(_group(stable=False, topology=None, counts={"nonExistent": 4},
                            bulk=_check("QUOTA_EXCEEDED", "Quota 'TPUS_V6E' exceeded. Limit: 8.0 in region us-east5.")),
                     slices.REFUSED, id="quota"),
        pytest.param(_group(stable=False, topology=None, counts={"nonExistent": 4},
                            bulk=_check("RESOURCE_NOT_FOUND", "The resource 'projects/p/zones/us-east5-b/reservations/r' "
                                        "was not found")), slices.REFUSED, id="missing-reservation"),
        # Evidence of a loss.
        pytest.param(_group(stable=True, topology="INCOMPLETE", counts={"running": 3, "terminated": 1},
                            bulk={"inProgress": False}), slices.BROKEN, id="vm-terminated"),
        pytest.param(_group(stable=False, topology="ACTIVE", counts={"running": 3, "stopping": 1},
                            bulk={"inProgress": False}), slices.BROKEN, id="vm-stopping"),
        pytest.param(_group(stable=False, topology="INCOMPLETE", counts={"running": 3, "nonExistent": 1},
                            bulk={"inProgress": False}), slices.BROKEN, id="vm-deleted-after-the-bulk-creation"),
        pytest.param(_group(stable=True, topology="FAILED", counts=ALL_RUNNING, bulk={"inProgress": False}),
                     slices.BROKEN, id="topology-failed"),
    ],
)
def test_a_slice_is_judged_on_evidence_only(group, state):
    """Whole only when every VM runs, the topology is ACTIVE and the group stable; broken only on evidence."""
    assert slices.slice_state(group).state == state


@pytest.fixture
def hook(monkeypatch):
    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

    with ComputeEmulator(operation_seconds=0.1) as emulator:
        emulator.add_reservation("slice-reservation", ZONE, 4, machine_type="ct6e-standard-4t")
        key = emulator.service_account_key(RUNNER_ACCOUNT, *RUNNER_ROLES, project=PROJECT)
        connection = {"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": json.dumps(key), "project": PROJECT}}
        monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(connection))
        yield TpuVmHook(api_endpoint=emulator.url, retry_initial_delay=0.2, retry_deadline=30), emulator


def _done(hook, operation: str | None, **location) -> None:
    """Poll the operation until DONE; it must end without errors."""
    deadline = time.monotonic() + 30
    while operation:
        answer = hook.get_operation(PROJECT, operation, **location)
        if answer["status"] == "DONE":
            assert not answer.get("error"), answer
            return
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


def _deleted(hook, delete, *args, **location) -> None:
    """Delete a template or policy, asking again while Compute still calls it in use by its deleted group."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return _done(hook, delete(PROJECT, *args, str(uuid.uuid4())), **location)
        except Exception as err:
            assert "resourceInUseByAnotherResource" in str(err) or "already being used" in str(err), err
            assert time.monotonic() < deadline, err
            time.sleep(0.1)


def _make_slice(hook) -> slices.SliceNames:
    bodies = slices.slice_bodies(slice_spec(), RUN_VM, ZONE, LABELS, None, SSH_KEYS)
    _done(hook, hook.insert_workload_policy(PROJECT, REGION, bodies.policy, str(uuid.uuid4())), region=REGION)
    _done(hook, hook.insert_instance_template(PROJECT, bodies.template, str(uuid.uuid4())))
    _done(hook, hook.insert_instance_group(PROJECT, ZONE, bodies.group, str(uuid.uuid4())), zone=ZONE)
    return bodies.names


def _state_when(hook, states: set[str], timeout: float = 30) -> slices.SliceState:
    """Poll the group, as the create does, until its slice is in one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        state = slices.slice_state(hook.get_instance_group(PROJECT, ZONE, RUN_VM))
        if state.state in states:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.1)


def test_a_v6e_16_slice_comes_up_whole_as_the_run_made_it_and_is_deleted_in_reverse(hook):
    """Four VMs RUNNING, each with the run's labels, SSH key and reservation; a retried insert finds what exists."""
    hook, emulator = hook
    names = _make_slice(hook)
    assert _make_slice(hook) == names  # a retried create: every resource already there (None, not an error)
    assert _state_when(hook, {slices.WHOLE}).state == slices.WHOLE

    members = hook.list_group_instances(PROJECT, ZONE, names.group)
    assert sorted((m["name"], m["instanceStatus"]) for m in members) == [
        (names.member(i), "RUNNING") for i in range(4)
    ]
    worker_ids = set()
    for member in members:
        vm = hook.get_instance(PROJECT, ZONE, member["name"])
        metadata = {item["key"]: item["value"] for item in vm["metadata"]["items"]}
        assert vm["machineType"].endswith("/machineTypes/ct6e-standard-4t")
        assert vm["labels"] == {**LABELS} and metadata["ssh-keys"] == SSH_KEYS
        assert metadata["enable-guest-attributes"] == "TRUE"  # its host keys are published, as a single VM's
        assert vm["reservationAffinity"]["values"] == ["slice-reservation"]
        assert "worker-id" not in metadata  # only the VM's metadata server tells it
        worker_ids.add(emulator.guest_attributes((PROJECT, ZONE, member["name"]))["worker-id"])
    assert worker_ids == {"0", "1", "2", "3"}

    for _ in range(2):  # the second time: a retried delete, every resource already gone
        _done(hook, hook.delete_instance_group(PROJECT, ZONE, names.group, str(uuid.uuid4())), zone=ZONE)
        _deleted(hook, hook.delete_instance_template, names.template)
        _deleted(hook, hook.delete_workload_policy, REGION, names.policy, region=REGION)
    assert emulator.instances() == [] and hook.get_instance_group(PROJECT, ZONE, names.group) is None


def test_a_slice_is_creating_until_every_vm_runs(hook):
    """The group's insert is DONE before its VMs exist: what follows is waited for, not taken for a failure."""
    hook, emulator = hook
    emulator.set_faults(operation_seconds=2.0)
    _make_slice(hook)
    assert _state_when(hook, {slices.CREATING, slices.WHOLE, slices.BROKEN}).state == slices.CREATING
    assert _state_when(hook, {slices.WHOLE, slices.BROKEN}).state == slices.WHOLE


def test_a_stockout_is_waited_for_with_computes_reason_and_no_vm_made(hook):
    hook, emulator = hook
    emulator.set_faults(stockout_zones=[ZONE])
    _make_slice(hook)
    waiting = _state_when(hook, {slices.NO_CAPACITY})
    assert waiting.detail.startswith("ZONE_RESOURCE_POOL_EXHAUSTED: The zone") and emulator.instances() == []
    emulator.set_faults(stockout_zones=[])
    assert _state_when(hook, {slices.WHOLE}).state == slices.WHOLE


def test_a_vm_lost_from_the_slice_breaks_it(hook):
    """A preempted VM of a bulk group is not made again: the slice cannot train, whatever the other three do."""
    hook, emulator = hook
    names = _make_slice(hook)
    _state_when(hook, {slices.WHOLE})
    emulator.preempt(ZONE, names.member(1))
    broken = _state_when(hook, {slices.BROKEN})
    assert re.fullmatch(r"3 of 4 VMs running \(1 (stopping|terminated)\); topology INCOMPLETE", broken.detail)


# Four local VMs boot, publish host keys and answer SSH in seconds; a bound for a loaded 2-core CI machine.
READY_TIMEOUT_S = 180


def _trigger(emulator, spec: TpuVmSpec | None = None, capacity_wait: float = 30, ready_timeout: float = READY_TIMEOUT_S):
    from airflow_tpu_posttrain.triggers.slice import TpuSliceCreateTrigger

    bodies = slices.slice_bodies(spec or slice_spec(), RUN_VM, ZONE, LABELS, None, SSH_KEYS)
    trigger = TpuSliceCreateTrigger(
        PROJECT, ZONE,
        {"policy": bodies.policy, "template": bodies.template, "group": bodies.group, "firewalls": list(bodies.firewalls)},
        network_path="internal", ssh_port=22, capacity_wait=capacity_wait, ready_timeout=ready_timeout,
        api_endpoint=emulator.url, poll_interval=0.2,
    )
    # What the triggerer gets back from the database is the serialized form: run that one.
    classpath, kwargs = trigger.serialize()
    assert classpath == "airflow_tpu_posttrain.triggers.slice.TpuSliceCreateTrigger"
    return TpuSliceCreateTrigger(**kwargs)


def _event(trigger) -> dict:
    async def first():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(first())


def _nothing_left(hook, emulator) -> bool:
    """No VM, group, template, policy or firewall rule of the slice, as Compute lists them."""
    return (
        emulator.instances() == []
        and emulator.firewalls() == []
        and hook.get_instance_group(PROJECT, ZONE, RUN_VM) is None
        and list(hook.instance_templates.list(project=PROJECT)) == []
        and list(hook.resource_policies.list(project=PROJECT, region=REGION)) == []
    )


def test_the_slice_create_hands_on_every_vm_reachable(hook, tmp_path):
    """Four local VMs booted with their sshds: each published its host keys and answers.

    Not their worker ids: those are each VM's to tell (test_slice_operators.py asks them)."""
    from airflow_tpu_posttrain.local.fleet import LocalFleet

    hook, emulator = hook
    emulator.fleet = LocalFleet(tmp_path / "disks", boot_delay=0)
    event = _event(_trigger(emulator))
    assert event["status"] == "ready", event
    assert [rule["name"] for rule in emulator.firewalls()] == [compute.firewall_name(RUN_VM, "int")]
    assert [vm["name"] for vm in event["vms"]] == [slices.slice_names(RUN_VM).member(i) for i in range(4)]
    assert all(set(vm["host_keys"]) >= {"ssh-ed25519"} for vm in event["vms"])
    assert len({vm["instance"]["networkInterfaces"][0]["networkIP"] for vm in event["vms"]}) == 4
    assert "metadata" not in event["vms"][0]["instance"]  # only what reaching and billing the VM needs

    again = _event(_trigger(emulator))  # a retried task: the same slice, found and handed on
    assert again["status"] == "ready" and again["vms"] == event["vms"]


def test_a_slice_without_capacity_in_time_fails_and_leaves_nothing(hook):
    hook, emulator = hook
    emulator.set_faults(stockout_zones=[ZONE])
    event = _event(_trigger(emulator, capacity_wait=1))
    assert (event["status"], event["reason"]) == ("failed", "no-capacity")
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in event["detail"]
    assert _nothing_left(hook, emulator)


def test_a_quota_refusal_fails_the_slice_at_once_not_after_the_capacity_window(hook):
    """A quota is no stock-out: no wait mends it, so the create fails at once, naming Compute's reason."""
    hook, emulator = hook
    emulator.set_faults(quota_exceeded_zones=[ZONE])
    started = time.monotonic()
    event = _event(_trigger(emulator, capacity_wait=600))
    assert (event["status"], event["reason"], event["kind"]) == ("failed", "refused", compute.ErrorKind.QUOTA)
    assert "QUOTA" in event["detail"] and time.monotonic() - started < 120
    assert _nothing_left(hook, emulator)


def test_a_slice_whose_max_run_duration_compute_refuses_is_made_again_without_it(hook):
    """As a single VM's create does: the VMs' cloud-side deadline is dropped, the reaper's expiry is the backstop.

    (No guest environment here: the slice made again is then refused as not ready, which is not this test's.)"""
    hook, emulator = hook
    emulator.set_faults(refuse_max_run_duration=["RESERVATION_BOUND"])
    spec = TpuVmSpec(
        project_id=PROJECT, zones=(ZONE,), accelerator_type="v6e-16", reservation="slice-reservation",
        max_run_duration_s=3600,
    )
    event = _event(_trigger(emulator, spec=spec, ready_timeout=1))
    assert (event["status"], event["reason"]) == ("failed", "not-ready"), event
    templates = [r["body"] for r in emulator.requests if r["method"] == "POST" and r["path"].endswith("/instanceTemplates")]
    assert ["maxRunDuration" in t["properties"]["scheduling"] for t in templates] == [True, False]
    assert _nothing_left(hook, emulator)


def test_a_slice_whose_topology_failed_is_deleted_whole_naming_computes_words(hook):
    """Every VM running and the topology FAILED, with its state details: broken at once, not waited on."""
    hook, emulator = hook
    emulator.set_faults(settled_topology=("FAILED", "the ICI links of host 2 did not come up"))
    event = _event(_trigger(emulator, capacity_wait=600))
    assert (event["status"], event["reason"]) == ("failed", "broken"), event
    assert "the ICI links of host 2 did not come up" in event["detail"] and "topology FAILED" in event["detail"]
    assert _nothing_left(hook, emulator)


@pytest.mark.parametrize("state", ["ACTIVE_DEGRADED", "REACTIVATING"])
def test_a_slice_whose_topology_never_becomes_active_is_not_trained_on(hook, state):
    """Degraded or reactivating with every VM running: waited on, never handed on, deleted at the deadline."""
    hook, emulator = hook
    emulator.set_faults(settled_topology=(state, None))
    event = _event(_trigger(emulator, capacity_wait=3))
    assert (event["status"], event["reason"]) == ("failed", "not-ready"), event
    assert f"4 of 4 VMs running, topology {state}" in event["detail"]
    assert _nothing_left(hook, emulator)


def test_a_slice_whose_vms_never_answer_is_deleted_whole(hook):
    """No guest environment here (no local fleet): no host keys, so no VM can be verified, and none is kept."""
    hook, emulator = hook
    event = _event(_trigger(emulator, ready_timeout=1))
    assert (event["status"], event["reason"]) == ("failed", "not-ready")
    assert "published no SSH host keys" in event["detail"]
    assert _nothing_left(hook, emulator)


def test_an_earlier_tries_broken_slice_is_deleted_and_made_again(hook, tmp_path):
    from airflow_tpu_posttrain.local.fleet import LocalFleet

    hook, emulator = hook
    emulator.fleet = LocalFleet(tmp_path / "disks", boot_delay=0)
    names = _make_slice(hook)
    _state_when(hook, {slices.WHOLE})
    emulator.preempt(ZONE, names.member(2))
    _state_when(hook, {slices.BROKEN})
    event = _event(_trigger(emulator))
    assert event["status"] == "ready", event
    assert slices.slice_state(hook.get_instance_group(PROJECT, ZONE, RUN_VM)).state == slices.WHOLE


@pytest.mark.parametrize(
    ("exit_code", "says"),
    [
        (remote_job.JOB_STALLED, "no output from the job on the VM for 180 s"),
        (remote_job.JOB_DIED, "died without an exit code"),
        (134, "failed on worker 1 of the slice with exit code 134"),
    ],
)
def test_a_failed_slice_job_shows_the_end_of_every_workers_log_however_it_ended(exit_code, says, capfd):
    """A stalled worker 0 is often waiting on a peer: the peer's log says why."""
    from airflow_tpu_posttrain.exceptions import RemoteJobError
    from airflow_tpu_posttrain.operators.maxtext import SftTrainOperator

    train = SftTrainOperator(task_id="train", model="tiny-gemma3-4b", stall_timeout_s=180)
    event = {
        "job_id": "train-a68ffc421f", "done": True, "exit_code": exit_code, "failed_worker": 0 if exit_code < 0 else 1,
        "workers": {
            "0": {"exit_code": exit_code if exit_code < 0 else None, "tail": "Started load checkpoint\n"},
            "1": {"exit_code": None if exit_code < 0 else exit_code, "tail": "Restoring\nGloo context failed\n"},
        },
    }
    with pytest.raises(RemoteJobError, match=says):
        train.execute_complete({"ti": SimpleNamespace(xcom_pull=lambda **_: None)}, event)  # no recovery yet
    shown = "".join(capfd.readouterr())
    assert "[worker 0] Started load checkpoint" in shown
    assert re.findall(r"\[worker 1\] [^\n\[]*\w", shown) == ["[worker 1] Restoring", "[worker 1] Gloo context failed"]


def test_the_teardown_asks_again_while_compute_still_calls_the_template_and_policy_in_use(hook):
    """Compute refuses the template's and policy's deletes for a while after their group is gone: asked again."""
    from airflow_tpu_posttrain.triggers.slice import TpuSliceDeleteTrigger

    hook, emulator = hook
    emulator.set_faults(references_linger_seconds=2.0)
    names = _make_slice(hook)
    _state_when(hook, {slices.CREATING, slices.WHOLE})
    trigger = TpuSliceDeleteTrigger(
        PROJECT, ZONE, names.group, names.template, names.policy, api_endpoint=emulator.url, poll_interval=0.2
    )
    _done(hook, hook.insert_firewall(PROJECT, compute.slice_firewall_body(slice_spec(), RUN_VM), str(uuid.uuid4())))
    event = _event(TpuSliceDeleteTrigger(**trigger.serialize()[1]))
    assert (event["status"], event["errors"]) == ("success", [])
    assert _nothing_left(hook, emulator)
    asked = [r for r in emulator.requests if r["method"] == "DELETE" and "/instanceTemplates/" in r["path"]]
    assert len(asked) > 1, "the template was deleted at the first ask: the in-use answer was not exercised"
