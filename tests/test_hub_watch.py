"""``schedule: on_change``'s watch (triggers/hub_revision.py) against the local Hub, through huggingface_hub.

A repo that does not change fires nothing; a new revision of a model or a dataset fires once; a restarted watch
remembers what it saw (the asset's state store) and reports a change made while it was down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest

from airflow_tpu_posttrain.local.hub_server import HubServer
from airflow_tpu_posttrain.triggers.hub_revision import REVISION_KEY, HubRevisionTrigger

TOKEN = "hub-watch-token"  # a test credential of the local Hub server only
POLL_S = 0.2
QUIET_S = 1.5  # several polls without an event: nothing changed


class _StateStore:
    """The watched asset's state store, as the triggerer hands it to the trigger (one asset)."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    async def aget(self, key: str, default=None):
        return self.values.get(key, default)

    async def aset(self, key: str, value) -> None:
        self.values[key] = value


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer(tmp_path / "hub", tokens=[TOKEN]) as server:
        monkeypatch.setenv(
            "AIRFLOW_CONN_HF_WATCH", json.dumps({"conn_type": "generic", "host": server.url, "password": TOKEN})
        )
        yield server


def _seed(store, repo_id: str, folder, text: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.jsonl").write_text(text)
    return store.seed_repo(repo_id, folder)


def _trigger(repo_id: str, repo_type: str, state: _StateStore | None) -> HubRevisionTrigger:
    _, kwargs = HubRevisionTrigger(repo_id, repo_type, hf_conn_id="hf_watch", poll_interval=POLL_S).serialize()
    trigger = HubRevisionTrigger(**kwargs)  # rebuilt, as the triggerer does
    trigger.asset_state_store = state
    return trigger


class _Watch:
    """The trigger running as in the triggerer; its events collected as they come."""

    def __init__(self, trigger: HubRevisionTrigger) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._collect(trigger))

    async def _collect(self, trigger: HubRevisionTrigger) -> None:
        async for event in trigger.run():
            await self.events.put(event.payload)

    async def next_event(self, timeout: float) -> dict | None:
        """The next event within ``timeout`` s, or None (the watch goes on)."""
        try:
            return await asyncio.wait_for(self.events.get(), timeout)
        except TimeoutError:
            assert not self._task.done(), self._task  # still watching, not ended by an error
            return None

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _recorded(state: _StateStore, timeout: float = 30) -> str:
    """The revision the watch keeps in its state store, once it has kept one (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while REVISION_KEY not in state.values:
        assert asyncio.get_running_loop().time() < deadline, "the watch kept no baseline"
        await asyncio.sleep(0.1)
    return state.values[REVISION_KEY]


@pytest.mark.parametrize("repo_type", ["model", "dataset"])
def test_a_new_revision_fires_once_and_an_unchanged_repo_never(hub, tmp_path, repo_type):
    store = hub.store if repo_type == "model" else hub.datasets
    first = _seed(store, "org/inputs", tmp_path / "v1", '{"text": "one"}\n')
    state = _StateStore()

    async def scenario():
        watch = _Watch(_trigger("org/inputs", repo_type, state))
        assert await watch.next_event(QUIET_S) is None  # what was there is the baseline
        assert await _recorded(state) == first  # its first look may come late on a loaded machine
        second = _seed(store, "org/inputs", tmp_path / "v2", '{"text": "two"}\n')
        event = await watch.next_event(10)
        assert event == {"repo_id": "org/inputs", "repo_type": repo_type, "revision": second}
        assert state.values[REVISION_KEY] == second
        assert await watch.next_event(QUIET_S) is None  # reported once
        await watch.stop()

    asyncio.run(scenario())


def test_a_restarted_watch_reports_what_changed_while_it_was_down_and_nothing_else(hub, tmp_path):
    _seed(hub.datasets, "org/chats", tmp_path / "v1", '{"text": "one"}\n')
    state = _StateStore()

    async def scenario():
        watch = _Watch(_trigger("org/chats", "dataset", state))
        assert await watch.next_event(QUIET_S) is None
        await watch.stop()  # the triggerer stops
        second = _seed(hub.datasets, "org/chats", tmp_path / "v2", '{"text": "two"}\n')
        watch = _Watch(_trigger("org/chats", "dataset", state))  # and starts again
        assert (await watch.next_event(10))["revision"] == second
        await watch.stop()
        watch = _Watch(_trigger("org/chats", "dataset", state))  # again, nothing new
        assert await watch.next_event(QUIET_S) is None
        await watch.stop()

    asyncio.run(scenario())


def test_an_unreachable_hub_is_asked_again_not_a_failed_watch(hub, tmp_path, monkeypatch):
    revision = _seed(hub.store, "org/model", tmp_path / "v1", '{"text": "one"}\n')
    state = _StateStore()
    state.values[REVISION_KEY] = revision
    monkeypatch.setenv(
        "AIRFLOW_CONN_HF_WATCH", json.dumps({"conn_type": "generic", "host": "http://127.0.0.1:9", "password": TOKEN})
    )

    async def scenario():
        watch = _Watch(_trigger("org/model", "model", state))
        assert await watch.next_event(QUIET_S) is None
        await watch.stop()

    asyncio.run(scenario())
    assert state.values[REVISION_KEY] == revision


# --------------------------------------------------------- on Airflow's real scheduler, triggerer and dag-processor

WATCH_DAG = """
from datetime import datetime

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

from airflow_tpu_posttrain.pipelines.inputs import input_assets
from airflow_tpu_posttrain.pipelines.registry import PipelineConfig

# The tiny SFT entry's inputs, as `schedule: on_change` watches them; a DAG that only notes it was started.
inputs = PipelineConfig(model="tiny-llama", recipe="sft", layout="seeds", max_tpu_vms=None, hf_conn_id="hf_watch", watch_interval_s=1)
with DAG("watch_probe", schedule=input_assets(inputs), start_date=datetime(2026, 1, 1), catchup=False):
    EmptyOperator(task_id="started")
"""


@pytest.mark.airflow_processes
def test_a_new_dataset_revision_on_the_hub_starts_a_run_and_an_unchanged_hub_none(tmp_path):
    """``schedule: on_change`` end to end: the watchers in the triggerer, the asset events, the scheduler's run."""
    from airflow_tpu_posttrain.recipes.models import TINY_CHATS_REPO, TINY_LLAMA_REPO
    from bench.local_airflow import LocalAirflow

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "watch_probe.py").write_text(WATCH_DAG)
    with HubServer(tmp_path / "hub", tokens=[TOKEN]) as hub:
        _seed(hub.store, TINY_LLAMA_REPO, tmp_path / "model", '{"model_type": "llama"}\n')
        _seed(hub.datasets, TINY_CHATS_REPO, tmp_path / "v1", '{"messages": []}\n')
        connection = json.dumps({"conn_type": "generic", "host": hub.url, "password": TOKEN})
        with LocalAirflow(tmp_path / "airflow", {"AIRFLOW_CONN_HF_WATCH": connection}, dags_folder=dags) as airflow:
            airflow.wait_for_dags(["watch_probe"], present="watch_probe")
            airflow.api("PATCH", "/dags/watch_probe", json={"is_paused": False})

            def runs() -> list[dict]:
                return airflow.api("GET", "/dags/watch_probe/dagRuns").json()["dag_runs"]

            def baselines() -> int:
                with contextlib.closing(airflow.db()) as db:
                    return db.execute("SELECT count(*) FROM asset_state_store WHERE key = ?", (REVISION_KEY,)).fetchone()[0]

            deadline = time.monotonic() + 120
            while baselines() < 2:  # both watches have seen what is there
                assert time.monotonic() < deadline, airflow.log_tail("triggerer")
                time.sleep(1)
            time.sleep(5)  # five more looks at an unchanged Hub
            assert runs() == []

            _seed(hub.datasets, TINY_CHATS_REPO, tmp_path / "v2", '{"messages": [{"role": "user"}]}\n')
            deadline = time.monotonic() + 120
            while not runs():
                assert time.monotonic() < deadline, airflow.log_tail("triggerer") + airflow.log_tail("scheduler")
                time.sleep(1)
            time.sleep(5)
            [run] = runs()  # one run for one new revision
            assert run["run_type"] == "asset_triggered", run
