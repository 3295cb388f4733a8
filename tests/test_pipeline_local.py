"""The tiny SFT and RL DAGs end to end in real Airflow, against the local stack.

The stack: Compute emulator whose every instance is a machine of its own, real MaxText on CPU, the local Hub
server. Slow (minutes): the real thing.

What is on a VM's disk is looked at just before the VM is destroyed (``stack.fleet.before_end``); after the
run, nothing of a deleted VM is left."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from conftest import FOCUSED_RUN, HF_TOKEN, REPO, storage_has, storage_objects

from airflow_tpu_posttrain.local.vm import PYENV_ROOT
from airflow_tpu_posttrain.pipelines.registry import LOCAL_CHECKPOINT_STORAGE

WORKDIR = "/tmp/airflow-tpu-posttrain"  # the jobs, scripts, launchers and token files on a VM (production's)
SEEDS_ROOT = "/dev/shm/tiny-llama"  # the seeds' layout root on the VM (a tmpfs of its own)
# The local twins of the tutorials' entries (recipes/models.twin_profile): their DAGs run the cloud entries' commands
# on the cloud entries' MaxText releases, differing only by recipes/runtime.LOCAL_DIFFERENCES.
SFT_TWIN, RL_TWIN = "tiny-gemma3-4b", "tiny-llama3.1-8b-Instruct"
SFT_TWIN_DAG, RL_TWIN_DAG = f"posttrain_sft__{SFT_TWIN}", f"posttrain_rl__{RL_TWIN}"
# A VM's own places, as it sees them; its MaxText venv and package cache (installed before any token exists,
# from packages) and the shared storage bound into its /tmp are left out of the scans of its files.
VM_PLACES = ("/tmp", "/var/tmp", "/home", "/root", "/dev/shm")
# Not the VM's own files: its MaxText venv and package cache (links of the package mirror's files), and the image's
# Python, bound read-only into its /root (2.5 GB: reading it took 45-70 s per VM).
NOT_SCANNED = ("/var/tmp/maxtext-venv", "/var/tmp/uv-cache", str(PYENV_ROOT))
# The split layout's VMs: the TPU VM, the conversion's CPU VM and the export's.
SPLIT_CREATES = ("create_tpu_vm", "create_cpu_vm", "create_export_vm")


def run_pipeline(dag_id: str, conf: dict | None = None):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    assert not bag.import_errors, bag.import_errors
    return bag.get_dag(dag_id).test(run_conf=conf)


def states(dag_run):
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def assert_succeeded(dag_run, logs: str) -> None:
    """The run succeeded; else the failure names the tasks that did not, and shows the end of the run's logs.

    ``dag.test`` logs every task to the output the test captured; the SSH libraries' chatter is left out."""
    if dag_run.state == "success":
        return
    told = [line for line in logs.splitlines() if "[asyncssh]" not in line and "[paramiko" not in line]
    print("\n".join(told[-300:]))
    unfinished = {task: state for task, state in states(dag_run).items() if state not in ("success", "skipped")}
    raise AssertionError(f"{dag_run.dag_id} ended {dag_run.state}: {unfinished}")


def xcom(dag_run, task_id):
    [ti] = [ti for ti in dag_run.get_task_instances() if ti.task_id == task_id]
    return ti.xcom_pull(task_ids=task_id)


def loads_and_generates(model_dir: Path) -> str:
    check = subprocess.run(
        [str(REPO / ".local/hfcheck-venv/bin/python"), str(REPO / "airflow_tpu_posttrain/local/check_hf_model.py"),
         str(model_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert check.returncode == 0, check.stderr
    return check.stdout


# ------------------------------------------------------------------------------ the VMs, before they end


def vm_files(vm, stack, places=VM_PLACES) -> dict[str, Path]:
    """``{path on the VM: host path}`` of the regular files in ``places`` of a running VM.

    Without NOT_SCANNED and the host directories every VM shares (checkpoint storage, published copies)."""
    root = vm.guest_path("/")  # /proc/<the VM's init>/root: found once, it scans /proc
    skip = {root / p.lstrip("/") for p in (*NOT_SCANNED, str(stack.storage_dir), str(stack.published_dir))}
    files = {}
    for place in places:
        for dirpath, dirnames, filenames in os.walk(root / place.lstrip("/")):
            dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in skip]
            for name in filenames:
                path = Path(dirpath, name)
                if path.is_file() and not path.is_symlink():
                    files["/" + str(path.relative_to(root))] = path
    return files


class VmEnds:
    """``stack.fleet.before_end``: what ``probe(vm)`` saw on each VM just before it was destroyed."""

    def __init__(self, fleet, probe: Callable) -> None:
        self.fleet = fleet
        self.probe = probe
        self.seen: dict[str, object] = {}  # VM name -> what the probe returned
        self.disks: dict[str, Path] = {}  # VM name -> its disk on this machine
        self.errors: list[str] = []

    def __call__(self, vm) -> None:
        try:
            self.seen[vm.name] = self.probe(vm)
        except Exception as err:  # noqa: BLE001 - an ending thread's error would be lost: the test reports it
            self.errors.append(f"{vm.name}: {err!r}")
        self.disks[vm.name] = vm.disk_dir

    def wait_gone(self, names: list[str], timeout: float = 600.0) -> None:
        """Until each named VM was probed, its processes killed and its disk deleted.

        The end runs in the background; each of its steps is bounded, so the timeout is only a backstop."""
        deadline = time.monotonic() + timeout
        while not set(names) <= set(self.disks) and not self.errors and time.monotonic() < deadline:
            time.sleep(0.2)  # the delete's operation is DONE before the fleet starts the VM's end
        still_ending = self.fleet.wait_ended(names, max(0.0, deadline - time.monotonic()))
        assert self.errors == [], self.errors
        assert still_ending == [], f"still ending after {timeout:.0f} s: {still_ending}"
        assert {n: e for n, e in self.fleet.end_errors.items() if n in names} == {}
        assert set(names) <= set(self.seen), f"never probed before its end: {set(names) - set(self.seen)}"
        # Nothing survives a deleted VM: its disk (its /tmp, /var/tmp, /home, /root) is gone.
        assert [n for n in names if self.disks[n].exists()] == []


@contextlib.contextmanager
def before_vm_end(stack, probe: Callable) -> Iterator[VmEnds]:
    ends = VmEnds(stack.fleet, probe)
    stack.fleet.before_end = ends
    try:
        yield ends
    finally:
        stack.fleet.before_end = None


def token_probe(stack):
    """Each VM's files at its end: which the pipeline wrote and which hold the token.

    The pipeline's are under WORKDIR; also what is left in the secrets directory."""

    def probe(vm) -> dict:
        files = vm_files(vm, stack)
        secrets = vm.guest_path(f"{WORKDIR}/secrets")
        return {
            "workdir_files": sorted(p for p in files if p.startswith(f"{WORKDIR}/")),
            "token_in": sorted(p for p, host in files.items() if HF_TOKEN.encode() in host.read_bytes()),
            "secrets_left": sorted(p.name for p in secrets.iterdir()) if secrets.is_dir() else [],
        }

    return probe


def files_holding(secret: str, *roots: Path) -> tuple[int, list[str]]:
    """``(files searched, those holding secret)``: every byte of every file under ``roots``."""
    searched, holding = 0, []
    for root in roots:
        for path in (p for p in root.rglob("*") if p.is_file()):
            searched += 1
            if secret.encode() in path.read_bytes():
                holding.append(str(path))
    return searched, holding


def token_in_storage_and_hub(stack) -> tuple[int, list[str]]:
    """The token in what the runs left behind, byte by byte.

    The local GCS server's objects (checkpoints, TensorBoard events, conversions, kept exports, metrics), the
    shared storage directories and the local Hub's repos."""
    return files_holding(HF_TOKEN, stack.vm_dir / "gcs", stack.vm_dir / "hub", stack.storage_dir, stack.published_dir)


def test_tiny_sft_end_to_end(stack, capfd):
    published_dir = stack.published_dir
    with before_vm_end(stack, token_probe(stack)) as ends:
        dr = run_pipeline(SFT_TWIN_DAG, {"storage_uri": str(published_dir)})
        logs = "".join(capfd.readouterr())
        assert_succeeded(dr, logs)
        vms = [xcom(dr, create)["name"] for create in SPLIT_CREATES]
        ends.wait_gone(vms)
    assert states(dr)["fail_run_if_a_step_failed"] == "skipped"

    # Split layout: the CPU VM converted into the cache in checkpoint storage (the local GCS server's bucket),
    # the TPU VM trained from there and wrote its checkpoints there, a CPU VM of its own exported, and every VM
    # is gone.
    storage = LOCAL_CHECKPOINT_STORAGE
    converted = xcom(dr, "convert_to_maxtext")
    assert converted["converted_params"].startswith(f"{storage}/conversions/{SFT_TWIN}/mt0.2.2-")
    assert xcom(dr, "create_cpu_vm")["machine_type"] == xcom(dr, "create_export_vm")["machine_type"] == "e2-standard-2"
    trained = xcom(dr, "train")
    assert trained["checkpoint"].endswith("/checkpoints/5/model_params") and storage_has(trained["checkpoint"])
    assert trained["checkpoint"].startswith(f"{storage}/post-train/")
    [train_ti] = [ti for ti in dr.get_task_instances() if ti.task_id == "train"]
    assert train_ti.xcom_pull(task_ids="train", key="_link_CheckpointLink") == (
        "https://console.cloud.google.com/storage/browser/" + trained["checkpoint"].removeprefix("gs://")
    )
    # The bucket holds what README says it holds, where it says: the conversion (orbax's commit marker and the
    # pipeline's), the training run's checkpoints (each committed) and done marker, the checked export.
    key = converted["conversion_key"]
    run = trained["run_name"]
    objects = storage_objects(storage)
    assert f"conversions/{SFT_TWIN}/{key}/.complete" in objects
    assert f"conversions/{SFT_TWIN}/{key}/0/commit_success.txt" in objects
    assert any(o.startswith(f"conversions/{SFT_TWIN}/{key}/0/items/") for o in objects)
    steps = {o.split("/")[3] for o in objects if o.startswith(f"post-train/{run}/checkpoints/")}
    assert "5" in steps
    for step in steps:  # every checkpoint orbax left is a committed one
        assert f"post-train/{run}/checkpoints/{step}/commit_success.txt" in objects, step
        assert any(o.startswith(f"post-train/{run}/checkpoints/{step}/model_params/") for o in objects), step
    assert f"post-train/{run}/.complete-5" in objects and f"post-train/{run}/.complete-5.metrics" in objects
    # The tutorials' profiler=xplane: JAX wrote its trace through TSL's GCS client, to Google's storage host.
    profile = f"post-train/{run}/tensorboard/plugins/profile/"
    assert any(o.startswith(profile) and o.endswith(".xplane.pb") for o in objects), objects
    assert f"exports/{run}.complete" in objects and f"exports/{run}/model.safetensors" in objects
    assert xcom(dr, "delete_cpu_vm")["deleted"] is True and xcom(dr, "delete_export_vm")["deleted"] is True
    # The export's VM was made once the training had ended, and the conversion's was gone by then: never two CPU VMs.
    ran = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert max(ran["train"].end_date, ran["delete_cpu_vm"].end_date) <= ran["create_export_vm"].start_date
    # What a later run's TPU VM request is timed by: this conversion (cached now) and the TPU VM's ready time.
    from airflow.models import Variable

    from airflow_tpu_posttrain.operators.just_in_time import TIMINGS_VARIABLE
    from airflow_tpu_posttrain.recipes import timings

    kept = Variable.get(TIMINGS_VARIABLE, deserialize_json=True)
    assert timings.is_converted(kept, SFT_TWIN, converted["source_revision"], "0.2.2")
    assert kept["ready"][xcom(dr, "create_tpu_vm")["machine_type"]]
    if not converted["reused"]:
        assert timings.expected_conversion_end(kept, SFT_TWIN, "e2-standard-2") > 0
    assert trained["metrics"]["steps_completed"] == 5 and trained["metrics"]["last_loss"] > 0
    assert "SFT: 5 steps" in logs
    # The quality gate (no_regression, the default): MaxText evaluated the held-out chats before step 1 and after
    # step 5; the base model's numbers are kept beside the checkpoints, where a resumed try would find them.
    base, after = trained["evaluation"]["base"]["eval_loss"], trained["evaluation"]["trained"]["eval_loss"]
    assert [step for step, _ in trained["metrics"]["eval_losses"]] == [0, 5]
    assert f"post-train/{run}/base_evaluation.log" in objects
    verdict = xcom(dr, "quality_gate")
    assert verdict["passed"] and verdict["rule"] == "no_regression" and (verdict["base"], verdict["trained"]) == (base, after)
    assert after <= base and f"Quality gate: SFT eval loss {base:.4g} → {after:.4g}" in logs

    published = xcom(dr, "export_and_publish")
    hub = published["hub"]
    assert hub["repo_id"] == "local/tiny-gemma3-4b-sft" and hub["revision"].startswith("run-posttrain-sft-tiny-gemma3-4b")
    [export_ti] = [ti for ti in dr.get_task_instances() if ti.task_id == "export_and_publish"]
    assert export_ti.xcom_pull(task_ids="export_and_publish", key="_link_PublishedModelLink") == hub["url"]
    model_copy = Path(published["storage_uri"].removeprefix("file://"))
    assert model_copy.is_relative_to(published_dir) and (model_copy / "model.safetensors").is_file()
    print(loads_and_generates(model_copy))
    # The model card, on the Hub branch and in the storage copy: the base model at the revision converted, the
    # run, the numbers, and the training curve the Hub serves beside it.
    from huggingface_hub import ModelCard, hf_hub_download

    download = {"repo_id": hub["repo_id"], "revision": hub["revision"], "endpoint": stack.hub.url,
                "token": HF_TOKEN, "cache_dir": stack.vm_dir / "hf-cache"}
    card = ModelCard.load(hf_hub_download(filename="README.md", **download))
    assert card.data.base_model == "google/gemma-3-4b-it" and "sft" in card.data.tags
    assert f"at revision `{converted['source_revision']}`" in card.text and "SFT, 5 steps" in card.text
    assert f"`{SFT_TWIN_DAG}` / `{dr.run_id}`" in card.text
    assert f"| eval loss on held-out data (base → trained) | {base} → {after} |" in card.text
    # What training cost: the TPU VM from its creation (Compute's timestamp) to the end of training.
    assert re.search(r"\| training VM, creation → end of training \| tpu-\S+ \(e2-standard-2, STANDARD\) ran "
                     r"\d+ min \d+ s: \$0\.\d\d at \$0\.067/h \|", card.text), card.text
    assert "![Training curve](training_curve.png)" in card.text
    curve = Path(hf_hub_download(filename="training_curve.png", **download)).read_bytes()
    assert curve.startswith(b"\x89PNG") and (model_copy / "training_curve.png").read_bytes() == curve
    assert ModelCard.load(model_copy / "README.md").content == card.content
    # MaxText writes no generation config: the published model carries its base model's, so it stops where it stops.
    base_generation = stack.local_dir / "tiny" / "tiny-gemma3" / "generation_config.json"
    published_generation = Path(hf_hub_download(filename="generation_config.json", **download))
    assert json.loads(published_generation.read_text()) == json.loads(base_generation.read_text())
    if os.environ.get("TPU_POSTTRAIN_SCREENSHOTS"):  # README's example: the card and curve this run published
        example = REPO / "docs" / "example-model-card"
        example.mkdir(exist_ok=True)
        for name in ("README.md", "training_curve.png"):
            shutil.copy(model_copy / name, example / name)

    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []
    # What each VM cost: its time (Compute's creation to the end of its delete), within the run's, at the price
    # table's price of its machine type (the local VMs are e2-standard-2, on demand).
    run_seconds = (dr.end_date - dr.start_date).total_seconds()
    for kind in ("tpu", "cpu", "export"):
        spent = xcom(dr, f"delete_{kind}_vm")
        assert spent["machine_type"] == "e2-standard-2" and spent["usd_per_hour"] == 0.067, spent
        assert 0 < spent["vm_seconds"] <= run_seconds + 1, (spent, run_seconds)
        billed_s = max(spent["vm_seconds"], 60)  # Compute bills a minute at least
        assert abs(spent["cost_usd"] - billed_s / 3600 * 0.067) < 1e-4, spent
    assert re.search(r"Cost: \S+ \(e2-standard-2, STANDARD\) ran \d+ min \d+ s: \$0\.\d\d at \$0\.067/h", logs)
    # The token: nowhere in the task logs, XCom, or left on any VM (every file of its own at its end; the
    # token files in the secrets directory removed).
    assert HF_TOKEN not in logs
    assert HF_TOKEN not in json.dumps([xcom(dr, t) for t in states(dr)], default=str)
    for name in vms:
        on_vm = ends.seen[name]
        assert on_vm["workdir_files"], f"{name}: no job files under {WORKDIR}"
        assert on_vm["token_in"] == [] and on_vm["secrets_left"] == [], (name, on_vm)
    # Nor in storage or on the Hub: the trainer ran without it (MaxText writes its whole config, a token in it
    # included, to TensorBoard beside the checkpoints).
    assert any(o.startswith(f"post-train/{run}/tensorboard/") for o in objects)
    searched, holding = token_in_storage_and_hub(stack)
    print(f"token search after SFT: {searched} files in storage and on the Hub")
    assert searched > 50 and holding == [], holding



def test_unchanged_inputs_skip_the_run_and_a_new_dataset_revision_does_not(stack, capfd):
    """After test_tiny_sft_end_to_end published (it runs first, in this module's stack and Airflow DB).

    The same inputs again: the run is skipped before any VM is created. Then the dataset's owner pushes a new
    revision of the chats to the Hub: the check lets the run train."""
    from airflow.dag_processing.dagbag import DagBag

    inserts_before = len([r for r in stack.compute.requests if r["method"] == "POST"])
    dr = run_pipeline(SFT_TWIN_DAG, {"storage_uri": str(stack.published_dir)})
    logs = "".join(capfd.readouterr())
    assert dr.state == "success" and set(states(dr).values()) == {"skipped"}, states(dr)
    assert "Inputs unchanged since the last published model" in logs and "Trigger with force=true" in logs
    assert len([r for r in stack.compute.requests if r["method"] == "POST"]) == inserts_before  # no VM, no rule

    revision = stack.seed_tiny_chats()
    dag = DagBag(dag_folder=os.environ["AIRFLOW__CORE__DAGS_FOLDER"]).get_dag(SFT_TWIN_DAG)
    # Only the check runs; every other task is marked done without running (no VM is created).
    checked = dag.test(run_conf={"storage_uri": str(stack.published_dir)}, mark_success_pattern=r"(?!check_inputs$).*")
    logs = "".join(capfd.readouterr())
    assert states(checked)["check_inputs"] == "success", states(checked)
    assert xcom(checked, "check_inputs")["revisions"]["dataset:local/tiny-chats"] == revision
    assert "Changed since the last published model: revisions" in logs
    assert len([r for r in stack.compute.requests if r["method"] == "POST"]) == inserts_before


def test_tiny_rl_end_to_end(stack, capfd):
    from test_maxtext_faults import ProcessSampler, all_xcom, rendered_fields

    sampler = ProcessSampler(HF_TOKEN.encode())  # every process's argv while the run goes
    sampler.start()
    with before_vm_end(stack, token_probe(stack)) as ends:
        dr = run_pipeline(RL_TWIN_DAG)
        logs = "".join(capfd.readouterr())
        assert_succeeded(dr, logs)
        vms = [xcom(dr, create)["name"] for create in SPLIT_CREATES]
        ends.wait_gone(vms)
    sampler.stop.set()
    sampler.join()
    # The RL entry reaches its VMs as from inside the VPC: no external IP.
    assert xcom(dr, "create_tpu_vm")["ssh_address"] == xcom(dr, "create_tpu_vm")["internal_ip"]
    assert not xcom(dr, "create_tpu_vm")["external_ip"]

    trained = xcom(dr, "train")
    # The tutorial's 50 batches of GRPO (recipes/models.twin_profile keeps them): the actor's last checkpoint is 50.
    assert trained["checkpoint"].endswith("/checkpoints/actor/50/model_params") and storage_has(trained["checkpoint"])
    assert trained["checkpoint"].startswith(f"{LOCAL_CHECKPOINT_STORAGE}/post-train/")
    metrics = trained["metrics"]
    assert metrics["rl_completed"] is True
    assert set(metrics["pre_rl"]) >= {"accuracy", "mean_reward"} and set(metrics["post_rl"]) >= {"accuracy", "mean_reward"}
    assert re.search(r"GRPO: .*accuracy \S+ → \S+, mean reward \S+ → \S+", logs)
    # The gate compares the tutorial's test accuracy before and after: the tiny model learns nothing, loses nothing.
    assert trained["evaluation"] == {"base": metrics["pre_rl"], "trained": metrics["post_rl"]}
    assert xcom(dr, "quality_gate")["passed"]

    hub = xcom(dr, "export_and_publish")["hub"]
    assert hub["repo_id"] == "local/tiny-llama3.1-8b-grpo"
    # The published branch holds the exported model; download it through huggingface_hub and load it.
    from huggingface_hub import snapshot_download

    local = snapshot_download(
        hub["repo_id"], revision=hub["revision"], endpoint=stack.hub.url,
        token=HF_TOKEN, cache_dir=str(stack.vm_dir / "hf-cache"),
    )
    print(loads_and_generates(Path(local)))
    card = (Path(local) / "README.md").read_text()
    assert "GRPO, 50 steps" in card and "| accuracy (before → after) |" in card
    assert (Path(local) / "training_curve.png").read_bytes().startswith(b"\x89PNG")
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []
    # The token: in no log, XCom, rendered field or argv of the GRPO run (the SFT's: test_maxtext_faults.py).
    assert HF_TOKEN not in logs
    ran = {task for task, state in states(dr).items() if state == "success"}
    rendered, xcoms = rendered_fields(dr.run_id, dr.dag_id), all_xcom(dr.run_id, dr.dag_id)
    assert ran <= set(rendered) and xcoms
    assert HF_TOKEN not in json.dumps(rendered, default=str) and HF_TOKEN not in json.dumps(xcoms, default=str)
    assert sampler.samples > 20 and sampler.leaks == [], sampler.leaks
    for name in vms:
        on_vm = ends.seen[name]
        assert on_vm["token_in"] == [] and on_vm["secrets_left"] == [], (name, on_vm)
    searched, holding = token_in_storage_and_hub(stack)
    print(f"token search after GRPO: {searched} files in storage and on the Hub")
    assert searched > 50 and holding == [], holding


def test_tiny_sft_in_the_seeds_layout(stack, capfd):
    """The tutorials' layout stays available: one VM does every step, files under its root, no storage."""

    def probe(vm) -> dict:
        root = vm.guest_path(SEEDS_ROOT)
        paths = root.rglob("*") if root.is_dir() else []
        return {"under_root": sorted(str(p.relative_to(root)) for p in paths)}

    with before_vm_end(stack, probe) as ends:
        dr = run_pipeline("posttrain_sft__tiny-llama__seeds", FOCUSED_RUN)
        capfd.readouterr()
        assert dr.state == "success", states(dr)
        vm = xcom(dr, "create_tpu_vm")["name"]
        ends.wait_gone([vm])
    assert "create_cpu_vm" not in states(dr)
    root = SEEDS_ROOT
    assert xcom(dr, "convert_to_maxtext")["converted_params"] == f"{root}/mt-format/0/items"
    trained = xcom(dr, "train")
    assert trained["checkpoint"].startswith(f"{root}/post-train/")
    # Both lived in the VM's /dev/shm until its end (and went with it).
    under_root = set(ends.seen[vm]["under_root"])
    checkpoint = trained["checkpoint"].removeprefix(f"{root}/")
    assert {"mt-format/0/items", checkpoint} <= under_root, sorted(under_root)[:20]
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []



def test_the_sft_tutorial_wired_by_hand_runs_end_to_end(stack, capfd, monkeypatch):
    """The wheel's example of the operators wired by hand (dags/sft_tutorial_by_hand.py), on the local stack.

    As a user runs it: its default connections (google_cloud_default, tpu_vm_ssh, hf_default) made to reach the
    stack, the fault tests' tiny Llama (the SFT twin's commands are test_tiny_sft_end_to_end's) and the local zones
    in its trigger form. It trains, publishes to the Hub and deletes its VM with no registry behind it."""
    dags_folder = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    shutil.copy(REPO / "dags" / "sft_tutorial_by_hand.py", dags_folder / "sft_tutorial_by_hand.py")
    for default, local in (("GOOGLE_CLOUD_DEFAULT", "LOCAL_COMPUTE"), ("TPU_VM_SSH", "LOCAL_VM"), ("HF_DEFAULT", "LOCAL_HUB")):
        monkeypatch.setenv(f"AIRFLOW_CONN_{default}", os.environ[f"AIRFLOW_CONN_{local}"])
    conf = {
        "model": "tiny-llama", "zones": ["local-cpu1-a"], "accelerator_type": "cpu", "provisioning_model": "STANDARD",
        "reservation": None, "hub_repo_id": "local/tiny-llama-by-hand",
    }
    dr = run_pipeline("sft_tutorial_by_hand", conf)
    assert_succeeded(dr, "".join(capfd.readouterr()))

    trained = xcom(dr, "train")
    assert trained["checkpoint"].endswith("/model_params") and trained["metrics"]["steps_completed"] > 0
    hub = xcom(dr, "export_and_publish")["hub"]
    assert hub["repo_id"] == conf["hub_repo_id"]
    from huggingface_hub import HfApi

    files = HfApi(endpoint=stack.hub.url, token=HF_TOKEN).list_repo_files(hub["repo_id"], revision=hub["revision"])
    assert {"config.json", "model.safetensors", "README.md"} <= set(files), files
    assert xcom(dr, "delete_tpu_vm")["deleted"] is True and stack.compute.instances() == []
