"""How Airflow reaches a fresh VM over SSH: the key it installs, the host keys it pins, the address it dials.

Pure. What Compute Engine does, and which this module follows (../shared/reference/gce-tpu.md, "Reaching a fresh
VM over SSH"):

- a VM accepts only keys in its ``ssh-keys`` metadata (``LOGIN:KEYTYPE KEY google-ssh {"userName": ...,
  "expireOn": ...}``; the guest agent drops expired keys) — cloud.google.com/compute/docs/connect/add-ssh-keys;
- with ``enable-oslogin: TRUE`` the VM ignores ``ssh-keys`` and accepts the keys of the caller's OS Login profile
  (``users.importSshPublicKey``, with an expiry), as the POSIX login OS Login answers —
  cloud.google.com/compute/docs/oslogin/manage-oslogin-in-an-org (``compute.requireOsLogin`` enforces it);
- with ``enable-guest-attributes: TRUE`` the guest environment publishes the VM's host keys as guest attributes
  under ``hostkeys/`` (``instances.getGuestAttributes``), which is what ``gcloud compute ssh`` pins —
  cloud.google.com/compute/docs/metadata/manage-guest-attributes;
- a VM is reached on its internal IP from inside the VPC, on its external IP through a firewall rule that
  admits the client's egress ranges, or through IAP's TCP forwarding (``gcloud compute start-iap-tunnel
  NAME 22 --listen-on-stdin`` as the SSH ProxyCommand, as providers-google's ``ComputeEngineSSHHook`` and
  ``gcloud compute ssh --tunnel-through-iap`` do) with a firewall rule admitting IAP's range 35.235.240.0/20 —
  cloud.google.com/iap/docs/using-tcp-forwarding.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import re
import shlex
from collections.abc import Sequence
from datetime import UTC, datetime

from airflow_tpu_posttrain.recipes.validation import SpecError

NETWORK_PATHS = ("internal", "external", "iap")
IAP_SOURCE_RANGE = "35.235.240.0/20"  # where IAP's TCP forwarding connects from
KEY_MODES = ("metadata", "oslogin")
SSH_PORT = 22
HOST_KEY_NAMESPACE = "hostkeys"
# Host key types a client can pin, in order of preference (what the guest environment publishes).
HOST_KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ssh-rsa")
CLIENT_KEY_TYPES = (*HOST_KEY_TYPES, "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")
_LOGIN = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_EMAIL = re.compile(r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}$")


def login(field: str, value: str | None) -> str:
    """The POSIX login the VM's guest agent creates from ``ssh-keys``; root is refused by the VM's sshd."""
    if not value or not _LOGIN.fullmatch(value):
        raise SpecError(
            field, value, "is not a POSIX login name", "set the SSH connection's login, e.g. 'airflow'"
        )
    if value == "root":
        raise SpecError(
            field, value, "is refused by the VM (root logins are off)", "use a plain login such as 'airflow'"
        )
    return value


def public_key(field: str, value: str) -> str:
    """An OpenSSH public key ``KEYTYPE BASE64``, the comment dropped (it would land in the VM's metadata)."""
    parts = (value or "").split()
    if len(parts) < 2 or parts[0] not in CLIENT_KEY_TYPES or not _BASE64.fullmatch(parts[1]):
        raise SpecError(
            field,
            "<public key>",
            "is not an OpenSSH public key",
            f"use a key of type {list(CLIENT_KEY_TYPES)}",
        )
    return f"{parts[0]} {parts[1]}"


def ssh_keys_metadata(user: str, key: str, expire_at: int) -> str:
    """The ``ssh-keys`` metadata line for ``user``'s public ``key``, expiring with the VM."""
    expire_on = datetime.fromtimestamp(expire_at, UTC).strftime("%Y-%m-%dT%H:%M:%S+0000")
    details = json.dumps({"userName": user, "expireOn": expire_on}, separators=(",", ":"))
    return f"{login('ssh login', user)}:{public_key('ssh public key', key)} google-ssh {details}"


def oslogin_user(field: str, value: str) -> str:
    """The Google account (user or service account e-mail) whose OS Login profile gets the key."""
    if not value or not _EMAIL.fullmatch(value):
        raise SpecError(
            field,
            value,
            "is not a Google account e-mail",
            "use the e-mail of the account the Google Cloud connection uses, e.g. "
            "'airflow@my-project.iam.gserviceaccount.com'",
        )
    return value


def source_ranges(field: str, ranges: tuple[str, ...]) -> tuple[str, ...]:
    for i, cidr in enumerate(ranges):
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError as err:
            raise SpecError(
                f"{field}[{i}]", cidr, f"is not a CIDR range ({err})", "use e.g. '203.0.113.0/24'"
            ) from None
    return ranges


def host_keys_from_guest_attributes(response: dict | None) -> dict[str, str]:
    """``{key type: base64}`` from an ``instances.getGuestAttributes?queryPath=hostkeys/`` answer."""
    items = ((response or {}).get("queryValue") or {}).get("items") or []
    keys = {}
    for item in items:
        key_type, value = item.get("key", ""), (item.get("value") or "").strip()
        if item.get("namespace") != HOST_KEY_NAMESPACE or key_type not in HOST_KEY_TYPES:
            continue
        value = value.split()[-1] if value else value  # "ssh-ed25519 AAAA..." or "AAAA..."
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        keys[key_type] = value
    return keys


def known_hosts(address: str, port: int, host_keys: dict[str, str]) -> str:
    """known_hosts lines pinning ``host_keys`` for ``address:port`` (OpenSSH's ``[host]:port`` off port 22)."""
    host = address if port == SSH_PORT else f"[{address}]:{port}"
    return "".join(f"{host} {key_type} {host_keys[key_type]}\n" for key_type in sorted(host_keys))


def iap_proxy_command(project: str, zone: str, name: str, port: int = SSH_PORT) -> str:
    """The SSH ProxyCommand that reaches the VM's ``port`` through IAP.

    The caller needs roles/iap.tunnelResourceAccessor."""
    argv = [
        "gcloud", "compute", "start-iap-tunnel", name, str(port), "--listen-on-stdin",
        f"--project={project}", f"--zone={zone}", "--verbosity=warning",
    ]  # fmt: skip
    return " ".join(shlex.quote(arg) for arg in argv)


# gcloud's auth/credential_file_override property ("a path to a credential file ... to use instead of the active
# account's": cloud.google.com/sdk/gcloud/reference/config/set), set for one gcloud process.
GCLOUD_CREDENTIAL_FILE_VARIABLE = "CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE"


def iap_proxy_command_as(proxy_command: str, key_file: str | None, impersonation_chain: Sequence[str] = ()) -> str:
    """``proxy_command`` (gcloud's IAP tunnel) run as the Airflow Google connection's identity.

    As providers-google's ComputeEngineSSHHook does: the connection's service account key as gcloud's credential
    and its impersonation chain as ``--impersonate-service-account``. Without a key file (the connection uses
    Application Default Credentials) gcloud keeps its own account: on Google Cloud, the machine's service
    account."""
    command = proxy_command
    if impersonation_chain:
        command += " " + shlex.quote(f"--impersonate-service-account={','.join(impersonation_chain)}")
    if key_file:
        command = f"env {GCLOUD_CREDENTIAL_FILE_VARIABLE}={shlex.quote(key_file)} {command}"
    return command


def ssh_address(instance: dict, network_path: str) -> str | None:
    """The address Airflow dials: the internal IP or the external IP.

    The internal IP is dialled from inside the VPC, or is the host name the IAP tunnel stands for."""
    interface = (instance.get("networkInterfaces") or [{}])[0]
    if network_path == "external":
        return ((interface.get("accessConfigs") or [{}])[0]).get("natIP")
    return interface.get("networkIP")
