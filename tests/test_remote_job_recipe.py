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
