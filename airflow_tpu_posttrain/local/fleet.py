"""The local machines behind the Compute emulator's instances: one :class:`LocalVm` per inserted instance.

The emulator tells the fleet what Compute Engine would do to the machine: an address when the instance is
inserted, its firewall with the other VMs from then on (the VPC's rules, ``vpc.firewall_ruleset``), a boot when it
turns RUNNING (reading its ``ssh-keys``, ``enable-oslogin`` and ``enable-guest-attributes``
metadata), the
end of everything when it is deleted or stops. The fleet never outlives what it was told: a deleted instance's
processes and disk are gone, as on Google Cloud.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.vm import LocalVm

InstanceKey = tuple[str, str, str]  # (project, zone, name)


def _metadata(instance: dict) -> dict[str, str]:
    return {item["key"]: item.get("value", "") for item in (instance.get("metadata") or {}).get("items", [])}


class LocalFleet:
    """Addresses, disks and sshds of the emulator's instances.

    :param disks_root: each instance's disk is a directory below it, deleted with the instance.
    :param shared_paths: host directories every VM sees (checkpoint storage standing in for ``gs://``).
    :param image_paths: host directories every VM sees read-only at the same path, as part of its boot image
        (the local stack's torch venv, wherever the checkout is).
    :param package_cache: a host directory standing in for a package mirror (uv's cache on the VMs).
    :param compile_cache: a host directory every VM's logins have as JAX's compilation cache (``~/jax_cache``):
        the VMs are one machine's CPU, so what one compiled another need not compile again. Not a multi-host
        slice's workers: each starts with an empty one, as a fresh VM does. JAX writes
        the cache from process 0 only and keys a process's own computations by its devices, so with a warm
        shared cache worker 0 skips the compiles worker 1 must do, and reaches the first cross-process
        collective that much sooner; on CPUs that collective's gloo rendezvous waits 30 s for the peer, fixed
        in XLA (``GlooKeyValueStore``), and a loaded machine's worker 1 missed it (CI's slice fault run).
    :param boot_delay: seconds from RUNNING until the VM's sshd answers.
    :param vm_environment: environment of every VM's sessions (the image's settings: the local GCS server's URL
        for the storage clients); may be set after construction, before the first boot.
    :param vm_hosts: host name -> address in every VM's /etc/hosts (Google's storage hosts at the local GCS
        server's HTTPS front); may be set as ``vm_environment`` is.
    :param vm_ca_bundle: the CAs every VM's TLS clients trust (the system's and the front's); set as the others.
    """

    def __init__(
        self,
        disks_root: Path,
        shared_paths: Sequence[Path] = (),
        image_paths: Sequence[Path] = (),
        package_cache: Path | None = None,
        compile_cache: Path | None = None,
        boot_delay: float = 2.0,
        port: int = 22,
        vm_environment: dict[str, str] | None = None,
        vm_hosts: dict[str, str] | None = None,
        vm_ca_bundle: Path | None = None,
    ) -> None:
        self.disks_root = Path(disks_root)
        self.vm_environment = dict(vm_environment or {})
        self.vm_hosts = dict(vm_hosts or {})
        self.vm_ca_bundle = vm_ca_bundle
        self.shared_paths = tuple(shared_paths)
        self.image_paths = tuple(image_paths)
        self.package_cache = package_cache
        self.compile_cache = compile_cache
        self.boot_delay = boot_delay
        self.port = port
        self._addresses: dict[InstanceKey, str] = {}
        self._vms: dict[InstanceKey, LocalVm] = {}
        self._firewalls: dict[InstanceKey, str] = {}  # the firewall ruleset each address's namespace holds
        self._endings: list[tuple[str, threading.Thread]] = []  # (VM name, the thread ending it)
        self.end_errors: dict[str, str] = {}
        """VM name -> what its end raised (its processes outlived the kill, its disk could not be deleted)."""
        self._lock = threading.Lock()
        self.before_end: Callable[[LocalVm], None] | None = None
        """Tests: called with each machine just before it ends (its files still readable, e.g. ``guest_path``)."""

    def allocate(self, key: InstanceKey) -> str:
        """The instance's address in the local VPC, fixed at insert (as its IP is on Google Cloud)."""
        address = vpc.allocate_vm_address()
        with self._lock:
            self._addresses[key] = address
        return address

    def set_firewall(self, key: InstanceKey, ruleset: str) -> None:
        """The firewall of the instance's machine with the other VMs (``vpc.firewall_ruleset``), from its insert on.

        Loaded only when it changed; nothing for an instance without an address (deleted meanwhile)."""
        with self._lock:
            address = self._addresses.get(key)
            if address is None or self._firewalls.get(key) == ruleset:
                return
            if vpc.apply_firewall(address, ruleset):
                self._firewalls[key] = ruleset

    def boot(
        self,
        key: InstanceKey,
        instance: dict,
        oslogin_url: str | None = None,
        oslogin_logins: Sequence[str] = (),
        egress: vpc.Egress = vpc.Egress.INTERNET,
        metadata_port: int | None = None,
        slice_worker: bool = False,
    ) -> None:
        """Start the instance's machine (its sshd answers ``boot_delay`` seconds later).

        With ``enable-oslogin: TRUE`` its sshd takes keys from ``oslogin_url`` only (metadata keys are
        ignored, as on Google Cloud), and the OS Login accounts known at boot exist on it. ``egress``: what its
        network interface lets it reach (``local/vpc.py``); ``metadata_port``: its metadata server's port on this
        machine's end of the VPC (reached at ``metadata.google.internal``); ``slice_worker``: a VM of a multi-host
        slice (no shared compilation cache)."""
        metadata = _metadata(instance)
        oslogin = metadata.get("enable-oslogin", "").upper() == "TRUE"
        with self._lock:
            if key in self._vms or key not in self._addresses:
                return
            vm = LocalVm(
                key[2],
                self.disks_root / f"{key[1]}-{key[2]}-{instance['id']}",
                self._addresses[key],
                None if oslogin else metadata.get("ssh-keys"),
                port=self.port,
                guest_attributes=metadata.get("enable-guest-attributes", "").upper() == "TRUE",
                boot_delay=self.boot_delay,
                shared_paths=self.shared_paths,
                image_paths=self.image_paths,
                package_cache=self.package_cache,
                compile_cache=None if slice_worker else self.compile_cache,
                oslogin_url=oslogin_url if oslogin else None,
                oslogin_logins=tuple(oslogin_logins) if oslogin else (),
                metadata_port=metadata_port,
                environment=self.vm_environment,
                hosts=self.vm_hosts,
                ca_bundle=self.vm_ca_bundle,
                egress=egress,
                domain=f"{key[1]}.c.{key[0]}.internal",
            )
            self._vms[key] = vm
        vm.boot()

    def end(self, key: InstanceKey) -> None:
        """The instance is deleted (or stopped): its processes die and its disk is deleted, in the background."""
        with self._lock:
            address = self._addresses.pop(key, None)
            vm = self._vms.pop(key, None)
            self._firewalls.pop(key, None)
            if vm is None:
                if address is not None:  # never booted: its address is free again
                    vpc.release_vm_address(address)
                return
            ending = threading.Thread(target=self._end, args=(vm, self.before_end), name=f"end-{key[2]}")
            self._endings.append((vm.name, ending))
        ending.start()

    def _end(self, vm: LocalVm, before_end: Callable[[LocalVm], None] | None) -> None:
        try:
            try:
                if before_end is not None and vm.is_running:
                    before_end(vm)
            finally:
                vm.destroy()
        except Exception as error:
            self.end_errors[vm.name] = repr(error)
            raise

    def wait_ended(self, names: Sequence[str], timeout: float) -> list[str]:
        """Wait until the ends of the named VMs are over; the names of those still ending at ``timeout``.

        Each ending's own steps are bounded: the timeout is a backstop."""
        deadline = time.monotonic() + timeout
        with self._lock:
            endings = [thread for name, thread in self._endings if name in names]
        for thread in endings:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            return sorted({name for name, thread in self._endings if name in names and thread.is_alive()})

    def guest_attributes(self, key: InstanceKey) -> list[dict]:
        with self._lock:
            vm = self._vms.get(key)
        return vm.guest_attributes if vm else []

    def vm(self, key: InstanceKey) -> LocalVm | None:
        """The machine of a live instance (tests: drop its SSH sessions, read its disk)."""
        with self._lock:
            return self._vms.get(key)

    def stop(self) -> None:
        """End every machine (and free the addresses of instances not booted yet); wait until all are gone."""
        with self._lock:
            keys = {*self._addresses, *self._vms}
        for key in keys:
            self.end(key)
        for _, ending in list(self._endings):
            ending.join()
        self._endings.clear()
