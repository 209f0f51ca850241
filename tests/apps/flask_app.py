"""The Flask app the gunicorn tests serve: ``gunicorn --threads 8 'flask_app:create_app()'``
(with ``--pythonpath tests/apps``).

An :class:`Observer` counts the executions inside each limited view (and inside the
streamed bodies), so a test can compare the peak concurrency the app really saw with the
limit. ``/_test/*`` endpoints are exempt: they report the observer and the engine, and open
the gates that hold requests in flight, so the tests synchronise on events, not sleeps.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flask import Blueprint, Flask, Response, jsonify, request, stream_with_context
from gatekeeper_wsgi.contrib.flask import GateKeeper

#: A gate left closed holds its requests at most this long, so a failed test cannot hang.
GATE_TIMEOUT = 30.0
#: Real (small) delay after a faulty response, so the test sees the slot come back.
FAULT_DELAY = 0.3

gk = GateKeeper()
api = Blueprint("api", __name__, url_prefix="/api")
gk.limit_blueprint(api, concurrency=4)


class Observer:
    """Counts the executions in progress per name and the highest count seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    @contextmanager
    def inside(self, *names: str) -> Iterator[None]:
        with self._lock:
            for name in names:
                count = self.current[name] = self.current.get(name, 0) + 1
                self.peak[name] = max(self.peak.get(name, 0), count)
        try:
            yield
        finally:
            with self._lock:
                for name in names:
                    self.current[name] -= 1


observer = Observer()
gates: dict[str, threading.Event] = {"hold": threading.Event(), "stream": threading.Event()}


def _work() -> bytes:
    # Real work that releases the GIL (hashlib does for large inputs), so threads overlap.
    return hashlib.sha256(b"x" * 400_000).hexdigest().encode()


@api.route("/a")
@gk.limit(concurrency=3)
def api_a() -> bytes:
    with observer.inside("api", "api/a"):
        return _work()


@api.route("/b")
@gk.limit(concurrency=3)
def api_b() -> bytes:
    with observer.inside("api", "api/b"):
        return _work()


def create_app() -> Flask:
    """The app factory gunicorn calls."""
    app = Flask(__name__)
    app.config["GATEKEEPER"] = {"project": "demo"}

    @app.route("/hold")
    @gk.limit(concurrency=2)
    def hold() -> str:
        with observer.inside("hold"):
            gates["hold"].wait(GATE_TIMEOUT)
        return "held"

    @app.route("/stream")
    @gk.limit(concurrency=1)
    def stream() -> Response:
        def generate() -> Iterator[str]:
            with observer.inside("stream"):
                # The request context is still alive while the body streams.
                yield f"first {request.args.get('n', '')}\n"
                gates["stream"].wait(GATE_TIMEOUT)
                yield "last\n"

        return Response(stream_with_context(generate()), mimetype="text/plain")

    @app.route("/stream-fail")
    @gk.limit(concurrency=1, delay=FAULT_DELAY)
    def stream_fail() -> Response:
        def generate() -> Iterator[str]:
            yield "partial\n"
            raise RuntimeError("backend failed mid-stream")

        return Response(stream_with_context(generate()), mimetype="text/plain")

    @app.route("/_test/state")
    @gk.exempt
    def state() -> Response:
        engine = gk.gatekeeper
        stats: dict[str, Any] = engine.stats()
        return jsonify(
            inflight=engine.inflight(),
            peak=observer.peak,
            current=observer.current,
            faulty_releases=stats["stages"]["service_error"]["count"],
            admitted=stats["counters"]["admitted"],
        )

    @app.route("/_test/open/<name>", methods=["POST"])
    @gk.exempt
    def open_gate(name: str) -> str:
        gates[name].set()
        return "open"

    @app.route("/_test/close/<name>", methods=["POST"])
    @gk.exempt
    def close_gate(name: str) -> str:
        gates[name].clear()
        return "closed"

    app.register_blueprint(api)
    gk.init_app(app)
    return app
