"""Compute Engine zonal managed instance groups (MIGs): what a multi-host TPU slice is made of.

Google's behaviour: ``instanceGroupManagers`` insert, get, list, aggregatedList, listManagedInstances, delete
(https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers; the insert's operation is DONE before
any VM exists), bulk mode (https://cloud.google.com/compute/docs/instance-groups/about-bulk-mode), workload policies
and accelerator topologies (https://cloud.google.com/compute/docs/instance-groups/about-workload-policies), v6e's
slice shapes (https://cloud.google.com/tpu/docs/v6e). Where Google documents nothing, the stricter choice is made and
its method says so (``docs/local-stand-ins.md`` lists each). Each VM a MIG makes is an ordinary instance
(``instances``) that its MIG watches.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import secrets
import time
from typing import Any

from airflow_tpu_posttrain.local import compute_schema
from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.compute_emulator.faults import FAILED_DELETE
from airflow_tpu_posttrain.local.compute_emulator.operations import OperationError
from airflow_tpu_posttrain.recipes.accelerators import (
    ACCELERATORS,
    SLICE_ACCELERATORS,
    SLICE_CHIPS_PER_VM,
    SLICE_MACHINE_TYPE,
)

# Multi-host TPU v6e slices, from the accelerator table: a slice of topology T is a MIG of its VM count of
# ct6e-standard-4t VMs (v6e-16, 4x4: 4 VMs).
SLICE_VMS = {ACCELERATORS[name].topology: ACCELERATORS[name].vms for name in SLICE_ACCELERATORS}
# Bulk mode supports only the reservation-bound and flex-start provisioning models
# (cloud.google.com/compute/docs/instance-groups/about-bulk-mode, its limitations): not on-demand, not Spot.
BULK_PROVISIONING_MODELS = ("RESERVATION_BOUND", "FLEX_START")
# The pattern of InstanceGroupManager.baseInstanceName (the v1 reference): a prefix, or one ending in -### for
# sequential names.
_BASE_INSTANCE_NAME_REGEX = r"[a-z](([-a-z0-9]{0,57})|([-a-z0-9]{0,51}-#{1,10}(\[[0-9]{1,10}\])?))"


@dataclasses.dataclass
class ManagedGroup:
    """A zonal managed instance group: its resource, and what its manager does that only ``status`` shows."""

    resource: dict[str, Any]
    template: dict[str, Any]
    """The instance template at the MIG's insert (a template cannot be changed, only replaced)."""
    members: dict[str, int | None]
    """Each instance the MIG keeps (by name, fixed at insert) -> its worker id in the slice (None: no slice)."""
    bulk: bool
    topology: str | None
    creating: bool = False
    """The insert's operation is DONE: from then on the manager creates the instances, asynchronously."""
    deleting: bool = False
    created: dict[str, str] = dataclasses.field(default_factory=dict)
    """Instance name -> the id of the instance the MIG made under it (a bulk MIG makes them once)."""
    next_check: float = 0.0
    last_check: float | None = None
    bulk_error: OperationError | None = None
    all_running_since: float | None = None
    """When every member was last seen RUNNING together (the topology activates from then on); None: not all."""
    member_errors: dict[str, OperationError] = dataclasses.field(default_factory=dict)
    """Why the last attempt to create each instance failed (a MIG without bulk mode creates them one by one)."""


def _camel(enum_value: str) -> str:
    """An enum value as the status field that counts it (``PENDING_STOP`` -> ``pendingStop``)."""
    first, *rest = enum_value.lower().split("_")
    return first + "".join(word.title() for word in rest)


def _member_names(base: str, count: int) -> list[str]:
    """The names a MIG gives its instances (the v1 reference, ``InstanceGroupManager.baseInstanceName``).

    "vm-###" gives vm-001, vm-002, ...; any other base a hyphen and a random four-character string. The
    reference's pattern also allows "vm-###[N]"; reading N as the first number is inferred (not documented)."""
    numbered = re.fullmatch(r"(.*-)(#+)(?:\[(\d+)\])?", base)
    if numbered:
        first = int(numbered[3] or 1)
        return [f"{numbered[1]}{n:0{len(numbered[2])}d}" for n in range(first, first + count)]
    names: set[str] = set()
    while len(names) < count:
        names.add(f"{base}-{''.join(secrets.choice('abcdefghijklmnopqrstuvwxyz0123456789') for _ in range(4))}")
    return sorted(names)


class InstanceGroupsMixin:
    """Managed instance groups (``_groups``, and ``_deleted_groups`` whose references linger)."""

    def _slice_group(self, key: tuple[str, str, str]) -> ManagedGroup | None:
        """The slice (a MIG with a topology) whose VM ``key`` (project, zone, name) is; None: not a slice's."""
        project, zone, name = key
        for (group_project, group_zone, _), group in self._groups.items():
            if (group_project, group_zone) == (project, zone) and group.topology and name in group.members:
                return group
        return None

    def _referring_groups(self) -> list[tuple[tuple[str, str, str], ManagedGroup]]:
        """The groups whose template and policy are in use: the live ones, and those deleted a moment ago."""
        now = time.time()
        self._deleted_groups = [entry for entry in self._deleted_groups if entry[0] > now]
        return [*self._groups.items(), *((key, group) for _, key, group in self._deleted_groups)]

    @staticmethod
    def _group_policy_key(project: str, zone: str, group: dict[str, Any]) -> tuple[str, str, str] | None:
        """(project, region, name) of a MIG's workload policy: a full or partial URL, or a name in its region."""
        ref = ((group.get("resourcePolicies") or {}).get("workloadPolicy") or "").split("/compute/v1/")[-1]
        if not ref:
            return None
        parts = re.fullmatch(r"(?:(?:projects/([^/]+)/)?regions/([^/]+)/resourcePolicies/)?([^/]+)", ref)
        if parts is None:
            return (project, zone.rsplit("-", 1)[0], ref)
        return (parts[1] or project, parts[2] or zone.rsplit("-", 1)[0], parts[3])

    def _group_template(self, project: str, group: dict[str, Any]) -> dict[str, Any]:
        """The MIG's instance template (``instanceTemplate``: a full or partial URL); 404 as for a missing network.

        Regional instance templates are not served."""
        ref = (group.get("instanceTemplate") or "").split("/compute/v1/")[-1]
        if not ref:
            raise api.ApiError(400, "required", "Required field 'resource.instanceTemplate' not specified")
        parts = re.fullmatch(r"(?:(?:projects/([^/]+)/)?global/instanceTemplates/)?([^/]+)", ref)
        owner, name = (parts[1] or project, parts[2]) if parts else (project, ref)
        template = self._instance_templates.get((owner, name))
        if template is None:
            raise api.not_found(api.resource_path(owner, None, "instanceTemplates", name))
        return template

    def _check_group(self, project: str, zone: str, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        """Refuse a MIG Compute would refuse; its template and the slice's accelerator topology (None: no slice).

        Cited: a workload policy is required for a multi-host TPU slice (about-workload-policies); bulk mode only
        with the reservation-bound and flex-start models, and flex-start only with
        ``defaultActionOnFailure: DO_NOTHING`` (about-bulk-mode); no placement policy in the template beside a
        workload policy (the A4X how-to's MIG limitations). Inferred, each the stricter choice: that a MIG of
        several ct6e-standard-4t VMs without a policy naming a topology is refused (this emulator cannot tell a
        pool of independent v6e-4 VMs from a slice missing its policy, so it refuses both), that the topology must
        be one of v6e's slice shapes (cloud.google.com/tpu/docs/v6e) with ``targetSize`` its VM count (or 0, to
        be resized later), that the policy be HIGH_THROUGHPUT and in the MIG's region, and the texts of these
        refusals."""
        api.check_insert("InstanceGroupManager", body)
        base = body.get("baseInstanceName")
        if not base:
            raise api.ApiError(400, "required", "Required field 'resource.baseInstanceName' not specified")
        if not re.fullmatch(_BASE_INSTANCE_NAME_REGEX, base):
            raise api.ApiError(
                400, "invalid", f"Invalid value for field 'resource.baseInstanceName': '{base}'. Must be a match of "
                f"regex '{_BASE_INSTANCE_NAME_REGEX}'"
            )
        size = body.get("targetSize")
        if size is None:
            raise api.ApiError(400, "required", "Required field 'resource.targetSize' not specified")
        if int(size) < 0:
            raise api.ApiError(
                400, "invalid", f"Invalid value for field 'resource.targetSize': '{size}'. Must be >= 0."
            )
        size = int(size)
        template = self._group_template(project, body)
        properties = template["properties"]
        policy_key = self._group_policy_key(project, zone, body)
        policy = None
        if policy_key is not None:
            policy = self._resource_policies.get(policy_key)
            policy_path = api.resource_path(policy_key[0], None, "resourcePolicies", policy_key[2], policy_key[1])
            if policy is None:
                raise api.not_found(policy_path)
            if policy_key[1] != zone.rsplit("-", 1)[0]:
                raise api.ApiError(
                    400, "invalid", f"Invalid value for field 'resource.resourcePolicies.workloadPolicy': "
                    f"'{policy_path}'. The workload policy must be in the region of zone '{zone}'."
                )
            if properties.get("resourcePolicies"):
                raise api.ApiError(
                    400, "invalid", "Invalid value for field 'resource.instanceTemplate': the instance template has "
                    "resource policies; a MIG with a workload policy cannot use a template with a placement policy."
                )
        workload = (policy or {}).get("workloadPolicy") or {}
        topology = workload.get("acceleratorTopology")
        machine_type = properties["machineType"].rsplit("/", 1)[-1]
        invalid_policy = "Invalid value for field 'resource.resourcePolicies.workloadPolicy'"
        if topology:
            vm_count = SLICE_VMS.get(topology, 0)
            if machine_type != SLICE_MACHINE_TYPE or not vm_count or workload.get("type") != "HIGH_THROUGHPUT":
                raise api.ApiError(
                    400, "invalid", f"{invalid_policy}: accelerator topology '{topology}' is not a multi-host "
                    f"slice of {machine_type} VMs (a HIGH_THROUGHPUT policy of {', '.join(SLICE_VMS)} "
                    f"for {SLICE_MACHINE_TYPE})."
                )
            if size not in (0, vm_count):
                raise api.ApiError(
                    400, "invalid", f"Invalid value for field 'resource.targetSize': '{size}'. Accelerator topology "
                    f"'{topology}' takes {vm_count} VMs of {SLICE_MACHINE_TYPE} ({SLICE_CHIPS_PER_VM} chips each)."
                )
        elif machine_type == SLICE_MACHINE_TYPE and size > 1:
            raise api.ApiError(
                400, "invalid", f"{invalid_policy}: ''. A MIG of {size} {machine_type} VMs is a multi-host TPU slice "
                "and needs a workload policy with an accelerator topology."
            )
        if (body.get("targetSizePolicy") or {}).get("mode") == "BULK":
            model = (properties.get("scheduling") or {}).get("provisioningModel", "STANDARD")
            if model not in BULK_PROVISIONING_MODELS:
                raise api.ApiError(
                    400, "invalid", "Invalid value for field 'resource.targetSizePolicy.mode': 'BULK'. Bulk mode "
                    f"supports only the {' and '.join(BULK_PROVISIONING_MODELS)} provisioning models; the instance "
                    f"template's is {model}."
                )
            on_failure = (body.get("instanceLifecyclePolicy") or {}).get("defaultActionOnFailure", "REPAIR")
            if model == "FLEX_START" and on_failure != "DO_NOTHING":
                raise api.ApiError(
                    400, "invalid", "Invalid value for field 'resource.instanceLifecyclePolicy.defaultActionOnFailure'"
                    f": '{on_failure}'. Bulk mode with flex-start VMs needs DO_NOTHING."
                )
        return template, topology

    def _insert_group(self, query: dict, body: dict, project: str, zone: str):
        """``instanceGroupManagers.insert``: its operation is DONE before any instance exists.

        "This operation is marked as DONE when the group is created even if the instances in the group have not
        yet been created" (its v1 reference). The MIG then creates them, all at once or none in bulk mode ("the
        MIG waits for the full capacity ... doesn't create any instance until Compute Engine has capacity for the
        specified target size": cloud.google.com/compute/docs/instance-groups/about-bulk-mode)."""
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            template, topology = self._check_group(project, zone, body)
            name = body["name"]
            path = api.resource_path(project, zone, "instanceGroupManagers", name)
            if (project, zone, name) in self._groups:
                raise api.already_exists(path)
            size = int(body["targetSize"])
            if topology and size and self.local_slice_vms is not None:  # the local stand-in's N VMs (see __init__)
                size = min(size, self.local_slice_vms)
            names = _member_names(body["baseInstanceName"], size)
            # Each VM of a slice learns its worker id from its metadata server. Which key Google sets on a MIG's TPU
            # VMs is not documented: JAX reads `agent-worker-number` from the metadata server (Cloud TPU API VMs); a
            # public report of MIG-made TPU7x VMs shows `worker-id` (issue 31's research, §1.3). This emulator tells
            # `worker-id` only, and only to the VM itself (guest_attribute): not in what `instances.get` shows.
            # Worker ids follow the slice's hosts, not the names (no Google page says name order is worker order),
            # so they are dealt at random here: a client must read them.
            worker_ids: list[int | None] = list(range(len(names))) if topology else [None] * len(names)
            secrets.SystemRandom().shuffle(worker_ids)
            group = {
                "targetSizePolicy": {"mode": "INDIVIDUAL"},
                **copy.deepcopy(body),
                "kind": "compute#instanceGroupManager",
                "id": api.numeric_id(),
                "instanceTemplate": template["selfLink"],
                "instanceGroup": f"{api.API_ROOT}/{api.resource_path(project, zone, 'instanceGroups', name)}",
                "zone": f"{api.API_ROOT}/projects/{project}/zones/{zone}",
                "selfLink": f"{api.API_ROOT}/{path}",
                "creationTimestamp": api.timestamp(time.time()),
                "fingerprint": secrets.token_urlsafe(8),
            }
            group["targetSize"] = size
            managed = ManagedGroup(
                group,
                template,
                dict(zip(names, worker_ids, strict=True)),
                bulk=group["targetSizePolicy"].get("mode") == "BULK",
                topology=topology,
            )
            self._groups[(project, zone, name)] = managed

            def on_done(failed: bool) -> None:
                managed.creating = True

            return 200, self._start_operation(project, zone, "insert", group, query, on_done=on_done)

    def _member(self, project: str, zone: str, group: ManagedGroup, name: str) -> dict[str, Any] | None:
        """The live instance the MIG made under ``name`` (None: not made yet, or deleted since)."""
        instance = self._instances.get((project, zone, name))
        return instance if instance is not None and group.created.get(name) == instance["id"] else None

    def _member_body(self, project: str, zone: str, group: ManagedGroup, name: str) -> dict[str, Any]:
        """The insert body of the MIG's instance ``name``.

        Its template's properties, its name, and the metadata a MIG adds to its VMs: ``created-by`` (the MIG's
        path) and ``instance-template`` (the keys seen on MIG VMs; no Google page was re-read for them here). A
        slice VM's worker id is not among them: only its metadata server tells it (:meth:`guest_attribute`)."""
        body = copy.deepcopy(group.template["properties"])
        body.pop("resourceManagerTags", None)  # an instance takes those under params, not as a field
        body["name"] = name
        body["machineType"] = f"zones/{zone}/machineTypes/{body['machineType'].rsplit('/', 1)[-1]}"
        added = {
            "created-by": api.resource_path(project, zone, "instanceGroupManagers", group.resource["name"]),
            "instance-template": group.template["selfLink"],
        }
        metadata = body.setdefault("metadata", {})
        metadata["items"] = [item for item in metadata.get("items") or [] if item.get("key") not in added] + [
            {"key": key, "value": value} for key, value in added.items()
        ]
        return body

    def _creation_failure(self, project: str, zone: str, bodies: list[dict[str, Any]]) -> OperationError | None:
        """Why the instances of ``bodies`` cannot all be created now.

        What an insert of each would refuse (its 400/403/404, as an error code of the kind an operation reports:
        modelled), a name taken, or what their inserts would fail on (quota, reservation, stock-out) with all of
        them counted at once."""
        codes = {
            "invalid": "INVALID_FIELD_VALUE", "notFound": "RESOURCE_NOT_FOUND", "quotaExceeded": "QUOTA_EXCEEDED"
        }
        for body in bodies:
            try:
                self._check_instance(project, zone, body)
            except api.ApiError as refused:
                reason = refused.body["error"]["errors"][0]["reason"]
                return OperationError(codes.get(reason, reason), str(refused), refused.status, "")
            if (project, zone, body["name"]) in self._instances:
                path = api.resource_path(project, zone, "instances", body["name"])
                return OperationError("RESOURCE_ALREADY_EXISTS", f"The resource '{path}' already exists", 409, "")
        return self._insert_failure(project, zone, bodies[0], adding=len(bodies))

    def _advance_groups(self, now: float) -> None:
        """Let each MIG create its missing instances (call with the lock held from ``_advance``).

        A bulk MIG checks for all of them at once and creates all or none, and creates them once: an instance lost
        later (deleted, or preempted with a DELETE action) is not recreated (about-bulk-mode: a bulk MIG adds
        instances only at target size 0 and removes them only by resizing to 0; that none is recreated is
        inferred), so its slice stays short. Any other
        MIG creates each one that fits and retries the rest, as a MIG keeps its target size. How often Google
        retries is not documented: here every ``operation_seconds``."""
        if self._creating_members:
            return
        self._creating_members = True
        try:
            for (project, zone, _), group in list(self._groups.items()):
                made_once = group.bulk and group.created
                if not group.creating or group.deleting or now < group.next_check or made_once:
                    continue
                missing = [name for name in group.members if self._member(project, zone, group, name) is None]
                if not missing:
                    continue
                group.next_check = now + self._faults.operation_seconds
                bodies = [self._member_body(project, zone, group, name) for name in missing]
                if group.bulk:
                    group.last_check = now
                    group.bulk_error = self._creation_failure(project, zone, bodies)
                    for body in [] if group.bulk_error else bodies:
                        self._create_member(project, zone, group, body)
                    continue
                for body in bodies:  # each checked after those before it are created: they count
                    error = self._creation_failure(project, zone, [body])
                    if error is None:
                        group.member_errors.pop(body["name"], None)
                        self._create_member(project, zone, group, body)
                    else:
                        group.member_errors[body["name"]] = error
        finally:
            self._creating_members = False

    def _create_member(self, project: str, zone: str, group: ManagedGroup, body: dict[str, Any]) -> None:
        operation = self._create_instance(project, zone, body, {})
        group.created[body["name"]] = operation["targetId"]

    def _member_action(self, group: ManagedGroup, instance: dict[str, Any] | None) -> str:
        """What the MIG is doing to one of its instances (``ManagedInstance.currentAction``)."""
        if instance is None:
            awaited = not group.deleting and not (group.bulk and group.created)
            return "CREATING" if awaited else "NONE"
        if group.deleting:
            return "DELETING"
        return "CREATING" if instance["status"] in ("PENDING", "PROVISIONING", "STAGING") else "NONE"

    def _group_view(self, project: str, zone: str, group: ManagedGroup) -> dict[str, Any]:
        """The MIG's resource with its ``currentActions`` and ``status`` as of now (call with the lock held).

        ``isStable`` is false until every instance runs with no action pending, and false again when one is lost:
        a MIG short of its target size is not "stable" in the reference's sense for a slice (inferred; the
        stricter reading, so a client cannot take a slice missing a VM for a ready one)."""
        view = copy.deepcopy(group.resource)
        members = {name: self._member(project, zone, group, name) for name in group.members}
        actions = dict.fromkeys(map(_camel, compute_schema.enum_values("ManagedInstance", "currentAction")), 0)
        statuses: dict[str, int] = {}
        for instance in members.values():
            actions[_camel(self._member_action(group, instance))] += 1
            state = _camel(instance["status"]) if instance is not None else "nonExistent"
            statuses[state] = statuses.get(state, 0) + 1
        running = statuses.get("running", 0)
        creating = actions["creating"] > 0
        now = time.time()
        if running != len(members):
            group.all_running_since = None
        elif group.all_running_since is None:
            group.all_running_since = now
        settle = self._faults.topology_activation_seconds
        settle = self._faults.operation_seconds if settle is None else settle
        activated = group.all_running_since is not None and now >= group.all_running_since + settle
        status: dict[str, Any] = {
            "isStable": group.creating and not group.deleting and activated and actions["none"] == len(members),
            "currentInstanceStatuses": statuses,  # "Currently only shown for TPU MIGs" (the v1 reference)
        }
        # Shown once the manager made its first progress check (not at the insert): inferred, the stricter reading.
        if group.bulk and (group.last_check is not None or group.created):
            # In progress until the whole slice is created and running (its instances' creation is part of it).
            in_progress = not group.deleting and running < len(members) and (not group.created or creating)
            check: dict[str, Any] = {}
            if group.last_check is not None:
                check["timestamp"] = api.timestamp(group.last_check)
            if group.bulk_error is not None:
                error = group.bulk_error
                check["error"] = {"errors": [{"code": error.code, "message": error.message}]}
            status["bulkInstanceOperation"] = {
                "inProgress": in_progress,
                **({"lastProgressCheck": check} if check else {}),
            }
        if group.topology:
            if group.deleting:
                state = "DEACTIVATING"
            elif activated:
                state = "ACTIVE"
            elif creating or running == len(members):
                state = "ACTIVATING"
            else:  # "cannot be activated due to insufficient number of running VMs" (the v1 reference)
                state = "INCOMPLETE"
            applied: dict[str, Any] = {"acceleratorTopology": group.topology, "state": state}
            settled = self._faults.settled_topology
            if state == "ACTIVE" and settled is not None:
                applied["state"], message = settled
                if message is not None:
                    error = {"code": "ACCELERATOR_TOPOLOGY_ERROR", "message": message}  # no code Google documents
                    applied["stateDetails"] = {"error": {"errors": [error]}, "timestamp": api.timestamp(now)}
                status["isStable"] = settled[0] != "REACTIVATING" and status["isStable"]
            status["appliedAcceleratorTopologies"] = [applied]
        view["currentActions"] = actions
        view["status"] = status
        return view

    def _existing_group(self, project: str, zone: str, name: str) -> ManagedGroup:
        group = self._groups.get((project, zone, name))
        if group is None:
            raise api.not_found(api.resource_path(project, zone, "instanceGroupManagers", name))
        return group

    def _get_group(self, query: dict, body: dict, project: str, zone: str, name: str):
        with self._lock:
            self._advance()
            return 200, self._group_view(project, zone, self._existing_group(project, zone, name))

    def _list_groups(self, query: dict, body: dict, project: str, zone: str):
        terms = api.parse_filter(query.get("filter", ""))
        with self._lock:
            self._advance()
            views = [
                self._group_view(project, zone, group)
                for (group_project, group_zone, _), group in self._groups.items()
                if (group_project, group_zone) == (project, zone)
            ]
        items = [view for view in views if api.matches(view, terms)]
        return api.list_response(
            "compute#instanceGroupManagerList", f"projects/{project}/zones/{zone}/instanceGroupManagers", items
        )

    def _list_managed_instances(self, query: dict, body: dict, project: str, zone: str, name: str):
        """``listManagedInstances`` (a POST with no body): every instance the MIG keeps, made or not.

        With the errors of the last attempt to create it ("If a previous action failed, the list displays the
        errors": its v1 reference). The bulk check's error is shown on each instance it kept from being created."""
        with self._lock:
            self._advance()
            group = self._existing_group(project, zone, name)
            listed = []
            for member in group.members:
                instance = self._member(project, zone, group, member)
                entry: dict[str, Any] = {
                    "instance": f"{api.API_ROOT}/{api.resource_path(project, zone, 'instances', member)}",
                    "name": member,
                    "currentAction": self._member_action(group, instance),
                }
                if instance is not None:
                    entry.update(id=instance["id"], instanceStatus=instance["status"])
                error = group.member_errors.get(member) or (group.bulk_error if instance is None else None)
                if error is not None:
                    entry["lastAttempt"] = {"errors": {"errors": [{"code": error.code, "message": error.message}]}}
                listed.append(entry)
        return 200, {"managedInstances": listed} if listed else {}

    def _delete_group(self, query: dict, body: dict, project: str, zone: str, name: str):
        """``instanceGroupManagers.delete``, in one operation; the group is gone when it is DONE.

        "Deletes the specified managed instance group and all of the instances in that group" (its v1 reference)."""
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            key = (project, zone, name)
            group = self._existing_group(project, zone, name)
            if group.deleting:
                path = api.resource_path(project, zone, "instanceGroupManagers", name)
                raise api.ApiError(400, "resourceNotReady", f"The resource '{path}' is not ready")
            group.deleting = True
            members = {
                member: instance
                for member in group.members
                if (instance := self._member(project, zone, group, member)) is not None
            }
            statuses_before = {member: instance["status"] for member, instance in members.items()}
            for member, instance in members.items():
                instance["status"] = "STOPPING"
                self._run_deadlines.pop((project, zone, member), None)

            def on_done(failed: bool) -> None:
                if failed:
                    group.deleting = False
                    for member, instance in members.items():
                        if self._instances.get((project, zone, member)) is instance:
                            instance["status"] = statuses_before[member]
                    return
                for member, instance in members.items():
                    if self._instances.get((project, zone, member)) is instance:
                        self._remove_instance((project, zone, member))
                if self._groups.get(key) is group:
                    del self._groups[key]
                    linger = self._faults.references_linger_seconds
                    linger = 3 * self._faults.operation_seconds if linger is None else linger
                    self._deleted_groups.append((time.time() + linger, key, group))

            failure = FAILED_DELETE if self._faults.fail_deletes else None
            return 200, self._start_operation(
                project, zone, "delete", group.resource, query, failure, on_done=on_done
            )

    def _aggregated_groups(self, query: dict, body: dict, project: str):
        """``instanceGroupManagers.aggregatedList``: the project's MIGs of every zone, keyed ``zones/<zone>``."""
        with self._lock:
            self._advance()
            found = [
                (f"zones/{zone}", self._group_view(p, zone, group))
                for (p, zone, _), group in self._groups.items()
                if p == project
            ]
            return api.aggregated_response("instanceGroupManager", "instanceGroupManagers", project, found, query)
