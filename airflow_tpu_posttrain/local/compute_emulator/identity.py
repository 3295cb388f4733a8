"""The Google APIs beside Compute that the provider's SSH path asks: OS Login, IAP, IAM Credentials, OAuth 2.0.

Google's behaviour: the OS Login API's ``users.importSshPublicKey`` and ``users.getLoginProfile``, on the caller's
own profile only (https://cloud.google.com/compute/docs/oslogin/rest), IAP's ``testIamPermissions`` on a tunnel
instance (https://cloud.google.com/iap/docs/reference/rest), IAM Credentials' ``generateAccessToken`` for
impersonation
(https://cloud.google.com/iam/docs/reference/credentials/rest/v1/projects.serviceAccounts/generateAccessToken), and
the OAuth 2.0 token endpoint where a service account key's signed JWT is exchanged for a token
(https://developers.google.com/identity/protocols/oauth2/service-account). Who holds which role is
``local/iam.py``'s; the OS Login directory ``local/oslogin.py``'s.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.iam import TOKEN_PATH, GrantRefused
from airflow_tpu_posttrain.local.oslogin import OsLoginError


class IdentityMixin:
    """Service accounts' keys and tokens (``iam``), OS Login profiles (``oslogin``), IAP's permission check."""

    def service_account_key(self, email: str, *roles: str, project: str) -> dict[str, Any]:
        """A new key file of service account ``email``, granted ``roles`` on ``project``."""
        self.iam.grant(project, email, *roles)
        return self.iam.create_key(email, project, self.url + TOKEN_PATH)

    def token(self, form: dict[str, str]) -> tuple[int, Any]:
        """The OAuth 2.0 token endpoint (the key files' ``token_uri``)."""
        try:
            return 200, self.iam.exchange(form)
        except GrantRefused as error:
            return 400, error.body

    def _own_profile(self, user: str) -> str:
        """``user``'s e-mail if it is the caller's: a caller reads and changes its own login profile only."""
        email = unquote(user)
        if email != self._request.caller:
            raise api.ApiError(
                403, "forbidden", "The caller does not have permission", status_name="PERMISSION_DENIED"
            )
        return email

    def _import_ssh_public_key(self, query: dict, body: dict, user: str):
        try:
            return 200, self.oslogin.import_key(self._own_profile(user), body)
        except OsLoginError as error:
            return error.code, error.body

    def _get_login_profile(self, query: dict, body: dict, user: str):
        try:
            return 200, self.oslogin.login_profile(self._own_profile(user))
        except OsLoginError as error:
            return error.code, error.body

    def _test_iap_permissions(self, query: dict, body: dict, project: str, zone: str, name: str):
        """IAP's ``testIamPermissions`` on a tunnel instance: those of ``permissions`` the caller holds."""
        asked = body.get("permissions") or []
        held = [p for p in asked if self.iam.permitted(project, self._request.caller, p)]
        return 200, {"permissions": held} if held else {}

    def _generate_access_token(self, query: dict, body: dict, email: str):
        delegates = [delegate.rsplit("/", 1)[-1] for delegate in body.get("delegates") or []]
        token = self.iam.impersonate(self._request.caller, unquote(email), delegates)
        if token is None:  # Google's answer whether the account is missing or the permission is
            raise api.ApiError(
                403,
                "forbidden",
                "Permission 'iam.serviceAccounts.getAccessToken' denied on resource (or it may not exist).",
                status_name="PERMISSION_DENIED",
            )
        return 200, token
