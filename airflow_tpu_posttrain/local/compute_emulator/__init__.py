"""A local Compute Engine v1 REST emulator for tests that cannot reach Google.

It serves the subset of the API that the provider uses (zonal instances, zone, region and global operations,
global firewalls; for multi-host TPU slices, regional workload policies, global instance templates and zonal
managed instance groups) with the real JSON shapes, so that ``google-cloud-compute`` (REST transport) and the
discovery-based ``ComputeEngineHook`` can talk to it via ``client_options={"api_endpoint": emulator.url}``, and
each VM's metadata server. Google's Compute Engine REST reference:
https://cloud.google.com/compute/docs/reference/rest/v1.

As strict as the real API where the provider depends on it: insert bodies are checked against Google's Compute v1
discovery document (``local/compute_schema.py``: an unknown field or enum value is a 400), and what Compute refuses
besides is refused. Faults (stock-outs, quota, missing reservations, transient 503/429, failing deletes) can be set
from Python with :meth:`ComputeEmulator.set_faults` or over HTTP under ``/_emulator/``.

One module per resource family, each saying first which Google behaviour it stands for and where that is
documented:

- ``instances``: VM instances (insert, get, list, aggregatedList, delete; lifecycle, preemption, maxRunDuration)
- ``instance_groups``: zonal managed instance groups, the VMs of a multi-host TPU slice
- ``instance_templates``: global instance templates
- ``resource_policies``: regional workload policies
- ``networks``: networks, subnetworks, Cloud Routers with Cloud NAT
- ``firewalls``: firewall rules, and each local VM's firewall kept with them
- ``reservations``: specific reservations
- ``operations``: zonal, regional and global operations, and the clock the emulator follows
- ``metadata_server``: the guest side (each VM's metadata server, guest attributes)
- ``identity``: OS Login, IAP, IAM Credentials and the OAuth token endpoint
- ``api``: what every family shares (paths, errors, names, list filters)
- ``faults``: what a test can make fail
- ``routing``: the HTTP paths, the admin API and the server; ``emulator``: the object made of them all

Standard library only; run it standalone with ``python -m airflow_tpu_posttrain.local.compute_emulator --port 8930``.
"""

from airflow_tpu_posttrain.local.compute_emulator.emulator import ComputeEmulator

__all__ = ["ComputeEmulator"]
