"""Cost of a request to a never-seen path or from a never-seen caller, with 1 000 and
100 000 configured limits.

Run ``python benchmarks/limit_lookup.py`` (``--help`` for options). Each measured request
names a (project, service) the engine has not seen before, so it pays for resolving its
limits (building a Route through the configuration's segment index) on top of admit +
release on the memory backend. The configuration is an operators' mix: project limits,
service limits, caller limits per service, and ``*`` limits on every level.

For reference it also times the rule the index replaced, a scan of every limit for each
level (what a never-seen path cost before: issue 15 measured 1 ms with 1 000 limits and
116 ms with 100 000). Target: the same few µs whatever the number of limits.

The second table is a spray of new caller ids at one service that has that many per-caller
limits (``shop/api/partner<i>``) besides ``shop/api/*``: each new caller used to be matched
against every per-caller limit of its route; now by one lookup per key source.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from typing import Any

from gatekeeper_wsgi.config import Config, Limit
from gatekeeper_wsgi.engine import GateKeeper


def limits_of(count: int) -> dict[str, dict[str, Any]]:
    """``count`` limits over projects of 100 services, a third of them per caller."""
    limits: dict[str, dict[str, Any]] = {
        "*": {"concurrency": 1_000_000},
        "*/*": {"concurrency": 1_000_000},
        "*/*/*": {"concurrency": 1_000_000},
    }
    index = 0
    while len(limits) < count:
        project = f"proj{index // 100}"
        limits.setdefault(project, {"concurrency": 1_000_000})
        path = f"{project}/svc{index}" + ("/*" if index % 3 == 0 else "")
        limits[path] = {"concurrency": 1_000_000}
        index += 1
    return dict(list(limits.items())[:count])


def never_seen_us(gk: GateKeeper, requests: int, round_: int) -> float:
    """µs per admit + release of a request whose (project, service) is new."""
    admit = gk.admit
    started = time.perf_counter()
    for i in range(requests):
        admit(f"proj{i % 50}", f"new-{round_}-{i}", "crm").release(200)
    return (time.perf_counter() - started) / requests * 1e6


def new_caller_us(per_caller_limits: int, requests: int, round_: int) -> float:
    """µs per admit + release of a request from a caller id never seen before."""
    limits: dict[str, dict[str, Any]] = {
        f"shop/api/partner{i}": {"concurrency": 5} for i in range(per_caller_limits)
    }
    limits["shop/api/*"] = {"concurrency": 1_000_000}
    gk = GateKeeper({"project": "shop", "limits": limits})
    try:
        admit = gk.admit
        admit("shop", "api", "warm-up").release(200)
        started = time.perf_counter()
        for i in range(requests):
            admit("shop", "api", f"new-{round_}-{i}").release(200)
        return (time.perf_counter() - started) / requests * 1e6
    finally:
        gk.close()


def scan_us(config: Config, requests: int) -> float:
    """µs per path for the former lookup: every limit looked at, on each level."""

    def most_specific(values: tuple[str, ...]) -> Limit | None:
        matching = [
            limit
            for limit in config.limits.values()
            if len(limit.segments) == len(values)
            and all(s == "*" or s == v for s, v in zip(limit.segments, values, strict=False))
        ]
        return max(
            matching,
            key=lambda limit: (tuple(s != "*" for s in limit.segments), limit.path),
            default=None,
        )

    started = time.perf_counter()
    for i in range(requests):
        most_specific((f"proj{i % 50}",))
        most_specific((f"proj{i % 50}", f"new-{i}"))
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2_000, help="never-seen paths per round")
    parser.add_argument("--rounds", type=int, default=5, help="the median is reported")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--no-scan", action="store_true", help="skip the former scan")
    args = parser.parse_args(argv)

    print(
        f"gatekeeper-wsgi never-seen path benchmark: Python {platform.python_version()}, "
        f"{platform.machine()}, memory backend, median of {args.rounds} rounds"
    )
    print(f"{'limits':>8}  {'never-seen path (index)':>24}  {'scan of every limit':>20}")
    for size in args.sizes:
        gk = GateKeeper({"project": "proj0", "limits": limits_of(size)})
        assert len(gk.config.limits) == size
        never_seen_us(gk, 100, -1)  # builds the index once, as the first request does
        gc.collect()
        indexed = statistics.median(
            never_seen_us(gk, args.requests, round_) for round_ in range(args.rounds)
        )
        assert not any(gk.inflight().values()), "every slot must be back"
        scanned = "skipped"
        if not args.no_scan:
            # The scan is slow at 100 000 limits: a few paths tell its cost.
            paths = max(3, min(args.requests, 200_000 // size))
            scanned = f"{scan_us(gk.config, paths):14.1f} µs"
        print(f"{size:>8}  {indexed:>21.1f} µs  {scanned:>20}")
        gk.close()
    print(f"{'per-caller limits':>17}  {'new caller':>12}")
    for size in args.sizes:
        cost = statistics.median(
            new_caller_us(size, args.requests, round_) for round_ in range(args.rounds)
        )
        print(f"{size:>17}  {cost:>9.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
