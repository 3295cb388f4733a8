"""Compute Engine VPC firewall rules: the global ``firewalls`` collection, and what its rules let between VMs.

Google's behaviour: ``firewalls`` insert, get, list, delete
(https://cloud.google.com/compute/docs/reference/rest/v1/firewalls) and how rules apply
(https://cloud.google.com/firewall/docs/firewalls: targets by tag or service account, sources, priority order, a deny
over an allow of the same priority, the implied rules, and the default network's pre-populated
``default-allow-internal``). With a fleet, what the VMs send each other passes their network's rules
(``local/vpc.py``), kept current as rules and instances change.
"""

from __future__ import annotations

import copy
import ipaddress
import time
from typing import Any

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.compute_emulator import api

# The firewall rule Google puts in every project's default network, which VMs of a slice talk over: "Pre-populated
# rules in the default network" (cloud.google.com/firewall/docs/firewalls#more_rules_default_vpc):
# default-allow-internal, ingress at priority 65534, tcp and udp on every port and icmp from the network's internal
# ranges (Google's 10.128.0.0/9; here the local VPC's). Modelled for the traffic between VMs only, and not listed:
# the emulator's default network lists none of Google's four pre-populated rules (default-allow-ssh, -rdp and -icmp
# are not modelled: what reaches a VM from outside the VPC is the IAP stand-in's and the SSH firewall rules' to
# decide). Every other network has only the implied rules: its VMs reach each other where its rules allow.
DEFAULT_NETWORK_RULES: tuple[dict[str, Any], ...] = (
    {
        "name": "default-allow-internal",
        "network": "global/networks/default",
        "direction": "INGRESS",
        "priority": 65534,
        "sourceRanges": [vpc.VPC_RANGE],
        "allowed": [
            {"IPProtocol": "tcp", "ports": ["0-65535"]},
            {"IPProtocol": "udp", "ports": ["0-65535"]},
            {"IPProtocol": "icmp"},
        ],
    },
)


def _check_firewall_rule(body: dict[str, Any]) -> None:
    """What Compute refuses in a firewall rule (the v1 reference, ``Firewall``; modelled texts).

    Each source range a CIDR (no host bits), not targetTags and targetServiceAccounts together (the reference:
    "If targetServiceAccounts is specified, then targetTags cannot be used"), and a protocol in every allowed
    or denied entry."""
    for i, cidr in enumerate(body.get("sourceRanges") or []):
        try:
            ipaddress.ip_network(cidr, strict=True)
        except ValueError:
            raise api.ApiError(
                400, "invalid", f"Invalid value for field 'resource.sourceRanges[{i}]': '{cidr}'. Must be a valid "
                "IPV4 or IPV6 CIDR range."
            ) from None
    if body.get("targetTags") and body.get("targetServiceAccounts"):
        raise api.ApiError(
            400, "invalid", "Invalid value for field 'resource.targetServiceAccounts': targetTags and "
            "targetServiceAccounts cannot both be set."
        )
    for kind in ("allowed", "denied"):
        for i, entry in enumerate(body.get(kind) or []):
            if not entry.get("IPProtocol"):
                raise api.ApiError(
                    400, "required", f"Required field 'resource.{kind}[{i}].IPProtocol' not specified"
                )


def _network_name(resource: dict[str, Any]) -> str:
    """The VPC network's name of an instance (its first interface's) or of a firewall rule."""
    if "networkInterfaces" in resource:
        network = (resource["networkInterfaces"] or [{}])[0].get("network")
    else:
        network = resource.get("network")
    return (network or "global/networks/default").rsplit("/", 1)[-1]


def _tags(instance: dict[str, Any]) -> set[str]:
    return set((instance.get("tags") or {}).get("items") or [])


def _service_accounts(instance: dict[str, Any]) -> set[str]:
    return {account.get("email", "") for account in instance.get("serviceAccounts") or []}


def _firewall_rules(rules: list[dict[str, Any]], instance: dict[str, Any], peers: list[dict[str, Any]]):
    """The firewall ``rules`` of the instance's project for its traffic with ``peers``, as ``vpc.FirewallRule``s.

    ``peers``: the other VMs of its network. As the Cloud firewall applies them
    (cloud.google.com/firewall/docs/firewalls): a rule of the instance's network, enabled, whose targets are all
    instances or include its tags (``targetTags``) or service account (``targetServiceAccounts``); an ingress
    rule's sources are its ``sourceRanges`` and the VMs its ``sourceTags`` or ``sourceServiceAccounts`` name (none
    of them: every address), an egress rule's destinations its ``destinationRanges`` (none: every address)."""
    network = _network_name(instance)
    applied = []
    for rule in rules:
        if rule.get("disabled") or _network_name(rule) != network:
            continue
        if rule.get("targetTags") and not set(rule["targetTags"]) & _tags(instance):
            continue
        accounts = set(rule.get("targetServiceAccounts") or [])
        if accounts and not accounts & _service_accounts(instance):
            continue
        ingress = rule.get("direction", "INGRESS") == "INGRESS"
        if ingress:
            ranges, tags = list(rule.get("sourceRanges") or []), set(rule.get("sourceTags") or [])
            accounts = set(rule.get("sourceServiceAccounts") or [])
            remote = ranges + [
                f"{peer['networkInterfaces'][0]['networkIP']}/32"
                for peer in peers
                if tags & _tags(peer) or accounts & _service_accounts(peer)
            ]
            if not (ranges or tags or accounts):
                remote = ["0.0.0.0/0"]
        else:
            remote = list(rule.get("destinationRanges") or ["0.0.0.0/0"])
        for kind, allow in (("allowed", True), ("denied", False)):
            if rule.get(kind):
                protocols = tuple((entry["IPProtocol"], tuple(entry.get("ports") or ())) for entry in rule[kind])
                priority = int(rule.get("priority", 1000))
                applied.append(vpc.FirewallRule(priority, allow, ingress, tuple(remote), protocols))
    return applied


class FirewallsMixin:
    """Firewall rules (``_firewalls``), and each local VM's firewall kept current with them."""

    def firewalls(self) -> list[dict[str, Any]]:
        with self._lock:
            self._advance()
            return copy.deepcopy(list(self._firewalls.values()))

    def _sync_firewalls(self) -> None:
        """Each local VM's firewall with the other VMs of its network, as its rules make it now (lock held).

        Done at each ``_advance`` (every request, and every operation started: an inserted instance has its
        firewall before it boots); the fleet loads a VM's ruleset only when it changed. Rules apply to running VMs
        as they change, as on Google Cloud."""
        set_firewall = getattr(self.fleet, "set_firewall", None)  # None: no fleet, or one with no network (a double)
        if set_firewall is None:
            return
        networks: dict[tuple[str, str], list[tuple[tuple[str, str, str], dict[str, Any]]]] = {}
        for key, instance in self._instances.items():
            networks.setdefault((key[0], _network_name(instance)), []).append((key, instance))
        for (project, network), members in networks.items():
            rules = [rule for (owner, _), rule in self._firewalls.items() if owner == project]
            if network == "default":
                rules += DEFAULT_NETWORK_RULES
            for key, instance in members:
                peers = [peer for other, peer in members if other != key]
                addresses = [peer["networkInterfaces"][0]["networkIP"] for peer in peers]
                set_firewall(key, vpc.firewall_ruleset(addresses, _firewall_rules(rules, instance, peers)))

    def _insert_firewall(self, query: dict, body: dict, project: str):
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            name = api.check_insert("Firewall", body)
            _check_firewall_rule(body)
            path = api.resource_path(project, None, "firewalls", name)
            if (project, name) in self._firewalls:
                raise api.already_exists(path)
            firewall = {
                "network": f"{api.API_ROOT}/projects/{project}/global/networks/default",
                "direction": "INGRESS",
                "priority": 1000,
                **copy.deepcopy(body),
                "kind": "compute#firewall",
                "id": api.numeric_id(),
                "selfLink": f"{api.API_ROOT}/{path}",
                "creationTimestamp": api.timestamp(time.time()),
            }
            self._firewalls[(project, name)] = firewall
            return 200, self._start_operation(project, None, "insert", firewall, query)

    def _list_firewalls(self, query: dict, body: dict, project: str):
        terms = api.parse_filter(query.get("filter", ""))
        with self._lock:
            self._advance()
            items = api.matching(self._firewalls, (project,), terms)
        return api.list_response("compute#firewallList", f"projects/{project}/global/firewalls", items)

    def _get_firewall(self, query: dict, body: dict, project: str, name: str):
        with self._lock:
            self._advance()
            firewall = self._firewalls.get((project, name))
            if firewall is None:
                raise api.not_found(api.resource_path(project, None, "firewalls", name))
            return 200, copy.deepcopy(firewall)

    def _delete_firewall(self, query: dict, body: dict, project: str, name: str):
        with self._lock:
            if replayed := self._replayed_operation(project, query):
                return 200, replayed
            firewall = self._firewalls.get((project, name))
            if firewall is None:
                raise api.not_found(api.resource_path(project, None, "firewalls", name))

            def on_done(failed: bool) -> None:
                if self._firewalls.get((project, name)) is firewall:
                    del self._firewalls[(project, name)]

            return 200, self._start_operation(project, None, "delete", firewall, query, on_done=on_done)
