"""Compute Engine v1's API conventions, shared by every resource family of the emulator.

Google's behaviour: resource paths and ``selfLink``s under ``https://www.googleapis.com/compute/v1``, zonal, regional
or global (https://cloud.google.com/compute/docs/regions-zones/global-regional-zonal-resources), resource names (RFC
1035, at most 63 characters: https://cloud.google.com/compute/docs/naming-resources), RFC 3339 timestamps and uint64
ids as strings (every resource's v1 reference, https://cloud.google.com/compute/docs/reference/rest/v1), the JSON
error body (https://cloud.google.com/apis/design/errors), and the ``filter`` parameter and answers of ``list`` and
``aggregatedList`` (e.g. https://cloud.google.com/compute/docs/reference/rest/v1/instances/list and
.../instances/aggregatedList). Bodies are checked against Google's v1 discovery document
(``local/compute_schema.py``).
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from airflow_tpu_posttrain.local import compute_schema

API_ROOT = "https://www.googleapis.com/compute/v1"
# Compute's timestamps are "RFC3339 text" (the v1 reference); what the API and gcloud print carries the US-Pacific
# offset of the moment (-07:00 or -08:00), so text order is not time order across the autumn clock change.
_COMPUTE_TIMEZONE = ZoneInfo("America/Los_Angeles")


class ApiError(Exception):
    """An HTTP error answered with Google's JSON error body."""

    def __init__(
        self, status: int, reason: str, message: str, domain: str = "global", status_name: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "code": status,
                "message": message,
                "errors": [{"message": message, "domain": domain, "reason": reason}],
            }
        }
        if status_name:  # the newer APIs' canonical status (OS Login, IAP)
            self.body["error"]["status"] = status_name


def timestamp(epoch_seconds: float) -> str:
    """RFC 3339 in US-Pacific time, as Compute writes its timestamps (``2026-11-01T01:10:00.000-08:00``)."""
    return datetime.fromtimestamp(epoch_seconds, _COMPUTE_TIMEZONE).isoformat(timespec="milliseconds")


def numeric_id() -> str:
    """A uint64 resource id; proto3 JSON encodes 64-bit integers as strings."""
    return str(secrets.randbits(63))


def scope_of(zone: str | None, region: str | None = None) -> str:
    """Where a resource lives: ``zones/Z``, ``regions/R`` or ``global``."""
    return f"zones/{zone}" if zone else f"regions/{region}" if region else "global"


def resource_path(project: str, zone: str | None, collection: str, name: str, region: str | None = None) -> str:
    return f"projects/{project}/{scope_of(zone, region)}/{collection}/{name}"


def check_schema(schema_name: str, body: dict[str, Any]) -> None:
    """A 400 for what Google's Compute v1 schema does not allow (unknown fields, enum values, types)."""
    try:
        compute_schema.validate(schema_name, body)
    except compute_schema.SchemaError as error:
        raise ApiError(400, error.reason, error.message) from error


_NAME_REGEX = "(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)"


def check_name(name: str) -> None:
    """Compute's resource names: RFC 1035, at most 63 characters.

    Its 400 names the field and the regex, e.g. "Invalid value for field 'labels.job': 'nfs_server'. Must be a
    match of regex ..." (cloudfoundry/bosh-google-cpi-release#70)."""
    if not re.fullmatch(_NAME_REGEX, name):
        raise ApiError(
            400, "invalid", f"Invalid value for field 'resource.name': '{name}'. Must be a match of regex '{_NAME_REGEX}'"
        )


def check_insert(schema_name: str, body: dict[str, Any]) -> str:
    """The name of an insert's ``body``, checked as Compute checks every insert first: its schema, then its name."""
    check_schema(schema_name, body)
    name = body.get("name")
    if not name:
        raise ApiError(400, "required", "Required field 'resource.name' not specified")
    check_name(name)
    return name

def not_found(path: str) -> ApiError:
    return ApiError(404, "notFound", f"The resource '{path}' was not found")


def already_exists(path: str) -> ApiError:
    return ApiError(409, "alreadyExists", f"The resource '{path}' already exists")


def in_use_error(kind: str, path: str, user: str) -> ApiError:
    """Compute's refusal to delete what another resource still references.

    Its text, seen as "Error 400: The instance_template resource 'projects/P/global/instanceTemplates/T' is already
    being used by 'projects/P/zones/Z/instanceGroupManagers/M', resourceInUseByAnotherResource"
    (hashicorp/terraform-provider-google#1601); for a resource policy the same text is inferred."""
    return ApiError(
        400, "resourceInUseByAnotherResource", f"The {kind} resource '{path}' is already being used by '{user}'"
    )


_FILTER_TERM = re.compile(r'\s*\(?\s*(?P<field>[\w.-]+)\s*(?P<op>!=|=|:)\s*(?P<value>"[^"]*"|[^\s()]+)\s*\)?')
_FILTER_AND = re.compile(r"\s*(?:AND\s+)?")


def parse_filter(expression: str) -> list[tuple[str, str, str]]:
    """Parse ``field = value``, ``field != value`` and ``field:value`` terms joined by AND or spaces."""
    terms = []
    position = 0
    expression = expression.strip()
    while position < len(expression):
        match = _FILTER_TERM.match(expression, position)
        if not match:
            message = f"Invalid value for field 'filter': '{expression}'. Invalid list filter expression."
            raise ApiError(400, "invalid", message)
        terms.append((match["field"], match["op"], match["value"].strip('"')))
        position = _FILTER_AND.match(expression, match.end()).end()
    return terms


def matching(resources: dict[tuple, dict], scope: tuple, terms: list[tuple[str, str, str]]) -> list[dict]:
    """Copies of the resources keyed ``(*scope, name)`` that the filter's terms match."""
    return [copy.deepcopy(r) for key, r in resources.items() if key[:-1] == scope and matches(r, terms)]


def list_response(kind: str, path: str, items: list[dict]) -> tuple[int, dict]:
    """A ``list`` method's answer; the real API omits an empty ``items``."""
    listing = {"kind": kind, "id": path, "selfLink": f"{API_ROOT}/{path}"}
    return 200, {**listing, **({"items": items} if items else {})}


def aggregated_response(kind: str, key: str, project: str, found: list[tuple[str, dict]], query: dict) -> tuple[int, dict]:
    """An ``aggregatedList`` method's answer: the resources the filter matches.

    ``items`` is keyed by scope (``zones/Z``, ``regions/R``), each scope's resources under ``key``."""
    terms = parse_filter(query.get("filter", ""))
    scoped: dict[str, dict[str, Any]] = {}
    for scope, resource in found:
        if matches(resource, terms):
            scoped.setdefault(scope, {key: []})[key].append(copy.deepcopy(resource))
    return 200, {"kind": f"compute#{kind}AggregatedList", "id": f"projects/{project}/aggregated/{key}", "items": scoped}


def matches(resource: dict[str, Any], terms: list[tuple[str, str, str]]) -> bool:
    for field, op, expected in terms:
        actual: Any = resource
        for part in field.split("."):
            actual = actual.get(part) if isinstance(actual, dict) else None
        if actual is not None and not isinstance(actual, str):
            actual = json.dumps(actual)  # so that booleans compare as "true"/"false"
        if op == ":" and expected == "*":
            matched = actual is not None
        elif op == "!=":
            matched = actual != expected
        else:
            matched = actual == expected
        if not matched:
            return False
    return True
