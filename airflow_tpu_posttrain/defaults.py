"""The defaults an operator and the registry (``dags/models.yaml``) share: one source for both.

A DAG wired by hand with the operators gets the same connections as the registry's DAGs unless it names others.
"""

from __future__ import annotations

GCP_CONN_ID = "google_cloud_default"  # Compute, OS Login and IAP are called with it
SSH_CONN_ID = "tpu_vm_ssh"  # the VMs' login and its private key
HF_CONN_ID = "hf_default"  # the Hugging Face token (and, for a Hub of one's own, its endpoint)

# The registry's cap, in VMs of an entry's size (its deprecated key max_tpu_vms; max_tpu_chips counts chips):
# one v6e-8 VM (8 chips) per line (a zone's reservation, else the zone and series); a slice takes all its VMs.
MAX_TPU_VMS = 1
MAX_WAIT_FOR_CAPACITY_MINUTES = 60  # for a fully used reservation (or FLEX_START's queue): a cloud stock-out
# The backstop of a wait in line (the create's deferral times out, and its wait leaves the line): the line moves as
# the runs ahead end, however long they train, so this only ends a wait behind a backfill of a week of dates.
MAX_WAIT_IN_LINE_HOURS = 24
# A training silent this long is taken for hung: stopped, and the try fails (a retry resumes). Training only: an
# install's upload or a large conversion is legitimately silent for long.
TRAINING_STALL_TIMEOUT_S = 1800
# Which revisions of a run's inputs it trains: those at its logical date, or the latest (inputs_as_of).
INPUTS_AS_OF = ("run_date", "latest")
# What a rejected (or unanswered) approval to publish does: skip the publish, or fail the run.
APPROVAL_ON_REJECT = ("skip", "fail")
