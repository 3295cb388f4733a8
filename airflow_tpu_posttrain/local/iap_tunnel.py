"""The local stand-in for ``gcloud compute start-iap-tunnel NAME PORT --listen-on-stdin``.

It is the SSH ProxyCommand of the ``iap`` network path, run as ``gcloud`` from the local stack's ``bin``
directory.

What IAP's TCP forwarding does, and this follows (cloud.google.com/iap/docs/using-tcp-forwarding): it connects
from 35.235.240.0/20 to the instance's internal IP, so it reaches the port only if an ingress firewall rule of
the instance's network admits that range on that port for the instance (all instances, or one of its network
tags) and no deny rule of a higher or equal priority refuses it; else the tunnel fails with ``4003: 'failed to connect to backend'``; an instance that does not exist or
is not RUNNING fails the same way. The instance and the rules are read from the Compute API at
``CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE`` (gcloud's own endpoint override) as gcloud's account: the service
account key of ``CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE`` (gcloud's ``auth/credential_file_override``), whose
access token comes from the key's ``token_uri``; without one gcloud has no active account. IAP lets the account
through only with ``iap.tunnelInstances.accessViaIAP`` on the instance (roles/iap.tunnelResourceAccessor), else
``4033: 'not authorized'``; asked here of the emulator's IAP ``testIamPermissions``. With
``--impersonate-service-account`` the tunnel's account is the impersonated one: its token is asked of the IAM
Credentials API (``generateAccessToken``, which needs roles/iam.serviceAccountTokenCreator).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading
import urllib.error
import urllib.request

IAP_RANGE = ipaddress.ip_network("35.235.240.0/20")
ENDPOINT_VARIABLE = "CLOUDSDK_API_ENDPOINT_OVERRIDES_COMPUTE"
CREDENTIAL_FILE_VARIABLE = "CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE"
_TUNNEL_PERMISSION = "iap.tunnelInstances.accessViaIAP"


class TunnelError(Exception):
    pass


def impersonated_token(iam_root: str, token: str, chain: list[str]) -> str:
    """``--impersonate-service-account=A[,B...]``: an access token of the chain's last account.

    Asked of the IAM Credentials API as gcloud's account, through the others as delegates (as gcloud does)."""
    *delegates, target = chain
    body = {
        "scope": ["https://www.googleapis.com/auth/cloud-platform"],
        "delegates": [f"projects/-/serviceAccounts/{delegate}" for delegate in delegates],
    }
    try:
        answer = _call(f"{iam_root}/v1/projects/-/serviceAccounts/{target}:generateAccessToken", token, body)
    except urllib.error.HTTPError:
        answer = None
    if not answer:
        raise TunnelError(
            f"Failed to impersonate [{target}]. Make sure the account that's trying to impersonate it has access to "
            'the service account itself and the "roles/iam.serviceAccountTokenCreator" role.'
        )
    return answer["accessToken"]


def access_token() -> str:
    """An access token of gcloud's account (the key file's service account), from the key's ``token_uri``."""
    key_file = os.environ.get(CREDENTIAL_FILE_VARIABLE)
    if not key_file:
        raise TunnelError(
            "You do not currently have an active account selected. Please run: $ gcloud auth login"
        )
    import google.auth.transport.requests
    from google.oauth2 import service_account

    credentials = service_account.Credentials.from_service_account_file(
        key_file, scopes=["https://www.googleapis.com/auth/cloud-platform"]
    )
    try:
        credentials.refresh(google.auth.transport.requests.Request())
    except Exception as error:  # gcloud reports a refused grant and stops
        raise TunnelError(f"There was a problem refreshing your current auth tokens: {error}") from None
    return credentials.token


def _call(url: str, token: str, body: dict | None = None) -> dict | None:
    """A JSON API call as gcloud's account (POST with ``body``); None for 404."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {token}"})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def _covers_port(entries: list[dict], port: int) -> bool:
    for entry in entries:
        if entry.get("IPProtocol") not in ("tcp", "all"):
            continue
        for ports in entry.get("ports") or ["0-65535"]:
            low, _, high = ports.partition("-")
            if int(low) <= port <= int(high or low):
                return True
    return False


def _applies(rule: dict, instance: dict, port: int, kind: str) -> bool:
    """Whether ``rule`` (its ``kind``: allowed or denied) applies to IAP's connection to ``port``.

    An allow must cover all of 35.235.240.0/20 (IAP's address within it is not known); a deny applies if it
    overlaps it at all: stricter than the network either way."""
    network = (instance.get("networkInterfaces") or [{}])[0].get("network", "global/networks/default")
    if not rule.get(kind) or rule.get("disabled") or rule.get("direction", "INGRESS") != "INGRESS":
        return False
    if rule.get("network", "").rsplit("/", 1)[-1] != network.rsplit("/", 1)[-1]:
        return False
    ranges = [ipaddress.ip_network(cidr) for cidr in rule.get("sourceRanges", [])]
    if not any(IAP_RANGE.subnet_of(r) if kind == "allowed" else IAP_RANGE.overlaps(r) for r in ranges):
        return False
    targets = rule.get("targetTags") or []
    if targets and not set(targets) & set((instance.get("tags") or {}).get("items", [])):
        return False
    return _covers_port(rule[kind], port)


def admits_iap(rules: list[dict], instance: dict, port: int) -> bool:
    """Whether the firewall ``rules`` let IAP reach ``port`` of ``instance``.

    VPC firewall evaluation (cloud.google.com/firewall/docs/firewalls, priority order): of the rules that apply,
    the lowest priority number wins, a deny over an allow of the same priority; none: the implied deny."""
    verdicts = [
        (rule.get("priority", 1000), kind == "allowed")
        for rule in rules
        for kind in ("denied", "allowed")
        if _applies(rule, instance, port, kind)
    ]
    return bool(verdicts) and min(verdicts)[1]


def backend(
    endpoint: str, project: str, zone: str, name: str, port: int, impersonate: list[str] | None = None
) -> tuple[str, int]:
    """The address IAP would connect to, or TunnelError as gcloud reports it."""
    iap = endpoint.split("/compute/v1/")[0]  # the emulator serves IAP's and IAM Credentials' APIs beside Compute's
    token = access_token()
    if impersonate:
        token = impersonated_token(iap, token, impersonate)
    tunnel = f"projects/{project}/iap_tunnel/zones/{zone}/instances/{name}"
    held = _call(f"{iap}/v1/{tunnel}:testIamPermissions", token, {"permissions": [_TUNNEL_PERMISSION]}) or {}
    if _TUNNEL_PERMISSION not in held.get("permissions", []):
        raise TunnelError("Error while connecting [4033: 'not authorized'].")
    instance = _call(f"{endpoint}projects/{project}/zones/{zone}/instances/{name}", token)
    if instance is None:
        raise TunnelError(
            f"Could not fetch resource: - The resource 'projects/{project}/zones/{zone}/instances/{name}' "
            "was not found"
        )
    rules = (_call(f"{endpoint}projects/{project}/global/firewalls", token) or {}).get("items", [])
    if instance.get("status") != "RUNNING" or not admits_iap(rules, instance, port):
        raise TunnelError("Error while connecting [4003: 'failed to connect to backend'].")
    return instance["networkInterfaces"][0]["networkIP"], port


def relay(address: tuple[str, int]) -> None:
    """Copy stdin to the connection and the connection to stdout until either side ends."""
    try:
        connection = socket.create_connection(address, timeout=10)
    except OSError as error:
        raise TunnelError("Error while connecting [4003: 'failed to connect to backend'].") from error
    connection.settimeout(None)

    def upstream() -> None:
        while data := os.read(sys.stdin.fileno(), 65536):
            connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := connection.recv(65536):
        os.write(sys.stdout.fileno(), data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gcloud")
    parser.add_argument("group", choices=["compute"])
    parser.add_argument("command", choices=["start-iap-tunnel"])
    parser.add_argument("instance")
    parser.add_argument("port", type=int)
    parser.add_argument("--listen-on-stdin", action="store_true", required=True)
    parser.add_argument("--project", required=True)
    parser.add_argument("--zone", required=True)
    parser.add_argument("--verbosity", default="warning")
    parser.add_argument("--impersonate-service-account", default="")
    args = parser.parse_args(argv)
    endpoint = os.environ.get(ENDPOINT_VARIABLE, "")
    try:
        if not endpoint:
            raise TunnelError(
                f"{ENDPOINT_VARIABLE} is not set: this stand-in reaches only a local Compute API"
            )
        chain = [account for account in args.impersonate_service_account.split(",") if account]
        relay(backend(endpoint.rstrip("/") + "/", args.project, args.zone, args.instance, args.port, chain))
    except TunnelError as error:
        print(f"ERROR: (gcloud.compute.start-iap-tunnel) {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
