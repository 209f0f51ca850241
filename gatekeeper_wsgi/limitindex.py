"""The rules of which limit applies and what a level inherits, in one place.

Everything that enforces or reports limits asks this module: the resolver (the engine's
slots and delay), ``gatekeeper check`` (the limit tree), the status page and Prometheus
(which limit counts a concrete key). So what is printed is what is enforced.

**Which limit applies** on a level is "the most specific matching path, where an exact
segment beats ``*`` and segments weigh from the left". A path ``values`` of n segments can only be
matched by the 2^n limit paths made of, for each segment, either that value or ``*``; so
instead of scanning every limit, :class:`LimitIndex` looks those few paths up in a dict, in
order of specificity, and the first one found is the answer. A never-seen request path thus
costs a handful of dict lookups however many limits are configured (issue 15: 116 ms per
never-seen path with 100 000 limits when every limit was scanned).

Caller-level limits of a (project, service) are bucketed by their first two segments, so
only the limits that can match a route are looked at and sorted.

**What a level inherits** (:func:`inherit`): of the limits that apply on each level, the
most specific one that sets a ``delay`` gives the delay (caller over service over project),
and the most specific of the project and service levels that sets a timeout marker gives
that marker (markers are not settable per caller).

A leaf module: it imports only the value types (:mod:`gatekeeper_wsgi.values`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import product
from typing import Generic, NamedTuple, Protocol, TypeVar

from gatekeeper_wsgi.values import Limit

__all__ = ["Inherited", "LimitIndex", "counting_limit", "counts", "inherit", "specificity"]


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

    def chain(self, values: tuple[str, ...]) -> tuple[L | None, ...]:
        """The limit that applies on each level of the concrete path ``values``, project
        first (None where none does): what :func:`inherit` reads."""
        return tuple(self.most_specific(values[:depth]) for depth in range(1, len(values) + 1))

    def callers(self, project: str, service: str) -> list[L]:
        """The caller-level limits under ``project/service``, most specific first."""
        found: list[L] = []
        for pattern in _patterns((project, service)):
            found.extend(self._callers.get(pattern, ()))
        found.sort(key=_order, reverse=True)
        return found


def counts(limit: Limit | None) -> bool:
    """Whether a limit takes a slot (a concurrency or a rate), rather than only setting a
    delay or timeout markers for the levels under it."""
    return limit is not None and (limit.concurrency is not None or limit.rate is not None)


def counting_limit(index: LimitIndex[Limit], path: str) -> Limit | None:
    """The configured limit a concrete path (``shop/login/alice``) is counted under: the
    one that applies on its level, if it counts. O(segments) however many limits."""
    limit = index.most_specific(tuple(path.split("/")))
    return limit if counts(limit) else None


class Inherited(NamedTuple):
    """What applies at a node, and which limit of its chain sets it (None: nothing does)."""

    #: the most specific limit of the chain that sets a delay
    delay: Limit | None
    #: the most specific limit of the project and service levels setting each marker
    timeout_status: Limit | None
    timeout_header: Limit | None
    timeout_body: Limit | None
    #: whether a limit of the chain counts concurrency: what a delay holds
    holds: bool = False

    @property
    def delay_seconds(self) -> float:
        """The effective delay: 0 when no level sets one, or when no limit of the chain
        counts concurrency - a delay holds concurrency slots, and without one it would
        hold only the backend's room (a shared table's leases, which a client sending
        faulty requests could fill)."""
        if not self.holds or self.delay is None or self.delay.delay is None:
            return 0.0
        return self.delay.delay


def inherit(chain: Sequence[Limit | None]) -> Inherited:
    """The delay and timeout markers in force under ``chain`` (the limit that applies on
    each level, project first, as :meth:`LimitIndex.chain` gives): the most specific level
    that sets one wins; markers come from the project and service levels only."""
    delay = status = header = body = None
    holds = False
    for depth, limit in enumerate(chain):
        if limit is None:
            continue
        holds = holds or limit.concurrency is not None
        if limit.delay is not None:
            delay = limit
        if depth < 2:
            if limit.timeout_status is not None:
                status = limit
            if limit.timeout_header is not None:
                header = limit
            if limit.timeout_body is not None:
                body = limit
    return Inherited(delay, status, header, body, holds)
