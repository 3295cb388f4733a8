"""The TPU VM reaper: the safety net behind each pipeline's teardown (and before Google's maxRunDuration)."""

from pathlib import Path

from airflow_tpu_posttrain.pipelines.reaper import build_reaper_dag
from airflow_tpu_posttrain.pipelines.registry import load_registry

tpu_vm_reaper = build_reaper_dag(load_registry(Path(__file__).with_name("models.yaml")))
