"""The training steps' evaluations for the quality gate: the base model's kept where a retry finds it.

The base model is evaluated once, before the first step, by the process that starts training from the
converted checkpoint. A try that resumes from a checkpoint evaluates a trained model first, and a lost VM takes
its log along; so as soon as the log shows the base model's evaluation, the job's watch keeps the log's metric
lines beside the run's checkpoints (``base_evaluation.log``), once. The watch looks for it in the log on the VM at
every poll, not in what it forwarded of the log so far: MaxText's verbose start can keep the forwarding minutes
behind, and a VM lost meanwhile took the evaluation with it.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.recipes import remote_job, storage

if TYPE_CHECKING:
    from collections.abc import Callable

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes import maxtext
    from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics

BASE_EVALUATION_FILE = "base_evaluation.log"
# The log lines that end the base model's evaluation: SFT, MaxText's summary of the evaluation before step 1
# (0.2.5: "Completed eval after train step 0,"; 0.2.2 and 0.2.3: "eval metrics after step: 0,"); GRPO, the
# tutorial's "Pre RL Training" (also logged by a resumed process, whose lines are then not kept: the first
# process's are there already).
BASE_EVALUATION_MARKERS = {
    "SFT": ("Completed eval after train step 0,", "eval metrics after step: 0,"),
    "GRPO": ("Pre RL Training:",),
}


class EvaluationMixin:
    """For the training operators: keep the base model's evaluation; both evaluations into XCom ``evaluation``."""

    log: Any
    step_title: str
    storage_tool: storage.GcsTool
    _vm: Callable[[], VmHook]  # VmConnectionMixin's, in the operators

    def base_evaluation_uri(self, spec: maxtext.RunSpec) -> str:
        return f"{posixpath.dirname(spec.layout.checkpoints_dir)}/{BASE_EVALUATION_FILE}"

    def keep_base_evaluation(self, spec: maxtext.RunSpec, log_file: str) -> dict[str, str]:
        """What the job's watch runs at every poll until it acted (``MaxTextJobTrigger``'s ``on_output``).

        Once the log shows the base model's evaluation, its command keeps the log's whole metric lines so far,
        unless an earlier process kept its own."""
        uri = self.base_evaluation_uri(spec)
        keep = f"{storage.exists_command(uri, self.storage_tool)} || {storage.write_command(uri, self.storage_tool)}"
        return {
            "command": remote_job.when_logged_command(log_file, list(BASE_EVALUATION_MARKERS[self.step_title]), keep),
            "description": f"keeping the base model's evaluation at {uri}",
        }

    def kept_base_evaluation_command(self, spec: maxtext.RunSpec) -> str:
        """Prints the metric lines kept at ``base_evaluation_uri``; nothing when none were kept."""
        return f"{storage.read_command(self.base_evaluation_uri(spec), self.storage_tool)} 2>/dev/null || true"

    def evaluation(
        self, spec: maxtext.RunSpec, metrics: TrainingMetrics, log_file: str, kept: str
    ) -> dict[str, Any]:
        """``{"base": ..., "trained": ...}``: the base numbers kept by the run's first process, else this log's.

        ``kept``: what ``kept_base_evaluation_command`` printed. Kept first: a resumed GRPO process logs
        "Pre RL Training" too, for the model it resumed (partly trained), and its log need not say it resumed."""
        from airflow_tpu_posttrain.recipes.metrics import parse_lines

        uri = self.base_evaluation_uri(spec)
        base = parse_lines(kept.splitlines()).base_evaluation()
        if base:
            self.log.info("The base model's evaluation %s, kept at %s", base, uri)
        else:
            base = metrics.base_evaluation()
            if base:  # the watch did not keep it (it never read that part of the log: a job that ended first)
                with self._vm() as vm:
                    vm.run(self.keep_base_evaluation(spec, log_file)["command"])
            else:
                self.log.warning("The base model's evaluation is neither in this log nor at %s", uri)
        return {"base": base, "trained": metrics.trained_evaluation()}
