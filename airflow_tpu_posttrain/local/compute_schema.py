"""Compute v1 request bodies checked against Google's own discovery document, as the real API checks them.

The schema is ``compute.v1.json`` as shipped inside ``google-api-python-client``; it is read once, on
first use, without importing the client. Refused, with Google's wording: unknown field names, enum
values the field does not list, and JSON values of the wrong type. Accepted, as by the real API:
"[Output Only]" fields (ignored there), ``null`` (the field's default) and, as Google's JSON-to-proto
converter does, one value where a list belongs (read as a one-element list).

Wordings, from Google's JSON-to-proto converter (protocolbuffers/protobuf,
src/google/protobuf/util/internal/proto_writer.cc: ``Lookup``, ``BeginNamed``, ``RenderPrimitiveField``)
and from real 400 answers:

* ``Invalid JSON payload received. Unknown name "const" at 'tools[0]...value': Cannot find field.``,
  reason "invalid": https://github.com/danny-avila/LibreChat/issues/11761,
  https://github.com/google-gemini/gemini-cli/issues/13972
* ``... Unknown name "type" at '...': Proto field is not repeating, cannot start list.``:
  https://github.com/zed-industries/zed/issues/53919, https://github.com/GodotNuts/GodotFirebase/issues/360
* ``Invalid value at '...properties[1].value' (description), Starting an object on a scalar field``:
  https://github.com/intrafind/ihub-apps/issues/885
* ``Invalid value at '...enum[0]' (TYPE_STRING), 0``: https://github.com/google-gemini/gemini-cli/issues/4415;
  likewise ``Invalid value at 'end_time_millis' (TYPE_INT64), "2021-08-16T11:07:23.313Z"`` (Fitness API)
* an enum, the type's URL in place of the kind: ``Invalid value at 'form_factor'
  (type.googleapis.com/google.chrome.uxreport.v1.FormFactor), "mobile"`` (Chrome UX Report API); so for
  Compute ``Invalid value at 'resource.scheduling.provisioning_model'
  (type.googleapis.com/compute.Scheduling.ProvisioningModel), "FOO"``.

The converter names locations with proto (snake_case) names; ``SchemaError.field`` keeps the JSON
(camelCase) path, as Compute's own checks do
("Invalid value for field 'resource.scheduling.provisioningModel'": skypilot-org/skypilot#3235).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

_ROOT = "resource"  # what Google's messages call the request body
_TYPE_URL = "type.googleapis.com/compute."
_INTEGER = {"int32": r"-?\d+", "uint32": r"\d+", "int64": r"-?\d+", "uint64": r"\d+"}
_KINDS = {"boolean": "BOOL", "integer": "INT32", "number": "DOUBLE", "string": "STRING"}


class SchemaError(Exception):
    """A 400 the real API would answer.

    ``field`` is the dotted path as Google names it (e.g. 'resource.scheduling.provisioningModel',
    'resource.networkInterfaces[0].accessConfigs[0].type'), ``reason`` the Google error reason ('invalid' /
    'required' ...), ``message`` Google's message text."""

    def __init__(self, field: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.field, self.reason, self.message = field, reason, message


@functools.cache
def _schemas() -> dict[str, dict]:
    """The discovery document's schemas, read once from the installed google-api-python-client."""
    spec = importlib.util.find_spec("googleapiclient")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "google-api-python-client is not installed; compute_schema reads its Compute v1 discovery "
            "document (googleapiclient/discovery_cache/documents/compute.v1.json): "
            "pip install google-api-python-client"
        )
    doc = Path(spec.submodule_search_locations[0], "discovery_cache", "documents", "compute.v1.json")
    return json.loads(doc.read_text(encoding="utf-8"))["schemas"]


def _resolve(schema: dict) -> tuple[dict, str | None]:
    """A field's schema with any ``$ref`` followed, and the referenced type's name."""
    ref = schema.get("$ref")
    return (_schemas()[ref], ref) if ref else (schema, None)


def _snake(path: str) -> str:
    """A JSON path in the proto names Google's converter reports (``networkIP`` -> ``network_i_p``)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z])", "_", path).lower()


def _leaf(path: str) -> tuple[str, str]:
    """``(parent path, field name)`` of ``path``, list indexes and map keys dropped from the name."""
    parent, _, name = re.sub(r"(\[[^]]*\])+$", "", path).rpartition(".")
    return parent, name


def _pascal(name: str) -> str:
    return name[:1].upper() + name[1:]


def _scalar_kind(schema: dict) -> str:
    """The proto kind the converter names in its message, e.g. TYPE_STRING, TYPE_INT64, TYPE_BOOL."""
    fmt = schema.get("format")
    return "TYPE_" + (fmt.upper() if fmt in {*_INTEGER, "float", "double"} else _KINDS[schema["type"]])


def _invalid(path: str, kind: str, value: Any) -> SchemaError:
    return SchemaError(path, "invalid", f"Invalid value at '{_snake(path)}' ({kind}), {json.dumps(value)}")


def _scalar_ok(schema: dict, value: Any) -> bool:
    """Whether a JSON scalar converts to the field's proto type, as Google's converter converts it."""
    kind, fmt = schema["type"], schema.get("format")
    if isinstance(value, bool) or kind == "boolean":
        return isinstance(value, bool) and kind == "boolean"
    if kind == "integer" or fmt in _INTEGER:
        if isinstance(value, str):
            return re.fullmatch(_INTEGER[fmt or "int64"], value) is not None
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return integral and (value >= 0 or not (fmt or "").startswith("u"))
    if kind == "number":
        try:
            float(value)
        except (TypeError, ValueError):
            return False
        return True
    return isinstance(value, str)


def _check(schema: dict, value: Any, path: str, owner: str) -> None:
    """Refuse ``value`` at ``path`` where the field's ``schema`` (declared in type ``owner``) refuses it."""
    if value is None or schema.get("type") == "any":
        return
    schema, ref = _resolve(schema)
    owner = ref or owner
    if schema.get("type") == "array":
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            _check(schema["items"], item, f"{path}[{i}]" if isinstance(value, list) else path, owner)
        return
    if isinstance(value, list):
        parent, name = _leaf(path)
        raise SchemaError(
            path,
            "invalid",
            f"Invalid JSON payload received. Unknown name \"{name}\" at '{_snake(parent)}': "
            "Proto field is not repeating, cannot start list.",
        )
    if schema.get("type") == "object":
        if not isinstance(value, dict):  # a nested type, or a map's entry type as protoc names it
            entry = "Entry" if "additionalProperties" in schema else ""
            nested = f"{owner}.{_pascal(_leaf(path)[1])}{entry}"
            raise _invalid(path, _TYPE_URL + (ref or nested), value)
        for key, item in value.items():
            if "additionalProperties" in schema:
                _check(schema["additionalProperties"], item, f'{path}["{key}"]', owner)
            elif key in schema.get("properties", {}):
                _check(schema["properties"][key], item, f"{path}.{key}", owner)
            else:
                raise SchemaError(
                    f"{path}.{key}",
                    "invalid",
                    f"Invalid JSON payload received. Unknown name \"{key}\" at '{_snake(path)}': "
                    "Cannot find field.",
                )
        return
    if isinstance(value, dict):
        parent, name = _leaf(path)
        raise SchemaError(
            path,
            "invalid",
            f"Invalid value at '{_snake(parent)}' ({_snake(name)}), Starting an object on a scalar field",
        )
    if "enum" in schema:
        if value not in schema["enum"]:
            raise _invalid(path, f"{_TYPE_URL}{owner}.{_pascal(_leaf(path)[1])}", value)
    elif not _scalar_ok(schema, value):
        raise _invalid(path, _scalar_kind(schema), value)


def validate(schema_name: str, body: dict) -> None:
    """Raise ``SchemaError`` where Compute would answer 400 to ``body`` as a ``schema_name`` resource."""
    _check({"$ref": schema_name}, body, _ROOT, schema_name)


def enum_values(schema_name: str, dotted_field: str) -> list[str]:
    """The values Compute accepts for an enum field, e.g. ``enum_values("Scheduling", "provisioningModel")``.

    ``dotted_field`` walks through nested types and lists (``"networkInterfaces.accessConfigs.type"``
    from "Instance"). ``KeyError`` for an unknown field, ``ValueError`` for a field that is no enum.
    """
    schema, _ = _resolve({"$ref": schema_name})
    for name in dotted_field.split("."):
        while schema.get("type") == "array":
            schema, _ = _resolve(schema["items"])
        schema, _ = _resolve(schema.get("properties", {})[name])
    if "enum" not in schema:
        raise ValueError(f"{schema_name}.{dotted_field} is not an enum field")
    return list(schema["enum"])
