"""The worker running a step dies right after starting its job (SIGKILL, lost node): the job keeps running on
the VM, and the next try re-attaches to it instead of starting a second one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest


class FakeTaskInstance:
    """What the operator uses of a task instance: its id and XCom push."""

    def __init__(self) -> None:
        self.id = "ti-1"
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def context():
    dag_run = SimpleNamespace(dag_id="reattach_dag", run_id="manual__reattach", logical_date=None)
    return {"dag_run": dag_run, "ti": FakeTaskInstance()}


def step(stack, operator_class, task_id):
    from airflow_tpu_posttrain.pipelines.registry import local_settings

    settings = local_settings(str(stack.local_dir), str(stack.vm_dir), stack.python312)
    return operator_class(
        task_id=task_id, model="tiny-llama", ssh_conn_id="local_vm", vm_task_id=None,
        remote_host="127.0.0.1", accelerator_type="cpu", poll_interval=1, **settings,
    )


async def until_done(trigger):
    async for event in trigger.run():
        return event


def test_next_try_reattaches_to_the_running_job(stack, capfd):
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_tpu_posttrain.operators.maxtext import MaxTextConvertOperator, MaxTextInstallOperator

    # The VM's venv and launchers. The install is already there: its job ends within the task's inline wait, so
    # the task finishes without deferring (no second trip through a worker).
    installed = step(stack, MaxTextInstallOperator, "install_maxtext").execute(context())
    assert installed["maxtext_version"] == "0.2.5"
    assert "Reusing the MaxText environment" in "".join(capfd.readouterr())

    first_try = step(stack, MaxTextConvertOperator, "convert_to_maxtext")
    with pytest.raises(TaskDeferred):
        first_try.execute(context())  # the job starts; then this worker is gone

    second_try = step(stack, MaxTextConvertOperator, "convert_to_maxtext")
    with pytest.raises(TaskDeferred) as deferred:
        second_try.execute(context())
    assert "Re-attaching to job" in "".join(capfd.readouterr())
    jobs = sorted(p.name for p in (stack.vm_dir / "work" / "jobs").iterdir() if p.name.startswith("convert"))
    assert jobs == [f"{jobs[0]}", f"{jobs[0]}.sh", f"{jobs[0]}.step.sh"]  # one job, not a second conversion

    event = asyncio.run(until_done(deferred.value.trigger))
    assert event.payload["exit_code"] == 0, event.payload
    result = second_try.execute_complete(context(), event.payload)
    assert result["converted_params"].endswith("/mt-format/0/items") and result["reused"] is False
