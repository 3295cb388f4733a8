"""Errors a DAG author may catch or see in a task's log, each saying what happened to which VM."""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException, AirflowFailException


class VmNotReadyError(AirflowException):
    """The VM turned RUNNING but could not be logged into in time (no host keys published, SSH port closed).
    Retryable: the create deleted the VM, and a retry makes a new one."""


class VmHostKeyMismatchError(AirflowFailException):
    """The machine at the VM's address is not the VM: its host key is not one the VM published. Not retried."""


class CapacityTimeoutError(AirflowFailException):
    """No place under the TPU cap (or in a fully used reservation) came free within ``max_wait_for_capacity``;
    nothing was created."""


class VmLostError(AirflowException):
    """The step's VM is gone: Compute lists it TERMINATED, STOPPING, STOPPED or SUSPENDED (a preemption, a host
    error), or not at all; not merely an SSH error. Training recovers from it (see ``operators/recovery.py``)
    up to ``max_recoveries`` times; other steps fail with it and the teardown deletes what is left."""
