"""The worker running a step dies right after starting its job (SIGKILL, lost node).

The job keeps running on the VM, and the next try re-attaches to it instead of starting a second one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from conftest import access_token

VM_ZONE = "local-cpu1-a"


class FakeTaskInstance:
    """What the operator uses of a task instance: its id and XCom push."""

    def __init__(self) -> None:
        self.id = "ti-1"
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


@pytest.fixture(autouse=True)
def _deployment(configured_deployment):
    """The steps' ``execute`` is called here outside a task process."""


def context(run_id: str = "manual__reattach"):
    dag_run = SimpleNamespace(dag_id="reattach_dag", run_id=run_id, logical_date=None)
    return {"dag_run": dag_run, "ti": FakeTaskInstance()}


def _compute(method: str, url: str, token: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read() or b"{}")


def _delete_when_ready(url: str, token: str) -> None:
    """DELETE, asked again while Compute answers 400 resourceNotReady (a preempted VM still STOPPING)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            _compute("DELETE", url, token)
            return
        except urllib.error.HTTPError as err:
            said = err.read().decode(errors="replace")
            if err.code != 400 or "resourceNotReady" not in said or time.monotonic() > deadline:
                raise AssertionError(f"DELETE {url}: {err.code} {said}") from err
        time.sleep(0.2)


@contextlib.contextmanager
def vm_of_its_own(stack, name: str, zone: str = VM_ZONE) -> Iterator[SimpleNamespace]:
    """A VM of the stack's Compute emulator made as the create task makes one, for steps run outside a DAG.

    The ``local_vm`` connection's public key is in its ``ssh-keys`` metadata, no external IP. Yields its
    machine (``vm``), ``address`` and the ``host_keys`` it published; deleted on exit, its disk with it."""
    from google.oauth2 import service_account

    from airflow_tpu_posttrain.hooks.vm import client_identity
    from airflow_tpu_posttrain.local.stack import LOCAL_PROJECT
    from airflow_tpu_posttrain.recipes import access, compute

    spec = compute.TpuVmSpec(
        project_id=LOCAL_PROJECT, zones=(zone,), accelerator_type="cpu", provisioning_model="STANDARD",
        network_path="internal",
    )
    identity = client_identity("local_vm")
    ssh_keys = access.ssh_keys_metadata(identity.login, identity.public_key, int(time.time()) + 3600)
    instances = f"{stack.compute.url}/compute/v1/projects/{LOCAL_PROJECT}/zones/{zone}/instances"
    token = access_token(
        service_account.Credentials.from_service_account_file(
            stack.google_key_file, scopes=["https://www.googleapis.com/auth/cloud-platform"]
        )
    )
    _compute("POST", instances, token, compute.instance_body(spec, name, zone, labels={}, ssh_keys=ssh_keys))
    try:
        deadline = time.monotonic() + 60
        while _compute("GET", f"{instances}/{name}", token)["status"] != "RUNNING":
            assert time.monotonic() < deadline, f"{name} never became RUNNING"
            time.sleep(0.2)
        vm = stack.fleet.vm((LOCAL_PROJECT, zone, name))
        vm.wait_until_booted(60)
        attributes = _compute("GET", f"{instances}/{name}/getGuestAttributes?queryPath=hostkeys/", token)
        instance = _compute("GET", f"{instances}/{name}", token)
        yield SimpleNamespace(
            vm=vm,
            address=access.ssh_address(instance, "internal"),
            host_keys=access.host_keys_from_guest_attributes(attributes),
        )
    finally:
        _delete_when_ready(f"{instances}/{name}", token)
        deadline = time.monotonic() + 60
        while stack.fleet.vm((LOCAL_PROJECT, zone, name)) is not None and time.monotonic() < deadline:
            _compute("GET", instances, token)  # the emulator moves its operations on when asked
            time.sleep(0.2)
    # Nothing survives a deleted VM: its disk (its /tmp, /var/tmp, /home, /root) is gone, bounded.
    deadline = time.monotonic() + 60
    while vm.disk_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not vm.disk_dir.exists(), vm.disk_dir


def step(stack, machine, operator_class, task_id):
    return operator_class(
        task_id=task_id, model="tiny-llama", ssh_conn_id="local_vm",
        remote_host=machine.address, host_keys=machine.host_keys, accelerator_type="cpu", poll_interval=1,
        hf_conn_id="local_hub",  # the tiny model is a gated repo on the local Hub (dags/models.yaml)
    )


async def until_done(trigger):
    async for event in trigger.run():
        return event


def test_next_try_reattaches_to_the_running_job(stack, capfd):
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_tpu_posttrain.operators.maxtext import MaxTextConvertOperator, MaxTextInstallOperator
    from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR

    with vm_of_its_own(stack, "reattach-vm") as machine:
        # The VM's venv and launchers: a fresh VM installs them (its job may outlast the task's inline wait:
        # then the trigger watches it to the end). Then the install is already there: another run's install
        # job ends within the task's inline wait, so the task finishes without deferring (no second trip
        # through a worker).
        install = step(stack, machine, MaxTextInstallOperator, "install_maxtext")
        try:
            installed = install.execute(context("manual__fresh-vm"))
        except TaskDeferred as deferred:
            event = asyncio.run(until_done(deferred.trigger))
            installed = install.execute_complete(context("manual__fresh-vm"), event.payload)
        assert installed["maxtext_version"] == "0.2.5"
        capfd.readouterr()
        installed = step(stack, machine, MaxTextInstallOperator, "install_maxtext").execute(context())
        assert installed["maxtext_version"] == "0.2.5"
        assert "Reusing the MaxText environment" in "".join(capfd.readouterr())

        first_try = step(stack, machine, MaxTextConvertOperator, "convert_to_maxtext")
        with pytest.raises(TaskDeferred):
            first_try.execute(context())  # the job starts; then this worker is gone

        second_try = step(stack, machine, MaxTextConvertOperator, "convert_to_maxtext")
        with pytest.raises(TaskDeferred) as deferred:
            second_try.execute(context())
        assert "Re-attaching to job" in "".join(capfd.readouterr())
        jobs_dir = machine.vm.guest_path(f"{DEFAULT_WORKDIR}/jobs")
        jobs = sorted(p.name for p in jobs_dir.iterdir() if p.name.startswith("convert"))
        # One job, not a second conversion.
        assert jobs == [f"{jobs[0]}", f"{jobs[0]}.sh", f"{jobs[0]}.step.sh"]

        event = asyncio.run(until_done(deferred.value.trigger))
        assert event.payload["exit_code"] == 0, event.payload
        result = second_try.execute_complete(context(), event.payload)
        assert result["converted_params"].endswith("/mt-format/0/items") and result["reused"] is False
        # The seeds' layout: the conversion is in the VM's own /dev/shm.
        assert machine.vm.guest_path(result["converted_params"]).is_dir()


def test_watch_ends_at_once_when_compute_says_the_vm_is_gone(stack):
    """A preempted VM is not an SSH hiccup.

    The trigger asks Compute when it cannot reconnect, and ends the watch with VM_LOST instead of riding out
    its reconnect budget (minutes of backoff)."""
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.local.stack import LOCAL_PROJECT
    from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR
    from airflow_tpu_posttrain.triggers.remote_job import VM_LOST, MaxTextJobTrigger

    paths = RemoteJobPaths(job_id="preempted", remote_os="posix", base_dir=f"{DEFAULT_WORKDIR}/jobs")
    with vm_of_its_own(stack, "preempted-vm") as machine:
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            vm.run(build_posix_wrapper_command("sleep 300", paths))
        stack.compute.preempt(VM_ZONE, "preempted-vm")
        trigger = MaxTextJobTrigger(
            ssh_conn_id="local_vm", remote_host=machine.address, host_keys=machine.host_keys,
            job_id=paths.job_id, job_dir=paths.job_dir, log_file=paths.log_file,
            exit_code_file=paths.exit_code_file, remote_os="posix", poll_interval=1, max_reconnect_attempts=8,
            vm={"project": LOCAL_PROJECT, "zone": VM_ZONE, "name": "preempted-vm", "gcp_conn_id": "local_compute"},
        )
        # Serialized and rebuilt, as the triggerer does.
        path, kwargs = trigger.serialize()
        assert kwargs["vm"]["name"] == "preempted-vm"
        event = asyncio.run(asyncio.wait_for(until_done(MaxTextJobTrigger(**kwargs)), timeout=60))
        assert event.payload["done"] and event.payload["exit_code"] is None, event.payload
        assert VM_LOST in event.payload["message"], event.payload
        assert "preempted-vm is STOPPING" in event.payload["message"] or "is TERMINATED" in event.payload["message"]


def test_a_job_silent_past_its_stall_timeout_is_stopped_and_a_chatty_one_is_not(stack):
    """A trainer blocked on storage it cannot reach neither exits nor writes: the watch stops it.

    It is stopped after ``stall_timeout`` s without output (SIGTERM, then SIGKILL for a process that ignores
    it), so the try fails and a retry resumes, instead of the VM idling until the task's timeout. Output
    resets the clock."""
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR
    from airflow_tpu_posttrain.recipes import remote_job
    from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

    jobs = {
        # Hung as the trainer was: no output, and SIGTERM ignored.
        "silent": "echo started; trap '' TERM; sleep 300 & wait $!; sleep 300",
        "chatty": "for i in $(seq 8); do echo step $i; sleep 1; done",  # never 3 s without a line
    }
    jobs_dir = f"{DEFAULT_WORKDIR}/jobs"
    paths = {name: RemoteJobPaths(job_id=name, remote_os="posix", base_dir=jobs_dir) for name in jobs}
    with vm_of_its_own(stack, "stall-vm") as machine:

        def watch(name: str) -> dict:
            job = paths[name]
            with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
                vm.run(build_posix_wrapper_command(jobs[name], job))
            trigger = MaxTextJobTrigger(
                ssh_conn_id="local_vm", remote_host=machine.address, host_keys=machine.host_keys,
                job_id=job.job_id, job_dir=job.job_dir, log_file=job.log_file, exit_code_file=job.exit_code_file,
                remote_os="posix", poll_interval=1, stall_timeout=3,
            )
            _, kwargs = trigger.serialize()  # rebuilt, as the triggerer does
            return asyncio.run(asyncio.wait_for(until_done(MaxTextJobTrigger(**kwargs)), timeout=60)).payload

        silent = watch("silent")
        assert silent["done"] and silent["exit_code"] == remote_job.JOB_STALLED, silent
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            job = paths["silent"]
            state = vm.run(remote_job.state_command(job.job_dir, job.pid_file, job.exit_code_file, job.log_file))
            assert remote_job.parse_state(state)[0] == "died", state  # none of its processes is left
            assert vm.run("pgrep -c -x sleep || true").strip() == "0"  # the stop returned once they were gone
        chatty = watch("chatty")
        assert chatty["done"] and chatty["exit_code"] == 0, chatty


def test_the_watch_acts_once_on_a_logged_marker_however_far_behind_its_forwarding_of_the_log_is(stack):
    """How the base model's evaluation is kept while training runs (operators/evaluation.py).

    The job logs 160 kB of start-up (as MaxText's config dump) before the marker, twice, then waits for the watch's
    command to have run: the watch forwards the log 32 bytes a poll (it would take an hour to reach the marker),
    yet the command runs within seconds of the marker, and once, given the log's metric lines (the job fails when
    it waited in vain)."""
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR
    from airflow_tpu_posttrain.recipes.remote_job import when_logged_command
    from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

    marker = "eval metrics after step: 0,"  # MaxText 0.2.2's; 0.2.5 writes the other one watched for
    job = RemoteJobPaths(job_id="marked", remote_os="posix", base_dir=f"{DEFAULT_WORKDIR}/jobs")
    kept = f"{DEFAULT_WORKDIR}/marked.kept"
    script = (
        f"( seq 1 5000 | sed 's/$/ Config param warming_up: 1/'; sleep 2; printf '{marker} loss=6.297\\n%.0s' 1 2; "
        f"for _ in $(seq 1 100); do [ -s {kept} ] && exit 0; sleep 0.2; done; exit 7 )"
    )
    with vm_of_its_own(stack, "marker-vm") as machine:
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            vm.run(build_posix_wrapper_command(script, job))
        trigger = MaxTextJobTrigger(
            ssh_conn_id="local_vm", remote_host=machine.address, host_keys=machine.host_keys,
            job_id=job.job_id, job_dir=job.job_dir, log_file=job.log_file, exit_code_file=job.exit_code_file,
            remote_os="posix", poll_interval=1, log_chunk_size=32,
            on_output={
                "command": when_logged_command(
                    job.log_file, ["Completed eval after train step 0,", marker], f"cat >> {kept}"
                ),
                "description": "keeping",
            },
        )
        _, kwargs = trigger.serialize()  # rebuilt, as the triggerer does
        event = asyncio.run(asyncio.wait_for(until_done(MaxTextJobTrigger(**kwargs)), timeout=120)).payload
        assert event["done"] and event["exit_code"] == 0, event
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            assert vm.run(f"cat {kept}").splitlines() == [f"{marker} loss=6.297"] * 2  # its metric lines, once


def test_a_succeeded_jobs_report_comes_with_its_event_after_the_last_marker_was_acted_on(stack):
    """What a finished step reads from the VM comes in the watch's event: its resumption in a worker asks nothing.

    The job logs the marker as its last line and ends at once, so the watch may see it only in its last poll: the
    report, run after that poll, still reads what the marker's command wrote (the kept base evaluation). A job
    that failed carries no report."""
    from airflow.providers.ssh.utils.remote_job import RemoteJobPaths, build_posix_wrapper_command

    from airflow_tpu_posttrain.hooks.vm import VmHook
    from airflow_tpu_posttrain.operators.maxtext_job import DEFAULT_WORKDIR
    from airflow_tpu_posttrain.recipes.remote_job import parse_report, report_command, when_logged_command
    from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

    marker = "eval metrics after step: 0,"
    kept = f"{DEFAULT_WORKDIR}/kept.log"
    report = report_command({
        "kept": f"cat {kept}",
        "absent": f"cat {DEFAULT_WORKDIR}/absent",
        "text": "printf 'two words\\nand a line with  spaces\\n'; echo 'on stderr' >&2",
    })

    def watch(machine, job_id: str, script: str) -> dict:
        job = RemoteJobPaths(job_id=job_id, remote_os="posix", base_dir=f"{DEFAULT_WORKDIR}/jobs")
        with VmHook("local_vm", remote_host=machine.address, host_keys=machine.host_keys) as vm:
            vm.run(build_posix_wrapper_command(script, job))
        trigger = MaxTextJobTrigger(
            ssh_conn_id="local_vm", remote_host=machine.address, host_keys=machine.host_keys,
            job_id=job.job_id, job_dir=job.job_dir, log_file=job.log_file, exit_code_file=job.exit_code_file,
            remote_os="posix", poll_interval=1,
            on_output={
                "command": when_logged_command(job.log_file, [marker], f"echo '{marker} loss=6.3' > {kept}"),
                "description": "keeping",
            },
            report_command=report,
        )
        _, kwargs = trigger.serialize()  # rebuilt, as the triggerer does
        return asyncio.run(asyncio.wait_for(until_done(MaxTextJobTrigger(**kwargs)), timeout=120)).payload

    with vm_of_its_own(stack, "report-vm") as machine:
        event = watch(machine, "reported", f"{{ sleep 3; echo '{marker} loss=6.3'; }}")
        assert event["done"] and event["exit_code"] == 0, event
        items = parse_report(event["report"])
        assert (items["kept"].status, items["kept"].stdout) == (0, f"{marker} loss=6.3\n")
        assert items["absent"].status != 0 and "No such file" in items["absent"].stderr
        assert items["text"].stdout == "two words\nand a line with  spaces\n"
        assert items["text"].stderr == "on stderr\n"

        failed = watch(machine, "failed", "{ echo working; (exit 3); }")
        assert failed["exit_code"] == 3 and "report" not in failed, failed


def test_a_stall_whose_stop_outlived_its_command_timeout_is_still_reported_as_a_stall():
    """A stall is reported as one even when its stop outlived the command's timeout.

    On a loaded VM the stop (SIGTERM, a grace, SIGKILL, the wait for the group) may outlive it; the base trigger
    reconnects and polls again. The job, gone by then without an exit code, is reported stalled (the operator's
    message says why it was stopped), not died, and is stopped again to be sure."""
    from airflow_tpu_posttrain.recipes import remote_job
    from airflow_tpu_posttrain.triggers.remote_job import MaxTextJobTrigger

    stops: list[str] = []
    answers = iter(["", "died"])  # the completion check: running, then gone without an exit code

    class Connection:
        async def run(self, command: str, timeout: float, check: bool) -> SimpleNamespace:
            if command.startswith('p="$(cat'):  # remote_job.stop_command
                stops.append(command)
                if len(stops) == 1:
                    raise TimeoutError
                return SimpleNamespace(stdout="", stderr="", exit_status=0)
            return SimpleNamespace(stdout=next(answers), stderr="", exit_status=0)

    trigger = MaxTextJobTrigger(
        ssh_conn_id="local_vm", remote_host="10.77.0.9", job_id="silent", job_dir="/w/jobs/silent",
        log_file="/w/jobs/silent/stdout.log", exit_code_file="/w/jobs/silent/exit_code", remote_os="posix",
        poll_interval=1, stall_timeout=3,
    )
    trigger._progress = (trigger.log_offset, time.monotonic() - 10)  # silent for 10 s
    with pytest.raises(TimeoutError):
        asyncio.run(trigger._check_completion(Connection()))
    assert asyncio.run(trigger._check_completion(Connection())) == remote_job.JOB_STALLED
    assert len(stops) == 2
