"""Which of our TPU VMs the reaper deletes, and why: a pure decision per instance.

The in-DAG teardown cannot cover a user marking a run failed, a scheduler or worker crash, or a deleted DAG;
the reaper does, on a short schedule. It only ever considers instances labelled ``managed-by`` by this
provider, and it keeps an instance while its DAG run is queued or running and its expiry has not passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from airflow_tpu_posttrain.recipes.compute import MANAGED_BY

LABEL_FILTER = f"labels.managed-by = {MANAGED_BY}"
ACTIVE_RUN_STATES = frozenset({"queued", "running"})


@dataclass(frozen=True)
class Decision:
    delete: bool
    reason: str


def _metadata(instance: dict) -> dict[str, str]:
    return {item["key"]: item.get("value", "") for item in instance.get("metadata", {}).get("items", [])}


def run_of(instance: dict) -> tuple[str | None, str | None]:
    """The (dag_id, run_id) that created the instance, from its metadata."""
    metadata = _metadata(instance)
    return metadata.get("airflow-dag-id"), metadata.get("airflow-run-id")


def decide(instance: dict, run_state: str | None, now: datetime, grace_s: int) -> Decision:
    """``run_state``: the DAG run's state, or None when the run (or its DAG) no longer exists."""
    labels = instance.get("labels", {})
    if labels.get("managed-by") != MANAGED_BY:
        return Decision(False, "not ours (no managed-by label)")
    created = datetime.fromisoformat(instance["creationTimestamp"])
    age_s = (now - created).total_seconds()
    expires_at = labels.get("expires-at", "")
    if expires_at.isdigit() and now.timestamp() > int(expires_at) + grace_s:
        return Decision(True, f"expired at {expires_at} (+{grace_s} s grace)")
    if run_state in ACTIVE_RUN_STATES:
        return Decision(False, f"its DAG run is {run_state}")
    if age_s < grace_s:
        return Decision(False, f"younger than the {grace_s} s grace period")
    if run_state is None:
        return Decision(True, "its DAG run no longer exists")
    return Decision(True, f"its DAG run is {run_state}")
