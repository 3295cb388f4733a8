"""The registry refuses entries that share a line of places but not its cap or location, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from airflow_tpu_posttrain.pipelines.registry import RegistryError, load_registry

DAGS_DIR = Path(__file__).resolve().parent.parent / "dags"
SFT, RL = "posttrain_sft__gemma3-4b", "posttrain_rl__llama3.1-8b-Instruct"


def registry_with(tmp_path: Path, sft: dict, rl: dict) -> Path:
    """The example registry's two tutorial entries, with ``sft`` and ``rl`` laid over them."""
    registry = yaml.safe_load((DAGS_DIR / "models.yaml").read_text())
    registry["pipelines"] = [{**registry["pipelines"][0], **sft}, {**registry["pipelines"][1], **rl}]
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(registry))
    return path


@pytest.mark.parametrize(
    ("case", "sft", "rl"),
    [
        ("8 and 16 chips", {"max_tpu_chips": 8}, {"max_tpu_chips": 16}),
        ("8 chips on res1, 2 VMs of 8 on us-east5-b=res1 of a per-zone reservation",
         {"max_tpu_chips": 8, "reservation": "res1"},
         {"zones": ["us-east5-b", "us-east5-a"], "reservation": "us-east5-a=res2,us-east5-b=res1", "max_tpu_vms": 2}),
        ("one cap, two capacity_claims buckets",
         {"capacity_claims": "gs://bucket-a/places"}, {"capacity_claims": "gs://bucket-b/places"}),
    ],
    ids=["two caps", "one reservation written two ways", "two locations"],
)
def test_entries_sharing_a_line_must_agree_on_its_cap_and_location(tmp_path, case, sft, rl, fault_matrix):
    with pytest.raises(RegistryError) as raised:
        load_registry(registry_with(tmp_path, sft, rl), local=False)
    [problem] = raised.value.problems
    assert f"{SFT} and {RL} share the line of places" in problem and "Fix: give both the same max_tpu_chips" in problem
    fault_matrix.record(
        f"capacity: two registry entries share a line of places but not its cap or location ({case}) -> refused "
        "at registry load, naming both", None, "n/a", None, problem[:200],
    )


def test_entries_sharing_a_line_with_one_cap_and_a_slice_under_its_size(tmp_path):
    """One cap however it is written (8 chips, or 1 VM of 8) loads; a slice larger than its cap does not."""
    configs = load_registry(registry_with(tmp_path, {"max_tpu_chips": 8}, {"max_tpu_vms": 1}), local=False)
    assert [c.tpu_cap_chips for c in configs] == [8, 8]
    with pytest.raises(RegistryError, match="max_tpu_chips=8: admits 8 TPU chips at once, fewer than the 16"):
        load_registry(registry_with(tmp_path, {"accelerator_type": "v6e-16", "max_tpu_chips": 8}, {}), local=False)
