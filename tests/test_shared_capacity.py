"""The shared table's own capacity (keys, leases, window entries, process slots) running
out: a ``CapacityError`` naming the slot that could not be tracked, with everything the
request took rolled back, never an outage that admits uncounted (SPEC §4.5); eviction
takes only idle keys, so no spray of fresh keys resets a limit; the derived sizes cover
wildcard and rate limits. Real files, the backend driven directly and through the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.base import Denial, Grant, Slot
from gatekeeper_wsgi.backends.shared import (
    DEFAULT_KEYS_CAP,
    DEFAULT_LEASES_CAP,
    MIN_LEASES,
    SharedBackend,
)
from gatekeeper_wsgi.backends.shared.layout import Layout
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.errors import CapacityError
from tests.conftest import FakeClock, busy

NOW = 1000.0


class Table:
    """A SharedBackend on a fresh file, with slots built from its configuration."""

    def __init__(self, path: Path, limits: dict[str, Any], query: str = "") -> None:
        self.config = build_config({"project": "shop", "limits": limits})
        self.backend = SharedBackend.from_url(f"shared://{path}{query}", self.config)

    def slots(self, *keys: str, shadow: tuple[str, ...] = ()) -> list[Slot]:
        """One slot per key, under the limit whose path matches it (``*`` for a value)."""
        chosen = []
        for key in keys:
            parts = key.split("/")
            for path, limit in self.config.limits.items():
                pattern = path.split("/")
                if len(pattern) == len(parts) and all(
                    want in ("*", got) for want, got in zip(pattern, parts, strict=True)
                ):
                    chosen.append(Slot(key, limit, path not in shadow))
                    break
            else:
                raise AssertionError(f"no limit for {key}")
        return chosen

    def admit(self, *keys: str, now: float = NOW) -> Grant | Denial:
        return self.backend.acquire(self.slots(*keys), now)

    def grant(self, *keys: str, now: float = NOW) -> Grant:
        result = self.admit(*keys, now=now)
        assert isinstance(result, Grant), result
        return result

    def full(self, *keys: str, now: float = NOW) -> CapacityError:
        """The CapacityError admitting ``keys`` raises, having changed nothing."""
        before, leases = busy(self.backend.inflight(now)), self.backend.usage()["leases"]
        with pytest.raises(CapacityError) as info:
            self.admit(*keys, now=now)
        assert busy(self.backend.inflight(now)) == before
        assert self.backend.usage()["leases"] == leases
        return info.value


@pytest.fixture
def table_path(tmp_path: Path) -> Path:
    return tmp_path / "capacity.shm"


@pytest.fixture
def tables(table_path: Path) -> Iterator[list[Table]]:
    made: list[Table] = []
    yield made
    for table in made:
        table.backend.close()


def open_table(tables: list[Table], path: Path, limits: dict[str, Any], query: str = "") -> Table:
    table = Table(path, limits, query)
    tables.append(table)
    return table


# --- each resource: refused by the slot that could not be tracked, nothing taken -----------


def test_full_lease_table_blames_the_most_specific_enforced_concurrency(
    tables: list[Table], table_path: Path
) -> None:
    """With every lease held, a request fails with CapacityError at its most specific
    enforced concurrency slot (shadow and rate-only slots are passed over)."""
    limits = {
        "shop": {"concurrency": 100},
        "shop/api": {"concurrency": 50},
        "shop/api/*": {"rate": "100/hour"},
        "shop/web/*": {"concurrency": 10},
    }
    table = open_table(tables, table_path, limits, "?leases=3")
    held = [table.grant("shop", "shop/api", f"shop/api/c{n}") for n in range(3)]
    error = table.full("shop", "shop/api", "shop/api/x")
    assert error.at == 1  # shop/api: the caller level has no concurrency
    assert "?leases=" in error.what
    slots = table.slots("shop", "shop/web/x", shadow=("shop/web/*",))
    with pytest.raises(CapacityError) as info:
        table.backend.acquire(slots, NOW)
    assert info.value.at == 0  # the caller level is shadow, the service has no limit
    table.backend.release(held[0], 200, 0.0, NOW)
    assert isinstance(table.admit("shop", "shop/api", "shop/api/x"), Grant)


def test_exhausted_window_entries_refuse_by_the_rate_slot(
    tables: list[Table], table_path: Path
) -> None:
    """With every rate-window entry in use, a new key's admission fails at its rate slot;
    once a window slides, room comes back. Never a 6th of 5/hour."""
    limits = {"shop": {"concurrency": 100}, "shop/login/*": {"rate": "5/hour"}}
    table = open_table(tables, table_path, limits, "?windows=2")
    for caller in ("a", "b"):  # 5 entries each: one 7-entry chunk each
        for _ in range(5):
            table.backend.release(table.grant("shop", f"shop/login/{caller}"), 200, 0.0, NOW)
    error = table.full("shop", "shop/login/c")
    assert error.at == 1
    assert "?windows=" in error.what
    sixth = table.admit("shop", "shop/login/a")
    assert isinstance(sixth, Denial)
    assert sixth.kind == "rate"
    later = NOW + 3601
    assert isinstance(table.admit("shop", "shop/login/c", now=later), Grant)


def test_max_keys_evicts_only_idle_keys(tables: list[Table], table_path: Path) -> None:
    """At max_keys a new key evicts an idle key (nothing in flight, window expired), never
    one in flight or inside its window: then the new key is refused."""
    limits = {"shop/login/*": {"concurrency": 5, "rate": "3/hour", "max_keys": 2}}
    table = open_table(tables, table_path, limits)
    held = table.grant("shop/login/a")  # in flight
    table.backend.release(table.grant("shop/login/b"), 200, 0.0, NOW)  # window live
    error = table.full("shop/login/c")
    assert error.at == 0
    assert "max_keys=2" in error.what
    assert 3599 <= error.retry_after <= 3600  # b's window empties in an hour
    later = NOW + 3601  # b's window has expired: b is idle, a is still in flight
    table.grant("shop/login/c", now=later)
    assert set(busy(table.backend.inflight(later))) == {"shop/login/a", "shop/login/c"}
    table.backend.release(held, 200, 0.0, later)


def test_spray_never_resets_a_used_window(tables: list[Table], table_path: Path) -> None:
    """A caller that used its 3/hour stays refused while 20 x max_keys fresh callers are
    sprayed: they are refused at capacity, the table never tracks more than max_keys."""
    limits = {"shop": {"concurrency": 1000}, "shop/login/*": {"rate": "3/hour", "max_keys": 50}}
    table = open_table(tables, table_path, limits)
    for _ in range(3):
        table.backend.release(table.grant("shop", "shop/login/victim"), 200, 0.0, NOW)
    refused = 0
    for number in range(1000):
        now = NOW + number * 0.5  # 500 s: well inside the victim's hour
        try:
            table.backend.release(
                table.grant("shop", f"shop/login/s{number}", now=now), 200, 0.0, now
            )
        except CapacityError as error:
            assert error.at == 1
            refused += 1
        victim = table.admit("shop", "shop/login/victim", now=now)
        assert isinstance(victim, Denial), number
        assert table.backend.usage()["keys"] <= 50 + 1  # + the project's key
    assert refused == 1000 - 49  # the victim holds one of the 50 keys


def test_full_buckets_never_evict_a_live_window(tables: list[Table], table_path: Path) -> None:
    """A table too small for its keys (?size=1: 72 nodes) evicts only idle nodes to make
    room in a full bucket; a key inside its window survives any number of new keys."""
    limits = {"shop/login/*": {"rate": "1/hour", "max_keys": 100_000}}
    table = open_table(tables, table_path, limits, "?size=1")
    capacity = table.backend.usage()["key_capacity"]
    admitted = refused = 0
    for number in range(4 * capacity):
        try:
            table.backend.release(table.grant(f"shop/login/k{number}"), 200, 0.0, NOW)
            admitted += 1
        except CapacityError as error:
            assert "?size=" in error.what
            refused += 1
    assert admitted <= capacity
    assert refused >= 3 * capacity
    # Every admitted key still has its window: none is admitted a second time this hour.
    again = 0
    for number in range(4 * capacity):
        with contextlib.suppress(CapacityError):
            again += isinstance(table.admit(f"shop/login/k{number}"), Grant)
    assert again == 0


def test_a_request_never_evicts_a_key_it_counts_on(tables: list[Table], table_path: Path) -> None:
    """In a table whose buckets are full of idle keys, a new caller key may evict idle
    keys but never the project or service key the same request is taking a slot at."""
    limits = {
        "shop": {"concurrency": 1000},
        "shop/api": {"concurrency": 1000},
        "shop/api/*": {"concurrency": 5, "max_keys": 100_000},
    }
    table = open_table(tables, table_path, limits, "?size=1")
    for number in range(400):
        grant = table.grant("shop", "shop/api", f"shop/api/c{number}")
        assert busy(table.backend.inflight(NOW)) == {
            "shop": 1,
            "shop/api": 1,
            f"shop/api/c{number}": 1,
        }, number
        table.backend.release(grant, 200, 0.0, NOW)


def test_a_long_window_expiring_at_once_is_one_small_update(
    tables: list[Table], table_path: Path
) -> None:
    """25 000 entries of one key's window expire together: the next admission frees
    their 3 572 chunks as one chain (no journal overflow, no backend error)."""
    table = open_table(tables, table_path, {"shop/bulk": {"rate": "25000/hour"}})
    slots = table.slots("shop/bulk")
    acquire, release = table.backend.acquire, table.backend.release
    for number in range(25_000):
        grant = acquire(slots, NOW + number * 0.001)
        assert isinstance(grant, Grant)
        release(grant, 200, 0.0, NOW)
    assert isinstance(acquire(slots, NOW + 30), Denial)
    assert isinstance(acquire(slots, NOW + 3700), Grant)


# --- sizing --------------------------------------------------------------------------------


def layout(limits: dict[str, Any], **sizes: int) -> Layout:
    return Layout.derive(build_config({"project": "shop", "limits": limits}), **sizes)


def test_leases_cover_wildcard_concurrency() -> None:
    """Leases: twice the sum of concurrency limits, a wildcard one counting for each of
    its max_keys keys; at least MIN_LEASES, at most DEFAULT_LEASES_CAP."""
    assert layout({"shop": {"concurrency": 10}}).leases == MIN_LEASES
    wildcard = {"shop": {"concurrency": 100}, "shop/api/*": {"concurrency": 2, "max_keys": 20_000}}
    assert layout(wildcard).leases == 2 * (100 + 2 * 20_000)
    huge = {"shop/api/*": {"concurrency": 1000, "max_keys": 1_000_000}}
    assert layout(huge).leases == DEFAULT_LEASES_CAP
    assert layout(huge, leases=7).leases == 7


def test_keys_and_windows_cover_wildcard_rate_limits() -> None:
    """Keys: max_keys per wildcard limit (capped at DEFAULT_KEYS_CAP in all); window
    chunks: room for N entries per key of an N/... limit."""
    limits = {"shop/login/*": {"rate": "5/hour", "max_keys": 10_000}}
    sized = layout(limits)
    assert sized.nodes >= 10_000
    assert sized.chunks * 7 >= 10_000 * 5
    many = {f"shop/s{n}/*": {"concurrency": 1, "max_keys": 1_000_000} for n in range(3)}
    assert layout(many).nodes <= DEFAULT_KEYS_CAP * 3 // 2 + 64 + 8


# --- through the engine: refused by the limit, counted, never admitted uncounted ----------


def settings_for(
    path: Path, limits: dict[str, Any], query: str = "", **options: Any
) -> dict[str, Any]:
    return {"project": "shop", **options, "backend": f"shared://{path}{query}", "limits": limits}


def test_default_table_full_of_requests_never_lets_a_caller_hold_two(
    table_path: Path, clock: FakeClock
) -> None:
    """The issue's attack: 16 384 requests in flight on a default-sized table (every
    lease held); a caller with concurrency 1 is refused (never holds 2) and so is any new
    request, by its limit's code; on_backend_error never applies."""
    limits = {
        "shop/bulk": {"rate": "1000000/hour"},
        "shop/api/*": {"concurrency": 1, "max_keys": 1000},
    }
    gk = GateKeeper(settings_for(table_path, limits, on_backend_error="allow"), clock=clock)
    assert gk.backend.usage()["lease_capacity"] == MIN_LEASES  # type: ignore[attr-defined]
    mine = gk.admit("shop", "api", "me")
    bulk = [gk.admit("shop", "bulk", f"b{n}") for n in range(MIN_LEASES - 1)]
    assert gk.backend.usage()["leases"] == MIN_LEASES  # type: ignore[attr-defined]
    for _ in range(3):
        with pytest.raises(Rejected) as info:
            gk.admit("shop", "api", "me")
        assert info.value.code == "GK-CONCURRENCY-LIMIT"
        with pytest.raises(Rejected) as info:
            gk.admit("shop", "api", "other")
        assert info.value.code == "GK-CONCURRENCY-LIMIT"
    assert busy(gk)["shop/api/me"] == 1
    counters = gk.stats()["counters"]
    assert counters["backend_errors"] == 0
    assert counters["capacity_refused"] == 3  # "me" is refused by its own count first
    mine.release(200)
    for admission in bulk:
        admission.release(200)
    assert busy(gk) == {}
    gk.close()


def test_exhausted_windows_never_give_a_sixth_of_five_per_hour(
    table_path: Path, clock: FakeClock
) -> None:
    """The issue's attack: window entries exhausted; a caller never gets a 6th of its
    5/hour, a new caller is refused with GK-RATE-LIMIT, nothing fails open."""
    limits = {"shop/login/*": {"rate": "5/hour"}}
    gk = GateKeeper(settings_for(table_path, limits, "?windows=3"), clock=clock)
    admitted: dict[str, int] = {}
    for caller in ("a", "b", "c", "d", "e"):
        for _ in range(7):
            try:
                gk.admit("shop", "login", caller).release(200)
            except Rejected as rejection:
                assert rejection.code == "GK-RATE-LIMIT"
            else:
                admitted[caller] = admitted.get(caller, 0) + 1
    assert admitted == {"a": 5, "b": 5, "c": 5}
    assert gk.stats()["counters"]["capacity_refused"] == 14
    assert gk.stats()["counters"]["backend_errors"] == 0
    gk.close()


def test_long_requests_at_the_head_of_the_lru_do_not_hide_idle_keys(
    tables: list[Table], table_path: Path
) -> None:
    """70 keys in flight at the head of a limit's LRU list, 30 idle keys behind them: a
    new key is tracked by its second try at the latest (the busy keys looked at move down
    the list), not refused for as long as the long requests last."""
    limits = {"shop/api/*": {"concurrency": 1, "max_keys": 100}}
    table = open_table(tables, table_path, limits)
    held = [table.grant(f"shop/api/long{n}") for n in range(70)]
    for n in range(30):
        table.backend.release(table.grant(f"shop/api/idle{n}"), 200, 0.0, NOW)
    tries = 0
    while True:
        tries += 1
        try:
            table.grant("shop/api/new")
        except CapacityError:
            assert tries < 2
        else:
            break
    assert len(busy(table.backend.inflight(NOW))) == 71
    for grant in held:
        table.backend.release(grant, 200, 0.0, NOW)


def test_a_key_longer_than_the_table_was_made_for_is_counted(tmp_path: Path) -> None:
    """The table's keys are sized for the longest limit path when it is made; a reload
    that adds a wildcard limit does not re-create it while it is in use. A valid caller
    longer than that is still tracked (stored as its first bytes and a digest of the
    whole), counted by its limit apart from a caller with the same beginning - never
    refused for its length."""
    ops = tmp_path / "ops.properties"
    ops.write_text("limits.shop.concurrency = 100\n")
    settings = {"project": "shop", "backend": f"shared://{tmp_path / 't.shm'}"}
    gk = GateKeeper({**settings, "reload": {"file": str(ops)}})
    anchor = gk.admit("shop", "x", "c")  # the table in use: the reload keeps it
    new = tmp_path / "ops.new"
    new.write_text("limits.shop.concurrency = 100\nlimits.shop/*/*.concurrency = 1\n")
    new.replace(ops)
    assert gk.reload() is True
    long_caller = "svc-billing-reconciliation.production@payments-eu-west-1.example.com"
    first = gk.admit("shop", "checkout", long_caller)
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "checkout", long_caller)
    assert refused.value.code == "GK-CONCURRENCY-LIMIT"
    assert refused.value.limit_path == "shop/*/*"
    other = gk.admit("shop", "checkout", long_caller[:-3] + "org")
    held = {path: n for path, n in busy(gk).items() if path.startswith("shop/checkout/")}
    assert sorted(held.values()) == [1, 1]
    assert all(path.startswith("shop/checkout/svc-billing") for path in held)
    assert gk.stats()["counters"]["capacity_refused"] == 0
    for admission in (first, other, anchor):
        admission.release(200)
    gk.close()


def test_a_table_bigger_than_the_free_space_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The table is sparse: a page is given when first written, and a file system with
    none left kills the writing process (SIGBUS). Creating a table that may grow past the
    free space says so in a WARNING; one that fits says nothing. On /dev/shm, a tmpfs whose
    room is a share of the machine's memory: far less than the largest table a `?size=`
    makes (about 1 TB, sparse)."""
    caplog.set_level(logging.WARNING, "gatekeeper")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:

        def create(name: str, size: int) -> int:
            path = Path(directory) / name
            gk = GateKeeper(
                {
                    "project": "shop",
                    "backend": f"shared://{path}?size={size}",
                    "limits": {"shop/*": {"concurrency": 1}},
                }
            )
            gk.close()
            return path.stat().st_size

        per_key = create("probe.shm", 100_000) / 100_000
        assert not [r for r in caplog.records if "SIGBUS" in r.getMessage()]
        status = os.statvfs(directory)
        keys = int(2 * status.f_bavail * status.f_frsize / per_key) + 1
        assert keys < 2**31  # a table this large fits the ?size= bound
        create("huge.shm", keys)
    (warning,) = [r.getMessage() for r in caplog.records if "SIGBUS" in r.getMessage()]
    assert "huge.shm may use up to" in warning and "MB free" in warning


def test_window_entries_run_out_with_the_wait_the_windows_say(tmp_path: Path) -> None:
    """A table whose rate-window entries are all taken refuses a new key by its limit,
    with the time until the soonest window looked at frees its chunks (a day, for
    `1000/day`), not "retry in a second" - which a client obeying it would hear again
    every second for a day."""
    gk = GateKeeper(
        {
            "project": "shop",
            "backend": f"shared://{tmp_path / 'w.shm'}?windows=4",
            "limits": {"shop/login/*": {"rate": "1000/day", "key": "ip"}},
        }
    )
    try:
        for _ in range(28):  # 4 chunks of 7 entries, all this key's
            gk.admit("shop", "login", "c", {"REMOTE_ADDR": "10.0.0.1"}).release(200)
        for address in ("10.0.0.1", "10.0.0.2"):
            with pytest.raises(Rejected) as refused:
                gk.admit("shop", "login", "c", {"REMOTE_ADDR": address})
            assert refused.value.code == "GK-RATE-LIMIT"
            assert 86_000 < refused.value.retry_after <= 86_400
        assert gk.stats()["counters"]["capacity_refused"] == 2
    finally:
        gk.close()
