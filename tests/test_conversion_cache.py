"""The conversion cache's key for a Hub model: the source revision is the Hub's current commit.

The commit of the model is asked through ``huggingface_hub`` with the token of the ``hf_conn_id`` connection
(here the local Hub server).

The local model is keyed the same way (its gated repo on the local Hub); the cache's reuse across runs is
exercised end to end by test_pipeline_reruns (backfill) and test_pipeline_local.
"""

from __future__ import annotations

import json

import pytest

from airflow_tpu_posttrain.local.hub_server import HubServer

TOKEN = "hub-test-token"  # a test credential of the local Hub server only


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer(tmp_path / "hub", tokens=[TOKEN]) as server:
        conn = {"conn_type": "generic", "host": server.url, "password": TOKEN}
        monkeypatch.setenv("AIRFLOW_CONN_HUB_FOR_CACHE", json.dumps(conn))
        yield server


def _commit(hub: HubServer, repo_id: str, content: bytes) -> str:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(repo_id, exist_ok=True)
    return api.upload_file(path_or_fileobj=content, path_in_repo="config.json", repo_id=repo_id).oid


def test_hub_models_are_keyed_by_the_hubs_current_commit(hub):
    from airflow_tpu_posttrain.operators.maxtext import MaxTextConvertOperator
    from airflow_tpu_posttrain.recipes.models import model_profile

    profile = model_profile("gemma3-4b")
    convert = MaxTextConvertOperator(task_id="convert_to_maxtext", model="gemma3-4b", hf_conn_id="hub_for_cache")
    first = _commit(hub, profile.hf_source, b'{"v": 1}')
    assert convert._source_revision(profile) == first
    second = _commit(hub, profile.hf_source, b'{"v": 2}')
    assert second != first
    assert convert._source_revision(profile) == second  # a new upstream revision means a new conversion
