"""The OS Login side of the local Compute emulator: login profiles, their POSIX accounts and SSH keys.

What Google's OS Login does, and this follows (cloud.google.com/compute/docs/oslogin, the OS Login API v1
reference, and ../shared/reference/gce-tpu.md):

- ``users.importSshPublicKey`` (``POST /v1/users/{email}:importSshPublicKey``) adds a key, with an optional
  ``expirationTimeUsec``, to the caller's login profile and answers the profile; the profile's primary POSIX
  account is created on first use: ``sa_<numeric id>`` for a service account, the e-mail with its
  non-alphanumerics as ``_`` for a user;
- on a VM with ``enable-oslogin: TRUE`` sshd asks the metadata server for the login's keys
  (``/computeMetadata/v1/oslogin/users?username=``); metadata ``ssh-keys`` are ignored; an expired key is
  not served;
- an unknown login answers 404; a malformed key answers 400 INVALID_ARGUMENT.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import re
import threading
import time
from typing import Any

_EMAIL = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$")
_KEY_TYPES = ("ssh-ed25519", "ssh-rsa", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")


class OsLoginError(Exception):
    """An OS Login API error: HTTP status, canonical status name, message."""

    def __init__(self, code: int, status: str, message: str):
        super().__init__(message)
        self.code = code
        self.body = {"error": {"code": code, "message": message, "status": status}}


def posix_username(email: str) -> str:
    """The POSIX login OS Login derives for ``email``."""
    domain = email.partition("@")[2]
    if domain.endswith(".iam.gserviceaccount.com"):
        # A service account's login is sa_ and its 21-digit unique id; the id is stable per account.
        return "sa_1" + str(int(hashlib.sha256(email.encode()).hexdigest(), 16))[:20]
    return re.sub(r"[^a-z0-9]", "_", email.lower())[:32]


def _fingerprint(key: str) -> str:
    fields = key.split()
    if len(fields) < 2 or fields[0] not in _KEY_TYPES:
        raise OsLoginError(400, "INVALID_ARGUMENT", "Invalid key format.")
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (binascii.Error, ValueError):
        raise OsLoginError(400, "INVALID_ARGUMENT", "Invalid key format.") from None
    return hashlib.sha256(blob).hexdigest()


class OsLoginDirectory:
    """Login profiles by e-mail; thread-safe."""

    def __init__(self) -> None:
        self._profiles: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def import_key(self, email: str, body: dict[str, Any]) -> dict[str, Any]:
        """``users.importSshPublicKey``: the ImportSshPublicKeyResponse."""
        if not _EMAIL.fullmatch(email):
            raise OsLoginError(400, "INVALID_ARGUMENT", f"Invalid user: users/{email}")
        key = (body or {}).get("key", "")
        fingerprint = _fingerprint(key)
        expiration = (body or {}).get("expirationTimeUsec")
        if expiration is not None and not str(expiration).isdigit():
            raise OsLoginError(
                400, "INVALID_ARGUMENT", "Invalid value at 'ssh_public_key.expiration_time_usec'"
            )
        with self._lock:
            profile = self._profiles.setdefault(email, self._new_profile(email))
            entry = {
                "key": key,
                "fingerprint": fingerprint,
                "name": f"users/{email}/sshPublicKeys/{fingerprint}",
            }
            if expiration is not None:
                entry["expirationTimeUsec"] = str(expiration)
            profile["sshPublicKeys"][fingerprint] = entry
            return {"loginProfile": self._current(profile)}

    def login_profile(self, email: str) -> dict[str, Any]:
        """``users.getLoginProfile``."""
        with self._lock:
            profile = self._profiles.get(email)
            if profile is None:
                raise OsLoginError(404, "NOT_FOUND", f"User users/{email} not found.")
            return self._current(profile)

    def guest_profile(self, username: str) -> dict[str, Any]:
        """What the metadata server answers a VM's ``oslogin/users?username=``."""
        with self._lock:
            for profile in self._profiles.values():
                if profile["posixAccounts"][0]["username"] == username:
                    return {"loginProfiles": [self._current(profile)]}
        raise OsLoginError(404, "NOT_FOUND", f"User {username} not found.")

    def usernames(self) -> list[str]:
        with self._lock:
            return [profile["posixAccounts"][0]["username"] for profile in self._profiles.values()]

    @staticmethod
    def _new_profile(email: str) -> dict[str, Any]:
        username = posix_username(email)
        return {
            "name": email,
            "posixAccounts": [
                {
                    "primary": True,
                    "username": username,
                    "homeDirectory": f"/home/{username}",
                    "shell": "/bin/bash",
                    "operatingSystemType": "LINUX",
                    "accountId": "local-project",
                    "name": f"users/{email}/projects/local-project",
                }
            ],
            "sshPublicKeys": {},
        }

    @staticmethod
    def _current(profile: dict[str, Any]) -> dict[str, Any]:
        """The profile without its expired keys (OS Login stops serving a key once it expires)."""
        now_usec = int(time.time() * 1_000_000)
        current = copy.deepcopy(profile)
        current["sshPublicKeys"] = {
            fingerprint: entry
            for fingerprint, entry in profile["sshPublicKeys"].items()
            if int(entry.get("expirationTimeUsec") or now_usec + 1) > now_usec
        }
        return current
