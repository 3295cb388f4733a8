"""Metrics from MaxText / Tunix trainer log lines, for XCom and a one-line task summary.

Pure: no I/O, no Airflow. Lines are matched on their message, wherever it sits in the line, so absl prefixes
(``I1129 15:29:33.081234 140 peft_trainer.py:488]``, ``INFO:absl:``), a ``[remote]`` tag, Airflow's
timestamps and ANSI colour codes are all ignored. Lines that match nothing are skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields

_NUMBER = r"[-+]?(?:nan|inf|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# Tunix PeftTrainer: "Train step 1 training loss: 6.275753  - training perplexity: 531.526489"
_TRAIN_STEP = re.compile(
    rf"Train step (\d+) training loss: ({_NUMBER})(?:\s*-\s*training perplexity: ({_NUMBER}))?", re.I
)
# MaxText: "completed step: 1, seconds: 43.755, ..., Tokens/s/device: 2.925, ..., loss: 6.276, lm_loss: 0.000,
# perplexity: 531.526". Its perplexity is not the step's: MaxText's post-training hook reads Tunix's
# ``metrics_logger.get_metric(..., "perplexity", "train")``, the geometric mean over every step so far
# (maxtext/trainers/post_train/hooks.py, tunix/sft/metrics_logger.py); the step's own is on the "Train step" line.
_COMPLETED_STEP = re.compile(r"completed step: (\d+),(.*)")
_STEP_TOKENS_PER_S = re.compile(rf"Tokens/s/device: ({_NUMBER})", re.I)
# Anchored on the comma so that "lm_loss" is not read as "loss".
_STEP_LOSS = re.compile(rf",\s*loss: ({_NUMBER})", re.I)

# Logged by every ``PeftTrainer.train()`` call, timing that call's loop: SFT makes one call, the RL learner one per
# batch (a tiny GRPO run: 5.1119 s, then 0.0396 s), so the training loop's time is their sum.
# MaxText, after each evaluation (``eval_interval``): "Completed eval after train step 4, loss=6.291,
# perplexity=541.219, total_weights=28.0, ..." (0.2.5), "eval metrics after step: 4, loss=6.291, perplexity=541.219,
# total_weights=28.0" (0.2.2, 0.2.3: maxtext/common/metric_logger.py ``_log_eval_metrics``). This loss is that
# evaluation's own mean over its batches; Tunix's "Train step 4 eval loss: 6.293824" beside it is the mean over
# every evaluation of the process so far.
_EVAL = re.compile(rf"(?:Completed eval after train step|eval metrics after step:) (\d+), loss=({_NUMBER})")
_TRAIN_LOOP_FINISHED = re.compile(rf"Train loop finished in: ({_NUMBER}) seconds")
_RESTORED = re.compile(r"Restored params from step: (\d+)")

# "Pre RL Training: corr=0, total=2, accuracy=0.0%, partial_accuracy=0.0%, format_accuracy=0.0%, ..."
_RL_EVAL = re.compile(r"\b(Pre|Post) RL Training: (.*)")
_RL_EVAL_FIELD = re.compile(rf"(\w+)=({_NUMBER})%?", re.I)
_RL_COMPLETED = re.compile(r"RL Training Completed Successfully")

# orbax (0.12) at each checkpoint load: the bytes it read, then the seconds the load took, e.g.
# "/jax/orbax/read/worker/io/requested throughput: 6.313 MiB/s (total gbytes: 272.6 KiB) (time elapsed: 0.04 s)"
# "[process=0] [sync] Finished load in 0.07 seconds @ gs://bucket/conversions/tiny-llama/mt0.2.5-2d8e/0/items"
_LOAD_BYTES = re.compile(rf"read/worker/io/requested throughput: .*?\(total gbytes: ({_NUMBER}) ([KMGTP]i)?B\)")
_LOAD_FINISHED = re.compile(rf"\] Finished load in ({_NUMBER}) seconds @ (\S+)")
_BINARY_PREFIXES = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}

_CONVERSION_SAVED = re.compile(r"Conversion complete\. Checkpoint saved to (\S.*)")
_PEAK_MEMORY = re.compile(rf"Peak Memory: ({_NUMBER}) GB")
_EXPORT_SAVED = re.compile(r"successfully saved in HuggingFace format at (\S.*)")

# What the lines above contain (an extended regular expression, for ``grep -E``): after a job, only the lines
# matching it are read back from the VM's log, and kept in storage with the job's output.
LOG_FILTER = (
    "Train step|completed step|Completed eval|eval metrics after step|Train loop finished|Restored params|RL Train|Pre RL|Post RL|Conversion complete|"
    "Peak Memory|successfully saved|Finished load in|read/worker/io/requested"
)

# (key, label, unit, decimals) of the RL evaluation numbers the summary shows.
_RL_SUMMARY_FIELDS = (("accuracy", "accuracy", "%", 1), ("mean_reward", "mean reward", "", 4))


@dataclass
class TrainingMetrics:
    """What one post-training step's log said. ``None`` / ``False`` means "not seen in the log".

    Step numbers are absolute: a run resumed from step 1 that trains to step 5 has ``steps_completed == 5``.
    RL evaluation dicts hold ``corr``, ``total`` (ints) and ``accuracy``, ``partial_accuracy``,
    ``format_accuracy`` (percent, e.g. ``50.0``), ``mean_reward`` (floats), as logged.
    """

    steps_completed: int | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    last_perplexity: float | None = None
    tokens_per_s_per_device: float | None = None
    train_loop_s: float | None = None
    resumed_from_step: int | None = None
    diverged: bool = False
    pre_rl: dict[str, int | float] | None = None
    post_rl: dict[str, int | float] | None = None
    rl_completed: bool = False
    output_path: str | None = None
    peak_memory_gb: float | None = None
    loss_curve: list[tuple[int, float]] | None = None  # (step, that step's loss), for the model card's curve
    eval_losses: list[tuple[int, float]] | None = None  # (step, eval loss) of each evaluation, SFT
    # Each checkpoint load, in order: {"uri", "seconds", "bytes"} (the converted parameters, a resumed step).
    checkpoint_loads: list[dict[str, object]] | None = None

    def as_xcom(self) -> dict[str, object]:
        """The fields that were seen, JSON-safe: a non-finite float becomes the string ``"nan"``/``"inf"``."""
        seen: dict[str, object] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None or value is False:
                continue
            seen[field.name] = _json_safe(value)
        return seen

    def summary(self, step_name: str) -> str:
        """One line for the task log, e.g. ``SFT: 5 steps (resumed from 1), loss 6.276 → 6.223, ...``."""
        parts = self._training_parts() + self._rl_parts() + self._output_parts()
        return f"{step_name}: {', '.join(parts) if parts else 'no metrics in the log'}"

    def _training_parts(self) -> list[str]:
        parts: list[str] = []
        if self.steps_completed is not None:
            steps = f"{self.steps_completed} steps"
            if self.resumed_from_step is not None:
                steps += f" (resumed from {self.resumed_from_step})"
            parts.append(steps)
        elif self.resumed_from_step is not None:
            parts.append(f"resumed from {self.resumed_from_step}")
        if self.first_loss is not None and self.last_loss is not None:
            parts.append(f"loss {self.first_loss:.3f} → {self.last_loss:.3f}")
        if self.diverged:
            parts.append("DIVERGED")
        if self.last_perplexity is not None:
            parts.append(f"perplexity {self.last_perplexity:.1f}")
        if self.train_loop_s is not None:
            parts.append(f"train loop {self.train_loop_s:.1f} s")
        if self.eval_losses:
            parts.append("eval loss " + " → ".join(f"{loss:.3f} (step {step})" for step, loss in self.eval_losses))
        return parts

    def base_evaluation(self) -> dict[str, float] | None:
        """The base model's numbers: the evaluation before the first step, when this log's process made it.

        None when the process resumed from a checkpoint (its first evaluation is of a trained model)."""
        if self.resumed_from_step is not None:
            return None
        if self.pre_rl is not None:
            return dict(self.pre_rl)
        losses = dict(self.eval_losses or ())
        return {"eval_loss": losses[0]} if 0 in losses else None

    def trained_evaluation(self) -> dict[str, float] | None:
        """The trained model's numbers: the evaluation after the last step."""
        if self.post_rl is not None:
            return dict(self.post_rl)
        losses = dict(self.eval_losses or ())
        if self.steps_completed and self.steps_completed in losses:
            return {"eval_loss": losses[self.steps_completed]}
        return None

    def _rl_parts(self) -> list[str]:
        parts: list[str] = []
        evaluations = [evaluation for evaluation in (self.pre_rl, self.post_rl) if evaluation is not None]
        for key, label, unit, decimals in _RL_SUMMARY_FIELDS:
            values = [evaluation[key] for evaluation in evaluations if key in evaluation]
            if values:
                parts.append(f"{label} " + " → ".join(f"{value:.{decimals}f}{unit}" for value in values))
        if evaluations and not self.rl_completed:
            parts.append("RL training not completed")
        return parts

    def _output_parts(self) -> list[str]:
        parts: list[str] = []
        if self.output_path is not None:
            parts.append(f"saved to {self.output_path}")
        if self.peak_memory_gb is not None:
            parts.append(f"peak memory {self.peak_memory_gb:.2f} GB")
        return parts


def parse_lines(lines: Iterable[str], into: TrainingMetrics | None = None) -> TrainingMetrics:
    """Fold log lines into ``into`` (updated in place) or a new :class:`TrainingMetrics`, and return it.

    Feeding a log chunk by chunk gives the same result as feeding it at once, provided each item is a whole
    line, given once: joining a line that was split across chunks, and not feeding a line twice (the training
    loop's time is a sum), is the caller's job.
    """
    metrics = into if into is not None else TrainingMetrics()
    for raw_line in lines:
        _parse_line(_ANSI_ESCAPE.sub("", raw_line).strip(), metrics)
    return metrics


def _parse_line(line: str, metrics: TrainingMetrics) -> None:
    if match := _TRAIN_STEP.search(line):
        step, loss, perplexity = int(match[1]), float(match[2]), match[3]
        _record_step(metrics, step, loss, float(perplexity) if perplexity else None, None)
        metrics.loss_curve = sorted({**dict(metrics.loss_curve or ()), step: loss}.items())
    elif match := _COMPLETED_STEP.search(line):
        rest = match[2]
        loss, tokens_per_s = (_search_float(pattern, rest) for pattern in (_STEP_LOSS, _STEP_TOKENS_PER_S))
        _record_step(metrics, int(match[1]), loss, None, tokens_per_s)
    elif match := _EVAL.search(line):
        metrics.eval_losses = sorted({**dict(metrics.eval_losses or ()), int(match[1]): float(match[2])}.items())
    elif match := _TRAIN_LOOP_FINISHED.search(line):
        metrics.train_loop_s = (metrics.train_loop_s or 0.0) + float(match[1])
    elif match := _RESTORED.search(line):
        metrics.resumed_from_step = int(match[1])
    elif match := _RL_EVAL.search(line):
        evaluation = {key: _int_or_float(value) for key, value in _RL_EVAL_FIELD.findall(match[2])}
        if match[1] == "Pre":
            metrics.pre_rl = evaluation
        else:
            metrics.post_rl = evaluation
    elif _RL_COMPLETED.search(line):
        metrics.rl_completed = True
    elif match := _CONVERSION_SAVED.search(line) or _EXPORT_SAVED.search(line):
        metrics.output_path = match[1].strip()
    elif match := _PEAK_MEMORY.search(line):
        metrics.peak_memory_gb = max(float(match[1]), metrics.peak_memory_gb or 0.0)
    elif match := _LOAD_BYTES.search(line):
        loads = metrics.checkpoint_loads = metrics.checkpoint_loads or []
        loads.append({"bytes": round(float(match[1]) * _BINARY_PREFIXES[match[2]])})
    elif match := _LOAD_FINISHED.search(line):
        loads = metrics.checkpoint_loads = metrics.checkpoint_loads or []
        if not loads or "uri" in loads[-1]:  # no byte count logged before it
            loads.append({})
        loads[-1].update(uri=match[2], seconds=float(match[1]))


def _record_step(
    metrics: TrainingMetrics,
    step: int,
    loss: float | None,
    perplexity: float | None,
    tokens_per_s: float | None,
) -> None:
    """Record a step: the latest values are those of the highest step seen (ties: the line logged later).

    Both trainer lines report a step; the last step's may come after "Train loop finished"."""
    if loss is not None:
        if metrics.first_loss is None:
            metrics.first_loss = loss
        if not math.isfinite(loss):
            metrics.diverged = True
    if metrics.steps_completed is not None and step < metrics.steps_completed:
        return
    metrics.steps_completed = step
    if loss is not None:
        metrics.last_loss = loss
    if perplexity is not None:
        metrics.last_perplexity = perplexity
    if tokens_per_s is not None:
        metrics.tokens_per_s_per_device = tokens_per_s


def _search_float(pattern: re.Pattern[str], text: str) -> float | None:
    match = pattern.search(text)
    return float(match[1]) if match else None


def _int_or_float(text: str) -> int | float:
    return int(text) if text.lstrip("+-").isdigit() else float(text)


def _json_safe(value: object) -> object:
    """``value`` with every non-finite float in it (in dicts, lists, tuples) a string."""
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return _json_number(value)


def _json_number(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
