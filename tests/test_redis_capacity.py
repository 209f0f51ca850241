"""``max_keys`` on Redis (SPEC §4.5, §6): a wildcard limit tracks at most ``max_keys`` keys;
a new key evicts an idle one (nothing in flight, its window empty) or is refused by that
limit, counted under ``capacity_refused``, as on the memory and shared backends. Against a
real redis-server; where Redis time must pass the test polls until a deadline."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend  # noqa: E402
from tests.conftest import busy, refusal  # noqa: E402
from tests.servers import wait_until  # noqa: E402
from tests.test_redis import keeper  # noqa: E402

pytestmark = pytest.mark.redis


def refused(gk: GateKeeper, caller: str) -> Rejected:
    with pytest.raises(Rejected) as info:
        gk.admit("shop", "cap", caller)
    return info.value


def capacity_refused(gk: GateKeeper) -> int:
    return int(gk.stats()["counters"]["capacity_refused"])


def backend_of(gk: GateKeeper) -> RedisBackend:
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    return backend


def tracked(gk: GateKeeper) -> int:
    """How many keys ``shop/cap/*`` tracks (its tracked set's size)."""
    backend = backend_of(gk)
    backend._outbox.flush()
    return int(backend.client.zcard(backend.tracking_key("shop/cap/*", "shop/cap/x")))


def path_keys(gk: GateKeeper) -> int:
    """How many concrete paths' sets of ``shop/cap/*`` exist in Redis (SCAN)."""
    backend = backend_of(gk)
    backend._outbox.flush()
    pattern = f"{backend.prefix}:{{shop}}:z:shop/cap/*"
    return sum(1 for _ in backend.client.scan_iter(match=pattern, count=1000))


def test_a_new_key_is_refused_by_concurrency_when_all_tracked_keys_are_in_flight(
    prefixed: str,
) -> None:
    gk = keeper(prefixed, {"shop/cap/*": {"concurrency": 1, "max_keys": 3}})
    try:
        held = [gk.admit("shop", "cap", caller) for caller in "abc"]
        fault = refused(gk, "d")
        assert refusal(fault) == ("GK-CONCURRENCY-LIMIT", "caller", "shop/cap/*", "1")
        assert fault.retry_after is not None and fault.retry_after >= 1
        counters = gk.stats()["counters"]
        assert counters["capacity_refused"] == 1
        assert counters["backend_errors"] == 0
        assert busy(gk) == {"shop/cap/a": 1, "shop/cap/b": 1, "shop/cap/c": 1}
        assert tracked(gk) == 3
        # A key it tracks is still counted by its own limit, not by capacity.
        assert refused(gk, "a").code == "GK-CONCURRENCY-LIMIT"
        assert capacity_refused(gk) == 1
        # A released key is idle at once: it makes room for the new one.
        held[0].release(200)
        gk.admit("shop", "cap", "d").release(200)
        for admission in held[1:]:
            admission.release(200)
        assert capacity_refused(gk) == 1
    finally:
        gk.close()


def test_a_new_key_is_refused_by_rate_while_all_tracked_windows_are_live(
    prefixed: str,
) -> None:
    gk = keeper(prefixed, {"shop/cap/*": {"rate": "1/30s", "max_keys": 3}})
    try:
        for caller in "abc":
            gk.admit("shop", "cap", caller).release(200)
        fault = refused(gk, "d")
        assert (fault.code, fault.limit_path, fault.limit_value) == (
            "GK-RATE-LIMIT",
            "shop/cap/*",
            "1/30s",
        )
        # The time until the first window empties, not a made-up second.
        assert fault.retry_after is not None and 25 <= fault.retry_after <= 30
        assert capacity_refused(gk) == 1
        assert refused(gk, "a").code == "GK-RATE-LIMIT"  # no reset by the spray
        assert capacity_refused(gk) == 1
        assert tracked(gk) == 3
    finally:
        gk.close()


def test_a_key_whose_window_ended_makes_room(prefixed: str) -> None:
    gk = keeper(prefixed, {"shop/cap/*": {"rate": "1/1s", "max_keys": 3}})
    try:
        for caller in "abc":
            gk.admit("shop", "cap", caller).release(200)
        assert refused(gk, "d").code == "GK-RATE-LIMIT"

        def admits_d() -> bool:
            try:
                gk.admit("shop", "cap", "d").release(200)
            except Rejected:
                return False
            return True

        wait_until(admits_d, timeout=10, what="d admitted once a window ended")
        assert tracked(gk) <= 3
    finally:
        gk.close()


def test_a_lease_that_expired_unreleased_makes_room(prefixed: str) -> None:
    """A crashed holder's key (its lease never released) is idle once max_hold passed."""
    gk = keeper(f"{prefixed}&max_hold=0.3", {"shop/cap/*": {"concurrency": 1, "max_keys": 3}})
    try:
        held = [gk.admit("shop", "cap", caller) for caller in "abc"]
        assert refused(gk, "d").code == "GK-CONCURRENCY-LIMIT"

        def admits_d() -> Any:
            try:
                return gk.admit("shop", "cap", "d")
            except Rejected:
                return None

        wait_until(admits_d, timeout=10, what="d admitted once a lease expired").release(200)
        assert tracked(gk) <= 3
        for admission in held:
            admission.release(200)  # long expired: does nothing
    finally:
        gk.close()


def test_a_delayed_release_keeps_its_key_tracked(prefixed: str) -> None:
    gk = keeper(prefixed, {"shop/cap/*": {"concurrency": 1, "delay": 30, "max_keys": 1}})
    try:
        gk.admit("shop", "cap", "a").release(500, faulty=True)
        assert refused(gk, "b").code == "GK-CONCURRENCY-LIMIT"
        assert capacity_refused(gk) == 1
    finally:
        gk.close()


def test_a_spray_of_callers_keeps_the_keys_bounded(prefixed: str) -> None:
    """5 000 fresh callers against max_keys 50 of a 1/hour limit: 50 admitted, the rest
    refused by the limit; Redis holds at most 50 of its paths' sets."""
    gk = keeper(prefixed, {"shop/cap/*": {"rate": "1/hour", "max_keys": 50}})
    try:
        admitted = 0
        for n in range(5000):
            try:
                gk.admit("shop", "cap", f"c{n}").release(200)
                admitted += 1
            except Rejected as fault:
                assert (fault.code, fault.limit_path) == ("GK-RATE-LIMIT", "shop/cap/*")
        assert admitted == 50
        assert capacity_refused(gk) == 4950
        assert tracked(gk) == 50
        assert path_keys(gk) <= 50
        assert refused(gk, "c0").code == "GK-RATE-LIMIT"
    finally:
        gk.close()


def test_an_idle_key_behind_busy_ones_makes_room(prefixed: str) -> None:
    """max_keys 40: 20 keys held in flight at the front of the tracked set (they end
    soonest), 20 idle ones behind them: a new key evicts an idle one, as on the memory and
    shared backends, instead of being refused for the busy ones looked at first."""
    gk = keeper(prefixed, {"shop/cap/*": {"concurrency": 1, "max_keys": 40}})
    try:
        held = [gk.admit("shop", "cap", f"busy{n}") for n in range(20)]
        for n in range(20):
            gk.admit("shop", "cap", f"idle{n}").release(200)
        assert tracked(gk) == 40
        gk.admit("shop", "cap", "newcomer").release(200)
        assert capacity_refused(gk) == 0
        assert tracked(gk) == 40
        for admission in held:
            admission.release(200)
    finally:
        gk.close()


def test_a_spray_on_an_adaptive_limit_keeps_its_hashes_bounded(prefixed: str) -> None:
    """An adaptive wildcard limit keeps a hash per key: an evicted key takes its hash
    along, so 300 fresh callers against max_keys 20 leave at most 20 hashes, not one per
    caller for an hour (SPEC 4.5)."""
    gk = keeper(prefixed, {"shop/cap/*": {"concurrency": "auto", "max_keys": 20}})
    try:
        for n in range(300):
            gk.admit("shop", "cap", f"c{n}").release(200)
        backend = backend_of(gk)
        backend._outbox.flush()
        pattern = f"{backend.prefix}:{{shop}}:a:shop/cap/*"
        hashes = sum(1 for _ in backend.client.scan_iter(match=pattern, count=1000))
        assert 0 < hashes <= 20
        assert tracked(gk) <= 20
    finally:
        gk.close()


def _spray(url: str, start: int, count: int, queue: Any) -> None:
    gk = keeper(url, {"shop/cap/*": {"rate": "1/hour", "max_keys": 50}})
    admitted = 0
    try:
        for n in range(start, start + count):
            try:
                gk.admit("shop", "cap", f"c{n}").release(200)
                admitted += 1
            except Rejected:
                pass
    finally:
        gk.close()
    queue.put(admitted)


def test_two_processes_spraying_never_track_more_than_max_keys(prefixed: str) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_spray, args=(prefixed, start, 1500, queue))
        for start in (0, 100_000)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    assert sum(results) == 50  # every tracked key used its 1/hour: nothing evicted
    gk = keeper(prefixed, {"shop/cap/*": {"rate": "1/hour", "max_keys": 50}})
    try:
        assert tracked(gk) == 50
        assert path_keys(gk) == 50
    finally:
        gk.close()


def test_a_reload_lowering_max_keys_evicts_idle_keys_enough_for_the_new_one(
    prefixed: str, tmp_path: Any
) -> None:
    """A reload lowers max_keys below the keys tracked: a new key evicts as many idle ones
    as it takes (up to the 64 looked at), as memory and shared admit it, not one per
    admission with the new keys refused meanwhile."""
    limits = tmp_path / "limits.properties"
    limits.write_text("limits.shop/cap/*.concurrency = 5\n")
    gk = keeper(prefixed, {}, reload={"file": str(limits)})
    try:
        for caller in "abcdef":
            gk.admit("shop", "cap", caller).release(200)
        replacement = tmp_path / "limits.new"
        replacement.write_text(
            "limits.shop/cap/*.concurrency = 5\nlimits.shop/cap/*.max_keys = 3\n"
        )
        replacement.replace(limits)
        assert gk.reload() is True
        for caller in "xyz":
            gk.admit("shop", "cap", caller).release(200)
        assert capacity_refused(gk) == 0
        assert tracked(gk) == 3
    finally:
        gk.close()
