"""A small werkzeug-served app that shows every kind of limit.

Run ``python -m example_site`` and try the curl lines it prints. Memory backend, no server
to install.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from werkzeug.wrappers import Request, Response

from gatekeeper_wsgi import GateKeeperMiddleware

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

SETTINGS = {
    "project": "demo",
    "limits": {
        "demo": {"concurrency": 50},
        # Two at a time; two more may wait up to 1 s, the rest are turned away at once.
        "demo/slow": {"concurrency": 2, "queue": {"size": 2, "wait": 1.0}},
        # A backend that answers "X-Fault-Code: TIMEOUT" keeps its slot 5 s longer.
        "demo/flaky": {"concurrency": 1, "delay": 5.0, "timeout_header": "X-Fault-Code: TIMEOUT"},
        # Password guessing: 5 failed logins (401) per minute per client address.
        "demo/login/*": {"rate": "5/minute", "key": "ip", "count": [401]},
        # Each calling system (X-Caller-Id) may have one request in flight.
        "demo/partner/*": {"concurrency": 1},
    },
}

INDEX = """gatekeeper-wsgi demo

  /slow      concurrency 2, queue of 2 waiting up to 1 s (each call takes 2 s)
  /flaky     answers with a timeout marker; its slot is held 5 s afterwards
  /login     POST password=secret; 5 failed logins per minute per IP
  /partner   one request in flight per X-Caller-Id (each call takes 2 s)
  /status    live in-flight counters and statistics (JSON)

Try:
  for i in 1 2 3 4 5; do curl -s localhost:{port}/slow & done; wait
  curl -s localhost:{port}/flaky; curl -s -H 'Accept: application/xml' localhost:{port}/flaky
  for i in 1 2 3 4 5 6; do curl -s -X POST -d password=guess localhost:{port}/login; echo; done
"""


def make_app(port: int = 8000) -> GateKeeperMiddleware:
    """The demo app wrapped in the middleware."""
    gatekeeper: GateKeeperMiddleware

    @Request.application  # type: ignore[arg-type]
    def app(request: Request) -> Response:
        path = request.path
        if path in ("/slow", "/partner"):
            time.sleep(2.0)  # stands for a slow backend call
            return Response(f"done: {path}\n")
        if path == "/flaky":
            return Response("backend timed out\n", headers={"X-Fault-Code": "TIMEOUT"})
        if path == "/login":
            if request.form.get("password") == "secret":
                return Response("welcome\n")
            return Response("wrong password\n", status=401)
        if path == "/status":
            import json

            keeper = gatekeeper.gatekeeper
            body = {"inflight": keeper.inflight(), "stats": keeper.stats()["counters"]}
            return Response(json.dumps(body, indent=2) + "\n", mimetype="application/json")
        return Response(INDEX.replace("{port}", str(port)))

    def exempt_status(environ: WSGIEnvironment) -> tuple[str, str] | None:
        if environ.get("PATH_INFO") == "/status":
            return None
        return "demo", _service(environ)

    def _service(environ: WSGIEnvironment) -> str:
        segment = (environ.get("PATH_INFO") or "/").strip("/").split("/")[0]
        return segment or "root"

    gatekeeper = GateKeeperMiddleware(app, SETTINGS, identify=exempt_status)
    return gatekeeper


def serve(port: int = 8000) -> None:
    """Serve the demo on 127.0.0.1 with a thread per request."""
    from werkzeug.serving import run_simple

    print(INDEX.replace("{port}", str(port)))

    def application(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return wsgi(environ, start_response)

    wsgi = make_app(port)
    run_simple("127.0.0.1", port, application, threaded=True)
