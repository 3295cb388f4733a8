"""Airflow provider for LLM post-training with MaxText on Google Cloud TPU VMs."""

__version__ = "0.1.0"
