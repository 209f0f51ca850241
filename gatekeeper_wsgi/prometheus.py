"""Prometheus metrics of a GateKeeper; the optional extra ``gatekeeper-wsgi[prometheus]``.

Metrics (label values are configured limit *paths*, so a client spraying caller ids
cannot grow the number of series; the one exception is bounded, see below):

=========================================  =========  =================================
``gatekeeper_admitted_total``              counter    admitted requests
``gatekeeper_rejected_total``              counter    rejections by ``code`` and ``limit``
                                                      (``limit=""`` for codes without one)
``gatekeeper_shadow_rejected_total``       counter    over-limit requests let through
``gatekeeper_reloads_total``               counter    configuration reloads
``gatekeeper_reload_failed_total``         counter    rejected configuration files
``gatekeeper_backend_errors_total``        counter    backend failures
``gatekeeper_capacity_refused_total``      counter    refused: a wildcard limit's keys
                                                      all busy (``max_keys``)
``gatekeeper_rejected_log_dropped_total``  counter    rejected-log records dropped
``gatekeeper_inflight``                    gauge      in flight per ``limit`` (wildcard
                                                      limits: summed over their keys)
``gatekeeper_inflight_keys``               gauge      wildcard limits: keys in flight
``gatekeeper_limit_concurrency``           gauge      the configured concurrency
``gatekeeper_adaptive_limit``              gauge      an adaptive limit's current value
                                                      (wildcards: per ``key``, see below)
``gatekeeper_delayed_pending``             gauge      delayed releases not yet due
``gatekeeper_backend_up``                  gauge      1 when the backend answered
``gatekeeper_stage_duration_seconds``      histogram  self-monitoring stage timings
=========================================  =========  =================================

An adaptive limit with ``*`` has one limit per key: ``gatekeeper_adaptive_limit{limit=
"shop/login/*", key="shop/login/alice"}`` is exported for at most ``ADAPTIVE_KEYS`` of its
keys per scrape, the busiest (most in flight, then those refused lately), so a spray of
callers cannot grow a scrape; a limit without ``*`` is ``{limit="shop"}`` alone. In
multiprocess mode, where prometheus_client cannot remove a series, a worker labels at most
``4 x ADAPTIVE_KEYS`` keys per limit in its lifetime; a key that is no longer among the
busiest reads NaN until it is again.

One process (threads, or ``runserver``)::

    from gatekeeper_wsgi.prometheus import register
    register(app.gatekeeper)          # a collector on prometheus_client's default REGISTRY

Values are read when Prometheus scrapes. Several processes (gunicorn, uWSGI) with
``PROMETHEUS_MULTIPROC_DIR`` set: call the same ``register(gk)`` in every worker
(``post_fork``, or the app module without ``--preload``). It then writes the values into
prometheus_client's multiprocess metrics, which ``MultiProcessCollector`` aggregates at
scrape time: the stage histograms on every sample, counters and gauges once per
``interval`` seconds from a daemon thread (and at exit). Counters add up over the
workers, dead ones included; ``gatekeeper_inflight`` adds up the live workers for the
per-process memory backend and takes the most recent value for the shared and Redis
backends, which every worker sees whole. In the gunicorn config::

    from prometheus_client import multiprocess

    def child_exit(server, worker):
        multiprocess.mark_process_dead(worker.pid)

and serve the scrape endpoint from a registry with a ``MultiProcessCollector``
(see the prometheus_client documentation, "Multiprocess Mode").
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.limitindex import counts
from gatekeeper_wsgi.monitor import STAGES
from gatekeeper_wsgi.status import limit_totals

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from gatekeeper_wsgi.backends.base import LimitTotals
    from gatekeeper_wsgi.engine import GateKeeper

__all__ = [
    "ADAPTIVE_KEYS",
    "BUCKETS",
    "GateKeeperCollector",
    "MultiProcessExporter",
    "register",
]

#: Keys of an adaptive wildcard limit exported per scrape (the busiest).
ADAPTIVE_KEYS = 10
# Multiprocess mode: keys one worker may ever label per adaptive wildcard limit.
_ADAPTIVE_KEYS_LABELLED = 4 * ADAPTIVE_KEYS

#: Histogram buckets of the stage timings, in seconds (10 µs .. 10 s).
BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_COUNTERS = (
    ("admitted", "Requests admitted"),
    ("shadow_rejected", "Requests over a limit let through by shadow mode"),
    ("reloads", "Configuration reloads that changed the configuration"),
    ("reload_failed", "Configuration files rejected on reload"),
    ("backend_errors", "Backend failures"),
    ("capacity_refused", "Requests refused because a wildcard limit had no idle key to evict"),
    ("rejected_log_dropped", "Rejected-request log records dropped: the listener fell behind"),
)


def _client() -> ModuleType:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ImportError(
            "gatekeeper_wsgi.prometheus needs prometheus_client: "
            "pip install 'gatekeeper-wsgi[prometheus]'"
        ) from exc
    return prometheus_client


def _multiprocess_dir() -> str | None:
    # prometheus_client still honours the old lower-case name.
    old_name = "prometheus_multiproc_dir"
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(old_name)


def _chain(
    first: Callable[[float], None] | None, second: Callable[[float], None]
) -> Callable[[float], None]:
    if first is None:
        return second

    def both(seconds: float) -> None:
        first(seconds)
        second(seconds)

    return both


class _Observation:
    """Reads one GateKeeper's counters, in-flight per limit and backend health."""

    def __init__(self, gatekeeper: GateKeeper) -> None:
        self.gatekeeper = gatekeeper

    def counters(self) -> dict[str, int]:
        monitor = self.gatekeeper.monitor
        return {name: int(getattr(monitor, name)) for name, _ in _COUNTERS}

    def rejections(self) -> dict[tuple[str, str], int]:
        return self.gatekeeper.monitor.rejections()

    def limits(self) -> _Reading:
        """In flight per limit, wildcard keys in flight, backend health, delayed releases
        and adaptive limits' current values.

        O(limits) with backends that keep totals (all three), whatever the keys."""
        keeper = self.gatekeeper
        config = keeper.config
        wildcards = any(
            limit.adaptive is not None and limit.wildcard for limit in config.limits.values()
        )
        try:
            totals = limit_totals(keeper, top=ADAPTIVE_KEYS if wildcards else 0)
            delayed = keeper.delayed_pending()
            up = True
        except Exception:
            totals, delayed, up = {}, 0, False
        inflight: dict[str, int] = {}
        keys: dict[str, int] = {}
        for limit in config.limits.values():
            if not counts(limit):
                continue
            found = totals.get(limit.path)
            inflight[limit.path] = 0 if found is None else found.inflight
            if limit.wildcard:
                keys[limit.path] = 0 if found is None else found.busy
        return _Reading(config, inflight, keys, up, delayed, self._adaptive(config, totals))

    def _adaptive(
        self, config: Config, totals: dict[str, LimitTotals]
    ) -> dict[tuple[str, str], int]:
        """``{(limit path, key): current value}``: each adaptive limit without ``*`` under
        the key ``""``, and up to ``ADAPTIVE_KEYS`` of the busiest keys of each with."""
        backend = self.gatekeeper.backend
        values: dict[tuple[str, str], int] = {}
        try:
            for limit in config.limits.values():
                if limit.adaptive is None:
                    continue
                if not limit.wildcard:
                    values[limit.path, ""] = backend.adaptive_limit(limit.path, limit)
                    continue
                found = totals.get(limit.path)
                for usage in () if found is None else found.top[:ADAPTIVE_KEYS]:
                    values[limit.path, usage.key] = backend.adaptive_limit(usage.key, limit)
        except Exception:
            return {}
        return values


class _Reading(NamedTuple):
    """What :meth:`_Observation.limits` read in one go."""

    config: Config
    inflight: dict[str, int]  #: per limit path
    keys: dict[str, int]  #: wildcard limits: keys in flight
    up: bool  #: the backend answered
    delayed: int  #: delayed releases not yet due
    adaptive: dict[tuple[str, str], int]  #: (limit path, key or ""): current value


_ADAPTIVE_HELP = "Current value of an adaptive (concurrency = auto) limit"


class GateKeeperCollector:
    """A prometheus_client collector reading one GateKeeper when scraped (one process).

    ::

        from prometheus_client import REGISTRY
        REGISTRY.register(GateKeeperCollector(gk))

    It attaches to the stage timers of ``gk`` to fill the duration histograms; ``close()``
    detaches it.
    """

    def __init__(self, gatekeeper: GateKeeper) -> None:
        _client()
        self.gatekeeper = gatekeeper
        self._observation = _Observation(gatekeeper)
        self._lock = threading.Lock()
        # stage -> [count per bucket (the last one is +Inf)], sum of nanoseconds
        self._buckets = {name: [0] * (len(BUCKETS) + 1) for name in STAGES}
        self._sums = dict.fromkeys(STAGES, 0.0)
        self._previous: dict[str, Callable[[float], None] | None] = {}
        self.registry: CollectorRegistry | None = None
        for name, stage in gatekeeper.monitor.stages.items():
            if name in self._buckets:
                self._previous[name] = stage.observer
                gatekeeper.monitor.observe(name, _chain(stage.observer, self._observer(name)))

    def _observer(self, name: str) -> Callable[[float], None]:
        buckets = self._buckets[name]
        sums = self._sums
        lock = self._lock

        def observe(seconds: float) -> None:
            index = bisect_left(BUCKETS, seconds)
            with lock:
                buckets[index] += 1
                sums[name] += seconds

        return observe

    def close(self) -> None:
        """Stop observing the stage timers (and leave the registry :func:`register` used)."""
        if self.registry is not None:
            self.registry.unregister(self)
            self.registry = None
        for name, previous in self._previous.items():
            self.gatekeeper.monitor.observe(name, previous)
        self._previous = {}

    def describe(self) -> Iterator[Metric]:
        """The metric families, without reading the backend (for registration)."""
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        """The current values."""
        yield from self._families(self._observation)

    def _families(self, observation: _Observation | None) -> Iterator[Metric]:
        _client()
        from prometheus_client import metrics_core as core

        for name, help_text in _COUNTERS:
            family = core.CounterMetricFamily(f"gatekeeper_{name}", help_text)
            if observation is not None:
                family.add_metric([], observation.counters()[name])
            yield family
        rejected = core.CounterMetricFamily(
            "gatekeeper_rejected",
            "Requests rejected, by fault code and limit path",
            labels=["code", "limit"],
        )
        inflight = core.GaugeMetricFamily(
            "gatekeeper_inflight",
            "Requests in flight per configured limit",
            labels=["limit", "level"],
        )
        keys = core.GaugeMetricFamily(
            "gatekeeper_inflight_keys",
            "Keys with requests in flight, per wildcard limit",
            labels=["limit"],
        )
        capacity = core.GaugeMetricFamily(
            "gatekeeper_limit_concurrency",
            "Configured concurrency per limit",
            labels=["limit", "level"],
        )
        delayed = core.GaugeMetricFamily(
            "gatekeeper_delayed_pending", "Delayed releases not yet due"
        )
        adaptive = core.GaugeMetricFamily(
            "gatekeeper_adaptive_limit", _ADAPTIVE_HELP, labels=["limit"]
        )
        up = core.GaugeMetricFamily("gatekeeper_backend_up", "1 when the backend answered")
        stages = core.HistogramMetricFamily(
            "gatekeeper_stage_duration_seconds", "Self-monitoring stage timings", labels=["stage"]
        )
        if observation is not None:
            for (code, limit_path), count in sorted(observation.rejections().items()):
                rejected.add_metric([code, limit_path], count)
            reading = observation.limits()
            for path, total in sorted(reading.inflight.items()):
                limit = reading.config.limits[path]
                inflight.add_metric([path, limit.level], total)
                if limit.concurrency is not None:
                    capacity.add_metric([path, limit.level], limit.concurrency)
            for path, count in sorted(reading.keys.items()):
                keys.add_metric([path], count)
            for (path, key), value in sorted(reading.adaptive.items()):
                # A wildcard's keys carry a second label; a plain limit keeps {limit} alone.
                labels = {"limit": path, "key": key} if key else {"limit": path}
                adaptive.add_sample("gatekeeper_adaptive_limit", labels, value)
            delayed.add_metric([], reading.delayed)
            up.add_metric([], 1 if reading.up else 0)
            with self._lock:
                snapshot = {name: (list(b), self._sums[name]) for name, b in self._buckets.items()}
            for name, (counts, seconds) in snapshot.items():
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for bound, count in zip((*BUCKETS, math.inf), counts, strict=True):
                    cumulative += count
                    buckets.append((_le(bound), cumulative))
                stages.add_metric([name], buckets, seconds)
        yield from (rejected, inflight, keys, capacity, adaptive, delayed, up, stages)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(bound)


_exporters: weakref.WeakSet[MultiProcessExporter] = weakref.WeakSet()
# Taken by a worker's first observation when the fork hook did not run (see _observer).
_fork_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()
    for exporter in list(_exporters):
        exporter._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class MultiProcessExporter:
    """Writes one worker's GateKeeper metrics into prometheus_client's multiprocess files.

    Needs ``PROMETHEUS_MULTIPROC_DIR`` set before prometheus_client is first imported.
    Stage timings are observed as they happen; counters and gauges are written by
    :meth:`sync`, every ``interval`` seconds from a daemon thread (``interval=None``:
    only when called) and at interpreter exit. A forked child starts its own thread and
    counts only what happens after the fork.
    """

    def __init__(self, gatekeeper: GateKeeper, *, interval: float | None = 1.0) -> None:
        client = _client()
        if _multiprocess_dir() is None:
            raise RuntimeError(
                "MultiProcessExporter needs PROMETHEUS_MULTIPROC_DIR set (before "
                "prometheus_client is imported); for one process use GateKeeperCollector"
            )
        self.gatekeeper = gatekeeper
        self.interval = interval
        self._observation = _Observation(gatekeeper)
        shared = not gatekeeper.backend.local
        # A shared/Redis backend shows every worker the same global count in flight: take
        # the most recent; memory backends count per process: add the live workers up.
        gauge_mode = "livemostrecent" if shared else "livesum"
        self._counters = {
            name: client.Counter(f"gatekeeper_{name}", help_text, registry=None)
            for name, help_text in _COUNTERS
        }
        self._rejected = client.Counter(
            "gatekeeper_rejected",
            "Requests rejected, by fault code and limit path",
            ["code", "limit"],
            registry=None,
        )
        self._inflight = client.Gauge(
            "gatekeeper_inflight",
            "Requests in flight per configured limit",
            ["limit", "level"],
            registry=None,
            multiprocess_mode=gauge_mode,
        )
        self._keys = client.Gauge(
            "gatekeeper_inflight_keys",
            "Keys with requests in flight, per wildcard limit",
            ["limit"],
            registry=None,
            multiprocess_mode=gauge_mode,
        )
        self._capacity = client.Gauge(
            "gatekeeper_limit_concurrency",
            "Configured concurrency per limit",
            ["limit", "level"],
            registry=None,
            multiprocess_mode="livemostrecent",
        )
        self._adaptive = client.Gauge(
            "gatekeeper_adaptive_limit",
            _ADAPTIVE_HELP,
            ["limit"],
            registry=None,
            multiprocess_mode="livemostrecent",
        )
        # The same metric with a ``key`` label, for adaptive wildcard limits' keys (the
        # multiprocess collector merges the two by name, as one family).
        self._adaptive_keys = client.Gauge(
            "gatekeeper_adaptive_limit",
            _ADAPTIVE_HELP,
            ["limit", "key"],
            registry=None,
            multiprocess_mode="livemostrecent",
        )
        # (limit path, key or "") of every adaptive series this worker has written
        self._adaptive_series: set[tuple[str, str]] = set()
        self._keyed_per_limit: dict[str, int] = {}
        # Redis counts the delays this process placed (memory too): added up; the shared
        # file's count is the host's, the same in every worker.
        self._delayed = client.Gauge(
            "gatekeeper_delayed_pending",
            "Delayed releases not yet due",
            registry=None,
            multiprocess_mode=(
                "livesum" if gatekeeper.backend.delayed_per_process else "livemostrecent"
            ),
        )
        self._up = client.Gauge(
            "gatekeeper_backend_up",
            "1 when the backend answered",
            registry=None,
            multiprocess_mode="livemin",
        )
        self._stages = client.Histogram(
            "gatekeeper_stage_duration_seconds",
            "Self-monitoring stage timings",
            ["stage"],
            registry=None,
            buckets=BUCKETS,
        )
        self._lock = threading.Lock()
        self._synced_counters: dict[str, int] = {}
        self._synced_rejections: dict[tuple[str, str], int] = {}
        self._labelled: set[tuple[str, str]] = set()
        self._baseline()
        self._previous: dict[str, Callable[[float], None] | None] = {}
        for name, stage in gatekeeper.monitor.stages.items():
            self._previous[name] = stage.observer
            child = self._stages.labels(name)
            gatekeeper.monitor.observe(name, _chain(stage.observer, self._observer(child)))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._start_thread()
        _exporters.add(self)
        atexit.register(self._at_exit)

    def _observer(self, child: Any) -> Callable[[float], None]:
        observe: Callable[[float], None] = child.observe

        def observe_here(seconds: float) -> None:
            # A worker forked without Python's fork hooks (uWSGI's default mode loads the
            # app in its master) has no sync thread and counts as the master: its first
            # observed stage finds that out (a stage of every request is observed).
            if os.getpid() != self._pid:
                with _fork_lock:
                    if os.getpid() != self._pid:
                        self._forked(at_fork=False)
            observe(seconds)

        return observe_here

    def _baseline(self) -> None:
        """Count from now on: what the monitor holds already is someone else's."""
        self._synced_counters = self._observation.counters()
        self._synced_rejections = self._observation.rejections()

    def _start_thread(self) -> None:
        if self.interval is None:
            return
        self._thread = threading.Thread(
            target=self._run, name="gatekeeper-prometheus-sync", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        assert self.interval is not None
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except Exception:  # never let a metrics hiccup end the thread
                continue

    def _forked(self, *, at_fork: bool = True) -> None:
        """In a forked child: its own files, thread and counts. Found after the fork
        (``at_fork`` False: see _observer), the counts since then are the child's own,
        the ones last written by the parent its baseline still."""
        self._lock = threading.Lock()
        self._pid = os.getpid()
        if at_fork:
            self._baseline()
        self._labelled = set()
        # A child writes files of its own pid: it starts with no adaptive series.
        self._adaptive_series = set()
        self._keyed_per_limit = {}
        self._stop = threading.Event()
        if self._thread is not None:
            self._start_thread()

    def sync(self) -> None:
        """Write the counters and gauges now."""
        with self._lock:
            counters = self._observation.counters()
            for name, value in counters.items():
                delta = value - self._synced_counters.get(name, 0)
                if delta > 0:
                    self._counters[name].inc(delta)
            self._synced_counters = counters
            rejections = self._observation.rejections()
            for labels, value in rejections.items():
                delta = value - self._synced_rejections.get(labels, 0)
                if delta > 0:
                    self._rejected.labels(*labels).inc(delta)
            self._synced_rejections = rejections
            reading = self._observation.limits()
            labelled: set[tuple[str, str]] = set()
            for path, total in reading.inflight.items():
                limit = reading.config.limits[path]
                self._inflight.labels(path, limit.level).set(total)
                if limit.concurrency is not None:
                    self._capacity.labels(path, limit.level).set(limit.concurrency)
                if path in reading.keys:
                    self._keys.labels(path).set(reading.keys[path])
                labelled.add((path, limit.level))
            self._sync_adaptive(reading.adaptive)
            # Limits removed by a reload stop being reported.
            for path, level in self._labelled - labelled:
                with contextlib.suppress(KeyError):
                    self._inflight.remove(path, level)
                with contextlib.suppress(KeyError):
                    self._capacity.remove(path, level)
                with contextlib.suppress(KeyError):
                    self._keys.remove(path)
            self._labelled = labelled
            self._delayed.set(reading.delayed)
            self._up.set(1 if reading.up else 0)

    def _sync_adaptive(self, values: dict[tuple[str, str], int]) -> None:
        """Write the adaptive limits: plain ones under ``{limit}``, the busiest keys of
        wildcard ones under ``{limit, key}``. A series can never be removed here
        (prometheus_client has no removal in multiprocess mode), so one that is gone
        (a limit reloaded away, a key no longer among the busiest) reads NaN, and a worker
        labels at most ``_ADAPTIVE_KEYS_LABELLED`` keys per limit: a spray of callers
        cannot grow the files."""
        for series in self._adaptive_series - values.keys():
            path, key = series
            child = self._adaptive_keys.labels(path, key) if key else self._adaptive.labels(path)
            child.set(math.nan)
        for (path, key), value in values.items():
            if not key:
                self._adaptive.labels(path).set(value)
                self._adaptive_series.add((path, key))
                continue
            if (path, key) not in self._adaptive_series:
                if self._keyed_per_limit.get(path, 0) >= _ADAPTIVE_KEYS_LABELLED:
                    continue
                self._adaptive_series.add((path, key))
                self._keyed_per_limit[path] = self._keyed_per_limit.get(path, 0) + 1
            self._adaptive_keys.labels(path, key).set(value)

    def _at_exit(self) -> None:
        if os.getpid() == self._pid and self._previous:
            try:
                self.sync()
            except Exception:
                return

    def close(self) -> None:
        """Write the values a last time, stop the thread and stop observing."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        if self._previous:
            self.sync()
        for name, previous in self._previous.items():
            self.gatekeeper.monitor.observe(name, previous)
        self._previous = {}
        _exporters.discard(self)


def register(
    gatekeeper: GateKeeper,
    registry: CollectorRegistry | None = None,
    *,
    multiprocess: bool | None = None,
    interval: float | None = 1.0,
) -> GateKeeperCollector | MultiProcessExporter:
    """Export ``gatekeeper``'s metrics; returns the collector or exporter (``close()`` it
    to stop).

    ``multiprocess`` defaults to whether ``PROMETHEUS_MULTIPROC_DIR`` is set. In one
    process a :class:`GateKeeperCollector` is registered on ``registry`` (default: the
    default registry); in multiprocess mode a :class:`MultiProcessExporter` writes the
    values for ``MultiProcessCollector`` to aggregate.
    """
    if multiprocess is None:
        multiprocess = _multiprocess_dir() is not None
    if multiprocess:
        return MultiProcessExporter(gatekeeper, interval=interval)
    collector = GateKeeperCollector(gatekeeper)
    target = registry if registry is not None else _client().REGISTRY
    target.register(collector)
    collector.registry = target
    return collector
