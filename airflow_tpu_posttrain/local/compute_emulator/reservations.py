"""Compute Engine reservations: a specific reservation that instances name, consume, and are refused when it is full.

Google's behaviour: ``reservations.get`` (https://cloud.google.com/compute/docs/reference/rest/v1/reservations/get)
and consuming a specific reservation through ``reservationAffinity``, a shared one named
``projects/P/reservations/R`` (https://cloud.google.com/compute/docs/instances/reservations-consume). A test makes
reservations (``add_reservation``); ``reservations.insert`` is not served.
"""

from __future__ import annotations

import re
import time
from typing import Any

from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.compute_emulator.operations import OperationError


def _reservation_ref(value: str, project: str) -> tuple[str, str]:
    """(owner project, reservation name) of a reservationAffinity value.

    The value is a name (in ``project``), a shared reservation's ``projects/P/reservations/R``, or one of its
    blocks, ``.../reservationBlocks/B``."""
    ref = re.fullmatch(r"(?:projects/([^/]+)/reservations/)?([^/]+)(?:/reservationBlocks/[^/]+)?", value)
    return (ref.group(1) or project, ref.group(2)) if ref else (project, value)


class ReservationsMixin:
    """Specific reservations (``_reservations``) and how many live instances consume each."""

    def add_reservation(
        self, name: str, zone: str, vm_count: int, machine_type: str | None = None, project: str | None = None
    ) -> None:
        """A specific reservation of ``vm_count`` VMs in ``zone`` (of ``machine_type``, when given).

        Consumed by the live instances naming it, refused to the next one while they hold it all."""
        with self._lock:
            self._reservations[(project, zone, name)] = {
                "count": vm_count, "machineType": machine_type, "id": api.numeric_id(), "created": time.time()
            }

    def _reservation_failure(
        self, project: str, zone: str, body: dict[str, Any], values: list[str], adding: int = 0
    ) -> OperationError | None:
        """Why a specific reservation cannot take the instance.

        Google's wordings, as quoted publicly (no public capture shows their HTTP status): "Specified
        reservations [R] do not exist." (Dataflow's TPU troubleshooting page, a MIG error:
        INVALID_FIELD_VALUE), "No available resources in specified reservations." for one of another machine
        type (Colab's troubleshooting page), and CONDITION_NOT_MET "Specified reservation 'R' does not have
        available resources for the request." for a fully used one (kubernetes/autoscaler,
        cluster-autoscaler/cloudprovider/gce/autoscaling_gce_client.go)."""
        names = [_reservation_ref(value, project) for value in values]
        found = {
            name: self._reservations.get((owner, zone, name)) or self._reservations.get((None, zone, name))
            for owner, name in names
            if name not in self._faults.missing_reservations
        }
        invalid = "Invalid value for field 'resource.reservationAffinity': '{\"consumeReservationType\": \"SPECIFIC_ALLOCATION\"}'."
        missing = [name for _, name in names if not found.get(name)]
        if missing:
            return OperationError(
                "INVALID_FIELD_VALUE",
                f"{invalid} Specified reservations [{', '.join(missing)}] do not exist.",
                400,
                "BAD REQUEST",
            )
        machine_type = body.get("machineType", "").rsplit("/", 1)[-1]
        for name, reservation in found.items():
            if reservation["machineType"] not in (None, machine_type):
                return OperationError(
                    "INVALID_FIELD_VALUE",
                    f"{invalid} No available resources in specified reservations.",
                    400,
                    "BAD REQUEST",
                )
            in_use = self._reservation_in_use(project, zone, name)
            if in_use + adding > reservation["count"]:  # an instance already inserted is counted in in_use
                return OperationError(
                    "CONDITION_NOT_MET",
                    f"Specified reservation '{name}' does not have available resources for the request.",
                    400,
                    "BAD REQUEST",
                )
        return None

    def _reservation_in_use(self, project: str, zone: str, name: str) -> int:
        """How many live instances of ``project`` in ``zone`` consume the reservation ``name``."""
        return sum(
            1
            for (instance_project, instance_zone, _), instance in self._instances.items()
            if (instance_project, instance_zone) == (project, zone)
            and instance["status"] not in ("TERMINATED", "STOPPED", "SUSPENDED")
            and name
            in [_reservation_ref(v, project)[1] for v in instance.get("reservationAffinity", {}).get("values", [])]
        )

    def _get_reservation(self, query: dict, body: dict, project: str, zone: str, name: str):
        """``reservations.get``: a specific reservation as Compute v1 shows it, 404 where there is none.

        Its count and use are strings (int64 in JSON); ``instanceProperties.machineType`` is a bare name, as
        ``gcloud compute reservations create --machine-type`` sets it."""
        with self._lock:
            reservation = self._reservations.get((project, zone, name)) or self._reservations.get((None, zone, name))
            path = api.resource_path(project, zone, "reservations", name)
            if reservation is None or name in self._faults.missing_reservations:
                raise api.not_found(path)
            properties = {"machineType": reservation["machineType"]} if reservation["machineType"] else {}
            return 200, {
                "kind": "compute#reservation",
                "id": reservation["id"],
                "creationTimestamp": api.timestamp(reservation["created"]),
                "name": name,
                "zone": f"{api.API_ROOT}/projects/{project}/zones/{zone}",
                "selfLink": f"{api.API_ROOT}/{path}",
                "specificReservation": {
                    "instanceProperties": properties,
                    "count": str(reservation["count"]),
                    "inUseCount": str(self._reservation_in_use(project, zone, name)),
                },
                "specificReservationRequired": True,
                "status": "READY",
                "shareSettings": {"shareType": "LOCAL"},
            }
