"""Compute Engine resource policies: the regional workload policy that a multi-host TPU slice's MIG names.

Google's behaviour: ``resourcePolicies`` insert, get, list, aggregatedList, delete
(https://cloud.google.com/compute/docs/reference/rest/v1/resourcePolicies), workload policies
(https://cloud.google.com/compute/docs/instance-groups/about-workload-policies) and gcloud's reference for
``resource-policies create workload-policy``
(https://cloud.google.com/sdk/gcloud/reference/compute/resource-policies/create/workload-policy). A policy that a MIG
still uses is refused deletion (``instance_groups``).
"""

from __future__ import annotations

import copy
import time

from airflow_tpu_posttrain.local.compute_emulator import api


class ResourcePoliciesMixin:
    """Resource policies (``_resource_policies``), by project, region and name."""

    def _insert_resource_policy(self, query: dict, body: dict, project: str, region: str):
        """``resourcePolicies.insert`` of a workload policy: what a multi-host TPU slice's MIG names.

        The body shape is the A4X how-to's (cloud.google.com/ai-hypercomputer/docs/create/create-mig-with-a4x):
        ``{"name", "workloadPolicy": {"type": "HIGH_THROUGHPUT", "acceleratorTopology": "4x4"}}``."""
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            name = api.check_insert("ResourcePolicy", body)
            workload = body.get("workloadPolicy")
            if workload is not None:
                # gcloud's --type is required (its reference for `resource-policies create workload-policy`);
                # that the API refuses a policy without it is inferred, and the stricter choice.
                if not workload.get("type"):
                    raise api.ApiError(400, "required", "Required field 'resource.workloadPolicy.type' not specified")
                # --accelerator-topology and --max-topology-distance are mutually exclusive (the same reference);
                # the text of the API's refusal is modelled.
                if workload.get("acceleratorTopology") and workload.get("maxTopologyDistance"):
                    raise api.ApiError(
                        400, "invalid", "Invalid value for field 'resource.workloadPolicy': acceleratorTopology and "
                        "maxTopologyDistance cannot both be set."
                    )
            path = api.resource_path(project, None, "resourcePolicies", name, region)
            if (project, region, name) in self._resource_policies:
                raise api.already_exists(path)
            policy = {
                **copy.deepcopy(body),
                "kind": "compute#resourcePolicy",
                "id": api.numeric_id(),
                "region": f"{api.API_ROOT}/projects/{project}/regions/{region}",
                "selfLink": f"{api.API_ROOT}/{path}",
                "creationTimestamp": api.timestamp(time.time()),
                "status": "READY",
            }
            self._resource_policies[(project, region, name)] = policy
            return 200, self._start_operation(project, None, "insert", policy, query, region=region)

    def _get_resource_policy(self, query: dict, body: dict, project: str, region: str, name: str):
        with self._lock:
            self._advance()  # Compute's operations end in time, whatever is asked
            policy = self._resource_policies.get((project, region, name))
            if policy is None:
                raise api.not_found(api.resource_path(project, None, "resourcePolicies", name, region))
            return 200, copy.deepcopy(policy)

    def _list_resource_policies(self, query: dict, body: dict, project: str, region: str):
        terms = api.parse_filter(query.get("filter", ""))
        with self._lock:
            self._advance()  # Compute's operations end in time, whatever is asked
            items = api.matching(self._resource_policies, (project, region), terms)
        return api.list_response(
            "compute#resourcePolicyList", f"projects/{project}/regions/{region}/resourcePolicies", items
        )

    def _delete_resource_policy(self, query: dict, body: dict, project: str, region: str, name: str):
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            key = (project, region, name)
            policy = self._resource_policies.get(key)
            path = api.resource_path(project, None, "resourcePolicies", name, region)
            if policy is None:
                raise api.not_found(path)
            for (group_project, zone, group_name), group in self._referring_groups():
                if self._group_policy_key(group_project, zone, group.resource) == key:
                    user = api.resource_path(group_project, zone, "instanceGroupManagers", group_name)
                    raise api.in_use_error("resource_policy", path, user)

            def on_done(failed: bool) -> None:
                if self._resource_policies.get(key) is policy:
                    del self._resource_policies[key]

            return 200, self._start_operation(
                project, None, "delete", policy, query, on_done=on_done, region=region
            )

    def _aggregated_resource_policies(self, query: dict, body: dict, project: str):
        """``resourcePolicies.aggregatedList``: the project's policies of every region, keyed ``regions/<region>``."""
        with self._lock:
            self._advance()  # Compute's operations end in time, whatever is asked
            found = [(f"regions/{region}", r) for (p, region, _), r in self._resource_policies.items() if p == project]
            return api.aggregated_response("resourcePolicy", "resourcePolicies", project, found, query)
