"""What the benchmark scripts share: the WSGI environ, the apps under test (Flask and
Django, bare, with gatekeeper-wsgi and with the peers Flask-Limiter / django-ratelimit),
the timing loops, and the servers they need (a private ``redis-server``, free ports).

Every limit is set so high that it never refuses: what is measured is the price every
admitted request pays. gatekeeper-wsgi is measured with two policies:

- ``1 rate``: one per-client-address rate limit, the same policy as the peers';
- ``3 conc + 1 rate``: concurrency limits on all three levels plus that rate limit.

The peers count a rate limit per client address too: Flask-Limiter with its
``moving-window`` strategy (exact, like ours), django-ratelimit (fixed windows; it has no
other kind) on the Django cache.

Also the gunicorn entry point: ``gunicorn --pythonpath benchmarks
'_common:make_app("flask", "gatekeeper-middleware", "shared:///dev/shm/x.shm")'``.
"""

from __future__ import annotations

import gc
import io
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

ROOT = Path(__file__).resolve().parent.parent

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: A GET of /orders by caller "crm" from 127.0.0.1; copy it per request (apps mutate it).
ENVIRON: dict[str, Any] = {
    "REQUEST_METHOD": "GET",
    "SCRIPT_NAME": "",
    "PATH_INFO": "/orders",
    "QUERY_STRING": "",
    "SERVER_NAME": "127.0.0.1",
    "SERVER_PORT": "8000",
    "SERVER_PROTOCOL": "HTTP/1.1",
    "REMOTE_ADDR": "127.0.0.1",
    "HTTP_HOST": "127.0.0.1:8000",
    "HTTP_X_CALLER_ID": "crm",
    "wsgi.version": (1, 0),
    "wsgi.url_scheme": "http",
    "wsgi.input": io.BytesIO(),  # empty; Django wraps it even for a GET
    "wsgi.errors": sys.stderr,
    "wsgi.multithread": True,
    "wsgi.multiprocess": False,
    "wsgi.run_once": False,
}

#: never reached in a run
HIGH_RATE = "1000000000/minute"
POLICIES = {
    "1 rate": {"shop/orders/*": {"rate": HIGH_RATE, "key": "ip"}},
    "3 conc + 1 rate": {
        "shop": {"concurrency": 10_000},
        "shop/orders": {"concurrency": 10_000},
        "shop/orders/*": {"concurrency": 10_000, "rate": HIGH_RATE, "key": "ip"},
    },
    "1 conc": {"shop/orders": {"concurrency": 10_000}},
    # min 100: even its latency probes leave room for every thread of the run.
    "1 auto conc": {
        "shop/orders": {
            "concurrency": "auto",
            "adaptive": {"min": 100, "max": 10_000, "initial": 100},
        }
    },
}
DEFAULT_POLICY = "3 conc + 1 rate"


def gatekeeper_settings(backend: str = "memory", policy: str = DEFAULT_POLICY) -> dict[str, Any]:
    """Settings of project "shop" under one of :data:`POLICIES`; a Redis backend gets a
    prefix of its own, so apps sharing one Redis never share counters."""
    if backend.startswith(("redis://", "valkey://")):
        joiner = "&" if "?" in backend else "?"
        backend = f"{backend}{joiner}prefix=bench-{uuid.uuid4().hex[:8]}"
    return {"project": "shop", "backend": backend, "limits": POLICIES[policy]}


def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    pass


# --- the Flask app, four ways -------------------------------------------------------------


def flask_app() -> Any:
    """The bare Flask app: ``GET /orders`` answers "ok"."""
    from flask import Flask

    app = Flask("bench")

    @app.route("/orders")
    def orders() -> str:
        return "ok"

    return app


def flask_gatekeeper_middleware(backend: str = "memory", policy: str = DEFAULT_POLICY) -> WSGIApp:
    """The Flask app wrapped in the core GateKeeperMiddleware (service: first path segment)."""
    from gatekeeper_wsgi import GateKeeperMiddleware

    return GateKeeperMiddleware(flask_app(), gatekeeper_settings(backend, policy))


def flask_gatekeeper_extension(backend: str = "memory", policy: str = DEFAULT_POLICY) -> WSGIApp:
    """The Flask app with the gatekeeper Flask extension (service: the endpoint name)."""
    from gatekeeper_wsgi.contrib.flask import GateKeeper

    app = flask_app()
    app.config["GATEKEEPER"] = gatekeeper_settings(backend, policy)
    GateKeeper(app)
    return app  # type: ignore[no-any-return]


def flask_limiter(storage_uri: str = "memory://") -> WSGIApp:
    """The Flask app with Flask-Limiter: one moving-window limit per client address."""
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = flask_app()
    Limiter(
        get_remote_address,
        app=app,
        default_limits=["1000000000 per minute"],
        storage_uri=storage_uri,
        strategy="moving-window",
    )
    return app  # type: ignore[no-any-return]


# --- the Django app, three ways -----------------------------------------------------------


class _URLConf:
    """ROOT_URLCONF of the Django app (a class: Django caches resolvers by urlconf)."""

    urlpatterns: ClassVar[list[Any]] = []


def configure_django(
    backend: str = "memory", redis_url: str | None = None, policy: str = DEFAULT_POLICY
) -> None:
    """Configure Django in this process, once: no database, the gatekeeper on ``backend``
    with ``policy`` (one per process: the Django middleware uses the process-wide engine),
    the cache django-ratelimit counts in (Redis when ``redis_url`` is given, else local
    memory)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    cache: dict[str, Any] = {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    if redis_url is not None:
        cache = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": redis_url}
    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=_URLConf,
        USE_TZ=True,
        INSTALLED_APPS=["gatekeeper_wsgi.contrib.django"],
        MIDDLEWARE=[],
        DATABASES={},
        CACHES={"default": cache},
        RATELIMIT_USE_CACHE="default",
        SILENCED_SYSTEM_CHECKS=["django_ratelimit.E003", "django_ratelimit.W001"],
        GATEKEEPER=gatekeeper_settings(backend, policy),
        LOGGING_CONFIG=None,
    )
    django.setup()
    from django.http import HttpResponse
    from django.urls import path
    from django_ratelimit.decorators import ratelimit

    def orders(request: Any) -> HttpResponse:
        return HttpResponse("ok")

    limited = ratelimit(key="ip", rate="1000000000/m", block=True)(orders)
    _URLConf.urlpatterns = [
        path("orders", orders, name="orders"),
        path("limited/orders", limited, name="limited-orders"),
    ]


def django_app(way: str) -> WSGIApp:
    """The Django app (after :func:`configure_django`): ``bare``, ``gatekeeper`` (the
    Django middleware, on the process-wide engine of ``settings.GATEKEEPER``) or
    ``django-ratelimit`` (its decorator on the same view)."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import override_settings

    if way == "gatekeeper":
        with override_settings(MIDDLEWARE=["gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"]):
            return WSGIHandler()
    handler = WSGIHandler()
    if way == "django-ratelimit":
        return _prefixed(handler, "/limited")
    if way != "bare":
        raise ValueError(f"unknown Django way {way!r}")
    return handler


def _prefixed(app: WSGIApp, prefix: str) -> WSGIApp:
    def call(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        environ["PATH_INFO"] = prefix + environ["PATH_INFO"]
        return app(environ, start)

    return call


def make_app(framework: str, way: str, backend: str = "memory", redis_url: str = "") -> WSGIApp:
    """One app under test by name: the gunicorn entry point, and what run_all spawns.

    ``framework`` "flask": ``way`` is bare, gatekeeper-middleware, gatekeeper-extension or
    flask-limiter (``backend`` is then its storage URI); "django": bare, gatekeeper or
    django-ratelimit (its cache is Redis when ``redis_url`` is given).
    """
    if framework == "flask":
        if way == "bare":
            return flask_app()  # type: ignore[no-any-return]
        if way == "gatekeeper-middleware":
            return flask_gatekeeper_middleware(backend)
        if way == "gatekeeper-extension":
            return flask_gatekeeper_extension(backend)
        if way == "flask-limiter":
            return flask_limiter(backend)
    elif framework == "django":
        configure_django(backend, redis_url or None)
        return django_app(way)
    raise ValueError(f"unknown app {framework!r} / {way!r}")


# --- timing -------------------------------------------------------------------------------


def call(app: WSGIApp, environ: dict[str, Any] = ENVIRON) -> None:
    """One request as a server makes it: call, iterate the body, close."""
    result = app(dict(environ), start_response)
    for _chunk in result:
        pass
    close = getattr(result, "close", None)
    if close is not None:
        close()


def run(
    app: WSGIApp,
    n: int,
    environ: dict[str, Any] = ENVIRON,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """µs per request over ``n`` requests in this thread, by ``clock`` (wall time; or
    ``time.thread_time``, this thread's CPU time, which other processes sharing the
    machine do not inflate)."""
    started = clock()
    for _ in range(n):
        call(app, environ)
    return (clock() - started) / n * 1e6


def threaded(threads: int, work: Callable[[int], None]) -> float:
    """Run ``work(thread_index)`` in ``threads`` threads started together; wall seconds
    from the common start until the last one ends."""
    barrier = threading.Barrier(threads + 1)

    def body(index: int) -> None:
        barrier.wait()
        work(index)

    workers = [threading.Thread(target=body, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


def run_threads(app: WSGIApp, n: int, threads: int) -> float:
    """Wall-clock µs per request with ``threads`` threads sharing ``n`` requests."""
    share = max(1, n // threads)
    seconds = threaded(threads, lambda _index: run(app, share))
    return seconds / (share * threads) * 1e6


T = TypeVar("T")
#: what take turns: apps, or the servers serving them
A = TypeVar("A")


def take_turns(apps: dict[str, A], rounds: int, measure: Callable[[A], T]) -> dict[str, list[T]]:
    """``measure(app)`` of every app in each of ``rounds`` rounds, with the collector off.

    The apps take turns in every round, in an order shuffled afresh each round (seeded:
    runs repeat), so neither machine noise nor a fixed position (whose predecessor warmed
    or cooled the caches) favours one of them.
    """
    samples: dict[str, list[T]] = {name: [] for name in apps}
    order = list(apps)
    shuffle = random.Random(0).shuffle
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            shuffle(order)
            for name in order:
                samples[name].append(measure(apps[name]))
    finally:
        gc.enable()
    return samples


def paired_median(values: list[float], base: list[float]) -> float:
    """The median of ``values`` less ``base`` round by round: a cost over the bare app that
    a machine whose speed drifts between rounds moves far less than a difference of two
    medians taken over different rounds."""
    return statistics.median(value - bare for value, bare in zip(values, base, strict=True))


def interleaved(
    apps: dict[str, WSGIApp],
    rounds: int,
    measure: Callable[[WSGIApp], float],
    *,
    paired: str | None = None,
) -> dict[str, float]:
    """Median of ``measure(app)`` per app over ``rounds`` rounds taken by :func:`take_turns`.
    With ``paired`` (the name of the bare app), every other app's figure is the bare median
    plus its :func:`paired_median` over the bare app: ``figure - bare`` is the paired cost.
    """
    samples = take_turns(apps, rounds, measure)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    if paired is None:
        return medians
    return {
        name: medians[paired] + paired_median(values, samples[paired])
        for name, values in samples.items()
    }


# --- servers and the machine --------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    """Block until something accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.02)


@contextmanager
def redis_server(url: str | None = None) -> Iterator[str]:
    """``url`` when given, else a private ``redis-server`` on a free loopback port (no
    persistence) for the duration; yields its URL. Exits when there is no binary."""
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: install it or pass --url")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait()


def machine() -> str:
    """CPU model, cores, OS and Python, for the record."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )
