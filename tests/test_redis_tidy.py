"""Leases tidy on Redis (issue 19 point 4): a matured delayed release leaves nothing behind
longer than its delay plus a millisecond, even on a key that had other requests in flight
when it was placed, and an admission that a frozen Redis runs only after its give-back takes
nothing. Against real redis-server processes; expiries are read with PTTL (Redis's clock),
and where Redis time must pass the test polls until a deadline."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import Admission, GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.backends.base import Slot  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend, _RedisGrant, _Release, _text  # noqa: E402
from tests.servers import ControlledRedis, wait_until  # noqa: E402
from tests.test_redis import admitted, keeper, outcome  # noqa: E402

pytestmark = pytest.mark.redis


def redis_backend(gk: GateKeeper) -> RedisBackend:
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    return backend


def plain_releases(*admissions: Admission) -> list[_Release]:
    """The plain releases the sender would send for ``admissions``, made by hand: a test
    sends them again, or pretends they are out."""
    grants = [admission._held[0] for admission in admissions]
    return [
        _Release(grant.lease, grant.input, grant.input.codes, 0.0, 0.0)
        for grant in grants
        if isinstance(grant, _RedisGrant)
    ]


def life_left(gk: GateKeeper, path: str) -> int:
    """PTTL of a concrete path's set (ms; -2 when it is gone), once the releases waiting
    in the process were sent."""
    backend = redis_backend(gk)
    backend._outbox.flush()
    return int(backend.client.pttl(backend.key_of(path)))


def assert_late_admission_takes_nothing(gk: GateKeeper, route: list[Slot], lease: str) -> None:
    """Give back ``lease``'s admission of ``route`` first, then run the admission (the
    order a frozen Redis may run them in): it is refused and nothing is held or counted."""
    backend = redis_backend(gk)
    packed = backend._input(route)
    backend._send([_Release(lease, packed, packed.codes, 0.0, 0.0, backend._hold_us)])
    answer, _ = backend._run([], packed, lease)  # the late admission
    assert answer != 1 and answer[0] == 0
    assert gk.inflight() == {}
    totals = gk.totals()
    assert totals is not None
    assert all(totals[slot.limit.path].inflight == 0 for slot in route)


def freezable_keeper(own_redis: ControlledRedis, concurrency: int, options: str = "") -> GateKeeper:
    """A keeper of ``shop/work`` on ``own_redis`` with short timeouts (a frozen Redis fails
    a call in 0.2 s), refusing on backend errors; connected and its script loaded."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05{options}",
        {"shop/work": {"concurrency": concurrency}},
        on_backend_error="reject",
    )
    gk.admit("shop", "work", "c").release(200)
    return gk


def admissions_in_a_freeze(
    own_redis: ControlledRedis, gk: GateKeeper, count: int, warm: bool = False
) -> list[str]:
    """``count`` threads each admit (and release) a request of shop/work at once while
    Redis is frozen, each first admitting one before the freeze when ``warm`` (its
    connection then open, its call sent into the frozen Redis); their outcomes, once Redis
    thawed and their give-backs were sent."""
    barrier = threading.Barrier(count + 1)
    frozen = threading.Event()
    outcomes: list[str] = []

    def request() -> None:
        if warm:
            gk.admit("shop", "work", "c").release(200)
        barrier.wait()
        frozen.wait()
        outcomes.append(outcome(gk))

    threads = [threading.Thread(target=request) for _ in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    own_redis.pause()
    try:
        frozen.set()
        for thread in threads:
            thread.join()
    finally:
        own_redis.resume()
    backend = redis_backend(gk)
    wait_until(lambda: backend.pending_releases() == 0, what="the give-backs to be sent")
    return outcomes


def assert_admits_exactly(
    gk: GateKeeper,
    count: int,
    path: tuple[str, str] = ("work", "c"),
    refused_with: str = "GK-CONCURRENCY-LIMIT",
) -> None:
    """``path`` (service, caller) of project shop admits ``count`` requests at once, the
    first once Redis answers again, and refuses one more (``refused_with``); all are
    released after."""
    held = [wait_until(lambda: admitted(gk, *path), what="an admission by Redis")]
    held += [gk.admit("shop", *path) for _ in range(count - 1)]
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", *path)
    assert refused.value.code == refused_with
    for admission in held:
        admission.release(200)


def test_a_delayed_release_on_a_busy_key_lives_by_its_delay(prefixed: str) -> None:
    """Two requests in flight on one key; the first ends faulty (60 s delay), the second
    ends well: the key then lives 60 s (its pending delayed release), not max_hold (300 s)
    after the second's admission."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 5, "delay": 60}})
    try:
        first, second = gk.admit("shop", "work", "c"), gk.admit("shop", "work", "c")
        first.release(503, faulty=True)
        assert life_left(gk, "shop/work") > 60_001  # the second's lease still needs it
        second.release(200)
        assert 59_000 < life_left(gk, "shop/work") <= 60_001
        assert gk.inflight() == {"shop/work": 1}  # the delayed release holds its slot
    finally:
        gk.close()


def test_a_matured_delayed_release_on_a_busy_key_leaves_nothing(prefixed: str) -> None:
    """Requests keep a key busy while short delayed releases (50 ms) are placed on it and
    mature; once the last request ends, the key is gone within the delay (+1 ms), not
    max_hold later, and the limit counts nothing."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 50, "delay": 0.05}})
    try:
        held = [gk.admit("shop", "work", "c") for _ in range(5)]
        for _ in range(20):
            gk.admit("shop", "work", "c").release(500, faulty=True)
        for admission in held:
            admission.release(200)
        assert 0 < life_left(gk, "shop/work") <= 51
        wait_until(lambda: life_left(gk, "shop/work") == -2, what="the key to go")
        assert gk.inflight() == {}
        totals = gk.totals()
        assert totals is not None and totals["shop/work"].inflight == 0
    finally:
        gk.close()


@pytest.mark.parametrize(
    ("limits", "path"),
    [
        ({"shop/work": {"concurrency": 5, "delay": 60}}, "shop/work"),
        ({"shop/work/*": {"concurrency": 5, "rate": "100/second", "delay": 60}}, "shop/work/c"),
    ],
    ids=["concurrency", "rate"],
)
def test_a_delayed_release_riding_along_an_admission_on_its_key_lives_by_its_delay(
    prefixed: str, limits: dict[str, Any], path: str
) -> None:
    """A faulty request's delayed release (60 s) carried by the next admission on its key,
    in one script call: once that next request ends well, the key lives by the pending
    delay (60 s), not max_hold (300 s), and the delay still holds its slot."""
    gk = keeper(prefixed, limits)
    try:
        backend = redis_backend(gk)
        first = gk.admit("shop", "work", "c")
        (release,) = plain_releases(first)
        delayed = release._replace(delay=60.0, placed=time.monotonic())
        (limit,) = gk.config.limits.values()
        route = [Slot(path, limit, True)]
        answer, _ = backend._run([delayed], backend._input(route), "next-lease")
        assert answer == 1
        assert gk.inflight() == {path: 2}
        (after,) = (item._replace(lease="next-lease") for item in plain_releases(first))
        backend._send([after])
        assert 59_000 < life_left(gk, path) <= 60_001
        assert gk.inflight() == {path: 1}
    finally:
        gk.close()


@pytest.mark.parametrize("delayed_first", [True, False], ids=["delayed first", "plain first"])
def test_a_delayed_and_a_plain_release_of_one_key_in_one_call(
    prefixed: str, delayed_first: bool
) -> None:
    """The last two requests on a key end in one batch, one faulty (60 s delay), one well:
    in either order the key then lives by the pending delay (60 s), not max_hold (300 s),
    and the delay holds its slot."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 5, "delay": 60}})
    try:
        backend = redis_backend(gk)
        faulty, good = plain_releases(gk.admit("shop", "work", "c"), gk.admit("shop", "work", "c"))
        faulty = faulty._replace(delay=60.0, placed=time.monotonic())
        backend._send([faulty, good] if delayed_first else [good, faulty])
        assert 59_000 < life_left(gk, "shop/work") <= 60_001
        assert gk.inflight() == {"shop/work": 1}
    finally:
        gk.close()


def test_a_rate_key_with_a_pending_delay_lives_by_the_longer(prefixed: str) -> None:
    """A rate-limited key whose request ended faulty with a delay longer than its window
    lives by the delay; with a shorter delay, by its window."""
    gk = keeper(
        prefixed,
        {
            "shop/slow/*": {"rate": "100/second", "concurrency": 5, "delay": 30},
            "shop/fast/*": {"rate": "100/minute", "concurrency": 5, "delay": 1},
        },
    )
    try:
        for service in ("slow", "fast"):
            first, second = gk.admit("shop", service, "c"), gk.admit("shop", service, "c")
            first.release(503, faulty=True)
            second.release(200)
        assert 29_000 < life_left(gk, "shop/slow/c") <= 30_001
        assert 59_000 < life_left(gk, "shop/fast/c") <= 60_001
    finally:
        gk.close()


def test_an_admission_run_after_its_give_back_takes_nothing(prefixed: str) -> None:
    """The order a frozen Redis may run things in, forced: the give-back of an admission
    whose answer never came arrives first, the admission after it. The admission takes no
    slot (the limit admits its full concurrency at once) and counts in no totals."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 2}, "shop": {"concurrency": 10}})
    try:
        backend = redis_backend(gk)
        route = [
            Slot("shop", gk.config.limits["shop"], True),
            Slot("shop/work", gk.config.limits["shop/work"], True),
        ]
        assert_late_admission_takes_nothing(gk, route, "stale-lease-1")
        both = [gk.admit("shop", "work", "c"), gk.admit("shop", "work", "c")]
        with pytest.raises(Rejected):
            gk.admit("shop", "work", "c")
        for admission in both:
            admission.release(200)
        # The tombstone lives as long as the lease would have (in the route's first set,
        # which the releases keep for it), and holds nothing.
        life = backend.client.pttl(backend.key_of("shop"))
        assert 290_000 < life <= 300_001
    finally:
        gk.close()


def test_admissions_lost_in_a_freeze_leak_no_slot(own_redis: ControlledRedis) -> None:
    """Redis frozen (SIGSTOP) while threads admit: their calls time out, their leases are
    given back; after the thaw, whichever order Redis runs the queued admissions and
    give-backs in, no slot stays taken: the limit admits its full concurrency."""
    gk = freezable_keeper(own_redis, 4)
    try:
        assert admissions_in_a_freeze(own_redis, gk, 4) == ["GK-BACKEND-UNAVAILABLE"] * 4
        assert_admits_exactly(gk, 4)
    finally:
        gk.close()


@pytest.mark.parametrize("ends_first", [0, 1], ids=["first ends first", "second ends first"])
def test_a_rate_key_keeps_its_life_for_a_request_in_flight(prefixed: str, ends_first: int) -> None:
    """Two requests in flight on one rate-limited key: when one ends (its release applied
    twice, as after a lost answer), the key still lives max_hold for the other, not just its
    1 s window; once both ended, it lives by its window, however often a release is replayed."""
    gk = keeper(prefixed, {"shop/work/*": {"concurrency": 5, "rate": "100/second"}})
    try:
        backend = redis_backend(gk)
        both = [gk.admit("shop", "work", "c"), gk.admit("shop", "work", "c")]
        replays = plain_releases(*both)
        both[ends_first].release(200)
        backend._send([replays[ends_first]])
        assert life_left(gk, "shop/work/c") > 290_000
        assert gk.inflight() == {"shop/work/c": 1}
        both[1 - ends_first].release(200)
        assert 0 < life_left(gk, "shop/work/c") <= 1_001
        backend._send(replays)
        assert 0 < life_left(gk, "shop/work/c") <= 1_001
        assert gk.inflight() == {}
    finally:
        gk.close()


def test_a_tombstone_on_a_rate_key_outlives_later_requests(prefixed: str) -> None:
    """A give-back's tombstone in a rate-limited first set: later requests' releases do not
    cut the set's life to its 1 s window, and the late admission still takes nothing."""
    gk = keeper(prefixed, {"shop/work/*": {"concurrency": 3, "rate": "100/second"}})
    try:
        route = [Slot("shop/work/c", gk.config.limits["shop/work/*"], True)]
        assert_late_admission_takes_nothing(gk, route, "stale-lease-3")
        for _ in range(3):
            gk.admit("shop", "work", "c").release(200)
        assert 290_000 < life_left(gk, "shop/work/c") <= 300_001
        backend = redis_backend(gk)
        answer, _ = backend._run([], backend._input(route), "stale-lease-3")
        assert answer != 1 and answer[0] == 0
        assert_admits_exactly(gk, 3)
    finally:
        gk.close()


def test_a_freeze_longer_than_max_hold_leaks_no_slot(own_redis: ControlledRedis) -> None:
    """Redis frozen (SIGSTOP) for longer than max_hold (2 s) while admissions' answers are
    lost: a give-back's tombstone lives max_hold from when Redis runs it, after the thaw, so
    whichever order Redis runs the queued admissions and give-backs in, no slot stays taken:
    the full concurrency is admitted as soon as the give-backs are answered."""
    gk = freezable_keeper(own_redis, 2, "&max_hold=2")
    try:
        backend = redis_backend(gk)
        own_redis.pause()
        try:
            for _ in range(2):
                with pytest.raises(Rejected) as refused:
                    gk.admit("shop", "work", "c")
                assert refused.value.code == "GK-BACKEND-UNAVAILABLE"
            # Redis time must pass max_hold while the admissions wait in it.
            thaw = time.monotonic() + 2.5
            wait_until(lambda: time.monotonic() > thaw, what="max_hold to pass, frozen")
        finally:
            own_redis.resume()
        wait_until(lambda: backend.pending_releases() == 0, what="the give-backs to be sent")
        assert_admits_exactly(gk, 2)
    finally:
        gk.close()


@pytest.mark.parametrize("rate", [None, "100/second"], ids=["no rate", "rate"])
@pytest.mark.parametrize("limit_path", ["shop/work", "shop/work/*"], ids=["exact", "wildcard"])
def test_a_matured_delayed_release_leaves_no_key_past_its_delay(
    prefixed: str, limit_path: str, rate: str | None
) -> None:
    """Other callers came and went (their rate windows, 1 s, still live), then a request
    ends faulty with a 2 s delay and nothing else is live: every key under the prefix,
    whatever its kind (the path's set with its ``<lease>:d``, a wildcard's totals and
    delayed sets, the windows, the marks they carry), expires by Redis's own PTTL within
    the delay + 1 ms, though its admissions gave them max_hold (300 s)."""
    settings: dict[str, Any] = {"concurrency": 5, "delay": 2}
    if rate is not None:
        settings["rate"] = rate
    gk = keeper(prefixed, {limit_path: settings})
    try:
        backend = redis_backend(gk)
        for index in range(3):
            gk.admit("shop", "work", f"other{index}").release(200)
        faulty = gk.admit("shop", "work", "c")
        concrete = "shop/work" if limit_path == "shop/work" else "shop/work/c"
        assert life_left(gk, concrete) > 290_000  # the lease's max_hold
        faulty.release(503, faulty=True)
        backend._outbox.flush()
        assert gk.inflight() == {concrete: 1}  # the delayed release holds its slot
        lives = {
            _text(key): int(backend.client.pttl(key))
            for key in backend.client.scan_iter(match=f"{backend.prefix}:*")
        }
        kinds = {key.split("}:", 1)[1].split(":", 1)[0] for key in lives}
        # Every kind of key a delayed release touches is there (a wildcard's totals set
        # without a rate was emptied of its last lease: gone; its tracked set holds the
        # delayed key), and none outlives it.
        expected = (
            {"z"}
            if limit_path == "shop/work"
            else {"z", "d", "t", "k"}
            if rate
            else {"z", "d", "k"}
        )
        assert kinds == expected
        assert all(0 < life <= 2_001 for life in lives.values()), lives
    finally:
        gk.close()


def test_requests_refused_in_a_freeze_leave_no_rate_window_entry(
    own_redis: ControlledRedis,
) -> None:
    """Requests whose admissions time out in a frozen Redis are refused (they never run);
    Redis runs the queued admissions once it thaws, and their give-backs then take their
    rate window entries out too: the caller has the rest of its window, not less."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05",
        {"shop/work": {"rate": "5/hour"}},
        on_backend_error="reject",
    )
    try:
        # Two admitted before the freeze: 3 of 5 left.
        refused = admissions_in_a_freeze(own_redis, gk, 2, warm=True)
        assert refused == ["GK-BACKEND-UNAVAILABLE"] * 2
        assert_admits_exactly(gk, 3, refused_with="GK-RATE-LIMIT")
    finally:
        gk.close()
