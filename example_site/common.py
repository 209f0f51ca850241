"""What the three example apps share: the limits, the dashboard token, the slow "backend
call" and the queue-wait stamp.

One setting picks the backend: ``GATEKEEPER_BACKEND`` (default ``memory``), e.g.
``shared:///dev/shm/gatekeeper-example.shm`` for all worker processes of a host or
``redis://127.0.0.1:6379/0?prefix=example`` for several hosts. It is read when an app is
built, not at import.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

    from gatekeeper_wsgi import GateKeeper

PROJECT = "demo"
BACKEND_ENV = "GATEKEEPER_BACKEND"
TOKEN_ENV = "GATEKEEPER_DASHBOARD_TOKEN"
#: seconds one call of /slow or /partner takes
WORK_SECONDS = 1.0
#: the response header telling how long a request waited before its view ran
QUEUE_WAIT_HEADER = "X-Queue-Wait-Ms"
#: the timeout marker /flaky answers with
TIMEOUT_MARKER = ("X-Fault-Code", "TIMEOUT")
PASSWORD = "secret"
#: the /search backend: this many calls at a time, SEARCH_SECONDS each; more wait (queue)
SEARCH_CAPACITY = 4
SEARCH_SECONDS = 0.1

_ARRIVED_KEY = "example_site.arrived"

INDEX = """gatekeeper-wsgi example site ({server}, backend {backend})

  GET  /slow       concurrency 2 plus a queue of 4 waiting up to 1.5 s; each call takes 1 s
  GET  /flaky      answers with the timeout marker X-Fault-Code: TIMEOUT: its slot is held 5 s
  POST /login      password=secret; 5 failed logins (401) per minute per client address
  GET  /partner    one request in flight per X-Caller-Id; each call takes 1 s
  GET  /search     concurrency "auto": its backend serves 4 at a time (0.1 s each) and
                   queues the rest; under load the adaptive limit settles near 4-6
                   (the answer tells the limit now, the load command prints it second
                   by second; so does /gatekeeper/status.json)
  GET  /gatekeeper/
                   the live dashboard (JSON: /gatekeeper/status.json), for the token
                   printed in the terminal at start-up (${token_env})

Try, in another terminal:

  for i in 1 2 3 4 5 6 7 8; do curl -s localhost:{port}/slow & done; wait
  for i in 1 2 3 4 5 6; do curl -s -X POST -d password=guess localhost:{port}/login; echo; done
  curl -s localhost:{port}/flaky; curl -s -H 'Accept: application/xml' localhost:{port}/flaky
  curl -s -H 'X-Caller-Id: crm' localhost:{port}/partner & \\
    curl -s -H 'X-Caller-Id: crm' localhost:{port}/partner; wait
  python -m example_site load --url http://127.0.0.1:{port}/slow --requests 10 --concurrency 10
  python -m example_site load --url http://127.0.0.1:{port}/search --requests 3000 --concurrency 32
  curl -s localhost:{port}/search
"""


def backend_url() -> str:
    """The backend the example uses: ``$GATEKEEPER_BACKEND``, else ``memory``."""
    return os.environ.get(BACKEND_ENV) or "memory"


def dashboard_token() -> str:
    """``$GATEKEEPER_DASHBOARD_TOKEN``; when unset, a random one, set there for the process
    (so the Django settings and the start-up banner see the same token)."""
    token = os.environ.get(TOKEN_ENV)
    if not token:
        token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(12)
    return token


def gatekeeper_settings() -> dict[str, Any]:
    """The ``GATEKEEPER`` settings of every example app."""
    return {
        "project": PROJECT,
        "backend": backend_url(),
        "dashboard": {"token": dashboard_token()},
        "limits": {
            PROJECT: {"concurrency": 50},
            # Two at a time; four more wait up to 1.5 s (FIFO), the rest are refused at once.
            f"{PROJECT}/slow": {"concurrency": 2, "queue": {"size": 4, "wait": 1.5}},
            # A backend that answers "X-Fault-Code: TIMEOUT" keeps its slot 5 s longer.
            f"{PROJECT}/flaky": {
                "concurrency": 1,
                "delay": 5.0,
                "timeout_header": "X-Fault-Code: TIMEOUT",
            },
            # Password guessing: 5 failed logins (401) per minute per client address.
            f"{PROJECT}/login/*": {"rate": "5/minute", "key": "ip", "count": [401]},
            # Each calling system (X-Caller-Id) may have one request in flight.
            f"{PROJECT}/partner/*": {"concurrency": 1},
            # No number to guess: the limit follows the latency of the search backend.
            f"{PROJECT}/search": {"concurrency": "auto", "adaptive": {"max": 50}},
        },
    }


TOKEN_HELP = """Dashboard token: {token}
  scrapers send it as a header:
    curl -s -H "Authorization: Bearer {token}" localhost:{port}/gatekeeper/status.json
  a browser opens /gatekeeper/?token=<the token> once: the server answers with a redirect
  to /gatekeeper/ and a cookie, so the token does not stay in the address bar.
"""


def index(server: str, port: int) -> str:
    """The start page (served to anyone: it names the dashboard, never its token)."""
    return INDEX.format(server=server, backend=backend_url(), token_env=TOKEN_ENV, port=port)


def banner(server: str, port: int) -> str:
    """What start-up prints on the terminal: the start page and how to use the token. No
    URL carrying the token, which would end up in access logs when followed."""
    token_help = TOKEN_HELP.format(token=dashboard_token(), port=port)
    return index(server, port) + "\n" + token_help


class Work:
    """Stands for a slow backend call: :meth:`run` takes ``seconds``, or ends early when
    :meth:`finish` is called. Tests hold requests in flight with it and wait for them with
    :meth:`wait_running` instead of sleeping."""

    def __init__(self, seconds: float = WORK_SECONDS) -> None:
        self.seconds = seconds
        self.running = 0
        self._finished = threading.Event()
        self._changed = threading.Condition()

    def run(self) -> None:
        with self._changed:
            self.running += 1
            self._changed.notify_all()
        try:
            self._finished.wait(self.seconds)
        finally:
            with self._changed:
                self.running -= 1
                self._changed.notify_all()

    def wait_running(self, count: int, timeout: float = 10.0) -> bool:
        """Block until ``count`` calls are running at once; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.running >= count, timeout)

    def finish(self) -> None:
        """End the running calls and every later one at once."""
        self._finished.set()


class Capacity:
    """A backend of fixed capacity: ``slots`` calls at a time take ``seconds`` each; more
    calls wait for a slot in FIFO order (they queue), so beyond ``slots`` latency grows with
    the load, evenly: ``seconds x (1 + queued / slots)``. :meth:`resize` changes the
    capacity while running (a backend losing half its nodes)."""

    def __init__(self, slots: int = SEARCH_CAPACITY, seconds: float = SEARCH_SECONDS) -> None:
        self.slots = slots
        self.seconds = seconds
        self.busy = 0
        self._lock = threading.Lock()
        self._queue: deque[threading.Event] = deque()

    def call(self) -> None:
        turn = None
        with self._lock:
            if self.busy < self.slots and not self._queue:
                self.busy += 1
            else:
                turn = threading.Event()
                self._queue.append(turn)
        if turn is not None:
            turn.wait()  # a finishing call hands its slot over: no barging past the queue
        try:
            time.sleep(self.seconds)  # the modelled service time, not a synchronization
        finally:
            with self._lock:
                self.busy -= 1
                self._hand_over()

    def resize(self, slots: int) -> None:
        with self._lock:
            self.slots = slots
            self._hand_over()

    def _hand_over(self) -> None:
        while self._queue and self.busy < self.slots:
            self.busy += 1
            self._queue.popleft().set()


def search_answer(gatekeeper: GateKeeper) -> str:
    """The /search answer: the adaptive limit of ``demo/search`` right now."""
    limit = gatekeeper.config.limits[f"{PROJECT}/search"]
    now = gatekeeper.backend.adaptive_limit(limit.path, limit)
    return f"done: search (adaptive limit now {now})\n"


def stamp_arrival(app: WSGIApplication) -> Callable[..., Iterable[bytes]]:
    """Wrap the whole app (outside the gatekeeper) to note when a request arrived, so a view
    can tell how long it waited in the gatekeeper's queue (:func:`queue_wait_header`)."""

    def stamped(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ[_ARRIVED_KEY] = time.monotonic()
        return app(environ, start_response)

    return stamped


def queue_wait_header(environ: dict[str, Any]) -> dict[str, str]:
    """``{X-Queue-Wait-Ms: …}``, called when the view starts: the time since arrival,
    nearly all of it spent in the queue; empty when the app was not wrapped by
    :func:`stamp_arrival` (test clients)."""
    arrived = environ.get(_ARRIVED_KEY)
    if arrived is None:
        return {}
    return {QUEUE_WAIT_HEADER: f"{(time.monotonic() - arrived) * 1000:.0f}"}
