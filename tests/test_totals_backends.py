"""Per-limit totals on every backend (SPEC §7): what memory and shared keep agrees with a
full count of their keys, locked-out rate keys show their window use, and the leases of
a killed worker leave the totals (Redis's own totals: tests/test_redis_totals.py)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends.shared import reads
from gatekeeper_wsgi.engine import Admission
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.status import inflight_by_limit, limit_totals
from tests.conftest import FakeClock

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 1000},
        "shop/checkout": {"concurrency": 50, "delay": 5.0},
        "shop/search/*": {"concurrency": 10},
        "shop/login/*": {"rate": "2/minute"},
        "shop/login/admin": {"rate": "1/minute"},
    },
}


@pytest.fixture
def keeper(clocked_backend_url: str, clock: FakeClock) -> Iterator[GateKeeper]:
    """A GateKeeper on memory and on shared, on the test's clock."""
    gk = GateKeeper({**SETTINGS, "backend": clocked_backend_url}, clock=clock)
    yield gk
    gk.close()


def full_count(gk: GateKeeper) -> dict[str, tuple[int, int]]:
    """(in flight, keys in flight) per limit path, from a pass over every key."""
    grouped = inflight_by_limit(gk.config, gk.inflight())
    return {
        path: (sum(counts.values()), sum(1 for n in counts.values() if n))
        for path, counts in grouped.items()
        if path is not None
    }


def test_kept_totals_agree_with_a_full_count(keeper: GateKeeper) -> None:
    """After a mix of held, released and delayed requests on exact and wildcard limits,
    the kept totals equal what a pass over every key counts."""
    check_kept_totals(keeper)


def check_kept_totals(keeper: GateKeeper) -> None:
    """Held, released and delayed (5 s) requests on shop/search/* and shop/checkout: the
    kept totals equal a full count, while held and once the held are released."""
    held: list[Admission] = []
    for index in range(40):
        admission = keeper.admit("shop", "search", f"c{index % 9}") if index % 3 else None
        if admission is None:
            continue
        if index % 4 == 0:
            admission.release(200)
        else:
            held.append(admission)
    for index in range(6):
        keeper.admit("shop", "checkout", f"c{index}").release(500, faulty=True)  # delayed
    held.append(keeper.admit("shop", "checkout", "x"))
    totals = keeper.totals()
    assert totals is not None
    counted = full_count(keeper)
    for path in ("shop", "shop/checkout", "shop/search/*"):
        assert (totals[path].inflight, totals[path].busy) == counted.get(path, (0, 0)), path
    assert totals["shop/checkout"].inflight == 7
    assert totals["shop/search/*"].keys == 6  # c1, c2, c4, c5, c7, c8
    for admission in held:
        admission.release(200)
    after = keeper.totals()
    assert after is not None
    assert after["shop/search/*"].inflight == 0
    assert after["shop/checkout"].inflight == 6  # the delayed releases are not due yet


def test_totals_agree_whether_keys_in_flight_are_few_or_many(keeper: GateKeeper) -> None:
    """The memory backend finds a limit's keys in flight from the requests in flight or
    from its tracked keys, whichever are fewer (a status read stays fast with 100 000 of
    either): both ways count the same as a pass over every key, delayed releases included."""
    for index in range(30):
        keeper.admit("shop", "search", f"idle{index}").release(200)  # 30 keys tracked
    few = [keeper.admit("shop", "search", "a"), keeper.admit("shop", "search", "a")]
    few.append(keeper.admit("shop", "search", "b"))
    keeper.admit("shop", "checkout", "d").release(500, faulty=True)  # delayed 5 s
    totals = keeper.totals()
    assert totals is not None
    counted = full_count(keeper)
    for path in ("shop", "shop/checkout", "shop/search/*"):
        assert (totals[path].inflight, totals[path].busy) == counted.get(path, (0, 0)), path
    search = totals["shop/search/*"]
    assert (search.inflight, search.busy, search.keys) == (3, 2, 32)
    assert [(usage.key, usage.inflight) for usage in search.top[:2]] == [
        ("shop/search/a", 2),
        ("shop/search/b", 1),
    ]
    many = [keeper.admit("shop", "search", f"idle{index}") for index in range(30)]
    totals = keeper.totals()
    assert totals is not None
    assert (totals["shop/search/*"].inflight, totals["shop/search/*"].busy) == (33, 32)
    assert totals["shop/search/*"].top[0].key == "shop/search/a"
    assert totals["shop/checkout"].inflight == 1
    for admission in few + many:
        admission.release(200)


def test_a_locked_out_key_reports_its_window(keeper: GateKeeper, clock: FakeClock) -> None:
    """A key refused by its rate limit, with nothing in flight, is detailed under its own
    limit (not under the exact limit next to it) with used, and when a place frees."""
    keeper.admit("shop", "login", "mallory").release(200)
    clock.advance(20)
    keeper.admit("shop", "login", "mallory").release(200)
    with pytest.raises(Rejected):
        keeper.admit("shop", "login", "mallory")
    keeper.admit("shop", "login", "admin").release(200)
    totals = keeper.totals()
    assert totals is not None
    login = {usage.key: usage for usage in totals["shop/login/*"].top}
    assert set(login) == {"shop/login/mallory"}
    mallory = login["shop/login/mallory"]
    assert (mallory.inflight, mallory.used) == (0, 2)
    assert mallory.resets_in == pytest.approx(40.0)
    admin = totals["shop/login/admin"].top
    assert [(usage.key, usage.used) for usage in admin] == [("shop/login/admin", 1)]


def test_status_totals_on_every_backend(backend_url: str) -> None:
    """limit_totals() gives the same in-flight totals on memory, shared and Redis."""
    gk = GateKeeper({**SETTINGS, "backend": backend_url})
    try:
        held = [gk.admit("shop", "search", f"c{n % 3}") for n in range(6)]
        totals = limit_totals(gk)
        assert totals["shop/search/*"].inflight == 6
        assert totals["shop/search/*"].busy == 3
        assert totals["shop"].inflight == 6
        for admission in held:
            admission.release(200)
        assert limit_totals(gk)["shop/search/*"].inflight == 0
    finally:
        gk.close()


def test_a_killed_workers_requests_leave_the_totals(tmp_path: Any, clock: FakeClock) -> None:
    """A worker process SIGKILLed with requests in flight: once it is reaped, the shared
    backend's totals no longer count its requests."""
    settings = {**SETTINGS, "backend": f"shared://{tmp_path}/gk.shm"}
    gk = GateKeeper(settings, clock=clock)
    try:
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: hold three requests, say so, wait to be killed
            try:
                child = GateKeeper(settings, clock=clock)
                held = [child.admit("shop", "search", f"w{n}") for n in range(3)]
                os.write(ready_write, b"x")
                signal.pause()
                del held
            finally:
                os._exit(0)
        assert os.read(ready_read, 1) == b"x"
        before = gk.totals()
        assert before is not None and before["shop/search/*"].inflight == 3
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        after = gk.totals()
        assert after is not None
        assert after["shop/search/*"].inflight == 0
        assert after["shop"].inflight == 0
    finally:
        gk.close()


def test_totals_of_20000_shared_keys(tmp_path: Any, clock: FakeClock) -> None:
    """20 000 keys tracked in the shared table: the totals count them from the registry,
    and detail only the keys in flight."""
    settings = {
        "project": "shop",
        "backend": f"shared://{tmp_path}/gk.shm?size=40000",
        "limits": {"shop/search/*": {"concurrency": 4, "max_keys": 30_000}},
    }
    gk = GateKeeper(settings, clock=clock)
    try:
        for index in range(20_000):
            gk.admit("shop", "search", f"c{index}").release(200)
        held = [gk.admit("shop", "search", f"c{index}") for index in range(5)]
        totals = gk.totals(top=3)
        assert totals is not None
        search = totals["shop/search/*"]
        assert (search.keys, search.inflight, search.busy, len(search.top)) == (20_000, 5, 5, 3)
        for admission in held:
            admission.release(200)
    finally:
        gk.close()


@pytest.mark.parametrize("lease_read", [0, 1_000_000], ids=["by columns", "by leases"])
def test_shared_totals_show_the_busiest_keys_then_the_least_by_key(
    tmp_path: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch, lease_read: int
) -> None:
    """With more keys in flight than the totals show, the shared table shows the busiest,
    and of those tied at the cut the least by key, whether it finds the keys in flight
    from the leases in use (few) or by a pass over the table's columns (many)."""
    monkeypatch.setattr(reads, "LEASE_READ", lease_read)
    settings = {
        "project": "shop",
        "backend": f"shared://{tmp_path}/gk.shm?size=2000",
        "limits": {"shop/search/*": {"concurrency": 4}, "shop": {"concurrency": 1000}},
    }
    gk = GateKeeper(settings, clock=clock)
    try:
        held = [gk.admit("shop", "search", f"c{index:03}") for index in range(200, 100, -1)]
        held += [gk.admit("shop", "search", name) for name in ("z", "z", "z", "y", "y")]
        gk.admit("shop", "search", "idle").release(200)
        totals = gk.totals(top=5)
        assert totals is not None
        search = totals["shop/search/*"]
        assert (search.keys, search.inflight, search.busy) == (103, 105, 102)
        assert [(usage.key, usage.inflight) for usage in search.top] == [
            ("shop/search/z", 3),
            ("shop/search/y", 2),
            ("shop/search/c101", 1),
            ("shop/search/c102", 1),
            ("shop/search/c103", 1),
        ]
        assert totals["shop"].inflight == 105
        assert gk.inflight()["shop/search/idle"] == 0  # every key the table holds
        for admission in held:
            admission.release(200)
        after = gk.totals(top=5)
        assert after is not None
        assert (after["shop/search/*"].inflight, after["shop/search/*"].top) == (0, ())
    finally:
        gk.close()
