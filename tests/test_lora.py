"""The LoRA twin's DAG end to end in real Airflow, and its adapter loaded with PEFT from the local Hub.

Adapters trained on the tiny Gemma 3 with MaxText 0.2.5 on the CPU, exported as a PEFT adapter, checked against the
base and published to the local Hub, then loaded from there onto the base the adapter names."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import HF_TOKEN, REPO, storage_objects
from test_pipeline_local import assert_succeeded, run_pipeline, states, xcom

from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

LORA_TWIN_DAG = "posttrain_sft__tiny-gemma3-4b__lora"
BASE_REPO = "google/gemma-3-4b-it"  # the tiny Gemma 3, served by the local Hub under the cloud model's id
# MaxText's default LoRA modules for Gemma 3 (post_train/lora_module_path.yml): every attention and MLP projection.
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def peft_loads(stack, adapter: str, revision: str) -> dict:
    check = subprocess.run(
        [str(REPO / ".local/hfcheck-venv/bin/python"), str(REPO / "airflow_tpu_posttrain/local/check_peft_adapter.py"),
         adapter, "--revision", revision],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_ENDPOINT": stack.hub.url, "HF_TOKEN": HF_TOKEN, "HF_HOME": str(stack.vm_dir / "peft-check")},
    )
    assert check.returncode == 0, check.stderr[-3000:]
    return json.loads(check.stdout.strip().splitlines()[-1])


def test_a_lora_run_publishes_an_adapter_that_peft_loads_onto_its_base(stack, capfd):
    dr = run_pipeline(LORA_TWIN_DAG, {"storage_uri": str(stack.published_dir)})
    logs = "".join(capfd.readouterr())
    assert_succeeded(dr, logs)
    assert states(dr)["fail_run_if_a_step_failed"] == "skipped"

    # Trained with the LoRA tutorial's keys on MaxText 0.2.5; the checkpoints hold the adapters only.
    converted, trained = xcom(dr, "convert_to_maxtext"), xcom(dr, "train")
    assert converted["converted_params"].startswith(f"{LOCAL_CHECKPOINT_STORAGE}/conversions/tiny-gemma3-4b/mt0.2.5-")
    assert "Config param lora: {'enable_lora': True, 'lora_rank': 16, 'lora_alpha': 32.0" in logs
    assert trained["metrics"]["steps_completed"] == 5 and xcom(dr, "quality_gate")["passed"]
    objects = storage_objects(LOCAL_CHECKPOINT_STORAGE)
    run = trained["run_name"]
    adapter_checkpoint = [o for o in objects if o.startswith(f"post-train/{run}/checkpoints/5/model_params/")]
    assert adapter_checkpoint and not any("token_embedder" in o or "embedding" in o for o in adapter_checkpoint)

    # Published: the adapter and its card, the adapter pointed at the base repo at the revision converted.
    published = xcom(dr, "export_and_publish")
    hub, validated = published["hub"], published["validated"]
    assert hub["repo_id"] == "local/tiny-gemma3-4b-lora"
    assert validated["adapter"]["r"] == 16 and set(validated["adapter"]["target_modules"]) == PROJECTIONS
    copy = Path(published["storage_uri"].removeprefix("file://"))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in copy.iterdir()}
    assert not (copy / "model.safetensors").exists()
    adapter_config = json.loads((copy / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == BASE_REPO
    assert adapter_config["revision"] == converted["source_revision"]
    card = (copy / "README.md").read_text()
    assert "library_name: peft" in card and f'PeftModel.from_pretrained(base, "{hub["repo_id"]}"' in card
    assert "LoRA adapter: rank 16, alpha 32.0" in card
    adapter_bytes = (copy / "adapter_model.safetensors").stat().st_size
    base_bytes = (stack.local_dir / "tiny" / "tiny-gemma3" / "model.safetensors").stat().st_size
    print(f"adapter {adapter_bytes} bytes, {validated['params']} params; the tiny base's weights {base_bytes} bytes")
    assert adapter_bytes < base_bytes

    # A user's load from the Hub: the base the adapter names, the adapter onto it; merged, it changes the weights
    # of the adapted projections of every layer and nothing else.
    loaded = peft_loads(stack, hub["repo_id"], hub["revision"])
    assert loaded["base"] == f"{BASE_REPO}@{converted['source_revision']}" and loaded["generated"]
    adapted = {name for name in loaded["changed"] + loaded["unchanged"]
               if ".layers." in name and name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJECTIONS
               and "vision" not in name}
    assert len(adapted) == 14 * len(PROJECTIONS)
    assert set(loaded["changed"]) == adapted
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []
