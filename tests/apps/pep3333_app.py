"""Apps for the PEP 3333 tests under real servers: the core middleware at concurrency 1
around a bare WSGI app (``bare``) and around a Flask app (``flask_app``, through the Flask
extension).

The observer: every inner ``close()`` (the bare body's, Flask's ``call_on_close``) is
appended as a line to the file named by ``GATEKEEPER_TEST_OBSERVED``, so the test counts
what really ran.

Paths: ``/one`` a one-element list body; ``/stream`` an endless stream (a client that
goes away ends it); ``/file`` a file through ``wsgi.file_wrapper`` with its
``Content-Length`` (Flask's ``send_file`` in the Flask app); ``/chunks`` a generator of a
few pieces and no ``Content-Length`` (a HEAD's is dropped by the server piece by piece);
``/upper``, ``/spaced``, ``/write``, ``/tuple`` sized bodies of the bare app in other
spellings and ways (see ``inner``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from flask import Flask, Response, send_file
from gatekeeper_wsgi.contrib.flask import GateKeeper

from gatekeeper_wsgi import GateKeeperMiddleware

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

SETTINGS = {"project": "site", "limits": {"site": {"concurrency": 1}}}
CHUNK = b"x" * 65536
FILE_BODY = b"file body " * 1000


def observed(line: str) -> None:
    with open(os.environ["GATEKEEPER_TEST_OBSERVED"], "a") as log:
        log.write(line + "\n")


class Endless:
    """A stream that never ends by itself; counts its close() calls in the observer."""

    def __iter__(self) -> Iterator[bytes]:
        while True:
            yield CHUNK

    def close(self) -> None:
        observed("closed bare")


def file_path() -> str:
    path = os.environ["GATEKEEPER_TEST_OBSERVED"] + ".file"
    if not os.path.exists(path):
        with open(path, "wb") as file:
            file.write(FILE_BODY)
    return path


def inner(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    path = environ["PATH_INFO"]
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return Endless()
    if path == "/file":
        length = str(len(FILE_BODY))
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", length)])
        # The environ's file_wrapper, as an app calls it.
        return environ["wsgi.file_wrapper"](open(file_path(), "rb"), 8192)  # type: ignore[no-any-return]
    if path == "/chunks":
        start_response("200 OK", [("Content-Type", "text/plain")])
        return pieces()
    # Sized bodies in the other ways PEP 3333 and HTTP allow: the slot must come back
    # before their last byte goes out as well.
    if path == "/upper":  # a generator, its length under another spelling
        start_response("200 OK", [("Content-Type", "text/plain"), ("CONTENT-LENGTH", "5")])
        return iter([b"hel", b"lo"])
    if path == "/spaced":  # blanks around the value
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", " 5 ")])
        return iter([b"hel", b"lo"])
    if path == "/write":  # the body written through write(), nothing returned
        write = start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "5")])
        write(b"hel")
        write(b"lo")
        return []
    if path == "/tuple":  # a one-element tuple, its length left to the server
        start_response("200 OK", [("Content-Type", "text/plain")])
        return (b"hello",)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


def pieces() -> Iterator[bytes]:
    for _ in range(8):
        yield CHUNK


bare = GateKeeperMiddleware(inner, SETTINGS)


flask_app = Flask(__name__)
GateKeeper(flask_app, SETTINGS)


@flask_app.get("/one")
def one() -> str:
    return "hello"


@flask_app.get("/chunks")
def chunks() -> Response:
    return Response(pieces(), mimetype="text/plain")


@flask_app.get("/file")
def file() -> Response:
    return send_file(file_path(), mimetype="text/plain")


@flask_app.get("/stream")
def stream() -> Response:
    def chunks() -> Iterator[bytes]:
        while True:
            yield CHUNK

    response = Response(chunks(), mimetype="application/octet-stream")
    response.call_on_close(lambda: observed("closed flask"))
    return response
