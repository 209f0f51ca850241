"""Per-request overhead of gatekeeper-wsgi against the bare app and Flask-Limiter.

Run ``python benchmarks/overhead.py``. One Flask app, three ways, measured interleaved in
one run (so machine noise hits all alike) by calling the WSGI app directly:

- bare Flask;
- Flask wrapped in GateKeeperMiddleware: concurrency limits on all three levels plus a
  per-IP rate limit, none of them ever hit (the cost every admitted request pays);
- Flask with Flask-Limiter (memory storage, moving window, one limit).

Prints median µs per request, the overhead over bare Flask and the ratio of overheads.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask

from gatekeeper_wsgi import GateKeeperMiddleware

# Three concurrency levels and a rate limit, all counted on every request, none ever hit.
GATEKEEPER_SETTINGS = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 10_000},
        "shop/orders": {"concurrency": 10_000},
        "shop/orders/*": {"concurrency": 10_000, "rate": "1000000000/minute"},
    },
}

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


def bare() -> WSGIApp:
    return flask_app()


def gatekeeper() -> WSGIApp:
    return GateKeeperMiddleware(flask_app(), GATEKEEPER_SETTINGS)


def flask_limiter() -> WSGIApp:
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = flask_app()
    Limiter(
        get_remote_address,
        app=app,
        default_limits=["1000000000 per minute"],
        storage_uri="memory://",
        strategy="moving-window",
    )
    return app


def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    pass


def run(app: WSGIApp, n: int) -> float:
    """µs per request over n requests."""
    environ = ENVIRON
    started = time.perf_counter()
    for _ in range(n):
        result = app(dict(environ), start_response)
        for _chunk in result:
            pass
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    args = parser.parse_args()
    apps = {"bare Flask": bare(), "gatekeeper-wsgi": gatekeeper(), "Flask-Limiter": flask_limiter()}
    samples: dict[str, list[float]] = {name: [] for name in apps}
    for app in apps.values():  # warm up
        run(app, 500)
    gc.disable()
    try:
        for _ in range(args.rounds):
            for name, app in apps.items():
                samples[name].append(run(app, args.requests))
    finally:
        gc.enable()
    median = {name: statistics.median(values) for name, values in samples.items()}
    base = median["bare Flask"]
    print(f"{args.rounds} rounds x {args.requests} requests, medians, direct WSGI calls")
    print(f"{'':18}{'µs/request':>12}{'overhead µs':>13}{'x bare':>9}")
    for name, value in median.items():
        print(f"{name:18}{value:12.2f}{value - base:13.2f}{value / base:9.2f}")
    ours = median["gatekeeper-wsgi"] - base
    theirs = median["Flask-Limiter"] - base
    print(
        f"\ngatekeeper-wsgi overhead (3 concurrency levels + 1 rate limit): {ours:.2f} µs; "
        f"Flask-Limiter (1 moving-window limit): {theirs:.2f} µs; "
        f"ratio {ours / theirs:.3f} (1/{theirs / ours:.1f})"
    )


if __name__ == "__main__":
    main()
