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
import statistics
import time

import _common
import redis
from _common import ENVIRON, WSGIApp, flask_app, flask_limiter, redis_server, start_response


def gatekeeper(url: str) -> WSGIApp:
    """Concurrency limits on all three levels plus a per-caller rate, under a fresh prefix."""
    return _common.flask_gatekeeper_middleware(url)


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
