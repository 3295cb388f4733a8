"""The tiny SFT and RL DAGs end to end in real Airflow, against the local stack: Compute emulator, an sshd playing
the VM, real MaxText on CPU, the local Hub server. Slow (minutes): the real thing."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path


from conftest import HF_TOKEN, REPO


def run_pipeline(dag_id: str, conf: dict | None = None):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag(dag_id).test(run_conf=conf)


def states(dag_run):
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def xcom(dag_run, task_id):
    [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == task_id]
    return ti.xcom_pull(task_ids=task_id)


def loads_and_generates(model_dir: Path) -> str:
    check = subprocess.run(
        [str(REPO / ".local/hfcheck-venv/bin/python"), str(REPO / "airflow_tpu_posttrain/local/check_hf_model.py"),
         str(model_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert check.returncode == 0, check.stderr
    return check.stdout


def test_tiny_sft_end_to_end(stack, capfd):
    published_dir = stack.vm_dir / "published"
    dr = run_pipeline("posttrain_sft__tiny-llama", {"storage_uri": str(published_dir)})
    logs = "".join(capfd.readouterr())
    assert dr.state == "success", states(dr)
    assert states(dr)["fail_run_if_a_step_failed"] == "skipped"

    # Split layout: the CPU VM converted into the cache in checkpoint storage, the TPU VM trained from there
    # and wrote its checkpoints there, and both VMs are gone.
    storage = stack.vm_dir / "storage"
    converted = xcom(dr, "convert_to_maxtext")
    assert Path(converted["converted_params"]).is_dir()
    assert converted["converted_params"].startswith(f"{storage}/conversions/tiny-llama/mt0.2.5-")
    assert xcom(dr, "create_cpu_vm")["machine_type"] == "e2-standard-2"
    trained = xcom(dr, "train")
    assert trained["checkpoint"].endswith("/checkpoints/5/model_params") and Path(trained["checkpoint"]).is_dir()
    assert trained["checkpoint"].startswith(f"{storage}/post-train/")
    assert xcom(dr, "delete_cpu_vm")["deleted"] is True
    assert trained["metrics"]["steps_completed"] == 5 and trained["metrics"]["last_loss"] > 0
    assert "SFT: 5 steps" in logs

    published = xcom(dr, "export_and_publish")
    hub = published["hub"]
    assert hub["repo_id"] == "local/tiny-llama-sft" and hub["revision"].startswith("run-posttrain-sft-tiny-llama")
    [export_ti] = [ti for ti in dr.get_task_instances() if ti.task_id == "export_and_publish"]
    assert export_ti.xcom_pull(task_ids="export_and_publish", key="_link_PublishedModelLink") == hub["url"]
    model_copy = Path(published["storage_uri"].removeprefix("file://"))
    assert (model_copy / "model.safetensors").is_file()
    print(loads_and_generates(model_copy))

    assert xcom(dr, "delete_tpu_vm")["deleted"] is True
    # The token: nowhere in the task logs, XCom, or left on the VM.
    assert HF_TOKEN not in logs
    assert HF_TOKEN not in json.dumps([xcom(dr, t) for t in states(dr)], default=str)
    vm_files = [p for p in (stack.vm_dir / "work").rglob("*") if p.is_file()]
    assert vm_files and not any(HF_TOKEN in p.read_text(errors="ignore") for p in vm_files)


def test_tiny_rl_end_to_end(stack, capfd):
    dr = run_pipeline("posttrain_rl__tiny-llama")
    logs = "".join(capfd.readouterr())
    assert dr.state == "success", states(dr)

    trained = xcom(dr, "train")
    assert trained["checkpoint"].endswith("/checkpoints/actor/2/model_params") and Path(trained["checkpoint"]).is_dir()
    metrics = trained["metrics"]
    assert metrics["rl_completed"] is True
    assert set(metrics["pre_rl"]) >= {"accuracy", "mean_reward"} and set(metrics["post_rl"]) >= {"accuracy", "mean_reward"}
    assert re.search(r"GRPO: .*accuracy \S+ → \S+, mean reward \S+ → \S+", logs)

    hub = xcom(dr, "export_and_publish")["hub"]
    assert hub["repo_id"] == "local/tiny-llama-grpo"
    # The published branch holds the exported model; download it through huggingface_hub and load it.
    from huggingface_hub import snapshot_download

    local = snapshot_download(
        hub["repo_id"], revision=hub["revision"], endpoint=stack.hub.url,
        token=HF_TOKEN, cache_dir=str(stack.vm_dir / "hf-cache"),
    )
    print(loads_and_generates(Path(local)))
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True
    assert HF_TOKEN not in logs


def test_tiny_sft_in_the_seeds_layout(stack, capfd):
    """The tutorials' layout stays available: one VM does every step, files under its root, no storage."""
    dr = run_pipeline("posttrain_sft__tiny-llama__seeds")
    capfd.readouterr()
    assert dr.state == "success", states(dr)
    assert "create_cpu_vm" not in states(dr)
    root = stack.vm_dir / "runs"
    assert xcom(dr, "convert_to_maxtext")["converted_params"] == f"{root}/mt-format/0/items"
    trained = xcom(dr, "train")
    assert trained["checkpoint"].startswith(f"{root}/post-train/") and Path(trained["checkpoint"]).is_dir()
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []
