"""Post-training DAGs on Google Cloud, one per (recipe, model) of models.yaml.

Cheap to parse: no cloud client is imported. The local entries are in local_dags.py, so each file parses its
own DAGs only."""

from pathlib import Path

from airflow_tpu_posttrain.pipelines.posttrain import build_dag
from airflow_tpu_posttrain.pipelines.registry import load_registry

for _config in load_registry(Path(__file__).with_name("models.yaml"), local=False):
    globals()[_config.dag_id] = build_dag(_config)
