"""The TPU VM requested just in time: on a conversion-cache miss, not before the conversion is nearly done.

The create of a split-layout run waits, deferred, until the conversion is expected to end within the TPU VM's
ready time (its create, boot and restore); a run whose conversion is cached requests it at once. What is
expected comes from earlier runs' measurements (``recipes/timings.py``), kept in the Airflow Variable
``airflow_tpu_posttrain.timings``:

- a Variable, not the checkpoint storage beside the conversion cache: the decision is taken in a worker, which
  reads a Variable through the Task SDK in milliseconds, while the storage is reached only from the VMs (a worker
  would need a storage client, and its credentials, for one small read). Every DAG and run of the deployment sees
  it; measurements are of the deployment's own VMs and network, and a deployment that never measured requests
  at once, as before. A conversion another deployment put in the shared storage is still reused: the wait also
  ends as soon as the conversion task ends.
- written read-modify-write by the tasks that measure (a conversion, an install); two runs writing at once may
  lose one measurement, which only leaves the next decision on the others.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import ConversionFailedError, InvalidInputError
from airflow_tpu_posttrain.recipes import timings
from airflow_tpu_posttrain.recipes.create_phases import Phase
from airflow_tpu_posttrain.recipes.validation import SpecError
from airflow_tpu_posttrain.triggers.conversion import FAILED

if TYPE_CHECKING:
    from collections.abc import Callable

    from airflow.sdk import Context

    from airflow_tpu_posttrain.recipes import compute

TIMINGS_VARIABLE = "airflow_tpu_posttrain.timings"


def load_timings() -> dict[str, Any]:
    from airflow.sdk import Variable

    return Variable.get(TIMINGS_VARIABLE, default=None, deserialize_json=True) or {}


def update_timings(change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    from airflow.sdk import Variable

    Variable.set(
        TIMINGS_VARIABLE,
        change(load_timings()),
        description="Measured conversion and TPU VM ready times: when a run requests its TPU VM (airflow-tpu-posttrain)",
        serialize_json=True,
    )


def run_elapsed_s(context: Context) -> float:
    """Seconds since the DAG run started."""
    started = context["dag_run"].start_date
    return max(0.0, time.time() - started.timestamp()) if started else 0.0


def record_conversion(
    context: Context, model: str, revision: str | None, maxtext_version: str, machine_type: str | None, ran: bool
) -> None:
    """After a conversion task: its output is in storage, and if it ran (not reused), how long the run took to it."""

    def change(record: dict[str, Any]) -> dict[str, Any]:
        if revision:
            record = timings.with_converted(record, model, revision, maxtext_version)
        if ran and machine_type:
            record = timings.with_conversion(record, model, machine_type, run_elapsed_s(context))
        return record

    update_timings(change)


def record_ready(vm: dict[str, Any]) -> None:
    """After a fresh install: how long the VM took from its request (``requested_at``) to this moment."""
    requested_at, machine_type = vm.get("requested_at"), vm.get("machine_type")
    if requested_at and machine_type:
        update_timings(lambda record: timings.with_ready(record, machine_type, time.time() - requested_at))


class JustInTimeMixin:
    """The create's wait for the conversion (``conversion_task_id``): the moment its VM is requested."""

    def _conversion_schedule(self, context: Context, spec: compute.TpuVmSpec) -> tuple[float, float | None, str]:
        """``(delay s, conversion's expected end as Unix time or None, why)`` for this run's TPU VM request."""
        from airflow_tpu_posttrain.recipes.accelerators import accelerator
        from airflow_tpu_posttrain.recipes.models import model_profile

        inputs = self.inputs if isinstance(self.inputs, dict) else {}
        model = inputs.get("model")
        if not model:
            return 0.0, None, "the run's inputs name no model"
        record = load_timings()
        revision = (inputs.get("revisions") or {}).get(f"model:{model_profile(model).hf_source}")
        if timings.is_converted(record, model, revision, inputs.get("maxtext_version")):
            return 0.0, None, f"{model} at {revision} is converted already (cached)"
        try:
            machine_type = accelerator(self.conversion_accelerator_type).machine_type
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        conversion_end = timings.expected_conversion_end(record, model, machine_type)
        if conversion_end is None:
            return 0.0, None, f"no conversion of {model} on {machine_type} measured yet"
        elapsed = run_elapsed_s(context)
        ready = timings.expected_ready(record, spec.machine_type)
        delay = timings.request_delay(conversion_end, ready, elapsed)
        why = f"conversion expected to end in {max(0, conversion_end - elapsed):.0f} s, the VM ready in {ready:.0f} s"
        return delay, time.time() + conversion_end - elapsed, why

    def _wait_for_conversion(self, context: Context, spec: compute.TpuVmSpec) -> None:
        """Return when the VM is to be requested now; else defer until then, or until the conversion ends."""
        from airflow_tpu_posttrain.triggers.conversion import ConversionScheduleTrigger

        delay, ends_at, why = self._conversion_schedule(context, spec)
        if delay <= 0:
            conversion_state = self._conversion_state(context)
            if conversion_state in FAILED:
                self._conversion_waited(context, {"status": "failed", "conversion_state": conversion_state})
            self._log_request(context, why)
            return
        self.log.info("TPU VM to be requested in %.0f s: %s", delay, why)
        dag_run = context["dag_run"]
        self.defer(
            trigger=ConversionScheduleTrigger(
                dag_id=dag_run.dag_id,
                run_id=dag_run.run_id,
                task_id=self.conversion_task_id,
                request_at=time.time() + delay,
                conversion_ends_at=ends_at,
                poll_interval=self.poll_interval,
                state={"phase": Phase.CONVERSION.value},
            ),
            method_name="execute_complete",
        )

    def _conversion_state(self, context: Context) -> str | None:
        """The conversion task's state now (a retry may find it failed already)."""
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        dag_run = context["dag_run"]
        states = RuntimeTaskInstance.get_task_states(
            dag_id=dag_run.dag_id, task_ids=[self.conversion_task_id], run_ids=[dag_run.run_id]
        )
        return (states.get(dag_run.run_id) or {}).get(self.conversion_task_id)

    def _log_request(self, context: Context, why: str) -> None:
        self.log.info("TPU VM requested at t+%.0f s: %s", run_elapsed_s(context), why)

    def _conversion_waited(self, context: Context, event: dict[str, Any]) -> None:
        """The wait ended: log why the VM is requested now; a failed conversion fails the create.

        Failed, not skipped: an earlier try of this create may have made the VM (and lost it from its record:
        a worker lost after the insert), and only a create that did not skip lets the teardown run and delete it."""
        if event["status"] == "failed":
            raise ConversionFailedError(
                f"The conversion ({self.conversion_task_id}) ended {event.get('conversion_state')}: this try "
                "requested no TPU VM; the teardown deletes any an earlier try made"
            )
        if event["status"] == "converted":
            self._log_request(context, f"the conversion ({self.conversion_task_id}) has ended")
            return
        ends_in = max(0.0, (event.get("conversion_ends_at") or time.time()) - time.time())
        self._log_request(context, f"conversion expected to end in {ends_in:.0f} s")
