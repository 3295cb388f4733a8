"""docs/registry.md, the reference of ``models.yaml``, rendered from the code that reads it.

Each key's type comes from pydantic's schema of :class:`~airflow_tpu_posttrain.pipelines.registry.PipelineConfig`
(what the loader validates with), its default from the dataclass, its description from the field's metadata or,
for a key that is a trigger form default, from that Param. ``python -m
airflow_tpu_posttrain.pipelines.registry_reference`` writes the page; ``tests/test_dags.py`` fails when it is stale.
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from airflow_tpu_posttrain.pipelines import registry
from airflow_tpu_posttrain.recipes import models

DOCUMENT = Path("docs") / "registry.md"
# A key of the registry that is the trigger form default of a Param of another name.
_PARAM_OF_KEY = {"max_wait_for_capacity_minutes": "max_wait_for_capacity"}
_TOP_LEVEL = {
    "defaults": "Keys laid under every entry of `pipelines` (an entry's own keys win).",
    "prices": "USD per hour, `{MACHINE_TYPE: {PROVISIONING_MODEL: USD}}`, laid over the built-in price table "
    "(`recipes/cost.py`); what the teardown and the reaper say each VM cost.",
    "models": "Models the package does not know, or fields laid over a built-in one's: `{KEY: {field: value}}` "
    "(below).",
    "pipelines": "One entry per DAG: `model`, `recipe` and any key below; its DAG is `posttrain_<recipe>__<model>` "
    "(`__seeds` for the seeds layout).",
}

# ``local`` is read by the loader itself (not a PipelineConfig key).
_LOCAL_ENTRY_ROW = (
    "| `local` | boolean | `false` | A local entry (the local CPU run): its DAG is built only when "
    "`TPU_POSTTRAIN_LOCAL_DIR` is set, with the local stack's settings (`pipelines/registry.py` "
    "`_local_entry_settings`). |"
)


def _type(schema: dict[str, Any], definitions: dict[str, Any]) -> str:
    if "$ref" in schema:
        return _type(definitions[schema["$ref"].rsplit("/", 1)[-1]], definitions)
    if "anyOf" in schema:
        return " or ".join(_type(option, definitions) for option in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        items = schema.get("items") or (schema.get("prefixItems") or [{}])[0]
        return f"list of {_type(items, definitions)}"
    return kind


def _yaml(value: object) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value).replace('"', "") + "`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _param_descriptions() -> dict[str, str]:
    """The trigger form's Param descriptions, of both recipes' forms (a tutorial entry's)."""
    from airflow_tpu_posttrain.pipelines.params import trigger_form

    described: dict[str, str] = {}
    for model, recipe in (("gemma3-4b", "sft"), ("llama3.1-8b-Instruct", "rl")):
        config = registry.PipelineConfig(model=model, recipe=recipe, checkpoint_storage="gs://bucket/prefix")
        for name, param in trigger_form(config).items():
            described.setdefault(name, f"The trigger form's default of **{param.schema.get('title', name)}**: "
                                 f"{param.description}")
    return described


def _entry_rows() -> list[str]:
    schema = registry._pipeline_adapter().json_schema()
    properties, definitions = schema["properties"], schema.get("$defs", {})
    described = _param_descriptions()
    rows = ["| key | type | default | what |", "|---|---|---|---|"]
    for f in fields(registry.PipelineConfig):
        if f.name in registry._LOADER_KEYS:
            continue
        text = f.metadata.get("doc") or described.get(_PARAM_OF_KEY.get(f.name, f.name))
        if not text:
            raise ValueError(f"registry key {f.name} has no description: give its field metadata=_doc(...)")
        choices = f.metadata.get("choices") or ()
        if choices:
            text += " One of: " + ", ".join(f"`{choice}`" for choice in choices) + "."
        default = "required" if f.default is MISSING and f.default_factory is MISSING else _yaml(f.default)
        rows.append(f"| `{f.name}` | {_type(properties[f.name], definitions)} | {default} | {_cell(text)} |")
    return [*rows, _LOCAL_ENTRY_ROW]


def _model_rows() -> list[str]:
    rows = ["| field | what |", "|---|---|"]
    for f in fields(models.ModelProfile):
        if f.name in models.MODEL_FIELDS:
            rows.append(f"| `{f.name}` | {_cell(f.metadata['doc'])} |")
    missing = set(models.MODEL_FIELDS) - {f.name for f in fields(models.ModelProfile)}
    if missing:
        raise ValueError(f"models: fields that are not ModelProfile's: {sorted(missing)}")
    return rows


def render() -> str:
    lines = [
        "# The registry: `models.yaml`",
        "",
        "<!-- Written by `python -m airflow_tpu_posttrain.pipelines.registry_reference` from the code that reads",
        "     the registry; tests/test_dags.py fails when it is stale. Do not edit by hand. -->",
        "",
        "`load_registry` reads it when the DAG file is parsed and refuses a malformed one with every problem, its",
        "place and its fix, before any DAG is built ([the DAGs](dags.md)).",
        "",
        "## Top level",
        "",
        "| key | what |",
        "|---|---|",
        *(f"| `{key}` | {_cell(text)} |" for key, text in _TOP_LEVEL.items()),
        "",
        "## Keys of `defaults` and of each `pipelines` entry",
        "",
        *_entry_rows(),
        "",
        "## Fields of a `models:` entry",
        "",
        "A model the package does not know needs `hf_source`, `maxtext_model_name` and `maxtext_version`; a built-in",
        "one's (`gemma3-4b`, `llama3.1-8b-Instruct`, their twins, `tiny-llama`) are laid over its own. `sft_dataset`",
        f"takes {', '.join(f'`{name}`' for name in models.SFT_DATASET_FIELDS)}.",
        "",
        *_model_rows(),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    """Write the page; run from the repository's root."""
    DOCUMENT.write_text(render())
    print(f"wrote {DOCUMENT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
