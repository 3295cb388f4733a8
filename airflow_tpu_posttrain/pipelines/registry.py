"""The model registry (``dags/models.yaml``): one :class:`PipelineConfig` per (recipe, model) entry.

Kept apart from the DAG factory so a DAG file that only needs the registry (the reaper) stays cheap to parse.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from airflow_tpu_posttrain import defaults
from airflow_tpu_posttrain.defaults import APPROVAL_ON_REJECT, INPUTS_AS_OF
from airflow_tpu_posttrain.recipes import access, approval_notices, compute, cost, maxtext, places, validation
from airflow_tpu_posttrain.recipes import quality_gate as gate
from airflow_tpu_posttrain.recipes.accelerators import ACCELERATORS, DEFAULT_ACCELERATOR, accelerator
from airflow_tpu_posttrain.recipes.lora import LoraSettings, check_model
from airflow_tpu_posttrain.recipes.models import define_models, model_definitions, model_profile
from airflow_tpu_posttrain.recipes.runtime import LOCAL_VENV, local_stack_dir
from airflow_tpu_posttrain.recipes.slices import SLICE_PROVISIONING_MODELS
from airflow_tpu_posttrain.recipes.validation import SpecError

START_DATE = datetime(2026, 1, 1, tzinfo=UTC)


def places_location(capacity_claims: str | None, checkpoint_storage: str | None) -> str | None:
    """``capacity_claims``, else ``tpu-capacity`` in the checkpoint bucket: shared by every deployment using it."""
    if capacity_claims:
        return capacity_claims
    if checkpoint_storage and checkpoint_storage.startswith("gs://"):
        return f"gs://{checkpoint_storage.removeprefix('gs://').split('/', 1)[0]}/tpu-capacity"
    return None


@dataclass(frozen=True)
class StepTimeouts:
    """Execution timeouts per step; the VM's cloud-side deadline derives from them.

    A run has no run-level timeout: when ``dagrun_timeout`` fires, Airflow marks every unfinished task SKIPPED,
    the teardowns included. Each step is bounded by its timeout and its retries, so the run is too."""

    create: timedelta = timedelta(hours=1)  # FLEX_START can wait for capacity
    install: timedelta = timedelta(minutes=45)
    convert: timedelta = timedelta(hours=1)
    train: timedelta = timedelta(hours=8)
    export: timedelta = timedelta(hours=1)
    delete: timedelta = timedelta(minutes=30)

    def vm_lifetime(self, retries: int, max_retry_delay: timedelta) -> timedelta:
        """The longest a run's VM may live, its ``maxRunDuration``: Google's deadline never ends a live try.

        Its create, every step at every try with the waits between tries, and its delete."""
        steps = (self.install, self.convert, self.train, self.export)
        return (
            self.create
            + sum(steps, timedelta()) * (retries + 1)
            + max_retry_delay * retries * len(steps)
            + self.delete
        )


LOCAL_TIMEOUTS = StepTimeouts(
    create=timedelta(minutes=5),
    install=timedelta(minutes=20),
    convert=timedelta(minutes=15),
    train=timedelta(minutes=30),
    export=timedelta(minutes=15),
    delete=timedelta(minutes=5),
)


LAYOUTS = ("split", "seeds")
RECIPES = ("sft", "rl")


def _cap_problems(accelerator_type: str, max_tpu_chips: int | None, max_tpu_vms: int | None) -> list[SpecError]:
    """A cap the entry's own TPU VM (or slice) cannot fit under: it would wait in line for ever."""
    shape = ACCELERATORS.get(accelerator_type)
    if shape is None or not shape.is_tpu:
        return []
    vms = None if max_tpu_chips is not None else max_tpu_vms
    try:  # the location is checked above: any stands in for it here
        places.cap_of(max_tpu_chips, vms, "gs://capacity", shape.chips_per_vm, shape.vms)
    except SpecError as err:
        return [err]
    return []


def _is_slice(accelerator_type: str) -> bool:
    acc = ACCELERATORS.get(accelerator_type)
    return bool(acc and acc.is_multi_host)


def _doc(text: str, choices: Iterable[str] = ()) -> dict[str, Any]:
    """A registry key's description (and allowed values) for its reference, docs/registry.md."""
    return {"doc": text, "choices": tuple(choices)}


class ConfigProblems(ValueError):
    """Every problem of one registry entry, each a :class:`SpecError` naming its field and the fix."""

    def __init__(self, problems: list[SpecError]) -> None:
        self.problems = problems
        super().__init__("; ".join(map(str, problems)))


@dataclass(frozen=True)
class PipelineConfig:
    """One registry entry: which model, which recipe, where it runs, and the trigger form's defaults.

    Each key's description is its field's ``metadata`` (``_doc``), or, for a key that is the default of a
    trigger form's Param, that Param's description; ``registry_reference`` renders them into docs/registry.md.
    """

    model: str = field(metadata=_doc("The model's key: a built-in one (`recipes/models.py`) or one defined under `models:`."))
    recipe: str = field(metadata=_doc("`sft` (the SFT tutorial) or `rl` (GRPO, the RL tutorial).", RECIPES))
    layout: str = field(
        default="split",
        metadata=_doc(
            "`split` converts and exports on a CPU VM (`cpu_accelerator_type`) while the TPU VM is created and "
            "installed, passes checkpoints through `checkpoint_storage` and deletes the TPU VM as soon as the final "
            "checkpoint is there; `seeds` runs every step on the TPU VM, as the tutorials do (DAG id suffix `__seeds`).",
            LAYOUTS,
        ),
    )
    checkpoint_storage: str | None = field(
        default=None,
        metadata=_doc(
            "`gs://bucket/prefix` the VMs may write: conversions (cached per model revision and MaxText release), "
            "checkpoints, kept exports. Required by the split layout."
        ),
    )
    cpu_accelerator_type: str = field(
        default="cpu-highmem-16", metadata=_doc("The split layout's CPU VM (`recipes/accelerators.py`: `cpu-highmem-16` is n2-highmem-16).")
    )
    schedule: str | None = field(
        default=None,
        metadata=_doc(
            "A cron expression or preset, null (manual runs only), or `on_change`: a run when the Hub shows a new "
            "revision of the base model or the dataset (`pipelines/inputs.py`), looked at every `watch_interval_s`."
        ),
    )
    watch_interval_s: int = field(default=600, metadata=_doc("Seconds between the Hub checks of `schedule: on_change`."))
    project_id: str | None = field(default=None, metadata=_doc("The Google Cloud project; null: the Google connection's."))
    zones: tuple[str, ...] = ("us-east5-b",)
    accelerator_type: str = DEFAULT_ACCELERATOR
    provisioning_model: str = "RESERVATION_BOUND"
    reservation: str | None = None
    network: str = field(default="default", metadata=_doc("The VPC network of the VMs."))
    subnetwork: str | None = field(
        default=None, metadata=_doc("Required on a custom-mode VPC: the subnetwork of the zones' region.")
    )
    network_path: str = field(
        default="external",
        metadata=_doc(
            "How Airflow reaches the VMs: `external` (an external IP, a firewall rule per VM for "
            "`ssh_source_ranges`), `internal` (from inside the VPC; no external IP: the subnetwork needs Cloud NAT "
            "and Private Google Access, checked before any VM), `iap` (through an IAP TCP tunnel; no external IP).",
            access.NETWORK_PATHS,
        ),
    )
    ssh_source_ranges: tuple[str, ...] = field(
        default=(), metadata=_doc("`external`: the CIDR ranges Airflow's workers and triggerer connect from.")
    )
    ssh_key_mode: str = field(
        default="metadata",
        metadata=_doc(
            "How Airflow's key reaches the VMs: the instance's `ssh-keys` metadata, or OS Login (`oslogin`).",
            access.KEY_MODES,
        ),
    )
    oslogin_user: str | None = field(
        default=None, metadata=_doc("`oslogin`: the account (e.g. a service account's email) whose OS Login holds the key.")
    )
    service_account: str = field(
        default="default",
        metadata=_doc("The VMs' service account (scope cloud-platform); grant it `checkpoint_storage` in IAM."),
    )
    max_tpu_chips: int | None = field(
        default=None,
        metadata=_doc(
            "How many TPU chips (as quota and reservations count them: a v6e-8 VM holds 8, a v6e-16 slice 16) the "
            "pipelines' TPU VMs may hold at once per line (a zone's reservation, else the zone and machine "
            "series), across DAGs and deployments: a create takes its chips in `capacity_claims` before it "
            "inserts, first come first served, and waits in line as long as the runs ahead train. Entries "
            "sharing a line must give the same cap. Given, it replaces `max_tpu_vms`; null: `max_tpu_vms`."
        ),
    )
    max_tpu_vms: int | None = field(
        default=defaults.MAX_TPU_VMS,
        metadata=_doc(
            "Deprecated, use `max_tpu_chips`: the cap in VMs of the entry's size (times its chips per VM; a "
            "slice takes one for each of its VMs). null (and no `max_tpu_chips`): no cap."
        ),
    )
    capacity_claims: str | None = field(
        default=None,
        metadata=_doc(
            "`gs://bucket/prefix` where the places under the cap are taken (one object per line); every "
            "deployment sharing the cap must name the same. null: `tpu-capacity` in `checkpoint_storage`'s bucket."
        ),
    )
    tpu_pool: str | None = field(
        default=None,
        metadata=_doc(
            "The Airflow pool of the TPU VM's steps (install, train): worker slots, not VMs. Create it first "
            "(`airflow pools set --include-deferred NAME SLOTS DESCRIPTION`): Airflow never runs a task of a pool "
            "that does not exist. null: no pool (Airflow's `default_pool`); the TPU VMs are capped by `max_tpu_chips`."
        ),
    )
    max_wait_for_capacity_minutes: int = field(
        default=defaults.MAX_WAIT_FOR_CAPACITY_MINUTES, metadata=_doc("The trigger form's default wait for a place under the cap or for capacity.")
    )
    maxtext_version: str | None = None
    dataset: str | None = None
    train_split: str | None = None
    eval_split: str | None = None
    train_data_columns: str | None = None
    steps: int | None = None
    num_batches: int | None = None
    num_test_batches: int | None = None
    hub_repo_id: str | None = None
    storage_uri: str | None = None
    overrides: tuple[str, ...] = ()
    gcp_conn_id: str = field(default=defaults.GCP_CONN_ID, metadata=_doc("The Airflow connection Compute is called with."))
    ssh_conn_id: str = field(default=defaults.SSH_CONN_ID, metadata=_doc("The Airflow SSH connection: the login and its private key."))
    hf_conn_id: str = field(default=defaults.HF_CONN_ID, metadata=_doc("The Airflow connection holding the Hugging Face token."))
    retries: int = field(default=2, metadata=_doc("Each step's retries."))
    retry_delay_s: int = field(
        default=60, metadata=_doc("The first retry's delay in seconds (then exponential backoff, at most 20 minutes).")
    )
    poll_interval_s: int | None = field(
        default=None, metadata=_doc("Seconds between the triggers' polls; null: each step's own (10 to 30 s).")
    )
    checkpoint_period: int = field(
        default=maxtext.DEFAULT_SFT_CHECKPOINT_PERIOD, metadata=_doc("SFT steps between checkpoints: at most what a retry or a VM recovery repeats.")
    )
    stall_timeout_s: int = field(
        default=defaults.TRAINING_STALL_TIMEOUT_S,
        metadata=_doc(
            "A training silent this long (seconds) is taken for hung and stopped, failing the try (a retry "
            "resumes): longer than its quietest healthy stretch (compiling, a checkpoint save), far shorter than the "
            "step's timeout. Training only: an install's upload or a large conversion is legitimately silent for long."
        ),
    )
    quality_gate: str = gate.DEFAULT_RULE
    inputs_as_of: str = "run_date"
    min_improvement_pct: float = gate.DEFAULT_MIN_IMPROVEMENT_PCT
    approval: bool = field(
        default=False,
        metadata=_doc(
            "A person approves each model before it is published (Airflow's human-in-the-loop, in the UI's "
            "Required actions): the export is checked and kept in `checkpoint_storage`, then `approve_publish` waits "
            "(no worker slot, no VM) showing the eval numbers, the gate's verdict and the model card; approved, a CPU "
            "VM made for it publishes the kept export. Only the registry turns it on or off: no trigger form field "
            "skips it. Split layout only; needs `approvers`."
        ),
    )
    approvers: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "Who may answer `approve_publish`: Airflow user ids, as the auth manager knows them (the Simple auth "
            "manager's: the username; FAB's: the user's id). Passed as the task's `assigned_users`: Airflow's API "
            "refuses (403) an answer from anyone else, the run's own triggerer included unless named. Required "
            "with `approval: true`. Airflow 3.3's human-in-the-loop assigns users, not roles."
        ),
    )
    approval_notify: tuple[approval_notices.Channel, ...] = field(
        default=(),
        metadata=_doc(
            "Where to say that a decision waits, and that it timed out, with the link to the task's Required "
            "actions page: `{via: smtp, to: [a@example.com], conn_id: smtp_default}` (apache-airflow-providers-smtp) "
            "or `{via: slack, channel: '#ml', conn_id: slack_api_default}` (apache-airflow-providers-slack). The "
            "task's log always says it. Empty: the log only."
        ),
    )
    approval_timeout_hours: float = field(
        default=72, metadata=_doc("How long `approve_publish` waits for an answer; then the answer is Reject.")
    )
    approval_on_reject: str = field(
        default="skip",
        metadata=_doc(
            "What Reject (or no answer in time) does, besides publishing nothing and keeping the export: `skip` the "
            "publish (the run succeeds) or `fail` the run.",
            APPROVAL_ON_REJECT,
        ),
    )
    lora: LoraSettings | None = field(
        default=None,
        metadata=_doc(
            "LoRA (QLoRA with `weight_qtype`) instead of full SFT: `{rank: 16, alpha: 32, target_modules: null, "
            "weight_qtype: null}`; trains adapters on the frozen base and publishes a PEFT adapter "
            "(`adapter_config.json`, `adapter_model.safetensors`). Each key is also a trigger form field "
            "(`lora_rank`, ...). SFT, split layout, one TPU VM, a Gemma 3 model on MaxText 0.2.4 or later "
            "(`maxtext_version: 0.2.5`); DAG id suffix `__lora`."
        ),
    )
    # Set by the loader, never by models.yaml (_LOADER_KEYS).
    timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    local: dict[str, str] | None = None  # the local CPU "VM"'s operator arguments (see _local_entry_settings)
    tags: tuple[str, ...] = field(default=(), metadata=_doc("Extra DAG tags."))
    # USD per hour by machine type and provisioning model: recipes/cost.py's defaults with the registry's
    # top-level ``prices:`` laid over them (what the teardown and the reaper say each VM cost).
    prices: Mapping[str, Mapping[str, float]] = field(default_factory=cost.price_table)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigProblems(problems)

    def problems(self) -> list[SpecError]:
        """Every value the registry may not hold, refused when the DAG file is parsed (not after VMs are made)."""
        problems: list[SpecError] = []

        def check(validate: Callable[..., object], *args: object) -> None:
            try:
                validate(*args)
            except SpecError as err:
                problems.append(err)

        check(model_profile, self.model)
        check(validation.one_of, "recipe", self.recipe, RECIPES)
        check(validation.one_of, "layout", self.layout, LAYOUTS)
        check(validation.one_of, "quality_gate", self.quality_gate, gate.RULES)
        check(validation.one_of, "inputs_as_of", self.inputs_as_of, INPUTS_AS_OF)
        check(validation.one_of, "approval_on_reject", self.approval_on_reject, APPROVAL_ON_REJECT)
        if self.approval and self.layout != "split":
            problems.append(SpecError(
                "approval", self.approval, "needs the split layout",
                "use layout: split (its TPU VM is deleted before the wait; the seeds layout would hold it)",
            ))
        if self.approval and not self.approvers:
            problems.append(SpecError(
                "approvers", self.approvers, "is empty, and approval: true needs someone to answer",
                "name the Airflow users who may approve, e.g. approvers: [alice] (their user ids)",
            ))
        for index, approver in enumerate(self.approvers):
            if not isinstance(approver, str) or not approver.strip():
                problems.append(SpecError(f"approvers[{index}]", approver, "is not a user id", "give a user id, e.g. alice"))
        for index, entry in enumerate(self.approval_notify):
            channel = entry if isinstance(entry, approval_notices.Channel) else approval_notices.Channel(**entry)
            check(approval_notices.check_channel, f"approval_notify[{index}]", channel)
            provider = approval_notices.PROVIDERS.get(channel.via)
            if provider and importlib.util.find_spec(provider.module.rsplit(".", 2)[0]) is None:
                problems.append(SpecError(
                    f"approval_notify[{index}].via", channel.via, f"needs {provider.package}, which is not installed",
                    f"install it where Airflow runs (pip install {provider.package}), or remove the channel",
                ))
        if self.approval_timeout_hours <= 0:
            problems.append(SpecError(
                "approval_timeout_hours", self.approval_timeout_hours, "is not positive", "give hours, e.g. 72"
            ))
        if self.lora is not None:
            problems.extend(PipelineConfig._lora_problems(self))
        check(accelerator, self.accelerator_type)
        if _is_slice(self.accelerator_type):
            problems.extend(PipelineConfig._slice_problems(self))
        check(validation.one_of, "provisioning_model", self.provisioning_model, compute.PROVISIONING_MODELS)
        check(validation.one_of, "network_path", self.network_path, access.NETWORK_PATHS)
        check(validation.one_of, "ssh_key_mode", self.ssh_key_mode, access.KEY_MODES)
        if not self.zones:
            problems.append(SpecError("zones", self.zones, "is empty", "give at least one zone, e.g. [us-east5-b]"))
        for zone in self.zones:
            check(validation.zone, "zones", zone)
        if self.tpu_pool is not None:
            check(validation.safe_name, "tpu_pool", self.tpu_pool)
        if self.retries < 0:
            problems.append(SpecError("retries", self.retries, "is negative", "give 0 or more"))
        if self.layout == "split":
            cpu = ACCELERATORS.get(self.cpu_accelerator_type)
            if cpu is None or cpu.is_tpu:
                cpus = [name for name, acc in ACCELERATORS.items() if not acc.is_tpu]
                problems.append(
                    SpecError("cpu_accelerator_type", self.cpu_accelerator_type, "is not a CPU VM", f"use one of {cpus}")
                )
            if not self.checkpoint_storage:
                problems.append(
                    SpecError(
                        "checkpoint_storage",
                        self.checkpoint_storage,
                        "is required by the split layout",
                        "set it to a gs://bucket/prefix the VMs may write (or use layout: seeds)",
                    )
                )
        cap = f"max_tpu_chips={self.max_tpu_chips}" if self.max_tpu_chips is not None else f"max_tpu_vms={self.max_tpu_vms}"
        capped = self.max_tpu_chips is not None or self.max_tpu_vms is not None
        if capped and not places_location(self.capacity_claims, self.checkpoint_storage):
            problems.append(
                SpecError(
                    "capacity_claims", None, f"is needed with {cap} and no checkpoint_storage",
                    "set capacity_claims (or checkpoint_storage) to a gs://bucket/prefix, or the cap to null",
                )
            )
        problems += _cap_problems(self.accelerator_type, self.max_tpu_chips, self.max_tpu_vms)
        return problems

    @property
    def tpu_cap_chips(self) -> int | None:
        """The TPU chips a line's VMs may hold at once: ``max_tpu_chips``, else ``max_tpu_vms`` VMs of this size."""
        if self.max_tpu_chips is not None:
            return self.max_tpu_chips
        if self.max_tpu_vms is None:
            return None
        return self.max_tpu_vms * accelerator(self.accelerator_type).chips_per_vm

    @property
    def places_location(self) -> str | None:
        """Where the places under the cap are taken (:func:`places_location`)."""
        return places_location(self.capacity_claims, self.checkpoint_storage)

    @property
    def is_slice(self) -> bool:
        """Whether the entry trains on a multi-host slice: its DAG creates and deletes slices, not one TPU VM."""
        return _is_slice(self.accelerator_type)

    def _slice_problems(self) -> list[SpecError]:
        """What a slice's pipeline does not do (yet), each named with the fix."""
        wants = (
            ("recipe", self.recipe, ("sft",), "GRPO trains on one TPU VM; use recipe sft on a slice"),
            ("layout", self.layout, ("split",), "a slice's checkpoints go to checkpoint_storage: use layout split"),
            ("provisioning_model", self.provisioning_model, SLICE_PROVISIONING_MODELS,
             "a slice is made all at once: use RESERVATION_BOUND (with a reservation) or FLEX_START"),
            ("network_path", self.network_path, ("internal", "external"), "use internal or external"),
            ("ssh_key_mode", self.ssh_key_mode, ("metadata",), "a slice's VMs take the key from its template's metadata"),
        )
        problems = [
            SpecError(name, value, f"is not served on a multi-host slice ({self.accelerator_type})", fix)
            for name, value, served, fix in wants
            if value not in served
        ]
        if len(self.zones) != 1:
            problems.append(SpecError(
                "zones", list(self.zones), "names more than one zone for a slice",
                "give the one zone of the slice's reservation (a slice's VMs share one zone's interconnect)",
            ))
        return problems

    def _lora_problems(self) -> list[SpecError]:
        """What a LoRA entry may not be: another recipe, layout or accelerator, or a model or release without it."""
        wants = (
            ("recipe", self.recipe, "sft", "LoRA trains with SFT's trainer: use recipe sft"),
            ("layout", self.layout, "split", "the adapter is exported on the CPU VM: use layout split"),
        )
        problems = [
            SpecError(name, value, "is not served with lora", fix) for name, value, served, fix in wants if value != served
        ]
        if _is_slice(self.accelerator_type):
            problems.append(SpecError(
                "accelerator_type", self.accelerator_type, "is a multi-host slice, where LoRA is not served yet",
                "use a single-host TPU VM (e.g. v6e-8), as MaxText's LoRA tutorial does",
            ))
        try:
            profile = model_profile(self.model)
            check_model(profile, self.maxtext_version or profile.maxtext_version)
        except SpecError as err:
            problems.append(err)
        return problems

    @property
    def dag_id(self) -> str:
        suffix = "__seeds" if self.layout == "seeds" else "__slice" if self.is_slice else ""
        suffix += "__lora" if self.lora is not None else ""
        return f"posttrain_{self.recipe}__{self.model}{suffix}"


# The local runs' checkpoint storage: a bucket of the local GCS server (local/gcs_server.py), which each local
# stack starts on a port of its own and names to its VMs (STORAGE_EMULATOR_HOST...), as a VM on Google Cloud
# reaches storage.googleapis.com with its service account.
LOCAL_BUCKET = "local-posttrain"
LOCAL_CHECKPOINT_STORAGE = f"gs://{LOCAL_BUCKET}/airflow-tpu-posttrain"




class RegistryError(ValueError):
    """``models.yaml`` is malformed: every problem at once, each with its place (entry and key) and the fix."""

    def __init__(self, path: str | Path, problems: list[str]) -> None:
        self.problems = problems
        listed = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"{path}: {len(problems)} problem(s), no DAG built from it:\n{listed}")


# Keys of PipelineConfig set by the loader, never by models.yaml.
_LOADER_KEYS = frozenset({"local", "timeouts", "prices"})
_ENTRY_KEYS = frozenset(f.name for f in fields(PipelineConfig)) - _LOADER_KEYS
_TOP_LEVEL_KEYS = ("defaults", "prices", "models", "pipelines")


@functools.cache
def _pipeline_adapter():
    """Pydantic's validator of PipelineConfig: types checked (``retries: "two"`` refused), unknown keys refused."""
    from pydantic import ConfigDict, TypeAdapter

    PipelineConfig.__pydantic_config__ = ConfigDict(extra="forbid")  # type: ignore[attr-defined]
    return TypeAdapter(PipelineConfig)


def _unknown_keys(keys: Iterable[str], known: Iterable[str]) -> list[str]:
    return validation.unknown_keys(keys, sorted(known), "key of the registry", "keys")


def _pydantic_problems(error: Any) -> list[tuple[str | None, str]]:
    """``(top-level key or None, text)`` per error of a pydantic ValidationError."""
    out = []
    for item in error.errors():
        context_error = (item.get("ctx") or {}).get("error")
        if isinstance(context_error, ConfigProblems):
            out += [(problem.field, str(problem)) for problem in context_error.problems]
            continue
        if isinstance(context_error, SpecError):
            out.append((context_error.field, str(context_error)))
            continue
        loc = item["loc"]
        place = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
        out.append((str(loc[0]) if loc else None, f"{place}={item['input']!r}: {item['msg']}"))
    return out


def _validated_entries(data: dict[str, Any], local_dir: str | None, problems: list[str]) -> list[tuple[bool, Any]]:
    """``(is_local, PipelineConfig)`` per ``pipelines`` entry; each problem (with its place) added to ``problems``."""
    from pydantic import ValidationError

    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        problems.append(f"defaults: must be a mapping of keys to values, not {type(defaults).__name__}")
        defaults = {}
    problems += [f"defaults: {problem}" for problem in _unknown_keys(defaults, _ENTRY_KEYS - {"model", "recipe"})]
    try:
        prices = cost.price_table(data.get("prices"))
    except SpecError as err:
        problems.append(f"prices: {err}")
        prices = cost.price_table()
    entries = data.get("pipelines")
    if not isinstance(entries, list) or not entries:
        problems.append("pipelines: must be a list with one entry per (model, recipe), e.g. - {model: gemma3-4b, recipe: sft}")
        return []
    validated = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"pipelines[{index}]: must be a mapping such as {{model: gemma3-4b, recipe: sft}}")
            continue
        place = f"pipelines[{index}] (model {entry.get('model')}, recipe {entry.get('recipe')})"
        unknown = _unknown_keys([key for key in entry if key != "local"], _ENTRY_KEYS)
        if unknown:
            problems += [f"{place}: {problem}" for problem in unknown]
            continue
        merged: dict[str, Any] = {key: value for key, value in defaults.items() if key in _ENTRY_KEYS}
        merged.update(entry)
        is_local = merged.pop("local", False)
        if is_local and local_dir:
            merged.update(_local_entry_settings(local_dir))
        try:
            validated.append((is_local, _pipeline_adapter().validate_python({**merged, "prices": prices})))
        except ValidationError as error:
            found = _pydantic_problems(error)
            # The type errors hide the checks of PipelineConfig.problems: run those on the values that had a type.
            mistyped = {key for key, _ in found}
            found += [(err.field, str(err)) for err in _problems_of_typed_values(merged, mistyped)]
            for key, text in found:
                where = place if key is None or key in entry or key not in defaults else "defaults"
                problem = f"{where}: {text}"
                if problem not in problems:  # a bad default is said once, not once per entry
                    problems.append(problem)
    return validated


def _problems_of_typed_values(merged: dict[str, Any], mistyped: set[str | None]) -> list[SpecError]:
    """PipelineConfig's own checks over ``merged`` with each mistyped value at its default (none if required)."""
    values: dict[str, Any] = {}
    for f in fields(PipelineConfig):
        if f.name in merged and f.name not in mistyped:
            values[f.name] = merged[f.name]
        elif f.default is not MISSING:
            values[f.name] = f.default
        elif f.default_factory is not MISSING:
            values[f.name] = f.default_factory()
        else:
            return []  # a required value (model, recipe) is missing or mistyped: said already
    values["zones"] = tuple(values["zones"])
    return PipelineConfig.problems(SimpleNamespace(**values))  # type: ignore[arg-type]


def _local_entry_settings(local_dir: str) -> dict[str, Any]:
    return {
        # The rest of the cpu runtime comes from the local stack's environment (recipes/runtime.py). The jobs'
        # files go where production puts them (/tmp, /dev/shm), on each VM's own disk.
        "local": {"maxtext_venv": LOCAL_VENV},
        "timeouts": LOCAL_TIMEOUTS,
        "checkpoint_storage": LOCAL_CHECKPOINT_STORAGE,  # the local GCS server's bucket
        "cpu_accelerator_type": "cpu",
        # The local run's pace: steps of a second, so tighter polls, retries and checkpoints.
        "retry_delay_s": 5,
        "poll_interval_s": 2,
        "checkpoint_period": 2,
        "stall_timeout_s": 180,
        "watch_interval_s": 2,
    }


def shared_line_problems(configs: Iterable[PipelineConfig]) -> list[str]:
    """Entries whose TPU VMs share a line of places (``places.line_key``) but not its cap or its location.

    Two caps on one pool each admit what the other did not mean to, and two locations are two lines for it."""
    first: dict[str, tuple[str, int | None, str | None]] = {}
    problems: list[str] = []
    for config in configs:
        shape = ACCELERATORS.get(config.accelerator_type)
        if shape is None or not shape.is_tpu:
            continue
        mine = (config.dag_id, config.tpu_cap_chips, config.places_location if config.tpu_cap_chips else None)
        for zone in config.zones:
            key = places.line_key(config.project_id or "(the connection's project)", zone, config.reservation, shape.machine_type)
            other = first.setdefault(key, mine)
            problem = (
                f"pipelines: {other[0]} and {mine[0]} share the line of places {key} but not its cap "
                f"({other[1] or 'none'} and {mine[1] or 'none'} TPU chips) and location ({other[2]} and {mine[2]}). "
                "Fix: give both the same max_tpu_chips and capacity_claims (checkpoint_storage's bucket), or "
                "different reservations or zones"
            )
            if other[1:] != mine[1:] and problem not in problems:
                problems.append(problem)
    return problems


def load_registry(path: str | Path, local: bool | None = None) -> list[PipelineConfig]:
    """Read ``models.yaml``: its ``models`` known to this process, ``defaults`` merged into each of ``pipelines``.

    Every entry is validated, whichever are returned; a malformed registry raises :class:`RegistryError` with
    every problem and its place, before any DAG is built. ``local: true`` entries are returned only when
    ``TPU_POSTTRAIN_LOCAL_DIR`` is set (the local CPU run; ``TPU_POSTTRAIN_VM_DIR`` is the "VM"'s disk).
    ``local``: only the local (True) or only the Google Cloud (False) entries; None: all."""
    import yaml

    try:  # libyaml's loader where PyYAML has it: a fifth of the pure-Python parser's time, in every parse
        data = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as err:
        raise RegistryError(path, [f"not YAML: {err}"]) from None
    if not isinstance(data, dict):
        raise RegistryError(path, [f"must be a mapping with the keys {', '.join(_TOP_LEVEL_KEYS)}"])
    problems = _unknown_keys(data, _TOP_LEVEL_KEYS)
    try:  # before the entries are checked: they may name these models
        define_models(model_definitions(data.get("models"), problems))
    except SpecError as err:
        problems.append(f"models: {err}")
    entries = _validated_entries(data, local_stack_dir(), problems)
    if not problems:
        problems += shared_line_problems([config for _, config in entries])
    if problems:
        raise RegistryError(path, problems)
    local_dir = local_stack_dir()
    return [
        config
        for is_local, config in entries
        if (local is None or is_local == local) and (not is_local or local_dir)
    ]
