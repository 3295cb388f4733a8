"""The quality gate's rule (recipes/quality_gate.py) and its operator, on the train task's XCom."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from airflow_tpu_posttrain.exceptions import InvalidInputError, QualityGateError
from airflow_tpu_posttrain.operators.quality_gate import QualityGateOperator
from airflow_tpu_posttrain.recipes.quality_gate import judge
from airflow_tpu_posttrain.recipes.validation import SpecError

SFT_BASE, SFT_TRAINED = {"eval_loss": 6.297}, {"eval_loss": 6.291}  # a real tiny run's (test_metrics.py)


@pytest.mark.parametrize(
    ("rule", "minimum", "passed"),
    [("off", 0, True), ("no_regression", 0, True), ("min_improvement", 0.05, True), ("min_improvement", 1, False)],
)
def test_sft_eval_loss_lower_is_better(rule, minimum, passed):
    verdict = judge(rule, "SFT", SFT_BASE, SFT_TRAINED, minimum)
    assert verdict.passed is passed
    assert verdict.base == 6.297 and verdict.trained == 6.291
    assert verdict.improvement == pytest.approx((6.297 - 6.291) / 6.297 * 100, abs=1e-4)  # 0.0953 %
    assert "SFT eval loss 6.297 → 6.291 (+0.10 %)" in verdict.message


def test_sft_regression_fails_no_regression():
    verdict = judge("no_regression", "SFT", SFT_TRAINED, SFT_BASE)
    assert not verdict.passed and "FAILED" in verdict.message and verdict.improvement < 0


@pytest.mark.parametrize(
    ("before", "after", "rule", "minimum", "passed"),
    [
        (0.0, 0.0, "no_regression", 0, True),  # the tiny model: nothing learned, nothing lost
        (50.0, 40.0, "no_regression", 0, False),
        (40.0, 45.0, "min_improvement", 5, True),  # points of accuracy
        (40.0, 44.0, "min_improvement", 5, False),
    ],
)
def test_grpo_accuracy_higher_is_better(before, after, rule, minimum, passed):
    verdict = judge(rule, "GRPO", {"accuracy": before, "total": 2}, {"accuracy": after}, minimum)
    assert verdict.passed is passed
    assert verdict.improvement == pytest.approx(after - before)


def test_unknown_numbers_fail_closed_except_when_off():
    verdict = judge("no_regression", "SFT", None, SFT_TRAINED)
    assert not verdict.passed
    assert verdict.message == (
        "the base model's eval loss is unknown; to publish without the gate, trigger with quality_gate=off"
    )
    assert judge("off", "GRPO", {"accuracy": 1.0}, None).passed


def test_bad_rule_names_the_field():
    with pytest.raises(SpecError, match="quality_gate='strict': is not a supported value"):
        judge("strict", "SFT", SFT_BASE, SFT_TRAINED)
    with pytest.raises(SpecError, match="min_improvement_pct=-1"):
        judge("min_improvement", "SFT", SFT_BASE, SFT_TRAINED, -1)


class _Ti:
    def __init__(self):
        self.pushed = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


def _gate(rule, minimum="1", checkpoint="gs://b/p/run/checkpoints/5/model_params"):
    trained = {
        "recipe": "SFT",
        "checkpoint": checkpoint,
        "evaluation": {"base": SFT_BASE, "trained": SFT_TRAINED},
    }
    return QualityGateOperator(task_id="quality_gate", trained=trained, rule=rule, min_improvement_pct=minimum)


def test_operator_fails_naming_the_numbers_and_the_checkpoint_and_keeps_them_in_xcom():
    ti = _Ti()
    with pytest.raises(QualityGateError) as failed:
        _gate("min_improvement", "50").execute({"ti": ti, "dag_run": SimpleNamespace()})
    assert "6.297 → 6.291" in str(failed.value) and "nothing was published" in str(failed.value)
    assert "gs://b/p/run/checkpoints/5/model_params" in str(failed.value)
    assert ti.pushed["return_value"]["passed"] is False and ti.pushed["return_value"]["min_improvement"] == 50


def test_a_checkpoint_on_the_vm_is_not_said_to_be_kept():
    """The tutorials' layout: the checkpoint is on the TPU VM's /dev/shm, which the teardown deletes."""
    with pytest.raises(QualityGateError) as failed:
        _gate("min_improvement", "50", "/dev/shm/tiny-llama/run/checkpoints/5/items").execute({"ti": _Ti()})
    message = str(failed.value)
    assert "stays" not in message
    assert "/dev/shm/tiny-llama/run/checkpoints/5/items is on the TPU VM and is deleted with it" in message
    assert "use the split layout (models.yaml: layout: split, checkpoint_storage: gs://bucket/prefix)" in message


def test_operator_passes_and_returns_the_verdict():
    verdict = _gate("no_regression").execute({"ti": _Ti()})
    assert verdict["passed"] and verdict["base"] == 6.297 and verdict["rule"] == "no_regression"


def test_operator_refuses_a_bad_minimum():
    with pytest.raises(InvalidInputError, match="min_improvement_pct='lots': is not a number"):
        _gate("min_improvement", "lots").execute({"ti": _Ti()})


# ----------------------------------------------------------------------- a real run whose model fails the gate


def test_a_model_that_fails_the_gate_is_not_published(stack, capfd, fault_matrix):
    """The tiny GRPO run (test accuracy 0 % before and after) against a gate that wants 5 points more.

    Real Airflow (dag.test) against the local stack. Slow (minutes)."""
    from conftest import log_excerpt, storage_has
    from huggingface_hub import HfApi
    from test_pipeline_local import run_pipeline, states, xcom

    dr = run_pipeline("posttrain_rl__tiny-llama", {"quality_gate": "min_improvement", "min_improvement_pct": 5})
    logs = "".join(capfd.readouterr())
    assert dr.state == "failed", states(dr)
    assert states(dr) | {"quality_gate": "failed", "export_and_publish": "upstream_failed"} == states(dr)
    assert states(dr)["delete_tpu_vm"] == states(dr)["delete_cpu_vm"] == "success"
    # No VM is made for an export that will not happen: the export VM's create never ran, its teardown found none.
    assert states(dr)["create_export_vm"] == "upstream_failed" and xcom(dr, "delete_export_vm")["deleted"] is False
    assert stack.compute.instances() == []

    trained = xcom(dr, "train")
    message = (
        "The trained model did not pass the quality gate (GRPO accuracy (%) 0 → 0 (+0.00 points); at least 5 "
        f"points better wanted: FAILED); nothing was published. Its checkpoint stays at {trained['checkpoint']}"
    )
    assert message in logs
    assert storage_has(trained["checkpoint"])  # the model is kept, in checkpoint storage
    verdict = xcom(dr, "quality_gate")
    assert (verdict["passed"], verdict["base"], verdict["trained"], verdict["min_improvement"]) == (False, 0, 0, 5)
    hub = HfApi(endpoint=stack.hub.url, token=stack.hf_token)
    repo = "local/tiny-llama-grpo"
    assert not (hub.repo_exists(repo) and hub.revision_exists(repo, f"run-{trained['run_name']}")), "published"
    fault_matrix.record(
        "pipeline: the trained model fails the quality gate (nothing published; checkpoint kept in storage)",
        stack.compute.instances() == [],
        dr.state,
        storage_has(trained["checkpoint"]),
        log_excerpt(logs, "did not pass the quality gate"),
    )

    # Its inputs are refused now: a second run with the same inputs trains nothing, makes no VM, asks no one.
    from test_pipeline_failures import instance_inserts

    inserted = len(instance_inserts(stack))
    again = run_pipeline("posttrain_rl__tiny-llama", {"quality_gate": "min_improvement", "min_improvement_pct": 5})
    logs = "".join(capfd.readouterr())
    refusal = f"Inputs equal those of run {dr.run_id}, whose model was refused (quality gate: GRPO accuracy (%) 0 → 0"
    assert again.state == "success" and refusal in logs, states(again)
    assert set(states(again).values()) == {"skipped"}, states(again)
    assert len(instance_inserts(stack)) == inserted
    fault_matrix.record(
        "claims: a second run with the inputs of a model the gate refused -> trains nothing, no VM, no one asked",
        stack.compute.instances() == [],
        again.state,
        storage_has(trained["checkpoint"]),
        log_excerpt(logs, "whose model was refused"),
    )
