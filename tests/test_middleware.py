"""GateKeeperMiddleware around plain WSGI apps: who is calling what, slots released exactly
once in the cases only the WSGI protocol has (an app raising around ``start_response``,
``exc_info``, ``wsgi.file_wrapper``; the rules every integration shares are proven in
``test_release_conformance.py``), faulty responses holding their slots for ``delay``, and
the ServiceFault a rejected client receives (SPEC §1, §4, §5).

Requests go through ``werkzeug.test.Client``; its unbuffered responses are closed by the
tests, as a real server closes them. Where the Client does not behave like a PEP 3333 server
(it re-raises any ``exc_info`` given to ``start_response`` and always reads the first chunk),
:func:`serve` plays the server.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from xml.etree.ElementTree import Element

import pytest
from defusedxml.ElementTree import fromstring
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from werkzeug.test import Client, EnvironBuilder, TestResponse, create_environ
from werkzeug.wsgi import FileWrapper

from gatekeeper_wsgi import (
    ConfigError,
    GateKeeper,
    GateKeeperMiddleware,
    Rejected,
    rejectlog,
)
from gatekeeper_wsgi.errors import FAULT_CODES
from gatekeeper_wsgi.resolve import MEMO_SIZE
from tests.conftest import FakeClock, busy
from tests.servers import free_port, wait_until

if TYPE_CHECKING:
    from collections.abc import Sequence

    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

NS = "{urn:gatekeeper-wsgi:fault:1}"
SOAP11 = "{http://schemas.xmlsoap.org/soap/envelope/}"
SOAP12 = "{http://www.w3.org/2003/05/soap-envelope}"
PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")
GENERATED_ID = re.compile(r"[0-9a-f]+-[0-9a-f]+")
JUNK = [
    "<&\"'>",
    "</requestId><evil/>]]>",
    "a\x00b\x07c\x1bd\x7fe",
    "line\r\nX-Injected: 1",
    "\u00e9\u00ff latin-1",
    "<&\"'\x01" * 2048,  # 10 KB of junk
]


class AppError(Exception):
    """The app's own exception; it must reach the server unchanged."""


# -- helpers --------------------------------------------------------------------------------


@pytest.fixture
def make(clock: FakeClock) -> Iterator[Callable[..., GateKeeperMiddleware]]:
    """Wrap an app in a middleware whose GateKeeper runs on the test's fake clock."""
    keepers: list[GateKeeper] = []

    def make(app: WSGIApplication, config: dict[str, Any]) -> GateKeeperMiddleware:
        keeper = GateKeeper(config, clock=clock)
        keepers.append(keeper)
        return GateKeeperMiddleware(app, keeper)

    yield make
    for keeper in keepers:
        keeper.close()


Refusing = Callable[..., GateKeeperMiddleware]


@pytest.fixture
def refusing(make: Callable[..., GateKeeperMiddleware]) -> Refusing:
    """Wraps ``ok_app`` in a middleware with these settings that turns every request of the
    project away (concurrency 0), so each answer is a fault."""

    def build(**settings: Any) -> GateKeeperMiddleware:
        return make(ok_app, {"project": "shop", **settings, "limits": {"shop": {"concurrency": 0}}})

    return build


def fetch(app: WSGIApplication, path: str = "/", **kwargs: Any) -> TestResponse:
    """One complete request, read and closed as a server would."""
    return Client(app).get(path, buffered=True, **kwargs)


def start(app: WSGIApplication, path: str = "/", **kwargs: Any) -> TestResponse:
    """A request whose response stays open (first chunk read) until the test closes it."""
    return Client(app).get(path, buffered=False, **kwargs)


def all_zero(gk: GateKeeper) -> bool:
    counts = gk.inflight().values()
    assert all(count >= 0 for count in counts), gk.inflight()
    return not any(counts)


def header(headers: Iterable[tuple[str, str]], name: str) -> str | None:
    values = [value for key, value in headers if key.lower() == name.lower()]
    assert len(values) <= 1, f"{name} sent {len(values)} times"
    return values[0] if values else None


class StartResponseRecorder:
    """A PEP 3333 ``start_response``: ``exc_info`` may replace the status and headers until
    the first body byte is sent; after that it re-raises, as a server must."""

    def __init__(self) -> None:
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.sent = False
        self.calls = 0

    def __call__(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        self.calls += 1
        if exc_info is not None:
            try:
                if self.sent:
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self.status is not None:
            raise AssertionError("start_response called twice without exc_info")
        self.status, self.headers = status, list(headers)
        return lambda data: None


def environ_for(path: str = "/", **kwargs: Any) -> WSGIEnvironment:
    return EnvironBuilder(path=path, **kwargs).get_environ()


def serve(
    app: WSGIApplication, path: str = "/", **kwargs: Any
) -> tuple[Iterable[bytes], StartResponseRecorder]:
    """Call the app as a server does, without reading the body yet."""
    recorder = StartResponseRecorder()
    return app(environ_for(path, **kwargs), recorder), recorder


def run(app: WSGIApplication, environ: WSGIEnvironment) -> tuple[StartResponseRecorder, bytes]:
    """One complete request on a hand-made environ: called, read and closed."""
    recorder = StartResponseRecorder()
    result = app(environ, recorder)
    try:
        return recorder, drain(result, recorder)
    finally:
        getattr(result, "close", lambda: None)()


def drain(result: Iterable[bytes], recorder: StartResponseRecorder) -> bytes:
    body = b""
    for chunk in result:
        if chunk:
            recorder.sent = True
        body += chunk
    return body


def follows_engine_clock(gk: GateKeeper) -> bool:
    """Whether the backend counts time by the engine's (fake) clock; Redis keeps its own
    (``TIME``), so its windows and delays pass in real time."""
    return not gk.config.backend.startswith(("redis", "rediss", "unix", "valkey"))


def after(seconds: float, clock: FakeClock, gk: GateKeeper, check: Callable[[], bool]) -> None:
    """Let ``seconds`` pass for the backend and wait for ``check``: the fake clock moves at
    once; a backend that keeps its own time (Redis ``TIME``) is polled up to a deadline."""
    clock.advance(seconds)
    if follows_engine_clock(gk):
        assert check(), f"not true {seconds}s later: inflight {gk.inflight()}"
    else:
        wait_until(check, seconds + 10.0, f"true {seconds}s later")


# -- tiny apps ------------------------------------------------------------------------------


def ok_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello ", b"world"]


class Seen:
    """An app that remembers the environ of its last call."""

    def __init__(self) -> None:
        self.environ: WSGIEnvironment | None = None
        self.calls = 0

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        self.environ = environ
        self.calls += 1
        return ok_app(environ, start_response)

    @property
    def identity(self) -> tuple[str, str, str]:
        assert self.environ is not None
        return self.environ["gatekeeper.identity"]  # type: ignore[no-any-return]


class Streaming:
    """A generator app that records how far it got and whether it was closed."""

    def __init__(
        self,
        chunks: Sequence[bytes] = (b"one ", b"two ", b"three"),
        *,
        status: str = "200 OK",
        headers: Sequence[tuple[str, str]] = (),
        fail_after: int | None = None,
    ) -> None:
        self.chunks = chunks
        self.status = status
        self.headers = list(headers)
        self.fail_after = fail_after
        self.produced = 0
        self.finished = False
        self.error = AppError("backend failed mid-stream")

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] in ("/held", "/probe"):
            return ok_app(environ, start_response)
        start_response(self.status, [("Content-Type", "text/plain"), *self.headers])
        return self.body()

    def body(self) -> Iterator[bytes]:
        try:
            for index, chunk in enumerate(self.chunks):
                if index == self.fail_after:
                    raise self.error
                self.produced += 1
                yield chunk
        finally:
            self.finished = True


HOLD = {"project": "shop", "limits": {"shop": {"concurrency": 2}}}


@contextmanager
def another_request_in_flight(mw: GateKeeperMiddleware) -> Iterator[GateKeeperMiddleware]:
    """Runs the block with ``mw`` while a second request on the same limit stays open, so a
    double release would show as its slot disappearing; afterwards every count is zero."""
    # Called, not yet read: a body handed out whole would already be released.
    held, _ = serve(mw, "/held")
    assert busy(mw.gatekeeper) == {"shop": 1}
    try:
        yield mw
    finally:
        held.close()  # type: ignore[attr-defined]
    assert all_zero(mw.gatekeeper)


def assert_holding(mw: GateKeeperMiddleware) -> None:
    """Both slots are taken: a third request is turned away."""
    assert busy(mw.gatekeeper) == {"shop": 2}
    assert fetch(mw, "/probe").status_code == 503


def assert_released_once(mw: GateKeeperMiddleware) -> None:
    """Only the other request's slot is left; a third request fits again."""
    assert busy(mw.gatekeeper) == {"shop": 1}
    assert fetch(mw, "/probe").status_code == 200
    assert busy(mw.gatekeeper) == {"shop": 1}


# -- 1. identification ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "service"),
    [
        ("/orders/42", "orders"),
        ("/orders", "orders"),
        ("/orders/", "orders"),
        ("/", "root"),
        ("", "root"),
        ("//x/y", "x"),
    ],
)
def test_service_is_the_first_path_segment(make: Any, path: str, service: str) -> None:
    """Without a routes table a request's service is its first path segment, `/` is `root`."""
    app = Seen()
    mw = make(app, {"project": "shop"})
    environ = environ_for()
    environ["PATH_INFO"] = path
    recorder, _ = run(mw, environ)
    assert recorder.status == "200 OK"
    assert app.identity == ("shop", service, "anonymous")


def test_project_defaults_to_default(make: Any) -> None:
    """Without a `project` setting requests belong to the project `default`."""
    app = Seen()
    mw = make(app, {"limits": {"default/api": {"concurrency": 1}}})
    held = start(mw, "/api/x")
    assert app.identity == ("default", "api", "anonymous")
    assert busy(mw.gatekeeper) == {"default/api": 1}
    held.close()
    assert all_zero(mw.gatekeeper)


def test_routes_table_names_services_by_werkzeug_rules(make: Any) -> None:
    """A `routes` rule names the service; paths no rule matches fall back to the first segment."""
    app = Seen()
    mw = make(
        app,
        {
            "project": "shop",
            "routes": {"/orders/<int:id>": "order", "/orders/<int:id>/items": "items"},
            "limits": {"shop/order": {"concurrency": 1}},
        },
    )
    fetch(mw, "/orders/7")
    assert app.identity[1] == "order"
    fetch(mw, "/orders/7/items")
    assert app.identity[1] == "items"
    fetch(mw, "/orders/seven")
    assert app.identity[1] == "orders"
    held = start(mw, "/orders/1")
    assert fetch(mw, "/orders/2").status_code == 503
    assert fetch(mw, "/orders/x").status_code == 200
    held.close()
    assert all_zero(mw.gatekeeper)


def test_a_routes_rule_with_non_ascii_text_matches_as_in_werkzeug(make: Any) -> None:
    """A rule of non-ASCII text matches the path werkzeug would match it on (PEP 3333's
    latin-1 string decoded as UTF-8), also under a mount: its limit applies."""
    app = Seen()
    mw = make(
        app,
        {
            "project": "shop",
            "routes": {"/café/<int:id>": "cafe"},
            "limits": {"shop/cafe": {"concurrency": 1}},
        },
    )
    fetch(mw, "/caf%C3%A9/1")
    assert app.identity[1] == "cafe"
    held = start(mw, "/caf%C3%A9/2")
    assert fetch(mw, "/caf%C3%A9/3").status_code == 503
    held.close()
    assert all_zero(mw.gatekeeper)


def test_a_refused_head_request_gets_the_headers_and_no_content(make: Any) -> None:
    """RFC 9110: a HEAD answer has no content, even a fault's; it keeps the fault's status
    and headers (a server that sent the body would desync a kept-alive connection)."""
    mw = make(Seen(), {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    seen: list[Any] = []
    for method in ("HEAD", "GET"):
        environ = EnvironBuilder(path="/x", method=method).get_environ()
        body = b"".join(mw(environ, lambda status, headers, *_: seen.append((status, headers))))
        assert seen[-1][0].startswith("503")
        assert header(seen[-1][1], "Retry-After") is not None
        assert (body == b"") == (method == "HEAD")
    assert all_zero(mw.gatekeeper)


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_empty_chunks_before_start_response_do_not_end_the_response(
    make: Any, clock: FakeClock, method: str
) -> None:
    """PEP 3333 lets an app hand out empty chunks before it calls start_response. A HEAD
    response (released at its first piece) is not released before its status is known:
    a 504 is held for its delay and a counted 401 counts, as for a GET."""

    def app(environ: Any, start_response: Any) -> Iterator[bytes]:
        yield b""
        status = "504 Gateway Timeout" if environ["PATH_INFO"] == "/slow" else "401 No"
        start_response(status, [("Content-Length", "4")])
        yield b"body"

    mw = make(
        app,
        {
            "project": "shop",
            "limits": {
                "shop/slow": {"concurrency": 5, "delay": 2},
                "shop/login/*": {"rate": "2/minute", "key": "ip", "count": [401]},
            },
        },
    )
    client = Client(mw)
    assert client.open("/slow", method=method, buffered=True).status_code == 504
    assert busy(mw.gatekeeper) == {"shop/slow": 1}  # held for the delay
    clock.advance(2.5)
    assert busy(mw.gatekeeper) == {}
    codes = [client.open("/login", method=method, buffered=True).status_code for _ in range(4)]
    assert codes == [401, 401, 429, 429]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_head_body_ends_with_its_first_piece(make: Any, method: str) -> None:
    """A HEAD's body, which the server drops, ends with its first piece: the app's
    generator makes no more (closed with the response), so no work runs outside the
    limit its released slot no longer counts - else HEAD requests would get around any
    concurrency limit on a streamed export. A GET's body is made whole."""
    made: list[int] = []
    closed: list[bool] = []

    def export(environ: Any, start_response: Any) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/csv")])
        try:
            for row in range(20):
                made.append(row)
                yield b"row %d\n" % row
        finally:
            closed.append(True)

    mw = make(export, {"project": "shop", "limits": {"shop/export": {"concurrency": 1}}})
    environ = {**create_environ("/export"), "REQUEST_METHOD": method}
    response = mw(environ, lambda status, headers, exc_info=None: None)
    pieces = list(response)  # as a server iterates it, dropping a HEAD's body
    assert busy(mw.gatekeeper) == {}
    response.close()
    assert closed == [True]
    assert len(made) == (1 if method == "HEAD" else 20)
    assert len(pieces) == len(made)


def test_a_status_the_app_started_and_raised_after_is_not_counted(make: Any) -> None:
    """An app that calls start_response("401 ...") and then raises sends no 401: the
    server answers 500, and a limit counting 401s does not count it."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("401 Unauthorized", [])
        raise RuntimeError("after start_response")

    mw = make(
        app,
        {"project": "shop", "limits": {"shop/login/*": {"rate": "2/minute", "count": [401]}}},
    )
    for _ in range(4):
        with pytest.raises(RuntimeError):
            fetch(mw, "/login")
    assert busy(mw.gatekeeper) == {}


def test_hostile_first_segment_is_digested_not_echoed(make: Any) -> None:
    """A path segment that is not a plain name is counted under a digest, never verbatim."""
    app = Seen()
    mw = make(app, {"project": "shop"})
    fetch(mw, "/<script>alert(1)</script>/x")
    service = app.identity[1]
    assert service.startswith("~")
    assert re.fullmatch(r"~[0-9a-f]{16}", service)


def test_naming_memos_stay_bounded_under_a_spray(make: Any) -> None:
    """Service names and caller checks are memoized per path and header value; a spray of
    new paths and callers keeps those memos bounded and every answer right."""
    mw = make(Seen(), {"project": "shop"})
    identifier = mw.gate.identifier()
    for n in range(MEMO_SIZE + 100):
        assert identifier.service({"PATH_INFO": f"/s{n}/x"}) == f"s{n}"
        assert identifier.caller({"HTTP_X_CALLER_ID": f"c{n}"}) == f"c{n}"
        assert identifier.caller({"HTTP_X_CALLER_ID": f"c {n}"}) is None
        assert len(identifier._services) <= MEMO_SIZE
        assert len(identifier._callers) <= MEMO_SIZE
    assert identifier.service({"PATH_INFO": "/<b>/x"}).startswith("~")


def test_a_head_answered_by_write_is_released_before_its_headers_go_out(make: Any) -> None:
    """A HEAD whose app answers through write(): the first write sends the headers, the
    whole answer, so the slot comes back before it, as before a HEAD body's first piece
    (SPEC 4.2: the client's next request never meets its own previous one)."""
    seen: list[dict[str, int]] = []

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        write = start_response("200 OK", [("Content-Length", "10")])
        seen.append(busy(environ["gatekeeper.test.keeper"]))
        write(b"hello")  # the first half of the body
        seen.append(busy(environ["gatekeeper.test.keeper"]))  # the app still runs
        return [b"world"]

    mw = make(app, {"project": "shop", "limits": {"shop": {"concurrency": 1}}})
    for method in ("HEAD", "GET"):
        environ = EnvironBuilder(path="/x", method=method).get_environ()
        environ["gatekeeper.test.keeper"] = mw.gatekeeper
        response = mw(environ, lambda status, headers, *_: lambda data: None)
        list(response)
        getattr(response, "close", lambda: None)()
    # HEAD: held until its first write, then free while the app goes on; GET: held until
    # the rest of its body is handed out.
    assert seen == [{"shop": 1}, {}, {"shop": 1}, {"shop": 1}]
    assert busy(mw.gatekeeper) == {}


def test_a_client_gone_during_write_is_not_a_faulty_response(make: Any) -> None:
    """The server's write() fails because the client went away, and the app lets the
    error through: the slot comes back at once, as when a client leaves a streamed body -
    the backend did not fail, so no delay holds it."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        write(b"part one")
        return [b"part two"]

    def gone(data: bytes) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    mw = make(app, {"project": "shop", "limits": {"shop": {"concurrency": 1, "delay": 30.0}}})
    with pytest.raises(BrokenPipeError):
        mw(environ_for("/x"), lambda status, headers, *_: gone)
    assert busy(mw.gatekeeper) == {}
    assert mw.gatekeeper.stats()["counters"]["delayed_pending"] == 0


@pytest.mark.parametrize("start_first", [True, False], ids=["started", "not started"])
def test_a_generator_raising_before_its_body_counts_as_the_500_sent(
    make: Any, start_first: bool
) -> None:
    """A generator that raises before any piece of body went out gets the server's 500,
    whatever status it started: a limit counting 500s counts it, as it counts an app
    raising before it returns."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def body() -> Iterator[bytes]:
            if start_first:
                start_response("200 OK", [("Content-Type", "text/plain")])
            raise RuntimeError("backend down")
            yield b"never"  # pragma: no cover - makes this a generator

        return body()

    limits = {"shop/x": {"rate": "1/minute", "count": [500]}}
    mw = make(app, {"project": "shop", "limits": limits})
    with pytest.raises(RuntimeError):
        Client(mw).get("/x")
    response = Client(mw).get("/x")
    assert (response.status_code, response.json["code"]) == (429, "GK-RATE-LIMIT")


def test_caller_from_header_default_and_invalid(make: Any) -> None:
    """The caller is the X-Caller-Id header; missing or invalid callers get the default."""
    app = Seen()
    mw = make(app, {"project": "shop"})
    fetch(mw, "/a", headers={"X-Caller-Id": "crm-2.prod@eu:1"})
    assert app.identity[2] == "crm-2.prod@eu:1"
    fetch(mw, "/a")
    assert app.identity[2] == "anonymous"
    for invalid in ("has space", "a/b", "x" * 129, "caf\u00e9", ""):
        fetch(mw, "/a", headers={"X-Caller-Id": invalid})
        assert app.identity[2] == "anonymous"
    fetch(mw, "/a", headers={"X-Caller-Id": "x" * 128})
    assert app.identity[2] == "x" * 128


def test_caller_header_and_default_are_configurable(make: Any) -> None:
    """`caller.header` and `caller.default` change where the caller comes from."""
    app = Seen()
    mw = make(app, {"project": "shop", "caller": {"header": "X-Client", "default": "guest"}})
    fetch(mw, "/a", headers={"X-Client": "erp", "X-Caller-Id": "ignored"})
    assert app.identity[2] == "erp"
    fetch(mw, "/a", headers={"X-Caller-Id": "ignored"})
    assert app.identity[2] == "guest"


def test_callers_are_limited_separately(make: Any) -> None:
    """A wildcard caller limit gives each caller its own count."""
    mw = make(ok_app, {"project": "shop", "limits": {"shop/api/*": {"concurrency": 1}}})
    held = start(mw, "/api", headers={"X-Caller-Id": "crm"})
    assert fetch(mw, "/api", headers={"X-Caller-Id": "crm"}).status_code == 503
    assert fetch(mw, "/api", headers={"X-Caller-Id": "erp"}).status_code == 200
    assert busy(mw.gatekeeper) == {"shop/api/crm": 1}
    held.close()
    assert all_zero(mw.gatekeeper)


def test_required_caller_missing_is_rejected_with_400(make: Any) -> None:
    """With `caller.required`, a request without a valid caller gets GK-CALLER-MISSING 400."""
    app = Seen()
    mw = make(app, {"project": "shop", "caller": {"required": True}})
    for headers in ({}, {"X-Caller-Id": "bad caller"}):
        response = fetch(mw, "/a", headers={**headers, "Accept": "application/json"})
        assert response.status_code == 400
        problem = response.get_json()
        assert problem["code"] == "GK-CALLER-MISSING"
        assert problem["status"] == 400
        assert "retryAfter" not in problem
        assert "Retry-After" not in response.headers
        assert response.headers["X-Request-Id"] == problem["requestId"]
    assert app.calls == 0
    assert fetch(mw, "/a", headers={"X-Caller-Id": "crm"}).status_code == 200
    assert app.calls == 1
    assert mw.gatekeeper.stats()["counters"]["rejected"] == {"GK-CALLER-MISSING": 2}
    assert all_zero(mw.gatekeeper)


def test_caller_resolver_callable_replaces_the_header(make: Any) -> None:
    """A callable `caller.resolver` names the caller (e.g. from authentication), not the header."""
    app = Seen()

    def resolver(environ: WSGIEnvironment) -> str | None:
        return environ.get("REMOTE_USER")

    mw = make(app, {"project": "shop", "caller": {"resolver": resolver, "required": True}})
    fetch(mw, "/a", environ_overrides={"REMOTE_USER": "alice"}, headers={"X-Caller-Id": "mallory"})
    assert app.identity[2] == "alice"
    response = fetch(mw, "/a", headers={"X-Caller-Id": "mallory"})
    assert response.status_code == 400
    assert json.loads(response.data)["code"] == "GK-CALLER-MISSING"


def test_caller_resolver_by_dotted_path(make: Any) -> None:
    """`caller.resolver` may be a dotted path to a function."""
    app = Seen()
    for path in ("tests.apps.wsgi_apps.caller_from_user", "tests.apps.wsgi_apps:caller_from_user"):
        mw = make(app, {"project": "shop", "caller": {"resolver": path}})
        fetch(mw, "/a", environ_overrides={"REMOTE_USER": "bob"})
        assert app.identity[2] == "bob"
        fetch(mw, "/a")
        assert app.identity[2] == "anonymous"


def test_caller_resolver_that_raises_or_returns_junk_means_missing(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A resolver that raises or returns an invalid name counts as a missing caller, not a 500."""
    answers: list[Any] = [RuntimeError("auth down"), "not a name!", 42, None]

    def resolver(environ: WSGIEnvironment) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    mw = make(ok_app, {"project": "shop", "caller": {"resolver": resolver, "required": True}})
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        for _ in range(4):
            assert fetch(mw, "/a").status_code == 400
    assert "caller.resolver raised" in caplog.text


def test_a_failing_resolver_is_reported_once_an_interval(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A resolver that raises on some input raises on every such request: one ERROR with
    its traceback per interval, not one per request a client can send."""

    def resolver(environ: WSGIEnvironment) -> Any:
        raise RuntimeError("auth down")

    mw = make(ok_app, {"project": "shop", "caller": {"resolver": resolver}})
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        for _ in range(500):
            assert fetch(mw, "/a").status_code == 200
    errors = [r for r in caplog.records if "caller.resolver raised" in r.getMessage()]
    assert len(errors) == 1 and "RuntimeError" in errors[0].getMessage()


def test_a_failing_resolver_never_logs_what_it_read(
    make: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A resolver's exception may quote the request (a KeyError of the API key it looked
    up): the ERROR names its type and where it was raised, never its message (SPEC 4.8)."""
    keys = {"k-live-known": "crm"}

    def resolver(environ: WSGIEnvironment) -> Any:
        return keys[environ["HTTP_X_API_KEY"]]

    mw = make(ok_app, {"project": "shop", "caller": {"resolver": resolver}})
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        assert fetch(mw, "/a", headers={"X-Api-Key": "k-live-TYPO-9f8e"}).status_code == 200
    assert "caller.resolver raised" in caplog.text
    assert "KeyError" in caplog.text and "in resolver" in caplog.text
    assert "k-live-TYPO-9f8e" not in caplog.text


def test_unimportable_resolver_is_a_config_error() -> None:
    """A resolver path that cannot be imported fails at start-up, naming `caller.resolver`."""
    with pytest.raises(ConfigError, match=r"caller\.resolver"):
        GateKeeperMiddleware(ok_app, {"caller": {"resolver": "tests.apps.wsgi_apps.nope"}})


def test_reload_with_unimportable_resolver_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload naming an unimportable resolver fails like any invalid file: logged once,
    counted, and the app keeps serving with the previous configuration."""
    file = tmp_path / "gatekeeper.properties"
    file.write_text("project = shop\nlimits.shop.concurrency = 5\n")
    keeper = GateKeeper({"reload": {"file": str(file)}})
    app = Seen()
    mw = GateKeeperMiddleware(app, keeper)
    assert fetch(mw, "/a", headers={"X-Caller-Id": "crm"}).status_code == 200
    file.write_text("project = shop\ncaller.resolver = tests.apps.nowhere.resolve\n")
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        assert keeper.reload() is False
        for _ in range(3):
            assert fetch(mw, "/a", headers={"X-Caller-Id": "crm"}).status_code == 200
    assert app.identity == ("shop", "a", "crm")
    assert keeper.stats()["counters"]["reload_failed"] == 1
    failed = [r for r in caplog.records if "reload of" in r.getMessage()]
    assert len(failed) == 1
    assert "caller.resolver" in failed[0].getMessage()
    file.write_text("project = shop\ncaller.resolver = tests.apps.wsgi_apps.caller_from_user\n")
    keeper.reload()
    fetch(mw, "/a", headers={"X-Caller-Id": "crm"}, environ_overrides={"REMOTE_USER": "bob"})
    assert app.identity == ("shop", "a", "bob")
    keeper.close()


def test_request_id_is_echoed_when_plain(refusing: Refusing) -> None:
    """A plain request id from X-Request-Id comes back in the fault's header and body."""
    mw = refusing()
    request_id = "9f1c-ab:12@x/y+z="
    response = fetch(mw, "/", headers={"X-Request-Id": request_id})
    assert response.headers["X-Request-Id"] == request_id
    assert response.get_json()["requestId"] == request_id


def test_request_id_is_generated_when_absent_or_junk(refusing: Refusing) -> None:
    """Without a usable request id each fault gets a fresh one, the same in header and body."""
    mw = refusing()
    seen = set()
    for headers in ({}, {"X-Request-Id": "has space"}, {"X-Request-Id": "y" * 129}):
        response = fetch(mw, "/", headers=headers)
        request_id = response.headers["X-Request-Id"]
        assert GENERATED_ID.fullmatch(request_id)
        assert response.get_json()["requestId"] == request_id
        seen.add(request_id)
    assert len(seen) == 3


def test_request_id_header_name_is_configurable(refusing: Refusing) -> None:
    """`request_id_header` names the header read and echoed."""
    mw = refusing(request_id_header="X-Correlation-Id")
    response = fetch(mw, "/", headers={"X-Correlation-Id": "abc", "X-Request-Id": "other"})
    assert response.headers["X-Correlation-Id"] == "abc"
    assert "X-Request-Id" not in response.headers
    assert response.get_json()["requestId"] == "abc"


def test_namespaced_environ_keys(make: Any) -> None:
    """Identity, admission and request id are found under namespaced `gatekeeper.*` keys."""
    app = Seen()
    mw = make(app, {"project": "shop", "limits": {"shop/full": {"concurrency": 0}}})
    environ = environ_for("/api", headers={"X-Caller-Id": "crm"})
    original = set(environ)
    run(mw, environ)
    assert environ["gatekeeper.identity"] == ("shop", "api", "crm")
    assert environ["gatekeeper.admission"].released is True
    assert all(key.startswith("gatekeeper.") for key in set(environ) - original)

    environ = environ_for("/full", headers={"X-Request-Id": "r-1"})
    result = mw(environ, StartResponseRecorder())
    assert environ["gatekeeper.request_id"] == "r-1"
    assert environ["gatekeeper.identity"] == ("shop", "full", "anonymous")
    assert "gatekeeper.admission" not in environ
    assert b"GK-CONCURRENCY-LIMIT" in b"".join(result)


def test_wrapping_twice_counts_once(clock: FakeClock) -> None:
    """Middleware wrapped twice around one app (or a plugin behind it) counts a request once."""
    keeper = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 1}}}, clock=clock)
    app = Seen()
    twice = GateKeeperMiddleware(GateKeeperMiddleware(app, keeper), keeper)
    held = start(twice, "/a")
    assert app.calls == 1
    assert busy(keeper) == {"shop": 1}
    assert fetch(twice, "/b").status_code == 503
    held.close()
    assert all_zero(keeper)
    assert fetch(twice, "/b").status_code == 200
    assert keeper.stats()["counters"]["admitted"] == 2

    outer_keeper = GateKeeper({"project": "outer"}, clock=clock)
    nested = GateKeeperMiddleware(GateKeeperMiddleware(app, keeper), outer_keeper)
    assert fetch(nested, "/c").status_code == 200
    assert keeper.stats()["counters"]["admitted"] == 2
    keeper.close()
    outer_keeper.close()


# -- 2. release exactly once ----------------------------------------------------------------

# What every integration shares (a body read, closed unread, dropped mid-stream, a raising
# stream, no close(), a raising close(), on every backend) is proven for all of them in
# test_release_conformance.py; what follows is the bare WSGI protocol's own: an app raising
# around start_response, exc_info, the server's wsgi.file_wrapper.


def raise_mid_stream_under_a_buffering_server(error: AppError) -> WSGIApplication:
    app = Streaming(fail_after=1)
    app.error = error
    return app


def raise_before_start_response(error: AppError) -> WSGIApplication:
    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/case":
            raise error
        return ok_app(environ, start_response)

    return app


def raise_after_start_response(error: AppError) -> WSGIApplication:
    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        start_response("200 OK", [])
        if environ["PATH_INFO"] == "/case":
            raise error
        return [b"ok"]

    return app


def raise_through_exc_info_after_headers_sent(error: AppError) -> WSGIApplication:
    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] != "/case":
            return ok_app(environ, start_response)
        start_response("200 OK", [])
        try:
            raise error
        except AppError:
            start_response("500 Internal Server Error", [], sys.exc_info())
        return [b"never"]

    return app


@pytest.mark.parametrize(
    "raising",
    [
        raise_mid_stream_under_a_buffering_server,
        raise_before_start_response,
        raise_after_start_response,
        raise_through_exc_info_after_headers_sent,
    ],
    ids=lambda raising: raising.__name__,
)
def test_app_raising_releases_once(make: Any, raising: Callable[[AppError], Any]) -> None:
    """However the app raises, the server gets that very exception and the slot is freed once."""
    error = AppError("the app failed")
    with another_request_in_flight(make(raising(error), HOLD)) as mw:
        with pytest.raises(AppError) as raised:
            fetch(mw, "/case")  # werkzeug's Client re-raises exc_info like a server that sent
        assert raised.value is error
        assert_released_once(mw)


def test_start_response_with_exc_info_releases_once(make: Any) -> None:
    """An app switching to an error page via exc_info is served, then released once."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] != "/case":
            return ok_app(environ, start_response)
        start_response("200 OK", [("Content-Type", "text/plain")])
        try:
            raise AppError("rendering failed")
        except AppError:
            start_response("500 Internal Server Error", [("X-Error", "1")], sys.exc_info())
        return [b"sorry"]

    with another_request_in_flight(make(app, HOLD)) as mw:
        result, recorder = serve(mw, "/case")
        assert recorder.calls == 2
        assert recorder.status == "500 Internal Server Error"
        assert recorder.headers == [("X-Error", "1")]
        assert_holding(mw)
        assert drain(result, recorder) == b"sorry"
        assert_released_once(mw)  # exhausted
        result.close()  # type: ignore[attr-defined]
        assert_released_once(mw)


class CloseError(Exception):
    pass


class FileApp:
    """Answers `/case` with the server's `wsgi.file_wrapper` around `environ["test.file"]`."""

    def __init__(self, status: str = "200 OK") -> None:
        self.status = status
        self.returned: list[object] = []

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] != "/case":
            return ok_app(environ, start_response)
        headers = [("Content-Type", "application/octet-stream")]
        if "test.length" in environ:
            headers.append(("Content-Length", environ["test.length"]))
        start_response(self.status, headers)
        wrapper = environ["wsgi.file_wrapper"](environ["test.file"], 4)
        self.returned.append(wrapper)
        return wrapper  # type: ignore[no-any-return]


def file_environ(file: io.BytesIO, wrapper: type = FileWrapper) -> WSGIEnvironment:
    environ = environ_for("/case")
    environ.update({"wsgi.file_wrapper": wrapper, "test.file": file})
    return environ


class ServersFileWrapper(FileWrapper):
    """A server's own class-style file_wrapper (gunicorn's, waitress's): it would send the
    file with sendfile, unseen by the middleware."""


def test_a_file_response_is_read_through_the_watch(make: Any) -> None:
    """An app's file_wrapper response is watched like any body (the app gets a wrapper that
    reads the file in blocks, not the server's sendfile one): its slot comes back as soon as
    its declared length is handed out - before the server could write the end and the
    client send its next request - and close() closes the file, once."""
    app = FileApp()
    with another_request_in_flight(make(app, HOLD)) as mw:
        file = io.BytesIO(b"file contents")
        environ = file_environ(file, ServersFileWrapper)
        environ["test.length"] = "13"
        recorder = StartResponseRecorder()
        result = mw(environ, recorder)
        assert type(app.returned[0]) is FileWrapper  # not the server's class
        assert result is not app.returned[0]
        assert_holding(mw)
        chunks = iter(result)
        assert [next(chunks) for _ in range(3)] == [b"file", b" con", b"tent"]
        assert_holding(mw)
        assert next(chunks) == b"s"  # the 13th byte: handed out, released
        assert_released_once(mw)
        assert not file.closed
        result.close()  # type: ignore[attr-defined]
        assert file.closed
        assert_released_once(mw)
        result.close()  # type: ignore[attr-defined]
        assert_released_once(mw)


def uwsgi_style_file_wrapper(filelike: Any, block_size: int = 8192) -> Any:
    """A function-style file_wrapper, as uWSGI's: it returns the file itself, and the
    server sends it with sendfile only when the app hands back that very object."""
    return filelike


def test_a_function_style_file_wrapper_is_not_handed_to_the_app(make: Any) -> None:
    """Under uWSGI's function-style file_wrapper the app gets a block-reading wrapper too
    (iterating the plain file would hand out lines); read to its end, the slot comes back."""
    app = FileApp()
    with another_request_in_flight(make(app, HOLD)) as mw:
        file = io.BytesIO(b"line one\nline two\n")
        environ = file_environ(file, uwsgi_style_file_wrapper)  # type: ignore[arg-type]
        recorder = StartResponseRecorder()
        result = mw(environ, recorder)
        assert result is not file
        assert_holding(mw)
        assert list(result) == [b"line", b" one", b"\nlin", b"e tw", b"o\n"]  # blocks of 4
        assert_released_once(mw)
        result.close()  # type: ignore[attr-defined]
        assert file.closed
        assert_released_once(mw)


def test_an_exempt_request_keeps_the_servers_file_wrapper() -> None:
    """An exempt request (identify() answers None) is not watched: the app gets
    the server's own file_wrapper, and the server its object back (its sendfile)."""
    app = FileApp()
    mw = GateKeeperMiddleware(app, {"project": "shop"}, identify=lambda environ: None)
    file = io.BytesIO(b"abc")
    result = mw(file_environ(file, ServersFileWrapper), StartResponseRecorder())
    assert type(result) is ServersFileWrapper
    assert result is app.returned[0]


def test_file_wrapper_through_client_releases_once(make: Any) -> None:
    """A file_wrapper response read by the Client is complete and frees its slot on close."""
    with another_request_in_flight(make(FileApp(), HOLD)) as mw:
        file = io.BytesIO(b"0123456789")
        response = fetch(
            mw,
            "/case",
            environ_overrides={"wsgi.file_wrapper": FileWrapper, "test.file": file},
        )
        assert response.data == b"0123456789"
        assert file.closed
        assert_released_once(mw)


def test_file_wrapper_whose_close_raises_still_releases(make: Any) -> None:
    """A file_wrapper whose close() raises still frees the slot; the error reaches the server."""

    class BrokenFile(io.BytesIO):
        def close(self) -> None:
            super().close()
            raise CloseError("disk gone")

    with another_request_in_flight(make(FileApp(), HOLD)) as mw:
        recorder = StartResponseRecorder()
        result = mw(file_environ(BrokenFile(b"abc")), recorder)
        assert drain(result, recorder) == b"abc"
        with pytest.raises(CloseError):
            result.close()  # type: ignore[attr-defined]
        assert_released_once(mw)


def test_many_requests_of_every_kind_end_at_zero(make: Any) -> None:
    """After a mix of normal, streamed, failing and abandoned responses, inflight is all zero."""
    apps: dict[str, WSGIApplication] = {
        "/list": ok_app,
        "/stream": Streaming(),
        "/boom": Streaming(fail_after=1),
    }

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return apps[environ["PATH_INFO"]](environ, start_response)

    mw = make(
        app,
        {
            "project": "shop",
            "limits": {"shop": {"concurrency": 50}, "shop/*/*": {"concurrency": 5}},
        },
    )
    for round_ in range(3):
        open_responses = [start(mw, "/stream", headers={"X-Caller-Id": f"c{n}"}) for n in range(5)]
        assert sum(busy(mw.gatekeeper).values()) == 5 + 5
        fetch(mw, "/list")
        with pytest.raises(AppError):
            fetch(mw, "/boom")
        for response in open_responses[round_:]:
            response.close()
        for response in open_responses[:round_]:
            response.close()
        assert all_zero(mw.gatekeeper)


# -- 3. faulty responses hold their slots for `delay` ---------------------------------------


FAULTY = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 1, "delay": 2.0, "timeout_status": [408]},
        "shop/hdr": {"timeout_header": "X-Fault-Code: ^TIME(OUT)?$"},
        "shop/body": {"timeout_body": "<fault>TIMEOUT</fault>"},
    },
}
MARKER = b"<fault>TIMEOUT</fault>"
KIB64 = 64 * 1024


def assert_held_for_delay(mw: GateKeeperMiddleware, clock: FakeClock, delay: float = 2.0) -> None:
    """The slot is held until `delay` has passed; meanwhile requests get a 503 with Retry-After."""
    gk = mw.gatekeeper
    assert busy(gk) == {"shop": 1}
    assert gk.stats()["counters"]["delayed_pending"] == 1
    refused = fetch(mw, "/probe")
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == str(int(delay))
    clock.advance(delay - 0.25)
    assert busy(gk) == {"shop": 1}
    clock.advance(0.25)
    assert all_zero(gk)
    assert gk.stats()["counters"]["delayed_pending"] == 0
    assert fetch(mw, "/probe").status_code == 200


def assert_released_at_once(mw: GateKeeperMiddleware) -> None:
    assert all_zero(mw.gatekeeper)
    assert mw.gatekeeper.stats()["counters"]["delayed_pending"] == 0
    assert fetch(mw, "/probe").status_code == 200


def chunked(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


@pytest.mark.parametrize(
    ("path", "status", "headers", "chunks"),
    [
        ("/any", "500 Internal Server Error", [], [b"oops"]),
        ("/any", "503 Service Unavailable", [], [b"busy"]),
        ("/any", "504 Gateway Timeout", [], []),
        ("/any", "408 Request Timeout", [], [b"timeout_status"]),
        ("/hdr", "200 OK", [("X-Fault-Code", "TIMEOUT")], [b"ok?"]),
        ("/hdr", "200 OK", [("x-fault-code", "TIME")], [b"ok?"]),
        ("/body", "200 OK", [], [b"<r>" + MARKER + b"</r>"]),
        ("/body", "200 OK", [], [b"<r><fault>TIME", b"OUT</fault></r>"]),
        ("/body", "200 OK", [], chunked(b"<r>" + MARKER + b"</r>", 1)),
        ("/body", "200 OK", [], [b"a" * 1000, b"", b"b" * 10_000, MARKER]),
        ("/body", "200 OK", [], [b"a" * (KIB64 - len(MARKER)) + MARKER, b"tail"]),
        ("/body", "200 OK", [], [b"a" * (KIB64 - 30), MARKER[:10], MARKER[10:]]),
    ],
    ids=[
        "500",
        "503",
        "504-empty",
        "timeout_status",
        "timeout_header",
        "timeout_header-case",
        "timeout_body",
        "timeout_body-split",
        "timeout_body-bytewise",
        "timeout_body-after-empty-chunk",
        "timeout_body-ends-at-64KiB",
        "timeout_body-split-near-64KiB",
    ],
)
def test_faulty_response_holds_its_slot_for_delay(
    make: Any,
    clock: FakeClock,
    path: str,
    status: str,
    headers: list[tuple[str, str]],
    chunks: list[bytes],
) -> None:
    """A 5xx, timeout status, header or body marker keeps the slot `delay` seconds after close."""
    app = Streaming(chunks, status=status, headers=headers)
    mw = make(app, FAULTY)
    assert fetch(mw, path).data == b"".join(chunks)
    assert_held_for_delay(mw, clock)


ANCHORED = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 1, "delay": 2.0},
        "shop/long": {"timeout_body": "BEGIN-+END"},
        "shop/start": {"timeout_body": "\\A<error>"},
        "shop/end": {"timeout_body": "TIMEOUT\\Z"},
    },
}


@pytest.mark.parametrize(
    ("path", "chunks", "faulty"),
    [
        ("/long", [b"BEGIN" + b"-" * 400, b"-" * 400 + b"END"], True),
        ("/start", [b"<err", b"or> at the start"], True),
        ("/start", [b"fine, then ", b"<error> mid-body"], False),
        ("/end", [b"ends in TIME", b"OUT"], True),
        ("/end", [b"TIMEOUT", b" is not the end"], False),
    ],
    ids=[
        "long-match-over-pieces",
        "start-split",
        "start-at-a-piece",
        "end-split",
        "end-of-a-piece",
    ],
)
def test_a_body_marker_is_searched_in_the_body_not_in_its_pieces(
    make: Any, clock: FakeClock, path: str, chunks: list[bytes], faulty: bool
) -> None:
    """The marker is searched in the body's first 64 KiB as one text, however the app
    cuts it: a match longer than a piece is found, and ``\\A`` / ``\\Z`` match at the
    body's start and end only, never at a piece's."""
    mw = make(Streaming(chunks), ANCHORED)
    assert fetch(mw, path).data == b"".join(chunks)
    if faulty:
        assert_held_for_delay(mw, clock)
    else:
        assert_released_at_once(mw)


def test_timeout_body_marker_beyond_64kib_is_not_scanned(make: Any, clock: FakeClock) -> None:
    """A marker that starts after the first 64 KiB of the body does not count."""
    late = [b"a" * (KIB64 - 5), b"b" * 5, MARKER]
    mw = make(Streaming(late), FAULTY)
    assert fetch(mw, "/body").data == b"".join(late)
    assert_released_at_once(mw)
    for straddling in ([b"a" * (KIB64 - 5) + MARKER], [b"a" * (KIB64 - 5), MARKER]):
        mw = make(Streaming(straddling), FAULTY)
        fetch(mw, "/body")
        assert_released_at_once(mw)


@pytest.mark.parametrize(
    ("path", "status", "headers", "body"),
    [
        ("/any", "200 OK", [], b"fine"),
        ("/any", "404 Not Found", [], b"missing"),
        ("/any", "429 Too Many Requests", [], b""),
        ("/hdr", "200 OK", [("X-Fault-Code", "TIMEOUTS")], b""),
        ("/hdr", "200 OK", [("X-Other", "TIMEOUT")], b""),
        ("/body", "200 OK", [], b"<fault>OK</fault>"),
        ("/any", "200 OK", [], MARKER),  # no body marker outside /body
    ],
)
def test_healthy_response_releases_at_once(
    make: Any, path: str, status: str, headers: list[tuple[str, str]], body: bytes
) -> None:
    """2xx and 4xx responses without a marker free their slot as soon as they are closed."""
    mw = make(Streaming([body], status=status, headers=headers), FAULTY)
    fetch(mw, path)
    assert_released_at_once(mw)


def test_timeout_body_is_scanned_while_streaming_without_buffering(
    make: Any, clock: FakeClock
) -> None:
    """The body scan passes each chunk on as it comes: nothing is held back to scan ahead."""
    app = Streaming([b"first", b"<fault>TIME", b"OUT</fault>", b"last"])
    mw = make(app, FAULTY)
    result, _ = serve(mw, "/body")
    iterator = iter(result)
    assert next(iterator) == b"first"
    assert app.produced == 1
    assert next(iterator) == b"<fault>TIME"
    assert app.produced == 2
    assert list(iterator) == [b"OUT</fault>", b"last"]
    result.close()  # type: ignore[attr-defined]
    assert_held_for_delay(mw, clock)


@pytest.mark.parametrize("where", ["before", "after", "mid-stream"])
def test_exception_holds_slot_for_delay_and_propagates(
    make: Any, clock: FakeClock, where: str
) -> None:
    """An app exception holds the slot for `delay` and reaches the server unchanged."""
    error = AppError(where)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/probe":
            return ok_app(environ, start_response)
        if where == "before":
            raise error
        start_response("200 OK", [])
        if where == "after":
            raise error

        def body() -> Iterator[bytes]:
            yield b"partial"
            raise error

        return body()

    mw = make(app, FAULTY)
    with pytest.raises(AppError) as raised:
        fetch(mw, "/any")
    assert raised.value is error
    assert_held_for_delay(mw, clock)


def test_lazy_start_response_in_generator_is_watched(make: Any, clock: FakeClock) -> None:
    """A generator app that calls start_response on first iteration is still seen as a 5xx."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/probe":
            yield from ok_app(environ, start_response)
            return
        start_response("502 Bad Gateway", [])
        yield b"upstream down"

    mw = make(app, FAULTY)
    assert fetch(mw, "/any").status_code == 502
    assert_held_for_delay(mw, clock)


def test_exc_info_error_page_holds_slot_for_delay(make: Any, clock: FakeClock) -> None:
    """An app that switches to a 500 page via exc_info has answered faultily."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        start_response("200 OK", [])
        try:
            raise AppError("x")
        except AppError:
            start_response("500 Internal Server Error", [], sys.exc_info())
        return [b"error page"]

    mw = make(app, FAULTY)
    result, recorder = serve(mw, "/any")
    drain(result, recorder)
    result.close()  # type: ignore[attr-defined]
    mw.app = ok_app
    assert_held_for_delay(mw, clock)


def test_faulty_file_wrapper_response_holds_slot_for_delay(make: Any, clock: FakeClock) -> None:
    """A file_wrapper response with a 5xx holds its slot for `delay` after close."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/probe":
            return ok_app(environ, start_response)
        start_response("503 Service Unavailable", [])
        return environ["wsgi.file_wrapper"](io.BytesIO(b"maintenance"))  # type: ignore[no-any-return]

    mw = make(app, FAULTY)
    response = fetch(mw, "/any", environ_overrides={"wsgi.file_wrapper": FileWrapper})
    assert response.data == b"maintenance"
    assert_held_for_delay(mw, clock)


def test_file_wrapper_body_is_scanned_when_a_marker_is_configured(
    make: Any, clock: FakeClock
) -> None:
    """With `timeout_body`, a file_wrapper body is scanned too (and so not passed through)."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ["PATH_INFO"] == "/probe":
            return ok_app(environ, start_response)
        start_response("200 OK", [])
        return environ["wsgi.file_wrapper"](io.BytesIO(b"xx" + MARKER), 7)  # type: ignore[no-any-return]

    mw = make(app, FAULTY)
    response = fetch(mw, "/body", environ_overrides={"wsgi.file_wrapper": FileWrapper})
    assert response.data == b"xx" + MARKER
    assert_held_for_delay(mw, clock)


def test_most_specific_delay_wins(make: Any, clock: FakeClock) -> None:
    """A service's `delay` overrides the project's, a caller limit's overrides both."""
    app = Streaming([b"x"], status="500 Internal Server Error")
    mw = make(
        app,
        {
            "project": "shop",
            "limits": {
                "shop": {"concurrency": 10, "delay": 9.0},
                "shop/crm": {"delay": 3.0},
                "shop/crm/vip": {"concurrency": 10, "delay": 1.0},
            },
        },
    )
    gk = mw.gatekeeper
    fetch(mw, "/crm")
    fetch(mw, "/crm", headers={"X-Caller-Id": "vip"})
    fetch(mw, "/other")
    assert busy(gk) == {"shop": 3, "shop/crm/vip": 1}
    clock.advance(1.0)
    assert busy(gk) == {"shop": 2}
    clock.advance(2.0)
    assert busy(gk) == {"shop": 1}
    clock.advance(6.0)
    assert all_zero(gk)


# -- 4. ServiceFault end to end -------------------------------------------------------------


def fault_fields(response: TestResponse) -> dict[str, Any]:
    """The ServiceFault's members, parsed as a client would by its Content-Type."""
    content_type = response.headers["Content-Type"]
    assert response.headers["Content-Length"] == str(len(response.data))
    for name, value in response.headers.items():
        assert PRINTABLE_ASCII.fullmatch(value), (name, value)
    if content_type == "application/problem+json":
        problem = json.loads(response.data.decode("ascii"))
        assert problem["type"] == f"urn:gatekeeper-wsgi:fault:{problem['code']}"
        assert problem["title"] == FAULT_CODES[problem["code"]][1]
        assert problem["status"] == response.status_code
        return {
            key: problem.get(key) for key in ("code", "level", "limit", "requestId", "retryAfter")
        }
    assert content_type == "application/xml; charset=utf-8", content_type
    return service_fault(fromstring(response.data))


def service_fault(element: Element) -> dict[str, Any]:
    assert element.tag == f"{NS}ServiceFault"
    children = {child.tag.removeprefix(NS): child for child in element}
    assert children["reason"].text == FAULT_CODES[children["code"].text or ""][1]
    limit = children.get("limit")
    retry = children.get("retryAfter")
    return {
        "code": children["code"].text,
        "level": children["level"].text if "level" in children else None,
        "limit": None if limit is None else {"path": limit.get("path"), "value": limit.text},
        "requestId": children["requestId"].text,
        "retryAfter": None if retry is None else int(retry.text or ""),
    }


def test_concurrency_fault_json(make: Any) -> None:
    """A full concurrency limit answers 503 GK-CONCURRENCY-LIMIT as RFC 9457 JSON by default."""
    mw = make(ok_app, {"project": "shop", "limits": {"shop/checkout": {"concurrency": 1}}})
    held = start(mw, "/checkout")
    response = fetch(mw, "/checkout", headers={"X-Request-Id": "req-1"})
    assert response.status_code == 503
    assert response.headers["Content-Type"] == "application/problem+json"
    assert response.headers["Retry-After"] == "1"
    assert response.headers["X-Request-Id"] == "req-1"
    assert response.headers["Cache-Control"] == "no-store"
    assert "RateLimit" not in response.headers
    assert fault_fields(response) == {
        "code": "GK-CONCURRENCY-LIMIT",
        "level": "service",
        "limit": {"path": "shop/checkout", "value": 1},
        "requestId": "req-1",
        "retryAfter": 1,
    }
    held.close()


def test_concurrency_fault_xml_when_accept_prefers_xml(refusing: Refusing) -> None:
    """A client preferring XML gets the same ServiceFault as XML in the fault namespace."""
    mw = refusing()
    for accept in ("application/xml", "text/xml", "application/json;q=0.5, application/xml"):
        response = fetch(mw, "/x", headers={"Accept": accept, "X-Request-Id": "r2"})
        assert response.status_code == 503
        assert fault_fields(response) == {
            "code": "GK-CONCURRENCY-LIMIT",
            "level": "project",
            "limit": {"path": "shop", "value": "0"},
            "requestId": "r2",
            "retryAfter": 1,
        }


@pytest.mark.parametrize(
    ("accept", "content_type", "fault_format", "expected"),
    [
        (None, None, "auto", "json"),
        ("*/*", None, "auto", "json"),
        ("application/json", None, "auto", "json"),
        ("application/xml;q=0.4, application/json", None, "auto", "json"),
        ("application/xml", None, "auto", "xml"),
        ("text/html, text/xml;q=0.9", None, "auto", "xml"),
        (None, "application/xml", "auto", "xml"),
        ("*/*", "text/xml; charset=utf-8", "auto", "xml"),
        ("application/json", "application/xml", "auto", "json"),
        ("application/json", None, "xml", "xml"),
        ("application/xml", "application/xml", "json", "json"),
        (";;;,,q=x", None, "auto", "json"),
    ],
)
def test_fault_format_negotiation(
    refusing: Refusing,
    accept: str | None,
    content_type: str | None,
    fault_format: str,
    expected: str,
) -> None:
    """XML when Accept prefers it or the body is XML, JSON otherwise; `fault.format` forces one."""
    mw = refusing(fault={"format": fault_format})
    headers = {} if accept is None else {"Accept": accept}
    kwargs: dict[str, Any] = {"headers": headers}
    if content_type is not None:
        kwargs.update(method="POST", data=b"<order/>", content_type=content_type)
    response = Client(mw).open("/x", buffered=True, **kwargs)
    assert response.status_code == 503
    want = "application/problem+json" if expected == "json" else "application/xml; charset=utf-8"
    assert response.headers["Content-Type"] == want
    assert fault_fields(response)["code"] == "GK-CONCURRENCY-LIMIT"


def test_rate_fault_with_ratelimit_headers(make: Any, clock: FakeClock) -> None:
    """An exhausted rate answers 429 with exact Retry-After and IETF RateLimit fields."""
    mw = make(
        ok_app,
        {"project": "shop", "limits": {"shop/login/*": {"rate": "5/minute", "key": "ip"}}},
    )
    for _ in range(5):
        assert fetch(mw, "/login").status_code == 200
    clock.advance(18)
    response = fetch(mw, "/login", headers={"Accept": "application/xml"})
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "42"
    assert response.headers["RateLimit-Policy"] == '"shop/login/*";q=5;w=60'
    assert response.headers["RateLimit"] == '"shop/login/*";r=0;t=42'
    fields = fault_fields(response)
    assert fields["code"] == "GK-RATE-LIMIT"
    assert fields["level"] == "caller"
    assert fields["limit"] == {"path": "shop/login/*", "value": "5/minute"}
    assert fields["retryAfter"] == 42
    other_ip = fetch(mw, "/login", environ_overrides={"REMOTE_ADDR": "10.0.0.9"})
    assert other_ip.status_code == 200
    clock.advance(41.5)
    assert fetch(mw, "/login").status_code == 429
    clock.advance(0.5)
    assert fetch(mw, "/login").status_code == 200
    assert all_zero(mw.gatekeeper)


def login_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    if environ.get("QUERY_STRING") == "password=secret":
        start_response("200 OK", [])
        return [b"welcome"]
    start_response("401 Unauthorized", [])
    return [b"wrong password"]


LOGIN = {
    "project": "shop",
    "limits": {"shop/login/*": {"rate": "5/minute", "key": "ip", "count": [401]}},
}


def test_login_limit_counts_only_failed_logins(make: Any, clock: FakeClock) -> None:
    """A login limit with `count = [401]` lets good logins through and stops the 6th failure."""
    mw = make(login_app, LOGIN)
    for _ in range(20):
        assert fetch(mw, "/login?password=secret").status_code == 200
    for _ in range(5):
        assert fetch(mw, "/login?password=guess").status_code == 401
    refused = fetch(mw, "/login?password=secret")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "60"
    assert refused.headers["RateLimit"] == '"shop/login/*";r=0;t=60'
    clock.advance(60)
    assert fetch(mw, "/login?password=secret").status_code == 200


def test_login_limit_reserves_places_for_responses_in_flight(make: Any) -> None:
    """Logins in flight reserve places; an uncounted status gives its place back on close."""
    # Called, not yet read (a body handed out whole is released at once).
    mw = make(login_app, LOGIN)
    pending: list[Any] = [serve(mw, "/login?password=guess")[0] for _ in range(5)]
    assert fetch(mw, "/login?password=guess").status_code == 429
    for response in pending[:2]:
        response.close()  # 401: counted
    assert fetch(mw, "/login?password=guess").status_code == 429
    pending[2].close()
    pending[3].close()
    pending[4].close()
    assert fetch(mw, "/login?password=guess").status_code == 429

    mw = make(login_app, LOGIN)
    pending = [serve(mw, "/login?password=secret")[0] for _ in range(5)]
    assert fetch(mw, "/login?password=secret").status_code == 429
    for response in pending:
        response.close()  # 200: not counted, places come back
    assert fetch(mw, "/login?password=secret").status_code == 200


def test_queue_full_and_queue_timeout_faults(clock: FakeClock) -> None:
    """A full queue answers GK-QUEUE-FULL at once; a waiter without a slot gets GK-QUEUE-TIMEOUT."""
    keeper = GateKeeper(  # real clock: waiting is real
        {
            "project": "shop",
            "limits": {"shop/slow": {"concurrency": 1, "queue": {"size": 1, "wait": 30}}},
        }
    )
    mw = GateKeeperMiddleware(ok_app, keeper)
    held = start(mw, "/slow")
    results: list[TestResponse] = []
    waiter = threading.Thread(target=lambda: results.append(fetch(mw, "/slow")))
    waiter.start()
    # No public view of the queue: wait until the waiter is in it.
    wait_until(lambda: keeper._waiting == 1, what="the waiter in the queue")
    full = fetch(mw, "/slow", headers={"X-Request-Id": "q1"})
    assert full.status_code == 503
    assert full.headers["Retry-After"] == "30"
    assert fault_fields(full) == {
        "code": "GK-QUEUE-FULL",
        "level": "service",
        "limit": {"path": "shop/slow", "value": 1},
        "requestId": "q1",
        "retryAfter": 30,
    }
    held.close()
    waiter.join(10)
    assert not waiter.is_alive()
    assert results[0].status_code == 200
    assert all_zero(keeper)
    keeper.close()

    impatient = GateKeeper(
        {
            "project": "shop",
            "limits": {"shop/slow": {"concurrency": 1, "queue": {"size": 5, "wait": 0.05}}},
        }
    )
    mw = GateKeeperMiddleware(ok_app, impatient)
    held = start(mw, "/slow")
    timed_out = fetch(mw, "/slow", headers={"Accept": "application/xml"})
    assert timed_out.status_code == 503
    assert timed_out.headers["Retry-After"] == "1"
    assert fault_fields(timed_out)["code"] == "GK-QUEUE-TIMEOUT"
    held.close()
    assert all_zero(impatient)
    impatient.close()


@pytest.mark.parametrize("on_error", ["reject", "allow"])
def test_backend_unavailable(
    clock: FakeClock, caplog: pytest.LogCaptureFixture, on_error: str
) -> None:
    """With the backend down, `reject` answers GK-BACKEND-UNAVAILABLE 503, `allow` serves."""
    # A real Redis URL on a loopback port nobody listens on: connection refused.
    keeper = GateKeeper(
        {
            "project": "shop",
            "backend": f"redis://127.0.0.1:{free_port()}/0",
            "on_backend_error": on_error,
            "limits": {"shop": {"concurrency": 5}},
        },
        clock=clock,
    )
    mw = GateKeeperMiddleware(ok_app, keeper)
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        response = fetch(mw, "/x")
    if on_error == "allow":
        assert response.status_code == 200
        return
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    fields = fault_fields(response)
    assert fields["code"] == "GK-BACKEND-UNAVAILABLE"
    assert fields["retryAfter"] == 1


@pytest.mark.parametrize(
    ("content_type", "extra", "envelope", "fault_code"),
    [
        ("text/xml; charset=utf-8", {"SOAPAction": '"urn:order"'}, SOAP11, "soap:Server"),
        ("application/soap+xml; charset=utf-8", {}, SOAP12, "env:Receiver"),
    ],
    ids=["soap11", "soap12"],
)
@pytest.mark.parametrize("fault_format", ["auto", "json"])
def test_soap_request_gets_a_soap_fault(
    refusing: Refusing,
    content_type: str,
    extra: dict[str, str],
    envelope: str,
    fault_code: str,
    fault_format: str,
) -> None:
    """A SOAP request gets a SOAP Fault (HTTP 500) with the ServiceFault, whatever the format."""
    mw = refusing(fault={"format": fault_format})
    response = Client(mw).post(
        "/orders",
        data=f'<s:Envelope xmlns:s="{envelope[1:-1]}"><s:Body/></s:Envelope>',
        content_type=content_type,
        headers={**extra, "X-Request-Id": "soap-1", "Accept": "application/json"},
        buffered=True,
    )
    assert response.status_code == 500
    assert response.headers["Retry-After"] == "1"
    assert response.headers["X-Request-Id"] == "soap-1"
    root = fromstring(response.data)
    assert root.tag == f"{envelope}Envelope"
    fault = root.find(f"{envelope}Body/{envelope}Fault")
    assert fault is not None
    if envelope == SOAP11:
        assert fault.findtext("faultcode") == fault_code
        assert fault.findtext("faultstring") == "Too many concurrent requests"
        detail = fault.find("detail")
    else:
        assert fault.findtext(f"{envelope}Code/{envelope}Value") == fault_code
        detail = fault.find(f"{envelope}Detail")
    assert detail is not None
    fields = service_fault(detail[0])
    assert fields["code"] == "GK-CONCURRENCY-LIMIT"
    assert fields["requestId"] == "soap-1"


def renderer(rejected: Rejected, request_id: str, environ: WSGIEnvironment) -> tuple[str, bytes]:
    return "application/vnd.site+json", json.dumps(
        {"err": rejected.code, "id": request_id}
    ).encode()


@pytest.mark.parametrize(
    ("setting", "content_type", "body"),
    [
        (renderer, "application/vnd.site+json", b'{"err": "GK-CONCURRENCY-LIMIT", "id": "r9"}'),
        (
            "tests.apps.wsgi_apps:plain_text_fault",
            "text/plain; charset=utf-8",
            b"GK-CONCURRENCY-LIMIT 503 r9\n",
        ),
    ],
    ids=["callable", "dotted-path"],
)
def test_user_renderer_replaces_the_body(
    refusing: Refusing, setting: Any, content_type: str, body: bytes
) -> None:
    """A `fault.renderer` writes the body in a site's own standard; status and headers stay."""
    mw = refusing(fault={"renderer": setting})
    response = fetch(mw, "/x", headers={"X-Request-Id": "r9", "Accept": "application/xml"})
    assert response.status_code == 503
    assert response.headers["Content-Type"] == content_type
    assert response.data == body
    assert response.headers["Retry-After"] == "1"
    assert response.headers["X-Request-Id"] == "r9"


def test_broken_renderer_falls_back_to_the_service_fault(
    refusing: Refusing, caplog: pytest.LogCaptureFixture
) -> None:
    """A renderer that raises never turns a rejection into a 500: the standard fault is sent."""

    def broken(rejected: Rejected, request_id: str, environ: WSGIEnvironment) -> Any:
        raise RuntimeError("bug in site renderer")

    mw = refusing(fault={"renderer": broken})
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        response = fetch(mw, "/x")
    assert response.status_code == 503
    assert fault_fields(response)["code"] == "GK-CONCURRENCY-LIMIT"


@pytest.mark.parametrize("junk", JUNK, ids=[f"junk{n}" for n in range(len(JUNK))])
@pytest.mark.parametrize(
    "request_headers",
    [
        {"HTTP_ACCEPT": "application/json"},
        {"HTTP_ACCEPT": "application/xml"},
        {"CONTENT_TYPE": "text/xml", "HTTP_SOAPACTION": '""'},
        {"CONTENT_TYPE": "application/soap+xml"},
    ],
    ids=["json", "xml", "soap11", "soap12"],
)
def test_junk_request_id_and_caller_never_break_the_fault(
    make: Any, junk: str, request_headers: dict[str, str]
) -> None:
    """Junk request ids and callers still give a well-formed fault that echoes none of it."""
    mw = make(
        ok_app,
        {"project": "shop", "limits": {"shop/api/*": {"concurrency": 0}}},
    )
    environ = environ_for("/api")
    environ.update(request_headers)
    environ["HTTP_X_REQUEST_ID"] = junk
    environ["HTTP_X_CALLER_ID"] = junk
    recorder = StartResponseRecorder()
    body = b"".join(mw(environ, recorder))
    assert recorder.status is not None
    for name, value in recorder.headers:
        assert PRINTABLE_ASCII.fullmatch(value), (name, value)
    request_id = header(recorder.headers, "X-Request-Id")
    assert request_id is not None
    assert GENERATED_ID.fullmatch(request_id)
    content_type = header(recorder.headers, "Content-Type") or ""
    if "json" in content_type:
        problem = json.loads(body)
        assert problem["requestId"] == request_id
        assert problem["limit"]["path"] == "shop/api/*"
    else:
        root = fromstring(body)
        ids = [element.text for element in root.iter(f"{NS}requestId")]
        assert ids == [request_id]
    assert b"evil" not in body
    assert b"Injected" not in body
    assert b"\x00" not in body


# -- 5. bad input never raises and never makes a malformed fault ----------------------------

header_text = st.one_of(
    st.binary(max_size=300).map(lambda raw: raw.decode("latin-1")),  # what a server passes
    st.text(max_size=300),  # any Unicode but lone surrogates, which no PEP 3333 server passes
    st.sampled_from(["application/xml", "text/xml;q=0", "*/*;q=abc", "a/b;c", ",", ";q=1"]),
)
path_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["orders", "1", "x", "..", "", "%2F", "<a>", "\u00e9"])).map(
        lambda parts: "/" + "/".join(parts)
    ),
)
BAD_INPUT_APPS = {
    "reject": GateKeeperMiddleware(
        ok_app,
        {
            "project": "shop",
            "routes": {"/orders/<int:id>": "order", "/files/<path:rest>": "files"},
            "limits": {"shop/*/*": {"concurrency": 0}},
        },
    ),
    "rate": GateKeeperMiddleware(
        ok_app,
        {
            "project": "shop",
            "routes": {"/orders/<int:id>": "order"},
            "limits": {"shop/*/*": {"rate": "1/hour", "key": "header:X-Caller-Id"}},
        },
    ),
    "required": GateKeeperMiddleware(ok_app, {"project": "shop", "caller": {"required": True}}),
    "admit": GateKeeperMiddleware(
        ok_app,
        {"project": "shop", "limits": {"shop": {"concurrency": 1}, "shop/*/*": {"concurrency": 1}}},
    ),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(BAD_INPUT_APPS)),
    caller=header_text,
    request_id=header_text,
    accept=header_text,
    path=path_text,
    query=header_text,
    content_type=st.sampled_from(["", "text/xml", "application/soap+xml", "application/json"]),
)
def test_bad_input_never_raises_and_faults_stay_well_formed(
    kind: str, caller: str, request_id: str, accept: str, path: str, query: str, content_type: str
) -> None:
    """Any caller, request id, Accept, path or query gets an answer, never an exception."""
    mw = BAD_INPUT_APPS[kind]
    environ = environ_for("/")
    environ.update(
        PATH_INFO=path,
        QUERY_STRING=query,
        CONTENT_TYPE=content_type,
        HTTP_X_CALLER_ID=caller,
        HTTP_X_REQUEST_ID=request_id,
        HTTP_ACCEPT=accept,
    )
    recorder = StartResponseRecorder()
    result = mw(environ, recorder)
    try:
        body = b"".join(result)
    finally:
        getattr(result, "close", lambda: None)()
    assert all_zero(mw.gatekeeper)
    assert recorder.status is not None
    status = int(recorder.status[:3])
    if status == 200:
        assert body == b"hello world"
        return
    for name, value in recorder.headers:
        assert PRINTABLE_ASCII.fullmatch(value), (name, value)
    assert header(recorder.headers, "Content-Length") == str(len(body))
    echoed = header(recorder.headers, "X-Request-Id")
    assert echoed is not None
    if echoed != request_id:
        assert GENERATED_ID.fullmatch(echoed)
    assert re.fullmatch(r"[A-Za-z0-9._:@/+=-]{1,128}", echoed)
    content_type_out = header(recorder.headers, "Content-Type") or ""
    if content_type_out == "application/problem+json":
        problem = json.loads(body.decode("ascii"))
        assert problem["status"] == status
        assert problem["requestId"] == echoed
        code = problem["code"]
    else:
        root = fromstring(body)
        faults = list(root.iter(f"{NS}ServiceFault"))
        assert len(faults) == 1
        assert faults[0].findtext(f"{NS}requestId") == echoed
        code = faults[0].findtext(f"{NS}code")
    assert code in FAULT_CODES
    assert status == (500 if "soap" in content_type_out else FAULT_CODES[code][0])


# -- the rejected-request log ---------------------------------------------------------------


@pytest.fixture
def rejected_lines(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The lines logged on `gatekeeper.rejected` since the test started, each time once the
    background thread has handled every record logged so far (earlier tests' included)."""
    assert rejectlog.flush()
    caplog.set_level(logging.INFO, logger="gatekeeper.rejected")
    caplog.clear()

    def lines() -> list[str]:
        assert rejectlog.flush()
        return [r.getMessage() for r in caplog.records if r.name == "gatekeeper.rejected"]

    return lines


def test_rejected_request_is_logged_as_one_json_line_with_secrets_redacted(
    make: Any, rejected_lines: Callable[[], list[str]]
) -> None:
    """Each rejection writes one JSON line to `gatekeeper.rejected`, secrets redacted."""
    mw = make(
        ok_app,
        {
            "project": "shop",
            "rejected_log": {"redact_headers": ["X-Api-Key"]},
            "limits": {"shop/orders": {"concurrency": 0}},
        },
    )
    fetch(mw, "/other")  # admitted: not logged (it would come first in the log)
    response = Client(mw, use_cookies=False).post(
        "/orders/7?expand=items",
        data=b'{"item": 1}',
        content_type="application/json",
        headers={
            "Authorization": "Bearer s3cret",
            "Cookie": "session=s3cret",
            "Proxy-Authorization": "Basic s3cret",
            "X-Api-Key": "s3cret",
            "X-Caller-Id": "crm",
            "X-Request-Id": "log-1",
            "X-Note": "a\x01b",
        },
        buffered=True,
    )
    assert response.status_code == 503
    lines = rejected_lines()
    assert len(lines) == 1
    line = lines[0]
    assert "\n" not in line and "\r" not in line
    assert "s3cret" not in line
    assert PRINTABLE_ASCII.fullmatch(line)
    record = json.loads(line)
    assert record["requestId"] == "log-1"
    assert record["code"] == "GK-CONCURRENCY-LIMIT"
    assert record["limit"] == {"path": "shop/orders", "value": 0}
    assert record["method"] == "POST"
    assert record["path"] == "/orders/7"
    assert record["query"] == "expand=items"
    assert record["body"] == '{"item": 1}'
    headers = record["headers"]
    for name in ("Authorization", "Cookie", "Proxy-Authorization", "X-Api-Key"):
        assert headers[name] == "[redacted]"
    assert headers["X-Caller-Id"] == "crm"
    assert headers["X-Note"] == "a\x01b"


def test_rejected_log_escapes_junk(
    refusing: Refusing, rejected_lines: Callable[[], list[str]]
) -> None:
    """Junk in a rejected request is logged escaped: still one parseable JSON line."""
    mw = refusing()
    for junk in JUNK:
        environ = environ_for("/x")
        environ["HTTP_X_CALLER_ID"] = junk
        environ["HTTP_X_REQUEST_ID"] = junk
        environ["PATH_INFO"] = "/" + junk
        b"".join(mw(environ, StartResponseRecorder()))
    lines = rejected_lines()
    assert len(lines) == len(JUNK)
    for junk, line in zip(JUNK, lines, strict=True):
        assert PRINTABLE_ASCII.fullmatch(line)
        record = json.loads(line)
        # SPEC §4.8: a logged header value is capped at 1 KiB.
        assert record["headers"]["X-Caller-Id"] == junk[:1024]
        assert GENERATED_ID.fullmatch(record["requestId"])


# -- engine conformance through the middleware, per backend ---------------------------------


@pytest.fixture
def backend_app(
    backend_url: str, clock: FakeClock
) -> Iterator[Callable[..., GateKeeperMiddleware]]:
    """Middleware factory on a fresh backend of each kind."""
    keepers: list[GateKeeper] = []

    def build(app: WSGIApplication, limits: dict[str, Any]) -> GateKeeperMiddleware:
        keeper = GateKeeper(
            {"project": "shop", "backend": backend_url, "limits": limits}, clock=clock
        )
        keepers.append(keeper)
        return GateKeeperMiddleware(app, keeper)

    yield build
    for keeper in keepers:
        keeper.close()


def test_conformance_exact_concurrency_under_threads(backend_app: Any) -> None:
    """However many threads arrive at once, exactly `concurrency` requests are admitted."""
    total, limit = 24, 3
    state = threading.Condition()
    counts = {"entered": 0, "rejected": 0}
    go = threading.Event()

    def decided() -> bool:
        return counts["entered"] + counts["rejected"] == total

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        with state:
            counts["entered"] += 1
            state.notify_all()
        assert go.wait(30)
        return ok_app(environ, start_response)

    mw = backend_app(app, {"shop/api": {"concurrency": limit}})
    barrier = threading.Barrier(total)
    statuses: list[int] = []

    def client() -> None:
        barrier.wait(30)
        response = fetch(mw, "/api")
        statuses.append(response.status_code)
        if response.status_code == 503:
            with state:
                counts["rejected"] += 1
                state.notify_all()

    for _round in range(3):
        counts.update(entered=0, rejected=0)
        go.clear()
        statuses.clear()
        threads = [threading.Thread(target=client) for _ in range(total)]
        for thread in threads:
            thread.start()
        with state:
            assert state.wait_for(decided, 30)
        assert counts["entered"] == limit
        assert busy(mw.gatekeeper) == {"shop/api": limit}
        go.set()
        for thread in threads:
            thread.join(30)
        assert sorted(statuses) == [200] * limit + [503] * (total - limit)
        assert all_zero(mw.gatekeeper)


def test_conformance_all_or_nothing_across_levels(backend_app: Any) -> None:
    """A request refused at one level takes no slot at the others."""
    mw = backend_app(
        ok_app,
        {"shop": {"concurrency": 2}, "shop/a": {"concurrency": 1}, "shop/a/*": {"concurrency": 5}},
    )
    held = start(mw, "/a", headers={"X-Caller-Id": "crm"})
    refused = fetch(mw, "/a", headers={"X-Caller-Id": "erp"})
    assert refused.status_code == 503
    assert fault_fields(refused)["level"] == "service"
    assert busy(mw.gatekeeper) == {"shop": 1, "shop/a": 1, "shop/a/crm": 1}
    other = start(mw, "/b")
    refused = fetch(mw, "/c")
    assert fault_fields(refused)["limit"] == {"path": "shop", "value": 2}
    assert busy(mw.gatekeeper) == {"shop": 2, "shop/a": 1, "shop/a/crm": 1}
    held.close()
    other.close()
    assert all_zero(mw.gatekeeper)


def test_conformance_rate_window(backend_app: Any, clock: FakeClock) -> None:
    """A rate admits N per rolling window, then again once the window has moved on."""
    mw = backend_app(ok_app, {"shop/api/*": {"rate": "3/2s"}})
    gk = mw.gatekeeper
    caller = {"X-Caller-Id": "crm"}
    assert [fetch(mw, "/api", headers=caller).status_code for _ in range(4)] == [200] * 3 + [429]
    assert fetch(mw, "/api", headers={"X-Caller-Id": "erp"}).status_code == 200
    if follows_engine_clock(gk):
        clock.advance(1.5)
        assert fetch(mw, "/api", headers=caller).status_code == 429
        clock.advance(0.5)
        assert fetch(mw, "/api", headers=caller).status_code == 200
    else:
        after(2.0, clock, gk, lambda: fetch(mw, "/api", headers=caller).status_code == 200)
    assert all_zero(gk)


def test_conformance_delayed_release(backend_app: Any, clock: FakeClock) -> None:
    """A faulty response holds its slot for `delay`, then it comes back by itself."""
    mw = backend_app(
        Streaming([b"x"], status="504 Gateway Timeout"),
        {"shop/api": {"concurrency": 1, "delay": 0.5}},
    )
    gk = mw.gatekeeper
    fetch(mw, "/api")
    if follows_engine_clock(gk):
        assert busy(gk) == {"shop/api": 1}
        assert fetch(mw, "/api").status_code == 503
    after(0.5, clock, gk, lambda: all_zero(gk))


def test_conformance_count_statuses(backend_app: Any) -> None:
    """A rate counting only 401s is exhausted by failures, not by successes."""
    mw = backend_app(login_app, {"shop/login/*": {"rate": "2/hour", "key": "ip", "count": [401]}})
    for _ in range(5):
        assert fetch(mw, "/login?password=secret").status_code == 200
    assert fetch(mw, "/login").status_code == 401
    assert fetch(mw, "/login").status_code == 401
    assert fetch(mw, "/login?password=secret").status_code == 429
    assert all_zero(mw.gatekeeper)


def test_sized_body_keeps_its_len_and_unsized_has_none(make: Any) -> None:
    """A list body keeps len() behind the middleware (servers add Content-Length for a
    one-element body); a generator body offers no len() a server could trip over."""
    mw = make(ok_app, HOLD)
    result, recorder = serve(mw, "/")
    assert len(result) == 2  # type: ignore[arg-type]  # ok_app answers two chunks
    drain(result, recorder)
    streamed, recorder = serve(make(Streaming(), HOLD), "/")
    assert not hasattr(streamed, "__len__")
    drain(streamed, recorder)
    streamed.close()  # type: ignore[attr-defined]
    result.close()  # type: ignore[attr-defined]


@contextmanager
def collector_off() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _generator_app(environ: Any, start_response: Any) -> Iterator[bytes]:
    """A streaming app as PEP 3333 writes one: a generator that keeps what it was given
    (``start_response`` and the ``write`` it returns) in its frame while it runs."""
    write = start_response("200 OK", [("Content-Type", "text/plain")])
    yield b"part 1"
    write(b"")
    yield b"part 2"


class _BodyKeepingStart:
    """A body object that keeps ``start_response`` as an attribute."""

    def __init__(self, environ: Any, start_response: Any) -> None:
        self.start_response = start_response
        start_response("200 OK", [])

    def __iter__(self) -> Iterator[bytes]:
        yield b"body"


@pytest.mark.parametrize("app", [_generator_app, _BodyKeepingStart], ids=["generator", "body"])
def test_a_dropped_streaming_response_comes_back_at_once(app: Any) -> None:
    """A test client without ``with`` drops the response unclosed: its slot (and a rate
    reservation of a status not counted) comes back as soon as the last reference goes,
    not when the cycle collector runs (it is off here): what the app keeps of
    ``start_response`` does not hold the response (SPEC 4.2)."""
    gk = GateKeeper(
        {
            "project": "shop",
            "limits": {
                "shop/stream": {"concurrency": 1},
                "shop/login/*": {"rate": "2/minute", "key": "ip", "count": [401]},
            },
        }
    )
    client = Client(GateKeeperMiddleware(app, gk))
    with collector_off():
        assert [client.get("/stream").status_code for _ in range(5)] == [200] * 5
        assert [client.get("/login").status_code for _ in range(4)] == [200] * 4
        assert busy(gk) == {}


def test_a_response_collected_inside_the_backends_lock_never_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The garbage collector runs whenever an allocation calls for it, on any thread, also
    inside the memory backend's lock: a response it finds there unclosed (in a reference
    cycle: a body that calls start_response itself) is released by the next call into
    the engine, never by waiting for that lock, which hung the worker and every thread
    behind it."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def body() -> Iterator[bytes]:  # response -> generator -> start_response -> response
            start_response("200 OK", [("Content-Type", "text/plain")])
            yield b"hello"

        return body()

    middleware = GateKeeperMiddleware(app, {"project": "p", "limits": {"p/*": {"concurrency": 5}}})
    backend = middleware.gatekeeper.backend
    create = backend._create  # type: ignore[attr-defined]  # runs under the lock

    def collecting(*args: Any) -> Any:
        gc.collect()
        return create(*args)

    gc.disable()
    try:
        dropped = middleware(environ_for("/first"), lambda *args: None)
        del dropped  # unclosed, unread, in a cycle: garbage for the collector
        monkeypatch.setattr(backend, "_create", collecting)
        served: list[Iterable[bytes]] = []
        worker = threading.Thread(
            target=lambda: served.append(middleware(environ_for("/second"), lambda *a: None)),
            daemon=True,
        )
        worker.start()
        worker.join(timeout=60)  # a bound for the failure only: it returns at once
        assert not worker.is_alive(), "the request waited for the lock its thread held"
    finally:
        gc.enable()
    assert middleware.gatekeeper.inflight() == {"p/first": 0, "p/second": 1}
    b"".join(served[0])
    assert middleware.gatekeeper.inflight() == {"p/first": 0, "p/second": 0}


class _Sized(list):  # type: ignore[type-arg]
    """A list subclass: a sized body that is not exactly a list."""


@pytest.mark.parametrize(
    "case", ["CONTENT-LENGTH", "content-length", " 5 ", "tuple", "subclass", "write", "lazy"]
)
def test_a_sized_body_is_released_before_its_last_byte_goes_out(case: str) -> None:
    """However the app gives its length - a Content-Length in any letter case or with
    blanks, a tuple or a list subclass (which servers size), a body written through
    PEP 3333's write(), a generator that calls start_response when first iterated (an
    empty piece before it) - the slot is free when the server takes the body's last
    piece: the client has its whole answer with it, and its next request must fit."""
    middleware: GateKeeperMiddleware

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if case == "lazy":

            def body() -> Iterator[bytes]:
                yield b""
                start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
                yield b"hel"
                yield b"lo"

            return body()
        if case in ("tuple", "subclass"):
            start_response("200 OK", [("Content-Type", "text/plain")])
            return (b"hel", b"lo") if case == "tuple" else _Sized([b"hel", b"lo"])
        name, value = ("Content-Length", case) if case.strip().isdigit() else (case, "5")
        if case == "write":
            name = "Content-Length"
        write = start_response("200 OK", [("Content-Type", "text/plain"), (name, value)])
        if case == "write":
            write(b"hel")
            write(b"lo")
            return []
        return iter([b"hel", b"lo"])

    middleware = GateKeeperMiddleware(
        app, {"project": "shop", "limits": {"shop": {"concurrency": 1}}}
    )
    sent: list[tuple[bytes, int]] = []  # each piece as it goes out, and the count then

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        return lambda data: sent.append((data, middleware.gatekeeper.inflight()["shop"]))

    result = middleware(environ_for("/"), start_response)
    for piece in result:
        sent.append((piece, middleware.gatekeeper.inflight()["shop"]))
    result.close()  # type: ignore[attr-defined]
    assert [(piece, count) for piece, count in sent if piece] == [(b"hel", 1), (b"lo", 0)]
    assert middleware.gatekeeper.inflight() == {"shop": 0}
