"""A multi-host TPU slice's create, run from the triggerer: every VM of it ready, or none left.

The slice is the three resources of ``recipes/slices.py``; this trigger makes them, waits on the group's own
account of its VMs (``slices.slice_state``) and then on each VM's host keys and sshd, as the single VM's create
(``triggers/create.py``) waits on one.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import TriggerEvent

from airflow_tpu_posttrain.recipes import access, capacity, compute, slices
from airflow_tpu_posttrain.triggers.compute import (
    _billed,
    _OperationsTrigger,
    not_ready_message,
    ssh_port_check,
)
from airflow_tpu_posttrain.triggers.places import (
    LeavesLineWhenCancelled,
    PlaceRefused,
    give_place_back,
    lifetime_of,
    request_of,
    take_place,
)

if TYPE_CHECKING:
    from airflow_tpu_posttrain.hooks.compute import TpuVmAsyncHook
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

class _SliceFailed(Exception):  # noqa: N818 - a control-flow signal inside the trigger, never raised out of it
    def __init__(self, reason: str, detail: str, kind: str | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.kind = kind


# How long the teardown asks again to delete a template or policy Compute still calls in use once its group is
# gone (no Google statement of how long that lasts; Google's cluster-toolkit retries such deletes on its next pass).
IN_USE_RETRY_S = 300.0


class _SliceTrigger(_OperationsTrigger):
    """What the slice's create and delete share: its deletion, in the order Compute allows."""

    async def _delete_slice(
        self, hook: TpuVmAsyncHook, zone: str, group: str, template: str, policy: str
    ) -> tuple[str | None, str]:
        """The group (with its VMs), then the template, the policy and the firewall rules: each gone before the next.

        Returns when the group's delete ended (its operation's ``endTime``; None when it was gone already) and
        what could not be deleted, with Compute's reason ("" when all is gone: else the reaper's to end)."""
        region = slices.region_of(zone)
        steps = (
            (hook.delete_instance_group, (zone, group), {"zone": zone}),
            (hook.delete_instance_template, (template,), {}),
            (hook.delete_workload_policy, (region, policy), {"region": region}),
            *((hook.delete_firewall, (rule,), {}) for rule in slices.slice_names(group).firewalls),
        )
        group_ended = None
        for index, (delete, args, location) in enumerate(steps):
            asked_until = time.monotonic() + IN_USE_RETRY_S
            while True:
                try:
                    operation = await self._poll(
                        lambda delete=delete, args=args: delete(self.project_id, *args, str(uuid.uuid4()))
                    )
                    finished = await self._finished(hook, [{"name": operation, **location}]) if operation else []
                    errors = next((op["error"]["errors"] for op in finished if op.get("error", {}).get("errors")), [])
                except Exception as err:
                    finished, errors = [], self._raised(err)
                # A template or policy stays "in use" for a while after its group is gone: asked again.
                if not (index and compute.still_in_use(errors) and time.monotonic() < asked_until):
                    break
                self.log.info("%s is still in use by its deleted group: asking again", args[-1])
                await asyncio.sleep(self.poll_interval)
            if errors:
                return group_ended, f"{args[-1]}: " + "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
            if index == 0 and finished:  # the group's
                group_ended = finished[0].get("endTime")
        return group_ended, ""


class TpuSliceCreateTrigger(LeavesLineWhenCancelled, _SliceTrigger):
    """Create a run's multi-host slice and wait until every VM of it can be reached over SSH: all, or nothing.

    In order: an earlier try's group is looked up (a broken one is deleted whole first, a live one waited on);
    without one, a place of all its chips under ``cap`` is taken in the zone's line (``recipes/places.py``),
    waiting in line first (a cancelled wait leaves the line at once), and the VMs' expiry is set from then; the
    firewall rules (between the slice's VMs, and SSH's when the run opens one),
    the workload policy, the instance template and the group are inserted (each insert's 409 is "there already"); the group is polled while it creates its VMs (bulk mode: all at once or
    none) or waits for capacity, up to ``capacity_wait`` seconds; then every VM must publish its host keys and
    answer on ``ssh_port`` within ``ready_timeout``. A slice that cannot be completed (no capacity in time, a VM lost, a
    VM that never answers, an insert refused) is deleted whole, the group with its VMs, then the template, the
    policy and the firewall rules, and its place given back, before the event: a partial slice is never handed on.

    Fires once with fixed keys: ``{"status": "ready", "zone", "vms": [{"name", "instance",
    "host_keys"}] by name, "state"}`` or ``{"status": "failed", "reason": "no-capacity" | "broken" |
    "not-ready" | "refused" | "no-place" (the line can never grant it), "detail", "kind" (``compute.ErrorKind`` of a refusal Compute explained, or
    None), "state"}``.

    :param project_id: the slice's project.
    :param zone: the slice's zone.
    :param bodies: ``{"policy", "template", "group"}``: the REST bodies of ``slices.slice_bodies``.
    :param network_path: how Airflow reaches the VMs: ``internal`` or ``external`` (``access.ssh_address``).
    :param ssh_port: the port every VM's sshd must answer on.
    :param group: the capacity label's value of the slice's line (on every VM of the slice).
    :param cap: the TPU chips the line's VMs may hold at once (``max_tpu_chips``); None: no cap.
    :param line: the zone's line of places (``gs://`` object, ``hooks/stored_records.py``); with ``cap``.
    :param request: the slice's request for a place (``places.request_of``: ``places.Request``'s fields but its
        expiry); with ``cap``.
    :param lifetime_s: the VMs' life from their insert (their ``maxRunDuration``): their ``expires-at`` label and
        the ``expireOn`` of their ``ssh-keys`` are set from when the slice's place is granted.
    :param capacity_wait: seconds to wait for the slice's capacity once its place is taken.
    :param ready_timeout: seconds the RUNNING VMs have to publish their host keys and answer on ``ssh_port``.
    """

    def __init__(
        self,
        project_id: str,
        zone: str,
        bodies: dict[str, dict],
        network_path: str,
        ssh_port: int,
        capacity_wait: float,
        ready_timeout: float,
        group: str | None = None,
        cap: int | None = None,
        line: str | None = None,
        request: dict[str, Any] | None = None,
        lifetime_s: int = 0,
        **common: Any,
    ) -> None:
        super().__init__(project_id, **common)
        self.zone = zone
        self.bodies = bodies
        self.network_path = network_path
        self.ssh_port = ssh_port
        self.group = group
        self.cap = cap
        self.line = line
        self.request = request
        self.lifetime_s = lifetime_s or lifetime_of(bodies["template"]["properties"], self.state)
        self.capacity_wait = capacity_wait
        self.ready_timeout = ready_timeout

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "zone": self.zone,
            "bodies": self.bodies,
            "network_path": self.network_path,
            "ssh_port": self.ssh_port,
            "capacity_wait": self.capacity_wait,
            "ready_timeout": self.ready_timeout,
            "group": self.group,
            "cap": self.cap,
            "line": self.line,
            "request": self.request,
            "lifetime_s": self.lifetime_s,
        }

    @property
    def _region(self) -> str:
        return slices.region_of(self.zone)

    @property
    def _group(self) -> str:
        return self.bodies["group"]["name"]

    @property
    def _template_and_policy(self) -> tuple[str, str]:
        return self.bodies["template"]["name"], self.bodies["policy"]["name"]

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

        hook = self._hook()
        lines = StoredRecordAsyncHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
        try:
            earlier = await self._poll(lambda: hook.get_instance_group(self.project_id, self.zone, self._group))
            if earlier and slices.slice_state(earlier).state == slices.BROKEN:
                self.log.info("Slice %s of an earlier try is broken: deleting it whole first", self._group)
                await self._delete_whole(hook, "the earlier try's broken slice could not be deleted")
                earlier = None
            if not earlier:
                expires_at = await self._take_place(hook, lines) or int(time.time()) + self.lifetime_s
                template = self.bodies["template"]
                properties = compute.expiring_at(template["properties"], expires_at)
                self.bodies = {**self.bodies, "template": {**template, "properties": properties}}
            deadline = time.monotonic() + self.capacity_wait
            await self._insert(hook)
            try:
                members = await self._whole(hook, deadline)
            except _SliceFailed as failed:
                if failed.reason != "refused" or "maxRunDuration" not in failed.detail:
                    raise
                members = await self._again_without_max_run_duration(hook, deadline, failed.detail)
            vms = await self._ready(hook, members)
        except _SliceFailed as failed:
            self.log.warning("Slice %s cannot be completed (%s): deleting it whole", self._group, failed.detail)
            _, left = await self._delete_slice(hook, self.zone, self._group, *self._template_and_policy)
            if self.cap is not None and self.line and not left:
                await give_place_back(lines, self.line, self._group, self.log)
            detail = f"{failed.detail}; not deleted: {left}" if left else failed.detail
            yield self._event({"status": "failed", "reason": failed.reason, "detail": detail, "kind": failed.kind})
            return
        yield self._event({"status": "ready", "zone": self.zone, "vms": vms})

    async def _again_without_max_run_duration(self, hook: TpuVmAsyncHook, deadline: float, refusal: str) -> list[dict]:
        """Compute refused ``scheduling.maxRunDuration`` for the slice's VMs: the slice made again without it.

        As the single VM's create does: the backstop is then the reaper, which deletes the VMs after their
        ``expires-at`` label. The refused group, template and policy are deleted first (a template cannot be
        changed, only replaced)."""
        self.log.warning(
            "Compute refused scheduling.maxRunDuration for the VMs of slice %s: making it once more without it; its "
            "backstop is then the reaper, which deletes it after its expires-at label. (%s)", self._group, refusal,
        )
        await self._delete_whole(hook, "the slice Compute refused could not be deleted")
        template = self.bodies["template"]
        scheduling = {k: v for k, v in template["properties"]["scheduling"].items() if k != "maxRunDuration"}
        properties = {**template["properties"], "scheduling": scheduling}
        self.bodies = {**self.bodies, "template": {**template, "properties": properties}}
        await self._insert(hook)
        return await self._whole(hook, deadline)

    async def _delete_whole(self, hook: TpuVmAsyncHook, failure: str) -> None:
        _, left = await self._delete_slice(hook, self.zone, self._group, *self._template_and_policy)
        if left:
            raise _SliceFailed("broken", f"{failure}: {left}")

    async def _live_places(self, hook: TpuVmAsyncHook) -> dict[str, int]:
        """The places the live VMs of the slice's line hold (by their label) with their chips, the slice's left out."""
        label_filter = f"labels.{capacity.GROUP_LABEL} = {self.group}"
        found = await self._poll(lambda: hook.list_instances(self.project_id, self.zone, label_filter))
        return {name: chips for name, chips in capacity.live_places(found).items() if name != self._group}

    async def _take_place(self, hook: TpuVmAsyncHook, lines: StoredRecordAsyncHook) -> int | None:
        """Wait in the zone's line until a place under ``cap`` is the slice's; when its VMs then expire."""
        if self.cap is None or not self.line or not self.request:
            return None
        try:
            return await take_place(
                lines, self.line, request_of(self.request), self.lifetime_s, self.cap,
                lambda: self._live_places(hook), self.poll_interval, self.log,
            )
        except PlaceRefused as refused:
            raise _SliceFailed("no-place", f"max_tpu_chips={self.cap}: {refused}") from None

    def _waiting_in(self) -> tuple[list[str], str]:
        return [self.line], self._group

    async def _insert(self, hook: TpuVmAsyncHook) -> None:
        """The firewall rules, the policy, the template, the group, each waited for; one Compute refuses fails the slice."""
        steps = (
            *((hook.insert_firewall, (rule,), {}) for rule in self.bodies.get("firewalls") or ()),
            (hook.insert_workload_policy, (self._region, self.bodies["policy"]), {"region": self._region}),
            (hook.insert_instance_template, (self.bodies["template"],), {}),
            (hook.insert_instance_group, (self.zone, self.bodies["group"]), {"zone": self.zone}),
        )
        for insert, args, location in steps:
            try:
                operation = await self._poll(
                    lambda insert=insert, args=args: insert(self.project_id, *args, str(uuid.uuid4()))
                )
            except Exception as err:
                raise _SliceFailed("refused", f"{type(err).__name__}: {err}") from err
            if operation:
                errors = await self._operation_errors(hook, [{"name": operation, **location}])
                if errors:
                    raise _SliceFailed("refused", "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors))

    async def _whole(self, hook: TpuVmAsyncHook, deadline: float) -> list[dict]:
        """Wait for the group's VMs, all RUNNING and its topology ACTIVE; its managed instances.

        Capacity and a group still creating or settling are waited for until ``deadline``; a refusal no wait
        mends (quota, a missing reservation) and evidence of a lost VM end the wait at once."""
        logged = ""
        while True:
            group = await self._poll(lambda: hook.get_instance_group(self.project_id, self.zone, self._group))
            state = slices.slice_state(group or {})
            if state.state == slices.WHOLE:
                return await self._poll(
                    lambda: hook.list_group_instances(self.project_id, self.zone, self._group)
                )
            if state.state == slices.BROKEN:
                raise _SliceFailed("broken", state.detail)
            if state.state == slices.REFUSED:
                errors = group["status"]["bulkInstanceOperation"]["lastProgressCheck"]["error"]["errors"]
                raise _SliceFailed("refused", state.detail, compute.classify_errors(errors))
            if time.monotonic() > deadline:
                if state.state == slices.NO_CAPACITY:
                    raise _SliceFailed("no-capacity", f"no capacity within {self.capacity_wait:.0f} s: {state.detail}")
                raise _SliceFailed("not-ready", f"slice {self._group} not whole within {self.capacity_wait:.0f} s: {state.detail}")
            if state.detail and state.detail != logged:
                waits = "waits for capacity" if state.state == slices.NO_CAPACITY else "is being created"
                self.log.info("Slice %s %s: %s", self._group, waits, state.detail)
                logged = state.detail
            await asyncio.sleep(self.poll_interval)

    async def _ready(self, hook: TpuVmAsyncHook, members: list[dict]) -> list[dict]:
        """Every VM's host keys and sshd; the VMs by name.

        Not their worker ids: only each VM's metadata server tells them, and the operator asks over SSH."""
        deadline = time.monotonic() + self.ready_timeout
        vms = []
        for member in sorted(members, key=lambda m: m["name"]):
            name = member["name"]
            while True:
                instance = await self._poll(lambda name=name: hook.get_instance(self.project_id, self.zone, name))
                status = (instance or {}).get("status")
                host_keys = await self._poll(lambda name=name: hook.get_host_keys(self.project_id, self.zone, name))
                answered = False
                if status == "RUNNING" and host_keys:
                    address = access.ssh_address(instance, self.network_path)
                    answered, _ = await ssh_port_check(address, self.ssh_port) if address else (False, "")
                if answered:
                    break
                if status != "RUNNING" or time.monotonic() > deadline:
                    raise _SliceFailed("not-ready", not_ready_message(name, status, host_keys, self.ready_timeout))
                await asyncio.sleep(self.poll_interval)
            reached = {"status": status, "networkInterfaces": instance.get("networkInterfaces"), **(_billed(instance) or {})}
            vms.append({"name": name, "instance": reached, "host_keys": host_keys})
        return vms


class TpuSliceDeleteTrigger(_SliceTrigger):
    """Delete a run's slice: its group with every VM, then its template and policy; what each VM cost.

    Fires once with fixed keys: ``{"status": "success" | "error", "deleted": [{"name", "instance"}] of the VMs
    the group held (an instance: what its cost needs of it, read before the delete), "ended" (the group's delete
    operation's ``endTime``; None when it was gone already), "errors": [{"code", "message"}], "state"}``.

    :param project_id: the slice's project.
    :param zone: the slice's zone.
    :param group: the group's name; ``template``, ``policy``: the names of its template and workload policy.
    """

    def __init__(self, project_id: str, zone: str, group: str, template: str, policy: str, **common: Any) -> None:
        super().__init__(project_id, **common)
        self.zone = zone
        self.group = group
        self.template = template
        self.policy = policy

    def _kwargs(self) -> dict[str, Any]:
        names = {"zone": self.zone, "group": self.group, "template": self.template, "policy": self.policy}
        return {**super()._kwargs(), **names}

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        deleted: list[dict[str, Any]] = []
        try:
            if await self._poll(lambda: hook.get_instance_group(self.project_id, self.zone, self.group)):
                members = await self._poll(lambda: hook.list_group_instances(self.project_id, self.zone, self.group))
                for member in members:
                    name = member["name"]
                    instance = await self._poll(lambda name=name: hook.get_instance(self.project_id, self.zone, name))
                    if instance:
                        deleted.append({"name": name, "instance": _billed(instance)})
            ended, left = await self._delete_slice(hook, self.zone, self.group, self.template, self.policy)
            errors = [{"code": "NOT_DELETED", "message": left}] if left else []
        except Exception as err:
            ended, errors = None, self._raised(err)
        status = "error" if errors else "success"
        yield self._event({"status": status, "deleted": deleted, "ended": ended, "errors": errors})
