"""A local slice: the emulator's v6e-16 made of two local VMs, which reach each other as a slice's VMs must.

MaxText on a CPU slice runs one JAX process per VM, joined by ``jax.distributed.initialize``: the coordinator listens
on worker 0's internal IP, port 1234, and gloo then connects the processes to each other on ports chosen at run
time, each bound to the address its VM's host name resolves to. So the VMs of a slice must reach each other on every
port (what the default network's ``default-allow-internal`` allows on Google Cloud, and only where the network's
rules allow it), and each VM's host name must resolve to its internal IP, as on a Compute Engine VM.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import time

import pytest
from conftest import PROJECT, REPO, compute_clients, connect_to
from google.api_core import exceptions
from google.cloud import compute_v1
from test_compute_emulator_slices import (
    get_mig,
    insert_mig,
    make_policy,
    make_template,
    managed,
    mig_resource,
)
from test_slice_operators import slice_dag
from test_tpu_vm_operators import task_states, xcom

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator
from airflow_tpu_posttrain.local.fleet import LocalFleet
from airflow_tpu_posttrain.local.stack import compile_cache
from airflow_tpu_posttrain.local.vm import JAX_CACHE_DIR
from airflow_tpu_posttrain.recipes import slices

ZONE = "us-east5-b"
SLICE_VMS = 2  # a local v6e-16: 2 VMs standing for its 4
# What CI builds (scripts/bootstrap.sh, `stack prepare`): MaxText's CPU venv, with JAX.
MAXTEXT_VENV = REPO / ".local" / "maxtext-venv"
COORDINATOR_PORT = 1234  # MaxText's, fixed (initialize_jax_for_cpu)
DONE = compute_v1.Operation.Status.DONE
WARM_ENTRY = "jit_init-0123456789abcdef-cache"  # an entry of the local VMs' shared compilation cache

# Worker 0's listener: port 1234 and one the kernel picks (as gloo's are), each answering every connection with its
# port. It prints the picked port first.
LISTENER = f"""
import socket, threading
servers = [socket.create_server(("0.0.0.0", {COORDINATOR_PORT})), socket.create_server(("0.0.0.0", 0))]
print(servers[1].getsockname()[1], flush=True)
def serve(server):
    while True:
        connection, _ = server.accept()
        connection.sendall(str(server.getsockname()[1]).encode())
        connection.close()
for server in servers[1:]:
    threading.Thread(target=serve, args=(server,), daemon=True).start()
serve(servers[0])
"""
# A connection to ADDRESS:PORT (argv), within 3 s; prints what the listener said.
# Prints what the listener said, or "dropped" when the connection timed out (a firewall drops, never refuses).
CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as connection:
        print(connection.recv(16).decode())
except TimeoutError:
    print("dropped")
"""
WHO_AM_I = "import socket; name = socket.gethostname(); print(name, socket.gethostbyname(name))"
# Each process joins the job as MaxText's CPU path does, then all gather one number from every process.
JAX_SUM = f"""
import sys
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
process_id, coordinator = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(
    coordinator_address=f"{{coordinator}}:{COORDINATOR_PORT}", num_processes={SLICE_VMS}, process_id=process_id,
    initialization_timeout=120,
)
gathered = multihost_utils.process_allgather(jnp.array([process_id + 1.0]))
print("sum", float(gathered.sum()), "of", jax.process_count(), "processes", flush=True)
jax.distributed.shutdown()
"""


@pytest.fixture
def local_slices(monkeypatch, tmp_path, client_key):
    """The ``emulator`` of conftest, with each slice ``SLICE_VMS`` local VMs (``local_slice_vms``).

    Its fleet has a warm JAX compilation cache, holding ``WARM_ENTRY``, as the local stack's.

    On a reservation of 2: it holds the VMs made, not the topology's 4. The VMs see MaxText's CPU venv (a shared
    path: it is this machine's, wherever the checkout is)."""
    shared = (MAXTEXT_VENV,) if MAXTEXT_VENV.is_dir() else ()
    warm_cache = compile_cache(tmp_path)  # what the other local VMs compiled
    (warm_cache / WARM_ENTRY).write_text("compiled by worker 0 of an earlier run\n")
    fleet = LocalFleet(tmp_path / "disks", boot_delay=0.5, shared_paths=shared, compile_cache=warm_cache)
    with ComputeEmulator(operation_seconds=0.2, fleet=fleet, local_slice_vms=SLICE_VMS) as emu:
        emu.add_reservation("slice-reservation", ZONE, SLICE_VMS, machine_type="ct6e-standard-4t")
        connect_to(emu, monkeypatch, client_key)
        yield emu


def make_slice(run_dag, dag_id: str, **dag_args) -> dict:
    """A v6e-16 made by the slice's create operator in a DAG (no teardown: the test's emulator ends its VMs)."""
    dr = run_dag(dag_id, slice_dag(dag_id, **dag_args).split("    @task")[0])
    assert dr.state == "success", task_states(dr)
    return xcom(dr, "create_tpu_vm")


def login(vm: dict):
    """A DAG step's SSH session on a VM of the create's record (its published host keys pinned)."""
    from airflow_tpu_posttrain.hooks.vm import VmHook

    return VmHook("tpu_vm_ssh", remote_host=vm["ssh_address"], username=vm["ssh_login"], host_keys=vm["host_keys"])


def python(program: str, *args: object, interpreter: str = "python3") -> str:
    return shlex.join([interpreter, "-c", program, *map(str, args)])


def start_listener(worker_0: dict) -> int:
    """Start ``LISTENER`` on worker 0, detached; the port the kernel picked for it."""
    with login(worker_0) as hook:
        hook.run(f"setsid nohup {python(LISTENER)} < /dev/null > ~/listener.out 2>&1 &")
        deadline = time.monotonic() + 30
        while not (said := hook.run("cat ~/listener.out 2>/dev/null || true").strip()):
            assert time.monotonic() < deadline, "the listener never started"
            time.sleep(0.2)
    return int(said)


def reaches(hook, address: str, port: int) -> bool | None:
    """Whether a connection from the hook's VM to ``address:port`` is answered by the listener on that port.

    False only when the connection was dropped; None when the probe itself gave no answer in time (its SSH
    command still running on a loaded machine): the caller asks again."""
    try:
        status, said = hook.run_status(python(CONNECT, address, port), timeout=30)
    except TimeoutError:
        return None
    assert status == 0, said
    return {str(port): True, "dropped": False}[said.strip()]


def wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_a_local_slice_is_checked_as_compute_checks_it_but_makes_its_n_vms():
    """``targetSize`` must still be the topology's VM count (4 for 4x4); the MIG then makes 2 and reports 2.

    A reservation of 2 VMs holds it (it counts the VMs made), and a client reads the group as a whole slice."""
    with ComputeEmulator(operation_seconds=0.1, local_slice_vms=SLICE_VMS) as emulator:
        emulator.add_reservation("slice-reservation", ZONE, SLICE_VMS, machine_type="ct6e-standard-4t")
        gce = compute_clients(emulator)
        template, policy = make_template(gce), make_policy(gce, topology="4x4")
        with pytest.raises(exceptions.BadRequest, match="takes 4 VMs of ct6e-standard-4t"):
            insert_mig(gce, mig_resource(template, policy, size=SLICE_VMS))
        done = insert_mig(gce, mig_resource(template, policy, size=4))
        assert done.status == DONE and not done.error.errors
        assert wait_for(lambda: get_mig(gce).status.is_stable, timeout=10)
        mig = get_mig(gce)
        assert mig.target_size == SLICE_VMS and mig.status.current_instance_statuses.running == SLICE_VMS
        assert [topology.state for topology in mig.status.applied_accelerator_topologies] == ["ACTIVE"]
        assert [m.name for m in managed(gce)] == ["slice-001", "slice-002"]
        assert slices.slice_state(json.loads(type(mig).to_json(mig, preserving_proto_field_name=False))).state == (
            slices.WHOLE
        )
        worker_ids = {emulator.guest_attributes((PROJECT, ZONE, name))["worker-id"] for name in ("slice-001", "slice-002")}
        assert worker_ids == {"0", "1"}


def test_the_vms_of_a_local_slice_reach_each_other_on_every_port_the_network_allows(local_slices, run_dag):
    """Worker 1 reaches worker 0's internal IP on 1234 and on a port the kernel picked (default-allow-internal).

    Neither worker has the other local VMs' compilation cache: each starts with an empty ``~/jax_cache``.

    A deny rule of higher priority closes 1234 alone, and deleting it opens it again. Each VM's host name is its
    name, and resolves to its internal IP."""
    record = make_slice(run_dag, "local_slice_network")
    worker_0, worker_1 = record["vms"]
    assert [vm["worker_id"] for vm in record["vms"]] == [0, 1]
    for vm in record["vms"]:
        with login(vm) as hook:
            assert hook.run(python(WHO_AM_I)).split() == [vm["name"], vm["internal_ip"]]
            # A fresh VM's ~/jax_cache: both workers compile what they run, neither far ahead of the other.
            assert hook.run(f"ls -A ~/{JAX_CACHE_DIR} 2>/dev/null || true").strip() == "", vm["name"]
    picked = start_listener(worker_0)
    address = worker_0["internal_ip"]
    gce = compute_clients(local_slices)
    with login(worker_1) as hook:
        assert wait_for(lambda: reaches(hook, address, COORDINATOR_PORT)) and wait_for(lambda: reaches(hook, address, picked))

        rule = compute_v1.Firewall(
            name="deny-coordinator", network="global/networks/default", direction="INGRESS", priority=1000,
            source_ranges=[vpc.VPC_RANGE], denied=[compute_v1.Denied(I_p_protocol="tcp", ports=["1234"])],
        )  # fmt: skip
        operation = gce.firewalls.insert(project=PROJECT, firewall_resource=rule)
        assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
        assert wait_for(lambda: reaches(hook, address, COORDINATOR_PORT) is False)
        assert wait_for(lambda: reaches(hook, address, picked))

        operation = gce.firewalls.delete(project=PROJECT, firewall="deny-coordinator")
        assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
        assert wait_for(lambda: reaches(hook, address, COORDINATOR_PORT))


def test_a_slice_on_a_custom_mode_network_reaches_itself_through_its_own_rule(local_slices, run_dag):
    """A custom-mode network has no default-allow-internal: the slice's VMs reach each other by its ``-int`` rule.

    Worker 1 reaches worker 0 on the coordinator's port and on one the kernel picked (as gloo's are); with the
    rule deleted, neither (nothing else in the network lets them in)."""
    local_slices.add_network("isolated", custom_mode=True)
    local_slices.add_subnetwork("isolated-east", "us-east5", network="isolated")
    record = make_slice(run_dag, "local_slice_custom_network", network="isolated", subnetwork="isolated-east")
    worker_0, worker_1 = record["vms"]
    gce = compute_clients(local_slices)
    [internal] = [rule for rule in gce.firewalls.list(project=PROJECT) if rule.name.endswith("-int")]
    assert internal.network.endswith("global/networks/isolated") and internal.source_tags == internal.target_tags
    picked, address = start_listener(worker_0), worker_0["internal_ip"]
    with login(worker_1) as hook:
        assert wait_for(lambda: reaches(hook, address, COORDINATOR_PORT)) and wait_for(lambda: reaches(hook, address, picked))

        operation = gce.firewalls.delete(project=PROJECT, firewall=internal.name)
        assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
        assert wait_for(lambda: reaches(hook, address, COORDINATOR_PORT) is False)
        assert wait_for(lambda: reaches(hook, address, picked) is False)


def _in_namespace(address: str, program: str, *args: object, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run ``program`` in the network namespace of the VM at ``address`` (as root, as the fleet enters it)."""
    argv = ["nsenter", f"--net=/run/netns/{vpc.namespace_of(address)}", "python3", "-c", program, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


def test_vms_of_a_network_without_an_internal_rule_reach_each_other_only_once_a_rule_allows(local_slices):
    """A custom-mode network has only the implied rules (deny ingress): its VMs are closed to each other.

    And to the default network's VMs (no route between networks), until a rule allows them in."""
    local_slices.add_network("isolated", custom_mode=True)
    local_slices.add_subnetwork("isolated-east", "us-east5", network="isolated")
    gce = compute_clients(local_slices)
    isolated = {"network": "global/networks/isolated", "subnetwork": "regions/us-east5/subnetworks/isolated-east"}
    interfaces = {
        "vm-a": compute_v1.NetworkInterface(**isolated),
        "vm-b": compute_v1.NetworkInterface(**isolated),
        "vm-default": compute_v1.NetworkInterface(network="global/networks/default"),
    }
    for name, interface in interfaces.items():
        instance = compute_v1.Instance(
            name=name, machine_type=f"zones/{ZONE}/machineTypes/ct6e-standard-8t", network_interfaces=[interface]
        )
        gce.instances.insert(project=PROJECT, zone=ZONE, instance_resource=instance)
    addresses = {}
    for name in interfaces:
        def get(name=name) -> compute_v1.Instance:
            return gce.instances.get(project=PROJECT, zone=ZONE, instance=name)

        assert wait_for(lambda: get().status == "RUNNING")
        addresses[name] = get().network_interfaces[0].network_i_p
        local_slices.fleet.vm((PROJECT, ZONE, name)).wait_until_booted(60)

    listener = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{vpc.namespace_of(addresses['vm-a'])}", "python3", "-c", LISTENER],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        picked = int(listener.stdout.readline())

        def reached(source: str, port: int) -> bool:
            said = _in_namespace(addresses[source], CONNECT, addresses["vm-a"], port, timeout=30)
            return said.returncode == 0 and said.stdout.strip() == str(port)

        assert not reached("vm-b", picked) and not reached("vm-default", picked)
        rule = compute_v1.Firewall(
            name="isolated-allow-internal", network="global/networks/isolated", direction="INGRESS",
            source_ranges=[vpc.VPC_RANGE], allowed=[compute_v1.Allowed(I_p_protocol="tcp")],
        )  # fmt: skip
        operation = gce.firewalls.insert(project=PROJECT, firewall_resource=rule)
        assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
        assert wait_for(lambda: reached("vm-b", picked)) and reached("vm-b", COORDINATOR_PORT)
        assert not reached("vm-default", picked)  # another network's VM: still no way in
    finally:
        listener.kill()
        listener.wait()


@pytest.mark.maxtext
def test_two_jax_processes_on_a_local_slice_join_and_sum_across_the_vms(local_slices, run_dag):
    """MaxText's CPU path across the slice: one JAX process per VM, joined at worker 0's internal IP, port 1234.

    Started over SSH as a step starts them; a cross-process gather (gloo, between the VMs) is seen by both."""
    interpreter = MAXTEXT_VENV / "bin" / "python"
    if not interpreter.exists():
        pytest.skip(f"no MaxText venv at {MAXTEXT_VENV} (scripts/bootstrap.sh makes it)")
    record = make_slice(run_dag, "local_slice_jax")
    coordinator = record["vms"][0]["internal_ip"]  # the record's VMs are in worker id order
    said: dict[int, str] = {}
    errors: list[str] = []

    def run(vm: dict) -> None:
        command = f"JAX_PLATFORMS=cpu {python(JAX_SUM, vm['worker_id'], coordinator, interpreter=str(interpreter))}"
        try:
            with login(vm) as hook:
                said[vm["worker_id"]] = hook.run(command, timeout=240)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(f"worker {vm['worker_id']}: {error}")

    workers = [threading.Thread(target=run, args=(vm,)) for vm in record["vms"]]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    assert not errors, errors
    assert {worker: text.strip().splitlines()[-1] for worker, text in said.items()} == {
        0: "sum 3.0 of 2 processes", 1: "sum 3.0 of 2 processes"
    }
