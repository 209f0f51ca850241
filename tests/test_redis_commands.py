"""Fewer commands per request on Redis (issue 19 point 2): a limit without a wildcard keeps
no totals set (its own sorted set holds its leases, delayed releases and window), its totals
are read from that set and stay exact, and a give-back's tombstone still stops a late
admission whichever slot comes first. Against real redis-server processes; commands are
counted by INFO commandstats, scripts' own included."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper  # noqa: E402
from gatekeeper_wsgi.backends.base import Slot  # noqa: E402
from tests.servers import ControlledRedis, wait_until  # noqa: E402
from tests.test_redis import keeper  # noqa: E402
from tests.test_redis_tidy import (  # noqa: E402
    assert_late_admission_takes_nothing,
    plain_releases,
    redis_backend,
)
from tests.test_redis_totals import commands_run  # noqa: E402
from tests.test_totals_backends import full_count  # noqa: E402

pytestmark = pytest.mark.redis

#: The benchmark's "3 conc + 1 rate" (benchmarks/_common.py), the caller in the path.
THREE_LEVELS: dict[str, Any] = {
    "shop": {"concurrency": 10_000},
    "shop/orders": {"concurrency": 10_000},
    "shop/orders/*": {"concurrency": 10_000, "rate": "100000/minute"},
}


def keys_under(gk: GateKeeper, kind: str) -> set[str]:
    """The keys of one kind (``z``, ``t``) under the keeper's prefix, by what follows it."""
    backend = redis_backend(gk)
    backend._outbox.flush()
    found = backend.client.scan_iter(match=f"{backend.prefix}:*:{kind}:*")
    return {key.decode().split(f":{kind}:", 1)[1] for key in found}


def test_per_slot_commands_for_three_levels_and_a_rate(own_redis: ControlledRedis) -> None:
    """Three concurrency levels and a rate, one request at a time: per request 19 commands
    (24 before): per level a count, an add and an expiry at admission and a removal at release
    (the plain levels do not look at what is left: nothing is marked), the rate level's second
    count, the wildcard level's totals add, expiry check and removal, its tracked set's add
    (max_keys: a known key, so nothing more), and the two cleanups of
    one admission in 16; no give-back check of its own. The rate key's release rides along
    with the next admission on it, whose expiry covers what is left, so only the last one
    looks at what is left and cuts the key's life to its window. Nothing is left but the rate
    key's window."""
    gk = keeper(own_redis.url, THREE_LEVELS)
    try:
        gk.admit("shop", "orders", "c").release(200)  # connected, script loaded
        backend = redis_backend(gk)
        backend._outbox.flush()
        backend.client.config_resetstat()
        requests = 160
        for _ in range(requests):
            gk.admit("shop", "orders", "c").release(200)
        backend._outbox.flush()
        calls = commands_run(backend.client)
        # The rate key's and the totals set's cleanups, on one admission in 16 (the lease
        # ids count up in hex: those ending in 0).
        assert calls.pop("zremrangebyscore") == 2 * requests // 16
        assert calls.pop("evalsha") == requests + 1  # the last release sent alone
        calls.pop("config|resetstat", None)
        assert calls == {
            "time": requests + 1,  # the last release looks at the rate key by itself
            "zcount": 4 * requests,
            "zadd": 5 * requests,
            "pexpire": 3 * requests + 1,
            "pttl": requests,
            "zrem": 4 * requests,
            "zrange": 1,
        }
        assert keys_under(gk, "t") == {"shop/orders/*"}
        assert keys_under(gk, "k") == {"shop/orders/*"}  # its tracked keys (max_keys)
        assert keys_under(gk, "z") == {"shop/orders/c"}  # idle exact keys are gone
        assert keys_under(gk, "d") == set()
    finally:
        gk.close()


def test_exact_limits_totals_come_from_their_own_sets(prefixed: str) -> None:
    """Held, delayed and window-counted requests on limits without a wildcard, from 16
    threads held at a barrier: totals() counts exactly what the threads hold (their own
    tally), agrees with a full count of the keys, and no totals set is written for them."""
    limits = {
        "shop": {"concurrency": 1000},
        "shop/checkout": {"concurrency": 50, "delay": 60.0},
        "shop/pay": {"concurrency": 50, "rate": "1000/minute"},
        "shop/pay/*": {"concurrency": 50},
    }
    gk = keeper(prefixed, limits)
    threads = 16
    holding = threading.Barrier(threads + 1)
    done = threading.Event()
    held: list[str] = []
    lock = threading.Lock()

    def hold(n: int) -> None:
        service = ("checkout", "pay")[n % 2]
        admission = gk.admit("shop", service, f"c{n}")
        with lock:
            held.append(service)
        holding.wait()
        done.wait()
        admission.release(200)

    workers = [threading.Thread(target=hold, args=(n,)) for n in range(threads)]
    try:
        # One checkout ended faulty: its 60 s delay keeps its slot taken.
        gk.admit("shop", "checkout", "x").release(503, faulty=True)
        for worker in workers:
            worker.start()
        holding.wait()
        totals = gk.totals()
        assert totals is not None
        assert totals["shop"].inflight == len(held) + 1
        assert totals["shop/checkout"].inflight == held.count("checkout") + 1
        assert totals["shop/pay"].inflight == held.count("pay")
        assert totals["shop/pay/*"].inflight == held.count("pay")
        assert (totals["shop/pay"].keys, totals["shop/pay"].busy) == (1, 1)
        assert totals["shop/pay/*"].busy == held.count("pay")
        assert [(usage.key, usage.used) for usage in totals["shop/pay"].top] == [
            ("shop/pay", held.count("pay"))
        ]
        counted = full_count(gk)
        for path in limits:
            assert counted[path][0] == totals[path].inflight, path
        assert keys_under(gk, "t") == {"shop/pay/*"}
        done.set()
        for worker in workers:
            worker.join()
        after = gk.totals()
        assert after is not None
        assert (after["shop"].inflight, after["shop/checkout"].inflight) == (1, 1)
        assert (after["shop/pay"].inflight, after["shop/pay"].keys) == (0, 1)  # its window
    finally:
        done.set()
        gk.close()


def test_an_exact_limits_window_leaves_the_totals_with_its_window(prefixed: str) -> None:
    """A limit without a wildcard is tracked while its window is live and not after, with
    nothing in flight (Redis time passes: the test polls)."""
    gk = keeper(prefixed, {"shop/pay": {"rate": "5/second"}})
    try:
        gk.admit("shop", "pay", "c").release(200)
        totals = gk.totals()
        assert totals is not None
        assert (totals["shop/pay"].inflight, totals["shop/pay"].keys) == (0, 1)

        def untracked() -> bool:
            now = gk.totals()
            assert now is not None
            return now["shop/pay"].keys == 0

        wait_until(untracked, what="the window to slide out")
        assert keys_under(gk, "t") == set()
    finally:
        gk.close()


@pytest.mark.parametrize(
    "first",
    ["shop", "shop/work/*"],
    ids=["exact first", "wildcard first"],
)
def test_a_late_admission_after_its_give_back_takes_nothing(prefixed: str, first: str) -> None:
    """A give-back that Redis runs before its admission, on a route whose first slot has a
    wildcard or not: the admission takes nothing anywhere, and the tombstone is counted by
    no limit; the limit then admits its full concurrency."""
    limits = {first: {"concurrency": 10}, "shop/work": {"concurrency": 2}}
    gk = keeper(prefixed, limits)
    try:
        key = "shop" if first == "shop" else "shop/work/c"
        route = [
            Slot(key, gk.config.limits[first], True),
            Slot("shop/work", gk.config.limits["shop/work"], True),
        ]
        assert_late_admission_takes_nothing(gk, route, "stale-lease-2")
        totals = gk.totals()
        assert totals is not None
        assert (totals[first].keys, totals["shop/work"].keys) == (0, 0)
        both = [gk.admit("shop", "work", "c") for _ in range(2)]
        totals = gk.totals()
        assert totals is not None
        assert (totals[first].inflight, totals["shop/work"].inflight) == (2, 2)
        for admission in both:
            admission.release(200)
    finally:
        gk.close()


def test_a_release_sent_again_costs_one_look(own_redis: ControlledRedis) -> None:
    """A release sent again along with an admission, because the sender's call with it was
    still out: if that call had not run, the copy frees the slots; once it has, the copy
    costs one look (a ZSCORE) and changes nothing."""
    gk = keeper(own_redis.url, THREE_LEVELS)
    try:
        backend = redis_backend(gk)
        admission = gk.admit("shop", "orders", "c")
        (release,) = plain_releases(admission)
        copy = release._replace(again=True)
        backend._send([copy])
        assert gk.inflight() == {}
        backend.client.config_resetstat()
        backend._send([copy])
        calls = commands_run(backend.client)
        assert (calls.pop("evalsha"), calls.pop("config|resetstat", 1)) == (1, 1)
        assert calls == {"zscore": 1}
        admission.release(200)  # its own release, later still, does nothing either
        assert gk.inflight() == {}
        totals = gk.totals()
        assert totals is not None
        assert all(totals[path].inflight == 0 for path in THREE_LEVELS)
    finally:
        gk.close()


@pytest.mark.parametrize(
    "form", ["plain", "sent again", "sent again, applied", "give-back", "delayed"]
)
def test_a_release_riding_along_an_admission_of_its_route_frees_its_slots(
    own_redis: ControlledRedis, form: str
) -> None:
    """A release of the route an admission is for, carried by that admission's call (it
    sends no keys of its own: gate.lua reads the admission's), in each form: its slots are
    freed on every level (a delayed release holds them until it matures), the new request
    holds its own, and the totals count what the limits count."""
    gk = keeper(own_redis.url, THREE_LEVELS)
    try:
        backend = redis_backend(gk)
        (release,) = plain_releases(gk.admit("shop", "orders", "c"))
        one = gk.inflight()
        if form == "sent again":
            release = release._replace(again=True)
        elif form == "sent again, applied":
            backend._send([release])
            release = release._replace(again=True)
        elif form == "give-back":
            release = release._replace(tombstone=backend._hold_us)
        elif form == "delayed":
            release = release._replace(delay=60.0, placed=time.monotonic())
        answer, _ = backend._run([release], release.input, "next-lease")
        assert answer == 1
        held = 2 if form == "delayed" else 1
        assert gk.inflight() == {path: count * held for path, count in one.items()}
        totals = gk.totals()
        assert totals is not None
        assert all(totals[path].inflight == held for path in THREE_LEVELS)
        backend._send([release._replace(lease="next-lease", again=False, tombstone=0, delay=0.0)])
        assert gk.inflight() == ({} if held == 1 else one)
    finally:
        gk.close()
