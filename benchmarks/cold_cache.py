"""Why the middleware costs more around Flask than around a trivial app: cold caches.

Run ``python benchmarks/cold_cache.py``. The core middleware (memory backend, 3 concurrency
levels + 1 rate, as ``overhead.py``) executes the same number of instructions per request
around any app (``instructions.py``: ~48 000 around Flask and around a trivial WSGI app
alike), yet its cost in time around Flask is over twice its cost around the trivial app.
This script measures that cost, over the trivial app, with something else done between two
of its requests:

- nothing (request after request: the middleware's code and data stay in the CPU caches);
- one request to a bare Flask app (what the middleware meets around Flask in
  ``overhead.py``, where Flask's work runs between its admission and its release);
- a write to every cache line of a buffer of N KiB, for growing N (nothing but evicting).

On this machine class (``benchmarks/RESULTS.md``, twentieth stop) the middleware costs ~5 µs
alone and ~13-14 µs with a Flask request in between; a sweep of 1 to 4 MiB accounts for
that difference between 2 and 5 µs: the price of fetching the middleware's data again from
memory on every request. (Larger sweeps take so long themselves that their noise hides the
difference.) The rest is what Flask's own code displaces and a data sweep does not,
presumably the middleware's code in the instruction caches and its branch history. What
lowers either is touching fewer distinct objects and less code per request, which
instruction counts do not show.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import _common
from _common import WSGIApp

#: buffer sizes swept between two requests, KiB
SWEEPS = (256, 1024, 4096)


def trivial(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def sweep(kib: int) -> Callable[[], None]:
    """A write to every 64-byte line of a buffer of ``kib`` KiB (in C: no Python code)."""
    buffer = bytearray(kib * 1024)
    fill = b"x" * (len(buffer) // 64)

    def run() -> None:
        buffer[::64] = fill

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--requests", type=int, default=300, help="per way and round")
    args = parser.parse_args(argv)
    from gatekeeper_wsgi import GateKeeperMiddleware

    gatekeeper = GateKeeperMiddleware(trivial, _common.gatekeeper_settings("memory"))
    flask = _common.flask_app()

    def nothing() -> None:
        pass

    def flask_request() -> None:
        _common.call(flask)

    between: dict[str, Callable[[], None]] = {
        "nothing": nothing,
        "a bare Flask request": flask_request,
    }
    between.update({f"a sweep of {kib:,} KiB": sweep(kib) for kib in SWEEPS})
    # Two ways per step, "<step> / trivial" and "<step> / gatekeeper": µs per pair.
    ways: dict[str, tuple[Callable[[], None], WSGIApp]] = {}
    for name, step in between.items():
        ways[f"{name} / trivial"] = (step, trivial)
        ways[f"{name} / gatekeeper"] = (step, gatekeeper)

    def measure(way: tuple[Callable[[], None], WSGIApp]) -> float:
        step, app = way
        call = _common.call
        started = time.perf_counter()
        for _ in range(args.requests):
            step()
            call(app)
        return (time.perf_counter() - started) / args.requests * 1e6

    for way in ways.values():  # warm up
        measure(way)
    samples = _common.take_turns(ways, args.rounds, measure)
    print(_common.machine())
    print(
        f"middleware (memory, 3 conc + 1 rate) around a trivial app: {args.rounds} rounds x "
        f"{args.requests} requests, paired medians"
    )
    print(f"{'between two requests':32}{'µs over the trivial app':>25}{'x alone':>10}")
    alone = 0.0
    for name in between:
        cost = _common.paired_median(samples[f"{name} / gatekeeper"], samples[f"{name} / trivial"])
        alone = alone or cost
        print(f"{name:32}{cost:25.2f}{cost / alone:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
