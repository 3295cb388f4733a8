"""The package's operators, for DAGs wired by hand: ``from airflow_tpu_posttrain.operators import SftTrainOperator``.

Each is imported on first use (PEP 562), so a DAG file that imports one does not pay for the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULE_OF = {
    "HfExportOperator": "export",
    "InputsCheckOperator": "inputs_check",
    "GrpoTrainOperator": "maxtext",
    "MaxTextConvertOperator": "maxtext",
    "MaxTextInstallOperator": "maxtext",
    "SftTrainOperator": "maxtext",
    "PublishApprovalOperator": "approval",
    "QualityGateOperator": "quality_gate",
    "TpuVmReaperOperator": "reaper",
    "TpuDeleteOperator": "tpu_delete",
    "TpuSliceCreateOperator": "tpu_slice",
    "TpuSliceDeleteOperator": "tpu_slice",
    "TpuVmCreateOperator": "tpu_vm",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
