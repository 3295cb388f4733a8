"""Compute Engine I/O for TPU VMs, through Google's official ``google-cloud-compute`` client.

Credentials come from a ``google_cloud_platform`` connection (providers-google's base hook). The API
endpoint can be overridden (hook argument, or the connection extra ``compute_api_endpoint``) so the same
code talks to a local Compute emulator.
"""

from __future__ import annotations

import asyncio
import json
from functools import cached_property
from typing import Any

from airflow.providers.google.common.hooks.base_google import GoogleBaseAsyncHook, GoogleBaseHook

from airflow_tpu_posttrain.defaults import GCP_CONN_ID

# Errors a retry can fix: rate limits and server-side hiccups.
_TRANSIENT_NAMES = (
    "TooManyRequests",
    "ServiceUnavailable",
    "InternalServerError",
    "BadGateway",
    "GatewayTimeout",
)


def resource_not_ready(error: Exception) -> bool:
    """Compute's 400 ``resourceNotReady``: "The resource '...' is not ready" (busy with another operation)."""
    from google.api_core.exceptions import BadRequest

    reasons = [getattr(e, "get", lambda _: None)("reason") for e in getattr(error, "errors", None) or []]
    return isinstance(error, BadRequest) and ("resourceNotReady" in reasons or "is not ready" in str(error))


def _message_to_dict(message: Any) -> dict:
    """A proto-plus message as the REST JSON the API documents (camelCase keys)."""
    return json.loads(type(message).to_json(message, use_integers_for_enums=False))


class TpuVmHook(GoogleBaseHook):
    """Create, inspect and delete TPU VM instances, firewall rules and their operations."""

    conn_name_attr = "gcp_conn_id"
    default_conn_name = GCP_CONN_ID
    conn_type = "google_cloud_platform"
    hook_name = "Google Cloud (TPU VMs)"

    def __init__(
        self,
        gcp_conn_id: str = default_conn_name,
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        retry_initial_delay: float = 1.0,
        retry_deadline: float = 300.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(gcp_conn_id=gcp_conn_id, impersonation_chain=impersonation_chain, **kwargs)
        self._api_endpoint = api_endpoint
        self.retry_initial_delay = retry_initial_delay
        self.retry_deadline = retry_deadline

    @cached_property
    def api_endpoint(self) -> str | None:
        return self._api_endpoint or self._get_field("compute_api_endpoint") or None

    def _client(self, name: str) -> Any:
        from google.cloud import compute_v1

        options = {"api_endpoint": self.api_endpoint} if self.api_endpoint else None
        return getattr(compute_v1, name)(
            transport="rest", credentials=self.get_credentials(), client_options=options
        )

    @cached_property
    def instances(self) -> Any:
        return self._client("InstancesClient")

    @cached_property
    def zone_operations(self) -> Any:
        return self._client("ZoneOperationsClient")

    @cached_property
    def firewalls(self) -> Any:
        return self._client("FirewallsClient")

    @cached_property
    def global_operations(self) -> Any:
        return self._client("GlobalOperationsClient")

    @cached_property
    def region_operations(self) -> Any:
        return self._client("RegionOperationsClient")

    @cached_property
    def resource_policies(self) -> Any:
        return self._client("ResourcePoliciesClient")

    @cached_property
    def instance_templates(self) -> Any:
        return self._client("InstanceTemplatesClient")

    @cached_property
    def instance_groups(self) -> Any:
        return self._client("InstanceGroupManagersClient")

    @cached_property
    def retry(self) -> Any:
        """Backoff on 429/5xx, and on 400 ``resourceNotReady`` (the instance busy with another operation).

        Inserts and deletes are safe to repeat because they carry a requestId."""
        from google.api_core import exceptions
        from google.api_core.retry import Retry, if_exception_type

        transient = if_exception_type(*(getattr(exceptions, name) for name in _TRANSIENT_NAMES))
        return Retry(
            predicate=lambda error: transient(error) or resource_not_ready(error),
            initial=self.retry_initial_delay,
            maximum=max(self.retry_initial_delay, 30.0),
            multiplier=2.0,
            timeout=self.retry_deadline,
        )

    def get_instance(self, project: str, zone: str, name: str) -> dict | None:
        """The instance as REST JSON, or None when it does not exist."""
        from google.api_core.exceptions import NotFound

        try:
            return _message_to_dict(
                self.instances.get(project=project, zone=zone, instance=name, retry=self.retry)
            )
        except NotFound:
            return None

    def get_host_keys(self, project: str, zone: str, name: str) -> dict[str, str]:
        """The host keys the VM's guest environment published (``hostkeys/`` guest attributes).

        ``{}`` until it has, and when guest attributes are off (the API then answers 400 or 404, both taken as
        "none yet")."""
        from google.api_core.exceptions import BadRequest, NotFound

        from airflow_tpu_posttrain.recipes.access import HOST_KEY_NAMESPACE, host_keys_from_guest_attributes

        try:
            answer = self.instances.get_guest_attributes(
                request={
                    "project": project,
                    "zone": zone,
                    "instance": name,
                    "query_path": f"{HOST_KEY_NAMESPACE}/",
                },
                retry=self.retry,
            )
        except (BadRequest, NotFound):
            return {}
        return host_keys_from_guest_attributes(_message_to_dict(answer))

    @cached_property
    def reservations(self) -> Any:
        return self._client("ReservationsClient")

    def get_reservation(self, project: str, zone: str, name: str) -> dict | None:
        """The reservation as REST JSON, or None when it does not exist (403 is raised: not readable)."""
        from google.api_core.exceptions import NotFound

        try:
            return _message_to_dict(
                self.reservations.get(project=project, zone=zone, reservation=name, retry=self.retry)
            )
        except NotFound:
            return None

    @cached_property
    def networks(self) -> Any:
        return self._client("NetworksClient")

    def get_network(self, project: str, name: str) -> dict | None:
        from google.api_core.exceptions import NotFound

        try:
            return _message_to_dict(self.networks.get(project=project, network=name, retry=self.retry))
        except NotFound:
            return None

    def get_subnetwork(self, project: str, region: str, name: str) -> dict | None:
        from google.api_core.exceptions import NotFound

        client = self._client("SubnetworksClient")
        try:
            return _message_to_dict(
                client.get(project=project, region=region, subnetwork=name, retry=self.retry)
            )
        except NotFound:
            return None

    def list_routers(self, project: str, region: str) -> list[dict]:
        pages = self._client("RoutersClient").list(project=project, region=region, retry=self.retry)
        return [_message_to_dict(router) for router in pages]

    def list_instances(self, project: str, zone: str, label_filter: str) -> list[dict]:
        pages = self.instances.list(
            request={"project": project, "zone": zone, "filter": label_filter}, retry=self.retry
        )
        return [_message_to_dict(instance) for instance in pages]

    def list_project_instances(self, project: str, label_filter: str) -> list[tuple[str, dict]]:
        """``(zone, instance)`` of the project's instances matching ``label_filter``, in every zone.

        One ``instances.aggregatedList``."""
        pages = self.instances.aggregated_list(
            request={"project": project, "filter": label_filter}, retry=self.retry
        )
        return [
            (scope.removeprefix("zones/"), _message_to_dict(instance))
            for scope, scoped in pages
            for instance in scoped.instances
        ]

    def find_instances(self, project: str, name: str) -> list[dict]:
        """The project's instances named ``name``, in any zone (``instances.aggregatedList``)."""
        pages = self.instances.aggregated_list(
            request={"project": project, "filter": f"name = {name}"}, retry=self.retry
        )
        return [_message_to_dict(instance) for _, scoped in pages for instance in scoped.instances]

    def list_firewalls(self, project: str) -> list[dict]:
        pages = self.firewalls.list(request={"project": project}, retry=self.retry)
        return [_message_to_dict(rule) for rule in pages]

    def insert_instance(self, project: str, zone: str, body: dict, request_id: str) -> str | None:
        """Start an insert; the operation name, or None when an instance of that name already exists."""
        from google.api_core.exceptions import Conflict
        from google.cloud import compute_v1

        resource = compute_v1.Instance.from_json(json.dumps(body))
        try:
            operation = self.instances.insert(
                request={
                    "project": project,
                    "zone": zone,
                    "instance_resource": resource,
                    "request_id": request_id,
                },
                retry=self.retry,
            )
        except Conflict:
            return None
        return operation.name

    def delete_instance(self, project: str, zone: str, name: str, request_id: str) -> str | None:
        """Start a delete; the operation name, or None when there is nothing to delete."""
        from google.api_core.exceptions import NotFound

        try:
            operation = self.instances.delete(
                request={"project": project, "zone": zone, "instance": name, "request_id": request_id},
                retry=self.retry,
            )
        except NotFound:
            return None
        return operation.name

    def get_operation(
        self, project: str, operation: str, zone: str | None = None, region: str | None = None
    ) -> dict:
        """A zonal operation (``zone`` given), a regional one (``region``: policies) or a global one."""
        if zone:
            message = self.zone_operations.get(
                project=project, zone=zone, operation=operation, retry=self.retry
            )
        elif region:
            message = self.region_operations.get(
                project=project, region=region, operation=operation, retry=self.retry
            )
        else:
            message = self.global_operations.get(project=project, operation=operation, retry=self.retry)
        return _message_to_dict(message)

    def insert_firewall(self, project: str, body: dict, request_id: str) -> str | None:
        from google.api_core.exceptions import Conflict
        from google.cloud import compute_v1

        resource = compute_v1.Firewall.from_json(json.dumps(body))
        try:
            operation = self.firewalls.insert(
                request={"project": project, "firewall_resource": resource, "request_id": request_id},
                retry=self.retry,
            )
        except Conflict:
            return None
        return operation.name

    def delete_firewall(self, project: str, name: str, request_id: str) -> str | None:
        from google.api_core.exceptions import NotFound

        try:
            operation = self.firewalls.delete(
                request={"project": project, "firewall": name, "request_id": request_id}, retry=self.retry
            )
        except NotFound:
            return None
        return operation.name


    # A multi-host slice (recipes/slices.py): its policy, template and group. Each insert answers None when the
    # resource exists (409), each delete None when it is gone (404): a retried create or delete goes on.

    def _started(self, call: Any, request: dict, none_on: type[Exception]) -> str | None:
        try:
            return call(request=request, retry=self.retry).name
        except none_on:
            return None

    def insert_workload_policy(self, project: str, region: str, body: dict, request_id: str) -> str | None:
        from google.api_core.exceptions import Conflict
        from google.cloud import compute_v1

        resource = compute_v1.ResourcePolicy.from_json(json.dumps(body))
        request = {"project": project, "region": region, "resource_policy_resource": resource}
        return self._started(self.resource_policies.insert, {**request, "request_id": request_id}, Conflict)

    def insert_instance_template(self, project: str, body: dict, request_id: str) -> str | None:
        from google.api_core.exceptions import Conflict
        from google.cloud import compute_v1

        resource = compute_v1.InstanceTemplate.from_json(json.dumps(body))
        request = {"project": project, "instance_template_resource": resource, "request_id": request_id}
        return self._started(self.instance_templates.insert, request, Conflict)

    def insert_instance_group(self, project: str, zone: str, body: dict, request_id: str) -> str | None:
        """Start a group's insert. Its operation is DONE once the group exists, before any of its VMs does."""
        from google.api_core.exceptions import Conflict
        from google.cloud import compute_v1

        resource = compute_v1.InstanceGroupManager.from_json(json.dumps(body))
        request = {"project": project, "zone": zone, "instance_group_manager_resource": resource}
        return self._started(self.instance_groups.insert, {**request, "request_id": request_id}, Conflict)

    def get_instance_group(self, project: str, zone: str, name: str) -> dict | None:
        from google.api_core.exceptions import NotFound

        try:
            group = self.instance_groups.get(
                project=project, zone=zone, instance_group_manager=name, retry=self.retry
            )
        except NotFound:
            return None
        return _message_to_dict(group)

    def list_group_instances(self, project: str, zone: str, name: str) -> list[dict]:
        """The group's managed instances: ``{"name", "instance" (its URL), "instanceStatus", "currentAction"}``."""
        pages = self.instance_groups.list_managed_instances(
            request={"project": project, "zone": zone, "instance_group_manager": name}, retry=self.retry
        )
        return [_message_to_dict(member) for member in pages]

    def find_instance_groups(self, project: str, name: str) -> list[dict]:
        """The project's groups named ``name``, in any zone (``instanceGroupManagers.aggregatedList``)."""
        pages = self.instance_groups.aggregated_list(
            request={"project": project, "filter": f"name = {name}"}, retry=self.retry
        )
        return [_message_to_dict(group) for _, scoped in pages for group in scoped.instance_group_managers]

    def list_instance_groups(self, project: str) -> list[tuple[str, dict]]:
        """The project's zonal groups in every zone: ``(zone, group)`` (``instanceGroupManagers.aggregatedList``)."""
        pages = self.instance_groups.aggregated_list(request={"project": project}, retry=self.retry)
        return [
            (scope.rsplit("/", 1)[-1], _message_to_dict(group))
            for scope, scoped in pages
            for group in scoped.instance_group_managers
        ]

    def list_instance_templates(self, project: str) -> list[dict]:
        pages = self.instance_templates.list(request={"project": project}, retry=self.retry)
        return [_message_to_dict(template) for template in pages]

    def list_workload_policies(self, project: str) -> list[tuple[str, dict]]:
        """The project's resource policies in every region: ``(region, policy)``."""
        pages = self.resource_policies.aggregated_list(request={"project": project}, retry=self.retry)
        return [
            (scope.rsplit("/", 1)[-1], _message_to_dict(policy))
            for scope, scoped in pages
            for policy in scoped.resource_policies
        ]

    def delete_instance_group(self, project: str, zone: str, name: str, request_id: str) -> str | None:
        """Start a group's delete, which deletes its VMs."""
        from google.api_core.exceptions import NotFound

        request = {"project": project, "zone": zone, "instance_group_manager": name, "request_id": request_id}
        return self._started(self.instance_groups.delete, request, NotFound)

    def delete_instance_template(self, project: str, name: str, request_id: str) -> str | None:
        from google.api_core.exceptions import NotFound

        request = {"project": project, "instance_template": name, "request_id": request_id}
        return self._started(self.instance_templates.delete, request, NotFound)

    def delete_workload_policy(self, project: str, region: str, name: str, request_id: str) -> str | None:
        from google.api_core.exceptions import NotFound

        request = {"project": project, "region": region, "resource_policy": name, "request_id": request_id}
        return self._started(self.resource_policies.delete, request, NotFound)


class TpuVmAsyncHook(GoogleBaseAsyncHook):
    """The triggerer's view: the sync client's calls run in a thread so the event loop never blocks."""

    sync_hook_class = TpuVmHook

    async def get_operation(
        self, project: str, operation: str, zone: str | None = None, region: str | None = None
    ) -> dict:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.get_operation, project, operation, zone, region)

    async def get_instance(self, project: str, zone: str, name: str) -> dict | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.get_instance, project, zone, name)

    async def list_instances(self, project: str, zone: str, label_filter: str) -> list[dict]:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.list_instances, project, zone, label_filter)

    async def get_host_keys(self, project: str, zone: str, name: str) -> dict[str, str]:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.get_host_keys, project, zone, name)

    async def delete_instance(self, project: str, zone: str, name: str, request_id: str) -> str | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.delete_instance, project, zone, name, request_id)

    async def delete_firewall(self, project: str, name: str, request_id: str) -> str | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.delete_firewall, project, name, request_id)

    async def insert_instance(self, project: str, zone: str, body: dict, request_id: str) -> str | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.insert_instance, project, zone, body, request_id)

    async def insert_firewall(self, project: str, body: dict, request_id: str) -> str | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.insert_firewall, project, body, request_id)

    async def get_network(self, project: str, name: str) -> dict | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.get_network, project, name)

    async def get_subnetwork(self, project: str, region: str, name: str) -> dict | None:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.get_subnetwork, project, region, name)

    async def list_routers(self, project: str, region: str) -> list[dict]:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.list_routers, project, region)

    # A multi-host slice's resources (the sync hook's methods of the same names).

    async def _in_thread(self, method: str, *args: Any) -> Any:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(getattr(hook, method), *args)

    async def insert_workload_policy(self, project: str, region: str, body: dict, request_id: str) -> str | None:
        return await self._in_thread("insert_workload_policy", project, region, body, request_id)

    async def insert_instance_template(self, project: str, body: dict, request_id: str) -> str | None:
        return await self._in_thread("insert_instance_template", project, body, request_id)

    async def insert_instance_group(self, project: str, zone: str, body: dict, request_id: str) -> str | None:
        return await self._in_thread("insert_instance_group", project, zone, body, request_id)

    async def get_instance_group(self, project: str, zone: str, name: str) -> dict | None:
        return await self._in_thread("get_instance_group", project, zone, name)

    async def list_group_instances(self, project: str, zone: str, name: str) -> list[dict]:
        return await self._in_thread("list_group_instances", project, zone, name)

    async def delete_instance_group(self, project: str, zone: str, name: str, request_id: str) -> str | None:
        return await self._in_thread("delete_instance_group", project, zone, name, request_id)

    async def delete_instance_template(self, project: str, name: str, request_id: str) -> str | None:
        return await self._in_thread("delete_instance_template", project, name, request_id)

    async def delete_workload_policy(self, project: str, region: str, name: str, request_id: str) -> str | None:
        return await self._in_thread("delete_workload_policy", project, region, name, request_id)
