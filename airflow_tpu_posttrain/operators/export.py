"""The last step: export the trained checkpoint to Hugging Face format and publish it before the VM goes."""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from importlib import resources
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.defaults import GCP_CONN_ID
from airflow_tpu_posttrain.exceptions import RemoteJobError
from airflow_tpu_posttrain.links import XComUrlLink
from airflow_tpu_posttrain.operators.inputs_check import record_published
from airflow_tpu_posttrain.operators.maxtext_job import Job, MaxTextJobOperator
from airflow_tpu_posttrain.recipes import cost, layout, maxtext, storage, trainings, validation
from airflow_tpu_posttrain.recipes.accelerators import CPU_CONVERSION_ARGS
from airflow_tpu_posttrain.recipes.lora import LoraSettings
from airflow_tpu_posttrain.recipes.runtime import LOCAL_TORCH_VENV, Step, local_stack_dir
from airflow_tpu_posttrain.recipes.validation import SpecError

# Copied to the VM's workdir by each try: the publish script first, then the module it imports, then the export's
# fidelity check.
VM_SCRIPTS = ("publish_model.py", "model_card.py", "export_fidelity.py")
# The fidelity check (vm_scripts/export_fidelity.py): how many held-out rows, cut at how many tokens. Measured on the
# local twins, MaxText's forward pass of four 128-token rows on the CPU is about a third of the check's time, the rest
# MaxText's and torch's imports and loading the checkpoint.
FIDELITY_ROWS = 4
FIDELITY_MAX_LENGTH = 128
# MaxText's SFT default held-out split (post_train/sft.yml's hf_eval_split), for a dataset other than the model's.
MAXTEXT_SFT_EVAL_SPLIT = "test_sft"

if TYPE_CHECKING:
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics
    from airflow_tpu_posttrain.recipes.remote_job import ReportItem


class PublishedModelLink(XComUrlLink):
    """The task's button to the published model (its Hub branch, else its storage copy)."""

    name = "Published model"


class HfExportOperator(MaxTextJobOperator):
    """Export the trained checkpoint to Hugging Face format (``to_huggingface``), check it, and publish it.

    It is published durably BEFORE the VM can go: to a Hub repo (private by default, one branch per DAG run,
    commit message naming dag and run) and/or a copy to a storage URI (``gs://``, ``file://`` or a local
    directory on the VM).

    With checkpoint storage (the split layout) the checked export is first kept there
    (``<checkpoint_storage>/exports/<run name>``): a failed publish loses nothing (the URI is in the error and
    in XCom ``kept_export``), and a retry or a re-run on a new VM publishes that copy without exporting again.

    Before anything is kept or published, the export's fidelity is checked (``vm_scripts/export_fidelity.py``): on held-out
    rows of the run's dataset, its loss with transformers (an adapter: on its base, with PEFT, which must load it
    without missing or unexpected keys and, merged, change exactly its target modules) must match MaxText's of the
    trained checkpoint. A mismatch fails the try naming both losses (the export copied to ``<kept>.unfaithful`` for a
    look, where checkpoint storage is set); the next try exports again.

    XCom: ``export_dir``, ``kept_uri``, ``hub`` (``repo_id, revision, commit_sha, url``), ``storage_uri``,
    ``validated`` (with ``fidelity``: both losses, their gaps and the tolerances); and ``inputs``, what the published model was trained from (``InputsCheckOperator``).

    :param trained: the training task's record, wired as its XComArg (``train.output``): its ``checkpoint`` is
        what to export.
    :param trained_checkpoint: that checkpoint, when it does not come from ``trained``.
    :param hub_repo_id: ``owner/name`` on the Hub (or None). :param hub_private: create the repo private.
    :param storage_uri: where to copy the model, into ``<storage_uri>/<run name>`` (or None). At least one
        publish target is required.
    :param prices: USD per hour by machine type and provisioning model (``recipes/cost.py``; default its
        table): the model card's cost of the training VM, from its creation to the end of training.
    :param inputs: the run's inputs, wired as the inputs check's XComArg (``check.output``): recorded once the
        model is published, so that a run with the same inputs is skipped.
    :param training_claim: the inputs check's claim on those inputs (``check.output["training_claim"]``): marked
        published with the model's places, for the runs that follow or come later with the same inputs.
    :param gcp_conn_id: the Google connection that writes that claim.
    :param lora: a LoRA run's settings, as its trigger form's LoRA fields give them (``recipes/lora.PARAM_KEYS``):
        the trained checkpoint holds adapters, exported, checked against the base model and published as a PEFT
        adapter. None: a full model.
    :param maxtext_version: the run's MaxText release, for the model card (blank: the model's).
    :param publish: False: export, check and keep the model in checkpoint storage only, publishing nothing (a
        person approves first, ``operators/approval.py``); a later task with True publishes the kept export
        without exporting again.
    """

    fields_from_records = MappingProxyType({"trained_checkpoint": ("trained", "checkpoint")})
    template_fields: Sequence[str] = (
        *MaxTextJobOperator.template_fields,
        "trained",
        "trained_checkpoint",
        "inputs",
        "training_claim",
        "hub_repo_id",
        "storage_uri",
        "lora",
        "maxtext_version",
    )
    operator_extra_links = (PublishedModelLink(),)
    step_title = "Export"

    def __init__(
        self,
        *,
        trained: Any = None,
        trained_checkpoint: str | None = None,
        hub_repo_id: str | None = None,
        hub_private: bool = True,
        storage_uri: str | None = None,
        inputs: Any = None,
        training_claim: str | None = None,
        gcp_conn_id: str = GCP_CONN_ID,
        prices: Mapping[str, Mapping[str, float]] | None = None,
        publish: bool = True,
        lora: Mapping[str, Any] | None = None,
        maxtext_version: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lora = lora
        self.maxtext_version = maxtext_version
        self.publish = publish
        self.inputs = inputs
        self.training_claim = training_claim
        self.gcp_conn_id = gcp_conn_id
        self.prices = prices
        self.trained = trained
        self.trained_checkpoint = trained_checkpoint
        self.hub_repo_id = hub_repo_id
        self.hub_private = hub_private
        self.storage_uri = storage_uri

    def failure_hint(self, context: Context) -> str:
        layout = self.run_spec(context).layout
        kept = layout.kept_export_dir
        if kept and self._kept(kept):
            context["ti"].xcom_push(key="kept_export", value=kept)
            return (
                f". The checked export is kept at {kept}: a retry or a re-run publishes it without "
                "exporting again"
            )
        return (
            f". The exported model, if the export finished, was at {layout.export_dir} on the VM "
            f"(host {self.remote_host})"
        )

    def _kept(self, kept: str) -> bool:
        """Whether the kept export is complete.

        False when that cannot be read (the hint must not mask the step's own error)."""
        try:
            with self._vm() as vm:
                return vm.exists(f"{kept}.complete", self.storage_tool)
        except Exception as err:  # noqa: BLE001 - any failure here only loses the hint
            self.log.warning("Could not check the kept export at %s: %s", kept, err)
            return False

    def _publish_script_path(self) -> str:
        return f"{self.workdir}/vm_scripts/{VM_SCRIPTS[0]}"

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        hub_repo_id = validation.blank_to_none(self.hub_repo_id) if self.publish else None
        storage_uri = validation.blank_to_none(self.storage_uri) if self.publish else None
        if self.publish and not hub_repo_id and not storage_uri:
            raise SpecError("publish target", None, "is missing", "set hub_repo_id and/or storage_uri")
        if not self.publish and not spec.layout.kept_export_dir:
            raise SpecError(
                "checkpoint_storage", None, "is missing", "an export awaiting approval is kept there: set it"
            )
        lora = self._lora()
        export = maxtext.to_huggingface(spec, self.trained_checkpoint, lora=lora)
        dag_run = context["dag_run"]
        result_file = f"{spec.layout.export_dir}.publish.json"
        publish = [
            f"{spec.runtime.venv}/bin/python",
            self._publish_script_path(),
            "--model-dir",
            spec.layout.export_dir,
            "--result-file",
            result_file,
        ]
        if hub_repo_id:
            publish += [
                "--hub-repo",
                validation.hf_repo_id("hub_repo_id", hub_repo_id),
                "--hub-revision",
                f"run-{spec.layout.run_name}",
                "--hub-private",
                "true" if self.hub_private else "false",
                "--commit-message",
                f"Post-trained by Airflow: dag {dag_run.dag_id}, run {dag_run.run_id}",
            ]
            endpoint = self._hub_endpoint()
            if endpoint:
                publish += ["--hub-endpoint", endpoint]
        if storage_uri:
            # One folder per run, as the Hub gets one branch per run.
            uri = validation.storage_uri("storage_uri", storage_uri)
            publish += ["--storage-uri", f"{uri}/{spec.layout.run_name}"]
        card_file = f"{spec.layout.export_dir}.card.json"
        publish += ["--card", card_file, "--base-model", spec.model.hf_source]
        base_revision = (self.trained if isinstance(self.trained, dict) else {}).get("source_revision")
        if base_revision:
            publish += ["--base-revision", base_revision]
        if lora is not None:
            publish += ["--adapter-rank", str(lora.rank), "--adapter-alpha", repr(float(lora.alpha))]
        export_marker = f"{spec.layout.export_dir}/.complete"
        kept = spec.layout.kept_export_dir
        reference = f"{spec.layout.export_dir}.fidelity-maxtext.json"
        export_step = [f"  bash -c {shlex.quote(export.script())}", f"  {self._fidelity_reference(spec, lora, reference)}"]
        publish += ["--fidelity-reference", reference, "--fidelity-python", self._torch_python(spec)]
        if kept:
            publish += ["--keep-uri", kept]
            restore = storage.copy_tree_command(kept, spec.layout.export_dir, self.storage_tool)
            export_step = [
                f"  if {storage.exists_command(kept + '.complete', self.storage_tool)}; then",
                f"    echo {shlex.quote(f'Restoring the export kept at {kept} (checked by an earlier try)')}",
                f"    {restore}",
                f"    printf '%s' {shlex.quote(json.dumps({'restored_from': kept}))} > {shlex.quote(reference)}",
                "  else",
                *(f"  {line}" for line in export_step),
                "  fi",
            ]
        script = "\n".join(
            [
                "set -euo pipefail",
                f"if [ ! -e {shlex.quote(export_marker)} ]; then",
                *export_step,
                f"  touch {shlex.quote(export_marker)}",
                "fi",
                "export HF_HUB_DISABLE_XET=1 HF_HUB_DISABLE_PROGRESS_BARS=1",
                f"printf '%s' {shlex.quote(json.dumps(self._card_facts(spec, context)))} > {shlex.quote(card_file)}",
                # 3: the export is not what MaxText trained (publish_model.py): the next try exports again
                f"{shlex.join(publish)} || {{ status=$?; [ $status -ne 3 ] || rm -f {shlex.quote(export_marker)}; "
                "exit $status; }",
            ]
        )
        return Job(
            script + "\n",
            None,
            {"export_dir": spec.layout.export_dir, "result_file": result_file},
            reads_hub=True,  # to_huggingface takes the tokenizer from the base model's repo
            token_file=bool(hub_repo_id),
        )

    def _fidelity_reference(self, spec: maxtext.RunSpec, lora: LoraSettings | None, reference_file: str) -> str:
        """The first half of the export's fidelity check (``vm_scripts/export_fidelity.py``), a job line.

        MaxText's next-token losses of the trained checkpoint on held-out rows, into ``reference_file``; publish_model.py
        then scores the folder it would publish with transformers (an adapter: on its base, with PEFT) and refuses a
        mismatch before anything is kept or published; the export stays on the VM.

        The rows: SFT, the dataset's held-out split (the model's ``eval_split``, else MaxText's ``test_sft``); GRPO,
        its eval files (GSM8K's test split)."""
        trained = self.trained if isinstance(self.trained, dict) else {}
        rl = trained.get("recipe") == "GRPO" or "/checkpoints/actor/" in (self.trained_checkpoint or "")
        profile_dataset = spec.model.rl_dataset.repo if rl else spec.model.sft_dataset.hf_path
        dataset = trained.get("dataset") or profile_dataset
        if rl:
            files = spec.model.rl_dataset.eval_files
        else:
            split = (spec.model.sft_dataset.eval_split if dataset == profile_dataset else None) or MAXTEXT_SFT_EVAL_SPLIT
            files = f"data/{split}-*.parquet"
        recorded = (self.inputs.get("revisions") or {}) if isinstance(self.inputs, dict) else {}
        script = f"{self.workdir}/vm_scripts/export_fidelity.py"
        reference = [
            f"{spec.runtime.venv}/bin/python", script, "reference",
            "--model-dir", spec.layout.export_dir, "--out", reference_file,
            "--tokenizer", spec.model.hf_source, "--dataset", dataset, "--files", files,
            "--rows", str(FIDELITY_ROWS), "--max-length", str(FIDELITY_MAX_LENGTH),
        ]
        if trained.get("source_revision"):
            reference += ["--tokenizer-revision", trained["source_revision"]]
        if recorded.get(f"dataset:{dataset}"):
            reference += ["--dataset-revision", recorded[f"dataset:{dataset}"]]
        maxtext_args = {
            "model_name": spec.model.maxtext_model_name,
            "load_parameters_path": self.trained_checkpoint,
            "scan_layers": "True",
            "use_multimodal": "False",
            **spec.model.maxtext_overrides,
            **CPU_CONVERSION_ARGS,
            # float32 on the CPU: the losses differ by arithmetic only; the weights are rounded as the export's
            "attention": "dot_product",
            "dtype": "float32",
            "weight_dtype": "float32",
        }
        if lora is not None:
            reference.append("--lora")
            maxtext_args |= {
                "load_parameters_path": self._converted_params(spec),
                **lora.train_args(),
                "lora.lora_restore_path": self.trained_checkpoint,
            }
            maxtext_args.pop("lora.lora_weight_qtype", None)  # the base as the adapter's user loads it: unquantized
        reference += [f"{key}={value}" for key, value in maxtext_args.items()]
        return f"JAX_PLATFORMS=cpu {shlex.join(reference)}"

    def _torch_python(self, spec: maxtext.RunSpec) -> str:
        """The Python that scores the export: MaxText's venv on Google Cloud; the local stack's torch venv locally."""
        if spec.runtime.is_cpu and local_stack_dir():
            return f"{local_stack_dir()}/{LOCAL_TORCH_VENV}/bin/python"
        return f"{spec.runtime.venv}/bin/python"

    def _converted_params(self, spec: maxtext.RunSpec) -> str:
        """The converted base checkpoint a LoRA run trained on: where the convert task keeps it.

        The seeds layout: ``layout.converted_params``. The split layout: the conversion cache's entry, named as
        ``MaxTextConvertOperator`` names it, by the MaxText release, the revision converted and to_maxtext's
        arguments."""
        if not spec.layout.storage:
            return spec.layout.converted_params
        trained = self.trained if isinstance(self.trained, dict) else {}
        version = validation.blank_to_none(self.maxtext_version) or spec.model.maxtext_version
        profile = dataclasses.replace(spec.model, maxtext_version=version)
        unkeyed = dataclasses.replace(
            spec, model=profile, layout=dataclasses.replace(spec.layout, conversion_key="pending")
        )
        argv = maxtext.to_maxtext(unkeyed).argv[len(spec.runtime.entry_point(Step.TO_MAXTEXT)) :]
        options = [arg for arg in argv if not arg.startswith("base_output_directory=")]
        key = layout.conversion_key(version, trained.get("source_revision") or "", options)
        return dataclasses.replace(spec.layout, conversion_key=key).converted_params

    def _lora(self) -> LoraSettings | None:
        return LoraSettings.from_params(self.lora) if self.lora is not None else None

    def _card_facts(self, spec: maxtext.RunSpec, context: Context) -> dict[str, Any]:
        """What the model card says (no secret: it is written into the job's script).

        The base model, the training's provenance and metrics (``trained``), the MaxText release and the DAG
        run."""
        trained = self.trained if isinstance(self.trained, dict) else {}
        return {
            "base_model": spec.model.hf_source,
            "base_revision": trained.get("source_revision"),
            "dataset": trained.get("dataset"),
            "recipe": trained.get("recipe"),
            "steps": trained.get("steps") or trained.get("num_batches"),
            "accelerator": trained.get("accelerator"),
            "maxtext_version": validation.blank_to_none(self.maxtext_version) or spec.model.maxtext_version,
            "lora": dataclasses.asdict(self._lora()) if self.lora is not None else None,
            "dag_id": context["dag_run"].dag_id,
            "run_id": context["dag_run"].run_id,
            "metrics": trained.get("metrics") or {},
            "evaluation": trained.get("evaluation") or {},
            "training_cost": self._training_cost(trained),
        }

    def _training_cost(self, trained: dict[str, Any]) -> str | None:
        """The training VMs' time and cost: the card's line.

        The VM it finished on, from its start to the end of training, and each VM lost before it (a recovery),
        from its start to its loss. None when this run did not train (the training of an earlier try or run was reused), or a fact is
        missing. The VMs' teardowns, which may end after the card is written, log the billed figures."""
        if trained.get("reused"):
            return None
        served = [(trained.get("vm") or {}, trained.get("finished_at"))]
        served += [(lost, lost.get("lost_at")) for lost in trained.get("lost_vms") or []]
        costs = []
        for vm, ended in served:
            started = vm.get("started_at") or vm.get("created_at")
            if not (started and ended and vm.get("machine_type")):
                return None
            instance = {
                "machineType": vm["machine_type"],
                "scheduling": {"provisioningModel": vm.get("provisioning_model")},
                "creationTimestamp": started,
            }
            costs.append(cost.vm_cost(vm.get("name") or "VM", instance, ended, self.prices))
        if len(costs) == 1:
            return costs[0].describe()
        lines = "; ".join(c.describe() for c in costs)
        if any(c.usd is None for c in costs):
            return f"{len(costs)} VMs (recoveries): {lines}"
        return f"${sum(c.usd for c in costs):.2f} over {len(costs)} VMs (recoveries): {lines}"

    def prepare(self, vm: VmHook, spec: maxtext.RunSpec, job: Job) -> None:
        scripts = resources.files("airflow_tpu_posttrain.vm_scripts")
        for name in VM_SCRIPTS:
            vm.put_bytes(f"{self.workdir}/vm_scripts/{name}", (scripts / name).read_bytes(), 0o644)

    def report_commands(self, context: Context, job: Job, paths: RemoteJobPaths) -> dict[str, str]:
        """Also what publishing wrote to its result file."""
        published = f"cat {shlex.quote(job.outputs['result_file'])}"
        return {**super().report_commands(context, job, paths), "published": published}

    def results(
        self,
        context: Context,
        job: Job,
        metrics: TrainingMetrics,
        paths: RemoteJobPaths,
        report: dict[str, ReportItem],
    ) -> dict:
        published = report["published"]
        text = published.stdout if published.status == 0 else None
        if text is None:
            raise RemoteJobError(
                f"Publishing left no result file; the exported model is on the VM at {job.outputs['export_dir']}"
            )
        published = json.loads(text)
        if not self.publish:
            self.log.info("Exported, checked and kept at %s; published nowhere yet", published["kept_uri"])
            return published
        hub = published.get("hub")
        if hub:
            self.log.info(
                "Published to the Hub: %s (revision %s, commit %s)",
                hub["url"],
                hub["revision"],
                hub["commit_sha"],
            )
        if published.get("storage_uri"):
            self.log.info("Copied to %s", published["storage_uri"])
        link = hub["url"] if hub else published.get("storage_uri")
        if link:
            PublishedModelLink().push(context, link)
        model = {key: published[key] for key in ("hub", "storage_uri", "kept_uri") if published.get(key)}
        if isinstance(self.inputs, dict):
            record_published(context, self.inputs, model)
        if self.training_claim:
            self._mark_claim_published(context, model)
        return published

    def _mark_claim_published(self, context: Context, model: dict[str, Any]) -> None:
        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook

        now = datetime.now(UTC).isoformat()
        StoredRecordHook(gcp_conn_id=self.gcp_conn_id).change(
            self.training_claim, lambda claim: trainings.published(claim, context["run_id"], now, model)
        )
        self.log.info("Runs with these inputs reuse this model now (%s)", self.training_claim)
