"""Places under the TPU cap: the line's rules (pure), and a place taken by exactly one of many creates at once.

The race runs against the local GCS server (fake-gcs-server), which answers ``ifGenerationMatch`` with 412 as Cloud
Storage does (https://cloud.google.com/storage/docs/request-preconditions)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from airflow_tpu_posttrain.recipes import capacity, places

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def request(claim: str, started: str = "2026-12-06T11:00:00+00:00", logical_date: str = "", **more) -> places.Request:
    return places.Request(
        claim=claim, run=f"dag/{claim}", deployment=more.get("deployment", "prod"), started=started,
        logical_date=logical_date or started, expires_at=more.get("expires_at", int(NOW.timestamp()) + 3600),
        size=more.get("size", 1),
    )


def at(seconds: float) -> str:
    return (NOW + timedelta(seconds=seconds)).isoformat()


def test_one_place_goes_to_the_first_and_the_next_waits_in_line():
    line, first = places.ask({}, request("tpu-a"), 1, at(0))
    assert first.granted
    line, second = places.ask(line, request("tpu-b"), 1, at(1))
    assert (second.granted, second.position) == (False, 1)
    assert second.describe(1) == "1 of 1 TPU chips in use by dag/tpu-a (tpu-a, 1 chips)"
    line, again = places.ask(line, request("tpu-a"), 1, at(2))  # a retried create keeps its place
    assert again.granted
    line, held = places.release(line, "tpu-a")
    assert held
    line, served = places.ask(line, request("tpu-b"), 1, at(3))
    assert served.granted and list(line["holders"]) == ["tpu-b"] and line["waiting"] == {}


def test_the_line_is_served_in_the_order_runs_started_then_by_logical_date():
    """A backfill's runs start together: the oldest date first, whichever asked first."""
    line, _ = places.ask({}, request("tpu-holder"), 1, at(0))
    backfill = {"tpu-d3": "2026-01-03T00:00:00+00:00", "tpu-d1": "2026-01-01T00:00:00+00:00",
                "tpu-d2": "2026-01-02T00:00:00+00:00"}
    for i, (claim, date) in enumerate(backfill.items()):  # asked in the order d3, d1, d2
        line, answer = places.ask(line, request(claim, "2026-12-06T11:00:00.5+00:00", date), 1, at(i))
        assert not answer.granted
    # A run that started later waits behind them all, though its logical date is older.
    line, late = places.ask(line, request("tpu-late", "2026-12-06T11:00:02+00:00", "2025-01-01T00:00:00+00:00"), 1, at(4))
    assert late.position == 4 and late.ahead == [f"dag/{d} ({d}, 1 chips)" for d in ("tpu-d1", "tpu-d2", "tpu-d3")]
    line, _ = places.release(line, "tpu-holder")
    served = []
    for _ in backfill:
        for claim in ("tpu-late", "tpu-d3", "tpu-d2", "tpu-d1"):  # everyone asks; only the first in line gets it
            line, answer = places.ask(line, request(claim, "2026-12-06T11:00:00.5+00:00", backfill.get(claim, "")), 1, at(5))
            if answer.granted and claim not in served:
                served.append(claim)
                line, _ = places.release(line, claim)
                break
    assert served == ["tpu-d1", "tpu-d2", "tpu-d3"]


def test_runs_started_across_the_autumn_clock_change_are_served_in_the_order_they_started(fault_matrix):
    """2026-11-01, US-Pacific: 01:50 PDT (08:50 UTC) comes before 01:10 PST (09:10 UTC), whatever the text says."""
    line, _ = places.ask({}, request("tpu-holder"), 1, at(0))
    line, _ = places.ask(line, request("tpu-later", "2026-11-01T01:10:00-08:00"), 1, at(1))
    line, earlier = places.ask(line, request("tpu-earlier", "2026-11-01T01:50:00-07:00"), 1, at(2))
    assert earlier.position == 1
    fault_matrix.record(
        "capacity: two runs started across the autumn clock change (-07:00 then -08:00) -> served in the order they started",
        None, "n/a", None, "01:50-07:00 is first in line, 01:10-08:00 second",
    )


def test_a_vm_holding_no_place_counts_its_chips_and_a_slice_counts_all_its_vms():
    def vm(name, group=None, status="RUNNING", machine_type="ct6e-standard-4t"):
        items = [{"key": "created-by", "value": f"projects/p/zones/z/instanceGroupManagers/{group}"}] if group else []
        return {"name": name, "status": status, "metadata": {"items": items}, "machineType": f"zones/z/machineTypes/{machine_type}"}

    live = capacity.live_places(
        [vm(f"tpu-s-00{i}", "tpu-s") for i in range(4)]
        + [vm("tpu-old", machine_type="ct6e-standard-8t"), vm("tpu-gone", status="TERMINATED")]
    )
    assert live == {"tpu-old": 8, "tpu-s": 16}  # a slice of 4 VMs of 4 chips holds 16, never one
    line, answer = places.ask({}, request("tpu-new", size=8), 31, at(0), unclaimed=live)
    assert not answer.granted and "a VM that holds no place (tpu-old, 8 chips)" in answer.describe(31)
    line, answer = places.ask({}, request("tpu-new", size=8), 32, at(0), unclaimed=live)
    assert answer.granted


def test_a_waiting_create_that_stopped_asking_is_dropped_from_the_line():
    line, _ = places.ask({}, request("tpu-a"), 1, at(0))
    line, _ = places.ask(line, request("tpu-gone", "2026-12-06T11:00:01+00:00"), 1, at(0))
    line, waiting = places.ask(line, request("tpu-b", "2026-12-06T11:00:02+00:00"), 1, at(places.WAITING_STALE_S - 1))
    assert waiting.position == 2  # the other still counts
    line, waiting = places.ask(line, request("tpu-b", "2026-12-06T11:00:02+00:00"), 1, at(places.WAITING_STALE_S + 1))
    assert waiting.position == 1 and "tpu-gone" not in line["waiting"]


def test_a_waiting_create_writes_the_line_once_per_refresh_not_per_poll():
    line, _ = places.ask({}, request("tpu-a"), 1, at(0))
    line, _ = places.ask(line, request("tpu-b"), 1, at(1))
    unchanged, _ = places.ask(line, request("tpu-b"), 1, at(places.REFRESH_S / 2))
    assert unchanged == line
    refreshed, _ = places.ask(line, request("tpu-b"), 1, at(places.REFRESH_S + 2))
    assert refreshed["waiting"]["tpu-b"]["seen"] == at(places.REFRESH_S + 2)


def test_keys_name_the_line_a_vm_competes_in():
    assert places.line_key("p", "us-east5-b", None, "ct6e-standard-8t") == "p/us-east5-b-ct6e"
    assert places.line_key("p", "z", "r", "x") == "p/reservation-r"
    assert capacity.group_label("p/z-e2", "tpu") != capacity.group_label("p/z-e2", "cpu")  # a CPU VM never counts


@pytest.mark.parametrize(
    ("state", "exists", "expected"),
    [
        ("failed", False, "its DAG run is failed"),
        ("running", False, None),  # its create may be about to insert
        ("failed", True, None),  # the VM's own reaping gives the place back
        ("failed", None, None),  # Compute could not be read
        (None, False, None),  # the run's state could not be read
    ],
)
def test_the_reaper_gives_back_a_place_on_evidence_only(state, exists, expected):
    line, _ = places.ask({}, request("tpu-a"), 1, (NOW - timedelta(hours=1)).isoformat())
    reasons = places.stale_holders(line, {"tpu-a": exists}, {"dag/tpu-a": state}, NOW, 900, "prod")
    assert reasons.get("tpu-a") == expected


def test_another_deployments_place_goes_only_when_it_expired():
    line, _ = places.ask({}, request("tpu-a", deployment="staging", expires_at=int(NOW.timestamp()) - 3600), 1, at(-7200))
    assert "expired" in places.stale_holders(line, {"tpu-a": False}, {}, NOW, 900, "prod")["tpu-a"]
    line, _ = places.ask({}, request("tpu-a", deployment="staging"), 1, at(-7200))
    assert places.stale_holders(line, {"tpu-a": False}, {"dag/tpu-a": "failed"}, NOW, 900, "prod") == {}


def test_of_many_creates_asking_at_once_exactly_the_cap_take_places(emulator, capacity_claims, fault_matrix):
    """Eight creates ask for 2 places of one line at the same moment, each in its own thread and client.

    Through the Google connection the triggerer's creates use (the emulator's key: its token is the emulator's)."""
    from airflow_tpu_posttrain.hooks.stored_records import StoredRecordHook

    uri = places.line_uri(capacity_claims, places.line_key("p", "us-east5-b", None, "ct6e-standard-8t"))
    start, granted, errors = threading.Barrier(8), [], []

    def ask(claim: str) -> None:
        try:
            hook = StoredRecordHook()
            start.wait()
            answer = hook.change(uri, lambda line: places.ask(line, request(claim), 2, datetime.now(UTC).isoformat()))
            if answer.granted:
                granted.append(claim)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=ask, args=(f"tpu-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    line = StoredRecordHook().read(uri)
    assert len(granted) == 2 and sorted(line["holders"]) == sorted(granted)
    assert len(line["waiting"]) == 6
    fault_matrix.record(
        "capacity: 8 creates ask for 2 places at once (GCS generation preconditions) -> exactly 2 take one",
        None, "n/a", None, f"granted {sorted(granted)}; 6 wait in line",
    )


def test_a_line_is_the_zones_own_reservation_however_the_run_writes_it():
    """``res1`` alone and ``us-east5-b=res1,us-east5-a=res2`` are one pool in us-east5-b: one line, not two."""
    alone = places.line_key("p", "us-east5-b", "res1", "ct6e-standard-8t")
    assert places.line_key("p", "us-east5-b", "us-east5-b=res1,us-east5-a=res2", "ct6e-standard-8t") == alone
    assert places.line_key("p", "us-east5-b", "projects/p/reservations/res1/reservationBlocks/b1", "x") == alone
    assert places.line_key("p", "us-east5-a", "us-east5-b=res1,us-east5-a=res2", "x") == "p/reservation-res2"
    # A shared reservation is its owner's pool, whichever project consumes it.
    shared = "projects/host/reservations/r"
    assert places.line_key("p1", "z", shared, "x") == places.line_key("p2", "z", shared, "x") == "host/reservation-r"


def test_the_line_keeps_its_cap_and_refuses_a_run_that_brings_another():
    line, first = places.ask({}, request("tpu-a", size=8), 8, at(0))
    assert first.granted and line["cap"] == 8
    line, waiting = places.ask(line, request("tpu-b", size=8), 8, at(1))
    unchanged, other = places.ask(line, request("tpu-c", size=8), 16, at(2))
    assert not other.granted and unchanged == line  # refused, and not in line
    assert "the line keeps a cap of 8 TPU chips" in other.refused and "this run brings 16" in other.refused
    for claim in ("tpu-a", "tpu-b"):
        line, _ = places.release(line, claim)
    line, later = places.ask(line, request("tpu-c", size=8), 16, at(3))  # an empty line takes the next cap
    assert later.granted and line["cap"] == 16


def test_a_large_request_is_neither_overtaken_nor_starved_and_one_over_the_cap_is_refused():
    """Strict first come, first served by chips: a v6e-8 behind a waiting 16-chip slice waits, though 8 are free."""
    line, _ = places.ask({}, request("tpu-vm", size=8), 16, at(0))
    line, big = places.ask(line, request("tpu-slice", "2026-12-06T11:00:01+00:00", size=16), 16, at(1))
    line, small = places.ask(line, request("tpu-small", "2026-12-06T11:00:02+00:00", size=8), 16, at(2))
    assert (big.granted, small.granted, small.position) == (False, False, 2)
    assert big.describe(16) == "8 of 16 TPU chips in use by dag/tpu-vm (tpu-vm, 8 chips)"
    line, _ = places.release(line, "tpu-vm")
    line, small = places.ask(line, request("tpu-small", "2026-12-06T11:00:02+00:00", size=8), 16, at(3))
    line, big = places.ask(line, request("tpu-slice", "2026-12-06T11:00:01+00:00", size=16), 16, at(4))
    assert (small.granted, big.granted) == (False, True)
    _, over = places.ask({}, request("tpu-huge", size=32), 16, at(5))
    assert not over.granted and "needs 32 TPU chips, more than the cap of 16" in over.refused


def test_a_cancelled_wait_leaves_the_line_but_a_place_held_stays():
    line, _ = places.ask({}, request("tpu-a"), 1, at(0))
    line, _ = places.ask(line, request("tpu-b"), 1, at(1))
    left, waited = places.leave_waiting(line, "tpu-b")
    assert waited and left["waiting"] == {} and list(left["holders"]) == ["tpu-a"]
    kept, waited = places.leave_waiting(line, "tpu-a")
    assert not waited and kept == line


def test_the_cap_counts_chips_and_max_tpu_vms_counts_vms_of_the_create_size():
    assert places.cap_of(16, None, "gs://bkt/places", 4, 4) == places.Cap(16, 16, "gs://bkt/places")
    assert places.cap_of(None, 2, "gs://bkt/places", 8, 1) == places.Cap(16, 8, "gs://bkt/places")  # deprecated: 2 VMs of 8
    assert places.cap_of(None, None, None, 8, 1) is None
    with pytest.raises(ValueError, match="max_tpu_vms=1: admits 4 TPU chips at once, fewer than the 16"):
        places.cap_of(None, 1, "gs://bkt/places", 4, 4)  # a slice of 4 VMs: 16 chips, never one place
    with pytest.raises(ValueError, match="max_tpu_vms=1: is given with max_tpu_chips=8"):
        places.cap_of(8, 1, "gs://bkt/places", 8, 1)
