"""Buttons on a task in Airflow's UI, each to a URL the task stored in XCom.

The URLs are Google Cloud console pages as providers-google's ``ComputeInstanceDetailsLink`` and
``StorageLink`` build them; those classes are not imported here because their module loads Google's clients
(seconds), and the operators a DAG file imports must stay cheap to parse.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.sdk import BaseOperator, BaseOperatorLink

CONSOLE = "https://console.cloud.google.com"


class XComUrlLink(BaseOperatorLink):
    """A button to the URL the task pushed under this link's ``xcom_key`` (none: no button target)."""

    name: ClassVar[str]

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        from airflow.providers.common.compat.sdk import XCom

        return XCom.get_value(key=self.xcom_key, ti_key=ti_key) or ""

    def push(self, context: Any, url: str) -> None:
        context["ti"].xcom_push(key=self.xcom_key, value=url)


class VmConsoleLink(XComUrlLink):
    """The VM's page in the Google Cloud console (its status, serial console, SSH button)."""

    name = "VM in the Google Cloud console"

    @staticmethod
    def url(project: str, zone: str, name: str) -> str:
        return f"{CONSOLE}/compute/instancesDetail/zones/{zone}/instances/{name}?project={project}"


class CheckpointLink(XComUrlLink):
    """The final checkpoint's folder in the Cloud Storage browser."""

    name = "Checkpoint in Cloud Storage"

    @staticmethod
    def url(uri: str) -> str | None:
        """The browser URL of a ``gs://`` folder; None for a checkpoint elsewhere (the seeds layout's VM)."""
        if not uri.startswith("gs://"):
            return None
        return f"{CONSOLE}/storage/browser/{uri.removeprefix('gs://').rstrip('/')}"
