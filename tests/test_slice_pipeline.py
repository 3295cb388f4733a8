"""The SFT twin on a local multi-host slice, end to end in real Airflow (dag.test) against the local stack.

A v6e-16 slice (its create and teardown exactly the cloud entry's) whose VMs are 2 local machines standing for its 4
(the emulator's ``local_slice_vms``, docs/local-stand-ins.md): the same MaxText command on both, each one JAX
process, joined through MaxText's CPU path (``jax.distributed``). Slow: real MaxText on CPU, twice at once."""

from __future__ import annotations

import re
import subprocess

from conftest import REPO, storage_objects
from test_pipeline_local import SFT_TWIN, assert_succeeded, before_vm_end, run_pipeline, xcom

from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

SLICE_DAG = f"posttrain_sft__{SFT_TWIN}__slice"
STEPS = 5  # the local entries' SFT steps
# Each process holds its own rows of the global batch without packing: the rows one process with both would hold.
SAME_BATCHES = "packing=false"  # a MaxText override (the overrides Param is a list of them)
LOSS_TOLERANCE = 2e-3  # bfloat16 activations: the same batch on 2 devices of 2 processes or on 1 sums in another order
_LOSS = re.compile(r"completed step: (\d+), .*? loss: ([0-9.]+)")
_COMPLETED = re.compile(rb"completed step: (\d+),")
_RESTORED = re.compile(rb"Restored params from step: (\d+)")


def _single_process_losses(tmp_path) -> dict[int, float]:
    """The twin's SFT steps in ONE process on this machine, with the slice's global batch (2 rows per step).

    Built by the same builders from the same tiny model, on the same MaxText release's venv (local/stack.py's
    ``maxtext-venv-0.2.2``): converted here, then trained with ``per_device_batch_size=2``."""
    from airflow_tpu_posttrain.recipes import maxtext
    from airflow_tpu_posttrain.recipes.accelerators import accelerator
    from airflow_tpu_posttrain.recipes.layout import RunLayout
    from airflow_tpu_posttrain.recipes.models import local_profile, model_profile
    from airflow_tpu_posttrain.recipes.runtime import cpu_runtime

    local = REPO / ".local"
    model = local_profile(model_profile(SFT_TWIN), str(local / "tiny"))
    spec = maxtext.RunSpec(
        model=model,
        accelerator=accelerator("cpu"),
        runtime=cpu_runtime(str(local / "vm-launchers"), str(local / f"maxtext-venv-{model.maxtext_version}")),
        layout=RunLayout(SFT_TWIN, "single-process", str(tmp_path)),
    )
    # The local Hub holds the twin under the tutorial's repo id; here the converter reads the same files from disk.
    convert = maxtext.to_maxtext(spec).script().replace("\nexec ", "\nexec env HF_HUB_OFFLINE=1 ", 1)
    convert = convert.rstrip("\n") + f" --hf_model_path={local / 'tiny' / 'tiny-gemma3'}\n"
    train = maxtext.train_sft(spec, steps=STEPS, per_device_batch_size=2, overrides=[SAME_BATCHES])
    train_script = train.script().replace(spec.layout.base_model_files_dir, str(local / "tiny" / "tiny-gemma3"))
    said = ""
    for script in (convert, train_script):
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=900, cwd=tmp_path)
        said = done.stdout + done.stderr
        assert done.returncode == 0, said[-3000:]
    return {int(step): float(loss) for step, loss in _LOSS.findall(said)}


def test_tiny_sft_on_a_local_slice_matches_one_process(stack, capfd, tmp_path):
    """Made together, trained by one JAX process per VM, published, deleted whole.

    The loss of each step is a single process's on the same batches."""
    with before_vm_end(stack, lambda vm: None) as ends:
        dr = run_pipeline(SLICE_DAG, {"storage_uri": str(stack.published_dir), "overrides": [SAME_BATCHES]})
        logs = "".join(capfd.readouterr())
        assert_succeeded(dr, logs)
        made = xcom(dr, "create_tpu_vm")
        ends.wait_gone([vm["name"] for vm in made["vms"]] + [xcom(dr, "create_cpu_vm")["name"]])
    assert made["accelerator_type"] == "v6e-16" and made["machine_type"] == "ct6e-standard-4t"
    assert [vm["worker_id"] for vm in made["vms"]] == [0, 1]
    # One program over both VMs: MaxText's mesh spans the two processes' devices, gloo joined worker 0 to its peer.
    assert "Num_devices: 2" in logs and "Rank 0 is connected to 1 peer ranks" in logs
    trained = xcom(dr, "train")
    assert trained["metrics"]["steps_completed"] == STEPS
    run = trained["run_name"]
    objects = storage_objects(LOCAL_CHECKPOINT_STORAGE)
    # Each process wrote its part of the final checkpoint to the shared storage; process 0 committed it.
    assert f"post-train/{run}/checkpoints/{STEPS}/commit_success.txt" in objects
    for process in (0, 1):
        assert any(f"checkpoints/{STEPS}/model_params/ocdbt.process_{process}/" in o for o in objects), process
    assert f"exports/{run}/model.safetensors" in objects
    deleted = xcom(dr, "delete_tpu_vm")
    assert (deleted["deleted"], deleted["vms"]) == (True, 2)
    assert stack.compute.instances() == []

    on_slice = dict(trained["metrics"]["loss_curve"])
    alone = _single_process_losses(tmp_path)
    assert sorted(on_slice) == sorted(alone) == list(range(1, STEPS + 1)), (on_slice, alone)
    assert all(abs(on_slice[step] - alone[step]) <= LOSS_TOLERANCE for step in alone), (on_slice, alone)
