"""Self-monitoring: the counters and stage timings behind ``GateKeeper.stats()``.

Recording is a handful of attribute updates, cheap enough for every request: a count, a
total (so ``mean_us`` covers the whole life of the process) and a ring of the most recent
1024 samples, from which ``p99_us`` and ``max_us`` describe current behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["STAGES", "Monitor", "Stage"]

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
)

_RING = 1024  # a power of two: the ring index is a mask
_RING_MASK = _RING - 1


class Stage:
    """Timings of one stage, in nanoseconds."""

    __slots__ = ("count", "observer", "ring", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.ring = [0] * _RING
        #: called with every sample (nanoseconds); exporters (Prometheus) set it
        self.observer: Callable[[int], None] | None = None

    def record(self, ns: int) -> None:
        count = self.count
        self.ring[count & _RING_MASK] = ns
        self.count = count + 1
        self.total += ns
        if self.observer is not None:
            self.observer(ns)

    def summary(self) -> dict[str, Any]:
        count = self.count
        if not count:
            return {"count": 0, "mean_us": 0.0, "p99_us": 0.0, "max_us": 0.0}
        recent = sorted(self.ring[: min(count, _RING)])
        p99 = recent[min(len(recent) - 1, (len(recent) * 99) // 100)]
        return {
            "count": count,
            "mean_us": round(self.total / count / 1000, 3),
            "p99_us": round(p99 / 1000, 3),
            "max_us": round(recent[-1] / 1000, 3),
        }


class Monitor:
    """Counters and stage timings of one :class:`~gatekeeper_wsgi.GateKeeper`."""

    def __init__(self) -> None:
        self.stages = {name: Stage() for name in STAGES}
        self.admitted = 0
        self.rejected: dict[str, int] = {}
        self.rejected_by_limit: dict[str, int] = {}
        #: (code, limit path or "") -> count, for exporters that label by both
        self.rejected_by_code_limit: dict[tuple[str, str], int] = {}
        self.shadow_rejected = 0
        self.reloads = 0
        self.reload_failed = 0
        self.backend_errors = 0
        # Dict updates of two counters must not interleave with a concurrent snapshot.
        self._lock = threading.Lock()

    def count_rejection(self, code: str, limit_path: str | None) -> None:
        with self._lock:
            self.rejected[code] = self.rejected.get(code, 0) + 1
            if limit_path is not None:
                by_limit = self.rejected_by_limit
                by_limit[limit_path] = by_limit.get(limit_path, 0) + 1
            pair = (code, limit_path or "")
            pairs = self.rejected_by_code_limit
            pairs[pair] = pairs.get(pair, 0) + 1

    def rejections(self) -> dict[tuple[str, str], int]:
        """Rejections by (code, limit path); the path is "" for codes without a limit."""
        with self._lock:
            return dict(self.rejected_by_code_limit)

    def snapshot(self, delayed_pending: int) -> dict[str, Any]:
        with self._lock:
            counters: dict[str, Any] = {
                "admitted": self.admitted,
                "rejected": dict(self.rejected),
                "rejected_by_limit": dict(self.rejected_by_limit),
                "shadow_rejected": self.shadow_rejected,
                "delayed_pending": delayed_pending,
                "reloads": self.reloads,
                "reload_failed": self.reload_failed,
                "backend_errors": self.backend_errors,
            }
        return {
            "counters": counters,
            "stages": {name: stage.summary() for name, stage in self.stages.items()},
        }
