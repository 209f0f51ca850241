"""Adaptive concurrency (``concurrency = "auto"``): controllers that find a limit by themselves.

A :class:`Controller` belongs to one concrete limit path (one per key of a wildcard limit).
It is fed one sample per admitted request when the request is released: its latency
(admission to release), whether the response was faulty (an exception, a 5xx, a timeout
marker) and how many requests of that path were in flight. Rejected requests are never
samples: counting them would make the limit chase its own refusals down to ``min``.

Samples are gathered into windows (at least ``WINDOW_SAMPLES`` samples and
``WINDOW_SECONDS``, and at least two mean latencies long, so a window sees the effect of
the previous change); in a window's mean a sample counts at most twice the baseline, so a
stall of the host that hits a few requests hard does not read as a queue. When a window
closes, the algorithm moves the limit:

``gradient`` (after Netflix's Gradient2 and Envoy's gradient controller)
    ``limit x clamp(min_latency / latency, 0.5, 1) + headroom``, smoothed, where the
    headroom is ``√limit`` less the queue the window saw (``limit x (1 - min_latency /
    latency)``), at least 1. Climbs by ``√limit`` while nothing queues, then settles with
    about ``√limit / 2`` requests queued above the concurrency the backend serves without
    queueing (22 for a capacity of 20, 105 for 100); reacts in proportion.
``vegas`` (after TCP Vegas / Netflix's VegasLimit)
    estimates the queue ``limit x (1 - min_latency / latency)`` and steps the limit by
    ``log10(limit)``-sized amounts (at least 1) to keep it between ``2·log10`` and
    ``4·log10`` requests.
``aimd`` (additive increase, multiplicative decrease)
    grows x 1.5 per busy window until latency rises 10 % (slow start), then ``+1`` per
    busy window; ``x 0.9`` when a window saw a faulty response or a mean latency above 1.2 x the
    minimum. Loss-driven: simple, a sawtooth up to 20 % over capacity, slower to recover.

Faulty responses lower the limit only by what exceeds the share a probe (below) measured
at no load, and beyond the noise of a window of that size: errors the backend gives
whatever its load (a dependency failing for some keys, input that makes 500s) are not a
sign of overload, and a steady 20 % of them walked the limit down to a handful, window
after window. Gradient and vegas multiply their next limit by ``1 - that excess``, so a
backend that starts failing sheds load in proportion; aimd backs off when there is any.

The minimum latency is the no-load baseline. It falls whenever a window is faster, and it
is measured again, up or down, by a *probe* (as Envoy does): at the start and then about
every ``PROBE_EVERY`` seconds (jittered per path) the limit is pinned to a few requests
until ``PROBE_SAMPLES`` requests admitted under it have finished, or ``PROBE_SECONDS`` have
passed with at least one; their mean latency is the new baseline. Without it a baseline
would never rise after a slower deploy and the limit would collapse; a window gathered at
that low concurrency anyway also counts as a probe.

A limit only grows when the window was busy (at least half the limit in flight), so an idle
or lightly used path never drifts upwards for lack of a signal. Everything here is pure
and deterministic: time comes in as ``now`` (seconds on the engine's clock)::

    controller = Controller(AdaptiveSpec("gradient", min=1, max=200, initial=10), now=0.0)
    controller.sample(latency=0.020, inflight=8, faulty=False, admitted=0.0, now=0.02)
    controller.limit   # the current limit, an int in [min, max]
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import ClassVar, Literal, TypedDict, get_args

__all__ = [
    "ALGORITHMS",
    "PROBE_EVERY",
    "PROBE_SAMPLES",
    "PROBE_SECONDS",
    "SAMPLE_CEILING",
    "WINDOW_SAMPLES",
    "WINDOW_SECONDS",
    "AdaptiveReport",
    "AdaptiveSpec",
    "Algorithm",
    "Controller",
]

Algorithm = Literal["gradient", "aimd", "vegas"]
#: The known algorithms, in the order the docs list them.
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)

#: A window closes after at least this many samples ...
WINDOW_SAMPLES = 10
#: ... and at least this many seconds (and two mean latencies).
WINDOW_SECONDS = 0.1
#: Seconds between two probes of the no-load latency (± 15 % per path).
PROBE_EVERY = 30.0
#: Requests admitted under the pinned limit that a probe waits for ...
PROBE_SAMPLES = 10
#: ... or, with at least one, this many seconds: light traffic would otherwise keep the
#: limit pinned until ten requests came, minutes on a quiet path (and a burst meanwhile
#: refused at 3); busy traffic brings its ten in a fraction of that.
PROBE_SECONDS = 1.0
#: The concurrency a probe pins the limit to (raised to ``min`` when that is higher).
PROBE_CONCURRENCY = 3

# Gradient: how much slower than the baseline a window may be before the limit shrinks
# (a little slack for latency noise), how far one window may shrink it, and how much of
# each step is taken (smoothing against noise).
_GRADIENT_TOLERANCE = 1.0
_GRADIENT_FLOOR = 0.5
_GRADIENT_SMOOTHING = 0.5
# Vegas: the queue (in log10(limit) steps) below which the limit grows and above which it
# shrinks. Lower than Netflix's 3 and 6, as the queue is latency every admitted request
# pays; not lower, as its queue estimate (limit x noise) grows with the limit: at 1 and 2 a
# limit of 100 under noisy latencies mistook noise for a queue and halved itself.
_VEGAS_ALPHA = 2.0
_VEGAS_BETA = 4.0
# AIMD: the latency ratio it treats like a drop (1.2: its sawtooth peaks 20 % over the
# backend's capacity; 1.3 let every admitted request queue up to 30 % longer), and its
# multiplicative backoff.
_AIMD_TOLERANCE = 1.2
_AIMD_BACKOFF = 0.9
# AIMD's slow start: growth per busy window, and the latency ratio that ends it. Gentler
# than TCP's doubling: latency shows an increase only a window later.
_SLOW_START_GROWTH = 1.5
_SLOW_START_EXIT = 1.1
#: The most one sample counts for in a window's mean, as a multiple of the baseline: a
#: backend that gathers a window outside the controller (in a Redis hash, say) adds
#: ``min(latency, SAMPLE_CEILING x min_latency)`` per good sample to keep its decisions.
SAMPLE_CEILING = 2.0
# One window of faulty responses never cuts the limit by more than half.
_DROP_FLOOR = 0.5
# The attributes of Controller.STATE that are counts.
_INTEGERS = frozenset({"limit", "_count", "_drops", "_peak", "_probe_count", "_probe_drops"})


def _excess(share: float, baseline: float, count: int) -> float:
    """How much of a window's ``share`` of faulty responses (of ``count``) says the
    backend is overloaded: what exceeds the no-load ``baseline`` by more than twice the
    noise a window of that size has at that share (binomial: ``sqrt(p(1 - p) / n)``), so
    random windows of a steady error rate do not read as a rise. With no errors at no load
    the noise is 0: any error counts, as before a baseline was kept."""
    if share <= baseline:
        return 0.0
    noise = 2.0 * math.sqrt(baseline * (1.0 - baseline) / count) if count else 0.0
    return max(0.0, share - baseline - noise)


class AdaptiveReport(TypedDict):
    """One adaptive limit in ``gk.stats()["adaptive"]`` (SPEC §4.9)."""

    #: the concurrency the controller allows now
    limit: int
    #: the smoothed latency of admitted requests, in milliseconds
    latency_ms: float
    #: the no-load latency it compares with, in milliseconds
    min_latency_ms: float


@dataclass(frozen=True, slots=True)
class AdaptiveSpec:
    """The ``adaptive`` table of a ``concurrency = "auto"`` limit (SPEC §3)."""

    algorithm: Algorithm = "gradient"
    min: int = 1
    max: int = 1000
    initial: int = 10


class Controller:
    """The adaptive limit of one concrete path: feed it :meth:`sample`, read ``limit``.

    Not thread-safe by itself: the backend that owns it feeds and reads it under the
    lock that guards the path's in-flight count.
    """

    __slots__ = (
        "_ceiling",
        "_count",
        "_drops",
        "_due",
        "_next_probe",
        "_peak",
        "_probe_count",
        "_probe_drops",
        "_probe_total",
        "_probing",
        "_seed",
        "_slow_start",
        "_total",
        "drop_baseline",
        "estimate",
        "latency",
        "limit",
        "min_latency",
        "spec",
    )

    _due: float
    _count: int
    _total: float
    _drops: int
    _peak: int

    def __init__(self, spec: AdaptiveSpec, now: float, *, key: str = "") -> None:
        self.spec = spec
        #: the algorithm's value before rounding (steps smaller than one request add up)
        self.estimate = float(spec.initial)
        #: the enforced limit: requests in flight may not reach it
        self.limit = spec.initial
        #: mean latency of the last window (seconds; 0 before the first)
        self.latency = 0.0
        #: the no-load baseline (seconds; 0 before the first probe)
        self.min_latency = 0.0
        #: the share of faulty responses at no load (the probes'): errors the backend
        #: gives whatever its load, which do not lower the limit
        self.drop_baseline = 0.0
        # The most one sample counts for in a window's mean (derived from min_latency,
        # so not part of STATE).
        self._ceiling = math.inf
        # Jitter from the path, so the keys (and hosts) of a deployment do not probe in
        # step, yet the same path always behaves the same (deterministic tests).
        self._seed = (zlib.crc32(key.encode("utf-8", "surrogatepass")) % 1000) / 1000.0
        self._next_probe = now
        self._reset_window(now)
        self._probing: float | None = None
        self._slow_start = True
        self._probe_count = 0
        self._probe_total = 0.0
        self._probe_drops = 0

    #: The attributes :meth:`state` lists, in order: everything a controller has learned
    #: and is gathering (its window, its probe), as numbers. A backend that shares one
    #: controller between processes or hosts stores these (doubles in a file, fields of a
    #: Redis hash) and rebuilds the controller with :meth:`restore` to feed it a sample.
    STATE: ClassVar[tuple[str, ...]] = (
        "estimate",
        "limit",
        "latency",
        "min_latency",
        "_next_probe",
        "_due",
        "_count",
        "_total",
        "_drops",
        "_peak",
        "_probing",
        "_slow_start",
        "_probe_count",
        "_probe_total",
        "drop_baseline",
        "_probe_drops",
    )

    def window(self) -> tuple[float, int, float, int, int]:
        """The window being gathered: ``(due, count, latency total, drops, peak)``."""
        return self._due, self._count, self._total, self._drops, self._peak

    def load_window(self, window: tuple[float, int, float, int, int], min_latency: float) -> None:
        """Take a window gathered elsewhere (and the baseline its samples are capped by),
        so :meth:`sample` adds to it: a backend that keeps the window in a file loads it
        into one spare controller per release instead of restoring a whole state."""
        self._due, self._count, self._total, self._drops, self._peak = window
        self._set_baseline(min_latency)

    def state(self) -> tuple[float, ...]:
        """The numbers :data:`STATE` names (``_probing`` None as NaN, booleans as 0/1)."""
        probing = self._probing
        return tuple(
            math.nan if name == "_probing" and probing is None else float(getattr(self, name))
            for name in self.STATE
        )

    @classmethod
    def restore(cls, spec: AdaptiveSpec, state: tuple[float, ...], *, key: str = "") -> Controller:
        """The controller :meth:`state` described, under ``spec`` (a reloaded table's
        bounds apply at once, as :meth:`respec`). Integers come back as ``int``."""
        if len(state) != len(cls.STATE):
            raise ValueError(f"an adaptive state has {len(cls.STATE)} numbers, not {len(state)}")
        controller = cls(spec, 0.0, key=key)
        # Only spec and seed are not part of the state; __init__ set both from its arguments.
        for name, value in zip(cls.STATE, state, strict=True):
            if name == "_probing":
                controller._probing = None if math.isnan(value) else value
            elif name == "_slow_start":
                controller._slow_start = bool(value)
            elif name in _INTEGERS:
                setattr(controller, name, int(value))
            else:
                setattr(controller, name, value)
        controller._set_baseline(controller.min_latency)
        controller.estimate = min(max(controller.estimate, float(spec.min)), float(spec.max))
        controller.limit = min(max(controller.limit, spec.min), spec.max)
        return controller

    def respec(self, spec: AdaptiveSpec) -> None:
        """Take a reloaded ``adaptive`` table: keep what was learned, within the new bounds."""
        if spec == self.spec:
            self.spec = spec
            return
        self.spec = spec
        self.estimate = min(max(self.estimate, spec.min), spec.max)
        if self._probing is None:
            self.limit = self._rounded()
        else:
            self.limit = self._probe_limit()

    # --- samples --------------------------------------------------------------------------

    def sample(
        self, latency: float, inflight: int, faulty: bool, admitted: float, now: float
    ) -> None:
        """One released request: ``latency`` seconds from admission (at ``admitted``) to
        release (at ``now``), ``inflight`` requests of this path in flight at release
        (itself included), ``faulty`` if its response was."""
        # Runs on every release under the backend's lock: four updates and one
        # comparison; everything else waits until something is due.
        self._count += 1
        if faulty:
            # A failure's latency says nothing of the backend's queue (a quick 500 would
            # pull the mean, and then the baseline, down); it counts as a drop only.
            self._drops += 1
        elif latency < self._ceiling:
            self._total += latency
        else:
            self._total += self._ceiling
        if inflight > self._peak:
            self._peak = inflight
        if now >= self._due:
            self._due_now(latency, faulty, admitted, now)

    def _due_now(self, latency: float, faulty: bool, admitted: float, now: float) -> None:
        if self._probing is not None:
            self._probe_sample(latency, faulty, admitted, now)
        elif now >= self._next_probe:
            self._start_probe(now)
        elif self._count >= WINDOW_SAMPLES:
            self._close_window(now)
        # else: the window is long enough but has too few samples; the next one checks

    def _reset_window(self, now: float) -> None:
        self._count = 0
        self._total = 0.0
        self._drops = 0
        self._peak = 0
        # A window lasts WINDOW_SECONDS and two mean latencies, or until the next probe.
        self._due = min(now + max(WINDOW_SECONDS, 2.0 * self.latency), self._next_probe)

    def _close_window(self, now: float) -> None:
        count = self._count
        drop_share = self._drops / count
        good = count - self._drops
        # A clock that does not move (or moves back) gives 0 or less: no queue to see.
        latency = max(self._total / good, 0.0) if good else self.latency
        peak = self._peak
        self.latency = latency
        self._reset_window(now)
        if peak <= PROBE_CONCURRENCY and not drop_share:
            # As few requests in flight as a probe pins: this window measured no-load
            # latency, whether it is higher (a slower deploy) or lower than the baseline.
            self._set_baseline(latency)
        elif latency < self.min_latency or not self.min_latency:
            self._set_baseline(latency)
        spec = self.spec
        excess = _excess(drop_share, self.drop_baseline, count)
        estimate = self._next(self.estimate, latency, self.min_latency, peak, excess)
        self.estimate = min(max(estimate, float(spec.min)), float(spec.max))
        self.limit = self._rounded()

    def _set_baseline(self, latency: float) -> None:
        self.min_latency = latency
        # A sample counts at most CEILING x the baseline: beyond it the gradient is at its
        # floor anyway, vegas sees half the limit queued, aimd a drop. A stall of the host
        # (a GC pause, a starved CPU) gives a few requests many times the usual latency;
        # uncapped, they alone would drag a window's mean, and the limit, down.
        self._ceiling = SAMPLE_CEILING * latency if latency > 0.0 else math.inf

    def _next(
        self, estimate: float, latency: float, baseline: float, peak: int, excess: float
    ) -> float:
        """The algorithm's next estimate after a window (mean ``latency``, the ``baseline``
        no-load latency, ``peak`` requests in flight, ``excess`` share of faulty responses
        over the no-load share, see :func:`_excess`)."""
        algorithm = self.spec.algorithm
        busy = 2 * peak >= estimate
        # How much faster the backend was unloaded; 1 when a latency of 0 says nothing.
        ratio = baseline / latency if latency > 0.0 else 1.0
        if algorithm == "aimd":
            if excess or latency > _AIMD_TOLERANCE * baseline:
                self._slow_start = False
                return estimate * _AIMD_BACKOFF
            if latency > _SLOW_START_EXIT * baseline:
                self._slow_start = False  # a queue is forming: from now on, one at a time
            if not busy:
                return estimate
            # Slow start (as TCP): multiply until a queue forms, then add one.
            return estimate * _SLOW_START_GROWTH if self._slow_start else estimate + 1.0
        if algorithm == "vegas":
            queue = estimate * (1.0 - ratio)
            step = max(1.0, math.log10(estimate))
            if queue <= _VEGAS_ALPHA * step / 2.0:
                target = estimate + 4.0 * step if busy else estimate
            elif queue < _VEGAS_ALPHA * step:
                target = estimate + step if busy else estimate
            elif queue > _VEGAS_BETA * step:
                # Far over: shed half the excess queue at once, not log10 per window.
                target = estimate - max(step, (queue - _VEGAS_BETA * step) / 2.0)
            else:
                target = estimate
            return target * max(_DROP_FLOOR, 1.0 - excess)
        gradient = min(max(_GRADIENT_TOLERANCE * ratio, _GRADIENT_FLOOR), 1.0)
        # The headroom (requests allowed to queue) is √limit while no queue shows, so the
        # limit climbs fast to where one forms; each request seen waiting takes one off it,
        # so it settles with a queue of about √limit / 2 instead of √limit (+12 % of 20,
        # not +23 %): that standing queue is latency every admitted request pays.
        queue = estimate * (1.0 - min(ratio, 1.0))
        wanted = estimate * gradient + max(1.0, math.sqrt(estimate) - queue)
        if not busy:
            wanted = min(wanted, estimate)
        wanted *= max(_DROP_FLOOR, 1.0 - excess)
        return estimate + (wanted - estimate) * _GRADIENT_SMOOTHING

    def _rounded(self) -> int:
        spec = self.spec
        return min(max(int(self.estimate), spec.min), spec.max)

    # --- probing the no-load latency ------------------------------------------------------

    def _probe_limit(self) -> int:
        spec = self.spec
        return min(max(PROBE_CONCURRENCY, spec.min), spec.max)

    def _start_probe(self, now: float) -> None:
        self._probing = now
        self._due = -math.inf  # every sample of a probe is looked at
        self._probe_count = 0
        self._probe_total = 0.0
        self._probe_drops = 0
        self.limit = min(self._probe_limit(), self._rounded())

    def _probe_sample(self, latency: float, faulty: bool, admitted: float, now: float) -> None:
        # Requests admitted before the probe began ran under the old, higher limit.
        assert self._probing is not None
        if admitted < self._probing:
            return
        self._probe_count += 1
        self._probe_total += latency
        self._probe_drops += faulty
        if self._probe_count < PROBE_SAMPLES and now - self._probing < PROBE_SECONDS:
            return
        self._set_baseline(max(self._probe_total / self._probe_count, 0.0))
        # The errors of no load, averaged with the last probe's (ten samples are few).
        share = self._probe_drops / self._probe_count
        previous = self.drop_baseline
        self.drop_baseline = share if previous <= 0.0 else (previous + share) / 2.0
        self._probing = None
        self._next_probe = now + PROBE_EVERY * (0.85 + 0.3 * self._seed)
        self.limit = self._rounded()
        self._reset_window(now)

    # --- reports --------------------------------------------------------------------------

    def report(self) -> AdaptiveReport:
        """``{"limit", "latency_ms", "min_latency_ms"}`` for ``gk.stats()["adaptive"]``."""
        return {
            "limit": self.limit,
            "latency_ms": round(self.latency * 1000.0, 3),
            "min_latency_ms": round(self.min_latency * 1000.0, 3),
        }
