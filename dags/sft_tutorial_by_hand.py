"""The SFT tutorial's steps wired by hand with the provider's operators: an example for a DAG of one's own.

Create the TPU VM, install MaxText, convert the Hugging Face checkpoint, train, export and publish, and delete the
VM (a teardown: it runs whatever happened before it). Every step is the operator the registry's DAGs use, with the
registry's defaults (``airflow_tpu_posttrain.defaults``): the connections ``google_cloud_default``, ``tpu_vm_ssh``
and ``hf_default``, at most one of the pipelines' TPU VMs per reservation at once, a training silent for 30
minutes taken for hung. Set the Params below (the trigger form shows them) and trigger it.

What the registry's DAGs (``posttrain_dags.py`` with ``models.yaml``) add: the inputs check (nothing retrained
twice, a gated repo refused before any VM), a CPU VM that converts and exports off the TPU's clock, checkpoints in
``gs://`` storage (a lost VM resumed on a new one), the quality gate, and the trigger form's validation.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from airflow_tpu_posttrain.operators import (
    HfExportOperator,
    MaxTextConvertOperator,
    MaxTextInstallOperator,
    SftTrainOperator,
    TpuDeleteOperator,
    TpuVmCreateOperator,
)

with DAG(
    dag_id="sft_tutorial_by_hand",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,  # zones: a list
    default_args={"retries": 2},
    params={
        "model": Param(
            "gemma3-4b", type="string", title="Model", description="The model profile, e.g. gemma3-4b (the tutorial's)."
        ),
        "zones": Param(
            ["us-east5-b"], type="array", title="Zones", description="Tried in order (a stock-out moves on), e.g. us-east5-b."
        ),
        "accelerator_type": Param("v6e-8", type="string", title="Accelerator", description="The TPU, e.g. v6e-8."),
        "provisioning_model": Param(
            "RESERVATION_BOUND", type="string", title="Provisioning model",
            enum=["RESERVATION_BOUND", "STANDARD", "SPOT", "FLEX_START"], description="How the VM is obtained.",
        ),
        "reservation": Param(
            "my-v6e-reservation", type=["null", "string"], title="Reservation",
            description="The reservation to consume, e.g. my-v6e-reservation; empty with SPOT or FLEX_START.",
        ),
        "hub_repo_id": Param(
            "my-org/gemma3-4b-ultrachat-sft", type="string", title="Hub repo",
            description="Where to publish the trained model, e.g. my-org/gemma3-4b-ultrachat-sft.",
        ),
    },
    tags=["tpu", "maxtext", "sft", "example"],
) as sft_tutorial_by_hand:
    create = TpuVmCreateOperator(
        task_id="create_tpu_vm",
        zones="{{ params.zones }}",
        accelerator_type="{{ params.accelerator_type }}",
        provisioning_model="{{ params.provisioning_model }}",
        reservation="{{ params.reservation }}",
        network_path="internal",  # Airflow inside the VPC (Cloud Composer 3 attached to it: docs/composer.md)
    )
    install = MaxTextInstallOperator(task_id="install_maxtext", vm=create.output, model="{{ params.model }}")
    convert = MaxTextConvertOperator(task_id="convert_to_maxtext", vm=create.output, model="{{ params.model }}")
    train = SftTrainOperator(
        task_id="train", vm=create.output, conversion=convert.output, model="{{ params.model }}"
    )
    export = HfExportOperator(
        task_id="export_and_publish",
        vm=create.output,
        trained=train.output,
        model="{{ params.model }}",
        hub_repo_id="{{ params.hub_repo_id }}",
    )
    delete = TpuDeleteOperator(task_id="delete_tpu_vm", zones="{{ params.zones }}", retries=3)
    create >> install >> convert >> train >> export >> delete.as_teardown(setups=[create, install])
