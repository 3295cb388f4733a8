"""A run whose inputs equal those of the last published model is skipped (operators/inputs_check.py).

Real Airflow (dag.test, its Variables) with the Hub's revisions stood in for by an environment variable."""

from __future__ import annotations

import os
import threading
import time
from datetime import UTC, datetime

import pytest
from conftest import log_excerpt

BODY = """
import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator, record_published


class Check(InputsCheckOperator):
    def _check_access(self, repos):  # tests/test_hub_access.py checks it against the local Hub
        pass

    def _revisions(self, repos, as_of):
        return {f"{kind}:{repo}": os.environ["HUB_REVISION"] for repo, kind in repos}


with DAG("inputs_probe", schedule=None, start_date=datetime(2026, 1, 1), render_template_as_native_obj=True,
         params={"force": False, "steps": None, "hub_repo_id": "me/tiny"}) as dag:
    check = Check(task_id="check_inputs", model="tiny-llama", recipe="sft", force="{{ params.force }}",
                  settings={"steps": "{{ params.steps }}", "hub_repo_id": "{{ params.hub_repo_id }}"})

    @task(task_id="export_and_publish")
    def publish(inputs, **context):
        record_published(context, inputs)  # what the export does after it published

    publish(check.output)
"""


def _runner(airflow_db, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models import Variable

    from airflow_tpu_posttrain.operators.inputs_check import published_inputs_variable

    path = airflow_db / "dags" / "inputs_probe.py"
    path.write_text(BODY)
    Variable.delete(published_inputs_variable("inputs_probe"))  # nothing published yet

    def run(revision: str, logical_date: datetime | None, **conf) -> dict[str, str]:
        monkeypatch.setenv("HUB_REVISION", revision)
        bag = DagBag(dag_folder=str(path))  # parsed per run, as a worker does (dag.test keeps a run's conf)
        assert not bag.import_errors, bag.import_errors
        dag_run = bag.get_dag("inputs_probe").test(run_conf=conf or None, logical_date=logical_date)
        return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}

    return run


TRAINED = {"check_inputs": "success", "export_and_publish": "success"}
SKIPPED = {"check_inputs": "skipped", "export_and_publish": "skipped"}


def test_only_changed_or_forced_inputs_train(airflow_db, monkeypatch):
    dates = iter(datetime(2026, 5, day, tzinfo=UTC) for day in range(1, 28))  # each run after the one before
    run = _runner(airflow_db, monkeypatch)

    assert run("aaa", next(dates)) == TRAINED  # nothing published yet
    assert run("aaa", next(dates)) == SKIPPED
    assert run("aaa", next(dates), force=True) == TRAINED
    assert run("bbb", next(dates)) == TRAINED  # a new revision
    assert run("bbb", next(dates), steps=7) == TRAINED  # other settings
    # Several published runs before it: compared with the newest (steps=7), not with a list of them all.
    assert run("bbb", next(dates), steps=7) == SKIPPED
    assert run("bbb", next(dates)) == TRAINED
    # A new publish target holds nothing of this model yet.
    assert run("bbb", next(dates), hub_repo_id="me/tiny-v2") == TRAINED


def test_compared_with_the_model_published_last_whatever_the_runs_dates(airflow_db, monkeypatch):
    """Runs on a change and REST triggers have no logical date; a backfill has an older one."""
    run = _runner(airflow_db, monkeypatch)
    assert run("aaa", datetime(2026, 6, 10, tzinfo=UTC)) == TRAINED
    assert run("bbb", None) == TRAINED  # triggered on a change: published bbb, the newest model
    assert run("bbb", datetime(2026, 6, 1, tzinfo=UTC)) == SKIPPED  # a backfill of an earlier date: bbb is out
    assert run("aaa", None) == TRAINED  # the newest published is bbb, whatever the dated aaa run
    assert run("aaa", None) == SKIPPED


# The cloud side of the check: the buckets and the reservation a run names, against the Compute emulator and the
# local GCS server (its bucket "ours"), through the default Google connection the emulator fixture makes.
CLOUD_BODY = """
import os
from datetime import datetime

from airflow.sdk import DAG

from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator


class Check(InputsCheckOperator):
    def _check_access(self, repos):  # the Hub's side is not this DAG's subject
        pass

    def _revisions(self, repos, as_of):
        return {f"{kind}:{repo}": "aaa" for repo, kind in repos}


with DAG("cloud_probe", schedule=None, start_date=datetime(2026, 1, 1), render_template_as_native_obj=True,
         params={"zones": ["us-east5-b"], "reservation": None, "accelerator_type": "v6e-8", "storage_uri": None}):
    Check(task_id="check_inputs", model="tiny-llama", recipe="sft", force=True, zones="{{ params.zones }}",
          reservation="{{ params.reservation }}", accelerator_type="{{ params.accelerator_type }}",
          checkpoint_storage=os.environ["PROBE_CHECKPOINT_STORAGE"], storage_uri="{{ params.storage_uri }}")
"""

PASSING = [
    pytest.param("gs://ours/checkpoints", {}, id="all-there"),
    pytest.param("/var/lib/checkpoints", {"storage_uri": "/srv/models"}, id="local-paths-not-looked-up"),
    pytest.param("gs://ours/checkpoints", {"reservation": "v6e-reserved"}, id="reservation-there"),
    pytest.param(
        "gs://ours/checkpoints", {"reservation": "projects/owner-project/reservations/shared-v6e"},
        id="shared-reservation-there",
    ),
]
REFUSED = [
    pytest.param(
        "gs://nobodys-bucket/checkpoints", {}, "checkpoint_storage: the bucket gs://nobodys-bucket does not exist",
        id="checkpoint bucket missing",
    ),
    pytest.param(
        "gs://ours/checkpoints", {"storage_uri": "gs://gone/models"}, "storage_uri: the bucket gs://gone does not exist",
        id="export bucket missing",
    ),
    pytest.param(
        "gs://ours/checkpoints", {"reservation": "misspelt"},
        "reservation: the reservation misspelt of project test-project in zone us-east5-b does not exist",
        id="reservation missing",
    ),
    pytest.param(
        "gs://ours/checkpoints",
        {"zones": ["us-east5-a", "us-east5-b"], "reservation": "us-east5-a=v6e-reserved,us-east5-b=v6e-elsewhere"},
        "reservation: the reservation v6e-elsewhere of project test-project in zone us-east5-b does not exist",
        id="one zone's reservation missing",
    ),
    pytest.param(
        "gs://ours/checkpoints", {"reservation": "v5e-reserved"},
        "reservation: the reservation v5e-reserved of project test-project in zone us-east5-b reserves "
        "ct5lp-hightpu-8t, and accelerator_type v6e-8 runs on ct6e-standard-8t",
        id="reservation of another machine type",
    ),
]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    from airflow_tpu_posttrain.local.gcs_server import GcsServer

    with GcsServer(tmp_path_factory.mktemp("gcs") / "objects", buckets=("ours",)) as server:
        yield server


@pytest.fixture
def check_cloud(emulator, gcs, run_dag, monkeypatch, capfd):
    """Runs the probe DAG's check with ``checkpoint_storage`` and the run's ``conf``: (its state, its logs).

    The emulator holds reservations of v6e (ct6e-standard-8t) in both zones, of v5e in one, and one that
    another project shares; the GCS server the bucket "ours". Nothing may be created either way."""
    from airflow_tpu_posttrain.local.gcs_server import client_environment

    emulator.add_reservation("v6e-reserved", "us-east5-a", 1, machine_type="ct6e-standard-8t")
    emulator.add_reservation("v6e-reserved", "us-east5-b", 1, machine_type="ct6e-standard-8t")
    emulator.add_reservation("v5e-reserved", "us-east5-b", 1, machine_type="ct5lp-hightpu-8t")
    emulator.add_reservation("shared-v6e", "us-east5-b", 1, machine_type="ct6e-standard-8t", project="owner-project")
    for name, value in client_environment(gcs.url).items():
        monkeypatch.setenv(name, value)

    def check(checkpoint_storage: str, conf: dict) -> tuple[str, str]:
        monkeypatch.setenv("PROBE_CHECKPOINT_STORAGE", checkpoint_storage)
        dag_run = run_dag("cloud_probe", CLOUD_BODY, conf=conf)
        logs = "".join(capfd.readouterr())
        assert not [r for r in emulator.requests if r["method"] == "POST"]  # no VM, no rule, nothing made
        return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}["check_inputs"], logs

    return check


@pytest.mark.parametrize(("checkpoint_storage", "conf"), PASSING)
def test_the_buckets_and_reservation_that_are_there_pass_the_check(checkpoint_storage, conf, check_cloud):
    state, logs = check_cloud(checkpoint_storage, conf)
    assert state == "success", logs


@pytest.mark.parametrize(("checkpoint_storage", "conf", "refusal"), REFUSED)
def test_a_missing_bucket_or_reservation_fails_the_check_before_any_vm(
    checkpoint_storage, conf, refusal, check_cloud, fault_matrix, request
):
    """A first run names a bucket or a reservation that is not there: it fails in the check, before any VM.

    The error names the field and the fix, and nothing is created."""
    state, logs = check_cloud(checkpoint_storage, conf)
    assert state == "failed" and refusal in logs and "CloudResourceError" in logs, logs
    assert "Fix: " in logs and "No VM was created." in logs
    fault_matrix.record(
        f"first run: {request.node.callspec.id} -> check_inputs fails", None, state, None, log_excerpt(logs, refusal, 100)
    )


# ------------------------------------------------------------------------- inputs as of the run's date

DATED_BODY = """
from datetime import datetime

from airflow.sdk import DAG

from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator

with DAG("dated_probe", schedule=None, start_date=datetime(2025, 1, 1), render_template_as_native_obj=True,
         params={"inputs_as_of": "run_date"}):
    InputsCheckOperator(task_id="check_inputs", model="tiny-llama", recipe="sft", hf_conn_id="hf_dated",
                        inputs_as_of="{{ params.inputs_as_of }}")
"""


def test_the_inputs_are_the_hubs_revisions_at_the_runs_date(airflow_db, tmp_path, monkeypatch, capfd):
    """The local Hub's dated commits, read as ``HfApi.list_repo_commits`` reads the Hub's.

    A run of a date trains the base model and the dataset as they were then; ``latest`` trains them as they are; a date before the
    model existed fails the check, naming the field."""
    import json

    from airflow.dag_processing.dagbag import DagBag
    from airflow.models import Variable

    from airflow_tpu_posttrain.local.hub_server import HubServer
    from airflow_tpu_posttrain.operators.inputs_check import published_inputs_variable
    from airflow_tpu_posttrain.recipes.models import TINY_CHATS_REPO, TINY_LLAMA_REPO

    Variable.delete(published_inputs_variable("dated_probe"))
    files = tmp_path / "files"
    files.mkdir()
    with HubServer(tmp_path / "hub", tokens=["tok"]) as hub:
        monkeypatch.setenv(
            "AIRFLOW_CONN_HF_DATED", json.dumps({"conn_type": "generic", "host": hub.url, "password": "tok"})
        )
        shas = []
        for version, day in ((1, 1), (2, 10)):
            (files / "config.json").write_text(json.dumps({"version": version}))
            shas.append(hub.store.seed_repo(TINY_LLAMA_REPO, files, date=datetime(2026, 1, day, 12, tzinfo=UTC)))
        chats = hub.datasets.seed_repo(TINY_CHATS_REPO, files, date=datetime(2026, 1, 1, 6, tzinfo=UTC))
        path = airflow_db / "dags" / "dated_probe.py"
        path.write_text(DATED_BODY)

        def revisions(day: datetime, **conf) -> dict | str:
            dag = DagBag(dag_folder=str(path)).get_dag("dated_probe")  # parsed per run: dag.test keeps a conf
            dag_run = dag.test(logical_date=day, run_conf=conf or None)
            [ti] = dag_run.get_task_instances()
            return ti.xcom_pull(task_ids="check_inputs")["revisions"] if ti.state == "success" else ti.state

        assert revisions(datetime(2026, 1, 5, tzinfo=UTC)) == {
            f"model:{TINY_LLAMA_REPO}": shas[0], f"dataset:{TINY_CHATS_REPO}": chats
        }
        assert revisions(datetime(2026, 1, 12, tzinfo=UTC))[f"model:{TINY_LLAMA_REPO}"] == shas[1]
        latest = revisions(datetime(2026, 1, 5, tzinfo=UTC), inputs_as_of="latest")
        assert latest[f"model:{TINY_LLAMA_REPO}"] == shas[1]
        capfd.readouterr()
        assert revisions(datetime(2025, 12, 31, tzinfo=UTC)) == "failed"
    logs = "".join(capfd.readouterr())
    assert f"inputs_as_of: the model {TINY_LLAMA_REPO} has no commit on or before 2025-12-31T00:00:00+00:00" in logs
    assert "trigger with inputs_as_of=latest" in logs


# ------------------------------------------------------------------------- one training per distinct input

CLAIM_BODY = """
import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_tpu_posttrain.operators.inputs_check import InputsCheckOperator


class Check(InputsCheckOperator):
    def _check_access(self, repos):
        pass

    def _revisions(self, repos, as_of):
        return {f"{kind}:{repo}": "aaa" for repo, kind in repos}


with DAG("claim_probe", schedule=None, start_date=datetime(2026, 1, 1), render_template_as_native_obj=True,
         params={"force": False}):
    check = Check(task_id="check_inputs", model="tiny-llama", recipe="sft", force="{{ params.force }}",
                  checkpoint_storage=os.environ["PROBE_CHECKPOINT_STORAGE"], poll_interval=0.2)

    @task(task_id="train")
    def train(inputs):
        return inputs

    train(check.output)
"""


@pytest.fixture
def claim_runs(airflow_db, emulator, gcs, run_dag, monkeypatch, capfd):
    """Runs of the claim probe (``run_id``, ``conf``): (the check's state, its XComs, the logs).

    With checkpoint storage of this test alone, and a follower that looks at its leader's run every 2 s."""
    import hashlib

    from airflow.models import Variable

    from airflow_tpu_posttrain.local.gcs_server import client_environment
    from airflow_tpu_posttrain.operators.inputs_check import published_inputs_variable
    from airflow_tpu_posttrain.recipes import trainings

    for name, value in client_environment(gcs.url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PROBE_CHECKPOINT_STORAGE", f"gs://ours/{hashlib.sha256(os.urandom(8)).hexdigest()[:10]}")
    monkeypatch.setattr(trainings, "RECHECK_S", 2)  # the follower looks at its leader's run every 2 s
    Variable.delete(published_inputs_variable("claim_probe"))

    def run(run_id: str, logical_date: datetime | None = None, **conf) -> tuple[str, dict, str]:
        dag_run = run_dag("claim_probe", CLAIM_BODY, run_id=run_id, conf=conf or None, logical_date=logical_date)
        [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == "check_inputs"]
        pulled = {key: ti.xcom_pull(task_ids="check_inputs", key=key) for key in ("training_claim", "reused_model")}
        return ti.state, pulled, "".join(capfd.readouterr())

    return run


def _set_run_state(dag_id: str, run_id: str, state: str) -> None:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).update({"state": state})


def _task_state(dag_id: str, run_id: str, task_id: str) -> str | None:
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        ti = session.query(TaskInstance).filter_by(dag_id=dag_id, run_id=run_id, task_id=task_id).one_or_none()
        return str(ti.state.value if hasattr(ti.state, "value") else ti.state) if ti is not None else None


def _once_following(run_id: str, action) -> threading.Thread:
    """A thread doing ``action`` (what the leader does next) once ``run_id``'s check waits (deferred) for its leader.

    A bounded poll (300 s): past it the action is done anyway, so the run ends and the test's asserts name what the
    follower did instead of waiting."""
    def act_once_followed() -> None:
        deadline = time.monotonic() + 300
        while _task_state("claim_probe", run_id, "check_inputs") != "deferred" and time.monotonic() < deadline:
            time.sleep(0.2)
        action()

    thread = threading.Thread(target=act_once_followed)
    thread.start()
    return thread


def test_a_run_follows_the_run_training_its_inputs_then_reuses_its_model(claim_runs, gcs):
    """Two runs with the same inputs at once: the second waits (deferred) for the first's model, then reuses it."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
    from airflow_tpu_posttrain.recipes import trainings

    run = claim_runs
    state, pulled, logs = run("manual__leader")  # its check took the claim; the run is in flight again below
    assert state == "success", logs
    uri = pulled["training_claim"]
    records = StoredRecordHook()
    assert records.read(uri)["run_id"] == "manual__leader"
    model = {"hub": {"url": "http://hub/local/tiny-llama-sft/tree/run-x"}}

    def publish() -> None:  # what the leader's export does
        records.change(uri, lambda claim: trainings.published(claim, "manual__leader", "now", model))

    _set_run_state("claim_probe", "manual__leader", "running")
    publisher = _once_following("manual__follower", publish)
    state, pulled, logs = run("manual__follower")
    publisher.join()
    assert "Inputs equal those run manual__leader is training now" in logs, logs
    assert state == "skipped", logs
    assert pulled["reused_model"] == {"run_id": "manual__leader", **model}
    assert "Inputs equal those run manual__leader trained and published: this run's model is that one" in logs
    assert "http://hub/local/tiny-llama-sft/tree/run-x" in logs


def test_a_run_takes_over_inputs_whose_run_ended_without_publishing(claim_runs):
    """The run that held the inputs failed (its claim still says training): the follower trains them itself."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook

    run = claim_runs
    state, pulled, logs = run("manual__doomed")
    assert state == "success", logs
    _set_run_state("claim_probe", "manual__doomed", "running")
    failing = _once_following("manual__next", lambda: _set_run_state("claim_probe", "manual__doomed", "failed"))
    state, pulled, logs = run("manual__next")
    failing.join()
    assert state == "success", logs
    assert "following it, deferred and holding no VM" in logs
    assert "Run manual__doomed, which held these inputs, ended without a model: this run trains them" in logs
    assert StoredRecordHook().read(pulled["training_claim"])["run_id"] == "manual__next"
    # Forced, a run trains inputs another holds, leaving the claim to its holder.
    _set_run_state("claim_probe", "manual__next", "running")
    state, _, logs = run("manual__forced", force=True)
    assert state == "success" and "Training anyway (force), though run manual__next holds these inputs" in logs


def test_a_claims_states_decide_what_a_run_does():
    """Published: reused. Refused: trains nothing (force trains). Training: followed, taken over once its run is over.

    Of runs asking at once, whichever asks first trains (no wait on the others' dates)."""
    from airflow_tpu_posttrain.recipes import trainings

    rules = {"force": False, "ended_owner": None}
    held, first = trainings.decide({}, "run_2", "t0", **rules)
    assert first.action == trainings.TRAIN and held == {"state": "training", "run_id": "run_2", "since": "t0"}
    assert trainings.decide(held, "run_1", "t1", **rules)[1].action == trainings.FOLLOW
    taken, decision = trainings.decide(held, "run_1", "t2", force=False, ended_owner="run_2")
    assert (decision.action, decision.took_over_from, taken["run_id"]) == (trainings.TRAIN, "run_2", "run_1")
    refused, changed = trainings.refused(held, "run_2", "t3", "quality gate: loss 6.3 → 6.4")
    assert changed and refused["state"] == "refused" and refused["reason"] == "quality gate: loss 6.3 → 6.4"
    assert trainings.decide(refused, "run_3", "t4", **rules)[1].action == trainings.REFUSE
    assert trainings.decide(refused, "run_3", "t4", force=True, ended_owner=None)[1].action == trainings.TRAIN
    published = trainings.published(refused, "run_4", "t5", {"hub": {}})[0]
    assert trainings.refused(published, "run_5", "t6", "rejected") == (published, False)  # a model exists


def test_a_run_with_inputs_whose_model_was_refused_trains_nothing(claim_runs):
    """The quality gate (or a person) refused the model of these inputs: later runs train nothing.

    A later run, and a run following the refused one, is skipped naming that run and the reason; force trains."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
    from airflow_tpu_posttrain.recipes import trainings

    run = claim_runs
    state, pulled, logs = run("manual__refused")
    assert state == "success", logs
    uri, records = pulled["training_claim"], StoredRecordHook()
    reason = "quality gate: SFT eval loss 6.30 → 6.40: FAILED"

    def refuse() -> None:  # what the owner's quality gate does once it failed
        records.change(uri, lambda claim: trainings.refused(claim, "manual__refused", "2026-12-07T10:00:00", reason))

    _set_run_state("claim_probe", "manual__refused", "running")
    refuser = _once_following("manual__follower", refuse)
    state, pulled, logs = run("manual__follower")
    refuser.join()
    assert "Inputs equal those run manual__refused is training now" in logs, logs
    expected = (
        f"Inputs equal those of run manual__refused, whose model was refused ({reason}; at 2026-12-07T10:00:00): "
        "nothing to train, no one asked, no VM created."
    )
    assert state == "skipped" and expected in logs, logs
    _set_run_state("claim_probe", "manual__refused", "success")
    state, _, logs = run("manual__later")
    assert state == "skipped" and expected in logs, logs
    state, _, logs = run("manual__forced", force=True)
    assert state == "success" and "Training anyway (force), though run manual__refused had refused these" in logs
    assert records.read(uri)["state"] == "refused"  # a forced run leaves the claim as it is until its own outcome


def test_an_unreadable_owner_state_is_followed_not_taken_over(claim_runs, monkeypatch):
    """The API server answers 503 when the follower reads its owner's state: no second training.

    The follower asks again, and reuses the owner's model once published. A run no longer in Airflow (404) is
    taken over."""
    import httpx
    from airflow.sdk.api.client import DagRunOperations, ServerResponseError

    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
    from airflow_tpu_posttrain.recipes import trainings

    run = claim_runs
    state, pulled, logs = run("manual__owner")
    assert state == "success", logs
    uri, records = pulled["training_claim"], StoredRecordHook()
    answered = DagRunOperations.get_state
    outages = []

    def unavailable(self, dag_id, run_id):
        if run_id == "manual__owner" and len(outages) < 2:
            outages.append(run_id)
            request = httpx.Request("GET", f"http://api/execution/dag-runs/{dag_id}/{run_id}/state")
            response = httpx.Response(503, json={"detail": "database unavailable"}, request=request)
            raise ServerResponseError.from_response(response)
        return answered(self, dag_id, run_id)

    monkeypatch.setattr(DagRunOperations, "get_state", unavailable)
    model = {"hub": {"url": "http://hub/local/tiny-llama-sft/tree/run-owner"}}

    def publish_after_the_outages() -> None:
        deadline = time.monotonic() + 300
        while len(outages) < 2:
            assert time.monotonic() < deadline, "the follower never read its owner's state twice"
            time.sleep(0.2)
        records.change(uri, lambda claim: trainings.published(claim, "manual__owner", "now", model))

    _set_run_state("claim_probe", "manual__owner", "running")
    publisher = threading.Thread(target=publish_after_the_outages)
    publisher.start()
    state, pulled, logs = run("manual__follower")
    publisher.join()
    assert outages == ["manual__owner"] * 2
    assert "Could not read the state of run manual__owner, which holds these inputs" in logs, logs
    assert "ended without a model" not in logs and state == "skipped", logs
    assert pulled["reused_model"] == {"run_id": "manual__owner", **model}
    # A claim whose run is gone from Airflow (deleted): provably over, taken over.
    records.change(uri, lambda claim: ({"state": "training", "run_id": "manual__deleted", "since": "t"}, None))
    state, pulled, logs = run("manual__heir")
    assert state == "success", logs
    assert "Run manual__deleted, which holds these inputs, is not in Airflow" in logs
    assert records.read(uri)["run_id"] == "manual__heir"
