"""The storage commands a job script runs on a VM, run here with bash on a local directory (gs://: test_gcs_tool.py)."""

import subprocess

from airflow_tpu_posttrain.recipes import storage


def _bash(script: str) -> str:
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{script}"], check=True, capture_output=True, text=True
    ).stdout


def test_metric_lines_kept_next_to_the_done_marker_can_be_read_back(tmp_path):
    marker = str(tmp_path / "run" / ".complete-10")
    log = tmp_path / "stdout.log"
    log.write_text("noise\ncompleted step: 9, loss: 6.2\n")
    kept = storage.metrics_uri(marker)
    # As the job script does: the grep's output ends a pipeline into the storage write, then the marker.
    _bash(
        f"{{ grep -a 'completed step' {log} || true; }} | {storage.write_command(kept)}\n{storage.mark_command(marker)}"
    )
    assert _bash(storage.exists_command(marker) + " && echo yes") == "yes\n"
    assert _bash(storage.read_command(kept)) == "completed step: 9, loss: 6.2\n"


def test_a_gcs_checkpoint_is_complete_only_with_orbax_s_commit_marker():
    """On GCS orbax writes a step in place and commit_success.txt last.

    In a directory it renames the step into place, so the item's own path says it is complete."""
    gcs = "gs://b/post-train/run/checkpoints/5/model_params"
    assert storage.committed_checkpoint(gcs) == "gs://b/post-train/run/checkpoints/5/commit_success.txt"
    local = "/shared/post-train/run/checkpoints/actor/2/model_params"
    assert storage.committed_checkpoint(local) == local
