"""The product's own capacity is never an outage (SPEC §4.5): a wildcard limit whose
``max_keys`` keys are all busy refuses a new key by that limit, counts it in
``capacity_refused`` and says so in one WARNING a minute; no spray of fresh keys resets
anyone's limit.

Every test runs on the backends of ``CAPACITY_BACKENDS``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeperMiddleware
from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from tests.conftest import FakeClock, busy, refusal
from tests.servers import wait_until

#: The backends that refuse a key they cannot track, driven by the FakeClock (Redis counts
#: by its own TIME: tests/test_redis_capacity.py covers it in real time).
CAPACITY_BACKENDS = ["memory", "shared"]
#: The backends of the spray property test.
SPRAY_BACKENDS = CAPACITY_BACKENDS

Make = Callable[..., GateKeeper]


def url_of(kind: str, directory: Path) -> str:
    return "memory" if kind == "memory" else f"shared://{directory}/gatekeeper.shm"


@pytest.fixture(params=CAPACITY_BACKENDS)
def make(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[Make]:
    """Builds GateKeepers on each backend, driven by the FakeClock; closes them after."""
    built: list[GateKeeper] = []

    def build(limits: dict[str, Any], **options: Any) -> GateKeeper:
        config = {"project": "shop", **options, "backend": url_of(request.param, tmp_path)}
        keeper = GateKeeper({**config, "limits": limits}, clock=clock)
        built.append(keeper)
        return keeper

    yield build
    for keeper in built:
        keeper.close()


def refused(gk: GateKeeper, service: str, caller: str) -> Rejected:
    with pytest.raises(Rejected) as info:
        gk.admit("shop", service, caller)
    return info.value


def counters(gk: GateKeeper) -> dict[str, Any]:
    counts: dict[str, Any] = gk.stats()["counters"]
    return counts


def capacity_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "at capacity" in record.getMessage()
    ]


# ------------------------------------------------------------------ refused, never uncounted


def test_new_key_refused_when_all_keys_are_in_flight(make: Make) -> None:
    """With max_keys keys all in flight a new key is refused by the wildcard limit's own
    code, not admitted uncounted, whatever on_backend_error says."""
    for policy in ("allow", "reject"):
        gk = make({"shop/api/*": {"concurrency": 1, "max_keys": 2}}, on_backend_error=policy)
        held = [gk.admit("shop", "api", "a"), gk.admit("shop", "api", "b")]
        fault = refused(gk, "api", "c")
        assert refusal(fault) == ("GK-CONCURRENCY-LIMIT", "caller", "shop/api/*", "1")
        assert fault.retry_after is not None and fault.retry_after >= 1
        assert busy(gk) == {"shop/api/a": 1, "shop/api/b": 1}
        assert refused(gk, "api", "a").code == "GK-CONCURRENCY-LIMIT"
        stats = counters(gk)
        assert stats["capacity_refused"] == 1
        assert stats["backend_errors"] == 0
        assert stats["rejected_by_limit"] == {"shop/api/*": 2}
        for admission in held:  # the shared backend's keepers share one table
            admission.release(200)


def test_new_key_refused_by_rate_when_all_windows_are_live(make: Make, clock: FakeClock) -> None:
    """Keys still inside their rate window are never evicted: the new key gets
    GK-RATE-LIMIT with the time until a window empties, and gets in once one has."""
    gk = make({"shop/login/*": {"rate": "1/minute", "max_keys": 2}})
    gk.admit("shop", "login", "x").release(200)
    clock.advance(10)
    gk.admit("shop", "login", "y").release(200)
    assert refused(gk, "login", "x").code == "GK-RATE-LIMIT"
    fault = refused(gk, "login", "z")
    assert (fault.code, fault.limit_path, fault.retry_after) == (
        "GK-RATE-LIMIT",
        "shop/login/*",
        50,
    )
    assert fault.rate is not None and fault.rate.remaining == 0
    assert set(gk.inflight()) == {"shop/login/x", "shop/login/y"}
    assert counters(gk)["capacity_refused"] == 1
    clock.advance(50)
    gk.admit("shop", "login", "z").release(200)
    assert set(gk.inflight()) == {"shop/login/y", "shop/login/z"}
    assert refused(gk, "login", "y").code == "GK-RATE-LIMIT"


def test_idle_keys_behind_busy_ones_are_reached(make: Make) -> None:
    """More busy keys at the front of a full table than one scan looks at (long polls,
    streams) do not hide the idle keys behind them for good: the keys passed over move
    back, so a refusal is not repeated while idle keys exist."""
    gk = make({"shop/a/*": {"concurrency": 1, "max_keys": 100}})
    held = [gk.admit("shop", "a", f"busy{n}") for n in range(70)]
    for n in range(30):
        gk.admit("shop", "a", f"done{n}").release(200)
    admitted = []
    for n in range(20):
        with contextlib.suppress(Rejected):
            admitted.append(gk.admit("shop", "a", f"new{n}"))
    assert len(admitted) >= 19
    assert counters(gk)["capacity_refused"] <= 1
    for admission in held + admitted:
        admission.release(200)


def test_keys_held_by_windows_refuse_by_rate_beside_keys_in_flight(make: Make) -> None:
    """A full limit with concurrency and a rate, one key in flight and one held only by
    its window: the new key is refused by rate (429, Retry-After until that window
    empties), as on every backend, not by concurrency with the window's wait."""
    gk = make({"shop/a/*": {"concurrency": 2, "rate": "1/hour", "max_keys": 2}})
    held = gk.admit("shop", "a", "c2")
    gk.admit("shop", "a", "anonymous").release(200)
    fault = refused(gk, "a", "c1")
    assert (fault.code, fault.retry_after) == ("GK-RATE-LIMIT", 3600)
    assert fault.rate is not None
    held.release(200)


def test_faulty_responses_on_a_route_without_concurrency_hold_nothing(
    make: Make, clock: FakeClock
) -> None:
    """A delay holds concurrency slots; on a route where no level counts concurrency
    (a rate alone) faulty responses hold nothing - not a shared table's leases either,
    which a client sending faulty requests would fill, refusing every route of the host."""
    gk = make(
        {"shop/feed": {"rate": "100000/second", "delay": 20.0}, "shop/pay": {"concurrency": 1}}
    )
    for _ in range(300):
        gk.admit("shop", "feed", "c").release(500, faulty=True)
    assert gk.stats()["counters"]["delayed_pending"] == 0
    assert busy(gk) == {}
    gk.admit("shop", "pay", "c").release(200)


def test_delayed_state_is_not_evicted(make: Make, clock: FakeClock) -> None:
    """A key whose slot is held by a delayed decrease is still in flight, so it is kept and
    the new key is refused; once the delay has passed the new key gets in."""
    gk = make({"shop/api/*": {"concurrency": 1, "delay": 10, "max_keys": 1}})
    gk.admit("shop", "api", "a").release(500, faulty=True)
    assert refused(gk, "api", "b").code == "GK-CONCURRENCY-LIMIT"
    assert busy(gk) == {"shop/api/a": 1}
    assert counters(gk)["capacity_refused"] == 1
    assert counters(gk)["backend_errors"] == 0
    clock.advance(10)
    gk.admit("shop", "api", "b")
    assert busy(gk) == {"shop/api/b": 1}


def test_reserved_window_entry_keeps_its_key(make: Make) -> None:
    """A key with a count=[401] reservation in flight is not idle; once the response
    gives the reservation back, the key is idle and makes room."""
    gk = make({"shop/login/*": {"rate": "1/minute", "count": [401], "max_keys": 1}})
    held = gk.admit("shop", "login", "mallory")
    assert refused(gk, "login", "alice").code == "GK-RATE-LIMIT"
    held.release(200)
    gk.admit("shop", "login", "alice").release(401)
    assert refused(gk, "login", "alice").code == "GK-RATE-LIMIT"
    assert refused(gk, "login", "mallory").code == "GK-RATE-LIMIT"


def test_other_levels_keep_counting_while_a_key_is_refused(make: Make) -> None:
    """The issue's attack: with the wildcard table full, a flood of new keys never takes
    the project past its concurrency (400 in flight against 100 was observed)."""
    gk = make({"shop": {"concurrency": 100}, "shop/api/*": {"concurrency": 5, "max_keys": 20}})
    held: list[Admission] = []
    for index in range(400):
        with contextlib.suppress(Rejected):
            held.append(gk.admit("shop", "api", f"key-{index % 20}"))
    assert len(held) == 100
    assert gk.inflight()["shop"] == 100
    assert counters(gk)["capacity_refused"] == 0
    for admission in held[20:]:
        admission.release(200)
    # 20 keys each hold 1..5 in flight: the table is full and nothing in it is idle.
    for index in range(400):
        with contextlib.suppress(Rejected):
            held.append(gk.admit("shop", "api", f"fresh-{index}"))
    assert len(held) == 100
    assert busy(gk)["shop"] == 20
    assert counters(gk)["capacity_refused"] == 400
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}


def test_caller_who_used_its_quota_stays_refused_after_a_spray(make: Make) -> None:
    """The issue's attack: after a caller used its 3/hour, a spray of max_keys fresh ids
    cannot evict its window; it stays refused."""
    gk = make({"shop/login/*": {"rate": "3/hour", "max_keys": 50}})
    for _ in range(3):
        gk.admit("shop", "login", "victim").release(200)
    sprayed = refusals = 0
    for index in range(2 * 50):
        try:
            gk.admit("shop", "login", f"spray-{index}").release(200)
            sprayed += 1
        except Rejected as fault:
            assert fault.code == "GK-RATE-LIMIT"
            refusals += 1
    assert refused(gk, "login", "victim").code == "GK-RATE-LIMIT"
    assert (sprayed, refusals) == (49, 51)
    assert len(gk.inflight()) <= 50


def test_refused_in_the_queue_wait_when_the_key_cannot_be_tracked(make: Make) -> None:
    """A request that waited in a queue and then finds its key untrackable is refused by
    the wildcard limit, and the queue is left clean."""
    queued_service = {"concurrency": 1, "queue": {"size": 5, "wait": 30}}
    gk = make({"shop/api": queued_service, "shop/*/*": {"rate": "1/minute", "max_keys": 2}})
    holder = gk.admit("shop", "api", "b")
    gk.admit("shop", "x", "a").release(200)
    outcome: list[BaseException | Admission] = []

    def queued() -> None:
        try:
            outcome.append(gk.admit("shop", "api", "c"))
        except Rejected as exc:
            outcome.append(exc)

    thread = threading.Thread(target=queued)
    thread.start()
    wait_until(lambda: gk._waiting == 1, what="the request to wait in the queue")
    holder.release(200)
    thread.join()
    (fault,) = outcome
    assert isinstance(fault, Rejected)
    assert (fault.code, fault.limit_path) == ("GK-RATE-LIMIT", "shop/*/*")
    assert counters(gk)["capacity_refused"] == 1
    assert gk._waiting == 0


def test_query_answers_the_capacity_refusal_without_counting(make: Make) -> None:
    """query() says a new key would be refused while the table is full, records nothing,
    and still answers None for a tracked key with room."""
    gk = make({"shop/api/*": {"concurrency": 2, "max_keys": 1}})
    gk.admit("shop", "api", "a")
    answer = gk.query("shop", "api", "b")
    assert answer is not None and answer.code == "GK-CONCURRENCY-LIMIT"
    assert gk.query("shop", "api", "a") is None
    assert counters(gk)["capacity_refused"] == 0
    assert counters(gk)["rejected"] == {}


# ------------------------------------------------------------------------------ shadow mode


def test_shadow_limit_that_cannot_track_a_key_does_not_refuse(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    """A shadow wildcard limit at capacity admits the new key untracked there, while the
    enforcing project limit keeps counting it; counted as shadow_rejected, and warned."""
    gk = make(
        {
            "shop": {"concurrency": 3},
            "shop/api/*": {"concurrency": 1, "max_keys": 1, "mode": "shadow"},
        }
    )
    gk.admit("shop", "api", "a")
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        untracked = gk.admit("shop", "api", "b")
    assert busy(gk) == {"shop": 2, "shop/api/a": 1}
    stats = counters(gk)
    assert (stats["shadow_rejected"], stats["capacity_refused"]) == (1, 0)
    (warning,) = capacity_warnings(caplog)
    assert "shop/api/*" in warning and "shadow" in warning
    gk.admit("shop", "api", "c")
    assert refused(gk, "api", "d").limit_path == "shop"
    untracked.release(200)
    assert busy(gk) == {"shop": 2, "shop/api/a": 1}


def test_request_whose_only_slot_is_untrackable_shadow_is_admitted(make: Make) -> None:
    """A request whose only limit is a shadow wildcard at capacity is admitted and its
    release is harmless."""
    gk = make({"shop/api/*": {"concurrency": 1, "max_keys": 1}}, mode="shadow")
    gk.admit("shop", "api", "a")
    admission = gk.admit("shop", "api", "b")
    admission.release(200)
    admission.release(200)
    assert busy(gk) == {"shop/api/a": 1}
    assert counters(gk)["shadow_rejected"] == 1


# ---------------------------------------------------------------------------- the WARNING


def test_one_capacity_warning_per_minute_per_limit(
    make: Make, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """However many requests a full limit refuses, one WARNING a minute names the limit and
    how to size it; every refusal is counted."""
    one_key = {"concurrency": 1, "max_keys": 1}
    gk = make({"shop/api/*": one_key, "shop/b/*": one_key})
    gk.admit("shop", "api", "a")
    gk.admit("shop", "b", "a")
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        for index in range(50):
            refused(gk, "api", f"new-{index}")
            clock.advance(1)
        refused(gk, "b", "new")
        clock.advance(10)
        refused(gk, "api", "later")
    warnings = capacity_warnings(caplog)
    assert len(warnings) == 3
    assert "'shop/api/*'" in warnings[0] and "max_keys" in warnings[0]
    assert "'shop/b/*'" in warnings[1]
    assert "'shop/api/*'" in warnings[2]
    assert counters(gk)["capacity_refused"] == 52


# --------------------------------------------------------------------- through the middleware


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_middleware_fault_names_the_full_limit(make: Make) -> None:
    """Through the middleware, a key the full table cannot track gets the limit's
    ServiceFault: code, level, limit path and Retry-After."""
    gk = make({"shop/api/*": {"rate": "2/minute", "max_keys": 2}})
    client = Client(GateKeeperMiddleware(ok_app, gk))
    for caller in ("a", "b"):
        response = client.get("/api", headers={"X-Caller-Id": caller})
        response.close()
        assert response.status_code == 200
    response = client.get("/api", headers={"X-Caller-Id": "c", "Accept": "application/json"})
    response.close()
    assert response.status_code == 429
    fault = response.get_json()
    assert fault["code"] == "GK-RATE-LIMIT"
    assert fault["level"] == "caller"
    assert fault["limit"] == {"path": "shop/api/*", "value": "2/minute"}
    assert response.headers["Retry-After"] == "60"
    assert counters(gk)["capacity_refused"] == 1


def test_threads_flooding_new_keys_never_exceed_the_project_limit(make: Make) -> None:
    """150 threads with fresh caller ids against a table of 30 keys all in flight: the app
    sees 30 at once, never more (with fail-open it saw every one of them)."""
    gk = make({"shop": {"concurrency": 100}, "shop/api/*": {"concurrency": 1, "max_keys": 30}})
    inside = 0
    most = 0
    lock = threading.Lock()
    go = threading.Event()
    statuses: list[int] = []

    def app(environ: Any, start_response: Any) -> list[bytes]:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        go.wait()
        with lock:
            inside -= 1
        return ok_app(environ, start_response)

    client_app = GateKeeperMiddleware(app, gk)

    def call(index: int) -> None:
        response = Client(client_app).get("/api", headers={"X-Caller-Id": f"c{index}"})
        response.close()
        with lock:
            statuses.append(response.status_code)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(150)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(statuses) + inside == 150, what="every request admitted or refused")
    go.set()
    for thread in threads:
        thread.join()
    assert most == 30
    assert sorted(set(statuses)) == [200, 503]
    assert statuses.count(200) == 30
    assert counters(gk)["capacity_refused"] == 120
    assert busy(gk) == {}


# ---------------------------------------------------------------------- spray, as a property

WINDOW = 60.0
QUOTA = 3
MAX_KEYS = 4

operations = st.lists(
    st.one_of(
        st.tuples(st.just("advance"), st.floats(0, 40)),
        st.tuples(st.just("victim"), st.integers(0, 1)),
        st.tuples(st.just("burst"), st.integers(0, 1)),
        st.tuples(st.just("hold"), st.integers(0, 1)),
        st.tuples(st.just("release"), st.just(0)),
        st.tuples(st.just("spray"), st.integers(1, 2 * MAX_KEYS)),
    ),
    max_size=40,
)


@pytest.mark.parametrize("kind", SPRAY_BACKENDS)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=operations)
def test_no_spray_lets_a_key_past_its_limit(kind: str, steps: list[tuple[str, Any]]) -> None:
    """For any interleaving of victims' requests and sprays of fresh keys larger than
    max_keys, no key is admitted more than N times in any window nor twice at once, and
    tracked state stays within max_keys."""
    clock = FakeClock()
    limit = {"concurrency": 1, "rate": f"{QUOTA}/{int(WINDOW)}s", "max_keys": MAX_KEYS}
    with tempfile.TemporaryDirectory() as directory:
        backend = url_of(kind, Path(directory))
        config = {"project": "shop", "backend": backend, "limits": {"shop/api/*": limit}}
        gk = GateKeeper(config, clock=clock)
        admitted: dict[str, list[float]] = {}
        held: dict[str, Admission] = {}
        fresh = 0
        try:

            def attempt(caller: str) -> Admission | None:
                try:
                    admission = gk.admit("shop", "api", caller)
                except Rejected:
                    return None
                times = admitted.setdefault(caller, [])
                times.append(clock.now)
                recent = [t for t in times if t > clock.now - WINDOW]
                assert len(recent) <= QUOTA, f"{caller} admitted {len(recent)} times in a window"
                assert caller not in held, f"{caller} admitted twice at once"
                return admission

            for step, arg in steps:
                if step == "advance":
                    clock.advance(arg)
                elif step in ("victim", "burst"):
                    # A burst tries one more than the quota: a victim that used it all.
                    for _ in range(QUOTA + 1 if step == "burst" else 1):
                        admission = attempt(f"victim-{arg}")
                        if admission is not None:
                            admission.release(200)
                elif step == "hold":
                    admission = attempt(f"victim-{arg}")
                    if admission is not None:
                        held[f"victim-{arg}"] = admission
                elif step == "release":
                    for admission in held.values():
                        admission.release(200)
                    held.clear()
                else:
                    for _ in range(arg):
                        fresh += 1
                        admission = attempt(f"spray-{fresh}")
                        if admission is not None:
                            admission.release(200)
                assert len(gk.inflight()) <= MAX_KEYS
                assert busy(gk) == {f"shop/api/{caller}": 1 for caller in held}
        finally:
            gk.close()
