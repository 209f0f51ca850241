"""Limit resolution: which configured limits apply to a (project, service, caller).

On each level at most one limit applies: of the paths matching that level, the most
specific one, where an exact segment beats ``*`` and segments weigh from the left
(``shop/*`` beats ``*/login``). A ``*`` counts every value separately, so the slot's key is
the concrete path (``shop/login/*`` -> ``shop/login/10.0.0.7``).

The project and service levels depend only on (project, service) and are resolved once
per pair and cached, through the configuration's :class:`~gatekeeper_wsgi.limitindex.LimitIndex`
(a never-seen pair costs O(segments), not O(limits)); the caller level depends on the request
and is picked from the route's candidates, ordered by the same rule and indexed by exact
segment (a never-seen caller costs one lookup per key source, not a scan).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.limitindex import counts, inherit
from gatekeeper_wsgi.requestvalues import (  # re-exported: their first home
    MEMO_KEY_CHARS,
    MEMO_SIZE,
    ip_segment,
    key_segment,
    remember,
)
from gatekeeper_wsgi.values import Limit, Slot, TimeoutHeader

__all__ = [
    "MEMO_KEY_CHARS",
    "MEMO_SIZE",
    "CallerLimit",
    "Route",
    "ip_segment",
    "key_segment",
    "remember",
    "resolve_route",
]

# Slot(...) runs NamedTuple's generated __new__, a Python function; the caller level makes
# a slot for every new key, so it builds the tuple directly.
_new_slot = tuple.__new__


class CallerLimit:
    """A caller-level limit that can apply to one route (``Route.caller_candidates``), how
    to read its key from a request (``source``, ``environ_key``), and what its slot needs
    besides the key: computed once per route, not per request."""

    __slots__ = (
        "counts",
        "enforce",
        "environ_key",
        "ipv6_prefix",
        "kind",
        "limit",
        "prefix",
        "segment",
        "source",
    )

    def __init__(self, limit: Limit, prefix: str, enforce: bool, ipv6_prefix: int) -> None:
        self.limit = limit
        #: the concrete path before the key: "project/service/"
        self.prefix = prefix
        self.enforce = enforce
        #: False for a limit that only sets a delay: it matches but takes no slot
        self.counts = counts(limit)
        self.segment = limit.segments[2]
        self.kind = limit.key
        self.environ_key = ""
        self.ipv6_prefix = ipv6_prefix
        if limit.key == "ip":
            self.environ_key = "REMOTE_ADDR"
        elif limit.key.startswith("header:"):
            name = limit.key[len("header:") :]
            self.environ_key = "HTTP_" + name.upper().replace("-", "_")
        #: the request value the key is read from: "caller", "user" or an environ key
        self.source = self.environ_key or self.kind


class Route:
    """The limits of one (project, service), plus the effective delay and timeout markers."""

    __slots__ = (
        "_chain",
        "_claimed",
        "_exact",
        "_memo",
        "_source",
        "_wildcard",
        "caller_candidates",
        "delay",
        "ipv6_prefix",
        "marks_headers",
        "mode",
        "project",
        "service",
        "slots",
        "timeout_body",
        "timeout_header",
        "timeout_status",
    )

    def __init__(self, config: Config, project: str, service: str) -> None:
        # Only what requests read, not the Config itself: an admission in flight holds
        # its Route, and once a reload swapped in another configuration nothing may keep
        # the previous one alive (SPEC 3), however long the response streams.
        self.ipv6_prefix = config.ipv6_prefix
        self.project = project
        self.service = service
        self.mode = config.mode
        self._memo: dict[tuple[str, str, str], tuple[tuple[Slot, ...], float | None]] = (
            config.caller_memo
        )
        # The index looks at only the limits that can match: O(segments), not O(limits).
        index = config.limit_index
        chain = index.chain((project, service))
        self.slots = tuple(
            Slot(key, limit, self.enforces(limit))
            for key, limit in zip((project, f"{project}/{service}"), chain, strict=True)
            if limit is not None and counts(limit)
        )
        callers = index.callers(project, service)
        prefix = f"{project}/{service}/"
        self.caller_candidates = tuple(
            CallerLimit(limit, prefix, self.enforces(limit), config.ipv6_prefix)
            for limit in callers
        )
        # The first candidate in that order that matches the request wins. A `*` one always
        # matches, so only the first of those can win; an exact one matches when its
        # segment is the request's value for its key. Indexing the exact ones by (source,
        # segment) - first in order kept - finds the winner in O(key sources), however
        # many per-caller limits there are (a spray of new callers never scans them).
        self._wildcard: tuple[int, CallerLimit] | None = None
        self._exact: dict[str, dict[str, tuple[int, CallerLimit]]] = {}
        for position, candidate in enumerate(self.caller_candidates):
            if candidate.segment == "*":
                if self._wildcard is None:
                    self._wildcard = (position, candidate)
            else:
                by_segment = self._exact.setdefault(candidate.source, {})
                by_segment.setdefault(candidate.segment, (position, candidate))
        # The segments of the exact limits that can win on this route and take a slot:
        # their counters are named prefix + segment, and the `*` limit's counter of the
        # same value, read from another key, must not be the same one (a header, a user
        # name or a caller named "vip" would spend the limit of caller "vip"; SPEC 4.5).
        wildcard_at = len(self.caller_candidates) if self._wildcard is None else self._wildcard[0]
        self._claimed = frozenset(
            candidate.segment
            for candidate in self.caller_candidates[:wildcard_at]
            if candidate.counts
        )
        # When every candidate reads the same request value, the caller level depends on
        # that value alone and is memoized by it: a repeat caller costs one dict lookup.
        sources = {candidate.source for candidate in self.caller_candidates}
        self._source = sources.pop() if len(sources) == 1 else None
        # What the levels pass down (limitindex.inherit: the most specific level that sets
        # a value wins); a caller-level limit's delay overrides it per request (the same
        # rule one level further down, see caller_level).
        inherited = inherit(chain)
        self._chain = tuple(chain)
        self.delay = inherited.delay_seconds
        status, header, body = (
            inherited.timeout_status,
            inherited.timeout_header,
            inherited.timeout_body,
        )
        self.timeout_status = None if status is None else status.timeout_status
        self.timeout_header: TimeoutHeader | None = (
            None if header is None else header.timeout_header
        )
        self.timeout_body: Any = None if body is None else body.timeout_body
        #: whether a status or header marker can make a response faulty (besides a 5xx)
        self.marks_headers = self.timeout_status is not None or self.timeout_header is not None

    def enforces(self, limit: Limit) -> bool:
        return (limit.mode or self.mode) == "enforce"

    def caller_level(
        self, caller: str, environ: Mapping[str, Any], user: str | None
    ) -> tuple[tuple[Slot, ...], float | None]:
        """The slots of this request (the route's, plus its caller-level slot) and the
        delay its caller-level limit sets, if one matches."""
        source = self._source
        if source is None:
            return self._caller_level(caller, environ, user)
        raw: object
        if source == "caller":
            raw = caller
        elif source == "user":
            raw = user or environ.get("REMOTE_USER")
        else:
            raw = environ.get(source)
        if not isinstance(raw, str):
            return self._caller_level(caller, environ, user)
        # The memo belongs to this route's configuration, shared by all its routes (so its
        # size is bounded however many routes a spray of paths creates) and keyed by
        # names, not by Route: a reload's new configuration starts a new memo, and nothing
        # in it keeps the old configuration alive.
        memo = self._memo
        key = (self.project, self.service, raw)
        try:  # a subscript: a hit costs a bytecode, not a method call
            return memo[key]
        except KeyError:
            return remember(memo, key, self._caller_level(caller, environ, user), len(raw))

    def _caller_level(
        self, caller: str, environ: Mapping[str, Any], user: str | None
    ) -> tuple[tuple[Slot, ...], float | None]:
        best = self._wildcard
        value = ""
        ipv6 = self.ipv6_prefix
        for source, by_segment in self._exact.items():
            found = by_segment.get(_key_value(source, caller, environ, user, ipv6))
            if found is not None and (best is None or found[0] < best[0]):
                best = found
                value = found[1].segment
        if best is None:
            return self.slots, None
        candidate = best[1]
        limit = candidate.limit
        # The delay under the caller level too (limitindex.inherit: the most specific
        # level that sets one wins, and only where a level counts concurrency).
        delay = inherit((*self._chain, limit)).delay_seconds
        if not candidate.counts:
            return self.slots, delay
        if candidate.segment == "*":
            value = _key_value(candidate.source, caller, environ, user, ipv6)
            if value in self._claimed:
                # An exact limit's counter (of another key: one of the same key would
                # have won): this value counts apart, under a digest of key and value.
                value = key_segment(f"{candidate.source}\0{value}")
        slot = _new_slot(Slot, (candidate.prefix + value, limit, candidate.enforce))
        return (*self.slots, slot), delay


def _key_value(
    source: str, caller: str, environ: Mapping[str, Any], user: str | None, ipv6_prefix: int
) -> str:
    """The request's value for a caller-level key read from ``source``, as a path segment
    (an IPv6 address as its network of ``ipv6_prefix`` bits)."""
    if source == "caller":
        return caller
    if source == "user":
        return key_segment(user or environ.get("REMOTE_USER"))
    if source == "REMOTE_ADDR":
        return ip_segment(environ.get("REMOTE_ADDR"), ipv6_prefix)
    return key_segment(environ.get(source))


def resolve_route(config: Config, project: str, service: str) -> Route:
    """Resolve the project and service levels of ``(project, service)``."""
    return Route(config, project, service)
