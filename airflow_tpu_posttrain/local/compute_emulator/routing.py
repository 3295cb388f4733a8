"""How a request reaches its handler: Compute v1's REST paths, the emulator's admin paths, and the HTTP server.

Google's behaviour: Compute Engine v1's REST paths (``/compute/v1/projects/...``, each method's "HTTP request" in
https://cloud.google.com/compute/docs/reference/rest/v1; accepted with and without the ``/compute/v1`` prefix), JSON
bodies and Google's error body, a 401 for a request without a credential, and the transient 503 ``backendError`` and
429 ``rateLimitExceeded`` a client must retry (https://cloud.google.com/compute/api-quota). The metadata server's
text answers (403 without ``Metadata-Flavor: Google``:
https://cloud.google.com/compute/docs/metadata/querying-metadata) and the OAuth token endpoint's form body are
answered here too. ``/_emulator/`` is the emulator's own admin API (requests, faults, preemption, an instance's
status, reset), no Google behaviour.
"""

from __future__ import annotations

import json
import re
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from airflow_tpu_posttrain.local.compute_emulator import api
from airflow_tpu_posttrain.local.compute_emulator.metadata_server import GUEST_ATTRIBUTES_PATH, GUEST_PREFIX
from airflow_tpu_posttrain.local.iam import TOKEN_PATH, Unauthenticated

if TYPE_CHECKING:
    from airflow_tpu_posttrain.local.compute_emulator.emulator import ComputeEmulator


def compile_routes(emulator: ComputeEmulator) -> list[tuple[re.Pattern[str], dict[str, tuple[Any, str | None]]]]:
    """Each API path pattern with, per HTTP method, its handler and its kind of request for ``transient_errors``."""
    zonal = r"/projects/(?P<project>[^/]+)/zones/(?P<zone>[^/]+)"
    global_ = r"/projects/(?P<project>[^/]+)/global"
    regional = r"/projects/(?P<project>[^/]+)/regions/(?P<region>[^/]+)"
    # path pattern -> {HTTP method: (handler, kind of request for transient_errors)}
    routes = {
        f"{zonal}/instances": {
            "GET": (emulator._list_instances, "list"),
            "POST": (emulator._insert_instance, "insert"),
        },
        f"{zonal}/instances/(?P<name>[^/]+)": {
            "GET": (emulator._get_instance, "get"),
            "DELETE": (emulator._delete_instance, "delete"),
        },
        f"{zonal}/instances/(?P<name>[^/]+)/getGuestAttributes": {
            "GET": (emulator._get_guest_attributes, "get"),
        },
        f"{global_}/networks/(?P<name>[^/]+)": {"GET": (emulator._get_network, None)},
        f"{regional}/subnetworks/(?P<name>[^/]+)": {"GET": (emulator._get_subnetwork, None)},
        f"{regional}/routers": {"GET": (emulator._list_routers, "list")},
        f"{zonal}/operations/(?P<name>[^/]+)": {"GET": (emulator._get_operation, "operation")},
        f"{zonal}/operations/(?P<name>[^/]+)/wait": {"POST": (emulator._wait_operation, "operation")},
        f"{global_}/operations/(?P<name>[^/]+)": {"GET": (emulator._get_operation, "operation")},
        f"{global_}/operations/(?P<name>[^/]+)/wait": {"POST": (emulator._wait_operation, "operation")},
        f"{regional}/operations/(?P<name>[^/]+)": {"GET": (emulator._get_operation, "operation")},
        f"{regional}/operations/(?P<name>[^/]+)/wait": {"POST": (emulator._wait_operation, "operation")},
        f"{zonal}/reservations/(?P<name>[^/]+)": {"GET": (emulator._get_reservation, "get")},
        f"{global_}/firewalls": {
            "GET": (emulator._list_firewalls, "list"),
            "POST": (emulator._insert_firewall, None),
        },
        f"{regional}/resourcePolicies": {
            "GET": (emulator._list_resource_policies, None),
            "POST": (emulator._insert_resource_policy, None),
        },
        f"{regional}/resourcePolicies/(?P<name>[^/]+)": {
            "GET": (emulator._get_resource_policy, None),
            "DELETE": (emulator._delete_resource_policy, None),
        },
        f"{global_}/instanceTemplates": {
            "GET": (emulator._list_instance_templates, None),
            "POST": (emulator._insert_instance_template, None),
        },
        f"{global_}/instanceTemplates/(?P<name>[^/]+)": {
            "GET": (emulator._get_instance_template, None),
            "DELETE": (emulator._delete_instance_template, None),
        },
        f"{zonal}/instanceGroupManagers": {
            "GET": (emulator._list_groups, "list"),
            "POST": (emulator._insert_group, "insert"),
        },
        f"{zonal}/instanceGroupManagers/(?P<name>[^/]+)": {
            "GET": (emulator._get_group, "get"),
            "DELETE": (emulator._delete_group, "delete"),
        },
        f"{zonal}/instanceGroupManagers/(?P<name>[^/]+)/listManagedInstances": {
            "POST": (emulator._list_managed_instances, "list"),
        },
        r"/projects/(?P<project>[^/]+)/aggregated/instances": {
            "GET": (emulator._aggregated_instances, "list")
        },
        r"/projects/(?P<project>[^/]+)/aggregated/instanceGroupManagers": {
            "GET": (emulator._aggregated_groups, "list")
        },
        r"/projects/(?P<project>[^/]+)/aggregated/resourcePolicies": {
            "GET": (emulator._aggregated_resource_policies, "list")
        },
        f"{global_}/firewalls/(?P<name>[^/]+)": {
            "GET": (emulator._get_firewall, None),
            "DELETE": (emulator._delete_firewall, None),
        },
        # OS Login API v1 (oslogin.googleapis.com), and its metadata-server side that a VM's sshd asks.
        r"/v1/users/(?P<user>[^/:]+):importSshPublicKey": {"POST": (emulator._import_ssh_public_key, None)},
        r"/v1/users/(?P<user>[^/:]+)/loginProfile": {"GET": (emulator._get_login_profile, None)},
        GUEST_PREFIX + "users": {"GET": (emulator._guest_oslogin_user, None)},
        GUEST_PREFIX + "authorize": {"GET": (emulator._guest_oslogin_authorize, None)},
        # IAP (iap.googleapis.com v1): what the stand-in IAP tunnel asks before it connects.
        r"/v1/projects/(?P<project>[^/]+)/iap_tunnel/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/:]+)"
        r":testIamPermissions": {"POST": (emulator._test_iap_permissions, None)},
        # IAM Credentials API v1 (iamcredentials.googleapis.com): impersonation, as gcloud's
        # --impersonate-service-account asks it.
        r"/v1/projects/-/serviceAccounts/(?P<email>[^/:]+):generateAccessToken": {
            "POST": (emulator._generate_access_token, None)
        },
    }
    return [(re.compile(pattern), methods) for pattern, methods in routes.items()]


class RoutingMixin:
    """Dispatch (``_routes``), the transient errors served (``_transient_served``) and the admin API."""

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, authorization: str | None = None
    ) -> tuple[int, Any]:
        """Answer one HTTP request; returns (status, JSON payload).

        Every API request must carry a service account's credential (``authorization``); the admin paths and
        the VMs' metadata server do not."""
        try:
            if path.startswith("/_emulator/"):
                return self._handle_admin(method, path, body)
            if not path.startswith("/_vm/"):
                self._request.caller = self.iam.caller(authorization)
            return self._handle_api(method, path, query, body)
        except Unauthenticated as error:
            return 401, error.body
        except api.ApiError as error:
            return error.status, error.body

    def _handle_api(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        with self._lock:
            self._requests.append({"method": method, "path": path, "query": query, "body": body})
        api_path = path.removeprefix("/compute/v1")
        for pattern, methods in self._routes:
            match = pattern.fullmatch(api_path)
            if not match:
                continue
            if method not in methods:
                raise api.ApiError(405, "httpMethodNotAllowed", f"Method {method} not allowed on {path}")
            handler, transient_kind = methods[method]
            if transient_kind:
                self._maybe_fail_transiently(transient_kind)
            return handler(query, body or {}, **match.groupdict())
        raise api.ApiError(404, "notFound", f"No such API path: {path}")

    def _maybe_fail_transiently(self, kind: str) -> None:
        """Raise 503 backendError and 429 rateLimitExceeded alternately while the kind's count lasts."""
        with self._lock:
            if self._faults.transient_errors.get(kind, 0) <= 0:
                return
            self._faults.transient_errors[kind] -= 1
            served = self._transient_served.get(kind, 0)
            self._transient_served[kind] = served + 1
        if served % 2 == 0:
            raise api.ApiError(503, "backendError", "Backend Error")
        raise api.ApiError(429, "rateLimitExceeded", "Rate Limit Exceeded", domain="usageLimits")

    def _handle_admin(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) == ("GET", "/_emulator/requests"):
            return 200, self.requests
        if (method, path) == ("GET", "/_emulator/instances"):
            return 200, self.instances()
        if (method, path) == ("GET", "/_emulator/faults"):
            return 200, self.faults
        if (method, path) == ("POST", "/_emulator/faults"):
            try:
                self.set_faults(**(body or {}))
            except (TypeError, ValueError) as error:
                raise api.ApiError(400, "invalid", str(error)) from error
            return 200, self.faults
        if (method, path) == ("POST", "/_emulator/reset"):
            self.reset()
            return 200, {}
        match = re.fullmatch(r"/_emulator/instances/([^/]+)/([^/]+)/preempt", path)
        if method == "POST" and match:
            try:
                self.preempt(*match.groups(), project=(body or {}).get("project"))
            except KeyError as error:
                raise api.ApiError(404, "notFound", str(error)) from error
            except ValueError as error:
                raise api.ApiError(400, "invalid", str(error)) from error
            return 200, {}
        match = re.fullmatch(r"/_emulator/instances/([^/]+)/([^/]+)/status", path)
        if method == "POST" and match:
            body = body or {}
            if "status" not in body:
                raise api.ApiError(400, "required", 'Send {"status": "TERMINATED"} (optionally with "project")')
            try:
                self.set_instance_status(*match.groups(), body["status"], project=body.get("project"))
            except KeyError as error:
                raise api.ApiError(404, "notFound", str(error)) from error
            return 200, {}
        raise api.ApiError(404, "notFound", f"No such emulator endpoint: {method} {path}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the google clients expect

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw_body = self.rfile.read(length) if length else b""
        if (method, url.path) == ("POST", TOKEN_PATH):  # form-encoded, as OAuth 2.0 token requests are
            self._answer(*self.server.emulator.token(dict(parse_qsl(raw_body.decode()))))
            return
        if method == "GET" and url.path.startswith(GUEST_ATTRIBUTES_PATH):
            self._answer_guest(url.path.removeprefix(GUEST_ATTRIBUTES_PATH))
            return
        try:
            body = json.loads(raw_body) if raw_body else None
        except json.JSONDecodeError:
            status, payload = 400, api.ApiError(400, "parseError", "Parse Error").body
        else:
            status, payload = self.server.emulator.handle(
                method, url.path, dict(parse_qsl(url.query)), body, self.headers.get("Authorization")
            )
        self._answer(status, payload)

    def _answer_guest(self, key: str) -> None:
        """The metadata server's text answer: 403 without ``Metadata-Flavor: Google``, as Google's refuses it."""
        if self.headers.get("Metadata-Flavor") != "Google":
            status, text = 403, "Missing Metadata-Flavor:Google header.\n"
        else:
            value = self.server.emulator.guest_attribute(self.client_address[0], key)
            status, text = (404, "Not Found\n") if value is None else (200, value)
        data = text.encode()
        self.send_response(status)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", "application/text")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request access log; requests are recorded in ``ComputeEmulator.requests``."""
