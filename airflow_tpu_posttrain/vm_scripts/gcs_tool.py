#!/usr/bin/env python3
"""The pipeline's own ``gs://`` operations on a VM: tests for markers, small files, archives and directory trees.

Runs ON the VM: the pipeline copies this file there and runs it with an interpreter that has
google-cloud-storage (the MaxText venv's python: MaxText depends on google-cloud-storage; before that venv
exists, ``uv run --with google-cloud-storage``: see recipes/install.py). Standard library plus
google-cloud-storage, imported when a command runs.

Credentials are the VM's own (application default credentials: the VM's service account through its metadata
server); nothing is copied onto the VM for storage. Locally the VMs' environment names the local GCS server in
``STORAGE_EMULATOR_HOST``, which google-cloud-storage honours itself (anonymous access, as the local server
allows).

Commands (exit 0 on success; ``exists`` exits 1 for "no"; any other failure, storage unreachable included,
exits 2 with the error on stderr, so "not there" is never mistaken for "could not look")::

    exists URI            an object, or a "folder" (objects under URI/)
    cat URI               the object to standard output
    write URI             standard input to the object (a resumable upload in chunks: any size, bounded memory)
    move SOURCE DEST      the object SOURCE renamed DEST (a server-side rewrite, then SOURCE deleted)
    sync SOURCE DEST      a tree: every object under gs://.../SOURCE/ into the directory DEST, or every file under
                          the directory SOURCE to gs://.../DEST/ (objects whose MD5 already matches are skipped)
    claim URI OWNER STALE_S
                          create the object URI naming OWNER only if it does not exist (a generation-match
                          precondition: of claims racing, one wins); exits 0 if OWNER holds it now (made, already
                          OWNER's, or taken over from a holder silent for STALE_S seconds), 3 if another does
    release URI OWNER     delete the claim object URI if OWNER holds it
    drop-uncommitted URI  delete every step directory under the checkpoint directory URI (``URI/<step>/``) that
                          has no ``commit_success.txt``: what a trainer killed while saving left
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

CHUNK_SIZE = 16 * 1024 * 1024  # resumable uploads in 16 MiB chunks (a multiple of 256 KiB, as GCS requires)
# How long reads and listings are retried (google-cloud-storage's own policy: transient errors and connection
# failures, exponential backoff) before the tool gives up; the library's default is 120 s.
RETRY_DEADLINE_VARIABLE = "GCS_TOOL_RETRY_DEADLINE_S"
EXIT_NO = 1
EXIT_ERROR = 2
EXIT_HELD = 3


class StorageToolError(Exception):
    pass


def split(uri: str) -> tuple[str, str]:
    """``(bucket, object name or prefix)`` of ``gs://bucket/name``; the name without a trailing '/'."""
    if not uri.startswith("gs://"):
        raise StorageToolError(f"not a gs:// URI: {uri!r}")
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    if not bucket:
        raise StorageToolError(f"no bucket in {uri!r}")
    return bucket, name.strip("/")


def _client():
    from google.cloud import storage

    return storage.Client()


def _retry():
    from google.cloud.storage.retry import DEFAULT_RETRY

    deadline = float(os.environ.get(RETRY_DEADLINE_VARIABLE) or 120)
    return (
        DEFAULT_RETRY.with_timeout(deadline)
        if hasattr(DEFAULT_RETRY, "with_timeout")
        else (DEFAULT_RETRY.with_deadline(deadline))
    )


def exists(uri: str) -> bool:
    bucket_name, name = split(uri)
    client = _client()
    bucket = client.bucket(bucket_name)
    if name and bucket.blob(name).exists(retry=_retry()):
        return True
    prefix = f"{name}/" if name else ""
    return any(True for _ in client.list_blobs(bucket_name, prefix=prefix, max_results=1, retry=_retry()))


def cat(uri: str) -> None:
    bucket_name, name = split(uri)
    _client().bucket(bucket_name).blob(name).download_to_file(sys.stdout.buffer, retry=_retry())
    sys.stdout.buffer.flush()


def write(uri: str) -> None:
    bucket_name, name = split(uri)
    if not name:
        raise StorageToolError(f"no object name in {uri!r}")
    blob = _client().bucket(bucket_name).blob(name)
    # A resumable upload fed chunk by chunk from the stream (a pipe cannot seek, so not upload_from_file); the
    # object appears only when the last chunk is in: a reader never sees a partial archive.
    with blob.open("wb", chunk_size=CHUNK_SIZE, ignore_flush=True) as out:
        shutil.copyfileobj(sys.stdin.buffer, out, CHUNK_SIZE)


def move(source: str, destination: str) -> None:
    """Rename an object.

    A stream's upload finalizes whatever arrived before its end of file, a writer that died midway included,
    so a whole archive is written under a temporary name and moved into place only once its producer
    succeeded."""
    (source_bucket, source_name), (bucket_name, name) = split(source), split(destination)
    client = _client()
    blob = client.bucket(source_bucket).blob(source_name)
    target = client.bucket(bucket_name).blob(name)
    token, _, _ = target.rewrite(blob, retry=_retry())
    while token is not None:  # large objects are rewritten in several calls
        token, _, _ = target.rewrite(blob, token=token, retry=_retry())
    blob.delete(retry=_retry())


def claim(uri: str, owner: str, stale_s: float) -> bool:
    """Whether ``owner`` holds the claim object ``uri`` now; see the module's docstring."""
    from datetime import UTC, datetime

    from google.api_core.exceptions import NotFound, PreconditionFailed

    bucket_name, name = split(uri)
    blob = _client().bucket(bucket_name).blob(name)
    record = json.dumps({"owner": owner})
    try:
        blob.upload_from_string(record, if_generation_match=0, retry=_retry())
        return True
    except PreconditionFailed:
        pass
    try:
        blob.reload(retry=_retry())
        holder = json.loads(blob.download_as_bytes(if_generation_match=blob.generation, retry=_retry()))["owner"]
    except (NotFound, PreconditionFailed):  # released or taken over meanwhile: ask again next time
        return False
    if holder == owner:  # this owner's earlier try
        return True
    silent_s = (datetime.now(UTC) - blob.updated).total_seconds()
    print(f"gcs_tool claim: {uri} is held by {holder} (written {silent_s:.0f} s ago)", file=sys.stderr)
    if silent_s < stale_s:
        return False
    try:
        blob.upload_from_string(record, if_generation_match=blob.generation, retry=_retry())
    except PreconditionFailed:
        return False
    print(f"gcs_tool claim: taken over from {holder}, silent for {stale_s:.0f} s or more", file=sys.stderr)
    return True


def release(uri: str, owner: str) -> None:
    from google.api_core.exceptions import NotFound, PreconditionFailed

    bucket_name, name = split(uri)
    blob = _client().bucket(bucket_name).blob(name)
    try:
        blob.reload(retry=_retry())
        if json.loads(blob.download_as_bytes(if_generation_match=blob.generation))["owner"] == owner:
            blob.delete(if_generation_match=blob.generation, retry=_retry())
    except (NotFound, PreconditionFailed):  # gone, or taken over meanwhile: not this owner's to delete
        pass


COMMIT_MARKER = "commit_success.txt"  # orbax's "this step is complete" where storage has no atomic rename


def drop_uncommitted(uri: str) -> list[str]:
    """Delete the checkpoint steps under ``uri`` that orbax never committed; their numbers.

    On storage without rename orbax writes a step in place and its commit marker last, and a trainer that saves
    a step already there stops with ``FileExistsError``: a step half-written by a trainer that was killed (its
    VM lost) would stop the resumed training when it reaches that step again."""
    from google.api_core.exceptions import NotFound

    bucket_name, name = split(uri)
    prefix = f"{name}/"
    steps: dict[str, list] = {}
    for blob in _client().list_blobs(bucket_name, prefix=prefix, retry=_retry()):
        step = blob.name[len(prefix):].split("/", 1)[0]
        if step.isdigit():
            steps.setdefault(step, []).append(blob)
    dropped = []
    for step, blobs in sorted(steps.items(), key=lambda item: int(item[0])):
        if any(blob.name == f"{prefix}{step}/{COMMIT_MARKER}" for blob in blobs):
            continue
        for blob in blobs:
            try:
                blob.delete(retry=_retry())
            except NotFound:  # another worker of the slice dropped it first
                pass
        dropped.append(step)
    return dropped


def _md5(path: Path) -> str:
    digest = hashlib.md5()  # noqa: S324 - GCS's own content hash, not for security
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return base64.b64encode(digest.digest()).decode()


def sync(source: str, destination: str) -> int:
    """Copy a tree between a gs:// prefix and a local directory; returns how many files were transferred."""
    client = _client()
    if source.startswith("gs://") and not destination.startswith("gs://"):
        bucket_name, name = split(source)
        prefix = f"{name}/" if name else ""
        target = Path(destination)
        count = 0
        for blob in client.list_blobs(bucket_name, prefix=prefix, retry=_retry()):
            relative = blob.name[len(prefix) :]
            if not relative or relative.endswith("/"):
                continue  # a "folder" placeholder object
            path = target / relative
            if ".." in Path(relative).parts:
                raise StorageToolError(f"refusing object name outside the destination: {blob.name!r}")
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_file() and _md5(path) == blob.md5_hash:
                continue
            partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
            blob.download_to_filename(str(partial), retry=_retry())
            os.replace(partial, path)
            count += 1
        return count
    if destination.startswith("gs://") and not source.startswith("gs://"):
        root = Path(source)
        if not root.is_dir():
            raise StorageToolError(f"not a directory: {source}")
        bucket_name, name = split(destination)
        bucket = client.bucket(bucket_name)
        count = 0
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relative = path.relative_to(root).as_posix()
            object_name = f"{name}/{relative}" if name else relative
            existing = bucket.get_blob(object_name, retry=_retry())
            if existing is not None and existing.md5_hash == _md5(path):
                continue
            bucket.blob(object_name, chunk_size=CHUNK_SIZE).upload_from_filename(str(path))
            count += 1
        return count
    raise StorageToolError(f"sync copies between gs:// and a directory, got {source!r} -> {destination!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gcs_tool", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in ("exists", "cat", "write", "drop-uncommitted"):
        commands.add_parser(command).add_argument("uri")
    for command in ("sync", "move"):
        two_uris = commands.add_parser(command)
        two_uris.add_argument("source")
        two_uris.add_argument("destination")
    claim_parser = commands.add_parser("claim")
    claim_parser.add_argument("uri")
    claim_parser.add_argument("owner")
    claim_parser.add_argument("stale_s", type=float)
    release_parser = commands.add_parser("release")
    release_parser.add_argument("uri")
    release_parser.add_argument("owner")
    args = parser.parse_args(argv)
    try:
        if args.command == "exists":
            return 0 if exists(args.uri) else EXIT_NO
        if args.command == "claim":
            return 0 if claim(args.uri, args.owner, args.stale_s) else EXIT_HELD
        if args.command == "release":
            release(args.uri, args.owner)
            return 0
        if args.command == "drop-uncommitted":
            dropped = drop_uncommitted(args.uri)
            if dropped:
                print(f"gcs_tool: dropped the uncommitted checkpoint step(s) {', '.join(dropped)} of {args.uri}")
            return 0
        if args.command == "cat":
            cat(args.uri)
        elif args.command == "write":
            write(args.uri)
        elif args.command == "move":
            move(args.source, args.destination)
        else:
            count = sync(args.source, args.destination)
            print(
                f"gcs_tool: {count} file(s) copied from {args.source} to {args.destination}", file=sys.stderr
            )
    except Exception as err:  # noqa: BLE001 - every failure is reported as one line and exit 2
        print(f"gcs_tool {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
