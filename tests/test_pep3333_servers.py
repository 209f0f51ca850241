"""PEP 3333 exactness under real servers (gunicorn sync and gthread, waitress, and uWSGI
where it is installed): a client's strictly sequential requests at concurrency 1 are never
refused by its own previous one (slots come back when the body is exhausted, before the
server's close()); the app's close() runs exactly once when a client disconnects; a
one-element body keeps its automatic Content-Length; a file response (``wsgi.file_wrapper``,
Flask's ``send_file``) read whole never refuses the client's next request either."""

from __future__ import annotations

import http.client
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest

from tests.apps import pep3333_app
from tests.servers import DEADLINE, UWSGI, Gunicorn, Waitress, uwsgi_binary, wait_until

pytestmark = pytest.mark.slow

APPS = str(Path(__file__).parent / "apps")

#: CI sets this (and installs uwsgi, which compiles from source), so a missing uwsgi fails there.
REQUIRE_UWSGI = os.environ.get("GATEKEEPER_REQUIRE_UWSGI") == "1"
needs_uwsgi = pytest.mark.skipif(
    uwsgi_binary() is None and not REQUIRE_UWSGI,
    reason="uwsgi is not installed (pip install uwsgi)",
)


def start_server(kind: str, app: str, workdir: Path) -> Gunicorn:
    """A real server of ``kind`` serving ``pep3333_app:<app>``, its observer in workdir."""
    env = {"GATEKEEPER_TEST_OBSERVED": str(workdir / "observed"), "PYTHONPATH": APPS}
    target = f"pep3333_app:{app}"
    if kind == "gunicorn-sync":
        server = Gunicorn(workdir, "--workers", "1", "--pythonpath", APPS, target, env=env)
    elif kind == "gunicorn-gthread":
        args = ("--workers", "1", "--threads", "4", "--pythonpath", APPS, target)
        server = Gunicorn(workdir, *args, env=env)
    elif kind == "waitress":
        server = Waitress(workdir, "--threads=4", target, env=env)
    else:
        server = UWSGI(workdir, "--threads", "4", "--module", target, env=env)
    server.start()
    return server


SERVERS = [
    "gunicorn-sync",
    "gunicorn-gthread",
    "waitress",
    pytest.param("uwsgi", marks=needs_uwsgi),
]


@pytest.fixture(params=SERVERS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["bare", "flask_app"])
def app(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(kind: str, app: str, tmp_path: Path) -> Iterator[Gunicorn]:
    server = start_server(kind, app, tmp_path)
    try:
        yield server
    finally:
        server.stop()


def observed(server: Gunicorn) -> list[str]:
    path = server.workdir / "observed"
    return path.read_text().splitlines() if path.exists() else []


def test_back_to_back_requests_at_concurrency_1_are_never_refused(server: Gunicorn) -> None:
    """100 strictly sequential requests, each read to its end before the next is sent, on
    fresh connections and on one kept-alive connection: every one is admitted."""
    statuses = [server.request("/one")[0] for _ in range(50)]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    try:
        for _ in range(50):
            connection.request("GET", "/one")
            response = connection.getresponse()
            assert response.read() == b"hello", (len(statuses), response.headers)
            statuses.append(response.status)
            if response.will_close:  # gunicorn's sync worker closes every connection
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    finally:
        connection.close()
    assert statuses == [200] * 100, statuses


def test_a_file_read_whole_never_refuses_the_next_request(server: Gunicorn) -> None:
    """A file response (the server's sendfile path before) read to its end, then the next
    request at once on a fresh connection, 100 times: every one is admitted. The slot comes
    back as the file's last byte is handed out, not at the server's close() (gunicorn's
    comes after its access log line, waitress's after its event loop sent the file)."""
    statuses = []
    for _ in range(50):
        assert server.request("/file") == (200, pep3333_app.FILE_BODY)
        statuses.append(server.request("/one")[0])
    assert statuses == [200] * 50, statuses


def test_a_head_answered_never_refuses_the_next_request(server: Gunicorn) -> None:
    """A HEAD of a streamed body: the client has the whole response with its headers (and
    the body, which the server drops, ends there). The next request at once, on a fresh
    connection, 50 times: every one is admitted (the slot comes back before the headers go
    out)."""
    statuses = []
    for _ in range(50):
        assert server.request("/chunks", method="HEAD") == (200, b"")
        statuses.append(server.request("/one")[0])
    assert statuses == [200] * 50, statuses


@pytest.mark.parametrize("app", ["bare"])
@pytest.mark.parametrize("path", ["/upper", "/spaced", "/write", "/tuple"])
def test_a_sized_body_in_any_spelling_never_refuses_the_next_request(
    server: Gunicorn, path: str
) -> None:
    """A body whose length the client knows however the app gave it (a Content-Length
    spelled in capitals or with blanks, a body written through write(), a one-element
    tuple the server sizes): read whole, then the next request at once on a fresh
    connection, 50 times: every one is admitted."""
    statuses = []
    for _ in range(50):
        assert server.request(path) == (200, b"hello")
        statuses.append(server.request("/one")[0])
    assert statuses == [200] * 50, statuses


def disconnect_mid_stream(server: Gunicorn) -> None:
    """Start the endless stream, read some of it, then vanish (RST, not a clean close)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE)
    try:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received = 0
        while received < 200_000:
            data = sock.recv(65536)
            assert data, "the server ended the endless stream"
            received += len(data)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def test_client_disconnect_closes_the_app_once_and_frees_the_slot(
    server: Gunicorn, app: str
) -> None:
    """Three clients vanish mid-stream one after another: the app's close() (Flask's
    call_on_close) ran exactly once for each, and the slot came back each time."""
    name = "closed bare" if app == "bare" else "closed flask"
    for round in range(1, 4):
        disconnect_mid_stream(server)
        # At concurrency 1, a 200 means the streaming request was released, which happens
        # after (and so counts) every close() its server made.
        wait_until(lambda: server.request("/one")[0] == 200, what="the slot back")
        assert observed(server) == [name] * round


@pytest.mark.parametrize("kind", ["waitress"])
def test_one_element_body_keeps_content_length_under_waitress(server: Gunicorn) -> None:
    """waitress still adds Content-Length to a one-element body behind the middleware."""
    connection, response = server.open("/one")
    try:
        assert response.read() == b"hello"
        assert response.getheader("Content-Length") == "5"
        assert response.getheader("Transfer-Encoding") is None
    finally:
        connection.close()


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_one_element_body_keeps_content_length_under_wsgiref(tmp_path: Path) -> None:
    """wsgiref's server (a real socket) still adds Content-Length behind the middleware."""
    os.environ["GATEKEEPER_TEST_OBSERVED"] = str(tmp_path / "observed")
    httpd = make_server("127.0.0.1", 0, pep3333_app.bare, handler_class=QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", httpd.server_port, timeout=DEADLINE)
        connection.request("GET", "/one")
        response = connection.getresponse()
        assert response.read() == b"hello"
        assert response.getheader("Content-Length") == "5"
        connection.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(DEADLINE)
