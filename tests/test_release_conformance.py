"""One release conformance suite over every integration - the bare WSGI middleware, the
Flask extension, Django under WSGI and Django under ASGI: a request's slots come back when
its body is exhausted or closed, whichever is first, or - when neither happens (a test
client, a server dropping a response) - when the response is garbage collected; exactly
once, however the response ends (read whole, closed unread, dropped mid-stream, a stream
that raises, an iterable without ``close()``, a ``close()`` that raises); the app's own
close() runs exactly once; ``count = [...]`` reservations come back; a response that is
not faulty releases at once whatever the delay; on every backend. The adapters' own test
files keep only what is theirs (naming, settings, framework behaviours such as
``exc_info``, ``wsgi.file_wrapper``, async views, a disconnect while the view runs); the
release rules are proven here, once, for all of them.

Each integration is driven as its server drives it: the WSGI ones by a hand-made environ
and the returned iterable, Django's ASGI handler by its ASGI messages, on an event loop
of its own, paused where a slow client would hold it (after the response's start, and
before the last body message is acknowledged), so a test can look at the counts there.

Where the frameworks differ, the integration says so and the test asserts each one's
behaviour: Django closes its response's resources swallowing their errors, turns a view's
exception into a 500 and gives the slot back as soon as a stream raises (its ASGI handler
never closes a response whose stream raised); the bare middleware and Flask hand a
``close()`` error and a raising stream to the server, and release at its ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpResponse, StreamingHttpResponse
from django.urls import path
from flask import Flask, Response
from gatekeeper_wsgi.contrib.django import get_gatekeeper
from gatekeeper_wsgi.contrib.flask import GateKeeper as FlaskGateKeeper
from werkzeug.test import EnvironBuilder

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from tests.conftest import busy
from tests.django_project import configure
from tests.test_django_asgi import DEADLINE, Exchange
from tests.test_middleware import AppError, CloseError, Streaming

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

configure()

pytestmark = [
    # Django consumes a synchronous stream under ASGI, and says so.
    pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume synchronous:Warning"),
    # Django's ASGIHandler leaves its request body file unclosed when a stream raises; it is
    # collected whenever the collector runs next (in this module, under this filter).
    pytest.mark.filterwarnings(
        "ignore:Unclosed file <tempfile.SpooledTemporaryFile:ResourceWarning"
    ),
]

#: The limits every integration runs with: one request at a time on /work, a rate on
#: /status counting only 401s; a delay everywhere, which only a faulty response (none of
#: the suite's, but on /case/) would wait for. /case/<kind>/ holds two requests and has
#: no delay, so a faulty case (a raising stream) is released as any other.
LIMITS = {
    "site": {"delay": 3600},
    "site/work": {"concurrency": 1},
    "site/stream": {"concurrency": 1},
    "site/status": {"rate": "2/hour", "count": [401]},
    "site/case": {"concurrency": 2, "delay": 0},
}
CASE = "site/case"

#: close() calls of the app's streamed bodies, by every integration.
CLOSES: list[str] = []


class Body:
    """A streamed body of three chunks that counts its close() calls in CLOSES."""

    def __iter__(self) -> Iterator[bytes]:
        yield from (b"one ", b"two ", b"three")

    def close(self) -> None:
        CLOSES.append("closed")


class NoClose:
    """An iterable without close()."""

    def __iter__(self) -> Iterator[bytes]:
        yield b"no "
        yield b"close"


class BadClose:
    """An iterable whose close() raises."""

    def __init__(self) -> None:
        self.error = CloseError("close failed")

    def __iter__(self) -> Iterator[bytes]:
        yield b"data"

    def close(self) -> None:
        raise self.error


class Cases:
    """What /case/<kind>/ answers, fresh for every test: ``held`` and ``probe`` (a
    request kept open, one that checks for room), ``list`` (a body of two chunks),
    ``stream`` (a generator that records how far it got and whether it was closed),
    ``fail`` (one that raises after two chunks), ``noclose`` (an iterable without
    ``close()``), ``badclose`` (one whose ``close()`` raises), ``raise`` (the view raises
    before answering)."""

    def __init__(self) -> None:
        self.stream = Streaming()
        self.fail = Streaming(fail_after=2)
        self.badclose = BadClose()
        self.error = AppError("the app failed")

    def body(self, kind: str) -> Iterable[bytes]:
        if kind == "raise":
            raise self.error
        if kind == "list":
            return [b"hello ", b"world"]
        if kind == "stream":
            return self.stream.body()
        if kind == "fail":
            return self.fail.body()
        if kind == "noclose":
            return NoClose()
        if kind == "badclose":
            return self.badclose
        return [b"ok"]

    @staticmethod
    def streamed(kind: str) -> bool:
        return kind in ("stream", "fail", "noclose", "badclose")


CASES = Cases()


# -- the integrations, each serving /work/, /stream/, /status/<code>/ and /case/<kind>/ -----


def bare_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    parts = environ["PATH_INFO"].strip("/").split("/")
    if parts[0] == "case":
        body = CASES.body(parts[1])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return body
    if parts[0] == "stream":
        start_response("200 OK", [])
        return Body()
    if parts[0] == "status":
        start_response(f"{parts[1]} Status", [])
        return [b"status"]
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def bare(backend: str) -> tuple[WSGIApplication, GateKeeper]:
    settings = {"project": "site", "backend": backend, "limits": LIMITS}
    middleware = GateKeeperMiddleware(bare_app, settings)
    return middleware, middleware.gatekeeper


def flask(backend: str = "memory") -> tuple[WSGIApplication, GateKeeper]:
    app = Flask(__name__)
    extension = FlaskGateKeeper(app, {"project": "site", "backend": backend, "limits": LIMITS})

    @app.get("/work/", endpoint="work")
    def work() -> str:
        return "ok"

    @app.get("/stream/", endpoint="stream")
    def stream() -> Response:
        return Response(Body())

    @app.get("/status/<int:code>/", endpoint="status")
    def status(code: int) -> tuple[str, int]:
        return "status", code

    @app.get("/case/<kind>/", endpoint="case")
    def case(kind: str) -> Response:
        return Response(CASES.body(kind))

    return app, extension.gatekeeper_for(app)


def django_status(request: Any, code: int) -> HttpResponse:
    return HttpResponse("status", status=code)


def django_case(request: Any, kind: str) -> HttpResponse | StreamingHttpResponse:
    body = CASES.body(kind)
    if Cases.streamed(kind):
        return StreamingHttpResponse(body)
    return HttpResponse(b"".join(body))


urlpatterns = [
    path("work/", lambda request: HttpResponse("ok"), name="work"),
    path("stream/", lambda request: StreamingHttpResponse(Body()), name="stream"),
    path("status/<int:code>/", django_status, name="status"),
    path("case/<str:kind>/", django_case, name="case"),
]


def django(settings: Any, backend: str = "memory") -> tuple[WSGIApplication, GateKeeper]:
    settings.ROOT_URLCONF = __name__
    settings.GATEKEEPER = {"project": "site", "backend": backend, "limits": LIMITS}
    return WSGIHandler(), get_gatekeeper()


class Served:
    """One WSGI integration as a server sees it."""

    #: the app's exception reaches the server (else the framework answers a 500)
    app_errors_reach_server = True
    #: an exception of the body's close() reaches the server (Django swallows it)
    close_errors_reach_server = True
    #: a response may be read chunk by chunk, dropped unread and left unclosed
    steps = True

    def __init__(self, app: WSGIApplication, keeper: GateKeeper) -> None:
        self.app = app
        self.keeper = keeper
        self.statuses: list[str] = []

    def call(self, path: str) -> Iterable[bytes]:
        """Call the app (the server's first step); the body is not read yet."""
        environ = EnvironBuilder(path=path).get_environ()
        return self.app(environ, lambda status, headers, exc_info=None: self.started(status))

    def started(self, status: str) -> Callable[[bytes], object]:
        self.statuses.append(status)
        return lambda data: None

    def inflight(self) -> dict[str, int]:
        return busy(self.keeper)

    def status(self) -> int:
        return int(self.statuses[-1][:3])

    def finish(self) -> None:
        """Whatever the integration still has running is ended (nothing, for WSGI)."""


class DjangoServed(Served):
    close_errors_reach_server = False
    app_errors_reach_server = False


class FlaskServed(Served):
    app_errors_reach_server = False


class AsgiLoop:
    """An event loop on a thread of its own, where Django's ASGI handler runs while the
    test thread plays the client and looks at the counts."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(DEADLINE)
        self.loop.close()


class PausedExchange(Exchange):
    """An exchange whose client is slow: the handler waits after sending the response's
    start, and again after sending its last body message, until the test lets it on."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        #: set when the handler waits, and when it is done
        self.paused = threading.Event()
        self.go = asyncio.Event()
        self.at_end = False

    async def send(self, message: dict[str, Any]) -> None:
        await super().send(message)
        if message["type"] == "http.response.start" or not message.get("more_body", False):
            self.at_end = message["type"] == "http.response.body"
            self.go.clear()
            self.paused.set()
            await self.go.wait()


class AsgiResponse:
    """One request through Django's ASGI handler, as its server sees it: iterating is the
    client reading the body (to its last message, not yet acknowledged, so Django has
    not closed the response); ``close()`` is the end of the exchange - the client
    acknowledging the end, or disconnecting when it read nothing."""

    def __init__(self, loop: AsgiLoop, path: str) -> None:
        self.loop = loop
        self.exchange = PausedExchange(path)
        self.done = asyncio.run_coroutine_threadsafe(self.exchange.run(), loop.loop)
        self.done.add_done_callback(lambda _: self.exchange.paused.set())
        self._wait()

    def _wait(self) -> None:
        assert self.exchange.paused.wait(DEADLINE), "the ASGI handler is stuck"

    def _resume(self) -> None:
        self.exchange.paused.clear()
        self.loop.loop.call_soon_threadsafe(self.exchange.go.set)
        self._wait()

    def __iter__(self) -> Iterator[bytes]:
        while not self.done.done() and not self.exchange.at_end:
            self._resume()
        if self.done.done():
            self.done.result()  # the handler's exception, as its server would get it
        return iter([m["body"] for m in self.exchange.sent[1:] if m.get("body")])

    def close(self) -> None:
        if self.done.done():
            return
        # Nothing read: the client goes away, and the handler stays where it waits (let
        # on, it would stream the body meanwhile). Else it acknowledges the end.
        waiting = self.exchange.disconnect if not self.exchange.at_end else self.exchange.go
        self.loop.loop.call_soon_threadsafe(waiting.set)
        self.done.result(DEADLINE)


class AsgiServed(DjangoServed):
    """Django under its ASGI handler: the handler reads the body and closes the response
    itself, so nothing is ever dropped unclosed, nor read chunk by chunk."""

    steps = False

    def __init__(self, keeper: GateKeeper, loop: AsgiLoop) -> None:
        super().__init__(WSGIHandler(), keeper)
        self.loop = loop
        self.responses: list[AsgiResponse] = []

    def call(self, path: str) -> Iterable[bytes]:
        response = AsgiResponse(self.loop, path)
        self.responses.append(response)
        self.statuses.append(f"{response.exchange.status} ASGI")
        return response

    def finish(self) -> None:
        for response in self.responses:
            # A response whose stream raised: the test has seen its exception already.
            with contextlib.suppress(Exception):
                response.close()


@pytest.fixture(scope="module")
def asgi_loop() -> Iterator[AsgiLoop]:
    loop = AsgiLoop()
    yield loop
    loop.stop()


def serve(name: str, settings: Any, backend: str, request: pytest.FixtureRequest) -> Served:
    if name == "bare WSGI":
        return Served(*bare(backend))
    if name == "Flask":
        return FlaskServed(*flask(backend))
    app, keeper = django(settings, backend)
    if name == "Django WSGI":
        return DjangoServed(app, keeper)
    return AsgiServed(keeper, request.getfixturevalue("asgi_loop"))


WSGI = ["bare WSGI", "Flask", "Django WSGI"]
ALL = [*WSGI, "Django ASGI"]


@contextmanager
def serving(served: Served) -> Iterator[Served]:
    CLOSES.clear()
    global CASES
    CASES = Cases()
    try:
        yield served
    finally:
        served.finish()
    gc.collect()
    assert busy(served.keeper) == {}, "a slot leaked"


@pytest.fixture(params=ALL)
def served(request: pytest.FixtureRequest, settings: Any) -> Iterator[Served]:
    """Each integration on the memory backend."""
    with serving(serve(request.param, settings, "memory", request)) as served:
        yield served


@pytest.fixture(params=WSGI)
def wsgi_served(request: pytest.FixtureRequest, settings: Any) -> Iterator[Served]:
    """Each WSGI integration on the memory backend: its responses may be read chunk by
    chunk, and dropped unread."""
    with serving(serve(request.param, settings, "memory", request)) as served:
        yield served


@pytest.fixture(params=ALL)
def served_on(request: pytest.FixtureRequest, settings: Any, backend_url: str) -> Iterator[Served]:
    """Each integration on each backend."""
    with serving(serve(request.param, settings, backend_url, request)) as served:
        yield served


def read(result: Iterable[bytes]) -> bytes:
    return b"".join(result)


def close(result: Iterable[bytes]) -> None:
    """Close a response as a server does: if it has a close() (a refusal may be a list)."""
    closer = getattr(result, "close", None)
    if closer is not None:
        closer()


def fetch(served: Served, path: str) -> int:
    """One complete request, read and closed: its status."""
    result = served.call(path)
    try:
        read(result)
    finally:
        close(result)
    return served.status()


@contextmanager
def another_request_in_flight(served: Served) -> Iterator[None]:
    """Runs the block while a second request on the /case/ limit stays open, so a double
    release would show as its slot disappearing; afterwards every count is zero."""
    held = served.call("/case/held/")  # called, not yet read
    assert served.inflight() == {CASE: 1}
    try:
        yield
    finally:
        close(held)
    assert served.inflight() == {}


def assert_holding(served: Served) -> None:
    """Both slots are taken: a third request is turned away."""
    assert served.inflight() == {CASE: 2}
    assert fetch(served, "/case/probe/") == 503


def assert_released_once(served: Served) -> None:
    """Only the other request's slot is left; a third request fits again."""
    assert served.inflight() == {CASE: 1}
    assert fetch(served, "/case/probe/") == 200
    assert served.inflight() == {CASE: 1}


# -- the suite ------------------------------------------------------------------------------


def test_a_body_read_to_its_end_is_released_before_close(served: Served) -> None:
    """Unread, a response holds its slot (a second request is refused); read to its end it
    has given the slot back although close() is still due; the close() that follows frees
    nothing more."""
    for route, body in (("/work/", b"ok"), ("/stream/", b"one two three")):
        result = served.call(route)
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        read(served.call(route))  # a refusal: a ServiceFault, holding nothing
        assert served.status() == 503
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        assert read(result) == body
        assert served.inflight() == {}
        second = served.call(route)  # fits while the first is not closed yet
        assert served.status() == 200
        close(result)
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        close(second)
        assert served.inflight() == {}


def test_a_response_dropped_unread_and_unclosed_is_released_when_collected(
    wsgi_served: Served,
) -> None:
    """A response neither read nor closed (a test client, a dropped response) gives its
    slot back when it is garbage collected - once: a second request fits, a third not."""
    served = wsgi_served
    result = served.call("/work/")
    assert served.inflight() == {"site/work": 1}
    del result
    gc.collect()
    assert served.inflight() == {}
    held = served.call("/work/")
    assert served.status() == 200
    served.call("/work/")
    assert served.status() == 503
    close(held)


def test_a_response_closed_unread_is_released_once(served: Served) -> None:
    """A response the server closes without reading it (a HEAD, a client gone before the
    body) gives its slot back at that close(), once: a second close() frees nothing more."""
    for route in ("/work/", "/stream/"):
        result = served.call(route)
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        close(result)
        assert served.inflight() == {}
        held = served.call(route)
        assert served.status() == 200
        if route == "/work/":  # a stream's second close() would close the app's twice
            close(result)
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        close(held)
        assert served.inflight() == {}
    assert CLOSES == ["closed", "closed"]


def test_a_healthy_response_releases_at_once_whatever_the_delay(served: Served) -> None:
    """2xx and 4xx responses are not faulty: under a limit with a delay they give their
    slots back as soon as they are finished, and no delayed release is pending."""
    for route, status in (("/status/404/", 404), ("/work/", 200), ("/status/200/", 200)):
        read(served.call(route))
        assert served.status() == status
    assert served.inflight() == {}
    assert served.keeper.stats()["counters"]["delayed_pending"] == 0


def test_a_stream_dropped_mid_way_then_closed_closes_the_app_once(wsgi_served: Served) -> None:
    """A client gone mid-stream: the server drops its iterator, then closes the response.
    The app's close() runs exactly once, and the slot comes back once."""
    served = wsgi_served
    result = served.call("/stream/")
    iterator = iter(result)
    assert next(iterator)
    del iterator
    gc.collect()
    assert CLOSES == []
    close(result)
    assert CLOSES == ["closed"]
    assert served.inflight() == {}
    del result
    gc.collect()
    assert CLOSES == ["closed"]


def test_uncounted_statuses_give_their_reservation_back_without_close(
    wsgi_served: Served,
) -> None:
    """A rate counting only 401s: 200 responses never closed give their place back (read
    or only dropped), so ten of them all pass; then two 401s use the rate up."""
    served = wsgi_served
    for index in range(10):
        result = served.call("/status/200/")
        assert served.status() == 200
        if index % 2:
            read(result)
        del result
        gc.collect()
    for _ in range(2):
        read(served.call("/status/401/"))
        assert served.status() == 401
    served.call("/status/200/")
    assert served.status() == 429


# -- every way a response ends frees its slot once (moved from test_middleware) -------------


def test_a_list_body_is_released_on_close_once(served: Served) -> None:
    """A list body holds its slot until it is read or closed, and frees only its own, once."""
    with another_request_in_flight(served):
        result = served.call("/case/list/")
        assert_holding(served)
        assert read(result) == b"hello world"
        close(result)
        assert_released_once(served)
        close(result)
        assert_released_once(served)


def test_a_streamed_generator_is_released_on_exhaustion_once(wsgi_served: Served) -> None:
    """A streamed body holds its slot while it streams; read to its end it frees it (SPEC
    §4.2: exhausted or closed, whichever first), and the later close frees nothing more."""
    served = wsgi_served
    with another_request_in_flight(served):
        result = served.call("/case/stream/")
        chunks = iter(result)
        assert next(chunks) == b"one "
        assert CASES.stream.produced == 1
        assert_holding(served)
        assert b"".join(chunks) == b"two three"
        assert_released_once(served)
        close(result)
        assert CASES.stream.finished
        assert_released_once(served)


def test_a_client_gone_mid_stream_releases_once(wsgi_served: Served) -> None:
    """A client that leaves mid-stream (the server closes early) frees the slot and closes
    the generator, which produced nothing more."""
    served = wsgi_served
    with another_request_in_flight(served):
        result = served.call("/case/stream/")
        assert next(iter(result)) == b"one "
        assert CASES.stream.produced == 1
        close(result)
        assert CASES.stream.finished
        assert CASES.stream.produced == 1
        assert_released_once(served)


def test_a_stream_raising_mid_way_releases_once(served: Served) -> None:
    """A generator that raises mid-stream hands its very exception to the server; the slot
    comes back once, at the raise - whether or not anything closes the response then (a
    framework that never closes a response whose stream raised, Django; a test client
    whose reader raised, Flask's without `with`) - and a close frees nothing more."""
    with another_request_in_flight(served):
        result = served.call("/case/fail/")
        assert_holding(served)
        with pytest.raises(AppError) as raised:
            read(result)
        assert raised.value is CASES.fail.error
        assert_released_once(served)
        close(result)
        assert_released_once(served)
        close(result)
        assert_released_once(served)


def test_a_response_closed_without_iteration_releases_once(served: Served) -> None:
    """A streamed response the server closes without reading it (a HEAD, a client gone)
    frees its slot; the generator never ran; a second close frees nothing more."""
    with another_request_in_flight(served):
        result = served.call("/case/stream/")
        assert_holding(served)
        close(result)
        assert CASES.stream.produced == 0
        assert_released_once(served)
        close(result)
        assert_released_once(served)


def test_an_iterable_without_close_releases_once(served: Served) -> None:
    """An iterable without close() is still released when the server closes the response."""
    with another_request_in_flight(served):
        result = served.call("/case/noclose/")
        assert_holding(served)
        assert read(result) == b"no close"
        close(result)
        assert_released_once(served)


def test_an_inner_close_raising_still_releases_once(served: Served) -> None:
    """An inner close() that raises still frees the slot; its exception reaches the server
    (Django, which closes a response's resources swallowing their errors, drops it)."""
    with another_request_in_flight(served):
        # Closed unread (a client gone), so it is close() that must release.
        result = served.call("/case/badclose/")
        assert_holding(served)
        if served.close_errors_reach_server:
            with pytest.raises(CloseError) as raised:
                close(result)
            assert raised.value is CASES.badclose.error
        else:
            close(result)
        assert_released_once(served)
        if served.close_errors_reach_server:
            with pytest.raises(CloseError):
                fetch(served, "/case/badclose/")
        else:
            assert fetch(served, "/case/badclose/") == 200
        assert_released_once(served)


def test_every_way_a_response_ends_frees_its_slot_once_on_every_backend(
    served_on: Served,
) -> None:
    """Every way a response can end - closed twice, read whole, a stream that raises, a
    view that raises, closed unread - frees its slot once, on every backend."""
    served = served_on
    with another_request_in_flight(served):
        for route in ("/case/list/", "/case/stream/"):
            result = served.call(route)
            assert_holding(served)
            close(result)
            close(result)
            assert_released_once(served)
        for route in ("/case/fail/", "/case/raise/"):
            if served.app_errors_reach_server or route == "/case/fail/":
                with pytest.raises(AppError):
                    fetch(served, route)
            else:  # the framework answers a 500 for the view's exception
                assert fetch(served, route) == 500
            assert_released_once(served)
        result = served.call("/case/stream/")
        close(result)
        assert_released_once(served)


# -- Django under ASGI: the handler reads and closes itself ---------------------------------


def asgi_get(path: str) -> tuple[int, bytes]:
    """One request through Django's ASGI handler: (status, body)."""
    exchange = Exchange(path)
    asyncio.run(exchange.run())
    return exchange.status, exchange.body


# Django consumes a synchronous stream under ASGI, and says so.
@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume synchronous:Warning")
def test_django_asgi_releases_every_kind_of_response(settings: Any) -> None:
    """Under ASGI, sequential requests at concurrency 1 all pass (plain and streamed),
    the app's close() runs once per stream, and uncounted statuses give their place back."""
    CLOSES.clear()
    django(settings)
    assert [asgi_get("/work/")[0] for _ in range(5)] == [200] * 5
    assert [asgi_get("/stream/") for _ in range(3)] == [(200, b"one two three")] * 3
    assert CLOSES == ["closed"] * 3
    assert [asgi_get("/status/200/")[0] for _ in range(5)] == [200] * 5
    assert [asgi_get("/status/401/")[0] for _ in range(3)] == [401, 401, 429]
    assert busy(get_gatekeeper()) == {}


# -- the Flask test client, used as Flask's docs show ---------------------------------------


def test_flask_test_client_without_with_admits_every_request() -> None:
    """`client.get(...)` without `with` never closes its response: at concurrency 1 every
    request still passes (the issue's `[200, 503, 503]`), and count reservations return."""
    app, keeper = flask()
    client = app.test_client()
    assert [client.get("/work/").status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/stream/").status_code for _ in range(3)] == [200, 200, 200]
    assert [client.get("/status/200/").status_code for _ in range(5)] == [200] * 5
    assert busy(keeper) == {}
