"""Limit resolution: which configured limits apply to a (project, service, caller).

On each level at most one limit applies: of the paths matching that level, the most
specific one, where an exact segment beats ``*`` and segments weigh from the left
(``shop/*`` beats ``*/login``). A ``*`` counts every value separately, so the slot's key is
the concrete path (``shop/login/*`` -> ``shop/login/10.0.0.7``).

The project and service levels depend only on (project, service) and are resolved once
per pair and cached; the caller level depends on the request and is picked from a short
pre-sorted candidate list.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from gatekeeper_wsgi.backends.base import Slot
from gatekeeper_wsgi.config import CALLER_RE, Config, Limit, TimeoutHeader

__all__ = ["Route", "key_segment", "resolve_route"]


def key_segment(value: str | None) -> str:
    """A request-derived value made safe to use as a path segment and in logs.

    Values that are not plain names (``[A-Za-z0-9._:@-]``, ≤ 128 chars) are replaced by a
    short stable digest, so hostile input can neither forge a path nor bloat a key.
    Missing values count together as ``-``.
    """
    if not value:
        return "-"
    if CALLER_RE.fullmatch(value):
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8)
    return "~" + digest.hexdigest()


def _specificity(limit: Limit) -> tuple[bool, ...]:
    return tuple(segment != "*" for segment in limit.segments)


def _matches(limit: Limit, values: tuple[str, ...]) -> bool:
    return all(
        seg == "*" or seg == value for seg, value in zip(limit.segments, values, strict=False)
    )


def _most_specific(candidates: list[Limit]) -> Limit | None:
    if not candidates:
        return None
    return max(candidates, key=lambda limit: (_specificity(limit), limit.path))


class _CallerCandidate:
    """A caller-level limit of one route, how to read its key from a request, and what
    its slot needs besides the key (computed once per route, not per request)."""

    __slots__ = ("counts", "enforce", "environ_key", "kind", "limit", "prefix", "segment")

    def __init__(self, limit: Limit, prefix: str, enforce: bool) -> None:
        self.limit = limit
        #: the concrete path before the key: "project/service/"
        self.prefix = prefix
        self.enforce = enforce
        #: False for a limit that only sets a delay: it matches but takes no slot
        self.counts = limit.concurrency is not None or limit.rate is not None
        self.segment = limit.segments[2]
        self.kind = limit.key
        self.environ_key = ""
        if limit.key == "ip":
            self.environ_key = "REMOTE_ADDR"
        elif limit.key.startswith("header:"):
            name = limit.key[len("header:") :]
            self.environ_key = "HTTP_" + name.upper().replace("-", "_")


class Route:
    """The limits of one (project, service), plus the effective delay and timeout markers."""

    __slots__ = (
        "caller_candidates",
        "config",
        "delay",
        "mode",
        "project",
        "service",
        "slots",
        "timeout_body",
        "timeout_header",
        "timeout_status",
    )

    def __init__(self, config: Config, project: str, service: str) -> None:
        self.config = config
        self.project = project
        self.service = service
        self.mode = config.mode
        limits = config.limits.values()
        chosen: list[Limit] = []
        slots: list[Slot] = []
        for level, values in ((1, (project,)), (2, (project, service))):
            limit = _most_specific(
                [lim for lim in limits if len(lim.segments) == level and _matches(lim, values)]
            )
            if limit is None:
                continue
            chosen.append(limit)
            if limit.concurrency is not None or limit.rate is not None:
                slots.append(Slot("/".join(values), limit, self.enforces(limit)))
        self.slots = tuple(slots)
        callers = [
            lim for lim in limits if len(lim.segments) == 3 and _matches(lim, (project, service))
        ]
        callers.sort(key=lambda limit: (_specificity(limit), limit.path), reverse=True)
        prefix = f"{project}/{service}/"
        self.caller_candidates = tuple(
            _CallerCandidate(limit, prefix, self.enforces(limit)) for limit in callers
        )
        # The most specific level that sets a value wins: service over project.
        self.delay = 0.0
        self.timeout_status: frozenset[int] | None = None
        self.timeout_header: TimeoutHeader | None = None
        self.timeout_body: Any = None
        for limit in chosen:
            if limit.delay is not None:
                self.delay = limit.delay
            if limit.timeout_status is not None:
                self.timeout_status = limit.timeout_status
            if limit.timeout_header is not None:
                self.timeout_header = limit.timeout_header
            if limit.timeout_body is not None:
                self.timeout_body = limit.timeout_body

    def enforces(self, limit: Limit) -> bool:
        return (limit.mode or self.mode) == "enforce"

    def caller_level(
        self, caller: str, environ: Mapping[str, Any], user: str | None
    ) -> tuple[Slot | None, float | None]:
        """The caller-level slot for this request and the delay that limit sets, if any
        caller-level limit matches."""
        for candidate in self.caller_candidates:
            kind = candidate.kind
            if kind == "caller":
                value = caller
            elif kind == "user":
                value = key_segment(user or environ.get("REMOTE_USER"))
            else:
                value = key_segment(environ.get(candidate.environ_key))
            segment = candidate.segment
            if segment != "*" and segment != value:
                continue
            limit = candidate.limit
            if not candidate.counts:
                return None, limit.delay
            return Slot(candidate.prefix + value, limit, candidate.enforce), limit.delay
        return None, None


def resolve_route(config: Config, project: str, service: str) -> Route:
    """Resolve the project and service levels of ``(project, service)``."""
    return Route(config, project, service)
