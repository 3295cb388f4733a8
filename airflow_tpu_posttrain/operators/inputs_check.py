"""Retrain only when something changed, and train each distinct input once.

A run's inputs are the Hub's revisions as of its date; a run whose inputs equal those of the last published
model, or of a model another run published or is training now, trains nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.defaults import GCP_CONN_ID, HF_CONN_ID, INPUTS_AS_OF
from airflow_tpu_posttrain.exceptions import CloudResourceError, HubAccessError, InvalidInputError
from airflow_tpu_posttrain.recipes import compute, maxtext_config, storage, trainings, validation
from airflow_tpu_posttrain.recipes.accelerators import accelerator
from airflow_tpu_posttrain.recipes.lora import LoraSettings
from airflow_tpu_posttrain.recipes.lora import check_model as check_lora_model
from airflow_tpu_posttrain.recipes.models import input_repos, model_profile
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

PUBLISHED_INPUTS_KEY = "inputs"  # the export's XCom: the inputs of the model it published
TRAINING_CLAIM_KEY = "training_claim"  # the inputs check's XCom: its claim on the inputs (``recipes/trainings.py``)
REUSED_MODEL_KEY = "reused_model"  # the inputs check's XCom when the run reuses another run's model
# How a forced run's log names the claim it trains beside, by the claim's state.
_CLAIM_VERBS = {trainings.TRAINING: "holds", trainings.PUBLISHED: "published", trainings.REFUSED: "had refused"}


def published_inputs_variable(dag_id: str) -> str:
    """The Airflow Variable holding what the DAG's last published model was trained from.

    A Variable, not the export's XCom across runs: Airflow pulls prior XComs by logical date, which runs
    triggered on a change or through the REST API do not have (their order then differs between PostgreSQL and
    SQLite), and a backfill sees only earlier dates. The last published model is the one published last."""
    return f"airflow_tpu_posttrain.published_inputs.{dag_id}"


def record_published(context: Context, inputs: dict[str, Any], model: dict[str, Any] | None = None) -> None:
    """After a publish: ``inputs`` are what the DAG's newest published model (at ``model``'s places) was trained from."""
    from airflow.sdk import Variable

    dag_run = context["dag_run"]
    record = {
        "inputs": inputs,
        "run_id": dag_run.run_id,
        "published_at": datetime.now(UTC).isoformat(),
        "model": model or {},
    }
    Variable.set(
        published_inputs_variable(dag_run.dag_id),
        record,
        description="What the last published model was trained from (airflow-tpu-posttrain's check_inputs)",
        serialize_json=True,
    )
    context["ti"].xcom_push(key=PUBLISHED_INPUTS_KEY, value=inputs)


def record_refused(context: Context, training_claim: str | None, reason: str, gcp_conn_id: str) -> bool:
    """After the run's model was refused for ``reason``: later runs with its inputs train nothing and ask no one.

    ``training_claim``: the inputs check's claim (None: no shared storage, nothing to record). Whether the claim
    says so now (not when these inputs' model was published meanwhile)."""
    if not training_claim:
        return False
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook

    now = datetime.now(UTC).isoformat()
    return StoredRecordHook(gcp_conn_id=gcp_conn_id).change(
        training_claim, lambda claim: trainings.refused(claim, context["run_id"], now, reason)
    )


# What the log says once a run's refusal is in its claim.
REFUSAL_RECORDED = "Runs with these inputs train nothing now (their model was refused; force=true trains them): %s"


class InputsCheckOperator(BaseOperator):
    """Checks the run's inputs and targets before any VM is created: there, readable, and changed.

    Fails when the token cannot download a base model's or dataset's files (a gated repo without a grant) or
    write the Hub repo to publish to, when a bucket or the reservation the run names does not exist (or
    Airflow's Google connection may not read it), and when an override sets a key the run's MaxText release's
    trainer does not define (``recipes/maxtext_config.py``); skips the whole run when nothing it would train from
    has changed.

    The inputs: the base model's and the dataset's revisions on the Hub, the MaxText version and the run's
    settings, publish targets included (a new target has nothing of this model yet). The revisions are those
    of the run's date (``inputs_as_of``): a backfill date trains what was on the Hub that day, and a retry or
    re-run of a run trains what it first did. The conversion, the tokenizer and the export read the base
    model at the revision recorded here.

    They are compared with those the export recorded when the DAG last published, whichever run that was
    (:func:`published_inputs_variable`). With ``gs://`` checkpoint storage the run also takes a claim on its
    inputs (``recipes/trainings.py``): inputs another run published are not trained again (the run is
    skipped, naming that run's model), nor inputs whose model was refused by the quality gate or a person (the
    run is skipped, naming that run and the reason), and inputs another run is training now are waited for,
    deferred, then reused, or trained if that run is provably over without a model. XCom: the inputs, for the export to record;
    ``training_claim``, the claim's ``gs://`` object; ``reused_model``, the model a skipped run reuses.

    :param model: model profile key.
    :param recipe: ``sft`` or ``rl``.
    :param dataset: the run's SFT dataset (blank: the model's).
    :param maxtext_version: the run's MaxText release (blank: the model's).
    :param settings: the run's recipe settings and publish targets (rendered Params, e.g. steps, hub_repo_id),
        compared as given (blank = None).
    :param hf_conn_id: connection whose password is the Hugging Face token and whose host, if set, the Hub
        (default ``hf_default``, as the registry's; None: anonymous).
    :param hub_repo_id: the Hub repo the export will publish to (blank: none); the token must be able to
        create and write it, checked here rather than after the training.
    :param force: train even when nothing changed, or another run has these inputs.
    :param inputs_as_of: ``run_date`` (default): the revisions current at the run's logical date (a run without
        one, such as a run started by a new revision, at its start); ``latest``: the revisions now.
    :param poll_interval: seconds between two looks at the claim of a run followed.
    :param gcp_conn_id: Google connection that reads the buckets and the reservation (storage.buckets.get,
        compute.reservations.get).
    :param project_id: the project of the VMs and of a reservation named without one (None: the connection's).
    :param zones: the zones the TPU VM may be made in; a reservation is looked up in each.
    :param reservation: the reservation the TPU VM will consume (None: none), in any form ``reservation`` takes.
    :param accelerator_type: the TPU VM's accelerator: a reservation of another machine type is refused.
    :param checkpoint_storage: the ``gs://`` checkpoint storage; its bucket must exist.
    :param storage_uri: where the export keeps the model; its bucket must exist when it is ``gs://``.
    :param lora: a LoRA run's settings, as its trigger form's LoRA fields give them (``recipes/lora.PARAM_KEYS``);
        refused here when the model or the run's MaxText release cannot train and export them. None: full SFT.
    """

    template_fields: Sequence[str] = (
        "model",
        "dataset",
        "maxtext_version",
        "settings",
        "hub_repo_id",
        "force",
        "inputs_as_of",
        "zones",
        "reservation",
        "accelerator_type",
        "storage_uri",
        "lora",
    )
    ui_color = "#e8e8f4"

    def __init__(
        self,
        *,
        model: str,
        recipe: str,
        dataset: str | None = None,
        maxtext_version: str | None = None,
        settings: Mapping[str, Any] | None = None,
        hf_conn_id: str | None = HF_CONN_ID,
        hub_repo_id: str | None = None,
        force: bool | str = False,
        inputs_as_of: str = "run_date",
        poll_interval: float = 15.0,
        gcp_conn_id: str = GCP_CONN_ID,
        project_id: str | None = None,
        zones: Sequence[str] | str | None = None,
        reservation: str | None = None,
        accelerator_type: str | None = None,
        checkpoint_storage: str | None = None,
        storage_uri: str | None = None,
        lora: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lora = lora
        self.model = model
        self.recipe = recipe
        self.dataset = dataset
        self.maxtext_version = maxtext_version
        self.settings = settings
        self.hf_conn_id = hf_conn_id
        self.hub_repo_id = hub_repo_id
        self.force = force
        self.inputs_as_of = inputs_as_of
        self.poll_interval = poll_interval
        self.gcp_conn_id = gcp_conn_id
        self.project_id = project_id
        self.zones = zones
        self.reservation = reservation
        self.accelerator_type = accelerator_type
        self.checkpoint_storage = checkpoint_storage
        self.storage_uri = storage_uri

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        try:
            profile = model_profile(self.model)
            release = validation.blank_to_none(self.maxtext_version) or profile.maxtext_version
            overrides = validation.override_pairs("overrides", (self.settings or {}).get("overrides") or [])
            if overrides and not maxtext_config.check_override_keys("overrides", overrides, release, self.recipe):
                self.log.warning("The overrides' keys are not checked here: no key list of MaxText %s", release)
            if self.lora is not None:
                LoraSettings.from_params(self.lora)
                check_lora_model(profile, release)
            force = validation.flag("force", self.force)
            hub_repo_id = validation.blank_to_none(self.hub_repo_id)
            as_of = self._as_of(context)
            if hub_repo_id:
                validation.hf_repo_id("hub_repo_id", hub_repo_id)
            buckets = self._buckets()
            reservations = self._reservations()
            machine_type = accelerator(self.accelerator_type).machine_type if self.accelerator_type else None
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err, "No VM was created.") from err
        dataset = validation.blank_to_none(self.dataset) if self.recipe == "sft" else None
        repos = input_repos(profile, self.recipe, dataset)
        self._check_access(repos)
        if hub_repo_id:
            self._check_publish_target(hub_repo_id)
        for field, bucket in buckets.items():
            self._check_bucket(field, bucket)
        if reservations:
            self._check_reservations(reservations, machine_type)
        inputs = {
            "model": profile.key,
            "revisions": self._revisions(repos, as_of),
            "maxtext_version": release,
            "settings": {key: _comparable(value) for key, value in sorted((self.settings or {}).items())},
        }
        self.log.info("Inputs as of %s: %s", as_of.isoformat() if as_of else "now (inputs_as_of=latest)", inputs)
        last = _last_published(context["dag_run"].dag_id)
        if last is None:
            self.log.info("No model published yet")
        else:
            self.log.info("The last published model: run %s, at %s", last["run_id"], last["published_at"])
            changed = sorted(key for key in inputs if last["inputs"].get(key) != inputs[key])
            if changed:
                self.log.info("Changed since the last published model: %s", ", ".join(changed))
            elif force:
                self.log.info("Inputs unchanged since the last published model; training anyway (force)")
            else:
                model = last.get("model") or {}
                context["ti"].xcom_push(key=REUSED_MODEL_KEY, value={"run_id": last["run_id"], **model})
                raise AirflowSkipException(
                    f"Inputs unchanged since the last published model (run {last['run_id']}, {_model_place(model)}): "
                    "nothing to train, no VM created. Trigger with force=true to train anyway."
                )
        context["ti"].xcom_push(key="inputs", value=inputs)
        return self._claim(context, inputs, force)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The claim changed, or it is time to look at the run it waits for again: decide anew."""
        inputs = context["ti"].xcom_pull(task_ids=self.task_id, key="inputs")
        return self._claim(context, inputs, validation.flag("force", self.force))

    def _claim(self, context: Context, inputs: dict[str, Any], force: bool) -> dict[str, Any]:
        """The run's claim on ``inputs``: train, follow the run that trains them, reuse its model, or refuse them."""
        from airflow.sdk.exceptions import AirflowSkipException

        from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook
        from airflow_tpu_posttrain.operators.compute_base import deployment_id
        from airflow_tpu_posttrain.triggers.trainings import ClaimChangeTrigger

        storage_at = validation.blank_to_none(self.checkpoint_storage)
        dag_run = context["dag_run"]
        claimed = storage_at and storage.is_gcs(storage_at)
        uri = trainings.claim_uri(storage_at, deployment_id(), dag_run.dag_id, inputs) if claimed else None
        context["ti"].xcom_push(key=TRAINING_CLAIM_KEY, value=uri)
        if uri is None:  # no storage every run shares: the last published model is all there is to compare with
            return inputs
        now = datetime.now(UTC).isoformat()
        records = StoredRecordHook(gcp_conn_id=self.gcp_conn_id)
        ended = self._ended_owner(context, records.read(uri))
        decision = records.change(
            uri, lambda claim: trainings.decide(claim, dag_run.run_id, now, force=force, ended_owner=ended)
        )
        owner = decision.claim.get("run_id")
        if decision.action == trainings.TRAIN:
            if decision.took_over_from:
                self.log.info(
                    "Run %s, which held these inputs, ended without a model: this run trains them (%s)",
                    decision.took_over_from, uri,
                )
            elif owner != dag_run.run_id:
                self.log.info(
                    "Training anyway (force), though run %s %s these inputs (%s)",
                    owner, _CLAIM_VERBS[decision.claim.get("state")], uri,
                )
            else:
                self.log.info("This run trains these inputs (its claim: %s)", uri)
            return inputs
        if decision.action == trainings.REUSE:
            model = decision.claim.get("model") or {}
            context["ti"].xcom_push(key=REUSED_MODEL_KEY, value={"run_id": owner, **model})
            raise AirflowSkipException(
                f"Inputs equal those run {owner} trained and published: this run's model is that one "
                f"({_model_place(model)}); nothing to train, no VM created. Trigger with force=true to train anyway."
            )
        if decision.action == trainings.REFUSE:
            raise AirflowSkipException(
                f"Inputs equal those of run {owner}, whose model was refused ({decision.claim.get('reason')}; "
                f"at {decision.claim.get('since')}): nothing to train, no one asked, no VM created. A change of "
                "model, dataset, MaxText release or settings trains again; trigger with force=true to train these "
                f"inputs again ({uri})."
            )
        self.log.info(
            "Inputs equal those run %s is training now (since %s): following it, deferred and holding no VM; "
            "its model is reused once published, or these inputs are trained here if it ends without one (%s)",
            owner, decision.claim.get("since"), uri,
        )
        self.defer(
            trigger=ClaimChangeTrigger(
                uri, decision.claim, trainings.RECHECK_S, self.poll_interval, gcp_conn_id=self.gcp_conn_id
            ),
            method_name="execute_complete",
        )

    def _ended_owner(self, context: Context, claim: dict[str, Any]) -> str | None:
        """The run holding ``claim`` for training, if it is provably over: ended, or not in Airflow (404).

        Any other error reading its state (the API server's 5xx, a timeout, a refused connection) proves
        nothing: the run is followed on, and its state read again at the next look."""
        from airflow.sdk.api.client import ServerResponseError
        from airflow.sdk.exceptions import AirflowRuntimeError

        owner = claim.get("run_id")
        if claim.get("state") != trainings.TRAINING or not owner or owner == context["dag_run"].run_id:
            return None
        try:
            state = context["ti"].get_dagrun_state(context["dag_run"].dag_id, owner)
        except (AirflowRuntimeError, ServerResponseError) as err:  # the latter in-process (``airflow dags test``)
            if _status_code(err) == 404:
                self.log.info("Run %s, which holds these inputs, is not in Airflow (%s): taken for ended", owner, err)
                return owner
            self.log.warning(
                "Could not read the state of run %s, which holds these inputs (%s): following it on, and asking "
                "again in %d s", owner, err, trainings.RECHECK_S,
            )
            return None
        return owner if state in ("success", "failed") else None

    def _as_of(self, context: Context) -> datetime | None:
        """The instant whose revisions the run trains: None for the latest."""
        if validation.one_of("inputs_as_of", self.inputs_as_of, INPUTS_AS_OF) == "latest":
            return None
        dag_run = context["dag_run"]
        return dag_run.logical_date or dag_run.run_after

    def _hub_api(self) -> Any:
        from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

        return HuggingFaceHubHook(self.hf_conn_id).get_conn()

    def _revisions(self, repos: list[tuple[str, str]], as_of: datetime | None) -> dict[str, str]:
        """``{"<type>:<repo>": commit}`` of each repo: now, or the newest commit of its main dated by ``as_of``."""
        api = self._hub_api()
        if as_of is None:
            return {f"{kind}:{repo}": api.repo_info(repo, repo_type=kind).sha for repo, kind in repos}
        revisions = {}
        for repo, kind in repos:
            commits = api.list_repo_commits(repo, repo_type=kind)
            dated = [commit for commit in commits if commit.created_at <= as_of]
            if not dated:
                first = min(commit.created_at for commit in commits).isoformat()
                raise InvalidInputError(
                    f"{self.task_id}: invalid input: inputs_as_of: the {kind} {repo} has no commit on or before "
                    f"{as_of.isoformat()}, the run's date (its first is of {first}). Fix: run dates from {first} "
                    "on, or trigger with inputs_as_of=latest. No VM was created."
                )
            revisions[f"{kind}:{repo}"] = max(dated, key=lambda commit: commit.created_at).commit_id
        return revisions

    def _check_access(self, repos: list[tuple[str, str]]) -> None:
        """Fails before any VM when the token cannot download an input's files.

        A gated repo shows its card to anyone; only its files need the grant, and the conversion would find
        out on the VM, on every retry. ``HfApi.auth_check`` asks the Hub exactly that."""
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

        api = self._hub_api()
        who = f"the token of connection {self.hf_conn_id!r}" if self.hf_conn_id else "no token (anonymous)"
        for repo, kind in repos:
            page = f"{api.endpoint}/{'datasets/' if kind == 'dataset' else ''}{repo}"
            try:
                api.auth_check(repo, repo_type=kind)
            except GatedRepoError:
                raise HubAccessError(
                    f"The {kind} {repo} is gated and {who} has no access to its files. Fix: with the Hub account "
                    f"the token belongs to, accept the licence at {page} (wait for the grant), or set a token of "
                    "an account that has access in the connection; then trigger again. No VM was created."
                ) from None
            except RepositoryNotFoundError:
                raise HubAccessError(
                    f"The {kind} {repo} is not found with {who} (private, or misspelt). Fix: check the id, or "
                    f"set a token of an account that can read {page}; then trigger again. No VM was created."
                ) from None


    def _check_publish_target(self, repo_id: str) -> None:
        """Fails before any VM when the token cannot create or write ``repo_id``.

        Found out by the export, it is found out after the whole training. The Hub's ``whoami``: the token's
        role, its user and the organizations it may write in."""
        from huggingface_hub.errors import HfHubHTTPError

        namespace = repo_id.split("/", 1)[0]
        where = f"connection {self.hf_conn_id!r}"
        if not self.hf_conn_id:
            raise HubAccessError(
                f"Publishing to {repo_id} needs a Hugging Face token: set hf_conn_id (a connection whose password "
                "is a write token). No VM was created."
            )
        try:
            me = self._hub_api().whoami()
        except HfHubHTTPError as err:
            raise HubAccessError(
                f"The Hub does not know the token of {where} ({err}). Fix: set a valid write token. No VM was created."
            ) from None
        role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
        writable = [me.get("name")] + [
            org.get("name") for org in me.get("orgs") or [] if org.get("roleInOrg") not in ("read",)
        ]
        if role == "read":
            problem, fix = "is a read-only token", "set a token with the write role (or a fine-grained one)"
        elif namespace not in writable:
            problem = f"belongs to {me.get('name')!r}, who may write in {', '.join(map(repr, writable))} only"
            fix = f"publish under one of those (hub_repo_id), or use a token of a member of {namespace!r}"
        else:
            return
        raise HubAccessError(
            f"The model cannot be published to {repo_id}: the token of {where} {problem}. Fix: {fix}; then trigger "
            "again. No VM was created."
        )


    def _buckets(self) -> dict[str, str]:
        """``{field: bucket}`` of the ``gs://`` storage the run writes to."""
        uris = {"checkpoint_storage": self.checkpoint_storage, "storage_uri": self.storage_uri}
        return {
            field: validation.storage_uri(field, uri).removeprefix("gs://").split("/", 1)[0]
            for field, uri in uris.items()
            if validation.blank_to_none(uri) and storage.is_gcs(str(uri))
        }

    def _reservations(self) -> dict[str, str]:
        """``{zone: reservation}`` the TPU VM may consume, as the create will name them."""
        reservation = validation.blank_to_none(self.reservation)
        if not reservation:
            return {}
        from airflow_tpu_posttrain.operators.compute_base import as_list

        return compute.reservations_by_zone(reservation, tuple(as_list(self.zones)))

    def _check_bucket(self, field: str, bucket: str) -> None:
        """Fails before any VM when ``bucket`` does not exist or Airflow's Google connection may not read it.

        Found out on the VM, it is found out after the VM is paid for, and by a step that retries."""
        from airflow.providers.google.cloud.hooks.gcs import GCSHook
        from google.api_core.exceptions import Forbidden

        who = f"Airflow's Google connection {self.gcp_conn_id!r}"
        try:
            found = GCSHook(gcp_conn_id=self.gcp_conn_id).get_conn().lookup_bucket(bucket)
        except Forbidden:
            raise CloudResourceError(
                f"{field}: {who} may not read the bucket gs://{bucket}: it is another project's, or the account "
                "lacks storage.buckets.get on it. Fix: name a bucket of yours, or grant the account "
                f"roles/storage.legacyBucketReader on gs://{bucket}; then trigger again. No VM was created."
            ) from None
        if found is None:
            raise CloudResourceError(
                f"{field}: the bucket gs://{bucket} does not exist. Fix: create it (gcloud storage buckets create "
                f"gs://{bucket} --location=REGION, in the TPU's region) or name an existing one; then trigger "
                "again. No VM was created."
            )

    def _check_reservations(self, reservations: dict[str, str], machine_type: str | None) -> None:
        """Fails before any VM when a zone's reservation does not exist or reserves another machine type.

        A reservation shared by another project may be unreadable here (its owner grants the use, not the
        view): that one is left to the create, which Compute answers."""
        from google.api_core.exceptions import Forbidden

        from airflow_tpu_posttrain.hooks.compute import TpuVmHook

        hook = TpuVmHook(gcp_conn_id=self.gcp_conn_id)
        project = self.project_id or hook.project_id
        for zone, reference in reservations.items():
            owner, name = compute.reservation_owner_and_name(reference, project)
            where = f"the reservation {name} of project {owner} in zone {zone}"
            try:
                found = hook.get_reservation(owner, zone, name)
            except Forbidden:
                if owner != project:
                    self.log.info("%s is not readable from project %s; the create will consume it", where, project)
                    continue
                raise CloudResourceError(
                    f"reservation: Airflow's Google connection {self.gcp_conn_id!r} may not read {where} (it "
                    "lacks compute.reservations.get). Fix: grant it roles/compute.viewer on the project; then "
                    "trigger again. No VM was created."
                ) from None
            if found is None:
                raise CloudResourceError(
                    f"reservation: {where} does not exist. Fix: name one that does (gcloud compute reservations "
                    f"list --project={owner}), give one per zone (ZONE=RESERVATION,...), or clear reservation; "
                    "then trigger again. No VM was created."
                )
            reserved = ((found.get("specificReservation") or {}).get("instanceProperties") or {}).get("machineType")
            if machine_type and reserved and reserved != machine_type:
                raise CloudResourceError(
                    f"reservation: {where} reserves {reserved}, and accelerator_type {self.accelerator_type} "
                    f"runs on {machine_type}. Fix: name a reservation of {machine_type}, or the accelerator "
                    "it reserves; then trigger again. No VM was created."
                )
            self.log.info("Reservation %s: %s", where, (found.get("specificReservation") or {}))


def _last_published(dag_id: str) -> dict[str, Any] | None:
    from airflow.sdk import Variable

    return Variable.get(published_inputs_variable(dag_id), default=None, deserialize_json=True)


def _status_code(err: Exception) -> int | None:
    """The HTTP status the API server answered a Task SDK call with (None: no answer, e.g. a refused connection).

    A task under Airflow's supervisor gets it in an ``AirflowRuntimeError``'s detail; one run in-process, the
    client's own ``ServerResponseError``."""
    response = getattr(err, "response", None)
    if response is not None:
        return response.status_code
    detail = getattr(getattr(err, "error", None), "detail", None)
    return detail.get("status_code") if isinstance(detail, dict) else None


def _model_place(model: dict[str, Any]) -> str:
    """Where a published model is, as the export recorded it."""
    hub = model.get("hub") or {}
    places = [hub.get("url")] if hub.get("url") else []
    places += [model[key] for key in ("storage_uri", "kept_uri") if model.get(key)]
    return ", ".join(places) or "no copy recorded"


def _comparable(value: Any) -> Any:
    """A rendered Param as compared: blank (None, "", "None", []) is None, a list a list."""
    value = validation.blank_to_none(value)
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return value
