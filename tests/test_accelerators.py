"""The accelerator table: single-host TPU VMs, the multi-host v6e slices it knows, and what a run may name."""

from __future__ import annotations

import pytest

from airflow_tpu_posttrain.recipes.accelerators import (
    ACCELERATORS,
    SLICE_ACCELERATORS,
    TPU_ACCELERATORS,
    tpu_env,
)


def test_each_v6e_slice_is_its_topologys_vms_of_four_chips():
    """cloud.google.com/tpu/docs/v6e: a slice's VMs are ct6e-standard-4t, 2x2 chips each."""
    shapes = {
        name: (acc.topology, acc.vms, acc.chips_per_vm, acc.machine_type, acc.host_bounds)
        for name, acc in ACCELERATORS.items()
        if acc.is_multi_host
    }
    assert shapes == {
        "v6e-16": ("4x4", 4, 4, "ct6e-standard-4t", "2,2,1"),
        "v6e-32": ("4x8", 8, 4, "ct6e-standard-4t", "2,4,1"),
        "v6e-64": ("8x8", 16, 4, "ct6e-standard-4t", "4,4,1"),
        "v6e-128": ("8x16", 32, 4, "ct6e-standard-4t", "4,8,1"),
        "v6e-256": ("16x16", 64, 4, "ct6e-standard-4t", "8,8,1"),
    }
    assert SLICE_ACCELERATORS == tuple(shapes)


def test_single_host_types_are_as_before_and_the_only_ones_a_run_may_name():
    assert TPU_ACCELERATORS == ("v6e-1", "v6e-4", "v6e-8")
    v6e_8 = ACCELERATORS["v6e-8"]
    assert (v6e_8.vms, v6e_8.chips, v6e_8.chips_per_vm, v6e_8.machine_type) == (1, 8, 8, "ct6e-standard-8t")
    assert tpu_env(v6e_8)["TPU_HOST_BOUNDS"] == "1,1,1" and tpu_env(v6e_8)["TPU_WORKER_HOSTNAMES"] == "localhost"


def test_one_vms_create_refuses_a_slice_and_the_registry_what_a_slice_does_not_serve():
    from airflow_tpu_posttrain.exceptions import InvalidInputError
    from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator
    from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

    refusal = r"accelerator_type='v6e-16': is a multi-host slice \(4 VMs of ct6e-standard-4t, topology 4x4\)"
    entry = PipelineConfig(
        model="gemma3-4b", recipe="sft", accelerator_type="v6e-16", checkpoint_storage="gs://b/x", max_tpu_chips=16
    )
    assert entry.is_slice and entry.dag_id == "posttrain_sft__gemma3-4b__slice"
    with pytest.raises(ValueError) as raised:
        PipelineConfig(
            model="llama3.1-8b-Instruct", recipe="rl", accelerator_type="v6e-16", checkpoint_storage="gs://b/x",
            zones=("us-east5-a", "us-east5-b"),
        )
    said = str(raised.value)
    assert "recipe='rl': is not served on a multi-host slice (v6e-16)" in said
    assert "Fix: GRPO trains on one TPU VM; use recipe sft on a slice" in said
    assert "zones=['us-east5-a', 'us-east5-b']: names more than one zone for a slice" in said
    operator = TpuVmCreateOperator(
        task_id="create_tpu_vm", project_id="my-project", zones=["us-east5-b"], accelerator_type="v6e-16",
        reservation="r", max_run_duration=3600,
    )
    with pytest.raises(InvalidInputError, match=refusal):
        operator._spec({})
