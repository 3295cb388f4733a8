"""``scripts/demo`` as a person runs it: what the terminal shows, and ``--ui`` with Airflow's own services.

Each test runs the demo's module as ``scripts/demo`` does after its set-up (scripts/test runs that set-up first),
on the repository's ``.local``: one whole run of the tiny SFT DAG (its compact view and summary), and one run under
``--ui`` watched through the UI and the REST API, then stopped with Ctrl-C (SIGINT) while it goes.

``TPU_POSTTRAIN_SCREENSHOTS=1`` also writes the run's page in the UI to docs/img/demo-ui.png (the README's).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
README_SCREENSHOT = REPO / "docs" / "img" / "demo-ui.png"
CHROMIUM = "/usr/bin/chromium"  # Debian's (scripts/bootstrap.sh), as in test_trigger_form.py
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
]
DEMO_TIMEOUT_S = 1200.0  # a bound, not a pause: the whole run on a loaded 2-core machine
TERMINAL_LINES_MAX = 100

pytestmark = pytest.mark.maxtext


def _demo_env(**extra: str) -> dict[str, str]:
    """The environment a person's shell gives the demo: none of this session's Airflow settings."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}, **extra}


def _wait_for(what: str, probe: Callable[[], object], timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while not (result := probe()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)
    return result


def _line(pattern: str, lines: list[str]) -> re.Match:
    matches = [m for line in lines if (m := re.search(pattern, line))]
    assert matches, f"no line matches {pattern!r} in:\n" + "\n".join(lines)
    return matches[-1]


@pytest.mark.timeout(DEMO_TIMEOUT_S + 60)
def test_demo_shows_the_run_in_a_few_lines_and_ends_with_its_summary():
    demo = subprocess.run(
        [sys.executable, "-m", "airflow_tpu_posttrain.local.demo"],
        cwd=REPO,
        env=_demo_env(),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )
    lines = demo.stdout.splitlines()
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert len(lines) < TERMINAL_LINES_MAX, demo.stdout

    assert _line(r"^demo: run \S+ success in ", lines)
    for task in ("create_tpu_vm", "train", "export_and_publish", "delete_tpu_vm", "delete_cpu_vm", "delete_export_vm"):
        assert _line(
            rf"^\s+{task}\s+success\s+\d+( min \d+)? s$", lines
        )  # its duration, in the summary's table
    assert _line(r"^demo: SFT: \d+ steps, loss \d+\.\d+ → \d+\.\d+", lines)
    stored = Path(
        _line(r"^demo: model \(Hugging Face format\) in storage: (\S+)$", lines)[1].removeprefix("file://")
    )
    assert (stored / "config.json").is_file()
    assert _line(r"^demo: on the Hub: http://\S+ \(revision run-\S+, commit [0-9a-f]{12}\)$", lines)
    assert _line(r"^demo: sample: 'What is 2 plus 3\?' → '.+'$", lines)
    # Each VM's time, creation to deletion, at the price table's e2-standard-2 price (what the local VMs are): the
    # TPU VM's, the conversion's CPU VM's and the export's.
    vm = r"\S+ .+ \(e2-standard-2\)"
    assert _line(rf"^demo: VM cost: \$\d+\.\d{{4}} for .+ of VM time: tpu-{vm}, cpu-{vm}, export-{vm}$", lines)
    assert "demo: VMs left: 0" in lines
    # The rest went to the log file it names: Airflow's task logs and the VMs' output.
    log = Path(_line(r"^demo: full logs in (\S+)$", lines)[1]).read_text()
    assert "Train step" in log and "[remote]" in log


class _Output:
    """A process's stdout lines, read as they come (the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def match(self, pattern: str) -> re.Match | None:
        return next((m for line in list(self.lines) if (m := re.search(pattern, line))), None)


def _marked(marker: str) -> list[psutil.Process]:
    """The processes whose environment holds the marker the test gave the demo (inherited by what it starts)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TPU_POSTTRAIN_DEMO_TEST") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _started_by(demo: psutil.Process, marker: str) -> list[psutil.Process]:
    """Every process the demo started: its descendants, and any other holding its marker (a daemon)."""
    found = {proc.pid: proc for proc in demo.children(recursive=True)}
    found.update((proc.pid, proc) for proc in _marked(marker) if proc.pid != demo.pid)
    return list(found.values())


def _still_running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for proc in procs:
        try:  # is_running() compares the start time too: a reused pid is not this process
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            continue
    return left


def _screenshot(page_url: str) -> None:
    from playwright import sync_api

    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = chromium.new_page(viewport={"width": 1600, "height": 900})
        page.set_default_timeout(60_000)
        page.goto(page_url)
        page.get_by_text("completed step").first.wait_for()  # the task's log, with the training's steps
        page.screenshot(path=README_SCREENSHOT)
        chromium.close()


@pytest.mark.timeout(DEMO_TIMEOUT_S + 300)
def test_ui_serves_the_running_run_and_ctrl_c_ends_everything_the_demo_started():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    marker = uuid.uuid4().hex
    demo = subprocess.Popen(
        [sys.executable, "-m", "airflow_tpu_posttrain.local.demo", "--ui", "--port", str(port)],
        cwd=REPO,
        env=_demo_env(TPU_POSTTRAIN_DEMO_TEST=marker),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = _Output(demo)
    try:
        ui = _wait_for(
            "the demo to print the run's address in the UI",
            lambda: (
                output.match(rf"^demo: the UI: (http://127\.0\.0\.1:{port}/dags/(\S+)/runs/(\S+))$")
                or demo.poll() is not None
            ),
            DEMO_TIMEOUT_S,
        )
        assert demo.poll() is None, "\n".join(output.lines)
        run_url, dag_id, run_id = ui[1], ui[2], ui[3]
        assert output.match(r"^demo: login: ")
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v2", timeout=30)

        def run_going_with_a_task_done() -> dict | None:
            run = api.get(f"/dags/{dag_id}/dagRuns/{run_id}").json()
            tasks = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
            return run if any(task["state"] == "success" for task in tasks) else None

        run = _wait_for("a task of the run to succeed", run_going_with_a_task_done, DEMO_TIMEOUT_S)
        assert run["state"] == "running", run
        assert run["conf"]["storage_uri"].endswith("/published"), run["conf"]
        grid = httpx.get(run_url, timeout=30)
        assert grid.status_code == 200 and "<title>Airflow" in grid.text, grid.text[:500]
        if os.environ.get("TPU_POSTTRAIN_SCREENSHOTS") == "1":
            # For the README: the run in its training, as the demo's view shows it, with the steps in the log.
            _wait_for("a training step", lambda: output.match(r"^  SFT: \d+ steps, loss "), DEMO_TIMEOUT_S)
            _screenshot(f"{run_url}/tasks/train")
        started = _started_by(psutil.Process(demo.pid), marker)
        assert any("scheduler" in " ".join(proc.cmdline()) for proc in started), started

        demo.send_signal(signal.SIGINT)  # Ctrl-C

        try:
            ended = demo.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the demo did not end within 180 s of Ctrl-C:\n" + "\n".join(output.lines))
        assert ended == 130, "\n".join(output.lines)
        output.reader.join(timeout=30)
        assert output.match(r"^demo: stopped \(Ctrl-C\)"), "\n".join(output.lines)
        _wait_for("every process the demo started to end", lambda: not _still_running(started), 60)
        assert not _still_running(_marked(marker))
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for proc in _marked(marker):  # what a failed stop left behind: not into the rest of the suite
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_the_live_view_counts_each_trainer_line_once(tmp_path):
    """The demo's log holds each trainer line twice: the training loop's time is not counted twice.

    Once as the trigger streamed it, once as the step read it back when it ended (lines from a real tiny GRPO
    run)."""
    import io

    from rich.console import Console

    from airflow_tpu_posttrain.local.demo_view import LogTail, ProgressView

    streamed = [
        "I1130 16:20:52.705280 140686168148864 peft_trainer.py:748] Train loop finished in: 5.1119 seconds",
        "I1130 16:20:53.010911 140686168148864 peft_trainer.py:748] Train loop finished in: 0.0396 seconds "
        "[airflow_tpu_posttrain.triggers.remote_job.MaxTextJobTrigger] loc=ssh_remote_job.py:316",
    ]
    read_back = [
        f"2026-11-30T16:20:56.289941Z [info     ] {line.split(' [airflow')[0]} "
        "[airflow.task.hooks.airflow_tpu_posttrain.hooks.vm.VmHook] loc=ssh.py:556"
        for line in streamed
    ]
    log = tmp_path / "demo.log"
    log.write_text("\n".join(streamed) + "\n")
    view = ProgressView(Console(file=io.StringIO()), "GRPO", LogTail(lambda: [log]))
    view.update(None)
    with log.open("a") as more:
        more.write("\n".join(read_back) + "\n")
    view.update(None)

    assert view.metrics.train_loop_s == 5.1119 + 0.0396
