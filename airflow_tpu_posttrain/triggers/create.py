"""The TPU VM create, run from the triggerer: every Compute call of a create, none in a worker.

The worker's part of a create (``operators/tpu_vm.py``) validates the input, builds the instance bodies and
defers at once; this trigger walks the create's phases (``recipes/create_phases.py``) to a VM that can be logged
into, or to a failure after deleting what the failed attempt left. The triggerer has the Compute client loaded,
so no create pays its import (seconds) or holds a worker slot while Compute works.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NamedTuple

from airflow.triggers.base import TriggerEvent

from airflow_tpu_posttrain.recipes import access, capacity, compute
from airflow_tpu_posttrain.recipes.create_phases import DELETES_FIRST, Action, Phase, Progress, next_action
from airflow_tpu_posttrain.recipes.validation import SpecError
from airflow_tpu_posttrain.triggers.compute import (
    _LASTING_TUNNEL_ERRORS,
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

_REQUEST_NAMESPACE = uuid.UUID("0c5e7d4a-8f3b-4d21-a6e9-5b1f2c3d4e60")


class _Ended(NamedTuple):
    """How the wait of one phase ended: what ``create_phases.next_action`` decides on."""

    phase: Phase
    status: str
    errors: list[dict]
    instance: dict | None = None
    host_keys: dict[str, str] | None = None


class _Failed(Exception):  # noqa: N818 - a control-flow signal inside the trigger, never raised out of it
    """The create cannot go on: ``action`` says why (a ``create_phases.Action`` failure), ``detail`` with what."""

    def __init__(self, action: Action, detail: str) -> None:
        super().__init__(detail)
        self.action = action
        self.detail = detail


class TpuVmCreateTrigger(LeavesLineWhenCancelled, _OperationsTrigger):
    """Create a run's VM: find an earlier try's, else insert (zone by zone), then wait until it can be logged into.

    What it does, in order: refuse a network the VM cannot use (missing, custom-mode without ``subnetwork``, no
    NAT or Private Google Access for a VM without an external IP); look for the instance of an earlier try in
    each zone (reuse a live one, replace a dead one, never touch another deployment's); take a place under ``cap``
    in the zone's line (``recipes/places.py``), waiting in line first come, first served, for as long as the line
    moves or its holders are live runs; set the VM's expiry from then (``lifetime_s``: its label, its ``ssh-keys``)
    and import the key into OS Login until then (``oslogin``); insert the SSH firewall rule and the instance, moving
    to the next zone's line on a stock-out and waiting on a fully used reservation; then wait for the VM's host keys
    and sshd. A wait cancelled (the task marked failed or cleared, the deferral timed out) leaves the line at once;
    a triggerer that stops keeps it. A failure deletes what the attempt left (the instance, if this
    deployment's, and the firewall rule) and gives its place back before the event; the VM's delete gives it back
    otherwise (``TpuDeleteOperator``).

    Fires once with fixed keys: ``{"status": "ready", "zone", "instance", "host_keys", "ssh_login" (OS Login's, or
    None), "without_max_run_duration", "state"}`` or ``{"status": "failed", "action": a create_phases.Action failure, "phase", "zone", "detail",
    "state"}``. A trigger run again after a triggerer restart starts over from the lookup, which finds the
    instance the earlier run inserted; its requestIds are new, so Compute never answers with an earlier run's
    finished insert.

    :param project_id: the VM's project.
    :param name: the instance name (deterministic per DAG run).
    :param zones: the zones to try, in order.
    :param bodies: the instance body (REST JSON) for each zone.
    :param firewall: the SSH firewall rule's body, or None.
    :param deployment: the Airflow deployment id the instance must be labelled with to be used or deleted.
    :param network_check: ``{"network", "subnetwork_given", "network_path", "egress": [[region, subnetwork]]}``.
    :param groups: the capacity label's value of each zone's line (``capacity.group_label``).
    :param cap: the TPU chips a line's VMs may hold at once (``max_tpu_chips``); None: no cap.
    :param lines: each zone's line of places (``gs://`` object, ``hooks/stored_records.py``); with ``cap``.
    :param request: the create's request for a place (``places.request_of``: ``places.Request``'s fields but its
        expiry); with ``cap``.
    :param lifetime_s: the VM's life from its insert (its ``maxRunDuration``): its ``expires-at`` label, the
        ``expireOn`` of its ``ssh-keys`` and its OS Login key's expiry are set from when its place is granted.
    :param capacity_wait: seconds to wait while first in line, or for a fully used reservation.
    :param oslogin: ``ssh_key_mode="oslogin"``: ``{"user", "public_key"}``, the key to import into the OS Login
        profile of ``user`` (None: the Google connection's account) until the VM expires, before it is inserted; the
        event's ``ssh_login`` is then the POSIX login OS Login answers. None: the key is in the instance metadata.
    :param ssh_port: the port the VM's sshd must answer on.
    :param ready_timeout: seconds a RUNNING VM has to publish its host keys and answer on ``ssh_port``.
    :param request_id_base: what the requestIds derive from (stable within one try of one task instance).
    :param accelerator_type: the VM's accelerator type, for the log.
    :param reservation: the reservation the VM consumes, as given, for the log.
    """

    def __init__(
        self,
        project_id: str,
        name: str,
        zones: list[str],
        bodies: dict[str, dict],
        firewall: dict | None,
        deployment: str,
        network_check: dict[str, Any],
        groups: dict[str, str],
        cap: int | None,
        capacity_wait: float,
        oslogin: dict[str, Any] | None,
        ssh_port: int,
        ready_timeout: float,
        request_id_base: str,
        accelerator_type: str,
        reservation: str | None = None,
        lines: dict[str, str] | None = None,
        request: dict[str, Any] | None = None,
        lifetime_s: int = 0,
        **common: Any,
    ) -> None:
        super().__init__(project_id, **common)
        self.name = name
        self.zones = zones
        self.bodies = bodies
        self.firewall = firewall
        self.deployment = deployment
        self.network_check = network_check
        self.groups = groups
        self.cap = cap
        self.lines = lines
        self.request = request
        self.lifetime_s = lifetime_s or lifetime_of(bodies[zones[0]], self.state)
        self.capacity_wait = capacity_wait
        self.oslogin = oslogin
        self.ssh_port = ssh_port
        self.ready_timeout = ready_timeout
        self.request_id_base = request_id_base
        self.accelerator_type = accelerator_type
        self.reservation = reservation

    def _kwargs(self) -> dict[str, Any]:
        return {
            **super()._kwargs(),
            "name": self.name,
            "zones": self.zones,
            "bodies": self.bodies,
            "firewall": self.firewall,
            "deployment": self.deployment,
            "network_check": self.network_check,
            "groups": self.groups,
            "cap": self.cap,
            "lines": self.lines,
            "request": self.request,
            "lifetime_s": self.lifetime_s,
            "capacity_wait": self.capacity_wait,
            "oslogin": self.oslogin,
            "ssh_port": self.ssh_port,
            "ready_timeout": self.ready_timeout,
            "request_id_base": self.request_id_base,
            "accelerator_type": self.accelerator_type,
            "reservation": self.reservation,
        }

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordAsyncHook

        lines = StoredRecordAsyncHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
        run = _CreateRun(self, self._hook(), lines, uuid.uuid4().hex)
        yield self._event(await run.walk())

    def _waiting_in(self) -> tuple[list[str], str]:
        return list((self.lines or {}).values()), self.name


class _CreateRun:
    """One run of :class:`TpuVmCreateTrigger`: its hook, where the create stands, and the steps of each phase."""

    def __init__(
        self, trigger: TpuVmCreateTrigger, hook: TpuVmAsyncHook, lines: StoredRecordAsyncHook, nonce: str
    ) -> None:
        self.trigger = trigger
        self.hook = hook
        self.lines = lines
        self.nonce = nonce
        self.progress = Progress()
        self.in_play = False  # an instance of this run may exist: a failure from here on deletes it
        self.expires_at: int | None = None  # set when the place is granted (or an earlier try's VM is found)
        self.login: str | None = None  # the POSIX login OS Login answered, once the key is imported
        self.log = trigger.log

    @property
    def project(self) -> str:
        return self.trigger.project_id

    @property
    def name(self) -> str:
        return self.trigger.name

    @property
    def zone(self) -> str:
        zones = self.trigger.zones
        return zones[min(self.progress.zone_index, len(zones) - 1)]

    def _request_id(self, *parts: object) -> str:
        """New for every run of the trigger, the same for the client's own retries of one call."""
        return str(uuid.uuid5(_REQUEST_NAMESPACE, "/".join(map(str, (self.trigger.request_id_base, self.nonce, *parts)))))

    async def walk(self) -> dict[str, Any]:
        """Every phase of the create, to the event it fires."""
        phase = Phase.CREATE
        try:
            await self._check_network()
            ended = await self._start()
            if ended is None:
                action = Action.INSERT
            else:
                phase, action = ended.phase, self._next(ended)
            while action is not Action.DONE:
                if action in DELETES_FIRST:
                    await self._delete_leftover()
                if action is Action.INSERT:
                    ended = await self._insert_when_capacity()
                elif action is Action.AWAIT_LOGIN:
                    ended = await self._ready(ended.instance)
                elif action is Action.NEXT_ZONE:
                    ended = await self._next_zone(compute.describe_errors(ended.errors))
                elif action is Action.WAIT_FOR_RESERVATION:
                    self.log.warning(
                        "Reservation %s is fully used: %s",
                        self.trigger.reservation,
                        compute.describe_errors(ended.errors),
                    )
                    self.progress = self.progress._replace(attempt=self.progress.attempt + 1)
                    ended = await self._wait_for_reservation()
                elif action is Action.FAIL_NO_CAPACITY:
                    raise _Failed(action, f"reservation {self.trigger.reservation} fully used")
                else:
                    raise _Failed(action, compute.describe_errors(ended.errors))
                phase = ended.phase
                action = self._next(ended)
        except _Failed as failed:
            if failed.action in DELETES_FIRST:
                await self._delete_leftover()
            await self._give_place_back()
            return self._failed(failed.action, phase, failed.detail)
        except Exception as err:  # an API answer no phase expects: as a failed operation (FAIL)
            if self.in_play:
                await self._delete_leftover()
            await self._give_place_back()
            return self._failed(Action.FAIL, phase, f"{type(err).__name__}: {err}")
        return {
            "status": "ready",
            "zone": self.zone,
            "instance": ended.instance,
            "host_keys": ended.host_keys,
            "ssh_login": self.login,
            "without_max_run_duration": self.progress.without_max_run_duration,
        }

    def _failed(self, action: Action, phase: Phase, detail: str) -> dict[str, Any]:
        return {
            "status": "failed",
            "action": action.value,
            "phase": phase.value,
            "zone": self.zone,
            "detail": detail,
        }

    def _next(self, ended: _Ended) -> Action:
        kind = compute.classify_errors(ended.errors) if ended.errors else None
        return next_action(ended.phase, ended.status, kind)

    # -- before anything is created -------------------------------------------------------------------------
    async def _check_network(self) -> None:
        check = self.trigger.network_check
        network = await self.trigger._poll(lambda: self.hook.get_network(self.project, check["network"]))
        egress = []
        if network is not None:
            for region, subnetwork in check["egress"]:
                found = await self.trigger._poll(
                    lambda r=region, s=subnetwork: self.hook.get_subnetwork(self.project, r, s)
                )
                routers = await self.trigger._poll(lambda r=region: self.hook.list_routers(self.project, r))
                egress.append((region, subnetwork, found, routers))
        problem = compute.network_problem(
            self.project, check["network"], check["subnetwork_given"], check["network_path"], network, egress
        )
        if problem is not None:
            raise _Failed(Action.FAIL_INVALID_INPUT, str(problem))

    async def _import_oslogin_key(self) -> None:
        """``oslogin``: the key into the OS Login profile until the VM expires, once; the POSIX login it answers."""
        # The REST transport raises by HTTP status (Forbidden, Unauthorized), gRPC by canonical code.
        from google.api_core.exceptions import Forbidden, PermissionDenied, Unauthenticated, Unauthorized

        from airflow_tpu_posttrain.hooks.oslogin import OsLoginKeyAsyncHook

        request, trigger = self.trigger.oslogin, self.trigger
        if not request or self.login is not None:
            return
        hook = OsLoginKeyAsyncHook(gcp_conn_id=trigger.gcp_conn_id, impersonation_chain=trigger.impersonation_chain)
        user = request["user"] or await hook.account_email()
        try:
            login = await hook.import_key(
                access.oslogin_user("oslogin_user", user), request["public_key"], self.expires_at, self.project
            )
        except SpecError as err:
            raise _Failed(Action.FAIL_INVALID_INPUT, str(err)) from None
        except (Forbidden, PermissionDenied, Unauthorized, Unauthenticated) as err:
            raise _Failed(
                Action.FAIL_ACCESS,
                f"OS Login refused to add the SSH key to {user}'s profile: "
                f"{err.message}. Use the account's own credentials (or set oslogin_user to it) and grant it "
                "roles/compute.osAdminLogin on the project.",
            ) from None
        self.log.info("SSH key added to %s's OS Login profile until the VM expires; login %s", user, login)
        self.login = login

    async def _start(self) -> _Ended | None:
        """An earlier try's instance: wait for a live one, replace a dead one; None: there is none, insert."""
        for index, zone in enumerate(self.trigger.zones):
            existing = await self.trigger._poll(lambda z=zone: self.hook.get_instance(self.project, z, self.name))
            if existing is None:
                continue
            owner = (existing.get("labels") or {}).get(compute.DEPLOYMENT_LABEL)
            if owner != self.trigger.deployment:
                raise _Failed(Action.FAIL_FOREIGN, owner or "")
            self.progress = self.progress._replace(zone_index=index)
            self.in_play = True
            status = existing.get("status")
            if status in compute.LIVE_STATES:
                self.log.info("Reusing instance %s in %s (status %s) from an earlier try", self.name, zone, status)
                expires = str((existing.get("labels") or {}).get("expires-at", ""))
                self.expires_at = int(expires) if expires.isdigit() else int(time.time()) + self.trigger.lifetime_s
                await self._import_oslogin_key()
                return await self._settled(Phase.WAIT, [], {"name": self.name, "zone": zone})
            self.log.info(
                "Instance %s in %s is %s: deleting it before creating a fresh one", self.name, zone, status
            )
            operation = await self.trigger._poll(
                lambda z=zone: self.hook.delete_instance(self.project, z, self.name, self._request_id(z, "replace"))
            )
            ended = await self._settled(Phase.REPLACE, [{"name": operation, "zone": zone}] if operation else [], None)
            if ended.status == "success":  # the fresh one is inserted from the first zone on, with a new requestId
                self.progress = self.progress._replace(zone_index=0, attempt=1)
            return ended
        return None

    # -- capacity -----------------------------------------------------------------------------------------
    async def _live_places(self, zone: str) -> dict[str, int]:
        """The places the live VMs of ``zone``'s line hold (by their label) with their chips, ours left out."""
        label_filter = f"labels.{capacity.GROUP_LABEL} = {self.trigger.groups[zone]}"
        found = await self.trigger._poll(lambda: self.hook.list_instances(self.project, zone, label_filter))
        return {name: chips for name, chips in capacity.live_places(found).items() if name != self.name}

    async def _insert_when_capacity(self) -> _Ended:
        """Insert once this create holds a place in its zone's line (at once with no cap), expiring from then."""
        if self.progress.zone_index < len(self.trigger.zones):  # else _insert fails: no zone left
            granted_until = await self._take_place()
            if self.expires_at is None:
                self.expires_at = granted_until or int(time.time()) + self.trigger.lifetime_s
            await self._import_oslogin_key()
        return await self._insert()

    async def _take_place(self) -> int | None:
        """Wait in the current zone's line until a place under ``cap`` is this create's; when the VM then expires."""
        trigger, zone = self.trigger, self.zone
        if trigger.cap is None:
            return None
        request = request_of(trigger.request)
        try:
            return await take_place(
                self.lines, trigger.lines[zone], request, trigger.lifetime_s, trigger.cap,
                lambda: self._live_places(zone), trigger.poll_interval, self.log,
            )
        except PlaceRefused as refused:
            raise _Failed(Action.FAIL_INVALID_INPUT, f"max_tpu_chips={trigger.cap}: {refused}") from None

    async def _give_place_back(self) -> None:
        """Leave the line of the zone this create stands in (its place, or its wait there)."""
        if self.trigger.cap is not None and self.trigger.lines:
            await give_place_back(self.lines, self.trigger.lines[self.zone], self.name, self.log)

    async def _wait_for_reservation(self) -> _Ended:
        """The reservation is fully used: wait a while, then insert again, until ``capacity_wait`` from the first wait."""
        deadline = self.progress.deadline or time.time() + self.trigger.capacity_wait
        self.progress = self.progress._replace(deadline=deadline)
        if time.time() >= deadline:
            return _Ended(Phase.CAPACITY, "timeout", [])
        self.log.info(
            "Waiting for TPU capacity (up to %s s): reservation %s is fully used",
            int(deadline - time.time()), self.trigger.reservation,
        )
        retry_after = max(3 * self.trigger.poll_interval, 1.0)
        await asyncio.sleep(min(retry_after, max(0.0, deadline - time.time())))
        return _Ended(Phase.CAPACITY, "available" if time.time() < deadline else "timeout", [])

    # -- the insert ---------------------------------------------------------------------------------------
    async def _insert(self) -> _Ended:
        """Insert in ``zones[zone_index]`` and wait for the instance to be RUNNING.

        A later attempt (after a replacement) gets a new requestId, or Compute would
        answer with the old, finished insert."""
        from google.api_core.exceptions import BadRequest, Forbidden

        progress = self.progress
        if progress.zone_index >= len(self.trigger.zones):
            raise _Failed(Action.FAIL_NO_ZONE_LEFT, "; ".join(progress.stockouts))
        zone = self.trigger.zones[progress.zone_index]
        operations = []
        if self.trigger.firewall:
            firewall_op = await self.hook.insert_firewall(
                self.project, self.trigger.firewall, self._request_id("firewall")
            )
            if firewall_op:
                operations.append({"name": firewall_op, "zone": None})
        body = compute.expiring_at(self.trigger.bodies[zone], self.expires_at)
        if progress.without_max_run_duration:
            body = {**body, "scheduling": {k: v for k, v in body["scheduling"].items() if k != "maxRunDuration"}}
        scheduling = body.get("scheduling") or {}
        self.log.info(
            "Creating %s (%s, %s) in %s",
            self.name,
            body.get("machineType", "").rsplit("/", 1)[-1],
            scheduling.get("provisioningModel", "STANDARD"),
            zone,
        )
        request_id = self._request_id(zone, "insert", progress.attempt, progress.without_max_run_duration)
        self.in_play = True
        try:
            operation = await self.hook.insert_instance(self.project, zone, body, request_id)
        except Forbidden as err:
            if "quotaExceeded" not in str(err) and "Quota" not in err.message:
                raise
            raise _Failed(Action.FAIL_QUOTA, err.message) from None
        except BadRequest as err:
            if "does not exist in zone" in err.message:
                raise _Failed(Action.FAIL_ZONE_UNSOLD, err.message) from None
            if "The referenced image resource cannot be found" in err.message:
                raise _Failed(Action.FAIL_NO_IMAGE, err.message) from None
            if "maxRunDuration" not in str(err) or progress.without_max_run_duration:
                raise
            self.log.warning(
                "Compute refused scheduling.maxRunDuration for a %s VM: creating %s once more without it; its "
                "backstop is then the reaper, which deletes it after its expires-at label. (%s)",
                scheduling.get("provisioningModel"),
                self.name,
                err.message,
            )
            self.progress = progress._replace(attempt=progress.attempt + 1, without_max_run_duration=True)
            return await self._insert()
        if operation:
            operations.append({"name": operation, "zone": zone})
        else:
            self.log.info("Instance %s already exists in %s: waiting for it instead", self.name, zone)
        return await self._settled(Phase.CREATE, operations, {"name": self.name, "zone": zone})

    async def _next_zone(self, detail: str) -> _Ended:
        """A stock-out: delete what the zone left behind (if anything), then insert in the next zone."""
        zone = self.zone
        self.log.warning("Zone %s is out of %s capacity: %s", zone, self.trigger.accelerator_type, detail)
        await self._give_place_back()  # the next zone has a line of its own
        self.progress = self.progress._replace(
            zone_index=self.progress.zone_index + 1, stockouts=(*self.progress.stockouts, f"{zone}: {detail}")
        )
        if await self.trigger._poll(lambda: self.hook.get_instance(self.project, zone, self.name)):
            operation = await self.trigger._poll(
                lambda: self.hook.delete_instance(self.project, zone, self.name, self._request_id(zone, "stockout"))
            )
            if operation:
                return await self._settled(Phase.REPLACE, [{"name": operation, "zone": zone}], None)
        return await self._insert_when_capacity()

    async def _delete_leftover(self) -> None:
        """Delete-on-error: a failing create cleans up (its firewall rule too).

        A teardown does not run when its setup failed. Another deployment's instance of this name is never
        deleted."""
        zone = self.zone
        if self.trigger.firewall:
            await self.trigger._poll(
                lambda: self.hook.delete_firewall(
                    self.project, self.trigger.firewall["name"], self._request_id("firewall-on-error")
                )
            )
        instance = await self.trigger._poll(lambda: self.hook.get_instance(self.project, zone, self.name))
        if instance is None:
            return
        if (instance.get("labels") or {}).get(compute.DEPLOYMENT_LABEL) != self.trigger.deployment:
            return
        self.log.warning("Deleting %s in %s: the create failed and the instance must not outlive it", self.name, zone)
        await self.trigger._poll(
            lambda: self.hook.delete_instance(self.project, zone, self.name, self._request_id(zone, "on-error"))
        )

    # -- waits --------------------------------------------------------------------------------------------
    async def _settled(self, phase: Phase, operations: list[dict], instance: dict | None) -> _Ended:
        """Wait for ``operations`` to be DONE (reading ``operation.error``), then for ``instance`` to be RUNNING."""
        errors = await self.trigger._operation_errors(self.hook, operations)
        if errors:
            return _Ended(phase, "error", errors)
        if not instance:
            return _Ended(phase, "success", [])
        zone, name = instance["zone"], instance["name"]
        while True:
            found = await self.trigger._poll(lambda: self.hook.get_instance(self.project, zone, name))
            status = found.get("status") if found else None
            if status == "RUNNING":
                return _Ended(phase, "success", [], found)
            if status is None or status in compute.DEAD_STATES:
                message = f"instance {name} in {zone} is {status or 'gone'} instead of RUNNING"
                return _Ended(phase, "error", [{"code": "INSTANCE_NOT_RUNNING", "message": message}])
            self.log.info("Instance %s is %s; waiting for RUNNING", name, status)
            await asyncio.sleep(self.trigger.poll_interval)

    async def _ready(self, instance: dict) -> _Ended:
        """Until the RUNNING VM has published its host keys (guest attributes) and its sshd answers."""
        from airflow_tpu_posttrain.hooks.vm import proxy_command_as_async

        zone, name, trigger = self.zone, self.name, self.trigger
        network_path = trigger.network_check["network_path"]
        address = access.ssh_address(instance, network_path)
        proxy = access.iap_proxy_command(self.project, zone, name) if network_path == "iap" else None
        self.log.info("VM %s is RUNNING in %s; waiting for its host keys and its SSH port", name, zone)
        # The tunnel's gcloud runs as the Google connection this trigger asks Compute with.
        account = {"gcp_conn_id": trigger.gcp_conn_id, "impersonation_chain": trigger.impersonation_chain}
        proxy_command = await proxy_command_as_async(proxy, account)
        deadline = time.monotonic() + trigger.ready_timeout
        host_keys: dict[str, str] = {}
        port_open, tunnel_said = False, ""
        poll_interval = min(trigger.poll_interval, 5.0)
        while True:
            try:
                if not host_keys:
                    host_keys = await self.hook.get_host_keys(self.project, zone, name)
                if host_keys and not port_open:
                    port_open, tunnel_said = await ssh_port_check(
                        address, trigger.ssh_port, proxy_command=proxy_command
                    )
                if host_keys and port_open:
                    return _Ended(Phase.READY, "ready", [], instance, host_keys=host_keys)
                if any(sign in tunnel_said for sign in _LASTING_TUNNEL_ERRORS):
                    return self._not_ready(
                        f"The IAP tunnel to VM {name} cannot connect: {tunnel_said}. The identity Airflow runs "
                        "gcloud as (the Google connection's account, or its impersonation chain's last) needs "
                        "roles/iap.tunnelResourceAccessor, and gcloud must be on the PATH of the triggerer and the "
                        "workers"
                    )
                found = await self.hook.get_instance(self.project, zone, name)
            except Exception as err:
                return self._not_ready(f"{type(err).__name__}: {err}")
            status = found.get("status") if found else None
            if status != "RUNNING" or time.monotonic() > deadline:
                return self._not_ready(not_ready_message(name, status, host_keys, trigger.ready_timeout, tunnel_said))
            await asyncio.sleep(poll_interval)

    @staticmethod
    def _not_ready(message: str) -> _Ended:
        return _Ended(Phase.READY, "error", [{"code": "VM_NOT_READY", "message": message}])
