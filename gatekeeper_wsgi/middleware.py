"""The WSGI middleware: admit, run the app, release when the response is done.

Release follows PEP 3333 and SPEC §4.2: the slots come back when the returned iterable is
exhausted or when the server calls its ``close()`` (after the body is sent, or when the
client went away), whichever comes first - so a client's next request never meets its own
previous one, even under servers that close only after writing their access log. As a
last resort a response dropped without ``close()`` (test clients) releases when it is
garbage collected. This covers streamed responses, generators that raise, responses never
iterated, apps that raise before or after ``start_response``. Each admission is released
exactly once, and the app's own ``close()`` is called exactly once, by the server's.

It is a thin client of the integration kernel (:mod:`gatekeeper_wsgi.kernel`): its
:class:`~gatekeeper_wsgi.kernel.Gate` admits and answers rejections, and the response it
returns is a :class:`~gatekeeper_wsgi.kernel.ResponseWatch` that also serves as the
``start_response`` wrapper, the iterable and the closer. The kernel's names are
re-exported here, where they were first defined.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from gatekeeper_wsgi.engine import ConfigSource, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.kernel import (
    ADMISSION_KEY,
    BODY_SCAN_LIMIT,
    IDENTITY_KEY,
    REQUEST_ID_KEY,
    Gate,
    Identify,
    ResponseWatch,
)
from gatekeeper_wsgi.requestvalues import remember

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "ADMISSION_KEY",
    "BODY_SCAN_LIMIT",
    "IDENTITY_KEY",
    "REQUEST_ID_KEY",
    "Gate",
    "GateKeeperMiddleware",
    "Identify",
    "ResponseWatch",
]


class _WatchedResponse(ResponseWatch):
    """The app's response iterable, watched, released when exhausted or closed.

    One object per request serves as the ``start_response`` wrapper, the iterable and
    the closer. ``close()`` forwards to the inner iterable inside try/finally, so the
    slots come back even when the inner ``close()`` raises.
    """

    # Set by GateKeeperMiddleware.__call__: the server's start_response, the headers
    # (empty until start_response), then the app's iterable (no __init__ of its own,
    # which would cost a super() call per request).
    __slots__ = ("_headers", "_inner", "_start_response")
    _headers: list[tuple[str, str]] | tuple[()]
    _inner: Iterable[bytes]
    _start_response: StartResponse

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
    ) -> Callable[[bytes], object]:
        try:  # a subscript: a hit costs a bytecode, not a method call
            code = _STATUS_CODES[status]
        except KeyError:
            code = _status_code(status)
        if code < 500 and not self.admission.route.marks_headers:
            # Only a 5xx can make it faulty: no header to look at.
            self.status = code
            self.faulty = False
        else:
            self.headers(code, headers)
        self._headers = headers
        return self._start_response(status, headers, exc_info)

    def __iter__(self) -> Iterator[bytes]:
        inner = self._inner
        length: int | None = None
        if type(inner) is list:
            length = sum(map(len, inner))
        else:
            # The Content-Length the app declared, if a plain number (read here, not by a
            # helper: a call costs more than this loop over a few headers). Another
            # spelling only means the slots come back when the body is exhausted rather
            # than when its last byte is handed out.
            for name, value in self._headers:
                if name in _CONTENT_LENGTH:
                    try:  # a subscript: most responses repeat a few lengths
                        length = _LENGTHS[value]
                    except KeyError:
                        length = _length(value)
                    break
        return self.stream(inner, False, length)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            if not self.done:  # else released already, as the body's end was handed out
                self.done = True
                self.admission.release(self.status, self.faulty)


class _SizedWatchedResponse(_WatchedResponse):
    """A watched response around a sized iterable (a list): ``len()`` stays visible, so
    servers still add ``Content-Length`` to a one-element body (wsgiref, waitress)."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


# Content-Length as apps spell it (see _WatchedResponse.__iter__).
_CONTENT_LENGTH = frozenset(("Content-Length", "content-length", "Content-length"))


# Status line -> code: a few distinct lines, parsed once (int() on each one is measurable).
_STATUS_CODES: dict[str, int] = {}
# Content-Length value -> its length, or None when not a plain number.
_LENGTHS: dict[str, int | None] = {}


def _length(value: str) -> int | None:
    # isdigit() alone admits non-ASCII digits; 18 digits bound int()'s work.
    length = int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None
    return remember(_LENGTHS, value, length, len(value))


def _status_code(status: str) -> int:
    try:
        code = int(status[:3])
    except ValueError:
        code = 500
    return remember(_STATUS_CODES, status, code, len(status))


class GateKeeperMiddleware:
    """WSGI middleware that admits or rejects each request by the configured limits.

    ``config`` is a settings dict, the path of a ``.toml``/``.properties`` file, or a
    :class:`GateKeeper` to share one engine between several apps::

        from gatekeeper_wsgi import GateKeeperMiddleware

        app = GateKeeperMiddleware(app, {
            "project": "shop",
            "limits": {
                "shop": {"concurrency": 100},
                "shop/checkout": {"concurrency": 10, "queue": {"size": 20, "wait": 1.5}},
                "shop/login/*": {"rate": "5/minute", "key": "ip", "count": [401]},
            },
        })

    ``identify(environ) -> (project, service) | None`` replaces the bare-WSGI naming
    (``routes`` table, else first path segment); returning None leaves a request
    unlimited. The framework plugins use it.
    """

    def __init__(
        self,
        app: WSGIApplication,
        config: ConfigSource | GateKeeper,
        *,
        identify: Identify | None = None,
    ) -> None:
        self.app = app
        self.gate = Gate(config if isinstance(config, GateKeeper) else GateKeeper(config))
        self.gatekeeper = self.gate.keeper
        self._identify = identify

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if ADMISSION_KEY in environ:  # already counted by an outer gatekeeper
            return self.app(environ, start_response)
        started = time.perf_counter()
        gate = self.gate
        identifier = gate.keeper.identifier
        if self._identify is not None:
            names = self._identify(environ)
            if names is None:
                return self.app(environ, start_response)
            project, service = names
        else:
            project, service = identifier.config.project, identifier.service(environ)
        try:
            admission = gate.admit(identifier, environ, project, service, None, started)
        except Rejected as rejected:
            status, headers, body = gate.fault(identifier, environ, rejected)
            start_response(status, headers)
            # A HEAD response carries the headers of the GET and no content (RFC 9110
            # 9.3.2): some servers send whatever the app returns, which would be read as
            # the start of the next response on a kept-alive connection.
            return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
        # Admitted: run the app. The admission is released when the response is exhausted
        # or closed (or, failing both, garbage collected). In this method rather than a
        # helper of its own: a call per request costs ~600 instructions.
        response = _WatchedResponse(admission)
        response._start_response = start_response
        response._headers = ()
        file_wrapper = environ.get("wsgi.file_wrapper")
        made: list[object] | None = None
        if file_wrapper is not None and not isinstance(file_wrapper, type):
            # A function-style file_wrapper (uWSGI's returns the very file it is given, and
            # sends it with sendfile only if the app returns that object): what it made is
            # recorded, so that object can be recognised and handed back untouched.
            made = []
            environ["wsgi.file_wrapper"] = _recording(file_wrapper, made)
        try:
            result = response._inner = self.app(environ, response.start_response)
        except BaseException:
            admission.release(response.status, True)
            raise
        if file_wrapper is not None and admission.route.timeout_body is None:
            if made is None:
                is_file = isinstance(result, file_wrapper)
            else:
                environ["wsgi.file_wrapper"] = file_wrapper
                is_file = any(result is each for each in made)
            if is_file and _hook_close(result, response):
                # Handed back untouched, so the server can still send the file efficiently;
                # the hook holds the watch, which so lives (and is collected) with `result`.
                response._inner = ()
                return result
        if type(result) is list or hasattr(result, "__len__"):
            response.__class__ = _SizedWatchedResponse
        return response


def _recording(file_wrapper: Callable[..., Any], made: list[object]) -> Callable[..., Any]:
    """``file_wrapper``, remembering in ``made`` what it returned."""

    def wrap(filelike: Any, *args: Any, **kwargs: Any) -> Any:
        result = file_wrapper(filelike, *args, **kwargs)
        made.append(result)
        return result

    return wrap


def _hook_close(result: Any, watch: ResponseWatch) -> bool:
    """Make a ``wsgi.file_wrapper`` object release on close (or, an object whose
    ``close`` cannot be replaced - a plain file - when it is collected, as a server drops
    it right after closing it); False if neither can be done."""
    inner_close = getattr(result, "close", None)

    def close() -> None:
        try:
            if inner_close is not None:
                inner_close()
        finally:
            watch.finish()

    try:
        result.close = close
    except AttributeError:
        try:
            weakref.finalize(result, watch.finish)
        except TypeError:
            return False
    return True
