"""Self-monitoring: the counters and stage timings behind ``GateKeeper.stats()``.

Recording is cheap enough for every request. A stage keeps a count (over the life of the
process) and a ring of its most recent 1024 samples, from which ``mean_us``, ``p99_us``
and ``max_us`` describe current behaviour.

The stages every request passes - its decision's (below) and ``response`` - count every
request but time one in :data:`SAMPLING` (each one while an exporter observes the stage):
their clock readings and records were a tenth of a request's overhead, and the cost of a
step varies little from one request to the next, so the sample describes them all.

The three stages of an admission decision - ``resolve_limits``, ``decide`` and
``request`` - are not recorded one by one: :meth:`Monitor.decision` stores the decision's
clock readings as they are, and the three durations are computed from them when asked
for. It runs on every request, where three stage records (or only the float arithmetic
of three durations) cost a measurable share of the overhead.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypedDict

# Imported, not only for type checking: the TypedDicts below are read at run time too.
from gatekeeper_wsgi.adaptive import AdaptiveReport

__all__ = [
    "DECISION_STAGES",
    "HISTORY_SECONDS",
    "REFUSED_KEYS",
    "SAMPLING",
    "STAGES",
    "Counters",
    "Monitor",
    "Snapshot",
    "Stage",
    "StageSummary",
    "Stats",
]

#: The stages timed on every request (SPEC §7).
STAGES = (
    "resolve_limits",
    "decide",
    "request",
    "reject",
    "response",
    "service_error",
    "reload",
    "delay_place",
    "delay_process",
    "queue_wait",
)
#: The stages read from :meth:`Monitor.decision`'s timestamps.
DECISION_STAGES = ("resolve_limits", "decide", "request")
#: One plain decision and release in this many is timed (a power of two; see above).
SAMPLING = 8

#: Keys remembered per limit as refused lately: the status page details them (a client
#: locked out by a rate limit has nothing in flight, so it is not among the busiest).
REFUSED_KEYS = 20
# Limit paths remembered with refused keys; reloads may retire paths, so it is bounded too.
_REFUSED_LIMITS = 1024

#: Seconds of rejection history kept (per-second counts by code), so a dashboard opened
#: now shows the rejections of the last minutes, not only those after it was opened.
HISTORY_SECONDS = 300

_RING = 1024  # a power of two: the ring index is a mask
_RING_MASK = _RING - 1
# Rings are lists, not arrays of doubles: a store into a list is one specialised
# bytecode, where an array's converts the float through PyArg_Parse (~300 instructions,
# four stores per request: measured with callgrind).

#: called with a sample, in seconds
Observer = Callable[[float], None]


class StageSummary(TypedDict):
    """One stage's timings in ``stats()["stages"]`` (SPEC §7), over its recent samples."""

    count: int
    mean_us: float
    p99_us: float
    max_us: float


class Counters(TypedDict):
    """``stats()["counters"]`` (SPEC §7)."""

    admitted: int
    #: code -> rejections
    rejected: dict[str, int]
    #: limit path -> rejections
    rejected_by_limit: dict[str, int]
    shadow_rejected: int
    delayed_pending: int
    reloads: int
    reload_failed: int
    backend_errors: int
    capacity_refused: int
    rejected_log_dropped: int


class Snapshot(TypedDict):
    """The counters and stage timings of one :class:`Monitor`."""

    counters: Counters
    #: stage name (:data:`STAGES`) -> its timings
    stages: dict[str, StageSummary]


class Stats(Snapshot):
    """What ``GateKeeper.stats()`` returns (SPEC §7, §4.9)."""

    #: concrete path of an adaptive limit -> its current limit and latencies
    adaptive: dict[str, AdaptiveReport]


class Stage:
    """Timings of one stage, in seconds (``time.perf_counter`` differences)."""

    __slots__ = ("count", "observer", "ring", "timed", "untimed")

    def __init__(self) -> None:
        #: occurrences, timed or not
        self.count = 0
        #: samples recorded (the ring holds the latest of them)
        self.timed = 0
        self.ring: list[float] = [0.0] * _RING
        #: called with every sample; exporters (Prometheus) set it through
        #: :meth:`Monitor.observe`
        self.observer: Observer | None = None
        #: a mask of the count: an occurrence is timed when ``count & untimed`` is 0
        #: (0: every one; the caller asks, see :data:`SAMPLING`)
        self.untimed = 0

    def record(self, seconds: float) -> None:
        timed = self.timed
        self.ring[timed & _RING_MASK] = seconds
        self.timed = timed + 1
        self.count += 1
        if self.observer is not None:
            self.observer(seconds)

    def summary(self) -> StageSummary:
        return _summary(self.count, self.ring[: min(self.timed, _RING)])


def _summary(count: int, samples: list[float]) -> StageSummary:
    if not count or not samples:
        return {"count": count, "mean_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
    recent = sorted(samples)
    p99 = recent[min(len(recent) - 1, (len(recent) * 99) // 100)]
    return {
        "count": count,
        "mean_us": round(sum(recent) / len(recent) * 1e6, 3),
        "p99_us": round(p99 * 1e6, 3),
        "max_us": round(recent[-1] * 1e6, 3),
    }


class Monitor:
    """Counters and stage timings of one :class:`~gatekeeper_wsgi.GateKeeper`."""

    def __init__(self) -> None:
        #: every stage; those of DECISION_STAGES only carry their observers
        self.stages = {name: Stage() for name in STAGES}
        self.stages["response"].untimed = SAMPLING - 1
        #: The most recent timed decisions, as (started, resolved, decided, waited, admitted):
        #: its perf_counter readings, the seconds it waited in a queue and whether it
        #: admitted. Readings are stored as they come, not as durations (a subtraction
        #: makes a float object). A deque bounded to the ring's size: GateKeeper.admit
        #: appends a plain admission itself, one C call where :meth:`decision` is a
        #: Python frame (callgrind: ~1 300 instructions fewer per request).
        self.recent: deque[tuple[float, float, float, float, bool]] = deque(maxlen=_RING)
        #: decisions that refused (admitted ones are ``admitted``): their sum is the count
        #: of decisions
        self.refused_decisions = 0
        #: whether an observer watches a decision stage (then every decision goes
        #: through :meth:`decision`)
        self.observed = False
        #: a mask of the count of decisions, as :attr:`Stage.untimed` is of a stage's: a
        #: decision is timed when ``decisions & untimed`` is 0 (every one while observed)
        self.untimed = SAMPLING - 1
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.rejected_by_limit: dict[str, int] = {}
        #: (code, limit path or "") -> count, for exporters that label by both
        self.rejected_by_code_limit: dict[tuple[str, str], int] = {}
        self.shadow_rejected = 0
        self.reloads = 0
        self.reload_failed = 0
        self.backend_errors = 0
        # limit path -> the concrete keys it refused lately, oldest first (as dict keys)
        self._refused: dict[str, dict[str, None]] = {}
        # (monotonic second, {code: rejections in it}) of the seconds that had any
        self._history: deque[tuple[int, dict[str, int]]] = deque(maxlen=HISTORY_SECONDS)
        #: rejected-log records dropped because the listener fell behind (queue_size)
        self.rejected_log_dropped = 0
        #: requests refused because the backend's own capacity (keys, leases, window
        #: entries) could not track them (SPEC §4.5)
        self.capacity_refused = 0
        # Dict updates of two counters must not interleave with a concurrent snapshot.
        self._lock = threading.Lock()

    def decision(
        self, started: float, resolved: float, decided: float, admitted: bool, waited: float = 0.0
    ) -> None:
        """One admission decision (``time.perf_counter`` readings): the limits were
        resolved after ``started``, the backend decided after ``resolved``, ``waited``
        seconds of which in a queue (timed as ``queue_wait``, not as ``decide``). Times
        ``resolve_limits`` and ``decide``, and ``request`` (start to finish, waits
        included) when admitted; ``resolved`` 0.0 counts an untimed one (see
        :data:`SAMPLING`).
        """
        if resolved:
            self.recent.append((started, resolved, decided, waited, admitted))
        if admitted:
            self.admitted += 1
        else:
            self.refused_decisions += 1
        if self.observed:
            stages = self.stages
            times = _decision_times(
                resolved - started, decided - resolved - waited, decided - started, admitted
            )
            for name, seconds in times:
                observer = stages[name].observer
                if observer is not None:
                    observer(seconds)

    def observe(self, name: str, observer: Observer | None) -> None:
        """Call ``observer`` with every sample of stage ``name`` (None: stop); a sampled
        stage is timed every time while observed."""
        stage = self.stages[name]
        stage.observer = observer
        if name == "response":
            stage.untimed = 0 if observer is not None else SAMPLING - 1
        self.observed = any(self.stages[each].observer for each in DECISION_STAGES)
        self.untimed = 0 if self.observed else SAMPLING - 1

    def stage_summaries(self) -> dict[str, StageSummary]:
        """count, mean_us, p99_us and max_us of every stage."""
        summaries = {name: stage.summary() for name, stage in self.stages.items()}
        decided = self.admitted + self.refused_decisions
        # A copy in one C call, which no other thread's append can interleave (the GIL).
        recent = self.recent.copy()
        summaries["resolve_limits"] = _summary(decided, [r - s for s, r, _, _, _ in recent])
        summaries["decide"] = _summary(decided, [d - r - w for _, r, d, w, _ in recent])
        requests = [d - s for s, _, d, _, admitted in recent if admitted]
        summaries["request"] = _summary(self.admitted, requests)
        return summaries

    def count_rejection(self, code: str, limit_path: str | None, key: str | None = None) -> None:
        """Count one rejection; ``key`` is the concrete path refused (``shop/login/bob``)."""
        second = int(time.monotonic())
        with self._lock:
            history = self._history
            if not history or history[-1][0] != second:
                history.append((second, {}))
            counts = history[-1][1]
            counts[code] = counts.get(code, 0) + 1
            if key is not None and limit_path is not None:
                refused = self._refused.get(limit_path)
                if refused is None:
                    if len(self._refused) >= _REFUSED_LIMITS:
                        self._refused.clear()
                    refused = self._refused[limit_path] = {}
                refused.pop(key, None)
                refused[key] = None
                if len(refused) > REFUSED_KEYS:
                    del refused[next(iter(refused))]
            self.rejected[code] = self.rejected.get(code, 0) + 1
            if limit_path is not None:
                by_limit = self.rejected_by_limit
                by_limit[limit_path] = by_limit.get(limit_path, 0) + 1
            pair = (code, limit_path or "")
            pairs = self.rejected_by_code_limit
            pairs[pair] = pairs.get(pair, 0) + 1

    def recent_rejections(self) -> list[tuple[int, dict[str, int]]]:
        """Rejections of the last ``HISTORY_SECONDS`` seconds, by code, per second:
        ``(seconds ago, {code: count})``, oldest first; seconds without any are left out."""
        now = int(time.monotonic())
        with self._lock:
            return [
                (now - second, dict(counts))
                for second, counts in self._history
                if now - second < HISTORY_SECONDS
            ]

    def refused_keys(self) -> dict[str, tuple[str, ...]]:
        """Per limit path, the concrete keys it refused lately (at most ``REFUSED_KEYS``,
        most recent last)."""
        with self._lock:
            return {path: tuple(keys) for path, keys in self._refused.items()}

    def rejections(self) -> dict[tuple[str, str], int]:
        """Rejections by (code, limit path); the path is "" for codes without a limit."""
        with self._lock:
            return dict(self.rejected_by_code_limit)

    def snapshot(self, delayed_pending: int) -> Snapshot:
        """The counters (``delayed_pending`` as the backend counts it) and stage timings."""
        with self._lock:
            counters: Counters = {
                "admitted": self.admitted,
                "rejected": dict(self.rejected),
                "rejected_by_limit": dict(self.rejected_by_limit),
                "shadow_rejected": self.shadow_rejected,
                "delayed_pending": delayed_pending,
                "reloads": self.reloads,
                "reload_failed": self.reload_failed,
                "backend_errors": self.backend_errors,
                "rejected_log_dropped": self.rejected_log_dropped,
                "capacity_refused": self.capacity_refused,
            }
        return {"counters": counters, "stages": self.stage_summaries()}


def _decision_times(
    resolving: float, deciding: float, total: float, admitted: bool
) -> list[tuple[str, float]]:
    times = [("resolve_limits", resolving), ("decide", deciding)]
    if admitted:
        times.append(("request", total))
    return times
