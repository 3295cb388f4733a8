"""The quality gate between training and publishing (``recipes/quality_gate.py`` decides)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.defaults import GCP_CONN_ID
from airflow_tpu_posttrain.exceptions import InvalidInputError, QualityGateError
from airflow_tpu_posttrain.operators.inputs_check import REFUSAL_RECORDED, record_refused
from airflow_tpu_posttrain.recipes import quality_gate
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context


class QualityGateOperator(BaseOperator):
    """Fails the run, before anything is published, when the trained model is not better than its base.

    Reads the train task's evaluations (XCom ``evaluation``: ``base`` and ``trained``); needs no VM. XCom: the
    verdict (rule, numbers, improvement, message), passed or not.

    :param trained: the train task's record, wired as its XComArg (``train.output``).
    :param rule: ``off`` (publish anyway; the numbers are still reported), ``no_regression`` (the trained model
        is at least as good), or ``min_improvement``.
    :param min_improvement_pct: for ``min_improvement``: SFT, how many percent lower the eval loss must be; GRPO,
        how many points higher the accuracy (in percent) must be.
    :param training_claim: the inputs check's claim on the run's inputs (its ``training_claim`` XCom; None: no
        shared storage). A failed gate marks it refused: later runs with these inputs train nothing.
    :param gcp_conn_id: the Google connection that writes the claim.
    """

    template_fields: Sequence[str] = ("trained", "rule", "min_improvement_pct", "training_claim")
    ui_color = "#f4ecd8"

    def __init__(
        self,
        *,
        trained: Any,
        rule: str = quality_gate.DEFAULT_RULE,
        min_improvement_pct: float | str = quality_gate.DEFAULT_MIN_IMPROVEMENT_PCT,
        training_claim: str | None = None,
        gcp_conn_id: str = GCP_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trained = trained
        self.rule = rule
        self.min_improvement_pct = min_improvement_pct
        self.training_claim = training_claim
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context: Context) -> dict[str, object]:
        trained = self.trained if isinstance(self.trained, dict) else {}
        evaluation = trained.get("evaluation") or {}
        try:
            verdict = quality_gate.judge(
                self.rule,
                trained.get("recipe") or "",
                evaluation.get("base"),
                evaluation.get("trained"),
                _float("min_improvement_pct", self.min_improvement_pct),
            )
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        self.log.info("Quality gate: %s", verdict.message)
        if not verdict.passed:
            context["ti"].xcom_push(key="return_value", value=verdict.as_xcom())  # the numbers, failed or not
            if record_refused(context, self.training_claim, f"quality gate: {verdict.message}", self.gcp_conn_id):
                self.log.info(REFUSAL_RECORDED, self.training_claim)
            raise QualityGateError(
                f"The trained model did not pass the quality gate ({verdict.message}); nothing was published. "
                + _where_the_checkpoint_stays(str(trained.get("checkpoint") or ""))
            )
        return verdict.as_xcom()


def _where_the_checkpoint_stays(checkpoint: str) -> str:
    """What the failed gate's message says of the checkpoint: kept in checkpoint storage, or deleted with the VM.

    In the tutorials' layout it is on the TPU VM's /dev/shm, which the teardown deletes."""
    if checkpoint.startswith("gs://"):
        return f"Its checkpoint stays at {checkpoint}"
    return (
        f"Its checkpoint {checkpoint} is on the TPU VM and is deleted with it (the tutorials' layout keeps nothing "
        "after the run). To keep a model that fails the gate, use the split layout (models.yaml: layout: split, "
        "checkpoint_storage: gs://bucket/prefix)."
    )


def _float(field: str, value: float | str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise SpecError(field, value, "is not a number", "give a number, e.g. 1") from err
