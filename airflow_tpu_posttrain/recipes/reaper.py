"""Which of our TPU VMs the reaper deletes, and why: a pure decision per instance.

The in-DAG teardown cannot cover a user marking a run failed, a scheduler or worker crash, or a deleted DAG;
the reaper does, on a short schedule. It only ever considers instances labelled ``managed-by`` by this
provider (and SSH firewall rules whose description names one), and deletes only on positive evidence: Airflow
answered that the run is over or does not exist, or the instance's expiry has passed. A run state it could not
read (the API down, an error) keeps the VM: deleting on doubt would kill a live run's training. Only the VMs of
its own deployment are asked about: another deployment's run is unknown to this Airflow (a 404) or, worse, is
one of its own runs with the same id; those VMs go on their expiry only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from airflow_tpu_posttrain.recipes.compute import DEPLOYMENT_LABEL, MANAGED_BY, firewall_instance

LABEL_FILTER = f"labels.managed-by = {MANAGED_BY}"
ACTIVE_RUN_STATES = frozenset({"queued", "running"})
RUN_ABSENT = "absent"
"""The run state when Airflow answered that the run (or its DAG) does not exist."""


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


def _age_s(resource: dict, now: datetime) -> float:
    return (now - datetime.fromisoformat(resource["creationTimestamp"])).total_seconds()


def of_deployment(instance: dict, deployment: str) -> bool:
    """Whether the instance was made by the Airflow deployment ``deployment`` (its runs are this Airflow's)."""
    return (instance.get("labels") or {}).get(DEPLOYMENT_LABEL) == deployment


def decide(instance: dict, run_state: str | None, now: datetime, grace_s: int, deployment: str) -> Decision:
    """``run_state``: the DAG run's state, ``RUN_ABSENT`` or None.

    ``RUN_ABSENT`` when Airflow answered that the run does not exist; None when it could not be read (or was
    not asked: another deployment's VM)."""
    labels = instance.get("labels", {})
    if labels.get("managed-by") != MANAGED_BY:
        return Decision(False, "not ours (no managed-by label)")
    expires_at = labels.get("expires-at", "")
    if expires_at.isdigit() and now.timestamp() > int(expires_at) + grace_s:
        return Decision(True, f"expired at {expires_at} (+{grace_s} s grace)")
    if not of_deployment(instance, deployment):
        return Decision(
            False,
            f"made by Airflow deployment {labels.get(DEPLOYMENT_LABEL)!r}, not this one ({deployment!r}): "
            f"its runs are not this Airflow's; kept until it expires at {expires_at}",
        )
    if run_state in ACTIVE_RUN_STATES:
        return Decision(False, f"its DAG run is {run_state}")
    if run_state is None:
        return Decision(
            False, f"its DAG run's state could not be read; kept until it expires at {expires_at}"
        )
    if _age_s(instance, now) < grace_s:
        return Decision(False, f"younger than the {grace_s} s grace period")
    if run_state == RUN_ABSENT:
        return Decision(True, "its DAG run no longer exists")
    return Decision(True, f"its DAG run is {run_state}")


def decide_firewall(rule: dict, instance_exists: bool | None, now: datetime, grace_s: int) -> Decision:
    """An SSH rule of ours goes once its instance is gone in every zone and the grace period has passed.

    ``instance_exists`` is False when the instance is gone; None: the lookup failed. The rule must be older
    than the grace period (a create makes the rule just before the VM)."""
    instance = firewall_instance(rule)
    if instance is None:
        return Decision(False, "not ours (no managed-by description)")
    if instance_exists is None:
        return Decision(False, f"could not look up its instance {instance}")
    if instance_exists:
        return Decision(False, f"its instance {instance} exists")
    if _age_s(rule, now) < grace_s:
        return Decision(False, f"younger than the {grace_s} s grace period")
    return Decision(True, f"its instance {instance} is gone")
