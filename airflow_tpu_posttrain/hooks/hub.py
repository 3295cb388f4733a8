"""The Hugging Face Hub connection: a token and, for a Hub of one's own, its endpoint."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_tpu_posttrain.defaults import HF_CONN_ID

if TYPE_CHECKING:
    from huggingface_hub import HfApi


class HuggingFaceHubHook(BaseHook):
    """``huggingface_hub``'s client with the connection's token (its password) and endpoint (its host).

    Connection type ``tpu_posttrain_huggingface``: the form shows the two fields, labelled. The type's name is
    this provider's own, so no other provider (Apache's Hugging Face provider registers ``huggingface``) can
    take it. A connection of another type with the same two fields (``generic``, ``huggingface``) works too.

    :param hf_conn_id: the connection; None: anonymous, against huggingface.co.
    """

    conn_name_attr = "hf_conn_id"
    default_conn_name = HF_CONN_ID
    conn_type = "tpu_posttrain_huggingface"
    hook_name = "Hugging Face Hub"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login", "port", "extra", "description"],
            "relabeling": {"password": "Token", "host": "Hub endpoint"},
            "placeholders": {
                "password": "hf_... (read: the base models and datasets; write: to publish)",
                "host": "blank: https://huggingface.co",
            },
        }

    def __init__(self, hf_conn_id: str | None = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hf_conn_id = hf_conn_id

    @cached_property
    def _connection(self) -> Any:
        return self.get_connection(self.hf_conn_id) if self.hf_conn_id else None

    @property
    def endpoint(self) -> str | None:
        """The Hub's URL; None: huggingface.co."""
        return (self._connection.host or None) if self._connection else None

    @property
    def token(self) -> str | None:
        return (self._connection.password or None) if self._connection else None

    def get_conn(self) -> HfApi:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)
