"""Who is calling what: the service of a bare WSGI request, the caller, the request id.

Everything read from a request is validated here and made safe (SPEC §4.7-4.8): a value
that is not a plain name is treated as missing, replaced or digested, never echoed.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, RequestRedirect, Rule

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.forks import ForkWatch
from gatekeeper_wsgi.redact import Throttle, failure_without_message
from gatekeeper_wsgi.requestvalues import key_segment, remember
from gatekeeper_wsgi.values import CALLER_RE

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

__all__ = ["Identifier", "environ_key", "request_id_from"]

logger = logging.getLogger("gatekeeper")

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# SPEC §4.7: a caller name is at most this long.
MAX_CALLER_CHARS = 128
# Unique per process and request, without the cost of uuid4 on every request.
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def _new_id_prefix() -> None:
    # A forked worker (gunicorn --preload, uWSGI, multiprocessing) inherits the parent's
    # prefix and counter: without a prefix of its own it would repeat its siblings' ids.
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX = os.urandom(6).hex()
    _ID_COUNTER = itertools.count(1)


_ID_FORKS = ForkWatch(_new_id_prefix)

CallerResolver = Callable[["WSGIEnvironment"], "str | None"]

#: seconds between two ERRORs of a failing caller.resolver (monotonic clock)
RESOLVER_LOG_INTERVAL = 10.0


def environ_key(header: str) -> str:
    """The WSGI environ key of an HTTP header name (``X-Caller-Id`` -> ``HTTP_X_CALLER_ID``)."""
    return "HTTP_" + header.upper().replace("-", "_")


def request_id_from(environ: Mapping[str, Any], environ_key: str) -> str:
    """The request's id from its header when that is a plain token, else a fresh one."""
    value = environ.get(environ_key)
    if isinstance(value, str) and len(value) <= 128 and _REQUEST_ID_RE.fullmatch(value):
        return value
    _ID_FORKS.check()
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


class Identifier:
    """Per-configuration helpers to name a request's service and caller.

    Built once per configuration (a reload builds a new one), so the per-request work is
    a dict lookup and a regular-expression match. The configuration model has already
    imported the resolver and checked the routes, so building one never fails.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.caller_key = environ_key(config.caller.header)
        self.request_id_key = environ_key(config.request_id_header)
        self.resolver: CallerResolver | None = config.caller.resolver
        self._resolver_failures = Throttle(RESOLVER_LOG_INTERVAL)
        #: whether a limit counts by user (Django reads request.user only then)
        self.needs_user = any(limit.key == "user" for limit in config.limits.values())
        # Memos of the per-request regular-expression work: path -> service (without a
        # routes table) and header value -> whether it is a valid caller name.
        self._services: dict[str, str] = {}
        self._callers: dict[str, bool] = {}
        self._adapter = None
        if config.routes:
            rules = [Rule(rule, endpoint=name) for rule, name in config.routes.items()]
            self._adapter = Map(rules, strict_slashes=False).bind("localhost")

    def service(self, environ: Mapping[str, Any]) -> str:
        """The ``routes`` table's service for this path, else its first segment."""
        path = environ.get("PATH_INFO") or "/"
        if self._adapter is not None:
            # PEP 3333 hands the path's bytes over as latin-1; the rules are text, matched
            # on the path decoded as UTF-8, as werkzeug (and so Flask) decodes it.
            # (A path that is no latin-1 string, against PEP 3333, is matched as best it can.)
            if not path.isascii():
                text = path.encode("latin-1", "replace").decode("utf-8", "replace")
            else:
                text = path
            try:
                endpoint, _ = self._adapter.match(text, method=environ.get("REQUEST_METHOD"))
                return str(endpoint)
            except (HTTPException, RequestRedirect):
                pass
            except Exception:  # a hostile path must never turn into a 500
                logger.debug("gatekeeper: route matching failed for %r", path, exc_info=True)
        # A subscript, not .get(): a hit (nearly every request) is one bytecode, where a
        # method call costs ~150 instructions; a miss pays the KeyError, beside the work
        # it does anyway. Not `in` then [], which a full memo cleared in between would fail.
        try:
            return self._services[path]
        except KeyError:
            first = path.lstrip("/").split("/", 1)[0]
            return remember(
                self._services, path, key_segment(first) if first else "root", len(path)
            )

    def caller(self, environ: WSGIEnvironment) -> str | None:
        """The caller named by the resolver or header, or None when missing or invalid."""
        if self.resolver is not None:
            try:
                value = self.resolver(environ)
            except Exception as exc:
                failures = self._resolver_failures.due()
                if failures:
                    logger.error(
                        "gatekeeper: caller.resolver raised (%d times since the last report);"
                        " caller treated as missing: %s",
                        failures,
                        failure_without_message(exc),
                    )
                return None
        else:
            value = environ.get(self.caller_key)
        if not isinstance(value, str):
            return None
        try:  # a subscript, as in service()
            valid = self._callers[value]
        except KeyError:
            # Longer than a caller name may be: invalid, without a regex run or a memo entry.
            if len(value) > MAX_CALLER_CHARS:
                return None
            valid = remember(
                self._callers, value, CALLER_RE.fullmatch(value) is not None, len(value)
            )
        return value if valid else None
