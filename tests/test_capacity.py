"""The TPU cap counts VMs, not tasks: a create waits in the triggerer, holding no VM.

It waits until its capacity group has room; a fully used reservation is waited for too; a wait that times out
fails having created nothing."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from conftest import PROJECT, emulator_credentials, log_excerpt
from test_tpu_vm_operators import inserts, no_instances_within, task_states

from airflow_tpu_posttrain.recipes import capacity

CAP_DAG = """
from datetime import datetime, timedelta
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    create = TpuVmCreateOperator(
        task_id="create_tpu_vm", zones=["us-east5-b"], reservation={reservation!r}, poll_interval=0.5,
        max_tpu_vms={cap!r}, max_wait_for_capacity={wait!r},
    )
    delete = TpuDeleteOperator(task_id="delete_tpu_vm", zones=["us-east5-b"], poll_interval=0.2)
    create >> delete.as_teardown(setups=create)
"""


def cap_dag(dag_id: str, cap: int | None = 1, wait: int = 60, reservation: str = "my-reservation") -> str:
    return CAP_DAG.format(dag_id=dag_id, cap=cap, wait=wait, reservation=reservation)


def _client(emulator):
    from google.cloud import compute_v1

    return compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )


def hold_place(emulator, name: str, reservation: str = "my-reservation", group: str | None = None) -> None:
    """Another run's TPU VM of the same capacity group (as its create would have made it), RUNNING.

    ``group``: the capacity group's label value, when it is not that of ``reservation``'s VMs."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.recipes.compute import TpuVmSpec, instance_body

    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation=reservation)
    group = group or capacity.group_label(PROJECT, reservation, spec.zones, spec.machine_type)
    labels = {capacity.GROUP_LABEL: group}
    metadata = {"airflow-dag-id": "posttrain_rl__other", "airflow-run-id": "scheduled__other"}
    body = instance_body(spec, name, "us-east5-b", labels, metadata)
    resource = compute_v1.Instance.from_json(json.dumps(body))
    _client(emulator).insert(project=PROJECT, zone="us-east5-b", instance_resource=resource)
    deadline = time.monotonic() + 10
    while not any(i["name"] == name and i["status"] == "RUNNING" for i in emulator.instances()):
        assert time.monotonic() < deadline, "the other run's VM never turned RUNNING"
        time.sleep(0.1)


def release_when_waiting(emulator, name: str, seconds: float, waiting_sign: str) -> threading.Thread:
    """Delete the other run's VM (its run ended) ``seconds`` after the create started waiting.

    The create shows it waits by the requests it makes: ``waiting_sign`` in a request's path or query (bounded
    wait for it)."""

    def release() -> None:
        deadline = time.monotonic() + 180
        while not any(waiting_sign in json.dumps(r) for r in emulator.requests):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(seconds)
        _client(emulator).delete(project=PROJECT, zone="us-east5-b", instance=name)

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def alive_sampler(emulator) -> tuple[threading.Event, list[int]]:
    """Sample how many VMs are RUNNING (up, billed), every 0.2 s, until the event is set."""
    stop, counts = threading.Event(), []

    def sample() -> None:
        while not stop.is_set():
            counts.append(sum(i["status"] == "RUNNING" for i in emulator.instances()))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    return stop, counts


def test_the_first_created_holds_across_the_autumn_clock_change(fault_matrix):
    """2026-11-01, US-Pacific: 01:50 PDT (08:50 UTC) comes before 01:10 PST (09:10 UTC), whatever the text says."""
    group = [
        {"name": "later", "status": "RUNNING", "creationTimestamp": "2026-11-01T01:10:00.000-08:00"},
        {"name": "earlier", "status": "RUNNING", "creationTimestamp": "2026-11-01T01:50:00.000-07:00"},
    ]
    assert [i["name"] for i in capacity.holders(group)] == ["earlier", "later"]
    assert capacity.over_cap("later", group, 1) and not capacity.over_cap("earlier", group, 1)
    fault_matrix.record(
        "capacity: two creates across the autumn clock change (-07:00 then -08:00) -> the first created keeps its place",
        None, "n/a", None, "01:50-07:00 holds, 01:10-08:00 is over the cap of 1",
    )


def test_pure_ordering_keeps_the_first_created():
    group = [
        {"name": "b", "status": "RUNNING", "creationTimestamp": "2026-11-30T10:00:01.000+00:00"},
        {"name": "a", "status": "STAGING", "creationTimestamp": "2026-11-30T10:00:01.000+00:00"},
        {"name": "c", "status": "TERMINATED", "creationTimestamp": "2026-11-30T09:00:00.000+00:00"},
    ]
    assert [i["name"] for i in capacity.holders(group)] == ["a", "b"]  # same time: by name; TERMINATED holds none
    assert not capacity.over_cap("a", group, 1) and capacity.over_cap("b", group, 1)
    assert capacity.group_label("p", "r", ["z1"], "ct6e-standard-8t") == capacity.group_label(
        "p", "projects/p/reservations/r", ["z2"], "ct6e-standard-4t"
    )
    # One per zone, a block of a shared one: the group is the set of reservations, however they are named.
    per_zone = "us-east5-a=r2,us-east5-b=projects/host-project/reservations/r1/reservationBlocks/b1"
    assert capacity.reservation_names(per_zone) == ["r1", "r2"]
    assert capacity.group_label("p", per_zone, ["z1"], "x") == capacity.group_label("p", "r1,r2", ["z2"], "x")
    assert capacity.group_label("p", None, ["z1"], "ct6e-standard-8t") != capacity.group_label(
        "p", None, ["z1"], "n2-highmem-16"
    )
    # A run's CPU VM (the split layout) never counts against the TPU VMs, even of the same machine series.
    assert capacity.group_label("p", None, ["z1"], "e2-standard-2", "tpu") != capacity.group_label(
        "p", None, ["z1"], "e2-standard-2", "cpu"
    )


def test_a_slice_holds_one_place_however_many_vms_it_has():
    def vm(name, stamp, group=None):
        items = [{"key": "created-by", "value": f"projects/p/zones/z/instanceGroupManagers/{group}"}] if group else []
        return {"name": name, "status": "RUNNING", "creationTimestamp": stamp, "metadata": {"items": items}}

    slice_vms = [vm(f"tpu-run-a-00{i}", f"2026-11-01T01:00:0{i}-07:00", "tpu-run-a") for i in (4, 1, 3, 2)]
    group = [*slice_vms, vm("tpu-run-b", "2026-11-01T01:00:02-07:00")]
    held = capacity.holders(group)
    assert [place["name"] for place in held] == ["tpu-run-a", "tpu-run-b"]  # the slice from its first VM on
    assert not capacity.over_cap("tpu-run-b", group, 2) and capacity.over_cap("tpu-run-b", group, 1)
    assert capacity.describe(group, 2).startswith("2 of 2 in use by ")


def test_create_waits_for_capacity_holding_no_vm(emulator, run_dag, capfd, fault_matrix):
    hold_place(emulator, "tpu-other-run")
    stop, counts = alive_sampler(emulator)
    release_when_waiting(emulator, "tpu-other-run", 6, f"labels.{capacity.GROUP_LABEL} =")
    dr = run_dag("cap_wait", cap_dag("cap_wait"))
    stop.set()
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Waiting for TPU capacity (up to" in logs
    assert "1 of 1 in use by posttrain_rl__other run scheduled__other (tpu-other-run)" in logs
    assert max(counts) == 1  # never our VM beside the other run's
    assert len(inserts(emulator)) == 2  # the other run's, then ours once it had ended
    assert no_instances_within(emulator)
    fault_matrix.record(
        "capacity: cap of 1 reached -> create waits in the triggerer, then creates", True, dr.state, None,
        log_excerpt(logs, "1 of 1 in use by"),
    )


def test_the_later_of_two_racing_creates_yields_once_its_insert_has_ended(
    emulator, run_dag, capfd, monkeypatch, fault_matrix
):
    """Both creates saw room and inserted; the other run's VM was created first, so ours yields.

    Ours is deleted once its insert has ended (Compute answers a delete sooner with 400 resourceNotReady), then
    the create waits for room and creates again when the other run's VM is gone."""
    from airflow_tpu_posttrain.triggers.create import _CreateRun

    count_group, counts_made = _CreateRun._group, []

    async def first_count_sees_room(self):  # as if Compute had listed the group before the other insert
        counts_made.append(self)
        return [] if len(counts_made) == 1 else await count_group(self)

    monkeypatch.setattr(_CreateRun, "_group", first_count_sees_room)
    hold_place(emulator, "tpu-other-run")
    emulator.set_faults(operation_seconds=2.0)  # an insert takes a while, as a TPU VM's does

    def ours_deleted() -> list[dict]:
        return [
            r for r in emulator.requests if r["method"] == "DELETE" and not r["path"].endswith("/tpu-other-run")
        ]

    def release_once_ours_yielded() -> None:
        deadline = time.monotonic() + 120
        while not ours_deleted() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3)
        _client(emulator).delete(project=PROJECT, zone="us-east5-b", instance="tpu-other-run")

    threading.Thread(target=release_once_ours_yielded, daemon=True).start()
    dr = run_dag("cap_race", cap_dag("cap_race"))
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "is over the cap of 1 TPU VMs (another run created its VM first): deleted it, waiting" in logs
    # The yielded VM ran (and is billed) from its start to its delete: its cost is said, not lost.
    assert re.search(r"cost of the yielded VM: tpu-\S+ \(ct6e-standard-8t, \w+\) ran \d+ min \d+ s", logs), logs[-3000:]
    assert "Waiting for TPU capacity" in logs
    assert len(inserts(emulator)) == 3  # the other run's, ours that yielded, ours again
    assert len(ours_deleted()) == 2  # the yield's, accepted at once, and the teardown's
    assert no_instances_within(emulator)
    fault_matrix.record(
        "capacity: two creates race for the last place -> the later yields once its insert ended, then waits",
        True, dr.state, None, log_excerpt(logs, "is over the cap of 1"),
    )


def test_wait_for_capacity_times_out_having_created_nothing(emulator, run_dag, capfd, fault_matrix):
    hold_place(emulator, "tpu-other-run")
    dr = run_dag("cap_timeout", cap_dag("cap_timeout", wait=8))
    assert task_states(dr)["create_tpu_vm"] == "failed" and dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "No TPU capacity for" in logs and "within 8 s" in logs and "Nothing was created" in logs
    assert [i["name"] for i in emulator.instances()] == ["tpu-other-run"]
    assert len(inserts(emulator)) == 1
    fault_matrix.record(
        "capacity: no place within max_wait_for_capacity -> fails, nothing created", None, dr.state, None,
        log_excerpt(logs, "No TPU capacity for"),
    )


def test_fully_used_reservation_is_waited_for(emulator, run_dag, capfd, fault_matrix):
    emulator.add_reservation("one-v6e", "us-east5-b", vm_count=1, machine_type="ct6e-standard-8t")
    hold_place(emulator, "tpu-holder", reservation="one-v6e")
    stop, counts = alive_sampler(emulator)
    release_when_waiting(emulator, "tpu-holder", 6, "cap-resv")
    dr = run_dag("cap_resv", cap_dag("cap_resv", cap=None, reservation="one-v6e"))
    stop.set()
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Specified reservation 'one-v6e' does not have available resources for the request." in logs
    assert "reservation one-v6e is fully used" in logs
    assert max(counts) == 1 and len(inserts(emulator)) >= 3  # the holder's, ours refused, ours again
    assert no_instances_within(emulator)
    fault_matrix.record(
        "capacity: reservation fully used -> waits, then creates", True, dr.state, None,
        log_excerpt(logs, "does not have available resources"),
    )


def test_missing_reservation_still_fails_at_once(emulator, run_dag, capfd, fault_matrix):
    dr = run_dag("cap_noresv", cap_dag("cap_noresv", cap=None, reservation="no-such-reservation"))
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "Specified reservations [no-such-reservation] do not exist." in logs and "Reservation problem" in logs
    assert len(inserts(emulator)) == 1 and no_instances_within(emulator)
    fault_matrix.record(
        "capacity: reservation does not exist -> fails at once (1 insert)", True, dr.state, None,
        log_excerpt(logs, "Specified reservations"),
    )


# ------------------------------------------------------------------------------ on Airflow's real components

PROBE_DAGS = """
from datetime import datetime
from airflow.sdk import DAG, TriggerRule
from airflow_tpu_posttrain.operators.maxtext_job import Job, MaxTextJobOperator
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator


class UseVm(MaxTextJobOperator):
    \"\"\"A step that holds the VM for a while, through the same remote-job protocol as the MaxText steps.\"\"\"

    def build_job(self, spec, context):
        return Job("sleep 8\\n", None, {{}})


for dag_id, cap, reservation in [("cap_probe", 1, "my-reservation"), ("resv_probe", None, "one-v6e")]:
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=3,
             render_template_as_native_obj=True) as dag:
        create = TpuVmCreateOperator(
            task_id="create_tpu_vm", project_id="{project}", zones=["us-east5-b"], reservation=reservation,
            max_tpu_vms=cap, max_wait_for_capacity=600, poll_interval=1,
        )
        use = UseVm(
            task_id="use_vm", vm=create.output, model="tiny-llama", maxtext_venv="/var/tmp/unused",
            poll_interval=1,
        )
        delete = TpuDeleteOperator(task_id="delete_tpu_vm", project_id="{project}", zones=["us-east5-b"],
                                   poll_interval=1)
        create >> use >> delete.as_teardown(setups=create)
        delete.trigger_rule = TriggerRule.NONE_SKIPPED  # as the pipelines wire it: also after a failed create
    globals()[dag_id] = dag
"""


OVERLAP_S = 60
"""Seconds a race's loser may run beside the winner: its trigger's poll, the scheduler
resuming its create, the delete; on a loaded 2-core machine."""


def _run_states(airflow, dag_id: str) -> dict[str, str]:
    runs = airflow.api("GET", f"/dags/{dag_id}/dagRuns").json()["dag_runs"]
    return {run["dag_run_id"]: run["state"] for run in runs}


def _task_report(airflow, dag_id: str) -> str:
    """Each task's state and, for a task not successful, its log's errors and end: what a failure shows."""
    lines = []
    for run_id in _run_states(airflow, dag_id):
        tasks = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
        for task in tasks:
            lines.append(f"{run_id} {task['task_id']} try {task['try_number']}: {task['state']}")
            if task["state"] != "success":
                folder = airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task['task_id']}"
                for log in folder.glob("*.log"):
                    text = log.read_text(errors="replace")
                    errors = [line[:3000] for line in text.splitlines() if '"level":"error"' in line]
                    lines += [f"  {log.name} errors:", *errors, f"  {log.name} end: {text[-1500:]}"]
    return "\n".join(lines)


def _trigger_and_sample(airflow, emulator, dag_id: str, runs: int, timeline: list) -> None:
    """Trigger ``runs`` runs at once; every second, note which VMs are RUNNING; until all runs succeeded.

    Bounded; a failed run fails the test with each task's state and the failing tasks' logs."""
    for i in range(runs):
        airflow.trigger(dag_id, f"run-{i}", {})
    started, deadline = time.monotonic(), time.monotonic() + 600
    while True:
        running = sorted(i["name"] for i in emulator.instances() if i["status"] == "RUNNING")
        timeline.append((round(time.monotonic() - started), running))
        states = _run_states(airflow, dag_id)
        if len(states) == runs and all(state in ("success", "failed") for state in states.values()):
            assert set(states.values()) == {"success"}, _task_report(airflow, dag_id)
            return
        assert time.monotonic() < deadline, (
            f"runs still going after 600 s: {states}; instances: "
            f"{[(i['name'], i['status']) for i in emulator.instances()]}\n{_task_report(airflow, dag_id)}"
        )
        time.sleep(1)


def _overlaps(timeline: list) -> list[tuple[int, int]]:
    """The stretches (first second, seconds) when more than one VM was RUNNING, from the samples."""
    stretches, start = [], None
    for t, names in timeline:
        if len(names) > 1 and start is None:
            start = t
        if len(names) <= 1 and start is not None:
            stretches.append((start, t - start))
            start = None
    if start is not None:
        stretches.append((start, timeline[-1][0] - start))
    return stretches


def _use_intervals(airflow, dag_id: str) -> list[tuple[str, str]]:
    """When each run's ``use_vm`` step ran (ISO start and end, from Airflow): the VM in use."""
    intervals = []
    for run_id in _run_states(airflow, dag_id):
        task = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/use_vm").json()
        intervals.append((task["start_date"], task["end_date"]))
    return sorted(intervals)


@pytest.mark.airflow_processes
def test_three_runs_at_once_never_hold_more_vms_than_the_cap(emulator, tmp_path, fault_matrix):
    """Three runs triggered at once under a cap of 1 use a VM one after another.

    With Airflow's scheduler, triggerer and LocalExecutor (bench/local_airflow.py). All three see room and
    insert; Compute refuses to delete an instance whose insert is unfinished (400 resourceNotReady), so the two
    later ones run until then and are deleted at once: the overlap is that moment, never a step on two VMs.
    Then, with the cap removed, a reservation of one VM keeps to one VM RUNNING for two runs."""
    from bench.local_airflow import LocalAirflow

    emulator.add_reservation("one-v6e", "us-east5-b", vm_count=1)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "probe_dags.py").write_text(PROBE_DAGS.format(project=PROJECT))
    capped, reserved = [], []
    with LocalAirflow(tmp_path / "airflow", {}, dags_folder=dags) as airflow:
        assert all(airflow.wait_for_dags(["cap_probe", "resv_probe"], present="cap_probe").values())
        _trigger_and_sample(airflow, emulator, "cap_probe", 3, capped)
        uses = _use_intervals(airflow, "cap_probe")
        _trigger_and_sample(airflow, emulator, "resv_probe", 2, reserved)
    for title, timeline in (("cap 1, three runs", capped), ("reservation of 1 VM, no cap, two runs", reserved)):
        changes = [(t, names) for i, (t, names) in enumerate(timeline) if i == 0 or timeline[i - 1][1] != names]
        print(f"\n{title} — from second: VMs RUNNING")
        print("\n".join(f"{t:4d}: {', '.join(names) or '-'}" for t, names in changes))
    assert all(end <= start for (_, end), (start, _) in zip(uses, uses[1:], strict=False)), uses  # one run on a VM at a time
    overlaps = _overlaps(capped)
    assert all(seconds <= OVERLAP_S for _, seconds in overlaps), overlaps  # a loser is deleted at once
    assert max(len(names) for _, names in reserved) == 1  # Compute itself refuses the second VM
    assert len({name for _, names in capped for name in names}) == 3  # each run had its VM, in turn
    assert no_instances_within(emulator, seconds=30)
    fault_matrix.record(
        "capacity: three runs at once, cap 1 (scheduler, triggerer, LocalExecutor)", True, "success", None,
        f"the 3 runs used a VM one after another; {len(overlaps)} moment(s) of a 2nd VM RUNNING (a loser of the "
        f"race, from its insert's end to its delete), longest {max((n for _, n in overlaps), default=0)} s",
    )
    fault_matrix.record(
        "capacity: two runs, reservation of 1 VM, no cap (real components)", True, "success", None,
        f"never more than 1 VM RUNNING over {len(reserved)} samples; the second waited for the reservation",
    )
