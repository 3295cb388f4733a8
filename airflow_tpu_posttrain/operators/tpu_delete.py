"""Delete a run's VM and its SSH firewall rule, from the triggerer: the pipelines' teardown."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import VmDeleteError
from airflow_tpu_posttrain.operators.compute_base import ComputeOperator, as_list, deployment_id
from airflow_tpu_posttrain.recipes import compute, cost

if TYPE_CHECKING:
    from airflow.sdk import Context


class TpuDeleteOperator(ComputeOperator):
    """Delete the TPU VM (or CPU VM) of this DAG run and its SSH firewall rule, from the triggerer.

    Built to be the teardown: the worker only works out what to delete and defers at once.

    It finds the VM from the create task's XCom (also the partial record a failed create leaves), in each of the
    create's zones (a recovery may have made it again in another), and, when there is no XCom, by its
    deterministic name in each of ``zones``. A VM that is already gone counts as
    success. Once it is gone, the place it held under the cap is given back (``recipes/places.py``). Returns (XCom) ``{"deleted": bool, "name", "zone", "firewall_deleted": bool}``, and for a VM it
    deleted what the VM cost: ``machine_type``, ``provisioning_model``, ``vm_seconds`` (creation to deletion,
    Compute's timestamps), ``usd_per_hour`` and ``cost_usd`` (None when ``prices`` has no price for it).

    :param create_task_id: the task id of the :class:`TpuVmCreateOperator` whose VM to delete.
    :param zones: where to look when there is no XCom (a list, or a comma-separated string).
    :param instance_name: delete this instance instead of the deterministic name.
    :param firewall: also delete the deterministic SSH firewall rule when there is no XCom.
    :param prices: USD per hour by machine type and provisioning model (``recipes.cost.price_table``); None:
        the defaults, ``recipes.cost.DEFAULT_PRICES``.
    """

    template_fields: Sequence[str] = (
        "project_id",
        "zones",
        "instance_name",
        "api_endpoint",
        *ComputeOperator.connection_template_fields,
    )
    ui_color = "#f7d5d5"

    def __init__(
        self,
        *,
        create_task_id: str | None = "create_tpu_vm",
        zones: Sequence[str] | str | None = None,
        instance_name: str | None = None,
        firewall: bool = False,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.create_task_id = create_task_id
        self.zones = zones
        self.instance_name = instance_name
        self.firewall = firewall
        self.prices = prices

    def _target(self, context: Context) -> tuple[str, list[str], str | None, dict[str, str] | None]:
        """The VM's name, the zones to look in, its firewall rule and its lines of places (from the create)."""
        record = None
        if self.create_task_id:
            record = context["ti"].xcom_pull(task_ids=self.create_task_id)
        if record and record.get("name"):
            self.project_id = self.project_id or record.get("project")
            # The recorded zone first, then the others: a recovery may have created the VM again elsewhere.
            zones = list(dict.fromkeys(filter(None, [record.get("zone"), *(record.get("zones") or [])])))
            return record["name"], zones or as_list(self.zones), record.get("firewall"), record.get("place_lines")
        name = self.instance_name or compute.instance_name(
            context["dag"].dag_id, context["run_id"], self.name_prefix, deployment_id()
        )
        self.log.info("No XCom from %s: looking for %s by its deterministic name", self.create_task_id, name)
        return name, as_list(self.zones), compute.firewall_name(name) if self.firewall else None, None

    def execute(self, context: Context) -> Any:
        name, zones, firewall, place_lines = self._target(context)
        deletes = [
            {"name": name, "zone": zone, "request_id": self._request_id(context, name, zone, "delete")}
            for zone in zones
        ]
        if firewall:
            deletes.append(
                {"name": firewall, "zone": None, "request_id": self._request_id(context, firewall, "delete")}
            )
        self.log.info(
            "Deleting %s (looking in %s)%s", name, zones, f" and firewall rule {firewall}" if firewall else ""
        )
        from airflow_tpu_posttrain.triggers.compute import ComputeDeleteTrigger

        self.defer(
            trigger=ComputeDeleteTrigger(
                deletes=deletes,
                state={"name": name, "zones": zones, "firewall": firewall, "place_lines": place_lines},
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            timeout=self.wait_timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        state = event["state"]
        if event["status"] != "success":
            raise VmDeleteError(
                f"Deleting {state['name']} failed: {compute.describe_errors(event.get('errors', []))}"
            )
        deleted = event["deleted"]
        self._give_places_back(state["name"], state.get("place_lines"))
        vm = next((d for d in deleted if d["zone"]), None)
        result = {
            "deleted": vm is not None,
            "name": state["name"],
            "zone": vm and vm["zone"],
            "firewall_deleted": any(d["zone"] is None for d in deleted),
        }
        if vm is None:
            self.log.info("Nothing to delete: %s was not found in %s", state["name"], state["zones"])
            return result
        self.log.info(
            "Deleted %s in %s%s",
            state["name"],
            vm["zone"],
            " and its firewall rule" if result["firewall_deleted"] else "",
        )
        if vm.get("instance") and vm.get("ended"):  # not when an earlier try's delete already ended
            spent = cost.vm_cost(state["name"], vm["instance"], vm["ended"], self.prices)
            self.log.info("Cost: %s", spent.describe())
            result.update(spent.as_dict())
        return result
