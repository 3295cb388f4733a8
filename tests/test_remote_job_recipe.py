"""The remote-job protocol's shell (recipes/remote_job.py), run by bash against real job directories."""

from __future__ import annotations

import subprocess

import pytest

from airflow_tpu_posttrain.recipes import remote_job


def _files(job_dir):
    return {
        "pid_file": str(job_dir / "pid"),
        "exit_code_file": str(job_dir / "exit_code"),
        "log_file": str(job_dir / "stdout.log"),
    }


def _run(command: str) -> str:
    return subprocess.run(["bash", "-c", command], check=True, capture_output=True, text=True).stdout


def _state(job_dir):
    files = _files(job_dir)
    return remote_job.parse_state(_run(remote_job.state_command(str(job_dir), **files)))


def _completion(job_dir):
    files = _files(job_dir)
    return remote_job.parse_completion(_run(remote_job.completion_command(files["pid_file"], files["exit_code_file"])))


@pytest.fixture
def job_dir(tmp_path):
    return tmp_path / "jobs" / "train-1 (odd name)"  # quoted in every command


def test_absent_job(job_dir):
    assert _state(job_dir) == ("absent", 0)


def test_running_job_then_its_exit_codes(job_dir):
    job_dir.mkdir(parents=True)
    (job_dir / "stdout.log").write_text("step 1\n")
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        try:
            (job_dir / "pid").write_text(str(sleeper.pid))
            assert _state(job_dir) == ("running", 7)
            assert _completion(job_dir) is None
        finally:
            sleeper.kill()
    (job_dir / "exit_code").write_text("0")
    assert _state(job_dir) == ("succeeded", 7)
    assert _completion(job_dir) == 0
    (job_dir / "exit_code").write_text("137")
    assert _state(job_dir) == ("failed with exit code 137", 7)
    assert _completion(job_dir) == 137


def test_job_gone_without_an_exit_code_died(job_dir):
    job_dir.mkdir(parents=True)
    with subprocess.Popen(["true"]) as finished:
        finished.wait()  # reaped: its pid answers no signal
        (job_dir / "pid").write_text(str(finished.pid))
    assert _state(job_dir) == ("died", 0)
    assert _completion(job_dir) == remote_job.JOB_DIED


STEP_PRINTS_ITS_ENVIRONMENT = """
echo "token=${HF_TOKEN:-} endpoint=${HF_ENDPOINT:-} token_file=${HF_TOKEN_FILE:-}"
test -n "${HF_TOKEN_FILE:-}" && echo "file holds $(cat "$HF_TOKEN_FILE")" || echo "no file"
echo "completed step: 4, seconds: 0.412, loss: 6.223"
echo "a line the summary does not read"
"""


def _run_wrapper(tmp_path, **options) -> tuple[str, dict]:
    """Runs the wrapper as the detached job would, with its output as the job's log."""
    step, log, token_file = tmp_path / "step.sh", tmp_path / "stdout.log", tmp_path / "secrets" / "job.token"
    step.write_text(STEP_PRINTS_ITS_ENVIRONMENT)
    token_file.parent.mkdir()
    token_file.write_text("hf_secret")
    token_file.chmod(0o600)
    script = remote_job.wrapper_script(str(step), str(log), token_file=str(token_file), **options)
    with log.open("w") as out:
        subprocess.run(["bash", "-c", script], check=True, stdout=out)
    return script, {"log": log.read_text(), "token_file_left": token_file.exists()}


def test_wrapper_reads_the_token_into_the_environment_and_deletes_its_file(tmp_path):
    script, ran = _run_wrapper(tmp_path, token_in_env=True, hub_endpoint="http://hub.local:8080/a b")
    assert "token=hf_secret endpoint=http://hub.local:8080/a b token_file=" in ran["log"]
    assert "no file" in ran["log"]
    assert not ran["token_file_left"]
    assert "hf_secret" not in script  # the script names the file; the token is read when the job runs


def test_wrapper_keeps_the_token_file_for_the_publisher_until_the_job_ends(tmp_path):
    _, ran = _run_wrapper(tmp_path, token_in_env=True, keep_token_file=True)
    assert "file holds hf_secret" in ran["log"]
    assert not ran["token_file_left"]  # deleted on exit


def test_wrapper_keeps_the_metric_lines_beside_the_done_marker(tmp_path):
    marker = tmp_path / "storage" / ".complete-5"
    marker.parent.mkdir()
    _run_wrapper(tmp_path, done_marker=str(marker))
    assert marker.exists()
    kept = (tmp_path / "storage").glob(".complete-5*")
    [metrics] = [p.read_text() for p in kept if p != marker]
    assert metrics == "completed step: 4, seconds: 0.412, loss: 6.223\n"  # the trainer's lines, nothing else


def test_complete_metric_lines_leave_out_a_line_still_being_written(tmp_path):
    """The base evaluation is kept while the job runs: a number cut mid-write (6.2 of 6.297) must not be read."""
    log = tmp_path / "stdout.log"
    done = "I1201 metric_logger.py:302] Completed eval after train step 0, loss=6.297, perplexity=542.910\n"
    log.write_text("noise\n" + done + "I1201 metric_logger.py:302] Completed eval after train step 4, loss=6.2")
    assert _run(remote_job.complete_metric_lines_command(str(log))) == done
    log.write_text("noise\n" + done + done)
    assert _run(remote_job.complete_metric_lines_command(str(log))) == done + done
    # It can start a pipeline: the lines go to the next command (the base evaluation's writer), not around it.
    assert _run(remote_job.complete_metric_lines_command(str(log)) + " | wc -l").strip() == "2"
    log.write_text("no metric here\n")
    assert _run(remote_job.complete_metric_lines_command(str(log))) == ""
