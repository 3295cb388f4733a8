"""Errors a DAG author may catch or see in a task's log, each saying what happened to which VM."""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_tpu_posttrain.recipes.validation import SpecError


class InvalidInputError(AirflowFailException):
    """Bad input (a Param, an operator argument): the task fails at once, without retries.

    A retry would fail the same way. The error names the field and the fix; nothing was created."""

    @classmethod
    def of(cls, task_id: str, err: SpecError, outcome: str = "") -> InvalidInputError:
        """``outcome``: what the failure left, said after the fix (e.g. "No VM was created.")."""
        return cls(f"{task_id}: invalid input: {err}{'. ' + outcome if outcome else ''}")


class CapacityUnavailableError(AirflowException):
    """Every zone was out of capacity; nothing was left behind. Retryable: capacity comes and goes."""


class VmCreateError(AirflowException):
    """Creating the VM failed for a reason Compute gave (its operation's error); the VM was deleted."""


class VmDeleteError(AirflowException):
    """Deleting the VM failed; the reaper (and the VM's maxRunDuration) remain behind it."""


class RemoteJobError(AirflowException):
    """A MaxText step's job on the VM failed, died or was lost; a retry re-attaches or resumes."""


class StorageError(AirflowException):
    """Checkpoint storage could not be asked from the VM (unreachable, refused): retryable.

    Never taken for "not there", which would redo a finished step or fail a finished training."""


class CheckpointMissingError(AirflowException):
    """Training ended but its final checkpoint is not where it must be durable; a retry resumes."""


class ConversionFailedError(AirflowFailException):
    """The conversion the TPU VM's create waited for failed: no VM is requested, and no retry would convert it.

    The create fails rather than skips, so its teardown runs and deletes a VM an earlier try may have made."""


class StepFailedError(AirflowFailException):
    """Raised by the pipelines' watcher when a post-training step failed (teardowns do not fail a run)."""


class VmNotReadyError(AirflowException):
    """The VM turned RUNNING but could not be logged into in time (no host keys published, SSH port closed).

    Retryable: the create deleted the VM, and a retry makes a new one."""


class VmHostKeyMismatchError(AirflowFailException):
    """The machine at the VM's address is not the VM: its host key is not one the VM published. Not retried."""


class QuotaExceededError(AirflowFailException):
    """Compute refused the VM for a quota (e.g. TPU chips in the region); the VM was deleted.

    Not retried: it takes a quota increase or another region."""


class ReservationError(AirflowFailException):
    """The reservation to consume cannot serve the VM; the VM was deleted.

    The reservation is missing, of another machine type, in another zone or not shared with the project. Not
    retried: the reservation or the provisioning model must change."""


class VmAccessError(AirflowFailException):
    """Airflow's key could not be let into the VM (OS Login refused it). Not retried: it takes a grant in IAM."""


class CapacityTimeoutError(AirflowFailException):
    """No place under the TPU cap came free within ``max_wait_for_capacity``; nothing was created.

    The same for a place in a fully used reservation."""


class VmLostError(AirflowException):
    """The step's VM is gone: Compute lists it TERMINATED, STOPPING, STOPPED or SUSPENDED, or not at all.

    The cause is a preemption or a host error; not merely an SSH error. Training recovers from it (see
    ``operators/recovery.py``) up to ``max_recoveries`` times; other steps fail with it and the teardown
    deletes what is left."""


class QualityGateError(AirflowFailException):
    """The trained model did not pass the quality gate: nothing was published, and a retry would judge the same.

    The message gives the numbers and where the trained checkpoint stays."""


class HubAccessError(AirflowFailException):
    """The Hugging Face token cannot read a run's input: no retry helps, so nothing is created.

    A gated repo without a grant, a private or missing repo."""


class CloudResourceError(AirflowFailException):
    """A bucket or reservation the run names does not exist, or Airflow's Google connection may not read it.

    Found by the inputs check, before any VM: nothing is created, and no retry helps."""


class PublishRejectedError(AirflowFailException):
    """A person rejected publishing the model (or no one answered in time), and the run is to fail for it.

    Nothing was published; the message names where the checked export is kept."""
