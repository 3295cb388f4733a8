"""docker-compose.yaml's deployment, run for real: PostgreSQL, Redis, two Celery workers, a separate triggerer.

The compose services as processes of this machine (local/deployment.py: docker-compose.yaml is the one source
of their settings, deploy/init.sh their init), the pool ``tpu_vms`` at 1 slot. On it the tiny SFT pipeline runs
from a REST trigger; a run of the tiny GRPO pipeline, triggered while the SFT training holds the slot waiting in
the triggerer, waits for the pool; the Celery worker that deferred the SFT training is killed (SIGKILL, its
whole process group) while the training waits, and the training resumes on the other worker; the reaper runs
while the pipelines' VMs are up and deletes none of them; at the end both runs succeeded and no VM is left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from conftest import FOCUSED_RUN, HF_TOKEN, REPO

SFT, RL, REAPER = "posttrain_sft__tiny-llama", "posttrain_rl__tiny-llama", "tpu_vm_reaper"
POOL = "tpu_vms"
ACTIVE = ("queued", "running", "deferred")  # what a pool slot is taken by (deferred counted)
RUNS_TIMEOUT_S = 1500.0
SAMPLE_S = 0.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator:
    from airflow_tpu_posttrain.local.stack import LocalStack

    local = LocalStack(REPO / ".local", tmp_path_factory.mktemp("vm"), hf_token=HF_TOKEN)
    with local:
        yield local


@pytest.fixture(scope="module")
def deployment(stack, tmp_path_factory) -> Iterator:
    from airflow_tpu_posttrain.local.deployment import ComposeDeployment
    from airflow_tpu_posttrain.local.stack import LOCAL_PROJECT

    # The credentials directory of .env.example: the TPU VM SSH key, which airflow-init's tpu_vm_ssh names.
    credentials = tmp_path_factory.mktemp("credentials")
    shutil.copy(stack.client_key, credentials / "tpu_vm_ssh_key")
    dotenv = {
        "AIRFLOW_UID": str(os.getuid()),
        "AIRFLOW_CREDENTIALS_DIR": str(credentials),
        "AIRFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(12),
        "TPU_VM_POOL_SLOTS": "1",
        "HF_TOKEN": HF_TOKEN,
    }
    # The registry's Google Cloud entries are swept by the reaper too: their google_cloud_default is the Compute
    # emulator here (a connection in the environment comes before the one airflow-init stored).
    emulator = {
        "conn_type": "google_cloud_platform",
        "extra": {"key_path": str(stack.google_key_file), "project": LOCAL_PROJECT, "compute_api_endpoint": stack.compute.url},
    }
    extra_env = {**stack.environment(), "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps(emulator)}
    with ComposeDeployment(tmp_path_factory.mktemp("deployment"), dotenv, extra_env) as running:
        running.wait_for_dags([SFT, RL, REAPER])
        yield running


@dataclasses.dataclass(frozen=True)
class Task:
    dag_id: str
    task_id: str
    state: str | None
    hostname: str
    pool: str


class MetadataDb:
    """Samples of the task instances, read from PostgreSQL (cheaper than asking the api-server each time)."""

    def __init__(self, url: str) -> None:
        self.connection = psycopg2.connect(url)
        self.connection.autocommit = True

    def tasks(self) -> dict[tuple[str, str], Task]:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT dag_id, task_id, state, hostname, pool FROM task_instance")
            return {(row[0], row[1]): Task(*row) for row in cursor.fetchall()}

    def return_values(self, dag_id: str, task_id: str | None = None) -> list:
        """The XCom return values of ``dag_id``'s tasks (of ``task_id`` only, when given)."""
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT value FROM xcom WHERE dag_id = %s AND key = 'return_value' AND task_id LIKE %s",
                (dag_id, task_id or "%"),
            )
            return [row[0] for row in cursor.fetchall()]

    def run_states(self, dag_id: str) -> list[str]:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT state FROM dag_run WHERE dag_id = %s", (dag_id,))
            return [row[0] for row in cursor.fetchall()]


def test_init_made_the_pool_and_connections(deployment, stack) -> None:
    """deploy/init.sh ran against PostgreSQL: the pool counts deferred tasks, the connections are stored."""
    pool = deployment.api("GET", f"/pools/{POOL}").json()
    assert (pool["slots"], pool["include_deferred"]) == (1, True), pool
    stored = {c["connection_id"]: c for c in deployment.api("GET", "/connections").json()["connections"]}
    assert {"google_cloud_default", "tpu_vm_ssh", "hf_default"} <= stored.keys()
    key_file = Path(json.loads(stored["tpu_vm_ssh"]["extra"])["key_file"])  # /opt/airflow/credentials/...
    assert key_file.read_bytes() == stack.client_key.read_bytes()
    assert HF_TOKEN not in json.dumps(stored)  # the API shows the token's connection, not the token


def test_pipelines_share_the_pool_and_survive_a_worker_killed_while_a_task_waits(deployment, stack, fault_matrix) -> None:
    db = MetadataDb(deployment.database_url())
    deployment.trigger(SFT, FOCUSED_RUN)
    rl_run = None
    killed, restarted, reaper_triggered = None, False, False
    waits: list[tuple[Task, Task]] = []  # (waiting pool task, the task holding the slot)
    held_by_two: list[list[Task]] = []
    overtaken: list[Task] = []  # the other run's pool tasks that ran while the SFT training waited to resume
    first_seen: dict[tuple[str, str, str | None], float] = {}  # (dag, task, state) -> seconds since the trigger
    started = time.monotonic()
    deadline = started + RUNS_TIMEOUT_S
    while True:
        tasks = db.tasks()
        for task in tasks.values():
            first_seen.setdefault((task.dag_id, task.task_id, task.state), time.monotonic() - started)
        in_pool = [task for task in tasks.values() if task.pool == POOL]
        holders = [task for task in in_pool if task.state in ACTIVE]
        if len(holders) > 1:
            held_by_two.append(holders)
        waits += [(task, holders[0]) for task in in_pool if task.state == "scheduled" and holders]
        train = tasks.get((SFT, "train"))
        if killed and train.state == "scheduled":  # resuming: it needs its slot back
            overtaken += [task for task in holders if task.dag_id == RL]
        busy = [task for task in tasks.values() if task.state in ("queued", "running")]
        if killed is None and train and train.state == "deferred" and not busy:
            # The training waits in the triggerer; the worker that ran it until then goes away.
            killed = train.hostname
            deployment.kill(killed)
            rl_run = deployment.trigger(RL, FOCUSED_RUN)
        if killed and not restarted and train.state in ("running", "success") and train.hostname != killed:
            deployment.start_service(killed)  # back, as compose's `restart: always` brings a worker back
            restarted = True
        rl_vm = tasks.get((RL, "create_tpu_vm"))
        if rl_run and not reaper_triggered and rl_vm and rl_vm.state == "success":
            deployment.trigger(REAPER, {"dry_run": False})  # while both runs' VMs are up
            reaper_triggered = True
        states = db.run_states(SFT) + db.run_states(RL)
        if rl_run and all(state in ("success", "failed") for state in states):
            break
        assert time.monotonic() < deadline, (tasks, deployment.log_tail("airflow-scheduler"))
        time.sleep(SAMPLE_S)

    tasks = db.tasks()
    assignment = "\n".join(
        f"{task.dag_id:28} {task.task_id:28} {task.state:10} {task.hostname}"
        for task in sorted(tasks.values(), key=lambda t: (t.dag_id, t.task_id))
    )
    timeline = "\n".join(
        f"{seconds:7.1f} s  {dag_id} {task_id} {state}"
        for (dag_id, task_id, state), seconds in sorted(first_seen.items(), key=lambda item: item[1])
    )
    print(f"per-task worker assignment (killed: {killed}):\n{assignment}\ntimeline:\n{timeline}")
    assert db.run_states(SFT) == ["success"] and db.run_states(RL) == ["success"], assignment

    # The deferred training resumed on the other worker, the one still up; both workers ran tasks.
    assert killed in deployment.workers
    survivor = tasks[(SFT, "train")].hostname
    assert survivor in deployment.workers and survivor != killed, assignment
    # The pool: never two of its tasks at once, and a run's task waited while the other's held the slot.
    assert not held_by_two, held_by_two[:3]
    deferred_waits = [(waiting, holder) for waiting, holder in waits if holder.state == "deferred"]
    assert any(waiting.dag_id == RL for waiting, _ in deferred_waits), waits[:5]
    # ... and the training, its trigger fired, got the slot back before them (its VM idles until it has).
    assert not overtaken, overtaken[:3]

    # The reaper looked up the runs of the VMs it found through the api-server, and deleted none.
    deadline = time.monotonic() + 300
    while any(state not in ("success", "failed") for state in db.run_states(REAPER)):
        assert time.monotonic() < deadline, deployment.log_tail("airflow-scheduler")
        time.sleep(2)
    assert set(db.run_states(REAPER)) == {"success"}
    sweeps = db.return_values(REAPER)
    assert sweeps and all(sweep["deleted"] == 0 and sweep["kept"] == sweep["seen"] for sweep in sweeps), sweeps
    assert max(sweep["seen"] for sweep in sweeps) >= 2, sweeps  # at least the SFT and GRPO runs' TPU VMs
    reaper_logs = deployment.task_logs(REAPER)
    assert "its DAG run is running" in reaper_logs, reaper_logs[-3000:]

    # Nothing left: no instance in Compute, no local machine; the SFT model was published.
    assert stack.compute.instances() == [] and stack.vms() == []
    [published] = [value for value in db.return_values(SFT, "export_and_publish")]
    assert stack.hub.store.load_repo(published["hub"]["repo_id"]) is not None, published
    # The Hub token reached the runs only through connections: no service or task log shows it.
    for log in deployment.home.rglob("*.log"):
        assert HF_TOKEN not in log.read_text(errors="replace"), log
    fault_matrix.record(
        "deployment: the Celery worker that ran the deferred training is SIGKILLed (PostgreSQL, Redis, 2 workers)",
        True, "success", True,
        f"train deferred on {killed}, resumed on {survivor}; reaper kept {max(s['seen'] for s in sweeps)} VMs",
    )
