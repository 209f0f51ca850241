"""One release conformance suite over every integration - the bare WSGI middleware, the
Flask extension, Django under WSGI and Django under ASGI: a request's slots come back when
its body is exhausted or closed, whichever is first, or - when neither happens (a test
client, a server dropping a response) - when the response is garbage collected; exactly
once; the app's own close() runs exactly once; ``count = [...]`` reservations come back;
a response that is not faulty releases at once whatever the delay. The adapters' own test
files keep only what is theirs (naming, settings, framework behaviours); the release rules
are proven here, once, for all of them.

Each integration is driven as its server drives it: the WSGI ones by a hand-made environ
and the returned iterable, Django's ASGI handler by its ASGI messages.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterable, Iterator
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
from tests.test_django_asgi import Exchange

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

configure()

#: The limits every integration runs with: one request at a time on /work, a rate on
#: /status counting only 401s; a delay everywhere, which only a faulty response (none of
#: the suite's) would wait for.
LIMITS = {
    "site": {"delay": 3600},
    "site/work": {"concurrency": 1},
    "site/stream": {"concurrency": 1},
    "site/status": {"rate": "2/hour", "count": [401]},
}

#: close() calls of the app's streamed bodies, by every integration.
CLOSES: list[str] = []


class Body:
    """A streamed body of three chunks that counts its close() calls in CLOSES."""

    def __iter__(self) -> Iterator[bytes]:
        yield from (b"one ", b"two ", b"three")

    def close(self) -> None:
        CLOSES.append("closed")


# -- the integrations, each serving /work/, /stream/ and /status/<code>/ --------------------


def bare_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    parts = environ["PATH_INFO"].strip("/").split("/")
    if parts[0] == "stream":
        start_response("200 OK", [])
        return Body()
    if parts[0] == "status":
        start_response(f"{parts[1]} Status", [])
        return [b"status"]
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def bare() -> tuple[WSGIApplication, GateKeeper]:
    middleware = GateKeeperMiddleware(bare_app, {"project": "site", "limits": LIMITS})
    return middleware, middleware.gatekeeper


def flask() -> tuple[WSGIApplication, GateKeeper]:
    app = Flask(__name__)
    extension = FlaskGateKeeper(app, {"project": "site", "limits": LIMITS})

    @app.get("/work/", endpoint="work")
    def work() -> str:
        return "ok"

    @app.get("/stream/", endpoint="stream")
    def stream() -> Response:
        return Response(Body())

    @app.get("/status/<int:code>/", endpoint="status")
    def status(code: int) -> tuple[str, int]:
        return "status", code

    return app, extension.gatekeeper_for(app)


def django_status(request: Any, code: int) -> HttpResponse:
    return HttpResponse("status", status=code)


urlpatterns = [
    path("work/", lambda request: HttpResponse("ok"), name="work"),
    path("stream/", lambda request: StreamingHttpResponse(Body()), name="stream"),
    path("status/<int:code>/", django_status, name="status"),
]


def django(settings: Any) -> tuple[WSGIApplication, GateKeeper]:
    settings.ROOT_URLCONF = __name__
    settings.GATEKEEPER = {"project": "site", "limits": LIMITS}
    return WSGIHandler(), get_gatekeeper()


INTEGRATIONS: dict[str, Callable[..., tuple[WSGIApplication, GateKeeper]]] = {
    "bare WSGI": lambda settings: bare(),
    "Flask": lambda settings: flask(),
    "Django WSGI": django,
}


@pytest.fixture(params=list(INTEGRATIONS))
def served(request: pytest.FixtureRequest, settings: Any) -> Iterator[Served]:
    CLOSES.clear()
    app, keeper = INTEGRATIONS[request.param](settings)
    yield Served(app, keeper)
    gc.collect()
    assert busy(keeper) == {}, "a slot leaked"


class Served:
    """One integration as a WSGI server sees it."""

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


def read(result: Iterable[bytes]) -> bytes:
    return b"".join(result)


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
        getattr(result, "close")()  # noqa: B009 - every integration's result has one
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        getattr(second, "close")()  # noqa: B009
        assert served.inflight() == {}


def test_a_response_dropped_unread_and_unclosed_is_released_when_collected(
    served: Served,
) -> None:
    """A response neither read nor closed (a test client, a dropped response) gives its
    slot back when it is garbage collected - once: a second request fits, a third not."""
    result = served.call("/work/")
    assert served.inflight() == {"site/work": 1}
    del result
    gc.collect()
    assert served.inflight() == {}
    held = served.call("/work/")
    assert served.status() == 200
    served.call("/work/")
    assert served.status() == 503
    getattr(held, "close")()  # noqa: B009


def test_a_response_closed_unread_is_released_once(served: Served) -> None:
    """A response the server closes without reading it (a HEAD, a client gone before the
    body) gives its slot back at that close(), once: a second close() frees nothing more."""
    for route in ("/work/", "/stream/"):
        result = served.call(route)
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        getattr(result, "close")()  # noqa: B009
        assert served.inflight() == {}
        held = served.call(route)
        assert served.status() == 200
        if route == "/work/":  # a stream's second close() would close the app's twice
            getattr(result, "close")()  # noqa: B009
        assert served.inflight() == {f"site{route.rstrip('/')}": 1}
        getattr(held, "close")()  # noqa: B009
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


def test_a_stream_dropped_mid_way_then_closed_closes_the_app_once(served: Served) -> None:
    """A client gone mid-stream: the server drops its iterator, then closes the response.
    The app's close() runs exactly once, and the slot comes back once."""
    result = served.call("/stream/")
    iterator = iter(result)
    assert next(iterator)
    del iterator
    gc.collect()
    assert CLOSES == []
    getattr(result, "close")()  # noqa: B009
    assert CLOSES == ["closed"]
    assert served.inflight() == {}
    del result
    gc.collect()
    assert CLOSES == ["closed"]


def test_uncounted_statuses_give_their_reservation_back_without_close(served: Served) -> None:
    """A rate counting only 401s: 200 responses never closed give their place back (read
    or only dropped), so ten of them all pass; then two 401s use the rate up."""
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
