"""Multi-host TPU v6e slices on the Compute emulator: a workload policy, an instance template, a zonal MIG.

Driven by the official google-cloud-compute REST clients, in the order issue 31's research gives: the policy
(regional), the template (global), the MIG in bulk mode; deleted in the reverse order.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import access_token, compute_clients, emulator_credentials
from google.api_core import exceptions
from google.cloud import compute_v1

from airflow_tpu_posttrain.local import vpc
from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator

PROJECT = "test-project"
ZONE = "us-east5-b"
REGION = "us-east5"
DONE = compute_v1.Operation.Status.DONE
IMAGE = "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e"


@pytest.fixture
def emulator():
    with ComputeEmulator(operation_seconds=0.1) as emulator:
        emulator.add_reservation("slice-reservation", ZONE, 4, machine_type="ct6e-standard-4t")
        yield emulator


@pytest.fixture
def gce(emulator):
    return compute_clients(emulator)


def reservation_bound() -> dict:
    """The template fields of a VM on the specific reservation (research §1.2, step 2)."""
    return {
        "scheduling": compute_v1.Scheduling(
            provisioning_model="RESERVATION_BOUND",
            on_host_maintenance="TERMINATE",
            instance_termination_action="DELETE",
        ),
        "reservation_affinity": compute_v1.ReservationAffinity(
            consume_reservation_type="SPECIFIC_RESERVATION",
            key="compute.googleapis.com/reservation-name",
            values=["slice-reservation"],
        ),
    }


def make_policy(gce, name: str = "slice-wp", topology: str = "4x4", region: str = REGION) -> str:
    workload = compute_v1.ResourcePolicyWorkloadPolicy(type_="HIGH_THROUGHPUT", accelerator_topology=topology)
    operation = gce.policies.insert(
        project=PROJECT,
        region=region,
        resource_policy_resource=compute_v1.ResourcePolicy(name=name, workload_policy=workload),
    )
    assert gce.region_operations.wait(project=PROJECT, region=region, operation=operation.name).status == DONE
    return f"projects/{PROJECT}/regions/{region}/resourcePolicies/{name}"


def make_template(gce, name: str = "slice-it", **properties) -> str:
    fields = {
        "machine_type": "ct6e-standard-4t",
        "disks": [
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=IMAGE, disk_size_gb=200),
            )
        ],
        "network_interfaces": [compute_v1.NetworkInterface(network="global/networks/default")],
        "metadata": compute_v1.Metadata(items=[compute_v1.Items(key="enable-oslogin", value="TRUE")]),
        **reservation_bound(),
        **properties,
    }
    operation = gce.templates.insert(
        project=PROJECT,
        instance_template_resource=compute_v1.InstanceTemplate(
            name=name, properties=compute_v1.InstanceProperties(**fields)
        ),
    )
    assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
    return f"projects/{PROJECT}/global/instanceTemplates/{name}"


def mig_resource(template: str, policy: str | None, size: int = 4, mode: str = "BULK", **fields):
    if policy is not None:
        fields["resource_policies"] = compute_v1.InstanceGroupManagerResourcePolicies(workload_policy=policy)
    return compute_v1.InstanceGroupManager(
        name="slice-mig",
        base_instance_name="slice-###",
        instance_template=template,
        target_size=size,
        target_size_policy=compute_v1.InstanceGroupManagerTargetSizePolicy(mode=mode),
        instance_lifecycle_policy=compute_v1.InstanceGroupManagerInstanceLifecyclePolicy(
            default_action_on_failure="DO_NOTHING"
        ),
        **fields,
    )


def insert_mig(gce, resource: compute_v1.InstanceGroupManager) -> compute_v1.Operation:
    operation = gce.migs.insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=resource)
    return gce.zone_operations.wait(project=PROJECT, zone=ZONE, operation=operation.name)


def get_mig(gce, name: str = "slice-mig") -> compute_v1.InstanceGroupManager:
    return gce.migs.get(project=PROJECT, zone=ZONE, instance_group_manager=name)


def wait_until(gce, condition, timeout: float = 10.0) -> compute_v1.InstanceGroupManager:
    """Poll the MIG, as a provider does, until ``condition(mig)`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        mig = get_mig(gce)
        if condition(mig) or time.monotonic() > deadline:
            return mig
        time.sleep(0.05)


def managed(gce, name: str = "slice-mig") -> list[compute_v1.ManagedInstance]:
    return list(gce.migs.list_managed_instances(project=PROJECT, zone=ZONE, instance_group_manager=name))


def delete_mig(gce) -> compute_v1.Operation:
    operation = gce.migs.delete(project=PROJECT, zone=ZONE, instance_group_manager="slice-mig")
    deadline = time.monotonic() + 10
    done = gce.zone_operations.wait(project=PROJECT, zone=ZONE, operation=operation.name)
    while done.status != DONE and time.monotonic() < deadline:
        done = gce.zone_operations.wait(project=PROJECT, zone=ZONE, operation=operation.name)
    return done


def slice_names(emulator) -> list[str]:
    return sorted(instance["name"] for instance in emulator.instances())


def test_a_bulk_v6e_16_slice_on_its_reservation_comes_up_whole(gce, emulator):
    """Four ct6e-standard-4t VMs RUNNING, a stable MIG, an active 4x4 topology, and a worker id on each VM."""
    emulator.set_faults(operation_seconds=0.5)
    done = insert_mig(gce, mig_resource(make_template(gce), make_policy(gce)))
    assert done.status == DONE and not done.error.errors
    assert done.operation_type == "insert" and done.target_link.endswith("/instanceGroupManagers/slice-mig")

    mig = wait_until(gce, lambda mig: mig.status.is_stable)

    assert mig.status.is_stable and mig.status.current_instance_statuses.running == 4
    assert mig.current_actions.none == 4 and mig.current_actions.creating == 0
    assert not mig.status.bulk_instance_operation.in_progress
    assert not mig.status.bulk_instance_operation.last_progress_check.error.errors
    [topology] = mig.status.applied_accelerator_topologies
    assert (topology.accelerator_topology, topology.state) == ("4x4", "ACTIVE")
    names = ["slice-001", "slice-002", "slice-003", "slice-004"]
    listed = managed(gce)
    assert [(m.name, m.instance_status, m.current_action) for m in listed] == [(n, "RUNNING", "NONE") for n in names]
    assert listed[0].instance.endswith(f"/projects/{PROJECT}/zones/{ZONE}/instances/slice-001")
    worker_ids = set()
    for name in names:
        instance = gce.instances.get(project=PROJECT, zone=ZONE, instance=name)
        metadata = {item.key: item.value for item in instance.metadata.items}
        assert instance.status == "RUNNING"
        assert instance.machine_type.endswith(f"zones/{ZONE}/machineTypes/ct6e-standard-4t")
        assert instance.reservation_affinity.values == ["slice-reservation"]
        assert metadata["created-by"] == f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/slice-mig"
        assert metadata["instance-template"].endswith("/global/instanceTemplates/slice-it")
        assert metadata["enable-oslogin"] == "TRUE"  # the template's own metadata
        # Not in the API's view: only the VM's metadata server tells it (asked from the VM's own address).
        assert "worker-id" not in metadata and "agent-worker-number" not in metadata
        worker_ids.add(emulator.guest_attributes((PROJECT, ZONE, name))["worker-id"])
    assert worker_ids == {"0", "1", "2", "3"}


def test_the_mig_insert_is_done_before_any_vm_exists(gce, emulator):
    """VM creation is asynchronous: the insert's operation is DONE, the MIG still creating."""
    template, policy = make_template(gce), make_policy(gce)
    emulator.set_faults(operation_seconds=3.0)
    operation = gce.migs.insert(
        project=PROJECT, zone=ZONE, instance_group_manager_resource=mig_resource(template, policy)
    )
    deadline = time.monotonic() + 10
    while emulator.instances() == [] and time.monotonic() < deadline:
        time.sleep(0.05)

    assert gce.zone_operations.get(project=PROJECT, zone=ZONE, operation=operation.name).status == DONE
    mig = get_mig(gce)
    assert not mig.status.is_stable and mig.status.bulk_instance_operation.in_progress
    assert mig.current_actions.creating == 4
    assert {m.instance_status for m in managed(gce)} == {"PENDING"}  # TPU VMs start PENDING


def test_a_stockout_creates_no_vm_and_the_bulk_mig_waits_for_the_whole_slice(gce, emulator):
    emulator.set_faults(stockout_zones=[ZONE])
    assert not insert_mig(gce, mig_resource(make_template(gce), make_policy(gce))).error.errors

    mig = wait_until(gce, lambda mig: mig.status.bulk_instance_operation.last_progress_check.error.errors)

    [error] = mig.status.bulk_instance_operation.last_progress_check.error.errors
    assert error.code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    assert error.message.startswith(f"The zone 'projects/{PROJECT}/zones/{ZONE}' does not have enough resources")
    assert mig.status.bulk_instance_operation.in_progress and not mig.status.is_stable
    assert mig.status.current_instance_statuses.non_existent == 4
    assert mig.status.applied_accelerator_topologies[0].state == "ACTIVATING"
    assert emulator.instances() == []
    listed = managed(gce)
    assert [m.current_action for m in listed] == ["CREATING"] * 4
    assert all(not m.instance_status for m in listed)
    assert listed[0].last_attempt.errors.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"

    emulator.set_faults(stockout_zones=[])  # capacity comes: the MIG creates the whole slice
    mig = wait_until(gce, lambda mig: mig.status.is_stable)
    assert mig.status.current_instance_statuses.running == 4 and len(emulator.instances()) == 4


def test_a_reservation_short_of_the_slice_creates_no_vm(gce, emulator):
    emulator.add_reservation("slice-reservation", ZONE, 3, machine_type="ct6e-standard-4t")
    insert_mig(gce, mig_resource(make_template(gce), make_policy(gce)))

    wait_until(gce, lambda mig: mig.status.bulk_instance_operation.last_progress_check.error.errors)
    time.sleep(0.3)  # several more checks: still none

    [error] = get_mig(gce).status.bulk_instance_operation.last_progress_check.error.errors
    assert (error.code, error.message) == (
        "CONDITION_NOT_MET",
        "Specified reservation 'slice-reservation' does not have available resources for the request.",
    )
    assert emulator.instances() == []


def test_without_bulk_mode_the_mig_creates_what_fits_and_retries_the_rest(gce, emulator):
    """INDIVIDUAL mode (the default): 3 of 4 VMs, billed and no slice, until capacity comes.

    "creates as many instances as possible ... and attempts to create the remaining instances as capacity
    becomes available" (about-bulk-mode)."""
    emulator.add_reservation("slice-reservation", ZONE, 3, machine_type="ct6e-standard-4t")
    insert_mig(gce, mig_resource(make_template(gce), make_policy(gce), mode="INDIVIDUAL"))

    mig = wait_until(gce, lambda mig: mig.status.current_instance_statuses.running == 3)
    time.sleep(0.3)

    assert slice_names(emulator) == ["slice-001", "slice-002", "slice-003"]
    assert not mig.status.is_stable and mig.status.applied_accelerator_topologies[0].state == "ACTIVATING"
    waiting = [m for m in managed(gce) if not m.instance_status]
    assert [(m.name, m.current_action) for m in waiting] == [("slice-004", "CREATING")]
    assert waiting[0].last_attempt.errors.errors[0].code == "CONDITION_NOT_MET"

    emulator.add_reservation("slice-reservation", ZONE, 4, machine_type="ct6e-standard-4t")
    assert wait_until(gce, lambda mig: mig.status.is_stable).status.current_instance_statuses.running == 4


@pytest.mark.parametrize(
    ("policy", "size", "template_fields", "lifecycle", "says"),
    [
        (None, 4, {}, "DO_NOTHING", "needs a workload policy with an accelerator topology"),
        ("4x4", 8, {}, "DO_NOTHING", "Accelerator topology '4x4' takes 4 VMs of ct6e-standard-4t"),
        ("4x8", 4, {}, "DO_NOTHING", "Accelerator topology '4x8' takes 8 VMs"),
        ("3x3", 4, {}, "DO_NOTHING", "accelerator topology '3x3' is not a multi-host slice"),
        ("4x4", 4, {"machine_type": "ct6e-standard-8t"}, "DO_NOTHING", "is not a multi-host slice of ct6e-standard-8t"),
        ("4x4", 4, {"scheduling": compute_v1.Scheduling(provisioning_model="SPOT")}, "DO_NOTHING", "template's is SPOT"),
        ("4x4", 4, {"scheduling": compute_v1.Scheduling()}, "DO_NOTHING", "template's is STANDARD"),
        (
            "4x4",
            4,
            {"scheduling": compute_v1.Scheduling(provisioning_model="FLEX_START")},
            "REPAIR",
            "Bulk mode with flex-start VMs needs DO_NOTHING",
        ),
    ],
)
def test_a_slice_compute_would_refuse_is_refused_before_anything_is_made(
    gce, emulator, policy, size, template_fields, lifecycle, says
):
    template = make_template(gce, **template_fields)
    policy_url = make_policy(gce, topology=policy) if policy else None
    resource = mig_resource(template, policy_url, size=size)
    resource.instance_lifecycle_policy.default_action_on_failure = lifecycle

    with pytest.raises(exceptions.BadRequest) as refused:
        gce.migs.insert(project=PROJECT, zone=ZONE, instance_group_manager_resource=resource)

    assert says in refused.value.message
    assert refused.value.errors[0]["reason"] == "invalid"
    with pytest.raises(exceptions.NotFound, match="instanceGroupManagers/slice-mig' was not found"):
        get_mig(gce)
    assert emulator.instances() == []


def test_a_mig_needs_its_template_and_a_policy_of_its_region(gce, emulator):
    template = make_template(gce)
    with pytest.raises(exceptions.NotFound, match="global/instanceTemplates/nope' was not found"):
        insert_mig(gce, mig_resource(f"projects/{PROJECT}/global/instanceTemplates/nope", make_policy(gce)))
    with pytest.raises(exceptions.BadRequest, match="must be in the region of zone 'us-east5-b'"):
        insert_mig(gce, mig_resource(template, make_policy(gce, "other-wp", region="europe-west4")))
    assert emulator.instances() == []


def test_what_an_instance_insert_refuses_in_the_template_fails_the_bulk_creation(gce, emulator):
    """Not at the template's or the MIG's insert: each VM's creation meets it, and the MIG's status says so."""
    bad_image = compute_v1.AttachedDisk(
        boot=True,
        initialize_params=compute_v1.AttachedDiskInitializeParams(source_image="projects/x/global/images/family/nope"),
    )
    template = make_template(gce, disks=[bad_image])
    assert not insert_mig(gce, mig_resource(template, make_policy(gce))).error.errors

    mig = wait_until(gce, lambda mig: mig.status.bulk_instance_operation.last_progress_check.error.errors)

    [error] = mig.status.bulk_instance_operation.last_progress_check.error.errors
    assert error.code == "INVALID_FIELD_VALUE"
    assert "The referenced image resource cannot be found." in error.message
    assert emulator.instances() == []


def refused_post(emulator, path: str, body: dict) -> tuple[int, dict]:
    """POST a body the official clients cannot send (a field the API does not have); Google's status and error."""
    request = urllib.request.Request(
        f"{emulator.url}/compute/v1/projects/{PROJECT}/{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {access_token(emulator_credentials(emulator))}"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    return refused.value.code, json.load(refused.value)["error"]


def test_the_workload_policy_body_is_checked_as_compute_checks_it(gce, emulator):
    """Against Google's discovery document, and what gcloud's reference says cannot go together."""
    status, error = refused_post(
        emulator,
        f"regions/{REGION}/resourcePolicies",
        {"name": "wp", "workloadPolicy": {"type": "HIGH_THROUGHPUT", "acceleratorTopologies": "4x4"}},
    )
    assert (status, error["errors"][0]["reason"]) == (400, "invalid")
    assert 'Unknown name "acceleratorTopologies" at \'resource.workload_policy\': Cannot find field.' in error["message"]
    status, error = refused_post(
        emulator, f"regions/{REGION}/resourcePolicies", {"name": "wp", "workloadPolicy": {"acceleratorTopology": "4x4"}}
    )
    assert (status, error["message"]) == (400, "Required field 'resource.workloadPolicy.type' not specified")
    workload = compute_v1.ResourcePolicyWorkloadPolicy(
        type_="HIGH_THROUGHPUT", accelerator_topology="4x4", max_topology_distance="BLOCK"
    )
    with pytest.raises(exceptions.BadRequest, match="acceleratorTopology and maxTopologyDistance cannot both"):
        gce.policies.insert(
            project=PROJECT,
            region=REGION,
            resource_policy_resource=compute_v1.ResourcePolicy(name="wp", workload_policy=workload),
        )
    policy = gce.policies.get(project=PROJECT, region=REGION, resource_policy=make_policy(gce).rsplit("/", 1)[-1])
    assert (policy.workload_policy.type_, policy.workload_policy.accelerator_topology) == ("HIGH_THROUGHPUT", "4x4")
    assert policy.region.endswith(f"/regions/{REGION}") and policy.status == "READY"
    assert [p.name for p in gce.policies.list(project=PROJECT, region=REGION)] == ["slice-wp"]


def test_the_template_and_policy_are_deleted_only_after_the_mig(gce, emulator):
    """Delete order: MIG, template, workload policy; while the MIG references them, 400 resourceInUseByAnotherResource."""
    template, policy = make_template(gce), make_policy(gce)
    insert_mig(gce, mig_resource(template, policy))
    mig_path = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/slice-mig"

    with pytest.raises(exceptions.BadRequest) as template_refused:
        gce.templates.delete(project=PROJECT, instance_template="slice-it")
    with pytest.raises(exceptions.BadRequest) as policy_refused:
        gce.policies.delete(project=PROJECT, region=REGION, resource_policy="slice-wp")

    assert template_refused.value.message.endswith(
        f"The instance_template resource '{template}' is already being used by '{mig_path}'"
    )
    assert template_refused.value.errors[0]["reason"] == "resourceInUseByAnotherResource"
    assert policy_refused.value.errors[0]["reason"] == "resourceInUseByAnotherResource"
    emulator.set_faults(references_linger_seconds=1.0)
    assert delete_mig(gce).status == DONE
    # A moment after its MIG is gone, Compute still calls them in use: a teardown must ask again.
    with pytest.raises(exceptions.BadRequest) as still_in_use:
        gce.templates.delete(project=PROJECT, instance_template="slice-it")
    assert still_in_use.value.errors[0]["reason"] == "resourceInUseByAnotherResource"
    time.sleep(1.0)
    operation = gce.templates.delete(project=PROJECT, instance_template="slice-it")
    assert gce.global_operations.wait(project=PROJECT, operation=operation.name).status == DONE
    operation = gce.policies.delete(project=PROJECT, region=REGION, resource_policy="slice-wp")
    assert gce.region_operations.wait(project=PROJECT, region=REGION, operation=operation.name).status == DONE
    with pytest.raises(exceptions.NotFound):
        gce.templates.get(project=PROJECT, instance_template="slice-it")
    with pytest.raises(exceptions.NotFound):
        gce.policies.get(project=PROJECT, region=REGION, resource_policy="slice-wp")


@pytest.mark.parametrize(
    ("loss", "counted_as", "action"),
    [("delete", "non_existent", "NONE"), ("preempt", "terminated", "NONE")],
)
def test_a_vm_lost_from_a_bulk_slice_leaves_it_short(gce, emulator, loss, counted_as, action):
    """A bulk MIG creates its VMs once: one lost (a user's delete, a preemption) is not recreated."""
    insert_mig(gce, mig_resource(make_template(gce), make_policy(gce)))
    wait_until(gce, lambda mig: mig.status.is_stable)

    if loss == "delete":
        operation = gce.instances.delete(project=PROJECT, zone=ZONE, instance="slice-002")
        gce.zone_operations.wait(project=PROJECT, zone=ZONE, operation=operation.name)
    else:  # a reservation-bound VM preempted (a host error) stops, TERMINATED
        emulator.preempt(ZONE, "slice-002")
    time.sleep(0.3)

    mig = get_mig(gce)
    assert not mig.status.is_stable
    assert mig.status.current_instance_statuses.running == 3
    assert getattr(mig.status.current_instance_statuses, counted_as) == 1
    assert mig.status.applied_accelerator_topologies[0].state == "INCOMPLETE"
    assert not mig.status.bulk_instance_operation.in_progress
    lost = [m for m in managed(gce) if m.name == "slice-002"][0]
    assert lost.current_action == action
    assert len(emulator.instances()) == (3 if loss == "delete" else 4)


def test_a_base_name_without_hashes_gets_random_four_character_suffixes(gce, emulator):
    """The reference: "the MIG appends a hyphen and a random four-character string to the base instance name"."""
    resource = mig_resource(make_template(gce), make_policy(gce))
    resource.base_instance_name = "worker"
    insert_mig(gce, resource)

    names = [m.name for m in managed(gce)]

    assert len(set(names)) == 4
    assert all(re.fullmatch(r"worker-[a-z0-9]{4}", name) for name in names)


def test_deleting_the_mig_deletes_every_vm_and_frees_its_network_namespace(gce, emulator, tmp_path):
    """One operation ends the MIG and each of its VMs, each booted as a local machine of its own."""
    from airflow_tpu_posttrain.local.fleet import LocalFleet

    emulator.fleet = fleet = LocalFleet(tmp_path / "disks", boot_delay=0)
    insert_mig(gce, mig_resource(make_template(gce), make_policy(gce)))
    wait_until(gce, lambda mig: mig.status.is_stable, timeout=30)
    addresses = {
        name: gce.instances.get(project=PROJECT, zone=ZONE, instance=name).network_interfaces[0].network_i_p
        for name in slice_names(emulator)
    }
    assert len(set(addresses.values())) == 4
    assert all(fleet.vm((PROJECT, ZONE, name)) is not None for name in addresses)
    assert all(Path(f"/run/netns/{vpc.namespace_of(address)}").exists() for address in addresses.values())

    done = delete_mig(gce)

    assert done.status == DONE and done.operation_type == "delete" and not done.error.errors
    assert emulator.instances() == []
    with pytest.raises(exceptions.NotFound):
        get_mig(gce)
    assert fleet.wait_ended(list(addresses), timeout=30) == []
    assert [a for a in addresses.values() if Path(f"/run/netns/{vpc.namespace_of(a)}").exists()] == []
