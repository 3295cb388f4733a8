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

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.defaults import HF_CONN_ID, SSH_CONN_ID
from airflow_tpu_posttrain.exceptions import InvalidInputError, RemoteJobError
from airflow_tpu_posttrain.operators.compute_base import deployment_id
from airflow_tpu_posttrain.operators.recovery import VmRecoveryMixin
from airflow_tpu_posttrain.operators.vm_connection import VmConnectionMixin
from airflow_tpu_posttrain.recipes import compute, layout, maxtext, remote_job, storage, validation
from airflow_tpu_posttrain.recipes.accelerators import DEFAULT_ACCELERATOR, Accelerator, accelerator
from airflow_tpu_posttrain.recipes.models import ModelProfile, model_profile
from airflow_tpu_posttrain.recipes.runtime import (
    LOCAL_VENV,
    Runtime,
    cpu_runtime,
    local_python,
    tpu_runtime,
)
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths
    from airflow.sdk import Context

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.recipes.metrics import TrainingMetrics

DEFAULT_WORKDIR = "/tmp/airflow-tpu-posttrain"
LOG_REST_BYTES = 65536  # of a finished job's log past what its watch streamed, read into the task's log


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
        prefetch: str | None = None,
        claim: tuple[str, str] | None = None,
        done_check: str | None = None,
        before_step: str | None = None,
    ):
        self.script = script
        self.done_marker = done_marker
        self.done_check = done_check  # a command on the VM whose exit 0 says the step's result is there already
        self.outputs = outputs
        self.reads_hub = reads_hub  # MaxText / transformers download the model: HF_TOKEN and HF_ENDPOINT set
        self.token_file = token_file  # publish_model.py reads the token from the file HF_TOKEN_FILE names
        self.prefetch = prefetch  # run with HF_TOKEN before the step, which then runs without it
        self.claim = claim  # (take, release-on-failure): one run at a time writes done_marker's output
        self.before_step = before_step  # run just before the step, without the token (a resumed trainer's clean-up)


class MaxTextJobOperator(VmRecoveryMixin, VmConnectionMixin, BaseOperator):
    """Base of the MaxText steps: runs a step's script as a detached, re-attachable job on the VM.

    When the VM is gone (Compute says so, not merely an SSH error) the step fails with :class:`VmLostError`;
    training recovers (``operators/recovery.py``).

    :param model: model profile key (``gemma3-4b``, ``llama3.1-8b-Instruct``, ``tiny-llama``).
    :param ssh_conn_id: SSH connection to the VM (login and private key); the host is the VM's.
    :param vm: the VM's record from its create task, wired as that task's XComArg (``create.output``): its
        address, login, proxy command, host keys and accelerator type are the defaults of the five below. A
        multi-host slice's record (``TpuSliceCreateOperator``) lists its VMs: the step runs on every one, as one
        job (worker 0's log in Airflow; when one worker fails, the others are stopped), and its checkpoints
        must go to ``checkpoint_storage``.
    :param remote_host: the VM's address, when it does not come from ``vm``.
    :param ssh_login: the login on the VM (default: the one the create task let in, from ``vm``: the
        connection's login, or the OS Login POSIX name); empty: the connection's login.
    :param ssh_proxy_command: reach the VM through this command (default: the IAP tunnel the create task names,
        from ``vm``, its gcloud run as the create's Google connection; empty: dial ``remote_host`` directly).
    :param host_keys: ``{key type: base64}`` the VM must present (default: the ones it published, from
        ``vm``); every connection, in the worker and in the triggerer, is pinned to them.
    :param accelerator_type: default: the VM's, from ``vm``.
    :param maxtext_venv: MaxText's venv on the VM (default ``maxtext_venv`` in the SSH user's home; a local model's:
        the local stack's).
    :param root_dir: where the run's files go on the VM (default ``/dev/shm/<model>``, as in the tutorials).
    :param checkpoint_storage: ``gs://bucket/prefix`` (or, locally, a directory every VM sees) for the converted
        and trained checkpoints (the split layout); empty: everything under ``root_dir`` (the tutorials').
    :param workdir: the jobs' scripts, logs and launchers on the VM.
    :param hf_conn_id: connection whose password is the Hugging Face token (and whose host, if set, the Hub
        endpoint; default ``hf_default``, as the registry's; None: anonymous); needed to read gated models and to
        publish.
    :param poll_interval: seconds between the trigger's polls of the job.
    :param max_reconnect_attempts: consecutive SSH failures the trigger rides out (with backoff).
    :param stall_timeout_s: seconds without output from the job after which it is taken for hung (a trainer whose
        storage is unreachable is silent for minutes before it fails): its processes are stopped and the try
        fails, so a retry resumes from the newest checkpoint instead of the VM idling. 0: never.
    """

    # Fields filled from an upstream task's record (an XComArg) when not given: {field: (record field, its key)}.
    fields_from_records: Mapping[str, tuple[str, str]] = MappingProxyType({})
    template_fields: Sequence[str] = (
        "vm",
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

    def __init__(
        self,
        *,
        model: str,
        ssh_conn_id: str = SSH_CONN_ID,
        vm: Any = None,
        remote_host: str | None = None,
        ssh_login: str | None = None,
        ssh_proxy_command: str | None = None,
        host_keys: dict[str, str] | str | None = None,
        accelerator_type: str | None = None,
        maxtext_venv: str | None = None,
        root_dir: str | None = None,
        checkpoint_storage: str | None = None,
        workdir: str = DEFAULT_WORKDIR,
        hf_conn_id: str | None = HF_CONN_ID,
        poll_interval: int = 10,
        log_chunk_size: int = 65536,
        command_timeout: float = 30.0,
        max_reconnect_attempts: int = 8,
        stall_timeout_s: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.vm = vm
        self.ssh_conn_id = ssh_conn_id
        self.remote_host = remote_host
        self.ssh_login = ssh_login
        self.ssh_proxy_command = ssh_proxy_command
        self.host_keys = host_keys
        self.model = model
        self.accelerator_type = accelerator_type
        self.maxtext_venv = maxtext_venv
        self.root_dir = root_dir
        self.checkpoint_storage = checkpoint_storage
        self.workdir = workdir
        self.hf_conn_id = hf_conn_id
        self.poll_interval = poll_interval
        self.log_chunk_size = log_chunk_size
        self.command_timeout = command_timeout
        self.max_reconnect_attempts = max_reconnect_attempts
        self.stall_timeout_s = stall_timeout_s

    def render_template_fields(self, context: Context, jinja_env: Any = None) -> None:
        """Render, then fill what was not given explicitly from the records rendered by now.

        The VM's (``vm``), and each of ``fields_from_records``: ``{field: (record field, key)}``."""
        super().render_template_fields(context, jinja_env)
        for field, (record_field, key) in self.fields_from_records.items():
            record = getattr(self, record_field)
            if not getattr(self, field) and isinstance(record, dict):
                setattr(self, field, record.get(key))
        vm = self.vm if isinstance(self.vm, dict) else {}
        lead = (vm.get("vms") or [vm])[0]  # a slice's worker 0: the connection fields are its
        self.remote_host = self.remote_host or lead.get("ssh_address")
        self.ssh_login = self.ssh_login or lead.get("ssh_login")
        if self.ssh_proxy_command is None:
            self.ssh_proxy_command = lead.get("ssh_proxy_command")
            self.ssh_proxy_account = lead.get("ssh_proxy_account")
        self.host_keys = self.host_keys or lead.get("host_keys")
        self.accelerator_type = self.accelerator_type or vm.get("accelerator_type")

    def _workers(self) -> list[dict]:
        """The VMs of a multi-host slice by worker id (the slice create's record); [] for one VM."""
        vm = self.vm if isinstance(self.vm, dict) else {}
        return sorted(vm.get("vms") or [], key=lambda worker: int(worker["worker_id"]))

    def _vm_of(self, worker: dict) -> VmHook:
        """A connection to one VM of the slice, pinned to the host keys it published."""
        from airflow_tpu_posttrain.hooks.vm import VmHook

        return VmHook(
            ssh_conn_id=self.ssh_conn_id,
            remote_host=worker["ssh_address"],
            username=self.ssh_login or worker.get("ssh_login") or None,
            host_keys=worker["host_keys"],
            proxy_command=self._proxy_command(),
            proxy_account=self.ssh_proxy_account,
        )

    def _for_worker(self, spec: maxtext.RunSpec, worker_id: int) -> maxtext.RunSpec:
        """``spec`` on worker ``worker_id`` of the slice: how its program finds the others (their internal IPs)."""
        if not spec.accelerator.is_multi_host:
            return spec
        addresses = tuple(worker["internal_ip"] for worker in self._workers())
        return dataclasses.replace(spec, worker=maxtext.SliceWorker(worker_id, addresses))

    @property
    def jobs_dir(self) -> str:
        return f"{self.workdir}/jobs"

    @property
    def storage_tool(self) -> storage.GcsTool:
        """How the VM reaches ``gs://`` storage: ``vm_scripts/gcs_tool.py`` run by the MaxText venv's python.

        The tool is copied by :meth:`ship_storage_tool`; the venv's python has google-cloud-storage (a MaxText
        dependency)."""
        return storage.GcsTool(
            script=f"{self.workdir}/vm_scripts/{storage.GCS_TOOL_NAME}",
            python=f"{self._runtime().venv}/bin/python",
        )

    def ship_storage_tool(self, vm: VmHook, spec: maxtext.RunSpec) -> None:
        """Copy ``gcs_tool.py`` to the VM when the run's storage is ``gs://`` (each try: a new VM has none)."""
        if storage.is_gcs(spec.layout.storage):
            tool = resources.files("airflow_tpu_posttrain.vm_scripts") / storage.GCS_TOOL_NAME
            vm.put_bytes(self.storage_tool.script, tool.read_bytes(), 0o644)

    # -- what each step defines ------------------------------------------------------------------
    def build_job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        raise NotImplementedError

    # -- shared machinery ------------------------------------------------------------------------
    def _runtime(self) -> Runtime:
        """A cloud model's: the TPU VM's (the tutorials'); a local model's: the local stack's CPU "VM"'s."""
        if model_profile(self.model).is_local:
            return cpu_runtime(f"{self.workdir}/launchers", self.maxtext_venv or LOCAL_VENV, local_python())
        return tpu_runtime(self.maxtext_venv or "maxtext_venv")

    def _profile(self) -> ModelProfile:
        return model_profile(self.model)

    def run_spec(self, context: Context, conversion_key: str = "") -> maxtext.RunSpec:
        """Everything the user gave, validated; bad input fails the task at once, without retries."""
        try:
            validation.safe_absolute_path("workdir", self.workdir)
            dag_run = context["dag_run"]
            name = layout.run_name(
                dag_run.dag_id, dag_run.run_id, getattr(dag_run, "logical_date", None), deployment_id()
            )
            profile = self._profile()
            return maxtext.RunSpec(
                model=profile,
                accelerator=self._accelerator(),
                runtime=self._runtime(),
                layout=layout.RunLayout(
                    profile.key, name, self.root_dir or "", self.checkpoint_storage or "", conversion_key
                ),
            )
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def _accelerator(self) -> Accelerator:
        """The accelerator; a multi-host slice needs its VMs (``vm``) and checkpoint storage every VM writes to."""
        acc = accelerator(self.accelerator_type or DEFAULT_ACCELERATOR)
        if acc.is_multi_host:
            if len(self._workers()) < 2:
                raise SpecError(
                    "vm", None, f"names no VMs of the multi-host slice {acc.type}",
                    "wire the slice's create task (TpuSliceCreateOperator) as vm",
                )
            if not self.checkpoint_storage:
                raise SpecError(
                    "checkpoint_storage", None,
                    f"is required on a multi-host slice ({acc.type}): every VM writes its part of each checkpoint",
                    "give gs://bucket/prefix",
                )
        return acc

    def _remote_job_id(self, context: Context) -> str:
        dag_run = context["dag_run"]
        task = re.sub(r"[^a-z0-9]+", "-", self.task_id.lower()).strip("-")[:40]
        return f"{task}-{compute.run_hash(dag_run.dag_id, dag_run.run_id)}"

    def _job_script(self, job: Job, paths: RemoteJobPaths) -> tuple[str, str | None]:
        """The script the detached job runs, and where the token file goes (if the step needs one)."""
        needs_token = job.reads_hub or job.token_file or job.prefetch
        token_file = f"{self.workdir}/secrets/{paths.job_id}.token" if needs_token else None
        script = remote_job.wrapper_script(
            f"{paths.job_dir}.step.sh",
            paths.log_file,
            token_file=token_file,
            token_in_env=job.reads_hub,
            keep_token_file=job.token_file,
            prefetch=job.prefetch,
            hub_endpoint=self._hub_endpoint() if job.reads_hub or job.prefetch else None,
            done_marker=job.done_marker,
            storage_tool=self.storage_tool if job.done_marker and storage.is_gcs(job.done_marker) else None,
            claim=job.claim,
            before_step=job.before_step,
        )
        return script, token_file

    def _job(self, spec: maxtext.RunSpec, context: Context) -> Job:
        """The step's job; on a slice, worker 0's unless ``spec`` names the worker."""
        if spec.worker is None:
            spec = self._for_worker(spec, 0)
        try:
            return self.build_job(spec, context)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err

    def execute(self, context: Context) -> Any:
        spec = self.run_spec(context)
        self.validate(spec, context)
        from airflow.providers.ssh.utils.remote_job import RemoteJobPaths

        paths = RemoteJobPaths(job_id=self._remote_job_id(context), remote_os="posix", base_dir=self.jobs_dir)
        if self._workers():
            return self._execute_on_slice(context, spec, paths)
        with self._vm() as vm:
            self.ship_storage_tool(vm, spec)
            spec = self.resolve(context, vm, spec)
            job = self._job(spec, context)
            if job.done_marker and vm.exists(job.done_marker, self.storage_tool):
                self.log.info(
                    "%s: output already complete (%s); nothing to redo", self.step_title, job.done_marker
                )
                return self.finish(context, job, paths, self._report(vm, context, job, paths), reused=True)
            if job.done_check:
                status, said = vm.run_status(job.done_check)
                if status == 0:
                    self.log.info("%s: %s", self.step_title, said.strip())
                    return self.finish(context, job, paths, self._report(vm, context, job, paths), reused=True)
            state, log_offset = vm.job_state(paths)
            if state == "running":
                self.log.info("Re-attaching to job %s, still running on the VM", paths.job_id)
            else:
                if state == "succeeded":
                    self.log.info("Job %s already finished successfully on the VM", paths.job_id)
                    return self.finish(context, job, paths, self._report(vm, context, job, paths), reused=True)
                if state != "absent":
                    self.log.info(
                        "Earlier job %s %s; starting it again (training resumes from its checkpoint)",
                        paths.job_id,
                        state,
                    )
                    vm.run(f"mv {shlex.quote(paths.job_dir)} {shlex.quote(paths.job_dir)}.$(date +%s)")
                self._start(vm, spec, job, paths)
                log_offset = 0
        return self._watch(context, job, paths, log_offset=log_offset, first=True)

    def _execute_on_slice(self, context: Context, spec: maxtext.RunSpec, paths: RemoteJobPaths) -> Any:
        """The step on every VM of the slice, as one job.

        Reused when done on every VM, re-attached when running on every VM; else whatever still runs is stopped
        and every VM starts again (training resumes from its newest checkpoint)."""
        workers = self._workers()
        with self._vm_of(workers[0]) as vm:
            self.ship_storage_tool(vm, spec)
            spec = self.resolve(context, vm, spec)
            lead = self._job(self._for_worker(spec, 0), context)
            if lead.done_marker and vm.exists(lead.done_marker, self.storage_tool):
                self.log.info("%s: output already complete (%s); nothing to redo", self.step_title, lead.done_marker)
                return self.finish(context, lead, paths, self._report(vm, context, lead, paths), reused=True)
        states = []
        for worker in workers:
            with self._vm_of(worker) as vm:
                job = self._job(self._for_worker(spec, int(worker["worker_id"])), context)
                if worker is not workers[0]:
                    self.ship_storage_tool(vm, spec)
                if job.done_check and vm.run_status(job.done_check)[0] == 0:
                    states.append(("succeeded", 0))
                else:
                    states.append(vm.job_state(paths))
        log_offset = states[0][1]
        if all(state == "succeeded" for state, _ in states):
            self.log.info("%s: done on every VM of the slice already", self.step_title)
            with self._vm_of(workers[0]) as vm:
                return self.finish(context, lead, paths, self._report(vm, context, lead, paths), reused=True)
        if all(state == "running" for state, _ in states):
            self.log.info("Re-attaching to job %s, still running on the slice's %d VMs", paths.job_id, len(workers))
        else:
            self.log.info(
                "Starting job %s on the slice's %d VMs (earlier: %s)",
                paths.job_id, len(workers), ", ".join(f"worker {i} {state}" for i, (state, _) in enumerate(states)),
            )
            for worker, (state, _) in zip(workers, states, strict=True):
                with self._vm_of(worker) as vm:
                    if state == "running":
                        vm.run(remote_job.stop_command(paths.pid_file), check=False)
                    if state != "absent":
                        vm.run(f"mv {shlex.quote(paths.job_dir)} {shlex.quote(paths.job_dir)}.$(date +%s)")
                    self._start(vm, spec, self._job(self._for_worker(spec, int(worker["worker_id"])), context), paths)
            log_offset = 0
        return self._watch(context, lead, paths, log_offset=log_offset, first=True)

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

    def _watch(self, context: Context, job: Job, paths: RemoteJobPaths, log_offset: int, first: bool = False) -> None:
        """Defer to the remote-job trigger; before the first deferral, record the job for ``on_kill``."""
        from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger
        from airflow_tpu_posttrain.triggers.slice_job import SliceJobTrigger

        peers = [
            {
                "worker_id": int(worker["worker_id"]),
                "name": worker["name"],
                "remote_host": worker["ssh_address"],
                "login": self.ssh_login or worker.get("ssh_login"),
                "host_keys": worker["host_keys"],
            }
            for worker in self._workers()[1:]
        ]
        watch = SliceJobTrigger if peers else MaxTextJobTrigger
        if first:
            context["ti"].xcom_push(
                key="ssh_remote_job",
                value={"job_id": paths.job_id, "log_file": paths.log_file, "pid_file": paths.pid_file},
            )
        self.defer(
            trigger=watch(
                **({"peers": peers} if peers else {}),
                ssh_conn_id=self.ssh_conn_id,
                remote_host=self.remote_host,
                login=self.ssh_login or None,
                proxy_command=self._proxy_command(),
                proxy_account=self.ssh_proxy_account,
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
                stall_timeout=self.stall_timeout_s,
                on_output=self.on_output(context, paths),
                report_command=self._report_command(context, job, paths),
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
            job = self._job(self.resolved(context, self.run_spec(context)), context)
            return self._watch(context, job, paths, log_offset=event.get("log_offset", 0))
        exit_code = event.get("exit_code")
        if event.get("workers"):
            self._log_worker_tails(event)
        elif exit_code is not None:
            self._log_rest(paths.log_file, event.get("log_offset", 0))
        if exit_code == remote_job.JOB_DIED:
            raise RemoteJobError(
                f"{self.step_title}: the job on the VM died without an exit code (killed, out of memory?); "
                f"a retry resumes from the newest checkpoint (log: {paths.log_file})"
            )
        if exit_code == remote_job.JOB_STALLED:
            raise RemoteJobError(
                f"{self.step_title}: no output from the job on the VM for {self.stall_timeout_s} s (storage "
                f"unreachable? a hung process?); it was stopped, and a retry resumes from the newest checkpoint "
                f"(log: {paths.log_file})"
            )
        if exit_code is None:
            lost = self.vm_lost(context)
            if lost:
                return self.on_vm_lost(context, lost)
            raise RemoteJobError(
                f"{self.step_title}: lost the job on the VM: {event.get('message', 'unknown error')}"
            )
        if event.get("workers"):
            raise RemoteJobError(
                f"{self.step_title} failed on worker {event['failed_worker']} of the slice with exit code "
                f"{exit_code}; the other workers were stopped (log on each VM: {paths.log_file}). A retry starts "
                "every worker again from the newest checkpoint"
            )
        if exit_code != 0:
            raise RemoteJobError(
                f"{self.step_title} failed on the VM with exit code {exit_code} (log: {paths.log_file})"
                f"{self.failure_hint(context)}"
            )
        job = self._job(self.resolved(context, self.run_spec(context)), context)
        report = event.get("report")
        if report is None:  # the watch could not read it
            with self._vm() as vm:
                report = vm.run(self._report_command(context, job, paths), timeout=remote_job.REPORT_TIMEOUT_S)
        return self.finish(context, job, paths, remote_job.parse_report(report), reused=False)

    def _log_rest(self, log_file: str, streamed: int) -> None:
        """The end of a finished job's log past what the watch streamed: its last lines, an error's among them.

        The watch hands over at most ``log_chunk_size`` bytes a poll, and a job that wrote more than that since its
        last poll (MaxText prints its whole config at start-up) would otherwise end without its traceback in the
        task's log. The last ``LOG_REST_BYTES`` of it; a failure to read it only loses those lines."""
        command = f"tail -c +{int(streamed) + 1} {shlex.quote(log_file)} | tail -c {LOG_REST_BYTES}"
        try:
            with self._vm() as vm:
                rest = vm.run(command, timeout=remote_job.REPORT_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - the job's outcome does not depend on these lines
            self.log.warning("Could not read the end of the job's log %s: %s", log_file, err)
            return
        for line in rest.splitlines():
            self.log.info("[remote] %s", line)

    def _log_worker_tails(self, event: dict[str, Any]) -> None:
        """The end of every worker's log, however the slice's job ended (failed, died, stalled)."""
        for worker, said in sorted(event["workers"].items(), key=lambda item: int(item[0])):
            self.log.error("Worker %s (exit code %s), the end of its log:", worker, said["exit_code"])
            for line in said["tail"].splitlines():
                self.log.error("[worker %s] %s", worker, line)

    def on_kill(self) -> None:
        """A kill of the running task stops the job's processes on the VM."""
        ti = getattr(self, "task_instance", None)
        job = ti.xcom_pull(task_ids=self.task_id, key="ssh_remote_job") if ti else None
        if not job:
            return
        self.log.info("Killing job %s on the VM", job["job_id"])
        for worker in self._workers() or [None]:
            with self._vm_of(worker) if worker else self._vm() as vm:
                vm.run(remote_job.stop_command(job["pid_file"]), check=False)

    def report_commands(self, context: Context, job: Job, paths: RemoteJobPaths) -> dict[str, str]:
        """What ``finish`` reads from the VM, ``{name: command}``: the job's metric lines, and each step's own.

        Run as one command (``remote_job.report_command``) by the job's watch when the job succeeded, or here
        when a finished output is reused. The metric lines are the log's, or, when the job finished on an
        earlier VM (its log went with that VM's disk), those kept in storage."""
        lines = remote_job.metric_lines_command(paths.log_file)
        if job.done_marker:
            kept = storage.read_command(storage.metrics_uri(job.done_marker), self.storage_tool)
            lines = f'm=$({lines}); if [ -n "$m" ]; then printf "%s\\n" "$m"; else {kept} 2>/dev/null || true; fi'
        return {"metric_lines": lines}

    def _report_command(self, context: Context, job: Job, paths: RemoteJobPaths) -> str:
        return remote_job.report_command(self.report_commands(context, job, paths))

    def _report(
        self, vm: VmHook, context: Context, job: Job, paths: RemoteJobPaths
    ) -> dict[str, remote_job.ReportItem]:
        output = vm.run(self._report_command(context, job, paths), timeout=remote_job.REPORT_TIMEOUT_S)
        return remote_job.parse_report(output)

    def finish(
        self,
        context: Context,
        job: Job,
        paths: RemoteJobPaths,
        report: dict[str, remote_job.ReportItem],
        reused: bool,
    ) -> dict:
        """Parse metrics, push outputs and metrics, log the one-line summary; from the VM's ``report``."""
        from airflow_tpu_posttrain.recipes.metrics import parse_lines

        metrics = parse_lines(report["metric_lines"].stdout.splitlines())
        result = {**job.outputs, "metrics": metrics.as_xcom(), "reused": reused}
        result.update(self.results(context, job, metrics, paths, report))
        self.log.info("%s%s", metrics.summary(self.step_title), " (reused)" if reused else "")
        return result

    def failure_hint(self, context: Context) -> str:
        """What a user should know when the step failed (appended to the error)."""
        return ""

    def on_output(self, context: Context, paths: RemoteJobPaths) -> dict[str, str] | None:
        """What the job's watch runs on the VM at every poll until it acted (``MaxTextJobTrigger``); None: nothing."""
        return None

    def results(
        self,
        context: Context,
        job: Job,
        metrics: TrainingMetrics,
        paths: RemoteJobPaths,
        report: dict[str, remote_job.ReportItem],
    ) -> dict:
        """Step-specific results, from what the VM reported (``report_commands``; ``metrics``: the job's log)."""
        return {}
