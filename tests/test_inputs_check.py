"""A run whose inputs equal those of the last published model is skipped (operators/inputs_check.py).

Real Airflow (dag.test, its Variables) with the Hub's revisions stood in for by an environment variable."""

from __future__ import annotations

from datetime import UTC, datetime

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
