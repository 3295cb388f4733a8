"""How a MaxText step reaches its VM: the pinned SSH connection, and the Hugging Face token and endpoint."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import InvalidInputError
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow_tpu_posttrain.hooks.vm import VmHook


class VmConnectionMixin:
    """For :class:`MaxTextJobOperator`: its rendered connection fields made into a :class:`VmHook`."""

    task_id: str
    ssh_conn_id: str
    remote_host: str | None
    ssh_login: str | None
    ssh_proxy_command: str | None
    # Who the proxy command's gcloud runs as, from the VM's record (hooks/vm.py proxy_command_as); None: its own.
    ssh_proxy_account: dict | None = None
    host_keys: Any
    hf_conn_id: str | None

    def _pinned_host_keys(self) -> dict[str, str]:
        """The rendered ``host_keys`` (a dict; a rendered string when the DAG does not render native objects)."""
        if isinstance(self.host_keys, str):
            return ast.literal_eval(self.host_keys) if self.host_keys.strip() else {}
        return dict(self.host_keys or {})

    def _vm(self) -> VmHook:
        from airflow_tpu_posttrain.hooks.vm import VmHook

        return VmHook(
            ssh_conn_id=self.ssh_conn_id,
            remote_host=self.remote_host or None,
            username=self.ssh_login or None,
            host_keys=self._pinned_host_keys(),
            proxy_command=self._proxy_command(),
            proxy_account=self.ssh_proxy_account,
        )

    def _proxy_command(self) -> str | None:
        """The rendered ``ssh_proxy_command``; a missing XCom value renders as "None"."""
        command = (self.ssh_proxy_command or "").strip()
        return command if command and command != "None" else None

    def _hub_endpoint(self) -> str | None:
        from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

        return HuggingFaceHubHook(self.hf_conn_id).endpoint if self.hf_conn_id else None

    def _token(self) -> str:
        from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

        if not self.hf_conn_id:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "hf_conn_id",
                    None,
                    "is required",
                    "name the connection whose password is the Hugging Face token",
                ),
            )
        token = HuggingFaceHubHook(self.hf_conn_id).token
        if not token:
            raise InvalidInputError.of(
                self.task_id,
                SpecError(
                    "hf_conn_id",
                    self.hf_conn_id,
                    "has no password",
                    "set the connection's password to the Hugging Face token",
                ),
            )
        return token
