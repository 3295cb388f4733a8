"""Retrain only when something changed: a run whose inputs equal those of the last published model is skipped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_tpu_posttrain.defaults import HF_CONN_ID
from airflow_tpu_posttrain.exceptions import HubAccessError, InvalidInputError
from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.models import input_repos, model_profile
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

PUBLISHED_INPUTS_KEY = "inputs"  # the export's XCom: the inputs of the model it published


def published_inputs_variable(dag_id: str) -> str:
    """The Airflow Variable holding what the DAG's last published model was trained from.

    A Variable, not the export's XCom across runs: Airflow pulls prior XComs by logical date, which runs
    triggered on a change or through the REST API do not have (their order then differs between PostgreSQL and
    SQLite), and a backfill sees only earlier dates. The last published model is the one published last."""
    return f"airflow_tpu_posttrain.published_inputs.{dag_id}"


def record_published(context: Context, inputs: dict[str, Any]) -> None:
    """After a publish: ``inputs`` are what the DAG's newest published model was trained from."""
    from datetime import datetime

    from airflow.sdk import Variable

    dag_run = context["dag_run"]
    record = {"inputs": inputs, "run_id": dag_run.run_id, "published_at": datetime.now(UTC).isoformat()}
    Variable.set(
        published_inputs_variable(dag_run.dag_id),
        record,
        description="What the last published model was trained from (airflow-tpu-posttrain's check_inputs)",
        serialize_json=True,
    )
    context["ti"].xcom_push(key=PUBLISHED_INPUTS_KEY, value=inputs)


class InputsCheckOperator(BaseOperator):
    """Checks the run's inputs before any VM is created: readable with the token, and changed.

    Fails when the token cannot download a base model's or dataset's files (a gated repo without a grant),
    and skips the whole run when nothing it would train from has changed.

    The inputs: the base model's and the dataset's revisions on the Hub (the commit of each now), the MaxText
    version and the run's settings, publish targets included (a new target has nothing of this model yet). They
    are compared with those the export recorded when the DAG last published, whichever run that was
    (:func:`published_inputs_variable`). XCom: the inputs, for the export to record.

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
    :param force: train even when nothing changed.
    """

    template_fields: Sequence[str] = ("model", "dataset", "maxtext_version", "settings", "hub_repo_id", "force")
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.recipe = recipe
        self.dataset = dataset
        self.maxtext_version = maxtext_version
        self.settings = settings
        self.hf_conn_id = hf_conn_id
        self.hub_repo_id = hub_repo_id
        self.force = force

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        try:
            profile = model_profile(self.model)
            force = validation.flag("force", self.force)
            hub_repo_id = validation.blank_to_none(self.hub_repo_id)
            if hub_repo_id:
                validation.hf_repo_id("hub_repo_id", hub_repo_id)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err) from err
        dataset = validation.blank_to_none(self.dataset) if self.recipe == "sft" else None
        repos = input_repos(profile, self.recipe, dataset)
        self._check_access(repos)
        if hub_repo_id:
            self._check_publish_target(hub_repo_id)
        inputs = {
            "model": profile.key,
            "revisions": self._revisions(repos),
            "maxtext_version": validation.blank_to_none(self.maxtext_version) or profile.maxtext_version,
            "settings": {key: _comparable(value) for key, value in sorted((self.settings or {}).items())},
        }
        last = _last_published(context["dag_run"].dag_id)
        if last is None:
            self.log.info("Inputs %s; no model published yet", inputs)
            return inputs
        self.log.info("The last published model: run %s, at %s", last["run_id"], last["published_at"])
        last = last["inputs"]
        changed = sorted(key for key in inputs if last.get(key) != inputs[key])
        if changed:
            self.log.info("Inputs %s; changed since the last published model: %s", inputs, ", ".join(changed))
            return inputs
        if force:
            self.log.info("Inputs unchanged since the last published model; training anyway (force)")
            return inputs
        raise AirflowSkipException(
            f"Inputs unchanged since the last published model ({inputs}): nothing to train, no VM created. "
            "Trigger with force=true to train anyway."
        )

    def _hub_api(self) -> Any:
        from airflow_tpu_posttrain.hooks.hub import HuggingFaceHubHook

        return HuggingFaceHubHook(self.hf_conn_id).get_conn()

    def _revisions(self, repos: list[tuple[str, str]]) -> dict[str, str]:
        """``{"<type>:<repo>": commit}`` of each repo now."""
        api = self._hub_api()
        return {f"{kind}:{repo}": api.repo_info(repo, repo_type=kind).sha for repo, kind in repos}

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


def _last_published(dag_id: str) -> dict[str, Any] | None:
    from airflow.sdk import Variable

    return Variable.get(published_inputs_variable(dag_id), default=None, deserialize_json=True)


def _comparable(value: Any) -> Any:
    """A rendered Param as compared: blank (None, "", "None", []) is None, a list a list."""
    value = validation.blank_to_none(value)
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return value
