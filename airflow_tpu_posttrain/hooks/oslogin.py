"""OS Login I/O: put the SSH connection's public key into the caller's OS Login profile.

providers-google's :class:`OSLoginHook` does the call; this adds the API endpoint override (hook argument, or
the connection extra ``oslogin_api_endpoint``) through the client's REST transport, so the same code talks to
the local emulator.
"""

from __future__ import annotations

import asyncio
from functools import cached_property
from typing import Any

from airflow.providers.google.cloud.hooks.os_login import OSLoginHook
from airflow.providers.google.common.hooks.base_google import GoogleBaseAsyncHook

from airflow_tpu_posttrain.defaults import GCP_CONN_ID


class OsLoginKeyHook(OSLoginHook):
    """Import SSH public keys into an OS Login profile and answer its POSIX login."""

    def __init__(
        self, gcp_conn_id: str = GCP_CONN_ID, api_endpoint: str | None = None, **kwargs: Any
    ):
        super().__init__(gcp_conn_id=gcp_conn_id, **kwargs)
        self._api_endpoint = api_endpoint

    @cached_property
    def api_endpoint(self) -> str | None:
        return self._api_endpoint or self._get_field("oslogin_api_endpoint") or None

    def get_conn(self) -> Any:
        from google.cloud.oslogin_v1 import OsLoginServiceClient

        if self._conn is None:
            options = {"api_endpoint": self.api_endpoint} if self.api_endpoint else None
            self._conn = OsLoginServiceClient(
                transport="rest", credentials=self.get_credentials(), client_options=options
            )
        return self._conn

    def account_email(self) -> str:
        """The e-mail of the account the connection's credentials belong to (whose profile gets the key)."""
        return self._get_credentials_email

    def import_key(self, user: str, public_key: str, expire_at: int, project_id: str) -> str:
        """Add ``public_key`` (``KEYTYPE BASE64``) to ``user``'s profile until ``expire_at`` (epoch seconds).

        Returns the profile's primary POSIX login, the name to log in to an OS Login VM as."""
        response = self.import_ssh_public_key(
            user=user,
            ssh_public_key={"key": public_key, "expiration_time_usec": int(expire_at) * 1_000_000},
            project_id=project_id,
        )
        accounts = list(response.login_profile.posix_accounts)
        primary = next(
            (account for account in accounts if account.primary), accounts[0] if accounts else None
        )
        if primary is None or not primary.username:
            raise ValueError(f"OS Login answered no POSIX account for {user}")
        return primary.username


class OsLoginKeyAsyncHook(GoogleBaseAsyncHook):
    """The triggerer's view: the sync client's calls run in a thread so the event loop never blocks."""

    sync_hook_class = OsLoginKeyHook

    async def account_email(self) -> str:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.account_email)

    async def import_key(self, user: str, public_key: str, expire_at: int, project_id: str) -> str:
        hook = await self.get_sync_hook()
        return await asyncio.to_thread(hook.import_key, user, public_key, expire_at, project_id)
