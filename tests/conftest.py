"""Shared fixtures: an isolated Airflow home (SQLite), the Compute emulator, DAG runs through dag.test()."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

# Airflow reads its configuration when first imported: point it at a throw-away home before any import.
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="tpu-posttrain-airflow-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(_AIRFLOW_HOME / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__LOGGING__BASE_LOG_FOLDER"] = str(_AIRFLOW_HOME / "logs")
(_AIRFLOW_HOME / "dags").mkdir()

PROJECT = "test-project"
REPO = Path(__file__).resolve().parents[1]
# The Hugging Face token of the local stack: a unique marker that must appear nowhere but the VM's 0600 file.
HF_TOKEN = "hf_marker_token_7f3a9c2e51d04b8a"


# The conf of runs in tests about something else. The quality gate off: its SFT evaluations add about a minute of
# compiling on CPU per run (test_pipeline_local, test_preemption and the demo run with the gate on, the default).
# Training forced: a module's runs share one Airflow DB and one local Hub, so after one run publishes, the next with
# the same inputs would be skipped (test_pipeline_local tests that).
FOCUSED_RUN = {"quality_gate": "off", "force": True}

@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated SQLite metadata DB, once per session."""
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    return _AIRFLOW_HOME


SSH_LOGIN = "posttrain"
# The account the tests' Google connection holds a key of, and its roles on PROJECT (what README grants).
RUNNER_ACCOUNT = "airflow-runner@my-project.iam.gserviceaccount.com"
RUNNER_ROLES = ("roles/compute.instanceAdmin.v1", "roles/compute.osAdminLogin", "roles/iap.tunnelResourceAccessor")


@pytest.fixture(scope="session")
def client_key(tmp_path_factory) -> Path:
    """The SSH connection's private key (ed25519), made once per session."""
    key = tmp_path_factory.mktemp("client") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


def access_token(credentials) -> str:
    """The access token google-auth gets for ``credentials`` (the OAuth 2.0 JWT bearer grant at the key's token_uri)."""
    import google.auth.transport.requests

    credentials.refresh(google.auth.transport.requests.Request())
    return credentials.token


def compute_clients(emulator):
    """The Compute clients production code builds (REST, a service account key), pointed at ``emulator``."""
    from types import SimpleNamespace

    from google.cloud import compute_v1

    options = {
        "transport": "rest",
        "client_options": {"api_endpoint": emulator.url},
        "credentials": emulator_credentials(emulator),
    }
    return SimpleNamespace(
        instances=compute_v1.InstancesClient(**options),
        firewalls=compute_v1.FirewallsClient(**options),
        policies=compute_v1.ResourcePoliciesClient(**options),
        templates=compute_v1.InstanceTemplatesClient(**options),
        migs=compute_v1.InstanceGroupManagersClient(**options),
        zone_operations=compute_v1.ZoneOperationsClient(**options),
        region_operations=compute_v1.RegionOperationsClient(**options),
        global_operations=compute_v1.GlobalOperationsClient(**options),
    )


def emulator_credentials(emulator, account: str = "", roles: tuple[str, ...] = ()):
    """Credentials the Google clients send to ``emulator``: a new key of ``account`` (default the runner's).

    As a user's service account key file, through google-auth (``Credentials.from_service_account_info``)."""
    from google.oauth2 import service_account

    if not account:
        account, roles = RUNNER_ACCOUNT, RUNNER_ROLES
    key = emulator.service_account_key(account, *roles, project=PROJECT)
    return service_account.Credentials.from_service_account_info(
        key, scopes=["https://www.googleapis.com/auth/cloud-platform"]
    )


def connect_to(emu, monkeypatch, client_key) -> None:
    """Point the default Google connection and ``tpu_vm_ssh`` at ``emu``.

    Google: Compute and OS Login, with a key of the account tests run as; SSH as README makes it (login, key)."""
    key = emu.service_account_key(RUNNER_ACCOUNT, *RUNNER_ROLES, project=PROJECT)
    extra = {
        "keyfile_dict": json.dumps(key), "project": PROJECT, "compute_api_endpoint": emu.url,
        "oslogin_api_endpoint": emu.url,
    }
    monkeypatch.setenv(
        "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps({"conn_type": "google_cloud_platform", "extra": extra})
    )
    ssh = {"conn_type": "ssh", "login": SSH_LOGIN, "extra": {"key_file": str(client_key)}}
    monkeypatch.setenv("AIRFLOW_CONN_TPU_VM_SSH", json.dumps(ssh))


@pytest.fixture
def emulator(monkeypatch, tmp_path, client_key):
    """A Compute emulator whose instances are local machines (fleet.py), and the connections to use it.

    The default Google connection is pointed at it with a key of ``RUNNER_ACCOUNT``, and the ``tpu_vm_ssh``
    connection is made as README makes it (login and key only)."""
    from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
    from airflow_tpu_posttrain.local.fleet import LocalFleet

    fleet = LocalFleet(tmp_path / "disks", boot_delay=0.5)
    with ComputeEmulator(operation_seconds=0.2, fleet=fleet) as emu:
        for zone in ("us-east5-a", "us-east5-b"):  # the reservations the tests' DAGs name
            for reservation in ("my-reservation", "r"):
                emu.add_reservation(reservation, zone, vm_count=8)
        connect_to(emu, monkeypatch, client_key)
        yield emu


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The local GCS server (``local/gcs_server.py``) with the bucket ``capacity``, for the lines of places."""
    from airflow_tpu_posttrain.local.gcs_server import GcsServer

    with GcsServer(tmp_path_factory.mktemp("gcs") / "objects", buckets=("capacity",)) as server:
        yield server


@pytest.fixture
def capacity_claims(gcs_server, monkeypatch, request) -> str:
    """A ``gs://`` location of the lines of places under the TPU cap, of this test alone; the clients pointed at it."""
    from airflow_tpu_posttrain.local.gcs_server import client_environment

    for key, value in client_environment(gcs_server.url).items():
        monkeypatch.setenv(key, value)
    return f"gs://capacity/{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"


@pytest.fixture
def configured_deployment(monkeypatch) -> str:
    """Tasks run outside a task process (their ``execute`` called directly): the deployment id is configured.

    In a task it is the Variable the deployment's first create draws; outside one, Airflow's Variables cannot be
    written."""
    monkeypatch.setenv("AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID", "airflow-staging")
    return "airflow-staging"


@pytest.fixture
def run_dag(airflow_db, monkeypatch):
    """Write a DAG file into the dags folder, parse it as the scheduler would, and run it with dag.test()."""

    def _run(
        dag_id: str, body: str, run_id: str | None = None, conf: dict | None = None, logical_date: datetime | None = None
    ):
        """Give the same ``run_id`` twice to clear and re-run that DAG run, as a user does in the UI.

        A run id without ``logical_date`` gets a date of its own, drawn from the id."""
        from airflow.dag_processing.dagbag import DagBag
        from airflow.models.dagrun import DagRun

        kwargs: dict = {"run_conf": conf} if conf else {}
        if run_id:
            # dag.test() replaces the run that has the same logical date: same date + same run_id = a re-run.
            monkeypatch.setattr(DagRun, "generate_run_id", staticmethod(lambda **_: run_id))
            kwargs["logical_date"] = logical_date or datetime(2026, 1, 1, tzinfo=UTC) + timedelta(
                seconds=int(hashlib.sha256(run_id.encode()).hexdigest()[:6], 16)
            )

        path = airflow_db / "dags" / f"{dag_id}.py"
        path.write_text(textwrap.dedent(body))
        bag = DagBag(dag_folder=str(path))
        assert not bag.import_errors, bag.import_errors
        dag = bag.get_dag(dag_id)
        return dag.test(**kwargs)

    return _run


@pytest.fixture(scope="module")
def stack(airflow_db, tmp_path_factory):
    """The local stack (Compute emulator, Hub server) with its connections and the repository's DAGs.

    The Compute emulator's every instance is a machine of its own. Its VMs' disks, checkpoint storage and
    published copies are in a fresh temp dir, its connections in the environment, the repository's DAGs in the
    dags folder and the TPU pool. Tests that set ``stack.fleet.before_end`` reset it; it is reset here too
    before the stack stops, so that no test's hook runs on the VMs ended at shutdown."""
    from airflow.models import Variable
    from airflow.models.pool import Pool

    from airflow_tpu_posttrain.local.stack import LocalStack
    from airflow_tpu_posttrain.operators.inputs_check import published_inputs_variable
    from airflow_tpu_posttrain.operators.just_in_time import TIMINGS_VARIABLE
    from airflow_tpu_posttrain.pipelines.registry import load_registry

    local = LocalStack(REPO / ".local", tmp_path_factory.mktemp("vm"), hf_token=HF_TOKEN)
    with local as env, pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        for name in ("posttrain_dags.py", "local_dags.py", "models.yaml"):
            shutil.copy(REPO / "dags" / name, airflow_db / "dags" / name)
        Pool.create_or_update_pool("tpu_vms", slots=2, description="TPU VMs", include_deferred=True)
        # A stack is a fresh deployment (its storage holds no conversion): no timings measured by another one's
        # runs. Else a module's first run would wait for a conversion measured in another module's world, and in
        # dag.test, which runs one task at a time, that wait holds up the whole run.
        Variable.delete(TIMINGS_VARIABLE)
        # Nor any model published from another stack's Hub and storage: the models' seeds are the same commits in
        # every stack (dated SEEDED_AT), so a module's first run would find "its" inputs already published.
        for dag_id in {cfg.dag_id for cfg in load_registry(REPO / "dags" / "models.yaml", local=True)}:
            Variable.delete(published_inputs_variable(dag_id))
        try:
            yield local
        finally:
            local.fleet.before_end = None


def storage_objects(uri: str) -> list[str]:
    """The object names under a ``gs://bucket/prefix`` of the local GCS server, relative to the prefix.

    The stack's environment names the server in STORAGE_EMULATOR_HOST; the names are listed through
    google-cloud-storage."""
    from google.cloud import storage

    bucket, _, prefix = uri.removeprefix("gs://").partition("/")
    prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    return sorted(blob.name[len(prefix):] for blob in storage.Client().list_blobs(bucket, prefix=prefix))


def storage_has(uri: str) -> bool:
    """Whether ``uri`` is an object or has objects under it, in the local GCS server."""
    from google.cloud import storage

    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return storage.Client().bucket(bucket).blob(name).exists() or bool(storage_objects(uri))


# ------------------------------------------------------------------------------------------- fault matrix
# Every test that takes the ``fault_matrix`` fixture is a registered fault case: it records its row(s) after its
# assertions passed (a row means "verified"). Rows travel in the test's report (``user_properties``), so they
# reach the controller from pytest-xdist's workers. The terminal summary prints the table; with
# $TPU_POSTTRAIN_FAULT_MATRIX set (scripts/test sets it for a full run) the table is written to that file, and a
# registered case without its row (failed, skipped) fails the run and leaves the file as it was.

FAULT_MATRIX_COMMAND = "./scripts/test"
_ROW_PROPERTY = "fault_matrix_row"
_FAULT_ROWS: dict[str, list[tuple]] = {}  # nodeid -> the rows it recorded, in order
_FAULT_CASES: set[str] = set()  # nodeids of the registered cases that ran or were skipped


class FaultMatrix:
    def __init__(self, node: pytest.Item) -> None:
        self._node = node

    def record(self, case: str, vm_deleted: bool | None, run_state: str, model_intact: bool | None, message: str) -> None:
        self._node.user_properties.append((_ROW_PROPERTY, (case, vm_deleted, str(run_state), model_intact, message)))


@pytest.fixture(autouse=True)
def _no_settle_wait_in_process(monkeypatch):
    """Triggers run in this process (dag.test) send their events without the settle wait.

    The wait (triggers/settle.py) keeps Airflow's scheduler from taking an executor's late report for a resumed
    task (apache/airflow#71580); dag.test has no executor, so it only cost every deferral 5 s here. The tests
    that start Airflow's own processes (a scheduler, a triggerer) keep it: those import the module afresh."""
    from airflow_tpu_posttrain.triggers import settle

    monkeypatch.setattr(settle, "MIN_DEFERRAL_SECONDS", 0.0)


@pytest.fixture(autouse=True)
def _models_defined_per_test(monkeypatch):
    """The models a test's registries define stay in that test (a process keeps them, as a worker does)."""
    from airflow_tpu_posttrain.recipes import models

    monkeypatch.setattr(models, "_DEFINED", {})


@pytest.fixture
def fault_matrix(request) -> FaultMatrix:
    return FaultMatrix(request.node)


# The files that take longest (each runs whole pipelines), longest first (their worker-seconds in a full run, as
# .local/last-suite-times.json gives them): xdist hands whole files to the workers in collection order
# (scripts/test: --no-loadscope-reorder), so the workers finish close together, on the short files.
_LONGEST_FIRST = (
    "test_slice_pipeline.py",
    "test_pipeline_local.py",
    "test_pipeline_reruns.py",
    "test_backfill.py",
    "test_maxtext_faults.py",
    "test_pipeline_failures.py",
    "test_deployment.py",
    "test_approval.py",
    "test_preemption.py",
    "test_composer_floor.py",
    "test_capacity.py",
    "test_demo.py",
    "test_trigger_form.py",
    "test_vm_access.py",
    "test_reattach.py",
    "test_quality_gate.py",
    "test_hub_watch.py",
    "test_tpu_vm_operators.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "fault_matrix" in fixtures:
            item.add_marker("fault_case")
        if "stack" in fixtures:  # the local stack's pipelines train with MaxText
            item.add_marker("maxtext")
    rank = {name: index for index, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# ------------------------------------------------------------------------------------------- suite time
# Every run prints its time against the budget (bench/suite_time.py); with $TPU_POSTTRAIN_SUITE_TIMES set
# (scripts/test sets it for a full run) a green run writes it, with its slowest tests, into that page.
_TEST_SECONDS: dict[str, float] = {}  # nodeid -> set-up + call + teardown
_WORKER_ENDS: dict[str, float] = {}  # xdist worker -> when its last test ended (monotonic)
_SESSION_STARTED: list[float] = []


def pytest_sessionstart(session):
    _SESSION_STARTED.append(time.monotonic())


def _suite_times(passed: int) -> dict:
    import multiprocessing

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "cpus": multiprocessing.cpu_count(),
        "passed": passed,
        "setup_s": float(os.environ.get("TPU_POSTTRAIN_SETUP_S", "0")),
        "pytest_s": time.monotonic() - _SESSION_STARTED[0],
        "slowest": sorted(((seconds, nodeid) for nodeid, seconds in _TEST_SECONDS.items()), reverse=True),
        # How long each worker sat idle at the end, waiting for the others: the files' order to fix if large.
        "idle_at_end": {worker: time.monotonic() - ended for worker, ended in sorted(_WORKER_ENDS.items())},
    }


def pytest_runtest_logreport(report):
    _TEST_SECONDS[report.nodeid] = _TEST_SECONDS.get(report.nodeid, 0.0) + report.duration
    worker = getattr(report, "node", None)
    if worker is not None:
        _WORKER_ENDS[worker.workerinput["workerid"]] = time.monotonic()
    if "fault_case" not in report.keywords:
        return
    _FAULT_CASES.add(report.nodeid)
    if report.when == "call" and report.passed:
        _FAULT_ROWS[report.nodeid] = [tuple(value) for key, value in report.user_properties if key == _ROW_PROPERTY]


def log_excerpt(text: str, needle: str, width: int = 80) -> str:
    """The first log line holding ``needle``, from ``needle`` on, at most ``width`` characters."""
    line = next(line for line in text.splitlines() if needle in line)
    return line[line.index(needle) :][:width].strip()


def fault_matrix_rows() -> list[tuple]:
    """The verified rows, grouped by test file and test, in a stable order whatever the workers' order."""
    return [row for nodeid in sorted(_FAULT_ROWS) for row in _FAULT_ROWS[nodeid]]


def fault_matrix_markdown() -> str:
    def cell(value: object) -> str:
        text = {True: "yes", False: "**no**", None: "n/a"}[value] if value is None or isinstance(value, bool) else value
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| case | VM deleted | run state | model intact | message |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in fault_matrix_rows()]
    return "\n".join(lines) + "\n"


def _missing_fault_cases() -> list[str]:
    return sorted(nodeid for nodeid in _FAULT_CASES if not _FAULT_ROWS.get(nodeid))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    _write_fault_matrix(session, exitstatus)
    _write_suite_times(session)


def _write_suite_times(session) -> None:
    """A green full run writes its time into docs/performance.md (after the fault matrix's verdict)."""
    target = os.environ.get("TPU_POSTTRAIN_SUITE_TIMES")
    if not target or session.exitstatus != 0:
        return
    from bench.suite_time import suite_section, write_suite_section

    times = _suite_times(_passed(session.config))
    write_suite_section(Path(target), suite_section(**times))
    # Every test's seconds, for whoever balances the files between the workers (.local is not committed).
    (REPO / ".local" / "last-suite-times.json").write_text(json.dumps(times, indent=1))


def _passed(config) -> int:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return len([r for r in reporter.stats.get("passed", []) if r.when == "call"]) if reporter else 0


def _write_fault_matrix(session, exitstatus) -> None:
    target = os.environ.get("TPU_POSTTRAIN_FAULT_MATRIX")
    if not target or not _FAULT_CASES:
        return
    if exitstatus != 0:
        return  # only a green run writes the matrix
    if _missing_fault_cases():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    header = (
        "# Fault matrix\n\n"
        "Written by the fault tests of a full test run (each row is recorded only after its test's assertions "
        f"passed): `{FAULT_MATRIX_COMMAND}`. Do not edit by hand.\n\n"
        "Columns: VM deleted (no instance left in the Compute emulator; n/a where no VM is in play), final "
        "state of the DAG run (or of the failing task), model intact (the run's checkpoint / exported model "
        "is still there; n/a where the case produces none), and what the logs say.\n\n"
    )
    Path(target).write_text(header + fault_matrix_markdown())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    from bench.suite_time import BUDGET_S

    times = _suite_times(_passed(config))
    total_s = times["setup_s"] + times["pytest_s"]
    terminalreporter.write_sep("=", "suite time")
    terminalreporter.write_line(
        f"set-up {times['setup_s']:.0f} s + pytest {times['pytest_s']:.0f} s = {total_s / 60:.1f} min on "
        f"{times['cpus']} CPUs; a full run's budget is {BUDGET_S // 60} min"
        + ("" if total_s <= BUDGET_S else " (OVER it)")
    )
    if times["idle_at_end"]:
        terminalreporter.write_line(
            "idle at the end: " + ", ".join(f"{w} {s:.0f} s" for w, s in times["idle_at_end"].items())
        )
    if _FAULT_CASES:
        _summarize_fault_matrix(terminalreporter, exitstatus)


def _summarize_fault_matrix(terminalreporter, exitstatus) -> None:
    rows = fault_matrix_rows()
    terminalreporter.write_sep("=", f"fault matrix ({len(rows)} verified rows)")
    terminalreporter.write(fault_matrix_markdown())
    missing = _missing_fault_cases()
    target = os.environ.get("TPU_POSTTRAIN_FAULT_MATRIX")
    if missing:
        terminalreporter.write_line(f"fault cases without a verified row ({len(missing)}): " + ", ".join(missing))
    if target:
        written = exitstatus == 0 and not missing
        terminalreporter.write_line(
            f"fault matrix written to {target}" if written else f"{target} NOT written: only a green run writes it"
        )
