"""The quality gate: whether a trained model may be published, judged against its base model. Pure.

The numbers are the trainers' own evaluations on held-out data: for SFT, MaxText's eval loss before the first
step and after the last (``eval_interval`` = the steps); for GRPO, the tutorial's accuracy on the test batches
before and after training. A rule that cannot be judged (a number missing) fails: nothing unproven is published.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from airflow_tpu_posttrain.recipes import validation

RULES = ("off", "no_regression", "min_improvement")
DEFAULT_RULE = "no_regression"
DEFAULT_MIN_IMPROVEMENT_PCT = 1.0


@dataclass(frozen=True)
class Measure:
    """What the gate compares for a recipe, and which way is better."""

    key: str  # in the evaluation dicts of the train task's XCom
    label: str
    lower_is_better: bool
    unit: str  # of the improvement: "%" relative for a loss, "points" for an accuracy in percent


MEASURES = {
    "SFT": Measure("eval_loss", "eval loss", lower_is_better=True, unit="%"),
    "GRPO": Measure("accuracy", "accuracy (%)", lower_is_better=False, unit="points"),
}


@dataclass(frozen=True)
class Verdict:
    """The gate's decision, with the numbers it was made on (for XCom, the log and the error)."""

    rule: str
    passed: bool
    measure: str
    base: float | None
    trained: float | None
    improvement: float | None  # SFT: relative drop of the loss in %; GRPO: rise of the accuracy in points
    min_improvement: float | None
    message: str

    def as_xcom(self) -> dict[str, object]:
        return asdict(self)


def improvement(measure: Measure, base: float, trained: float) -> float:
    """How much better the trained model is, in the measure's unit (negative: worse)."""
    if measure.lower_is_better:
        return (base - trained) / abs(base) * 100 if base else 0.0
    return trained - base


def judge(
    rule: str,
    recipe: str,
    base: dict | None,
    trained: dict | None,
    min_improvement: float = DEFAULT_MIN_IMPROVEMENT_PCT,
) -> Verdict:
    """The verdict of ``rule`` on the base and trained evaluations of a ``recipe`` (``SFT`` / ``GRPO``) run.

    Raises :class:`validation.SpecError` for an unknown rule or recipe, or a negative minimum."""
    validation.one_of("quality_gate", rule, RULES)
    measure = MEASURES.get(recipe)
    if measure is None:
        raise validation.SpecError("recipe", recipe, "has no quality measure", f"use one of {sorted(MEASURES)}")
    if rule == "min_improvement" and not min_improvement >= 0:
        raise validation.SpecError(
            "min_improvement_pct", min_improvement, "must be 0 or more", "give e.g. 1 for 1 %"
        )
    before = _number((base or {}).get(measure.key))
    after = _number((trained or {}).get(measure.key))
    floor = min_improvement if rule == "min_improvement" else None
    if before is None or after is None:
        missing = " and ".join(
            name for name, value in (("base model's", before), ("trained model's", after)) if value is None
        )
        passed = rule == "off"
        message = f"the {missing} {measure.label} is unknown" + (
            "" if passed else "; to publish without the gate, trigger with quality_gate=off"
        )
        return Verdict(rule, passed, measure.key, before, after, None, floor, message)
    gain = improvement(measure, before, after)
    if rule == "off":
        passed = True
    elif rule == "no_regression":
        passed = after <= before if measure.lower_is_better else after >= before
    else:
        passed = gain >= min_improvement
    wanted = {
        "off": "the gate is off",
        "no_regression": "no regression wanted",
        "min_improvement": f"at least {min_improvement:g} {measure.unit} better wanted",
    }[rule]
    message = (
        f"{recipe} {measure.label} {before:.4g} → {after:.4g} ({gain:+.2f} {measure.unit}); {wanted}: "
        f"{'passed' if passed else 'FAILED'}"
    )
    return Verdict(rule, passed, measure.key, before, after, round(gain, 4), floor, message)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
