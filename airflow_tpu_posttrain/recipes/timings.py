"""When to request the TPU VM of a run that converts: the measured timings, and the decision from them.

Pure: the record is plain JSON (kept by ``operators/just_in_time.py``), read and written here. Three things are
kept, each from the runs that measured it:

- ``conversions``: per model and the conversion VM's machine type, the seconds from a DAG run's start to the end
  of a conversion it ran (not reused). From the run's start, not the job's: what the TPU VM's request waits for
  is the whole path to the converted checkpoint (the CPU VM's create and restore, the conversion itself).
- ``ready``: per TPU machine type, the seconds from the TPU VM's request to the end of its MaxText install (the
  create, the boot, the environment's restore): how long before the conversion's end the request must go out.
- ``converted``: which (model, Hub revision, MaxText version) have a conversion in storage: a run of one of these
  reuses it, so its TPU VM is requested at once.
"""

from __future__ import annotations

from typing import Any

KEEP = 5  # measurements kept per key; the decision reads all of them
KEEP_CONVERTED = 50  # converted (model, revision, version) remembered, the newest last
# A run-start-to-conversion-end time beyond this is not a conversion's: the run's start_date is not when it started
# (a run given an old date by `dag.test`, a run cleared and run again days later). Such a measurement is dropped.
MAX_CONVERSION_S = 24 * 3600.0
DEFAULT_READY_S = 180.0  # until a TPU VM's ready time is measured: create 2 min + restore 1 min (docs/performance.md)


def conversion_key(model: str, machine_type: str) -> str:
    return f"{model}/{machine_type}"


def converted_key(model: str, revision: str, maxtext_version: str) -> str:
    return f"{model}@{revision}/maxtext-{maxtext_version}"


def _kept(values: list[float], value: float, keep: int = KEEP) -> list[float]:
    return [*values, round(value, 1)][-keep:]


def with_conversion(record: dict[str, Any], model: str, machine_type: str, seconds: float) -> dict[str, Any]:
    """``record`` with a conversion measured: ``seconds`` from its run's start to its end (unless implausible)."""
    if not 0 < seconds <= MAX_CONVERSION_S:
        return record
    conversions = dict(record.get("conversions") or {})
    key = conversion_key(model, machine_type)
    conversions[key] = _kept(list(conversions.get(key) or []), seconds)
    return {**record, "conversions": conversions}


def with_ready(record: dict[str, Any], machine_type: str, seconds: float) -> dict[str, Any]:
    """``record`` with a VM's ready time measured: ``seconds`` from its request to its install's end."""
    ready = dict(record.get("ready") or {})
    ready[machine_type] = _kept(list(ready.get(machine_type) or []), seconds)
    return {**record, "ready": ready}


def with_converted(record: dict[str, Any], model: str, revision: str, maxtext_version: str) -> dict[str, Any]:
    """``record`` knowing that this model's revision is converted for this MaxText version (in storage)."""
    key = converted_key(model, revision, maxtext_version)
    converted = [k for k in record.get("converted") or [] if k != key]
    return {**record, "converted": [*converted, key][-KEEP_CONVERTED:]}


def is_converted(record: dict[str, Any], model: str, revision: str | None, maxtext_version: str | None) -> bool:
    if not revision or not maxtext_version:
        return False
    return converted_key(model, revision, maxtext_version) in (record.get("converted") or [])


def expected_conversion_end(record: dict[str, Any], model: str, machine_type: str) -> float | None:
    """Seconds from a run's start to its conversion's end, as measured; None when never measured.

    The shortest of the kept measurements: a TPU VM requested early idles for seconds, one requested late holds
    the training back by as much."""
    measured = (record.get("conversions") or {}).get(conversion_key(model, machine_type)) or []
    return min(measured) if measured else None


def expected_ready(record: dict[str, Any], machine_type: str) -> float:
    """Seconds from a TPU VM's request to its install's end: the longest kept, or ``DEFAULT_READY_S``."""
    measured = (record.get("ready") or {}).get(machine_type) or []
    return max(measured) if measured else DEFAULT_READY_S


def request_delay(conversion_end_s: float | None, ready_s: float, elapsed_s: float) -> float:
    """Seconds from now until the TPU VM is to be requested; 0: at once.

    The request goes out ``ready_s`` before the conversion's expected end (``conversion_end_s`` after the run's
    start, ``elapsed_s`` ago). Nothing measured (None): at once, as a run whose conversion is cached; a guess
    would hold back a run whose conversion is quick, and this run's conversion is measured for the next."""
    if conversion_end_s is None:
        return 0.0
    return max(0.0, conversion_end_s - ready_s - elapsed_s)
