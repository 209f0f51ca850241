"""Per-request cost of gatekeeper-wsgi against the bare app and the usual peer, by direct
WSGI calls.

Run ``python benchmarks/overhead.py`` (Flask, memory backend, 1 and 8 threads);
``--framework django``, ``--backend shared`` or ``--backend redis`` (starts its own
``redis-server`` unless ``--redis-url`` names one nobody else uses) for the other cells.
One app, several ways, measured interleaved in one run (so machine noise hits all alike):

- Flask: bare; the core GateKeeperMiddleware (one rate limit per client address, as the
  peer; and concurrency limits on all three levels plus that rate); the gatekeeper Flask
  extension (3 levels + rate); Flask-Limiter (one moving-window limit per address); the
  middleware with one static concurrency limit and with one adaptive (``"auto"``) one,
  whose costs over bare are compared (``auto ÷ static``).
- Django: bare; the gatekeeper Django middleware (3 levels + rate); django-ratelimit
  (one limit per address, on the Django cache: local memory, or Redis with ``redis``).

The peers have no host-wide file store, so they sit out ``--backend shared``. On a
shared, loaded machine ``--cpu`` times the one-thread rows by the measuring thread's CPU
time (``time.thread_time``), which other processes do not inflate (no 8-thread rows then).
Prints µs per request, the cost over the bare app (the median of the per-round
differences: many short rounds in a shuffled order, each way paired with the bare app's
run of the same round), and that cost as a share of the peer's cost over the same bare
app; with 8 threads the time is wall time / requests (what the GIL and the locks leave of
parallelism).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import _common
from _common import WSGIApp

BARE = {"flask": "bare Flask", "django": "bare Django"}
PEER = {"flask": "Flask-Limiter (1 rate)", "django": "django-ratelimit (1 rate)"}


def apps(framework: str, backend: str, url: Callable[[], str]) -> dict[str, WSGIApp]:
    """The ways to serve ``framework`` on ``backend``; ``url()`` gives a fresh backend URL."""
    if framework == "flask":
        ways: dict[str, WSGIApp] = {
            BARE["flask"]: _common.flask_app(),
            "gatekeeper middleware (1 rate)": _common.flask_gatekeeper_middleware(url(), "1 rate"),
            "gatekeeper middleware (3 conc + 1 rate)": _common.flask_gatekeeper_middleware(url()),
            "gatekeeper Flask extension (3 conc + 1 rate)": _common.flask_gatekeeper_extension(
                url()
            ),
            "gatekeeper middleware (1 conc)": _common.flask_gatekeeper_middleware(url(), "1 conc"),
            # The adaptive limit's cost is judged against the static one just above.
            "gatekeeper middleware (1 auto conc)": _common.flask_gatekeeper_middleware(
                url(), "1 auto conc"
            ),
        }
        if backend != "shared":
            storage = "memory://" if backend == "memory" else url()
            ways[PEER["flask"]] = _common.flask_limiter(storage)
        return ways
    redis_url = url() if backend == "redis" else None
    _common.configure_django(url(), redis_url)
    ways = {
        BARE["django"]: _common.django_app("bare"),
        "gatekeeper Django middleware (3 conc + 1 rate)": _common.django_app("gatekeeper"),
    }
    if backend != "shared":
        ways[PEER["django"]] = _common.django_app("django-ratelimit")
    return ways


def measure(
    framework: str,
    backend: str,
    redis_url: str | None,
    rounds: int,
    requests: int,
    *,
    cpu: bool = False,
) -> dict[str, dict[str, float]]:
    """{"1": {way: µs}, "8": {way: µs}} over interleaved rounds: the bare app's median, and
    for every other way that plus its median paired cost (see ``_common.interleaved``).
    With ``cpu``, the one-thread figures are the measuring thread's CPU time, and there is
    no "8"."""
    with ExitStack() as stack:
        if backend == "redis":
            server = stack.enter_context(_common.redis_server(redis_url))

            def url() -> str:
                return server

        elif backend == "shared":
            directory = Path(
                stack.enter_context(tempfile.TemporaryDirectory(dir=_tmpfs(), prefix="gk-bench-"))
            )
            files = iter(range(1_000))

            def url() -> str:
                return f"shared://{directory}/table-{next(files)}.shm"

        else:

            def url() -> str:
                return "memory"

        ways = apps(framework, backend, url)
        for app in ways.values():  # warm up: imports, connections, scripts, first pages
            _common.run(app, 300)
        clock = time.thread_time if cpu else time.perf_counter
        bare = BARE[framework]
        results = {
            "1": _common.interleaved(
                ways, rounds, lambda app: _common.run(app, requests, clock=clock), paired=bare
            )
        }
        if not cpu:  # CPU time of one thread says nothing of what 8 threads leave
            results["8"] = _common.interleaved(
                ways, rounds, lambda app: _common.run_threads(app, requests, 8), paired=bare
            )
        return results


def _tmpfs() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("flask", "django"), default="flask")
    parser.add_argument("--backend", choices=("memory", "shared", "redis"), default="memory")
    parser.add_argument("--redis-url", help="an existing Redis nobody else uses")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument(
        "--requests", type=int, help="per round and way (default 300, 100 on Redis)"
    )
    parser.add_argument("--json", type=Path, help="also write the medians here")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="time by this thread's CPU time (one thread only): for a shared, loaded machine",
    )
    args = parser.parse_args(argv)
    requests = args.requests or (100 if args.backend == "redis" else 300)
    results = measure(
        args.framework, args.backend, args.redis_url, args.rounds, requests, cpu=args.cpu
    )

    bare, peer = BARE[args.framework], PEER[args.framework]
    print(
        f"{args.framework}, backend {args.backend}: {args.rounds} rounds x {requests} "
        f"requests, paired medians, direct WSGI calls"
        + (", CPU time of the thread" if args.cpu else "")
    )
    print(
        f"{'':48}{'threads':>8}{'µs/request':>12}{'over bare':>11}{'x bare':>8}"
        f"{'over bare ÷ peer':>18}"
    )
    for threads, medians in results.items():
        base = medians[bare]
        peer_cost = medians[peer] - base if peer in medians else None
        for name, value in medians.items():
            cost = value - base
            versus = f"{cost / peer_cost:18.2f}" if peer_cost and name != bare else f"{'—':>18}"
            print(f"{name:48}{threads:>8}{value:12.2f}{cost:11.2f}{value / base:8.2f}{versus}")
        static, auto = "gatekeeper middleware (1 conc)", "gatekeeper middleware (1 auto conc)"
        if static in medians and auto in medians:
            ratio = (medians[auto] - base) / (medians[static] - base)
            print(f"{'  adaptive limit: cost over bare, auto ÷ static':56}{ratio:12.2f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"framework": args.framework, "backend": args.backend, "results": results},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
