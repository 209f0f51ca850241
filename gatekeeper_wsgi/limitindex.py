"""The configured limits indexed by their segments, for lookups that cost O(segments).

Which limit applies on a level is "the most specific matching path, where an exact segment
beats ``*`` and segments weigh from the left". A path ``values`` of n segments can only be
matched by the 2^n limit paths made of, for each segment, either that value or ``*``; so
instead of scanning every limit, :class:`LimitIndex` looks those few paths up in a dict, in
order of specificity, and the first one found is the answer. A never-seen request path thus
costs a handful of dict lookups however many limits are configured (issue 15: 116 ms per
never-seen path with 100 000 limits when every limit was scanned).

Caller-level limits of a (project, service) are bucketed by their first two segments, so
only the limits that can match a route are looked at and sorted.

A leaf module: it knows limits only by their ``segments`` and ``path``.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import product
from typing import Generic, Protocol, TypeVar

__all__ = ["LimitIndex", "specificity"]


class _Addressed(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def segments(self) -> tuple[str, ...]: ...


L = TypeVar("L", bound=_Addressed)


def specificity(limit: _Addressed) -> tuple[bool, ...]:
    """How specific a limit path is: True per exact segment; compare tuples, left weighs most."""
    return tuple(segment != "*" for segment in limit.segments)


def _order(limit: _Addressed) -> tuple[tuple[bool, ...], str]:
    # The rule's total order: specificity, then the path (a stable tie-break).
    return specificity(limit), limit.path


def _patterns(values: tuple[str, ...]) -> Iterable[tuple[str, ...]]:
    """The limit paths that can match ``values``, most specific first.

    Each segment is either the value itself or ``*``; ``product`` over ``(value, "*")``
    yields exact-before-``*`` weighed from the left, which is the specificity order. A value
    that is itself ``*`` has only the one choice, so no path is yielded twice and the
    yielded order is the true specificity order.
    """
    return product(*(("*",) if value == "*" else (value, "*") for value in values))


class LimitIndex(Generic[L]):
    """Limits by exact segments, plus caller-level limits by their first two segments.

    Example::

        index = LimitIndex(config.limits.values())
        index.most_specific(("shop", "login"))   # the service-level limit that applies
        index.callers("shop", "login")           # caller limits that can apply, in order
    """

    __slots__ = ("_by_segments", "_callers")

    def __init__(self, limits: Iterable[L]) -> None:
        self._by_segments: dict[tuple[str, ...], L] = {}
        self._callers: dict[tuple[str, ...], list[L]] = {}
        for limit in limits:
            segments = limit.segments
            # Paths are unique, so one limit per segments tuple; keep the rule's tie-break
            # anyway should two limits ever share segments.
            known = self._by_segments.get(segments)
            if known is None or _order(limit) > _order(known):
                self._by_segments[segments] = limit
            if len(segments) == 3:
                self._callers.setdefault(segments[:2], []).append(limit)

    def most_specific(self, values: tuple[str, ...]) -> L | None:
        """The limit of level ``len(values)`` that applies to the concrete path ``values``."""
        by_segments = self._by_segments
        for pattern in _patterns(values):
            limit = by_segments.get(pattern)
            if limit is not None:
                return limit
        return None

    def callers(self, project: str, service: str) -> list[L]:
        """The caller-level limits under ``project/service``, most specific first."""
        found: list[L] = []
        for pattern in _patterns((project, service)):
            found.extend(self._callers.get(pattern, ()))
        found.sort(key=_order, reverse=True)
        return found
