"""Bodies checked against Compute's own v1 discovery document: what the real API refuses, in its words."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from airflow_tpu_posttrain.local import compute_schema
from airflow_tpu_posttrain.local.compute_schema import SchemaError, enum_values, validate
from airflow_tpu_posttrain.recipes import compute

LABELS = {"managed-by": "airflow-tpu-posttrain"}


def _body(**spec: object) -> dict:
    base: dict = {"project_id": "test-project", "zones": ("us-east5-b",)}
    return compute.instance_body(compute.TpuVmSpec(**{**base, **spec}), "tpu-x", "us-east5-b", LABELS)


def _refusal(body: dict, schema: str = "Instance") -> SchemaError:
    with pytest.raises(SchemaError) as caught:
        validate(schema, body)
    assert caught.value.reason == "invalid"
    return caught.value


@pytest.mark.parametrize(
    "spec",
    [
        {"reservation": "r1"},
        {"provisioning_model": "SPOT", "max_run_duration_s": 3600, "reservation": None},
        {"provisioning_model": "FLEX_START", "max_run_duration_s": 3600, "reservation": None},
    ],
    ids=["reservation-bound", "spot", "flex-start"],
)
def test_the_providers_insert_bodies_pass(spec):
    validate("Instance", _body(**spec))


def test_the_providers_firewall_body_passes():
    spec = compute.TpuVmSpec(project_id="test-project", zones=("us-east5-b",), reservation="r1")
    # The rule's builder, under its name before and after the SSH-access rework of recipes/compute.py.
    firewall_body = compute.ssh_firewall_body
    validate("Firewall", firewall_body(spec, "tpu-x"))


def test_guest_attributes_metadata_service_account_and_subnetwork_pass():
    validate(
        "Instance",
        {
            "metadata": {
                "items": [
                    {"key": "enable-guest-attributes", "value": "TRUE"},
                    {"key": "ssh-keys", "value": "airflow:ssh-ed25519 AAAAC3Nza airflow"},
                ]
            },
            "serviceAccounts": [
                {"email": "default", "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
            ],
            "networkInterfaces": [
                {"network": "global/networks/default", "subnetwork": "regions/us-east5/subnetworks/default"}
            ],
        },
    )


def test_params_request_valid_for_duration_is_in_this_doc_and_passes():
    assert "requestValidForDuration" in compute_schema._schemas()["InstanceParams"]["properties"]
    validate("Instance", {"params": {"requestValidForDuration": {"seconds": "3600"}}})


def test_output_only_fields_nulls_and_int64_as_integer_are_accepted_as_the_real_api_accepts_them():
    validate(
        "Instance",
        {
            "kind": "compute#instance",
            "id": "1234567890",
            "status": "RUNNING",
            "selfLink": "https://compute.googleapis.com/compute/v1/projects/p/zones/z/instances/x",
            "description": None,
            "scheduling": {"maxRunDuration": {"seconds": 3600, "nanos": 0}},
        },
    )


def test_one_value_where_a_list_belongs_is_read_as_a_one_element_list_as_googles_converter_does():
    validate("Firewall", {"sourceRanges": "35.235.240.0/20", "allowed": {"IPProtocol": "tcp"}})
    assert _refusal({"allowed": {"bogus": 1}}, "Firewall").field == "resource.allowed.bogus"


def test_an_unknown_top_level_field_is_refused_with_googles_words():
    error = _refusal({**_body(reservation="r1"), "foo": 1})
    assert error.field == "resource.foo"
    assert error.message == (
        "Invalid JSON payload received. Unknown name \"foo\" at 'resource': Cannot find field."
    )


@pytest.mark.parametrize(
    ("where", "field", "location"),
    [
        ("scheduling", "resource.scheduling.preemptable", "resource.scheduling"),
        ("nic", "resource.networkInterfaces[0].preemptable", "resource.network_interfaces[0]"),
        ("access-config", "resource.networkInterfaces[0].accessConfigs[0].preemptable", None),
    ],
)
def test_an_unknown_nested_field_is_refused_naming_its_path(where, field, location):
    body = _body(reservation="r1")
    if where == "scheduling":
        body["scheduling"]["preemptable"] = True
    elif where == "nic":
        body["networkInterfaces"][0]["preemptable"] = True
    else:
        body["networkInterfaces"][0]["accessConfigs"] = [{"type": "ONE_TO_ONE_NAT", "preemptable": True}]
    error = _refusal(body)
    assert error.field == field
    assert 'Unknown name "preemptable"' in error.message and error.message.endswith("Cannot find field.")
    if location:
        assert f"at '{location}'" in error.message


def test_an_unknown_enum_value_is_refused_with_googles_words():
    body = _body(reservation="r1")
    body["scheduling"]["provisioningModel"] = "CHEAP"
    error = _refusal(body)
    assert error.field == "resource.scheduling.provisioningModel"
    assert error.message == (
        "Invalid value at 'resource.scheduling.provisioning_model' "
        '(type.googleapis.com/compute.Scheduling.ProvisioningModel), "CHEAP"'
    )


def test_an_enum_inside_lists_is_checked_too():
    body = _body(reservation="r1")
    body["networkInterfaces"][0]["accessConfigs"] = [{"type": "ONE_TO_ONE"}]
    error = _refusal(body)
    assert error.field == "resource.networkInterfaces[0].accessConfigs[0].type"
    assert "(type.googleapis.com/compute.AccessConfig.Type), \"ONE_TO_ONE\"" in error.message


@pytest.mark.parametrize(
    ("patch", "field", "message"),
    [
        (
            {"labels": ["a"]},
            "resource.labels",
            "Invalid JSON payload received. Unknown name \"labels\" at 'resource': "
            "Proto field is not repeating, cannot start list.",
        ),
        (
            {"name": {"value": "tpu-x"}},
            "resource.name",
            "Invalid value at 'resource' (name), Starting an object on a scalar field",
        ),
        ({"name": 7}, "resource.name", "Invalid value at 'resource.name' (TYPE_STRING), 7"),
        (
            {"canIpForward": "yes"},
            "resource.canIpForward",
            "Invalid value at 'resource.can_ip_forward' (TYPE_BOOL), \"yes\"",
        ),
        (
            {"scheduling": {"maxRunDuration": {"seconds": "1h"}}},
            "resource.scheduling.maxRunDuration.seconds",
            "Invalid value at 'resource.scheduling.max_run_duration.seconds' (TYPE_INT64), \"1h\"",
        ),
        (
            {"scheduling": "SPOT"},
            "resource.scheduling",
            "Invalid value at 'resource.scheduling' (type.googleapis.com/compute.Scheduling), \"SPOT\"",
        ),
        ({"labels": {"team": 7}}, 'resource.labels["team"]', None),
    ],
    ids=[
        "list-for-map",
        "object-for-string",
        "number-for-string",
        "string-for-bool",
        "bad-int64",
        "string-for-message",
        "number-in-map",
    ],
)
def test_a_type_mismatch_is_refused_naming_the_field(patch, field, message):
    error = _refusal({**_body(reservation="r1"), **patch})
    assert error.field == field
    if message:
        assert error.message == message
    assert str(error) == error.message


def test_enum_values_come_from_the_same_document():
    assert set(compute.PROVISIONING_MODELS) <= set(enum_values("Scheduling", "provisioningModel"))
    assert "ONE_TO_ONE_NAT" in enum_values("Instance", "networkInterfaces.accessConfigs.type")
    assert enum_values("Firewall", "direction") == ["EGRESS", "INGRESS"]
    with pytest.raises(KeyError):
        enum_values("Scheduling", "provisioningModle")
    with pytest.raises(ValueError, match="not an enum"):
        enum_values("Scheduling", "maxRunDuration")


def test_the_document_is_read_without_importing_the_client():
    code = (
        "import sys; from airflow_tpu_posttrain.local.compute_schema import validate; "
        "validate('Scheduling', {'provisioningModel': 'SPOT'}); "
        "assert 'googleapiclient' not in sys.modules, sorted(m for m in sys.modules if 'google' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_the_client_installed_the_error_says_what_to_install(monkeypatch):
    compute_schema._schemas.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    try:
        with pytest.raises(ModuleNotFoundError, match="pip install google-api-python-client"):
            validate("Instance", {})
    finally:
        compute_schema._schemas.cache_clear()


def test_every_instance_status_compute_answers_is_either_live_or_dead():
    """A status the pipeline does not know would be neither reused nor replaced, nor taken for a lost VM."""
    statuses = set(enum_values("Instance", "status"))
    assert statuses == compute.LIVE_STATES | compute.DEAD_STATES
    assert not compute.LIVE_STATES & compute.DEAD_STATES
