"""What a run's VMs cost: each VM's time, times a price per hour.

The time runs from the VM's start (``lastStartTimestamp``: a VM is billed while RUNNING, not while queued in
PENDING or being provisioned) to the end of its deletion (Compute's own timestamps); the price is that of its
machine type and provisioning model.

The price table is data: ``DEFAULT_PRICES`` below, and a registry (``models.yaml``) may replace or add entries
under ``prices:``. A machine type and provisioning model with no price gives no cost (the log says which entry
to add) rather than a guess: SPOT and FLEX_START prices change with demand and are not in the defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType

from airflow_tpu_posttrain.recipes.validation import SpecError

# Read on this date. TPU v6e: $2.70 per chip-hour on demand (Google Cloud's Trillium GA announcement, Dec
# 2024: "available starting at $2.7000 per chip-hour"), 8 chips for a v6e-8: the tutorials' $21.6 an hour.
# CPU machines: Compute Engine's on-demand price list, us-central1 (N2 highmem: $0.031611 per vCPU-hour and
# $0.004237 per GB-hour; e2-standard-2 $0.067006). A reservation's VM is priced as on demand (a reservation
# without a committed-use discount). Other regions differ: edit the table in models.yaml.
# Billing (https://cloud.google.com/compute/vm-instance-pricing, "Billing model"): a minimum of 1 minute, then
# per second.
MINIMUM_BILLED_SECONDS = 60
PRICES_READ_ON = "2026-12-01"
_ON_DEMAND = ("STANDARD", "RESERVATION_BOUND")
DEFAULT_PRICES: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "ct6e-standard-1t": dict.fromkeys(_ON_DEMAND, 2.70),
        "ct6e-standard-4t": dict.fromkeys(_ON_DEMAND, 10.80),
        "ct6e-standard-8t": dict.fromkeys(_ON_DEMAND, 21.60),
        "n2-highmem-16": dict.fromkeys(_ON_DEMAND, 1.0481),
        "e2-standard-2": dict.fromkeys(_ON_DEMAND, 0.0670),
    }
)


def price_table(overrides: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """``DEFAULT_PRICES`` with a registry's ``prices:`` laid over them (per machine type, per model)."""
    table = {machine: dict(models) for machine, models in DEFAULT_PRICES.items()}
    for machine, models in (overrides or {}).items():
        if not isinstance(models, Mapping):
            raise SpecError(
                "prices",
                {machine: models},
                "maps a machine type to prices",
                "write prices: {TYPE: {MODEL: USD}}",
            )
        for model, usd in models.items():
            if isinstance(usd, bool) or not isinstance(usd, (int, float)) or usd < 0:
                raise SpecError(
                    f"prices.{machine}.{model}", usd, "is not a price", "give USD per hour, e.g. 2.7"
                )
            table.setdefault(machine, {})[model] = float(usd)
    return table


@dataclass(frozen=True)
class VmCost:
    """One VM's time and, when the table prices its machine type and provisioning model, its cost."""

    name: str
    machine_type: str
    provisioning_model: str
    seconds: float
    usd_per_hour: float | None

    @property
    def usd(self) -> float | None:
        if self.usd_per_hour is None:
            return None
        return round(max(self.seconds, MINIMUM_BILLED_SECONDS) / 3600 * self.usd_per_hour, 4)

    def as_dict(self) -> dict:
        return {
            "machine_type": self.machine_type,
            "provisioning_model": self.provisioning_model,
            "vm_seconds": round(self.seconds, 1),
            "usd_per_hour": self.usd_per_hour,
            "cost_usd": self.usd,
        }

    def describe(self) -> str:
        ran = f"{self.name} ({self.machine_type}, {self.provisioning_model}) ran {_duration(self.seconds)}"
        if self.usd_per_hour is None:
            return (
                f"{ran}; no price for {self.machine_type} {self.provisioning_model} in the price table "
                f"(add prices: {{{self.machine_type}: {{{self.provisioning_model}: USD/h}}}} to models.yaml)"
            )
        return f"{ran}: ${self.usd:.2f} at ${self.usd_per_hour:g}/h"


def vm_cost(
    name: str, instance: Mapping, ended: str, prices: Mapping[str, Mapping[str, float]] | None = None
) -> VmCost:
    """The cost of ``instance`` (a Compute instance resource, as read before its deletion).

    Its deletion ended at ``ended`` (the delete operation's ``endTime``)."""
    machine_type = (instance.get("machineType") or "").rsplit("/", 1)[-1]
    model = (instance.get("scheduling") or {}).get("provisioningModel") or "STANDARD"
    started = instance.get("lastStartTimestamp") or instance["creationTimestamp"]
    seconds = (datetime.fromisoformat(ended) - datetime.fromisoformat(started)).total_seconds()
    table = DEFAULT_PRICES if prices is None else prices
    return VmCost(name, machine_type, model, max(seconds, 0.0), (table.get(machine_type) or {}).get(model))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"
