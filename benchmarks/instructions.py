"""Instructions per request (callgrind), the figure a loaded machine cannot blur.

Run ``python benchmarks/instructions.py`` (needs ``valgrind``; a few minutes: each way runs
in its own process under callgrind, which is ~50x slower). Timings on a machine shared with
other work move by tens of percent from one run to the next; the number of instructions a
request executes does not. Each way serves ``GET /orders`` after a warm-up, and only the
measured requests are counted: they run inside one ``any()`` call, and callgrind collects
only while ``builtin_any`` runs (``--toggle-collect``), with the garbage collector off: a
collection falls on one request or another by chance, which moved the figure of the same
code by thousands of instructions per request between runs (what the collector then does is
left out of every way alike).

Ways: the bare Flask app; the core middleware around it (memory, 3 concurrency levels + 1
rate, as ``overhead.py``); the Flask extension (the same limits); Flask-Limiter (one
moving-window limit); and the core middleware around a trivial WSGI app (no Flask: what
gatekeeper-wsgi itself executes). Prints instructions per request, the cost over the bare
app, and that cost as a share of Flask-Limiter's. Instructions are not time (cache misses,
branch mispredictions and system calls weigh differently), but a change that removes
instructions from the hot path is measured exactly.
"""

from __future__ import annotations

import argparse
import gc
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from itertools import repeat
from pathlib import Path
from typing import Any

import _common
from _common import WSGIApp

HERE = Path(__file__).resolve().parent


def trivial(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def _middleware_around_trivial() -> WSGIApp:
    from gatekeeper_wsgi import GateKeeperMiddleware

    return GateKeeperMiddleware(trivial, _common.gatekeeper_settings("memory"))


BARE = "bare Flask"
PEER = "Flask-Limiter (1 rate)"
#: way -> (what builds its app, the way its cost is counted over; None for a bare one)
WAYS: dict[str, tuple[Callable[[], WSGIApp], str | None]] = {
    BARE: (_common.flask_app, None),
    "gatekeeper middleware (3 conc + 1 rate)": (_common.flask_gatekeeper_middleware, BARE),
    "gatekeeper Flask extension (3 conc + 1 rate)": (_common.flask_gatekeeper_extension, BARE),
    PEER: (lambda: _common.flask_limiter("memory://"), BARE),
    "trivial WSGI app": (lambda: trivial, None),
    "gatekeeper middleware around it": (_middleware_around_trivial, "trivial WSGI app"),
}


def serve(way: str, requests: int) -> None:
    """In the process callgrind watches: warm up, then ``requests`` inside ``any()``."""
    app = WAYS[way][0]()
    for _ in range(2000):
        _common.call(app)

    def one(environ: dict[str, Any]) -> None:
        _common.call(app, environ)

    gc.collect()
    gc.disable()  # see the module's docstring
    any(map(one, repeat(_common.ENVIRON, requests)))


def count(way: str, requests: int) -> float:
    """Instructions per request of ``way``, measured in a child process under callgrind."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--toggle-collect=builtin_any",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve",
        way,
        "--requests",
        str(requests),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=HERE)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind summary for {way!r}: {done.stderr[-500:]}")
    return int(found.group(1)) / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="measured per way")
    parser.add_argument("--serve", choices=list(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.requests)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind not found (apt-get install valgrind)", file=sys.stderr)
        return 1
    counts = {way: count(way, args.requests) for way in WAYS}
    print(f"instructions per request (callgrind), {args.requests} requests per way after a warm-up")
    print(f"{'':46}{'instr/request':>15}{'over bare':>11}{'over bare ÷ peer':>18}")
    peer = counts[PEER] - counts[BARE]
    for way, value in counts.items():
        base = WAYS[way][1]
        cost = 0.0 if base is None else value - counts[base]
        versus = f"{cost / peer:18.3f}" if base == BARE else f"{'—':>18}"
        print(f"{way:46}{value:15,.0f}{cost:11,.0f}{versus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
