"""WSGI apps the tests serve with a real server (gunicorn), and the helpers the tests name by
dotted path in settings (``caller.resolver``, ``fault.renderer``).

Served as ``tests.apps.wsgi_apps:app`` from the repository root. The gatekeeper's
``inflight()`` is published on ``/_status``, a path no limit applies to, so a test can watch
the slots of the requests it disconnected come back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

#: The file ``/file`` sends through ``wsgi.file_wrapper`` (set by the test that serves it).
FILE_ENV = "GK_TEST_FILE"
CHUNK = b"x" * 16384
#: A cap, so a stream whose client is gone ends even if the server never noticed.
MAX_CHUNKS = 200_000

SETTINGS = {
    "project": "demo",
    "limits": {
        # No project-level limit: /_status stays exempt and always answers.
        "demo/stream": {"concurrency": 64},
        "demo/stream/*": {"concurrency": 2},
        "demo/boom": {"concurrency": 64},
        "demo/file": {"concurrency": 64},
    },
}


def caller_from_user(environ: WSGIEnvironment) -> str | None:
    """A ``caller.resolver``: the authenticated user instead of the caller header."""
    user = environ.get("REMOTE_USER")
    return user if isinstance(user, str) else None


def plain_text_fault(
    rejected: Rejected, request_id: str, environ: WSGIEnvironment
) -> tuple[str, str]:
    """A ``fault.renderer``: a site's own one-line plain text fault."""
    return "text/plain; charset=utf-8", f"{rejected.code} {rejected.status} {request_id}\n"


def _stream() -> Iterator[bytes]:
    for _ in range(MAX_CHUNKS):
        yield CHUNK


def _boom() -> Iterator[bytes]:
    for _ in range(64):
        yield CHUNK
    raise RuntimeError("backend failed mid-stream")


def inner_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    """``/stream``: a practically endless body; ``/boom``: a body that fails after 1 MiB;
    ``/file``: a file through ``wsgi.file_wrapper``; ``/_status``: the gatekeeper's
    in-flight counters as JSON."""
    path = environ.get("PATH_INFO") or "/"
    if path == "/_status":
        body = json.dumps(gatekeeper.inflight()).encode()
        start_response(
            "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]
    if path == "/stream":
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return _stream()
    if path == "/boom":
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return _boom()
    if path == "/file":
        name = os.environ[FILE_ENV]
        size = os.path.getsize(name)
        start_response(
            "200 OK",
            [("Content-Type", "application/octet-stream"), ("Content-Length", str(size))],
        )
        return environ["wsgi.file_wrapper"](open(name, "rb"), 65536)
    start_response("404 Not Found", [("Content-Type", "text/plain")])
    return [b"not found\n"]


gatekeeper = GateKeeper(SETTINGS)
app = GateKeeperMiddleware(inner_app, gatekeeper)
