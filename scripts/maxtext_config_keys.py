#!/usr/bin/env python3
"""Write airflow_tpu_posttrain/recipes/maxtext_config_keys.json: the keys each pinned MaxText release accepts.

For every release a registry entry pins, its local venv (scripts/bootstrap.sh builds them: `.local/maxtext-venv`
for the tiny model's release, `.local/maxtext-venv-<release>` for the others) is asked for the fields of the
config class each recipe's trainer validates its command line against: ``types.MaxTextConfig`` for SFT, and
``types.RLConfig`` for RL where the release has one (0.2.5's train_rl), each nested model's fields as
``parent.child``. Run it again when a pin changes:

    .venv/bin/python scripts/maxtext_config_keys.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_tpu_posttrain.recipes import maxtext_config  # noqa: E402
from airflow_tpu_posttrain.recipes.models import MODELS, model_profile  # noqa: E402

# Run with the release's own Python: its config classes, as its trainers validate against them.
EXTRACT = """
import json
from pydantic import BaseModel
from maxtext.configs import types

def keys(model, prefix=""):
    for name, field in model.model_fields.items():
        for key in {name, field.alias or name}:
            yield prefix + key
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from keys(field.annotation, prefix + key + ".")

classes = {"sft": types.MaxTextConfig, "rl": getattr(types, "RLConfig", types.MaxTextConfig)}
print(json.dumps({recipe: sorted(set(keys(cls))) for recipe, cls in classes.items()}))
"""


def release_venv(release: str) -> Path:
    tiny_release = model_profile("tiny-llama").maxtext_version
    return REPO / ".local" / ("maxtext-venv" if release == tiny_release else f"maxtext-venv-{release}")


def main() -> None:
    releases = sorted({profile.maxtext_version for profile in MODELS.values()})
    written = {}
    for release in releases:
        python = release_venv(release) / "bin" / "python"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
        said = subprocess.run([str(python), "-c", EXTRACT], capture_output=True, text=True, check=True, env=env)
        written[release] = json.loads(said.stdout.strip().splitlines()[-1])
        print(f"MaxText {release}: " + ", ".join(f"{r} {len(k)} keys" for r, k in written[release].items()))
    maxtext_config.KEYS_FILE.write_text(json.dumps(written, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
