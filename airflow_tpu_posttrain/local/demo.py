"""The local default, end to end: ``python -m airflow_tpu_posttrain.local.demo [sft|rl]``.

Starts the local stack (Compute emulator whose instances are local machines, Hub server), runs the tiny model's DAG from
``dags/`` in real Airflow (SQLite metadata DB under ``.local/airflow``), prints where the trained Hugging Face
model is, proves it loads and generates with ``transformers``, and stops everything it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / ".local"


def _airflow_home() -> Path:
    """A private Airflow home; set before Airflow is imported, which reads its configuration once."""
    home = LOCAL / "airflow"
    os.environ.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__DAGS_FOLDER=str(REPO / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )
    home.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    return home


def main(recipe: str = "sft") -> int:
    if recipe not in ("sft", "rl"):
        raise SystemExit("usage: demo [sft|rl]")
    _airflow_home()
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.pool import Pool

    from airflow_tpu_posttrain.local.stack import LocalStack

    dag_id = f"posttrain_{recipe}__tiny-llama"
    stack = LocalStack(LOCAL)
    with stack as env:
        os.environ.update(env)
        Pool.create_or_update_pool(
            "tpu_vms", slots=2, description="Concurrent TPU VMs", include_deferred=True
        )
        bag = DagBag(dag_folder=str(REPO / "dags"))
        if bag.import_errors:
            print(bag.import_errors, file=sys.stderr)
            return 1
        print(f"demo: running {dag_id} (CPU VM converts and exports, TPU VM trains; both deleted at the end)")
        dag_run = bag.get_dag(dag_id).test(run_conf={"storage_uri": str(stack.published_dir)})
        states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
        print(f"demo: run {dag_run.run_id} ended {dag_run.state}: {states}")
        print(f"demo: VMs left in the Compute emulator: {len(stack.compute.instances())}")
        if dag_run.state != "success":
            return 1
        [export] = [ti for ti in dag_run.get_task_instances() if ti.task_id == "export_and_publish"]
        result = export.xcom_pull(task_ids="export_and_publish")
        model_dir = Path(result["storage_uri"].removeprefix("file://"))
        hub = result["hub"]
        print(f"demo: trained model (Hugging Face format): {model_dir}")
        print(
            f"demo: published to the local Hub: {hub['url']} (revision {hub['revision']}, commit {hub['commit_sha']})"
        )
    check = subprocess.run(
        [
            str(LOCAL / "hfcheck-venv" / "bin" / "python"),
            str(Path(__file__).with_name("check_hf_model.py")),
            str(model_dir),
        ],
        capture_output=True,
        text=True,
    )
    print(check.stdout.strip() or check.stderr.strip())
    return check.returncode


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
