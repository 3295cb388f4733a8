"""``scripts/demo --ui``: the DAG run by Airflow's own services, as a deployment runs it, with its UI to watch.

What ``airflow standalone`` starts (dag-processor, scheduler with the LocalExecutor, triggerer, api-server) on the
demo's SQLite DB, each in a process group of its own so that :meth:`AirflowServices.stop` ends it with all its
children. SimpleAuthManager's all-admins mode: no login, so the api-server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from airflow_tpu_posttrain.local.processes import stop_group

SERVICES = ("dag-processor", "scheduler", "triggerer", "api-server")
START_TIMEOUT_S = 300.0  # a bound on the wait for the DAG to be served, on a busy 2-core machine


class AirflowServices:
    """The four services, their output in ``log_dir/<service>.log``."""

    def __init__(self, env: dict[str, str], port: int, log_dir: Path) -> None:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as error:
                raise SystemExit(
                    f"demo --ui: port {port} is taken ({error}); choose another with --port"
                ) from None
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_dir = log_dir
        self.env = {
            **env,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",  # worker processes: the DAG runs a few tasks at once
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(
                32
            ),  # shared by the api-server and workers
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",  # the files do not change meanwhile
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.http = httpx.Client(base_url=f"{self.url}/api/v2", timeout=30)

    def start(self) -> None:
        airflow = [sys.executable, "-m", "airflow"]
        commands = {name: [*airflow, name] for name in SERVICES}
        commands["api-server"] += ["--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        for name, command in commands.items():
            with (self.log_dir / f"{name}.log").open("wb") as log:
                self.procs[name] = subprocess.Popen(
                    command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise SystemExit(
                    f"demo --ui: airflow {name} exited ({proc.returncode}); its log: {self.log_dir / name}.log"
                )

    def wait_until_served(self, dag_id: str) -> None:
        """Until the api-server serves the DAG (the dag-processor has parsed it)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if self.http.get(f"/dags/{dag_id}").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"demo --ui: {dag_id} not served after {START_TIMEOUT_S:.0f} s; logs: {self.log_dir}"
                )
            time.sleep(1)

    def trigger(self, dag_id: str, conf: dict) -> str:
        """Unpause the DAG and trigger a run, as the UI's Trigger button does; the run's id."""
        self.http.patch(f"/dags/{dag_id}", json={"is_paused": False}).raise_for_status()
        response = self.http.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
        response.raise_for_status()
        return response.json()["dag_run_id"]

    def stop(self) -> None:
        """TERM each service's process group, then KILL what is left of it (a service can hang on TERM)."""
        self.http.close()
        for proc in reversed(self.procs.values()):
            stop_group(proc)
