"""The defaults an operator and the registry (``dags/models.yaml``) share: one source for both.

A DAG wired by hand with the operators gets the same connections as the registry's DAGs unless it names others.
"""

from __future__ import annotations

GCP_CONN_ID = "google_cloud_default"  # Compute, OS Login and IAP are called with it
SSH_CONN_ID = "tpu_vm_ssh"  # the VMs' login and its private key
HF_CONN_ID = "hf_default"  # the Hugging Face token (and, for a Hub of one's own, its endpoint)

MAX_TPU_VMS = 1  # the registry's TPU VMs alive at once per line (the reservation, else the zone); a slice counts once
MAX_WAIT_FOR_CAPACITY_MINUTES = 60  # first in line for a place under the cap, or for a fully used reservation
# How long a create may wait behind others in line (the line moving) before its task times out: a backfill of a
# week of dates behind a day's trainings. The wait while first in line is MAX_WAIT_FOR_CAPACITY_MINUTES.
MAX_WAIT_IN_LINE_HOURS = 24
# A training silent this long is taken for hung: stopped, and the try fails (a retry resumes). Training only: an
# install's upload or a large conversion is legitimately silent for long.
TRAINING_STALL_TIMEOUT_S = 1800
# Which revisions of a run's inputs it trains: those at its logical date, or the latest (inputs_as_of).
INPUTS_AS_OF = ("run_date", "latest")
# What a rejected (or unanswered) approval to publish does: skip the publish, or fail the run.
APPROVAL_ON_REJECT = ("skip", "fail")
