"""One training per distinct input: the claim a run takes on its inputs before it trains them.

A claim is a JSON object in checkpoint storage, one per (deployment, DAG, inputs), at :func:`claim_uri`. It is
changed only by compare-and-swap (``hooks/stored_records.py``), so two runs that check the same inputs at once
never both train them: one takes the claim, the other follows it. What a claim holds::

    {"state": "training", "run_id": ..., "since": ...}                  a run trains these inputs
    {"state": "published", "run_id": ..., "since": ..., "model": ...}   it published their model (the export's
                                                                        hub and storage copy)
    {"state": "refused", "run_id": ..., "since": ..., "reason": ...}    its model was refused: by the quality
                                                                        gate, or by a person (rejected, or no
                                                                        answer in time)

A run whose inputs were published reuses that model; whose inputs were refused trains nothing and asks no one
(``force`` trains them again); whose inputs a run still going trains waits (deferred) for that run's outcome. A
claim whose run is provably over without a model (ended, or no longer in Airflow) is taken over: the follower
trains. Of runs that ask at once (a backfill's), whichever asks first trains, and the others reuse its model.
Pure functions: the caller reads the runs' states and does the I/O.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

TRAINING, PUBLISHED, REFUSED = "training", "published", "refused"
TRAIN, FOLLOW, REUSE, REFUSE = "train", "follow", "reuse", "refuse"
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
    """What the run does with its inputs: ``train``, ``follow`` the owner, ``reuse`` or ``refuse`` its model."""

    action: str
    claim: dict[str, Any]  # the claim as it is after the decision
    took_over_from: str | None = None


def decide(
    claim: dict[str, Any], run_id: str, now: str, *, force: bool, ended_owner: str | None
) -> tuple[dict[str, Any], Decision]:
    """The claim after ``run_id`` asked for it (to write back only if it is unchanged), and the run's decision.

    ``ended_owner``: a run the caller found provably over (ended, or gone); a claim it still holds for training
    is taken over. ``force``: train whatever the claim says, leaving it as it is."""
    mine = {"state": TRAINING, "run_id": run_id, "since": now}
    owner = claim.get("run_id")
    if not claim:
        return mine, Decision(TRAIN, mine)
    if force:
        return claim, Decision(TRAIN, claim)
    if claim.get("state") == PUBLISHED:
        return claim, Decision(REUSE, claim)
    if claim.get("state") == REFUSED:
        return claim, Decision(REFUSE, claim)
    if owner == run_id:
        return claim, Decision(TRAIN, claim)
    if owner == ended_owner:
        return mine, Decision(TRAIN, mine, took_over_from=owner)
    return claim, Decision(FOLLOW, claim)


def published(claim: dict[str, Any], run_id: str, now: str, model: dict[str, Any]) -> tuple[dict[str, Any], None]:
    """The claim once ``run_id`` published the model of its inputs (whoever held it: the model now exists)."""
    return {"state": PUBLISHED, "run_id": run_id, "since": now, "model": model}, None


def refused(claim: dict[str, Any], run_id: str, now: str, reason: str) -> tuple[dict[str, Any], bool]:
    """The claim once ``run_id``'s model of these inputs was refused for ``reason``, and whether it changed.

    A published claim stays published: a model of these inputs exists (a forced run's refusal does not undo it)."""
    if claim.get("state") == PUBLISHED:
        return claim, False
    return {"state": REFUSED, "run_id": run_id, "since": now, "reason": reason}, True
