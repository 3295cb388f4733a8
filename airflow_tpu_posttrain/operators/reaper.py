"""The reaper: deletes TPU VMs of this provider whose DAG run is over or whose expiry has passed."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.operators.tpu_vm import _as_list, _ComputeOperator
from airflow_tpu_posttrain.recipes import reaper

if TYPE_CHECKING:
    from airflow.sdk import Context


class TpuVmReaperOperator(_ComputeOperator):
    """
    List the instances labelled ``managed-by=airflow-tpu-posttrain`` in ``zones`` and delete those whose expiry
    label has passed or whose DAG run is no longer queued or running (looked up through Airflow's API), after a
    grace period. Instances without the label are never touched. One log line per decision; XCom: counts.

    :param zones: zones to sweep (a list, or a comma-separated string).
    :param grace_period_s: an instance younger than this, or expired by less than this, is kept.
    :param dry_run: log the decisions, delete nothing.
    """

    template_fields: Sequence[str] = ("project_id", "zones", "api_endpoint", "dry_run")
    ui_color = "#f0e4d5"

    def __init__(
        self, *, zones: Sequence[str] | str, grace_period_s: int = 900, dry_run: bool = False, **kwargs: Any
    ):
        super().__init__(**kwargs)
        self.zones = zones
        self.grace_period_s = grace_period_s
        self.dry_run = dry_run

    def _run_state(self, context: Context, instance: dict) -> str | None:
        dag_id, run_id = reaper.run_of(instance)
        if not dag_id or not run_id:
            return None
        try:
            return str(context["ti"].get_dagrun_state(dag_id=dag_id, run_id=run_id))
        except Exception as err:  # the API answers "not found" as an error: the run or its DAG is gone
            self.log.info("No DAG run %s / %s (%s)", dag_id, run_id, err)
            return None

    def execute(self, context: Context) -> dict:
        now = datetime.now(timezone.utc)
        counts = {"seen": 0, "deleted": 0, "kept": 0, "dry_run": self.dry_run}
        for zone in _as_list(self.zones):
            for instance in self.hook.list_instances(self.project, zone, reaper.LABEL_FILTER):
                counts["seen"] += 1
                decision = reaper.decide(
                    instance, self._run_state(context, instance), now, self.grace_period_s
                )
                name = instance["name"]
                if not decision.delete:
                    counts["kept"] += 1
                    self.log.info("keep   %s in %s: %s", name, zone, decision.reason)
                    continue
                if self.dry_run:
                    self.log.info("WOULD delete %s in %s: %s (dry run)", name, zone, decision.reason)
                    continue
                self.log.warning("delete %s in %s: %s", name, zone, decision.reason)
                self.hook.delete_instance(self.project, zone, name, str(uuid.uuid4()))
                counts["deleted"] += 1
        self.log.info("Reaper: %s", counts)
        return counts
