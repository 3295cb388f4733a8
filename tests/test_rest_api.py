"""Triggering the post-training DAGs through Airflow's REST API, as a user or a CI job does.

A real ``airflow api-server`` on 127.0.0.1 (SimpleAuthManager with a users/passwords file, token from
``POST /auth/token``) on the conftest's SQLite DB; the DAGs are written to the DB with ``airflow dags
reserialize`` instead of a DAG processor. No scheduler: the runs are created and stay queued.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_tpu_posttrain.local.processes import free_port, stop_group

pytestmark = pytest.mark.airflow_processes

httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
DAG_ID = "posttrain_sft__tiny-llama"
RL_DAG_ID = "posttrain_rl__tiny-llama"
USER, PASSWORD = "admin", "admin-test-password"
DAG_FILES = ("posttrain_dags.py", "local_dags.py", "models.yaml")


@pytest.fixture(scope="module")
def api(airflow_db, tmp_path_factory):
    """An api-server with the repo's DAGs serialized into the DB; yields (base_url, token)."""
    home = airflow_db
    work = tmp_path_factory.mktemp("rest-api")
    dags_dir = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    for name in DAG_FILES:
        shutil.copy(REPO / "dags" / name, dags_dir / name)
    passwords = work / "passwords.json"
    passwords.write_text(json.dumps({USER: PASSWORD}))
    env = {
        **os.environ,
        "TPU_POSTTRAIN_LOCAL_DIR": str(work / "local"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__API_AUTH__JWT_SECRET": "test-only-secret-" + "x" * 32,
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = {name: open(work / f"{name}.log", "wb") for name in ("reserialize", "api-server")}
    airflow = [sys.executable, "-m", "airflow"]
    procs = []
    try:
        # Both start at once (each spends most of its time importing Airflow); each in its own process group.
        reserialize = subprocess.Popen(
            [*airflow, "dags", "reserialize"], env=env, cwd=home, stdout=logs["reserialize"],
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        procs.append(reserialize)
        server = subprocess.Popen(
            [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--apps", "core"],
            env=env, cwd=home, stdout=logs["api-server"], stderr=subprocess.STDOUT, start_new_session=True,
        )
        procs.append(server)
        assert reserialize.wait(timeout=90) == 0, (work / "reserialize.log").read_text()[-3000:]

        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, (work / "api-server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "api-server did not come up:\n" + (
                (work / "api-server.log").read_text()[-3000:]
            )
            time.sleep(0.5)

        response = httpx.post(f"{base}/auth/token", json={"username": USER, "password": PASSWORD}, timeout=30)
        assert response.status_code == 201, response.text
        yield base, response.json()["access_token"]
    finally:
        for proc in reversed(procs):
            stop_group(proc, grace=10)
        for log in logs.values():
            log.close()
        for name in DAG_FILES:
            (dags_dir / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def client(api):
    base, token = api
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30) as c:
        yield c


def _trigger(client, conf: dict, dag_id: str = DAG_ID):
    return client.post(f"/api/v2/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})


def test_token_requires_the_right_password(api):
    base, _ = api
    response = httpx.post(f"{base}/auth/token", json={"username": USER, "password": "wrong"}, timeout=30)
    assert response.status_code == 401


def test_trigger_needs_a_token(api):
    base, _ = api
    response = httpx.post(f"{base}/api/v2/dags/{DAG_ID}/dagRuns", json={"logical_date": None, "conf": {}}, timeout=30)
    assert response.status_code == 401


def test_dags_are_served_with_their_params(client):
    response = client.get("/api/v2/dags", params={"dag_id_pattern": "posttrain_%"})
    assert response.status_code == 200, response.text
    dag_ids = {d["dag_id"] for d in response.json()["dags"]}
    assert {DAG_ID, RL_DAG_ID, "posttrain_sft__gemma3-4b", "posttrain_rl__llama3.1-8b-Instruct"} <= dag_ids

    details = client.get(f"/api/v2/dags/{DAG_ID}/details")
    assert details.status_code == 200, details.text
    params = details.json()["params"]
    assert params["steps"]["schema"]["minimum"] == 1
    assert params["accelerator_type"]["schema"]["enum"] == ["cpu"]
    assert params["zones"]["value"] == ["local-cpu1-a", "local-cpu1-b"]


def test_trigger_stores_the_conf(client):
    response = _trigger(client, {"steps": 3})
    assert response.status_code == 200, response.text
    run = response.json()
    assert run["dag_id"] == DAG_ID
    assert run["conf"] == {"steps": 3}
    assert run["logical_date"] is None
    assert run["state"] == "queued"
    assert run["triggered_by"] == "rest_api"

    stored = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns/{run['dag_run_id']}")
    assert stored.status_code == 200, stored.text
    assert stored.json()["conf"] == {"steps": 3}


def test_trigger_rl_with_batches(client):
    response = _trigger(client, {"num_batches": 2, "num_test_batches": 1}, dag_id=RL_DAG_ID)
    assert response.status_code == 200, response.text
    assert response.json()["conf"] == {"num_batches": 2, "num_test_batches": 1}


def test_trigger_accepts_empty_optional_values(client):
    """What the trigger form sends for fields left empty: None, meaning the model's default."""
    optional = ("reservation", "maxtext_version", "storage_uri", "overrides", "dataset", "train_split", "steps")
    empty = dict.fromkeys(optional, None)
    response = _trigger(client, empty)
    assert response.status_code == 200, response.text
    assert response.json()["conf"] == empty


BAD_CONFS = [
    ({"overrides": ["x=1; rm -rf /"]}, "overrides"),
    ({"steps": 0}, "steps"),
    ({"zones": []}, "zones"),
    ({"zones": ["us-east5-b; id"]}, "zones"),
    ({"accelerator_type": "v6e-8"}, "accelerator_type"),  # the local DAG only offers "cpu"
    ({"hub_repo_id": "a/b$(id)"}, "hub_repo_id"),
    ({"dataset": "../x"}, "dataset"),
]


@pytest.mark.parametrize(("conf", "field"), BAD_CONFS, ids=[f for _, f in BAD_CONFS])
def test_trigger_rejects_invalid_conf(client, conf, field):
    before = client.get(f"/api/v2/dags/{DAG_ID}/dagRuns").json()["total_entries"]
    response = _trigger(client, conf)
    assert response.status_code == 400, response.text
    assert f"Invalid input for param {field}:" in response.json()["detail"]
    assert client.get(f"/api/v2/dags/{DAG_ID}/dagRuns").json()["total_entries"] == before  # no run was created


def test_trigger_rejects_trailing_newline(client):
    response = _trigger(client, {"train_split": "train_sft\n"})
    assert response.status_code == 400, response.text
