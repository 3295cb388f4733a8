"""What ``scripts/demo`` shows while a run goes: the run's tasks and the training's progress.

The tasks are read from the metadata DB, the progress from the logs; drawn with ``rich``.

On a terminal, a live table (one row per task: state and duration) under the training's latest step; elsewhere
(a pipe, a CI log), one line per change: a task starting, retrying or ending, a new training step. Reads only:
whoever runs the DAG (``airflow dags test`` or the scheduler) writes the DB and the logs.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics, parse_lines

# The trainer's own lines (not the conversion's or the export's "saved to", which the same log carries).
TRAINING_LINE = re.compile(
    r"Train step|completed step|Train loop finished|Restored params|RL Train|Pre RL|Post RL"
)
# An absl line's header (severity, time to the microsecond, thread, file:line): the same trainer line, whichever
# logger carried it into the demo's log.
ABSL_HEADER = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")
FINISHED = {"success", "failed", "skipped", "upstream_failed", "removed"}
# Worth a line of their own when the output is not a terminal: a task starting, being retried, ending.
REPORTED = FINISHED | {"running", "up_for_retry"}
STATE_STYLE = {
    "success": "green",
    "failed": "bold red",
    "upstream_failed": "red",
    "up_for_retry": "yellow",
    "running": "cyan",
    "deferred": "cyan",
    "skipped": "magenta",
}


@dataclass(frozen=True)
class TaskView:
    task_id: str
    state: str
    start: datetime | None
    end: datetime | None

    @property
    def seconds(self) -> float | None:
        """Its duration; so far, while it runs."""
        if self.start is None:
            return None
        return ((self.end or datetime.now(UTC)) - self.start).total_seconds()


@dataclass(frozen=True)
class RunView:
    run_id: str
    state: str
    start: datetime | None
    end: datetime | None
    tasks: tuple[TaskView, ...]

    @property
    def finished(self) -> bool:
        return self.state in ("success", "failed")


def newest_run_id(dag_id: str) -> int:
    """The DB id of the DAG's newest run (0 if none): the run to watch is the first one after it."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return session.scalar(select(func.max(DagRun.id)).where(DagRun.dag_id == dag_id)) or 0


def read_run(dag_id: str, after_id: int) -> RunView | None:
    """The DAG's first run created after the run ``after_id``, with its tasks (those started first, first)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalar(
            select(DagRun).where(DagRun.dag_id == dag_id, DagRun.id > after_id).order_by(DagRun.id).limit(1)
        )
        if run is None:
            return None
        instances = session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)
        ).all()
        tasks = [TaskView(ti.task_id, ti.state or "waiting", ti.start_date, ti.end_date) for ti in instances]
        tasks.sort(key=lambda task: (task.start is None, task.start or datetime.min, task.task_id))
        return RunView(run.run_id, run.state, run.start_date, run.end_date, tuple(tasks))


def task_result(dag_id: str, run_id: str, task_id: str) -> dict:
    """A task's XCom ``return_value`` ({} if it pushed none)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalar(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == "return_value",
            )
        )
        return (XComModel.deserialize_value(row) if row is not None else None) or {}


def metrics_from_xcom(metrics: dict) -> TrainingMetrics:
    """The train task's XCom ``metrics`` back as :class:`TrainingMetrics` (``as_xcom`` wrote "nan"/"inf" as text)."""

    def number(value: object) -> object:
        return float(value) if isinstance(value, str) and value in ("nan", "inf", "-inf") else value

    return TrainingMetrics(
        **{
            key: {k: number(v) for k, v in value.items()} if isinstance(value, dict) else number(value)
            for key, value in metrics.items()
        }
    )


class LogTail:
    """The lines appended to some files since the last call (files may appear later: a task's next attempt)."""

    def __init__(self, files: Callable[[], Iterable[Path]]) -> None:
        self.files = files
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}

    def new_lines(self) -> list[str]:
        lines: list[str] = []
        for path in self.files():
            with path.open("rb") as file:
                file.seek(self.offsets.get(path, 0))
                data = self.partial.pop(path, b"") + file.read()
                self.offsets[path] = file.tell()
            complete, _, rest = data.rpartition(b"\n")
            if rest:
                self.partial[path] = rest
            lines += complete.decode(errors="replace").splitlines() if complete else []
        return lines


def log_messages(line: str) -> list[str]:
    """The lines of a log line: a task log file's JSON line holds a message of several lines (a remote chunk)."""
    if line.startswith("{"):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                return record["event"].splitlines()
    return [line]


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def styled_state(state: str) -> Text:
    return Text(state, style=STATE_STYLE.get(state, "dim"))


def task_table(tasks: Iterable[TaskView], indent: str = "") -> Table:
    """One row per task: its id, state and duration."""
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column()
    table.add_column()
    table.add_column(justify="right")
    for task in tasks:
        table.add_row(indent + task.task_id, styled_state(task.state), duration(task.seconds))
    return table


class ProgressView:
    """The run as it goes, on ``console``: a live table on a terminal, one line per change elsewhere."""

    def __init__(self, console: Console, step_title: str, log_tail: LogTail) -> None:
        self.console = console
        self.step_title = step_title
        self.log_tail = log_tail
        self.metrics = TrainingMetrics()
        # The log holds each trainer line twice (streamed by the trigger, read back when the step ends).
        self.seen_lines: set[str] = set()
        self.run: RunView | None = None
        self.reported: dict[str, str] = {}
        self.reported_training = ""
        # transient: when the run ends, the summary takes the table's place
        self.live = Live(console=console, get_renderable=self._table, refresh_per_second=2, transient=True)

    def __enter__(self) -> ProgressView:
        if self.console.is_terminal:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live.is_started:
            self.live.stop()

    def update(self, run: RunView | None) -> None:
        self.run = run
        messages = (message for line in self.log_tail.new_lines() for message in log_messages(line))
        new = {}
        for message in filter(TRAINING_LINE.search, messages):
            header = ABSL_HEADER.search(message)
            key = header[0] if header else message
            if key not in self.seen_lines:
                new[key] = message
        self.seen_lines.update(new)
        parse_lines(new.values(), into=self.metrics)
        if self.console.is_terminal:
            return  # the live table redraws itself from self.run and self.metrics
        for task in run.tasks if run else ():
            if task.state in REPORTED and self.reported.get(task.task_id) != task.state:
                self.reported[task.task_id] = task.state
                took = f" ({duration(task.seconds)})" if task.state in FINISHED else ""
                self.console.print(
                    Text(f"  {task.task_id:<28} ").append(styled_state(task.state)).append(took)
                )
        if self.training() and self.training() != self.reported_training:
            self.reported_training = self.training()
            self.console.print(f"  {self.reported_training}")

    def training(self) -> str:
        """The training's summary so far ("" before its first step or evaluation)."""
        return self.metrics.summary(self.step_title) if self.metrics.as_xcom() else ""

    def _table(self) -> Group:
        table = task_table(self.run.tasks if self.run else ())
        state = f"run {self.run.run_id}: {self.run.state}" if self.run else "waiting for the run to start"
        return Group(
            Text(state, style="bold"), table, Text(self.training() or f"{self.step_title}: not started")
        )
