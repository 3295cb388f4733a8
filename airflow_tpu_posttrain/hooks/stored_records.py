"""Records several runs and deployments share, in Cloud Storage: read, changed, written back only if unchanged.

Each record is one JSON object: a line of places under the TPU cap (``recipes/places.py``, at
``<capacity_claims>/<line key>.json``), a claim on a run's inputs (``recipes/trainings.py``). A change reads the
object and its generation, computes the new record, and writes it with
``ifGenerationMatch`` = that generation (0: the object must not exist yet): Cloud Storage refuses the write with
412 if anyone wrote the object in between, and the change is made again on what they wrote. Credentials come
from providers-google's GCSHook (its connection, impersonation chain, and ``STORAGE_EMULATOR_HOST`` locally).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from airflow.providers.google.cloud.hooks.gcs import GCSHook
from airflow.providers.google.common.hooks.base_google import GoogleBaseAsyncHook

from airflow_tpu_posttrain.exceptions import CloudResourceError

T = TypeVar("T")
# Two creates rarely write one line within the same second; a busy line (a backfill's runs all asking) still
# settles within a few rounds. Cloud Storage allows about one write per second to one object.
MAX_ROUNDS = 30


class StoredRecordHook(GCSHook):
    """Change one record in Cloud Storage, as one compare-and-swap."""

    def change(self, uri: str, change: Callable[[dict[str, Any]], tuple[dict[str, Any], T]]) -> T:
        """Apply ``change`` (the record -> the new record and a result) to the record at ``uri``; its result.

        The write is skipped when the record is unchanged. Raises :class:`CloudResourceError` when the bucket
        does not exist or the line stayed contended for ``MAX_ROUNDS`` rounds."""
        from google.api_core.exceptions import NotFound, PreconditionFailed

        bucket_name, _, name = uri.removeprefix("gs://").partition("/")
        bucket = self.get_conn().bucket(bucket_name)
        for _ in range(MAX_ROUNDS):
            try:
                blob = bucket.get_blob(name)
                generation = blob.generation if blob is not None else 0
                line = json.loads(blob.download_as_bytes(if_generation_match=generation)) if blob else {}
                new, result = change(line)
                if new != line:
                    bucket.blob(name).upload_from_string(
                        json.dumps(new, sort_keys=True), content_type="application/json",
                        if_generation_match=generation,
                    )
                return result
            except PreconditionFailed:  # written in between: change what is there now
                time.sleep(random.uniform(0.05, 0.5))
            except NotFound as err:
                raise CloudResourceError(
                    f"The bucket gs://{bucket_name} of {uri} does not exist ({err}). Fix: create it, or point "
                    "capacity_claims (checkpoint_storage) at a bucket every deployment sharing it can write."
                ) from err
        raise CloudResourceError(f"{uri}: still contended after {MAX_ROUNDS} rounds; try again")

    def lines(self, capacity_claims: str) -> list[str]:
        """The lines (their ``gs://`` objects) under ``capacity_claims``."""
        bucket, _, prefix = capacity_claims.removeprefix("gs://").partition("/")
        prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        return [f"gs://{bucket}/{name}" for name in self.list(bucket, prefix=prefix) if name.endswith(".json")]

    def read(self, uri: str) -> dict[str, Any]:
        """The record at ``uri`` as it is now (empty when nobody wrote it yet)."""
        bucket_name, _, name = uri.removeprefix("gs://").partition("/")
        blob = self.get_conn().bucket(bucket_name).get_blob(name)
        return json.loads(blob.download_as_bytes()) if blob is not None else {}



class StoredRecordAsyncHook(GoogleBaseAsyncHook):
    """The triggerer's view: the sync client's calls run in a thread so the event loop never blocks."""

    sync_hook_class = StoredRecordHook

    async def change(self, uri: str, change: Callable[[dict[str, Any]], tuple[dict[str, Any], T]]) -> T:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.change, uri, change)

    async def read(self, uri: str) -> dict[str, Any]:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.read, uri)
