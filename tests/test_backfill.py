"""Airflow's own backfill of a post-training DAG: each date trains its inputs once, in line behind another DAG.

The tiny SFT pipeline (models.yaml's entry, given a daily schedule and a cap of one TPU VM) backfilled over three
dates through Airflow's REST API (``POST /api/v2/backfills``, what the UI's Backfill dialog and ``airflow
backfill create`` call), with Airflow's api-server, scheduler, triggerer and LocalExecutor (bench/local_airflow.py)
against the local stack. The local Hub's model gets a commit between the first and second dates. The tiny GRPO
pipeline, in the same line under the same cap, trains first: the backfill's runs wait for its TPU VM with
``max_wait_for_capacity`` 0 (no wait for a stock-out), and wait holding no VM.
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
RL = "posttrain_rl__tiny-llama"
STEPS = 2
SAMPLE_S = 0.5
# A bound, not a pause: four runs one after the other (three trainings), 11 min on a quiet machine; CI's full run
# trains on its other workers at the same time (a pipeline there takes up to 3 times as long).
RUNS_TIMEOUT_S = 2400.0
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
    """models.yaml's tiny SFT entry, scheduled daily, and its GRPO entry, alone in the DAGs folder.

    Both capped at one TPU VM, in one line (their VMs' zone and machine)."""
    import yaml

    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    tiny = [e for e in registry["pipelines"] if e["model"] == "tiny-llama" and "layout" not in e]
    [sft] = [e for e in tiny if e["recipe"] == "sft"]
    [rl] = [e for e in tiny if e["recipe"] == "rl"]
    registry["pipelines"] = [{**sft, "schedule": "@daily", "max_tpu_vms": 1}, {**rl, "max_tpu_vms": 1}]
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


def _tasks(airflow, run_id: str, dag_id: str = SFT) -> dict[str, dict]:
    found = airflow.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    return {task["task_id"]: task for task in found}


def _xcom(airflow, run_id: str, task_id: str, key: str = "return_value", dag_id: str = SFT):
    response = airflow.client.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")
    return response.json()["value"] if response.status_code == 200 else None


def _log(airflow, run_id: str, task_id: str, dag_id: str = SFT) -> str:
    """The task's log, every try and resume of it."""
    folder = airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
    return "".join(log.read_text(errors="replace") for log in sorted(folder.glob("*.log")))


def _runs(airflow, dag_id: str = SFT) -> dict[str, dict]:
    return {run["dag_run_id"]: run for run in airflow.api("GET", f"/dags/{dag_id}/dagRuns").json()["dag_runs"]}


def _report(airflow) -> str:
    """Each run's and task's state, and the errors of the tasks that did not succeed."""
    lines = []
    for dag_id in (SFT, RL):
        for run_id, run in _runs(airflow, dag_id).items():
            lines.append(f"{dag_id} {run_id}: {run['state']}")
            for task_id, task in _tasks(airflow, run_id, dag_id).items():
                lines.append(f"  {task_id} try {task['try_number']}: {task['state']}")
                if task["state"] not in ("success", "skipped"):
                    folder = airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
                    for log in folder.glob("*.log"):
                        text = log.read_text(errors="replace")
                        errors = [line[:2000] for line in text.splitlines() if '"error"' in line]
                        lines += [f"    {log.name}:", *errors[-5:]]
    return "\n".join(lines)


def _sample_until_done(airflow, stack, runs: int, timeline: list) -> dict[str, dict]:
    """Every ``SAMPLE_S``, the VMs that exist (from insert to the delete's end), until the runs ended.

    A sample: ``(epoch seconds, [(run label, task label, name), ...])``; done once ``runs`` runs of the SFT DAG
    and the GRPO run ended."""
    deadline = time.monotonic() + RUNS_TIMEOUT_S
    while True:
        vms = sorted(
            ((i.get("labels") or {}).get("airflow-run", ""), (i.get("labels") or {}).get("airflow-task", ""), i["name"])
            for i in stack.compute.instances()
        )
        timeline.append((time.time(), vms))
        found, holder = _runs(airflow), _runs(airflow, RL)
        ended = [run["state"] in ("success", "failed") for run in [*found.values(), *holder.values()]]
        if len(found) >= runs and all(ended):
            return found
        assert time.monotonic() < deadline, f"runs not done after {RUNS_TIMEOUT_S} s:\n{_report(airflow)}"
        time.sleep(SAMPLE_S)


def _tpu_vms(sample: list[tuple[str, str, str]]) -> list[str]:
    return [name for _, task, name in sample if task == "create-tpu-vm"]


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _logged_at(log: str, text: str, last: bool = False) -> float | None:
    """When the task's log first (or last) said ``text`` (epoch seconds)."""
    said = [json.loads(line) for line in log.splitlines() if text in line and line.startswith("{")]
    if not said:
        return None
    return datetime.fromisoformat(said[-1 if last else 0]["timestamp"]).timestamp()


@pytest.mark.airflow_processes
@pytest.mark.timeout(RUNS_TIMEOUT_S + 300)  # four runs, three of them trainings, one after the other
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
        assert all(airflow.wait_for_dags([SFT, RL], present=SFT).values())
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": False})
        # The GRPO run takes the line's one place first; the backfill's runs then wait behind its training, with no
        # wait allowed for a stock-out (max_wait_for_capacity 0): a line that moves is no reason to fail.
        airflow.trigger(RL, "manual__holder", {"quality_gate": "off", "max_wait_for_capacity": 0})
        deadline = time.monotonic() + 600
        while (_tasks(airflow, "manual__holder", RL).get("train") or {}).get("state") not in ("running", "deferred"):
            holding = _runs(airflow, RL)["manual__holder"]["state"] in ("queued", "running")
            assert time.monotonic() < deadline and holding, _report(airflow)
            time.sleep(1)
        conf = {"steps": STEPS, "quality_gate": "off", "max_wait_for_capacity": 0}
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
        creates = [_log(airflow, run_id, "create_tpu_vm") for run_id in run_ids]
        vms = [
            {kind: (_xcom(airflow, run_id, f"create_{kind}_vm") or {}).get("name") for kind in ("tpu", "cpu", "export")}
            for run_id in run_ids
        ]
        vm_seconds = {
            (_xcom(airflow, run_id, f"delete_{kind}_vm") or {}).get("name"): (
                _xcom(airflow, run_id, f"delete_{kind}_vm") or {}
            ).get("vm_seconds")
            for run_id in run_ids for kind in ("tpu", "cpu", "export")
        }
        holder_state = _runs(airflow, RL)["manual__holder"]["state"]
        holder_vm = _xcom(airflow, "manual__holder", "create_tpu_vm", dag_id=RL)["name"]

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
    # The first date's conversion is its own; the new revision's may be the GRPO run's (the cache is by content).
    assert converted[0]["reused"] is False
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
    most = max(len(_tpu_vms(sample)) for _, sample in timeline)
    assert most == 1, [sample for sample in timeline if len(_tpu_vms(sample[1])) > 1]
    first, second = sorted(trainers, key=lambda i: tasks[i]["train"]["start_date"])
    assert tasks[first]["delete_tpu_vm"]["end_date"] <= tasks[second]["train"]["start_date"]
    # The GRPO run held the place, then each training in turn; the backfill's trainings waited behind the runs
    # that trained, first in line longer than max_wait_for_capacity (0), and none failed for it.
    assert holder_state == "success", report
    waited = [i for i in trainers if "Waiting for TPU capacity" in creates[i]]
    assert waited, [creates[i][-3000:] for i in trainers]
    assert not any("No TPU capacity" in log for log in creates), report
    # Waiting in line, a run holds no VM: after its conversion, its conversion's CPU VM is deleted (the samples
    # seen are its teardown's), and its export's CPU VM is made only after the training.
    idle = {}
    for i in waited:
        asked = max(_logged_at(creates[i], "Waiting for TPU capacity"), _epoch(tasks[i]["convert_to_maxtext"]["end_date"]))
        granted = _logged_at(creates[i], "Took a place")
        held = [(at, name) for at, sample in timeline if asked <= at <= granted for _, _, name in sample
                if name in vms[i].values()]
        assert {name for _, name in held} <= {vms[i]["cpu"]}, held
        assert all(at <= _epoch(tasks[i]["delete_cpu_vm"]["end_date"]) + SAMPLE_S for at, _ in held), held
        behind = "the GRPO run" if holder_vm in creates[i] else "the other training"
        idle[run_ids[i]] = (round(granted - asked), len(held) * SAMPLE_S, behind)
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
    fault_matrix.record(
        "line: cap 1, SFT backfill runs wait first in line behind a GRPO run's and each other's training, past "
        "max_wait_for_capacity (0)",
        stack.compute.instances() == [], "success", True,
        "; ".join(
            f"{run_id} waited {wait} s behind {behind} holding {seconds:.1f} VM-s (its conversion VM's teardown)"
            for run_id, (wait, seconds, behind) in idle.items()
        ) + f"; never more than {most} TPU VM",
    )
    print(json.dumps({
        "samples": len(timeline), "most_tpu_vms": most, "follower_looks": looks[follower],
        "waits_in_line": idle, "vm_seconds": vm_seconds,
    }))
