"""The value types several layers share: a leaf module that imports no other layer.

The configuration builds :class:`Limit` (with its :class:`Rate`, :class:`QueueSpec` and
:class:`TimeoutHeader`), the resolver turns limits into the :class:`Slot` of a request, the
backends count slots, and faults report by ``LEVELS`` and ``FAULT_CODES`` with a
:class:`RateInfo`; the backend registry's scheme names (``BACKENDS``) are read by the
configuration's validation and by the Django checks as well as by the registry. Keeping them
here, below all of those, is what lets each layer import them without importing another
layer (``config`` and ``backends`` once imported each other for them).

It imports only other leaves: :mod:`~gatekeeper_wsgi.adaptive` for ``AdaptiveSpec`` and
:mod:`~gatekeeper_wsgi.redact` to mask a backend URL quoted in an error.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple, get_args

from gatekeeper_wsgi.adaptive import AdaptiveSpec
from gatekeeper_wsgi.redact import mask_url

__all__ = [
    "BACKENDS",
    "CALLER_RE",
    "DEFAULT_MAX_KEYS",
    "FAULT_CODES",
    "LEVELS",
    "Level",
    "Limit",
    "LimitKind",
    "Mode",
    "QueueSpec",
    "Rate",
    "RateInfo",
    "Slot",
    "TimeoutHeader",
    "scheme_of",
]

#: SPEC §4.7: what a caller name may be.
CALLER_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")

DEFAULT_MAX_KEYS = 100_000

#: URL scheme -> "module:class"
BACKENDS: dict[str, str] = {
    "memory": "gatekeeper_wsgi.backends.memory:MemoryBackend",
    "shared": "gatekeeper_wsgi.backends.shared:SharedBackend",
    "redis": "gatekeeper_wsgi.backends.redis:RedisBackend",
    "rediss": "gatekeeper_wsgi.backends.redis:RedisBackend",
    "unix": "gatekeeper_wsgi.backends.redis:RedisBackend",
    "valkey": "gatekeeper_wsgi.backends.redis:RedisBackend",
}


def scheme_of(url: str) -> str:
    """The registry scheme of a backend URL (``BACKENDS``); ValueError saying why for an
    unknown scheme or a memory URL with an address. Callers wrap it in their ConfigError."""
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else url.strip().lower()
    if scheme not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"unknown backend {mask_url(url)!r}; expected one of: {known}")
    if scheme == "memory" and url.strip().lower() not in ("memory", "memory://", "memory:"):
        raise ValueError(f"the memory backend takes no address, got {mask_url(url)!r}")
    return scheme


#: code -> (HTTP status, reason)
FAULT_CODES: dict[str, tuple[int, str]] = {
    "GK-CONCURRENCY-LIMIT": (503, "Too many concurrent requests"),
    "GK-RATE-LIMIT": (429, "Too many requests"),
    "GK-QUEUE-FULL": (503, "Too many requests waiting"),
    "GK-QUEUE-TIMEOUT": (503, "Waited too long for a free slot"),
    "GK-CALLER-MISSING": (400, "Missing or invalid caller identification"),
    "GK-BACKEND-UNAVAILABLE": (503, "Limit backend unavailable"),
}

#: The three levels a request is identified at (SPEC §1), outermost first.
Level = Literal["project", "service", "caller"]
LEVELS: tuple[Level, ...] = get_args(Level)
#: Which count of a limit refused a request (a Denial's, a CapacityError's ``kind``).
LimitKind = Literal["concurrency", "rate"]
#: ``mode`` (global and per limit): refuse over-limit requests, or only report them.
Mode = Literal["enforce", "shadow"]


@dataclass(frozen=True)
class RateInfo:
    """What the IETF ``RateLimit-Policy`` / ``RateLimit`` fields say about a rate limit."""

    quota: int  #: N of "N per window"
    window: float  #: window length in seconds
    remaining: int  #: admissions still possible now
    reset: float  #: seconds until one more admission is possible


@dataclass(frozen=True, slots=True)
class Rate:
    """``N`` admissions in any rolling window of ``seconds``; ``text`` as configured."""

    limit: int
    seconds: float
    text: str


@dataclass(frozen=True)
class QueueSpec:
    """Wait up to ``wait`` seconds in a FIFO of at most ``size`` waiters."""

    size: int
    wait: float


@dataclass(frozen=True)
class TimeoutHeader:
    """A response header whose value, matching ``pattern``, marks a timeout."""

    name: str
    pattern: re.Pattern[str]
    text: str


@dataclass(frozen=True, eq=False, slots=True)
class Limit:
    """One configured limit, addressed by its path (``shop``, ``shop/checkout/*``)."""

    path: str
    segments: tuple[str, ...]
    #: requests in flight; for ``concurrency = "auto"`` the upper bound ``adaptive.max``
    concurrency: int | None = None
    rate: Rate | None = None
    key: str = "caller"
    #: statuses that count against ``rate``; None counts every admission
    count: frozenset[int] | None = None
    max_keys: int = DEFAULT_MAX_KEYS
    delay: float | None = None
    timeout_status: frozenset[int] | None = None
    timeout_header: TimeoutHeader | None = None
    timeout_body: re.Pattern[bytes] | None = None
    queue: QueueSpec | None = None
    #: "enforce" / "shadow"; None follows the global mode
    mode: Mode | None = None
    #: set for ``concurrency = "auto"``: the backend enforces the limit its controller finds
    adaptive: AdaptiveSpec | None = None

    #: ``"project"``, ``"service"`` or ``"caller"`` (derived from the path)
    level: Level = field(init=False, compare=False)
    #: whether a segment is ``*`` (one counter per value; derived from the path)
    wildcard: bool = field(init=False, compare=False)
    #: ``concurrency``, or no bound when None (derived; one comparison per admission);
    #: -inf for an adaptive limit, so that this one comparison sends every admission of it
    #: to the current limit of its controller, and static limits pay nothing for that
    capacity: float = field(init=False, compare=False)
    # The hash, made on first use (a frozen limit's never changes): the Redis backend's
    # memo of packed inputs hashes a route's limits on every admission, and hashing the
    # identity tuple costs ~1.3 µs per request for three limits.
    _hash: int | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Read on every admission: computed once, not by a property.
        object.__setattr__(self, "level", LEVELS[len(self.segments) - 1])
        object.__setattr__(self, "wildcard", "*" in self.segments)
        capacity = math.inf if self.concurrency is None else self.concurrency
        if self.adaptive is not None:
            capacity = -math.inf
        object.__setattr__(self, "capacity", capacity)

    def _identity(self) -> tuple[Any, ...]:
        th = self.timeout_header
        return (
            self.path,
            self.concurrency,
            self.rate,
            self.key,
            self.count,
            self.max_keys,
            self.delay,
            self.timeout_status,
            None if th is None else (th.name, th.text),
            None if self.timeout_body is None else self.timeout_body.pattern,
            self.queue,
            self.mode,
            self.adaptive,
        )

    def __eq__(self, other: object) -> bool:
        # Compiled patterns compare by identity; compare their sources instead.
        return isinstance(other, Limit) and self._identity() == other._identity()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as every field but the hash, made again on first use where it is
        # unpickled (maybe in another process, whose string hashes differ). Not by
        # __getstate__ / __setstate__: Python 3.10's dataclass puts its own on a frozen
        # slotted class, which would carry the hash along.
        return (_unpickled_limit, (tuple(getattr(self, name) for name in _PICKLED),))

    def __hash__(self) -> int:
        known = self._hash
        if known is None:
            known = hash(self._identity())
            object.__setattr__(self, "_hash", known)
        return known


#: the fields a pickled Limit carries (all but the hash)
_PICKLED = tuple(each.name for each in fields(Limit) if each.name != "_hash")


def _unpickled_limit(values: tuple[Any, ...]) -> Limit:
    """The limit :meth:`Limit.__reduce__` pickled, its hash made again on first use."""
    limit = object.__new__(Limit)
    for name, value in zip(_PICKLED, values, strict=True):
        object.__setattr__(limit, name, value)
    object.__setattr__(limit, "_hash", None)
    return limit


class Slot(NamedTuple):
    """One limit a request must fit under."""

    key: str  #: the concrete path counted, e.g. ``shop/login/10.0.0.7``
    limit: Limit
    enforce: bool  #: False in shadow mode: over-limit is reported, not refused
