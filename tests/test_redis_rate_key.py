"""A rate-limited key on Redis without marks (issue 19 point 3): its releases always look at
what is left, so a request still in flight keeps the key alive for its whole max_hold
whatever the order of the releases before it; and its slid-out window entries and ended
leases, dropped on one admission in 16 only, are never counted. Against a real
redis-server; expiries are read with PTTL (Redis's clock), and where Redis time must pass
the test polls until a deadline."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import Rejected  # noqa: E402
from gatekeeper_wsgi.backends import redis as redis_module  # noqa: E402
from gatekeeper_wsgi.backends.base import Slot  # noqa: E402
from tests.servers import wait_until  # noqa: E402
from tests.test_redis import keeper  # noqa: E402
from tests.test_redis_tidy import life_left, plain_releases, redis_backend  # noqa: E402
from tests.test_redis_totals import commands_run  # noqa: E402

pytestmark = pytest.mark.redis

RATE_AND_CONCURRENCY = {"shop/work/*": {"concurrency": 5, "rate": "100/second"}}


def lease_numbers(pruning: bool) -> Iterator[int]:
    """Lease numbers whose hex form ends in 0 (every admission cleans up) or never does."""
    return (n for n in itertools.count(1) if (n % 16 == 0) == pruning)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_a_rate_key_lives_max_hold_while_any_request_is_in_flight(
    prefixed: str, order: tuple[int, ...]
) -> None:
    """Three requests in flight on one rate-limited key (the first admitted alone), released
    in every order and each release sent twice: while one is still in flight the key lives
    its max_hold (300 s), not its 1 s window; after the last, it lives by its window."""
    gk = keeper(prefixed, RATE_AND_CONCURRENCY)
    try:
        backend = redis_backend(gk)
        held = [gk.admit("shop", "work", "c") for _ in range(3)]
        replays = plain_releases(*held)
        for done, index in enumerate(order, start=1):
            held[index].release(200)
            backend._send([replays[index]])
            if done < 3:
                assert life_left(gk, "shop/work/c") > 290_000
                assert gk.inflight() == {"shop/work/c": 3 - done}
        assert 0 < life_left(gk, "shop/work/c") <= 1_001
        assert gk.inflight() == {}
    finally:
        gk.close()


def wait_for_the_window_to_slide_out(client: redis.Redis, key: str) -> None:
    """Poll Redis's clock until the newest window entry of ``key`` (scored MINUS its
    admission time, µs) is more than a second old."""
    newest = -client.zrange(key, 0, 0, withscores=True)[0][1]

    def now_us() -> int:
        seconds, micros = client.time()
        return int(seconds) * 1_000_000 + int(micros)

    wait_until(lambda: now_us() > newest + 1_000_000, what="the window to slide out")


@pytest.mark.parametrize("pruning", [False, True], ids=["never cleaned", "always cleaned"])
def test_a_rate_window_counts_only_live_entries(
    prefixed: str, pruning: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5/second window filled, slid out and filled again while a request in flight keeps the
    key alive, with the cleanup never run (lease ids that do not end in 0) or run by every
    admission: each time exactly 5 are admitted and the sixth is refused, retry within the
    window; with no cleanup the slid-out entries stay in the set and are not counted."""
    monkeypatch.setattr(redis_module, "_sequence", lease_numbers(pruning))
    gk = keeper(prefixed, {"shop/work/*": {"rate": "5/second"}})
    try:
        backend = redis_backend(gk)
        key = backend.key_of("shop/work/c")
        route = [Slot("shop/work/c", gk.config.limits["shop/work/*"], True)]
        holder = gk.admit("shop", "work", "c")  # its lease keeps the key for max_hold
        wait_for_the_window_to_slide_out(backend.client, key)
        for round_ in range(3):
            for _ in range(5):
                gk.admit("shop", "work", "c").release(200)
            with pytest.raises(Rejected) as refused:
                gk.admit("shop", "work", "c")
            assert refused.value.code == "GK-RATE-LIMIT"
            # A peek's answer: refused by the rate (kind 2), retry in µs of the oldest live
            # entry, never of a slid-out one left in the set.
            answer, _ = backend._run([], backend._input(route), "")
            assert answer[2] == 2 and 0 < answer[3] <= 1_000_000
            # The holder's lease, and with no cleanup its window entry and every round's.
            assert backend.client.zcard(key) == (1 + 5 if pruning else 2 + 5 * (round_ + 1))
            wait_for_the_window_to_slide_out(backend.client, key)
        assert gk.inflight() == {"shop/work/c": 1}
        holder.release(200)
        assert gk.inflight() == {}
    finally:
        gk.close()


def test_a_full_concurrency_on_a_rate_key_skips_ended_leases(prefixed: str) -> None:
    """Leases left unreleased past a short max_hold on a rate-limited key (as a crashed
    holder's), with no cleanup run: once they ended the key admits its full concurrency
    again, and refuses one more."""
    url = f"{prefixed}&max_hold=0.3"
    gk = keeper(url, RATE_AND_CONCURRENCY)
    crashed = keeper(url, RATE_AND_CONCURRENCY)
    try:
        for _ in range(5):
            crashed.admit("shop", "work", "c")  # never released
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "c")
        assert refused.value.code == "GK-CONCURRENCY-LIMIT"
        # All five ended, not only the first (admitted one after another, they end so: on
        # a loaded machine tens of ms apart); the read counts live leases, dropping none.
        wait_until(lambda: "shop/work/c" not in gk.inflight(), what="the crashed leases to end")
        held = [gk.admit("shop", "work", "c") for _ in range(5)]
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "c")
        assert refused.value.code == "GK-CONCURRENCY-LIMIT"
        for admission in held:
            admission.release(200)
    finally:
        gk.close()
        crashed.close()


def test_a_release_riding_along_an_admission_on_its_key_makes_no_look(prefixed: str) -> None:
    """A rate key's release carried by the next admission on the same key (as under
    gunicorn, where a process's releases ride along with its next request): the call makes
    no look at what is left (the admission's expiry covers it), the key lives max_hold for
    the new request, and once that one ends alone, by its 1 s window."""
    gk = keeper(prefixed, RATE_AND_CONCURRENCY)
    try:
        backend = redis_backend(gk)
        first = gk.admit("shop", "work", "c")
        (release,) = plain_releases(first)
        route = [Slot("shop/work/c", gk.config.limits["shop/work/*"], True)]
        backend.client.config_resetstat()
        answer, _ = backend._run([release], backend._input(route), "next-lease")
        assert answer == 1
        calls = commands_run(backend.client)
        assert "zrange" not in calls and calls["pexpire"] == 1  # the admission's own
        assert life_left(gk, "shop/work/c") > 290_000
        assert gk.inflight() == {"shop/work/c": 1}
        (after,) = (item._replace(lease="next-lease") for item in plain_releases(first))
        backend._send([after])
        assert 0 < life_left(gk, "shop/work/c") <= 1_001
        assert gk.inflight() == {}
    finally:
        gk.close()


@pytest.mark.parametrize("then", ["refused", "peek", "another key", "nothing"])
def test_a_released_rate_key_lives_by_its_window_whatever_follows(prefixed: str, then: str) -> None:
    """A rate key's last release carried by a call that takes no slot on that key (an
    admission its full window refuses, a peek, an admission elsewhere, or no admission):
    the key's life is still cut from max_hold to its 1 s window."""
    limits = {
        "shop/work/*": {"concurrency": 5, "rate": "1/second"},
        "shop/other": {"concurrency": 5},
    }
    gk = keeper(prefixed, limits)
    try:
        backend = redis_backend(gk)
        first = gk.admit("shop", "work", "c")
        assert life_left(gk, "shop/work/c") > 290_000
        (release,) = plain_releases(first)
        work = backend._input([Slot("shop/work/c", gk.config.limits["shop/work/*"], True)])
        other = backend._input([Slot("shop/other", gk.config.limits["shop/other"], True)])
        if then == "refused":
            answer, _ = backend._run([release], work, "next-lease")
            assert answer != 1 and answer[0] == 0  # its one entry fills the window
        elif then == "peek":
            backend._run([release], work, "")
        elif then == "another key":
            assert backend._run([release], other, "next-lease")[0] == 1
        else:
            backend._run([release], None, "")
        assert 0 < life_left(gk, "shop/work/c") <= 1_001
        assert "shop/work/c" not in gk.inflight()
    finally:
        gk.close()
