"""Redis cost per request: gatekeeper-wsgi's Redis backend against Flask-Limiter's Redis storage.

Run ``python benchmarks/redis_backend.py`` (starts its own ``redis-server`` on a free
loopback port; ``--url redis://…`` uses an existing one, and must be one nobody else
uses while it runs). One Flask app, three ways, measured interleaved in one run by calling
the WSGI app directly:

- bare Flask;
- Flask wrapped in GateKeeperMiddleware on ``redis://``: concurrency limits on all three
  levels plus a per-caller rate limit, none ever hit;
- Flask with Flask-Limiter on ``redis://`` (moving window, one limit).

Prints, per way: round trips per request (commands clients sent, seen by ``MONITOR``),
before the body is returned and in ``close()``,
commands per request (``INFO commandstats`` deltas, including those scripts ran), and
median µs per request, split into the part the client waits for (until the body is
returned) and the release in ``close()`` after the response is sent.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from flask import Flask

from gatekeeper_wsgi import GateKeeperMiddleware

ENVIRON = {
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
    "wsgi.input": None,
    "wsgi.errors": sys.stderr,
    "wsgi.multithread": True,
    "wsgi.multiprocess": False,
    "wsgi.run_once": False,
}

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def flask_app() -> Flask:
    app = Flask("bench")

    @app.route("/orders")
    def orders() -> str:
        return "ok"

    return app


def gatekeeper(url: str) -> WSGIApp:
    return GateKeeperMiddleware(
        flask_app(),
        {
            "project": "shop",
            "backend": f"{url}?prefix=bench-{uuid.uuid4().hex[:6]}",
            "limits": {
                "shop": {"concurrency": 10_000},
                "shop/orders": {"concurrency": 10_000},
                "shop/orders/*": {"concurrency": 10_000, "rate": "1000000000/minute"},
            },
        },
    )


def flask_limiter(url: str) -> WSGIApp:
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = flask_app()
    Limiter(
        get_remote_address,
        app=app,
        default_limits=["1000000000 per minute"],
        storage_uri=url,
        strategy="moving-window",
    )
    return app


def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    pass


def run(app: WSGIApp, n: int) -> tuple[float, float]:
    """µs per request over n requests: (until the body is returned, the close() after)."""
    waited = closing = 0.0
    clock = time.perf_counter
    for _ in range(n):
        started = clock()
        result = app(dict(ENVIRON), start_response)
        for _chunk in result:
            pass
        body = clock()
        close = getattr(result, "close", None)
        if close is not None:
            close()
        waited += body - started
        closing += clock() - body
    return waited / n * 1e6, closing / n * 1e6


def round_trips(server: redis.Redis, app: WSGIApp, n: int) -> tuple[float, float]:
    """Commands clients sent per request (scripts' own commands excluded), by MONITOR:
    (until the body is returned, in close())."""
    pool = redis.ConnectionPool(**server.connection_pool.connection_kwargs)
    sender = redis.Redis(connection_pool=pool)
    own = sender.client_info()["addr"]  # the markers' sender, connected before MONITOR
    sent = {"body": 0, "close": 0}
    with server.monitor() as monitor:
        for _ in range(n):
            result = app(dict(ENVIRON), start_response)
            for _chunk in result:
                pass
            sender.echo("body")
            close = getattr(result, "close", None)
            if close is not None:
                close()
            sender.echo("close")
        sender.echo("end")
        phase = "body"
        while True:
            command = monitor.next_command()
            origin = f"{command['client_address']}:{command['client_port']}"
            if origin == own:
                if command["command"] == "ECHO end":
                    break
                phase = "close" if command["command"] == "ECHO body" else "body"
            elif command["client_type"] != "lua":
                sent[phase] += 1
    sender.close()
    return sent["body"] / n, sent["close"] / n


def commands(server: redis.Redis, app: WSGIApp, n: int) -> tuple[float, dict[str, int]]:
    """All commands per request, including those scripts ran, by INFO commandstats."""
    server.config_resetstat()
    run(app, n)
    stats = server.info("commandstats")
    calls = {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))
    }
    return sum(calls.values()) / n, calls


@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: install it or pass --url")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis nobody else uses (default: start one)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=1000, help="requests per round")
    args = parser.parse_args()
    with redis_server(args.url) as url:
        server = redis.Redis.from_url(url)
        apps = {"bare Flask": flask_app(), "gatekeeper-wsgi": gatekeeper(url)}
        apps["Flask-Limiter"] = flask_limiter(url)
        for app in apps.values():  # warm up: connections, scripts loaded
            run(app, 200)
        counts = {
            name: (round_trips(server, app, 200), *commands(server, app, 1000))
            for name, app in apps.items()
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in apps}
        gc.disable()
        try:
            for _ in range(args.rounds):
                for name, app in apps.items():
                    samples[name].append(run(app, args.requests))
        finally:
            gc.enable()
    print(f"{args.rounds} rounds x {args.requests} requests, medians, direct WSGI calls, {url}")
    print(
        f"{'':17}{'round trips':>12}{'in close()':>11}{'commands':>10}{'waited µs':>11}"
        f"{'close() µs':>12}{'total µs':>10}"
    )
    median: dict[str, tuple[float, float]] = {}
    for name, values in samples.items():
        waited = statistics.median(value[0] for value in values)
        closing = statistics.median(value[1] for value in values)
        median[name] = (waited, closing)
        (trips, trips_closing), per_request, _ = counts[name]
        print(
            f"{name:17}{trips:12.2f}{trips_closing:11.2f}{per_request:10.2f}{waited:11.1f}"
            f"{closing:12.1f}{waited + closing:10.1f}"
        )
    for name in ("gatekeeper-wsgi", "Flask-Limiter"):
        calls = counts[name][2]
        listed = ", ".join(f"{cmd} {n / 1000:g}" for cmd, n in sorted(calls.items()) if n)
        print(f"  {name} commands per request: {listed}")
    base = median["bare Flask"][0]
    ours = median["gatekeeper-wsgi"][0] - base
    theirs = median["Flask-Limiter"][0] - base
    print(
        f"\nadmission a request waits for, over bare Flask: gatekeeper-wsgi "
        f"(3 concurrency levels + 1 rate, 1 round trip) {ours:.1f} µs; Flask-Limiter "
        f"(1 moving-window limit, 1 round trip) {theirs:.1f} µs; ratio {ours / theirs:.2f}. "
        f"gatekeeper-wsgi releases in close(), after the response: "
        f"{median['gatekeeper-wsgi'][1]:.1f} µs, 1 round trip."
    )


if __name__ == "__main__":
    main()
