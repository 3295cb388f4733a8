"""The MaxText steps that run on the VMs before the export: install, convert, SFT and GRPO training."""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from airflow_tpu_posttrain.defaults import TRAINING_STALL_TIMEOUT_S
from airflow_tpu_posttrain.exceptions import CheckpointMissingError, InvalidInputError
from airflow_tpu_posttrain.links import CheckpointLink
from airflow_tpu_posttrain.operators import just_in_time
from airflow_tpu_posttrain.operators.compute_base import deployment_id
from airflow_tpu_posttrain.operators.evaluation import EvaluationMixin
from airflow_tpu_posttrain.operators.maxtext_job import Job, MaxTextJobOperator
from airflow_tpu_posttrain.recipes import install, layout, maxtext, storage, validation
from airflow_tpu_posttrain.recipes.lora import LoraSettings
from airflow_tpu_posttrain.recipes.models import ModelProfile, SftDataset
from airflow_tpu_posttrain.recipes.runtime import LOCAL_DIR_VARIABLE, LOCAL_LAUNCHERS, Step, local_stack_dir
from airflow_tpu_posttrain.recipes.validation import SpecError

# A conversion claim is a dead run's after this long when the convert step has no timeout of its own.
CLAIM_STALE_DEFAULT = timedelta(hours=2)

if TYPE_CHECKING:
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics
    from airflow_tpu_posttrain.recipes.remote_job import ReportItem


class MaxTextInstallOperator(MaxTextJobOperator):
    """Install MaxText on the VM, as the tutorials do (or the CPU recipe locally).

    Cached: a marker in the venv keyed by version and extras makes a re-run a no-op in seconds; with
    ``checkpoint_storage`` a new VM restores the environment from an archive in
    ``<checkpoint_storage>/environments`` (see recipes/install.py). On a fresh VM, the seconds from its request
    (``vm``'s ``requested_at``) to the install's end are measured: how early a later run requests its TPU VM
    (``operators/just_in_time.py``).

    :param maxtext_version: default: the model profile's (the tutorials: 0.2.2 for SFT, 0.2.3 for RL).
    :param save_environment: after a fresh install, save the archive for later VMs (one VM of a run does).
    """

    template_fields: Sequence[str] = (*MaxTextJobOperator.template_fields, "maxtext_version")
    step_title = "Install"
    installs_maxtext = True  # how a recovery finds its VM's install task (operators/recovery.py)

    def __init__(
        self, *, maxtext_version: str | None = None, save_environment: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.maxtext_version = maxtext_version
        self.save_environment = save_environment

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        version = validation.blank_to_none(self.maxtext_version) or spec.model.maxtext_version
        cache = f"{spec.layout.storage}/environments" if spec.layout.storage else None
        return Job(
            install.install_script(
                spec.runtime,
                version,
                cache,
                save=self.save_environment,
                storage_tool_script=self.storage_tool.script,
            ),
            None,
            {"venv": spec.runtime.venv, "maxtext_version": version},
            done_check=install.installed_check(spec.runtime, version),
        )

    def prepare(self, vm: VmHook, spec: maxtext.RunSpec, job: Job) -> None:
        if not spec.runtime.is_cpu:
            return
        stack_dir = local_stack_dir()
        if not stack_dir:
            problem = SpecError(
                "model", self.model, "is a local model: it runs on the local stack's CPU VMs only",
                f"run it with the local stack (README: ./scripts/demo), which sets {LOCAL_DIR_VARIABLE}",
            )
            raise InvalidInputError.of(self.task_id, problem)
        for launcher in sorted(Path(stack_dir, LOCAL_LAUNCHERS).glob("*.py")):
            vm.put_bytes(f"{spec.runtime.launcher_dir}/{launcher.name}", launcher.read_bytes(), 0o644)

    def finish(
        self, context: Context, job: Job, paths: RemoteJobPaths, report: dict[str, ReportItem], reused: bool
    ) -> dict:
        result = super().finish(context, job, paths, report, reused)
        if not reused and isinstance(self.vm, dict):
            just_in_time.record_ready(self.vm)
        return result


class MaxTextConvertOperator(MaxTextJobOperator):
    """Convert the Hugging Face checkpoint to MaxText format (``to_maxtext``).

    Skipped when a complete conversion exists. XCom: ``converted_params`` (the path the trainers load), and
    with checkpoint storage ``conversion_key`` and ``source_revision``.

    With ``checkpoint_storage`` the conversion is cached there under a key of (MaxText version, source revision,
    conversion arguments): the source revision is the one the inputs check recorded for the run (``inputs``),
    else the Hub's current commit of the model (asked with the ``hf_conn_id`` token). Scheduled retraining and
    backfills then convert once per new revision or MaxText release. What it converted, and how long the run took
    to a conversion it ran, are kept for the TPU VM's create (``operators/just_in_time.py``).

    :param maxtext_version: the MaxText release installed on the VM (default: the model profile's).
    :param use_pathways: the tutorials' USE_PATHWAYS (zarr3/ocdbt storage off when true).
    :param inputs: the inputs check's record (its XComArg): the base model's revision of the run's date in its
        ``revisions``.
    """

    template_fields: Sequence[str] = (*MaxTextJobOperator.template_fields, "maxtext_version", "inputs")
    step_title = "Convert"

    def __init__(
        self,
        *,
        maxtext_version: str | None = None,
        use_pathways: bool = False,
        inputs: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.maxtext_version = maxtext_version
        self.use_pathways = use_pathways
        self.inputs = inputs

    def _profile(self) -> ModelProfile:
        """The model's profile at the run's MaxText release (the conversion's arguments may depend on it)."""
        profile = super()._profile()
        version = validation.blank_to_none(self.maxtext_version)
        return dataclasses.replace(profile, maxtext_version=version) if version else profile

    @staticmethod
    def _unkeyed(spec: maxtext.RunSpec) -> maxtext.RunSpec:
        """``spec`` with a placeholder conversion key, to render the conversion before its key is known."""
        if not spec.layout.storage:
            return spec
        return dataclasses.replace(spec, layout=dataclasses.replace(spec.layout, conversion_key="pending"))

    def validate(self, spec: maxtext.RunSpec, context: Context) -> None:
        self._job(self._unkeyed(spec), context)

    def resolve(self, context: Context, vm: VmHook, spec: maxtext.RunSpec) -> maxtext.RunSpec:
        if not spec.layout.storage:
            return spec
        revision = self._source_revision(spec.model)
        argv = maxtext.to_maxtext(self._unkeyed(spec), use_pathways=self.use_pathways).argv
        arguments = argv[len(spec.runtime.entry_point(Step.TO_MAXTEXT)) :]
        options = [arg for arg in arguments if not arg.startswith("base_output_directory=")]
        try:
            version = validation.blank_to_none(self.maxtext_version) or spec.model.maxtext_version
            key = layout.conversion_key(version, revision, options)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        context["ti"].xcom_push(key="conversion", value={"conversion_key": key, "source_revision": revision})
        self.log.info("Conversion key %s (source revision %s)", key, revision)
        return self.resolved(context, spec)

    def resolved(self, context: Context, spec: maxtext.RunSpec) -> maxtext.RunSpec:
        if not spec.layout.storage:
            return spec
        stashed = context["ti"].xcom_pull(task_ids=self.task_id, key="conversion")
        return dataclasses.replace(
            spec, layout=dataclasses.replace(spec.layout, conversion_key=stashed["conversion_key"])
        )

    def _source_revision(self, model: ModelProfile) -> str:
        """Which weights the conversion reads: the run's (its inputs'), else the Hub's commit of the model now."""
        from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

        recorded = (self.inputs.get("revisions") or {}) if isinstance(self.inputs, dict) else {}
        if recorded.get(f"model:{model.hf_source}"):
            return recorded[f"model:{model.hf_source}"]
        return HuggingFaceHubHook(self.hf_conn_id).get_conn().model_info(model.hf_source).sha

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        outputs = {"converted_params": spec.layout.converted_params}
        revision = None
        if spec.layout.conversion_key:
            outputs["conversion_key"] = spec.layout.conversion_key
            # Known once resolved (not yet when the job is only validated, with a placeholder key).
            stashed = context["ti"].xcom_pull(task_ids=self.task_id, key="conversion") or {}
            revision = outputs["source_revision"] = stashed.get("source_revision")
        # The revision the cache key names is the one converted.
        command = maxtext.to_maxtext(spec, use_pathways=self.use_pathways, revision=revision)
        return Job(
            command.script(),
            f"{spec.layout.converted_dir}/.complete",
            outputs,
            reads_hub=True,
            claim=self._claim(spec, context) if spec.layout.conversion_key else None,
        )

    def finish(
        self, context: Context, job: Job, paths: RemoteJobPaths, report: dict[str, ReportItem], reused: bool
    ) -> dict:
        result = super().finish(context, job, paths, report, reused)
        if job.outputs.get("conversion_key"):
            record = self.vm if isinstance(self.vm, dict) else {}
            spec = self.run_spec(context)
            just_in_time.record_conversion(
                context,
                model=spec.model.key,
                revision=job.outputs.get("source_revision"),
                maxtext_version=validation.blank_to_none(self.maxtext_version) or spec.model.maxtext_version,
                machine_type=record.get("machine_type"),
                ran=not reused,
            )
        return result

    def _claim(self, spec: maxtext.RunSpec, context: Context) -> tuple[str, str]:
        """One conversion per key at a time.

        Runs of several DAGs (or backfills) converting the same model wait for the first and reuse its
        conversion instead of writing the same checkpoint at once. A claim older than this step's timeout is a dead run's and is taken over."""
        converted = spec.layout.converted_dir
        owner = f"{deployment_id()}/{context['dag'].dag_id}/{context['run_id']}"
        stale_s = int((self.execution_timeout or CLAIM_STALE_DEFAULT).total_seconds())
        tool = self.storage_tool if storage.is_gcs(converted) else None
        uri = f"{converted}/.claim"
        return storage.claim_command(uri, owner, stale_s, tool), storage.release_command(uri, owner, tool)


class _TrainOperator(EvaluationMixin, MaxTextJobOperator):
    """What SFT and GRPO share: the converted checkpoint, overrides, the final checkpoint, and recovery.

    The final checkpoint is made durable. The recovery is from the loss of the VM: with checkpoint storage,
    the VM is created again and training resumes. XCom ``evaluation``: the base and trained models' numbers
    (``operators/evaluation.py``), which the quality gate compares.

    :param conversion: the convert task's record, wired as its XComArg (``convert.output``): its
        ``converted_params`` is the checkpoint training starts from.
    :param converted_params: that checkpoint, when it does not come from ``conversion``.
    :param inputs: the inputs check's record (its XComArg): the training reads the dataset at the revision it
        recorded for the run's date; without it, the dataset's main.
    :param stall_timeout_s: seconds without output after which the training is taken for hung (default 1800, as
        the registry's; 0: never).
    """

    fields_from_records = MappingProxyType({"converted_params": ("conversion", "converted_params")})
    template_fields: Sequence[str] = (
        *MaxTextJobOperator.template_fields,
        "overrides",
        "conversion",
        "converted_params",
        "inputs",
        "max_recoveries",
    )
    operator_extra_links = (CheckpointLink(),)

    def __init__(
        self,
        *,
        overrides: Sequence[str] | None = None,
        conversion: Any = None,
        converted_params: str | None = None,
        inputs: Any = None,
        max_recoveries: int | str = 3,
        stall_timeout_s: int = TRAINING_STALL_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(stall_timeout_s=stall_timeout_s, **kwargs)
        self.overrides = overrides
        self.conversion = conversion
        self.converted_params = converted_params
        self.inputs = inputs
        self.max_recoveries = max_recoveries

    def _source_revision(self) -> str | None:
        """The Hub commit the conversion read (split layout), so the tokenizer comes from the same one."""
        return self.conversion.get("source_revision") if isinstance(self.conversion, dict) else None

    def fetch_run_files(self, spec: maxtext.RunSpec, dataset: str) -> str:
        """The base model's files at the conversion's revision and ``dataset`` at the one the run recorded."""
        recorded = (self.inputs.get("revisions") or {}) if isinstance(self.inputs, dict) else {}
        return maxtext.fetch_run_files(
            spec,
            model_revision=self._source_revision(),
            dataset=dataset,
            dataset_revision=recorded.get(f"dataset:{dataset}"),
        )

    def provenance(self, spec: maxtext.RunSpec, dataset: str | None) -> dict[str, Any]:
        """What the export's model card says of this training.

        Recipe, dataset (its Hub id), the accelerator, the base model's revision the
        conversion read, and the VM that trained (for its cost: its machine, provisioning model and creation)."""
        conversion = self.conversion if isinstance(self.conversion, dict) else {}
        vm = self.vm if isinstance(self.vm, dict) else {}
        return {
            "recipe": self.step_title,
            "dataset": dataset,
            "accelerator": spec.accelerator.type,
            "source_revision": conversion.get("source_revision"),
            "vm": {key: vm.get(key) for key in ("name", "machine_type", "provisioning_model", "created_at")},
        }

    def execute(self, context: Context) -> Any:
        self.validate(self.run_spec(context), context)  # bad input fails before Compute is asked anything
        lost = self.vm_lost(context)
        if lost:
            return self.recover(context, lost)
        adopted = self.adopt_current_vm(context)
        if adopted:
            return self.train_on_adopted_vm(context, adopted)
        return super().execute(context)

    def start_on_vm(self, context: Context) -> Any:
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        self.adopt_recovered_vm(context)
        return super().execute_complete(context, event)

    def on_output(self, context: Context, paths: RemoteJobPaths) -> dict[str, str]:
        return self.keep_base_evaluation(self.resolved(context, self.run_spec(context)), paths.log_file)

    def on_vm_lost(self, context: Context, lost: Any) -> Any:
        return self.recover(context, lost)

    def report_commands(self, context: Context, job: Job, paths: RemoteJobPaths) -> dict[str, str]:
        """Also whether the final checkpoint was committed, and the base model's evaluation kept in storage."""
        spec = self.resolved(context, self.run_spec(context))
        committed = storage.committed_checkpoint(job.outputs["checkpoint"])
        return {
            **super().report_commands(context, job, paths),
            "checkpoint_committed": storage.exists_command(committed, self.storage_tool),
            "kept_base_evaluation": self.kept_base_evaluation_command(spec),
        }

    def results(
        self,
        context: Context,
        job: Job,
        metrics: TrainingMetrics,
        paths: RemoteJobPaths,
        report: dict[str, ReportItem],
    ) -> dict:
        """The final checkpoint must be durable before the task succeeds: the TPU VM is deleted right after.

        Durable: in storage, or on the VM in the seeds' layout. Then the evaluations."""
        from airflow_tpu_posttrain.hooks.vm import exists_answer

        checkpoint = job.outputs["checkpoint"]
        committed = storage.committed_checkpoint(checkpoint)  # a half-written step is not a checkpoint
        answer = report["checkpoint_committed"]
        if not exists_answer(committed, answer.status, answer.stderr):
            raise CheckpointMissingError(
                f"{self.step_title} finished but its final checkpoint {checkpoint} is missing or incomplete "
                f"(no {committed}); a retry resumes from the newest checkpoint"
            )
        link = CheckpointLink.url(checkpoint)
        if link:
            CheckpointLink().push(context, link)
        spec = self.resolved(context, self.run_spec(context))
        return {
            "evaluation": self.evaluation(spec, metrics, paths.log_file, report["kept_base_evaluation"].stdout),
            "finished_at": datetime.now(UTC).isoformat(),
            # What the training's cost counts: the VM it finished on and those lost before (recoveries).
            "vm": self.serving_vm(context),
            "lost_vms": self.lost_vms(context),
        }

    def _overrides(self) -> list[str]:
        overrides = validation.blank_to_none(self.overrides)
        if isinstance(overrides, str):
            return [pair for pair in overrides.split() if pair]
        return list(overrides or [])


class SftTrainOperator(_TrainOperator):
    """Supervised fine-tuning (``train_sft``) from the converted checkpoint.

    The checkpoint is ``conversion`` (the convert task's XComArg) or ``converted_params``. The run name is
    deterministic per DAG run, so a retry resumes from the newest checkpoint; a finished run is not retrained.
    XCom: ``checkpoint`` (the final ``model_params``), ``run_name``, ``metrics``.

    :param steps: training steps (tutorial: 1000).
    :param dataset: Hub dataset id owner/name (tutorial: HuggingFaceH4/ultrachat_200k).
    :param train_split: (tutorial: train_sft). :param train_data_columns: (tutorial: ``['messages']``).
    :param eval_split: the held-out split ``evaluate`` reads (default: the model's; for another dataset,
        MaxText's default, test_sft).
    :param checkpoint_period: steps between checkpoints: how much a retry or a recovery can lose.
    :param evaluate: evaluate on the dataset's held-out rows before the first step and after the last (the
        quality gate's numbers; the tutorial does not).
    :param overrides: extra MaxText ``key=value`` pairs, validated.
    :param max_recoveries: how many times a try may create the VM again after losing it (preempted, host
        error) and resume training from storage; 0: the loss fails the task.
    :param lora: LoRA instead of full SFT, as the trigger form's LoRA fields give it (``recipes/lora.PARAM_KEYS``):
        adapters trained on the frozen base, the checkpoints holding the adapters only. None: full SFT.
    """

    template_fields: Sequence[str] = (
        *_TrainOperator.template_fields,
        "lora",
        "steps",
        "dataset",
        "train_split",
        "eval_split",
        "train_data_columns",
        "checkpoint_period",
        "evaluate",
    )
    step_title = "SFT"

    def __init__(
        self,
        *,
        steps: int | str | None = None,
        dataset: str | None = None,
        train_split: str | None = None,
        eval_split: str | None = None,
        train_data_columns: str | None = None,
        checkpoint_period: int | str = maxtext.DEFAULT_SFT_CHECKPOINT_PERIOD,
        evaluate: bool | str = False,
        lora: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lora = lora
        self.evaluate = evaluate
        self.steps = steps
        self.dataset = dataset
        self.train_split = train_split
        self.eval_split = eval_split
        self.train_data_columns = train_data_columns
        self.checkpoint_period = checkpoint_period

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        steps = validation.optional_count("steps", self.steps) or spec.model.sft_steps
        base = spec.model.sft_dataset
        hf_path = validation.hf_repo_id("dataset", validation.blank_to_none(self.dataset) or base.hf_path)
        dataset = SftDataset(
            hf_path=hf_path,
            train_split=validation.blank_to_none(self.train_split) or base.train_split,
            train_data_columns=validation.blank_to_none(self.train_data_columns) or base.train_data_columns,
            eval_split=validation.blank_to_none(self.eval_split)
            or (base.eval_split if hf_path == base.hf_path else None),
            eval_steps=base.eval_steps,
        )
        command = maxtext.train_sft(
            spec,
            steps=steps,
            dataset=dataset,
            checkpoint_period=int(self.checkpoint_period),
            overrides=self._overrides(),
            converted_params=self.converted_params,
            evaluate=validation.flag("evaluate", self.evaluate),
            lora=LoraSettings.from_params(self.lora) if self.lora is not None else None,
        )
        run_dir = posixpath.dirname(spec.layout.checkpoints_dir)
        return Job(
            command.script(),
            f"{run_dir}/.complete-{steps}",
            {
                "checkpoint": spec.layout.sft_params(steps),
                "run_name": spec.layout.run_name,
                "steps": steps,
                **self.provenance(spec, dataset.hf_path),
            },
            prefetch=self.fetch_run_files(spec, dataset.hf_path),
            before_step=storage.drop_uncommitted_command(spec.layout.checkpoints_dir, self.storage_tool),
        )


class GrpoTrainOperator(_TrainOperator):
    """GRPO reinforcement learning (``train_rl``) from the converted checkpoint; resumable like SFT.

    XCom: ``checkpoint`` (the actor's final ``model_params``), ``run_name``, ``metrics`` (pre/post accuracy,
    reward).

    :param num_batches: (tutorial: 50). :param num_test_batches: (tutorial: 10).
    :param overrides: extra MaxText ``key=value`` pairs, validated.
    :param max_recoveries: how many times a try may create the VM again after losing it and resume from storage.
    """

    template_fields: Sequence[str] = (*_TrainOperator.template_fields, "num_batches", "num_test_batches")
    step_title = "GRPO"

    def __init__(
        self,
        *,
        num_batches: int | str | None = None,
        num_test_batches: int | str | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.num_batches = num_batches
        self.num_test_batches = num_test_batches

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        batches = validation.optional_count("num_batches", self.num_batches) or spec.model.rl_num_batches
        tests = validation.optional_count("num_test_batches", self.num_test_batches)
        command = maxtext.train_rl(
            spec,
            num_batches=batches,
            num_test_batches=tests,
            overrides=self._overrides(),
            converted_params=self.converted_params,
        )
        run_dir = posixpath.dirname(spec.layout.checkpoints_dir)
        return Job(
            command.script(),
            f"{run_dir}/.complete-{batches}",
            {
                "checkpoint": spec.layout.rl_params(batches),
                "run_name": spec.layout.run_name,
                "num_batches": batches,
                **self.provenance(spec, spec.model.rl_dataset.repo),
            },
            prefetch=self.fetch_run_files(spec, spec.model.rl_dataset.repo),
        )
