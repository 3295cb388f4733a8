"""A person's approval before the model is published, asked in the Airflow UI (Airflow's human-in-the-loop).

The pipelines wire it after the quality gate, after the export was checked and kept in checkpoint storage and
after both VMs' teardowns, so while it waits nothing is held but that copy: on Airflow 3.3+ the task waits in the
``awaiting_input`` state, no worker slot, no trigger, no VM. Once approved, a CPU VM made for it publishes the copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

from airflow_tpu_posttrain.defaults import APPROVAL_ON_REJECT, GCP_CONN_ID
from airflow_tpu_posttrain.exceptions import InvalidInputError, PublishRejectedError
from airflow_tpu_posttrain.links import CONSOLE
from airflow_tpu_posttrain.operators.inputs_check import REFUSAL_RECORDED, record_refused
from airflow_tpu_posttrain.recipes import validation
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

class PublishApprovalOperator(ApprovalOperator):
    """Ask a person whether to publish the trained model, showing its evaluation, the gate's verdict and card.

    Approve: the publish task runs. Reject, or no answer within ``response_timeout`` (its default answer is
    Reject): nothing is published, the log names the kept export, and the publish task is skipped (``on_reject``
    ``skip``: the run succeeds) or this task fails (``fail``: the run fails). A run that does not ask
    (``required`` false) is approved by that rule at once. XCom, once approved: ``{"approved", "by",
    "kept_export"}``.

    :param required: whether this run asks (a Param: true/false).
    :param verdict: the quality gate's verdict (its XComArg): the numbers shown.
    :param export: the kept export's record (the keeping export task's XComArg): its ``kept_uri``.
    :param on_reject: ``skip`` (default) or ``fail``.
    :param response_timeout: how long to wait for an answer; then the answer is Reject.
    :param training_claim: the inputs check's claim on the run's inputs (its ``training_claim`` XCom; None: no
        shared storage). Reject marks it refused: later runs with these inputs train nothing and ask no one.
    :param gcp_conn_id: the Google connection that writes the claim.
    """

    template_fields = (*ApprovalOperator.template_fields, "required", "verdict", "export", "training_claim")

    def __init__(
        self,
        *,
        required: bool | str = True,
        verdict: Any = None,
        export: Any = None,
        on_reject: str = "skip",
        response_timeout: timedelta | None = None,
        training_claim: str | None = None,
        gcp_conn_id: str = GCP_CONN_ID,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("subject", "Publish the model of run {{ run_id }}?")
        super().__init__(
            defaults=ApprovalOperator.REJECT,
            response_timeout=response_timeout,
            fail_on_reject=on_reject == "fail",
            **kwargs,
        )
        self.required = required
        self.verdict = verdict
        self.export = export
        self.on_reject = on_reject
        self.training_claim = training_claim
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context: Context) -> Any:
        try:
            on_reject = validation.one_of("approval_on_reject", self.on_reject, APPROVAL_ON_REJECT)
            required = validation.flag("approval", self.required)
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err, "Nothing was published.") from err
        if not required:
            self.log.info("This run does not ask for approval (approval=false): publishing")
            return {"approved": True, "by": "rule", "kept_export": self._kept()}
        self.body = self._body(context, on_reject)
        self.log.info("Asking for approval to publish in the Airflow UI (Required actions); the export: %s", self._kept())
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """The answer: Approve publishes; Reject (or the timeout's default, Reject) skips the publish or fails.

        Said before ``ApprovalOperator`` acts on it: its skip of the publish ends the task there."""
        from airflow.providers.standard.exceptions import HITLRejectException

        by = event.get("responded_by_user") or {}
        who = (by.get("name") or by.get("id")) if isinstance(by, Mapping) else str(by)
        if event.get("chosen_options") == [self.APPROVE]:
            self.log.info("Approved by %s: publishing", who)
        elif "chosen_options" in event:
            why = f"rejected by {who}" if who else f"no answer within {self.response_timeout} (the default: Reject)"
            message = (
                f"Not published: {why}. The checked export is kept at {self._kept()}; clearing approve_publish "
                "(and what follows it) asks again, and an approval publishes that copy without exporting again."
            )
            self.log.info(message)
            if record_refused(context, self.training_claim, f"publish {why}", self.gcp_conn_id):
                self.log.info(REFUSAL_RECORDED, self.training_claim)
        try:
            super().execute_complete(context, event)  # on Reject, skips the publish (never a teardown) and ends
        except HITLRejectException:
            raise PublishRejectedError(message) from None
        return {"approved": True, "by": who, "kept_export": self._kept()}

    def _kept(self) -> str | None:
        return self.export.get("kept_uri") if isinstance(self.export, Mapping) else None

    def _body(self, context: Context, on_reject: str) -> str:
        """What the person reads: the numbers, the gate's verdict, the model card and what each answer does."""
        verdict = self.verdict if isinstance(self.verdict, Mapping) else {}
        kept = self._kept()
        # The card's page in the Cloud Storage browser (an object's details page).
        card = f"{CONSOLE}/storage/browser/_details/{kept.removeprefix('gs://')}/README.md" if kept else None
        lines = [
            f"**{context['dag_run'].dag_id}**, run `{context['run_id']}`: the trained model passed the quality gate "
            "and is exported, checked and kept; it is published once you approve.",
            "",
            f"- Quality gate: {verdict.get('message') or 'no verdict (the gate was off)'}",
        ]
        for name in ("base", "trained", "improvement"):
            if verdict.get(name) is not None:
                lines.append(f"- {name}: {verdict[name]}")
        lines += [
            f"- The kept export: `{kept}`" + (f" ([model card]({card}))" if card else ""),
            "",
            "Reject (or no answer in time) publishes nothing and keeps the export; "
            + ("the run then fails." if on_reject == "fail" else "the run then ends without publishing."),
        ]
        return "\n".join(lines)
