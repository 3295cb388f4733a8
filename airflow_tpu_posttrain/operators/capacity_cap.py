"""The TPU cap in the create: at most ``max_tpu_vms`` of a capacity group's VMs alive at once.

The VMs are counted from Compute; a create over it waits in the triggerer holding no VM, and the later of two
racing creates yields."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import CapacityTimeoutError
from airflow_tpu_posttrain.operators.compute_base import seconds
from airflow_tpu_posttrain.recipes import capacity, compute
from airflow_tpu_posttrain.recipes.create_phases import Phase, Progress

if TYPE_CHECKING:
    from airflow.sdk import Context


class CapacityCapMixin:
    """The create operator's waits for capacity (``max_tpu_vms``, a fully used reservation)."""

    def _capacity_group(self, spec: compute.TpuVmSpec) -> list[dict]:
        """The live instances of this VM's capacity group, from Compute (the group's label, in its zones)."""
        label_filter = f"labels.{capacity.GROUP_LABEL} = {self._group(spec)}"
        return [
            i for zone in spec.zones for i in self.hook.list_instances(spec.project_id, zone, label_filter)
        ]

    def _group(self, spec: compute.TpuVmSpec) -> str:
        return capacity.group_label(
            spec.project_id, spec.reservation, spec.zones, spec.machine_type, self.name_prefix
        )

    def _insert_when_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: Progress
    ) -> Any:
        """Insert now if the capacity group has room (``max_tpu_vms``), else wait for it in the triggerer."""
        if self.max_tpu_vms is None:
            return self._insert(context, spec, name, progress)
        others = [i for i in self._capacity_group(spec) if i.get("name") != name]
        if len(capacity.holders(others)) < self.max_tpu_vms:
            return self._insert(context, spec, name, progress)
        return self._wait_for_capacity(
            context, spec, name, progress, capacity.describe(others, self.max_tpu_vms)
        )

    def _wait_for_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: Progress, in_use: str
    ) -> None:
        """Defer until the group has room (or, ``in_use`` empty, a full reservation is worth trying again)."""
        from airflow_tpu_posttrain.triggers.capacity import TpuCapacityTrigger

        deadline = progress.deadline or time.time() + seconds(self.max_wait_for_capacity)
        progress = progress._replace(deadline=deadline)
        if time.time() >= deadline:
            raise self._no_capacity(spec, name, in_use)
        self.log.info(
            "Waiting for TPU capacity (up to %s s): %s",
            int(deadline - time.time()),
            in_use or f"reservation {spec.reservation} is fully used",
        )
        self.defer(
            trigger=TpuCapacityTrigger(
                zones=list(spec.zones),
                group=self._group(spec),
                cap=self.max_tpu_vms if in_use else None,
                own_name=name,
                deadline=deadline,
                retry_after=max(3 * self.poll_interval, 1.0),
                state={"phase": Phase.CAPACITY.value, **progress._asdict()},
                **self._trigger_arguments(),
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=max(0.0, deadline - time.time()) + 300),
        )

    def _no_capacity(self, spec: compute.TpuVmSpec, name: str, in_use: str) -> CapacityTimeoutError:
        held = in_use or f"reservation {spec.reservation} fully used"
        return CapacityTimeoutError(
            f"No TPU capacity for {name} within {seconds(self.max_wait_for_capacity)} s ({held}). Nothing was "
            "created. Raise max_wait_for_capacity or max_tpu_vms, or trigger the run later."
        )

    def _lost_the_race(self, spec: compute.TpuVmSpec, name: str) -> bool:
        """Whether another create took the last place first: asked once our insert has finished.

        Both saw room and inserted; the later by creation time yields. Not sooner: Compute refuses to delete an
        instance whose insert is unfinished (400 resourceNotReady), so the loser's VM runs for the moment
        between its insert's end and its delete."""
        return self.max_tpu_vms is not None and capacity.over_cap(
            name, self._capacity_group(spec), self.max_tpu_vms
        )

    def _yield_capacity(
        self, context: Context, spec: compute.TpuVmSpec, name: str, progress: Progress
    ) -> Any:
        """Another run's VM of the group was created first and the group is over its cap: delete ours, wait.

        Called once our insert has finished, when Compute accepts the delete."""
        from datetime import UTC, datetime

        from airflow_tpu_posttrain.recipes import cost

        zone = spec.zones[progress.zone_index]
        # The delete first: until it starts, the group holds one VM too many.
        operation = self.hook.delete_instance(
            spec.project_id, zone, name, self._request_id(context, name, zone, "yield", progress.attempt)
        )
        instance = self.hook.get_instance(spec.project_id, zone, name)  # STOPPING: its timestamps still there
        spent = cost.vm_cost(name, instance, datetime.now(UTC).isoformat(), self.prices) if instance else None
        self.log.warning(
            "%s is over the cap of %s TPU VMs (another run created its VM first): deleted it, waiting; %s",
            name,
            self.max_tpu_vms,
            f"cost of the yielded VM: {spent.describe()}" if spent else "it was already gone",
        )
        progress = progress._replace(attempt=progress.attempt + 1)
        operations = [{"name": operation, "zone": zone}] if operation else []
        return self._complete_or_defer(context, operations, None, Phase.YIELD, progress)
