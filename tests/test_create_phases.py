"""The TPU VM create's phases: every transition of the pure state machine the create operator follows."""

from __future__ import annotations

import itertools

import pytest

from airflow_tpu_posttrain.recipes.compute import ErrorKind
from airflow_tpu_posttrain.recipes.create_phases import DELETES_FIRST, Action, Phase, next_action

KINDS = (ErrorKind.CAPACITY, ErrorKind.QUOTA, ErrorKind.RESERVATION, ErrorKind.RESERVATION_FULL, ErrorKind.OTHER)


@pytest.mark.parametrize(
    ("phase", "status", "kind", "action"),
    [
        # Waiting for the conversion: due or ended, the VM is requested; failed, nothing is created (and the
        # create fails, so its teardown runs).
        (Phase.CONVERSION, "due", None, Action.START),
        (Phase.CONVERSION, "converted", None, Action.START),
        (Phase.CONVERSION, "failed", None, Action.FAIL_CONVERSION),
        # In line for a place: taken, or the wait is over with nothing created.
        (Phase.CAPACITY, "available", None, Action.INSERT),
        (Phase.CAPACITY, "timeout", None, Action.FAIL_NO_CAPACITY),
        # An unusable instance deleted: insert again (after taking a place in line).
        (Phase.REPLACE, "success", None, Action.INSERT),
        # RUNNING: log in (its place was taken before the insert).
        (Phase.CREATE, "success", None, Action.AWAIT_LOGIN),
        (Phase.WAIT, "success", None, Action.AWAIT_LOGIN),
        (Phase.READY, "ready", None, Action.DONE),
        (Phase.READY, "error", ErrorKind.OTHER, Action.FAIL_NOT_READY),
        # The insert failed: a stock-out moves on, a full reservation waits, the rest fail with their fix.
        (Phase.CREATE, "error", ErrorKind.CAPACITY, Action.NEXT_ZONE),
        (Phase.CREATE, "error", ErrorKind.RESERVATION_FULL, Action.WAIT_FOR_RESERVATION),
        (Phase.CREATE, "error", ErrorKind.QUOTA, Action.FAIL_QUOTA),
        (Phase.CREATE, "error", ErrorKind.RESERVATION, Action.FAIL_RESERVATION),
        (Phase.CREATE, "error", ErrorKind.OTHER, Action.FAIL),
        # An earlier try's instance that dies while we wait for it is not a stock-out of a new insert.
        (Phase.WAIT, "error", ErrorKind.CAPACITY, Action.FAIL),
        (Phase.REPLACE, "error", ErrorKind.OTHER, Action.FAIL),
    ],
)
def test_transitions(phase, status, kind, action):
    assert next_action(phase, status, kind) is action


def test_only_failures_after_an_insert_clean_up_first():
    """What continues the create never deletes its instance; every failure with an instance does."""
    assert {Action.INSERT, Action.AWAIT_LOGIN, Action.DONE} & DELETES_FIRST == set()
    # Nothing was created while waiting for capacity, so that failure deletes nothing.
    assert Action.FAIL_NO_CAPACITY not in DELETES_FIRST
    for phase, kind in itertools.product((Phase.CREATE, Phase.WAIT, Phase.READY), KINDS):
        action = next_action(phase, "error", kind)
        assert action in DELETES_FIRST or action is Action.NEXT_ZONE, (phase, kind, action)


def test_failures_before_anything_is_made_delete_nothing():
    """A network refused, or an instance of another deployment under this run's name: nothing of ours to delete."""
    assert {Action.FAIL_INVALID_INPUT, Action.FAIL_FOREIGN} & DELETES_FIRST == set()
    # The insert refused at once (no such machine type in the zone, no such image) or every zone stocked out:
    # the SSH firewall rule made just before is deleted.
    assert {Action.FAIL_ZONE_UNSOLD, Action.FAIL_NO_IMAGE, Action.FAIL_NO_ZONE_LEFT} <= DELETES_FIRST
