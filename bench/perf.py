"""The pipeline's performance figures (P1-P6), measured on this machine, printed as one table.

    .venv/bin/python bench/perf.py [--quick]

In order, so that no two measurements share the machine: P3, DAG file parse times (bench/parse_time.py, fresh
interpreters); P4's baseline, the SFT chain as a plain shell script (bench/plain_pipeline.sh --sft-only); then
the local stack (Compute emulator whose every instance is a machine of its own, Hub server; the VMs' disks and
checkpoint storage under .local/bench/vm, emptied first) and Airflow's real components with LocalExecutor
(bench/local_airflow.py, home .local/bench/airflow), started before any clock runs, and these DAG runs, each
watched by bench/run_probe.py (each with quality_gate=off: the plain script it is compared with runs the
tutorial's commands, which do not evaluate; and force=true: the warm run's inputs are the cold run's):

  cold    posttrain_sft__tiny-llama, first run, nothing cached      P1, P2, P4 cold
          or measured (a new deployment): its TPU VM is requested at once
  revision  the same DAG after a new revision of the model on the Hub: its conversion runs again, and is
          measured (the cold run's), so its TPU VM is requested just in time     P1, P2
  warm    the same DAG, another run id                               P1, P2, P4 warm, conversions repeated
  seeds   posttrain_sft__tiny-llama__seeds (the tutorials' layout)   P1, P2 (row skipped if the DAG is absent)
  gemma   posttrain_sft__tiny-gemma3-4b (the full SFT twin)          P1, P2
  lora    posttrain_sft__tiny-gemma3-4b__lora (its LoRA twin)       P1, P2
  fault   our DAG with steps=8, trainer SIGKILLed at step 5          P5 (not with --quick)
  fault-sync  the same with synchronous checkpoints (an override)    P5 (not with --quick)

then what the pipelines' policies cost, in Airflow's components started again on a DAGs folder of their own
(.local/bench/policy-dags: models.yaml's tiny Llama SFT, scheduled daily, and GRPO, both capped at one TPU VM, and
the LoRA twin asking a person before it publishes):

  holder, date 1-3  a GRPO run takes the line's one place, then a 3-date backfill of the SFT DAG (the model
          committed between dates 1 and 2: dates 2 and 3 share their inputs) waits behind it in line
          VM-seconds held idle in line; worker resumes and API-server calls per run (the claim decision)
  approval  the LoRA twin, answered Approve APPROVAL_HOLD_S after it asked   worker and VM seconds of the wait

P6, what storage costs a VM: the seconds and bytes to load the converted checkpoint (orbax's own figures, from the
cold run's train task: its XCom), and to save and restore the MaxText environment archive through the install
script's own storage commands (tar | gcs_tool.py write, gcs_tool.py cat | tar -x) against a local GCS server,
with the MaxText venv the local VMs install (.local/maxtext-venv).

A full run writes the table and its notes to docs/performance.md. --quick also parses each DAG file once instead
of 5 times, and writes nothing. Everything started is stopped on exit, Ctrl-C or
SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import parse_time
import suite_time
from local_airflow import USER, LocalAirflow
from run_probe import TPU_CREATE, Approver, RunRecord, TrainerKiller, watch_run, watch_runs

from airflow_tpu_posttrain.local.gcs_server import GcsServer, client_environment
from airflow_tpu_posttrain.local.processes import stop_group
from airflow_tpu_posttrain.local.stack import LocalStack
from airflow_tpu_posttrain.recipes import cost, storage
from airflow_tpu_posttrain.recipes.models import TINY_LLAMA_REPO

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / ".local" / "bench"
OURS = "posttrain_sft__tiny-llama"
SEEDS = "posttrain_sft__tiny-llama__seeds"
GRPO = "posttrain_rl__tiny-llama"
GEMMA = "posttrain_sft__tiny-gemma3-4b"  # the full SFT twin of Gemma 3, beside its LoRA twin
LORA = "posttrain_sft__tiny-gemma3-4b__lora"
RUN_LABELS = ("cold", "revision", "warm", "seeds", "gemma", "lora")  # the runs with P1 and P2 rows
BACKFILL_DATES = 3
APPROVAL_HOLD_S = 60  # how long the bench's person takes to answer (Approve)
HOLDER_TRAINS_S = 600  # until the GRPO run that holds the line's place trains
KILL_AT_STEP = 5
FAULT_STEPS = 8
CHECKPOINT_PERIOD = 2  # the local SFT DAGs' checkpoint_period (pipelines/posttrain.py)
TARGETS = {
    "P1": 1.15, "P2": 0.05, "P3": 100.0, "P4": 1.10, "P5": CHECKPOINT_PERIOD, "conversions": 0, "idle in line": 0,
    "approval": 0,
}


# -- P1 at the tutorials' scale, from stated and measured parts --------------------------------------------


@dataclass(frozen=True)
class Minute:
    """One step's minutes on Google Cloud, and where the figure comes from (stated, measured, assumed)."""

    minutes: float
    source: str


@dataclass(frozen=True)
class Minutes:
    """Step durations on Google Cloud (v6e-8 and the split layout's CPU VM).

    Stated by the tutorials: convert (on the VM) and train (v6e-8). :func:`measured_minutes` replaces what this
    bench measured; the rest stay assumed."""

    convert: Minute = Minute(5.0, "stated")
    train: Minute = Minute(10.0, "stated")
    create_vm: Minute = Minute(2.0, "assumed")  # any VM: the insert to SSH answering
    install: Minute = Minute(5.0, "assumed")  # MaxText installed from scratch (the tutorials)
    install_restored: Minute = Minute(1.0, "assumed")  # ours, the environment archive restored
    export: Minute = Minute(3.0, "assumed")
    delete_vm: Minute = Minute(1.0, "assumed")

    def sources(self) -> str:
        by_source: dict[str, list[str]] = {}
        for name, part in vars(self).items():
            by_source.setdefault(part.source.split(":")[0], []).append(f"{name} {part.minutes:.2f}")
        return "; ".join(f"{source}: {', '.join(parts)}" for source, parts in sorted(by_source.items()))


# Google does not publish a TPU VM's boot time; what a TPU VM adds to the local VM's boot (the host's TPU
# runtime and its health checks) is assumed at a minute.
TPU_BOOT_MIN = 1.0


def measured_minutes(archive: dict[str, float], records: dict[str, RunRecord]) -> Minutes:
    """:class:`Minutes` with what this bench measured in place of assumptions.

    - ``install_restored``: the MaxText environment archive's restore (P6), the same archive a TPU VM restores;
    - ``create_vm``: the cold run's TPU VM from the emulator's creation to its create task's end (the local
      VM's boot, its host keys and SSH answering) plus :data:`TPU_BOOT_MIN`, assumed."""
    m = Minutes()
    restore = Minute(archive["restore_s"] / 60, "measured: P6 restore")
    cold = records.get("cold")
    created, create = (cold.vms.get("create_tpu_vm"), cold.tasks.get("create_tpu_vm")) if cold else (None, None)
    if created and create and create.end:
        boot = Minute((create.end - created.created) / 60 + TPU_BOOT_MIN, "measured: local boot + assumed TPU boot")
        return Minutes(m.convert, m.train, boot, m.install, restore, m.export, m.delete_vm)
    return Minutes(m.convert, m.train, m.create_vm, m.install, restore, m.export, m.delete_vm)


def _layout_minutes(m: Minutes) -> dict[str, tuple[float, float]]:
    """Per layout, the TPU VM's and the CPU VM's minutes held (0: no CPU VM).

    The tutorials hold the TPU VM through every step. Ours holds it from its request through training; a CPU
    VM, created at the run's start, converts (training waits for the conversion) and exports off the TPU's clock.
    The TPU VM's request waits for the conversion, just in time, once a conversion of the model was measured
    (operators/just_in_time.py): the first run of a deployment requests it at once."""
    tpu_ready = m.create_vm.minutes + m.install_restored.minutes
    converted = tpu_ready + m.convert.minutes  # the CPU VM's create and restore, then the conversion
    train, delete, export = m.train.minutes, m.delete_vm.minutes, m.export.minutes
    steps = (m.create_vm, m.install, m.convert, m.train, m.export, m.delete_vm)
    return {
        "tutorials": (sum(step.minutes for step in steps), 0.0),
        "ours, first run of a deployment": (max(tpu_ready, converted) + train + delete, converted + train + export + delete),
        "ours, new revision (conversion measured)": (tpu_ready + train + delete, converted + train + export + delete),
        "ours, conversion cached": (tpu_ready + train + delete, tpu_ready + train + export + delete),
    }


def modelled_p1(m: Minutes) -> dict[str, float]:
    """TPU-held ÷ training time, per layout (:func:`_layout_minutes`)."""
    return {name: tpu / m.train.minutes for name, (tpu, _) in _layout_minutes(m).items()}


def modelled_cost(m: Minutes, prices: dict | None = None) -> dict[str, tuple[float, str]]:
    """USD of one tutorial run per layout, from the same minutes and the pipelines' price table.

    The TPU VM is a v6e-8 (ct6e-standard-8t); the split layout's CPU VM an n2-highmem-16."""
    table = prices or cost.price_table()

    def vm(name: str, machine: str, minutes: float) -> cost.VmCost:
        return cost.VmCost(name, machine, "RESERVATION_BOUND", minutes * 60, table[machine]["RESERVATION_BOUND"])

    rows = {}
    for name, (tpu, cpu) in _layout_minutes(m).items():
        vms = [vm("v6e-8", "ct6e-standard-8t", tpu)] + ([vm("cpu", "n2-highmem-16", cpu)] if cpu else [])
        parts = ", ".join(f"{v.name} {v.seconds / 60:.1f} min ${v.usd:.2f}" for v in vms)
        rows[name] = (round(sum(v.usd for v in vms), 2), parts)
    return rows


# -- measurements -------------------------------------------------------------------------------------


def run_in_group(command: list[str]) -> str:
    """Run ``command`` in its own process group (stopped with it on any exit); its output."""
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate()
    finally:
        stop_group(proc, grace=5)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
    return output


def plain_baseline(work: Path = BENCH / "plain") -> dict[str, float]:
    """Seconds per step of bench/plain_pipeline.sh --sft-only in ``work``, and ``pipeline total`` (convert → export)."""
    output = run_in_group(["bash", "bench/plain_pipeline.sh", "--sft-only", str(work)])
    return {
        m["step"]: float(m["s"])
        for m in re.finditer(r"^(?P<step>\S+(?: total)?) +(?P<s>\d+\.\d) s\b", output, re.MULTILINE)
    }


def environment_archive(
    venv: Path = REPO / ".local" / "maxtext-venv", python: Path | None = None, work: Path = BENCH / "environment"
) -> dict[str, float]:
    """Seconds to save ``venv`` as an archive in storage and to restore it into an empty directory.

    Both with the install script's commands (the storage tool run by ``python``, default the venv's own), against
    a local GCS server under ``work`` (emptied first, removed after); also the venv's and the archive's bytes."""
    tool = storage.GcsTool(
        script=str(REPO / "airflow_tpu_posttrain" / "vm_scripts" / storage.GCS_TOOL_NAME),
        python=str(python or venv / "bin" / "python"),
    )
    archive = "gs://bench/environments/maxtext-env.tar.gz"
    shutil.rmtree(work, ignore_errors=True)
    restored = work / "restored"
    restored.mkdir(parents=True)
    # tar's status 1, a file that changed as it was read, is the link count of the package cache's files, which
    # this machine's local VMs link into their venvs meanwhile (another bench, a test): the bytes are the same.
    tar = f"tar -cz --warning=no-file-changed -C {venv.parent} {venv.name}"
    save = f"{{ {tar}; [ $? -le 1 ]; }} | {storage.write_command(archive, tool)}"
    restore = f"{storage.read_command(archive, tool)} | tar -xz -C {restored}"
    figures: dict[str, float] = {}
    with GcsServer(work / "gcs", buckets=("bench",)) as server:
        env = {**os.environ, **client_environment(server.url)}
        for label, command in (("save_s", save), ("restore_s", restore)):
            started = time.monotonic()
            subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], check=True, env=env)
            figures[label] = time.monotonic() - started
        name = urllib.parse.quote(archive.removeprefix("gs://bench/"), safe="")
        with urllib.request.urlopen(f"{server.url}/storage/v1/b/bench/o/{name}", timeout=10) as answer:
            figures["archive_bytes"] = int(json.load(answer)["size"])
    files = [path for path in (restored / venv.name).rglob("*") if path.is_file() and not path.is_symlink()]
    figures["venv_bytes"] = sum(path.stat().st_size for path in files)
    shutil.rmtree(work, ignore_errors=True)
    return figures


def parse_times(runs: int) -> dict[str, dict]:
    return {f.name: parse_time.measure(f, runs) for f in sorted((REPO / "dags").glob("*.py"))}


@contextlib.contextmanager
def stdout_to_stderr():
    """Keep stdout for the table: what subprocesses print meanwhile (the stack's VM image check) goes to stderr."""
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def measure_runs(quick: bool) -> tuple[dict[str, RunRecord], dict[str, str]]:
    """The DAG runs in real Airflow; returns the records by label and notes on runs that were skipped."""
    shutil.rmtree(BENCH / "vm", ignore_errors=True)
    stack = LocalStack(local_dir=REPO / ".local", vm_dir=BENCH / "vm")
    records: dict[str, RunRecord] = {}
    skipped: dict[str, str] = {}
    # Leaving the block stops the stack: every VM still there ends with all its processes (an interrupted
    # run's jobs included) and its disk.
    with stdout_to_stderr(), stack as env, LocalAirflow(BENCH / "airflow", env) as airflow:
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": True})
        present = airflow.wait_for_dags([OURS, SEEDS, GEMMA, LORA], present=OURS)
        # Like for like: the plain script (P4's baseline) runs the tutorial's commands, which do not evaluate.
        # Forced: the warm run has the cold run's inputs, which check_inputs would skip as already published.
        plain = {"quality_gate": "off", "force": True}
        plan = [
            ("cold", OURS, plain, None),
            ("revision", OURS, plain, None),
            ("warm", OURS, plain, None),
            ("seeds", SEEDS, plain, None),
            ("gemma", GEMMA, plain, None),
            ("lora", LORA, plain, None),
        ]
        if not quick:
            # MaxText saves checkpoints asynchronously: a kill can catch the newest one half-written, so
            # the retry resumes from the one before it. With synchronous saves it cannot.
            fault = {**plain, "steps": FAULT_STEPS}
            sync = {**fault, "overrides": ["async_checkpointing=false"]}
            for label, conf in (("fault", fault), ("fault-sync", sync)):
                killer = TrainerKiller(stack, OURS, f"bench-{label}", KILL_AT_STEP)
                plan.append((label, OURS, conf, killer))
        for label, dag_id, conf, killer in plan:
            if not present[dag_id]:
                skipped[label] = f"{dag_id} does not exist (yet)"
                continue
            if label == "revision":
                new_model_revision(stack)
            print(f"perf: running {dag_id} ({label}) ...", file=sys.stderr, flush=True)
            records[label] = watch_run(airflow, stack.compute, dag_id, f"bench-{label}", conf, killer)
            must_train(label, records[label])
        records.update(measure_policies(stack, env))
    return records, skipped


def measure_policies(stack: LocalStack, env: dict[str, str]) -> dict[str, RunRecord]:
    """The policy runs (a backfill behind a run holding the line's place, an approval); their records by label.

    In Airflow's components started again, on a DAGs folder of their own (:func:`write_policy_dags`)."""
    policy_dags = BENCH / "policy-dags"
    write_policy_dags(policy_dags)
    with LocalAirflow(BENCH / "airflow-policy", env, dags_folder=policy_dags) as airflow:
        airflow.api("POST", "/pools", json={"name": "tpu_vms", "slots": 4, "include_deferred": True})
        airflow.wait_for_dags([OURS, GRPO, LORA], present=OURS)
        print(f"perf: running {GRPO} (holder) and a {BACKFILL_DATES}-date backfill of {OURS} ...", file=sys.stderr)
        records = backfill_runs(airflow, stack)
        print(f"perf: running {LORA} with approval ...", file=sys.stderr, flush=True)
        approver = Approver(airflow, LORA, "bench-approval", APPROVAL_HOLD_S)
        records["approval"] = watch_run(airflow, stack.compute, LORA, "bench-approval", {"force": True}, approver)
        if not approver.answered:
            raise SystemExit(f"perf: {LORA} (approval) never asked: {records['approval'].tasks}")
        must_train("approval", records["approval"])
    return records


def must_train(label: str, record: RunRecord) -> None:
    """Stop the bench at a run that did not train: its figures would measure something else.

    A run that trained and failed after (its export) is measured; the notes give its state."""
    train = record.tasks.get("train")
    if not train or train.state != "success":
        raise SystemExit(f"perf: {record.dag_id} ({label}) did not train: train {train}, run {record.state}")


def write_policy_dags(folder: Path) -> None:
    """The policy runs' DAGs alone in ``folder``: models.yaml's local entries they need, and dags/local_dags.py.

    The tiny Llama's SFT, scheduled daily (a backfill's dates), and its GRPO, both capped at one TPU VM (one line,
    one place); the LoRA twin asking a person before it publishes, the bench's own Airflow user."""
    import yaml

    registry = yaml.safe_load((REPO / "dags" / "models.yaml").read_text())
    local = [entry for entry in registry["pipelines"] if entry.get("local") and "layout" not in entry]

    def entry(model: str, recipe: str, lora: bool = False) -> dict:
        (found,) = (e for e in local if (e["model"], e["recipe"], bool(e.get("lora"))) == (model, recipe, lora)
                    and e.get("accelerator_type") == "cpu")
        return found

    registry["pipelines"] = [
        {**entry("tiny-llama", "sft"), "schedule": "@daily", "max_tpu_vms": 1},
        {**entry("tiny-llama", "rl"), "max_tpu_vms": 1},
        {**entry("tiny-gemma3-4b", "sft", lora=True), "approval": True, "approvers": [USER]},  # the bench answers
    ]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "models.yaml").write_text(yaml.safe_dump(registry))
    shutil.copy(REPO / "dags" / "local_dags.py", folder)


def backfill_runs(airflow, stack: LocalStack) -> dict[str, RunRecord]:
    """A GRPO run takes the line's one place; then a backfill of the SFT DAG's last dates waits behind it.

    The model gets a commit between the first and the second date, so the later dates share their inputs: one
    trains them, the other follows its claim. Records by label: ``holder``, ``date 1``, ``date 2``..."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    # Ending today: the newest date is the DAG's latest tick, so unpausing it adds no scheduled run.
    dates = [today - timedelta(days=n) for n in reversed(range(BACKFILL_DATES))]
    new_model_revision(stack, dates[0] + timedelta(hours=12))
    holder = (GRPO, "bench-holder")

    def start() -> None:
        airflow.trigger(*holder, {"quality_gate": "off", "force": True})
        deadline = time.monotonic() + HOLDER_TRAINS_S
        db = airflow.db()
        query = "SELECT state FROM task_instance WHERE dag_id = ? AND run_id = ? AND task_id = 'train'"
        while (db.execute(query, holder).fetchone() or (None,))[0] not in ("running", "deferred"):
            if time.monotonic() > deadline:
                raise SystemExit(f"perf: {GRPO} (holder) did not train within {HOLDER_TRAINS_S} s")
            time.sleep(1)
        db.close()
        body = {
            "dag_id": OURS, "from_date": dates[0].isoformat(), "to_date": dates[-1].isoformat(),
            "dag_run_conf": {"quality_gate": "off"}, "max_active_runs": BACKFILL_DATES, "reprocess_behavior": "none",
        }
        for _ in range(30):  # SQLite-backed Airflow answers 503 while another writer holds the DB; nothing made
            made = airflow.client.post("/backfills", json=body)
            if made.status_code != 503:
                break
            time.sleep(1)
        made.raise_for_status()
        airflow.api("PATCH", f"/dags/{OURS}", json={"is_paused": False})

    records = watch_runs(airflow, stack.compute, start, {holder: RunRecord(*holder)}, (OURS,), 1 + BACKFILL_DATES)
    must_train("holder", records[holder])
    by_date = sorted((r for key, r in records.items() if key != holder), key=lambda r: r.logical_date or 0)
    return {"holder": records[holder], **{f"date {i}": r for i, r in enumerate(by_date, 1)}}


def new_model_revision(stack: LocalStack, when: datetime | None = None) -> str:
    """A new commit of the tiny model on the local Hub (its model card), dated ``when`` (default now).

    The next run whose date is after it converts again."""
    card = BENCH / "revision"
    shutil.rmtree(card, ignore_errors=True)
    card.mkdir(parents=True)
    (card / "README.md").write_text(f"tiny-llama, revised {time.time():.0f}\n")
    return stack.hub.store.seed_repo(TINY_LLAMA_REPO, card, gated="manual", date=when)


# -- figures and table --------------------------------------------------------------------------------


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def p1(record: RunRecord) -> tuple[float | None, str]:
    held, train = record.vm_held("create_tpu_vm"), record.tasks.get("train")
    train_s = train.seconds if train else None
    return ratio(held, train_s), f"TPU VM held {fmt(held)} s / train {fmt(train_s)} s"


def p2(record: RunRecord) -> tuple[float | None, str]:
    running, deferred = record.state_seconds("running"), record.state_seconds("deferred")
    how = f"running {running:.0f} s (deferred {deferred:.0f} s) / run {fmt(record.wall)} s"
    return ratio(running, record.wall), how


def p5_steps(record: RunRecord) -> tuple[float | None, str]:
    if not record.killed or record.killed_at_step is None:
        return None, "the trainer was not killed (training ended first?)"
    metrics = (record.xcom.get("train") or {}).get("metrics") or {}
    resumed = metrics.get("resumed_from_step", 0)  # absent: the retry started over
    return (
        record.killed_at_step - resumed,
        f"killed after step {record.killed_at_step}, resumed from {resumed}",
    )


def p5_conversions(record: RunRecord) -> tuple[float, str]:
    """Conversion jobs that ran rather than being reused (the convert task's XCom says which)."""
    converts = {
        task: bool((value or {}).get("reused")) for task, value in record.xcom.items() if "convert" in task
    }
    how = ", ".join(f"{task} {'reused' if reused else 'ran'}" for task, reused in converts.items())
    return sum(not reused for reused in converts.values()), how or "no conversion task"


def converted_checkpoint_load(record: RunRecord) -> tuple[float | None, str]:
    """The train task's load of the converted checkpoint (orbax's seconds and bytes, from its XCom)."""
    loads = ((record.xcom.get("train") or {}).get("metrics") or {}).get("checkpoint_loads") or []
    converted = [load for load in loads if "/conversions/" in str(load.get("uri"))]
    if not converted:
        return None, "no load of the converted checkpoint in the train task's XCom"
    load = converted[0]
    return load.get("seconds"), f"{_mib(load.get('bytes'))} from {load['uri']}"


def line_wait(record: RunRecord) -> tuple[float, float]:
    """Seconds the run waited in line for a TPU place, and the VM-seconds it held idle meanwhile.

    In line: its TPU VM's create deferred, without its VM, while another run's TPU VM exists (the cap is one).
    Held idle: each VM of the run, while none of its other tasks runs or waits (deferred) on anything."""
    waited = idle = 0.0
    for sample in record.timeline:
        if sample.states.get(TPU_CREATE) != "deferred" or TPU_CREATE in sample.vms or not sample.other_tpu_vms:
            continue
        waited += sample.seconds
        busy = any(state in ("running", "deferred") for task, state in sample.states.items() if task != TPU_CREATE)
        idle += 0.0 if busy else sample.seconds * len(sample.vms)
    return waited, idle


def approval_wait(record: RunRecord) -> tuple[float, float, float]:
    """Seconds a person was asked, and the run's worker seconds (its tasks running) and VM-seconds meanwhile."""
    asked = worker = vm = 0.0
    for sample in record.timeline:
        if sample.states.get(Approver.TASK) == "awaiting_input":
            asked += sample.seconds
            worker += sample.seconds * sum(state == "running" for state in sample.states.values())
            vm += sample.seconds * len(sample.vms)
    return asked, worker, vm


def _per_run(values: dict[str, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def _mib(size: float | None) -> str:
    return "n/a" if size is None else f"{size / 2**20:.2f} MiB"


def report(
    records: dict[str, RunRecord], skipped: dict[str, str], plain: dict, parsed: dict, archive: dict[str, float]
) -> str:
    """The table and its notes, as printed and written to docs/performance.md."""
    lines: list[str] = []
    rows = []

    def row(figure: str, subject: str, result: tuple[float | None, str], target: float | None, digits: int = 2):
        value, how = result
        ok = "n/a" if value is None or target is None else ("ok" if value <= target else "MISS")
        rows.append((figure, subject, fmt(value, digits), "-" if target is None else f"<= {target:g}", ok, how))

    runs = [(label, r) for label, r in records.items() if label in RUN_LABELS]
    for label, r in runs:
        row("P1", f"{r.dag_id} ({label})", p1(r), TARGETS["P1"])
    m = measured_minutes(archive, records)
    for name, value in modelled_p1(m).items():
        row("P1", f"modelled: {name}", (value, "minutes of the notes: stated, measured, assumed"), TARGETS["P1"])
    for name, result in modelled_cost(m).items():
        row("cost", f"modelled, USD: {name}", result, None)
    for label, r in runs:
        row("P2", f"{r.dag_id} ({label})", p2(r), TARGETS["P2"], digits=3)
    for name, result in parsed.items():
        how = f"ms; {result['dags']} DAG(s), {result['dag_file_ms'] / max(result['dags'], 1):.0f} ms per DAG"
        row("P3", f"dags/{name}", (result["dag_file_ms"], how), TARGETS["P3"], digits=0)
    total, sft_export = plain.get("pipeline total"), plain.get("sft", 0) + plain.get("export-sft", 0)
    for label in ("cold", "warm"):
        if label in records:
            wall = records[label].wall
            how = f"DAG run {fmt(wall)} s / plain convert→SFT→export {fmt(total)} s"
            row("P4", f"{OURS} ({label})", (ratio(wall, total), how), TARGETS["P4"])
    if "warm" in records:
        wall = records["warm"].wall
        how = f"DAG run {fmt(wall)} s / plain SFT→export {sft_export:.0f} s (its conversion cached too)"
        row("P4", f"{OURS} (warm, vs plain w/o convert)", (ratio(wall, sft_export), how), TARGETS["P4"])
    if "fault" in records:
        row("P5", "training steps repeated by the retry", p5_steps(records["fault"]), TARGETS["P5"], digits=0)
    if "fault-sync" in records:
        result = p5_steps(records["fault-sync"])
        row("P5", "the same, synchronous checkpoints", result, TARGETS["P5"], digits=0)
    if "warm" in records:
        row(
            "P5",
            "conversions repeated (warm run)",
            p5_conversions(records["warm"]),
            TARGETS["conversions"],
            0,
        )

    if "cold" in records:
        row("P6", "converted checkpoint load on the TPU VM, s", converted_checkpoint_load(records["cold"]), None)
    sizes = f"venv {_mib(archive['venv_bytes'])}, archive {_mib(archive['archive_bytes'])}"
    row("P6", "MaxText environment archive: save, s", (archive["save_s"], sizes), None, digits=1)
    row("P6", "MaxText environment archive: restore, s", (archive["restore_s"], sizes), None, digits=1)

    dates = {label: r for label, r in records.items() if label.startswith("date ")}
    if dates:
        waits = {label: line_wait(r) for label, r in dates.items()}
        how = "; ".join(f"{label} waited {wait:.0f} s, {idle:.1f} VM-s idle" for label, (wait, idle) in waits.items())
        idle = sum(idle for _, idle in waits.values())
        row("line", f"VM-s held idle waiting in line ({len(dates)}-date backfill)", (idle, how), TARGETS["idle in line"], 1)
        resumes = {label: sum(r.resumes.values()) for label, r in dates.items()}
        how = "; ".join(
            f"{label} {count}" + "".join(f" ({task} {n})" for task, n in dates[label].resumes.items())
            for label, count in resumes.items()
        )
        row("claims", f"worker resumes per run ({len(dates)}-date backfill)", (_per_run(resumes), how), None, 1)
        calls = {label: r.api_calls or 0 for label, r in dates.items()}
        how = "; ".join(f"{label} {calls[label]} ({r.state_reads} reads of a run's state)" for label, r in dates.items())
        row("claims", f"API-server calls per run ({len(dates)}-date backfill)", (_per_run(calls), how), None, 0)
    if "approval" in records:
        asked, worker, vm = approval_wait(records["approval"])
        how = f"asked {asked:.0f} s, answered Approve after {APPROVAL_HOLD_S} s"
        row("approval", "worker seconds while a person decides", (worker, how), TARGETS["approval"], 1)
        row("approval", "VM-seconds held while a person decides", (vm, how), TARGETS["approval"], 1)

    header = ("fig", "subject", "value", "target", "", "how")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(5)]
    for r in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=False)) + "  " + r[5])

    lines.append("\nnotes:")
    for label, why in skipped.items():
        lines.append(f"  {label} run skipped: {why}")
    lines.append(f"  modelled P1, minutes on Google Cloud (v6e-8): {m.sources()}")
    lines.append(
        f"    measured here: restore = P6's archive restore (the same archive); create_vm = the cold run's local TPU "
        f"VM boot to its create task's end + {TPU_BOOT_MIN:g} assumed for a TPU VM's boot. The tiny model's "
        "conversion is not scaled up: its seconds are the converter's start (imports, JAX), not tensor work"
    )
    lines.append(
        f"  modelled cost: those minutes at the price table of recipes/cost.py (read {cost.PRICES_READ_ON}; v6e-8 "
        "$21.60/h, n2-highmem-16 $1.0481/h, a reservation's VM priced as on demand)"
    )
    lines.append(f"  plain baseline (bench/plain_pipeline.sh --sft-only), seconds: {plain}")
    lines.append(
        "  runs: state, run wall s, queued→start s, train tries, most tasks running+deferred at once, mean load:"
    )
    for label, r in records.items():
        train = r.tasks.get("train")
        held = ", ".join(f"{task} {fmt(r.vm_held(task))} s" for task in r.vms)
        lines.append(
            f"    {label:5} {r.dag_id}: {r.state}, {fmt(r.wall)}, {fmt(r.latency, 1)}, "
            f"{train.try_number if train else 'n/a'}, {r.peak_busy}, {fmt(r.mean_load, 2)}; VMs held: {held}"
        )
        by_task = sorted(
            ((s, task) for (task, state), s in r.seconds_in.items() if state == "running"), reverse=True
        )
        lines.append(
            "          worker seconds (running) by task: "
            + ", ".join(f"{task} {s:.0f}" for s, task in by_task)
        )
        for command in r.killed:
            lines.append(f"          SIGKILLed: {command}")
    return "\n".join(lines)


PERFORMANCE_DOC = REPO / "docs" / "performance.md"
DOC_METHOD = """\
How each figure is computed: P1, the TPU VM's time from the emulator's instance creation to the first sample
without the instance, over the `train` task's start to end. P2, the time task instances spend `running` (in a
worker) over the DAG run's start to end. P3, `bench/parse_time.py` (fresh interpreters, after `import airflow`,
the bytecode written as in a deployment). P4, the DAG run over `bench/plain_pipeline.sh --sft-only` (the same MaxText commands in a shell script). P5, a
run with more steps whose trainer is SIGKILLed once it logs a chosen step; the retry's resumed step from its
XCom. P6, orbax's own figures for the converted checkpoint's load (the cold run's train XCom), and the install
script's storage commands timed on the local venv and GCS server. Modelled P1 and cost: `modelled_p1` and
`modelled_cost` in bench/perf.py, from the tutorials' stated minutes, this bench's measurements and the
assumptions the notes list (each named there). The policies' rows, from the same samples (every 0.5 s: the
task instances' states, the VMs that exist): line, the seconds a backfill run's TPU VM create waits deferred
while another run's TPU VM holds the one place, times each VM the run holds meanwhile with none of its other
tasks running or deferred; claims, from the API server's access log, the requests of a run's tasks (each task's
supervisor keeps one connection and names its task instance first: `calls_of` in bench/run_probe.py), and each
task instance's starts in a worker after its first (a resume after a deferral);
approval, while `approve_publish` awaits the answer, the run's tasks running and its VMs, times the seconds.
"""


def machine() -> str:
    """What the figures were measured on, read from this machine."""
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")
    )
    versions = {
        name: subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True, text=True,
        ).stdout.strip() or "n/a"
        for name, python in (
            ("apache-airflow", Path(sys.executable)),
            ("maxtext", REPO / ".local" / "maxtext-venv" / "bin" / "python"),
        )
    }  # fmt: skip
    return (
        f"{os.cpu_count()} CPUs, {memory_kib / 2**20:.0f} GiB RAM, Python {sys.version.split()[0]}, "
        f"Airflow {versions['apache-airflow']}, MaxText {versions['maxtext']} on the CPU (the tiny model)"
    )


def write_doc(text: str, took_min: float) -> None:
    """The page, keeping the test suite's section, which the suite's full run writes (bench/suite_time.py)."""
    kept = suite_time.section_of(PERFORMANCE_DOC.read_text()) if PERFORMANCE_DOC.exists() else None
    page = (
        "# Performance\n\n"
        "Written by `.venv/bin/python bench/perf.py` (a full run, not `--quick`); do not edit by hand. "
        f"Measured on {time.strftime('%Y-%m-%d')}: {machine()}; the bench took {took_min:.0f} min.\n\n"
        f"```text\n{text}\n```\n\n{DOC_METHOD}"
    )
    PERFORMANCE_DOC.write_text(suite_time.with_suite_section(page, kept))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="parse once per file; no fault run; no doc written")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through every finally: all is stopped
    started = time.monotonic()
    print("perf: P3 parse times ...", file=sys.stderr, flush=True)
    parsed = parse_times(1 if args.quick else 5)
    print("perf: P4 baseline (plain shell script) ...", file=sys.stderr, flush=True)
    plain = plain_baseline()
    print("perf: P6 the MaxText environment archive through storage ...", file=sys.stderr, flush=True)
    archive = environment_archive()
    records, skipped = measure_runs(args.quick)
    text = report(records, skipped, plain, parsed, archive)
    print(text)
    took_min = (time.monotonic() - started) / 60
    if args.quick:
        print("  --quick: each DAG file parsed in 1 interpreter (not 5); no fault run (P5 training steps)")
    else:
        write_doc(text, took_min)
        print(f"\nwritten to {PERFORMANCE_DOC.relative_to(REPO)}")
    print(f"\n(perf.py took {took_min:.0f} min; load average now {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
