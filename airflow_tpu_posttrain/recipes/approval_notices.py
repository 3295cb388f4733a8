"""Who is told that a publish waits for a person, or that nobody answered, and what they are told.

Pure: the registry's ``approval_notify`` channels and the message; ``operators/approval.py`` sends it through the
providers' notifiers (``SmtpNotifier``, ``SlackNotifier``) and always into the task's log.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from airflow_tpu_posttrain.recipes.validation import SpecError

WAITING, TIMED_OUT = "waiting", "timed_out"


@dataclass(frozen=True)
class Provider:
    """The provider notifier a channel's ``via`` names, and the package that ships it."""

    module: str
    name: str
    package: str


PROVIDERS = {
    "smtp": Provider("airflow.providers.smtp.notifications.smtp", "SmtpNotifier", "apache-airflow-providers-smtp"),
    "slack": Provider("airflow.providers.slack.notifications.slack", "SlackNotifier", "apache-airflow-providers-slack"),
}


@dataclass(frozen=True)
class Channel:
    """One ``approval_notify`` entry: ``via`` smtp (``to``: addresses) or slack (``channel``).

    ``conn_id``: the provider's connection (None: its default, ``smtp_default`` / ``slack_api_default``)."""

    via: str
    to: list[str] = field(default_factory=list)
    channel: str | None = None
    conn_id: str | None = None


def check_channel(name: str, channel: Channel) -> None:
    """Refuses a channel that names no provider we send through, or no one to tell."""
    if channel.via not in PROVIDERS:
        raise SpecError(f"{name}.via", channel.via, "is not a channel we send through", f"use one of {sorted(PROVIDERS)}")
    if channel.via == "smtp" and not channel.to:
        raise SpecError(f"{name}.to", channel.to, "is empty", "give the addresses to tell, e.g. to: [ml-oncall@example.com]")
    if channel.via == "slack" and not channel.channel:
        raise SpecError(f"{name}.channel", channel.channel, "is empty", "give the channel, e.g. channel: '#ml'")


@dataclass(frozen=True)
class Notice:
    """What a waiting or timed-out approval says: a subject line and a text (Markdown-light, fit for mail and Slack)."""

    subject: str
    text: str


def notice(event: str, dag_id: str, run_id: str, link: str, verdict: str, kept: str | None, deadline: str) -> Notice:
    """The notice of ``event`` (``waiting`` or ``timed_out``) for the run's approval.

    ``link``: the task's Required actions page; ``verdict``: the quality gate's message; ``kept``: the kept export;
    ``deadline``: when the wait ends (ISO 8601), or how long it was."""
    where = f"{dag_id}, run {run_id}"
    if event == WAITING:
        return Notice(
            f"Approve publishing the model of {where}?",
            f"The model of {where} passed the quality gate ({verdict}) and waits for an approver's answer "
            f"until {deadline}: {link}\nThe kept export: {kept}. No answer by then is a Reject: nothing is published.",
        )
    return Notice(
        f"Not published: nobody answered for {where}",
        f"Nobody answered the approval of {where} within {deadline}: nothing was published. The checked export is "
        f"kept at {kept}; clearing approve_publish asks again: {link}",
    )
