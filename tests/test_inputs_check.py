"""A run whose inputs equal those of the last published model is skipped (operators/inputs_check.py).

Real Airflow (dag.test, its Variables) with the Hub's revisions stood in for by an environment variable."""

from __future__ import annotations

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

    def _revisions(self, repos):
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

    def _revisions(self, repos):
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
