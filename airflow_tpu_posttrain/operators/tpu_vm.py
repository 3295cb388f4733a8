"""Create and delete the TPU VM (a Compute Engine instance) of one DAG run, deferrably and idempotently."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException
from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.recipes import compute, validation
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

# Without a DAG-level timeout to derive it from, the cloud-side backstop deletes the VM after this long.
DEFAULT_MAX_RUN_DURATION = timedelta(hours=12)
# Added to the DAG's dagrun_timeout so teardown normally wins the race against the backstop.
BACKSTOP_MARGIN = timedelta(minutes=30)
_REQUEST_NAMESPACE = uuid.UUID("6f1c1e0a-5b7d-4f0e-9d55-2f6c7a3b9e10")


def _request_id(context: Context, *parts: object) -> str:
    """A requestId stable within one try of one task instance (the same call repeated by the client's retries,
    or after a deferral, is recognised by Compute as a repeat) and new for every try and every re-run: the task
    instance's id changes with each try, so a re-run never replays an earlier run's finished operations."""
    return str(uuid.uuid5(_REQUEST_NAMESPACE, "/".join(str(p) for p in (context["ti"].id, *parts))))


def _as_list(value: Sequence[str] | str | None) -> list[str]:
    """Zones from Python, a rendered template or a Param: a list, or a comma-separated string."""
    if value is None:
        return []
    if isinstance(value, str):
        return [
            part.strip()
            for part in value.strip("[]").replace("'", "").replace('"', "").split(",")
            if part.strip()
        ]
    return list(value)


def _seconds(value: timedelta | int | float | None) -> int | None:
    if value is None:
        return None
    return int(value.total_seconds() if isinstance(value, timedelta) else value)


class _ComputeOperator(BaseOperator):
    """What create and delete share: the connection, the endpoint and how they build the hook."""

    def __init__(
        self,
        *,
        project_id: str | None = None,
        gcp_conn_id: str = "google_cloud_default",
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        poll_interval: float = 10.0,
        inline_wait: float = 5.0,
        name_prefix: str = "tpu",
        wait_timeout: timedelta = timedelta(hours=3),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.wait_timeout = wait_timeout
        self.project_id = project_id
        self.gcp_conn_id = gcp_conn_id
        self.api_endpoint = api_endpoint
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.inline_wait = inline_wait
        self.name_prefix = name_prefix

    @cached_property
    def hook(self) -> TpuVmHook:
        from airflow_tpu_posttrain.hooks.compute import TpuVmHook

        return TpuVmHook(
            gcp_conn_id=self.gcp_conn_id,
            api_endpoint=self.api_endpoint,
            impersonation_chain=self.impersonation_chain,
        )

    @property
    def project(self) -> str:
        project = self.project_id or self.hook.project_id
        if not project:
            raise AirflowFailException(
                "project_id is not set: pass project_id or set 'project' in the Google Cloud connection"
            )
        return project

    def _defer_on(
        self, operations: list[dict], instance: dict | None, deletes: list[dict] | None = None, **state: Any
    ) -> None:
        """Wait (and delete) in the triggerer; ``state`` comes back in the event (``event["state"]``)."""
        from airflow_tpu_posttrain.triggers.compute import ComputeOperationsTrigger

        self.defer(
            trigger=ComputeOperationsTrigger(
                project_id=self.project,
                operations=operations,
                instance=instance,
                deletes=deletes,
                gcp_conn_id=self.gcp_conn_id,
                api_endpoint=self.api_endpoint,
                impersonation_chain=self.impersonation_chain,
                poll_interval=self.poll_interval,
                state=state,
            ),
            method_name="execute_complete",
            timeout=self.wait_timeout,
        )


class TpuVmCreateOperator(_ComputeOperator):
    """
    Create the TPU VM of this DAG run (or, with a CPU ``accelerator_type``, its CPU VM), or find and reuse it.

    The instance name is deterministic per (dag_id, run_id), so a retry or a re-run finds the instance of an
    earlier try: a live one is reused, a TERMINATED/STOPPED one is replaced, and no second one is created.
    Zones are tried in order; a stock-out moves on to the next zone, quota and reservation errors fail at once.

    Returns (XCom) ``name, project, zone, status, internal_ip, external_ip, machine_type, accelerator_type,
    firewall``; a partial record with the name is pushed before the first API call so a teardown can find
    the VM even if this task dies half-way.

    :param zones: zones to try, in order (a list, or a comma-separated string).
    :param accelerator_type: ``v6e-1``, ``v6e-4`` or ``v6e-8`` (the machine type is derived from it), or
        ``cpu`` for a CPU VM.
    :param provisioning_model: RESERVATION_BOUND (the tutorials'; needs ``reservation``), STANDARD, SPOT or
        FLEX_START.
    :param reservation: name of the specific reservation to consume.
    :param network: VPC network name.
    :param tags: network tags.
    :param iap_firewall: also create the tutorials' IAP SSH firewall rule (target tag = instance name).
    :param max_run_duration: cloud-side backstop (``scheduling.maxRunDuration``, termination action DELETE).
        Default: the DAG's ``dagrun_timeout`` plus 30 minutes, else 12 hours.
    :param service_account_scopes: OAuth scopes of the VM's default service account (e.g.
        ``compute.STORAGE_SCOPES`` to write gs:// checkpoints); empty: Compute's defaults.
    :param instance_name: override the deterministic name (rarely needed).
    :param labels: extra labels; the ownership labels (managed-by, dag, run, task, expires-at) are always set.
    :param metadata: extra instance metadata items (e.g. ``enable-oslogin: "TRUE"``).
    :param api_endpoint: Compute API endpoint override (a local emulator); default from the connection.
    """

    template_fields: Sequence[str] = (
        "project_id",
        "zones",
        "accelerator_type",
        "provisioning_model",
        "reservation",
        "network",
        "tags",
        "instance_name",
        "labels",
        "metadata",
        "api_endpoint",
    )
    ui_color = "#d5e8f7"

    def __init__(
        self,
        *,
        zones: Sequence[str] | str,
        accelerator_type: str = "v6e-8",
        provisioning_model: str = "RESERVATION_BOUND",
        reservation: str | None = None,
        network: str = "default",
        tags: Sequence[str] | None = None,
        iap_firewall: bool = False,
        boot_disk_size_gb: int = 200,
        image_project: str = compute.DEFAULT_IMAGE_PROJECT,
        image_family: str = compute.DEFAULT_IMAGE_FAMILY,
        max_run_duration: timedelta | int | None = None,
        service_account_scopes: Sequence[str] = (),
        instance_name: str | None = None,
        labels: dict[str, str] | None = None,
        metadata: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.zones = zones
        self.accelerator_type = accelerator_type
        self.provisioning_model = provisioning_model
        self.reservation = reservation
        self.network = network
        self.tags = tags
        self.iap_firewall = iap_firewall
        self.boot_disk_size_gb = boot_disk_size_gb
        self.image_project = image_project
        self.image_family = image_family
        self.max_run_duration = max_run_duration
        self.service_account_scopes = service_account_scopes
        self.instance_name = instance_name
        self.labels = labels
        self.metadata = metadata

    def _max_run_duration_s(self, context: Context) -> int:
        explicit = _seconds(self.max_run_duration)
        if explicit is not None:
            return explicit
        dagrun_timeout = getattr(context["dag"], "dagrun_timeout", None)
        if dagrun_timeout:
            return int((dagrun_timeout + BACKSTOP_MARGIN).total_seconds())
        return int(DEFAULT_MAX_RUN_DURATION.total_seconds())

    def _spec(self, context: Context) -> compute.TpuVmSpec:
        """Validate everything the user gave before any API call; bad input fails without a retry."""
        try:
            return compute.TpuVmSpec(
                project_id=self.project,
                zones=tuple(_as_list(self.zones)),
                accelerator_type=self.accelerator_type,
                provisioning_model=self.provisioning_model,
                reservation=self.reservation or None,
                network=self.network,
                tags=tuple(_as_list(self.tags)),
                iap_firewall=self.iap_firewall,
                boot_disk_size_gb=self.boot_disk_size_gb,
                image_project=self.image_project,
                image_family=self.image_family,
                max_run_duration_s=self._max_run_duration_s(context),
                service_account_scopes=tuple(self.service_account_scopes),
                labels=dict(self.labels or {}),
                metadata=dict(self.metadata or {}),
            )
        except SpecError as err:
            raise AirflowFailException(f"{self.task_id}: invalid input: {err}") from err

    def _name(self, context: Context) -> str:
        if self.instance_name:
            try:
                return validation.gce_name("instance_name", self.instance_name)
            except SpecError as err:
                raise AirflowFailException(f"{self.task_id}: invalid input: {err}") from err
        return compute.instance_name(context["dag"].dag_id, context["run_id"], self.name_prefix)

    def _record(
        self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str | None, **more: Any
    ) -> dict:
        record = {
            "name": name,
            "project": spec.project_id,
            "zone": zone,
            "zones": list(spec.zones),
            "machine_type": spec.machine_type,
            "accelerator_type": spec.accelerator_type,
            "firewall": compute.firewall_name(name) if spec.iap_firewall else None,
            **more,
        }
        context["ti"].xcom_push(key="return_value", value=record)
        return record

    def execute(self, context: Context) -> Any:
        spec = self._spec(context)
        name = self._name(context)
        self._record(context, spec, name, None, status="CREATING")
        for zone in spec.zones:
            existing = self.hook.get_instance(spec.project_id, zone, name)
            if existing is None:
                continue
            status = existing.get("status")
            if status in compute.LIVE_STATES:
                self.log.info("Reusing instance %s in %s (status %s) from an earlier try", name, zone, status)
                self._record(context, spec, name, zone, status=status)
                return self._complete_or_defer(
                    context, [], {"name": name, "zone": zone}, phase="wait", zone_index=spec.zones.index(zone)
                )
            self.log.info(
                "Instance %s in %s is %s: deleting it before creating a fresh one", name, zone, status
            )
            operation = self.hook.delete_instance(
                spec.project_id, zone, name, _request_id(context, name, zone, "replace")
            )
            if operation:
                return self._complete_or_defer(
                    context, [{"name": operation, "zone": zone}], None, phase="replace", zone_index=0
                )
        return self._insert(context, spec, name, zone_index=0, stockouts=[])

    def _insert(
        self,
        context: Context,
        spec: compute.TpuVmSpec,
        name: str,
        zone_index: int,
        stockouts: list[str],
        replaced: bool = False,
    ) -> None:
        """Insert in ``zones[zone_index]`` and defer. The requestId is stable for this try and this purpose, so
        the client's own retries never create twice; after a replacement it differs, or Compute would answer
        with the old, finished insert."""
        if zone_index >= len(spec.zones):
            raise AirflowException(
                f"No {spec.accelerator_type} capacity in any zone ({'; '.join(stockouts)}). No instance was left "
                "behind. Add zones, use a reservation or FLEX_START, or let the task retry later."
            )
        zone = spec.zones[zone_index]
        operations = []
        if spec.iap_firewall:
            firewall_op = self.hook.insert_firewall(
                spec.project_id,
                compute.iap_firewall_body(spec, name),
                _request_id(context, name, "firewall"),
            )
            if firewall_op:
                operations.append({"name": firewall_op, "zone": None})
        labels = compute.ownership_labels(
            context["dag"].dag_id,
            context["run_id"],
            self.task_id,
            compute.expiry(spec.max_run_duration_s, int(DEFAULT_MAX_RUN_DURATION.total_seconds())),
        )
        metadata = {"airflow-dag-id": context["dag"].dag_id, "airflow-run-id": context["run_id"]}
        body = compute.instance_body(spec, name, zone, labels, metadata)
        self.log.info("Creating %s (%s, %s) in %s", name, spec.machine_type, spec.provisioning_model, zone)
        self._record(context, spec, name, zone, status="CREATING")
        request_id = _request_id(context, name, zone, "replacement" if replaced else "insert")
        operation = self.hook.insert_instance(spec.project_id, zone, body, request_id)
        if operation:
            operations.append({"name": operation, "zone": zone})
        else:
            self.log.info("Instance %s already exists in %s: waiting for it instead", name, zone)
        return self._complete_or_defer(
            context,
            operations,
            {"name": name, "zone": zone},
            phase="create",
            zone_index=zone_index,
            stockouts=stockouts,
        )

    def _complete_or_defer(
        self, context: Context, operations: list[dict], instance: dict | None, **state: Any
    ) -> Any:
        """Wait up to ``inline_wait`` seconds here (a reused VM, a quick operation), else in the triggerer."""
        event = self._wait_briefly(operations, instance)
        if event is None:
            self._defer_on(operations, instance, **state)
        return self.execute_complete(context, {**event, "state": state})

    def _wait_briefly(self, operations: list[dict], instance: dict | None) -> dict | None:
        """The trigger's event, when the operations and the instance settle within ``inline_wait``; else None."""
        deadline = time.monotonic() + self.inline_wait
        pending = list(operations)
        while True:
            while pending:
                operation = self.hook.get_operation(self.project, pending[0]["name"], pending[0].get("zone"))
                if operation.get("status") != "DONE":
                    break
                errors = operation.get("error", {}).get("errors", [])
                if errors:
                    return {"status": "error", "operation": pending[0]["name"], "errors": errors}
                pending.pop(0)
            if not pending:
                if not instance:
                    return {"status": "success"}
                found = self.hook.get_instance(self.project, instance["zone"], instance["name"])
                if found and found.get("status") == "RUNNING":
                    return {"status": "success", "instance": found}
            if time.monotonic() + 0.5 > deadline:
                return None
            time.sleep(0.5)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        phase, zone_index = event["state"]["phase"], event["state"]["zone_index"]
        stockouts = list(event["state"].get("stockouts") or [])
        spec = self._spec(context)
        name = self._name(context)
        if phase == "replace" and event["status"] == "success":
            return self._insert(context, spec, name, zone_index, stockouts, replaced=True)
        zone = spec.zones[zone_index]
        if event["status"] == "success":
            instance = event["instance"]
            interface = (instance.get("networkInterfaces") or [{}])[0]
            access = (interface.get("accessConfigs") or [{}])[0]
            record = self._record(
                context,
                spec,
                name,
                zone,
                status=instance.get("status"),
                internal_ip=interface.get("networkIP"),
                external_ip=access.get("natIP"),
                self_link=instance.get("selfLink"),
            )
            self.log.info(
                "TPU VM %s is RUNNING in %s (internal %s, external %s)",
                name,
                zone,
                record["internal_ip"],
                record["external_ip"],
            )
            return record

        errors = event.get("errors", [])
        detail = compute.describe_errors(errors)
        kind = compute.classify_errors(errors)
        if phase == "create" and kind == compute.ErrorKind.CAPACITY:
            self.log.warning("Zone %s is out of %s capacity: %s", zone, spec.accelerator_type, detail)
            stockouts.append(f"{zone}: {detail}")
            leftover = self.hook.get_instance(spec.project_id, zone, name)
            if leftover:
                operation = self.hook.delete_instance(
                    spec.project_id, zone, name, _request_id(context, name, zone, "stockout")
                )
                if operation:
                    return self._complete_or_defer(
                        context,
                        [{"name": operation, "zone": zone}],
                        None,
                        phase="replace",
                        zone_index=zone_index + 1,
                        stockouts=stockouts,
                    )
            return self._insert(context, spec, name, zone_index + 1, stockouts)
        self._delete_leftover(context, spec, name, zone)
        if kind == compute.ErrorKind.QUOTA:
            raise AirflowFailException(
                f"Quota exceeded creating {name} in {zone}: {detail}. Request a quota increase for "
                f"{spec.accelerator_type} in that region (IAM & Admin > Quotas) or choose another region."
            )
        if kind == compute.ErrorKind.RESERVATION:
            raise AirflowFailException(
                f"Reservation problem creating {name} in {zone}: {detail}. Check that reservation "
                f"'{spec.reservation}' exists in {zone}, has free {spec.machine_type} capacity and allows "
                "specific consumption, or choose another provisioning_model."
            )
        raise AirflowException(f"{phase} of {name} in {zone} failed: {detail}")

    def _delete_leftover(self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str) -> None:
        """Delete-on-error: a teardown does not run when its setup failed, so a failing create cleans up."""
        if self.hook.get_instance(spec.project_id, zone, name) is None:
            return
        self.log.warning(
            "Deleting %s in %s: the create failed and the instance must not outlive it", name, zone
        )
        self.hook.delete_instance(spec.project_id, zone, name, _request_id(context, name, zone, "on-error"))


class TpuDeleteOperator(_ComputeOperator):
    """
    Delete the TPU VM (or CPU VM) of this DAG run and its IAP firewall rule, from the triggerer. Built to be the
    teardown: the worker only works out what to delete and defers at once.

    It finds the VM from the create task's XCom (also the partial record a failed create leaves) and, when
    there is none, from the deterministic name in each of ``zones``. A VM that is already gone counts as
    success. Returns (XCom) ``{"deleted": bool, "name", "zone", "firewall_deleted": bool}``.

    :param create_task_id: the task id of the :class:`TpuVmCreateOperator` whose VM to delete.
    :param zones: where to look when there is no XCom (a list, or a comma-separated string).
    :param instance_name: delete this instance instead of the deterministic name.
    :param iap_firewall: also delete the deterministic IAP firewall rule when there is no XCom.
    """

    template_fields: Sequence[str] = ("project_id", "zones", "instance_name", "api_endpoint")
    ui_color = "#f7d5d5"

    def __init__(
        self,
        *,
        create_task_id: str | None = "create_tpu_vm",
        zones: Sequence[str] | str | None = None,
        instance_name: str | None = None,
        iap_firewall: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.create_task_id = create_task_id
        self.zones = zones
        self.instance_name = instance_name
        self.iap_firewall = iap_firewall

    def _target(self, context: Context) -> tuple[str, list[str], str | None]:
        record = None
        if self.create_task_id:
            record = context["ti"].xcom_pull(task_ids=self.create_task_id)
        if record and record.get("name"):
            self.project_id = self.project_id or record.get("project")
            zones = [record["zone"]] if record.get("zone") else list(record.get("zones") or [])
            return record["name"], zones or _as_list(self.zones), record.get("firewall")
        name = self.instance_name or compute.instance_name(
            context["dag"].dag_id, context["run_id"], self.name_prefix
        )
        self.log.info("No XCom from %s: looking for %s by its deterministic name", self.create_task_id, name)
        return name, _as_list(self.zones), compute.firewall_name(name) if self.iap_firewall else None

    def execute(self, context: Context) -> Any:
        name, zones, firewall = self._target(context)
        deletes = [
            {"name": name, "zone": zone, "request_id": _request_id(context, name, zone, "delete")}
            for zone in zones
        ]
        if firewall:
            deletes.append(
                {"name": firewall, "zone": None, "request_id": _request_id(context, firewall, "delete")}
            )
        self.log.info(
            "Deleting %s (looking in %s)%s", name, zones, f" and firewall rule {firewall}" if firewall else ""
        )
        self._defer_on([], None, deletes=deletes, name=name, zones=zones, firewall=firewall)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict:
        state = event["state"]
        if event["status"] != "success":
            raise AirflowException(
                f"Deleting {state['name']} failed: {compute.describe_errors(event.get('errors', []))}"
            )
        deleted = event.get("deleted", [])
        zone = next((d["zone"] for d in deleted if d["zone"]), None)
        result = {
            "deleted": zone is not None,
            "name": state["name"],
            "zone": zone,
            "firewall_deleted": any(d["zone"] is None for d in deleted),
        }
        if zone is None:
            self.log.info("Nothing to delete: %s was not found in %s", state["name"], state["zones"])
        else:
            self.log.info(
                "Deleted %s in %s%s",
                state["name"],
                zone,
                " and its firewall rule" if result["firewall_deleted"] else "",
            )
        return result
