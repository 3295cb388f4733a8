"""A wait in line from the triggerer's side: a cancelled wait leaves the line at once, a triggerer that stops keeps it.

Airflow 3.3's triggerer calls a trigger's ``on_kill`` when a user acts on its task (marks it or its run failed,
clears it) and its ``cleanup`` whenever the trigger stops: after ``on_kill``, on a deferral timeout, and when the
triggerer itself stops (the trigger then runs again elsewhere). The create's trigger is built by the operator, as a
worker defers it, and run here as a triggerer runs it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from conftest import PROJECT
from test_capacity import CHIPS, hold_place, line_of

from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
from airflow_tpu_posttrain.recipes import places


def deferred_create(claims: str, run_id: str, started: datetime):
    """The create's trigger for the run ``run_id`` of ``wait_dag``, as its worker defers it."""
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

    op = TpuVmCreateOperator(
        task_id="create_tpu_vm", project_id=PROJECT, zones=["us-east5-b"], reservation="my-reservation",
        poll_interval=0.2, max_tpu_chips=CHIPS, capacity_claims=claims,
    )
    dag_run = SimpleNamespace(dag_id="wait_dag", run_id=run_id, start_date=started, logical_date=started, run_after=started)
    context = {
        "ti": SimpleNamespace(id=f"ti-{run_id}", xcom_push=lambda **_: None),
        "dag": SimpleNamespace(dag_id="wait_dag", dagrun_timeout=None), "run_id": run_id, "dag_run": dag_run,
    }
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    return deferred.value.trigger


def revived(trigger):
    """The trigger as a triggerer rebuilds it from its serialized form (another triggerer, or after a restart)."""
    classpath, kwargs = trigger.serialize()
    module, cls = classpath.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[cls]), cls)(**kwargs)


async def until(condition, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        await asyncio.sleep(0.1)


async def stopped(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_cancelled_wait_leaves_the_line_and_a_triggerer_restart_keeps_its_place(
    emulator, capacity_claims, configured_deployment, fault_matrix
):
    hold_place(emulator, "tpu-other-run", claims=capacity_claims)  # a live run holds the cap
    uri = line_of(capacity_claims)
    read = StoredRecordHook().read
    start = datetime.now(UTC) - timedelta(minutes=5)
    marked_failed = deferred_create(capacity_claims, "manual__failed", start)
    timing_out = deferred_create(capacity_claims, "manual__timeout", start + timedelta(seconds=1))
    restarted = deferred_create(capacity_claims, "manual__restart", start + timedelta(seconds=2))
    later = places.Request(
        claim="tpu-later-run", run="wait_dag/manual__later", deployment=configured_deployment,
        started=(start + timedelta(seconds=3)).isoformat(), logical_date=start.isoformat(), expires_at=2**31, size=CHIPS,
    )

    def waits(trigger) -> bool:
        return trigger.name in (read(uri).get("waiting") or {})

    async def scenario() -> dict[str, object]:
        seen: dict[str, object] = {}
        tasks = {t.name: asyncio.create_task(anext(t.run())) for t in (marked_failed, timing_out, restarted)}
        for trigger in (marked_failed, timing_out, restarted):
            await until(lambda t=trigger: waits(t), f"{trigger.name} in line")
        await asyncio.to_thread(
            StoredRecordHook().change, uri, lambda line: places.ask(line, later, CHIPS, datetime.now(UTC).isoformat())
        )
        # The user marks the first run failed: the triggerer cancels its trigger, then calls on_kill and cleanup.
        await stopped(tasks[marked_failed.name])
        await marked_failed.on_kill()
        await marked_failed.cleanup()
        seen["failed_left"] = not waits(marked_failed)
        # The second's deferral times out: cancelled, then cleanup (no on_kill) past its timeout_after.
        await stopped(tasks[timing_out.name])
        timing_out.timeout_after = datetime.now(UTC) - timedelta(seconds=1)
        await timing_out.cleanup()
        seen["timeout_left"] = not waits(timing_out)
        # The triggerer running the third stops: cancelled, cleanup (its deferral still current).
        asked = read(uri)["waiting"][restarted.name]["asked"]
        await stopped(tasks[restarted.name])
        restarted.timeout_after = datetime.now(UTC) + timedelta(hours=1)
        await restarted.cleanup()
        seen["restart_kept"] = waits(restarted) and read(uri)["waiting"][restarted.name]["asked"] == asked
        # Run again (another triggerer): the holder leaves, and the place is the restarted run's, not the later one's.
        again = asyncio.create_task(anext(revived(restarted).run()))
        await asyncio.to_thread(emulator.set_instance_status, "us-east5-b", "tpu-other-run", "TERMINATED")
        await asyncio.to_thread(StoredRecordHook().change, uri, lambda line: places.release(line, "tpu-other-run"))
        await until(lambda: restarted.name in read(uri)["holders"], "the restarted run granted")
        seen["later_waits"] = list(read(uri)["waiting"]) == ["tpu-later-run"]
        await stopped(again)
        return seen

    seen = asyncio.run(scenario())
    assert seen == {"failed_left": True, "timeout_left": True, "restart_kept": True, "later_waits": True}
    fault_matrix.record(
        "capacity: a wait in line cancelled (run marked failed, deferral timed out) -> leaves the line at once; a "
        "triggerer restart keeps its place", None, "n/a", None,
        "on_kill and a timed-out cleanup leave the line; a restart's cleanup keeps it, and it is served before a later run",
    )


WAIT_DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("line_wait", schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    TpuVmCreateOperator(
        task_id="create_tpu_vm", project_id="{project}", zones=["us-east5-b"], reservation="my-reservation",
        max_tpu_chips={chips}, capacity_claims="{claims}", poll_interval=1,
    )
"""


@pytest.mark.airflow_processes
def test_a_run_marked_failed_while_it_waits_leaves_the_line_at_once(emulator, capacity_claims, tmp_path, fault_matrix):
    """With Airflow's scheduler, triggerer and API: the user marks the waiting run failed, its wait leaves the line.

    Before, it held its place in line until it went stale (places.WAITING_STALE_S, 600 s), ahead of the next run."""
    from bench.local_airflow import LocalAirflow

    hold_place(emulator, "tpu-other-run", claims=capacity_claims)
    uri, read = line_of(capacity_claims), StoredRecordHook().read
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "line_wait.py").write_text(WAIT_DAG.format(project=PROJECT, chips=CHIPS, claims=capacity_claims))

    def bounded(condition, what: str, seconds: float) -> float:
        started = time.monotonic()
        while not condition():
            assert time.monotonic() - started < seconds, f"not within {seconds} s: {what}"
            time.sleep(0.5)
        return time.monotonic() - started

    with LocalAirflow(tmp_path / "airflow", {}, dags_folder=dags) as airflow:
        airflow.wait_for_dags(["line_wait"], present="line_wait")
        airflow.trigger("line_wait", "run-0", {})
        bounded(lambda: len(read(uri).get("waiting") or {}) == 1, "the run waits in line", 240)
        airflow.api("PATCH", "/dags/line_wait/dagRuns/run-0", json={"state": "failed"})
        left = bounded(lambda: not read(uri).get("waiting"), "its wait left the line", 120)
    assert list(read(uri)["holders"]) == ["tpu-other-run"] and len(emulator.instances()) == 1
    fault_matrix.record(
        "capacity: a run marked failed while it waits in line (scheduler, triggerer, API) -> its wait leaves the line "
        "at once", None, "failed", None, f"left the line {left:.0f} s after the run was marked failed (was: up to "
        f"{places.WAITING_STALE_S:.0f} s, until stale)",
    )


def test_a_create_deferred_by_the_earlier_release_keeps_its_vms_life(emulator, capacity_claims, configured_deployment):
    """A trigger serialized before the upgrade (its request's expiry set, no lifetime_s) keeps the VM's whole life.

    12 h here (no dagrun_timeout): never a VM that expires as it is made."""
    from airflow_tpu_posttrain.triggers.places import request_of

    classpath, kwargs = deferred_create(capacity_claims, "manual__upgrade", datetime.now(UTC)).serialize()
    earlier = {key: value for key, value in kwargs.items() if key != "lifetime_s"}
    earlier["request"] = {k: v for k, v in kwargs["request"].items() if k != "size"} | {"expires_at": 2**31}
    module, cls = classpath.rsplit(".", 1)
    rebuilt = getattr(__import__(module, fromlist=[cls]), cls)(**earlier)
    assert abs(rebuilt.lifetime_s - 12 * 3600) <= 1
    assert request_of(rebuilt.request) == places.Request(**{**earlier["request"], "expires_at": 0})
