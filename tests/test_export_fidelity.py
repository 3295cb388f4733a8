"""The export's fidelity check (vm_scripts/export_fidelity.py), as publish_model.py runs it before keeping or publishing.

The exports here are the tiny models' Hugging Face folders (a full model, and a PEFT adapter of the tiny Gemma 3 in the
shape MaxText writes it); their reference losses are their own, computed with transformers in the check venv
(local/setup_hfcheck.sh): the stand-in for MaxText's, which every local pipeline's export computes with MaxText
(tests/test_pipeline_local.py, tests/test_approval.py; the broken export in a pipeline: tests/test_maxtext_faults.py).
The faults are the local export launcher's own (local/vm_launchers/to_huggingface_cpu.py ``break_export``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_publish import bytecode_cache, folder_contents, hub, hub_args, run_publish, token, token_file  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
HFCHECK = REPO / ".local" / "hfcheck-venv" / "bin" / "python"
TINY = REPO / ".local" / "tiny"
CHECK_TIMEOUT_S = 600  # the check loads torch, transformers and PEFT: minutes on a loaded 2-core machine
sys.path.insert(0, str(REPO / "airflow_tpu_posttrain" / "local" / "vm_launchers"))
from to_huggingface_cpu import break_export  # noqa: E402

sys.path.remove(str(REPO / "airflow_tpu_posttrain" / "local" / "vm_launchers"))

# Run in the check venv: the rows' token ids and their losses under the folder given (an adapter: on its base), as
# export_fidelity.py's reference writes them; and, for an adapter, one made with PEFT on the language model's
# q_proj and v_proj, non-zero, its config naming them as MaxText does.
_HELPER = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import export_fidelity as ef
command, folder, base = sys.argv[2], Path(sys.argv[3]), sys.argv[4] or None
if command == "adapter":
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = r"model\\.language_model\\.layers\\.\\d+\\.self_attn\\.(q_proj|v_proj)"
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)).save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["q_proj", "v_proj"]}))
    sys.exit(0)
rows = [[2, 17, 40, 41, 60, 99, 130, 200, 7, 8], [2, 11, 12, 13, 300, 301]]
if base:  # the adapter as it will be published: its config naming the language model's modules only
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"target_modules": sys.argv[5]}))
model, _ = ef.load_export(folder, base)
print(json.dumps({"rows": rows, "maxtext": ef.transformers_token_losses(model, rows), "rounded_to": "float32"}))
"""


def _in_check_venv(*args: str) -> str:
    proc = subprocess.run(
        [str(HFCHECK), "-c", _HELPER, str(REPO / "airflow_tpu_posttrain" / "vm_scripts"), *args],
        capture_output=True, text=True, timeout=CHECK_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _fidelity_args(reference: Path) -> list[str]:
    return ["--fidelity-reference", str(reference), "--fidelity-python", str(HFCHECK)]


def test_a_permuted_tensor_fails_the_check_before_anything_is_kept_naming_both_losses(
    tmp_path, run_publish, fault_matrix  # noqa: F811
):
    export = tmp_path / "export"
    shutil.copytree(TINY / "tiny-llama", export)
    reference = tmp_path / "maxtext.json"
    reference.write_text(_in_check_venv("losses", str(export), ""))
    kept, copied = tmp_path / "kept", tmp_path / "published"

    proc = run_publish("--model-dir", str(export), "--result-file", str(tmp_path / "ok.json"), *_fidelity_args(reference),
                       "--keep-uri", str(kept), "--storage-uri", str(copied), timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    fidelity = json.loads((tmp_path / "ok.json").read_text())["validated"]["fidelity"]
    assert fidelity["faithful"] and fidelity["loss_gap"] <= 1e-6 and fidelity["max_token_gap"] <= 1e-5, fidelity
    assert "publish_model: export fidelity: loss " in proc.stdout
    shutil.rmtree(kept), shutil.rmtree(copied)

    broken = tmp_path / "broken"
    shutil.copytree(TINY / "tiny-llama", broken)
    break_export("permute", broken)
    proc = run_publish("--model-dir", str(broken), "--result-file", str(tmp_path / "broken.json"),
                       *_fidelity_args(reference), "--keep-uri", str(kept), "--storage-uri", str(copied),
                       timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 3, proc.stderr  # the export job then drops its marker: the next try exports again
    assert not kept.exists() and not copied.exists() and not (tmp_path / "broken.json").exists()
    assert f"The export is kept for a look at {kept}.unfaithful" in proc.stderr
    assert folder_contents(Path(f"{kept}.unfaithful")) == folder_contents(broken)
    assert not Path(f"{kept}.unfaithful.complete").exists()
    [said] = [json.loads(line.removeprefix("export_fidelity: ")) for line in proc.stdout.splitlines()
              if line.startswith("export_fidelity: {")]
    loss_maxtext, loss_export = f"{said['loss_maxtext']:.6f}", f"{said['loss_export']:.6f}"
    assert f"the export's loss is {loss_export}, MaxText's of the trained checkpoint {loss_maxtext}" in proc.stderr
    assert loss_export != loss_maxtext and f"the export in {broken} is not the model MaxText trained" in proc.stderr
    assert (broken / "model.safetensors").exists()  # left there for a look
    fault_matrix.record(
        "export: a tensor permuted (full model) -> refused before it is kept or published, both losses named",
        None, "n/a", True, f"loss {loss_export} vs MaxText's {loss_maxtext}; kept for a look at <kept>.unfaithful",
    )


@pytest.mark.parametrize(
    ("fault", "refusal"),
    [
        ("zero_adapter", "merged, the adapter leaves unchanged 28 of its 28 target weights: "
                         "model.language_model.layers.0.self_attn.q_proj"),
        ("drop_module", "missing adapter weights (PEFT adapts the module; the file has no lora_A/lora_B) for "
                        "model.language_model.layers.0.self_attn.q_proj"),
    ],
)
def test_a_broken_adapter_fails_the_check_before_anything_is_kept(
    tmp_path, run_publish, hub, token, token_file, fault, refusal, fault_matrix  # noqa: F811
):
    """A zeroed adapter loads with PEFT and generates; one missing a module loads with a warning only."""
    revision = hub.store.seed_repo("google/gemma-3-4b-it", TINY / "tiny-gemma3")
    adapter = tmp_path / "adapter"
    _in_check_venv("adapter", str(adapter), str(TINY / "tiny-gemma3"))
    # What publish_model.py makes the config say (target_language_model_only), which the reference is scored with.
    published_targets = r"model\.language_model\.(?:.*\.)?(?:q_proj|v_proj)"
    pristine = tmp_path / "pristine"
    shutil.copytree(adapter, pristine)
    reference = tmp_path / "maxtext.json"
    reference.write_text(_in_check_venv("losses", str(pristine), str(TINY / "tiny-gemma3"), published_targets))
    publish = ["--base-model", "google/gemma-3-4b-it", "--base-revision", revision, "--adapter-rank", "4",
               "--adapter-alpha", "8.0", "--hub-endpoint", hub.url, *_fidelity_args(reference)]
    env = {"HF_TOKEN": token, "HF_HOME": str(tmp_path / "hf-home")}

    faithful = tmp_path / "faithful"
    shutil.copytree(adapter, faithful)
    proc = run_publish("--model-dir", str(faithful), "--result-file", str(tmp_path / "ok.json"),
                       "--keep-uri", str(tmp_path / "kept-ok"), *publish, env=env, timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert f"target_modules {published_targets!r}, the language model's modules MaxText named" in proc.stdout
    fidelity = json.loads((tmp_path / "ok.json").read_text())["validated"]["fidelity"]
    assert fidelity["faithful"] and fidelity["adapter_changes"] == 28 and fidelity["loss_gap"] == 0.0, fidelity

    break_export(fault, adapter)
    kept = tmp_path / "kept"
    proc = run_publish("--model-dir", str(adapter), "--result-file", str(tmp_path / "result.json"),
                       "--keep-uri", str(kept), *hub_args(hub), *publish, token_file=token_file, env=env,
                       timeout=CHECK_TIMEOUT_S)
    assert proc.returncode == 3, proc.stderr
    assert refusal in proc.stderr and "the export's loss is " in proc.stderr
    assert not kept.exists() and Path(f"{kept}.unfaithful", "adapter_model.safetensors").exists()
    assert not any(r.method == "POST" for r in hub.requests), "nothing may reach the Hub"
    fault_matrix.record(
        f"export: an adapter {'zeroed' if fault == 'zero_adapter' else 'missing a module'} -> refused before it is "
        "kept or published", None, "n/a", True, refusal[:80],
    )
