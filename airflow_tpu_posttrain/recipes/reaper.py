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


def _decide_leftover(
    resource: dict, owner: str | None, what: str, owner_exists: bool | None, now: datetime, grace_s: int
) -> Decision:
    """A resource of ours that only serves ``owner`` goes once the owner is gone and the grace period has passed.

    ``owner_exists`` is False when the owner is gone; None: the lookup failed. The resource must be older than the
    grace period (a create makes it just before its owner)."""
    if owner is None:
        return Decision(False, "not ours (no managed-by description)")
    if owner_exists is None:
        return Decision(False, f"could not look up its {what} {owner}")
    if owner_exists:
        return Decision(False, f"its {what} {owner} exists")
    if _age_s(resource, now) < grace_s:
        return Decision(False, f"younger than the {grace_s} s grace period")
    return Decision(True, f"its {what} {owner} is gone")


def decide_firewall(rule: dict, instance_exists: bool | None, now: datetime, grace_s: int) -> Decision:
    """An SSH rule of ours goes once its instance is gone in every zone and the grace period has passed."""
    return _decide_leftover(rule, firewall_instance(rule), "instance", instance_exists, now, grace_s)


def group_as_instance(group: dict, template: dict | None) -> dict | None:
    """A slice's group as the reaper judges a VM: its template's labels and metadata, the group's age.

    A group has no labels of its own (v1 ``InstanceGroupManager``); every VM it makes carries its template's, so
    a group waiting for capacity with no VM yet is judged on exactly what its VMs would be. None: not ours, or its
    template (and so its run) cannot be read."""
    if not (group.get("description") or "").startswith(f"{MANAGED_BY}:") or template is None:
        return None
    properties = template.get("properties") or {}
    return {
        "name": group["name"],
        "labels": properties.get("labels") or {},
        "metadata": properties.get("metadata") or {},
        "creationTimestamp": group["creationTimestamp"],
    }


def slice_part_group(resource: dict) -> str | None:
    """The group a slice's instance template or workload policy serves; None when it is not ours.

    Both are named as their group (``recipes/slices.py``)."""
    return resource["name"] if (resource.get("description") or "").startswith(f"{MANAGED_BY}:") else None


def decide_slice_part(resource: dict, group_exists: bool | None, now: datetime, grace_s: int) -> Decision:
    """A slice's template or policy of ours goes once its group is gone in every zone and the grace passed."""
    return _decide_leftover(resource, slice_part_group(resource), "group", group_exists, now, grace_s)
