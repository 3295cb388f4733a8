"""What a VM cost: Compute's timestamps times the registry's price table."""

from __future__ import annotations

import textwrap

import pytest

from airflow_tpu_posttrain.recipes import cost
from airflow_tpu_posttrain.recipes.validation import SpecError

INSTANCE = {
    "creationTimestamp": "2026-12-01T01:00:00.000-08:00",
    "machineType": "https://www.googleapis.com/compute/v1/projects/p/zones/us-east5-b/machineTypes/ct6e-standard-8t",
    "scheduling": {"provisioningModel": "RESERVATION_BOUND"},
}


def test_a_v6e_8_for_an_hour_and_a_half_costs_what_the_price_list_says():
    spent = cost.vm_cost("tpu-vm", INSTANCE, "2026-12-01T10:30:00.000+00:00")  # 02:30 PST
    assert spent.seconds == 5400 and spent.usd_per_hour == 21.6 and spent.usd == 32.4
    assert spent.describe() == "tpu-vm (ct6e-standard-8t, RESERVATION_BOUND) ran 1 h 30 min: $32.40 at $21.6/h"
    assert spent.as_dict() == {
        "machine_type": "ct6e-standard-8t",
        "provisioning_model": "RESERVATION_BOUND",
        "vm_seconds": 5400.0,
        "usd_per_hour": 21.6,
        "cost_usd": 32.4,
    }


def test_a_model_without_a_price_has_no_cost_and_says_which_entry_to_add():
    spot = {**INSTANCE, "scheduling": {"provisioningModel": "SPOT"}}
    spent = cost.vm_cost("tpu-vm", spot, "2026-12-01T09:00:45+00:00")
    assert spent.usd is None and spent.as_dict()["cost_usd"] is None and spent.seconds == 45
    assert "no price for ct6e-standard-8t SPOT" in spent.describe()
    assert "prices: {ct6e-standard-8t: {SPOT: USD/h}}" in spent.describe()


def test_a_vm_that_lived_under_a_minute_is_billed_a_minute():
    spent = cost.vm_cost("tpu-vm", INSTANCE, "2026-12-01T09:00:45+00:00")
    assert spent.seconds == 45 and spent.usd == 0.36  # 60 s of $21.6/h


def test_the_registry_prices_lay_over_the_defaults():
    table = cost.price_table({"ct6e-standard-8t": {"SPOT": 9.5}, "n2-standard-8": {"STANDARD": 0.39}})
    assert table["ct6e-standard-8t"] == {"STANDARD": 21.6, "RESERVATION_BOUND": 21.6, "SPOT": 9.5}
    assert table["n2-standard-8"] == {"STANDARD": 0.39}
    spot = {**INSTANCE, "scheduling": {"provisioningModel": "SPOT"}}
    assert cost.vm_cost("v", spot, "2026-12-01T10:00:00+00:00", table).usd == 9.5
    assert cost.DEFAULT_PRICES["ct6e-standard-8t"].get("SPOT") is None  # the defaults are left as they were


@pytest.mark.parametrize(
    ("prices", "field"),
    [({"ct6e-standard-8t": 21.6}, "prices"), ({"ct6e-standard-8t": {"SPOT": "cheap"}}, "prices.ct6e-standard-8t.SPOT")],
)
def test_a_malformed_price_table_names_the_entry(prices, field):
    with pytest.raises(SpecError) as raised:
        cost.price_table(prices)
    assert raised.value.field == field


def test_a_registry_with_a_bad_price_refuses_to_load(tmp_path):
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    registry = tmp_path / "models.yaml"
    registry.write_text(
        textwrap.dedent(
            """
            prices:
              ct6e-standard-8t: {SPOT: -1}
            defaults: {checkpoint_storage: "gs://b/p"}
            pipelines:
              - {model: gemma3-4b, recipe: sft}
            """
        )
    )
    with pytest.raises(ValueError, match=r"prices\.ct6e-standard-8t\.SPOT=-1: is not a price"):
        load_registry(registry)
    registry.write_text(registry.read_text().replace("{SPOT: -1}", "{SPOT: 9.5}"))
    [config] = load_registry(registry)
    assert config.prices["ct6e-standard-8t"]["SPOT"] == 9.5


def test_a_flex_start_vm_is_billed_from_its_start_not_its_queue():
    """Queued in PENDING for an hour (no capacity yet), then RUNNING for 30 minutes: 30 minutes billed."""
    queued = {**INSTANCE, "lastStartTimestamp": "2026-12-01T02:00:00.000-08:00"}
    spent = cost.vm_cost("tpu-vm", queued, "2026-12-01T10:30:00.000+00:00")
    assert spent.seconds == 1800 and spent.usd == 10.8


def _card_cost(trained: dict) -> str | None:
    from airflow_tpu_posttrain.operators.export import HfExportOperator

    operator = HfExportOperator(task_id="export_and_publish", model="tiny-llama", vm={}, trained=trained)
    return operator._training_cost(trained)


VM = {"name": "tpu-x", "machine_type": "ct6e-standard-8t", "provisioning_model": "RESERVATION_BOUND"}


def test_the_cards_cost_counts_every_vm_a_recovered_training_ran_on():
    """The first VM ran an hour until it was lost; the recovered one from its own start to the end."""
    trained = {
        "vm": {**VM, "started_at": "2026-12-01T11:10:00+00:00"},
        "finished_at": "2026-12-01T11:40:00+00:00",
        "lost_vms": [{**VM, "started_at": "2026-12-01T10:00:00+00:00", "lost_at": "2026-12-01T11:00:00+00:00"}],
    }
    line = _card_cost(trained)
    assert line.startswith("$32.40 over 2 VMs (recoveries): ")  # 30 min + 60 min at $21.6/h; not the 10 min down
    assert "ran 30 min 00 s: $10.80" in line and "ran 1 h 00 min: $21.60" in line


def test_a_reused_training_claims_no_cost():
    """The final checkpoint of an earlier try was reused: this run's VM did not train."""
    trained = {"vm": {**VM, "started_at": "2026-12-01T10:00:00+00:00"}, "finished_at": "2026-12-01T10:20:00+00:00"}
    assert _card_cost(trained).endswith("$7.20 at $21.6/h")
    assert _card_cost({**trained, "reused": True}) is None
