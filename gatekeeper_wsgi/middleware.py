"""The WSGI middleware: admit, run the app, release when the response is closed.

Release follows PEP 3333: the server calls ``close()`` on the returned iterable after the
body is sent or when the client went away, so that is where the slots come back -
including streamed responses, generators that raise, responses never iterated, apps that
raise before or after ``start_response``. Each admission is released exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    5xx status, or a timeout marker in the status, a header or the body's first 64 KiB.

    Framework plugins feed it what they see and call :meth:`finish` once.
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


class _WatchedResponse(ResponseWatch):
    """The app's response iterable, watched, with release on ``close()``.

    One object per request serves as the ``start_response`` wrapper, the iterable and
    the closer. ``close()`` forwards to the inner iterable inside try/finally, so the
    slots come back even when the inner ``close()`` raises.
    """

    # Set by GateKeeperMiddleware.call_app: the server's start_response, then the app's
    # iterable (no __init__ of its own, which would cost a super() call per request).
    __slots__ = ("_inner", "_start_response")
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
        return self._start_response(status, headers, exc_info)

    def __iter__(self) -> Iterator[bytes]:
        try:
            if self.admission.route.timeout_body is not None:
                for chunk in self._inner:
                    self.chunk(chunk)
                    yield chunk
            else:
                yield from self._inner
        except GeneratorExit:
            raise
        except BaseException:
            self.faulty = True
            raise

    def close(self) -> None:
        try:
            close = getattr(self._inner, "close", None)
            if close is not None:
                close()
        finally:
            self.admission.release(self.status, faulty=self.faulty)


# Status line -> code: a few distinct lines, parsed once (int() on each one is measurable).
_STATUS_CODES: dict[str, int] = {}


def _status_code(status: str) -> int:
    try:
        code = int(status[:3])
    except ValueError:
        code = 500
    return remember(_STATUS_CODES, status, code)


class Gate:
    """The steps every integration shares around its framework: name the caller, admit,
    and answer a rejection (ServiceFault, rejected-request log, stage timings).

    The WSGI middleware and the Django middleware both go through it, so admission and
    rejection behave the same wherever a request comes from.
    """

    def __init__(self, keeper: GateKeeper) -> None:
        self.keeper = keeper
        self._identifier = Identifier(keeper.config)
        self._first_request = True

    def identifier(self) -> Identifier:
        """The request helpers of the configuration in force (rebuilt after a reload)."""
        identifier = self._identifier
        if identifier.config is not self.keeper.config:
            identifier = self._identifier = Identifier(self.keeper.config)
        return identifier

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
            if environ.get("wsgi.multiprocess"):
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
        identifier = gate._identifier
        if identifier.config is not gate.keeper.config:
            identifier = gate.identifier()
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
        """Run the app for an admitted request; the admission is released on close."""
        response = _WatchedResponse(admission)
        response._start_response = start_response
        try:
            response._inner = self.app(environ, response.start_response)
        except BaseException:
            admission.release(response.status, faulty=True)
            raise
        result = response._inner
        file_wrapper = environ.get("wsgi.file_wrapper")
        if (
            file_wrapper is not None
            and isinstance(file_wrapper, type)
            and isinstance(result, file_wrapper)
            and admission.route.timeout_body is None
            and _hook_close(result, response)
        ):
            # Handed back untouched, so the server can still send the file efficiently.
            return result
        return response


def _hook_close(result: Any, watch: ResponseWatch) -> bool:
    """Make a ``wsgi.file_wrapper`` object release on close; False if it cannot be done."""
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
        return False
    return True
