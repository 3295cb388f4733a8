"""The configuration keys each pinned MaxText release's trainers accept: overrides are checked before any VM.

MaxText's config classes refuse a key they do not define (pydantic ``extra="forbid"``, "MAXTEXT CONFIG ERROR"),
but only once the trainer starts on the TPU VM, after its create, its install and the conversion: a typo in an
override cost a v6e-8's first half hour. ``maxtext_config_keys.json`` holds, per release a registry entry pins,
the keys of the config class each recipe's trainer validates against (SFT: ``types.MaxTextConfig``; RL:
``types.RLConfig`` where the release has one), written by ``scripts/maxtext_config_keys.py`` from the release's
own package. A release it does not hold (a run's ``maxtext_version`` of its own) is not checked here.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Sequence
from pathlib import Path

from airflow_tpu_posttrain.recipes.validation import SpecError

KEYS_FILE = Path(__file__).with_name("maxtext_config_keys.json")


@functools.cache
def _keys() -> dict[str, dict[str, frozenset[str]]]:
    written = json.loads(KEYS_FILE.read_text())
    return {release: {recipe: frozenset(keys) for recipe, keys in recipes.items()} for release, recipes in written.items()}


def known_keys(release: str, recipe: str) -> frozenset[str] | None:
    """The keys ``recipe``'s trainer accepts at MaxText ``release``; None when this package holds no list for it."""
    return _keys().get(release, {}).get(recipe)


def check_override_keys(field: str, overrides: Sequence[str] | None, release: str, recipe: str) -> bool:
    """Refuse an override whose key the release's trainer does not define, naming the closest keys it does.

    True when the keys were checked, False when the release has no list here (nothing was refused)."""
    known = known_keys(release, recipe)
    if known is None:
        return False
    for index, pair in enumerate(overrides or ()):
        key = str(pair).split("=", 1)[0]
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            raise SpecError(
                f"{field}[{index}]",
                pair,
                f"sets {key!r}, which MaxText {release}'s {recipe.upper()} trainer does not define",
                f"use one of its config keys{' (closest: ' + ', '.join(close) + ')' if close else ''}",
            )
    return True
