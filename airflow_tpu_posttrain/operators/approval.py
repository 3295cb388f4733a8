"""A person's approval before the model is published, asked in the Airflow UI (Airflow's human-in-the-loop).

The pipelines wire it after the quality gate, after the export was checked and kept in checkpoint storage and
after both VMs' teardowns, so while it waits nothing is held but that copy: on Airflow 3.3+ the task waits in the
``awaiting_input`` state, no worker slot, no trigger, no VM. Once approved, a CPU VM made for it publishes the copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

from airflow_tpu_posttrain.defaults import APPROVAL_ON_REJECT, GCP_CONN_ID
from airflow_tpu_posttrain.exceptions import InvalidInputError, PublishRejectedError
from airflow_tpu_posttrain.links import CONSOLE
from airflow_tpu_posttrain.operators.inputs_check import REFUSAL_RECORDED, record_refused
from airflow_tpu_posttrain.recipes import approval_notices, validation
from airflow_tpu_posttrain.recipes.approval_notices import Channel
from airflow_tpu_posttrain.recipes.validation import SpecError

if TYPE_CHECKING:
    from airflow.sdk import Context

class PublishApprovalOperator(ApprovalOperator):
    """Ask the approvers whether to publish the trained model, showing its evaluation, the gate's verdict and card.

    Only the ``approvers`` may answer (Airflow's API refuses anyone else). Approve: the publish task runs. Reject,
    or no answer within ``response_timeout`` (its default answer is Reject): nothing is published, the log names
    the kept export, the run's inputs are marked refused, and the publish task is skipped (``on_reject``
    ``skip``: the run succeeds) or this task fails (``fail``: the run fails). The ``notify`` channels, and the
    task's log, are told when the answer waits and when the wait ends unanswered. XCom ``answer`` (and the
    return value, once approved): ``{"approved", "answer", "by", "at", "kept_export"}``.

    :param approvers: the Airflow user ids who may answer (the HITL ``assigned_users``); at least one.
    :param verdict: the quality gate's verdict (its XComArg): the numbers shown.
    :param export: the kept export's record (the keeping export task's XComArg): its ``kept_uri``.
    :param on_reject: ``skip`` (default) or ``fail``.
    :param response_timeout: how long to wait for an answer; then the answer is Reject.
    :param notify: where to say a decision waits or timed out (``recipes/approval_notices.Channel`` or its dict).
    :param training_claim: the inputs check's claim on the run's inputs (its ``training_claim`` XCom; None: no
        shared storage). Reject marks it refused: later runs with these inputs train nothing and ask no one.
    :param gcp_conn_id: the Google connection that writes the claim.
    """

    template_fields = (*ApprovalOperator.template_fields, "verdict", "export", "training_claim")

    def __init__(
        self,
        *,
        approvers: Sequence[str],
        verdict: Any = None,
        export: Any = None,
        on_reject: str = "skip",
        response_timeout: timedelta | None = None,
        notify: Sequence[Channel | Mapping[str, Any]] = (),
        training_claim: str | None = None,
        gcp_conn_id: str = GCP_CONN_ID,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("subject", "Publish the model of run {{ run_id }}?")
        super().__init__(
            defaults=ApprovalOperator.REJECT,
            response_timeout=response_timeout,
            fail_on_reject=on_reject == "fail",
            assigned_users=[{"id": user, "name": user} for user in approvers],
            **kwargs,
        )
        self.approvers = approvers
        self.verdict = verdict
        self.export = export
        self.on_reject = on_reject
        self.notify = notify
        self.training_claim = training_claim
        self.gcp_conn_id = gcp_conn_id

    def execute(self, context: Context) -> Any:
        try:
            on_reject = validation.one_of("approval_on_reject", self.on_reject, APPROVAL_ON_REJECT)
            if not self.approvers:
                raise SpecError("approvers", self.approvers, "is empty", "name the Airflow users who may approve")
            channels = [_channel(entry) for entry in self.notify]
        except SpecError as err:
            raise InvalidInputError.of(self.task_id, err, "Nothing was published.") from err
        self.body = self._body(context, on_reject)
        self.notifiers = [lambda context: self._tell(context, channels, approval_notices.WAITING)]
        self.log.info(
            "Asking %s for approval to publish in the Airflow UI (Required actions); the export: %s",
            ", ".join(self.approvers), self._kept(),
        )
        return super().execute(context)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """The answer: Approve publishes; Reject (or the timeout's default, Reject) skips the publish or fails.

        Said, and recorded (XCom ``answer``), before ``ApprovalOperator`` acts on it: its skip of the publish ends
        the task there."""
        from airflow.providers.standard.exceptions import HITLRejectException

        by = event.get("responded_by_user") or {}
        who = ((by.get("name") or by.get("id")) if isinstance(by, Mapping) else str(by)) or None
        approved = event.get("chosen_options") == [self.APPROVE]
        answer = {
            "approved": approved,
            "answer": self.APPROVE if approved else (self.REJECT if who else "no answer"),
            "by": who,
            "at": str(event.get("responded_at") or ""),
            "kept_export": self._kept(),
        }
        context["ti"].xcom_push(key="answer", value=answer)
        if approved:
            self.log.info("Approved by %s: publishing", who)
        elif "chosen_options" in event:
            why = f"rejected by {who}" if who else f"no answer within {self.response_timeout} (the default: Reject)"
            message = (
                f"Not published: {why}. The checked export is kept at {self._kept()}; clearing approve_publish "
                "(and what follows it) asks again, and an approval publishes that copy without exporting again."
            )
            self.log.info(message)
            if not who:
                channels = [_channel(entry) for entry in self.notify]
                self._tell(context, channels, approval_notices.TIMED_OUT)
            if record_refused(context, self.training_claim, f"publish {why}", self.gcp_conn_id):
                self.log.info(REFUSAL_RECORDED, self.training_claim)
        try:
            super().execute_complete(context, event)  # on Reject, skips the publish (never a teardown) and ends
        except HITLRejectException:
            raise PublishRejectedError(message) from None
        return answer

    def _tell(self, context: Context, channels: list[Channel], event: str) -> None:
        """Say ``event`` in the log and through each channel (a channel that fails is logged, not fatal)."""
        verdict = self.verdict if isinstance(self.verdict, Mapping) else {}
        deadline = str(self.response_timeout) if event == approval_notices.TIMED_OUT else self._deadline()
        said = approval_notices.notice(
            event, context["dag_run"].dag_id, context["run_id"], self._link(context),
            verdict.get("message") or "the gate was off", self._kept(), deadline,
        )
        self.log.info("Notice (%s): %s\n%s", event, said.subject, said.text)
        for channel in channels:
            try:
                _notifier(channel, said)(context)
            except Exception as err:  # noqa: BLE001 - a mail server down must not decide the publish
                self.log.warning("Could not notify through %s (%s): %s", channel.via, channel.conn_id or "default", err)

    def _link(self, context: Context) -> str:
        """The task's Required actions page (Airflow's own deep link; a path where ``[api] base_url`` is unset)."""
        try:
            return self.generate_link_to_ui_from_context(context=context)
        except ValueError:
            ti = context["ti"]
            return f"/dags/{ti.dag_id}/runs/{ti.run_id}/tasks/{ti.task_id}/required_actions"

    def _deadline(self) -> str:
        if not self.response_timeout:
            return "an approver answers"
        return (datetime.now(UTC) + self.response_timeout).isoformat(timespec="minutes")

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


def _channel(entry: Channel | Mapping[str, Any]) -> Channel:
    channel = entry if isinstance(entry, Channel) else Channel(**entry)
    approval_notices.check_channel("notify", channel)
    return channel


def _notifier(channel: Channel, said: approval_notices.Notice) -> Any:
    """The provider's notifier that says ``said`` through ``channel`` (imported only when used)."""
    import importlib

    provider = approval_notices.PROVIDERS[channel.via]
    try:
        notifier = getattr(importlib.import_module(provider.module), provider.name)
    except ImportError as err:
        raise InvalidInputError(
            f"approval_notify: {channel.via} needs {provider.package} where Airflow runs. Fix: install it "
            f"(pip install {provider.package}) or remove the channel. ({err})"
        ) from None
    connection = {"smtp_conn_id": channel.conn_id} if channel.via == "smtp" else {"slack_conn_id": channel.conn_id}
    connection = {key: value for key, value in connection.items() if value}
    if channel.via == "smtp":
        return notifier(to=channel.to, subject=said.subject, html_content=said.text.replace("\n", "<br>"), **connection)
    return notifier(text=f"*{said.subject}*\n{said.text}", channel=channel.channel, **connection)
