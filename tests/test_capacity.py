"""The TPU cap counts chips, not tasks: a create takes a place in its line before it inserts, waiting in the triggerer.

It waits in line (``recipes/places.py``) until a place is free, however long the runs ahead train; a place whose
holder is gone is given back; a fully used reservation is waited for up to max_wait_for_capacity, then the create
fails having created nothing."""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime

import pytest
from conftest import PROJECT, emulator_credentials, log_excerpt
from test_tpu_vm_operators import inserts, no_instances_within, task_states

from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
from airflow_tpu_posttrain.recipes import capacity, places

CAP_DAG = """
from datetime import datetime, timedelta
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    create = TpuVmCreateOperator(
        task_id="create_tpu_vm", zones=["us-east5-b"], reservation={reservation!r}, poll_interval=0.5,
        {cap_key}={cap!r}, max_wait_for_capacity={wait!r}, capacity_claims={claims!r},
    )
    delete = TpuDeleteOperator(task_id="delete_tpu_vm", zones=["us-east5-b"], poll_interval=0.2)
    create >> delete.as_teardown(setups=create)
"""


CHIPS = 8  # a v6e-8 VM's (the default accelerator_type)


def cap_dag(
    dag_id: str, cap: int | None = CHIPS, wait: int = 60, reservation: str = "my-reservation", claims: str | None = None,
    cap_key: str = "max_tpu_chips",
) -> str:
    return CAP_DAG.format(dag_id=dag_id, cap=cap, wait=wait, reservation=reservation, claims=claims, cap_key=cap_key)


def _client(emulator):
    from google.cloud import compute_v1

    return compute_v1.InstancesClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )


def hold_place(
    emulator, name: str, reservation: str = "my-reservation", claims: str | None = None, key: str | None = None,
    expires_at: int = 2**31, vm: bool = True, cap: int = CHIPS,
) -> None:
    """Another run's TPU VM in the same line (as its create would have made it), RUNNING.

    With ``claims``, its create took its place in the line first, as every create under a cap does; without, it
    holds none (a VM made by a create that took no place). ``key``: the line's, when not the VM's own. ``vm``
    False: the place alone, its VM gone (its run ended without its teardown), expiring at ``expires_at``. ``cap``:
    the line's, in chips (the VM holds 8)."""
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.recipes.compute import TpuVmSpec, instance_body

    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation=reservation)
    key = key or places.line_key(PROJECT, "us-east5-b", reservation, spec.machine_type)
    if claims:
        other = places.Request(
            claim=name, run="posttrain_rl__other/scheduled__other", deployment="other", started="2026-12-01T00:00:00+00:00",
            logical_date="2026-12-01T00:00:00+00:00", expires_at=expires_at, size=CHIPS,
        )
        taken = StoredRecordHook().change(
            places.line_uri(claims, key), lambda line: places.ask(line, other, cap, datetime.now(UTC).isoformat())
        )
        assert taken.granted
    if not vm:
        return
    labels = {capacity.GROUP_LABEL: capacity.group_label(key)}
    metadata = {"airflow-dag-id": "posttrain_rl__other", "airflow-run-id": "scheduled__other"}
    body = instance_body(spec, name, "us-east5-b", labels, metadata)
    resource = compute_v1.Instance.from_json(json.dumps(body))
    _client(emulator).insert(project=PROJECT, zone="us-east5-b", instance_resource=resource)
    deadline = time.monotonic() + 10
    while not any(i["name"] == name and i["status"] == "RUNNING" for i in emulator.instances()):
        assert time.monotonic() < deadline, "the other run's VM never turned RUNNING"
        time.sleep(0.1)


def release_when_waiting(
    emulator, name: str, seconds: float, waiting_sign: str, line: str | None = None
) -> threading.Thread:
    """Delete the other run's VM (its run ended) ``seconds`` after the create started waiting.

    Its delete then gives its place in ``line`` back, as the teardown does. The create shows it waits by the requests it makes: ``waiting_sign`` in a request's path or query (bounded
    wait for it)."""

    def release() -> None:
        deadline = time.monotonic() + 180
        while not any(waiting_sign in json.dumps(r) for r in emulator.requests):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(seconds)
        _client(emulator).delete(project=PROJECT, zone="us-east5-b", instance=name)
        while any(i["name"] == name for i in emulator.instances()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if line:
            StoredRecordHook().change(line, lambda held: places.release(held, name))

    thread = threading.Thread(target=release, daemon=True)
    thread.start()
    return thread


def line_of(claims: str, reservation: str = "my-reservation", machine_type: str = "ct6e-standard-8t") -> str:
    return places.line_uri(claims, places.line_key(PROJECT, "us-east5-b", reservation, machine_type))


def alive_sampler(emulator) -> tuple[threading.Event, list[int]]:
    """Sample how many VMs are RUNNING (up, billed), every 0.2 s, until the event is set."""
    stop, counts = threading.Event(), []

    def sample() -> None:
        while not stop.is_set():
            counts.append(sum(i["status"] == "RUNNING" for i in emulator.instances()))
            time.sleep(0.2)

    threading.Thread(target=sample, daemon=True).start()
    return stop, counts


def test_create_waits_in_line_holding_no_vm(emulator, capacity_claims, run_dag, capfd, fault_matrix):
    hold_place(emulator, "tpu-other-run", claims=capacity_claims)
    stop, counts = alive_sampler(emulator)
    release_when_waiting(emulator, "tpu-other-run", 6, f"labels.{capacity.GROUP_LABEL} =", line_of(capacity_claims))
    dr = run_dag("cap_wait", cap_dag("cap_wait", claims=capacity_claims))
    stop.set()
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Waiting for TPU capacity, #1 in line" in logs
    assert "8 of 8 TPU chips in use by posttrain_rl__other/scheduled__other (tpu-other-run, 8 chips)" in logs
    assert "Took a place of 8 TPU chips under the cap of 8" in logs and "Gave back the place of tpu-" in logs
    assert max(counts) == 1  # never our VM beside the other run's
    assert len(inserts(emulator)) == 2  # the other run's, then ours once it had ended
    assert no_instances_within(emulator)
    assert StoredRecordHook().read(line_of(capacity_claims)) == {"holders": {}, "waiting": {}}  # the delete gave it back
    fault_matrix.record(
        "capacity: cap of 8 chips (one v6e-8) reached -> create waits in line in the triggerer, then creates", True, dr.state, None,
        log_excerpt(logs, "8 of 8 TPU chips in use by"),
    )


def test_a_vm_that_holds_no_place_counts_against_the_cap(emulator, capacity_claims, run_dag, capfd, fault_matrix):
    """A VM of the line made by a create that took no place (an earlier release's, say) is counted from Compute."""
    hold_place(emulator, "tpu-other-run")
    release_when_waiting(emulator, "tpu-other-run", 3, f"labels.{capacity.GROUP_LABEL} =")
    stop, counts = alive_sampler(emulator)
    dr = run_dag("cap_unclaimed", cap_dag("cap_unclaimed", claims=capacity_claims))
    stop.set()
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "8 of 8 TPU chips in use by a VM that holds no place (tpu-other-run, 8 chips)" in logs
    assert max(counts) == 1 and len(inserts(emulator)) == 2
    assert no_instances_within(emulator)
    fault_matrix.record(
        "capacity: a VM of the line that holds no place -> counted from Compute, the create waits", True, dr.state,
        None, log_excerpt(logs, "a VM that holds no place"),
    )


def test_a_cap_without_a_place_to_take_it_fails_naming_the_field(emulator, run_dag, capfd):
    dr = run_dag("cap_noclaims", cap_dag("cap_noclaims", cap=1, cap_key="max_tpu_vms"))
    assert task_states(dr)["create_tpu_vm"] == "failed" and inserts(emulator) == []
    logs = "".join(capfd.readouterr())
    assert "capacity_claims=None: is needed with max_tpu_vms=1" in logs and "Fix: give a gs://" in logs


def test_first_in_line_behind_a_training_run_waits_past_max_wait_for_capacity(
    emulator, capacity_claims, run_dag, capfd, fault_matrix
):
    """The run ahead trains for longer than max_wait_for_capacity (3 s here): the next waits, then creates."""
    hold_place(emulator, "tpu-other-run", claims=capacity_claims)
    release_when_waiting(emulator, "tpu-other-run", 10, f"labels.{capacity.GROUP_LABEL} =", line_of(capacity_claims))
    started = time.monotonic()
    dr = run_dag("cap_long", cap_dag("cap_long", wait=3, claims=capacity_claims))
    took = time.monotonic() - started
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Waiting for TPU capacity, #1 in line" in logs and "No TPU capacity" not in logs
    assert len(inserts(emulator)) == 2 and no_instances_within(emulator)
    fault_matrix.record(
        "capacity: first in line behind a live holder for longer than max_wait_for_capacity -> keeps waiting, "
        "creates once the holder leaves", True, dr.state, None,
        f"waited past the 3 s bound behind a 10 s holder; run took {took:.0f} s",
    )


def test_a_place_whose_holder_is_gone_and_expired_is_given_back_by_the_next_in_line(
    emulator, capacity_claims, run_dag, capfd, fault_matrix
):
    """A run ended without its teardown (its VM reaped): its place, expired, goes to the next in line."""
    from airflow_tpu_posttrain.triggers.places import HOLDER_GRACE_S

    expired = int(time.time()) - HOLDER_GRACE_S - 60
    hold_place(emulator, "tpu-dead-run", claims=capacity_claims, expires_at=expired, vm=False)
    dr = run_dag("cap_dead", cap_dag("cap_dead", wait=3, claims=capacity_claims))
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    assert "Gave back the place of tpu-dead-run" in logs and f"expired at {expired}" in logs
    assert len(inserts(emulator)) == 1 and no_instances_within(emulator)
    assert StoredRecordHook().read(line_of(capacity_claims)) == {"holders": {}, "waiting": {}}
    fault_matrix.record(
        "capacity: a place held by a gone, expired holder -> given back by the next in line, which creates", True,
        dr.state, None, log_excerpt(logs, "Gave back the place of tpu-dead-run"),
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


CAPPED = [(f"cap_probe_{{i}}", 1, "my-reservation") for i in range(3)]  # three DAGs, one line: the reservation's
for dag_id, cap, reservation in [*CAPPED, ("resv_probe", None, "one-v6e")]:
    with DAG(dag_id, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=3,
             render_template_as_native_obj=True) as dag:
        create = TpuVmCreateOperator(
            task_id="create_tpu_vm", project_id="{project}", zones=["us-east5-b"], reservation=reservation,
            max_tpu_vms=cap, capacity_claims="{claims}" if cap else None, max_wait_for_capacity=600, poll_interval=1,
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


SAMPLE_S = 0.5  # how often the test counts the VMs


CAPPED_DAGS = [f"cap_probe_{i}" for i in range(3)]


def _run_states(airflow, dag_ids: list[str]) -> dict[tuple[str, str], str]:
    """``{(dag_id, run_id): state}`` of every run of ``dag_ids``."""
    states = {}
    for dag_id in dag_ids:
        for run in airflow.api("GET", f"/dags/{dag_id}/dagRuns").json()["dag_runs"]:
            states[(dag_id, run["dag_run_id"])] = run["state"]
    return states


def _task_report(airflow, dag_ids: list[str]) -> str:
    """Each task's state and, for a task not successful, its log's errors and end: what a failure shows."""
    lines = []
    for dag_id, run_id in _run_states(airflow, dag_ids):
        tasks = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
        for task in tasks:
            lines.append(f"{dag_id} {run_id} {task['task_id']} try {task['try_number']}: {task['state']}")
            if task["state"] != "success":
                folder = airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task['task_id']}"
                for log in folder.glob("*.log"):
                    text = log.read_text(errors="replace")
                    errors = [line[:3000] for line in text.splitlines() if '"level":"error"' in line]
                    lines += [f"  {log.name} errors:", *errors, f"  {log.name} end: {text[-1500:]}"]
    return "\n".join(lines)


def _trigger_and_sample(airflow, emulator, runs: list[tuple[str, str]], timeline: list) -> None:
    """Trigger ``runs`` (dag_id, run_id) at once; every ``SAMPLE_S``, note which VMs exist and which are RUNNING.

    A VM exists (and may be billed) from its insert to its delete's end. Until all runs succeeded; bounded; a failed run fails the test with each task's state and the failing tasks' logs."""
    for dag_id, run_id in runs:
        airflow.trigger(dag_id, run_id, {})
    dag_ids = sorted({dag_id for dag_id, _ in runs})
    started, deadline = time.monotonic(), time.monotonic() + 600
    while True:
        instances = emulator.instances()
        existing = sorted(i["name"] for i in instances)
        running = sorted(i["name"] for i in instances if i["status"] == "RUNNING")
        timeline.append((round(time.monotonic() - started, 1), existing, running))
        states = _run_states(airflow, dag_ids)
        if len(states) == len(runs) and all(state in ("success", "failed") for state in states.values()):
            assert set(states.values()) == {"success"}, _task_report(airflow, dag_ids)
            return
        assert time.monotonic() < deadline, (
            f"runs still going after 600 s: {states}; instances: "
            f"{[(i['name'], i['status']) for i in emulator.instances()]}\n{_task_report(airflow, dag_ids)}"
        )
        time.sleep(SAMPLE_S)


def _uses_and_starts(airflow, dag_ids: list[str]) -> tuple[list[str], list[str]]:
    """The runs (``dag_id/run_id``) in the order their ``use_vm`` step ran, and in the order the line serves them."""
    uses, starts = [], []
    for dag_id, run_id in _run_states(airflow, dag_ids):
        task = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/use_vm").json()
        run = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}").json()
        uses.append((task["start_date"], task["end_date"], f"{dag_id}/{run_id}"))
        order = places.order_of({"started": run["start_date"], "logical_date": run["logical_date"]})
        starts.append((order, f"{dag_id}/{run_id}"))
    uses.sort()
    assert all(end <= start for (_, end, _), (start, _, _) in zip(uses, uses[1:], strict=False)), uses  # one at a time
    return [run for _, _, run in uses], [run for _, run in sorted(starts)]


@pytest.mark.airflow_processes
def test_three_dags_at_once_never_hold_more_vms_than_the_cap(emulator, capacity_claims, tmp_path, fault_matrix):
    """Runs of three DAGs triggered at once under a cap of 1 use a VM one after another, in the order they started.

    With Airflow's scheduler, triggerer and LocalExecutor (bench/local_airflow.py). Each create takes its place
    in the line before it inserts, so the VMs are never more than one, sampled every 0.5 s. Then, with the cap
    removed, a reservation of one VM keeps to one VM RUNNING for two runs."""
    from bench.local_airflow import LocalAirflow

    emulator.add_reservation("one-v6e", "us-east5-b", vm_count=1)
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "probe_dags.py").write_text(PROBE_DAGS.format(project=PROJECT, claims=capacity_claims))
    capped, reserved = [], []
    with LocalAirflow(tmp_path / "airflow", {}, dags_folder=dags) as airflow:
        assert all(airflow.wait_for_dags([*CAPPED_DAGS, "resv_probe"], present="resv_probe").values())
        _trigger_and_sample(airflow, emulator, [(dag_id, "run-0") for dag_id in CAPPED_DAGS], capped)
        used, started = _uses_and_starts(airflow, CAPPED_DAGS)
        _trigger_and_sample(airflow, emulator, [("resv_probe", f"run-{i}") for i in range(2)], reserved)
    for title, timeline in (("cap 1, three DAGs", capped), ("reservation of 1 VM, no cap, two runs", reserved)):
        changes = [sample for i, sample in enumerate(timeline) if i == 0 or timeline[i - 1][1:] != sample[1:]]
        print(f"\n{title} — from second: VMs (RUNNING)")
        print("\n".join(f"{t:6.1f}: {', '.join(names) or '-'} ({', '.join(up) or '-'})" for t, names, up in changes))
    most = max(len(names) for _, names, _ in capped)
    assert most == 1, [sample for sample in capped if len(sample[1]) > 1]  # never two VMs, not for one sample
    # The first to ask found the place free; the others waited in line and were served in the order they started.
    assert used[1:] == [run for run in started if run != used[0]], (used, started)
    assert len({name for _, names, _ in capped for name in names}) == 3  # each run had its VM, in turn
    assert max(len(up) for _, _, up in reserved) == 1  # Compute itself refuses the second VM
    assert no_instances_within(emulator, seconds=30)
    assert StoredRecordHook().read(line_of(capacity_claims)) == {"holders": {}, "waiting": {}}
    fault_matrix.record(
        "capacity: runs of three DAGs at once, cap 1 (scheduler, triggerer, LocalExecutor)", True, "success", None,
        f"never more than {most} VM over {len(capped)} samples 0.5 s apart; those in line served in the order their runs started",
    )
    fault_matrix.record(
        "capacity: two runs, reservation of 1 VM, no cap (real components)", True, "success", None,
        f"never more than 1 VM RUNNING over {len(reserved)} samples; the second waited for the reservation",
    )


def test_a_vm_granted_after_a_wait_in_line_expires_its_whole_life_after_it_is_made(
    emulator, capacity_claims, run_dag, capfd, fault_matrix
):
    """Its expires-at label and its ssh-keys' expireOn count max_run_duration from its insert, not from the request."""
    hold_place(emulator, "tpu-other-run", claims=capacity_claims)
    release_when_waiting(emulator, "tpu-other-run", 8, f"labels.{capacity.GROUP_LABEL} =", line_of(capacity_claims))
    create_only = cap_dag("cap_expiry", claims=capacity_claims).replace(
        "poll_interval=0.5,", "poll_interval=0.5, max_run_duration=3600,"
    ).split("    delete = ")[0]
    requested = time.time()
    dr = run_dag("cap_expiry", create_only)
    assert dr.state == "success", task_states(dr)
    [vm] = [i for i in emulator.instances() if i["name"].startswith("tpu-cap-expiry")]
    made = datetime.fromisoformat(vm["creationTimestamp"]).timestamp()
    expires_at = int(vm["labels"]["expires-at"])
    [keys] = [item["value"] for item in vm["metadata"]["items"] if item["key"] == "ssh-keys"]
    expire_on = datetime.strptime(json.loads(keys.split(" google-ssh ", 1)[1])["expireOn"], "%Y-%m-%dT%H:%M:%S%z")
    assert made - requested > 7  # it waited in line
    assert abs(expires_at - (made + 3600)) <= 2 and expire_on.timestamp() == expires_at
    fault_matrix.record(
        "capacity: a VM granted after a wait in line -> expires max_run_duration after its insert (label, ssh-keys)",
        None, dr.state, None,
        f"waited {made - requested:.0f} s; expires-at - creation = {expires_at - made:.0f} s (max_run_duration 3600)",
    )


def test_a_run_that_brings_another_cap_to_a_line_is_refused_before_any_vm(
    emulator, capacity_claims, run_dag, capfd, fault_matrix
):
    """The line keeps the cap of the runs in it (8 chips): a run of another DAG bringing 16 is refused, not let in."""
    hold_place(emulator, "tpu-other-run", claims=capacity_claims)
    dr = run_dag("cap_other", cap_dag("cap_other", cap=16, claims=capacity_claims))
    assert task_states(dr)["create_tpu_vm"] == "failed"
    logs = "".join(capfd.readouterr())
    assert "invalid input: max_tpu_chips=16:" in logs and "the line keeps a cap of 8 TPU chips" in logs
    assert len(inserts(emulator)) == 1  # the other run's alone
    assert list(StoredRecordHook().read(line_of(capacity_claims))["waiting"]) == []
    fault_matrix.record(
        "capacity: a run brings a cap of 16 chips to a line whose runs keep 8 -> refused before any VM, naming both",
        None, dr.state, None, log_excerpt(logs, "the line keeps a cap"),
    )
