"""Validation of user-supplied values before anything reaches a cloud API or a shell.

Every check raises :class:`SpecError`, which names the field, shows the rejected value and says how to fix
it. Values that pass are still shell-quoted where they are used; these checks are the first line, quoting
the second.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")

# Characters that let a value escape a shell word or start a second command.
_SHELL_META = re.compile(r"[;&|`$<>(){}\\\"\n\r\t\x00*?!#~]")
# Pattern bodies shared with the trigger form's Params (pipelines/params.py anchors them for JSON schema).
SAFE_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9._-]*"
GCE_NAME_RE = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"
ZONE_RE = r"[a-z]+-[a-z]+[0-9]+-[a-z]"
# A MaxText config key; a nested one (``rl.num_generations``, ``lora.lora_rank``) as MaxText's command line takes it.
OVERRIDE_KEY_RE = r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*"
OVERRIDE_VALUE_RE = r"[A-Za-z0-9_.,:/+@=' \[\]-]*"
VERSION_RE = r"\d+\.\d+\.\d+"
COLUMN_LIST_RE = r"\['[A-Za-z0-9_]+'(, ?'[A-Za-z0-9_]+')*\]"

_SAFE_NAME = re.compile(f"^{SAFE_NAME_RE}$")
_SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
_FILE_GLOB_SEGMENT = re.compile(r"^[A-Za-z0-9._*-]+$")  # a path segment may be hidden ('.local'), never '.' or '..'
_GCE_NAME = re.compile(f"^{GCE_NAME_RE}$")
_ZONE = re.compile(f"^{ZONE_RE}$")
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")
_OVERRIDE_KEY = re.compile(f"^{OVERRIDE_KEY_RE}$")
_OVERRIDE_VALUE = re.compile(f"^{OVERRIDE_VALUE_RE}$")
_HUB_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_GCS_URI = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[A-Za-z0-9._=-]+)*/?$")


class SpecError(ValueError):
    """A user-supplied value is invalid; the message names the field and the fix."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        self.field = field
        super().__init__(f"{field}={value!r}: {problem}. Fix: {fix}")


def _no_shell_meta(field: str, value: str) -> None:
    bad = _SHELL_META.search(value)
    if bad:
        raise SpecError(
            field,
            value,
            f"contains the shell metacharacter {bad.group()!r}",
            "remove it; this value is never a command",
        )


def safe_name(field: str, value: str, max_len: int = 128) -> str:
    """A single path segment or identifier: letters, digits, '.', '_' and '-', not starting with '.'."""
    if not isinstance(value, str) or not value:
        raise SpecError(field, value, "must be a non-empty string", "give a name such as 'gemma3-4b'")
    _no_shell_meta(field, value)
    if ".." in value or "/" in value:
        raise SpecError(field, value, "is a path, not a name", "use a plain name without '/' or '..'")
    if len(value) > max_len or not _SAFE_NAME.fullmatch(value):
        raise SpecError(
            field,
            value,
            f"is not a plain name (max {max_len} chars)",
            "use letters, digits, '.', '_' and '-' only",
        )
    return value


def _path_segments(field: str, value: str) -> list[str]:
    segments = [s for s in value.split("/") if s]
    if not segments:
        raise SpecError(field, value, "has no path segments", "give a path such as '/dev/shm/run'")
    for segment in segments:
        if segment in (".", ".."):
            raise SpecError(field, value, "contains '.' or '..'", "give a normalised path without '..'")
        if len(segment) > 255 or not _SAFE_SEGMENT.fullmatch(segment):
            raise SpecError(
                field, value, f"has an invalid segment {segment!r}", "use letters, digits, '.', '_', '-'"
            )
    return segments


def safe_absolute_path(field: str, value: str) -> str:
    """An absolute POSIX path made of plain segments (no '..', no shell characters)."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise SpecError(field, value, "must be an absolute path", "start it with '/'")
    _no_shell_meta(field, value)
    return "/" + "/".join(_path_segments(field, value))


def safe_relative_path(field: str, value: str) -> str:
    """A relative path of plain segments, e.g. a Hub dataset id 'HuggingFaceH4/ultrachat_200k'."""
    if not isinstance(value, str) or not value:
        raise SpecError(
            field, value, "must be a non-empty string", "give a relative name such as 'owner/name'"
        )
    if value.startswith("/"):
        raise SpecError(field, value, "is an absolute path where a name is expected", "give a relative name")
    _no_shell_meta(field, value)
    return "/".join(_path_segments(field, value))


def file_glob(field: str, value: str) -> str:
    """Files in a repo, by a relative pattern such as 'main/train-*.parquet' (plain segments; '*' matches)."""
    if not isinstance(value, str) or not value or value.startswith("/"):
        raise SpecError(field, value, "is not a relative file pattern", "give one such as 'main/train-*.parquet'")
    for segment in value.split("/"):
        if segment in ("", ".", "..") or not _FILE_GLOB_SEGMENT.fullmatch(segment):
            raise SpecError(
                field, value, f"has an invalid segment {segment!r}", "use letters, digits, '.', '_', '-' and '*'"
            )
    return value


def hf_repo_id(field: str, value: str) -> str:
    """A Hugging Face repo id 'owner/name'."""
    name = safe_relative_path(field, value)
    if name.count("/") != 1 or len(name) > 96:
        raise SpecError(field, value, "is not a Hub repo id", "use 'owner/name' (at most 96 characters)")
    return name


def hub_revision(field: str, value: str) -> str:
    """A Hub commit: the 40 hexadecimal digits the Hub's API answers as a repo's ``sha``."""
    if not isinstance(value, str) or not _HUB_COMMIT.fullmatch(value):
        raise SpecError(field, value, "is not a Hub commit", "give the 40-hex-digit sha the Hub reports")
    return value


def storage_uri(field: str, value: str) -> str:
    """Where a model is kept: 'gs://bucket/prefix', 'file:///abs/dir' or an absolute local directory."""
    if isinstance(value, str) and value.startswith("gs://"):
        if not _GCS_URI.fullmatch(value) or ".." in value:
            raise SpecError(field, value, "is not a valid gs:// URI", "use gs://<bucket>/<prefix>")
        return value.rstrip("/")
    if isinstance(value, str) and value.startswith("file://"):
        return "file://" + safe_absolute_path(field, value[len("file://") :])
    return safe_absolute_path(field, value)


def capacity_claims(cap: int | None, claims: str | None) -> str | None:
    """``capacity_claims`` for a cap of ``cap`` VMs: a ``gs://`` location, required with a cap (None: no cap)."""
    if cap is None:
        return None
    positive_int("max_tpu_vms", cap)
    if not claims or not str(claims).startswith("gs://"):
        raise SpecError(
            "capacity_claims", claims, f"is needed with max_tpu_vms={cap}: the places under the cap are taken there",
            "give a gs://<bucket>/<prefix> every deployment sharing the cap can write (the pipelines use "
            "<checkpoint bucket>/tpu-capacity), or set max_tpu_vms to None",
        )
    return storage_uri("capacity_claims", claims)


def zone(field: str, value: str) -> str:
    if not isinstance(value, str) or not _ZONE.fullmatch(value):
        raise SpecError(field, value, "is not a Compute Engine zone", "use a zone such as 'us-east5-b'")
    return value


# A reservation as reservationAffinity names one: its name (in the VM's zone and project), a shared one's path,
# or a block of an AI Hypercomputer reservation (cloud.google.com/compute/docs/instances/reservations-consume).
PROJECT_ID_RE = r"[a-z][a-z0-9-]{4,61}[a-z0-9]"
RESERVATION_RE = (
    f"{GCE_NAME_RE}|projects/{PROJECT_ID_RE}/reservations/{GCE_NAME_RE}(/reservationBlocks/{GCE_NAME_RE})?"
)
# One reservation per zone: "ZONE=RESERVATION,ZONE=RESERVATION" (a reservation is zonal).
RESERVATIONS_RE = f"({RESERVATION_RE})|{ZONE_RE}=({RESERVATION_RE})(,{ZONE_RE}=({RESERVATION_RE}))*"


def gce_name(field: str, value: str) -> str:
    if not isinstance(value, str) or not _GCE_NAME.fullmatch(value):
        raise SpecError(
            field,
            value,
            "is not a valid Compute Engine name",
            "use 1-63 lowercase letters, digits and '-', starting with a letter and not ending with '-'",
        )
    return value


def labels(
    field: str, value: dict[str, str], max_count: int = 64, reserved: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Compute labels: at most ``max_count``, none of the ``reserved`` keys (the pipeline's own)."""
    if not isinstance(value, dict):
        raise SpecError(field, value, "must be a mapping", "give a dict of label key to value")
    if len(value) > max_count:
        raise SpecError(
            field,
            len(value),
            f"has more than {max_count} labels (Compute allows 64 per VM; the pipeline sets {64 - max_count})",
            f"give at most {max_count} labels",
        )
    for key, val in value.items():
        if key in reserved:
            raise SpecError(
                f"{field}.{key}", key, "is a label the pipeline sets itself", f"drop it; reserved: {sorted(reserved)}"
            )
        if not isinstance(key, str) or not _LABEL_KEY.fullmatch(key):
            raise SpecError(
                f"{field}.{key}",
                key,
                "is not a valid label key",
                "use lowercase letters, digits, '_' and '-'",
            )
        if not isinstance(val, str) or not _LABEL_VALUE.fullmatch(val):
            raise SpecError(
                f"{field}.{key}",
                val,
                "is not a valid label value",
                "use <=63 lowercase letters, digits, '_', '-'",
            )
    return dict(value)


def override_pairs(field: str, pairs: Sequence[str], reserved: frozenset[str] = frozenset()) -> list[str]:
    """Free-form MaxText overrides, each a validated 'key=value'; keys the pipeline owns are refused."""
    if not isinstance(pairs, (list, tuple)):
        raise SpecError(field, pairs, "must be a list of 'key=value' strings", "e.g. ['learning_rate=1e-5']")
    for i, pair in enumerate(pairs):
        where = f"{field}[{i}]"
        if not isinstance(pair, str) or "=" not in pair:
            raise SpecError(where, pair, "is not a 'key=value' pair", "write it as key=value")
        key, val = pair.split("=", 1)
        if not _OVERRIDE_KEY.fullmatch(key):
            raise SpecError(
                where, pair, f"has an invalid key {key!r}", "use a MaxText config key (lowercase, '_')"
            )
        if key in reserved:
            raise SpecError(
                where, pair, f"overrides {key!r}, which the pipeline sets", f"use the {key} parameter"
            )
        if key.split(".", 1)[0] == "lora":
            # A LoRA run saves only its adapter: the full-model export would publish the base model unchanged.
            raise SpecError(
                where, pair, "turns on LoRA, whose adapter the full-model export of this recipe leaves out",
                "leave lora.* unset: these recipes fine-tune the whole model",
            )
        _no_shell_meta(where, val)
        if not _OVERRIDE_VALUE.fullmatch(val) or ".." in val:
            raise SpecError(
                where,
                pair,
                "has characters a MaxText value does not need",
                "use letters, digits and . , : / + - [ ] '",
            )
    return list(pairs)


_VERSION = re.compile(VERSION_RE)
_COLUMN_LIST = re.compile(COLUMN_LIST_RE)


def positive_int(field: str, value: int) -> int:
    """A count such as steps or batches: an int >= 1 (bools are refused, though Python counts them as ints)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(field, value, "must be a whole number >= 1", "give a positive integer such as 100")
    return value


def one_of(field: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise SpecError(
            field, value, "is not a supported value", f"use one of: {', '.join(map(repr, choices))}"
        )
    return value


def package_version(field: str, value: str) -> str:
    """An exact release 'X.Y.Z', as pinned with '==' in an install command."""
    if not isinstance(value, str) or not _VERSION.fullmatch(value):
        raise SpecError(field, value, "is not an exact release version", "use X.Y.Z, e.g. '0.2.3'")
    return value


def safe_path(field: str, value: str) -> str:
    """A directory or file on the VM: absolute, or relative to the remote user's home.

    Unlike :func:`safe_absolute_path`, hidden segments such as ``.local`` are allowed (never '.' or '..').
    """
    if not isinstance(value, str) or not value:
        raise SpecError(field, value, "must be a non-empty path", "give a path such as 'maxtext_venv'")
    _no_shell_meta(field, value)
    segments = [s for s in value.split("/") if s]
    if not segments:
        raise SpecError(field, value, "has no path segments", "give a path such as 'maxtext_venv'")
    for segment in segments:
        safe_name(field, segment[1:] if segment.startswith(".") else segment, max_len=255)
    return ("/" if value.startswith("/") else "") + "/".join(segments)


def column_list(field: str, value: str) -> str:
    """A MaxText list of dataset column names, written as a Python list literal: "['messages']"."""
    if not isinstance(value, str) or not _COLUMN_LIST.fullmatch(value):
        raise SpecError(field, value, "is not a list of column names", "write it as \"['messages']\"")
    return value


def blank_to_none(value: T) -> T | None:
    """None for a value left empty in the trigger form or REST conf.

    None, "" and "None" (a None rendered into a string template) all mean "absent" (the model's default);
    anything else is returned as is, to be validated."""
    if value is None or value in ("", "None"):
        return None
    return value


def optional_count(field: str, value: object) -> int | None:
    """An optional count such as steps: None when left empty, else a whole number >= 1.

    Digits in a rendered string template are accepted."""
    value = blank_to_none(value)
    if value is None:
        return None
    if isinstance(value, str):
        if not value.isdecimal():
            raise SpecError(
                field,
                value,
                "is not a whole number",
                "give a positive integer such as 100, or leave it empty",
            )
        value = int(value)
    return positive_int(field, value)


def flag(field: str, value: bool | str) -> bool:
    """A yes/no setting, given as a bool or as the text a template rendered (``True``/``False``)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise SpecError(field, value, "is not true or false", "give true or false")


def unknown_keys(keys: Iterable[object], known: Iterable[str], what: str, listed: str, prefix: str = "") -> list[str]:
    """``<prefix><key>: not a <what>; did you mean ...?`` (else the ``listed`` known names) per unknown key."""
    known = list(known)
    problems = []
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            fix = f"did you mean {close[0]!r}?" if close else f"the {listed} are: {', '.join(known)}"
            problems.append(f"{prefix}{key}: not a {what}; {fix}")
    return problems
