"""Memory per key: what a wildcard rate limit costs per tracked key on the memory backend.

Run ``python benchmarks/memory_keys.py`` (``--help`` for options). In one fresh process it
builds a GateKeeper with one limit ``shop/login/*`` (``--rate``, default ``5/minute``,
``max_keys`` = ``--keys``), admits and releases one request for each of ``--keys``
distinct callers (default 100 000, all inside their window, so every key stays tracked),
and prints the growth of the process's resident set size (RSS, from ``/proc/self/statm``),
in total and per key. Everything a key costs is counted: the backend's counter and window,
its tables, the key string and the engine's bounded memo of callers.

Target (issue 14): 100 000 keys of a 5/minute limit cost at most 50 MB of RSS.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import sys
from pathlib import Path

from gatekeeper_wsgi.engine import GateKeeper


def rss_bytes() -> int:
    """The resident set size of this process now (Linux), else its peak so far."""
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(keys: int, rate: str, backend: str) -> tuple[int, int]:
    """(RSS growth in bytes, keys tracked) for ``keys`` distinct callers."""
    limits = {"shop/login/*": {"rate": rate, "max_keys": keys + 1}}  # + the warm-up key
    gk = GateKeeper({"project": "shop", "backend": backend, "limits": limits})
    admit = gk.admit
    admit("shop", "login", "warm-up").release(200)
    names = [f"caller-{index:07d}" for index in range(keys)]  # the callers' own strings
    gc.collect()
    before = rss_bytes()
    for name in names:
        admit("shop", "login", name).release(200)
    gc.collect()
    grown = rss_bytes() - before
    tracked = sum(1 for key in gk.inflight() if key.startswith("shop/login/caller-"))
    gk.close()
    return grown, tracked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000, help="distinct callers")
    parser.add_argument("--rate", default="5/minute", help="the wildcard limit's rate")
    parser.add_argument("--backend", default="memory", help="memory (others keep no keys here)")
    args = parser.parse_args(argv)
    grown, tracked = measure(args.keys, args.rate, args.backend)
    print(
        f"gatekeeper-wsgi memory per key: Python {platform.python_version()}, "
        f"{platform.machine()}, backend {args.backend}, limit shop/login/* rate {args.rate}"
    )
    print(f"keys tracked        {tracked:>12,}")
    print(f"RSS growth          {grown / 1e6:>12.1f} MB")
    print(f"bytes per key       {grown / max(tracked, 1):>12.0f}")
    if tracked != args.keys:
        print(f"expected {args.keys} keys tracked", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
