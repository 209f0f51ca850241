"""The example as a Flask app, limited by the gatekeeper-wsgi Flask extension.

``python -m example_site`` serves it on 127.0.0.1:8000; ``create_app()`` builds it (the
``GATEKEEPER`` settings come from :func:`example_site.common.gatekeeper_settings`).
"""

from __future__ import annotations

from collections.abc import Callable

from flask import Flask, Response, request
from gatekeeper_wsgi.contrib.flask import GateKeeper

from example_site.common import (
    PASSWORD,
    TIMEOUT_MARKER,
    Capacity,
    Work,
    gatekeeper_settings,
    index,
    queue_wait_header,
    search_answer,
    stamp_arrival,
)


def create_app(work: Work | None = None, clock: Callable[[], float] | None = None) -> Flask:
    """The example Flask app; ``work`` is what /slow and /partner do, ``clock`` goes to the
    engine (tests pass both)."""
    app = Flask("example_site")
    app.config["GATEKEEPER"] = gatekeeper_settings()
    gk = GateKeeper(clock=clock)
    work = work or Work()
    app.extensions["example_work"] = work

    @app.route("/")
    @gk.exempt
    def home() -> Response:
        port = int(request.environ.get("SERVER_PORT") or 8000)
        return Response(index("Flask", port), mimetype="text/plain")

    @app.route("/slow")
    def slow() -> Response:
        waited = queue_wait_header(request.environ)
        work.run()
        return Response("done: slow\n", headers=waited)

    @app.route("/flaky")
    def flaky() -> Response:
        # The backend behind this service timed out: the marker holds the slot `delay` s.
        return Response("backend timed out\n", headers=[TIMEOUT_MARKER])

    @app.route("/login", methods=["POST"])
    def login() -> Response:
        if request.form.get("password") == PASSWORD:
            return Response("welcome\n")
        return Response("wrong password\n", status=401)

    @app.route("/partner")
    def partner() -> Response:
        work.run()
        return Response(f"done: partner for {request.headers.get('X-Caller-Id', 'anonymous')}\n")

    search_backend = Capacity()

    @app.route("/search")
    def search() -> Response:
        search_backend.call()
        return Response(search_answer(gk.gatekeeper))

    gk.init_app(app)
    app.register_blueprint(gk.status_blueprint(url_prefix="/gatekeeper"))
    # Outermost, so the stamp is taken before the gatekeeper can queue the request.
    app.wsgi_app = stamp_arrival(app.wsgi_app)  # type: ignore[method-assign]
    return app
