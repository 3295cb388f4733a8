"""A run whose inputs equal those of the last published model is skipped (operators/inputs_check.py).

Real Airflow (dag.test, its XCom across runs) with the Hub's revisions stood in for by an environment variable."""

from __future__ import annotations

from datetime import UTC, datetime

BODY = """
import os
from datetime import datetime

from airflow.sdk import DAG, task

from airflow_tpu_posttrain.operators.inputs_check import PUBLISHED_INPUTS_KEY, InputsCheckOperator


class Check(InputsCheckOperator):
    def _check_access(self, repos):  # tests/test_hub_access.py checks it against the local Hub
        pass

    def _revisions(self, repos):
        return {f"{kind}:{repo}": os.environ["HUB_REVISION"] for repo, kind in repos}


with DAG("inputs_probe", schedule=None, start_date=datetime(2026, 1, 1), render_template_as_native_obj=True,
         params={"force": False, "steps": None}) as dag:
    check = Check(task_id="check_inputs", model="tiny-llama", recipe="sft", settings={"steps": "{{ params.steps }}"},
                  force="{{ params.force }}")

    @task(task_id="export_and_publish")
    def publish(inputs, **context):
        context["ti"].xcom_push(key=PUBLISHED_INPUTS_KEY, value=inputs)

    publish(check.output)
"""


def test_only_changed_or_forced_inputs_train(airflow_db, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    path = airflow_db / "dags" / "inputs_probe.py"
    path.write_text(BODY)
    dates = iter(datetime(2026, 5, day, tzinfo=UTC) for day in range(1, 28))  # each run after the one before

    def run(name: str, revision: str, **conf):
        monkeypatch.setenv("HUB_REVISION", revision)
        bag = DagBag(dag_folder=str(path))  # parsed per run, as a worker does (dag.test keeps a run's conf)
        assert not bag.import_errors, bag.import_errors
        dag_run = bag.get_dag("inputs_probe").test(run_conf=conf or None, logical_date=next(dates))
        return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}

    trained = {"check_inputs": "success", "export_and_publish": "success"}
    skipped = {"check_inputs": "skipped", "export_and_publish": "skipped"}
    assert run("first", "aaa") == trained  # nothing published yet
    assert run("same", "aaa") == skipped
    assert run("forced", "aaa", force=True) == trained
    assert run("new-revision", "bbb") == trained
    assert run("other-settings", "bbb", steps=7) == trained
    # Several published runs before it: compared with the newest (steps=7), not with a list of them all.
    assert run("same-as-newest", "bbb", steps=7) == skipped
    assert run("same-as-older", "bbb") == trained
