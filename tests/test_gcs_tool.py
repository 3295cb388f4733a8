"""The storage commands a job script runs on a VM for ``gs://`` storage, run here with bash.

The commands are ``recipes/storage.py`` rendering ``vm_scripts/gcs_tool.py``, run against the local GCS server
(fake-gcs-server), as a VM's job runs them: google-cloud-storage pointed at the server by
``STORAGE_EMULATOR_HOST``, no credentials."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_tpu_posttrain.local.gcs_server import GcsServer, client_environment
from airflow_tpu_posttrain.recipes import storage

REPO = Path(__file__).resolve().parents[1]
TOOL = storage.GcsTool(
    script=str(REPO / "airflow_tpu_posttrain" / "vm_scripts" / "gcs_tool.py"), python=sys.executable
)
BUCKET = "checkpoints"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with GcsServer(tmp_path_factory.mktemp("gcs") / "objects", buckets=(BUCKET,)) as server:
        yield server


@pytest.fixture
def env(gcs, monkeypatch):
    """The VM's environment: the server's URL for the clients (the test's own client reads it too)."""
    variables = {**client_environment(gcs.url), "GCS_TOOL_RETRY_DEADLINE_S": "5"}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return {**os.environ}


def _bash(script: str, env: dict, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{script}"], env=env, input=stdin, capture_output=True, timeout=120
    )


def _objects(prefix: str) -> dict[str, bytes]:
    from google.cloud import storage as gcs_client

    client = gcs_client.Client()
    return {b.name: b.download_as_bytes() for b in client.list_blobs(BUCKET, prefix=prefix)}


def test_a_done_marker_and_its_metric_lines_are_objects_in_the_bucket(env, tmp_path):
    marker = f"gs://{BUCKET}/post-train/run-1/.complete-10"
    log = tmp_path / "stdout.log"
    log.write_text("noise\ncompleted step: 9, loss: 6.2\n")
    kept = storage.metrics_uri(marker)
    # As the job script does (recipes/remote_job.py): the grep's output ends a pipeline into the write.
    made = _bash(
        f"{{ grep -a 'completed step' {log} || true; }} | {storage.write_command(kept, TOOL)}\n"
        f"{storage.mark_command(marker, TOOL)}",
        env,
    )
    assert made.returncode == 0, made.stderr
    assert _objects("post-train/run-1/") == {
        "post-train/run-1/.complete-10": b"",
        "post-train/run-1/.complete-10.metrics": b"completed step: 9, loss: 6.2\n",
    }
    assert _bash(storage.exists_command(marker, TOOL), env).returncode == 0
    assert _bash(storage.read_command(kept, TOOL), env).stdout == b"completed step: 9, loss: 6.2\n"


def test_exists_tells_an_object_a_folder_and_nothing_apart(env):
    assert _bash(f"printf x | {storage.write_command(f'gs://{BUCKET}/ckpt/5/model_params/a', TOOL)}", env).returncode == 0
    for present in ("ckpt/5/model_params/a", "ckpt/5/model_params", "ckpt/5/model_params/", "ckpt"):
        assert _bash(storage.exists_command(f"gs://{BUCKET}/{present}", TOOL), env).returncode == 0, present
    # A prefix of a name is not a folder: ckpt/5/model is neither an object nor has objects under ckpt/5/model/.
    for absent in ("ckpt/5/model", "ckpt/6", "other"):
        answer = _bash(storage.exists_command(f"gs://{BUCKET}/{absent}", TOOL), env)
        assert answer.returncode == storage.EXISTS_NO and answer.stderr == b"", absent


def test_storage_unreachable_is_an_error_not_a_no(env):
    """A job must not take "could not look" for "not there" (that would redo a finished conversion)."""
    with_dead_server = {**env, **client_environment("http://127.0.0.1:9")}  # discard port: nothing listens
    started = time.monotonic()
    answer = _bash(storage.exists_command(f"gs://{BUCKET}/anything", TOOL), with_dead_server)
    assert answer.returncode not in (0, storage.EXISTS_NO)
    assert b"gcs_tool exists:" in answer.stderr
    assert time.monotonic() - started < 90  # bounded by GCS_TOOL_RETRY_DEADLINE_S, not the library's 120 s


def test_a_missing_object_cannot_be_read(env):
    answer = _bash(storage.read_command(f"gs://{BUCKET}/no/such/object", TOOL), env)
    assert answer.returncode != 0 and b"NotFound" in answer.stderr


def test_a_stream_of_several_chunks_arrives_whole(env, monkeypatch):
    """The environment archive is streamed from tar into the tool: a resumable upload in chunks."""
    data = os.urandom(40 * 1024 * 1024 + 123)  # more than two 16 MiB chunks
    uri = f"gs://{BUCKET}/environments/maxtext-env.tar.gz"
    assert _bash(storage.write_command(uri, TOOL), env, stdin=data).returncode == 0
    back = _bash(storage.read_command(uri, TOOL), env)
    assert back.returncode == 0 and back.stdout == data


def test_a_tree_goes_to_the_bucket_and_comes_back(env, tmp_path):
    """The kept export: copied to storage by one VM, restored on another."""
    source = tmp_path / "export"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "model.safetensors").write_bytes(os.urandom(1000))
    uri = f"gs://{BUCKET}/exports/run-7"
    up = _bash(storage.copy_tree_command(str(source), uri, TOOL), env)
    assert up.returncode == 0, up.stderr
    assert sorted(_objects("exports/run-7/")) == ["exports/run-7/config.json", "exports/run-7/sub/model.safetensors"]
    again = _bash(storage.copy_tree_command(str(source), uri, TOOL), env)
    assert b"0 file(s) copied" in again.stderr  # unchanged files are not uploaded again

    restored = tmp_path / "restored"
    down = _bash(storage.copy_tree_command(uri, str(restored), TOOL), env)
    assert down.returncode == 0, down.stderr
    assert sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file()) == [
        "config.json", "sub/model.safetensors"]
    assert (restored / "sub" / "model.safetensors").read_bytes() == (source / "sub" / "model.safetensors").read_bytes()


def test_gs_commands_need_the_tool_and_quote_the_uri():
    uri = "gs://bucket/run name/.complete-10.metrics"
    with pytest.raises(ValueError, match="storage tool"):
        storage.write_command(uri)
    tool = storage.GcsTool(script="/tmp/w/vm_scripts/gcs_tool.py", python="maxtext_venv/bin/python")
    assert storage.read_command(uri, tool) == (
        "\"$HOME\"/maxtext_venv/bin/python /tmp/w/vm_scripts/gcs_tool.py cat 'gs://bucket/run name/.complete-10.metrics'"
    )


def test_a_restarted_server_serves_what_it_held_once_started(tmp_path, monkeypatch):
    """The fault tests stop and start the server mid-run; a start returns only once its buckets are served."""
    from google.cloud import storage as gcs_client

    server = GcsServer(tmp_path / "objects", buckets=(BUCKET,))
    with server:
        for name, value in client_environment(server.url).items():
            monkeypatch.setenv(name, value)
        gcs_client.Client().bucket(BUCKET).blob("kept/object").upload_from_string(b"kept")
    for _ in range(20):
        with server:  # at once, as the outage thread does
            assert [b.name for b in gcs_client.Client().list_blobs(BUCKET, prefix="kept/")] == ["kept/object"]



def test_a_server_stopped_mid_upload_serves_its_finished_objects_again_and_not_the_cut_ones(tmp_path, monkeypatch):
    """After a restart the bucket serves the objects whose upload completed, and not those a stop cut short.

    A stop in the middle of an upload leaves what fake-gcs-server had written so far; on Cloud Storage an upload
    that did not complete is no object. Unhandled, one such file made every list of its bucket fail after the
    restart (a storage outage run in CI: its retry found storage still down)."""
    from google.cloud import storage as gcs_client

    server = GcsServer(tmp_path / "objects", buckets=(BUCKET,))
    with server:
        for name, value in client_environment(server.url).items():
            monkeypatch.setenv(name, value)
        gcs_client.Client().bucket(BUCKET).blob("run/checkpoints/3/commit_success.txt").upload_from_string(b"done")
    step = tmp_path / "objects" / BUCKET / "run" / "checkpoints" / "4"
    step.mkdir(parents=True)
    (step / ".commit_success.txt1234567").write_bytes(b"cut")  # its temporary file, before the rename
    (step / "_CHECKPOINT_METADATA").write_bytes(b"cut")  # renamed into place, its metadata not yet written
    with server:
        listed = [blob.name for blob in gcs_client.Client().list_blobs(BUCKET, prefix="run/")]
    assert listed == ["run/checkpoints/3/commit_success.txt"]
    assert sorted(path.name for path in step.iterdir()) == []

def _claim(uri: str, owner: str, env: dict, stale_s: int = 3600) -> int:
    return _bash(storage.claim_command(uri, owner, stale_s, TOOL if storage.is_gcs(uri) else None), env).returncode


@pytest.mark.parametrize("where", ["gs", "dir"])
def test_a_claim_is_held_by_one_owner_until_it_is_stale(env, tmp_path, where):
    """Of runs racing for a claim one wins; its next try keeps it; another takes it only from a dead owner."""
    from concurrent.futures import ThreadPoolExecutor

    uri = f"gs://{BUCKET}/conversions/key-{where}/.claim" if where == "gs" else str(tmp_path / "key" / ".claim")
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda owner: _claim(uri, owner, env), [f"dag/run-{i}" for i in range(4)]))
    assert sorted(codes) == [0, storage.CLAIM_HELD, storage.CLAIM_HELD, storage.CLAIM_HELD], codes
    winner = f"dag/run-{codes.index(0)}"
    loser = next(f"dag/run-{i}" for i, code in enumerate(codes) if code)
    assert _claim(uri, winner, env) == 0  # the winner's retry
    assert _claim(uri, loser, env) == storage.CLAIM_HELD
    if where == "dir":  # find -mmin counts whole minutes: age the file instead of waiting
        old = time.time() - 7200
        os.utime(uri, (old, old))
    assert _claim(uri, loser, env, stale_s=0 if where == "gs" else 3600) == 0  # the winner went silent
    assert _claim(uri, winner, env) == storage.CLAIM_HELD


@pytest.mark.parametrize("where", ["gs", "dir"])
def test_two_jobs_writing_one_output_run_the_step_once(env, tmp_path, where):
    """Two runs converting the same model at once: one converts, the other waits and reuses it."""
    from airflow_tpu_posttrain.recipes import remote_job

    output = f"gs://{BUCKET}/conversions/shared-{where}" if where == "gs" else str(tmp_path / "shared")
    tool = TOOL if where == "gs" else None
    runs = tmp_path / "step-runs"
    step = tmp_path / "step.sh"
    # The conversion: seconds long; the first one to run fails when told to (a failed try of the claim's holder).
    step.write_text(f"echo ran >> {runs}\nsleep 3\nif [ -e {tmp_path}/fail ]; then rm {tmp_path}/fail; exit 7; fi\n")

    def start(owner: str) -> subprocess.Popen:
        script = tmp_path / f"{owner.replace('/', '_')}.sh"
        claim = f"{output}/.claim"
        script.write_text(
            remote_job.wrapper_script(
                str(step), str(tmp_path / "log"), done_marker=f"{output}/.complete", storage_tool=tool,
                claim=(storage.claim_command(claim, owner, 3600, tool), storage.release_command(claim, owner, tool)),
                claim_poll_s=0.5,
            )
        )
        return subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)

    (tmp_path / "fail").touch()
    failing = start("dag-a/run-1")
    assert failing.wait(timeout=120) == 7  # failed, and let the claim go: the next run does not wait an hour
    jobs = [start("dag-a/run-2"), start("dag-b/run-1")]
    outputs = [job.communicate(timeout=120)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0]
    assert runs.read_text() == "ran\nran\n"  # the failed try, then the step once for the two runs
    [waited] = [out for out in outputs if remote_job.CLAIM_WAIT_LINE in out]
    assert remote_job.CLAIM_DONE_LINE in waited
    assert _bash(storage.exists_command(f"{output}/.complete", tool), env).returncode == 0


def test_stacks_started_at_once_share_one_matching_certificate_and_key(tmp_path):
    """Test processes start their stacks together: each must find a certificate and the key it was made for.

    Two writers at once once left one's key beside the other's certificate, and every later stack failed to
    serve HTTPS (``KEY_VALUES_MISMATCH``)."""
    import ssl

    program = (
        "import sys, time; from pathlib import Path; import cryptography.x509;"
        "from airflow_tpu_posttrain.local.gcs_server import google_storage_tls;"
        "go = Path(sys.argv[2]); [time.sleep(0.001) for _ in iter(lambda: go.exists(), True)];"
        "import ssl; cert, key, _ = google_storage_tls(Path(sys.argv[1]));"
        "ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)"  # as the front loads them
    )
    tls_dir, go = tmp_path / "tls", tmp_path / "go"
    makers = [subprocess.Popen([sys.executable, "-c", program, str(tls_dir), str(go)]) for _ in range(8)]
    time.sleep(3)  # every maker imported and waiting: they start together
    go.touch()
    assert [maker.wait(timeout=120) for maker in makers] == [0] * 8
    from airflow_tpu_posttrain.local.gcs_server import google_storage_tls

    cert, key, bundle = google_storage_tls(tls_dir)
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)  # raises on a mismatch
    ssl.create_default_context(cafile=str(bundle))


def test_a_half_written_checkpoint_step_is_dropped_before_a_resume_and_committed_ones_kept(env):
    """Orbax on GCS writes a step in place and its commit marker last.

    A trainer killed while saving step 4 leaves ``checkpoints/4/...`` without the marker, and the resumed trainer
    would stop on it (FileExistsError)."""
    from google.cloud import storage as gcs_client

    bucket = gcs_client.Client().bucket(BUCKET)
    run = "post-train/run-2/checkpoints"
    for name in ("2/commit_success.txt", "2/model_params/d/0", "4/model_params/d/0", "4/_CHECKPOINT_METADATA"):
        bucket.blob(f"{run}/{name}").upload_from_string(b"x")
    bucket.blob("post-train/run-2/checkpoints-elsewhere/4/x").upload_from_string(b"x")
    command = storage.drop_uncommitted_command(f"gs://{BUCKET}/{run}", TOOL)
    dropped = _bash(command, env)
    assert dropped.returncode == 0, dropped.stderr
    assert b"dropped the uncommitted checkpoint step(s) 4" in dropped.stdout
    assert sorted(_objects("post-train/run-2/")) == [
        "post-train/run-2/checkpoints-elsewhere/4/x", f"{run}/2/commit_success.txt", f"{run}/2/model_params/d/0",
    ]
    again = _bash(command, env)  # nothing left to drop: a no-op, as on the slice's other workers
    assert again.returncode == 0 and again.stdout == b""
    assert storage.drop_uncommitted_command("/dev/shm/run/checkpoints") is None  # a directory: orbax renames
