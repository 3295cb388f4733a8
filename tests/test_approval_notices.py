"""Who may let a model out, and who is told a decision waits: the registry's ``approvers`` and ``approval_notify``."""

from __future__ import annotations

import sys
import types
from datetime import timedelta
from types import SimpleNamespace

import pytest

from airflow_tpu_posttrain.recipes import approval_notices

ENTRY = {"model": "gemma3-4b", "recipe": "sft", "checkpoint_storage": "gs://bkt/x", "approval": True}


def test_an_approval_names_its_approvers_and_channels_we_can_send_through():
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    with pytest.raises(ValueError, match=r"approvers=\(\): is empty, and approval: true needs someone to answer"):
        PipelineConfig(**ENTRY)
    with pytest.raises(ValueError, match=r"approval_notify\[0\]\.via='pager': is not a channel we send through"):
        PipelineConfig(**ENTRY, approvers=["alice"], approval_notify=[{"via": "pager"}])
    with pytest.raises(ValueError, match=r"approval_notify\[0\]\.to=\[\]: is empty"):
        PipelineConfig(**ENTRY, approvers=["alice"], approval_notify=[{"via": "smtp"}])
    # A provider that is not installed where Airflow runs is refused when the DAG file is parsed, naming it.
    with pytest.raises(ValueError, match=r"needs apache-airflow-providers-slack, which is not installed"):
        PipelineConfig(**ENTRY, approvers=["alice"], approval_notify=[{"via": "slack", "channel": "#ml"}])
    config = PipelineConfig(**ENTRY, approvers=["alice", "bob"])
    assert list(config.approvers) == ["alice", "bob"]


def test_a_wait_and_a_timeout_are_said_through_each_channel_with_the_tasks_link(monkeypatch, capfd):
    """The notices go to the provider's notifier (here a stand-in of SmtpNotifier) and to the log."""
    from airflow_tpu_posttrain.operators.approval import PublishApprovalOperator

    sent = []

    class SmtpNotifier:  # what apache-airflow-providers-smtp's takes
        def __init__(self, *, to, subject, html_content, smtp_conn_id="smtp_default"):
            self.message = {"to": to, "subject": subject, "html": html_content, "conn": smtp_conn_id}

        def __call__(self, context):
            sent.append(self.message)

    module = types.ModuleType("fake_smtp_notifications")
    module.SmtpNotifier = SmtpNotifier
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(
        approval_notices.PROVIDERS, "smtp", approval_notices.Provider(module.__name__, "SmtpNotifier", "a-package")
    )
    operator = PublishApprovalOperator(
        task_id="approve_publish", approvers=["alice"], response_timeout=timedelta(hours=2),
        verdict={"message": "SFT eval loss 6.30 → 6.10: passed"}, export={"kept_uri": "gs://b/exports/run"},
    )
    ti = SimpleNamespace(dag_id="posttrain_sft__x", run_id="manual__1", task_id="approve_publish", map_index=-1)
    context = {"ti": ti, "task_instance": ti, "task": operator, "run_id": "manual__1",
               "dag_run": SimpleNamespace(dag_id="posttrain_sft__x")}
    channel = approval_notices.Channel(via="smtp", to=["ml@example.com"], conn_id="smtp_ops")
    operator._tell(context, [channel], approval_notices.WAITING)
    operator._tell(context, [channel], approval_notices.TIMED_OUT)
    link = "/dags/posttrain_sft__x/runs/manual__1/tasks/approve_publish/required_actions"
    waiting, timed_out = sent
    assert waiting["to"] == ["ml@example.com"] and waiting["conn"] == "smtp_ops"
    assert waiting["subject"] == "Approve publishing the model of posttrain_sft__x, run manual__1?"
    assert link in waiting["html"] and "SFT eval loss 6.30 → 6.10: passed" in waiting["html"]
    assert timed_out["subject"] == "Not published: nobody answered for posttrain_sft__x, run manual__1"
    assert "within 2:00:00: nothing was published" in timed_out["html"] and "gs://b/exports/run" in timed_out["html"]
    assert "Notice (timed_out): Not published: nobody answered" in "".join(capfd.readouterr())
