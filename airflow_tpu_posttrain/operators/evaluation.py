"""The training steps' evaluations for the quality gate: the base model's kept where a retry finds it.

The base model is evaluated once, before the first step, by the process that starts training from the
converted checkpoint. A try that resumes from a checkpoint evaluates a trained model first, and a lost VM takes
its log along, so the base numbers are kept in the run's storage (beside its checkpoints) as soon as the log
shows them.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.recipes import remote_job, storage

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes import maxtext
    from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics

BASE_EVALUATION_FILE = "base_evaluation.json"
# Where an evaluation line starts: SFT (MaxText's summary of each evaluation), GRPO (the tutorial's "Pre RL").
_EVALUATION_MARKERS = ("Completed eval", "Pre RL Training")


class EvaluationMixin:
    """For the training operators: the base and trained evaluations into XCom ``evaluation``."""

    log: Any
    jobs_dir: str
    storage_tool: storage.GcsTool

    def base_evaluation_uri(self, spec: maxtext.RunSpec) -> str:
        return f"{posixpath.dirname(spec.layout.checkpoints_dir)}/{BASE_EVALUATION_FILE}"

    def keep_base_evaluation_from_log(self, context: Context, event: dict[str, Any]) -> None:
        """While the job runs: when a new log chunk shows an evaluation, keep the base model's numbers.

        A failure here is only logged: the finished job's log, or a later chunk, still gives them."""
        from airflow.providers.ssh.utils.remote_job import RemoteJobPaths

        from airflow_tpu_posttrain.recipes.metrics import parse_lines

        chunk = event.get("log_chunk") or ""
        if event.get("done") or not any(marker in chunk for marker in _EVALUATION_MARKERS):
            return
        paths = RemoteJobPaths(job_id=event["job_id"], remote_os="posix", base_dir=self.jobs_dir)
        try:
            spec = self.resolved(context, self.run_spec(context))
            with self._vm() as vm:
                lines = vm.run(remote_job.complete_metric_lines_command(paths.log_file))
                base = parse_lines(lines.splitlines()).base_evaluation()
                if base:
                    self._write_base_evaluation(vm, spec, base)
        except Exception as err:  # noqa: BLE001 - the job's end gives the numbers again
            self.log.warning("Could not keep the base model's evaluation yet: %s", err)

    def evaluation(self, vm: VmHook, spec: maxtext.RunSpec, metrics: TrainingMetrics) -> dict[str, Any]:
        """``{"base": ..., "trained": ...}``: this log's numbers; the base ones from storage if it resumed."""
        base = metrics.base_evaluation()
        uri = self.base_evaluation_uri(spec)
        if base:
            self._write_base_evaluation(vm, spec, base)
        else:
            kept = vm.run(f"{storage.read_command(uri, self.storage_tool)} 2>/dev/null || true").strip()
            base = json.loads(kept) if kept else None
            if base is None:
                self.log.warning("The base model's evaluation is not in this log nor at %s", uri)
        return {"base": base, "trained": metrics.trained_evaluation()}

    def _write_base_evaluation(self, vm: VmHook, spec: maxtext.RunSpec, base: dict[str, Any]) -> None:
        uri = self.base_evaluation_uri(spec)
        vm.run(f"printf '%s' {shlex.quote(json.dumps(base))} | {storage.write_command(uri, self.storage_tool)}")
        self.log.info("The base model's evaluation %s is kept at %s", base, uri)
