"""Exactly-once release under any thread switch (SPEC §4.2): two threads releasing the same
admission, or the same backend grant, free its slots once, on every backend.

A line tracer (what coverage tools and APM agents install, and what a free-threaded build
does without one) runs the two releases in lockstep, line by line, so each thread's check
is followed by the other's before either acts on it: the schedule that made in-flight go
to -1 and a concurrency-1 limit admit two.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from types import CodeType, FrameType
from typing import Any

import pytest

from gatekeeper_wsgi.backends.base import Grant
from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from tests.conftest import FakeClock, busy

TRIALS = 25
LIMITS = {"shop": {"concurrency": 1}, "shop/api/*": {"concurrency": 1, "rate": "1000/second"}}
# A partner that reaches no line for this long is blocked: on the lock the other holds
# (memory and shared release under a lock, so the other's next line waits for a partner
# that cannot come), or in a broken release. The other then goes on alone, so a regression
# fails the assertions instead of hanging the suite. No assertion depends on it: a
# partner that is merely slow costs only some forced switches.
STUCK = 0.2

Trace = Callable[[FrameType, str, Any], Any]


class Lockstep:
    """Runs two threads through the lines of ``codes`` in turns: at every line event each
    waits for the other to reach a line too. When a thread leaves the outermost traced
    call, the other runs on freely."""

    def __init__(self, codes: set[CodeType], outermost: CodeType) -> None:
        self.codes = codes
        self.outermost = outermost
        self.turns = threading.Barrier(2, timeout=STUCK)

    def run(self, call: Callable[[], object]) -> None:
        previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            call()
        finally:
            sys.settrace(previous)

    def _global(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        return self._local if frame.f_code in self.codes else None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Trace | None:
        if event == "line":
            with contextlib.suppress(threading.BrokenBarrierError):
                self.turns.wait()
        elif event == "return" and frame.f_code is self.outermost:
            self.turns.abort()
        return self._local


def race(lockstep: Lockstep, release: Callable[[], object]) -> None:
    threads = [threading.Thread(target=lockstep.run, args=(release,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def release_codes(gk: GateKeeper) -> set[CodeType]:
    backend_release = type(gk.backend).release
    return {Admission.release.__code__, Grant.claim.__code__, backend_release.__code__}


def assert_counted_once(gk: GateKeeper) -> None:
    """Nothing in flight, nothing below zero, and the concurrency-1 limit admits exactly one."""
    assert all(count >= 0 for count in gk.inflight().values()), gk.inflight()
    assert busy(gk) == {}
    first = gk.admit("shop", "api", "a")
    with pytest.raises(Rejected):
        gk.admit("shop", "api", "b")
    first.release(200)


@pytest.fixture
def gk(backend_url: str, clock: FakeClock) -> Iterator[GateKeeper]:
    """A GateKeeper with a concurrency-1 project on each backend of the table."""
    config = {"project": "shop", "backend": backend_url, "limits": LIMITS}
    keeper = GateKeeper(config, clock=clock)
    yield keeper
    keeper.close()


def test_concurrent_admission_releases_free_the_slots_once(gk: GateKeeper) -> None:
    """Two threads releasing one admission in lockstep free its slots once, every trial."""
    for _ in range(TRIALS):
        admission = gk.admit("shop", "api", "a")
        lockstep = Lockstep(release_codes(gk), Admission.release.__code__)
        race(lockstep, lambda admission=admission: admission.release(200))
        assert admission.released
        assert_counted_once(gk)


def test_concurrent_grant_releases_free_the_slots_once(gk: GateKeeper, clock: FakeClock) -> None:
    """Two threads handing one backend grant back in lockstep free its slots once."""
    backend = gk.backend
    slots = gk.route("shop", "api").slots
    for _ in range(TRIALS):
        grant = backend.acquire(slots, clock())
        assert isinstance(grant, Grant)
        outermost = type(backend).release.__code__
        lockstep = Lockstep(release_codes(gk), outermost)
        race(lockstep, functools.partial(backend.release, grant, 200, 0.0, clock()))
        assert_counted_once(gk)


def test_faulty_release_racing_a_plain_one_holds_the_delay_once(
    clocked_backend_url: str, clock: FakeClock
) -> None:
    """A faulty release (delayed) racing a plain one is applied once: either the slot is
    free now or it is held until the delay, never freed twice."""
    limits = {"shop": {"concurrency": 1}}
    gk = GateKeeper(
        {"project": "shop", "backend": clocked_backend_url, "limits": limits}, clock=clock
    )
    try:
        for _ in range(TRIALS):
            admission = gk.admit("shop", "api", "a")
            admission.delay = 5.0
            lockstep = Lockstep(release_codes(gk), Admission.release.__code__)
            flavours = iter([True, False])
            lock = threading.Lock()

            def release(
                admission: Admission = admission,
                flavours: Iterator[bool] = flavours,
                lock: threading.Lock = lock,
            ) -> None:
                with lock:
                    faulty = next(flavours)
                admission.release(500 if faulty else 200, faulty=faulty)

            race(lockstep, release)
            counts = gk.inflight()
            assert all(count >= 0 for count in counts.values()), counts
            assert busy(gk) in ({}, {"shop": 1})
            clock.advance(5)
            assert busy(gk) == {}
    finally:
        gk.close()
