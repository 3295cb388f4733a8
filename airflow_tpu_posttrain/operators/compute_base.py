"""What the Compute operators (create, delete, the reaper) share.

The connection, the endpoint, the hook, and requestIds that make a repeated call a repeat for Compute."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.defaults import GCP_CONN_ID
from airflow_tpu_posttrain.exceptions import InvalidInputError
from airflow_tpu_posttrain.recipes import compute
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

# Without a DAG-level timeout to derive it from, the cloud-side backstop deletes the VM after this long.
DEFAULT_MAX_RUN_DURATION = timedelta(hours=12)
# Added to the DAG's dagrun_timeout so teardown normally wins the race against the backstop.
BACKSTOP_MARGIN = timedelta(minutes=30)
_REQUEST_NAMESPACE = uuid.UUID("6f1c1e0a-5b7d-4f0e-9d55-2f6c7a3b9e10")


DEPLOYMENT_VARIABLE = "airflow_tpu_posttrain.deployment_id"
# A drawn id is used once it has stayed the same this long: every create racing to draw the first one has then
# written its draw (they all found the Variable absent at the same moment), and they all use the last.
# Seen: a draw written more than 3 s after the others found the Variable absent (a loaded API server), and a VM
# renamed between its insert and its record; the create now records the name it requested whatever happens.
DEPLOYMENT_ID_SETTLE_S = 10.0
_DEPLOYMENT_ID_POLL_S = 0.5


def deployment_id() -> str:
    """The id of the Airflow deployment running the task, in its VMs' names and labels.

    Deployments sharing a project (staging and production, with the same DAG files on the same schedule) then
    never find, reuse, delete or reap each other's VMs. ``[tpu_posttrain] deployment_id`` (environment:
    ``AIRFLOW__TPU_POSTTRAIN__DEPLOYMENT_ID``), or else an id drawn at the deployment's first create and kept as
    the Airflow Variable ``airflow_tpu_posttrain.deployment_id``.

    A Variable is written last-writer-wins, so several first creates at once each draw and write an id; each
    then waits until the Variable has settled and takes its final value, so no task of the deployment ever sees
    an id change (which would rename a VM between its insert and its wait)."""
    import secrets
    import time

    from airflow.sdk import Variable
    from airflow.sdk.configuration import conf

    from airflow_tpu_posttrain.recipes import validation

    configured = conf.get("tpu_posttrain", "deployment_id", fallback="")
    try:
        if configured:
            return validation.gce_name("[tpu_posttrain] deployment_id", configured)
        kept = Variable.get(DEPLOYMENT_VARIABLE, default=None)
        if kept:
            return validation.gce_name(DEPLOYMENT_VARIABLE, kept)
    except SpecError as err:
        raise InvalidInputError(str(err)) from err
    Variable.set(
        DEPLOYMENT_VARIABLE,
        f"airflow-{secrets.token_hex(4)}",
        description="This deployment's id in its TPU VMs' names and labels (airflow-tpu-posttrain); keep it",
    )
    settled = Variable.get(DEPLOYMENT_VARIABLE)
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < DEPLOYMENT_ID_SETTLE_S:
        time.sleep(_DEPLOYMENT_ID_POLL_S)
        latest = Variable.get(DEPLOYMENT_VARIABLE)
        if latest != settled:
            settled, stable_since = latest, time.monotonic()
    return settled


def max_run_duration_s(explicit: timedelta | int | None, context: Context) -> int:
    """A VM's cloud-side backstop in seconds.

    ``explicit``, else the DAG's ``dagrun_timeout`` plus ``BACKSTOP_MARGIN``, else ``DEFAULT_MAX_RUN_DURATION``."""
    given = seconds(explicit)
    if given is not None:
        return given
    dagrun_timeout = getattr(context["dag"], "dagrun_timeout", None)
    if dagrun_timeout:
        return int((dagrun_timeout + BACKSTOP_MARGIN).total_seconds())
    return int(DEFAULT_MAX_RUN_DURATION.total_seconds())


def vm_lifetime_s(spec: compute.TpuVmSpec) -> int:
    """How long the VM (and the key that lets Airflow in) lives, from its insert: its expiry is set then."""
    return spec.max_run_duration_s or int(DEFAULT_MAX_RUN_DURATION.total_seconds())


def vm_expires_at(spec: compute.TpuVmSpec) -> int:
    """When the VM would expire if it were made now: what a body carries until its create sets it at the insert."""
    return compute.expiry(spec.max_run_duration_s, vm_lifetime_s(spec))


def request_id(context: Context, *parts: object) -> str:
    """A requestId stable within one try of one task instance, and new for every try and every re-run.

    The same call repeated by the client's retries, or after a deferral, is recognised by Compute as a repeat.
    The task instance's id changes with each try, so a re-run never replays an earlier run's finished
    operations."""
    return str(uuid.uuid5(_REQUEST_NAMESPACE, "/".join(str(p) for p in (context["ti"].id, *parts))))


def as_list(value: Sequence[str] | str | None) -> list[str]:
    """Zones from Python, a rendered template or a Param: a list, or a comma-separated string."""
    if value is None:
        return []
    if isinstance(value, str):
        return [
            part.strip()
            for part in value.strip("[]").replace("'", "").replace('"', "").split(",")
            if part.strip()
        ]
    return list(value)


def seconds(value: timedelta | int | float | str | None) -> int | None:
    """Seconds from a timedelta, a number, or a rendered template (a string when not rendered natively)."""
    if value is None:
        return None
    return int(value.total_seconds() if isinstance(value, timedelta) else float(value))


class ComputeOperator(BaseOperator):
    """What create and delete share: the connection, the endpoint and how they build the hook."""

    # Templated in every subclass, as Google's own operators template them.
    connection_template_fields: tuple[str, ...] = ("gcp_conn_id", "impersonation_chain")
    request_id_salt = ""  # set when the task's work runs again within one try (a VM recovery)

    def __init__(
        self,
        *,
        project_id: str | None = None,
        gcp_conn_id: str = GCP_CONN_ID,
        api_endpoint: str | None = None,
        impersonation_chain: str | list[str] | None = None,
        poll_interval: float = 10.0,
        name_prefix: str = "tpu",
        wait_timeout: timedelta = timedelta(hours=3),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.wait_timeout = wait_timeout
        self.project_id = project_id
        self.gcp_conn_id = gcp_conn_id
        self.api_endpoint = api_endpoint
        self.impersonation_chain = impersonation_chain
        self.poll_interval = poll_interval
        self.name_prefix = name_prefix

    def _request_id(self, context: Context, *parts: object) -> str:
        return request_id(context, *([self.request_id_salt] if self.request_id_salt else []), *parts)

    @cached_property
    def hook(self) -> TpuVmHook:
        from airflow_tpu_posttrain.hooks.compute import TpuVmHook

        return TpuVmHook(
            gcp_conn_id=self.gcp_conn_id,
            api_endpoint=self.api_endpoint,
            impersonation_chain=self.impersonation_chain,
        )

    @property
    def project(self) -> str:
        """``project_id``, else the Google connection's: its ``project`` extra, else its credentials' project.

        The extra is read from the connection alone, as the hook would let it override the credentials' project:
        a worker that only defers never imports the Google client libraries for it."""
        project = self.project_id or self._connection_project() or self.hook.project_id
        if not project:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "project_id",
                    None,
                    "is not set",
                    "pass project_id or set 'project' in the Google Cloud connection",
                ),
            )
        return project

    def _give_places_back(self, name: str, place_lines: Mapping[str, str] | None) -> None:
        """Give back the place ``name`` holds (or waits for) in any of ``place_lines``, once its VM is gone."""
        if not place_lines:
            return
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
        from airflow_tpu_posttrain.recipes import places

        hook = StoredRecordHook(gcp_conn_id=self.gcp_conn_id, impersonation_chain=self.impersonation_chain)
        for uri in dict.fromkeys(place_lines.values()):
            if hook.change(uri, lambda line: places.release(line, name)):
                self.log.info("Gave back the place of %s in %s", name, uri)

    def _connection_project(self) -> str | None:
        from airflow.sdk import BaseHook

        extras = BaseHook.get_connection(self.gcp_conn_id).extra_dejson
        return extras.get("project") or extras.get("extra__google_cloud_platform__project") or None

    def _trigger_arguments(self) -> dict[str, Any]:
        return {
            "project_id": self.project,
            "gcp_conn_id": self.gcp_conn_id,
            "api_endpoint": self.api_endpoint,
            "impersonation_chain": self.impersonation_chain,
            "poll_interval": self.poll_interval,
        }
