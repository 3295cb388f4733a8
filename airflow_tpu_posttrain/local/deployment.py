"""docker-compose.yaml's deployment as processes on this machine (tests/test_deployment.py).

PostgreSQL and Redis from Debian's packages, Airflow's services from the project's venv, configured by
docker-compose.yaml itself, the one source of their settings. Each service's environment, command and
healthcheck are read from the file (anchors merged, ``${VAR:-default}`` substituted from the given .env values
as docker-compose substitutes them), and the compose project is mapped onto this machine:

- the network: a service's host name (``postgres``, ``redis``, ``airflow-apiserver``) is 127.0.0.1, and each of
  its container ports a free port here;
- the containers' files: the image's AIRFLOW_HOME, ``/opt/airflow``, is one directory, in which each volume
  is a directory (a named volume) or a link to its source (a bind mount); ``airflow-init`` runs
  ``deploy/init.sh`` without the image's ``/entrypoint``;
- the containers' own files: each service has its own HOME and TMPDIR (what it writes there, no other sees);
- the containers' host names: each service's own (``airflow-worker-1``, ``airflow-worker-2``, as
  ``docker-compose up --scale airflow-worker=2`` names them), which Airflow's ``hostname_callable`` reports and
  Celery's node name carries, so that task instances tell the workers apart as they tell containers apart.

What differs from the compose file: PostgreSQL 15 and Redis 7.0 (Debian 12's) instead of the images' 16 and 7.2;
the processes run as the current user, not AIRFLOW_UID; each worker's and the triggerer's log server gets a free
port (in containers each has 8793 / 8794 to itself); and the local profile's connections and settings (the
Compute emulator, the local Hub and VMs) are added to every Airflow service's environment.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from airflow_tpu_posttrain.local.processes import StartedProcesses, free_port, stop_group

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yaml"
IMAGE_HOME = "/opt/airflow"  # AIRFLOW_HOME of the official image
# The ports the compose file's URLs may leave out: the images' defaults.
DEFAULT_PORTS = {"postgres": 5432, "redis": 6379}
SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
WORKER = "airflow-worker"
START_TIMEOUT_S = 300.0
HOSTNAME_VARIABLE = "HOSTNAME"

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\})")


def container_hostname() -> str:
    """Airflow's ``[core] hostname_callable`` here: the service's container host name, ``$HOSTNAME``."""
    return os.environ[HOSTNAME_VARIABLE]


def interpolate(value: str, variables: dict[str, str]) -> str:
    """docker-compose's substitution: ``${VAR}``, ``${VAR:-default}`` (unset or empty), ``${VAR-default}``, ``$$``."""

    def substitute(match: re.Match) -> str:
        if match["escaped"]:
            return "$"
        found = variables.get(match["name"])
        if match["op"] == ":-":
            return found or match["default"]
        if match["op"] == "-":
            return match["default"] if found is None else found
        return found or ""

    return _VARIABLE.sub(substitute, value)


class DeploymentError(RuntimeError):
    """A part of the deployment did not start or stay up; the message names it and its log."""


class ComposeDeployment(StartedProcesses):
    """``with ComposeDeployment(home, dotenv, extra_env) as deployment:`` starts it and waits until healthy.

    ``dotenv``: what docker-compose would read from .env; ``extra_env``: added to every Airflow service's
    environment (the local profile's connections). Leaving the block stops every process it started."""

    def __init__(
        self,
        home: Path,
        dotenv: dict[str, str],
        extra_env: dict[str, str],
        workers: int = 2,
        compose_file: Path = COMPOSE_FILE,
    ) -> None:
        self.home = Path(home).absolute()
        self.dotenv = dotenv
        self.extra_env = extra_env
        self.compose = yaml.safe_load(compose_file.read_text())
        self.compose_dir = compose_file.parent
        self.workers = [f"{WORKER}-{index}" for index in range(1, workers + 1)]
        self.logs = self.home / "service-logs"
        # (service, container port) -> port of 127.0.0.1
        self.ports: dict[tuple[str, int], int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.client: httpx.Client | None = None
        self._pg_dir: Path | None = None

    # -- the compose file, mapped ------------------------------------------------------------------------------

    def service(self, name: str) -> dict[str, Any]:
        return self.compose["services"][WORKER if name in self.workers else name]

    def port(self, service: str, container_port: int) -> int:
        return self.ports.setdefault((service, container_port), free_port())

    def _map(self, value: str, service: str) -> str:
        """A value of ``service``'s definition, as it is on this machine."""
        value = interpolate(value, self.dotenv)

        def host(match: re.Match) -> str:
            port = int(match["port"] or DEFAULT_PORTS[match["host"]])
            return f"127.0.0.1:{self.port(match['host'], port)}"

        value = re.sub(
            r"(?<=[@/])(?P<host>postgres|redis|airflow-apiserver)(?::(?P<port>\d+))?(?=/)", host, value
        )
        value = re.sub(r"\blocalhost:(\d+)", lambda m: f"127.0.0.1:{self.port(service, int(m[1]))}", value)
        return value.replace(IMAGE_HOME, str(self.home))

    def environment(self, name: str) -> dict[str, str]:
        """The full environment of Airflow service ``name``: the compose file's, mapped, and the local profile's."""
        service = self.service(name)
        compose_env = {
            key: self._map(str(value), name) for key, value in service.get("environment", {}).items()
        }
        listening = {
            "airflow-apiserver": {
                "AIRFLOW__API__HOST": "127.0.0.1",
                "AIRFLOW__API__PORT": self.port(name, 8080),
            },
            "airflow-scheduler": {
                "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_PORT": self.port(name, 8974)
            },
            "airflow-triggerer": {"AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": self.port(name, 8794)},
        }.get(
            name,
            {"AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": self.port(name, 8793)}
            if name in self.workers
            else {},
        )
        path = f"{Path(sys.executable).parent}{os.pathsep}{self.extra_env.get('PATH', os.environ['PATH'])}"
        # A container's own files: nothing a worker writes to its home or /tmp is seen by another service.
        private = self.home / "containers" / name
        for part in ("home", "tmp"):
            (private / part).mkdir(parents=True, exist_ok=True)
        return {
            "LANG": "C.UTF-8",
            **self.extra_env,
            "HOME": str(private / "home"),
            "TMPDIR": str(private / "tmp"),
            "PATH": path,
            "AIRFLOW_HOME": str(self.home),
            HOSTNAME_VARIABLE: name,
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": f"{__name__}.container_hostname",
            **compose_env,
            **{key: str(value) for key, value in listening.items()},
        }

    def command(self, name: str) -> list[str]:
        """What the image's entrypoint runs for ``name``: ``airflow`` and the service's command."""
        command = [shutil.which("airflow", path=str(Path(sys.executable).parent)) or "airflow"]
        command += shlex.split(self.service(name)["command"])
        if name in self.workers:  # Celery's default node name in a container: celery@<container host name>
            command += ["--celery-hostname", f"celery@{name}"]
        return command

    def _mount_volumes(self) -> None:
        """``/opt/airflow`` of every Airflow service: named volumes as directories, bind mounts as links."""
        mounts: dict[str, Path] = {}
        for name in (*SERVICES, WORKER, "airflow-init"):
            for volume in self.compose["services"][name].get("volumes", []):
                source, target = interpolate(volume, self.dotenv).split(":")[:2]
                if not target.startswith(f"{IMAGE_HOME}/"):
                    raise DeploymentError(f"{name}: volume {volume!r} is not under {IMAGE_HOME}")
                local = (
                    (self.compose_dir / source).resolve()
                    if source.startswith((".", "/"))
                    else self.home / "volumes" / source
                )
                if mounts.setdefault(target, local) != local:
                    raise DeploymentError(
                        f"{target} is a different volume in {name}: one home cannot map both"
                    )
        for target, local in mounts.items():
            path = self.home / Path(target).relative_to(IMAGE_HOME)
            path.parent.mkdir(parents=True, exist_ok=True)
            if local.is_relative_to(self.home / "volumes"):
                local.mkdir(parents=True, exist_ok=True)
            path.symlink_to(local)

    # -- starting and stopping ---------------------------------------------------------------------------------

    def start(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self._mount_volumes()
        self._start_postgres()
        self._start_redis()
        self._init()
        for name in (*SERVICES, *self.workers):
            self.start_service(name)
        for name in (*SERVICES, *self.workers):
            self.wait_healthy(name)
        self.client = self._api_client()

    def start_service(self, name: str) -> None:
        """Start (or, after :meth:`kill`, restart, as ``restart: always`` does) the Airflow service ``name``."""
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(
                self.command(name),
                env=self.environment(name),
                cwd=self.home,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self, name: str) -> None:
        """SIGKILL the service's whole process group: its container, or its machine, gone at once."""
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        if self.client:
            self.client.close()
        for proc in reversed(list(self.procs.values())):
            stop_group(proc)
        self.procs.clear()
        if self._pg_dir:
            shutil.rmtree(self._pg_dir, ignore_errors=True)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def task_logs(self, dag_id: str) -> str:
        """Every task log of ``dag_id``, from the logs volume every service shares."""
        logs = sorted((self.home / "logs" / f"dag_id={dag_id}").rglob("*.log"))
        return "\n".join(path.read_text(errors="replace") for path in logs)

    def _start_postgres(self) -> None:
        """The ``postgres`` service: its image's POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB, password auth.

        PostgreSQL refuses to run as root: as root, the cluster belongs to Debian's ``postgres`` user, in a
        directory of its own outside the (root-only) test directories."""
        env = {
            key: self._map(str(value), "postgres")
            for key, value in self.service("postgres")["environment"].items()
        }
        user, password, database = env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], env["POSTGRES_DB"]
        self._pg_dir = Path(tempfile.mkdtemp(prefix="tpu-posttrain-pg-"))
        as_owner: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self._pg_dir, "postgres")
            as_owner = ["runuser", "-u", "postgres", "--"]
        password_file = self._pg_dir / "password"
        password_file.write_text(password)
        if as_owner:
            shutil.chown(password_file, "postgres")
        bin_dir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))[-1]).parent
        data = self._pg_dir / "data"
        self._run(
            [
                *as_owner,
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                user,
                f"--pwfile={password_file}",
                "--auth=scram-sha-256",
                "-E",
                "UTF8",
            ],
            "initdb",
        )
        port = self.port("postgres", DEFAULT_PORTS["postgres"])
        with open(self.logs / "postgres.log", "ab") as log:
            self.procs["postgres"] = subprocess.Popen(
                [
                    *as_owner,
                    str(bin_dir / "postgres"),
                    "-D",
                    str(data),
                    "-p",
                    str(port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    f"unix_socket_directories={self._pg_dir}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        client_env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(port), "PGPASSWORD": password}
        self._wait("postgres", lambda: self._passes(["pg_isready", "-U", user], client_env))
        self._run(["createdb", "-U", user, database], "createdb", env=client_env)

    def _start_redis(self) -> None:
        """The ``redis`` service: an in-memory Redis on its port, as the image runs it (no persistence here)."""
        port = self.port("redis", DEFAULT_PORTS["redis"])
        with open(self.logs / "redis.log", "ab") as log:
            self.procs["redis"] = subprocess.Popen(
                [
                    "redis-server",
                    "--bind",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self._pg_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait("redis", lambda: self._passes(["redis-cli", "-p", str(port), "ping"], dict(os.environ)))

    def _init(self) -> None:
        """The ``airflow-init`` service: its entrypoint and command, deploy/init.sh, with its environment."""
        init = self.compose["services"]["airflow-init"]
        env = {**self.environment("airflow-init"), "AIRFLOW_IMAGE_ENTRYPOINT": ""}
        self._run(
            [self._map(init["entrypoint"], "airflow-init"), self._map(init["command"], "airflow-init")],
            "airflow-init",
            env=env,
            log=self.logs / "airflow-init.log",
        )

    def healthcheck(self, name: str) -> list[str]:
        """The service's compose healthcheck, as a command of this machine."""
        test = self.service(name)["healthcheck"]["test"]
        kind, *args = test
        mapped = [self._map(arg, name) for arg in args]
        return ["/bin/sh", "-c", mapped[0]] if kind == "CMD-SHELL" else mapped

    def wait_healthy(self, name: str) -> None:
        """Until the service's compose healthcheck passes (a service that exits fails at once)."""
        self._wait(name, lambda: self._passes(self.healthcheck(name), self.environment(name)))

    def _passes(self, command: list[str], env: dict[str, str]) -> bool:
        try:
            return (
                subprocess.run(command, env=env, capture_output=True, timeout=60, check=False).returncode == 0
            )
        except subprocess.TimeoutExpired:
            return False

    def _wait(self, name: str, healthy) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy():
            for proc_name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise DeploymentError(
                        f"{proc_name} exited ({proc.returncode}):\n{self.log_tail(proc_name)}"
                    )
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"{name} is not healthy after {START_TIMEOUT_S:.0f} s:\n{self.log_tail(name)}"
                )
            time.sleep(2)

    def _run(
        self, command: list[str], what: str, env: dict[str, str] | None = None, log: Path | None = None
    ) -> None:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, cwd=self.home)
        if log:
            log.write_text(done.stdout + done.stderr)
        if done.returncode:
            raise DeploymentError(
                f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )

    # -- the REST API, as a user reaches it --------------------------------------------------------------------

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port('airflow-apiserver', 8080)}"

    def _api_client(self) -> httpx.Client:
        """Signed in as ``admin`` with AIRFLOW_ADMIN_PASSWORD, the password airflow-init stored."""
        token = httpx.post(
            f"{self.api_url}/auth/token",
            json={"username": "admin", "password": self.dotenv["AIRFLOW_ADMIN_PASSWORD"]},
            timeout=30,
        )
        token.raise_for_status()
        return httpx.Client(
            base_url=f"{self.api_url}/api/v2",
            headers={"Authorization": f"Bearer {token.json()['access_token']}"},
            timeout=60,
        )

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        response = self.client.request(method, path, **kwargs)
        response.raise_for_status()
        return response

    def wait_for_dags(self, dag_ids: list[str], timeout: float = START_TIMEOUT_S) -> None:
        """Until the dag-processor has stored every one of ``dag_ids``."""
        deadline = time.monotonic() + timeout
        while missing := [dag for dag in dag_ids if self.client.get(f"/dags/{dag}").status_code != 200]:
            if time.monotonic() > deadline:
                errors = self.api("GET", "/importErrors").json()
                raise DeploymentError(f"{missing} never appeared; import errors: {str(errors)[:3000]}")
            time.sleep(2)

    def trigger(self, dag_id: str, conf: dict) -> str:
        """Unpause ``dag_id`` and trigger a run with ``conf``, as the UI's Trigger button does; the run's id."""
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf}).json()
        return run["dag_run_id"]

    def database_url(self) -> str:
        """The metadata DB's URL for psycopg2 (reading it costs less than asking the api-server)."""
        url = self.environment("airflow-scheduler")["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        return url.replace("postgresql+psycopg2://", "postgresql://")
