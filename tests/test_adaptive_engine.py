"""Adaptive limits through the engine and the memory backend: exact enforcement of the
current value, samples fed at release, and what users see (faults, stats)."""

from __future__ import annotations

import heapq
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeperMiddleware
from gatekeeper_wsgi.adaptive import PROBE_CONCURRENCY, PROBE_SAMPLES, PROBE_SECONDS
from gatekeeper_wsgi.backends.memory import MemoryBackend
from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from tests.conftest import FakeClock, busy

AUTO = {"concurrency": "auto"}


def keeper(clock: FakeClock, limits: dict[str, Any] | None = None) -> GateKeeper:
    return GateKeeper({"project": "shop", "limits": limits or {"shop": AUTO}}, clock=clock)


def refusal(gk: GateKeeper, service: str = "a", caller: str = "c") -> Rejected:
    with pytest.raises(Rejected) as info:
        gk.admit("shop", service, caller)
    return info.value


def test_initial_limit_is_enforced_and_reported(clock: FakeClock) -> None:
    """Before any sample the limit is ``initial``: that many are admitted, the next is
    refused with GK-CONCURRENCY-LIMIT and the current value."""
    gk = keeper(clock, {"shop": {"concurrency": "auto", "adaptive": {"initial": 4}}})
    held = [gk.admit("shop", "a", "c") for _ in range(4)]
    rejected = refusal(gk)
    assert (rejected.code, rejected.limit_path, rejected.limit_value) == (
        "GK-CONCURRENCY-LIMIT",
        "shop",
        "4",
    )
    assert busy(gk) == {"shop": 4}
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}


def test_a_lower_limit_cuts_nothing_off_and_admits_only_below_it(clock: FakeClock) -> None:
    """The limit drops from 10 to the probe's 3 while 9 are in flight: all 9 finish and
    release normally, and nothing new is admitted until fewer than 3 are in flight."""
    gk = keeper(clock)
    held = [gk.admit("shop", "a", "c") for _ in range(10)]
    clock.advance(0.02)
    held.pop().release(200)  # the first sample starts a probe: the limit is pinned to 3
    assert gk.stats()["adaptive"]["shop"]["limit"] == PROBE_CONCURRENCY
    while len(held) >= PROBE_CONCURRENCY:
        assert refusal(gk).limit_value == str(PROBE_CONCURRENCY)
        held.pop().release(200)
    assert busy(gk) == {"shop": PROBE_CONCURRENCY - 1}
    held.append(gk.admit("shop", "a", "c"))
    assert refusal(gk).limit_value == str(PROBE_CONCURRENCY)
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}


def test_many_threads_never_exceed_the_current_limit(clock: FakeClock) -> None:
    """64 threads race for a limit pinned at 3 (a probe whose requests all hang): exactly
    3 are in the app at once, by the app's own count; the rest are refused."""
    gk = keeper(clock)
    clock.advance(0.01)
    gk.admit("shop", "a", "c").release(200)  # starts the probe: limit 3
    entered = 0
    peak = 0
    lock = threading.Lock()
    start = threading.Barrier(64)
    finish = threading.Event()
    outcomes: list[str] = []

    def worker() -> None:
        nonlocal entered, peak
        start.wait()
        try:
            admission = gk.admit("shop", "a", "c")
        except Rejected as exc:
            with lock:
                outcomes.append(str(exc.limit_value))
            return
        with lock:
            entered += 1
            peak = max(peak, entered)
            outcomes.append("admitted")
        finish.wait()
        with lock:
            entered -= 1
        admission.release(200)

    threads = [threading.Thread(target=worker) for _ in range(64)]
    for thread in threads:
        thread.start()
    while len(outcomes) < 64:
        threading.Event().wait(0.001)  # polling a count, not synchronizing on time
    assert busy(gk) == {"shop": PROBE_CONCURRENCY}
    finish.set()
    for thread in threads:
        thread.join()
    assert peak == PROBE_CONCURRENCY
    assert outcomes.count("admitted") == PROBE_CONCURRENCY
    assert outcomes.count(str(PROBE_CONCURRENCY)) == 64 - PROBE_CONCURRENCY
    assert busy(gk) == {}


def simulate(
    gk: GateKeeper,
    clock: FakeClock,
    capacity: float,
    seconds: float,
    *,
    clients: int = 200,
    base: float = 0.02,
    faulty_every: int = 0,
) -> dict[str, int]:
    """Clients hammer service 'a' through the engine: each retries at once when refused;
    an admitted request takes ``base x max(1, in_flight / capacity)`` (a backend that
    queues beyond ``capacity``). Returns counts of what happened."""
    done: list[tuple[float, int, Admission]] = []
    seq = 0
    counts = {"admitted": 0, "refused": 0, "peak": 0}
    end = clock.now + seconds
    while clock.now < end:
        # Every idle client tries once at this instant; refused ones wait for a release.
        while len(done) < clients:
            try:
                admission = gk.admit("shop", "a", "c")
            except Rejected:
                counts["refused"] += 1
                break
            latency = base * max(1.0, (len(done) + 1) / capacity)
            seq += 1
            heapq.heappush(done, (clock.now + latency, seq, admission))
            counts["admitted"] += 1
            counts["peak"] = max(counts["peak"], len(done))
        if not done:  # every slot held by a delayed decrease: wait for the next one
            clock.advance(0.005)
            continue
        due, _, admission = heapq.heappop(done)
        clock.now = max(clock.now, due)
        faulty = bool(faulty_every) and seq % faulty_every == 0
        admission.release(500 if faulty else 200, faulty=faulty)
    for _, _, admission in done:
        admission.release(200)
    return counts


@pytest.mark.parametrize("algorithm", ["gradient", "vegas", "aimd"])
def test_engine_settles_near_a_modelled_backends_capacity(clock: FakeClock, algorithm: str) -> None:
    """200 clients, a backend of capacity 20: through admit/release the limit settles
    between 0.9 and 1.3 times 20, and the in-flight count never exceeds max."""
    gk = keeper(clock, {"shop": {"concurrency": "auto", "adaptive": {"algorithm": algorithm}}})
    counts = simulate(gk, clock, capacity=20, seconds=20.0)
    report = gk.stats()["adaptive"]["shop"]
    assert 18 <= report["limit"] <= 26
    assert report["min_latency_ms"] == pytest.approx(20.0, rel=0.05)
    assert counts["refused"] > 0 and counts["peak"] <= 1000


def test_rejections_are_not_samples(clock: FakeClock) -> None:
    """A flood of refused requests changes neither the limit nor its latencies."""
    gk = keeper(clock)
    simulate(gk, clock, capacity=20, seconds=10.0)
    before = gk.stats()["adaptive"]["shop"]
    held = []
    while True:
        try:
            held.append(gk.admit("shop", "a", "c"))
        except Rejected:
            break
    for _ in range(5000):
        refusal(gk)
        clock.advance(0.001)
    assert gk.stats()["adaptive"]["shop"] == before
    for admission in held:
        admission.release(200)


def test_faulty_responses_lower_the_limit_and_delays_still_hold(clock: FakeClock) -> None:
    """Every second response faulty (with a delay): the limit falls well below what it
    had settled at, and a faulty response's slot is still held for its delay."""
    gk = keeper(clock, {"shop": {"concurrency": "auto", "delay": 0.5}})
    simulate(gk, clock, capacity=20, seconds=10.0)
    settled = gk.stats()["adaptive"]["shop"]["limit"]
    clock.advance(1.0)
    simulate(gk, clock, capacity=20, seconds=3.0, faulty_every=2)
    clock.advance(1.0)
    assert gk.stats()["adaptive"]["shop"]["limit"] < settled / 2
    admission = gk.admit("shop", "a", "c")
    admission.release(500, faulty=True)
    assert busy(gk) == {"shop": 1}
    clock.advance(0.5)
    assert busy(gk) == {}


def test_wildcard_keys_each_have_their_own_limit(clock: FakeClock) -> None:
    """`shop/a/*` = auto: each caller gets its own controller and stats entry."""
    gk = keeper(clock, {"shop/a/*": {"concurrency": "auto", "adaptive": {"initial": 2}}})
    alice = [gk.admit("shop", "a", "alice") for _ in range(2)]
    bob = gk.admit("shop", "a", "bob")
    assert refusal(gk, caller="alice").limit_value == "2"
    assert set(gk.stats()["adaptive"]) == {"shop/a/alice", "shop/a/bob"}
    for admission in [*alice, bob]:
        admission.release(200)


def test_stats_adaptive_shape(clock: FakeClock) -> None:
    """`gk.stats()["adaptive"]` maps each path to its int limit and float latencies."""
    gk = keeper(clock)
    simulate(gk, clock, capacity=20, seconds=2.0)
    report = gk.stats()["adaptive"]["shop"]
    assert set(report) == {"limit", "latency_ms", "min_latency_ms"}
    assert isinstance(report["limit"], int)
    assert isinstance(report["latency_ms"], float) and report["latency_ms"] > 0
    assert isinstance(report["min_latency_ms"], float) and report["min_latency_ms"] > 0


def test_light_traffic_keeps_the_probe_pin_short(clock: FakeClock) -> None:
    """A quiet path (a request every 0.2 s) is pinned by its first probe only until
    PROBE_SECONDS have passed, not until PROBE_SAMPLES requests came: a burst then gets
    the limit it had, 10, rather than the probe's 3."""
    gk = keeper(clock)
    clock.advance(0.01)
    gk.admit("shop", "a", "c").release(200)  # the first sample starts the probe
    assert gk.stats()["adaptive"]["shop"]["limit"] == PROBE_CONCURRENCY
    for _ in range(round(PROBE_SECONDS / 0.2)):
        clock.advance(0.2)
        admission = gk.admit("shop", "a", "c")
        clock.advance(0.01)
        admission.release(200)
    assert PROBE_SECONDS / 0.2 < PROBE_SAMPLES  # ended by time, not by samples
    assert gk.stats()["adaptive"]["shop"]["limit"] == 10
    burst = [gk.admit("shop", "a", "c") for _ in range(10)]
    assert refusal(gk).limit_value == "10"
    for admission in burst:
        admission.release(200)


def test_stats_report_an_adaptive_limit_from_the_start(clock: FakeClock) -> None:
    """Before its first request an adaptive limit without `*` is in stats() at its
    initial value, as its faults would give it; a wildcard limit has no key yet."""
    gk = keeper(
        clock,
        {
            "shop": {"concurrency": "auto", "adaptive": {"initial": 7}},
            "shop/a/*": AUTO,
            "shop/b": {"concurrency": 3},
        },
    )
    assert gk.stats()["adaptive"] == {
        "shop": {"limit": 7, "latency_ms": 0.0, "min_latency_ms": 0.0}
    }
    assert gk.stats(adaptive_keys=["shop/b"])["adaptive"] == {}
    held = [gk.admit("shop", "a", "c") for _ in range(7)]
    assert refusal(gk).limit_value == "7"
    assert set(gk.stats()["adaptive"]) == {"shop", "shop/a/c"}
    for admission in held:
        admission.release(200)


def test_a_reload_to_a_fixed_limit_leaves_the_adaptive_report(
    clock: FakeClock, tmp_path: Path
) -> None:
    """A limit a reload turns from "auto" into a number is no longer reported as
    adaptive, though its controller has learned a value."""
    file = tmp_path / "gk.properties"
    file.write_text("project = shop\nlimits.shop.concurrency = auto\n")
    gk = GateKeeper(str(file), clock=clock)
    simulate(gk, clock, capacity=20, seconds=2.0)
    assert set(gk.stats()["adaptive"]) == {"shop"}
    file.write_text("project = shop\nlimits.shop.concurrency = 6\n")
    assert gk.reload()
    assert gk.stats()["adaptive"] == {}
    held = [gk.admit("shop", "a", "c") for _ in range(6)]
    assert refusal(gk).limit_value == "6"
    for admission in held:
        admission.release(200)


def test_a_reload_to_a_lower_max_applies_at_once(clock: FakeClock, tmp_path: Path) -> None:
    """The learned limit is clamped to a lowered max as soon as the new table is in use,
    in what is enforced and in what stats report."""
    file = tmp_path / "gk.properties"
    file.write_text("project = shop\nlimits.shop.concurrency = auto\n")
    gk = GateKeeper(str(file), clock=clock)
    simulate(gk, clock, capacity=20, seconds=10.0)
    assert gk.stats()["adaptive"]["shop"]["limit"] > 5
    file.write_text(
        "project = shop\nlimits.shop.concurrency = auto\nlimits.shop.adaptive = max=5\n"
    )
    assert gk.reload()
    assert gk.stats()["adaptive"]["shop"]["limit"] == 5  # reported as enforced
    held = [gk.admit("shop", "a", "c") for _ in range(5)]
    assert refusal(gk).limit_value == "5"
    for admission in held:
        admission.release(200)


def test_fault_json_carries_the_current_limit_as_a_number(clock: FakeClock) -> None:
    """Through the middleware, the JSON fault's limit.value is the current limit, a
    JSON number."""
    gk = keeper(clock, {"shop": {"concurrency": "auto", "adaptive": {"initial": 1}}})

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    wrapped = GateKeeperMiddleware(app, gk)
    held = gk.admit("shop", "x", "c")
    response = Client(wrapped).get("/x", headers={"Accept": "application/json"})
    body = json.loads(response.get_data())
    assert response.status_code == 503
    assert body["limit"] == {"path": "shop", "value": 1}
    held.release(200)


def test_prometheus_shows_the_current_limit(clock: FakeClock) -> None:
    """`gatekeeper_adaptive_limit{limit="shop"}` follows the limit; a wildcard's keys are
    never a limit label of their own (they are labelled `key` under the pattern, see
    test_prometheus_adaptive; every key's value is in stats)."""
    from prometheus_client import CollectorRegistry

    from gatekeeper_wsgi.prometheus import register

    gk = keeper(clock, {"shop": AUTO, "shop/a/*": AUTO})
    registry = CollectorRegistry()
    register(gk, registry, multiprocess=False)
    value = registry.get_sample_value
    simulate(gk, clock, capacity=20, seconds=5.0)
    current = gk.stats()["adaptive"]["shop"]["limit"]
    assert value("gatekeeper_adaptive_limit", {"limit": "shop"}) == current
    assert value("gatekeeper_adaptive_limit", {"limit": "shop/a/c"}) is None
    assert "shop/a/c" in gk.stats()["adaptive"]


def test_a_backend_that_cannot_adapt_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """On a backend without adaptive support the start-up log names the auto limits and
    that their max is what is enforced (no silent pretending)."""

    class Static(MemoryBackend):
        adaptive_limits = False

    with caplog.at_level("WARNING", logger="gatekeeper"):
        gk = GateKeeper(
            {
                "project": "shop",
                "limits": {"shop/a": {"concurrency": "auto", "adaptive": {"max": 7}}},
            },
            backend=Static(),
        )
    gk.close()
    assert any(
        "shop/a" in record.getMessage() and "adaptive.max" in record.getMessage()
        for record in caplog.records
    )


def test_a_spray_of_keys_keeps_adaptive_state_bounded(clock: FakeClock) -> None:
    """50 000 callers on `shop/a/*` = auto with max_keys 50: at most 50 controllers are
    kept and reported; evicted keys take theirs along."""
    gk = keeper(clock, {"shop/a/*": {"concurrency": "auto", "max_keys": 50}})
    for index in range(50_000):
        gk.admit("shop", "a", f"spray{index}").release(200)
    assert len(gk.stats()["adaptive"]) <= 50
    assert busy(gk) == {}
