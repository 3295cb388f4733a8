"""A trigger's event never comes sooner than the settle time after its deferral (triggers/settle.py)."""

from __future__ import annotations

import asyncio
import time

from airflow_tpu_posttrain.triggers import settle


async def _collect(events, started: float) -> list[tuple[str, float]]:
    return [(event, time.monotonic()) async for event in settle.not_before_settled(events, started)]


async def _two_events():
    yield "first"
    yield "second"


def test_an_event_ready_at_once_waits_out_the_settle_time_and_a_later_one_does_not_wait(monkeypatch):
    monkeypatch.setattr(settle, "MIN_DEFERRAL_SECONDS", 1.0)  # conftest sets 0 for the in-process tests
    started = time.monotonic()
    (first, first_at), (second, second_at) = asyncio.run(_collect(_two_events(), started))
    assert (first, second) == ("first", "second")
    assert first_at - started >= 1.0  # asyncio.sleep never returns early
    assert second_at - first_at < 1.0  # the settle time is counted from the deferral, once: no second wait


def test_an_event_after_the_settle_time_is_not_delayed(monkeypatch):
    monkeypatch.setattr(settle, "MIN_DEFERRAL_SECONDS", 5.0)
    now = time.monotonic()
    [(event, at)] = asyncio.run(_collect(_one_event(), now - 10))  # deferred 10 s ago
    assert event == "only" and at - now < 5.0


async def _one_event():
    yield "only"
