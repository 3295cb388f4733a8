"""The insert body, names and labels: pure, no API."""

from __future__ import annotations

import re

import pytest

from airflow_tpu_posttrain.recipes import access, compute
from airflow_tpu_posttrain.recipes.validation import SpecError

SEED = dict(project_id="my-project", zones=("us-east5-b",), reservation="my-reservation")


def test_seed_v6e8_body_equals_gcloud_mapping_field_by_field():
    spec = compute.TpuVmSpec(**SEED, network="my-net", tags=("my-tag",), max_run_duration_s=14400)
    body = compute.instance_body(spec, "tpu-x", "us-east5-b", {"managed-by": "airflow-tpu-posttrain"})
    assert body["name"] == "tpu-x"
    # --machine-type=ct6e-standard-8t (derived from v6e-8)
    assert body["machineType"] == "zones/us-east5-b/machineTypes/ct6e-standard-8t"
    # --image-project/--image-family, --boot-disk-size=200GB
    [disk] = body["disks"]
    assert disk["boot"] is True and disk["autoDelete"] is True
    assert disk["initializeParams"] == {
        "sourceImage": "projects/ubuntu-os-accelerator-images/global/images/family/ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
        "diskSizeGb": "200",
    }
    # --maintenance-policy=TERMINATE --instance-termination-action=DELETE --provisioning-model=RESERVATION_BOUND
    assert body["scheduling"] == {
        "onHostMaintenance": "TERMINATE",
        "instanceTerminationAction": "DELETE",
        "provisioningModel": "RESERVATION_BOUND",
        "maxRunDuration": {"seconds": "14400"},
    }
    # --reservation-affinity=specific --reservation=R
    assert body["reservationAffinity"] == {
        "consumeReservationType": "SPECIFIC_RESERVATION",
        "key": "compute.googleapis.com/reservation-name",
        "values": ["my-reservation"],
    }
    # --network=N --tags=T
    assert body["networkInterfaces"][0]["network"] == "global/networks/my-net"
    assert body["tags"] == {"items": ["my-tag"]}
    assert body["labels"] == {"managed-by": "airflow-tpu-posttrain"}
    # What gcloud adds on its own and the raw API does not: the default service account (Google's TPU examples'
    # scope), and an external IP (the default network path).
    assert body["serviceAccounts"] == [
        {"email": "default", "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
    ]
    assert body["networkInterfaces"][0]["accessConfigs"] == [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]
    # Host keys published as guest attributes; metadata keys, not OS Login.
    items = {item["key"]: item["value"] for item in body["metadata"]["items"]}
    assert items == {"enable-guest-attributes": "TRUE", "enable-oslogin": "FALSE"}


def test_ssh_key_goes_into_metadata_in_googles_format_expiring_with_the_vm():
    spec = compute.TpuVmSpec(**SEED)
    line = access.ssh_keys_metadata("airflow", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHk airflow@worker", 1_800_000_000)
    body = compute.instance_body(spec, "tpu-x", "us-east5-b", {}, ssh_keys=line)
    items = {item["key"]: item["value"] for item in body["metadata"]["items"]}
    assert items["ssh-keys"] == (
        'airflow:ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHk google-ssh '
        '{"userName":"airflow","expireOn":"2027-01-15T08:00:00+0000"}'
    )


@pytest.mark.parametrize(
    ("login", "key", "field"),
    [("root", "ssh-ed25519 AAAA", "ssh login"), ("Air Flow", "ssh-ed25519 AAAA", "ssh login"),
     ("airflow", "ssh-dss AAAA", "ssh public key"), ("airflow", "ssh-ed25519 $(x)", "ssh public key")],
)
def test_bad_ssh_identity_is_refused(login, key, field):
    with pytest.raises(SpecError) as err:
        access.ssh_keys_metadata(login, key, 1_800_000_000)
    assert err.value.field == field


def test_internal_path_requests_no_external_ip_and_names_the_subnetwork():
    spec = compute.TpuVmSpec(**SEED, network="vpc", subnetwork="tpu-subnet", network_path="internal")
    [interface] = compute.instance_body(spec, "tpu-x", "us-east5-b", {})["networkInterfaces"]
    assert interface == {"network": "global/networks/vpc", "subnetwork": "regions/us-east5/subnetworks/tpu-subnet"}
    assert not spec.opens_firewall


def test_split_layout_cpu_vm_body_can_write_checkpoint_storage():
    spec = compute.TpuVmSpec(
        project_id="my-project",
        zones=("us-east5-b",),
        accelerator_type="cpu-highmem-16",
        provisioning_model="STANDARD",
        image_project=compute.CPU_IMAGE_PROJECT,
        image_family=compute.CPU_IMAGE_FAMILY,
        service_account="trainer@my-project.iam.gserviceaccount.com",
    )
    body = compute.instance_body(spec, "cpu-x", "us-east5-b", {})
    assert body["machineType"] == "zones/us-east5-b/machineTypes/n2-highmem-16"
    assert body["disks"][0]["initializeParams"]["sourceImage"] == (
        "projects/ubuntu-os-cloud/global/images/family/ubuntu-2204-lts"
    )
    assert body["serviceAccounts"] == [
        {"email": "trainer@my-project.iam.gserviceaccount.com", "scopes": [compute.CLOUD_PLATFORM_SCOPE]}
    ]
    assert "reservationAffinity" not in body


@pytest.mark.parametrize(
    ("accelerator", "machine_type"),
    [("v6e-1", "ct6e-standard-1t"), ("v6e-4", "ct6e-standard-4t"), ("v6e-8", "ct6e-standard-8t")],
)
def test_machine_type_is_derived_from_accelerator(accelerator, machine_type):
    assert compute.TpuVmSpec(**SEED, accelerator_type=accelerator).machine_type == machine_type


@pytest.mark.parametrize("model", ["SPOT", "FLEX_START"])
def test_spot_and_flex_start_consume_no_reservation(model):
    spec = compute.TpuVmSpec(project_id="my-project", zones=("us-east5-b",), provisioning_model=model, max_run_duration_s=3600)
    body = compute.instance_body(spec, "tpu-x", "us-east5-b", {})
    assert body["scheduling"]["provisioningModel"] == model
    assert body["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}


def test_flex_start_sends_its_wait_for_capacity_and_nothing_else_does():
    def body(model, wait):
        spec = compute.TpuVmSpec(
            project_id="my-project", zones=("us-east5-b",), provisioning_model=model, max_run_duration_s=3600,
            capacity_wait_s=wait,
        )
        return compute.instance_body(spec, "tpu-x", "us-east5-b", {})

    assert body("FLEX_START", 1800)["params"] == {"requestValidForDuration": {"seconds": "1800"}}
    assert "params" not in body("FLEX_START", 0)  # no wait: capacity now or a stock-out
    assert "params" not in body("SPOT", 1800)


@pytest.mark.parametrize(
    ("reservation", "zones", "expected"),
    [
        ("r", ("us-east5-b",), {"us-east5-b": "r"}),
        ("projects/host-project/reservations/r", ("us-east5-b",), {"us-east5-b": "projects/host-project/reservations/r"}),
        (
            "projects/host-project/reservations/r/reservationBlocks/b",
            ("us-east5-b",),
            {"us-east5-b": "projects/host-project/reservations/r/reservationBlocks/b"},
        ),
        ("us-east5-a=ra,us-east5-b=rb", ("us-east5-a", "us-east5-b"), {"us-east5-a": "ra", "us-east5-b": "rb"}),
    ],
)
def test_reservation_forms(reservation, zones, expected):
    assert compute.reservations_by_zone(reservation, zones) == expected
    spec = compute.TpuVmSpec(project_id="my-project", zones=zones, reservation=reservation)
    for zone in zones:
        affinity = compute.instance_body(spec, "tpu-x", zone, {})["reservationAffinity"]
        assert affinity["values"] == [expected[zone]]


def test_ssh_firewall_admits_the_given_ranges_to_the_instance_only():
    spec = compute.TpuVmSpec(**SEED, ssh_source_ranges=("203.0.113.0/24",))
    body = compute.instance_body(spec, "tpu-x", "us-east5-b", {})
    rule = compute.ssh_firewall_body(spec, "tpu-x")
    assert body["tags"]["items"] == ["tpu-x"]
    assert rule["targetTags"] == ["tpu-x"] and rule["sourceRanges"] == ["203.0.113.0/24"]
    assert rule["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]


def test_iap_path_has_no_external_ip_and_a_rule_for_iaps_range_only():
    spec = compute.TpuVmSpec(**SEED, network_path="iap")
    body = compute.instance_body(spec, "tpu-x", "us-east5-b", {})
    assert "accessConfigs" not in body["networkInterfaces"][0] and body["tags"]["items"] == ["tpu-x"]
    assert compute.ssh_firewall_body(spec, "tpu-x")["sourceRanges"] == ["35.235.240.0/20"]


def test_instance_name_is_deterministic_valid_and_distinct_per_run():
    dag_id = "posttrain_sft__Gemma3-4B.with_a_very_long_name_that_keeps_going_and_going_and_going"
    first = compute.instance_name(dag_id, "manual__2026-11-29T10:00:00+00:00")
    assert first == compute.instance_name(dag_id, "manual__2026-11-29T10:00:00+00:00")
    assert first != compute.instance_name(dag_id, "manual__2026-11-29T11:00:00+00:00")
    # The same DAG run of two deployments sharing the project (same DAG files, same schedule): two VMs.
    scheduled = "scheduled__2026-11-29T00:00:00+00:00"
    staging, production = (compute.instance_name(dag_id, scheduled, "tpu", d) for d in ("airflow-stg", "airflow-prd"))
    assert staging != production and len(staging) == len(production)
    assert len(first) <= 63 and re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", first)


def test_firewall_rules_of_two_runs_of_a_long_named_dag_stay_apart():
    """Two runs' rules never share a name, however long the DAG's.

    Instance names differ only in their hash's 10 characters at the end; a rule name cut to 56 characters kept a
    few of them, and runs collided (found here among a few thousand run ids)."""
    dag_id = "posttrain_sft__a_model_whose_name_is_long_enough_to_be_cut_short"
    seen: dict[str, str] = {}
    for day in range(20_000):
        name = compute.instance_name(dag_id, f"manual__run-{day}")
        if name[:56] in seen:
            first, second = seen[name[:56]], name
            break
        seen[name[:56]] = name
    assert len(first) > 56 and first != second
    rules = [compute.firewall_name(name) for name in (first, second)]
    assert rules[0] != rules[1]
    assert all(len(r) <= 63 and re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", r) for r in rules)
    assert compute.firewall_name("tpu-short-0123456789") == "tpu-short-0123456789-ssh"


def test_ownership_labels_are_valid_compute_labels():
    labels = compute.ownership_labels(
        "Posttrain.SFT", "scheduled__2026-11-29T00:00:00+00:00", "create_tpu_vm", 1_800_000_000, "airflow-prd"
    )
    assert labels["managed-by"] == "airflow-tpu-posttrain" and labels["airflow-deployment"] == "airflow-prd"
    # What a user may add is Compute's 64 less exactly these (TpuVmSpec.labels).
    assert set(labels) | {compute.CAPACITY_GROUP_LABEL} == compute.PIPELINE_LABELS
    assert labels["expires-at"] == "1800000000"
    for key, value in labels.items():
        assert re.match(r"^[a-z][a-z0-9_-]{0,62}$", key) and re.match(r"^[a-z0-9_-]{0,63}$", value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"accelerator_type": "v7-8"}, "accelerator_type"),
        ({"zones": ("us-east5",)}, "zones[0]"),
        ({"zones": ("us-east5-b; rm -rf /",)}, "zones[0]"),
        ({"zones": ()}, "zones"),
        ({"reservation": None}, "reservation"),
        ({"provisioning_model": "ON_DEMAND"}, "provisioning_model"),
        ({"labels": {"Team": "x"}}, "labels.Team"),
        ({"labels": {"team": "Has Spaces"}}, "labels.team"),
        # Compute's 64 labels per VM, the pipeline's own 8 among them; and none of the pipeline's keys.
        ({"labels": {f"team-{i}": "x" for i in range(57)}}, "labels"),
        ({"labels": {"expires-at": "9999999999"}}, "labels.expires-at"),
        ({"network": "Bad_Net"}, "network"),
        ({"max_run_duration_s": 10}, "max_run_duration"),
        ({"provisioning_model": "FLEX_START", "reservation": None}, "max_run_duration"),
        ({"provisioning_model": "FLEX_START", "reservation": None, "max_run_duration_s": 300}, "max_run_duration"),
        ({"provisioning_model": "FLEX_START", "reservation": None, "max_run_duration_s": 8 * 86400}, "max_run_duration"),
        (
            {"provisioning_model": "FLEX_START", "reservation": None, "max_run_duration_s": 3600,
             "capacity_wait_s": 3 * 3600},
            "max_wait_for_capacity",
        ),
        ({"zones": ("us-east5-a", "us-east5-b")}, "reservation"),  # one zonal reservation, two zones
        ({"zones": ("us-east5-a", "us-east5-b"), "reservation": "us-east5-a=r"}, "reservation"),
        ({"reservation": "projects/p/reservations/r"}, "reservation"),  # not a project id
        ({"reservation": "r;id"}, "reservation"),
        ({"provisioning_model": "SPOT"}, "reservation"),
        ({"ssh_key_mode": "password"}, "ssh_key_mode"),
        ({"service_account_scopes": ("cloud-platform",)}, "service_account_scopes[0]"),
        ({"service_account_scopes": ()}, "service_account_scopes"),
        ({"service_account": "me@gmail.com"}, "service_account"),
        ({"subnetwork": "regions/us-east5/subnetworks/x"}, "subnetwork"),
        ({"network_path": "tunnel"}, "network_path"),
        ({"network_path": "iap", "ssh_source_ranges": ("10.0.0.0/8",)}, "ssh_source_ranges"),
        ({"ssh_source_ranges": ("0.0.0.0/33",)}, "ssh_source_ranges[0]"),
    ],
)
def test_bad_input_names_the_field(overrides, field):
    with pytest.raises(SpecError) as err:
        compute.TpuVmSpec(**{**SEED, **overrides})
    assert err.value.field == field
    assert "Fix:" in str(err.value)


def test_error_classification():
    assert compute.classify_errors([{"code": "ZONE_RESOURCE_POOL_EXHAUSTED"}]) == compute.ErrorKind.CAPACITY
    assert compute.classify_errors([{"code": "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"}]) == compute.ErrorKind.CAPACITY
    assert compute.classify_errors([{"code": "QUOTA_EXCEEDED", "message": "Quota 'TPU_V6E_CHIPS'"}]) == compute.ErrorKind.QUOTA
    assert compute.classify_errors([{"code": "RESERVATION_NOT_FOUND"}]) == compute.ErrorKind.RESERVATION
    assert compute.classify_errors([{"code": "INTERNAL_ERROR"}]) == compute.ErrorKind.OTHER


def test_a_body_expires_when_it_is_made_its_label_and_every_ssh_key():
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    body = {
        "labels": {"expires-at": "100", "managed-by": "airflow-tpu-posttrain"},
        "metadata": {"items": [
            {"key": "ssh-keys", "value": access.ssh_keys_metadata("airflow", key, 100)},
            {"key": "enable-oslogin", "value": "FALSE"},
        ]},
    }
    made = compute.expiring_at(body, 1_900_000_000)
    assert made["labels"] == {"expires-at": "1900000000", "managed-by": "airflow-tpu-posttrain"}
    assert made["metadata"]["items"][0]["value"] == access.ssh_keys_metadata("airflow", key, 1_900_000_000)
    assert made["metadata"]["items"][1] == {"key": "enable-oslogin", "value": "FALSE"}
    assert body["labels"]["expires-at"] == "100"  # the trigger's own body is left as it was
