"""The guest side of Compute Engine: each VM's metadata server, and the guest attributes its guest writes.

Google's behaviour: the metadata server at ``http://metadata.google.internal/computeMetadata/v1/`` answers a VM about
itself (``instance/attributes/<key>``, text, only with ``Metadata-Flavor: Google``:
https://cloud.google.com/compute/docs/metadata/querying-metadata) and answers OS Login's lookups from the VM's sshd
(https://cloud.google.com/compute/docs/oslogin); ``instances.getGuestAttributes``
(https://cloud.google.com/compute/docs/reference/rest/v1/instances/getGuestAttributes) serves what the guest wrote,
its SSH host keys under ``hostkeys/``, only with ``enable-guest-attributes`` TRUE
(https://cloud.google.com/compute/docs/metadata/manage-guest-attributes).

What the real ``getGuestAttributes`` answers before anything is published, or with guest attributes off, is not
documented; this emulator answers 404 and 400 respectively, and the provider treats both as "none yet". Without a
fleet no instance ever publishes host keys (an image without Google's guest environment).
"""

from __future__ import annotations

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.oslogin import OsLoginError

GUEST_OSLOGIN_PATH = "/computeMetadata/v1/oslogin/"
"""Where a local VM's sshd looks up OS Login keys, as a real one asks its metadata server (under
``/_vm/<project>``: the metadata server knows the VM's project, which the login's authorization is asked in)."""
GUEST_PREFIX = r"/_vm/(?P<project>[^/]+)" + GUEST_OSLOGIN_PATH
GUEST_ATTRIBUTES_PATH = "/computeMetadata/v1/instance/attributes/"
"""The metadata server's view of the asking VM's own metadata (cloud.google.com/compute/docs/metadata/querying-
metadata: ``instance/attributes/<key>``, text, only with ``Metadata-Flavor: Google``). The VM is known by the
address it asks from, as Google's metadata server knows it; a local VM reaches it at ``metadata.google.internal``
(local/vpc.py routes 169.254.169.254:80 there)."""


def _impostor_key(key_type: str) -> str:
    """A well-formed public key of ``key_type`` that belongs to no VM."""
    import subprocess
    import tempfile
    from pathlib import Path

    kinds = {"ssh-ed25519": ["-t", "ed25519"], "ssh-rsa": ["-t", "rsa", "-b", "2048"]}
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "key"
        argv = kinds.get(key_type, ["-t", "ecdsa", "-b", "256"])
        subprocess.run(["ssh-keygen", "-q", *argv, "-N", "", "-f", str(path)], check=True)
        return path.with_suffix(".pub").read_text().split()[1]


class MetadataServerMixin:
    """What each instance's metadata server serves it, and the guest attributes its guest environment published."""

    def guest_oslogin_url(self, project: str) -> str:
        """Where the sshd of a VM of ``project`` asks for OS Login keys (its metadata server's OS Login)."""
        return f"http://{vpc.GATEWAY}:{self._server.server_address[1]}/_vm/{project}{GUEST_OSLOGIN_PATH}"

    def guest_attribute(self, address: str, key: str) -> str | None:
        """``instance/attributes/<key>`` as the metadata server answers the VM at ``address``; None: 404."""
        with self._lock:
            for instance_key, instance in self._instances.items():
                if (instance.get("networkInterfaces") or [{}])[0].get("networkIP") == address:
                    return self.guest_attributes(instance_key).get(key)
        return None

    def guest_attributes(self, key: tuple[str, str, str]) -> dict[str, str]:
        """What the metadata server of instance ``key`` (project, zone, name) serves under ``instance/attributes/``.

        The instance's own metadata items and, for a VM of a slice, its ``worker-id``: the one place this
        emulator shows a slice VM's worker id (Google documents none in ``instances.get`` for MIG-made TPU VMs)."""
        with self._lock:
            instance = self._instances.get(key) or {}
            items = {item["key"]: item.get("value", "") for item in (instance.get("metadata") or {}).get("items", [])}
            group = self._slice_group(key)
            if group is not None and group.members[key[2]] is not None and not self._faults.no_worker_id_metadata:
                items["worker-id"] = str(group.members[key[2]])
            return items

    def _guest_oslogin_user(self, query: dict, body: dict, project: str):
        try:
            return 200, self.oslogin.guest_profile(query.get("username", ""))
        except OsLoginError as error:
            return error.code, error.body

    def _guest_oslogin_authorize(self, query: dict, body: dict, project: str):
        """Whether the account may log in (``policy=login``) or log in with sudo (``adminLogin``) on the VM."""
        permission = {"login": "compute.instances.osLogin", "adminLogin": "compute.instances.osAdminLogin"}.get(
            query.get("policy", "")
        )
        if permission is None:
            raise api.ApiError(400, "invalid", "policy must be login or adminLogin")
        return 200, {"success": self.iam.permitted(project, query.get("email", ""), permission)}

    def _get_guest_attributes(self, query: dict, body: dict, project: str, zone: str, name: str):
        """``hostkeys/`` as the guest environment publishes it: only once booted, only when enabled."""
        with self._lock:
            self._advance()
            key = (project, zone, name)
            instance = self._instances.get(key)
            path = api.resource_path(project, zone, "instances", name)
            if instance is None:
                raise api.not_found(path)
            enabled = any(
                item.get("key") == "enable-guest-attributes" and str(item.get("value", "")).upper() == "TRUE"
                for item in (instance.get("metadata") or {}).get("items", [])
            )
        if not enabled:
            raise api.ApiError(400, "badRequest", f"Guest attributes are not enabled for '{path}'.")
        query_path = query.get("queryPath", "")
        published = (
            self.fleet.guest_attributes(key) if self.fleet and not self._faults.no_guest_environment else []
        )
        if published and self._faults.impostor_host_keys:
            published = [{**item, "value": _impostor_key(item["key"])} for item in published]
        items = [item for item in published if f"{item['namespace']}/{item['key']}".startswith(query_path)]
        if not items:
            raise api.not_found(f"{path}/guestAttributes/{query_path}")
        return 200, {
            "kind": "compute#guestAttributes",
            "queryPath": query_path,
            "queryValue": {"items": items},
            "selfLink": f"{api.API_ROOT}/{path}/guestAttributes/{query_path}",
        }
