"""The WSGI middleware: admit, run the app, release when the response is done.

Release follows PEP 3333 and SPEC §4.2: the slots come back when the returned iterable is
exhausted or when the server calls its ``close()`` (after the body is sent, or when the
client went away), whichever comes first - so a client's next request never meets its own
previous one, even under servers that close only after writing their access log. As a
last resort a response dropped without ``close()`` (test clients) releases when it is
garbage collected. This covers streamed responses, generators that raise, responses never
iterated, apps that raise before or after ``start_response``. Each admission is released
exactly once, and the app's own ``close()`` is called exactly once, by the server's.

This module also holds the kernel the framework plugins share: :class:`Gate` (admit and
answer a rejection) and :class:`ResponseWatch` (watch a response, release it once, with
the garbage-collection safety net); the Django middleware reuses both.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gatekeeper_wsgi.engine import Admission, ConfigSource, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.fault import render_fault
from gatekeeper_wsgi.identify import Identifier, request_id_from
from gatekeeper_wsgi.rejectlog import log_rejected
from gatekeeper_wsgi.resolve import Route, remember

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["ADMISSION_KEY", "Gate", "GateKeeperMiddleware", "ResponseWatch"]

#: environ key holding the request's Admission; its presence means "already counted".
ADMISSION_KEY = "gatekeeper.admission"
#: environ key holding (project, service, caller) as identified.
IDENTITY_KEY = "gatekeeper.identity"
#: environ key holding the request id used in faults and logs.
REQUEST_ID_KEY = "gatekeeper.request_id"

# The SPEC scans timeout markers in the first 64 KiB of a body as it streams through.
BODY_SCAN_LIMIT = 64 * 1024

#: identify(environ) -> (project, service), or None to leave the request unlimited
Identify = Callable[["WSGIEnvironment"], "tuple[str, str] | None"]


class ResponseWatch:
    """Watches one response for the signs of a faulty backend (SPEC §3): an exception, a
    5xx status, or a timeout marker in the status, a header or the body's first 64 KiB;
    and releases its admission once.

    Framework plugins feed it what they see and call :meth:`finish`; whoever holds the
    response holds the watch, so a response dropped without ``close()`` finishes it when
    it is garbage collected (``__del__``: cheaper per request than ``weakref.finalize``).
    Finishing twice does nothing.
    """

    __slots__ = ("_scanned", "_tail", "admission", "faulty", "status")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.status: int | None = None
        self.faulty = False
        # Only a route with a body marker scans; chunk() returns before reading these
        # otherwise, and most requests are spared setting them.
        if admission.route.timeout_body is not None:
            self._scanned = 0
            self._tail = b""

    @property
    def scans_body(self) -> bool:
        return self.admission.route.timeout_body is not None

    def headers(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        """The response's status and headers (again, when ``start_response`` is re-called)."""
        self.status = status
        route: Route = self.admission.route
        marker = route.timeout_header
        self.faulty = status >= 500 or (
            route.timeout_status is not None and status in route.timeout_status
        )
        if marker is not None and not self.faulty:
            name = marker.name.lower()
            for key, value in headers:
                if key.lower() == name and marker.pattern.search(value):
                    self.faulty = True
                    break

    def chunk(self, data: bytes) -> None:
        """A piece of the body as it streams through; scanned within the first 64 KiB."""
        pattern = self.admission.route.timeout_body
        if pattern is None or self.faulty or self._scanned >= BODY_SCAN_LIMIT:
            return
        data = data[: BODY_SCAN_LIMIT - self._scanned]
        self._scanned += len(data)
        # Keep a tail, so a marker split across two chunks is still found.
        window = self._tail + data
        if pattern.search(window):
            self.faulty = True
        self._tail = window[-256:]

    def error(self) -> None:
        """The app raised."""
        self.faulty = True

    def finish(self) -> None:
        """Release the admission (after its delay when the response was faulty)."""
        self.admission.release(self.status, faulty=self.faulty)

    def __del__(self) -> None:
        # The safety net: nothing closed the response. An exception here could only be
        # printed as "Exception ignored", and the backend's own expiry still frees the
        # slots, so none escapes.
        try:
            admission = self.admission
            if not admission.released:
                admission.release(self.status, faulty=self.faulty)
        except Exception:
            pass

    def stream(
        self, content: Iterable[bytes], *, finish_on_error: bool, length: int | None = None
    ) -> Iterator[bytes]:
        """``content`` passed through, scanned for a body marker; finished when exhausted,
        or - when the body's ``length`` is known - as soon as that many bytes were handed
        out: a client reading a body of known size sees its end before the server asks
        for more (or closes), and its next request, on another thread, must fit.

        Iterated with ``for``, not ``yield from``: closing this generator (a server
        dropping it when the client went away) must not close ``content`` as well - its
        ``close()`` is called once, by whoever closes the response. An error mid-stream
        is faulty; with ``finish_on_error`` it also releases at once (for a server that
        skips ``close()`` when the stream raises).
        """
        scans = self.admission.route.timeout_body is not None
        left = -1 if length is None else length
        try:
            for chunk in content:  # not `yield from`: see the docstring
                if scans:
                    self.chunk(chunk)
                if left >= 0:
                    left -= len(chunk)
                    if left <= 0:
                        left = -1
                        self.finish()
                yield chunk
        except GeneratorExit:  # closed early: the client went away
            raise
        except BaseException:
            self.faulty = True
            if finish_on_error:
                self.finish()
            raise
        self.finish()

    async def astream(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The async form of :meth:`stream` (with ``finish_on_error``)."""
        try:
            async for chunk in content:
                self.chunk(chunk)
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            self.faulty = True
            self.finish()
            raise
        self.finish()


class _WatchedResponse(ResponseWatch):
    """The app's response iterable, watched, released when exhausted or closed.

    One object per request serves as the ``start_response`` wrapper, the iterable and
    the closer. ``close()`` forwards to the inner iterable inside try/finally, so the
    slots come back even when the inner ``close()`` raises.
    """

    # Set by GateKeeperMiddleware.call_app: the server's start_response, the headers
    # (empty until start_response), then the app's iterable (no __init__ of its own,
    # which would cost a super() call per request).
    __slots__ = ("_headers", "_inner", "_start_response")
    _headers: list[tuple[str, str]] | tuple[()]
    _inner: Iterable[bytes]
    _start_response: StartResponse

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
    ) -> Callable[[bytes], object]:
        code = _STATUS_CODES.get(status)
        if code is None:
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
        if type(inner) is list:
            length: int | None = sum(map(len, inner))
        else:
            length = _declared_length(self._headers)
        return self.stream(inner, finish_on_error=False, length=length)

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self.admission.release(self.status, faulty=self.faulty)


class _SizedWatchedResponse(_WatchedResponse):
    """A watched response around a sized iterable (a list): ``len()`` stays visible, so
    servers still add ``Content-Length`` to a one-element body (wsgiref, waitress)."""

    __slots__ = ()

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]


# Content-Length as apps spell it; another spelling only means the slots come back when
# the body is exhausted rather than when its last byte is handed out.
_CONTENT_LENGTH = frozenset(("Content-Length", "content-length", "Content-length"))


def _declared_length(headers: Iterable[tuple[str, str]]) -> int | None:
    """The Content-Length an app declared, or None (none, or not a plain number)."""
    for name, value in headers:
        if name in _CONTENT_LENGTH:
            # isdigit() alone admits non-ASCII digits; 18 digits bound int()'s work.
            if value.isascii() and value.isdigit() and len(value) <= 18:
                return int(value)
            return None
    return None


# Status line -> code: a few distinct lines, parsed once (int() on each one is measurable).
_STATUS_CODES: dict[str, int] = {}


def _status_code(status: str) -> int:
    try:
        code = int(status[:3])
    except ValueError:
        code = 500
    return remember(_STATUS_CODES, status, code, len(status))


class Gate:
    """The steps every integration shares around its framework: name the caller, admit,
    and answer a rejection (ServiceFault, rejected-request log, stage timings).

    The WSGI middleware and the Django middleware both go through it, so admission and
    rejection behave the same wherever a request comes from.
    """

    def __init__(self, keeper: GateKeeper) -> None:
        self.keeper = keeper
        self._first_request = True

    def identifier(self) -> Identifier:
        """The request helpers of the configuration in force (the engine rebuilds them
        when it swaps in a reloaded configuration)."""
        return self.keeper.identifier

    def server_is_multiprocess(self, environ: WSGIEnvironment) -> bool:
        """Whether the server says other processes serve the app too (PEP 3333's
        ``wsgi.multiprocess``); asked on the first request, so a per-process backend can
        warn. A plugin whose framework sets the flag itself overrides this."""
        return bool(environ.get("wsgi.multiprocess"))

    def admit(
        self,
        identifier: Identifier,
        environ: WSGIEnvironment,
        project: str,
        service: str,
        user: str | None = None,
        *,
        started: float,
    ) -> Admission:
        """Admit the request (raises :class:`Rejected`) and mark it counted in ``environ``."""
        keeper = self.keeper
        if self._first_request:
            self._first_request = False
            if self.server_is_multiprocess(environ):
                keeper.backend.multiprocess()
        caller = identifier.caller(environ)
        if caller is None:
            config = identifier.config
            if config.caller.required:
                raise keeper._counted(Rejected("GK-CALLER-MISSING"))
            caller = config.caller.default
        environ[IDENTITY_KEY] = (project, service, caller)
        admission = environ[ADMISSION_KEY] = keeper._admit(
            project, service, caller, environ, user, started
        )
        return admission

    def fault(
        self,
        identifier: Identifier,
        environ: WSGIEnvironment,
        rejected: Rejected,
        log_environ: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        """The ServiceFault of a rejection (status line, headers, body), logged on
        ``gatekeeper.rejected``; the request id used is left in ``environ``."""
        started = time.perf_counter()
        config = identifier.config
        request_id = request_id_from(environ, identifier.request_id_key)
        environ[REQUEST_ID_KEY] = request_id
        response = render_fault(
            rejected,
            environ,
            request_id,
            fault_format=config.fault.format,
            request_id_header=config.request_id_header,
            renderer=config.fault.renderer,
        )
        if not log_rejected(
            environ if log_environ is None else log_environ, rejected, request_id, config
        ):
            self.keeper.monitor.rejected_log_dropped += 1
        self.keeper.monitor.stages["reject"].record(time.perf_counter() - started)
        return response


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
            admission = gate.admit(identifier, environ, project, service, started=started)
        except Rejected as rejected:
            status, headers, body = gate.fault(identifier, environ, rejected)
            start_response(status, headers)
            return [body]
        return self.call_app(environ, start_response, admission)

    def call_app(
        self, environ: WSGIEnvironment, start_response: StartResponse, admission: Admission
    ) -> Iterable[bytes]:
        """Run the app for an admitted request; the admission is released when the
        response is exhausted or closed (or, failing both, garbage collected)."""
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
            admission.release(response.status, faulty=True)
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
