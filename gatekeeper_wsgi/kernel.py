"""The integration kernel: what every framework integration shares around its framework.

:class:`Gate` names the caller, admits (through the engine) and answers a rejection
(ServiceFault, rejected-request log, stage timings); :class:`ResponseWatch` watches one
response for the signs of a faulty backend and releases its admission exactly once, with
the garbage-collection safety net. The environ keys (``ADMISSION_KEY`` and the others)
are how an integration marks a request as counted, so middleware and plugin never count
one request twice.

The WSGI middleware (:mod:`gatekeeper_wsgi.middleware`) and the Django middleware
(``gatekeeper_wsgi.contrib.django``) are both thin clients of this module: neither
re-implements admission, rejection or release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.fault import render_fault
from gatekeeper_wsgi.identify import Identifier, request_id_from
from gatekeeper_wsgi.rejectlog import log_rejected
from gatekeeper_wsgi.requestvalues import content_length, remember
from gatekeeper_wsgi.resolve import Route

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

__all__ = [
    "ADMISSION_KEY",
    "BODY_SCAN_LIMIT",
    "DECLARED_LENGTHS",
    "IDENTITY_KEY",
    "REQUEST_ID_KEY",
    "Gate",
    "Identify",
    "ResponseWatch",
    "declared_length",
]

#: environ key holding the request's Admission; its presence means "already counted".
ADMISSION_KEY = "gatekeeper.admission"
#: environ key holding (project, service, caller) as identified.
IDENTITY_KEY = "gatekeeper.identity"
#: environ key holding the request id used in faults and logs.
REQUEST_ID_KEY = "gatekeeper.request_id"

# ResponseWatch.stream: the body's declared length has been handed out (and released).
_FINISHED = -2
# The SPEC scans timeout markers in the first 64 KiB of a body as it streams through.
BODY_SCAN_LIMIT = 64 * 1024

#: identify(environ) -> (project, service), or None to leave the request unlimited
Identify = Callable[["WSGIEnvironment"], "tuple[str, str] | None"]

#: Content-Length value -> its length, or None when not a plain number (most responses
#: repeat a few: read by subscript on the WSGI hot path, filled by declared_length).
DECLARED_LENGTHS: dict[str, int | None] = {}


def declared_length(value: str) -> int | None:
    """The body length a ``Content-Length`` value declares, None unless a plain number
    (:func:`~gatekeeper_wsgi.requestvalues.content_length`, memoized)."""
    return remember(DECLARED_LENGTHS, value, content_length(value), len(value))


class ResponseWatch:
    """Watches one response for the signs of a faulty backend (SPEC §3): an exception, a
    5xx status, or a timeout marker in the status, a header or the body's first 64 KiB;
    and releases its admission once.

    Framework plugins feed it what they see and call :meth:`finish`; whoever holds the
    response holds the watch, so a response dropped without ``close()`` finishes it when
    it is garbage collected (``__del__``: cheaper per request than ``weakref.finalize``).
    Finishing twice does nothing.
    """

    __slots__ = ("_body", "admission", "done", "faulty", "status")
    _body: bytearray

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.status: int | None = None
        self.faulty = False
        #: whether this watch released its admission: its later finishes (``close()``
        #: after the body, then ``__del__``) skip the call. Only a shortcut - the
        #: admission's own release is what frees the slots exactly once, whatever races.
        self.done = False
        # _body is set by the first chunk() kept: only a route with a body marker keeps
        # one, and most requests are spared setting it.

    def late_length(self) -> int | None:
        """The body length still to hand out as the response declared it, for a
        :meth:`stream` begun before its status was known; None: not declared."""
        return None

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
        """A piece of the body as it streams through: its first 64 KiB are kept, for
        :meth:`judge` to search once, as one text, when the response ends - so a marker
        split over pieces is found however long it is, and ``^`` or ``$`` match at the
        body's start and end, not at each piece's."""
        if self.admission.route.timeout_body is None or self.faulty:
            return
        try:
            body = self._body
        except AttributeError:  # the first piece
            self._body = bytearray(data[:BODY_SCAN_LIMIT])
            return
        room = BODY_SCAN_LIMIT - len(body)
        if room > 0:
            body += data[:room]

    def judge(self) -> None:
        """Search the body kept for the route's marker (before the release)."""
        pattern = self.admission.route.timeout_body
        if pattern is not None and not self.faulty:
            try:
                body = self._body
            except AttributeError:
                body = bytearray()
            self.faulty = pattern.search(body) is not None

    def error(self) -> None:
        """The app raised."""
        self.faulty = True

    def finish(self) -> None:
        """Release the admission (after its delay when the response was faulty)."""
        self.done = True
        if not self.faulty and self.admission.route.timeout_body is not None:
            self.judge()
        self.admission.release(self.status, self.faulty)

    def __del__(self) -> None:
        # The safety net: nothing closed the response. The release is made by the next
        # call into the engine (Admission.release_collected): the garbage collector may
        # run this inside a backend's lock, on the thread that holds it.
        if self.done:  # the usual case: one attribute read, not a call
            return
        self.done = True
        self.judge()
        self.admission.release_collected(self.status, self.faulty)

    def stream(
        self,
        content: Iterable[bytes],
        length: int | None = None,
        sent: bool = False,
        *,
        head: bool = False,
    ) -> Iterator[bytes]:
        """``content`` passed through, scanned for a body marker; finished when exhausted,
        or - when the body's ``length`` is known - as soon as that many bytes were handed
        out: a client reading a body of known size sees its end before the server asks
        for more (or closes), and its next request, on another thread, must fit.

        Iterated with ``for``, not ``yield from``: closing this generator (a server
        dropping it when the client went away) must not close ``content`` as well - its
        ``close()`` is called once, by whoever closes the response. An error mid-stream
        is faulty and releases at once: the response ends there, whether or not the
        server (or a test client whose reader raised) closes it afterwards; raised before
        any body went out (``sent``: some went out already, by ``write()``), it is the
        500 the server answers.

        ``head``: the body of a HEAD response (``length`` 0), which the server drops. It
        ends with its first piece (handed out once the status is known, for the servers
        that send the headers with it): the rest is not made, and the app's generator,
        closed with the response, does no work its released slots no longer count
        (gunicorn, waitress and uWSGI would iterate it to its end).
        """
        scans = self.admission.route.timeout_body is not None
        # Bytes still to hand out; -1: length unknown, _FINISHED: all handed out.
        left = -1 if length is None else length
        # No status yet: an app that calls start_response from its generator (PEP 3333
        # lets it) declares its length with the first piece (see late_length).
        late = length is None and self.status is None
        # The piece last handed out: a non-empty one took the status line out with it;
        # before any, the server answers an error with 500 (PEP 3333), whatever status was
        # started. (Set once here, not per piece: only an error reads it.)
        chunk = b""
        try:
            for chunk in content:  # not `yield from`: see the docstring
                if late and self.status is not None:
                    late = False
                    declared = self.late_length()
                    if declared is not None:
                        left = declared
                if scans:
                    self.chunk(chunk)
                if left >= 0:
                    left -= len(chunk)
                    # Not before the status is known: an app may hand out empty chunks
                    # before it calls start_response (PEP 3333), and a HEAD's length is 0.
                    if left <= 0 and self.status is not None:
                        left = _FINISHED
                        # finish(), inlined: a frame less on every sized body
                        self.done = True
                        if scans:
                            self.judge()
                        self.admission.release(self.status, self.faulty)
                        if head:
                            yield chunk
                            return
                yield chunk
        except GeneratorExit:  # closed early: the client went away
            raise
        except BaseException:
            if not (sent or chunk):  # a `count` limit counts what the client got
                self.status = 500
            self.faulty = True
            self.finish()
            raise
        if left != _FINISHED:  # else finished already (a second call would do nothing)
            self.finish()

    async def astream(
        self, content: AsyncIterator[bytes], length: int | None = None, *, head: bool = False
    ) -> AsyncIterator[bytes]:
        """The async form of :meth:`stream`."""
        left = -1 if length is None else length
        try:
            async for chunk in content:
                self.chunk(chunk)
                if left >= 0:
                    left -= len(chunk)
                    if left <= 0:
                        left = _FINISHED
                        self.finish()
                        if head:
                            yield chunk
                            return
                yield chunk
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            self.faulty = True
            self.finish()
            raise
        if left != _FINISHED:
            self.finish()


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
        user: str | None,
        started: float,
    ) -> Admission:
        """Admit the request (raises :class:`Rejected`) and mark it counted in ``environ``;
        ``started`` is its ``time.perf_counter()`` reading from when naming it began."""
        keeper = self.keeper
        if self._first_request:
            self._first_request = False
            if self.server_is_multiprocess(environ):
                keeper.backend.multiprocess()
        caller = identifier.caller(environ)
        if caller is None:
            config = identifier.config
            if config.caller.required:
                keeper.count_request()
                raise keeper.count_rejection(Rejected("GK-CALLER-MISSING"))
            caller = config.caller.default
        environ[IDENTITY_KEY] = (project, service, caller)
        admission = environ[ADMISSION_KEY] = keeper.admit(
            project, service, caller, environ, user, started
        )
        return admission

    def fault(
        self,
        environ: WSGIEnvironment,
        rejected: Rejected,
        log_environ: Mapping[str, Any] | None = None,
    ) -> tuple[str, list[tuple[str, str]], bytes]:
        """The ServiceFault of a rejection (status line, headers, body), logged on
        ``gatekeeper.rejected``; the request id used is left in ``environ``.

        Rendered and logged by the configuration in force now, not the one the request
        was named by: the admission that refused it may have swapped in a reloaded file
        (SPEC 3), whose fault format and redacted fields the refusal must follow."""
        started = time.perf_counter()
        identifier = self.keeper.identifier
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
        logged = environ if log_environ is None else log_environ
        # The status the client gets: a SOAP fault's is 500 whatever the rejection's.
        status = int(response[0][:3])
        if not log_rejected(logged, rejected, request_id, config, status):
            self.keeper.monitor.rejected_log_dropped += 1
        self.keeper.monitor.stages["reject"].record(time.perf_counter() - started)
        return response
