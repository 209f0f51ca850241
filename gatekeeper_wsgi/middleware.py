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

from werkzeug.wsgi import FileWrapper

from gatekeeper_wsgi.engine import ConfigSource, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.kernel import (
    ADMISSION_KEY,
    BODY_SCAN_LIMIT,
    DECLARED_LENGTHS,
    IDENTITY_KEY,
    REQUEST_ID_KEY,
    Gate,
    Identify,
    ResponseWatch,
    declared_length,
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

    The app gets it as ``start_response`` through a weak proxy (``_proxy``), and the same
    proxy back as ``write``: a generator app holds what it was given in its frame, which
    the response holds as its iterable; a strong reference would make a cycle, and a
    response dropped without ``close()`` (a test client) would keep its slots until the
    cycle collector ran instead of coming back at once (SPEC 4.2).
    """

    # Set by GateKeeperMiddleware.__call__, its only maker: the fields of ResponseWatch,
    # the server's start_response, the body length the app's headers declare (None until
    # start_response), the bytes the app wrote through write(), then the app's iterable;
    # by start_response: the server's write(). object's __init__, not ResponseWatch's:
    # calling a class whose __init__ is Python code costs ~800 instructions per request.
    __slots__ = (
        "__weakref__",
        "_declared",
        "_inner",
        "_proxy",
        "_start_response",
        "_write",
        "_written",
    )
    __init__ = object.__init__
    _declared: int | None
    _inner: Iterable[bytes]
    _start_response: StartResponse
    _write: Callable[[bytes], object]
    _written: int
    _proxy: Any

    def __call__(
        self,
        status: Any,
        headers: list[tuple[str, str]] | None = None,
        exc_info: OptExcInfo | None = None,
    ) -> Any:
        """The app's ``start_response(status, headers, exc_info=None)``, and ``write(data)``
        (called with the data alone) through the proxy it returns."""
        if headers is None:
            return self.write(status)
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
        # The Content-Length the app declared, if a number (read here, not by a helper,
        # for the common spellings: a call costs more than this loop over a few headers;
        # header names are case-insensitive, so any other is looked at too).
        length = None
        for name, value in headers:
            if name in _CONTENT_LENGTH or (len(name) == 14 and name.lower() == "content-length"):
                try:  # a subscript: most responses repeat a few lengths
                    length = DECLARED_LENGTHS[value]
                except KeyError:
                    length = declared_length(value)
                break
        self._declared = length
        self._write = self._start_response(status, headers, exc_info)
        return self._proxy

    def write(self, data: bytes) -> object:
        """PEP 3333's ``write()``: a body (or its start) written before the iterable is
        returned. Watched as the iterable is: scanned for a body marker, and the slots
        come back before the piece that completes the declared Content-Length goes out
        (the client has its whole answer with it)."""
        self.chunk(data)
        self._written += len(data)
        length = self._declared
        if not self.done and length is not None and self._written >= length:
            self.finish()
        try:
            return self._write(data)
        except ConnectionError:
            # The client went away (the server's write failed, and the app will let it
            # through): released now as what the response was so far, as a streamed
            # body the server stops iterating - not as the app's own error.
            if not self.done:
                self.finish()
            raise

    def __iter__(self) -> Iterator[bytes]:
        inner = self._inner
        if type(inner) is list or isinstance(inner, (list, tuple)):
            length: int | None = sum(map(len, inner))
        else:
            length = self._declared
            if self._written and length is not None:  # the rest of a body write() began
                length = max(0, length - self._written)
        return self.stream(inner, length, self._written > 0)

    def late_length(self) -> int | None:
        """The Content-Length the app declared once its generator called start_response,
        less what it wrote through write()."""
        length = self._declared
        return None if length is None else max(0, length - self._written)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            if not self.done:  # else released already, as the body's end was handed out
                self.finish()


class _HeadWatchedResponse(_WatchedResponse):
    """The watched response of a HEAD request: released as the server takes the first
    piece of the body it will drop, or at its end if there is none - before the headers
    go out. The client has the whole response with them, and its next request, on
    another thread, must fit. The body ends there (:meth:`ResponseWatch.stream`'s
    ``head``): gunicorn, waitress and uWSGI would iterate the rest, and the app would make
    it outside the limit - a way around any concurrency limit for whoever sends HEAD."""

    __slots__ = ()

    def write(self, data: bytes) -> object:
        """A HEAD's first ``write()`` sends the headers, which are its whole answer: the
        slots come back before it goes out, as before a HEAD body's first piece."""
        if not self.done:
            self.finish()
        return self._write(data)

    def __iter__(self) -> Iterator[bytes]:
        return self.stream(self._inner, 0, self._written > 0, head=True)


class _SizedWatchedResponse(_WatchedResponse):
    """A watched response around a sized iterable (a list): ``len()`` stays visible, so
    servers still add ``Content-Length`` to a one-element body (wsgiref, waitress)."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


class _SizedHeadWatchedResponse(_HeadWatchedResponse, _SizedWatchedResponse):
    """A HEAD's watched response around a sized iterable: the HEAD's ``__iter__``, the
    sized one's ``__len__``."""

    __slots__ = ()


# Content-Length as apps spell it (see _WatchedResponse.__iter__).
_CONTENT_LENGTH = frozenset(("Content-Length", "content-length", "Content-length"))


# Status line -> code: a few distinct lines, parsed once (int() on each one is measurable).
_STATUS_CODES: dict[str, int] = {}


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
            status, headers, body = gate.fault(environ, rejected)
            start_response(status, headers)
            # A HEAD response carries the headers of the GET and no content (RFC 9110
            # 9.3.2): some servers send whatever the app returns, which would be read as
            # the start of the next response on a kept-alive connection.
            return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
        # Admitted: run the app. The admission is released when the response is exhausted
        # or closed (or, failing both, garbage collected). In this method rather than a
        # helper of its own: a call per request costs ~600 instructions.
        response: _WatchedResponse = _WatchedResponse()  # filled here: see its __slots__
        response.admission = admission
        response.status = None
        response.faulty = False
        response.done = False
        response._start_response = start_response
        response._declared = None
        response._written = 0
        response._proxy = proxy = weakref.proxy(response)
        if "wsgi.file_wrapper" in environ:
            # A file is read through the watch like any body, not handed to the server's
            # sendfile: its end must be seen, or the slot would come back only when the
            # server closes the response - after it wrote its access log (gunicorn), after
            # its event loop sent the last byte (waitress) - and a client that has the
            # whole file could be refused its next request by it (SPEC 4.2).
            environ["wsgi.file_wrapper"] = FileWrapper
        head = environ.get("REQUEST_METHOD") == "HEAD"
        if head:  # before the app runs: its write() may send the headers
            response.__class__ = _HeadWatchedResponse
        try:
            result = response._inner = self.app(environ, proxy)
        except BaseException:
            # The server answers 500, whatever status the app started: that one never
            # went out (a `count` limit counts what the client got).
            admission.release(500, True)
            raise
        sized = type(result) is list or hasattr(result, "__len__")
        if head:
            if sized:
                response.__class__ = _SizedHeadWatchedResponse
        elif sized:
            response.__class__ = _SizedWatchedResponse
        return response
