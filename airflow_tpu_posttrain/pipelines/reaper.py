"""The reaper DAG: the safety net behind each pipeline's teardown, and before Google's maxRunDuration."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, Param

from airflow_tpu_posttrain.operators.reaper import TpuVmReaperOperator
from airflow_tpu_posttrain.pipelines.registry import START_DATE, PipelineConfig


def build_reaper_dag(configs: list[PipelineConfig], every_minutes: int = 10, dry_run: bool = False) -> DAG:
    """``tpu_vm_reaper``: every few minutes, one sweep per (connection, project), over all of its zones."""
    sweeps = sorted({(cfg.gcp_conn_id, cfg.project_id) for cfg in configs}, key=str)
    dag = DAG(
        dag_id="tpu_vm_reaper",
        schedule=timedelta(minutes=every_minutes),
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        dagrun_timeout=timedelta(minutes=every_minutes),
        params={
            "dry_run": Param(
                dry_run,
                type="boolean",
                title="Dry run",
                description="On: only log which VMs would be deleted and why; off: delete them.",
            )
        },
        render_template_as_native_obj=True,
        tags=["tpu", "maintenance"],
        doc_md="Deletes TPU VMs labelled by this provider whose DAG run is over or whose expiry label passed "
        "(a user marked the run failed, a crash, a deleted DAG), and gives back their places under the TPU cap. "
        "Never touches other instances.",
    )
    with dag:
        for i, (conn_id, project_id) in enumerate(sweeps):
            TpuVmReaperOperator(
                task_id=f"reap_{i}_{conn_id}",
                gcp_conn_id=conn_id,
                project_id=project_id,
                dry_run="{{ params.dry_run }}",
                prices=configs[0].prices if configs else None,
                capacity_claims=sorted(
                    {
                        cfg.places_location for cfg in configs
                        if (cfg.gcp_conn_id, cfg.project_id) == (conn_id, project_id) and cfg.tpu_cap_chips is not None
                        and cfg.places_location
                    }
                ),
                retries=1,
                execution_timeout=timedelta(minutes=every_minutes),
            )
    return dag
