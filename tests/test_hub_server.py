"""The local Hub answers as the real Hub does, through the real ``huggingface_hub`` client.

A gated repo's info and file list are public, its files need an accepted token, and only a token holder may
gate a repo; a model card's metadata is checked before it is committed."""

from __future__ import annotations

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

from airflow_tpu_posttrain.local.hub_server import HubServer

TOKEN = "hub-test-token"  # a test credential of the local Hub server only
OTHER_USER = "hub-test-other-user"  # accepted, never granted the gated repo
REPO = "org/gated-model"


@pytest.fixture
def hub(tmp_path):
    with HubServer(tmp_path / "hub", tokens=[TOKEN, OTHER_USER]) as server:
        api = HfApi(endpoint=server.url, token=TOKEN)
        api.create_repo(REPO)
        api.upload_file(path_or_fileobj=b'{"model_type": "llama"}', path_in_repo="config.json", repo_id=REPO)
        api.update_repo_settings(REPO, gated="manual")
        yield server


def _download(hub: HubServer, tmp_path, token: str | bool) -> str:
    path = hf_hub_download(REPO, "config.json", endpoint=hub.url, token=token, cache_dir=tmp_path / "cache")
    return open(path).read()


def test_gated_files_need_an_accepted_token(hub, tmp_path):
    with pytest.raises(GatedRepoError) as no_token:
        _download(hub, tmp_path, token=False)
    assert no_token.value.response.status_code == 401
    assert "restricted" in no_token.value.server_message

    with pytest.raises(HfHubHTTPError) as wrong_token:
        _download(hub, tmp_path, token="not-a-token")
    assert wrong_token.value.response.status_code == 401
    assert not isinstance(wrong_token.value, GatedRepoError)

    assert _download(hub, tmp_path, token=TOKEN) == '{"model_type": "llama"}'


def test_gated_files_need_a_grant_and_auth_check_says_so(hub, tmp_path):
    """A valid token without the repo's grant: 403 GatedRepo on a download and on HfApi.auth_check."""
    with pytest.raises(GatedRepoError) as no_grant:
        _download(hub, tmp_path, token=OTHER_USER)
    assert no_grant.value.response.status_code == 403
    assert "not in the authorized list" in no_grant.value.server_message
    with pytest.raises(GatedRepoError):
        HfApi(endpoint=hub.url, token=OTHER_USER).auth_check(REPO)
    with pytest.raises(GatedRepoError):
        HfApi(endpoint=hub.url, token=False).auth_check(REPO)
    HfApi(endpoint=hub.url, token=TOKEN).auth_check(REPO)  # the creator's

    hub.grant(OTHER_USER, REPO)
    HfApi(endpoint=hub.url, token=OTHER_USER).auth_check(REPO)
    assert _download(hub, tmp_path, token=OTHER_USER) == '{"model_type": "llama"}'


def test_gated_repo_info_and_file_list_are_public(hub):
    anonymous = HfApi(endpoint=hub.url, token=False)
    assert anonymous.model_info(REPO).gated == "manual"
    assert "config.json" in anonymous.list_repo_files(REPO)


def test_only_a_token_holder_gates_a_repo(hub):
    with pytest.raises(HfHubHTTPError) as refused:
        HfApi(endpoint=hub.url, token=False).update_repo_settings(REPO, gated=False)
    assert refused.value.response.status_code == 401
    with pytest.raises(ValueError):  # the client refuses an unknown value before asking
        HfApi(endpoint=hub.url, token=TOKEN).update_repo_settings(REPO, gated="everyone")
    HfApi(endpoint=hub.url, token=TOKEN).update_repo_settings(REPO, gated=False)
    assert HfApi(endpoint=hub.url, token=False).model_info(REPO).gated is False


def test_a_model_card_must_name_a_base_model_of_the_hub(hub):
    """huggingface_hub validates a README.md's metadata with the Hub before committing it.

    A base model that is not a model of the Hub (a local path) is refused with the Hub's errors, a real one is
    accepted."""
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo("org/tuned")

    def card(base_model: str) -> bytes:
        return f"---\nbase_model: {base_model}\ntags:\n- maxtext\n---\n\n# tuned\n".encode()

    with pytest.raises(ValueError, match='"base_model" with value "/dev/shm/model" is not valid'):
        api.upload_file(path_or_fileobj=card("/dev/shm/model"), path_in_repo="README.md", repo_id="org/tuned")
    assert "README.md" not in api.list_repo_files("org/tuned")
    api.upload_file(path_or_fileobj=card(REPO), path_in_repo="README.md", repo_id="org/tuned")
    assert "README.md" in api.list_repo_files("org/tuned")


def test_a_token_writes_only_in_its_users_namespaces_and_reads_only_their_private_repos(tmp_path):
    """As on the Hub: a token belongs to a user and the user's organizations.

    Elsewhere it may not create or write a repo (403), and another user's private repo is not found (404)."""
    alice, bob = "hub-test-alice", "hub-test-bob"  # test credentials of the local Hub server only
    with HubServer(tmp_path / "hub", tokens=[alice, bob], namespaces={alice: ["alice", "team"], bob: ["bob"]}) as hub:
        as_alice, as_bob = HfApi(endpoint=hub.url, token=alice), HfApi(endpoint=hub.url, token=bob)
        assert as_alice.whoami()["name"] == "alice"
        assert [org["name"] for org in as_alice.whoami()["orgs"]] == ["team"]
        as_alice.create_repo("team/shared")
        as_alice.create_repo("alice/private-model", private=True)
        with pytest.raises(HfHubHTTPError, match="You don't have the rights to create a model under the namespace"):
            as_bob.create_repo("team/not-bobs")
        with pytest.raises(HfHubHTTPError) as refused:
            as_bob.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="team/shared")
        assert refused.value.response.status_code == 403
        with pytest.raises(HfHubHTTPError) as hidden:
            as_bob.model_info("alice/private-model")
        assert hidden.value.response.status_code == 404
        assert as_alice.model_info("alice/private-model").private


def test_a_training_vm_copies_the_dataset_at_the_runs_revision(hub, tmp_path):
    """The line the trainer's VM runs first (``maxtext.fetch_run_files``) copies the run's revisions.

    The gated model's tokenizer files, and the whole dataset repo at the revision the run recorded, not at its main."""
    import os
    import subprocess
    import sys
    from datetime import UTC, datetime

    from airflow_tpu_posttrain.recipes import maxtext
    from airflow_tpu_posttrain.recipes.accelerators import accelerator
    from airflow_tpu_posttrain.recipes.layout import RunLayout
    from airflow_tpu_posttrain.recipes.models import ModelProfile
    from airflow_tpu_posttrain.recipes.runtime import tpu_runtime

    hub.grant(TOKEN, REPO)
    data = tmp_path / "chats"
    (data / "data").mkdir(parents=True)
    revisions = []
    for version in (1, 2):
        (data / "data" / "train_sft-00000-of-00001.parquet").write_bytes(b"rows of version %d" % version)
        revisions.append(hub.datasets.seed_repo("org/chats", data, date=datetime(2026, 1, version, tzinfo=UTC)))
    model = ModelProfile(key="probe", maxtext_model_name="gemma3-4b", hf_source=REPO, maxtext_version="0.2.2")
    spec = maxtext.RunSpec(
        model=model,
        accelerator=accelerator("v6e-8"),
        runtime=tpu_runtime(venv=os.path.dirname(os.path.dirname(sys.executable))),
        layout=RunLayout("probe", "run", root=str(tmp_path / "vm")),
    )
    line = maxtext.fetch_run_files(spec, dataset="org/chats", dataset_revision=revisions[0])
    env = {**os.environ, "HF_TOKEN": TOKEN, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    result = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    copy = tmp_path / "vm" / "dataset" / "data" / "train_sft-00000-of-00001.parquet"
    assert copy.read_bytes() == b"rows of version 1"
    assert (tmp_path / "vm" / "base-model-files" / "config.json").read_text() == '{"model_type": "llama"}'
    assert TOKEN not in line
    assert revisions[0] in line
