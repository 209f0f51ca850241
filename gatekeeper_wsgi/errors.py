"""The exceptions of gatekeeper-wsgi, all in one place."""

from __future__ import annotations

import math
import re

# Re-exported here, where they were first defined; they live in the leaf module.
from gatekeeper_wsgi.values import FAULT_CODES, LEVELS, Level, LimitKind, RateInfo

__all__ = [
    "FAULT_CODES",
    "LEVELS",
    "BackendError",
    "CapacityError",
    "ConfigError",
    "GateKeeperError",
    "Level",
    "LimitKind",
    "RateInfo",
    "Rejected",
]


class GateKeeperError(Exception):
    """Base class of every exception raised by gatekeeper-wsgi."""


# Characters a message must not carry raw (a log line forged by a newline, a terminal
# driven by escapes): C0/C1 controls, DEL, line/paragraph separators and bidi controls.
_UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``, ``\\u2028``)."""
    return _UNSAFE_CHARS.sub(lambda m: repr(m.group())[1:-1], text)


#: the longest key a :class:`ConfigError` message quotes whole
KEY_SHOWN = 200


class ConfigError(GateKeeperError, ValueError):
    """Invalid configuration.

    The message names the offending key, the value found and what was expected; for
    configuration files also the file and line number::

        gatekeeper.properties:12: limits.shop.concurrency: expected an integer >= 0, got '-1'
    """

    def __init__(
        self,
        key: str,
        problem: str,
        *,
        file: str | None = None,
        line: int | None = None,
    ) -> None:
        # Keys, values and file names may come from a hostile file: escape what they carry.
        key, problem = escape_controls(key), escape_controls(problem)
        file = None if file is None else escape_controls(file)
        self.key = key
        self.problem = problem
        self.file = file
        self.line = line
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        # A key is quoted in full up to a length no real one reaches: a hostile file's
        # megabyte key must not make a megabyte message (and log line).
        shown = key if len(key) <= KEY_SHOWN else f"{key[:KEY_SHOWN]}... ({len(key)} characters)"
        super().__init__(f"{where}{shown}: {problem}" if key else f"{where}{problem}")


class BackendError(GateKeeperError):
    """The counter backend (shared file, Redis) failed; wraps the original exception."""


class CapacityError(GateKeeperError):
    """The backend's own capacity ran out for one slot of a request: it cannot track a new
    key of a limit (``max_keys``, all keys busy), a lease, or a rate-window entry.

    Not an outage, so not a :class:`BackendError`: ``on_backend_error`` never applies. The
    backend raises it having undone whatever it took for the request, and the engine refuses
    the request by the limit of ``slots[at]`` (SPEC §4.5), so a full table never admits a
    request uncounted.
    """

    def __init__(
        self, at: int, what: str, *, retry_after: float = 1.0, kind: LimitKind | None = None
    ) -> None:
        #: position of the slot that could not be tracked, in the slots given to ``acquire``
        self.at = at
        #: what ran out and how to size it, for the operator's WARNING
        self.what = what
        #: seconds until a retry may find room
        self.retry_after = retry_after
        #: which count could not be kept, ``"concurrency"`` (a lease, keys all in flight) or
        #: ``"rate"`` (window entries, keys all inside their window); None lets the engine
        #: pick by what the limit has (concurrency when it has one)
        self.kind = kind
        super().__init__(what)


class Rejected(GateKeeperError):
    """A request was refused; carries everything a ServiceFault shows.

    ``level`` is ``"project"``, ``"service"`` or ``"caller"``; ``limit_path`` the configured
    path of the refusing limit (the pattern, e.g. ``shop/login/*``) and ``limit_value`` its
    configured value (``"10"``, ``"5/minute"``).
    """

    def __init__(
        self,
        code: str,
        *,
        level: str | None = None,
        limit_path: str | None = None,
        limit_value: str | None = None,
        retry_after: float | None = None,
        rate: RateInfo | None = None,
    ) -> None:
        self.code = code
        self.status, self.reason = FAULT_CODES[code]
        self.level = level
        self.limit_path = limit_path
        self.limit_value = limit_value
        #: whole seconds, >= 1, rounded up; None for GK-CALLER-MISSING
        self.retry_after: int | None = (
            None if retry_after is None else max(1, math.ceil(retry_after - 1e-9))
        )
        self.rate = rate
        super().__init__(f"{code}: {self.reason}" + (f" ({limit_path})" if limit_path else ""))
