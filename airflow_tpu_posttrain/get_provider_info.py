"""Provider metadata read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from airflow_tpu_posttrain import __version__

_INTEGRATION = "TPU post-training"


def get_provider_info() -> dict:
    """What Airflow lists of the provider: every module of hooks, operators and triggers the wheel ships."""
    return {
        "package-name": "airflow-tpu-posttrain",
        "name": "TPU post-training",
        "description": "LLM post-training (SFT, GRPO) with MaxText on Google Cloud TPU VMs.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": _INTEGRATION,
                "external-doc-url": "https://cloud.google.com/tpu/docs/v6e-training",
                "tags": ["gcp"],
            }
        ],
        "hooks": [
            {
                "integration-name": _INTEGRATION,
                "python-modules": [
                    "airflow_tpu_posttrain.hooks.compute",
                    "airflow_tpu_posttrain.hooks.hub",
                    "airflow_tpu_posttrain.hooks.oslogin",
                    "airflow_tpu_posttrain.hooks.stored_records",
                    "airflow_tpu_posttrain.hooks.vm",
                ],
            }
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_tpu_posttrain.hooks.hub.HuggingFaceHubHook",
                "connection-type": "tpu_posttrain_huggingface",
                "hook-name": "Hugging Face Hub",
                # What the connection form shows (the hook's get_ui_field_behaviour, read without importing it)
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "port", "extra", "description"],
                    "relabeling": {"password": "Token", "host": "Hub endpoint"},
                    "placeholders": {
                        "password": "hf_... (read: the base models and datasets; write: to publish)",
                        "host": "blank: https://huggingface.co",
                    },
                },
            }
        ],
        "operators": [
            {
                "integration-name": _INTEGRATION,
                "python-modules": [
                    "airflow_tpu_posttrain.operators.approval",
                    "airflow_tpu_posttrain.operators.compute_base",
                    "airflow_tpu_posttrain.operators.export",
                    "airflow_tpu_posttrain.operators.inputs_check",
                    "airflow_tpu_posttrain.operators.maxtext",
                    "airflow_tpu_posttrain.operators.maxtext_job",
                    "airflow_tpu_posttrain.operators.quality_gate",
                    "airflow_tpu_posttrain.operators.reaper",
                    "airflow_tpu_posttrain.operators.tpu_delete",
                    "airflow_tpu_posttrain.operators.tpu_slice",
                    "airflow_tpu_posttrain.operators.tpu_vm",
                    "airflow_tpu_posttrain.operators.vm_shape",
                ],
            }
        ],
        "config": {
            "tpu_posttrain": {
                "description": "The TPU post-training provider's settings (every option it reads).\n",
                "options": {
                    "deployment_id": {
                        "description": (
                            "This Airflow deployment's id in its VMs' names and labels: give each deployment that "
                            "shares a Google Cloud project its own. Empty: one drawn at the first create and kept "
                            "in the Variable ``airflow_tpu_posttrain.deployment_id``.\n"
                        ),
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "prod",
                        "default": "",
                    }
                },
            }
        },
        "extra-links": [
            "airflow_tpu_posttrain.operators.export.PublishedModelLink",
            "airflow_tpu_posttrain.links.VmConsoleLink",
            "airflow_tpu_posttrain.links.CheckpointLink",
        ],
        "triggers": [
            {
                "integration-name": _INTEGRATION,
                "python-modules": [
                    "airflow_tpu_posttrain.triggers.compute",
                    "airflow_tpu_posttrain.triggers.conversion",
                    "airflow_tpu_posttrain.triggers.create",
                    "airflow_tpu_posttrain.triggers.hub_revision",
                    "airflow_tpu_posttrain.triggers.remote_job",
                    "airflow_tpu_posttrain.triggers.slice",
                    "airflow_tpu_posttrain.triggers.slice_job",
                    "airflow_tpu_posttrain.triggers.trainings",
                ],
            }
        ],
    }
