"""The TPU VM create as a state machine.

The phase it waits in, and what it does next when that wait ends. Pure: the create's trigger
(``triggers/create.py``) does the API calls, in the triggerer; the tests walk every transition.

A create of a run that converts may first wait in ``CONVERSION`` for the moment its VM is to be requested
(``operators/just_in_time.py``), in a trigger of its own. It then starts by looking for the instance of an earlier try (``WAIT`` for a live one, ``REPLACE`` a dead one)
or by inserting (``CREATE``), possibly after ``CAPACITY`` (in line for a place under ``max_tpu_vms``, or a fully
used reservation). Once RUNNING it waits in ``READY`` for the VM's host keys and sshd.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from airflow_tpu_posttrain.recipes.compute import ErrorKind


class Phase(StrEnum):
    CONVERSION = "conversion"  # nothing requested yet: waiting until the conversion is expected to end soon
    WAIT = "wait"  # an earlier try's live instance: waiting for it to be RUNNING
    REPLACE = "replace"  # deleting an instance that cannot be used (TERMINATED, or left by a stock-out)
    CAPACITY = "capacity"  # in line for a place under max_tpu_vms, or waiting on a fully used reservation
    CREATE = "create"  # the insert's operations, then RUNNING
    READY = "ready"  # RUNNING: waiting for its host keys and its sshd


class Action(StrEnum):
    START = "start"  # request the VM now: find an earlier try's instance, else insert
    # The conversion failed before this try requested the VM: create nothing, and fail rather than skip, so the
    # teardown (never run when its setup is skipped) deletes whatever an earlier try of the create made.
    FAIL_CONVERSION = "fail: the conversion failed"
    INSERT = "insert"  # take a place in the current zone's line (waiting in it), then insert
    AWAIT_LOGIN = "await login"  # RUNNING: wait until its host keys are published and its sshd answers
    DONE = "done"  # logged in: record the VM
    NEXT_ZONE = "next zone"  # a stock-out: delete what the zone left behind, insert in the next zone
    WAIT_FOR_RESERVATION = "wait for reservation"  # the reservation is fully used: wait, then insert again
    FAIL_NO_CAPACITY = "fail: no capacity in time"
    FAIL_NO_ZONE_LEFT = "fail: every zone out of capacity"
    FAIL_INVALID_INPUT = "fail: invalid input"  # the network cannot serve the VM: refused before any create
    FAIL_FOREIGN = "fail: another deployment's instance"  # of this run's name: neither used nor deleted
    FAIL_ACCESS = "fail: OS Login refused the key"  # before anything is created
    FAIL_ZONE_UNSOLD = "fail: zone does not sell the machine type"
    FAIL_NO_IMAGE = "fail: no such image"
    FAIL_NOT_READY = "fail: not ready"
    FAIL_QUOTA = "fail: quota"
    FAIL_RESERVATION = "fail: reservation"
    FAIL = "fail"


RUNNING_PHASES = frozenset({Phase.WAIT, Phase.CREATE})
"""Phases whose success means our instance is RUNNING."""

DELETES_FIRST = frozenset(
    {
        Action.WAIT_FOR_RESERVATION,
        Action.FAIL_NOT_READY,
        Action.FAIL_QUOTA,
        Action.FAIL_RESERVATION,
        Action.FAIL,
        Action.FAIL_NO_ZONE_LEFT,
        Action.FAIL_ZONE_UNSOLD,
        Action.FAIL_NO_IMAGE,
    }
)
"""Actions that first delete whatever the failed attempt left (the instance, its firewall rule): a teardown does
not run when its setup failed, so the create cleans up after itself."""


def next_action(phase: Phase, status: str, error_kind: str | None = None) -> Action:
    """What follows when the wait in ``phase`` ended with ``status``.

    ``status`` is a trigger's (``success``, ``ready``, ``available``, ``timeout``, ``error``, or the conversion
    wait's ``due``, ``converted`` and ``failed``);
    ``error_kind`` is the kind of its errors (``compute.ErrorKind``)."""
    if phase is Phase.CONVERSION:
        return Action.FAIL_CONVERSION if status == "failed" else Action.START
    if phase is Phase.CAPACITY:
        return Action.INSERT if status == "available" else Action.FAIL_NO_CAPACITY
    if status == "ready" and phase is Phase.READY:
        return Action.DONE
    if status == "success" and phase is Phase.REPLACE:
        return Action.INSERT
    if status == "success" and phase in RUNNING_PHASES:
        return Action.AWAIT_LOGIN
    if phase is Phase.READY:
        return Action.FAIL_NOT_READY
    if phase is Phase.CREATE and error_kind == ErrorKind.CAPACITY:
        return Action.NEXT_ZONE
    if phase is Phase.CREATE and error_kind == ErrorKind.RESERVATION_FULL:
        return Action.WAIT_FOR_RESERVATION
    if error_kind == ErrorKind.QUOTA:
        return Action.FAIL_QUOTA
    if error_kind == ErrorKind.RESERVATION:
        return Action.FAIL_RESERVATION
    return Action.FAIL


class Progress(NamedTuple):
    """Where a create stands in its trigger (``triggers/create.py``), from one phase to the next."""

    zone_index: int = 0
    stockouts: tuple[str, ...] = ()
    attempt: int = 0  # a new insert requestId after each replacement
    deadline: float | None = None  # Unix time the wait on a fully used reservation ends
    without_max_run_duration: bool = False  # Compute refused scheduling.maxRunDuration for this model
