"""Airflow's real components on this machine, for the benchmarks.

The api-server, scheduler (LocalExecutor), triggerer and dag-processor, on SQLite, in a private AIRFLOW_HOME
that starts empty each time.

``dag.test()`` runs one task at a time and runs triggers inline; these components run tasks in parallel in
worker processes and wait in the triggerer, as a deployment does. Airflow 3.3 accepts LocalExecutor on SQLite
(``airflow standalone`` runs exactly that); SQLite has one writer at a time, which the components wait for.

Settings that differ from the defaults: ``[core] parallelism`` 8 instead of 32 (with fork, LocalExecutor
starts that many worker processes at once; the DAGs never run more than 4 tasks at a time), one api-server
worker, examples off, DAGs paused at creation (only the benchmarked DAG is unpaused, so the scheduled DAGs and
the reaper stay quiet). The scheduler's and triggerer's loop timings are Airflow's defaults.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

from airflow_tpu_posttrain.local.processes import (
    StartedProcesses,
    ends_with_its_starter,
    free_port,
    stop_group,
)

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = {
    "api-server": ["api-server", "--host", "127.0.0.1", "--workers", "1"],
    "scheduler": ["scheduler"],
    "triggerer": ["triggerer"],
    "dag-processor": ["dag-processor"],
}
USER = "bench"
START_TIMEOUT_S = 240


class LocalAirflow(StartedProcesses):
    """``with LocalAirflow(home, env) as airflow:`` starts the components and waits until they are healthy.

    ``env``: the local stack's connections and settings; ``dags_folder``: the repository's DAGs unless given;
    ``users``: more users besides ``bench`` (admins too; :meth:`client_as` speaks as one). Leaving the block stops
    them all."""

    def __init__(
        self, home: Path, env: dict[str, str], dags_folder: Path = REPO / "dags", users: tuple[str, ...] = ()
    ) -> None:
        self.home = Path(home).absolute()
        self.db_path = self.home / "airflow.db"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.passwords = {user: secrets.token_hex(12) for user in (USER, *users)}
        self.env = {
            **os.environ,
            **env,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db_path}",
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{user}:admin" for user in self.passwords),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.client: httpx.Client | None = None

    def start(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        (self.home / "logs").mkdir(parents=True)
        (self.home / "passwords.json").write_text(json.dumps(self.passwords))
        self._airflow("db", "migrate")
        for name, args in COMPONENTS.items():
            args = [*args, "--port", str(self.port)] if name == "api-server" else args
            with open(self.home / "logs" / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "airflow", *args],
                    env=self.env,
                    cwd=self.home,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=ends_with_its_starter,  # started from the main thread, which outlives them
                )
        self._wait_healthy()
        self.client = self.client_as(USER)

    def client_as(self, user: str) -> httpx.Client:
        """A client of the REST API logged in as ``user`` (its own token)."""
        token = httpx.post(
            f"{self.base_url}/auth/token", json={"username": user, "password": self.passwords[user]}, timeout=30
        )
        token.raise_for_status()
        return httpx.Client(
            base_url=f"{self.base_url}/api/v2",
            headers={"Authorization": f"Bearer {token.json()['access_token']}"},
            timeout=60,
        )

    def stop(self) -> None:
        if self.client:
            self.client.close()
        for proc in reversed(list(self.procs.values())):
            stop_group(proc)
        self.procs.clear()

    def _airflow(self, *args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "airflow", *args],
            env=self.env,
            cwd=self.home,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            raise RuntimeError(
                f"airflow {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return (self.home / "logs" / f"{name}.log").read_text(errors="replace")[-chars:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                health = httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=5).json()
                parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
                if all((health.get(part) or {}).get("status") == "healthy" for part in parts):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Airflow's components did not become healthy; logs in {self.home / 'logs'}"
                )
            time.sleep(1)

    # -- what the benchmarks ask -------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.client.request(method, path, **kwargs)
        response.raise_for_status()
        return response

    def wait_for_dags(self, dag_ids: list[str], present: str, timeout: float = 180) -> dict[str, bool]:
        """Wait until the dag-processor has stored ``present``; then say which of ``dag_ids`` exist.

        Once ``present`` is stored, the file that defines the DAGs has been parsed; a DAG still being written
        may not exist."""
        deadline = time.monotonic() + timeout
        while self.client.get(f"/dags/{present}").status_code != 200:
            if time.monotonic() > deadline:
                errors = self.api("GET", "/importErrors").json()
                raise RuntimeError(f"{present} never appeared; import errors: {json.dumps(errors)[:3000]}")
            time.sleep(1)
        return {dag_id: self.client.get(f"/dags/{dag_id}").status_code == 200 for dag_id in dag_ids}

    def trigger(self, dag_id: str, run_id: str, conf: dict) -> None:
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        self.api(
            "POST", f"/dags/{dag_id}/dagRuns", json={"dag_run_id": run_id, "logical_date": None, "conf": conf}
        )

    def db(self) -> sqlite3.Connection:
        """A read-only connection to the metadata DB: sampling it directly costs far less CPU than the API."""
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
