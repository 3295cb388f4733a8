"""The local CPU run's DAGs (the ``local: true`` entries of models.yaml): only when TPU_POSTTRAIN_LOCAL_DIR is set."""

from pathlib import Path

from airflow_tpu_posttrain.pipelines.posttrain import build_dag
from airflow_tpu_posttrain.pipelines.registry import load_registry

for _config in load_registry(Path(__file__).with_name("models.yaml"), local=True):
    globals()[_config.dag_id] = build_dag(_config)
