"""A person's approval before publishing a LoRA adapter, answered through Airflow's REST API (what the UI calls).

The LoRA twin's pipeline (models.yaml's ``posttrain_sft__tiny-gemma3-4b__lora`` with ``approval: true``: adapters
trained on the tiny Gemma 3 with MaxText 0.2.5 on the CPU) on Airflow's api-server, scheduler, triggerer and
LocalExecutor (bench/local_airflow.py) against the local stack, with two users: ``bench``, who triggers the run, and
the one approver the registry names. One training: asked once every VM is gone (a conf saying ``approval: false``
changes nothing), the notice said with the task's link; ``bench``'s answer is refused by the API (403); nobody
answers in time, so nothing is published, the timeout is said and the export kept; asked again by clearing
``approve_publish``, the approver approves: a VM made for it publishes the kept adapter without exporting again,
and the adapter loads with PEFT from the local Hub onto the base it names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import HF_TOKEN, REPO, storage_has
from test_backfill import DAG_FILE

SFT = "posttrain_sft__tiny-gemma3-4b__lora"
BASE_REPO = "google/gemma-3-4b-it"  # the tiny Gemma 3, served by the local Hub under the cloud model's id
# MaxText's default LoRA modules for Gemma 3 (post_train/lora_module_path.yml): every attention and MLP projection.
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
RUN_ID = "manual__approval"
APPROVER = "approver"  # the one user the registry names; LocalAirflow's own user, bench, triggers the run
TIMEOUT_S = 90  # the registry's approval_timeout_hours, in seconds: the first asking goes unanswered
# The bound of each wait. The first waits for the whole pipeline up to the asking (two VMs, a conversion, a LoRA
# training, a third VM and the export's fidelity check): 7 min on a quiet machine, past 15 min in CI's full run,
# whose other workers train too; it stops at once when a step fails.
WAIT_S = 900.0
PIPELINE_WAIT_S = 2400.0
ANSWERED = ("success", "failed", "skipped")

pytestmark = pytest.mark.airflow_processes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from airflow_tpu_posttrain.local.stack import LocalStack

    local = LocalStack(REPO / ".local", tmp_path_factory.mktemp("vm"), hf_token=HF_TOKEN)
    with local:
        yield local


def _registry(dags: Path) -> None:
    """models.yaml's LoRA twin, asking before it publishes, alone in the DAGs folder."""
    import yaml

    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    [entry] = [e for e in registry["pipelines"] if e["model"] == "tiny-gemma3-4b" and e.get("lora")]
    registry["pipelines"] = [
        {**entry, "approval": True, "approvers": [APPROVER], "approval_timeout_hours": TIMEOUT_S / 3600}
    ]
    (dags / "models.yaml").write_text(yaml.safe_dump(registry))
    (dags / "approval_dags.py").write_text(DAG_FILE)


def _tasks(airflow) -> dict[str, dict]:
    found = airflow.api("GET", f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances").json()["task_instances"]
    return {task["task_id"]: task for task in found}


def _report(airflow) -> str:
    return "\n".join(f"{task_id} try {t['try_number']}: {t['state']}" for task_id, t in _tasks(airflow).items())


def _wait(airflow, what: str, done, within: float = WAIT_S, no_failures: bool = False) -> dict[str, dict]:
    """The run's tasks once ``done(tasks)`` holds, looked at every second for at most ``within`` seconds.

    ``no_failures``: a task that fails meanwhile ends the wait at once, naming it."""
    deadline = time.monotonic() + within
    while True:
        tasks = _tasks(airflow)
        if done(tasks):
            return tasks
        if no_failures:
            failed = sorted(task_id for task_id, t in tasks.items() if t["state"] in ("failed", "upstream_failed"))
            assert not failed, f"{what}: {failed} failed\n{_report(airflow)}"
        assert time.monotonic() < deadline, f"{what}: not after {within} s\n{_report(airflow)}"
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


def _answer(client, option: str):
    """The answer ``client``'s user gives, as the UI's Required actions page sends it; the API's response."""
    return client.patch(
        f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/approve_publish/-1/hitlDetails",
        json={"chosen_options": [option], "params_input": {}},
    )


def _answer_xcom(airflow):
    response = airflow.client.get(f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/approve_publish/xcomEntries/answer")
    return response.json()["value"] if response.status_code == 200 else None


def _xcom(airflow, task_id: str):
    response = airflow.client.get(f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/{task_id}/xcomEntries/return_value")
    return response.json()["value"] if response.status_code == 200 else None


def _task_log(airflow, task_id: str) -> str:
    folder = airflow.home / "logs" / f"dag_id={SFT}" / f"run_id={RUN_ID}" / f"task_id={task_id}"
    return "".join(log.read_text(errors="replace") for log in sorted(folder.glob("*.log")))


def _peft_loads(stack, adapter: str, revision: str) -> dict:
    """What a user's ``AutoPeftModelForCausalLM.from_pretrained`` from the Hub gets (local/check_peft_adapter.py)."""
    check = subprocess.run(
        [str(REPO / ".local/hfcheck-venv/bin/python"), str(REPO / "airflow_tpu_posttrain/local/check_peft_adapter.py"),
         adapter, "--revision", revision],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_ENDPOINT": stack.hub.url, "HF_TOKEN": HF_TOKEN, "HF_HOME": str(stack.vm_dir / "peft")},
    )
    assert check.returncode == 0, check.stderr[-3000:]
    return json.loads(check.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(3600)  # one LoRA training, its export's fidelity check, two askings (one times out), a publish
def test_only_an_approver_lets_an_adapter_out_and_an_unanswered_one_is_kept_not_published(
    stack, tmp_path, monkeypatch, fault_matrix
):
    from bench.local_airflow import LocalAirflow

    for name, value in stack.environment().items():  # the local stack's connections, to read its storage here
        monkeypatch.setenv(name, value)
    dags = tmp_path / "dags"
    dags.mkdir()
    _registry(dags)
    with LocalAirflow(tmp_path / "airflow", stack.environment(), dags_folder=dags, users=(APPROVER,)) as airflow:
        assert airflow.wait_for_dags([SFT], present=SFT)[SFT]
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": False})
        # The form has no switch for the approval the registry asks for: a conf that says otherwise still asks.
        assert "approval" not in airflow.api("GET", f"/dags/{SFT}/details").json()["params"]
        airflow.trigger(SFT, RUN_ID, {"force": True, "approval": False})
        asked = _wait(
            airflow, "asking for approval", lambda t: _asking(t) and _parked(airflow, 1),
            within=PIPELINE_WAIT_S, no_failures=True,
        )
        # Waiting for the answer: every VM is gone, the export is kept, nothing is published.
        assert asked["export_and_keep"]["state"] == "success", _report(airflow)
        for teardown in ("delete_tpu_vm", "delete_cpu_vm", "delete_export_vm"):
            assert asked[teardown]["state"] == "success", _report(airflow)
        assert asked["export_and_publish"]["state"] in (None, "scheduled", "none"), _report(airflow)
        assert stack.compute.instances() == []
        kept = _xcom(airflow, "export_and_keep")["kept_uri"]
        assert storage_has(f"{kept}/adapter_model.safetensors") and storage_has(f"{kept}/README.md"), kept
        assert not storage_has(f"{kept}/model.safetensors"), kept  # the adapters only, not a model
        # The local CPU venv (maxtext[tpu]) has no PEFT: the adapter's load with PEFT is tests/test_publish.py's.
        said = _task_log(airflow, "export_and_keep")
        assert "publish_model: the adapter was checked for its shapes only: peft is not installed here" in said
        detail = airflow.api(
            "GET", f"/dags/{SFT}/dagRuns/{RUN_ID}/taskInstances/approve_publish/-1/hitlDetails"
        ).json()
        gate = _xcom(airflow, "quality_gate")
        assert detail["options"] == ["Approve", "Reject"] and detail["defaults"] == ["Reject"], detail
        assert gate["message"] in detail["body"] and kept in detail["body"], detail["body"]
        assert [user["id"] for user in detail["assigned_users"]] == [APPROVER], detail
        said = _task_log(airflow, "approve_publish")
        link = f"/dags/{SFT}/runs/{RUN_ID}/tasks/approve_publish/required_actions"
        assert "Notice (waiting): Approve publishing the model of" in said and link in said, said[-3000:]

        # The user who triggered the run is not an approver: Airflow's API refuses the answer.
        refused = _answer(airflow.client, "Approve")
        assert refused.status_code == 403 and "is not a respondent" in refused.text, refused.text
        # Nobody answers within the timeout: the default, Reject; said, nothing published, the inputs refused.
        _wait(airflow, "the run's end after the timeout", lambda t: _run_state(airflow) in ("success", "failed"))
        timed_out = _tasks(airflow)
        assert _run_state(airflow) == "success", _report(airflow)
        for skipped in ("create_pub_vm", "install_maxtext_pub", "export_and_publish", "delete_pub_vm"):
            assert timed_out[skipped]["state"] == "skipped", _report(airflow)
        assert stack.compute.instances() == []
        assert _xcom(airflow, "export_and_publish") is None
        said = _task_log(airflow, "approve_publish")
        assert "Notice (timed_out): Not published: nobody answered" in said and link in said, said[-3000:]
        assert "Not published: no answer within" in said and f"The checked export is kept at {kept}" in said
        # The refusal is in the inputs' claim: a later run with these inputs trains nothing and asks no one.
        assert "Runs with these inputs train nothing now (their model was refused" in said
        assert _answer_xcom(airflow) | {"at": None} == {
            "approved": False, "answer": "no answer", "by": None, "at": None, "kept_export": kept
        }

        # Asked again (as from the UI: clear approve_publish and what follows): the approver approves, and the kept
        # copy is published from a VM made for it.
        airflow.api(
            "POST", f"/dags/{SFT}/clearTaskInstances",
            json={"dry_run": False, "dag_run_id": RUN_ID, "task_ids": ["approve_publish"], "include_downstream": True,
                  "only_failed": False, "reset_dag_runs": True},
        )
        _wait(airflow, "asking again", lambda t: _asking(t) and _parked(airflow, t["approve_publish"]["try_number"]))
        with airflow.client_as(APPROVER) as approver:
            answered = _answer(approver, "Approve")
        assert answered.status_code == 200, answered.text
        _wait(airflow, "the run after Approve", lambda t: _run_state(airflow) in ("success", "failed"))
        approved = _tasks(airflow)
        assert _run_state(airflow) == "success", _report(airflow)
        # Asking again reruns nothing before the asking (a loaded machine may have retried the training before it).
        for upstream in ("create_tpu_vm", "train", "export_and_keep"):
            assert approved[upstream]["try_number"] == asked[upstream]["try_number"], (upstream, _report(airflow))
        assert approved["delete_pub_vm"]["state"] == "success", _report(airflow)
        assert _xcom(airflow, "create_pub_vm")["name"].startswith("pub-")
        published = _xcom(airflow, "export_and_publish")
        assert published["hub"]["commit_sha"] and published["kept_uri"] == kept, published
        assert f"Restoring the export kept at {kept}" in _task_log(airflow, "export_and_publish")
        assert f"Approved by {APPROVER}: publishing" in _task_log(airflow, "approve_publish")
        assert _answer_xcom(airflow)["by"] == APPROVER and _xcom(airflow, "approve_publish")["answer"] == "Approve"
        # Trained with the LoRA tutorial's keys on MaxText 0.2.5, from its own conversion; its gate passed.
        converted, trained = _xcom(airflow, "convert_to_maxtext"), _xcom(airflow, "train")
        assert "/conversions/tiny-gemma3-4b/mt0.2.5-" in converted["converted_params"]
        assert "Config param lora: {'enable_lora': True, 'lora_rank': 16, 'lora_alpha': 32.0" in _task_log(airflow, "train")
        assert trained["metrics"]["steps_completed"] == 5 and gate["passed"]
    assert stack.compute.instances() == []

    # Published: the adapter and its card, the adapter pointed at the base repo at the revision converted.
    from huggingface_hub import HfApi, hf_hub_download

    hub, validated = published["hub"], published["validated"]
    assert hub["repo_id"] == "local/tiny-gemma3-4b-lora"
    # The adapter names the language model's projections only (a regex): PEFT leaves the vision tower alone.
    targets = validated["adapter"]["target_modules"]
    [pattern] = targets if isinstance(targets, list) else [targets]
    assert validated["adapter"]["r"] == 16, validated["adapter"]
    assert all(re.fullmatch(pattern, f"model.language_model.layers.0.mlp.{name}") for name in PROJECTIONS), pattern
    assert not any(re.fullmatch(pattern, f"model.vision_tower.layers.0.mlp.{name}") for name in PROJECTIONS), pattern
    download = {"repo_id": hub["repo_id"], "revision": hub["revision"], "endpoint": stack.hub.url, "token": HF_TOKEN,
                "cache_dir": tmp_path / "hub-cache"}
    files = set(HfApi(endpoint=stack.hub.url, token=HF_TOKEN).list_repo_files(hub["repo_id"], revision=hub["revision"]))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files and "model.safetensors" not in files
    adapter_config = json.loads(Path(hf_hub_download(filename="adapter_config.json", **download)).read_text())
    assert (adapter_config["base_model_name_or_path"], adapter_config["revision"]) == (
        BASE_REPO, converted["source_revision"]
    )
    card = Path(hf_hub_download(filename="README.md", **download)).read_text()
    assert "library_name: peft" in card and f'PeftModel.from_pretrained(base, "{hub["repo_id"]}"' in card
    assert "LoRA adapter: rank 16, alpha 32.0" in card
    adapter_bytes = Path(hf_hub_download(filename="adapter_model.safetensors", **download)).stat().st_size
    base_bytes = (stack.local_dir / "tiny" / "tiny-gemma3" / "model.safetensors").stat().st_size
    print(f"adapter: {adapter_bytes} bytes, {validated['params']} params; the tiny base's weights: {base_bytes} bytes")
    assert adapter_bytes < base_bytes

    # A user's load from the Hub: the base the adapter names, the adapter onto it; merged, it changes the weights
    # of the adapted projections of every layer and nothing else.
    loaded = _peft_loads(stack, hub["repo_id"], hub["revision"])
    assert loaded["base"] == f"{BASE_REPO}@{converted['source_revision']}" and loaded["generated"]
    adapted = {
        name for name in loaded["changed"] + loaded["unchanged"]
        if ".layers." in name and "vision" not in name and name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS
    }
    assert len(adapted) == 14 * len(PROJECTIONS)
    assert set(loaded["changed"]) == adapted
    fault_matrix.record(
        "approval: a LoRA adapter's publish answered by a non-approver (403), then unanswered -> nothing published, "
        "export kept, timeout said; asked again, the approver approves",
        stack.compute.instances() == [], "success", storage_has(f"{kept}/adapter_model.safetensors"),
        f"no VM while asked; bench refused 403; timed out after {TIMEOUT_S} s: the publish skipped; approved by "
        f"{APPROVER}: a publish VM published {kept} as Hub commit "
        f"{published['hub']['commit_sha'][:12]} without exporting again; adapter {adapter_bytes} bytes "
        f"({validated['params']} params), the base's weights {base_bytes} bytes; loaded with PEFT, it changed "
        f"{len(loaded['changed'])} of {len(loaded['changed']) + len(loaded['unchanged'])} tensors",
    )
