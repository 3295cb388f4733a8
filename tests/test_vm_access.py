"""Reaching a fresh VM as on Compute Engine.

The connection's key in the VM's metadata, host keys pinned from guest attributes, the network checked before
the insert; and the emulator refusing what the real API refuses."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from conftest import PROJECT, RUNNER_ACCOUNT, access_token, emulator_credentials, log_excerpt
from test_tpu_vm_operators import inserts, lifecycle, no_instances_within, task_states, xcom

STEP_DAG = """
from datetime import datetime
from airflow.sdk import DAG
from airflow_tpu_posttrain.operators.maxtext import MaxTextInstallOperator
from airflow_tpu_posttrain.operators.tpu_delete import TpuDeleteOperator
from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator

with DAG("{dag_id}", schedule=None, start_date=datetime(2026, 1, 1), catchup=False,
         render_template_as_native_obj=True):
    create = TpuVmCreateOperator(
        task_id="create_tpu_vm", zones=["us-east5-b"], reservation="my-reservation", poll_interval=0.2,
        max_tpu_vms=None,
    )
    install = MaxTextInstallOperator(
        task_id="install_maxtext", vm=create.output, model="tiny-llama", maxtext_venv="/var/tmp/venv",
        retries=0,
    )
    delete = TpuDeleteOperator(task_id="delete_tpu_vm", zones=["us-east5-b"], poll_interval=0.2)
    create >> install >> delete.as_teardown(setups=create)
"""


def _post(url: str, body: dict, token: str) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"name": "tpu-x", "acceleratorType": "v6e-8"}, "Unknown name \"acceleratorType\" at 'resource'"),
        ({"name": "tpu-x", "scheduling": {"provisioningModel": "CHEAP"}}, '"CHEAP"'),
    ],
)
def test_emulator_answers_400_for_what_compute_v1_does_not_know(emulator, body, message):
    url = f"{emulator.url}/compute/v1/projects/{PROJECT}/zones/us-east5-b/instances"
    status, answer = _post(url, body, access_token(emulator_credentials(emulator)))
    assert status == 400 and message in answer["error"]["message"]
    assert answer["error"]["errors"][0]["reason"] == "invalid"
    assert emulator.instances() == []


def test_custom_mode_network_without_subnetwork_fails_before_the_insert(
    emulator, run_dag, capfd, fault_matrix
):
    emulator.add_network("tpu-vpc", custom_mode=True)
    body = lifecycle("access_custom_vpc", tasks="create", create_kwargs='network="tpu-vpc"')
    dr = run_dag("access_custom_vpc", body)
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "subnetwork=None: is required: network 'tpu-vpc' is a custom-mode VPC" in logs
    assert inserts(emulator) == []
    fault_matrix.record(
        "access: custom-mode VPC without subnetwork -> refused before the insert",
        None,
        dr.state,
        None,
        log_excerpt(logs, "subnetwork=None"),
    )


def test_a_vm_without_external_ip_needs_cloud_nat_and_private_google_access_before_the_insert(
    emulator, run_dag, capfd, fault_matrix
):
    """network_path internal without Cloud NAT or Private Google Access: refused before anything is created.

    No external IP, so the install and the Hub download need Cloud NAT and every gs:// step needs Private Google
    Access; Google makes neither for you."""
    def run(dag_id: str):
        zones = ("us-east5-b", "us-east5-a")
        return run_dag(dag_id, lifecycle(dag_id, zones, tasks="create", create_kwargs='network_path="internal"'))

    dr = run("access_no_egress")
    logs = "".join(capfd.readouterr())
    assert dr.state == "failed" and task_states(dr)["create_tpu_vm"] == "failed"
    assert "subnetwork 'default' in us-east5 has no Private Google Access" in logs
    assert "--enable-private-ip-google-access" in logs
    assert "no Cloud NAT covers subnetwork 'default' in us-east5" in logs
    assert "gcloud compute routers nats create" in logs
    assert inserts(emulator) == []

    # A NAT for another subnetwork only does not cover it; one that lists it does.
    emulator.add_subnetwork("default", "us-east5", private_google_access=True)
    emulator.add_router("other-nat", "us-east5", nat_subnetworks=["other-subnet"])
    dr = run("access_nat_elsewhere")
    logs = "".join(capfd.readouterr())
    assert dr.state == "failed" and "no Cloud NAT covers subnetwork 'default'" in logs
    assert "Private Google Access" not in logs
    assert inserts(emulator) == []
    emulator.add_router("posttrain-nat", "us-east5", nat_subnetworks=["default"])
    dr = run("access_egress")
    assert dr.state == "success", task_states(dr)
    assert len(inserts(emulator)) == 1
    fault_matrix.record(
        "access: no external IP without Cloud NAT / Private Google Access -> refused before the insert",
        None,
        "failed",
        None,
        "no Cloud NAT covers subnetwork 'default' in us-east5",
    )


def test_vm_without_guest_environment_fails_the_create_and_is_deleted(emulator, run_dag, capfd, fault_matrix):
    emulator.set_faults(no_guest_environment=True)
    kwargs = "ready_timeout=__import__('datetime').timedelta(seconds=8)"
    dr = run_dag("access_no_guest", lifecycle("access_no_guest", create_kwargs=kwargs))
    assert task_states(dr)["create_tpu_vm"] == "failed" and dr.state == "failed"
    logs = "".join(capfd.readouterr())
    assert "published no SSH host keys within 8 s" in logs and "The VM was deleted" in logs
    assert no_instances_within(emulator, seconds=10)
    fault_matrix.record(
        "access: VM never publishes its host keys -> create fails, VM deleted",
        True,
        dr.state,
        None,
        log_excerpt(logs, "published no SSH host keys"),
    )


def test_a_machine_with_other_host_keys_is_refused_by_the_first_ssh_step(
    emulator, run_dag, capfd, fault_matrix
):
    emulator.set_faults(impostor_host_keys=True)
    dr = run_dag("access_impostor", STEP_DAG.format(dag_id="access_impostor"))
    states = task_states(dr)
    # The first SSH step is the create's own login check: the create fails, nothing after it runs.
    assert states["create_tpu_vm"] == "failed" and states["install_maxtext"] == "upstream_failed", states
    logs = "".join(capfd.readouterr())
    assert re.search(r"The machine at [\d.]+:22 presented the ssh-ed25519 host key", logs)
    assert "which is not the one the VM published" in logs
    assert "Started job" not in logs  # nothing was run on the impostor
    assert no_instances_within(emulator)
    fault_matrix.record(
        "access: the VM's host key differs from its guest attribute -> the create refuses to connect, VM deleted",
        True,
        "failed",
        None,
        log_excerpt(logs, "presented the ssh-ed25519 host key"),
    )


def test_oslogin_mode_puts_the_key_in_os_login_and_the_vm_takes_only_its_posix_name(
    emulator, run_dag, capfd, client_key, fault_matrix
):
    import paramiko

    from airflow_tpu_posttrain.hooks.vm import VmHook, VmHookAsync
    from airflow_tpu_posttrain.local.oslogin import posix_username

    user = "airflow-runner@my-project.iam.gserviceaccount.com"
    kwargs = f'ssh_key_mode="oslogin", oslogin_user="{user}"'
    dr = run_dag("access_oslogin", lifecycle("access_oslogin", tasks="create", create_kwargs=kwargs))
    assert dr.state == "success", task_states(dr)
    logs = "".join(capfd.readouterr())
    vm, login = xcom(dr, "create_tpu_vm"), posix_username(user)
    assert vm["ssh_login"] == login
    [insert] = inserts(emulator)
    metadata = {item["key"]: item["value"] for item in insert["body"]["metadata"]["items"]}
    assert metadata["enable-oslogin"] == "TRUE" and "ssh-keys" not in metadata
    # Before the insert, and again once RUNNING (a retry reusing the VM renews the key the same way).
    imports = [r for r in emulator.requests if r["path"].endswith(":importSshPublicKey")]
    public = " ".join(client_key.with_suffix(".pub").read_text().split()[:2])
    assert imports and {r["path"] for r in imports} == {f"/v1/users/{user.replace('@', '%40')}:importSshPublicKey"}
    assert {r["body"]["key"] for r in imports} == {public}
    expires_at = int(imports[0]["body"]["expirationTimeUsec"]) / 1e6
    assert 0 < expires_at - dr.start_date.timestamp() <= 13 * 3600  # with the VM (12 h backstop, no DAG timeout)

    # What every SSH step does, in the worker and in the triggerer: log in as the OS Login name, host keys pinned.
    pinned = {"ssh_conn_id": "tpu_vm_ssh", "host_keys": vm["host_keys"]}
    with VmHook(remote_host=vm["ssh_address"], username=login, **pinned) as session:
        assert session.run("id -un").strip() == login
    hook = VmHookAsync(host=vm["ssh_address"], username=login, **pinned)
    assert asyncio.run(hook.run_command("id -un"))[1].strip() == login
    # The connection's own login with the same key is not let in: the key is in OS Login, not in the metadata.
    with pytest.raises(paramiko.AuthenticationException), VmHook(remote_host=vm["ssh_address"], **pinned):
        pass
    fault_matrix.record(
        "access: OS Login mode -> key in the OS Login profile, the VM lets in only its POSIX name",
        None,
        dr.state,
        None,
        log_excerpt(logs, f"login {login}"),
    )


def iap_gcloud(emulator, tmp_path, monkeypatch, account: str = "", roles: tuple[str, ...] = ()):
    """The iap path's prerequisites: gcloud (the stand-in) on the PATH, Private Google Access, NAT.

    gcloud has no account of its own: the pipeline runs it as the Google connection's (the runner's, or
    ``account`` granted ``roles`` when given)."""
    import os

    from airflow_tpu_posttrain.local.iap_tunnel import ENDPOINT_VARIABLE
    from airflow_tpu_posttrain.local.stack import write_gcloud_stand_in

    write_gcloud_stand_in(tmp_path / "bin")  # gcloud compute start-iap-tunnel, reading the emulator
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(ENDPOINT_VARIABLE, f"{emulator.url}/compute/v1/")
    monkeypatch.delenv("CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE", raising=False)
    if account:
        key = emulator.service_account_key(account, *roles, project=PROJECT)
        extra = {"keyfile_dict": json.dumps(key), "project": PROJECT, "compute_api_endpoint": emulator.url,
                 "oslogin_api_endpoint": emulator.url}
        connection = {"conn_type": "google_cloud_platform", "extra": extra}
        monkeypatch.setenv("AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT", json.dumps(connection))
    emulator.add_subnetwork("default", "us-east5", private_google_access=True)
    emulator.add_router("nat-router", "us-east5")


def test_iap_path_reaches_the_vm_only_through_the_tunnel_and_its_rule(
    emulator, run_dag, capfd, tmp_path, monkeypatch, fault_matrix
):
    import paramiko
    from google.cloud import compute_v1

    from airflow_tpu_posttrain.hooks.vm import VmHook, VmHookAsync, proxy_command_as

    iap_gcloud(emulator, tmp_path, monkeypatch)
    dr = run_dag("access_iap", lifecycle("access_iap", tasks="create", create_kwargs='network_path="iap"'))
    assert dr.state == "success", task_states(dr)
    vm = xcom(dr, "create_tpu_vm")
    assert vm["external_ip"] is None and vm["ssh_address"] == vm["internal_ip"]
    tunnel = f"gcloud compute start-iap-tunnel {vm['name']} 22 --listen-on-stdin --project={PROJECT} --zone=us-east5-b"
    assert vm["ssh_proxy_command"].startswith(tunnel)
    [rule] = emulator.firewalls()
    assert rule["sourceRanges"] == ["35.235.240.0/20"] and rule["targetTags"] == [vm["name"]]

    # The tunnel runs as the Google connection that made the VM: its record names the connection, no credential.
    assert vm["ssh_proxy_account"] == {"gcp_conn_id": "google_cloud_default", "impersonation_chain": None}
    pinned = {"ssh_conn_id": "tpu_vm_ssh", "host_keys": vm["host_keys"], "proxy_command": vm["ssh_proxy_command"]}
    with VmHook(remote_host=vm["ssh_address"], proxy_account=vm["ssh_proxy_account"], **pinned) as session:
        assert session.run("id -un").strip() == "posttrain"
    hook = VmHookAsync(host=vm["ssh_address"], proxy_account=vm["ssh_proxy_account"], **pinned)
    assert asyncio.run(hook.run_command("id -un"))[1].strip() == "posttrain"
    # gcloud without the connection's account has none (no gcloud auth on this machine).
    alone = subprocess.run(vm["ssh_proxy_command"], shell=True, capture_output=True, text=True, input="")
    assert alone.returncode == 1 and "You do not currently have an active account selected" in alone.stderr

    # Without a rule admitting IAP's range, the tunnel cannot reach the VM (IAP's 4003).
    options = {"api_endpoint": emulator.url}
    firewalls = compute_v1.FirewallsClient(transport="rest", client_options=options, credentials=emulator_credentials(emulator))
    firewalls.delete(project=PROJECT, firewall=rule["name"])
    deadline = time.monotonic() + 5
    while emulator.firewalls() and time.monotonic() < deadline:
        time.sleep(0.1)
    as_connection = proxy_command_as(vm["ssh_proxy_command"], vm["ssh_proxy_account"])
    refused = subprocess.run(as_connection, shell=True, capture_output=True, text=True, input="")
    assert refused.returncode == 1 and "4003: 'failed to connect to backend'" in refused.stderr
    # The refused tunnel ends at once; paramiko waits out its banner timeout (30 s by default) all the same.
    with pytest.raises(paramiko.SSHException), VmHook(
        remote_host=vm["ssh_address"], proxy_account=vm["ssh_proxy_account"], banner_timeout=5, **pinned
    ):
        pass
    fault_matrix.record(
        "access: IAP path -> only through the tunnel, and only while a rule admits IAP's range",
        None,
        dr.state,
        None,
        refused.stderr.strip()[:80],
    )


def test_iap_without_the_tunnel_role_fails_at_once_naming_it(emulator, run_dag, capfd, tmp_path, monkeypatch, fault_matrix):
    """The Google connection's account lacks roles/iap.tunnelResourceAccessor: IAP answers 4033; no wait mends it."""
    account = "no-tunnel@my-project.iam.gserviceaccount.com"
    iap_gcloud(emulator, tmp_path, monkeypatch, account, roles=("roles/compute.instanceAdmin.v1",))
    create_kwargs = 'network_path="iap", ready_timeout=__import__("datetime").timedelta(seconds=120)'
    started = time.monotonic()
    dr = run_dag("access_iap_role", lifecycle("access_iap_role", create_kwargs=create_kwargs))
    waited = time.monotonic() - started
    logs = "".join(capfd.readouterr())
    assert dr.state == "failed" and task_states(dr)["create_tpu_vm"] in ("failed", "up_for_retry")
    assert "4033: 'not authorized'" in logs and "roles/iap.tunnelResourceAccessor" in logs
    assert waited < 110  # ended by what the tunnel said, not by the 120 s readiness timeout
    assert no_instances_within(emulator, seconds=30)
    fault_matrix.record(
        "access: IAP path, the connection's account without roles/iap.tunnelResourceAccessor -> fails at once naming it",
        True, dr.state, None, log_excerpt(logs, "4033"),
    )


def test_iap_through_a_connections_impersonation_chain(emulator, run_dag, tmp_path, monkeypatch):
    """A connection whose account may not tunnel but may impersonate one that may: the tunnel runs as that one.

    As providers-google's SSH hook: gcloud --impersonate-service-account, which asks IAM Credentials for the
    impersonated account's token (roles/iam.serviceAccountTokenCreator); without that role gcloud says so."""
    import paramiko

    from airflow_tpu_posttrain.hooks.vm import VmHook, proxy_command_as
    from airflow_tpu_posttrain.local.iam import IAP_TUNNEL_USER, TOKEN_CREATOR

    iap_gcloud(emulator, tmp_path, monkeypatch)
    dr = run_dag("access_iap_chain", lifecycle("access_iap_chain", tasks="create", create_kwargs='network_path="iap"'))
    assert dr.state == "success", task_states(dr)
    vm = xcom(dr, "create_tpu_vm")
    tunneller = f"tunneller@{PROJECT}.iam.gserviceaccount.com"
    emulator.service_account_key(tunneller, IAP_TUNNEL_USER, project=PROJECT)  # exists, may tunnel
    pinned = {"ssh_conn_id": "tpu_vm_ssh", "host_keys": vm["host_keys"], "proxy_command": vm["ssh_proxy_command"]}
    for conn_id, roles in (("gcp_token_creator", (TOKEN_CREATOR,)), ("gcp_no_token_creator", ())):
        key = emulator.service_account_key(f"{conn_id.replace('_', '-')}@{PROJECT}.iam.gserviceaccount.com", *roles,
                                           project=PROJECT)
        connection = {"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": json.dumps(key)}}
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(connection))
    # As its own account the connection may not tunnel; through the chain it may.
    alone = proxy_command_as(vm["ssh_proxy_command"], {"gcp_conn_id": "gcp_token_creator"})
    refused = subprocess.run(alone, shell=True, capture_output=True, text=True, input="")
    assert refused.returncode == 1 and "4033: 'not authorized'" in refused.stderr
    chain = {"gcp_conn_id": "gcp_token_creator", "impersonation_chain": [tunneller]}
    assert proxy_command_as(vm["ssh_proxy_command"], chain).endswith(f" --impersonate-service-account={tunneller}")
    with VmHook(remote_host=vm["ssh_address"], proxy_account=chain, **pinned) as session:
        assert session.run("id -un").strip() == "posttrain"
    asked = [r for r in emulator.requests if r["path"].endswith(":generateAccessToken")]
    assert asked and all(tunneller in r["path"] for r in asked)

    no_creator = {"gcp_conn_id": "gcp_no_token_creator", "impersonation_chain": tunneller}
    said = subprocess.run(proxy_command_as(vm["ssh_proxy_command"], no_creator), shell=True, capture_output=True,
                          text=True, input="")
    assert said.returncode == 1 and f"Failed to impersonate [{tunneller}]" in said.stderr
    with pytest.raises(paramiko.SSHException), VmHook(
        remote_host=vm["ssh_address"], proxy_account=no_creator, banner_timeout=5, **pinned
    ):
        pass


def test_oslogin_into_another_accounts_profile_is_refused_before_anything_is_created(
    emulator, run_dag, capfd, fault_matrix
):
    """OS Login adds keys to the caller's own profile only: another account's is a 403, named with the fix."""
    kwargs = 'ssh_key_mode="oslogin", oslogin_user="someone-else@my-project.iam.gserviceaccount.com"'
    dr = run_dag("access_oslogin_other", lifecycle("access_oslogin_other", create_kwargs=kwargs))
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "OS Login refused to add the SSH key to someone-else@my-project.iam.gserviceaccount.com's profile" in logs
    assert "The caller does not have permission" in logs and inserts(emulator) == []
    fault_matrix.record(
        "access: OS Login into another account's profile -> 403, fails before any VM with the fix",
        None, dr.state, None, log_excerpt(logs, "OS Login refused"),
    )


def test_oslogin_account_without_a_login_role_fails_naming_the_role_and_deletes_the_vm(
    emulator, run_dag, capfd, fault_matrix, monkeypatch
):
    """The key is in the caller's profile, but the VM lets an account in only with an OS Login role."""
    from airflow_tpu_posttrain.local.iam import OS_ADMIN_LOGIN
    from airflow_tpu_posttrain.operators import vm_login

    monkeypatch.setattr(vm_login, "LOGIN_GRACE", __import__("datetime").timedelta(seconds=4))
    emulator.iam.revoke(PROJECT, RUNNER_ACCOUNT, OS_ADMIN_LOGIN)
    dr = run_dag("access_oslogin_norole", lifecycle("access_oslogin_norole", create_kwargs='ssh_key_mode="oslogin"'))
    logs = "".join(capfd.readouterr())
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "refused Airflow's SSH login" in logs and "needs roles/compute.osAdminLogin" in logs
    assert len(inserts(emulator)) == 1 and no_instances_within(emulator, seconds=30)
    fault_matrix.record(
        "access: OS Login account without roles/compute.osAdminLogin -> the create fails naming it, VM deleted",
        True, dr.state, None, log_excerpt(logs, "needs roles/compute.osAdminLogin"),
    )


def test_oslogin_user_that_is_not_an_email_fails_before_anything_is_created(emulator, run_dag, capfd):
    kwargs = 'ssh_key_mode="oslogin", oslogin_user="airflow"'
    dr = run_dag("access_oslogin_bad", lifecycle("access_oslogin_bad", tasks="create", create_kwargs=kwargs))
    assert task_states(dr)["create_tpu_vm"] == "failed"
    assert "oslogin_user='airflow': is not a Google account e-mail" in "".join(capfd.readouterr())
    assert emulator.requests == []


def test_the_triggers_connection_is_pinned_to_the_published_keys(emulator, run_dag):
    import asyncssh

    from airflow_tpu_posttrain.hooks.vm import VmHookAsync

    first = xcom(run_dag("access_pin_a", lifecycle("access_pin_a", tasks="create")), "create_tpu_vm")
    second = xcom(run_dag("access_pin_b", lifecycle("access_pin_b", tasks="create")), "create_tpu_vm")
    assert first["ssh_address"] != second["ssh_address"] and first["host_keys"] != second["host_keys"]

    async def whoami(host_keys: dict) -> str:
        hook = VmHookAsync(ssh_conn_id="tpu_vm_ssh", host=first["ssh_address"], host_keys=host_keys)
        return (await hook.run_command("id -un"))[1].strip()

    assert asyncio.run(whoami(first["host_keys"])) == "posttrain"
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        asyncio.run(whoami(second["host_keys"]))


def test_private_key_is_in_no_log_xcom_request_or_rendered_field(emulator, run_dag, capfd, client_key):
    from airflow.models.renderedtifields import RenderedTaskInstanceFields

    dr = run_dag("access_secret", lifecycle("access_secret"))
    assert dr.state == "success", task_states(dr)
    private = client_key.read_text().splitlines()[1:-1]  # the PEM body, line by line
    public = client_key.with_suffix(".pub").read_text().split()[1]
    seen = {
        "logs": "".join(capfd.readouterr()),
        "xcom": json.dumps([xcom(dr, "create_tpu_vm"), xcom(dr, "delete_tpu_vm")]),
        "requests": json.dumps(emulator.requests),
        "rendered": json.dumps(
            [RenderedTaskInstanceFields.get_templated_fields(ti) for ti in dr.get_task_instances()],
            default=str,
        ),
    }
    assert public in seen["requests"]  # what the VM needs: the public half, in its metadata
    for where, text in seen.items():
        assert not any(line in text for line in private), where


def test_iap_readiness_reports_what_the_tunnel_said(emulator, run_dag, capfd, tmp_path, monkeypatch, fault_matrix):
    """A deny rule of higher priority shuts IAP out: the create's wait ends with the tunnel's own error."""
    from google.cloud import compute_v1

    iap_gcloud(emulator, tmp_path, monkeypatch)
    firewalls = compute_v1.FirewallsClient(
        transport="rest", client_options={"api_endpoint": emulator.url}, credentials=emulator_credentials(emulator)
    )
    deny = compute_v1.Firewall(
        name="deny-all-ingress", priority=900, source_ranges=["0.0.0.0/0"], denied=[compute_v1.Denied(I_p_protocol="all")]
    )
    firewalls.insert(project=PROJECT, firewall_resource=deny)
    deadline = time.monotonic() + 10
    while not emulator.firewalls() and time.monotonic() < deadline:
        time.sleep(0.1)
    create_kwargs = 'network_path="iap", ready_timeout=__import__("datetime").timedelta(seconds=15)'
    dr = run_dag("access_iap_denied", lifecycle("access_iap_denied", create_kwargs=create_kwargs))
    assert dr.state == "failed"
    logs = "".join(capfd.readouterr())
    said = "its IAP tunnel said: ERROR: (gcloud.compute.start-iap-tunnel) Error while connecting [4003:"
    assert said in logs and "a deny rule of higher priority wins" in logs
    assert no_instances_within(emulator, seconds=30)
    fault_matrix.record(
        "access: IAP path, a deny rule of higher priority -> the wait ends with the tunnel's own error",
        True, dr.state, None, log_excerpt(logs, "its IAP tunnel said"),
    )


IAP_ALLOW = {"name": "allow-iap", "sourceRanges": ["35.235.240.0/20"], "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}]}


@pytest.mark.parametrize(
    ("rules", "admitted"),
    [
        ([IAP_ALLOW], True),
        ([], False),  # the implied deny
        ([{**IAP_ALLOW, "sourceRanges": ["35.235.240.0/24"]}], False),  # covers part of IAP's range only
        ([{**IAP_ALLOW, "targetTags": ["other-vm"]}], False),
        ([{**IAP_ALLOW, "allowed": [{"IPProtocol": "tcp", "ports": ["2222"]}]}], False),
        # A deny of higher priority (lower number), or of the same priority, wins; a lower-priority one does not.
        ([IAP_ALLOW, {"name": "deny", "priority": 900, "sourceRanges": ["0.0.0.0/0"], "denied": [{"IPProtocol": "all"}]}], False),
        ([IAP_ALLOW, {"name": "deny", "sourceRanges": ["35.235.241.0/24"], "denied": [{"IPProtocol": "tcp"}]}], False),
        ([IAP_ALLOW, {"name": "deny", "priority": 2000, "sourceRanges": ["0.0.0.0/0"], "denied": [{"IPProtocol": "all"}]}], True),
        ([{**IAP_ALLOW, "disabled": True}], False),
    ],
)
def test_the_iap_stand_in_evaluates_firewall_rules_as_a_vpc_does(rules, admitted):
    from airflow_tpu_posttrain.local.iap_tunnel import admits_iap

    instance = {"networkInterfaces": [{"network": "global/networks/default"}], "tags": {"items": ["vm-1"]}}
    rules = [{"network": "projects/p/global/networks/default", **rule} for rule in rules]
    assert admits_iap(rules, instance, 22) is admitted


def test_the_port_check_reads_what_the_tunnel_wrote_on_stderr():
    """A tunnel that cannot connect says why on stderr; the readiness wait reports it (and stops on a 4033)."""
    from airflow_tpu_posttrain.triggers.compute import ssh_port_check

    refusal = "ERROR: (gcloud.compute.start-iap-tunnel) Error while connecting [4033: 'not authorized']."
    tunnel = f"echo connecting >&2; echo \"{refusal}\" >&2; exit 1"
    assert asyncio.run(ssh_port_check("10.0.0.2", 22, timeout=5, proxy_command=tunnel)) == (False, refusal)
    assert asyncio.run(ssh_port_check("10.0.0.2", 22, proxy_command="printf SSH-2.0-x")) == (True, "")


def test_the_port_check_ends_the_whole_tunnel_at_once():
    """A tunnel whose shell forked it (gcloud's wrapper may) is ended with it: the check does not wait for it.

    Before, the forked tunnel outlived the kill of its shell and held stderr open until sshd dropped the idle
    login (two minutes): each IAP VM's readiness took that long."""
    import psutil

    from airflow_tpu_posttrain.triggers.compute import ssh_port_check

    seconds = f"119.{time.time_ns() % 10**9:09d}"  # sleep's argument: this test's process, found by it
    tunnel = f"(printf SSH-2.0-x; exec sleep {seconds}) ; true"
    started = time.monotonic()
    assert asyncio.run(ssh_port_check("10.0.0.2", 22, proxy_command=tunnel)) == (True, "")
    assert time.monotonic() - started < 60
    left = [p for p in psutil.process_iter(["cmdline"]) if seconds in (p.info["cmdline"] or [])]
    assert left == []


def test_a_connection_dropped_at_the_first_login_is_asked_again_and_one_that_lasts_fails(monkeypatch):
    """The create's trigger saw the sshd answer; a dropped connection just after (a loaded VM) is not the step's end."""
    import datetime

    import paramiko

    from airflow_tpu_posttrain.hooks import vm as vm_hooks
    from airflow_tpu_posttrain.operators import vm_login
    from airflow_tpu_posttrain.operators.tpu_vm import TpuVmCreateOperator
    from airflow_tpu_posttrain.recipes.compute import TpuVmSpec

    failures = []

    class FlakyHook:
        def __init__(self, **_):
            pass

        def __enter__(self):
            if failures:
                raise failures.pop(0)
            return self

        def __exit__(self, *_):
            return False

        def run(self, command):
            return ""

    monkeypatch.setattr(vm_hooks, "VmHook", FlakyHook)
    monkeypatch.setattr(vm_login.time, "sleep", lambda _: None)
    operator = TpuVmCreateOperator(task_id="create_tpu_vm", project_id=PROJECT, zones=["us-east5-b"])
    vm = {"ssh_address": "10.0.0.2", "ssh_login": "posttrain", "ssh_proxy_command": None}
    spec = TpuVmSpec(project_id=PROJECT, zones=("us-east5-b",), reservation="my-reservation")

    failures[:] = [paramiko.SSHException("Error reading SSH protocol banner"), ConnectionResetError(104, "reset")]
    operator._check_login({}, spec, "tpu-x", "us-east5-b", vm, {})
    assert failures == []  # both asked again, then logged in

    monkeypatch.setattr(vm_login, "LOGIN_GRACE", datetime.timedelta(seconds=0))
    failures[:] = [paramiko.SSHException("Error reading SSH protocol banner")]
    with pytest.raises(paramiko.SSHException, match="banner"):
        operator._check_login({}, spec, "tpu-x", "us-east5-b", vm, {})
