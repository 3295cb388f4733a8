"""What each answer to ``approve_publish`` does (operators/approval.py), as Airflow hands the answer back.

The whole exchange through Airflow's REST API is tests/test_approval.py; these are the answers it does not give."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from airflow_tpu_posttrain.exceptions import PublishRejectedError

KEPT = "gs://bkt/airflow-tpu-posttrain/exports/run-1"


def _approval(on_reject: str):
    from airflow_tpu_posttrain.operators.approval import PublishApprovalOperator

    return PublishApprovalOperator(
        task_id="approve_publish", approvers=["Ada"], export={"kept_uri": KEPT}, on_reject=on_reject,
        response_timeout=timedelta(hours=2),
    )


class _Ti(SimpleNamespace):
    def xcom_push(self, key, value):
        self.pushed[key] = value


def _context(approval) -> dict:
    ti = _Ti(dag_id="posttrain_sft__x", run_id="manual__1", task_id="approve_publish", map_index=-1, pushed={})
    return {"ti": ti, "task_instance": ti, "task": approval, "run_id": ti.run_id,
            "dag_run": SimpleNamespace(dag_id=ti.dag_id)}


def _answer(option: str, by: dict | None) -> dict:
    """The event Airflow resumes the task with: a person's answer, or the timeout's default (by no one)."""
    return {
        "chosen_options": [option], "params_input": {}, "responded_at": datetime.now(UTC),
        "responded_by_user": by, "timedout": by is None,
    }


def test_no_answer_in_time_is_a_reject_that_fails_the_run_when_the_entry_says_fail(capfd):
    approval = _approval("fail")
    context = _context(approval)
    with pytest.raises(PublishRejectedError, match=rf"no answer within 2:00:00 .*kept at {KEPT}"):
        approval.execute_complete(context, _answer("Reject", None))
    assert context["ti"].pushed["answer"]["answer"] == "no answer" and context["ti"].pushed["answer"]["by"] is None
    assert "Notice (timed_out): Not published: nobody answered for posttrain_sft__x, run manual__1" in "".join(
        capfd.readouterr()
    )


def test_a_person_who_rejects_is_named_and_the_export_kept():
    approval = _approval("fail")
    context = _context(approval)
    with pytest.raises(PublishRejectedError, match=rf"Not published: rejected by Ada\. The checked export is kept at {KEPT}"):
        approval.execute_complete(context, _answer("Reject", {"id": "Ada", "name": "Ada"}))
    assert context["ti"].pushed["answer"] | {"at": None} == {
        "approved": False, "answer": "Reject", "by": "Ada", "at": None, "kept_export": KEPT
    }


def test_an_approval_says_who_approved():
    approval = _approval("fail")
    answer = approval.execute_complete(_context(approval), _answer("Approve", {"id": "Ada", "name": "Ada"}))
    assert answer | {"at": None} == {"approved": True, "answer": "Approve", "by": "Ada", "at": None, "kept_export": KEPT}


def test_an_approval_without_approvers_is_refused_before_asking():
    from airflow_tpu_posttrain.exceptions import InvalidInputError
    from airflow_tpu_posttrain.operators.approval import PublishApprovalOperator

    approval = PublishApprovalOperator(task_id="approve_publish", approvers=[], export={"kept_uri": KEPT})
    with pytest.raises(InvalidInputError, match="approvers=\\[\\]: is empty"):
        approval.execute(_context(approval))
