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
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import random
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

BRIDGE = "tpuvpc0"
VPC_PREFIX = "10.77"
GATEWAY = f"{VPC_PREFIX}.0.1"
GOOGLE_APIS_RANGE = "10.199.0.0/16"
INTERNET_RANGE = "10.203.0.0/16"
INTERNET_ADDRESS = "10.203.0.1"  # the local Hub's
VM_INTERFACE = "ens4"  # the name Google's Debian images give the VM's NIC
MTU = 1400  # below this machine's own uplink's, so a masqueraded connection never needs fragments
_NAMESPACE_PREFIX = "tpuvm-"
_SETUP_LOCK = Path("/run/tpu-posttrain-vpc.lock")
_NFT_TABLE = "tpu_posttrain_vpc"


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


def connect_vm(address: str, egress: Egress) -> None:
    """Give the namespace of ``address`` its interface, its address and the routes ``egress`` allows."""
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
    _checked(_ip("-n", namespace, "-batch", "-", stdin="\n".join(commands) + "\n"), f"configuring {address}")


def service_address(service_range: str, port: int) -> str:
    """An address of ``service_range`` on which nothing listens on ``port`` (probed by binding)."""
    ensure_network()
    for address in _addresses(".".join(service_range.split(".")[:2])):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind((address, port))
            return address
    raise RuntimeError(f"local VPC: no free address in {service_range} for port {port}")
