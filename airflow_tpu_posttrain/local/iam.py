"""Who calls the local Compute emulator: service accounts, their keys, their roles, and the credentials they send.

What Google does, and this follows:

- a service account key (``gcloud iam service-accounts keys create``) is a JSON file with an RSA private key,
  its ``private_key_id``, ``client_email`` and ``token_uri``; google-auth turns it into a bearer credential in
  one of two ways (google.oauth2.service_account, AIP-4111): a self-signed JWT (RS256, ``kid`` = the key id,
  ``iss`` = ``sub`` = the account) sent as the bearer token, as Google's API clients do, or an access token
  from the OAuth 2.0 JWT bearer grant at ``token_uri`` (RFC 7523), as plain google-auth sessions do;
- a request without credentials is answered 401 UNAUTHENTICATED, a bad or expired one 401 too
  (cloud.google.com/apis/design/errors); a refused grant 400 ``invalid_grant``;
- what a caller may do comes from the roles granted to it on the project
  (``gcloud projects add-iam-policy-binding``): OS Login's login needs ``roles/compute.osLogin`` or
  ``roles/compute.osAdminLogin`` (sudo), an IAP tunnel ``roles/iap.tunnelResourceAccessor``.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

OS_LOGIN = "roles/compute.osLogin"
OS_ADMIN_LOGIN = "roles/compute.osAdminLogin"
IAP_TUNNEL_USER = "roles/iap.tunnelResourceAccessor"
TOKEN_CREATOR = "roles/iam.serviceAccountTokenCreator"  # impersonation: another account's access token
# What each role used here lets a caller do (the permissions of Google's predefined roles that are asked for).
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    OS_LOGIN: frozenset({"compute.instances.osLogin"}),
    OS_ADMIN_LOGIN: frozenset({"compute.instances.osLogin", "compute.instances.osAdminLogin"}),
    IAP_TUNNEL_USER: frozenset({"iap.tunnelInstances.accessViaIAP"}),
    "roles/compute.instanceAdmin.v1": frozenset(),
    TOKEN_CREATOR: frozenset({"iam.serviceAccounts.getAccessToken"}),
}
TOKEN_PATH = "/token"
_TOKEN_SECONDS = 3600
_JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
# The audience a grant's assertion names: Google's token endpoint, whatever token_uri it is sent to (google-auth's
# service_account._make_authorization_grant_assertion).
_GRANT_AUDIENCE = "https://oauth2.googleapis.com/token"
_MISSING = (
    "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other "
    "valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project."
)
_INVALID = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login cookie or other valid "
    "authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project."
)


class Unauthenticated(Exception):
    """No credential, or one that is not valid: Google's 401 body."""

    def __init__(self, missing: bool):
        message = _MISSING if missing else _INVALID
        super().__init__(message)
        self.body = {
            "error": {
                "code": 401,
                "message": message,
                "errors": [
                    {
                        "message": "Login Required." if missing else "Invalid Credentials",
                        "domain": "global",
                        "reason": "required" if missing else "authError",
                        "location": "Authorization",
                        "locationType": "header",
                    }
                ],
                "status": "UNAUTHENTICATED",
            }
        }


class GrantRefused(Exception):
    """The token endpoint's 400 (RFC 6749 section 5.2)."""

    def __init__(self, description: str):
        super().__init__(description)
        self.body = {"error": "invalid_grant", "error_description": description}


@dataclass
class _Account:
    email: str
    public_keys: dict[str, str] = field(default_factory=dict)  # private_key_id -> PEM public key


class LocalIam:
    """Service accounts with keys, role grants per project, and the access tokens issued. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accounts: dict[str, _Account] = {}
        self._grants: dict[tuple[str, str], set[str]] = {}  # (project, member e-mail) -> roles
        self._tokens: dict[str, tuple[str, float]] = {}  # access token -> (e-mail, expiry)

    def create_key(self, email: str, project: str, token_uri: str) -> dict[str, Any]:
        """A new key of service account ``email`` (made on first use), as the key file Google hands out."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key_id = secrets.token_hex(20)
        public_pem = private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        with self._lock:
            account = self._accounts.setdefault(email, _Account(email))
            account.public_keys[key_id] = public_pem.decode()
        return {
            "type": "service_account",
            "project_id": project,
            "private_key_id": key_id,
            "private_key": private.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ).decode(),
            "client_email": email,
            "client_id": str(int.from_bytes(email.encode()[:8], "big")),
            "token_uri": token_uri,
        }

    def grant(self, project: str, email: str, *roles: str) -> None:
        unknown = set(roles) - set(ROLE_PERMISSIONS)
        if unknown:
            raise ValueError(f"roles not modelled: {sorted(unknown)}")
        with self._lock:
            self._grants.setdefault((project, email), set()).update(roles)

    def revoke(self, project: str, email: str, *roles: str) -> None:
        with self._lock:
            self._grants.get((project, email), set()).difference_update(roles)

    def permitted(self, project: str, email: str, permission: str) -> bool:
        with self._lock:
            roles = set(self._grants.get((project, email), ()))
        return any(permission in ROLE_PERMISSIONS[role] for role in roles)

    def exchange(self, form: dict[str, str]) -> dict[str, Any]:
        """The JWT bearer grant: an access token for the account whose key signed ``assertion``."""
        if form.get("grant_type") != _JWT_BEARER or not form.get("assertion"):
            raise GrantRefused("Invalid grant_type or missing assertion.")
        try:
            email = self._verify(form["assertion"], audience=_GRANT_AUDIENCE)
        except ValueError as err:
            raise GrantRefused(f"Invalid JWT: {err}") from None
        token = "ya29.local-" + secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = (email, time.time() + _TOKEN_SECONDS)
        return {"access_token": token, "expires_in": _TOKEN_SECONDS, "token_type": "Bearer"}

    def impersonate(self, caller: str, target: str, delegates: list[str]) -> dict[str, Any] | None:
        """IAM Credentials' ``generateAccessToken``: a token of ``target`` for ``caller``; None if refused.

        Each account of the chain (the caller, then each delegate) needs iam.serviceAccounts.getAccessToken on
        the next one, here granted on the next account's project (a service account's e-mail names it)."""
        chain = [caller, *delegates, target]
        for account, impersonated in zip(chain, chain[1:], strict=False):
            project = impersonated.partition("@")[2].removesuffix(".iam.gserviceaccount.com")
            if impersonated not in self._accounts or not self.permitted(
                project, account, "iam.serviceAccounts.getAccessToken"
            ):
                return None
        token = "ya29.local-" + secrets.token_urlsafe(32)
        expiry = time.time() + _TOKEN_SECONDS
        with self._lock:
            self._tokens[token] = (target, expiry)
        return {"accessToken": token, "expireTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expiry))}

    def caller(self, authorization: str | None) -> str:
        """The e-mail of the account a request's ``Authorization`` header speaks for, or :class:`Unauthenticated`."""
        scheme, _, credential = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not credential.strip():
            raise Unauthenticated(missing=True)
        credential = credential.strip()
        with self._lock:
            issued = self._tokens.get(credential)
        if issued is not None:
            email, expiry = issued
            if expiry > time.time():
                return email
            raise Unauthenticated(missing=False)
        try:
            return self._verify(credential, audience=None)  # a self-signed JWT (AIP-4111)
        except ValueError:
            raise Unauthenticated(missing=False) from None

    def _verify(self, assertion: str, audience: str | None) -> str:
        """The account that signed the JWT ``assertion`` with one of its keys (ValueError if none did)."""
        from google.auth import jwt

        header = jwt.decode_header(assertion)
        with self._lock:
            certs = {
                key_id: pem for account in self._accounts.values() for key_id, pem in account.public_keys.items()
            }
            owners = {
                key_id: account.email
                for account in self._accounts.values()
                for key_id in account.public_keys
            }
        key_id = header.get("kid")
        if key_id not in certs:
            raise ValueError("signed by an unknown key")
        # A self-signed JWT names its API (aud) or carries scopes instead; the grant's aud is the token URI.
        claims = jwt.decode(assertion, certs={key_id: certs[key_id]}, verify=True, audience=audience)
        if claims.get("iss") != owners[key_id]:
            raise ValueError("issuer is not the key's account")
        return owners[key_id]
