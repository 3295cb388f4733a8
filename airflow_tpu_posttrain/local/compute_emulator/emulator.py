"""The Compute Engine emulator: one object holding every resource, made of one mixin per resource family.

No Google behaviour of its own: which one each part stands for, and where Google documents it, is said at the top of
its module (``instances``, ``instance_groups``, ``instance_templates``, ``resource_policies``, ``networks``,
``firewalls``, ``reservations``, ``operations``, ``metadata_server``, ``identity``; the HTTP paths in ``routing``).
This module holds what is the emulator's own: its state (``reset``), its lifecycle (``start``, ``stop``) and its test
API (``requests``, ``faults``, ``set_faults``).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Self

from airflow_tpu_posttrain.local.compute_emulator.faults import TRANSIENT_KINDS, Faults
from airflow_tpu_posttrain.local.compute_emulator.firewalls import FirewallsMixin
from airflow_tpu_posttrain.local.compute_emulator.identity import IdentityMixin
from airflow_tpu_posttrain.local.compute_emulator.instance_groups import InstanceGroupsMixin, ManagedGroup
from airflow_tpu_posttrain.local.compute_emulator.instance_templates import InstanceTemplatesMixin
from airflow_tpu_posttrain.local.compute_emulator.instances import InstancesMixin
from airflow_tpu_posttrain.local.compute_emulator.metadata_server import MetadataServerMixin
from airflow_tpu_posttrain.local.compute_emulator.networks import NetworksMixin
from airflow_tpu_posttrain.local.compute_emulator.operations import Operation, OperationsMixin
from airflow_tpu_posttrain.local.compute_emulator.reservations import ReservationsMixin
from airflow_tpu_posttrain.local.compute_emulator.resource_policies import ResourcePoliciesMixin
from airflow_tpu_posttrain.local.compute_emulator.routing import Handler, RoutingMixin, compile_routes
from airflow_tpu_posttrain.local.iam import LocalIam
from airflow_tpu_posttrain.local.oslogin import OsLoginDirectory

if TYPE_CHECKING:
    from airflow_tpu_posttrain.local.fleet import LocalFleet


class ComputeEmulator(
    RoutingMixin,
    OperationsMixin,
    InstancesMixin,
    MetadataServerMixin,
    ReservationsMixin,
    NetworksMixin,
    FirewallsMixin,
    ResourcePoliciesMixin,
    InstanceTemplatesMixin,
    InstanceGroupsMixin,
    IdentityMixin,
):
    """In-process Compute Engine emulator serving HTTP from a daemon thread.

    Usable as a context manager or via :meth:`start` / :meth:`stop`. All public methods are
    thread-safe.

    :param local_slice_vms: None (the default): a slice's MIG makes its topology's VM count, as Compute does. A
        number N: a declared local stand-in difference, for CPU cost — a local slice is N local VMs standing for
        the topology's VM count. The MIG's insert is checked as Compute checks it (``targetSize`` the topology's VM
        count from the accelerator table, or 0), but the MIG makes only N VMs (at most the topology's count),
        worker ids 0..N-1, and reports N as its ``targetSize`` and in its statuses, so that a client reads the
        slice as whole once they run; a reservation counts the N VMs made.
    """

    def __init__(
        self,
        port: int = 0,
        operation_seconds: float = 0.2,
        instance_ip: str = "127.0.0.1",
        max_run_duration_scale: float = 1.0,
        fleet: LocalFleet | None = None,
        local_slice_vms: int | None = None,
    ):
        if local_slice_vms is not None and local_slice_vms < 1:
            raise ValueError(f"local_slice_vms must be at least 1 (or None), not {local_slice_vms}")
        self.local_slice_vms = local_slice_vms
        self._port = port
        self._instance_ip = instance_ip
        self.fleet = fleet
        self._initial_faults = Faults(
            operation_seconds=operation_seconds, max_run_duration_scale=max_run_duration_scale
        )
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._routes = compile_routes(self)
        # Who may call (service accounts, their keys and roles): kept across reset(), as keys handed to
        # connections outlive the resources a test makes.
        self.iam = LocalIam()
        self._request = threading.local()  # the caller of the request a server thread is answering
        self.reset()

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        # Every address of this machine: the VMs ask their metadata server on the local VPC's gateway.
        server = ThreadingHTTPServer(("0.0.0.0", self._port), Handler)
        server.daemon_threads = True
        server.emulator = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="compute-emulator", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulator is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # ---------------------------------------------------------------- test API

    @property
    def requests(self) -> list[dict[str, Any]]:
        """Every API request received (admin requests excluded): method, path, query, body."""
        with self._lock:
            return copy.deepcopy(self._requests)

    @property
    def transient_errors_served(self) -> dict[str, int]:
        """Per request kind, how many transient errors (503, 429 alternately) were answered since it was set."""
        with self._lock:
            return dict(self._transient_served)

    @property
    def faults(self) -> dict[str, Any]:
        with self._lock:
            return copy.deepcopy(dataclasses.asdict(self._faults))

    def set_faults(self, **faults: Any) -> None:
        """Change the given ``Faults`` fields; ``transient_errors`` counts are set per kind."""
        unknown = set(faults) - {field.name for field in dataclasses.fields(Faults)}
        if unknown:
            raise TypeError(f"unknown fault fields: {sorted(unknown)}")
        unknown_kinds = set(faults.get("transient_errors", {})) - set(TRANSIENT_KINDS)
        if unknown_kinds:
            raise ValueError(f"unknown transient error kinds {sorted(unknown_kinds)}; use {TRANSIENT_KINDS}")
        with self._lock:
            for name, value in faults.items():
                if name == "transient_errors":
                    self._faults.transient_errors.update(value)
                    for kind in value:
                        self._transient_served[kind] = 0
                else:
                    setattr(self._faults, name, copy.deepcopy(value))

    def reset(self) -> None:
        """Forget all resources, operations, recorded requests and faults."""
        with self._lock:
            self._faults = copy.deepcopy(self._initial_faults)
            self._transient_served: dict[str, int] = {}
            self._requests: list[dict[str, Any]] = []
            self._instances: dict[tuple[str, str, str], dict[str, Any]] = {}
            self._firewalls: dict[tuple[str, str], dict[str, Any]] = {}
            # (project or None for every project, zone, name) -> {"count", "machineType", "id", "created"}
            self._reservations: dict[tuple[str | None, str, str], dict[str, Any]] = {}
            # (project or None for every project, name) -> network fields
            self._networks: dict[tuple[str | None, str], dict[str, Any]] = {
                (None, "default"): {"autoCreateSubnetworks": True}
            }
            # (project or None, region, name) -> {"network", "privateIpGoogleAccess"}: subnetworks made explicitly
            self._subnetworks: dict[tuple[str | None, str, str], dict[str, Any]] = {}
            # (project or None, region, name) -> {"network", "natSubnetworks"}: Cloud Routers with a NAT
            self._routers: dict[tuple[str | None, str, str], dict[str, Any]] = {}
            self._operations: dict[tuple[str, str, str], Operation] = {}  # (project, scope, name)
            self._operations_by_request_id: dict[tuple[str, str], Operation] = {}
            # instance key -> (when maxRunDuration expires, scheduling.instanceTerminationAction)
            self._run_deadlines: dict[tuple[str, str, str], tuple[float, str]] = {}
            self._preemptions: dict[tuple[str, str, str], float] = {}  # STOPPING until then, then TERMINATED/gone
            self._resource_policies: dict[tuple[str, str, str], dict[str, Any]] = {}  # (project, region, name)
            self._instance_templates: dict[tuple[str, str], dict[str, Any]] = {}  # (project, name)
            self._groups: dict[tuple[str, str, str], ManagedGroup] = {}  # (project, zone, name)
            # Deleted groups whose template and policy Compute still calls in use: (until, key, group).
            self._deleted_groups: list[tuple[float, tuple[str, str, str], ManagedGroup]] = []
            self._creating_members = False  # guards _advance_groups against itself (creating starts operations)
            self.oslogin = OsLoginDirectory()
