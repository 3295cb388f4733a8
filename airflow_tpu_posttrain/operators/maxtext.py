"""The MaxText steps on the TPU VM, each a detached remote job watched from the triggerer.

The remote-job protocol is providers-ssh's (``utils/remote_job.py`` and ``SSHRemoteJobTrigger``): the job runs
under ``setsid`` with a log file and an atomic exit-code file, the trigger streams the log by byte offset and
reconnects after SSH drops, and a kill signals the job's process group. The operators do not subclass
``SSHRemoteJobOperator``: importing it loads paramiko and asyncssh, which would make every DAG file slow to
parse; they import the protocol's pieces when they run. What they add:

- a deterministic job id per (task, DAG run), so a retry finds its earlier job: still running → re-attach;
  finished → reuse; failed → start again (MaxText resumes from the newest checkpoint of the same run name);
- a completion marker per step output, so a re-run whose output is complete does not redo it; with checkpoint
  storage (the split layout) the markers and checkpoints are in storage, conversions are cached by a key of
  what determines them, and a training checkpoint must be in storage before the training task succeeds;
- the job script is uploaded over SFTP (the command line holds only its path), and the Hugging Face token
  reaches the VM as a 0600 file read by the job and deleted at once, never in a command line or a template;
- metrics parsed from the trainers' log lines into XCom and a one-line summary.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import posixpath
import re
import shlex
import time
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowFailException

from airflow_tpu_posttrain.exceptions import CheckpointMissingError, InvalidInputError, RemoteJobError
from airflow_tpu_posttrain.operators.recovery import VmRecoveryMixin
from airflow_tpu_posttrain.recipes import compute, install, layout, maxtext, remote_job, storage, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR, accelerator
from airflow_tpu_posttrain.recipes.models import ModelProfile, SftDataset, model_profile, tiny_llama_profile
from airflow_tpu_posttrain.recipes.runtime import Runtime, Step, cpu_runtime, tpu_runtime
from airflow_tpu_posttrain.recipes.shell import export_line
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.vm import VmHook

DEFAULT_WORKDIR = "/tmp/airflow-tpu-posttrain"
_VM_XCOM = "{{{{ ti.xcom_pull(task_ids='{task}')['{key}'] }}}}"


class Job:
    """What one step runs: the script, the marker that says its output is complete, and what it produced."""

    def __init__(
        self,
        script: str,
        done_marker: str | None,
        outputs: dict[str, Any],
        *,
        reads_hub: bool = False,
        token_file: bool = False,
    ):
        self.script = script
        self.done_marker = done_marker
        self.outputs = outputs
        self.reads_hub = reads_hub  # MaxText / transformers download the model: HF_TOKEN and HF_ENDPOINT set
        self.token_file = token_file  # publish_model.py reads the token from the file HF_TOKEN_FILE names


class PublishedModelLink(BaseOperatorLink):
    """The task's button to the published model (its Hub branch, else its storage copy)."""

    name = "Published model"

    def get_link(self, operator: BaseOperator, *, ti_key: Any) -> str:
        from airflow.providers.common.compat.sdk import XCom

        return XCom.get_value(key=self.xcom_key, ti_key=ti_key) or ""


class MaxTextJobOperator(VmRecoveryMixin, BaseOperator):
    """
    Base of the MaxText steps: runs a step's script as a detached, re-attachable job on the VM. When the VM is
    gone (Compute says so, not merely an SSH error) the step fails with :class:`VmLostError`; training recovers
    (``operators/recovery.py``).

    :param model: model profile key (``gemma3-4b``, ``llama3.1-8b-Instruct``, ``tiny-llama``).
    :param ssh_conn_id: SSH connection to the VM (login and private key); the host is the VM's.
    :param vm_task_id: the create task whose XCom gives the VM's address, host keys and accelerator type.
    :param remote_host: the VM's address, when it does not come from ``vm_task_id``.
    :param ssh_login: the login on the VM (default: the one the create task let in, from ``vm_task_id``: the
        connection's login, or the OS Login POSIX name); empty: the connection's login.
    :param ssh_proxy_command: reach the VM through this command (default: the IAP tunnel the create task names,
        from ``vm_task_id``; empty: dial ``remote_host`` directly).
    :param host_keys: ``{key type: base64}`` the VM must present (default: the ones it published, from
        ``vm_task_id``); every connection, in the worker and in the triggerer, is pinned to them.
    :param accelerator_type: default: the VM's, from ``vm_task_id``.
    :param runtime: ``tpu`` (the tutorials) or ``cpu`` (the local CPU "VM", see recipes/runtime.py).
    :param maxtext_venv: MaxText's venv on the VM (default ``maxtext_venv`` in the SSH user's home).
    :param base_python: the interpreter uv builds the venv from (``3.12`` on TPU, a path on cpu).
    :param model_source_dir: cpu runtime: where the local model and its data live on the VM.
    :param root_dir: where the run's files go on the VM (default ``/dev/shm/<model>``, as in the tutorials).
    :param checkpoint_storage: ``gs://bucket/prefix`` (or, locally, a directory every VM sees) for the converted
        and trained checkpoints (the split layout); empty: everything under ``root_dir`` (the tutorials').
    :param workdir: the jobs' scripts, logs and launchers on the VM.
    :param hf_conn_id: connection whose password is the Hugging Face token (and whose host, if set, the Hub
        endpoint); needed to read gated models and to publish.
    :param poll_interval: seconds between the trigger's polls of the job.
    :param inline_wait: seconds the task watches a job it started before deferring: a job that ends by then
        finishes without a second trip through a worker. Default: the step's ``quick_job_wait`` (the install,
        usually a reused environment: 5 s; the long steps: 0, they would only hold the worker longer).
    :param max_reconnect_attempts: consecutive SSH failures the trigger rides out (with backoff).
    """

    template_fields: Sequence[str] = (
        "ssh_conn_id",
        "remote_host",
        "ssh_login",
        "ssh_proxy_command",
        "host_keys",
        "model",
        "accelerator_type",
        "root_dir",
        "checkpoint_storage",
        "workdir",
    )
    ui_color = "#e4f0e8"
    step_title = "MaxText"
    quick_job_wait = 0.0

    def __init__(
        self,
        *,
        model: str,
        ssh_conn_id: str = "tpu_vm_ssh",
        vm_task_id: str | None = "create_tpu_vm",
        remote_host: str | None = None,
        ssh_login: str | None = None,
        ssh_proxy_command: str | None = None,
        host_keys: dict[str, str] | str | None = None,
        accelerator_type: str | None = None,
        runtime: str = "tpu",
        maxtext_venv: str | None = None,
        base_python: str | None = None,
        model_source_dir: str | None = None,
        root_dir: str | None = None,
        checkpoint_storage: str | None = None,
        workdir: str = DEFAULT_WORKDIR,
        hf_conn_id: str | None = None,
        poll_interval: int = 10,
        inline_wait: float | None = None,
        log_chunk_size: int = 65536,
        command_timeout: float = 30.0,
        max_reconnect_attempts: int = 8,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.vm_task_id = vm_task_id
        if vm_task_id:
            remote_host = remote_host or _VM_XCOM.format(task=vm_task_id, key="ssh_address")
            ssh_login = ssh_login or _VM_XCOM.format(task=vm_task_id, key="ssh_login")
            ssh_proxy_command = ssh_proxy_command or _VM_XCOM.format(task=vm_task_id, key="ssh_proxy_command")
            host_keys = host_keys or _VM_XCOM.format(task=vm_task_id, key="host_keys")
            accelerator_type = accelerator_type or _VM_XCOM.format(task=vm_task_id, key="accelerator_type")
        self.ssh_conn_id = ssh_conn_id
        self.remote_host = remote_host
        self.ssh_login = ssh_login
        self.ssh_proxy_command = ssh_proxy_command
        self.host_keys = host_keys
        self.model = model
        self.accelerator_type = accelerator_type
        self.runtime = runtime
        self.maxtext_venv = maxtext_venv
        self.base_python = base_python
        self.model_source_dir = model_source_dir
        self.root_dir = root_dir
        self.checkpoint_storage = checkpoint_storage
        self.workdir = workdir
        self.hf_conn_id = hf_conn_id
        self.poll_interval = poll_interval
        self.inline_wait = self.quick_job_wait if inline_wait is None else inline_wait
        self.log_chunk_size = log_chunk_size
        self.command_timeout = command_timeout
        self.max_reconnect_attempts = max_reconnect_attempts

    @property
    def jobs_dir(self) -> str:
        return f"{self.workdir}/jobs"

    # -- what each step defines ------------------------------------------------------------------
    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        raise NotImplementedError

    # -- shared machinery ------------------------------------------------------------------------
    def _runtime(self) -> Runtime:
        if self.runtime == "cpu":
            if not self.maxtext_venv:
                raise SpecError(
                    "maxtext_venv", None, "is required on the cpu runtime", "give the venv's path"
                )
            return cpu_runtime(
                f"{self.workdir}/launchers", self.maxtext_venv, self.base_python or "python3.12"
            )
        validation.one_of("runtime", self.runtime, ("tpu", "cpu"))
        return tpu_runtime(self.maxtext_venv or "maxtext_venv")

    def _profile(self) -> ModelProfile:
        profile = model_profile(self.model)
        if profile.is_local and self.model_source_dir:
            return tiny_llama_profile(self.model_source_dir)
        return profile

    def run_spec(self, context: Context, conversion_key: str = "") -> maxtext.RunSpec:
        """Everything the user gave, validated; bad input fails the task at once, without retries."""
        try:
            validation.safe_absolute_path("workdir", self.workdir)
            dag_run = context["dag_run"]
            name = layout.run_name(dag_run.dag_id, dag_run.run_id, getattr(dag_run, "logical_date", None))
            profile = self._profile()
            return maxtext.RunSpec(
                model=profile,
                accelerator=accelerator(self.accelerator_type or DEFAULT_ACCELERATOR),
                runtime=self._runtime(),
                layout=layout.RunLayout(
                    profile.key, name, self.root_dir or "", self.checkpoint_storage or "", conversion_key
                ),
            )
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def _remote_job_id(self, context: Context) -> str:
        dag_run = context["dag_run"]
        task = re.sub(r"[^a-z0-9]+", "-", self.task_id.lower()).strip("-")[:40]
        return f"{task}-{compute.run_hash(dag_run.dag_id, dag_run.run_id)}"

    def _pinned_host_keys(self) -> dict[str, str]:
        """The rendered ``host_keys`` (a dict; a rendered string when the DAG does not render native objects)."""
        if isinstance(self.host_keys, str):
            return ast.literal_eval(self.host_keys) if self.host_keys.strip() else {}
        return dict(self.host_keys or {})

    def _vm(self) -> VmHook:
        from airflow_tpu_posttrain.hooks.vm import VmHook

        return VmHook(
            ssh_conn_id=self.ssh_conn_id,
            remote_host=self.remote_host or None,
            username=self.ssh_login or None,
            host_keys=self._pinned_host_keys(),
            proxy_command=self._proxy_command(),
        )

    def _proxy_command(self) -> str | None:
        """The rendered ``ssh_proxy_command``; a missing XCom value renders as "None"."""
        command = (self.ssh_proxy_command or "").strip()
        return command if command and command != "None" else None

    def _hub_endpoint(self) -> str | None:
        if not self.hf_conn_id:
            return None
        from airflow.sdk import BaseHook

        return BaseHook.get_connection(self.hf_conn_id).host or None

    def _token(self) -> str:
        from airflow.sdk import BaseHook

        if not self.hf_conn_id:
            raise AirflowFailException(f"{self.task_id}: hf_conn_id is required (the Hugging Face token)")
        token = BaseHook.get_connection(self.hf_conn_id).password
        if not token:
            raise AirflowFailException(
                f"{self.task_id}: connection {self.hf_conn_id!r} has no password (token)"
            )
        return token

    def _job_script(self, job: Job, paths: RemoteJobPaths) -> tuple[str, str | None]:
        """The script the detached job runs, and where the token file goes (if the step needs one)."""
        needs_token = job.reads_hub or job.token_file
        token_file = f"{self.workdir}/secrets/{paths.job_id}.token" if needs_token else None
        lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
        if job.reads_hub:
            # MaxText's config and huggingface_hub read HF_TOKEN from the environment, never from argv.
            lines.append(f'export HF_TOKEN="$(cat {shlex.quote(token_file)})"')
            if endpoint := self._hub_endpoint():
                lines.append(export_line("HF_ENDPOINT", endpoint))
        if job.token_file:
            lines += [
                f"export HF_TOKEN_FILE={shlex.quote(token_file)}",
                f"trap 'rm -f {shlex.quote(token_file)}' EXIT",
            ]
        elif token_file:
            lines.append(f"rm -f {shlex.quote(token_file)}")
        step_script = f"{paths.job_dir}.step.sh"
        lines.append(f"bash {shlex.quote(step_script)}")
        if job.done_marker:
            keep_metrics = storage.write_command(storage.metrics_uri(job.done_marker))
            lines += [
                f"{{ {self._metric_lines_command(paths.log_file)}; }} | {keep_metrics}",
                storage.mark_command(job.done_marker),
            ]
        return "\n".join(lines) + "\n", token_file

    @staticmethod
    def _metric_lines_command(log_file: str) -> str:
        from airflow_tpu_posttrain.recipes.metrics import LOG_FILTER

        return f"grep -aE {shlex.quote(LOG_FILTER)} {shlex.quote(log_file)} || true"

    def _job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        try:
            return self.build_job(spec, context)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def execute(self, context: Context) -> Any:
        spec = self.run_spec(context)
        self.validate(spec, context)
        from airflow.providers.ssh.utils.remote_job import RemoteJobPaths

        paths = RemoteJobPaths(job_id=self._remote_job_id(context), remote_os="posix", base_dir=self.jobs_dir)
        with self._vm() as vm:
            spec = self.resolve(context, vm, spec)
            job = self._job(spec, context)
            if job.done_marker and vm.exists(job.done_marker):
                self.log.info(
                    "%s: output already complete (%s); nothing to redo", self.step_title, job.done_marker
                )
                return self.finish(context, vm, job, paths, reused=True)
            state, log_offset = self._job_state(vm, paths)
            if state == "running":
                self.log.info("Re-attaching to job %s, still running on the VM", paths.job_id)
            else:
                if state == "succeeded":
                    self.log.info("Job %s already finished successfully on the VM", paths.job_id)
                    return self.finish(context, vm, job, paths, reused=True)
                if state != "absent":
                    self.log.info(
                        "Earlier job %s %s; starting it again (training resumes from its checkpoint)",
                        paths.job_id,
                        state,
                    )
                    vm.run(f"mv {shlex.quote(paths.job_dir)} {shlex.quote(paths.job_dir)}.$(date +%s)")
                self._start(vm, spec, job, paths)
                log_offset = 0
            ended = self._wait_briefly(vm, paths)
        if ended is not None:
            return self.execute_complete(context, ended)
        return self._watch(context, paths, log_offset=log_offset, first=True)

    def _start(self, vm: VmHook, spec: maxtext.RunSpec, job: Job, paths: RemoteJobPaths) -> None:
        from airflow.providers.ssh.utils.remote_job import build_posix_wrapper_command

        self.prepare(vm, spec, job)
        script, token_file = self._job_script(job, paths)
        vm.put_text(f"{paths.job_dir}.step.sh", job.script, 0o700)
        vm.put_text(f"{paths.job_dir}.sh", script, 0o700)
        if token_file:
            vm.put_text(token_file, self._token(), 0o600)
        vm.run(build_posix_wrapper_command(f"bash {shlex.quote(paths.job_dir + '.sh')}", paths))
        self.log.info("Started job %s on the VM (log: %s)", paths.job_id, paths.log_file)

    def _wait_briefly(self, vm: VmHook, paths: RemoteJobPaths) -> dict | None:
        """The trigger's completion event, if the job ends within ``inline_wait`` seconds; else None."""
        deadline = time.monotonic() + self.inline_wait
        while time.monotonic() < deadline:
            time.sleep(0.5)
            exit_code = remote_job.parse_completion(
                vm.run(remote_job.completion_command(paths.pid_file, paths.exit_code_file))
            )
            if exit_code is not None:
                log = vm.get_text(paths.log_file) or ""
                return {"job_id": paths.job_id, "done": True, "exit_code": exit_code, "log_chunk": log}
        return None

    def validate(self, spec: maxtext.RunSpec, context: Context) -> None:
        """Bad input fails here, before the VM is touched."""
        self._job(spec, context)

    def resolve(self, context: Context, vm: VmHook, spec: maxtext.RunSpec) -> maxtext.RunSpec:
        """Complete ``spec`` with what only the VM or a service can tell (once per try; see ``resolved``)."""
        return spec

    def resolved(self, context: Context, spec: maxtext.RunSpec) -> maxtext.RunSpec:
        """``spec`` as ``resolve`` completed it earlier in this try (after the deferral)."""
        return spec

    def prepare(self, vm: VmHook, spec: maxtext.RunSpec, job: Job) -> None:
        """Upload what the step needs besides its script (launchers, helper scripts)."""

    @staticmethod
    def _job_state(vm: VmHook, paths: RemoteJobPaths) -> tuple[str, int]:
        command = remote_job.state_command(
            paths.job_dir, paths.pid_file, paths.exit_code_file, paths.log_file
        )
        return remote_job.parse_state(vm.run(command))

    def _watch(self, context: Context, paths: RemoteJobPaths, log_offset: int, first: bool = False) -> None:
        """Defer to the remote-job trigger; before the first deferral, record the job for ``on_kill``."""
        from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

        if first:
            context["ti"].xcom_push(
                key="ssh_remote_job",
                value={"job_id": paths.job_id, "log_file": paths.log_file, "pid_file": paths.pid_file},
            )
        self.defer(
            trigger=MaxTextJobTrigger(
                ssh_conn_id=self.ssh_conn_id,
                remote_host=self.remote_host,
                login=self.ssh_login or None,
                proxy_command=self._proxy_command(),
                host_keys=self._pinned_host_keys(),
                job_id=paths.job_id,
                job_dir=paths.job_dir,
                log_file=paths.log_file,
                exit_code_file=paths.exit_code_file,
                remote_os="posix",
                poll_interval=self.poll_interval,
                log_chunk_size=self.log_chunk_size,
                log_offset=log_offset,
                command_timeout=self.command_timeout,
                max_reconnect_attempts=self.max_reconnect_attempts,
                vm=self.vm_watch(context),
            ),
            method_name="execute_complete",
            timeout=self.execution_timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Stream the new log lines, re-defer while the job runs, then finish or fail."""
        from airflow.providers.ssh.utils.remote_job import RemoteJobPaths

        for line in (event.get("log_chunk") or "").splitlines():
            self.log.info("[remote] %s", line)
        paths = RemoteJobPaths(job_id=event["job_id"], remote_os="posix", base_dir=self.jobs_dir)
        if not event.get("done"):
            return self._watch(context, paths, log_offset=event.get("log_offset", 0))
        exit_code = event.get("exit_code")
        if exit_code == remote_job.JOB_DIED:
            raise RemoteJobError(
                f"{self.step_title}: the job on the VM died without an exit code (killed, out of memory?); "
                f"a retry resumes from the newest checkpoint (log: {paths.log_file})"
            )
        if exit_code is None:
            lost = self.vm_lost(context)
            if lost:
                return self.on_vm_lost(context, lost)
            raise RemoteJobError(
                f"{self.step_title}: lost the job on the VM: {event.get('message', 'unknown error')}"
            )
        if exit_code != 0:
            raise RemoteJobError(
                f"{self.step_title} failed on the VM with exit code {exit_code} (log: {paths.log_file})"
                f"{self.failure_hint(context)}"
            )
        job = self.build_job(self.resolved(context, self.run_spec(context)), context)
        with self._vm() as vm:
            return self.finish(context, vm, job, paths, reused=False)

    def on_kill(self) -> None:
        """A kill of the running task kills the job's process group on the VM."""
        from airflow.providers.ssh.utils.remote_job import build_posix_kill_command

        ti = getattr(self, "task_instance", None)
        job = ti.xcom_pull(task_ids=self.task_id, key="ssh_remote_job") if ti else None
        if not job:
            return
        self.log.info("Killing job %s on the VM", job["job_id"])
        with self._vm() as vm:
            vm.run(build_posix_kill_command(job["pid_file"]), check=False)

    def finish(self, context: Context, vm: VmHook, job: Job, paths: RemoteJobPaths, reused: bool) -> dict:
        """Parse metrics from the job's log (or those kept in storage), push outputs and metrics, log the
        one-line summary."""
        from airflow_tpu_posttrain.recipes.metrics import parse_lines

        log = vm.run(self._metric_lines_command(paths.log_file))
        if not log.strip() and job.done_marker:
            # finished on an earlier VM: its log went with that VM's disk; the lines were kept in storage
            kept = storage.read_command(storage.metrics_uri(job.done_marker))
            log = vm.run(f"{kept} 2>/dev/null || true")
        metrics = parse_lines(log.splitlines())
        result = {**job.outputs, "metrics": metrics.as_xcom(), "reused": reused}
        result.update(self.results(context, vm, job))
        self.log.info("%s%s", metrics.summary(self.step_title), " (reused)" if reused else "")
        return result

    def failure_hint(self, context: Context) -> str:
        """What a user should know when the step failed (appended to the error)."""
        return ""

    def results(self, context: Context, vm: VmHook, job: Job) -> dict:
        """Step-specific results read back from the VM."""
        return {}


class MaxTextInstallOperator(MaxTextJobOperator):
    """
    Install MaxText on the VM, as the tutorials do (or the CPU recipe locally). Cached: a marker in the venv keyed
    by version and extras makes a re-run a no-op in seconds; with ``checkpoint_storage`` a new VM restores the
    environment from an archive in ``<checkpoint_storage>/environments`` (see recipes/install.py).

    :param maxtext_version: default: the model profile's (the tutorials: 0.2.2 for SFT, 0.2.3 for RL).
    :param save_environment: after a fresh install, save the archive for later VMs (one VM of a run does).
    """

    template_fields: Sequence[str] = (*MaxTextJobOperator.template_fields, "maxtext_version")
    step_title = "Install"
    quick_job_wait = 5.0  # a reused or restored environment is ready in seconds

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
            install.install_script(spec.runtime, version, cache, save=self.save_environment),
            None,
            {"venv": spec.runtime.venv, "maxtext_version": version},
        )

    def prepare(self, vm: VmHook, spec: maxtext.RunSpec, job: Job) -> None:
        if not spec.runtime.is_cpu:
            return
        launchers = resources.files("airflow_tpu_posttrain.local") / "vm_launchers"
        for launcher in launchers.iterdir():
            if launcher.name.endswith(".py"):
                vm.put_bytes(f"{spec.runtime.launcher_dir}/{launcher.name}", launcher.read_bytes(), 0o644)


class MaxTextConvertOperator(MaxTextJobOperator):
    """
    Convert the Hugging Face checkpoint to MaxText format (``to_maxtext``). Skipped when a complete conversion
    exists. XCom: ``converted_params`` (the path the trainers load), and with checkpoint storage
    ``conversion_key`` and ``source_revision``.

    With ``checkpoint_storage`` the conversion is cached there under a key of (MaxText version, source revision,
    conversion arguments): the source revision is the Hub's current commit of the model (asked with the
    ``hf_conn_id`` token). Scheduled retraining and
    backfills then convert once per new revision or MaxText release.

    :param maxtext_version: the MaxText release installed on the VM (default: the model profile's).
    :param use_pathways: the tutorials' USE_PATHWAYS (zarr3/ocdbt storage off when true).
    """

    template_fields: Sequence[str] = (*MaxTextJobOperator.template_fields, "maxtext_version")
    step_title = "Convert"

    def __init__(
        self, *, maxtext_version: str | None = None, use_pathways: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.maxtext_version = maxtext_version
        self.use_pathways = use_pathways

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
        """Which weights the conversion reads: the Hub's commit of the model now."""
        from huggingface_hub import HfApi

        token = self._token() if self.hf_conn_id else None
        return HfApi(endpoint=self._hub_endpoint(), token=token).model_info(model.hf_source).sha

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        command = maxtext.to_maxtext(spec, use_pathways=self.use_pathways)
        outputs = {"converted_params": spec.layout.converted_params}
        if spec.layout.conversion_key:
            outputs["conversion_key"] = spec.layout.conversion_key
        return Job(
            command.script(),
            f"{spec.layout.converted_dir}/.complete",
            outputs,
            reads_hub=True,
        )


class _TrainOperator(MaxTextJobOperator):
    """What SFT and GRPO share: the converted checkpoint, overrides, the durable final checkpoint, and recovery
    from the loss of the VM (with checkpoint storage: the VM is created again and training resumes)."""

    template_fields: Sequence[str] = (
        *MaxTextJobOperator.template_fields,
        "overrides",
        "converted_params",
        "max_recoveries",
    )

    def __init__(
        self,
        *,
        overrides: Sequence[str] | None = None,
        convert_task_id: str = "convert_to_maxtext",
        converted_params: str | None = None,
        max_recoveries: int | str = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.overrides = overrides
        self.converted_params = (
            converted_params or f"{{{{ ti.xcom_pull(task_ids='{convert_task_id}')['converted_params'] }}}}"
        )
        self.max_recoveries = max_recoveries

    def execute(self, context: Context) -> Any:
        self.validate(self.run_spec(context), context)  # bad input fails before Compute is asked anything
        lost = self.vm_lost(context)
        if lost:
            return self.recover(context, lost)
        self.adopt_current_vm(context)
        return super().execute(context)

    def start_on_vm(self, context: Context) -> Any:
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        self.adopt_recovered_vm(context)
        return super().execute_complete(context, event)

    def on_vm_lost(self, context: Context, lost: Any) -> Any:
        return self.recover(context, lost)

    def results(self, context: Context, vm: VmHook, job: Job) -> dict:
        """The final checkpoint must be durable (in storage, or on the VM in the seeds' layout) before the task
        succeeds: the TPU VM is deleted right after."""
        checkpoint = job.outputs["checkpoint"]
        if not vm.exists(checkpoint):
            raise CheckpointMissingError(
                f"{self.step_title} finished but its final checkpoint {checkpoint} is missing; "
                "a retry resumes from the newest checkpoint"
            )
        return {}

    def _overrides(self) -> list[str]:
        overrides = validation.blank_to_none(self.overrides)
        if isinstance(overrides, str):
            return [pair for pair in overrides.split() if pair]
        return list(overrides or [])


class SftTrainOperator(_TrainOperator):
    """
    Supervised fine-tuning (``train_sft``) from the converted checkpoint (``converted_params``, default: the
    convert task's XCom). The run name is deterministic per DAG
    run, so a retry resumes from the newest checkpoint; a finished run is not retrained. XCom: ``checkpoint``
    (the final ``model_params``), ``run_name``, ``metrics``.

    :param steps: training steps (tutorial: 1000).
    :param dataset: Hub dataset id or ``json`` (tutorial: HuggingFaceH4/ultrachat_200k).
    :param train_split: (tutorial: train_sft). :param train_data_columns: (tutorial: ``['messages']``).
    :param checkpoint_period: steps between checkpoints: how much a retry or a recovery can lose.
    :param overrides: extra MaxText ``key=value`` pairs, validated.
    :param max_recoveries: how many times a try may create the VM again after losing it (preempted, host
        error) and resume training from storage; 0: the loss fails the task.
    """

    template_fields: Sequence[str] = (
        *_TrainOperator.template_fields,
        "steps",
        "dataset",
        "train_split",
        "train_data_columns",
        "checkpoint_period",
    )
    step_title = "SFT"

    def __init__(
        self,
        *,
        steps: int | str | None = None,
        dataset: str | None = None,
        train_split: str | None = None,
        train_data_columns: str | None = None,
        checkpoint_period: int | str = maxtext.DEFAULT_SFT_CHECKPOINT_PERIOD,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.steps = steps
        self.dataset = dataset
        self.train_split = train_split
        self.train_data_columns = train_data_columns
        self.checkpoint_period = checkpoint_period

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        steps = validation.optional_count("steps", self.steps) or spec.model.sft_steps
        base = spec.model.sft_dataset
        hf_path = validation.blank_to_none(self.dataset) or base.hf_path
        dataset = SftDataset(
            hf_path=hf_path,
            train_split=validation.blank_to_none(self.train_split) or base.train_split,
            train_data_columns=validation.blank_to_none(self.train_data_columns) or base.train_data_columns,
            train_files=base.train_files if hf_path == base.hf_path else None,
            eval_split=base.eval_split,
        )
        command = maxtext.train_sft(
            spec,
            steps=steps,
            dataset=dataset,
            checkpoint_period=int(self.checkpoint_period),
            overrides=self._overrides(),
            converted_params=self.converted_params,
        )
        run_dir = posixpath.dirname(spec.layout.checkpoints_dir)
        return Job(
            command.script(),
            f"{run_dir}/.complete-{steps}",
            {"checkpoint": spec.layout.sft_params(steps), "run_name": spec.layout.run_name, "steps": steps},
            reads_hub=True,
        )


class GrpoTrainOperator(_TrainOperator):
    """
    GRPO reinforcement learning (``train_rl``) from the converted checkpoint; resumable like SFT. XCom:
    ``checkpoint`` (the actor's final ``model_params``), ``run_name``, ``metrics`` (pre/post accuracy, reward).

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
            },
            reads_hub=True,
        )


class HfExportOperator(MaxTextJobOperator):
    """
    Export the trained checkpoint to Hugging Face format (``to_huggingface``), check it, and publish it durably
    BEFORE the VM can go: to a Hub repo (private by default, one branch per DAG run, commit message naming dag
    and run) and/or a copy to a storage URI (``gs://``, ``file://`` or a local directory on the VM).

    With checkpoint storage (the split layout) the checked export is first kept there
    (``<checkpoint_storage>/exports/<run name>``): a failed publish loses nothing (the URI is in the error and
    in XCom ``kept_export``), and a retry or a re-run on a new VM publishes that copy without exporting again.

    XCom: ``export_dir``, ``kept_uri``, ``hub`` (``repo_id, revision, commit_sha, url``), ``storage_uri``,
    ``validated``.

    :param train_task_id: the training task whose XCom ``checkpoint`` to export.
    :param hub_repo_id: ``owner/name`` on the Hub (or None). :param hub_private: create the repo private.
    :param storage_uri: where to copy the model, into ``<storage_uri>/<run name>`` (or None). At least one
        publish target is required.
    """

    template_fields: Sequence[str] = (
        *MaxTextJobOperator.template_fields,
        "trained_checkpoint",
        "hub_repo_id",
        "storage_uri",
    )
    operator_extra_links = (PublishedModelLink(),)
    step_title = "Export"

    def __init__(
        self,
        *,
        train_task_id: str = "train",
        trained_checkpoint: str | None = None,
        hub_repo_id: str | None = None,
        hub_private: bool = True,
        storage_uri: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trained_checkpoint = (
            trained_checkpoint or f"{{{{ ti.xcom_pull(task_ids='{train_task_id}')['checkpoint'] }}}}"
        )
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
        """Whether the kept export is complete; False when that cannot be read (the hint must not mask the
        step's own error)."""
        try:
            with self._vm() as vm:
                return vm.exists(f"{kept}.complete")
        except Exception as err:  # noqa: BLE001 - any failure here only loses the hint
            self.log.warning("Could not check the kept export at %s: %s", kept, err)
            return False

    def _publish_script_path(self) -> str:
        return f"{self.workdir}/vm_scripts/publish_model.py"

    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        hub_repo_id = validation.blank_to_none(self.hub_repo_id)
        storage_uri = validation.blank_to_none(self.storage_uri)
        if not hub_repo_id and not storage_uri:
            raise SpecError("publish target", None, "is missing", "set hub_repo_id and/or storage_uri")
        export = maxtext.to_huggingface(spec, self.trained_checkpoint)
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
        export_marker = f"{spec.layout.export_dir}/.complete"
        kept = spec.layout.kept_export_dir
        export_step = [f"  bash -c {shlex.quote(export.script())}"]
        if kept:
            publish += ["--keep-uri", kept]
            restore = storage.copy_tree_command(kept, spec.layout.export_dir)
            export_step = [
                f"  if {storage.exists_command(kept + '.complete')}; then",
                f"    echo {shlex.quote(f'Restoring the export kept at {kept} (checked by an earlier try)')}",
                f"    {restore}",
                "  else",
                f"  {export_step[0]}",
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
                shlex.join(publish),
            ]
        )
        return Job(
            script + "\n",
            None,
            {"export_dir": spec.layout.export_dir, "result_file": result_file},
            reads_hub=True,  # to_huggingface takes the tokenizer from the base model's repo
            token_file=bool(hub_repo_id),
        )

    def prepare(self, vm: VmHook, spec: maxtext.RunSpec, job: Job) -> None:
        script = resources.files("airflow_tpu_posttrain.vm_scripts") / "publish_model.py"
        vm.put_bytes(self._publish_script_path(), script.read_bytes(), 0o644)

    def results(self, context: Context, vm: VmHook, job: Job) -> dict:
        text = vm.get_text(job.outputs["result_file"])
        if text is None:
            raise AirflowFailException(
                f"Publishing left no result file; the exported model is on the VM at {job.outputs['export_dir']}"
            )
        published = json.loads(text)
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
            context["ti"].xcom_push(key=PublishedModelLink().xcom_key, value=link)
        return published
