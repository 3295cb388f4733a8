"""One training per distinct input: the claim a run takes on its inputs before it trains them.

A claim is a JSON object in checkpoint storage, one per (deployment, DAG, inputs), at :func:`claim_uri`. It is
changed only by compare-and-swap (``hooks/stored_records.py``), so two runs that check the same inputs at once
never both train them: one takes the claim, the other follows it. What a claim holds::

    {"state": "training", "run_id": ..., "since": ...}                 a run trains these inputs
    {"state": "published", "run_id": ..., "since": ..., "model": ...}  it published their model (the export's hub
                                                                       and storage copy)

A run whose inputs are claimed by a run still going waits (deferred) and then reuses the published model; when
that run ended without publishing (failed, or its model refused by the quality gate), the follower takes the
claim over and trains. Pure functions: the caller reads the owner's run state and does the I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

TRAINING, PUBLISHED = "training", "published"
TRAIN, FOLLOW, REUSE = "train", "follow", "reuse"
# Seconds a follower's trigger waits without seeing the claim change before the task looks at the owner's run
# again (a run that ended without publishing never writes its claim).
RECHECK_S = 120


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


def decide(
    claim: dict[str, Any], run_id: str, now: str, *, force: bool, ended_owner: str | None
) -> tuple[dict[str, Any], Decision]:
    """The claim after ``run_id`` asked for it (to write back only if it is unchanged), and the run's decision.

    ``ended_owner``: a run the caller found ended (or gone); a claim it still holds is taken over. ``force``:
    train whatever the claim says, leaving it as it is."""
    mine = {"state": TRAINING, "run_id": run_id, "since": now}
    owner = claim.get("run_id")
    if not claim:
        return mine, Decision(TRAIN, mine)
    if force:
        return claim, Decision(TRAIN, claim)
    if claim.get("state") == PUBLISHED:
        return claim, Decision(REUSE, claim)
    if owner == run_id:
        return claim, Decision(TRAIN, claim)
    if owner == ended_owner:
        return mine, Decision(TRAIN, mine, took_over_from=owner)
    return claim, Decision(FOLLOW, claim)


def published(claim: dict[str, Any], run_id: str, now: str, model: dict[str, Any]) -> tuple[dict[str, Any], None]:
    """The claim once ``run_id`` published the model of its inputs (whoever held it: the model now exists)."""
    return {"state": PUBLISHED, "run_id": run_id, "since": now, "model": model}, None
