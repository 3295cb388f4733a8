"""Letting Airflow into a new VM: its SSH key authorized, and the wait until it can be logged into.

The key goes into the instance metadata or OS Login; the create's trigger waits until the RUNNING VM has
published its host keys and its sshd answers, and the worker then logs in once, as every step will."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.exceptions import InvalidInputError, VmAccessError, VmHostKeyMismatchError
from airflow_tpu_posttrain.recipes import access, compute
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

# How long a refused login is asked again before the create gives up (OS Login grants and keys propagate).
LOGIN_GRACE = timedelta(seconds=30)


class VmLoginMixin:
    """The create operator's key authorization, its record of the VM, and its first login."""

    def _authorize_key(self, spec: compute.TpuVmSpec, expires_at: int) -> tuple[str | None, dict | None, str]:
        """How the SSH connection's key is let in until the VM expires.

        Returns the ``ssh-keys`` line for the instance metadata (``metadata`` mode), or what the create's trigger
        is to import into the OS Login profile (``oslogin`` mode: ``{"user", "public_key", "expires_at"}``, the
        user None for the Google connection's account); and the login (``oslogin``: the trigger answers it)."""
        from airflow_tpu_posttrain.hooks.vm import client_identity

        try:
            client = client_identity(self.ssh_conn_id)
            if spec.ssh_key_mode == "metadata":
                return access.ssh_keys_metadata(client.login, client.public_key, expires_at), None, client.login
            public_key = access.public_key("ssh public key", client.public_key)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        return None, {"user": self.oslogin_user, "public_key": public_key, "expires_at": expires_at}, ""

    def _session(self, vm: dict, host_keys: dict) -> Any:
        """An SSH session on ``vm`` (a create's record) as every step has it: its published host keys pinned."""
        from airflow_tpu_posttrain.hooks.vm import VmHook

        return VmHook(
            ssh_conn_id=self.ssh_conn_id,
            remote_host=vm["ssh_address"],
            username=vm["ssh_login"],
            host_keys=host_keys,
            proxy_command=vm["ssh_proxy_command"],
            proxy_account=vm.get("ssh_proxy_account"),
        )

    def _check_login(
        self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str, vm: dict, host_keys: dict
    ) -> None:
        """Log in once, as every SSH step will: a VM that refuses Airflow's key is deleted, with why.

        An SSH port that answers says nothing of the login: OS Login lets in only accounts with an OS Login role,
        and where the organization enforces OS Login a VM ignores ``ssh-keys``. A refusal is asked again for
        ``LOGIN_GRACE`` (a key or grant just made takes a moment to reach the VM), and so is a dropped connection."""
        import paramiko

        deadline = time.monotonic() + LOGIN_GRACE.total_seconds()
        while True:
            try:
                with self._session(vm, host_keys) as session:
                    session.run("true")
                return
            except VmHostKeyMismatchError as err:
                self._refused(context, spec, name, zone, err)  # never used: not the VM it published
            except paramiko.AuthenticationException as err:
                if time.monotonic() > deadline:
                    refused = err
                    break
                time.sleep(2)
            except (paramiko.SSHException, OSError):
                # The trigger saw this sshd answer: a connection dropped now is a moment's (a loaded VM's banner
                # late, a reset), asked again; one that lasts is the step's failure, retried as a whole.
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        if spec.ssh_key_mode == "oslogin":
            why = (
                f"OS Login let the key in but not the login {vm['ssh_login']}: the account whose profile holds the "
                f"key needs roles/compute.osAdminLogin on project {spec.project_id} (the install uses sudo): gcloud "
                f"projects add-iam-policy-binding {spec.project_id} --member=serviceAccount:ACCOUNT "
                "--role=roles/compute.osAdminLogin"
            )
        else:
            why = (
                f"the VM did not take the key of connection {self.ssh_conn_id!r} from its ssh-keys metadata for "
                f"login {vm['ssh_login']}: where the project or organization enforces OS Login (constraints/"
                "compute.requireOsLogin, or enable-oslogin in the project metadata) use ssh_key_mode: oslogin"
            )
        self._refused(
            context,
            spec,
            name,
            zone,
            VmAccessError(f"VM {name} refused Airflow's SSH login ({refused}): {why}. The VM was deleted."),
        )

    def _vm(
        self,
        spec: compute.TpuVmSpec,
        name: str,
        zone: str,
        instance: dict,
        login: str,
        without_max_run_duration: bool,
    ) -> dict[str, Any]:
        """What the steps need of the RUNNING VM to log into it, and what its cost is counted from."""
        from airflow_tpu_posttrain.hooks.vm import client_identity

        interface = (instance.get("networkInterfaces") or [{}])[0]
        return {
            "status": instance.get("status"),
            "internal_ip": interface.get("networkIP"),
            "external_ip": ((interface.get("accessConfigs") or [{}])[0]).get("natIP"),
            "ssh_address": access.ssh_address(instance, spec.network_path),
            "ssh_port": client_identity(self.ssh_conn_id).port,
            "ssh_login": login,
            "ssh_proxy_command": (
                access.iap_proxy_command(spec.project_id, zone, name) if spec.network_path == "iap" else None
            ),
            # Who the tunnel's gcloud runs as: the Google connection that made the VM (hooks/vm.py).
            "ssh_proxy_account": (
                {"gcp_conn_id": self.gcp_conn_id, "impersonation_chain": self.impersonation_chain}
                if spec.network_path == "iap"
                else None
            ),
            "network_path": spec.network_path,
            "self_link": instance.get("selfLink"),
            "created_at": instance.get("creationTimestamp"),
            # What its cost is counted from: RUNNING (a FLEX_START VM queued in PENDING is not billed).
            "started_at": instance.get("lastStartTimestamp") or instance.get("creationTimestamp"),
            "provisioning_model": spec.provisioning_model,
            # The cloud-side backstop the VM has (None: Compute refused it; the reaper is the backstop).
            "max_run_duration_s": None if without_max_run_duration else spec.max_run_duration_s,
        }

    def _refused(self, context: Context, spec: compute.TpuVmSpec, name: str, zone: str, error: Exception) -> None:
        """A VM Airflow cannot use is deleted (with its firewall rule) from the triggerer; then ``error`` is raised.

        A teardown does not run when its setup failed, so the create cleans up after itself."""
        from airflow_tpu_posttrain.triggers.compute import ComputeDeleteTrigger

        deletes = [{"name": name, "zone": zone, "request_id": self._request_id(context, name, zone, "on-error")}]
        if spec.opens_firewall:
            firewall = compute.firewall_name(name)
            deletes.append(
                {"name": firewall, "zone": None, "request_id": self._request_id(context, name, "firewall-on-error")}
            )
        self.log.warning("Deleting %s in %s: the create failed and the instance must not outlive it", name, zone)
        self.defer(
            trigger=ComputeDeleteTrigger(
                deletes=deletes,
                state={"error": type(error).__name__, "message": str(error)},
                **self._trigger_arguments(),
            ),
            method_name="refused_complete",
            timeout=self.wait_timeout,
        )

    def refused_complete(self, context: Context, event: dict[str, Any]) -> None:
        """The refused VM's delete ended: raise why it was refused."""
        state = event["state"]
        error = {"VmHostKeyMismatchError": VmHostKeyMismatchError}.get(state["error"], VmAccessError)
        if event["status"] != "success":
            self.log.warning("Deleting the refused VM failed: %s", compute.describe_errors(event.get("errors", [])))
        raise error(state["message"])
