"""Per-limit totals (SPEC §7): status JSON and Prometheus read what the backends keep per
limit, so their cost follows the number of limits, not of tracked keys."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.test import EnvironBuilder

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.monitor import REFUSED_KEYS
from gatekeeper_wsgi.status import KEYS_SHOWN_PER_LIMIT, StatusApp, inflight_by_limit, limit_of
from tests.conftest import FakeClock

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 1000},
        "shop/login/*": {"rate": "2/minute"},
        "shop/partner/*": {"concurrency": 1},
    },
}


@pytest.fixture
def keeper(clock: FakeClock) -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper on the fake clock."""
    gk = GateKeeper(SETTINGS, clock=clock)
    yield gk
    gk.close()


def test_refused_keys_are_remembered_per_limit_and_bounded(keeper: GateKeeper) -> None:
    """A spray of refused keys leaves at most REFUSED_KEYS per limit, the latest ones."""
    for index in range(REFUSED_KEYS * 5):
        key = f"sprayer{index}"
        keeper.admit("shop", "login", key).release(200)
        keeper.admit("shop", "login", key).release(200)
        with pytest.raises(Rejected):
            keeper.admit("shop", "login", key)
    refused = keeper.monitor.refused_keys()["shop/login/*"]
    assert len(refused) == REFUSED_KEYS
    assert refused[-1] == f"shop/login/sprayer{REFUSED_KEYS * 5 - 1}"


SPRAYED = 100_000


def many_limits(count: int, max_keys: int = SPRAYED) -> dict[str, Any]:
    """`count` limits: the project, a sprayed wildcard, a rate wildcard and fillers."""
    limits: dict[str, Any] = {
        "shop": {"concurrency": 10_000},
        "shop/search/*": {"concurrency": 5, "max_keys": max_keys},
        "shop/login/*": {"rate": "2/minute"},
    }
    for index in range(count - len(limits)):
        limits[f"shop/svc{index}"] = {"concurrency": 3}
    return {"project": "shop", "limits": limits}


def status_of(gk: GateKeeper) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(b"".join(StatusApp(gk, token="t")(*request("/status.json"))))
    return data


def request(path: str) -> tuple[dict[str, Any], Any]:
    environ = EnvironBuilder(path=path, headers=[("Authorization", "Bearer t")]).get_environ()
    return environ, lambda status, headers, exc_info=None: None


def test_status_with_100000_tracked_keys_returns_totals(clock: FakeClock) -> None:
    """With 100 000 keys tracked under one wildcard and 200 limits, the status JSON gives
    each limit's totals (keys tracked, in flight, keys in flight) and details only the
    busiest keys; Prometheus reports the same totals."""
    gk = GateKeeper(many_limits(200), clock=clock)
    try:
        for index in range(SPRAYED):
            gk.admit("shop", "search", f"c{index}").release(200)
        held = [gk.admit("shop", "search", "c7") for _ in range(3)]
        held += [gk.admit("shop", "search", f"c{index}") for index in range(100, 160)]
        held.append(gk.admit("shop", "svc3", "x"))
        data = status_of(gk)
        limits = {limit["path"]: limit for limit in data["config"]["limits"]}
        assert len(limits) == 200
        search = limits["shop/search/*"]
        assert search["tracked"] == SPRAYED
        assert search["inflight"] == 63
        assert search["keys"] == 61
        assert search["keys_shown"] == KEYS_SHOWN_PER_LIMIT
        assert data["inflight"]["shop/search/c7"]["inflight"] == 3
        assert limits["shop"]["inflight"] == 64
        assert limits["shop/svc3"]["inflight"] == 1
        assert len(data["inflight"]) < 300  # per-key detail is bounded, not 100 000 entries
        scraped = prometheus_text(gk)
        assert 'gatekeeper_inflight{level="caller",limit="shop/search/*"} 63.0' in scraped
        assert 'gatekeeper_inflight_keys{limit="shop/search/*"} 61.0' in scraped
        for admission in held:
            admission.release(200)
        after = {limit["path"]: limit for limit in status_of(gk)["config"]["limits"]}
        assert after["shop/search/*"]["inflight"] == 0
        assert after["shop/search/*"]["tracked"] == SPRAYED
    finally:
        gk.close()


def prometheus_text(gk: GateKeeper) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from gatekeeper_wsgi.prometheus import register

    registry = CollectorRegistry()
    collector = register(gk, registry, multiprocess=False)
    try:
        return generate_latest(registry).decode()
    finally:
        collector.close()


def test_a_locked_out_client_shows_its_rate_use(keeper: GateKeeper, clock: FakeClock) -> None:
    """A client locked out by a rate limit, with nothing in flight, is listed with its
    window use: 2 used, 0 remaining, and when the window frees a place."""
    keeper.admit("shop", "login", "mallory").release(200)
    clock.advance(10)
    keeper.admit("shop", "login", "mallory").release(200)
    for _ in range(3):
        with pytest.raises(Rejected):
            keeper.admit("shop", "login", "mallory")
    entry = status_of(keeper)["inflight"]["shop/login/mallory"]
    assert entry == {
        "inflight": 0,
        "limit": "shop/login/*",
        "concurrency": None,
        "rate": "2/minute",
        "used": 2,
        "remaining": 0,
        "resets_in": 50.0,
    }
    clock.advance(51)
    later = status_of(keeper)["inflight"]["shop/login/mallory"]
    assert (later["used"], later["remaining"]) == (1, 1)


def test_delayed_releases_stay_in_the_totals_until_due(clock: FakeClock) -> None:
    """A faulty response's slot, held for its delay, is counted until the delay passes."""
    settings = {"project": "shop", "limits": {"shop/api/*": {"concurrency": 2, "delay": 5.0}}}
    gk = GateKeeper(settings, clock=clock)
    try:
        gk.admit("shop", "api", "crm").release(500, faulty=True)
        totals = gk.totals()
        assert totals is not None
        assert totals["shop/api/*"].inflight == 1 and totals["shop/api/*"].busy == 1
        clock.advance(5.0)
        totals = gk.totals()
        assert totals is not None and totals["shop/api/*"].inflight == 0
    finally:
        gk.close()


def test_totals_agree_with_a_full_count_under_many_threads(clock: FakeClock) -> None:
    """While 32 threads hold requests on 8 keys (a barrier keeps them in flight), the kept
    totals equal what the threads hold, and what a full inflight() count groups to."""
    gk = GateKeeper(many_limits(10, max_keys=1000), clock=clock)
    threads = 32
    holding = threading.Barrier(threads + 1)
    done = threading.Event()
    admitted: list[int] = []

    def client(index: int) -> None:
        try:
            admission = gk.admit("shop", "search", f"k{index % 8}")
        except Rejected:
            holding.wait()
            return
        admitted.append(index)
        holding.wait()
        done.wait(30)
        admission.release(200)

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    try:
        holding.wait(30)
        totals = gk.totals()
        assert totals is not None
        search = totals["shop/search/*"]
        assert search.inflight == len(admitted) == threads  # 4 per key, under 5
        assert search.busy == 8
        grouped = inflight_by_limit(gk.config, gk.inflight())
        assert search.inflight == sum(grouped["shop/search/*"].values())
        assert {usage.key: usage.inflight for usage in search.top} == {
            f"shop/search/k{n}": 4 for n in range(8)
        }
    finally:
        done.set()
        for worker in workers:
            worker.join(30)
        gk.close()


def test_adaptive_report_follows_evictions(clock: FakeClock) -> None:
    """stats()['adaptive'] lists the adaptive keys the backend still tracks: an evicted
    key's controller goes with it (the report never grows past max_keys)."""
    settings = {
        "project": "shop",
        "limits": {
            "shop/api/*": {
                "concurrency": "auto",
                "adaptive": {"min": 1, "max": 50, "initial": 5},
                "max_keys": 2,
            }
        },
    }
    gk = GateKeeper(settings, clock=clock)
    try:
        for caller in ("a", "b", "c", "d"):
            gk.admit("shop", "api", caller).release(200)
        reported = gk.stats()["adaptive"]
        assert len(reported) == 2
        assert set(reported) <= {f"shop/api/{caller}" for caller in "abcd"}
        assert "shop/api/d" in reported
    finally:
        gk.close()


@pytest.mark.parametrize("backend", ["memory", "shared"])
def test_status_reports_the_adaptive_limits_of_the_paths_it_shows(
    clock: FakeClock, tmp_path: Any, backend: str
) -> None:
    """An adaptive wildcard limit tracking 300 keys: the status page reports the adaptive
    limits of the exact limit and of the wildcard's keys it lists, not one per key
    tracked (100 000 made a 7 MB page); stats() still reports every one."""
    settings = {
        "project": "shop",
        "backend": "memory" if backend == "memory" else f"shared://{tmp_path}/gk.shm",
        "limits": {
            "shop": {"concurrency": "auto", "adaptive": {"min": 1, "max": 50, "initial": 40}},
            "shop/api/*": {"concurrency": "auto", "adaptive": {"min": 1, "max": 50}},
        },
    }
    gk = GateKeeper(settings, clock=clock)
    try:
        for index in range(300):
            gk.admit("shop", "api", f"c{index}").release(200)
        held = [gk.admit("shop", "api", name) for name in ("busy", "busy", "other")]
        status = status_of(gk)
        assert set(status["stats"]["adaptive"]) == {"shop", "shop/api/busy", "shop/api/other"}
        assert set(status["inflight"]) == {"shop", "shop/api/busy", "shop/api/other"}
        assert len(gk.stats()["adaptive"]) == 1 + 302
        for admission in held:
            admission.release(200)
    finally:
        gk.close()


def test_status_carries_the_rejections_made_before_it_is_read(keeper: GateKeeper) -> None:
    """status.json lists the recent rejections per second by code, so a dashboard opened
    after them still charts them."""
    keeper.admit("shop", "partner", "crm")
    for _ in range(3):
        with pytest.raises(Rejected):
            keeper.admit("shop", "partner", "crm")
    recent = status_of(keeper)["rejections_recent"]
    assert sum(bucket["counts"].get("GK-CONCURRENCY-LIMIT", 0) for bucket in recent) == 3
    assert all(0 <= bucket["ago"] < 300 for bucket in recent)


def test_status_groups_every_key_under_the_limit_admission_counted_it_in() -> None:
    """limit_of (how the status groups keys a backend lists) names, for every slot an
    admission takes, the very limit that slot counts under: one rule for both."""
    settings = {
        "project": "shop",
        "limits": {
            "shop": {"concurrency": 100},
            "*": {"concurrency": 100},
            "shop/*": {"concurrency": 100},
            "shop/login": {"concurrency": 100},
            "shop/login/*": {"rate": "5/minute"},
            "shop/login/admin": {"rate": "1/minute"},
            "*/*/batch": {"concurrency": 1},
            "shop/quiet/*": {"delay": 2.0},
        },
    }
    gk = GateKeeper(settings)
    try:
        for project in ("shop", "other"):
            for service in ("login", "quiet", "report", "*"):
                route = gk.route(project, service)
                for caller in ("admin", "bob", "batch", "*"):
                    slots, _ = route.caller_level(caller, {}, None)
                    for slot in slots:
                        found = limit_of(gk.config, slot.key)
                        assert found is not None and found.path == slot.limit.path, slot.key
        assert limit_of(gk.config, "shop/quiet/bob") is None  # its limit only sets a delay
    finally:
        gk.close()
