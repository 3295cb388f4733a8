"""Airflow's own backfill of a post-training DAG: each date trains its own inputs, each distinct input once.

The tiny SFT pipeline (models.yaml's entry, given a daily schedule and a cap of one TPU VM) backfilled over three
dates through Airflow's REST API (``POST /api/v2/backfills``, what the UI's Backfill dialog and ``airflow
backfill create`` call), with Airflow's api-server, scheduler, triggerer and LocalExecutor (bench/local_airflow.py)
against the local stack. The local Hub's model gets a commit between the first and second dates.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import HF_TOKEN, REPO

from airflow_tpu_posttrain.recipes.models import TINY_LLAMA_REPO

SFT = "posttrain_sft__tiny-llama"
STEPS = 2
SAMPLE_S = 0.5
RUNS_TIMEOUT_S = 1500.0
DAG_FILE = """
from pathlib import Path

from airflow_tpu_posttrain.pipelines.posttrain import build_dag
from airflow_tpu_posttrain.pipelines.registry import load_registry

for _config in load_registry(Path(__file__).with_name("models.yaml"), local=True):
    globals()[_config.dag_id] = build_dag(_config)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from airflow_tpu_posttrain.local.stack import LocalStack

    local = LocalStack(REPO / ".local", tmp_path_factory.mktemp("vm"), hf_token=HF_TOKEN)
    with local:
        yield local


def _registry(dags: Path) -> None:
    """models.yaml's tiny SFT entry, scheduled daily and capped at one TPU VM, alone in the DAGs folder."""
    import yaml

    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    [entry] = [e for e in registry["pipelines"] if e["model"] == "tiny-llama" and e["recipe"] == "sft" and "layout" not in e]
    registry["pipelines"] = [{**entry, "schedule": "@daily", "max_tpu_vms": 1}]
    (dags / "models.yaml").write_text(yaml.safe_dump(registry))
    (dags / "backfill_dags.py").write_text(DAG_FILE)


def _commit_to_the_model(stack, when: datetime) -> str:
    """A commit of the model's owner on the local Hub, dated ``when``: a new revision from then on."""
    folder = stack.vm_dir / "hub-seed" / "tiny-llama-v2"
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("# tiny-llama\n\nSecond revision: the card corrected.\n")
    return stack.hub.store.seed_repo(TINY_LLAMA_REPO, folder, gated="manual", date=when)


def _create_backfill(airflow, body: dict) -> None:
    """``POST /backfills``, asked again while it answers 503.

    Airflow answers 503 when SQLite was locked by another writer ("Database is locked. Backfill creation is not
    supported on SQLite under concurrent access", ``backfills.py``); nothing was created then. PostgreSQL, as in
    docker-compose.yaml, has no such lock."""
    for _ in range(30):
        response = airflow.client.post("/backfills", json=body)
        if response.status_code != 503:
            response.raise_for_status()
            return
        time.sleep(1)
    response.raise_for_status()


def _tasks(airflow, run_id: str) -> dict[str, dict]:
    found = airflow.api("GET", f"/dags/{SFT}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    return {task["task_id"]: task for task in found}


def _xcom(airflow, run_id: str, task_id: str, key: str = "return_value"):
    response = airflow.client.get(f"/dags/{SFT}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")
    return response.json()["value"] if response.status_code == 200 else None


def _log(airflow, run_id: str, task_id: str) -> str:
    """The task's log, every try and resume of it."""
    folder = airflow.home / "logs" / f"dag_id={SFT}" / f"run_id={run_id}" / f"task_id={task_id}"
    return "".join(log.read_text(errors="replace") for log in sorted(folder.glob("*.log")))


def _runs(airflow) -> dict[str, dict]:
    return {run["dag_run_id"]: run for run in airflow.api("GET", f"/dags/{SFT}/dagRuns").json()["dag_runs"]}


def _report(airflow) -> str:
    """Each run's and task's state, and the errors of the tasks that did not succeed."""
    lines = []
    for run_id, run in _runs(airflow).items():
        lines.append(f"{run_id}: {run['state']}")
        for task_id, task in _tasks(airflow, run_id).items():
            lines.append(f"  {task_id} try {task['try_number']}: {task['state']}")
            if task["state"] not in ("success", "skipped"):
                folder = airflow.home / "logs" / f"dag_id={SFT}" / f"run_id={run_id}" / f"task_id={task_id}"
                for log in folder.glob("*.log"):
                    errors = [line[:2000] for line in log.read_text(errors="replace").splitlines() if '"error"' in line]
                    lines += [f"    {log.name}:", *errors[-5:]]
    return "\n".join(lines)


def _sample_until_done(airflow, stack, runs: int, timeline: list) -> dict[str, dict]:
    """Every ``SAMPLE_S``, the TPU VMs that exist (from insert to the delete's end), until ``runs`` runs ended."""
    started, deadline = time.monotonic(), time.monotonic() + RUNS_TIMEOUT_S
    while True:
        tpu_vms = sorted(
            i["name"] for i in stack.compute.instances() if (i.get("labels") or {}).get("airflow-task") == "create-tpu-vm"
        )
        timeline.append((round(time.monotonic() - started, 1), tpu_vms))
        found = _runs(airflow)
        if len(found) >= runs and all(run["state"] in ("success", "failed") for run in found.values()):
            return found
        assert time.monotonic() < deadline, f"runs not done after {RUNS_TIMEOUT_S} s:\n{_report(airflow)}"
        time.sleep(SAMPLE_S)


@pytest.mark.airflow_processes
def test_a_backfill_trains_each_dates_inputs_once_one_tpu_vm_at_a_time(stack, tmp_path, monkeypatch, fault_matrix):
    """Three dates, the model committed between the first and the second: two trainings, not three.

    Of the second and third dates (the same inputs), the one whose check asks first trains and the other follows it,
    deferred, then reuses its model; the TPU VMs one at a time; no run failed; nothing left behind. The dates end
    today (the newest is the DAG's latest tick, so unpausing it adds no scheduled run)."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
    from airflow_tpu_posttrain.recipes import trainings
    from bench.local_airflow import LocalAirflow

    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    dates = [today - timedelta(days=2), today - timedelta(days=1), today]
    revision_2 = _commit_to_the_model(stack, dates[0] + timedelta(hours=12))
    dags = tmp_path / "dags"
    dags.mkdir()
    _registry(dags)
    timeline: list = []
    with LocalAirflow(tmp_path / "airflow", stack.environment(), dags_folder=dags) as airflow:
        assert airflow.wait_for_dags([SFT], present=SFT)[SFT]
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": False})
        conf = {"steps": STEPS, "quality_gate": "off"}
        _create_backfill(
            airflow,
            {
                "dag_id": SFT, "from_date": dates[0].isoformat(), "to_date": dates[-1].isoformat(),
                "dag_run_conf": conf, "max_active_runs": 3, "reprocess_behavior": "none",
            },
        )
        airflow.api("PATCH", f"/dags/{SFT}", json={"is_paused": False})
        runs = _sample_until_done(airflow, stack, 3, timeline)
        report = _report(airflow)
        by_date = sorted(runs.values(), key=lambda run: run["logical_date"])
        run_ids = [run["dag_run_id"] for run in by_date]
        assert [datetime.fromisoformat(run["logical_date"]) for run in by_date] == dates, report
        assert [run["run_type"] for run in by_date] == ["backfill"] * 3, report
        assert [run["state"] for run in by_date] == ["success"] * 3, report

        inputs = [_xcom(airflow, run_id, "check_inputs", "inputs") for run_id in run_ids]
        trained = [_xcom(airflow, run_id, "train") for run_id in run_ids]
        converted = [_xcom(airflow, run_id, "convert_to_maxtext") for run_id in run_ids]
        reused = [_xcom(airflow, run_id, "check_inputs", "reused_model") for run_id in run_ids]
        published = [_xcom(airflow, run_id, "export_and_publish") for run_id in run_ids]
        tasks = [_tasks(airflow, run_id) for run_id in run_ids]
        claims = [_xcom(airflow, run_id, "check_inputs", "training_claim") for run_id in run_ids]
        looks = [_log(airflow, run_id, "check_inputs").count("Inputs equal those run ") for run_id in run_ids]

        # A re-run of the first date, cleared as from the UI: its inputs' model is the one it published.
        airflow.api(
            "POST", f"/dags/{SFT}/clearTaskInstances",
            json={"dry_run": False, "dag_run_id": run_ids[0], "only_failed": False, "reset_dag_runs": True},
        )
        deadline = time.monotonic() + 300
        while _runs(airflow)[run_ids[0]]["state"] not in ("success", "failed"):
            assert time.monotonic() < deadline, _report(airflow)
            time.sleep(1)
        rerun_state = _runs(airflow)[run_ids[0]]["state"]
        rerun_reused = _xcom(airflow, run_ids[0], "check_inputs", "reused_model")
        rerun_tasks = _tasks(airflow, run_ids[0])

    # Each date's inputs are the Hub's as of that date: the second and third dates see the new commit.
    model = f"model:{TINY_LLAMA_REPO}"
    assert inputs[0]["revisions"][model] != revision_2, report
    assert inputs[1]["revisions"][model] == inputs[2]["revisions"][model] == revision_2, report
    # Two trainings: the first date's, and one of the two dates that share the new revision (whichever asked
    # first); the other followed it, deferred, and reuses its model, having made no VM.
    trainers = [i for i, t in enumerate(trained) if t is not None]
    assert len(trainers) == 2 and trainers[0] == 0, report
    leader = trainers[1]
    follower = 3 - leader
    assert all(trained[i]["reused"] is False and trained[i]["metrics"]["steps_completed"] == STEPS for i in trainers)
    assert [converted[i]["source_revision"] for i in trainers] == [inputs[0]["revisions"][model], revision_2]
    assert [converted[i]["reused"] for i in trainers] == [False, False]
    assert tasks[follower]["check_inputs"]["state"] == "skipped", report
    assert {t["state"] for task_id, t in tasks[follower].items() if task_id != "check_inputs"} == {"skipped"}, report
    assert reused[follower]["run_id"] == run_ids[leader], reused[follower]
    assert reused[follower]["hub"]["commit_sha"] == published[leader]["hub"]["commit_sha"], reused[follower]
    for name, value in stack.environment().items():  # the local stack's connections, to read the claims here
        monkeypatch.setenv(name, value)
    records = StoredRecordHook(gcp_conn_id="local_compute")
    assert [records.read(claims[i])["state"] for i in trainers] == ["published", "published"]
    # One TPU VM at a time, over every 0.5 s sample: one training's VM was gone before the other's trained. (Which
    # came first is the order the creates asked in: a date whose create asks while the place is free takes it.)
    most = max(len(names) for _, names in timeline)
    assert most == 1, [sample for sample in timeline if len(sample[1]) > 1]
    first, second = sorted(trainers, key=lambda i: tasks[i]["train"]["start_date"])
    assert tasks[first]["delete_tpu_vm"]["end_date"] <= tasks[second]["train"]["start_date"]
    # The re-run of the first date trained nothing: its own published model is its date's.
    assert rerun_state == "success" and rerun_reused["run_id"] == run_ids[0], (rerun_state, rerun_reused)
    assert rerun_tasks["train"]["state"] == "skipped"
    # Nothing left: no VM, no place held under the cap.
    assert stack.compute.instances() == []
    # The claim decided with no wait on the other dates: a trainer's check looked once; the follower once, then
    # once per change of the claim or per RECHECK_S of its leader's training.
    assert [looks[i] for i in trainers] == [0, 0], looks
    leading = datetime.fromisoformat(by_date[leader]["end_date"]) - datetime.fromisoformat(by_date[leader]["start_date"])
    assert 1 <= looks[follower] <= 2 + leading.total_seconds() // trainings.RECHECK_S, (looks, leading)
    fault_matrix.record(
        "backfill: 3 dates via Airflow's REST API, cap 1, the model committed between dates 1 and 2",
        stack.compute.instances() == [], "success", True,
        f"2 trainings (dates 1, {leader + 1}), date {follower + 1} reused date {leader + 1}'s model; never more "
        f"than {most} TPU VM over {len(timeline)} samples 0.5 s apart; check_inputs resumed "
        f"{looks[follower]} time(s) in the follower, none in the trainers",
    )
    print(json.dumps({"samples": len(timeline), "most_tpu_vms": most, "follower_looks": looks[follower]}))
