"""Per-limit totals kept in Redis (SPEC §7, issue 15 point 5): the totals sets the scripts
maintain agree with a full count of the keys, follow a crashed holder's lease expiry, show a
locked-out key's window, and are read without SCAN in commands that do not grow with the
keys Redis tracks. Against a real redis-server; Redis time is waited for by polling."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from gatekeeper_wsgi import GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.prometheus import register  # noqa: E402
from gatekeeper_wsgi.status import status_payload  # noqa: E402
from tests.servers import wait_until  # noqa: E402
from tests.test_totals_backends import SETTINGS, check_kept_totals, full_count  # noqa: E402

pytestmark = pytest.mark.redis


@pytest.fixture
def keeper(prefixed: str) -> Iterator[GateKeeper]:
    """A GateKeeper on the session redis-server under a prefix of its own."""
    gk = GateKeeper({**SETTINGS, "backend": prefixed})
    yield gk
    gk.close()


def commands_run(server: Any) -> dict[str, int]:
    """Calls per command so far (INFO commandstats), scripts' own commands included."""
    return {
        name.removeprefix("cmdstat_"): int(stats["calls"])
        for name, stats in server.info("commandstats").items()
    }


def test_kept_totals_agree_with_a_full_count(keeper: GateKeeper) -> None:
    """After held, released and delayed requests on exact and wildcard limits, the totals
    Redis keeps equal what a SCAN over every key counts; released keys leave no trace."""
    check_kept_totals(keeper)
    after = keeper.totals()
    assert after is not None
    assert after["shop/search/*"].keys == 0  # nothing in flight, no window: nothing tracked


def test_a_locked_out_key_reports_its_window(keeper: GateKeeper) -> None:
    """A key refused by its rate limit, with nothing in flight, is detailed under its own
    limit with its window use and when a place frees; the exact limit next to it shows its
    own key."""
    keeper.admit("shop", "login", "mallory").release(200)
    keeper.admit("shop", "login", "mallory").release(200)
    with pytest.raises(Rejected):
        keeper.admit("shop", "login", "mallory")
    keeper.admit("shop", "login", "admin").release(200)
    totals = keeper.totals()
    assert totals is not None
    login = {usage.key: usage for usage in totals["shop/login/*"].top}
    assert set(login) == {"shop/login/mallory"}  # watched: refused lately
    mallory = login["shop/login/mallory"]
    assert (mallory.inflight, mallory.used) == (0, 2)
    assert 55 < mallory.resets_in <= 60
    assert totals["shop/login/*"].keys == 1  # its window keeps it tracked
    admin = totals["shop/login/admin"].top
    assert [(usage.key, usage.used) for usage in admin] == [("shop/login/admin", 1)]


def test_a_given_back_reservation_leaves_the_window_count(prefixed: str) -> None:
    """A limit that counts only some statuses: a response not counted gives its window
    entry back, and the key is no longer tracked for its window."""
    gk = GateKeeper(
        {
            "project": "shop",
            "backend": prefixed,
            "limits": {"shop/login/*": {"rate": "3/minute", "count": [401]}},
        }
    )
    try:
        gk.admit("shop", "login", "eve").release(401)
        gk.admit("shop", "login", "bob").release(200)  # not counted: given back
        totals = gk.totals()
        assert totals is not None
        assert totals["shop/login/*"].keys == 1
    finally:
        gk.close()


def test_a_crashed_workers_leases_leave_the_totals(prefixed: str) -> None:
    """A worker SIGKILLed with requests in flight: the totals count them until their
    leases expire (max_hold), then not, without anyone releasing them."""
    url = f"{prefixed}&max_hold=0.5"
    settings = {**SETTINGS, "backend": url}
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: hold three requests, say so, wait to be killed
        try:
            child = GateKeeper(settings)
            held = [child.admit("shop", "search", f"w{n}") for n in range(3)]
            os.write(ready_write, b"x")
            signal.pause()
            del held
        finally:
            os._exit(0)
    gk = GateKeeper(settings)
    try:
        assert os.read(ready_read, 1) == b"x"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        before = gk.totals()
        assert before is not None
        # Either still counted, or (on a slow machine) already expired: never more.
        assert before["shop/search/*"].inflight in (0, 3)

        def expired() -> bool:
            totals = gk.totals()
            assert totals is not None
            return totals["shop/search/*"].inflight == 0 and totals["shop"].inflight == 0

        wait_until(expired, what="the killed worker's leases to expire")
        after = gk.totals()
        assert after is not None
        assert (after["shop/search/*"].busy, after["shop/search/*"].keys) == (0, 0)
        assert full_count(gk).get("shop/search/*", (0, 0)) == (0, 0)
    finally:
        gk.close()


def test_reading_totals_costs_the_same_with_10000_keys(prefixed: str, redis_server: str) -> None:
    """10 000 keys tracked in their windows: a status JSON and a scrape read the totals
    without SCAN, in as many commands as with 20 keys, and count every key."""
    limits = {
        "shop/search/*": {"concurrency": 4, "rate": "1000/minute"},
        **{f"shop/svc{n}": {"concurrency": 10} for n in range(20)},
    }
    server = redis.Redis.from_url(redis_server)
    gk = GateKeeper({"project": "shop", "backend": prefixed, "limits": limits})
    try:
        registry = CollectorRegistry()
        collector = register(gk, registry, multiprocess=False)

        def reading_cost(keys: int) -> dict[str, int]:
            held = [gk.admit("shop", "search", f"h{n}") for n in range(5)]
            # The admissions took the waiting releases along; a call of the release sender
            # still out (a preempted thread lets it fire) would land in one count only.
            wait_until(lambda: gk.backend.pending_releases() == 0, what="the sender's call")
            before = commands_run(server)
            payload = status_payload(gk)
            generate_latest(registry)
            after = commands_run(server)
            search = next(
                limit for limit in payload["config"]["limits"] if limit["path"] == "shop/search/*"
            )
            assert (search["tracked"], search["inflight"], search["keys"]) == (keys + 5, 5, 5)
            for admission in held:
                admission.release(200)
            return {
                name: after[name] - before.get(name, 0)
                for name in after
                if after[name] != before.get(name, 0)
            }

        for index in range(20):
            gk.admit("shop", "search", f"c{index}").release(200)
        reading_cost(20)  # the first read loads the totals script (SCRIPT LOAD, EVALSHA again)
        small = reading_cost(20)
        for index in range(20, 10_000):
            gk.admit("shop", "search", f"c{index}").release(200)
        large = reading_cost(10_000)
        assert "scan" not in large
        assert large == small
        collector.close()
    finally:
        gk.close()
        server.close()
