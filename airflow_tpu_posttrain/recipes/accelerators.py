"""Accelerator types: the Compute Engine machine type and the TPU environment the trainers need."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from airflow_tpu_posttrain.recipes.shell import EnvValue, ShellExpansion
from airflow_tpu_posttrain.recipes.validation import SpecError

# What makes JAX use the host CPU; libtpu, when installed, otherwise probes for a TPU first.
CPU_JAX_ENV: Mapping[str, str] = MappingProxyType({"JAX_PLATFORMS": "cpu"})
# How MaxText's steps run on a machine without a TPU (its convert_checkpoint.md; the tutorials' to_maxtext): without
# them its pyconfig calls jax.distributed.initialize(), which needs a coordinator off a TPU.
CPU_CONVERSION_ARGS: Mapping[str, str] = MappingProxyType({"hardware": "cpu", "skip_jax_distributed_system": "true"})


@dataclass(frozen=True)
class Accelerator:
    """One machine shape: ``vms`` VMs of ``machine_type`` holding ``chips`` in all (a slice when ``vms`` > 1).

    The TPU fields are ``None`` for the CPU pseudo-accelerators."""

    type: str
    machine_type: str
    chips: int
    topology: str | None = None
    chips_per_host_bounds: str | None = None
    host_bounds: str | None = None
    vms: int = 1

    @property
    def is_tpu(self) -> bool:
        return self.topology is not None

    @property
    def is_multi_host(self) -> bool:
        return self.vms > 1

    @property
    def chips_per_vm(self) -> int:
        return self.chips // self.vms


def _v6e(chips: int, machine_type: str, topology: str, chips_per_host_bounds: str) -> Accelerator:
    return Accelerator(f"v6e-{chips}", machine_type, chips, topology, chips_per_host_bounds, "1,1,1")


# Multi-host v6e slices (cloud.google.com/tpu/docs/v6e, its table of slice shapes; on Compute Engine a MIG whose
# workload policy names the topology, compute/docs/tpus/create-tpu-mig-multi-host-slice): every VM of one is a
# ct6e-standard-4t with its 4 chips as 2x2, so a slice of X x Y chips is (X/2) x (Y/2) VMs.
SLICE_MACHINE_TYPE = "ct6e-standard-4t"
SLICE_CHIPS_PER_VM = 4


def _v6e_slice(topology: str) -> Accelerator:
    x, y = (int(side) for side in topology.split("x"))
    chips = x * y
    return Accelerator(
        f"v6e-{chips}", SLICE_MACHINE_TYPE, chips, topology, "2,2,1", f"{x // 2},{y // 2},1",
        vms=chips // SLICE_CHIPS_PER_VM,
    )


ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType(
    {
        acc.type: acc
        for acc in (
            _v6e(1, "ct6e-standard-1t", "1x1", "1,1,1"),
            _v6e(4, "ct6e-standard-4t", "2x2", "2,2,1"),
            _v6e(8, "ct6e-standard-8t", "2x4", "2,4,1"),
            *(_v6e_slice(topology) for topology in ("4x4", "4x8", "8x8", "8x16", "16x16")),
            # The local "VM" (this machine over SSH) runs the tiny model on its CPU. e2-standard-2 (2 vCPUs,
            # 8 GB) is the smallest general-purpose shape the tiny pipeline was seen to fit (peak < 1.1 GB
            # on 2 cores); the local Compute emulator records it, and a real e2-standard-2 could run it too.
            # chips=1 because MaxText sees one CPU device (train_rl's chips_per_vm).
            Accelerator("cpu", "e2-standard-2", 1),
            # The CPU VM that converts and exports while the TPU VM trains (split layout): 16 vCPUs, 128 GB,
            # room for an 8B model's weights loaded eagerly during conversion, at ~1/20 of a v6e-8's price.
            Accelerator("cpu-highmem-16", "n2-highmem-16", 1),
        )
    }
)


DEFAULT_ACCELERATOR = "v6e-8"  # the tutorials' TPU slice
# What a run may name: one VM each. The slices above are known (the emulator serves them) but not provisioned.
TPU_ACCELERATORS = tuple(name for name, acc in ACCELERATORS.items() if acc.is_tpu and not acc.is_multi_host)
SLICE_ACCELERATORS = tuple(name for name, acc in ACCELERATORS.items() if acc.is_multi_host)


def accelerator(accelerator_type: str) -> Accelerator:
    try:
        return ACCELERATORS[accelerator_type]
    except (KeyError, TypeError):
        raise SpecError(
            "accelerator_type",
            accelerator_type,
            "is not a supported accelerator",
            f"use one of: {', '.join(ACCELERATORS)}",
        ) from None


def single_host(field: str, accelerator_type: str) -> Accelerator:
    """The accelerator a run trains on: a known type of one VM; a multi-host slice is refused, naming the fix."""
    acc = accelerator(accelerator_type)
    if acc.is_multi_host:
        raise SpecError(
            field,
            accelerator_type,
            f"is a multi-host slice ({acc.vms} VMs of {acc.machine_type}, topology {acc.topology}), and a run "
            "trains on one TPU VM",
            f"use one of: {', '.join(TPU_ACCELERATORS)}",
        )
    return acc


def tpu_env(acc: Accelerator) -> dict[str, EnvValue]:
    """The environment the tutorials export before training, in their order; for ``cpu``, JAX's CPU switch.

    ``TPU_NAME`` is the VM's own hostname, computed on the VM as in the tutorials (``$(hostname)``).
    """
    if acc.topology is None or acc.chips_per_host_bounds is None or acc.host_bounds is None:
        return dict(CPU_JAX_ENV)
    return {
        "TPU_ACCELERATOR_TYPE": acc.type,
        "TPU_WORKER_ID": "0",
        "TPU_NAME": ShellExpansion.HOSTNAME,
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_TOPOLOGY": acc.topology,
        "TPU_CHIPS_PER_HOST_BOUNDS": acc.chips_per_host_bounds,
        "TPU_HOST_BOUNDS": acc.host_bounds,
    }


def slice_worker_env(acc: Accelerator, worker_id: int, worker_addresses: Sequence[str], *, cpu: bool) -> dict[str, EnvValue]:
    """What worker ``worker_id`` of a multi-host slice needs to find its peers: the same program runs on every VM.

    On the TPU, the tutorials' environment with this worker's id and every worker's address: with
    ``TPU_SKIP_MDS_QUERY`` set, JAX's cluster detection takes the slice from ``TPU_WORKER_HOSTNAMES`` and
    ``TPU_WORKER_ID`` (jax 0.12 ``_src/clusters/cloud_tpu_cluster.py``, ``GkeTpuCluster``), and so does libtpu. On
    a CPU (``cpu``: the local slice), what MaxText's ``initialize_jax_for_cpu`` hands ``jax.distributed.initialize``
    (MaxText 0.2.2 ``utils/max_utils.py``): worker 0's address (its port is MaxText's, 1234), the process count and
    this process's index."""
    if not acc.is_multi_host:
        raise ValueError(f"{acc.type} is one VM, not a slice")
    count = str(len(worker_addresses))
    if cpu:
        return {
            **CPU_JAX_ENV,
            "JAX_COORDINATOR_ADDRESS": worker_addresses[0],
            "JAX_PROCESS_COUNT": count,
            "JOB_INDEX": "0",
            "PROCESSES_IN_JOB": count,
            "JOB_COMPLETION_INDEX": str(worker_id),
        }
    return {**tpu_env(acc), "TPU_WORKER_ID": str(worker_id), "TPU_WORKER_HOSTNAMES": ",".join(worker_addresses)}
