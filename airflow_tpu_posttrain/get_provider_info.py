"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations


def get_provider_info() -> dict:
    return {
        "package-name": "airflow-tpu-posttrain",
        "name": "TPU post-training",
        "description": "LLM post-training (SFT, GRPO) with MaxText on Google Cloud TPU VMs.",
        "versions": ["0.1.0"],
        "integrations": [
            {
                "integration-name": "TPU post-training",
                "external-doc-url": "https://cloud.google.com/tpu/docs/v6e-training",
                "tags": ["gcp"],
            }
        ],
        "hooks": [
            {
                "integration-name": "TPU post-training",
                "python-modules": [
                    "airflow_tpu_posttrain.hooks.compute",
                    "airflow_tpu_posttrain.hooks.vm",
                ],
            }
        ],
        "operators": [
            {
                "integration-name": "TPU post-training",
                "python-modules": [
                    "airflow_tpu_posttrain.operators.tpu_vm",
                    "airflow_tpu_posttrain.operators.maxtext_job",
                    "airflow_tpu_posttrain.operators.maxtext",
                    "airflow_tpu_posttrain.operators.export",
                ],
            }
        ],
        "extra-links": ["airflow_tpu_posttrain.operators.export.PublishedModelLink"],
        "triggers": [
            {
                "integration-name": "TPU post-training",
                "python-modules": [
                    "airflow_tpu_posttrain.triggers.compute",
                    "airflow_tpu_posttrain.triggers.remote_job",
                ],
            }
        ],
    }
