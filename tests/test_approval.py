"""A person's approval before publishing, answered through Airflow's REST API (what the UI's Required actions call).

The tiny SFT pipeline (models.yaml's entry with ``approval: true``) on Airflow's api-server, scheduler, triggerer and
LocalExecutor (bench/local_airflow.py) against the local stack. One training: its publish is rejected (nothing
published, the export kept, the CPU VM deleted all the same), then asked again by clearing ``approve_publish`` and
approved: the kept export is published without exporting again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import HF_TOKEN, REPO, storage_has
from test_backfill import DAG_FILE

SFT = "posttrain_sft__tiny-llama"
RUN_ID = "manual__approval"
WAIT_S = 900.0
ANSWERED = ("success", "failed", "skipped")

pytestmark = pytest.mark.airflow_processes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from airflow_tpu_posttrain.local.stack import LocalStack

    local = LocalStack(REPO / ".local", tmp_path_factory.mktemp("vm"), hf_token=HF_TOKEN)
    with local:
        yield local


def _registry(dags: Path) -> None:
    """models.yaml's tiny SFT entry, asking before it publishes, alone in the DAGs folder."""
    import yaml

    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    [entry] = [e for e in registry["pipelines"] if e["model"] == "tiny-llama" and e["recipe"] == "sft" and "layout" not in e]
    registry["pipelines"] = [{**entry, "approval": True}]
    (dags / "models.yaml").write_text(yaml.safe_dump(registry))
    (dags / "approval_dags.py").write_text(DAG_FILE)


def _tasks(airflow) -> dict[str, dict]:
    found = airflow.api("GET", f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances").json()["task_instances"]
    return {task["task_id"]: task for task in found}


def _report(airflow) -> str:
    return "\n".join(f"{task_id} try {t['try_number']}: {t['state']}" for task_id, t in _tasks(airflow).items())


def _wait(airflow, what: str, done) -> dict[str, dict]:
    """The run's tasks once ``done(tasks)`` holds, looked at every second for at most ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        tasks = _tasks(airflow)
        if done(tasks):
            return tasks
        assert time.monotonic() < deadline, f"{what}: not after {WAIT_S} s\n{_report(airflow)}"
        time.sleep(1)


def _asking(tasks: dict[str, dict]) -> bool:
    state = tasks["approve_publish"]["state"]
    assert state not in ANSWERED or tasks["approve_publish"]["try_number"] == 0, state
    return state == "awaiting_input"


def _parked(airflow, try_number: int) -> bool:
    """Whether the scheduler has taken in that ``approve_publish``'s try is parked waiting for its answer.

    An answer given before that is lost in Airflow 3.3.2: the resumed try fails to start (the scheduler then
    reads the parked try's executor event as a failure), and the retry asks again."""
    scheduler = (airflow.home / "logs" / "scheduler.log").read_text(errors="replace")
    return any(
        "TaskInstance Finished" in line and "task_id=approve_publish" in line and "state=awaiting_input" in line
        and f"try_number={try_number}," in line
        for line in scheduler.splitlines()
    )


def _run_state(airflow) -> str:
    return airflow.api("GET", f"/dags/{SFT}/dagRuns/{RUN_ID}").json()["state"]


def _answer(airflow, option: str) -> None:
    airflow.api(
        "PATCH", f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/approve_publish/-1/hitlDetails",
        json={"chosen_options": [option], "params_input": {}},
    )


def _xcom(airflow, task_id: str):
    response = airflow.client.get(f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/{task_id}/xcomEntries/return_value")
    return response.json()["value"] if response.status_code == 200 else None


def _task_log(airflow, task_id: str) -> str:
    folder = airflow.home / "logs" / f"dag_id={SFT}" / f"run_id={RUN_ID}" / f"task_id={task_id}"
    return "".join(log.read_text(errors="replace") for log in sorted(folder.glob("*.log")))


def test_a_rejected_publish_keeps_the_export_and_an_approval_publishes_it(stack, tmp_path, monkeypatch, fault_matrix):
    from bench.local_airflow import LocalAirflow

    for name, value in stack.environment().items():  # the local stack's connections, to read its storage here
        monkeypatch.setenv(name, value)
    dags = tmp_path / "dags"
    dags.mkdir()
    _registry(dags)
    with LocalAirflow(tmp_path / "airflow", stack.environment(), dags_folder=dags) as airflow:
        assert airflow.wait_for_dags([SFT], present=SFT)[SFT]
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": False})
        airflow.trigger(SFT, RUN_ID, {"force": True})
        asked = _wait(airflow, "asking for approval", lambda t: _asking(t) and _parked(airflow, 1))
        # Waiting for the answer: the TPU VM is gone, the export is kept, nothing is published.
        assert asked["delete_tpu_vm"]["state"] == "success" and asked["export_and_keep"]["state"] == "success"
        assert asked["export_and_publish"]["state"] in (None, "scheduled", "none"), _report(airflow)
        alive = [i["name"] for i in stack.compute.instances()]
        assert [name.split("-")[0] for name in alive] == ["cpu"], alive
        kept = _xcom(airflow, "export_and_keep")["kept_uri"]
        assert storage_has(f"{kept}/model.safetensors") and storage_has(f"{kept}/README.md"), kept
        detail = airflow.api(
            "GET", f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/approve_publish/-1/hitlDetails"
        ).json()
        gate = _xcom(airflow, "quality_gate")
        assert detail["options"] == ["Approve", "Reject"] and detail["defaults"] == ["Reject"], detail
        assert gate["message"] in detail["body"] and kept in detail["body"], detail["body"]

        _answer(airflow, "Reject")
        rejected = _wait(airflow, "the run after Reject", lambda t: t["delete_cpu_vm"]["state"] in ANSWERED)
        _wait(airflow, "the run's end", lambda t: _run_state(airflow) in ("success", "failed"))
        assert _run_state(airflow) == "success", _report(airflow)
        assert rejected["export_and_publish"]["state"] == "skipped", _report(airflow)
        assert rejected["delete_cpu_vm"]["state"] == "success", _report(airflow)
        assert stack.compute.instances() == []
        assert _xcom(airflow, "export_and_publish") is None
        said = _task_log(airflow, "approve_publish")
        assert "Not published: rejected by" in said and f"The checked export is kept at {kept}" in said

        # Asked again (as from the UI: clear approve_publish and what follows): approved, the kept copy published.
        airflow.api(
            "POST", f"/dags/{SFT}/clearTaskInstances",
            json={"dry_run": False, "dag_run_id": RUN_ID, "task_ids": ["approve_publish"], "include_downstream": True,
                  "only_failed": False, "reset_dag_runs": True},
        )
        _wait(airflow, "asking again", lambda t: _asking(t) and _parked(airflow, t["approve_publish"]["try_number"]))
        _answer(airflow, "Approve")
        _wait(airflow, "the run after Approve", lambda t: _run_state(airflow) in ("success", "failed"))
        approved = _tasks(airflow)
        assert _run_state(airflow) == "success", _report(airflow)
        assert approved["create_tpu_vm"]["try_number"] == 1 and approved["train"]["try_number"] == 1
        published = _xcom(airflow, "export_and_publish")
        assert published["hub"]["commit_sha"] and published["kept_uri"] == kept, published
        assert f"Restoring the export kept at {kept}" in _task_log(airflow, "export_and_publish")
        assert "Approved by" in _task_log(airflow, "approve_publish")
    assert stack.compute.instances() == []
    fault_matrix.record(
        "approval: publish rejected through the REST API -> nothing published, export kept; asked again, approved",
        stack.compute.instances() == [], "success", storage_has(f"{kept}/model.safetensors"),
        f"rejected: export_and_publish skipped, CPU VM deleted; approved: published {kept} as Hub commit "
        f"{published['hub']['commit_sha'][:12]} without exporting again",
    )
