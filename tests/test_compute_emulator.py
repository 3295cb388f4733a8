"""The Compute Engine emulator, driven by the official google-cloud-compute REST client."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import RUNNER_ACCOUNT, RUNNER_ROLES, access_token, compute_clients, emulator_credentials
from google.api_core import exceptions
from google.cloud import compute_v1

from airflow_tpu_posttrain.local.compute_emulator import ComputeEmulator

PROJECT = "test-project"
ZONE = "us-east5-b"
DONE = compute_v1.Operation.Status.DONE


@pytest.fixture
def emulator():
    with ComputeEmulator(operation_seconds=0.1) as emulator:
        yield emulator


@pytest.fixture
def gce(emulator):
    return compute_clients(emulator)


def tpu_instance(name: str, **fields) -> compute_v1.Instance:
    fields.setdefault("machine_type", f"zones/{ZONE}/machineTypes/ct6e-standard-8t")
    return compute_v1.Instance(
        name=name,
        labels={"managed-by": "airflow-tpu-posttrain", "dag": "sft"},
        network_interfaces=[
            compute_v1.NetworkInterface(
                network="global/networks/default",
                access_configs=[compute_v1.AccessConfig(name="External NAT")],
            )
        ],
        **fields,
    )


def insert(gce, instance: compute_v1.Instance, zone: str = ZONE, request_id: str | None = None) -> str:
    """Insert an instance and return the operation's name."""
    request = compute_v1.InsertInstanceRequest(
        project=PROJECT, zone=zone, instance_resource=instance, request_id=request_id or str(uuid.uuid4())
    )
    return gce.instances.insert(request=request).name


def wait(gce, operation: str, zone: str = ZONE) -> compute_v1.Operation:
    return gce.zone_operations.wait(project=PROJECT, zone=zone, operation=operation)


def admin(emulator, method: str, path: str, body: dict | None = None, token: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{emulator.url}{path}", data=data, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request) as response:
        return json.load(response)


def test_a_tpu_instance_starts_pending_and_others_provisioning(gce, emulator):
    """"TPU instances start instead in the PENDING state" (Compute's instance-lifecycle page); others PROVISIONING.

    Read at once from the emulator itself: its operations stay PENDING for their first second at most."""
    emulator.set_faults(operation_seconds=4.0)
    insert(gce, tpu_instance("vm-tpu"))
    [first] = emulator.instances()
    insert(gce, tpu_instance("vm-cpu", machine_type=f"zones/{ZONE}/machineTypes/e2-standard-2"))
    second = next(i for i in emulator.instances() if i["name"] == "vm-cpu")
    assert (first["name"], first["status"], second["status"]) == ("vm-tpu", "PENDING", "PROVISIONING")


def test_insert_then_wait_gives_a_running_instance_with_local_ips(gce):
    operation = insert(gce, tpu_instance("vm-1"))

    done = wait(gce, operation)

    assert (done.status, done.operation_type, done.progress) == (DONE, "insert", 100)
    assert done.target_link.endswith(f"/projects/{PROJECT}/zones/{ZONE}/instances/vm-1")
    assert done.zone.endswith(f"/zones/{ZONE}") and done.end_time and not done.error.errors
    instance = gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1")
    assert instance.status == "RUNNING"
    assert instance.network_interfaces[0].network_i_p == "127.0.0.1"
    assert instance.network_interfaces[0].access_configs[0].nat_i_p == "127.0.0.1"
    assert instance.machine_type == f"zones/{ZONE}/machineTypes/ct6e-standard-8t"
    assert instance.labels["managed-by"] == "airflow-tpu-posttrain"
    assert instance.id and instance.creation_timestamp


def test_wait_returns_an_unfinished_operation_after_about_two_seconds(gce, emulator):
    emulator.set_faults(operation_seconds=30)
    operation = insert(gce, tpu_instance("vm-slow"))

    started = time.monotonic()
    assert wait(gce, operation).status == compute_v1.Operation.Status.RUNNING
    assert 1.8 < time.monotonic() - started < 3

    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-slow").status == "STAGING"


def test_same_request_id_twice_creates_one_instance(gce, emulator):
    request_id = str(uuid.uuid4())
    first = insert(gce, tpu_instance("vm-1"), request_id=request_id)
    second = insert(gce, tpu_instance("vm-1"), request_id=request_id)

    assert first == second
    assert [instance["name"] for instance in emulator.instances()] == ["vm-1"]


def test_same_name_with_a_new_request_id_conflicts(gce):
    insert(gce, tpu_instance("vm-1"))

    with pytest.raises(exceptions.Conflict) as raised:
        insert(gce, tpu_instance("vm-1"))

    message = f"The resource 'projects/{PROJECT}/zones/{ZONE}/instances/vm-1' already exists"
    assert message in raised.value.message
    assert raised.value.errors == [{"message": message, "domain": "global", "reason": "alreadyExists"}]


@pytest.mark.parametrize(
    ("zone", "machine_type", "message"),
    [
        (ZONE, "", "Required field 'resource.machineType' not specified"),
        (
            ZONE,
            f"zones/{ZONE}/machineTypes/ct6e-standard-9t",
            "Machine type with name 'ct6e-standard-9t' does not exist in zone 'us-east5-b'.",
        ),
        # us-central1-a sells TPU v5e and v5p, not v6e (cloud.google.com/tpu/docs/regions-zones).
        (
            "us-central1-a",
            "zones/us-central1-a/machineTypes/ct6e-standard-8t",
            "Machine type with name 'ct6e-standard-8t' does not exist in zone 'us-central1-a'.",
        ),
    ],
)
def test_an_instance_needs_a_machine_type_the_zone_has(gce, emulator, zone, machine_type, message):
    """As Compute: no instance without a machine type its zone sells, and nothing created by the refused insert."""
    with pytest.raises(exceptions.BadRequest) as raised:
        insert(gce, tpu_instance("vm-typeless", machine_type=machine_type), zone=zone)
    assert message in raised.value.message
    assert emulator.instances() == []


def test_missing_instance_is_not_found(gce):
    with pytest.raises(exceptions.NotFound, match="instances/nope' was not found"):
        gce.instances.get(project=PROJECT, zone=ZONE, instance="nope")
    with pytest.raises(exceptions.NotFound):
        gce.instances.delete(project=PROJECT, zone=ZONE, instance="nope")


def test_stockout_ends_the_operation_with_zone_resource_pool_exhausted(gce, emulator):
    emulator.set_faults(stockout_zones=[ZONE])

    done = wait(gce, insert(gce, tpu_instance("vm-1")))

    assert done.status == DONE and done.http_error_status_code == 503
    assert done.error.errors[0].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    assert done.error.errors[0].message.startswith(
        f"The zone 'projects/{PROJECT}/zones/{ZONE}' does not have enough resources available"
    )
    assert emulator.instances() == []
    # Another zone still has capacity.
    assert not wait(gce, insert(gce, tpu_instance("vm-1"), zone="us-east5-a"), zone="us-east5-a").error.errors


def test_quota_and_missing_reservation_errors(gce, emulator):
    emulator.set_faults(quota_exceeded_zones=["us-east5-a"])

    quota = wait(gce, insert(gce, tpu_instance("vm-1"), zone="us-east5-a"), zone="us-east5-a")
    affinity = compute_v1.ReservationAffinity(
        consume_reservation_type="SPECIFIC_RESERVATION",
        key="compute.googleapis.com/reservation-name",
        values=["my-reservation"],
    )
    reservation = wait(gce, insert(gce, tpu_instance("vm-2", reservation_affinity=affinity)))

    assert quota.error.errors[0].code == "QUOTA_EXCEEDED"
    assert quota.error.errors[0].message == "Quota 'TPU_V6E_CHIPS' exceeded.  Limit: 0.0 in region us-east5."
    assert reservation.error.errors[0].code == "INVALID_FIELD_VALUE"
    assert reservation.error.errors[0].message.endswith("Specified reservations [my-reservation] do not exist.")
    assert emulator.instances() == []


def test_a_reservation_holds_its_vm_count_and_frees_up_when_they_end(gce, emulator):
    emulator.add_reservation("one-vm", "us-east5-b", 1, machine_type="ct6e-standard-8t")
    affinity = compute_v1.ReservationAffinity(
        consume_reservation_type="SPECIFIC_RESERVATION",
        key="compute.googleapis.com/reservation-name",
        values=["projects/test-project/reservations/one-vm"],
    )
    first = wait(gce, insert(gce, tpu_instance("vm-1", reservation_affinity=affinity)))
    second = wait(gce, insert(gce, tpu_instance("vm-2", reservation_affinity=affinity)))
    assert not first.error.errors
    assert second.error.errors[0].code == "CONDITION_NOT_MET"
    assert second.error.errors[0].message == (
        "Specified reservation 'one-vm' does not have available resources for the request."
    )
    wait(gce, gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-1").name)
    assert not wait(gce, insert(gce, tpu_instance("vm-3", reservation_affinity=affinity))).error.errors


def test_transient_errors_alternate_503_and_429_then_succeed(gce, emulator):
    emulator.set_faults(transient_errors={"insert": 3})

    with pytest.raises(exceptions.ServiceUnavailable) as unavailable:
        insert(gce, tpu_instance("vm-1"))
    with pytest.raises(exceptions.TooManyRequests) as too_many:
        insert(gce, tpu_instance("vm-1"))
    with pytest.raises(exceptions.ServiceUnavailable):
        insert(gce, tpu_instance("vm-1"))
    wait(gce, insert(gce, tpu_instance("vm-1")))

    assert unavailable.value.errors[0]["reason"] == "backendError"
    assert too_many.value.errors[0]["reason"] == "rateLimitExceeded"
    assert len(emulator.instances()) == 1


def test_client_default_retry_on_get_absorbs_503_but_not_429(gce, emulator):
    wait(gce, insert(gce, tpu_instance("vm-1")))
    emulator.set_faults(transient_errors={"get": 1})
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "RUNNING"

    emulator.set_faults(transient_errors={"get": 2})
    with pytest.raises(exceptions.TooManyRequests):
        gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1")

    gets = [r for r in emulator.requests if r["method"] == "GET" and r["path"].endswith("/instances/vm-1")]
    assert len(gets) == 4  # each 503 was retried once by the client


def test_list_filters_on_labels_and_name(gce, emulator):
    wait(gce, insert(gce, tpu_instance("vm-1")))
    other = tpu_instance("vm-2")
    other.labels = {"team": "x"}
    wait(gce, insert(gce, other))

    def names(expression: str) -> list[str]:
        request = compute_v1.ListInstancesRequest(project=PROJECT, zone=ZONE, filter=expression)
        return sorted(instance.name for instance in gce.instances.list(request=request))

    assert names("") == ["vm-1", "vm-2"]
    assert names("labels.managed-by = airflow-tpu-posttrain") == ["vm-1"]
    assert names("labels.team:*") == ["vm-2"]
    assert names('labels.managed-by = "airflow-tpu-posttrain" AND labels.dag = sft') == ["vm-1"]
    assert names("(labels.dag = sft) (name = vm-2)") == []
    assert names("name = vm-2 status = RUNNING") == ["vm-2"]
    assert names("labels.dag != sft") == ["vm-2"]
    assert emulator.requests[-1]["query"] == {"filter": "labels.dag != sft"}


@pytest.mark.parametrize(
    ("labels", "says"),
    [
        ({f"k{i}": "v" for i in range(65)}, "at most 64 labels"),
        ({"team": "Has-Capitals"}, "Label value 'Has-Capitals' violates format constraints"),
        ({"9team": "x"}, "Label key '9team' violates format constraints"),
    ],
)
def test_labels_beyond_computes_rules_are_refused(gce, emulator, labels, says):
    instance = tpu_instance("vm-labelled")
    instance.labels = labels
    with pytest.raises(exceptions.BadRequest, match=re.escape(says)):
        insert(gce, instance)
    assert emulator.instances() == []


@pytest.mark.parametrize("name", ["Vm-1", "vm_1", "vm-", "1vm", "v" * 64])
def test_names_beyond_computes_pattern_are_refused(gce, emulator, name):
    """Instance and firewall names alike (the pipeline names a VM's firewall rule after the VM)."""
    says = re.escape(f"Invalid value for field 'resource.name': '{name}'")
    with pytest.raises(exceptions.BadRequest, match=says):
        insert(gce, tpu_instance(name))
    rule = compute_v1.Firewall(
        name=name, network="global/networks/default", source_ranges=["10.0.0.0/8"], target_tags=["vm-1"],
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
    )
    with pytest.raises(exceptions.BadRequest, match=says):
        gce.firewalls.insert(project=PROJECT, firewall_resource=rule)
    assert emulator.instances() == [] and emulator.firewalls() == []


def test_delete_stops_then_removes_the_instance(gce, emulator):
    wait(gce, insert(gce, tpu_instance("vm-1")))

    operation = gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-1")
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "STOPPING"
    done = wait(gce, operation.name)

    assert (done.status, done.operation_type) == (DONE, "delete")
    with pytest.raises(exceptions.NotFound):
        gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1")


def test_a_busy_instance_refuses_a_delete_and_the_hook_waits_it_out(gce, emulator, monkeypatch):
    """Compute answers 400 resourceNotReady to a delete while the instance is busy; the hook retries it.

    Busy: its insert unfinished (a teardown after a create cut short mid-insert), or a delete under way."""
    from airflow_tpu_posttrain.hooks.compute import TpuVmHook

    emulator.set_faults(operation_seconds=1.0)
    inserting = insert(gce, tpu_instance("vm-busy"))
    with pytest.raises(exceptions.BadRequest, match="is not ready"):
        gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-busy")
    key = emulator.service_account_key(RUNNER_ACCOUNT, *RUNNER_ROLES, project=PROJECT)
    google = {"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": json.dumps(key), "project": PROJECT}}
    monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(google))
    hook = TpuVmHook(api_endpoint=emulator.url, retry_initial_delay=0.2, retry_deadline=30)
    deleting = hook.delete_instance(PROJECT, ZONE, "vm-busy", str(uuid.uuid4()))
    assert wait(gce, inserting).status == DONE and deleting
    with pytest.raises(exceptions.BadRequest, match="is not ready"):  # the delete under way
        gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-busy")
    assert wait(gce, deleting).status == DONE and emulator.instances() == []




def test_failing_deletes_keep_the_instance(gce, emulator):
    wait(gce, insert(gce, tpu_instance("vm-1")))
    emulator.set_faults(fail_deletes=True)

    done = wait(gce, gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-1").name)

    assert done.error.errors[0].code == "INTERNAL_ERROR" and done.http_error_status_code == 500
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "RUNNING"


def test_firewall_insert_get_delete(gce, emulator):
    firewall = compute_v1.Firewall(
        name="allow-iap-ssh-vm-1",
        source_ranges=["35.235.240.0/20"],
        target_tags=["vm-1"],
        allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
    )
    operation = gce.firewalls.insert(project=PROJECT, firewall_resource=firewall)
    done = gce.global_operations.wait(project=PROJECT, operation=operation.name)
    assert done.status == DONE and not done.zone

    stored = gce.firewalls.get(project=PROJECT, firewall="allow-iap-ssh-vm-1")
    assert stored.allowed[0].ports == ["22"] and stored.direction == "INGRESS"
    with pytest.raises(exceptions.Conflict):
        gce.firewalls.insert(project=PROJECT, firewall_resource=firewall)

    operation = gce.firewalls.delete(project=PROJECT, firewall="allow-iap-ssh-vm-1")
    gce.global_operations.wait(project=PROJECT, operation=operation.name)
    with pytest.raises(exceptions.NotFound):
        gce.firewalls.get(project=PROJECT, firewall="allow-iap-ssh-vm-1")


@pytest.mark.parametrize(
    ("fields", "refused_for"),
    [
        ({"source_ranges": ["10.0.0.1/8"]}, "resource.sourceRanges[0]"),  # host bits set
        ({"source_ranges": ["10.0.0.0/33"]}, "resource.sourceRanges[0]"),
        ({"target_service_accounts": ["sa@p.iam.gserviceaccount.com"]}, "cannot both be set"),
        ({"allowed": [compute_v1.Allowed(ports=["22"])]}, "resource.allowed[0].IPProtocol"),
    ],
)
def test_a_firewall_rule_compute_would_refuse_is_refused(gce, emulator, fields, refused_for):
    rule = {
        "name": "allow-ssh-vm-1",
        "source_ranges": ["35.235.240.0/20"],
        "target_tags": ["vm-1"],
        "allowed": [compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])],
        **fields,
    }
    with pytest.raises(exceptions.BadRequest) as raised:
        gce.firewalls.insert(project=PROJECT, firewall_resource=compute_v1.Firewall(**rule))
    assert refused_for in raised.value.message
    assert emulator.firewalls() == []


def test_max_run_duration_deletes_the_instance_by_itself(gce, emulator):
    emulator.set_faults(max_run_duration_scale=0.01)  # 30 s -> 0.3 s
    scheduling = compute_v1.Scheduling(
        max_run_duration=compute_v1.Duration(seconds=30), instance_termination_action="DELETE"
    )
    wait(gce, insert(gce, tpu_instance("vm-1", scheduling=scheduling)))
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "RUNNING"

    time.sleep(0.4)

    assert emulator.instances() == []


@pytest.mark.parametrize(
    ("model", "action", "after"),
    [("SPOT", "DELETE", None), ("SPOT", "STOP", "TERMINATED"), ("STANDARD", "DELETE", "TERMINATED")],
)
def test_a_preempted_vm_is_stopped_or_deleted_by_its_termination_action(gce, emulator, model, action, after):
    """A Spot VM's preemption follows its instanceTerminationAction; a host error stops any other VM."""
    scheduling = compute_v1.Scheduling(provisioning_model=model, instance_termination_action=action)
    wait(gce, insert(gce, tpu_instance("vm-1", scheduling=scheduling)))
    emulator.preempt(ZONE, "vm-1")
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "STOPPING"
    deadline = time.monotonic() + 10
    while [i["status"] for i in emulator.instances()] == ["STOPPING"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [i["status"] for i in emulator.instances()] == ([after] if after else [])


@pytest.mark.parametrize(
    ("items", "refused_for"),
    [
        ([("ssh-keys", "a"), ("ssh-keys", "b")], "duplicate keys: ssh-keys"),
        ([("startup script", "x")], "'startup script'"),
        ([("k" * 128, "x")], "less than 128 bytes"),
        ([("big", "x" * 262145)], "larger than 262144 bytes"),
        ([(f"part-{i}", "x" * 200_000) for i in range(3)], "the limit is 512 KB"),
    ],
)
def test_metadata_beyond_computes_limits_is_refused(gce, emulator, items, refused_for):
    metadata = compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v) for k, v in items])
    with pytest.raises(exceptions.BadRequest) as raised:
        insert(gce, tpu_instance("vm-meta", metadata=metadata))
    assert refused_for in raised.value.message
    assert emulator.instances() == []


def test_an_image_family_that_does_not_exist_is_refused(gce, emulator):
    def boot_disk(family: str) -> list[compute_v1.AttachedDisk]:
        image = f"projects/ubuntu-os-cloud/global/images/family/{family}"
        return [compute_v1.AttachedDisk(boot=True, initialize_params=compute_v1.AttachedDiskInitializeParams(source_image=image))]

    with pytest.raises(exceptions.BadRequest) as raised:
        insert(gce, tpu_instance("vm-typo", disks=boot_disk("ubuntu-2204-ltsx")))
    assert "initializeParams.sourceImage" in raised.value.message
    assert "The referenced image resource cannot be found." in raised.value.message
    assert emulator.instances() == []
    wait(gce, insert(gce, tpu_instance("vm-ok", disks=boot_disk("ubuntu-2204-lts"))))
    assert [i["name"] for i in emulator.instances()] == ["vm-ok"]


def test_admin_endpoints(gce, emulator):
    faults = admin(emulator, "POST", "/_emulator/faults", {"stockout_zones": ["us-east5-a"]})
    assert faults["stockout_zones"] == ["us-east5-a"]
    wait(gce, insert(gce, tpu_instance("vm-1")))

    admin(emulator, "POST", f"/_emulator/instances/{ZONE}/vm-1/status", {"status": "TERMINATED"})

    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-1").status == "TERMINATED"
    listed = admin(emulator, "GET", "/_emulator/instances")
    assert [instance["status"] for instance in listed] == ["TERMINATED"]
    recorded = admin(emulator, "GET", "/_emulator/requests")
    assert recorded[0]["method"] == "POST" and recorded[0]["body"]["name"] == "vm-1"
    assert set(recorded[0]["query"]) == {"requestId"}

    admin(emulator, "POST", "/_emulator/reset", {})

    assert emulator.instances() == [] and emulator.requests == []
    assert emulator.faults["stockout_zones"] == []


def test_paths_without_the_compute_v1_prefix(emulator):
    token = access_token(emulator_credentials(emulator))
    body = {"name": "vm-1", "machineType": f"zones/{ZONE}/machineTypes/e2-standard-2", "labels": {"a": "b"}}
    operation = admin(emulator, "POST", f"/projects/{PROJECT}/zones/{ZONE}/instances?requestId=r1", body, token)
    done = admin(emulator, "POST", f"/projects/{PROJECT}/zones/{ZONE}/operations/{operation['name']}/wait", None, token)

    assert done["status"] == "DONE"
    instance = admin(emulator, "GET", f"/projects/{PROJECT}/zones/{ZONE}/instances/vm-1", None, token)
    assert instance["status"] == "RUNNING" and instance["networkInterfaces"][0]["networkIP"] == "127.0.0.1"
    # Without an access config there is no external IP, as on the real API.
    assert "accessConfigs" not in instance["networkInterfaces"][0]


def test_command_line_runs_until_sigterm():
    process = subprocess.Popen(
        [sys.executable, "-m", "airflow_tpu_posttrain.local.compute_emulator", "--port", "0"],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("compute emulator listening on http://127.0.0.1:")
        with urllib.request.urlopen(f"{line.split()[-1]}/_emulator/instances") as response:
            assert json.load(response) == []
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0


def test_a_call_without_valid_credentials_is_refused_401_as_google_refuses_it(emulator):
    """No credential, an unknown key's self-signed JWT, a refused grant: Google's 401 and 400 bodies."""
    from google.oauth2 import service_account

    path = f"/projects/{PROJECT}/zones/{ZONE}/instances"
    with pytest.raises(urllib.error.HTTPError) as missing:
        admin(emulator, "GET", path)
    error = json.load(missing.value)["error"]
    assert missing.value.code == 401 and error["status"] == "UNAUTHENTICATED"
    assert error["errors"][0]["reason"] == "required"

    key = emulator.service_account_key("someone@my-project.iam.gserviceaccount.com", project=PROJECT)
    forged = ComputeEmulator().iam.create_key(key["client_email"], PROJECT, key["token_uri"])  # not this emulator's
    clients = {"transport": "rest", "client_options": {"api_endpoint": emulator.url}}
    stranger = compute_v1.InstancesClient(
        credentials=service_account.Credentials.from_service_account_info(
            forged, scopes=["https://www.googleapis.com/auth/cloud-platform"]
        ),
        **clients,
    )
    with pytest.raises(exceptions.Unauthorized, match="invalid authentication credentials"):
        stranger.get(project=PROJECT, zone=ZONE, instance="vm-1")
    with pytest.raises(Exception, match="invalid_grant"):
        access_token(service_account.Credentials.from_service_account_info(forged, scopes=["x"]))
    # The account's own key: both ways google-auth makes a bearer credential are let in.
    own = service_account.Credentials.from_service_account_info(key, scopes=["https://www.googleapis.com/auth/cloud-platform"])
    assert admin(emulator, "GET", path, None, access_token(own)).get("items", []) == []  # an access token
    with pytest.raises(exceptions.NotFound):  # a self-signed JWT (the GAPIC clients' way): past authentication
        compute_v1.InstancesClient(credentials=own, **clients).get(project=PROJECT, zone=ZONE, instance="vm-1")


def test_os_login_changes_only_the_callers_own_profile_and_logs_in_only_with_a_role(emulator):
    """users.importSshPublicKey into another account's profile: 403. The VM's login check: a role is needed."""
    from google.cloud.oslogin_v1 import OsLoginServiceClient

    from airflow_tpu_posttrain.local.iam import OS_ADMIN_LOGIN, OS_LOGIN

    caller = "caller@my-project.iam.gserviceaccount.com"
    client = OsLoginServiceClient(
        transport="rest",
        credentials=emulator_credentials(emulator, caller),
        client_options={"api_endpoint": emulator.url},
    )
    key = {"key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOp2J1Y4TlY6k1ZbDL3Z8C9eS5hHvH5p1W9K0l8dC3Qm"}
    with pytest.raises(exceptions.Forbidden, match="The caller does not have permission"):  # REST: by HTTP code
        client.import_ssh_public_key(request={"parent": "users/other@my-project.iam.gserviceaccount.com", "ssh_public_key": key})
    profile = client.import_ssh_public_key(request={"parent": f"users/{caller}", "ssh_public_key": key}).login_profile

    def may(policy: str) -> bool:
        query = f"?email={caller.replace('@', '%40')}&policy={policy}"
        return admin(emulator, "GET", f"/_vm/{PROJECT}/computeMetadata/v1/oslogin/authorize{query}")["success"]

    assert profile.posix_accounts[0].username.startswith("sa_")
    assert (may("login"), may("adminLogin")) == (False, False)
    emulator.iam.grant(PROJECT, caller, OS_LOGIN)
    assert (may("login"), may("adminLogin")) == (True, False)
    emulator.iam.grant(PROJECT, caller, OS_ADMIN_LOGIN)
    assert (may("login"), may("adminLogin")) == (True, True)


def test_a_queued_flex_start_request_deleted_ends_its_insert_with_an_error(gce, emulator):
    """A FLEX_START request still waiting for capacity may be deleted mid-insert (no other insert may).

    Its insert then ends DONE with Compute's 409 CONFLICT (deleted while being created); nothing is left."""
    emulator.set_faults(flex_start_capacity_after=60)
    scheduling = compute_v1.Scheduling(
        provisioning_model="FLEX_START", instance_termination_action="DELETE",
        max_run_duration=compute_v1.Duration(seconds=3600),
    )
    params = compute_v1.InstanceParams(request_valid_for_duration=compute_v1.Duration(seconds=120))
    inserting = insert(gce, tpu_instance("vm-queued", scheduling=scheduling, params=params))
    assert gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-queued").status == "PENDING"

    deleting = gce.instances.delete(project=PROJECT, zone=ZONE, instance="vm-queued")

    inserted = wait(gce, inserting)
    assert (inserted.status, inserted.http_error_status_code, inserted.http_error_message) == (DONE, 409, "CONFLICT")
    assert inserted.error.errors
    assert wait(gce, deleting.name).status == DONE and not wait(gce, deleting.name).error.errors
    assert emulator.instances() == []


class _RecordingFleet:
    """Records what the emulator tells the machines behind its instances (no machine is started)."""

    def __init__(self) -> None:
        self.booted: dict[str, object] = {}

    def allocate(self, key) -> str:
        return "10.77.0.9"

    def boot(self, key, instance, oslogin_url, oslogin_logins, egress, **_) -> None:
        self.booted[key[2]] = egress

    def end(self, key) -> None: ...

    def stop(self) -> None: ...

    def guest_attributes(self, key) -> list:
        return []


@pytest.mark.parametrize(
    ("external_ip", "private_google_access", "nat_subnetworks", "egress"),
    [
        (True, False, "none", "internet"),
        (False, False, "none", "none"),
        (False, True, "none", "google-apis"),
        (False, False, None, "internet"),  # a NAT for all subnetworks of the region
        (False, True, ["other"], "google-apis"),  # a NAT for another subnetwork only
        (False, False, ["default"], "internet"),
    ],
)
def test_a_vm_boots_with_the_egress_its_interface_subnetwork_and_nat_give_it(
    gce, emulator, external_ip, private_google_access, nat_subnetworks, egress
):
    """What the local VM may reach (local/vpc.py) is what Google's network would let it reach."""
    emulator.fleet = _RecordingFleet()
    emulator.add_subnetwork("default", "us-east5", private_google_access=private_google_access)
    if nat_subnetworks != "none":
        emulator.add_router("nat", "us-east5", nat_subnetworks=nat_subnetworks)
    instance = tpu_instance("vm-egress")
    if not external_ip:
        instance.network_interfaces[0].access_configs = []
    insert(gce, instance)
    deadline = time.monotonic() + 30
    while "vm-egress" not in emulator.fleet.booted and time.monotonic() < deadline:
        gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-egress")
        time.sleep(0.05)
    assert emulator.fleet.booted["vm-egress"].value == egress


def test_an_instance_stopped_with_the_emulator_before_it_boots_frees_its_address(gce, emulator, tmp_path):
    """The local VPC's address of an instance still PENDING when the emulator stops is released (no namespace left)."""
    from airflow_tpu_posttrain.local import vpc
    from airflow_tpu_posttrain.local.fleet import LocalFleet

    emulator.fleet = LocalFleet(tmp_path / "disks")
    emulator.set_faults(operation_seconds=600)  # the insert never finishes: the VM never boots
    insert(gce, tpu_instance("vm-never-booted"))
    address = gce.instances.get(project=PROJECT, zone=ZONE, instance="vm-never-booted").network_interfaces[0].network_i_p
    assert Path(f"/run/netns/{vpc.namespace_of(address)}").exists()
    emulator.stop()
    assert not Path(f"/run/netns/{vpc.namespace_of(address)}").exists()
