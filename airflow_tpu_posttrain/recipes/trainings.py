"""One training per distinct input: the claim a run takes on its inputs before it trains them.

A claim is a JSON object in checkpoint storage, one per (deployment, DAG, inputs), at :func:`claim_uri`. It is
changed only by compare-and-swap (``hooks/stored_records.py``), so two runs that check the same inputs at once
never both train them: one takes the claim, the other follows it. What a claim holds::

    {"state": "training", "run_id": ..., "since": ..., "run_date": ...}  a run trains these inputs ("settling":
                                                                         true while runs of earlier dates may
                                                                         still ask for them)
    {"state": "published", "run_id": ..., "since": ..., "model": ...}    it published their model (the export's
                                                                         hub and storage copy)

A run whose inputs are claimed by a run still going waits (deferred) and then reuses the published model; when
that run ended without publishing (failed, or its model refused by the quality gate), the follower takes the
claim over and trains. Of runs that ask at once (a backfill's), the earliest date trains: a run asks, then
waits until the runs of earlier dates have asked too (``older_asked``); until then its claim is ``settling``
and a run of an earlier date takes it over. Pure functions: the caller reads the runs' states and does the I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

TRAINING, PUBLISHED = "training", "published"
TRAIN, FOLLOW, REUSE = "train", "follow", "reuse"
# Seconds a follower's trigger waits without seeing the claim change before the task looks at the owner's run
# again (a run that ended without publishing never writes its claim).
RECHECK_S = 120
# Seconds between two looks at whether the run of the previous date has asked for its inputs yet, and the most a
# run waits for that (a check takes seconds; past this, a stuck earlier run no longer holds the others back).
OLDER_RECHECK_S = 5
OLDER_WAIT_S = 600


def inputs_digest(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def claim_uri(checkpoint_storage: str, deployment: str, dag_id: str, inputs: dict[str, Any]) -> str:
    """Where the claim on ``inputs`` of ``dag_id`` in ``deployment`` lives, under checkpoint storage."""
    return f"{checkpoint_storage.rstrip('/')}/trainings/{deployment or 'default'}/{dag_id}/{inputs_digest(inputs)}.json"


@dataclass(frozen=True)
class Decision:
    """What the run does with its inputs: ``train``, ``follow`` the claim's owner, or ``reuse`` its model."""

    action: str
    claim: dict[str, Any]  # the claim as it is after the decision
    took_over_from: str | None = None
    earlier_date: bool = False  # taken over from a run of a later date that was still settling


def decide(
    claim: dict[str, Any],
    run_id: str,
    now: str,
    *,
    force: bool,
    ended_owner: str | None,
    run_date: str | None = None,
    older_asked: bool = True,
) -> tuple[dict[str, Any], Decision]:
    """The claim after ``run_id`` asked for it (to write back only if it is unchanged), and the run's decision.

    ``ended_owner``: a run the caller found ended (or gone); a claim it still holds is taken over. ``force``:
    train whatever the claim says, leaving it as it is. ``run_date``: the run's date (ISO 8601, UTC);
    ``older_asked``: whether every run of an earlier date still going has asked; until then a claim this run
    takes is ``settling``, and a settling claim of a later date is taken over."""
    mine = {"state": TRAINING, "run_id": run_id, "since": now, "run_date": run_date}
    if not older_asked:
        mine["settling"] = True
    owner = claim.get("run_id")
    if not claim:
        return mine, Decision(TRAIN, mine)
    if force:
        return claim, Decision(TRAIN, claim)
    if claim.get("state") == PUBLISHED:
        return claim, Decision(REUSE, claim)
    if owner == run_id:
        held = {key: value for key, value in claim.items() if key != "settling"} if older_asked else claim
        return held, Decision(TRAIN, held)
    if owner == ended_owner:
        return mine, Decision(TRAIN, mine, took_over_from=owner)
    if claim.get("settling") and _earlier(run_date, claim.get("run_date")):
        return mine, Decision(TRAIN, mine, took_over_from=owner, earlier_date=True)
    return claim, Decision(FOLLOW, claim)


def _earlier(date: str | None, other: str | None) -> bool:
    """Whether the instant ``date`` comes before ``other`` (both ISO 8601 with an offset; either missing: no)."""
    if not date or not other:
        return False
    return datetime.fromisoformat(date) < datetime.fromisoformat(other)


def published(claim: dict[str, Any], run_id: str, now: str, model: dict[str, Any]) -> tuple[dict[str, Any], None]:
    """The claim once ``run_id`` published the model of its inputs (whoever held it: the model now exists)."""
    return {"state": PUBLISHED, "run_id": run_id, "since": now, "model": model}, None
