"""The benchmark stays runnable: every path of bench/perf.py but its long runs, in the fast loop.

- P4's baseline, bench/plain_pipeline.sh, runs whole with MaxText's interpreter replaced by a recorder: every step
  runs in order, the script checks each file it reads (the tiny model and data that scripts/bootstrap.sh built),
  perf.py reads its seconds, and the MaxText commands it ran are those of the local DAG runs P4 compares it with,
  on the same files;
- the table and its page (``perf.report``, ``perf.write_doc``) from records of every kind of run the bench makes;
- P3's probe (bench/parse_time.py) in fresh interpreters, and P6's archive through storage on a small venv.

Nothing here trains: MaxText's runs are bench/perf.py's own (README's benchmark section).
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO
from test_twins import _command, _steps_in, dags  # noqa: F401 (dags: the fixture, parsed from dags/)

from airflow_tpu_posttrain.local.tiny_model import CHATS_DIR, GSM8K_DIR
from airflow_tpu_posttrain.recipes.models import LOCAL_HUB_SOURCES, TINY_CHATS_REPO, TINY_GSM8K_REPO
from airflow_tpu_posttrain.recipes.runtime import LOCAL_MODELS, Step

SCRIPT = REPO / "bench" / "plain_pipeline.sh"
# The local stack's tiny models and data, which it serves on its Hub (local/stack.py) and the runs' VMs copy.
TINY = REPO / ".local" / LOCAL_MODELS
# Which folder of TINY the local stack serves as each dataset repo (LocalStack.start).
DATASET_FOLDERS = {TINY_CHATS_REPO: CHATS_DIR, TINY_GSM8K_REPO: GSM8K_DIR}
# Arguments naming places (run names, directories, checkpoints, the model and data): local paths in the script,
# the VM's copies and checkpoint storage in a run. Every other argument must be the run's, value for value.
PLACES = {
    "run_name", "base_output_directory", "load_parameters_path", "tokenizer_path", "--hf_model_path", "hf_path",
    "hf_train_files", "hf_eval_files",
}
# The quality gate's evaluations (its default): the bench's runs turn the gate off, as the tutorial's commands do.
GATE = {"eval_interval", "eval_steps"}
# The baseline's steps (the script's names) and the DAG task each is compared with.
SFT_DAG, RL_DAG = "posttrain_sft__tiny-llama", "posttrain_rl__tiny-llama"
COMPARED = {
    "convert": (SFT_DAG, "convert_to_maxtext"),
    "sft": (SFT_DAG, "train"),
    "export-sft": (SFT_DAG, "export_and_publish"),
    "rl": (RL_DAG, "train"),
    "export-rl": (RL_DAG, "export_and_publish"),
}
RECORDER = """\
#!{python}
import json, os, sys
with open(os.environ["BENCH_RECORDED"], "a") as record:
    record.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@pytest.fixture(autouse=True)
def _deployment(configured_deployment):
    """The DAGs' commands are rendered outside a task process."""


@pytest.fixture(scope="module", autouse=True)
def _bench_modules():
    """bench/'s modules importable as its scripts import their siblings (``import run_probe``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(REPO / "bench"))
        yield


@pytest.fixture(scope="module")
def perf(_bench_modules):
    return importlib.import_module("perf")


@pytest.fixture
def recorded(tmp_path, monkeypatch) -> Path:
    """MaxText's and the transformers check's interpreters replaced by one that records its arguments, a line each."""
    venv = tmp_path / "recorder-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(RECORDER.format(python=sys.executable))
    (venv / "bin" / "python").chmod(0o755)
    record = tmp_path / "recorded.jsonl"
    monkeypatch.setenv("BENCH_RECORDED", str(record))
    monkeypatch.setenv("TPU_POSTTRAIN_MAXTEXT_VENV", str(venv))
    monkeypatch.setenv("TPU_POSTTRAIN_HFCHECK_VENV", str(venv))
    return record


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False)


def _steps(record: Path) -> dict[str, dict]:
    """The recorded MaxText commands by the script's step name: ``{"step": Step, "args": {key: value}}``."""
    found: dict[str, dict] = {}
    for line in record.read_text().splitlines():
        argv = json.loads(line)
        (step,) = _steps_in(" ".join(argv)) or (None,)
        if step is None:  # the tiny model's build and the transformers check
            continue
        args = dict(word.split("=", 1) for word in argv if "=" in word)
        if step is Step.TRAIN_SFT:
            name = args["run_name"]  # sft, or resume (the resume check's)
        elif step is Step.TO_HUGGINGFACE:
            name = "export-" + Path(args["base_output_directory"]).name.removeprefix("hf-")
        else:
            name = {Step.TO_MAXTEXT: "convert", Step.TRAIN_RL: "rl"}[step]
        found[name] = {"step": step, "args": args}
    return found


def test_the_baseline_runs_the_local_runs_commands_on_their_files(dags, recorded):  # noqa: F811
    """P4 compares like with like: each MaxText command of the script is its DAG task's, on the files its run reads.

    Run whole (RL and the resume check too), each step's interpreter a recorder."""
    done = _run_script("--resume-check", str(recorded.parent / "work"))
    assert done.returncode == 0, done.stdout + done.stderr
    steps = _steps(recorded)
    assert set(steps) == {*COMPARED, "resume"}, sorted(steps)
    for name, (dag_id, task_id) in COMPARED.items():
        mine, run = steps[name], _command(dags[dag_id], task_id)
        theirs = {key: value for key, value in run["args"].items() if key not in GATE}
        assert _steps_in(" ".join(run["entry"])) == [mine["step"]], name
        only_mine, only_theirs = sorted(mine["args"].keys() - theirs), sorted(theirs.keys() - mine["args"])
        assert not only_mine + only_theirs, f"{name}: only here {only_mine}, only in {dag_id}.{task_id} {only_theirs}"
        differ = {key for key in theirs if key not in PLACES and mine["args"][key] != theirs[key]}
        assert not differ, {key: (mine["args"][key], theirs[key]) for key in sorted(differ)}
        model = run["spec"].model
        model_files = str(TINY / LOCAL_HUB_SOURCES[model.hf_source])  # what the local Hub serves as the model
        for key in ("tokenizer_path", "--hf_model_path"):
            if key in mine["args"]:
                assert mine["args"][key] == model_files, (name, key)
        # The data: the folder the local Hub serves as the run's dataset repo, read as the run reads its copy.
        dataset_dir = run["spec"].layout.dataset_dir
        if name == "sft":
            data = model.sft_dataset
            assert theirs["hf_path"] == dataset_dir
            assert mine["args"]["hf_path"] == str(TINY / DATASET_FOLDERS[data.hf_path])
            assert list((TINY / DATASET_FOLDERS[data.hf_path]).glob(f"data/{data.train_split}-*.parquet"))
        if name == "rl":
            data, folder = model.rl_dataset, TINY / DATASET_FOLDERS[model.rl_dataset.repo]
            for key, files in (("hf_train_files", data.train_files), ("hf_eval_files", data.eval_files)):
                assert theirs[key] == f"{dataset_dir}/{files}"
                assert mine["args"][key] == f"{folder}/{files}"
                assert list(folder.glob(files)), f"no {files} in {folder}"
    assert steps["resume"]["args"] | {"run_name": "sft", "steps": "5"} == steps["sft"]["args"]


def test_perf_reads_the_baselines_seconds_per_step(perf, recorded, tmp_path):
    seconds = perf.plain_baseline(tmp_path / "plain")
    assert set(seconds) == {"tiny-model", "convert", "sft", "export-sft", "pipeline total", "check-hf-sft"}



def test_the_parse_time_probe_times_a_dag_file_and_names_its_heavy_imports(tmp_path):
    """P3's probe in fresh interpreters (Airflow imported and warmed up first), on a file of two DAGs."""
    import parse_time

    dag_file = tmp_path / "two_dags.py"
    dag_file.write_text(
        textwrap.dedent(
            """
            import huggingface_hub
            from airflow.sdk import DAG

            first = DAG("first", schedule=None)
            second = DAG("second", schedule=None)
            """
        )
    )
    measured = parse_time.measure(dag_file, runs=1)
    assert measured["dags"] == 2
    assert measured["heavy"] == ["huggingface_hub"]
    assert {"airflow_ms", "dag_file_ms"} <= set(measured)


def test_the_environment_archive_goes_through_storage_and_comes_back_whole(perf, tmp_path):
    """P6 with the install script's storage commands, on a small venv: what is restored is what was saved."""
    venv = tmp_path / "small-venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "module.py").write_text("x = 1\n" * 100)
    (venv / "bin").mkdir()
    (venv / "bin" / "tool").write_text("#!/bin/sh\n")
    figures = perf.environment_archive(venv, Path(sys.executable), tmp_path / "work")
    assert figures["venv_bytes"] == 600 + 10
    assert figures["archive_bytes"] > 0
    assert {"save_s", "restore_s"} <= set(figures)
    assert not (tmp_path / "work").exists()


def _record(run_probe, label: str, dag_id: str = SFT_DAG, **xcom):
    """A watched run (``run_probe.RunRecord``): started at 1000 s, 300 s long, its train task 1100 → 1300.

    Its TPU VM made at 1010, gone at 1250 (240 s held); tasks running 30 s of it, deferred 60 s."""
    record = run_probe.RunRecord(dag_id, f"bench-{label}", "success", queued=999.0, start=1000.0, end=1300.0)
    record.tasks = {
        "create_tpu_vm": run_probe.TaskTry("success", 1, 1000.0, 1060.0),
        "train": run_probe.TaskTry("success", 1, 1100.0, 1300.0),
    }
    record.vms = {"create_tpu_vm": run_probe.Vm(1010.0, 1250.0)}
    record.seconds_in.update({("train", "running"): 20.0, ("convert_to_maxtext", "running"): 10.0, ("train", "deferred"): 60.0})
    record.xcom = xcom
    return record


def _policy_records(run_probe) -> dict:
    """A 2-date backfill's runs and an approval's, their samples as the sampler takes them."""
    sample = run_probe.Sample
    first = _record(run_probe, "date-1")
    first.timeline = [
        sample(10.0, {"create_tpu_vm": "deferred", "convert_to_maxtext": "running"}, frozenset({"create_cpu_vm"}), 1),
        sample(4.0, {"create_tpu_vm": "deferred", "convert_to_maxtext": "success"}, frozenset({"create_cpu_vm"}), 1),
        sample(3.0, {"create_tpu_vm": "deferred"}, frozenset(), 0),  # the place free: not in line
        sample(5.0, {"create_tpu_vm": "success", "train": "running"}, frozenset({"create_tpu_vm"}), 0),
    ]
    first.api_calls, first.state_reads = 100, 0
    second = _record(run_probe, "date-2")
    second.api_calls, second.state_reads, second.resumes = 50, 2, {"check_inputs": 2}
    approval = _record(run_probe, "approval")
    approval.timeline = [
        sample(30.0, {"approve_publish": "awaiting_input", "delete_tpu_vm": "success"}, frozenset(), 0),
        sample(2.0, {"approve_publish": "awaiting_input", "create_pub_vm": "running"}, frozenset({"create_pub_vm"}), 0),
        sample(5.0, {"approve_publish": "success", "export_and_publish": "running"}, frozenset({"create_pub_vm"}), 0),
    ]
    return {"date 1": first, "date 2": second, "approval": approval}


def _rows(text: str) -> dict[tuple[str, str], list[str]]:
    """The table's rows by (figure, subject): ``[value, target, verdict, how]``."""
    lines = text.split("\nnotes:")[0].splitlines()[1:]
    return {(cells[0], cells[1]): cells[2:] for cells in (re.split(r" {2,}", line, maxsplit=5) for line in lines)}


def test_the_table_and_its_page_from_every_kind_of_run(perf, tmp_path, monkeypatch):
    """Each figure of the table from the records the runs give; the page keeps the test suite's section."""
    import run_probe

    loads = {"checkpoint_loads": [{"uri": "gs://b/conversions/tiny-llama/k/0/items", "seconds": 1.5, "bytes": 2**20}]}
    records = {
        "cold": _record(run_probe, "cold", train={"metrics": loads}),
        "revision": _record(run_probe, "revision"),
        "warm": _record(run_probe, "warm", convert_to_maxtext={"reused": True}),
        "fault": _record(run_probe, "fault", train={"metrics": {"resumed_from_step": 4}}),
        "fault-sync": _record(run_probe, "fault-sync"),
    }
    for label in ("fault", "fault-sync"):
        records[label].killed, records[label].killed_at_step = ["python3 -m ...train_sft ..."], 5
    records.update(_policy_records(run_probe))
    plain = {"tiny-model": 0.1, "convert": 20.0, "sft": 60.0, "export-sft": 20.0, "pipeline total": 100.0}
    parsed = {"posttrain_dags.py": {"dag_file_ms": 90.0, "dags": 3, "airflow_ms": 900.0, "heavy": []}}
    archive = {"save_s": 30.0, "restore_s": 12.0, "archive_bytes": 2**30, "venv_bytes": 3 * 2**30}
    skipped = {"seeds": f"{perf.SEEDS} does not exist (yet)"}
    text = perf.report(records, skipped, plain, parsed, archive)
    rows = _rows(text)
    assert rows[("P1", f"{SFT_DAG} (cold)")] == ["1.20", "<= 1.15", "MISS", "TPU VM held 240 s / train 200 s"]
    assert rows[("P2", f"{SFT_DAG} (warm)")] == ["0.100", "<= 0.05", "MISS", "running 30 s (deferred 60 s) / run 300 s"]
    assert rows[("P3", "dags/posttrain_dags.py")][:3] == ["90", "<= 100", "ok"]
    assert rows[("P4", f"{SFT_DAG} (cold)")][0] == "3.00"
    assert rows[("P4", f"{SFT_DAG} (warm, vs plain w/o convert)")][0] == "3.75"
    assert rows[("P5", "training steps repeated by the retry")][:3] == ["1", "<= 2", "ok"]
    assert rows[("P5", "the same, synchronous checkpoints")][:3] == ["5", "<= 2", "MISS"]
    assert rows[("P5", "conversions repeated (warm run)")][:3] == ["0", "<= 0", "ok"]
    assert rows[("P6", "converted checkpoint load on the TPU VM, s")][0] == "1.50"
    assert rows[("P6", "MaxText environment archive: restore, s")][0] == "12.0"
    # The policies: the first date held its conversion's VM 4 s with nothing to do while in line; the second date
    # followed the first's claim; the person took 32 s, during which the publish VM was made (2 s of it).
    assert rows[("line", "VM-s held idle waiting in line (2-date backfill)")] == [
        "4.0", "<= 0", "MISS", "date 1 waited 14 s, 4.0 VM-s idle; date 2 waited 0 s, 0.0 VM-s idle"
    ]
    assert rows[("claims", "worker resumes per run (2-date backfill)")] == [
        "1.0", "-", "n/a", "date 1 0; date 2 2 (check_inputs 2)"
    ]
    assert rows[("claims", "API-server calls per run (2-date backfill)")] == [
        "75", "-", "n/a", "date 1 100 (0 reads of a run's state); date 2 50 (2 reads of a run's state)"
    ]
    asked = f"asked 32 s, answered Approve after {perf.APPROVAL_HOLD_S} s"
    assert rows[("approval", "worker seconds while a person decides")] == ["2.0", "<= 0", "MISS", asked]
    assert rows[("approval", "VM-seconds held while a person decides")] == ["2.0", "<= 0", "MISS", asked]
    assert any(figure == "cost" for figure, _ in rows)
    assert f"seeds run skipped: {perf.SEEDS} does not exist (yet)" in text

    page = tmp_path / "performance.md"
    suite = "## The test suite\n\nWritten by the full run of `./scripts/test`.\n"
    page.write_text(f"# Performance\n\nold figures\n\n{suite}")
    monkeypatch.setattr(perf, "PERFORMANCE_DOC", page)
    perf.write_doc(text, took_min=42.0)
    written = page.read_text()
    assert f"```text\n{text}\n```" in written
    assert "the bench took 42 min" in written
    assert "old figures" not in written
    assert written.endswith(suite)


def test_a_runs_api_calls_and_resumes_are_read_from_the_api_servers_access_log(tmp_path):
    """Requests naming the run or one of its task instances' tries; a try's starts after its first are resumes."""
    import sqlite3

    import run_probe

    check, train, old_try = "0199aaaa-0000-7000-8000-00000000000a", "0199bbbb-0000-7000-8000-00000000000b", "0199cccc-0000-7000-8000-00000000000c"
    db = sqlite3.connect(":memory:")
    db.executescript(
        """
        CREATE TABLE dag_run (dag_id, run_id, state, queued_at, start_date, end_date, logical_date);
        CREATE TABLE task_instance (id, dag_id, run_id, task_id, state, try_number, start_date, end_date);
        CREATE TABLE task_instance_history (task_instance_id, dag_id, run_id, task_id);
        CREATE TABLE xcom (dag_id, run_id, task_id, key, value);
        """
    )
    db.execute("INSERT INTO dag_run VALUES ('d', 'r', 'success', NULL, '2026-12-01T00:00:00', '2026-12-01T00:05:00', "
               "'2026-12-01T00:00:00')")
    for ti, task in ((check, "check_inputs"), (train, "train")):  # the DB writes a UUID as 32 hex digits
        db.execute("INSERT INTO task_instance VALUES (?, 'd', 'r', ?, 'success', 1, NULL, NULL)", (ti.replace("-", ""), task))
    db.execute("INSERT INTO task_instance_history VALUES (?, 'd', 'r', 'train')", (old_try.replace("-", ""),))
    log = tmp_path / "logs" / "api-server.log"
    log.parent.mkdir()
    requests = [  # (the client's port, the path), in order
        (1, f"/execution/task-instances/{check}/run"), (1, "/execution/variables/deployment_id"),
        (1, "/execution/dag-runs/d/other/state"),  # its look at the run it follows
        (1, f"/execution/task-instances/{check}/state"),  # deferred
        (2, f"/execution/task-instances/{check}/run"), (2, f"/execution/task-instances/{check}/heartbeat"),  # resumed
        (3, f"/execution/task-instances/{old_try}/run"), (4, f"/execution/task-instances/{train}/run"),  # a retry
        (4, "/execution/xcoms/d/r/check_inputs/return_value"),
        (5, "/execution/dag-runs/d/r/state"),  # a client that named no try: counted by the run it names
        (6, "/execution/task-instances/0199dddd-0000-7000-8000-00000000000d/run"),  # another run's task
        (6, "/execution/variables/deployment_id"), (6, "/execution/dag-runs/d/r/state"),  # its look at this run
        (1, "/api/v2/dags/d/dagRuns"),  # the connection naming nothing: the try it named last's
    ]
    log.write_text("".join(
        f"2026-12-07T17:44:01.{i:06d}Z [info     ] request finished               [http.access] client_addr=127.0.0.1:"
        f"4000{port} duration_us=15883 loc=http_access_log.py:130 method=GET path={path} query= status_code=200\n"
        for i, (port, path) in enumerate(requests)
    ))
    record = run_probe.RunRecord("d", "r")
    run_probe._finish(db, record, run_probe.api_requests(type("Airflow", (), {"home": tmp_path})))
    assert (record.api_calls, record.state_reads, record.resumes) == (11, 2, {"check_inputs": 1})


def test_the_policy_runs_dags_share_one_line_and_ask_before_publishing(perf, tmp_path, monkeypatch):
    """The backfill's SFT (daily) and the GRPO run that holds the place: one TPU VM between them; the LoRA twin asks."""
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    monkeypatch.setenv("TPU_POSTTRAIN_LOCAL_DIR", str(tmp_path / "local"))
    perf.write_policy_dags(tmp_path / "dags")
    configs = {config.dag_id: config for config in load_registry(tmp_path / "dags" / "models.yaml", local=True)}
    assert sorted(configs) == sorted([perf.OURS, perf.GRPO, perf.LORA])
    sft, grpo = configs[perf.OURS], configs[perf.GRPO]
    assert (sft.schedule, sft.max_tpu_vms, grpo.max_tpu_vms) == ("@daily", 1, 1)
    assert (sft.zones, sft.accelerator_type, sft.reservation) == (grpo.zones, grpo.accelerator_type, grpo.reservation)
    assert (configs[perf.LORA].approval, configs[perf.LORA].approvers) == (True, ("bench",))  # who the bench speaks as
    assert (tmp_path / "dags" / "local_dags.py").read_text() == (REPO / "dags" / "local_dags.py").read_text()
