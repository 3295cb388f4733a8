"""A later try of a step whose VM an earlier try's recovery made again (operators/recovery.py).

The VM under the run's name is asked of Compute (a stub here: the end-to-end recovery is
tests/test_preemption.py); what matters is which VM the step then trusts, and that MaxText is made sure of."""

from __future__ import annotations

import logging

from airflow_tpu_posttrain.operators.recovery import RECOVERED_VM, VmRecoveryMixin

OLD_KEYS = {"ssh-ed25519": "AAAAC3NzaC1lZDI1NTE5AAAAIOLDOLDOLDOLDOLDOLDOLDOLDOLDOLDOLDOLDOLDOLDO"}
NEW_KEYS = {"ssh-ed25519": "AAAAC3NzaC1lZDI1NTE5AAAAINEWNEWNEWNEWNEWNEWNEWNEWNEWNEWNEWNEWNEWNEWN"}
RECORD = {
    "name": "tpu-posttrain-x", "project": "p", "zone": "us-east5-b", "zones": ["us-east5-b"],
    "ssh_address": "10.0.0.5", "ssh_login": "posttrain", "ssh_proxy_command": "", "host_keys": OLD_KEYS,
    "network_path": "internal",
}


class _Compute:
    """What Compute says of the run's VM now: RUNNING at ``address``, having published ``host_keys``."""

    def __init__(self, address: str, host_keys: dict) -> None:
        self.instance = {"status": "RUNNING", "networkInterfaces": [{"networkIP": address}]}
        self.host_keys = host_keys

    def get_instance(self, project, zone, name):
        return self.instance

    def get_host_keys(self, project, zone, name):
        return self.host_keys


class _Ti:
    def __init__(self) -> None:
        self.pushed: dict = {}

    def xcom_push(self, key, value):
        self.pushed[key] = value


class _Step(VmRecoveryMixin):
    """A training step as far as the recovery mixin goes; ``_delegate`` notes which task it would run."""

    task_id = "train"
    log = logging.getLogger(__name__)

    def __init__(self, compute: _Compute) -> None:
        self.vm = dict(RECORD)
        self.compute = compute
        self.remote_host, self.host_keys, self.ssh_login, self.ssh_proxy_command = "10.0.0.5", OLD_KEYS, "", ""
        self.delegated: list[tuple[str, str]] = []

    def _compute(self, context):
        return self.compute, "p"

    def _delegate(self, context, phase, method, event):
        self.delegated.append((phase, method))


def test_a_new_vm_at_the_lost_ones_address_is_told_by_its_host_keys_and_gets_maxtext(fault_matrix):
    """Same zone, same internal address (recycled), new host keys: the step trusts the new VM's keys.

    And it installs first: a recovery whose install failed left a RUNNING VM without MaxText."""
    step, ti = _Step(_Compute("10.0.0.5", NEW_KEYS)), _Ti()
    adopted = step.adopt_current_vm({"ti": ti})
    assert adopted is not None and step.host_keys == NEW_KEYS and step.remote_host == "10.0.0.5"
    step.train_on_adopted_vm({"ti": ti}, adopted)
    assert ti.pushed[RECOVERED_VM]["host_keys"] == NEW_KEYS
    assert step.delegated == [("install", "execute")]  # then training starts on it (start_on_vm)
    fault_matrix.record(
        "recovery: the new VM got the lost one's address -> its new host keys pinned, MaxText installed first",
        None, "n/a", None, "adopted with the new VM's host keys; install ran before training",
    )


def test_the_recorded_vm_itself_is_used_as_it_is():
    step = _Step(_Compute("10.0.0.5", OLD_KEYS))
    assert step.adopt_current_vm({"ti": _Ti()}) is None
    assert step.host_keys == OLD_KEYS and step.delegated == []
