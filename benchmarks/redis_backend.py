"""Redis cost per request: gatekeeper-wsgi's Redis backend against Flask-Limiter's Redis storage.

Run ``python benchmarks/redis_backend.py`` (starts its own ``redis-server`` on a free
loopback port; ``--url redis://…`` uses an existing one, and must be one nobody else
uses while it runs). One Flask app, three ways, measured interleaved in one run by calling
the WSGI app directly:

- bare Flask;
- Flask wrapped in GateKeeperMiddleware on ``redis://``: concurrency limits on all three
  levels plus a per-caller rate limit, none ever hit;
- Flask with Flask-Limiter on ``redis://`` (moving window, one limit).

Prints, per way: round trips per request (commands clients sent, seen by ``MONITOR``): those
the request's thread waits for, and those no request waits for (gatekeeper-wsgi's releases,
written as the response ends or sent by its release sender); commands per request (``INFO
commandstats`` deltas, including those scripts ran), in all and as a table per command;
and median µs per request, split into the part the client
waits for (until the body is returned) and ``close()`` after the response is sent, then the
whole (call + iterate + close) over bare Flask and as a share of Flask-Limiter's. The ways
take turns in every round in a freshly shuffled order, and the cost over bare Flask is the
median of the per-round differences (many short rounds: see ``_common.paired_median``).

``--json FILE`` also writes the commands per request of each way; ``--before FILE`` (one
written so by an earlier version) adds the columns that changed, as "<way> before":
``--before benchmarks/redis_commands_24.json`` compares with the 24-command layout (before
the marks; written by this script run against that version's package).

``--adaptive`` adds two more ways: one static concurrency limit and one adaptive one
(``concurrency = "auto"``, its state shared by all hosts through Redis), and prints their
whole per-request times side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

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
    """Commands clients sent per request (scripts' own commands excluded), by ``MONITOR``:
    (those a request's thread waits for, the others). Waited for: every command of the
    busiest connection, the request thread's own (neither client sends a command there
    without reading its answer), but for gatekeeper-wsgi's releases written on it as the
    response ends, whose answers are read with the thread's next command: a release-only
    call of its script (``EVALSHA`` whose arguments are the count of releases and those
    releases, no admission). The others: every other connection's, e.g. gatekeeper-wsgi's
    release sender, which no request waits for."""
    pool = redis.ConnectionPool(**server.connection_pool.connection_kwargs)
    sender = redis.Redis(connection_pool=pool)
    own = sender.client_info()["addr"]  # the end marker's sender, connected before MONITOR
    sent: dict[str, int] = {}
    written: dict[str, int] = {}  # release-only calls, per connection
    with server.monitor() as monitor:
        for _ in range(n):
            _common.call(app)
        sender.echo("end")
        while True:
            raw = monitor.connection.read_response()
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            _, data = text.split(" ", 1)
            found = monitor.monitor_re.match(data)
            assert found is not None
            _, origin, command = found.groups()
            if origin == own:
                break
            if origin == "lua":
                continue
            sent[origin] = sent.get(origin, 0) + 1
            words = monitor.command_re.findall(command)
            if words[0].upper() == "EVALSHA" and len(words) > 3 and words[2].isdigit():
                argv = words[3 + int(words[2]) :]
                if argv and argv[0].isdigit() and len(argv) == 1 + int(argv[0]):
                    written[origin] = written.get(origin, 0) + 1
    sender.close()
    busiest = max(sent, key=sent.__getitem__, default=None)
    waited = 0 if busiest is None else sent[busiest] - written.get(busiest, 0)
    return waited / n, (sum(sent.values()) - waited) / n


def commands(server: redis.Redis, app: WSGIApp, n: int) -> tuple[float, dict[str, float]]:
    """All commands per request, including those scripts ran, by INFO commandstats: in all,
    and per command."""
    server.config_resetstat()
    run(app, n)
    stats = server.info("commandstats")
    calls = {
        name.removeprefix("cmdstat_"): int(value["calls"]) / n
        for name, value in stats.items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))
    }
    return sum(calls.values()), calls


def command_table(columns: dict[str, dict[str, float]]) -> list[str]:
    """Commands per request as a table: a row per command, a column per way."""
    names = sorted({command for calls in columns.values() for command, n in calls.items() if n})
    width = max(12, *(len(name) + 2 for name in columns))
    lines = [f"{'per request':18}" + "".join(f"{name:>{width}}" for name in columns)]
    for command in [*names, "all"]:
        cells = [
            sum(calls.values()) if command == "all" else calls.get(command, 0.0)
            for calls in columns.values()
        ]
        lines.append(f"  {command:16}" + "".join(f"{cell:>{width}.2f}" for cell in cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="an existing Redis nobody else uses (default: start one)")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="also one static and one adaptive (auto) concurrency limit, side by side",
    )
    parser.add_argument("--json", type=Path, help="also write the commands per request here")
    parser.add_argument("--before", type=Path, help="a --json file of an earlier version")
    args = parser.parse_args()
    with redis_server(args.url) as url:
        server = redis.Redis.from_url(url)
        apps = {"bare Flask": flask_app(), "gatekeeper-wsgi": gatekeeper(url)}
        apps["Flask-Limiter"] = flask_limiter(url)
        if args.adaptive:
            apps["gk 1 conc"] = _common.flask_gatekeeper_middleware(url, "1 conc")
            apps["gk 1 auto conc"] = _common.flask_gatekeeper_middleware(url, "1 auto conc")
        for app in apps.values():  # warm up: connections, scripts loaded
            run(app, 200)
        counts = {
            name: (round_trips(server, app, 200), *commands(server, app, 1000))
            for name, app in apps.items()
        }
        samples = _common.take_turns(apps, args.rounds, lambda app: run(app, args.requests))
    print(f"{args.rounds} rounds x {args.requests} requests, medians, direct WSGI calls, {url}")
    print(
        f"{'':17}{'round trips':>12}{'background':>11}{'commands':>10}{'waited µs':>11}"
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
    columns = {name: counts[name][2] for name in apps if name != "bare Flask"}
    if args.json is not None:
        args.json.write_text(json.dumps(columns, indent=2, sort_keys=True))
    if args.before is not None:
        before = json.loads(args.before.read_text())
        changed = {
            f"{name} before": calls
            for name, calls in before.items()
            if name in columns and calls != columns[name]
        }
        columns = {**changed, **columns}
    print()
    print("\n".join(command_table(columns)))
    # A client and a redis-server sharing two cores make one round's round trips tens of
    # percent faster or slower than the next one's (which core each runs on, who wakes
    # whom): the costs are paired round by round.
    whole = {name: [sum(value) for value in values] for name, values in samples.items()}
    ours, theirs = (
        _common.paired_median(whole[name], whole["bare Flask"])
        for name in ("gatekeeper-wsgi", "Flask-Limiter")
    )
    print(
        f"\nwhole cost per request (call + iterate + close) over bare Flask, the median of its "
        f"per-round differences from bare Flask's: gatekeeper-wsgi "
        f"(3 concurrency levels + 1 rate) {ours:.1f} µs, Flask-Limiter (1 moving-window "
        f"limit) {theirs:.1f} µs: ratio {ours / theirs:.2f}. Round trips the request's "
        f"thread waits for: gatekeeper-wsgi {counts['gatekeeper-wsgi'][0][0]:.2f}, "
        f"Flask-Limiter {counts['Flask-Limiter'][0][0]:.2f}."
    )
    if args.adaptive:
        # Whole requests, not the cost over bare Flask: one limit's share is within the noise
        # of a shared machine, and a difference of two noisy medians can come out negative.
        static = sum(median["gk 1 conc"])
        auto = sum(median["gk 1 auto conc"])
        print(
            f"one concurrency limit, whole request: static {static:.1f} µs, adaptive "
            f"{auto:.1f} µs (its state shared by all hosts through Redis): "
            f"{auto - static:+.1f} µs, ratio {auto / static:.2f}."
        )


if __name__ == "__main__":
    main()
