"""The admission engine's conformance suite: every test runs on each backend of the table.

Tests that travel in time drive the injected FakeClock, on the backends that count time by
it (``make_clocked``); backends with a clock of their own (Redis) are covered by the
real-time variants, which use tiny windows and delays and wait on a condition, never on a
timing.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.test import Client, EnvironBuilder

from gatekeeper_wsgi import GateKeeperMiddleware, resolve
from gatekeeper_wsgi.config import load_config
from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.monitor import SAMPLING
from gatekeeper_wsgi.values import CALLER_RE
from tests.conftest import FakeClock, busy
from tests.logs import ok_app
from tests.servers import DEADLINE, wait_until


class Make(Protocol):
    def __call__(
        self,
        limits: dict[str, Any],
        *,
        clock: Callable[[], float] | None = None,
        **settings: Any,
    ) -> GateKeeper: ...


def keepers(backend_url: str, fake_clock: FakeClock) -> Iterator[Make]:
    """Builds GateKeepers on ``backend_url``, driven by the FakeClock by default; closes
    them afterwards."""
    built: list[GateKeeper] = []

    def build(
        limits: dict[str, Any], *, clock: Callable[[], float] | None = None, **options: Any
    ) -> GateKeeper:
        config = {"project": "shop", **options, "backend": backend_url, "limits": limits}
        keeper = GateKeeper(config, clock=clock or fake_clock)
        built.append(keeper)
        return keeper

    yield build
    for keeper in built:
        keeper.close()


@pytest.fixture
def make(backend_url: str, clock: FakeClock) -> Iterator[Make]:
    """Builds GateKeepers on each backend."""
    yield from keepers(backend_url, clock)


@pytest.fixture
def make_clocked(clocked_backend_url: str, clock: FakeClock) -> Iterator[Make]:
    """Builds GateKeepers on each backend that counts time by the FakeClock, for the tests
    that move it."""
    yield from keepers(clocked_backend_url, clock)


def refused(gk: GateKeeper, project: str, service: str, caller: str, **kw: Any) -> Rejected:
    with pytest.raises(Rejected) as info:
        gk.admit(project, service, caller, **kw)
    return info.value


def waiters(gk: GateKeeper) -> int:
    # The engine's own count of queued requests: how a test knows a thread is waiting.
    return gk._waiting


def rewrite(path: Path, text: str) -> None:
    """Replace a config file so its stat changes even within the file system's mtime tick
    (by an atomic rename, as docs/configuration.md advises: swapped in at the next check)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    later = max(temporary.stat().st_mtime_ns, before + 1_000_000_000)
    os.utime(temporary, ns=(later, later))
    os.replace(temporary, path)


def start(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------------------ limit resolution


def test_exact_service_beats_wildcard(make: Make) -> None:
    """An exact service limit replaces the project's `shop/*` limit for that service."""
    gk = make({"shop/*": {"concurrency": 2}, "shop/checkout": {"concurrency": 1}})
    gk.admit("shop", "checkout", "a")
    rejection = refused(gk, "shop", "checkout", "a")
    assert (rejection.level, rejection.limit_path, rejection.limit_value) == (
        "service",
        "shop/checkout",
        "1",
    )
    gk.admit("shop", "login", "a")
    gk.admit("shop", "login", "a")
    assert refused(gk, "shop", "login", "a").limit_path == "shop/*"


def test_specificity_weighs_from_the_left(make: Make) -> None:
    """`shop/*` beats `*/login` and `shop/*/*` beats `*/login/alice`: left segments weigh more."""
    gk = make(
        {
            "shop/*": {"concurrency": 1},
            "*/login": {"concurrency": 5},
            "shop/*/*": {"concurrency": 1},
            "*/login/alice": {"concurrency": 5},
        }
    )
    gk.admit("shop", "login", "alice")
    rejection = refused(gk, "shop", "login", "bob")
    assert rejection.limit_path == "shop/*"
    # A second configuration on the same backend: other paths, so no shared counters.
    gk2 = make({"mall/*/*": {"concurrency": 1}, "*/login/alice": {"concurrency": 5}})
    gk2.admit("mall", "login", "alice")
    assert refused(gk2, "mall", "login", "alice").limit_path == "mall/*/*"


def test_project_wildcard_counts_each_project(make: Make) -> None:
    """A `*` project limit gives every project its own counter."""
    gk = make({"*": {"concurrency": 1}, "shop/*": {"concurrency": 5}})
    gk.admit("shop", "checkout", "a")
    gk.admit("other", "checkout", "a")
    assert refused(gk, "shop", "login", "b").limit_path == "*"
    assert busy(gk) == {"shop": 1, "other": 1, "shop/checkout": 1}


def test_wildcard_counts_each_value_separately(make: Make) -> None:
    """`*` gives every service and caller its own counter, shown by concrete path."""
    gk = make({"shop/*": {"concurrency": 1}, "shop/api/*": {"concurrency": 1}})
    gk.admit("shop", "checkout", "a")
    gk.admit("shop", "login", "a")
    gk.admit("shop", "api", "alice")
    assert refused(gk, "shop", "checkout", "b").limit_path == "shop/*"
    assert busy(gk) == {
        "shop/checkout": 1,
        "shop/login": 1,
        "shop/api": 1,
        "shop/api/alice": 1,
    }
    assert refused(gk, "shop", "api", "bob").limit_path == "shop/*"


def test_exact_caller_beats_wildcard_caller(make: Make) -> None:
    """A named caller gets its own limit; everyone else falls under `shop/api/*`."""
    gk = make({"shop/api/*": {"concurrency": 1}, "shop/api/crm": {"concurrency": 3}})
    for _ in range(3):
        gk.admit("shop", "api", "crm")
    assert refused(gk, "shop", "api", "crm").limit_path == "shop/api/crm"
    gk.admit("shop", "api", "bob")
    rejection = refused(gk, "shop", "api", "bob")
    assert (rejection.level, rejection.limit_path, rejection.limit_value) == (
        "caller",
        "shop/api/*",
        "1",
    )


def test_most_specific_delay_and_markers_win(make: Make) -> None:
    """Delay and timeout markers come from the most specific level that sets them."""
    gk = make(
        {
            "shop": {
                "concurrency": 10,
                "delay": 2.0,
                "timeout_status": [504],
                "timeout_header": "X-Fault: TIMEOUT",
            },
            "shop/checkout": {"concurrency": 10, "delay": 5.0, "timeout_status": [502]},
            "shop/checkout/crm": {"concurrency": 10, "delay": 9.0},
            "shop/checkout/*": {"concurrency": 10},
        }
    )
    login = gk.admit("shop", "login", "bob")
    assert login.delay == 2.0
    assert login.route.timeout_status == frozenset({504})
    checkout = gk.admit("shop", "checkout", "bob")
    assert checkout.delay == 5.0
    assert checkout.route.timeout_status == frozenset({502})
    assert checkout.route.timeout_header is not None
    assert checkout.route.timeout_header.name == "X-Fault"
    assert gk.admit("shop", "checkout", "crm").delay == 9.0


def test_most_specific_delay_holds_the_slots(make_clocked: Make, clock: FakeClock) -> None:
    """A faulty response on checkout holds its slots for checkout's delay, not the project's."""
    gk = make_clocked(
        {
            "shop": {"concurrency": 10, "delay": 2.0},
            "shop/checkout": {"concurrency": 1, "delay": 5.0},
        }
    )
    gk.admit("shop", "checkout", "a").release(504, faulty=True)
    clock.advance(4.9)
    assert busy(gk) == {"shop": 1, "shop/checkout": 1}
    clock.advance(0.1)
    assert busy(gk) == {}


def test_caller_key_kinds(make: Make) -> None:
    """The third segment counts by caller, REMOTE_ADDR, REMOTE_USER / user, or a header."""
    gk = make(
        {
            "shop/login/*": {"concurrency": 1, "key": "ip"},
            "shop/me/*": {"concurrency": 1, "key": "user"},
            "shop/api/*": {"concurrency": 1, "key": "header:X-Api-Key"},
            "shop/other/*": {"concurrency": 1},
        }
    )
    gk.admit("shop", "login", "alice", environ={"REMOTE_ADDR": "10.0.0.7"})
    assert (
        refused(gk, "shop", "login", "bob", environ={"REMOTE_ADDR": "10.0.0.7"}).level == "caller"
    )
    gk.admit("shop", "login", "alice", environ={"REMOTE_ADDR": "2001:db8::1"})
    gk.admit("shop", "me", "x", environ={"REMOTE_USER": "bob"})
    gk.admit("shop", "me", "x", environ={"REMOTE_USER": "bob"}, user="carol")
    assert refused(gk, "shop", "me", "y", user="carol").limit_path == "shop/me/*"
    gk.admit("shop", "api", "x", environ={"HTTP_X_API_KEY": "k1"})
    gk.admit("shop", "other", "dave")
    # Requests without the value count together under '-'.
    gk.admit("shop", "api", "x")
    assert refused(gk, "shop", "api", "y").limit_path == "shop/api/*"
    assert busy(gk) == {
        "shop/login/10.0.0.7": 1,
        "shop/login/2001:db8::-64": 1,  # an IPv6 client counts by its /64
        "shop/me/bob": 1,
        "shop/me/carol": 1,
        "shop/api/k1": 1,
        "shop/api/-": 1,
        "shop/other/dave": 1,
    }


HOSTILE = [
    "../../etc/passwd",
    "a" * 500,
    "caf\u00e9",
    "x\r\nSet-Cookie: y",
    "shop/checkout",
    "<script>alert(1)</script>",
    "\x00",
]


def test_hostile_key_values_become_digests(make: Make) -> None:
    """Odd header values cannot forge a path or bloat a key: each becomes a short digest."""
    gk = make({"shop/api/*": {"concurrency": 1, "key": "header:X-Api-Key"}})
    for value in HOSTILE:
        gk.admit("shop", "api", "x", environ={"HTTP_X_API_KEY": value})
        # The same hostile value is still one key, so it stays limited.
        assert refused(gk, "shop", "api", "x", environ={"HTTP_X_API_KEY": value}).level == "caller"
    keys = busy(gk)
    assert len(keys) == len(HOSTILE)
    for key in keys:
        assert re.fullmatch(r"shop/api/~[0-9a-f]{16}", key), key


def test_hostile_user_and_ip_values_become_digests(make: Make) -> None:
    """REMOTE_USER and REMOTE_ADDR are sanitized the same way as headers."""
    gk = make(
        {
            "shop/me/*": {"concurrency": 1, "key": "user"},
            "shop/ip/*": {"concurrency": 1, "key": "ip"},
        }
    )
    gk.admit("shop", "me", "x", user="../admin")
    gk.admit("shop", "ip", "x", environ={"REMOTE_ADDR": "1.2.3.4, 5.6.7.8"})
    assert all(re.fullmatch(r"shop/(me|ip)/~[0-9a-f]{16}", key) for key in busy(gk))


def test_caller_level_memo_stays_bounded_and_exact(make: Make) -> None:
    """The caller level is memoized by the request value it reads; a spray of addresses
    keeps the memo bounded, and a repeat caller still meets its own limit afterwards."""
    gk = make({"shop/ip/*": {"concurrency": 1, "key": "ip"}})
    held = gk.admit("shop", "ip", "x", environ={"REMOTE_ADDR": "10.0.0.1"})
    for n in range(resolve.MEMO_SIZE + 100):
        address = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        if address != "10.0.0.1":
            gk.admit("shop", "ip", "x", environ={"REMOTE_ADDR": address}).release(200)
        assert len(gk.config.caller_memo) <= resolve.MEMO_SIZE
    rejected = refused(gk, "shop", "ip", "x", environ={"REMOTE_ADDR": "10.0.0.1"})
    assert rejected.limit_path == "shop/ip/*"
    held.release(200)
    gk.admit("shop", "ip", "x", environ={"REMOTE_ADDR": "10.0.0.1"})
    assert busy(gk) == {"shop/ip/10.0.0.1": 1}


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["caller", "ip", "user", "header:X-Key"]),
    exact=st.lists(st.sampled_from(["a", "b", "10.0.0.1", "x y"]), max_size=3, unique=True),
    values=st.lists(
        st.one_of(st.none(), st.sampled_from(["a", "b", "10.0.0.1", ""]), st.text(max_size=8)),
        min_size=1,
        max_size=6,
    ),
)
def test_memoized_caller_level_answers_as_the_limits_say(
    kind: str, exact: list[str], values: list[str | None]
) -> None:
    """Whatever the limits and request values, the memoized caller level gives the same
    slots and delay as resolving from scratch, on first sight and on a repeat."""
    limits: dict[str, Any] = {"shop/api/*": {"concurrency": 5, "key": kind, "delay": 1.0}}
    for n, segment in enumerate(exact):
        if " " not in segment:
            limits[f"shop/api/{segment}"] = {"concurrency": n + 1, "key": kind}
    route = resolve.Route(load_config({"project": "shop", "limits": limits}), "shop", "api")
    for value in values * 2:
        caller = value if value and CALLER_RE.fullmatch(value) else "anonymous"
        environ = {"REMOTE_ADDR": value, "HTTP_X_KEY": value}
        assert route.caller_level(caller, environ, value) == route._caller_level(
            caller, environ, value
        )


def test_caller_level_memo_follows_a_reload(make: Make, tmp_path: Path) -> None:
    """A memoized caller level is never answered from a replaced configuration."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "limits.shop/ip/*.concurrency = 1\nlimits.shop/ip/*.key = ip\n")
    gk = reloading(make, path)
    environ = {"REMOTE_ADDR": "10.0.0.1"}
    gk.admit("shop", "ip", "x", environ=environ)
    refused(gk, "shop", "ip", "x", environ=environ)
    rewrite(path, "limits.shop/ip/*.concurrency = 2\nlimits.shop/ip/*.key = ip\n")
    assert gk.reload() is True
    gk.admit("shop", "ip", "x", environ=environ)
    assert refused(gk, "shop", "ip", "x", environ=environ).limit_value == "2"


# ------------------------------------------------------------------ all-or-nothing admission


def test_rejection_at_caller_level_leaves_upper_levels_untouched(make: Make) -> None:
    """A request refused at level 3 takes no slot at levels 1 and 2."""
    gk = make(
        {
            "shop": {"concurrency": 10},
            "shop/checkout": {"concurrency": 10},
            "shop/checkout/*": {"concurrency": 1},
        }
    )
    gk.admit("shop", "checkout", "alice")
    for _ in range(5):
        assert refused(gk, "shop", "checkout", "alice").level == "caller"
    assert busy(gk) == {"shop": 1, "shop/checkout": 1, "shop/checkout/alice": 1}


def test_rejection_does_not_use_up_rate_of_other_levels(make: Make) -> None:
    """A request refused at the caller level leaves the project's rate budget unspent."""
    gk = make({"shop": {"rate": "2/minute"}, "shop/checkout/*": {"concurrency": 1}})
    gk.admit("shop", "checkout", "alice")
    for _ in range(5):
        assert refused(gk, "shop", "checkout", "alice").code == "GK-CONCURRENCY-LIMIT"
    gk.admit("shop", "checkout", "bob")
    assert refused(gk, "shop", "checkout", "carol").code == "GK-RATE-LIMIT"


def test_a_refusal_by_one_window_leaves_another_slid_out(
    make_clocked: Make, clock: FakeClock
) -> None:
    """A project window that has slid out stays empty when a request is then refused by
    its service's window: the refusal names the service, and the project admits its
    quota to the other services. (The shared table once reused, inside the refused
    update, the window chunk the slide had freed, and its rollback brought the old
    entries back with a new one among them: every later request was refused by the
    project.)"""
    gk = make_clocked({"shop": {"rate": "2/3s"}, "shop/login": {"rate": "2/minute"}})
    for _ in range(2):
        gk.admit("shop", "login", "a").release(200)
    clock.advance(3.3)
    rejection = refused(gk, "shop", "login", "a")
    assert (rejection.limit_path, rejection.retry_after) == ("shop/login", 57)
    for _ in range(2):
        gk.admit("shop", "other", "a").release(200)
    assert refused(gk, "shop", "other", "a").limit_path == "shop"


# ------------------------------------------------------------------------------ concurrency


def test_concurrency_limit_admits_exactly_n(make: Make) -> None:
    """With concurrency 3, three requests are in; the fourth gets GK-CONCURRENCY-LIMIT."""
    gk = make({"shop": {"concurrency": 3}})
    held = [gk.admit("shop", "checkout", "a") for _ in range(3)]
    rejection = refused(gk, "shop", "checkout", "a")
    assert (rejection.code, rejection.status) == ("GK-CONCURRENCY-LIMIT", 503)
    assert (rejection.level, rejection.limit_path, rejection.limit_value) == (
        "project",
        "shop",
        "3",
    )
    assert rejection.retry_after == 1
    assert rejection.rate is None
    held[0].release(200)
    gk.admit("shop", "checkout", "a")
    assert busy(gk) == {"shop": 3}


def test_concurrency_zero_blocks_the_path(make: Make) -> None:
    """Concurrency 0 refuses every request on that path and no other."""
    gk = make({"shop/maintenance": {"concurrency": 0}})
    assert refused(gk, "shop", "maintenance", "a").limit_value == "0"
    gk.admit("shop", "checkout", "a").release(200)


def test_threads_never_exceed_concurrency(make: Make) -> None:
    """However 48 threads interleave, exactly `concurrency` of them get in."""
    gk = make({"shop": {"concurrency": 20}, "shop/checkout": {"concurrency": 7}})
    for _ in range(5):
        barrier = threading.Barrier(48)
        admitted: list[Admission] = []
        refusals: list[Rejected] = []

        def attempt(
            barrier: threading.Barrier = barrier,
            admitted: list[Admission] = admitted,
            refusals: list[Rejected] = refusals,
        ) -> None:
            barrier.wait()
            try:
                admitted.append(gk.admit("shop", "checkout", "a"))
            except Rejected as rejection:
                refusals.append(rejection)

        threads = [start(attempt) for _ in range(48)]
        for thread in threads:
            thread.join()
        assert len(admitted) == 7
        assert {r.limit_path for r in refusals} == {"shop/checkout"}
        assert busy(gk) == {"shop": 7, "shop/checkout": 7}
        for admission in admitted:
            admission.release(200)
        assert busy(gk) == {}


def test_request_without_limits_is_admitted(make: Make) -> None:
    """A path no limit applies to is always admitted and counted nowhere."""
    gk = make({"shop/checkout": {"concurrency": 1}})
    for _ in range(3):
        gk.admit("shop", "login", "a")
    assert busy(gk) == {}
    assert gk.stats()["counters"]["admitted"] == 3


# ------------------------------------------------------------------------------------ rate


def test_rate_admits_n_per_rolling_window(make_clocked: Make, clock: FakeClock) -> None:
    """`3/10s` admits 3, refuses with GK-RATE-LIMIT until the first admission is 10 s old."""
    gk = make_clocked({"shop/checkout": {"rate": "3/10s"}})
    for _ in range(3):
        gk.admit("shop", "checkout", "a").release(200)
        clock.advance(1)
    clock.advance(-1)
    rejection = refused(gk, "shop", "checkout", "a")
    assert (rejection.code, rejection.status, rejection.level) == ("GK-RATE-LIMIT", 429, "service")
    assert (rejection.limit_path, rejection.limit_value) == ("shop/checkout", "3/10s")
    assert rejection.retry_after == 8
    clock.advance(7.999)
    assert refused(gk, "shop", "checkout", "a").retry_after == 1
    clock.advance(0.001)
    gk.admit("shop", "checkout", "a")
    assert refused(gk, "shop", "checkout", "a").retry_after == 1


def test_fixed_window_edge_cannot_admit_2n_minus_1(make_clocked: Make, clock: FakeClock) -> None:
    """1 hit at T, N-1 in [T+t/2, T+t), N tries at T+t: never 2N-1 within [T+t/2, T+3t/2)."""
    n, t = 5, 10.0
    gk = make_clocked({"shop/login/*": {"rate": f"{n}/{int(t)}s"}})
    start_time = clock.now
    admitted_at: list[float] = []

    def hit() -> None:
        try:
            gk.admit("shop", "login", "alice").release(200)
        except Rejected:
            return
        admitted_at.append(clock.now - start_time)

    hit()
    clock.advance(t / 2)
    for _ in range(n - 1):
        hit()
        clock.advance(t / 2 / n)
    clock.now = start_time + t
    for _ in range(n):
        hit()
    while clock.now < start_time + 1.5 * t:
        hit()
        clock.advance(0.25)
    in_edge_window = [at for at in admitted_at if t / 2 <= at < 1.5 * t]
    assert len(in_edge_window) == n
    assert len(admitted_at) == n + 1


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    limit=st.integers(1, 5),
    window=st.sampled_from([1.0, 2.5, 10.0]),
    gaps=st.lists(st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.5, 3.0]), min_size=1, max_size=40),
)
def test_rate_window_is_exact(
    make_clocked: Make, clock: FakeClock, limit: int, window: float, gaps: list[float]
) -> None:
    """A request is admitted if and only if fewer than N were admitted in the last window."""
    gk = make_clocked({"shop/login/*": {"rate": f"{limit}/{window}s"}})
    caller = f"c{next(_EXAMPLE)}"
    clock.advance(1000.0)
    admitted: list[float] = []
    for gap in gaps:
        clock.advance(gap)
        now = clock.now
        expected = sum(1 for at in admitted if at > now - window) < limit
        try:
            gk.admit("shop", "login", caller).release(200)
        except Rejected as rejection:
            assert not expected, f"refused at {now} with {admitted}"
            oldest = min(at for at in admitted if at > now - window)
            assert rejection.retry_after == max(1, math.ceil(round(oldest + window - now, 6)))
        else:
            assert expected, f"admitted at {now} with {admitted}"
            admitted.append(now)


_EXAMPLE = itertools.count()


def test_rate_retry_after_is_time_until_next_admission(
    make_clocked: Make, clock: FakeClock
) -> None:
    """Retry-After and the RateLimit fields say exactly when the next request gets in."""
    gk = make_clocked({"shop/login/*": {"rate": "2/minute"}})
    gk.admit("shop", "login", "alice").release(200)
    clock.advance(20)
    gk.admit("shop", "login", "alice").release(200)
    clock.advance(10.4)
    rejection = refused(gk, "shop", "login", "alice")
    assert rejection.retry_after == 30
    assert rejection.rate is not None
    assert (rejection.rate.quota, rejection.rate.window, rejection.rate.remaining) == (2, 60.0, 0)
    assert rejection.rate.reset == pytest.approx(29.6)
    assert rejection.limit_path == "shop/login/*"
    clock.advance(29.6)
    gk.admit("shop", "login", "alice")


def test_with_two_windows_full_the_longer_wait_is_answered(
    make_clocked: Make, clock: FakeClock
) -> None:
    """Refused with two rate windows full (2/10s on the project, 2/minute on the
    service), a request hears when it can really get in: the longer wait, in the name of
    the limit it waits for, and query() says the same."""
    gk = make_clocked({"shop": {"rate": "2/10s"}, "shop/login": {"rate": "2/minute"}})
    gk.admit("shop", "login", "a").release(200)
    clock.advance(1)
    gk.admit("shop", "login", "a").release(200)
    clock.advance(1)
    for rejection in (refused(gk, "shop", "login", "a"), gk.query("shop", "login", "a")):
        assert rejection is not None
        assert (rejection.limit_path, rejection.retry_after) == ("shop/login", 58)
        assert rejection.rate is not None
        assert rejection.rate.reset == pytest.approx(58)
    clock.advance(8.5)  # the project's window has room again, the service's has not
    assert (refused(gk, "shop", "login", "a").limit_path, gk.query("shop", "other", "a")) == (
        "shop/login",
        None,
    )
    clock.advance(50)
    gk.admit("shop", "login", "a")


def test_two_full_windows_on_every_backend(make: Make) -> None:
    """The same on a backend that keeps its own clock (Redis): with both windows full at
    once, the answer is the service's minute, not the project's ten seconds."""
    gk = make({"shop": {"rate": "2/10s"}, "shop/login": {"rate": "2/minute"}})
    for _ in range(2):
        gk.admit("shop", "login", "a").release(200)
    rejection = refused(gk, "shop", "login", "a")
    assert rejection.limit_path == "shop/login"
    assert rejection.retry_after in (59, 60)  # 60 less the moments the test took


@pytest.mark.parametrize("queue", [None, {"size": 5, "wait": 2}], ids=["no queue", "queue"])
def test_a_full_window_behind_a_full_concurrency_limit_is_answered(
    make: Make, queue: dict[str, float] | None
) -> None:
    """A caller whose window is full is refused by it, with the window's wait, also while
    a concurrency limit before it is full: told to come back in a second, it would be
    refused for the rest of the minute. Nor does it wait in that limit's queue (up to 2
    seconds) for an admission the window refuses for longer. Another caller, whose window
    has room, is refused by the concurrency limit (or waits in its queue) as before."""
    service: dict[str, Any] = {"concurrency": 1}
    if queue is not None:
        service["queue"] = queue
    gk = make({"shop/login": service, "shop/login/*": {"rate": "1/minute"}})
    held = gk.admit("shop", "login", "alice")
    for rejection in (refused(gk, "shop", "login", "alice"), gk.query("shop", "login", "alice")):
        assert rejection is not None
        assert (rejection.code, rejection.limit_path) == ("GK-RATE-LIMIT", "shop/login/*")
        assert rejection.retry_after in (59, 60)  # 60 less the moments the test took
    if queue is None:
        assert refused(gk, "shop", "login", "bob").code == "GK-CONCURRENCY-LIMIT"
    query = gk.query("shop", "login", "bob")
    assert query is not None and query.code == "GK-CONCURRENCY-LIMIT"
    held.release(200)


@pytest.mark.parametrize(
    "path", ["shop", "shop/login", "shop/login/alice", "shop/login/*"], ids=lambda p: p
)
def test_query_of_a_blocked_path_answers_as_admit_would_from_the_start(
    make: Make, path: str
) -> None:
    """`concurrency: 0` blocks a path (SPEC 3): query() says so before any request has
    touched it (a key never seen has no counter yet), as admit() then refuses."""
    gk = make({path: {"concurrency": 0}})
    query = gk.query("shop", "login", "alice")
    assert query is not None and query.code == "GK-CONCURRENCY-LIMIT"
    assert refused(gk, "shop", "login", "alice").limit_path == path
    assert gk.query("shop", "login", "alice") is not None


def test_concurrency_retry_after_follows_this_limits_delayed_releases(
    make_clocked: Make, clock: FakeClock
) -> None:
    """Retry-After of a full limit is when its own delayed slot frees, not another limit's."""
    gk = make_clocked(
        {
            "shop/flaky": {"concurrency": 1, "delay": 30},
            "shop/partner/*": {"concurrency": 1, "delay": 4},
        }
    )
    gk.admit("shop", "flaky", "crm").release(504, faulty=True)
    partner = gk.admit("shop", "partner", "crm")
    assert refused(gk, "shop", "partner", "crm").retry_after == 1  # in flight: any moment
    partner.release(504, faulty=True)
    clock.advance(1.5)
    assert refused(gk, "shop", "partner", "crm").retry_after == 3
    assert refused(gk, "shop", "flaky", "crm").retry_after == 29


def test_rate_window_slides_in_real_time(make: Make) -> None:
    """Real-time variant: after a tiny window passes, the rate limit admits again."""
    gk = make({"shop/login/*": {"rate": "2/0.2s"}}, clock=time.monotonic)
    gk.admit("shop", "login", "alice").release(200)
    gk.admit("shop", "login", "alice").release(200)

    def admitted() -> bool:
        try:
            gk.admit("shop", "login", "alice").release(200)
        except Rejected as rejection:
            assert rejection.code == "GK-RATE-LIMIT"
            assert rejection.retry_after == 1
            return False
        return True

    wait_until(admitted)
    assert gk.stats()["counters"]["admitted"] >= 3


def test_count_only_listed_statuses(make: Make) -> None:
    """With `count = [401]`, successful logins never use up the rate; failed ones do."""
    gk = make({"shop/login/*": {"rate": "2/minute", "count": [401]}})
    for _ in range(5):
        gk.admit("shop", "login", "alice").release(200)
    gk.admit("shop", "login", "alice").release(401)
    gk.admit("shop", "login", "alice").release(401)
    assert refused(gk, "shop", "login", "alice").code == "GK-RATE-LIMIT"
    gk.admit("shop", "login", "bob").release(200)


def test_count_reserves_at_admission_and_gives_back(make: Make) -> None:
    """Requests in flight hold their place in the window; a status not counted gives it back."""
    gk = make({"shop/login/*": {"rate": "2/minute", "count": [401, 403]}})
    first = gk.admit("shop", "login", "alice")
    second = gk.admit("shop", "login", "alice")
    assert refused(gk, "shop", "login", "alice").code == "GK-RATE-LIMIT"
    first.release(200)
    third = gk.admit("shop", "login", "alice")
    second.release(403)
    third.release(401)
    assert refused(gk, "shop", "login", "alice").code == "GK-RATE-LIMIT"


def test_concurrent_counted_responses_never_exceed_n(make: Make) -> None:
    """32 simultaneous failed logins count at most N: admission reserves the place."""
    gk = make({"shop/login/*": {"rate": "3/hour", "count": [401]}})
    barrier = threading.Barrier(32)
    all_tried = threading.Event()
    lock = threading.Lock()
    tried: list[bool] = []

    def attempt() -> None:
        barrier.wait()
        try:
            admission = gk.admit("shop", "login", "alice")
        except Rejected:
            admission = None
        with lock:
            tried.append(admission is not None)
        if admission is not None:
            # Hold until every other attempt was decided, then answer 401: counted.
            all_tried.wait(10)
            admission.release(401)

    threads = [start(attempt) for _ in range(32)]
    wait_until(lambda: len(tried) == 32)
    all_tried.set()
    for thread in threads:
        thread.join()
    assert tried.count(True) == 3
    assert refused(gk, "shop", "login", "alice").code == "GK-RATE-LIMIT"


def test_count_all_counts_every_status(make: Make) -> None:
    """`count = "all"` is the default: every admission counts whatever its status."""
    gk = make({"shop/login/*": {"rate": "2/minute", "count": "all"}})
    gk.admit("shop", "login", "alice").release(200)
    gk.admit("shop", "login", "alice").release(None)
    refused(gk, "shop", "login", "alice")


# ------------------------------------------------------------------------ delayed decreases


def test_faulty_response_holds_slots_for_the_delay(make_clocked: Make, clock: FakeClock) -> None:
    """After a faulty response the slots stay taken for `delay`, then free up on their own."""
    gk = make_clocked({"shop": {"concurrency": 5}, "shop/crm": {"concurrency": 1, "delay": 2.0}})
    threads_before = threading.active_count()
    gk.admit("shop", "crm", "a").release(504, faulty=True)
    assert gk.stats()["counters"]["delayed_pending"] == 1
    rejection = refused(gk, "shop", "crm", "a")
    assert rejection.retry_after == 2
    clock.advance(1.999)
    refused(gk, "shop", "crm", "a")
    assert busy(gk) == {"shop": 1, "shop/crm": 1}
    clock.advance(0.001)
    # Matured during this request's own handling: no background thread exists.
    gk.admit("shop", "crm", "a").release(200)
    assert threading.active_count() == threads_before
    assert gk.stats()["counters"]["delayed_pending"] == 0
    assert busy(gk) == {}


def test_delayed_pending_drops_the_matured_ones_with_no_traffic(
    make_clocked: Make, clock: FakeClock
) -> None:
    """`delayed_pending` counts the delays not matured yet: once they have, stats() reads
    0 without any request in between (after an incident, when traffic stopped)."""
    gk = make_clocked({"shop/crm": {"concurrency": 5, "delay": 2.0}})
    for _ in range(3):
        gk.admit("shop", "crm", "a").release(500, faulty=True)
        clock.advance(0.5)
    assert gk.stats()["counters"]["delayed_pending"] == 3
    assert gk.delayed_pending() == 3
    clock.advance(0.6)  # the first matured, two to go
    assert gk.stats()["counters"]["delayed_pending"] == 2
    clock.advance(1.0)
    assert gk.stats()["counters"]["delayed_pending"] == 0
    assert gk.delayed_pending() == 0
    assert busy(gk) == {}


def test_ok_response_frees_at_once_despite_delay(make: Make) -> None:
    """A healthy response releases immediately, whatever `delay` says."""
    gk = make({"shop": {"concurrency": 1, "delay": 60.0}})
    gk.admit("shop", "crm", "a").release(200)
    gk.admit("shop", "crm", "a").release(404)
    assert busy(gk) == {}
    assert gk.stats()["counters"]["delayed_pending"] == 0


def test_delays_mature_before_new_ones_and_all_reach_zero(
    make_clocked: Make, clock: FakeClock
) -> None:
    """Due delays are applied on the next release, too; after every delay all is zero."""
    gk = make_clocked(
        {
            "shop": {"concurrency": 10, "delay": 1.0},
            "shop/crm": {"concurrency": 3, "delay": 3.0},
            "shop/crm/*": {"concurrency": 2, "delay": 5.0},
        }
    )
    admissions = [gk.admit("shop", "crm", f"c{i % 2}") for i in range(3)]
    admissions += [gk.admit("shop", "erp", "x")]
    admissions[0].release(500, faulty=True)
    clock.advance(5)
    admissions[1].release(500, faulty=True)
    assert gk.stats()["counters"]["delayed_pending"] == 1
    admissions[2].release(200)
    admissions[3].release(500, faulty=True)
    clock.advance(5)
    assert busy(gk) == {}
    assert gk.stats()["counters"]["delayed_pending"] == 0


def test_delayed_decrease_in_real_time(make: Make) -> None:
    """Real-time variant: a faulty response's slots are held, then come back by themselves."""
    gk = make({"shop": {"concurrency": 1, "delay": 0.5}}, clock=time.monotonic)
    gk.admit("shop", "crm", "a").release(503, faulty=True)
    assert busy(gk) == {"shop": 1}
    wait_until(lambda: busy(gk) == {})
    gk.admit("shop", "crm", "a").release(200)


# -------------------------------------------------------------------------------- queueing


def test_queue_admits_waiters_in_fifo_order(make: Make) -> None:
    """Waiters are admitted one by one in the order they arrived."""
    gk = make({"shop/checkout": {"concurrency": 1, "queue": {"size": 10, "wait": 60}}})
    holder = gk.admit("shop", "checkout", "a")
    order: list[int] = []

    def waiter(index: int) -> Callable[[], None]:
        def run() -> None:
            admission = gk.admit("shop", "checkout", f"w{index}")
            order.append(index)
            admission.release(200)

        return run

    threads = []
    for index in range(6):
        threads.append(start(waiter(index)))
        wait_until(lambda queued=index + 1: waiters(gk) == queued)
    holder.release(200)
    for thread in threads:
        thread.join(10)
    assert order == list(range(6))
    assert gk.stats()["counters"]["rejected"] == {}
    assert busy(gk) == {}


def test_queue_full_rejects_at_once(make: Make) -> None:
    """With `size` waiters already queued, the next request gets GK-QUEUE-FULL immediately."""
    gk = make({"shop/checkout": {"concurrency": 1, "queue": {"size": 1, "wait": 30}}})
    holder = gk.admit("shop", "checkout", "a")
    admitted = threading.Event()

    def wait_in_queue() -> None:
        gk.admit("shop", "checkout", "b")
        admitted.set()

    thread = start(wait_in_queue)
    wait_until(lambda: waiters(gk) == 1)
    rejection = refused(gk, "shop", "checkout", "c")
    assert (rejection.code, rejection.status) == ("GK-QUEUE-FULL", 503)
    assert (rejection.level, rejection.limit_path, rejection.limit_value) == (
        "service",
        "shop/checkout",
        "1",
    )
    assert rejection.retry_after == 30
    assert not admitted.is_set()
    holder.release(200)
    thread.join(10)
    assert admitted.is_set()
    assert gk.stats()["counters"]["rejected"] == {"GK-QUEUE-FULL": 1}


def test_queue_timeout_after_a_short_real_wait(make: Make) -> None:
    """A waiter that gets no slot within `wait` seconds receives GK-QUEUE-TIMEOUT."""
    gk = make(
        {"shop/checkout": {"concurrency": 1, "queue": {"size": 5, "wait": 0.05}}},
        clock=time.monotonic,
    )
    gk.admit("shop", "checkout", "a")
    rejection = refused(gk, "shop", "checkout", "b")
    assert (rejection.code, rejection.status) == ("GK-QUEUE-TIMEOUT", 503)
    assert (rejection.limit_path, rejection.retry_after) == ("shop/checkout", 1)
    stats = gk.stats()["counters"]
    assert stats["rejected"] == {"GK-QUEUE-TIMEOUT": 1}
    assert stats["rejected_by_limit"] == {"shop/checkout": 1}
    assert waiters(gk) == 0
    assert busy(gk) == {"shop/checkout": 1}


def test_queue_faults_say_how_long_a_delay_still_holds_the_slot(
    make_clocked: Make, clock: FakeClock
) -> None:
    """A full queue, and a wait that timed out, answer the Retry-After a refusal without a
    queue gives (SPEC 5): the time the delayed release still holds the slot, not the
    queue's wait of one second (clients would come back three times during the delay
    meant to let the backend recover)."""
    gk = make_clocked(
        {"shop/checkout": {"concurrency": 1, "delay": 4, "queue": {"size": 1, "wait": 1}}}
    )
    gk.admit("shop", "checkout", "a").release(504, True)
    got: list[Rejected] = []

    def wait_in_line() -> None:
        with pytest.raises(Rejected) as info:
            gk.admit("shop", "checkout", "b")
        got.append(info.value)

    thread = start(wait_in_line)
    wait_until(lambda: waiters(gk) == 1)
    full = refused(gk, "shop", "checkout", "c")
    assert (full.code, full.limit_path, full.retry_after) == ("GK-QUEUE-FULL", "shop/checkout", 4)
    clock.advance(1.5)  # the waiter's second is up; 2.5 s of the delay are left
    thread.join(30)
    (timed_out,) = got
    assert (timed_out.code, timed_out.retry_after) == ("GK-QUEUE-TIMEOUT", 3)
    clock.advance(3)
    gk.admit("shop", "checkout", "d").release(200)
    assert busy(gk) == {}


def test_a_rate_limits_queue_timeout_says_when_the_window_admits(make: Make) -> None:
    """A waiter in a rate limit's queue that times out (the window freed a place within
    its wait, and the waiter ahead took it) hears when that window admits again (not the
    queue's wait), with the RateLimit fields of a rate refusal."""
    gk = make(
        {"shop/export": {"rate": "1/1s", "queue": {"size": 2, "wait": 1.5}}},
        clock=time.monotonic,
    )
    gk.admit("shop", "export", "a").release(200)
    got: list[Admission | Rejected] = []

    def wait_in_line() -> None:
        try:
            got.append(gk.admit("shop", "export", "b"))
        except Rejected as rejected:
            got.append(rejected)

    first = start(wait_in_line)
    wait_until(lambda: waiters(gk) == 1)
    second = start(wait_in_line)
    for thread in (first, second):
        thread.join(30)
    admitted, rejection = got
    assert isinstance(admitted, Admission) and isinstance(rejection, Rejected)
    assert (rejection.code, rejection.limit_path) == ("GK-QUEUE-TIMEOUT", "shop/export")
    assert rejection.retry_after == 1  # the window's next place, not the queue's wait
    assert rejection.rate is not None
    assert (rejection.rate.quota, rejection.rate.window, rejection.rate.remaining) == (1, 1.0, 0)


@pytest.mark.parametrize(
    "spec",
    [
        {"rate": "1/minute", "queue": {"size": 5, "wait": 5}},
        {"rate": "1/minute", "concurrency": 1},
        {"rate": "1/minute", "concurrency": 1, "queue": {"size": 5, "wait": 5}},
    ],
    ids=["rate + queue", "rate + concurrency", "rate + concurrency + queue"],
)
def test_a_window_that_refuses_longer_than_the_wait_answers_at_once(
    make: Make, spec: dict[str, Any]
) -> None:
    """A limit whose window refuses a request for a minute answers with the window's
    refusal at once: 429 and the minute's Retry-After - not a place in its queue held for
    the whole wait only to time out (a brute force tying up worker threads), and not the
    "retry in a second" of its concurrency when that is full too (the backends look at a
    limit's concurrency before its rate)."""
    gk = make({"shop/login": spec}, clock=time.monotonic)
    held = gk.admit("shop", "login", "a")
    if "concurrency" not in spec:
        held.release(200)
    rejection = refused(gk, "shop", "login", "b")
    assert (rejection.code, rejection.status) == ("GK-RATE-LIMIT", 429)
    assert rejection.retry_after in (59, 60)  # a minute less the moments the test took
    assert gk.stats()["counters"]["rejected"] == {"GK-RATE-LIMIT": 1}
    assert waiters(gk) == 0
    if "concurrency" in spec:
        held.release(200)


def test_queue_waiter_woken_by_release(make: Make) -> None:
    """A queued request gets in as soon as the holder's response is closed."""
    gk = make({"shop/checkout": {"concurrency": 1, "queue": {"size": 5, "wait": 60}}})
    holder = gk.admit("shop", "checkout", "a")
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "checkout", "b")))
    wait_until(lambda: waiters(gk) == 1)
    assert got == []
    holder.release(200)
    thread.join(10)
    assert len(got) == 1
    assert busy(gk) == {"shop/checkout": 1}


def test_queue_waiter_woken_by_a_reload_that_raises_the_limit(make: Make, tmp_path: Path) -> None:
    """A reload that raises a full limit admits its waiters at once (no release will tell
    them), while the holder still holds its slot."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "limits.shop/checkout.concurrency = 1\nlimits.shop/checkout.queue = 5, 120\n")
    gk = reloading(make, path)
    holder = gk.admit("shop", "checkout", "a")
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "checkout", "b")))
    wait_until(lambda: waiters(gk) == 1)
    rewrite(path, "limits.shop/checkout.concurrency = 2\nlimits.shop/checkout.queue = 5, 120\n")
    assert gk.reload()
    thread.join(DEADLINE)
    assert len(got) == 1
    assert busy(gk) == {"shop/checkout": 2}
    holder.release(200)
    got[0].release(200)


def test_queue_waiters_check_a_file_due_for_a_reload(make: Make, tmp_path: Path) -> None:
    """Waiters check the file as requests do: a reload due while they wait (no newcomer
    comes to make it, no one calls reload()) applies to them - a raised limit admits them
    while the holder still holds its slot."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "limits.shop/checkout.concurrency = 1\nlimits.shop/checkout.queue = 5, 120\n")
    gk = make({}, clock=time.monotonic, reload={"file": str(path), "every_seconds": 0.05})
    holder = gk.admit("shop", "checkout", "a")
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "checkout", "b")))
    wait_until(lambda: waiters(gk) == 1)
    rewrite(path, "limits.shop/checkout.concurrency = 2\nlimits.shop/checkout.queue = 5, 120\n")
    thread.join(DEADLINE)
    assert len(got) == 1
    assert gk.stats()["counters"]["reloads"] == 1
    assert busy(gk) == {"shop/checkout": 2}
    holder.release(200)
    got[0].release(200)


def test_queue_waiter_gets_the_slot_of_a_response_collected_unclosed(make: Make) -> None:
    """A response dropped without close() (a test client's) gives its slot back when
    collected: to the waiter in line, at once, not to whoever comes next."""
    gk = make({"shop/checkout": {"concurrency": 1, "queue": {"size": 5, "wait": 120}}})

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = GateKeeperMiddleware(app, gk)
    environ = EnvironBuilder(path="/checkout").get_environ()
    response = middleware(environ, lambda *args: None)
    assert busy(gk) == {"shop/checkout": 1}
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "checkout", "b")))
    wait_until(lambda: waiters(gk) == 1)
    del response  # collected: no close(), never iterated
    thread.join(DEADLINE)
    assert len(got) == 1
    assert busy(gk) == {"shop/checkout": 1}
    got[0].release(200)


def test_queue_waiter_woken_by_maturing_delay(make_clocked: Make, clock: FakeClock) -> None:
    """A slot freed by a maturing delay admits a waiter, though nobody released anything."""
    gk = make_clocked(
        {"shop/checkout": {"concurrency": 1, "delay": 0.05, "queue": {"size": 5, "wait": 60}}}
    )
    gk.admit("shop", "checkout", "a").release(504, faulty=True)
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "checkout", "b")))
    wait_until(lambda: waiters(gk) == 1)
    clock.advance(0.05)
    thread.join(10)
    assert len(got) == 1
    assert gk.stats()["counters"]["rejected"] == {}


def test_queue_waiter_woken_by_maturing_delay_in_real_time(make: Make) -> None:
    """Real-time variant: a waiter gets the slot a faulty response held for its delay."""
    gk = make(
        {"shop/checkout": {"concurrency": 1, "delay": 0.2, "queue": {"size": 5, "wait": 30}}},
        clock=time.monotonic,
    )
    gk.admit("shop", "checkout", "a").release(504, faulty=True)
    admission = gk.admit("shop", "checkout", "b")
    assert not admission.released
    assert gk.stats()["counters"]["rejected"] == {}


def test_queue_on_a_rate_limit_waits_for_the_window(make_clocked: Make, clock: FakeClock) -> None:
    """A queued request on an exhausted rate limit is admitted when the window slides."""
    gk = make_clocked({"shop/export": {"rate": "1/0.05s", "queue": {"size": 2, "wait": 60}}})
    gk.admit("shop", "export", "a").release(200)
    got: list[Admission] = []
    thread = start(lambda: got.append(gk.admit("shop", "export", "b")))
    wait_until(lambda: waiters(gk) == 1)
    clock.advance(0.05)
    thread.join(10)
    assert len(got) == 1


def test_queue_not_used_when_another_limit_refuses(make: Make) -> None:
    """A request refused by a limit without a queue is rejected at once, not queued."""
    gk = make(
        {
            "shop": {"concurrency": 1},
            "shop/checkout": {"concurrency": 5, "queue": {"size": 5, "wait": 60}},
        }
    )
    gk.admit("shop", "checkout", "a")
    rejection = refused(gk, "shop", "checkout", "b")
    assert (rejection.code, rejection.limit_path) == ("GK-CONCURRENCY-LIMIT", "shop")
    assert waiters(gk) == 0


def test_an_engine_dropped_unclosed_lets_its_backend_go(backend_url: str) -> None:
    """Frameworks drop engines (Django builds another on ``override_settings``, a Flask test
    builds an app per test): once one is collected, the backend it made is closed by the
    next call into an engine (its shared file's descriptor, its Redis connections and
    release thread let go), not kept to the process's end, where 250 settings changes
    ran out of descriptors."""

    def resources() -> tuple[int, int]:
        threads = sum(t.name == "gatekeeper-redis-release" for t in threading.enumerate())
        return len(os.listdir("/proc/self/fd")), threads

    settings = {"project": "shop", "backend": backend_url, "limits": {"shop": {"concurrency": 5}}}
    kept = GateKeeper(settings)

    def drop_one() -> None:
        dropped = GateKeeper(settings)
        dropped.admit("shop", "x", "a").release(200)
        del dropped
        gc.collect()
        kept.admit("shop", "x", "a").release(200)  # the next call into an engine

    for _ in range(3):  # and the kept engine's own connections are all open
        drop_one()
    before = resources()
    for _ in range(20):
        drop_one()
    assert resources() == before
    assert busy(kept) == {}
    kept.close()


# -------------------------------------------------------------------------------- shadow mode


def test_global_shadow_mode_never_rejects(make: Make) -> None:
    """In shadow mode requests over a limit are admitted, counted and logged, never refused."""
    gk = make({"shop": {"concurrency": 1, "rate": "2/minute"}}, mode="shadow")
    for _ in range(4):
        gk.admit("shop", "checkout", "a")
    counters = gk.stats()["counters"]
    assert counters["shadow_rejected"] == 3
    assert counters["rejected"] == {}
    assert counters["admitted"] == 4
    assert busy(gk) == {"shop": 4}


def test_shadow_admissions_are_logged_once_an_interval_per_limit(
    make: Make, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Sizing a limit in shadow mode on live traffic, its admissions over the limit come by
    the thousand, in the requests' threads: one INFO per limit and interval, with how many
    there were since the last, not one per request (a slow handler would hold up each)."""
    gk = make({"shop/report": {"concurrency": 0, "mode": "shadow"}})
    with caplog.at_level(logging.INFO, logger="gatekeeper"):
        for _ in range(50):
            gk.admit("shop", "report", "a").release(200)
        clock.advance(10)
        gk.admit("shop", "report", "a").release(200)
    lines = [r.getMessage() for r in caplog.records if "shadow mode" in r.getMessage()]
    assert lines == [
        "gatekeeper: shadow mode admitted 1 request(s) over the limit of shop/report since the"
        " last report",
        "gatekeeper: shadow mode admitted 50 request(s) over the limit of shop/report since the"
        " last report",
    ]
    assert gk.stats()["counters"]["shadow_rejected"] == 51


def test_per_limit_shadow_mode(make: Make) -> None:
    """A limit in shadow mode only reports, while the enforcing limits still refuse."""
    gk = make({"shop": {"concurrency": 1, "mode": "shadow"}, "shop/checkout": {"concurrency": 1}})
    gk.admit("shop", "login", "a")
    gk.admit("shop", "checkout", "a")
    rejection = refused(gk, "shop", "checkout", "a")
    assert rejection.limit_path == "shop/checkout"
    assert gk.stats()["counters"]["shadow_rejected"] == 1


def test_per_limit_enforce_in_global_shadow(make: Make) -> None:
    """A limit set to `enforce` refuses even when the whole configuration is in shadow mode."""
    gk = make(
        {"shop": {"concurrency": 1}, "shop/checkout": {"concurrency": 1, "mode": "enforce"}},
        mode="shadow",
    )
    gk.admit("shop", "checkout", "a")
    assert refused(gk, "shop", "checkout", "b").limit_path == "shop/checkout"
    gk.admit("shop", "login", "a")
    assert gk.stats()["counters"]["shadow_rejected"] == 1


def test_shadow_counts_rate_while_over_concurrency(make: Make) -> None:
    """A shadow request over concurrency still counts in the rate window it passed."""
    gk = make({"shop": {"concurrency": 1, "rate": "2/minute"}}, mode="shadow")
    held = [gk.admit("shop", "checkout", "a") for _ in range(2)]
    for admission in held:
        admission.release(200)
    assert gk.stats()["counters"]["shadow_rejected"] == 1
    # Two admissions fill the window: the third is over the rate, though not over concurrency.
    gk.admit("shop", "checkout", "a").release(200)
    assert gk.stats()["counters"]["shadow_rejected"] == 2


# ---------------------------------------------------------------------------- bounded keys
# max_keys is counted by the backends that keep their own tables (memory, shared), the same
# that follow the engine's clock; Redis lets idle keys expire instead.


def test_max_keys_bounds_memory_of_a_key_spraying_client(make_clocked: Make) -> None:
    """A client spraying 5 000 caller names cannot make the engine track over max_keys."""
    gk = make_clocked({"shop/api/*": {"concurrency": 1, "rate": "5/minute", "max_keys": 100}})
    for index in range(5000):
        # Past max_keys live windows, new keys are refused (tests/test_capacity.py).
        with contextlib.suppress(Rejected):
            gk.admit("shop", "api", f"spray-{index}").release(200)
    assert len(gk.inflight()) <= 100
    assert busy(gk) == {}


def test_idle_keys_are_evicted_first(make_clocked: Make) -> None:
    """A key still inside its rate window outlives newer idle keys when room is needed."""
    gk = make_clocked({"shop/login/*": {"rate": "1/minute", "count": [401], "max_keys": 2}})
    gk.admit("shop", "login", "mallory").release(401)
    gk.admit("shop", "login", "alice").release(200)
    gk.admit("shop", "login", "bob").release(200)
    assert set(gk.inflight()) == {"shop/login/mallory", "shop/login/bob"}
    assert refused(gk, "shop", "login", "mallory").code == "GK-RATE-LIMIT"


def test_least_recently_used_idle_key_goes_first(make_clocked: Make) -> None:
    """Among idle keys the one unused for longest is evicted. (Without an idle key, the
    new key is refused: tests/test_capacity.py.)"""
    gk = make_clocked({"shop/api/*": {"concurrency": 1, "max_keys": 3}})
    for caller in ("a", "b", "c", "a", "d"):
        gk.admit("shop", "api", caller).release(200)
    assert set(gk.inflight()) == {"shop/api/a", "shop/api/c", "shop/api/d"}


# In-flight and delayed state is never evicted: tests/test_capacity.py, on the backends
# that refuse a key they cannot track.


def test_a_user_named_as_an_exact_caller_path_counts_apart(make: Make) -> None:
    """A user whose name is an exact caller limit's segment neither spends that caller's
    limit nor shares its counter (nor is a server error): the `*` limit counts the user
    under a digest of its own."""
    gk = make(
        {"shop/login/alice": {"concurrency": 2}, "shop/login/*": {"concurrency": 1, "key": "user"}}
    )
    gk.admit("shop", "login", "bob", user="alice")
    assert refused(gk, "shop", "login", "carol", user="alice").limit_path == "shop/login/*"
    gk.admit("shop", "login", "alice")
    gk.admit("shop", "login", "alice")
    assert refused(gk, "shop", "login", "alice").limit_path == "shop/login/alice"
    keys = busy(gk)
    assert keys.pop("shop/login/alice") == 2
    [(digest, count)] = keys.items()
    assert re.fullmatch(r"shop/login/~[0-9a-f]{16}", digest) and count == 1


@pytest.mark.parametrize(
    ("limits", "attacker", "victim"),
    [
        (  # a header value naming the exact limit of caller "vip"
            {
                "p/x/vip": {"rate": "2/minute"},
                "p/x/*": {"rate": "2/minute", "key": "header:X-Key"},
            },
            ("mallory", {"HTTP_X_KEY": "vip"}),
            ("vip", {}),
        ),
        (  # a caller naming itself as the exact limit of an address
            {
                "p/x/10.0.0.7": {"rate": "2/minute", "key": "ip"},
                "p/x/*": {"rate": "2/minute"},
            },
            ("10.0.0.7", {"REMOTE_ADDR": "192.0.2.1"}),
            ("crm", {"REMOTE_ADDR": "10.0.0.7"}),
        ),
        (  # an IPv6 network's segment, named by a caller, spends nobody's quota
            {
                "p/x/2001:db8::-64": {"rate": "2/minute"},
                "p/x/*": {"rate": "2/minute", "key": "ip"},
            },
            ("mallory", {"REMOTE_ADDR": "2001:db8::7"}),
            ("2001:db8::-64", {"REMOTE_ADDR": "192.0.2.9"}),
        ),
    ],
    ids=["header-vs-caller", "caller-vs-ip", "ip-vs-caller"],
)
def test_a_wildcard_value_cannot_spend_an_exact_limit_read_from_another_key(
    make: Make,
    limits: dict[str, Any],
    attacker: tuple[str, dict[str, str]],
    victim: tuple[str, dict[str, str]],
) -> None:
    """Two caller-level limits of one route counting by different keys: a request value
    equal to the exact limit's segment counts under the `*` limit apart, so an attacker
    exhausting it leaves the exact limit's quota whole (SPEC 4.5)."""
    gk = make(limits)
    caller, environ = attacker
    for _ in range(2):
        gk.admit("p", "x", caller, environ=environ).release(200)
    assert refused(gk, "p", "x", caller, environ=environ).limit_path == "p/x/*"
    caller, environ = victim
    for _ in range(2):
        gk.admit("p", "x", caller, environ=environ).release(200)
    exact = next(path for path in limits if not path.endswith("*"))
    assert refused(gk, "p", "x", caller, environ=environ).limit_path == exact


# ------------------------------------------------------------------------------- hot reload


@pytest.fixture
def limits_file(tmp_path: Path) -> Path:
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "limits.shop/checkout.concurrency = 1\n")
    return path


def reloading(
    make: Make, path: Path, every_seconds: float = 3600, every_requests: int = 100_000
) -> GateKeeper:
    return make(
        {},
        reload={
            "file": str(path),
            "every_seconds": every_seconds,
            "every_requests": every_requests,
        },
    )


def test_requests_refused_for_a_missing_caller_still_reload(make: Make, tmp_path: Path) -> None:
    """A file that makes every request refused before admission (caller.required, no
    client sends one) is still replaced by the next: those requests are handled too, and
    count towards every_requests."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "caller.required = true\nlimits.shop.concurrency = 5\n")
    gk = reloading(make, path, every_requests=2)
    client = Client(GateKeeperMiddleware(ok_app, gk))
    assert client.get("/checkout").status_code == 400
    rewrite(path, "caller.required = false\nlimits.shop.concurrency = 5\n")
    statuses = [client.get("/checkout").status_code for _ in range(3)]
    assert statuses[-1] == 200 and gk.config.caller.required is False


@pytest.mark.parametrize("before", ["shop/login/*", "*/login/*"])
def test_a_reload_giving_a_tracked_key_its_own_rate_keeps_its_window(
    make: Make, tmp_path: Path, before: str
) -> None:
    """A key first counted by a wildcard limit, then (after a reload) by an exact limit of
    its own with a rate: other keys filling the wildcard's table cannot evict it and
    reset that rate (SPEC 4.5), as when the limits were there from the start. Also when
    the reload replaced the wildcard limit by a more specific one."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, f"limits.{before}.concurrency = 100\nlimits.{before}.max_keys = 2\n")
    gk = reloading(make, path, every_requests=1)
    gk.admit("shop", "login", "alice").release(200)
    rewrite(
        path,
        "limits.shop/login/*.concurrency = 100\nlimits.shop/login/*.max_keys = 2\n"
        "limits.shop/login/alice.rate = 1/hour\n",
    )
    gk.admit("shop", "login", "alice").release(200)  # the reload, then alice's one
    assert gk.config.limits["shop/login/alice"].rate is not None
    for n in range(3):
        gk.admit("shop", "login", f"spray{n}").release(200)
    assert refused(gk, "shop", "login", "alice").limit_path == "shop/login/alice"


def test_a_window_a_reload_lengthens_counts_what_is_inside_its_new_length(
    make_clocked: Make, clock: FakeClock, tmp_path: Path
) -> None:
    """1/1s with a concurrency of 1, then (reloaded) 2/5s: the admission of a second ago
    is inside the new window, even though it had slid out of the old one while a refusal
    by the concurrency limit looked at it (a look does not drop entries; hypothesis found
    the stress model dropping them there)."""
    path = tmp_path / "gatekeeper.properties"
    rewrite(path, "limits.shop.concurrency = 1\nlimits.shop.rate = 1/1s\n")
    gk = reloading(make_clocked, path, every_requests=1)
    held = gk.admit("shop", "orders", "c")
    clock.advance(1.0)
    assert refused(gk, "shop", "orders", "c").code == "GK-CONCURRENCY-LIMIT"
    rewrite(path, "limits.shop.rate = 2/5s\n")
    gk.admit("shop", "orders", "c").release(200)  # the reload, then the second in 5 s
    assert gk.config.limits["shop"].concurrency is None
    rejection = refused(gk, "shop", "orders", "c")
    assert (rejection.code, rejection.retry_after) == ("GK-RATE-LIMIT", 4)
    held.release(200)


def test_reload_after_every_requests(make: Make, limits_file: Path) -> None:
    """A changed file is picked up once `every_requests` requests have been handled."""
    gk = reloading(make, limits_file, every_requests=3)
    gk.admit("shop", "checkout", "a")
    rewrite(limits_file, "limits.shop/checkout.concurrency = 2\n")
    refused(gk, "shop", "checkout", "b")
    gk.admit("shop", "checkout", "c")
    assert gk.config.limits["shop/checkout"].concurrency == 2
    assert gk.stats()["counters"]["reloads"] == 1


def test_reload_after_every_seconds(make: Make, clock: FakeClock, limits_file: Path) -> None:
    """A changed file is picked up by the first request after `every_seconds`."""
    gk = reloading(make, limits_file, every_seconds=5)
    gk.admit("shop", "checkout", "a")
    rewrite(limits_file, "limits.shop/checkout.concurrency = 2\n")
    clock.advance(4.9)
    refused(gk, "shop", "checkout", "b")
    clock.advance(0.1)
    gk.admit("shop", "checkout", "c")
    assert gk.stats()["counters"]["reloads"] == 1


def test_reload_detects_changes_only(make: Make, limits_file: Path) -> None:
    """reload() is True only when the file's configuration really changed."""
    gk = reloading(make, limits_file)
    assert gk.reload() is False
    later = limits_file.stat().st_mtime_ns + 5_000_000_000
    os.utime(limits_file, ns=(later, later))
    assert gk.reload() is False
    rewrite(limits_file, "# same limits, new comment\nlimits.shop/checkout.concurrency = 1\n")
    assert gk.reload() is False
    rewrite(limits_file, "limits.shop/checkout.concurrency = 3\n")
    assert gk.reload() is True
    assert gk.reload() is False
    counters = gk.stats()["counters"]
    assert (counters["reloads"], counters["reload_failed"]) == (1, 0)
    assert gk.stats()["stages"]["reload"]["count"] >= 1


def test_invalid_file_keeps_the_old_configuration(
    make: Make, limits_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken file is reported once (file, line, reason) and the old limits stay in force."""
    gk = reloading(make, limits_file, every_requests=1)
    rewrite(limits_file, "project = shop\nlimits.shop/checkout.concurrency = -1\n")
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        gk.admit("shop", "checkout", "a")
        refused(gk, "shop", "checkout", "b")
        assert gk.reload() is False
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert f"{limits_file}:2:" in errors[0]
    assert "limits.shop/checkout.concurrency" in errors[0]
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert gk.config.limits["shop/checkout"].concurrency == 1
    rewrite(limits_file, "limits.shop/checkout.concurrency = 2\n")
    assert gk.reload() is True
    gk.admit("shop", "checkout", "c")


def test_deleted_file_keeps_the_old_configuration(make: Make, limits_file: Path) -> None:
    """A file that disappears is a failed reload, not an empty configuration."""
    gk = reloading(make, limits_file)
    limits_file.unlink()
    assert gk.reload() is False
    assert gk.stats()["counters"]["reload_failed"] == 1
    gk.admit("shop", "checkout", "a")
    refused(gk, "shop", "checkout", "a")


def test_admission_under_a_changed_limit_releases_once(make: Make, limits_file: Path) -> None:
    """A request admitted before its limit was raised releases its one slot, exactly once."""
    gk = reloading(make, limits_file)
    old = gk.admit("shop", "checkout", "a")
    rewrite(limits_file, "limits.shop/checkout.concurrency = 3\n")
    assert gk.reload() is True
    newer = [gk.admit("shop", "checkout", "b") for _ in range(2)]
    refused(gk, "shop", "checkout", "c")
    old.release(200)
    old.release(200)
    assert busy(gk) == {"shop/checkout": 2}
    for admission in newer:
        admission.release(200)
    assert busy(gk) == {}


def test_admission_under_a_removed_limit_releases_once(make: Make, limits_file: Path) -> None:
    """A request admitted under a limit the reload removed still releases cleanly."""
    rewrite(limits_file, "limits.shop/checkout/*.concurrency = 1\nlimits.shop.concurrency = 5\n")
    gk = reloading(make, limits_file)
    old = gk.admit("shop", "checkout", "alice")
    rewrite(limits_file, "limits.shop/login.rate = 5/minute\n")
    assert gk.reload() is True
    gk.admit("shop", "checkout", "alice").release(200)
    old.release(200)
    old.release(200)
    assert busy(gk) == {}
    assert all(count >= 0 for count in gk.inflight().values())


def test_reload_that_changes_a_wildcard_pattern(make: Make, limits_file: Path) -> None:
    """Keys counted under `shop/login/*` keep counting when a reload makes it `shop/*/*`."""
    rewrite(limits_file, "limits.shop/login/*.concurrency = 1\n")
    gk = reloading(make, limits_file)
    old = gk.admit("shop", "login", "alice")
    rewrite(limits_file, "limits.shop/*/*.concurrency = 1\n")
    assert gk.reload() is True
    assert refused(gk, "shop", "login", "alice").limit_path == "shop/*/*"
    gk.admit("shop", "login", "bob").release(200)
    old.release(200)
    gk.admit("shop", "login", "alice").release(200)
    assert busy(gk) == {}


def test_reloaded_file_is_laid_over_settings(make: Make, tmp_path: Path) -> None:
    """Settings keep the structure while the reloaded file changes the tunable limits."""
    path = tmp_path / "ops.toml"
    rewrite(path, '[limits."shop/checkout"]\nconcurrency = 1\n')
    gk = make(
        {"shop": {"concurrency": 10}, "shop/checkout": {"concurrency": 5}},
        reload={"file": str(path), "every_requests": 100_000, "every_seconds": 3600},
    )
    gk.admit("shop", "checkout", "a")
    refused(gk, "shop", "checkout", "a")
    rewrite(path, '[limits."shop/checkout"]\nconcurrency = 2\n')
    assert gk.reload() is True
    gk.admit("shop", "checkout", "a")
    assert gk.config.limits["shop"].concurrency == 10
    assert busy(gk) == {"shop": 2, "shop/checkout": 2}


def test_reload_without_a_file_is_a_no_op(make: Make) -> None:
    """reload() on a configuration from settings alone changes nothing and says so."""
    gk = make({"shop": {"concurrency": 1}})
    assert gk.reload() is False
    assert gk.stats()["counters"]["reloads"] == 0


# ------------------------------------------------------------------------------ monitoring


def test_stats_count_what_happened(make: Make) -> None:
    """Admissions, rejections by code and by limit, and stage timings are counted."""
    gk = make({"shop/checkout": {"concurrency": 1}, "shop/login/*": {"rate": "1/hour"}})
    gk.admit("shop", "checkout", "a")
    refused(gk, "shop", "checkout", "a")
    refused(gk, "shop", "checkout", "b")
    gk.admit("shop", "login", "alice").release(200)
    refused(gk, "shop", "login", "alice")
    stats = gk.stats()
    counters = stats["counters"]
    assert counters["admitted"] == 2
    assert counters["rejected"] == {"GK-CONCURRENCY-LIMIT": 2, "GK-RATE-LIMIT": 1}
    assert counters["rejected_by_limit"] == {"shop/checkout": 2, "shop/login/*": 1}
    assert counters["shadow_rejected"] == counters["backend_errors"] == 0
    assert stats["stages"]["resolve_limits"]["count"] == 5
    assert stats["stages"]["decide"]["count"] == 5
    decide = stats["stages"]["decide"]
    assert 0 <= decide["mean_us"] <= decide["max_us"]
    assert decide["p99_us"] <= decide["max_us"]


def test_decision_timings_count_all_and_keep_the_latest(make: Make) -> None:
    """Every decision is counted; one in SAMPLING is timed, and each one while an observer
    watches; the timings are those of the most recent decisions only: a long run keeps a
    bounded number of samples."""
    gk = make({"shop": {"concurrency": 10}})
    seen: list[float] = []
    for n in range(2100):
        if n == 1000:
            gk.monitor.observe("request", seen.append)
        gk.admit("shop", "crm", "a").release(200)
        if n == 999:
            assert len(gk.monitor.recent) == 1000 // SAMPLING
    stages = gk.stats()["stages"]
    assert stages["request"]["count"] == stages["decide"]["count"] == 2100
    assert len(seen) == 1100
    assert all(seconds >= 0 for seconds in seen)
    assert len(gk.monitor.recent) == 1024
    gk.monitor.observe("request", None)
    gk.admit("shop", "crm", "a").release(200)
    assert len(seen) == 1100
    assert gk.stats()["stages"]["request"]["count"] == 2101


def test_refusals_are_sampled_as_admissions_are(make: Make) -> None:
    """A run of refusals (a brute force against a rate limit) keeps the decision timings
    current: one decision in SAMPLING is timed, whatever its outcome."""
    gk = make({"shop/login/*": {"rate": "1/hour"}})
    gk.admit("shop", "login", "alice").release(200)
    for _ in range(8 * SAMPLING):
        refused(gk, "shop", "login", "alice")
    assert len(gk.monitor.recent) == 1 + 8
    stages = gk.stats()["stages"]
    assert stages["decide"]["count"] == 1 + 8 * SAMPLING
    assert stages["request"]["count"] == 1


def test_release_timings_count_all_and_time_a_sample(make: Make) -> None:
    """Every release is counted as the response stage and one in SAMPLING timed; a faulty
    one is timed each time, and so is every release while an observer watches."""
    gk = make({"shop": {"concurrency": 10}})
    for _ in range(4 * SAMPLING):
        gk.admit("shop", "crm", "a").release(200)
    response = gk.monitor.stages["response"]
    assert (response.count, response.timed) == (4 * SAMPLING, 4)
    assert gk.stats()["stages"]["response"]["count"] == 4 * SAMPLING
    for _ in range(3):
        gk.admit("shop", "crm", "a").release(500, faulty=True)
    errors = gk.monitor.stages["service_error"]
    assert (errors.count, errors.timed) == (3, 3)
    seen: list[float] = []
    gk.monitor.observe("response", seen.append)
    for _ in range(5):
        gk.admit("shop", "crm", "a").release(200)
    assert len(seen) == 5
    assert (response.count, response.timed) == (4 * SAMPLING + 5, 4 + 5)
    gk.monitor.observe("response", None)
    for _ in range(SAMPLING):
        gk.admit("shop", "crm", "a").release(200)
    assert len(seen) == 5
    assert response.count == 5 * SAMPLING + 5


def test_delay_stages_are_timed(make_clocked: Make, clock: FakeClock) -> None:
    """Placing and processing delayed decreases shows up in the stage timings."""
    gk = make_clocked({"shop": {"concurrency": 1, "delay": 1.0}})
    gk.admit("shop", "crm", "a").release(500, faulty=True)
    clock.advance(1)
    gk.admit("shop", "crm", "a")
    stages = gk.stats()["stages"]
    assert stages["delay_place"]["count"] == 1
    assert stages["delay_process"]["count"] >= 1


# ---------------------------------------------------------------------- release idempotence


def test_release_is_idempotent(make: Make, clock: FakeClock) -> None:
    """Releasing an admission twice frees its slots once; limits stay exact afterwards."""
    gk = make({"shop": {"concurrency": 2, "delay": 1.0}})
    first = gk.admit("shop", "checkout", "a")
    second = gk.admit("shop", "checkout", "a")
    first.release(200)
    first.release(200)
    first.release(500, faulty=True)
    assert first.released
    assert busy(gk) == {"shop": 1}
    gk.admit("shop", "checkout", "a")
    refused(gk, "shop", "checkout", "a")
    second.release(200)
    assert gk.stats()["counters"]["delayed_pending"] == 0


def test_retry_after_waits_for_the_longest_held_limit(make_clocked: Make, clock: FakeClock) -> None:
    """Two concurrency limits of a request full, each held by a delayed release of its own
    length: the refusal names the one the request must wait for longest, with its time,
    not the one that frees first (a client retrying then would be refused again)."""
    gk = make_clocked(
        {
            "shop": {"concurrency": 2},
            "shop/a": {"concurrency": 5, "delay": 2.0},
            "shop/b": {"concurrency": 1, "delay": 8.0},
        }
    )
    gk.admit("shop", "b", "c").release(500, faulty=True)
    gk.admit("shop", "a", "c").release(500, faulty=True)
    fault = refused(gk, "shop", "b", "c")
    assert (fault.code, fault.limit_path, fault.retry_after) == (
        "GK-CONCURRENCY-LIMIT",
        "shop/b",
        8,
    )
    clock.advance(2)
    assert refused(gk, "shop", "b", "c").retry_after == 6
    clock.advance(6)
    gk.admit("shop", "b", "c").release(200)
