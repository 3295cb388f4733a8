"""The tiny SFT DAG run again, after a failed export and a refused publish.

An export that fails keeps the trained checkpoint, and its re-run trains no more; a publish the Hub refuses to a
read-only token keeps the checked export in storage, and a re-run publishes it without exporting again. End to
end in real Airflow (dag.test) against the local stack, with the helpers and VM probes of
``test_pipeline_failures.py``. Slow (minutes). A backfill, and the re-run of one of its dates: ``test_backfill.py``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from conftest import log_excerpt, storage_has, storage_objects
from test_pipeline_failures import (  # noqa: F401 - vm_ends and _each_vm_probed are this module's fixtures too
    STEPS,
    WATCHER,
    _each_vm_probed,
    assert_failed_cleanly,
    assert_vms_gone,
    checkpoint_storage,
    file_in_place_of_on_export_vm,
    instance_inserts,
    root,
    run_pipeline,
    states,
    successful_conversions,
    vm_ends,
    xcom,
)

SFT_HUB_REPO = "local/tiny-llama-sft"  # dags/models.yaml


def test_export_fails_then_the_hub_refuses_then_a_rerun_publishes(stack, vm_ends, capfd, monkeypatch, fault_matrix):
    """One DAG run, three times: each re-run goes on from what the one before kept, on new VMs.

    1. The export cannot write its output directory (a regular file where ``<root>/hf-trained`` goes on the export VM,
       put there as soon as that VM is up): the run fails at the export; the trained checkpoint is kept.
    2. Re-run: the training is reused, not done again; the export succeeds, and the Hub refuses the upload (the
       token's write role is taken away as the export starts; it still reads the gated base model. A token
       read-only from the start is refused by check_inputs). The checked export is kept in storage.
    3. Re-run with the write role back: the kept export is published, without exporting again."""
    from airflow_tpu_posttrain.operators.export import HfExportOperator

    logical_date, run_id = datetime(2026, 2, 2, tzinfo=UTC), "manual__export-and-publish-fail"

    # 1. The export fails.
    with file_in_place_of_on_export_vm(stack, root() / "hf-trained") as placed:
        dr = run_pipeline(logical_date=logical_date, run_id=run_id)
    logs = "".join(capfd.readouterr())
    assert placed == [xcom(dr, "create_export_vm")["name"]], placed
    assert_failed_cleanly(stack, vm_ends, dr, "export_and_publish")
    trained = xcom(dr, "train")
    assert trained["reused"] is False and trained["metrics"]["steps_completed"] == STEPS
    assert storage_has(trained["checkpoint"])
    assert "Export failed on the VM with exit code" in logs
    assert str(root() / "hf-trained") in logs
    fault_matrix.record(
        "pipeline: export, output directory not writable (trained checkpoint kept)",
        stack.compute.instances() == [], dr.state, storage_has(trained["checkpoint"]),
        log_excerpt(logs, "Export failed on the VM with exit code"),
    )

    # 2. Re-run: the training reused, the publish refused.
    export = HfExportOperator.execute

    def export_after_the_write_role_went(self, context):
        stack.hub.set_read_only(stack.hf_token)
        return export(self, context)

    monkeypatch.setattr(HfExportOperator, "execute", export_after_the_write_role_went)
    hub_requests_before = len(stack.hub.requests)
    vm_ends.forget()
    try:
        dr = run_pipeline(logical_date=logical_date, run_id=run_id)
    finally:
        monkeypatch.setattr(HfExportOperator, "execute", export)
        stack.hub.set_read_only(stack.hf_token, False)
    logs = "".join(capfd.readouterr())
    assert_failed_cleanly(stack, vm_ends, dr, "export_and_publish")
    again = xcom(dr, "train")
    assert again["reused"] is True and (again["run_name"], again["checkpoint"]) == (
        trained["run_name"], trained["checkpoint"]
    )
    assert "Export failed on the VM with exit code" in logs
    assert "publish_model: error:" in logs
    writes = [r for r in stack.hub.requests[hub_requests_before:] if r.method in ("POST", "PUT")]
    assert writes, "the publish never asked the Hub"  # it asked, and was refused (403)
    from huggingface_hub import HfApi

    hub, revision = HfApi(endpoint=stack.hub.url, token=stack.hf_token), f"run-{trained['run_name']}"
    assert not (hub.repo_exists(SFT_HUB_REPO) and hub.revision_exists(SFT_HUB_REPO, revision)), "published"
    # Every VM and its disk is gone (assert_failed_cleanly), yet the checked export is whole in checkpoint
    # storage: the error and XCom say where.
    kept = f"{checkpoint_storage(stack)}/exports/{trained['run_name']}"
    assert f"The checked export is kept at {kept}" in logs
    [export_ti] = [ti for ti in dr.get_task_instances() if ti.task_id == "export_and_publish"]
    assert export_ti.xcom_pull(task_ids="export_and_publish", key="kept_export") == kept
    files = storage_objects(kept)
    assert storage_has(f"{kept}.complete")
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files), files
    refused = dr.state

    # 3. With the write role back: a re-run publishes the kept export, on new VMs, without exporting.
    vm_ends.forget()
    rerun = run_pipeline(logical_date=logical_date, run_id=run_id)
    relogs = "".join(capfd.readouterr())
    assert rerun.state == "success", states(rerun)
    assert f"Restoring the export kept at {kept}" in relogs
    published = xcom(rerun, "export_and_publish")
    assert published["kept_uri"] == kept and published["hub"]["revision"] == revision
    assert_vms_gone(vm_ends, rerun)
    fault_matrix.record(
        "pipeline: publish refused, the token's write role gone mid-run (checked export kept in storage; a re-run "
        "publishes it, no re-export)",
        stack.compute.instances() == [], refused, "config.json" in files,
        log_excerpt(logs, "The checked export is kept at"),
    )
