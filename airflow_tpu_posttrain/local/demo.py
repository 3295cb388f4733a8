"""The local default, end to end: ``python -m airflow_tpu_posttrain.local.demo [sft|rl] [--verbose] [--ui]``.

Starts the local stack (Compute emulator whose instances are local machines, Hub server), runs the tiny model's DAG
from ``dags/`` in real Airflow (SQLite metadata DB under ``.local/airflow``), proves the trained Hugging Face model
loads and generates with ``transformers``, prints a summary and stops everything it started.

The run goes through ``airflow dags test`` (``dag.test()``), or with ``--ui`` through Airflow's scheduler,
triggerer, dag-processor and api-server, whose UI stays up after the run until Ctrl-C. The terminal shows the
run's tasks and the training's progress (``demo_view.py``); Airflow's, MaxText's and the stand-ins' output goes to a
log file (``--verbose``: to the terminal, as it comes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.text import Text

from airflow_tpu_posttrain.local.demo_view import (
    LogTail,
    ProgressView,
    RunView,
    duration,
    metrics_from_xcom,
    newest_run_id,
    read_run,
    styled_state,
    task_result,
    task_table,
)
from airflow_tpu_posttrain.local.processes import stop_group

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / ".local"
COMMAND_STARTED_VARIABLE = "TPU_POSTTRAIN_DEMO_STARTED"  # scripts/demo's start, seconds since the epoch
SAMPLE_PROMPT = "What is 2 plus 3?"
POLL_S = 1.0


def _airflow_home() -> Path:
    """A private Airflow home, fresh at each start; set before Airflow is imported, which reads its settings once.

    Fresh: a run of an earlier demo stopped by Ctrl-C would otherwise be resumed by this one's scheduler, its VMs
    long gone with that demo's stand-ins."""
    home = LOCAL / "airflow"
    shutil.rmtree(home, ignore_errors=True)
    os.environ.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(home / "logs"),
    )
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    return home


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "recipe", nargs="?", default="sft", choices=("sft", "rl"), help="the DAG: SFT or GRPO"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="Airflow's and MaxText's output on the terminal"
    )
    parser.add_argument(
        "--ui", action="store_true", help="run it with Airflow's services; UI up until Ctrl-C"
    )
    parser.add_argument("--port", type=int, default=8080, help="the UI's port with --ui (default 8080)")
    return parser.parse_args(argv)


def _console(verbose: bool, log_file: Path) -> Console:
    """The terminal.

    Unless ``verbose``, everything else written to this process's stdout and stderr (its children's too) goes
    to ``log_file`` from here on."""
    if verbose:
        return Console(highlight=False, soft_wrap=True, force_interactive=False)  # lines, among the stream
    terminal = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, sys.stdout.fileno())
    os.dup2(log, sys.stderr.fileno())
    os.close(log)
    # soft_wrap: a long line (a URL) is left to the terminal to wrap, and stays one line in a pipe.
    return Console(file=terminal, highlight=False, soft_wrap=True)


CLEANUP_TIMEOUT_S = 120.0  # after Ctrl-C: the clean-up's bound, then what is left is killed


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C (and SIGTERM): the clean stop, asked until it is under way and bounded by a watchdog.

    Seen once in a full test run: a Ctrl-C left the demo running until it was killed, its services and a VM
    outliving it (a KeyboardInterrupt raised inside a library that swallows it is lost). So the request is also
    kept (``_stop_requested``), and the watch loop raises it again; and after ``CLEANUP_TIMEOUT_S`` a watchdog
    writes every thread's stack to the log, kills every process the demo started and exits with Ctrl-C's status."""
    if not _stop_requested.is_set():
        _stop_requested.set()
        threading.Thread(target=_end_everything_after_a_while, daemon=True).start()
    raise KeyboardInterrupt


_stop_requested = threading.Event()


def _raise_if_stop_requested() -> None:
    if _stop_requested.is_set():
        raise KeyboardInterrupt


def _end_everything_after_a_while() -> None:
    import faulthandler

    import psutil

    time.sleep(CLEANUP_TIMEOUT_S)
    print(f"demo: the clean-up did not end within {CLEANUP_TIMEOUT_S:.0f} s; its threads:", file=sys.stderr)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    os._exit(130)


def _watch(view: ProgressView, dag_id: str, after_id: int, check_runner: Callable[[], None]) -> RunView:
    """Poll the DB until the run ends."""
    with view:
        while True:
            _raise_if_stop_requested()
            check_runner()
            run = read_run(dag_id, after_id)
            view.update(run)
            if run is not None and run.finished:
                return run
            time.sleep(POLL_S)


def _generate(model_dir: Path) -> tuple[bool, str]:
    """Whether the model loads and generates in ``transformers``, and what it generated (or the error)."""
    check = subprocess.run(
        [
            str(LOCAL / "hfcheck-venv" / "bin" / "python"),
            str(Path(__file__).with_name("check_hf_model.py")),
            str(model_dir),
            "--prompt",
            SAMPLE_PROMPT,
        ],
        capture_output=True,
        text=True,
    )
    print(check.stdout, check.stderr)  # to the log
    generated = [line for line in check.stdout.splitlines() if line.startswith("generated text: ")]
    if check.returncode or not generated:
        return False, (check.stderr.strip() or check.stdout.strip()).splitlines()[-1]
    return True, f"{SAMPLE_PROMPT!r} → {generated[0].removeprefix('generated text: ')}"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # scripts/demo's start (its set-up first), else this process's: the summary's time is the command's.
    started = float(os.environ.get(COMMAND_STARTED_VARIABLE) or time.time())
    demo_dir = LOCAL / "demo" / datetime.now().strftime("%Y%m%d-%H%M%S")
    demo_dir.mkdir(parents=True)
    log_file = demo_dir / "demo.log"
    console = _console(args.verbose, log_file)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return _demo(args, console, demo_dir, log_file, started)
    except KeyboardInterrupt:
        console.print("demo: stopped (Ctrl-C); everything it started has ended")
        return 130
    except Exception as error:
        import traceback

        traceback.print_exc()  # to the log
        console.print(f"demo: failed: {type(error).__name__}: {error} (log: {log_file})")
        return 1


def _demo(args: argparse.Namespace, console: Console, demo_dir: Path, log_file: Path, started: float) -> int:
    home = _airflow_home()
    from airflow.models.pool import Pool

    from airflow_tpu_posttrain.local.stack import LocalStack
    from airflow_tpu_posttrain.operators.maxtext import GrpoTrainOperator, SftTrainOperator

    dag_id = f"posttrain_{args.recipe}__tiny-llama"
    step_title = {"sft": SftTrainOperator, "rl": GrpoTrainOperator}[args.recipe].step_title
    if not args.verbose:
        console.print(f"demo: full logs in {log_file}")
    console.print("demo: starting the local stand-ins (Compute emulator, Hub server, the VM image)")
    stack = LocalStack(LOCAL)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(stack.stop)
        os.environ.update(stack.start())
        Pool.create_or_update_pool(
            "tpu_vms", slots=2, description="Concurrent TPU VMs", include_deferred=True
        )
        after_id = newest_run_id(dag_id)
        conf = {"storage_uri": str(stack.published_dir)}
        if args.ui:
            from airflow_tpu_posttrain.local.demo_ui import AirflowServices

            services = AirflowServices(dict(os.environ), args.port, demo_dir)
            cleanup.callback(services.stop)
            console.print("demo: starting Airflow's dag-processor, scheduler, triggerer and api-server")
            services.start()
            services.wait_until_served(dag_id)
            run_id = services.trigger(dag_id, conf)
            console.print(f"demo: the UI: {services.url}/dags/{dag_id}/runs/{run_id}")
            console.print("demo: login: none needed (every visitor is admin; it listens on 127.0.0.1 only)")
            check_runner = services.check_alive
            run_logs = home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
            tail = LogTail(lambda: sorted(p for p in run_logs.glob("task_id=train/**/*") if p.is_file()))
        else:
            console.print(f"demo: running {dag_id} (a CPU VM converts, a TPU VM trains, another CPU VM exports)")
            command = [sys.executable, "-m", "airflow", "dags", "test", dag_id, "--conf", json.dumps(conf)]
            command += ["--dagfile-path", str(REPO / "dags" / "local_dags.py")]
            runner = subprocess.Popen(
                command, start_new_session=True
            )  # its output: ours (the log, or terminal)
            cleanup.callback(stop_group, runner)
            check_runner = _exits_with_the_run(runner, dag_id, after_id)
            tail = LogTail(lambda: [] if args.verbose else [log_file])
        cleanup.callback(_ignore_interrupts)  # runs first: a second Ctrl-C does not cut the clean-up short
        run = _watch(ProgressView(console, step_title, tail), dag_id, after_id, check_runner)
        if not args.ui:
            runner.wait()
        vms_left = len(stack.compute.instances())
        published = task_result(dag_id, run.run_id, "export_and_publish")
        generated = _generate(Path(published["storage_uri"].removeprefix("file://"))) if published else None
        _summary(console, run, time.time() - started, step_title, dag_id, published, generated, vms_left)
        ok = run.state == "success" and generated is not None and generated[0] and vms_left == 0
        if args.ui:
            console.print(f"demo: the UI stays up at {services.url} until Ctrl-C, which stops everything")
            while True:
                _raise_if_stop_requested()
                signal.pause()
        return 0 if ok else 1


def _exits_with_the_run(runner: subprocess.Popen, dag_id: str, after_id: int) -> Callable[[], None]:
    """A check that ``airflow dags test`` has not ended before its run did (an import error, a crash)."""

    def check() -> None:
        if runner.poll() is None:
            return
        run = read_run(dag_id, after_id)
        if run is None or not run.finished:
            raise RuntimeError(f"airflow dags test exited ({runner.returncode}) before its run ended")

    return check


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _summary(
    console: Console,
    run: RunView,
    wall_s: float,
    step_title: str,
    dag_id: str,
    published: dict,
    generated: tuple[bool, str] | None,
    vms_left: int,
) -> None:
    run_s = (run.end - run.start).total_seconds() if run.start and run.end else None
    console.print()
    console.print(
        Text.assemble(
            (f"demo: run {run.run_id} ", "bold"),
            styled_state(run.state),
            f" in {duration(run_s)} (the command, set-up included: {duration(wall_s)})",
        )
    )
    console.print(task_table(run.tasks, indent="  "))
    train = task_result(dag_id, run.run_id, "train")
    console.print(f"demo: {metrics_from_xcom(train.get('metrics', {})).summary(step_title)}")
    if published.get("storage_uri"):
        console.print(f"demo: model (Hugging Face format) in storage: {published['storage_uri']}")
    if hub := published.get("hub"):
        console.print(
            f"demo: on the Hub: {hub['url']} (revision {hub['revision']}, commit {hub['commit_sha'][:12]})"
        )
    if generated is not None:
        console.print(
            f"demo: sample: {generated[1]}"
            if generated[0]
            else f"demo: the model does not generate: {generated[1]}"
        )
    console.print(f"demo: {_vm_costs(dag_id, run.run_id)}")
    console.print(f"demo: VMs left: {vms_left}")


def _vm_costs(dag_id: str, run_id: str) -> str:
    """The run's VM time and cost, from the teardowns' XCom (what the price table says those VMs cost).

    Its VMs: the TPU VM, the conversion's CPU VM and the export's."""
    deleted = [task_result(dag_id, run_id, f"delete_{kind}_vm") for kind in ("tpu", "cpu", "export")]
    priced = [d for d in deleted if d.get("vm_seconds") is not None]
    if not priced:
        return "VM cost: not known (no teardown reported a VM's time)"
    seconds = sum(d["vm_seconds"] for d in priced)
    parts = [f"{d['name']} {duration(d['vm_seconds'])} ({d['machine_type']})" for d in priced]
    usd = [d["cost_usd"] for d in priced]
    total = f"${sum(usd):.4f}" if None not in usd else "not priced (see the teardown's log)"
    return f"VM cost: {total} for {duration(seconds)} of VM time: {', '.join(parts)}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
