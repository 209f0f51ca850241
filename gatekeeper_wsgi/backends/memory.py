"""The embedded backend: counters in this process's memory, one lock, exact for threads."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gatekeeper_wsgi.adaptive import Controller
from gatekeeper_wsgi.backends.base import Backend, Denial, Grant, Slot
from gatekeeper_wsgi.config import Limit
from gatekeeper_wsgi.errors import BackendError

__all__ = ["MemoryBackend"]

logger = logging.getLogger("gatekeeper")

# Processes that were warned that their limits are per process.
_WARNED: set[int] = set()
# Every memory backend of this process, for the fork hook below.
_BACKENDS: weakref.WeakSet[MemoryBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A lock held by another thread at fork time would stay held in the child forever.
    # Done by a fork hook rather than a pid check, which would cost a syscall per request.
    for backend in list(_BACKENDS):
        backend._lock = threading.Lock()
        backend._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# How many of a wildcard limit's oldest keys are looked at to choose one to evict.
_EVICTION_SAMPLE = 64


class _Counter:
    """State of one concrete path: requests in flight, the admission times of its
    rolling window (a sliding log: exact, O(N) per key) and, for an adaptive limit, the
    controller that sets its current limit."""

    __slots__ = ("gauge", "inflight", "used", "window")

    def __init__(self) -> None:
        self.inflight = 0
        self.window: deque[float] = deque()
        #: the admission (a count) that last used it, for eviction
        self.used = 0
        self.gauge: Controller | None = None


class _MemoryGrant(Grant):
    __slots__ = ("counters", "reserved", "stamp")

    def __init__(
        self,
        slots: Sequence[Slot],
        shadowed: tuple[int, ...],
        counters: list[_Counter],
        stamp: float,
        reserved: list[tuple[deque[float], frozenset[int]]],
        adaptive: bool,
    ) -> None:
        # Grant.__init__ inlined: a super() call per admission is measurable.
        self.slots = slots
        self.shadowed = shadowed
        self.adaptive = adaptive
        self.counters = counters
        #: the admission time, entered in the window of every rate slot that recorded it
        self.stamp = stamp
        #: (window, statuses that count) of the rate reservations the release decides on
        self.reserved = reserved


class FullError(BackendError):
    """A wildcard limit tracks ``max_keys`` keys, all with requests in flight."""


class MemoryBackend(Backend):
    """Counters in a dict guarded by one lock.

    Each request takes the lock once to admit and once to release; the work inside is a
    few dict lookups per level, so contention stays low even with many threads.
    """

    local = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, _Counter] = {}
        # Wildcard limits: the concrete keys each one created, oldest first (max_keys).
        self._wild: dict[str, dict[str, _Counter]] = {}
        self._delayed: list[tuple[float, int, list[_Counter]]] = []
        self._seq = itertools.count()
        self._tick = 0
        #: set in a forked child: the first admission there warns that limits are per process
        self._forked = False
        _BACKENDS.add(self)

    # --- admission ------------------------------------------------------------------------

    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        if self._forked:
            self._forked = False
            self.multiprocess()
        with self._lock:
            if self._delayed and self._delayed[0][0] <= now:
                self._mature(now)
            counters: list[_Counter] = []
            recording: list[deque[float]] = []
            reserved: list[tuple[deque[float], frozenset[int]]] = []
            shadowed: tuple[int, ...] = ()
            adaptive = False
            get = self._counters.get
            self._tick = tick = self._tick + 1
            # Counted as it goes; a refusal takes back what was counted before it. The
            # slot's index is len(counters): one counter per slot so far.
            for key, limit, enforce in slots:
                counter = get(key)
                if counter is None:
                    try:
                        counter = self._create(key, limit, now)
                    except FullError:
                        self._undo(counters)
                        raise
                counter.used = tick
                # An adaptive limit's capacity is -inf: its admissions all come here.
                if counter.inflight >= limit.capacity:
                    full = True
                    if limit.adaptive is not None:
                        adaptive = True
                        gauge = counter.gauge
                        if gauge is None or gauge.spec is not limit.adaptive:
                            gauge = self._gauge(key, counter, limit, now)
                        full = counter.inflight >= gauge.limit
                    if full:
                        if enforce:
                            self._undo(counters)
                            wait = self._soonest(counter, now)
                            return Denial(len(counters), "concurrency", wait, 0)
                        shadowed += (len(counters),)
                rate = limit.rate
                if rate is not None:
                    window = counter.window
                    cutoff = now - rate.seconds
                    while window and window[0] <= cutoff:
                        window.popleft()
                    if len(window) < rate.limit:
                        recording.append(window)
                        if limit.count is not None:
                            reserved.append((window, limit.count))
                    elif enforce:
                        self._undo(counters)
                        return Denial(len(counters), "rate", window[0] - cutoff, 0)
                    elif len(counters) not in shadowed:
                        # Shadow over concurrency still counts in the window; a full window
                        # is not extended (as enforce mode would not have admitted).
                        shadowed += (len(counters),)
                counter.inflight += 1
                counters.append(counter)
            for window in recording:
                window.append(now)
            return _MemoryGrant(slots, shadowed, counters, now, reserved, adaptive)

    @staticmethod
    def _undo(counters: list[_Counter]) -> None:
        for counter in counters:
            counter.inflight -= 1

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """What :meth:`acquire` would answer now, read under the lock: no trace, and no
        instant in which a probe holds slots."""
        with self._lock:
            if self._delayed and self._delayed[0][0] <= now:
                self._mature(now)
            for index, (key, limit, enforce) in enumerate(slots):
                counter = self._counters.get(key)
                if counter is None or not enforce:
                    continue
                concurrency = limit.concurrency
                if limit.adaptive is not None:
                    concurrency = self._gauge(key, counter, limit, now).limit
                if concurrency is not None and counter.inflight >= concurrency:
                    return Denial(index, "concurrency", self._soonest(counter, now), 0)
                if limit.rate is not None:
                    cutoff = now - limit.rate.seconds
                    live = [stamp for stamp in counter.window if stamp > cutoff]
                    if len(live) >= limit.rate.limit:
                        return Denial(index, "rate", live[0] - cutoff, 0)
        return None

    @staticmethod
    def _gauge(key: str, counter: _Counter, limit: Limit, now: float) -> Controller:
        """The controller of an adaptive limit's counter, made on first use and kept in
        step with a reloaded ``adaptive`` table."""
        spec = limit.adaptive
        assert spec is not None
        gauge = counter.gauge
        if gauge is None:
            gauge = counter.gauge = Controller(spec, now, key=key)
        elif gauge.spec is not spec:
            gauge.respec(spec)
        return gauge

    def observe(self, grant: Grant, faulty: bool, now: float) -> None:
        if TYPE_CHECKING:
            assert isinstance(grant, _MemoryGrant)
        stamp = grant.stamp
        with self._lock:
            for counter in grant.counters:
                gauge = counter.gauge
                if gauge is not None:
                    gauge.sample(now - stamp, counter.inflight, faulty, stamp, now)

    def adaptive(self) -> dict[str, dict[str, float | int]]:
        with self._lock:
            return {
                key: counter.gauge.report()
                for key, counter in self._counters.items()
                if counter.gauge is not None
            }

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        counter = self._counters.get(key)
        if counter is None or counter.gauge is None:
            return super().adaptive_limit(key, limit)
        return counter.gauge.limit

    def _create(self, key: str, limit: Limit, now: float) -> _Counter:
        counter = _Counter()
        if limit.wildcard:
            table = self._wild.setdefault(limit.path, {})
            if len(table) >= limit.max_keys:
                self._evict(table, limit, now)
            table[key] = counter
        self._counters[key] = counter
        return counter

    def _evict(self, table: dict[str, _Counter], limit: Limit, now: float) -> None:
        # Approximately least recently used, like Redis: of the oldest keys, an idle one
        # (nothing in flight, nothing left in the window) goes first, then the one used
        # longest ago with nothing in flight, losing its window. Keys with requests in
        # flight are never evicted. The search is bounded, so a spray of new keys costs
        # O(1) each.
        cutoff = now - limit.rate.seconds if limit.rate is not None else now
        idle = busy = None
        for scanned, (key, counter) in enumerate(table.items()):
            if counter.inflight == 0:
                window = counter.window
                if not window or window[-1] <= cutoff:
                    if idle is None or counter.used < table[idle].used:
                        idle = key
                elif busy is None or counter.used < table[busy].used:
                    busy = key
            if scanned >= _EVICTION_SAMPLE and (idle or busy) is not None:
                break
        victim = idle if idle is not None else busy
        if victim is None:
            raise FullError(
                f"limit {limit.path!r} tracks max_keys={len(table)} keys, all in flight"
            )
        del table[victim]
        self._counters.pop(victim, None)

    def _soonest(self, counter: _Counter, now: float) -> float:
        """Seconds until a delayed release of this counter matures; 0 when none is held
        (a request in flight may finish at any moment)."""
        dues = [due for due, _, counters in self._delayed if counter in counters]
        return max(0.0, min(dues) - now) if dues else 0.0

    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        if TYPE_CHECKING:  # checked by mypy only: an assert costs every release
            assert isinstance(grant, _MemoryGrant)
        with self._lock:
            for window, count in grant.reserved:
                if status not in count:
                    # It may have slid out of the window already.
                    with contextlib.suppress(ValueError):
                        window.remove(grant.stamp)
            if delay > 0:
                heapq.heappush(self._delayed, (now + delay, next(self._seq), grant.counters))
            else:
                for counter in grant.counters:
                    counter.inflight -= 1
            if self._delayed and self._delayed[0][0] <= now:
                self._mature(now)

    def _mature(self, now: float) -> None:
        started = time.perf_counter()
        delayed = self._delayed
        while delayed and delayed[0][0] <= now:
            for counter in heapq.heappop(delayed)[2]:
                counter.inflight -= 1
        if self.delay_stage is not None:
            self.delay_stage.record(time.perf_counter() - started)

    # --- observation ----------------------------------------------------------------------

    def inflight(self, now: float) -> dict[str, int]:
        with self._lock:
            if self._delayed and self._delayed[0][0] <= now:
                self._mature(now)
            return {key: counter.inflight for key, counter in self._counters.items()}

    def next_due(self) -> float | None:
        delayed = self._delayed
        return delayed[0][0] if delayed else None

    def delayed_pending(self) -> int:
        return len(self._delayed)

    def multiprocess(self) -> None:
        """Warn (once per process) that limits are counted per process: this runs in a
        forked worker, or the server says other processes serve the same app."""
        pid = os.getpid()
        if pid not in _WARNED:
            _WARNED.add(pid)
            logger.warning(
                "gatekeeper: the memory backend counts limits per process, and this process "
                "(pid %d) is one of several serving the app. Use backend "
                "'shared:///path/file' to share them between the workers of this host.",
                pid,
            )
