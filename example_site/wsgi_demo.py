"""The example as a bare WSGI app (werkzeug, no framework), wrapped in
:class:`~gatekeeper_wsgi.GateKeeperMiddleware`; ``python -m example_site --wsgi``.

Services are named by the first path segment; the dashboard is a
:class:`~gatekeeper_wsgi.status.StatusApp` mounted beside the limited app.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.wrappers import Request, Response

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
from gatekeeper_wsgi import GateKeeperMiddleware
from gatekeeper_wsgi.status import StatusApp

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment


class ExampleWSGI:
    """The example as one WSGI callable; ``.gatekeeper`` is its engine."""

    def __init__(self, work: Work | None = None) -> None:
        self.work = work or Work()
        self.search = Capacity()
        limited = GateKeeperMiddleware(self.app, gatekeeper_settings())
        self.gatekeeper = limited.gatekeeper
        dispatch = DispatcherMiddleware(limited, {"/gatekeeper": StatusApp(self.gatekeeper)})
        # Outermost, so the stamp is taken before the gatekeeper can queue the request.
        self._wsgi = stamp_arrival(dispatch)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return self._wsgi(environ, start_response)

    @Request.application  # type: ignore[arg-type]
    def app(self, request: Request) -> Response:
        path = request.path
        if path == "/slow":
            waited = queue_wait_header(request.environ)
            self.work.run()
            return Response("done: slow\n", headers=waited)
        if path == "/flaky":
            return Response("backend timed out\n", headers=[TIMEOUT_MARKER])
        if path == "/login" and request.method == "POST":
            if request.form.get("password") == PASSWORD:
                return Response("welcome\n")
            return Response("wrong password\n", status=401)
        if path == "/partner":
            self.work.run()
            return Response(
                f"done: partner for {request.headers.get('X-Caller-Id', 'anonymous')}\n"
            )
        if path == "/search":
            self.search.call()
            return Response(search_answer(self.gatekeeper))
        if path == "/":
            return Response(index("bare WSGI", int(request.environ.get("SERVER_PORT") or 8000)))
        return Response("not found\n", status=404)
