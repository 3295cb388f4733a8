"""What each answer to ``approve_publish`` does (operators/approval.py), as Airflow hands the answer back.

The whole exchange through Airflow's REST API is tests/test_approval.py; these are the answers it does not give."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from airflow_tpu_posttrain.exceptions import PublishRejectedError

KEPT = "gs://bkt/airflow-tpu-posttrain/exports/run-1"


def _approval(on_reject: str):
    from airflow_tpu_posttrain.operators.approval import PublishApprovalOperator

    return PublishApprovalOperator(
        task_id="approve_publish", export={"kept_uri": KEPT}, on_reject=on_reject, response_timeout=timedelta(hours=2)
    )


def _answer(option: str, by: dict | None) -> dict:
    """The event Airflow resumes the task with: a person's answer, or the timeout's default (by no one)."""
    return {
        "chosen_options": [option], "params_input": {}, "responded_at": datetime.now(UTC),
        "responded_by_user": by, "timedout": by is None,
    }


def test_no_answer_in_time_is_a_reject_that_fails_the_run_when_the_entry_says_fail():
    with pytest.raises(PublishRejectedError, match=rf"no answer within 2:00:00 .*kept at {KEPT}"):
        _approval("fail").execute_complete({}, _answer("Reject", None))


def test_a_person_who_rejects_is_named_and_the_export_kept():
    with pytest.raises(PublishRejectedError, match=rf"Not published: rejected by Ada\. The checked export is kept at {KEPT}"):
        _approval("fail").execute_complete({}, _answer("Reject", {"id": "7", "name": "Ada"}))


def test_an_approval_says_who_approved():
    answer = _approval("fail").execute_complete({}, _answer("Approve", {"id": "7", "name": "Ada"}))
    assert answer == {"approved": True, "by": "Ada", "kept_export": KEPT}


def test_a_run_that_does_not_ask_is_approved_by_its_rule_at_once():
    from airflow_tpu_posttrain.exceptions import InvalidInputError

    approval = _approval("skip")
    approval.required = "False"  # the Param as a template renders it
    assert approval.execute({}) == {"approved": True, "by": "rule", "kept_export": KEPT}
    approval.required = "maybe"
    with pytest.raises(InvalidInputError, match="approval='maybe': is not true or false"):
        approval.execute({})
