"""Compute Engine VM instances: insert, get, list, aggregatedList, delete, and what befalls a running VM.

Google's behaviour: the v1 reference of ``instances``
(https://cloud.google.com/compute/docs/reference/rest/v1/instances: insert, get, list, aggregatedList, delete), the
instance lifecycle (PENDING or PROVISIONING -> STAGING -> RUNNING -> STOPPING -> TERMINATED:
https://cloud.google.com/compute/docs/instances/instance-lifecycle), labels
(https://cloud.google.com/compute/docs/labeling-resources), metadata limits (the reference's ``Metadata``), machine
types by zone (https://cloud.google.com/tpu/docs/regions-zones), Spot VMs' preemption
(https://cloud.google.com/compute/docs/instances/spot), ``scheduling.maxRunDuration``
(https://cloud.google.com/compute/docs/instances/limit-vm-runtime) and flex-start VMs
(https://cloud.google.com/compute/docs/instances/about-flex-start-vms). Where a text or rule comes from a public
capture instead, its method says so.

With a :class:`~airflow_tpu_posttrain.local.fleet.LocalFleet`, every instance is a machine of its own (an address, an
sshd with fresh host keys that trusts only the instance's ``ssh-keys``, a disk), booted when the instance turns
RUNNING and ended with it.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any

from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.compute_emulator.faults import FAILED_DELETE
from airflow_tpu_posttrain.local.compute_emulator.operations import OperationError
from airflow_tpu_posttrain.recipes.accelerators import ACCELERATORS

# The machine types this emulator's zones offer: those of the accelerators the pipelines create (any other name
# is refused as Compute refuses a machine type a zone does not have).
KNOWN_MACHINE_TYPES = frozenset(acc.machine_type for acc in ACCELERATORS.values())
TPU_MACHINE_TYPES = frozenset(acc.machine_type for acc in ACCELERATORS.values() if acc.is_tpu)
# The zones that sell TPU v6e (the ct6e-standard-* machine types): cloud.google.com/tpu/docs/regions-zones, its
# North America and Europe rows (read 2026-12-02). Its Asia Pacific and South America rows were not captured, so
# their zones are refused here: stricter than Compute, never kinder.
V6E_ZONES = frozenset(
    {"us-central1-ai1", "us-central1-b", "us-east1-d", "us-east5-a", "us-east5-b", "us-south1-ai1b", "europe-west4-a"}
)


# The public image families the pipelines boot (gce-tpu.md: the tutorials' TPU image; Ubuntu 22.04 for the CPU
# VM); any other family is refused, as Compute refuses one that does not exist.
KNOWN_IMAGE_FAMILIES = frozenset(
    {
        "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
        "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts",
    }
)


def _check_boot_image(body: dict[str, Any]) -> None:
    """Compute refuses an image that does not exist, with this text (captured from gcloud's output)."""
    for i, disk in enumerate(body.get("disks") or []):
        image = (disk.get("initializeParams") or {}).get("sourceImage")
        if image and image.split("/compute/v1/")[-1] not in KNOWN_IMAGE_FAMILIES:
            raise api.ApiError(
                400, "invalid", f"Invalid value for field 'resource.disks[{i}].initializeParams.sourceImage': "
                f"'{image}'. The referenced image resource cannot be found."
            )


def _stockout(project: str, zone: str) -> OperationError:
    return OperationError(
        code="ZONE_RESOURCE_POOL_EXHAUSTED",
        message=f"The zone 'projects/{project}/zones/{zone}' does not have enough resources "
        "available to fulfill the request. Try a different zone, or try again later.",
        http_status=503,
        http_message="SERVICE UNAVAILABLE",
    )


def _is_tpu(instance: dict[str, Any]) -> bool:
    return instance["machineType"].rsplit("/", 1)[-1] in TPU_MACHINE_TYPES


def _is_queued_flex_start(instance: dict[str, Any]) -> bool:
    """A FLEX_START request still waiting for capacity: the one insert a delete may cancel before it ends."""
    waits = bool(((instance.get("params") or {}).get("requestValidForDuration") or {}).get("seconds"))
    flex_start = (instance.get("scheduling") or {}).get("provisioningModel") == "FLEX_START"
    return instance["status"] == "PENDING" and waits and flex_start


class InstancesMixin:
    """Instances (``_instances``), their run deadlines (``_run_deadlines``) and preemptions (``_preemptions``)."""

    def instances(self) -> list[dict[str, Any]]:
        with self._lock:
            self._advance()
            return copy.deepcopy(list(self._instances.values()))

    def _instance_keys(self, zone: str, name: str, project: str | None) -> list[tuple[str, str, str]]:
        """The keys of the instance ``name`` in ``zone`` (of ``project``, or any); call with the lock held."""
        self._advance()
        keys = [key for key in self._instances if key[1:] == (zone, name) and project in (None, key[0])]
        if not keys:
            raise KeyError(f"no instance {name!r} in zone {zone!r}")
        return keys

    def set_instance_status(self, zone: str, name: str, status: str, project: str | None = None) -> None:
        """Force an instance's status, e.g. TERMINATED after a host error or preemption (its machine stops)."""
        with self._lock:
            for key in self._instance_keys(zone, name, project):
                self._instances[key]["status"] = status
                if status != "RUNNING":
                    self._run_deadlines.pop(key, None)
                    if self.fleet is not None:
                        self.fleet.end(key)

    def preempt(self, zone: str, name: str, project: str | None = None) -> None:
        """Preempt a RUNNING instance as Compute does a Spot VM's (or a host error any VM's).

        STOPPING at once, its machine ended (every process, sshd included); ``operation_seconds`` later
        TERMINATED, or gone for a Spot VM whose ``instanceTerminationAction`` is DELETE ("Compute Engine stops or
        deletes the VM depending on its termination action": cloud.google.com/compute/docs/instances/spot)."""
        with self._lock:
            for key in self._instance_keys(zone, name, project):
                if self._instances[key]["status"] != "RUNNING":
                    raise ValueError(f"{name} is {self._instances[key]['status']}, not RUNNING")
                self._instances[key]["status"] = "STOPPING"
                self._run_deadlines.pop(key, None)
                self._preemptions[key] = time.time() + self._faults.operation_seconds
                if self.fleet is not None:
                    self.fleet.end(key)

    def _advance_instances(self, now: float) -> None:
        """End the preemptions and run durations due by ``now`` (call with the lock held, from ``_advance``)."""
        for key, deadline in list(self._preemptions.items()):
            if now >= deadline:
                del self._preemptions[key]
                scheduling = (self._instances.get(key) or {}).get("scheduling") or {}
                if scheduling.get("provisioningModel") == "SPOT" and scheduling.get(
                    "instanceTerminationAction"
                ) == "DELETE":
                    self._remove_instance(key)
                elif key in self._instances:
                    self._instances[key]["status"] = "TERMINATED"
        for key, (deadline, termination_action) in list(self._run_deadlines.items()):
            if now >= deadline:
                if termination_action == "STOP":
                    self._instances[key]["status"] = "TERMINATED"
                    del self._run_deadlines[key]
                else:
                    self._remove_instance(key)

    def _fail_pending_insert(self, instance: dict[str, Any]) -> None:
        """End the unfinished insert of ``instance``, deleted before it was created, with an error.

        Compute answers such an insert's operation with 409 CONFLICT (piercefreeman/cloud-gpu-reliability#5:
        "The GCE API will return a 409 CONFLICT error on the operation result if the instance is deleted while
        it's in CREATING state"); the error's code and message are not captured publicly: modelled here."""
        now = time.time()
        for operation in self._operations.values():
            resource = operation.resource
            if resource["targetId"] == instance["id"] and resource["operationType"] == "insert":
                if resource["status"] != "DONE":
                    operation.failure = OperationError(
                        code="RESOURCE_NOT_FOUND",
                        message=f"The resource '{instance['selfLink']}' was deleted before its creation ended.",
                        http_status=409,
                        http_message="CONFLICT",
                    )
                    operation.start_at = min(operation.start_at, now)
                    operation.done_at = now

    def _insert_instance(self, query: dict, body: dict, project: str, zone: str):
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            self._check_instance(project, zone, body)
            key = (project, zone, body["name"])
            if key in self._instances:
                raise api.already_exists(api.resource_path(project, zone, "instances", body["name"]))
            return 200, self._create_instance(project, zone, body, query)

    def _check_instance(self, project: str, zone: str, body: dict[str, Any]) -> None:
        """Refuse (``api.ApiError``) what Compute refuses in an instance insert's body, in its order."""
        api.check_schema("Instance", body)
        scheduling = body.get("scheduling") or {}
        model = scheduling.get("provisioningModel")
        if "maxRunDuration" in scheduling and model in self._faults.refuse_max_run_duration:
            raise api.ApiError(
                400,
                "invalid",
                "Invalid value for field 'resource.scheduling.maxRunDuration': "
                f"'{scheduling['maxRunDuration'].get('seconds')}s'. maxRunDuration is not supported for the "
                f"{model} provisioning model.",
            )
        name = body.get("name")
        if not name:
            raise api.ApiError(400, "required", "Required field 'resource.name' not specified")
        api.check_name(name)
        self._check_machine_type(zone, body.get("machineType"))
        _check_boot_image(body)
        self._check_labels(body.get("labels") or {})
        self._check_metadata((body.get("metadata") or {}).get("items") or [])
        if zone in self._faults.quota_refused_zones:
            raise api.ApiError(
                403, "quotaExceeded",
                f"Quota 'TPU_V6E_CHIPS' exceeded.  Limit: 0.0 in region {zone.rsplit('-', 1)[0]}.",
            )
        self._check_network_interface(project, body)

    def _create_instance(self, project: str, zone: str, body: dict[str, Any], query: dict[str, str]) -> dict[str, Any]:
        """Create the instance of a checked ``body`` and start its insert operation (call with the lock held).

        The instance goes PENDING/PROVISIONING -> STAGING -> RUNNING (booted in the fleet) unless its insert
        fails, which leaves no instance."""
        key = (project, zone, body["name"])
        instance = self._new_instance(project, zone, api.resource_path(project, zone, "instances", key[2]), body)
        self._instances[key] = instance

        def on_running() -> None:
            if failure is None and instance["status"] in ("PENDING", "PROVISIONING"):
                instance["status"] = "STAGING"

        def on_done(failed: bool) -> None:
            if self._instances.get(key) is not instance:
                return  # deleted meanwhile
            if failed:
                # A failed insert leaves no instance: after a stock-out Compute answers 404 for it
                # (googleapis/nodejs-compute#377) and lists none (kelseyhightower/kubernetes-the-hard-way#448).
                self._remove_instance(key)
            elif instance["status"] in ("PROVISIONING", "STAGING"):
                instance["status"] = "RUNNING"
                instance["lastStartTimestamp"] = api.timestamp(time.time())  # billing starts (Compute's field)
                self._schedule_max_run_duration(key, instance)
                if self.fleet is not None:
                    self.fleet.boot(
                        key,
                        instance,
                        self.guest_oslogin_url(project),
                        self.oslogin.usernames(),
                        self._egress(project, zone, instance),
                        metadata_port=self._server.server_address[1],
                        slice_worker=self._slice_group(key) is not None,
                    )

        failure = self._insert_failure(project, zone, body)
        queued_s = None
        wait_s = ((body.get("params") or {}).get("requestValidForDuration") or {}).get("seconds")
        if failure is None and wait_s and body["scheduling"].get("provisioningModel") == "FLEX_START":
            # Queued in Dynamic Workload Scheduler: PENDING until capacity comes, or the insert fails
            # when the wait time ends first ("If resources aren't available, then the VM creation request
            # fails": cloud.google.com/compute/docs/instances/about-flex-start-vms). No public capture of
            # that error's code: modelled as the zone's stock-out.
            instance["status"] = "PENDING"
            capacity_after = self._faults.flex_start_capacity_after or 0.0
            queued_s = min(capacity_after, float(wait_s))
            if capacity_after > float(wait_s):
                failure = _stockout(project, zone)
        return self._start_operation(
            project,
            zone,
            "insert",
            instance,
            query,
            failure,
            on_running=on_running,
            on_done=on_done,
            queued_s=queued_s,
        )

    @staticmethod
    def _check_labels(labels: dict[str, str]) -> None:
        """Compute's label rules (cloud.google.com/compute/docs/labeling-resources).

        At most 64 per resource; keys start with a lowercase letter; keys and values <= 63 of lowercase
        letters, digits, '_' and '-'. A bad value's text is Compute's, as captured in public issues (e.g.
        oap-project/cloudtik#14); the count's is not public, so it says the documented limit."""
        invalid = "Invalid value for field 'resource.labels': ''."
        if len(labels) > 64:
            raise api.ApiError(
                400, "invalid", f"{invalid} {len(labels)} labels given; a resource can have at most 64 labels."
            )
        allowed = "can only contain lowercase letters, numeric characters, underscores and dashes"
        for key, value in labels.items():
            for kind, text, pattern, rule in (
                ("key", key, r"[a-z][a-z0-9_-]{0,62}", f"The key must start with a lowercase character, {allowed}"),
                ("value", value, r"[a-z0-9_-]{0,63}", f"The value {allowed}"),
            ):
                if not re.fullmatch(pattern, text):
                    raise api.ApiError(
                        400, "invalid", f"{invalid} Label {kind} '{text}' violates format constraints. {rule}. The "
                        f"{kind} can be at most 63 characters long. International characters are allowed."
                    )

    @staticmethod
    def _check_metadata(items: list[dict[str, str]]) -> None:
        """Compute's metadata rules (the v1 reference, ``Metadata.items``).

        Keys match ``[a-zA-Z0-9-_]+`` and are under 128 bytes, each value at most 262144 bytes (256 KiB), all
        keys and values under 512 KB, no key twice. The texts are modelled on Compute's field errors (no public
        capture of these)."""
        invalid = "Invalid value for field 'resource.metadata'"
        keys = [item.get("key", "") for item in items]
        for key in keys:
            if not re.fullmatch(r"[a-zA-Z0-9_-]+", key) or len(key.encode()) >= 128:
                raise api.ApiError(
                    400, "invalid", f"{invalid}: '{key}'. Metadata keys must match [a-zA-Z0-9-_]+ and be less "
                    "than 128 bytes long."
                )
        duplicated = sorted({key for key in keys if keys.count(key) > 1})
        if duplicated:
            raise api.ApiError(400, "invalid", f"{invalid}. Metadata has duplicate keys: {', '.join(duplicated)}.")
        for item in items:
            if len((item.get("value") or "").encode()) > 262144:
                raise api.ApiError(
                    400, "invalid", f"{invalid}: the value of '{item['key']}' is larger than 262144 bytes."
                )
        total = sum(len(item.get("key", "").encode()) + len((item.get("value") or "").encode()) for item in items)
        if total >= 512 * 1024:
            raise api.ApiError(
                400, "invalid", f"{invalid}: its keys and values total {total} bytes; the limit is 512 KB."
            )

    @staticmethod
    def _check_machine_type(zone: str, machine_type: str | None) -> None:
        """Compute requires a machine type that exists, in the zone; the error texts are Compute's.

        For example "Machine type with name 'n2-highcpu-16' does not exist in zone 'us-east4-a'."
        (servo/community-tc-config#75)."""
        if not machine_type:
            raise api.ApiError(400, "required", "Required field 'resource.machineType' not specified")
        name = machine_type.rsplit("/", 1)[-1]
        if name not in KNOWN_MACHINE_TYPES or (name.startswith("ct6e-") and zone not in V6E_ZONES):
            raise api.ApiError(
                400,
                "invalid",
                f"Invalid value for field 'resource.machineType': '{machine_type}'. "
                f"Machine type with name '{name}' does not exist in zone '{zone}'.",
            )

    def _new_instance(self, project: str, zone: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        instance = copy.deepcopy(body)
        instance.update(
            kind="compute#instance",
            id=api.numeric_id(),
            selfLink=f"{api.API_ROOT}/{path}",
            zone=f"{api.API_ROOT}/projects/{project}/zones/{zone}",
            # "Flex-start VMs with a wait time and TPU instances start instead in the PENDING state"
            # (cloud.google.com/compute/docs/instances/instance-lifecycle); other VMs in PROVISIONING.
            status="PENDING" if _is_tpu(body) else "PROVISIONING",
            creationTimestamp=api.timestamp(time.time()),
        )
        address = self.fleet.allocate((project, zone, body["name"])) if self.fleet else self._instance_ip
        interfaces = instance.setdefault("networkInterfaces", [{}])
        interfaces[0].update(networkIP=address, name="nic0")
        # Like the real API, only an interface that asked for an access config gets an external IP.
        for access_config in interfaces[0].get("accessConfigs", []):
            access_config.update(natIP=address, kind="compute#accessConfig")
        return instance

    def _insert_failure(
        self, project: str, zone: str, body: dict[str, Any], adding: int = 0
    ) -> OperationError | None:
        """Why inserting ``body`` fails once accepted: quota, its specific reservation, a stock-out.

        ``adding``: how many such instances are about to be created besides those already in ``_instances``
        (a bulk MIG asks for all of its instances before it creates any)."""
        faults = self._faults
        if zone in faults.quota_exceeded_zones:
            region = zone.rsplit("-", 1)[0]
            return OperationError(
                code="QUOTA_EXCEEDED",
                message=f"Quota 'TPU_V6E_CHIPS' exceeded.  Limit: 0.0 in region {region}.",
                http_status=403,
                http_message="FORBIDDEN",
            )
        affinity = body.get("reservationAffinity", {})
        if affinity.get("consumeReservationType") == "SPECIFIC_RESERVATION":
            failure = self._reservation_failure(project, zone, body, affinity.get("values", []), adding)
            if failure:
                return failure
        if zone in faults.stockout_zones:
            return _stockout(project, zone)
        return None

    def _schedule_max_run_duration(self, key: tuple[str, str, str], instance: dict[str, Any]) -> None:
        """Arm the cloud-side backstop of ``scheduling.maxRunDuration``."""
        scheduling = instance.get("scheduling", {})
        duration = scheduling.get("maxRunDuration")
        if not duration:
            return
        seconds = float(duration.get("seconds", 0)) + duration.get("nanos", 0) / 1e9
        deadline = time.time() + seconds * self._faults.max_run_duration_scale
        self._run_deadlines[key] = (deadline, scheduling.get("instanceTerminationAction", "DELETE"))

    def _remove_instance(self, key: tuple[str, str, str]) -> None:
        del self._instances[key]
        self._run_deadlines.pop(key, None)
        self._preemptions.pop(key, None)
        if self.fleet is not None:
            self.fleet.end(key)

    def _aggregated_instances(self, query: dict, body: dict, project: str):
        """``instances.aggregatedList``: the project's instances of every zone, keyed ``zones/<zone>``."""
        with self._lock:
            self._advance()
            found = [(f"zones/{zone}", i) for (p, zone, _), i in self._instances.items() if p == project]
            return api.aggregated_response("instance", "instances", project, found, query)

    def _list_instances(self, query: dict, body: dict, project: str, zone: str):
        terms = api.parse_filter(query.get("filter", ""))
        with self._lock:
            self._advance()
            items = api.matching(self._instances, (project, zone), terms)
        return api.list_response("compute#instanceList", f"projects/{project}/zones/{zone}/instances", items)

    def _get_instance(self, query: dict, body: dict, project: str, zone: str, name: str):
        with self._lock:
            self._advance()
            instance = self._instances.get((project, zone, name))
            if instance is None:
                raise api.not_found(api.resource_path(project, zone, "instances", name))
            return 200, copy.deepcopy(instance)

    def _delete_instance(self, query: dict, body: dict, project: str, zone: str, name: str):
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            key = (project, zone, name)
            instance = self._instances.get(key)
            if instance is None:
                raise api.not_found(api.resource_path(project, zone, "instances", name))
            # Compute refuses a delete while the instance is busy: its insert unfinished (a queued FLEX_START
            # request excepted: deleting it cancels it) or another delete under way. Seen in
            # googleapis/google-cloud-java#9312 and GoogleCloudPlatform/compute-image-tools#542.
            busy = any(
                op.resource["targetId"] == instance["id"] and op.resource["status"] != "DONE"
                for op in self._operations.values()
            )
            if instance["status"] == "STOPPING" or (busy and not _is_queued_flex_start(instance)):
                raise api.ApiError(
                    400,
                    "resourceNotReady",
                    f"The resource '{api.resource_path(project, zone, 'instances', name)}' is not ready",
                )
            if busy:  # a queued FLEX_START request, cancelled: its insert ends with an error at once
                self._fail_pending_insert(instance)
            status_before = instance["status"]
            instance["status"] = "STOPPING"

            def on_done(failed: bool) -> None:
                if self._instances.get(key) is not instance:
                    return
                if failed:
                    instance["status"] = status_before
                else:
                    self._remove_instance(key)

            failure = FAILED_DELETE if self._faults.fail_deletes else None
            return 200, self._start_operation(
                project, zone, "delete", instance, query, failure, on_done=on_done
            )
