"""The local VPC: a local VM reaches what its network interface would let it reach on Google Cloud.

Each local VM has a network namespace of its own (named ``tpuvm-10-77-M-K`` after its address), joined to
this machine by a veth pair on the bridge ``tpuvpc0``. Address plan (all private ranges, none routed beyond
this machine):

- ``10.77.0.0/16``, the VPC: the VMs' addresses; ``10.77.0.1`` is this machine's end of it, where the VMs'
  metadata server (the Compute emulator's guest side) answers. Every VM reaches it, as every GCE VM reaches
  169.254.169.254.
- ``10.199.0.0/16``, Google's APIs: the local Cloud Storage server and its HTTPS front listen here.
- ``10.203.0.0/16``, the internet: the local Hub listens here; through it, with masquerade, this machine's
  own network (PyPI, which the install reaches as on Google Cloud).

Which of these a VM may reach is decided at its boot from its instance, as Google's network decides it
(cloud.google.com/vpc/docs/private-google-access, cloud.google.com/nat/docs/overview): an external IP or a
Cloud NAT covering its subnetwork gives it the internet and Google's APIs (Cloud NAT turns Private Google
Access on for the ranges it serves); Private Google Access on its subnetwork alone gives it Google's APIs; with
neither it reaches only the VPC and its metadata server. What it may not reach has no route in its namespace:
a connection fails at once with "Network is unreachable" where Google's network drops the packets and the
client times out — the same failure, sooner. The choice is made at boot: a NAT or Private Google Access changed
while a VM runs applies to the VMs booted after it.

Between VMs, the VPC's firewall rules decide, as Google's do (cloud.google.com/firewall/docs/firewalls: "implied
deny ingress", "implied allow egress", rules in priority order, a deny over an allow of the same priority,
stateful): each VM's namespace holds an nftables table (:func:`firewall_ruleset`, applied by
:func:`apply_firewall`) that filters what it receives from, and sends to, the other VMs' addresses. Its rules are
the Compute emulator's, kept current as rules and instances come and go. A VM of another VPC network is not
reached at all (no route between networks without peering). Traffic with this machine's end of the VPC (the
metadata server, Airflow's SSH, the IAP stand-in) is not filtered here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import ipaddress
import random
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

BRIDGE = "tpuvpc0"
VPC_PREFIX = "10.77"
VPC_RANGE = f"{VPC_PREFIX}.0.0/16"
GATEWAY = f"{VPC_PREFIX}.0.1"
GOOGLE_APIS_RANGE = "10.199.0.0/16"
INTERNET_RANGE = "10.203.0.0/16"
INTERNET_ADDRESS = "10.203.0.1"  # the local Hub's
VM_INTERFACE = "ens4"  # the name Google's Debian images give the VM's NIC
MTU = 1400  # below this machine's own uplink's, so a masqueraded connection never needs fragments
_NAMESPACE_PREFIX = "tpuvm-"
_SETUP_LOCK = Path("/run/tpu-posttrain-vpc.lock")
_NFT_TABLE = "tpu_posttrain_vpc"
_FIREWALL_TABLE = "tpu_posttrain_firewall"  # in each VM's namespace
_METADATA_TABLE = "tpu_posttrain_metadata"  # in each VM's namespace
# Where every Compute Engine VM reaches its metadata server, as ``metadata.google.internal``
# (cloud.google.com/compute/docs/metadata/querying-metadata), whatever its network lets it reach.
METADATA_ADDRESS = "169.254.169.254"
METADATA_HOST = "metadata.google.internal"
# IP protocol numbers of the names a firewall rule's IPProtocol may take (the v1 reference, Firewall.allowed[]).
_PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "icmp": 1, "esp": 50, "ah": 51, "sctp": 132, "ipip": 4}
_PORT_PROTOCOLS = (6, 17, 132)  # those whose rules may name ports


class Egress(enum.Enum):
    """What a VM's network interface lets it reach beyond its VPC and metadata server."""

    NONE = "none"
    GOOGLE_APIS = "google-apis"  # Private Google Access
    INTERNET = "internet"  # an external IP or Cloud NAT: the internet and Google's APIs


def egress_of(external_ip: bool, cloud_nat: bool, private_google_access: bool) -> Egress:
    if external_ip or cloud_nat:
        return Egress.INTERNET
    return Egress.GOOGLE_APIS if private_google_access else Egress.NONE


def _ip(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, check=False)


def _checked(result: subprocess.CompletedProcess[str], what: str) -> None:
    if result.returncode:
        raise RuntimeError(f"local VPC: {what} failed: {result.stderr.strip()}")


def ensure_network() -> None:
    """Make the bridge, the services' ranges and the masquerade, once per boot of this machine (idempotent).

    Needs root, as the local VMs do."""
    if _ip("link", "show", BRIDGE).returncode == 0 and _nft_table_exists():
        return
    with open(_SETUP_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test processes start their stacks at once
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        if _ip("link", "show", BRIDGE).returncode:
            _checked(_ip("link", "add", BRIDGE, "mtu", str(MTU), "type", "bridge"), "creating the bridge")
            _checked(_ip("addr", "add", f"{GATEWAY}/16", "dev", BRIDGE), "addressing the bridge")
            _checked(_ip("link", "set", BRIDGE, "up"), "starting the bridge")
        for service_range in (GOOGLE_APIS_RANGE, INTERNET_RANGE):
            # Every address of the range is this machine's (as 127.0.0.0/8 is): a service binds one of its own.
            _checked(_ip("route", "replace", "local", service_range, "dev", "lo"), f"routing {service_range}")
        if not _nft_table_exists():
            ruleset = (
                f"table ip {_NFT_TABLE} {{\n"
                "  chain postrouting {\n"
                "    type nat hook postrouting priority srcnat;\n"
                f'    ip saddr {VPC_PREFIX}.0.0/16 oifname != "{BRIDGE}" masquerade\n'
                "  }\n"
                "}\n"
            )
            result = subprocess.run(["nft", "-f", "-"], input=ruleset, capture_output=True, text=True, check=False)
            _checked(result, "the masquerade rule (nft)")


def _nft_table_exists() -> bool:
    result = subprocess.run(["nft", "list", "table", "ip", _NFT_TABLE], capture_output=True, check=False)
    return result.returncode == 0


def _addresses(prefix: str) -> Iterator[str]:
    """Every host address ``prefix.M.K`` (M 1-255, K 1-254) once, from a random one on: processes rarely collide."""
    count = 255 * 254
    start = random.randrange(count)
    for offset in range(count):
        index = (start + offset) % count
        yield f"{prefix}.{index // 254 + 1}.{index % 254 + 1}"


def namespace_of(address: str) -> str:
    return _NAMESPACE_PREFIX + address.replace(".", "-")


def allocate_vm_address() -> str:
    """A VPC address no other VM of this machine holds, claimed by creating its network namespace.

    Creating a named namespace fails when it exists, so processes allocating at once never get the same one."""
    ensure_network()
    for address in _addresses(VPC_PREFIX):
        if _ip("netns", "add", namespace_of(address)).returncode == 0:
            return address
    raise RuntimeError("local VPC: no free address")


def release_vm_address(address: str) -> None:
    """Delete the address's namespace: its interface (and the bridge's end of it) go with it."""
    _ip("netns", "delete", namespace_of(address))


def connect_vm(address: str, egress: Egress, metadata_port: int | None = None) -> None:
    """Give the namespace of ``address`` its interface, its address and the routes ``egress`` allows.

    With ``metadata_port``, ``METADATA_ADDRESS``:80 leads to this machine's end of the VPC on that port (the
    Compute emulator's guest side), whatever ``egress`` is, as every VM reaches its metadata server."""
    namespace = namespace_of(address)
    host_end = "tv" + "".join(f"{int(part):02x}" for part in address.split(".")[2:])
    _checked(
        _ip("link", "add", host_end, "mtu", str(MTU), "type", "veth", "peer", "name", VM_INTERFACE,
            "netns", namespace),
        f"the interface of {address}",
    )  # fmt: skip
    _checked(_ip("link", "set", host_end, "master", BRIDGE, "up"), f"joining {address} to the bridge")
    commands = [
        "link set lo up",
        f"addr add {address}/16 dev {VM_INTERFACE}",
        f"link set {VM_INTERFACE} up",
    ]
    if egress is Egress.GOOGLE_APIS:
        commands.append(f"route add {GOOGLE_APIS_RANGE} via {GATEWAY}")
    elif egress is Egress.INTERNET:
        commands.append(f"route add default via {GATEWAY}")
    if metadata_port is not None:
        commands.append(f"route add {METADATA_ADDRESS}/32 via {GATEWAY}")
    _checked(_ip("-n", namespace, "-batch", "-", stdin="\n".join(commands) + "\n"), f"configuring {address}")
    if metadata_port is not None:
        ruleset = (
            f"table ip {_METADATA_TABLE} {{\n  chain output {{\n    type nat hook output priority -100;\n"
            f"    ip daddr {METADATA_ADDRESS} tcp dport 80 dnat to {GATEWAY}:{metadata_port}\n  }}\n}}\n"
        )
        result = subprocess.run(
            ["nsenter", f"--net=/run/netns/{namespace}", "nft", "-f", "-"], input=ruleset, capture_output=True,
            text=True, check=False,
        )
        _checked(result, f"the metadata server's address in {address}")


@dataclasses.dataclass(frozen=True)
class FirewallRule:
    """One VPC firewall rule as it applies to a VM's traffic with the other VMs of its network.

    ``remote``: the other side's CIDRs (an ingress rule's sources, an egress rule's destinations);
    ``protocols``: its allowed or denied entries, ``(IPProtocol, ports)`` (ports like ``22`` or ``1000-2000``; none:
    every port)."""

    priority: int
    allow: bool
    ingress: bool
    remote: tuple[str, ...]
    protocols: tuple[tuple[str, tuple[str, ...]], ...]


def _address_match(direction: str, cidrs: Iterable[str]) -> str | None:
    """The nft match of ``cidrs`` ("" for any address; None when none is an IPv4 range: the rule matches nothing)."""
    networks = [network for cidr in cidrs if (network := ipaddress.ip_network(cidr, strict=False)).version == 4]
    collapsed = list(ipaddress.collapse_addresses(networks))
    if not collapsed:
        return None
    if collapsed == [ipaddress.ip_network("0.0.0.0/0")]:
        return ""
    return f"ip {direction} {{ {', '.join(map(str, collapsed))} }} "


def _protocol_matches(protocols: Iterable[tuple[str, tuple[str, ...]]]) -> list[str]:
    """One nft match per allowed or denied entry ("" for ``all``); an entry of an unknown protocol matches nothing."""
    matches = []
    for protocol, ports in protocols:
        name = protocol.lower()
        if name == "all":
            matches.append("")
            continue
        number = int(name) if name.isdigit() else _PROTOCOL_NUMBERS.get(name)
        if number is None:
            continue
        if ports and number in _PORT_PROTOCOLS:
            spans = sorted((int(low), int(high or low)) for low, _, high in (port.partition("-") for port in ports))
            merged: list[list[int]] = []
            for low, high in spans:  # nft refuses overlapping elements in one set
                if merged and low <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], high)
                else:
                    merged.append([low, high])
            listed = ", ".join(f"{low}-{high}" if high > low else str(low) for low, high in merged)
            matches.append(f"meta l4proto {number} th dport {{ {listed} }} ")
        else:
            matches.append(f"meta l4proto {number} ")
    return matches


def firewall_ruleset(peers: Iterable[str], rules: Sequence[FirewallRule]) -> str:
    """The nft script of a VM's firewall with the other VMs: ``peers``, the addresses of its network's VMs.

    Cloud VPC firewall semantics (cloud.google.com/firewall/docs/firewalls): the rules in priority order, a deny
    before an allow of the same priority, the first that matches decides; none: the implied deny ingress and
    allow egress. Stateful: a connection's replies pass. A VM of another network never reaches this one. Only
    traffic with the VPC's other addresses is filtered (not this machine's end, ``GATEWAY``, nor loopback)."""
    members = sorted(set(peers), key=ipaddress.ip_address)
    elements = f" elements = {{ {', '.join(members)} }}" if members else ""
    chains = {True: [], False: []}  # ingress, egress
    for rule in sorted(rules, key=lambda rule: (rule.priority, rule.allow)):
        remote = _address_match("saddr" if rule.ingress else "daddr", rule.remote)
        if remote is None:
            continue
        verdict = "accept" if rule.allow else "drop"
        chains[rule.ingress] += [f"    {remote}{match}{verdict}" for match in _protocol_matches(rule.protocols)]
    lines = [
        f"table inet {_FIREWALL_TABLE}",
        f"delete table inet {_FIREWALL_TABLE}",  # the new script replaces the old one in one transaction
        f"table inet {_FIREWALL_TABLE} {{",
        f"  set peers {{ type ipv4_addr;{elements} }}",
        "  chain ingress {",
        "    type filter hook input priority filter; policy accept;",
        '    iifname "lo" accept',
        "    meta nfproto ipv6 drop",  # the VPC is IPv4 only: no VM reaches another by a link-local address
        f"    ip saddr != {VPC_RANGE} accept",
        f"    ip saddr {GATEWAY} accept",
        "    ct state established,related accept",
        "    ip saddr != @peers drop",
        *chains[True],
        "    drop",  # the implied deny ingress
        "  }",
        "  chain egress {",
        "    type filter hook output priority filter; policy accept;",  # the implied allow egress
        '    oifname "lo" accept',
        f"    ip daddr != {VPC_RANGE} accept",
        f"    ip daddr {GATEWAY} accept",
        "    ct state established,related accept",
        *chains[False],
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def apply_firewall(address: str, ruleset: str) -> bool:
    """Load ``ruleset`` (:func:`firewall_ruleset`) into the namespace of ``address``; False if it is gone."""
    namespace = Path("/run/netns") / namespace_of(address)
    if not namespace.exists():
        return False
    result = subprocess.run(
        ["nsenter", f"--net={namespace}", "nft", "-f", "-"], input=ruleset, capture_output=True, text=True,
        check=False,
    )
    if result.returncode and not namespace.exists():  # released meanwhile
        return False
    _checked(result, f"the firewall of {address}")
    return True


def service_address(service_range: str, port: int) -> str:
    """An address of ``service_range`` on which nothing listens on ``port`` (probed by binding)."""
    ensure_network()
    for address in _addresses(".".join(service_range.split(".")[:2])):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind((address, port))
            return address
    raise RuntimeError(f"local VPC: no free address in {service_range} for port {port}")
