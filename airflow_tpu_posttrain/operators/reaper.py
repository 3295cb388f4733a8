"""The reaper: deletes TPU VMs of this provider whose DAG run is over or whose expiry has passed.

It also deletes SSH firewall rules whose VM is gone."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.operators.compute_base import ComputeOperator, deployment_id
from airflow_tpu_posttrain.recipes import compute, cost, reaper

if TYPE_CHECKING:
    from airflow.sdk import Context


def _status_code(err: Exception) -> int | None:
    """The HTTP status of Airflow's answer.

    A task sees the Execution API's error as an ``AirflowRuntimeError`` from its supervisor, or (in-process,
    as under ``dag.test()``) as the client's ``ServerResponseError``."""
    from airflow.sdk.api.client import ServerResponseError
    from airflow.sdk.exceptions import AirflowRuntimeError

    if isinstance(err, ServerResponseError):
        return err.response.status_code
    if isinstance(err, AirflowRuntimeError) and isinstance(err.error.detail, dict):
        return err.error.detail.get("status_code")
    return None


class TpuVmReaperOperator(ComputeOperator):
    """List the project's instances labelled ``managed-by=airflow-tpu-posttrain``; delete stale ones.

    Every zone is swept (``instances.aggregatedList``): a run's zones are a Param, not the registry's.

    Stale: the expiry label has passed, or Airflow's API says the DAG run is over or absent, after a grace
    period; a run state that cannot be read keeps the VM (until it expires), and so does another deployment's
    VM (``[tpu_posttrain] deployment_id``). Then delete the project's SSH
    firewall rules made by this provider whose instance is gone from every zone. Nothing without our label or
    description is touched. One log line per decision; XCom: counts.

    :param grace_period_s: an instance younger than this, or expired by less than this, is kept.
    :param dry_run: log the decisions, delete nothing.
    :param prices: USD per hour by machine type and provisioning model, for the log line that says what each
        deleted orphan had cost; None: ``recipes.cost.DEFAULT_PRICES``.
    """

    template_fields: Sequence[str] = (
        "project_id",
        "api_endpoint",
        "dry_run",
        *ComputeOperator.connection_template_fields,
    )
    ui_color = "#f0e4d5"

    def __init__(
        self,
        *,
        grace_period_s: int = 900,
        dry_run: bool = False,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.grace_period_s = grace_period_s
        self.dry_run = dry_run
        self.prices = prices

    def _run_state(self, context: Context, instance: dict) -> str | None:
        """The run's state; ``reaper.RUN_ABSENT`` when Airflow answers 404; None when it cannot be read."""
        dag_id, run_id = reaper.run_of(instance)
        if not dag_id or not run_id:
            return None
        try:
            state = context["ti"].get_dagrun_state(dag_id=dag_id, run_id=run_id)
            # A worker's task SDK answers its own DagRunState, a str Enum whose str() is "DagRunState.RUNNING".
            return str(getattr(state, "value", state))
        except Exception as err:  # noqa: BLE001 - any failure but a 404 leaves the state unknown, never "gone"
            if _status_code(err) == 404:
                self.log.info("No DAG run %s / %s (Airflow answered 404)", dag_id, run_id)
                return reaper.RUN_ABSENT
            self.log.warning("Cannot read the state of DAG run %s / %s: %s", dag_id, run_id, err)
            return None

    def _instance_exists(self, name: str) -> bool | None:
        from google.api_core.exceptions import GoogleAPICallError

        try:
            return bool(self.hook.find_instances(self.project, name))
        except GoogleAPICallError as err:
            self.log.warning("Cannot look up instance %s: %s", name, err)
            return None

    def execute(self, context: Context) -> dict:
        now = datetime.now(UTC)
        counts = {"seen": 0, "deleted": 0, "kept": 0, "firewalls_deleted": 0, "dry_run": self.dry_run}
        deployment = deployment_id()
        for zone, instance in self.hook.list_project_instances(self.project, reaper.LABEL_FILTER):
            counts["seen"] += 1
            ours = reaper.of_deployment(instance, deployment)
            run_state = self._run_state(context, instance) if ours else None
            decision = reaper.decide(instance, run_state, now, self.grace_period_s, deployment)
            name = instance["name"]
            if not decision.delete:
                counts["kept"] += 1
                self.log.info("keep   %s in %s: %s", name, zone, decision.reason)
                continue
            if self.dry_run:
                self.log.info("WOULD delete %s in %s: %s (dry run)", name, zone, decision.reason)
                continue
            spent = cost.vm_cost(name, instance, now.isoformat(), self.prices)
            self.log.warning(
                "delete %s in %s: %s; cost so far: %s", name, zone, decision.reason, spent.describe()
            )
            self.hook.delete_instance(self.project, zone, name, str(uuid.uuid4()))
            counts["deleted"] += 1
        for rule in self.hook.list_firewalls(self.project):
            instance = compute.firewall_instance(rule)
            if instance is None:
                continue
            decision = reaper.decide_firewall(rule, self._instance_exists(instance), now, self.grace_period_s)
            if not decision.delete:
                self.log.info("keep   firewall %s: %s", rule["name"], decision.reason)
            elif self.dry_run:
                self.log.info("WOULD delete firewall %s: %s (dry run)", rule["name"], decision.reason)
            else:
                self.log.warning("delete firewall %s: %s", rule["name"], decision.reason)
                self.hook.delete_firewall(self.project, rule["name"], str(uuid.uuid4()))
                counts["firewalls_deleted"] += 1
        self.log.info("Reaper: %s", counts)
        return counts
