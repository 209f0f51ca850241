"""The adaptive gauges of a shared table: the ``adaptive.Controller`` of each key of a
``concurrency = "auto"`` limit, kept next to the key's counters (gauge i belongs to node
i, ``m x 8 x 144`` bytes), so every process of the host feeds one window and enforces one
limit. A gauge is read only when its node's ``F_GAUGE`` flag says it holds a controller
(a new node's flags are 0), so a gauge page is touched only for keys of adaptive limits.

:class:`Gauges` works on the map, the layout and the journal it is given, nothing else.
"""

from __future__ import annotations

import mmap
import struct

from gatekeeper_wsgi.adaptive import ALGORITHMS, AdaptiveReport, AdaptiveSpec, Controller
from gatekeeper_wsgi.backends.shared.faults import Damaged
from gatekeeper_wsgi.backends.shared.journal import Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    F_GAUGE,
    G_HOT,
    G_STATE,
    GAUGE_HEAD,
    GAUGE_HOT,
    GAUGE_SIZE,
    GAUGE_SPEC,
    GAUGE_STATE,
    N_FLAGS,
    NODE_HEAD,
    U32,
    Layout,
)

# A gauge's baseline (min_latency, a double of its state), read alone by the fast path.
_DOUBLE = struct.Struct("<d")
_BASELINE_OFF = _DOUBLE.size * Controller.STATE.index("min_latency")
_LIMIT_AT = Controller.STATE.index("limit")
_LATENCY_AT = Controller.STATE.index("latency")
_BASELINE_AT = Controller.STATE.index("min_latency")


class Gauges(Structure):
    """The controllers of the adaptive keys of one mapped table."""

    __slots__ = ("_gauges_off", "_prints", "_scratch")

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal) -> None:
        super().__init__(mm, layout, journal)
        self._gauges_off = layout.gauges_off
        #: id(spec) -> (spec, its numbers in a gauge)
        self._prints: dict[int, tuple[AdaptiveSpec, tuple[int, int, int, int]]] = {}
        #: adds a sample to a window loaded from a gauge, reports a gauge
        self._scratch = Controller(AdaptiveSpec(), 0.0)

    def _fingerprint(self, spec: AdaptiveSpec) -> tuple[int, int, int, int]:
        """The numbers a gauge stores of the ``adaptive`` table its state was made under."""
        cached = self._prints.get(id(spec))
        if cached is not None and cached[0] is spec:
            return cached[1]
        numbers = (ALGORITHMS.index(spec.algorithm) + 1, spec.min, spec.max, spec.initial)
        if len(self._prints) >= 1024:  # one per limit; reloads make new ones
            self._prints = {}
        self._prints[id(spec)] = (spec, numbers)
        return numbers

    def _held(self, node: int) -> bool:
        """Whether ``node``'s gauge holds the controller of its key."""
        return bool(self._mm[self._nodes_off + node * self._node_size + N_FLAGS] & F_GAUGE)

    def limit(self, node: int, key: str, spec: AdaptiveSpec, now: float) -> float:
        """The enforced value of the adaptive limit of ``node`` (key ``key``): its gauge's,
        made first (the key's first admission) or brought under a reloaded ``spec``."""
        at = self._gauges_off + node * GAUGE_SIZE
        if self._held(node):
            algorithm, low, high, initial, limit = GAUGE_HEAD.unpack_from(self._mm, at)
            if (algorithm, low, high, initial) == self._fingerprint(spec):
                return float(limit)
        controller = self._held_controller(node, key, spec, now)
        self._store(at, spec, controller)
        return float(controller.limit)

    def current(self, node: int, key: str, spec: AdaptiveSpec) -> int | None:
        """The limit ``node``'s next admission enforces, read without changing anything;
        None if its gauge holds no controller yet."""
        if not self._held(node):
            return None
        at = self._gauges_off + node * GAUGE_SIZE
        algorithm, low, high, initial, current = GAUGE_HEAD.unpack_from(self._mm, at)
        if (algorithm, low, high, initial) == self._fingerprint(spec):
            return int(current)
        # Made under another table (a reload): what its next admission will enforce.
        return self._controller(at, key, spec, 0.0).limit

    def _held_controller(self, node: int, key: str, spec: AdaptiveSpec, now: float) -> Controller:
        """The controller of ``node``'s key under ``spec``: the one its gauge holds, else a
        new one (the caller stores it, and the node is marked as holding one)."""
        if self._held(node):
            return self._controller(self._gauges_off + node * GAUGE_SIZE, key, spec, now)
        offset = self._nodes_off + node * self._node_size
        self._journal.save(offset, NODE_HEAD)
        self._mm[offset + N_FLAGS] |= F_GAUGE
        return Controller(spec, now, key=key)

    def _controller(self, at: int, key: str, spec: AdaptiveSpec, now: float) -> Controller:
        """The controller the gauge at ``at`` holds (its node's ``F_GAUGE`` is set), under
        ``spec``: its state under the table it was made with, then ``respec``'d."""
        mm = self._mm
        algorithm, low, high, initial = GAUGE_SPEC.unpack_from(mm, at)
        if not 0 < algorithm <= len(ALGORITHMS) or not low <= initial <= high:
            raise Damaged("its adaptive gauge holds no valid adaptive table")
        made = AdaptiveSpec(ALGORITHMS[algorithm - 1], low, high, initial)
        controller = Controller.restore(made, GAUGE_STATE.unpack_from(mm, at + G_STATE), key=key)
        controller.respec(spec)
        return controller

    def _store(self, at: int, spec: AdaptiveSpec, controller: Controller) -> None:
        mm = self._mm
        self._journal.save(at, GAUGE_SIZE)
        GAUGE_SPEC.pack_into(mm, at, *self._fingerprint(spec))
        GAUGE_STATE.pack_into(mm, at + G_STATE, *controller.state())

    def sample(
        self,
        node: int,
        key: str,
        spec: AdaptiveSpec,
        admitted: float,
        faulty: bool,
        now: float,
    ) -> None:
        """Feed one released request to the controller of ``node``, in the table: every
        process's samples go into one window, one latency statistic, one limit."""
        mm = self._mm
        at = self._gauges_off + node * GAUGE_SIZE
        inflight = U32.unpack_from(mm, self._nodes_off + node * self._node_size)[0]
        if self._held(node) and GAUGE_SPEC.unpack_from(mm, at) == self._fingerprint(spec):
            due, count, total, drops, peak = GAUGE_HOT.unpack_from(mm, at + G_HOT)
            if now < due:
                # Nothing is due: the sample only adds to the window (Controller.sample's
                # first part), done on a scratch controller loaded with the window alone
                # instead of rebuilding the whole one (~20 µs) on every release.
                scratch = self._scratch
                baseline = _DOUBLE.unpack_from(mm, at + G_STATE + _BASELINE_OFF)[0]
                scratch.load_window((due, int(count), total, int(drops), int(peak)), baseline)
                scratch.sample(now - admitted, inflight, faulty, admitted, now)
                self._journal.save(at + G_HOT, GAUGE_HOT.size)
                GAUGE_HOT.pack_into(mm, at + G_HOT, *scratch.window())
                return
        controller = self._held_controller(node, key, spec, admitted)
        controller.sample(now - admitted, inflight, faulty, admitted, now)
        self._store(at, spec, controller)

    def report(self, node: int) -> AdaptiveReport | None:
        """The report of ``node``'s gauge (limit, latency, baseline under the table its
        state was last made with), None if it holds no controller."""
        if not self._held(node):
            return None
        numbers = GAUGE_STATE.unpack_from(self._mm, self._gauges_off + node * GAUGE_SIZE + G_STATE)
        scratch = self._scratch
        scratch.limit = int(numbers[_LIMIT_AT])
        scratch.latency = numbers[_LATENCY_AT]
        scratch.min_latency = numbers[_BASELINE_AT]
        return scratch.report()
