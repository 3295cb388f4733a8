"""The test suite's time: a section of docs/performance.md that the full run of ``./scripts/test`` writes.

The suite's time is measured by the suite itself (tests/conftest.py), the rest of the page by bench/perf.py;
each writer keeps the other's part.
"""

from __future__ import annotations

from pathlib import Path

HEADING = "## The test suite"
BUDGET_S = 35 * 60  # the full suite on 2 cores, set-up included (README's test command from a clean clone)
SLOWEST_SHOWN = 15


def suite_section(
    *,
    date: str,
    cpus: int,
    passed: int,
    setup_s: float,
    pytest_s: float,
    slowest: list[tuple[float, str]],
    idle_at_end: dict[str, float],
) -> str:
    """The section: the run's times against the budget, its workers' idle time at the end, its slowest tests."""
    total_s = setup_s + pytest_s
    verdict = "within" if total_s <= BUDGET_S else "OVER"
    idle = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in idle_at_end.items()) or "one process"
    rows = "\n".join(f"{seconds:7.1f} s  {nodeid}" for seconds, nodeid in slowest[:SLOWEST_SHOWN])
    return (
        f"{HEADING}\n\n"
        f"Written by the full run of `./scripts/test` (tests/conftest.py); do not edit by hand. Measured on {date}, "
        f"{cpus} CPUs: {passed} tests passed in {pytest_s / 60:.1f} min of pytest after {setup_s:.0f} s of set-up "
        f"(bootstrap, lint): {total_s / 60:.1f} min in all, {verdict} the budget of {BUDGET_S // 60} min. Idle at "
        f"the end (a worker done, waiting for the other): {idle}. The slowest tests (set-up, call and "
        f"teardown):\n\n```text\n{rows}\n```\n"
    )


def section_of(page: str) -> str | None:
    """The test-suite section of ``page``, if it has one (it runs to the page's end)."""
    _, found, tail = page.partition(HEADING)
    return found + tail if found else None


def with_suite_section(page: str, section: str | None) -> str:
    """``page`` with its test-suite section (if any) replaced by ``section`` (None: none)."""
    head = page.partition(HEADING)[0].rstrip("\n")
    return head + ("\n\n" + section if section else "\n")


def write_suite_section(path: Path, section: str) -> None:
    page = path.read_text() if path.exists() else "# Performance\n"
    path.write_text(with_suite_section(page, section))
