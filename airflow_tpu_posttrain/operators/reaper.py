"""The reaper: deletes TPU VMs of this provider whose DAG run is over or whose expiry has passed.

It also deletes SSH firewall rules whose VM is gone. A VM of a multi-host slice goes with its whole group, and a
slice's template and workload policy once their group is gone. And it gives back places under the TPU cap whose VM
(or slice) is gone and whose run is over."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.operators.compute_base import ComputeOperator, deployment_id
from airflow_tpu_posttrain.recipes import compute, cost, reaper

if TYPE_CHECKING:
    from airflow.sdk import Context


def status_code(err: Exception) -> int | None:
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
    :param capacity_claims: the ``gs://`` locations of lines of places under the TPU cap whose stale places to give
        back (``recipes/places.py``: the VM's evidence rule, applied to a place whose VM is gone).
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
        capacity_claims: Sequence[str] = (),
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.grace_period_s = grace_period_s
        self.dry_run = dry_run
        self.prices = prices
        self.capacity_claims = capacity_claims

    def _run_state(self, context: Context, instance: dict) -> str | None:
        """The run's state; ``reaper.RUN_ABSENT`` when Airflow answers 404; None when it cannot be read."""
        dag_id, run_id = reaper.run_of(instance)
        return self._state_of_run(context, dag_id, run_id)

    def _state_of_run(self, context: Context, dag_id: str | None, run_id: str | None) -> str | None:
        if not dag_id or not run_id:
            return None
        try:
            state = context["ti"].get_dagrun_state(dag_id=dag_id, run_id=run_id)
            # A worker's task SDK answers its own DagRunState, a str Enum whose str() is "DagRunState.RUNNING".
            return str(getattr(state, "value", state))
        except Exception as err:  # noqa: BLE001 - any failure but a 404 leaves the state unknown, never "gone"
            if status_code(err) == 404:
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

    def _group_exists(self, name: str) -> bool | None:
        from google.api_core.exceptions import GoogleAPICallError

        try:
            return bool(self.hook.find_instance_groups(self.project, name))
        except GoogleAPICallError as err:
            self.log.warning("Cannot look up instance group %s: %s", name, err)
            return None

    def _sweep_groups(
        self, context: Context, now: datetime, counts: dict, deployment: str, judged: set[tuple[str, str]]
    ) -> None:
        """Delete our slice groups that have no VM (waiting for capacity, or every VM lost) by the VMs' rule.

        A group without VMs keeps trying to make its slice: when capacity comes it makes every VM, and it may hold
        the reservation the next run needs. It is judged as its VMs would be, on its template's labels and
        metadata (expiry, deployment, DAG run) and its own age."""
        templates = {template["name"]: template for template in self.hook.list_instance_templates(self.project)}
        for zone, group in self.hook.list_instance_groups(self.project):
            if (zone, group["name"]) in judged:
                continue
            template = templates.get((group.get("instanceTemplate") or "").rsplit("/", 1)[-1])
            as_instance = reaper.group_as_instance(group, template)
            if as_instance is None:
                if (group.get("description") or "").startswith(f"{compute.MANAGED_BY}:"):
                    self.log.info("keep   slice %s in %s: its template cannot be read", group["name"], zone)
                continue
            ours = reaper.of_deployment(as_instance, deployment)
            run_state = self._run_state(context, as_instance) if ours else None
            decision = reaper.decide(as_instance, run_state, now, self.grace_period_s, deployment)
            if not decision.delete:
                self.log.info("keep   slice %s in %s (no VM): %s", group["name"], zone, decision.reason)
            elif self.dry_run:
                self.log.info("WOULD delete slice %s in %s (no VM): %s (dry run)", group["name"], zone, decision.reason)
            else:
                self.log.warning("delete slice %s in %s (no VM): %s", group["name"], zone, decision.reason)
                self.hook.delete_instance_group(self.project, zone, group["name"], str(uuid.uuid4()))
                counts["slices_deleted"] += 1

    def _sweep_slice_parts(self, now: datetime, counts: dict) -> None:
        """Delete our slices' templates and workload policies whose group is gone (after the grace period)."""
        from google.api_core.exceptions import GoogleAPICallError

        parts = [(None, t) for t in self.hook.list_instance_templates(self.project)]
        parts += self.hook.list_workload_policies(self.project)
        for region, part in parts:
            group = reaper.slice_part_group(part)
            if group is None:
                continue
            kind = "workload policy" if region else "instance template"
            decision = reaper.decide_slice_part(part, self._group_exists(group), now, self.grace_period_s)
            if not decision.delete:
                self.log.info("keep   %s %s: %s", kind, part["name"], decision.reason)
            elif self.dry_run:
                self.log.info("WOULD delete %s %s: %s (dry run)", kind, part["name"], decision.reason)
            else:
                self.log.warning("delete %s %s: %s", kind, part["name"], decision.reason)
                try:
                    if region:
                        self.hook.delete_workload_policy(self.project, region, part["name"], str(uuid.uuid4()))
                    else:
                        self.hook.delete_instance_template(self.project, part["name"], str(uuid.uuid4()))
                except GoogleAPICallError as err:
                    if not compute.still_in_use([{"message": str(err)}]):
                        raise
                    # Compute still calls it in use a while after its group is gone: the next pass deletes it.
                    self.log.info("keep   %s %s: still in use (%s); asked again next pass", kind, part["name"], err)
                    continue
                counts["slice_parts_deleted"] += 1

    def _sweep_places(self, context: Context, now: datetime, counts: dict) -> None:
        """Give back the places whose VM (or slice) is gone and whose run is over: the VMs' evidence rule."""
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
        from airflow_tpu_posttrain.recipes import places

        hook = StoredRecordHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
        deployment = deployment_id()
        for location in self.capacity_claims:
            try:
                lines = hook.lines(location)
            except Exception as err:  # noqa: BLE001 - a location it cannot read keeps its places: doubt gives none back
                self.log.warning("Cannot list the lines of places in %s: %s", location, err)
                continue
            for uri in lines:
                held = hook.read(uri).get("holders") or {}
                exists = {claim: self._made(claim) for claim in held}
                states = {
                    entry.get("run", ""): self._state_of_run(context, *entry.get("run", "/").split("/", 1))
                    for entry in held.values()
                    if entry.get("deployment") == deployment
                }
                stale = places.stale_holders({"holders": held}, exists, states, now, self.grace_period_s, deployment)
                for claim, reason in stale.items():
                    if self.dry_run:
                        self.log.info("WOULD give back the place of %s in %s: %s (dry run)", claim, uri, reason)
                        continue
                    self.log.warning("give back the place of %s in %s: %s", claim, uri, reason)
                    hook.change(uri, lambda line, claim=claim: places.release(line, claim))
                    counts["places_given_back"] += 1

    def _made(self, claim: str) -> bool | None:
        """Whether the VM or the slice (its group) of a place exists; None when Compute could not say."""
        vm, group = self._instance_exists(claim), self._group_exists(claim)
        if vm or group:
            return True
        return None if vm is None or group is None else False

    def execute(self, context: Context) -> dict:
        now = datetime.now(UTC)
        counts = {
            "seen": 0, "deleted": 0, "kept": 0, "firewalls_deleted": 0, "slices_deleted": 0,
            "slice_parts_deleted": 0, "places_given_back": 0, "dry_run": self.dry_run,
        }
        deployment = deployment_id()
        groups: set[tuple[str, str]] = set()
        judged_groups: set[tuple[str, str]] = set()  # the groups of the VMs judged here: judged with them
        for zone, instance in self.hook.list_project_instances(self.project, reaper.LABEL_FILTER):
            counts["seen"] += 1
            if slice_group := compute.slice_group_of(instance):
                judged_groups.add((zone, slice_group))
            ours = reaper.of_deployment(instance, deployment)
            run_state = self._run_state(context, instance) if ours else None
            decision = reaper.decide(instance, run_state, now, self.grace_period_s, deployment)
            name = instance["name"]
            if not decision.delete:
                counts["kept"] += 1
                self.log.info("keep   %s in %s: %s", name, zone, decision.reason)
                continue
            group = compute.slice_group_of(instance)  # a VM of a slice goes with its whole group
            if self.dry_run:
                what = f"{name} with its slice {group}" if group else name
                self.log.info("WOULD delete %s in %s: %s (dry run)", what, zone, decision.reason)
                continue
            spent = cost.vm_cost(name, instance, now.isoformat(), self.prices)
            if group is None:
                self.hook.delete_instance(self.project, zone, name, str(uuid.uuid4()))
            elif (zone, group) not in groups:
                groups.add((zone, group))
                self.log.warning("delete slice %s in %s, every VM of it", group, zone)
                self.hook.delete_instance_group(self.project, zone, group, str(uuid.uuid4()))
                counts["slices_deleted"] += 1
            self.log.warning(
                "delete %s in %s: %s; cost so far: %s", name, zone, decision.reason, spent.describe()
            )
            counts["deleted"] += 1
        for rule in self.hook.list_firewalls(self.project):
            instance = compute.firewall_instance(rule)
            if instance is None:
                continue
            # A slice's rules are named for it: kept while its group (or a VM of that name) exists.
            decision = reaper.decide_firewall(rule, self._made(instance), now, self.grace_period_s)
            if not decision.delete:
                self.log.info("keep   firewall %s: %s", rule["name"], decision.reason)
            elif self.dry_run:
                self.log.info("WOULD delete firewall %s: %s (dry run)", rule["name"], decision.reason)
            else:
                self.log.warning("delete firewall %s: %s", rule["name"], decision.reason)
                self.hook.delete_firewall(self.project, rule["name"], str(uuid.uuid4()))
                counts["firewalls_deleted"] += 1
        self._sweep_groups(context, now, counts, deployment, judged_groups)
        self._sweep_slice_parts(now, counts)
        self._sweep_places(context, now, counts)
        self.log.info("Reaper: %s", counts)
        return counts
