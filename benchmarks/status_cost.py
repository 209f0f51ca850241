"""Cost of reading the status: one status JSON and one Prometheus scrape with many keys
tracked, and what admissions pay while scrapes run (SPEC §7: O(limits), not O(keys)).

Run ``python benchmarks/status_cost.py`` (``--help`` for options). It builds a
GateKeeper with ``--limits`` limits (default 200: the project, one wildcard caller limit
per service for four services, the rest service limits) and sprays ``--keys`` distinct
callers (default 100 000) over the wildcard limits, with ``--held`` requests kept in
flight. Then it times:

- ``status JSON``: ``json.dumps(status_payload(gk))``, what ``/status.json`` serves;
- ``prometheus scrape``: ``generate_latest`` of a registry holding the collector;
- admit + release latency from ``--threads`` threads, alone and while the main thread
  scrapes back to back (p50, p99, max): a scrape must not stall admissions.

``--backend redis`` runs on a private ``redis-server`` on a free loopback port (or pass a
``redis://…`` URL nobody else uses). ``--fallback`` also times the O(tracked keys) path a
backend without ``totals()`` would take (grouping every key), for comparison. Target:
< 100 ms per status read and per scrape with 100 000 keys and 200 limits, and an
admission p99 during scrapes close to the one without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from _common import redis_server

from gatekeeper_wsgi.backends import backend_from_url
from gatekeeper_wsgi.backends.base import LimitTotals
from gatekeeper_wsgi.config import Limit
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.status import status_payload

WILDCARDS = 4


def settings(limits: int, keys: int, backend: str) -> dict[str, Any]:
    table: dict[str, Any] = {"shop": {"concurrency": 1_000_000}}
    # Room for every sprayed key plus the admitting threads own: none is ever evicted.
    per_limit = keys // WILDCARDS + 1_000
    for index in range(WILDCARDS):
        table[f"shop/api{index}/*"] = {
            "concurrency": 1_000,
            "rate": "1000000/minute",
            "max_keys": per_limit,
        }
    for index in range(limits - len(table)):
        table[f"shop/svc{index}"] = {"concurrency": 1_000}
    return {"project": "shop", "backend": backend, "limits": table}


def untallied(url: str, config: Any) -> Any:
    """The same backend with totals() switched off: the O(keys) path."""
    backend = backend_from_url(url, config)

    def no_totals(
        limits: Sequence[Limit], now: float, **options: Any
    ) -> dict[str, LimitTotals] | None:
        return None

    backend.totals = no_totals  # type: ignore[method-assign]
    return backend


def timed(run: Callable[[], object], rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return samples


def ms(samples: list[float]) -> str:
    return f"median {statistics.median(samples) * 1e3:8.2f} ms   max {max(samples) * 1e3:8.2f} ms"


def percentile(samples: list[float], share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def admissions(gk: GateKeeper, threads: int, seconds: float, busy: Callable[[], None]) -> str:
    """Admit + release latencies of `threads` threads for `seconds` while `busy` runs in
    a loop on this thread."""
    stop = threading.Event()
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def client(index: int) -> None:
        own = latencies[index]
        perf = time.perf_counter
        n = 0
        while not stop.is_set():
            n += 1
            started = perf()
            gk.admit("shop", f"api{index % WILDCARDS}", f"bench{index}-{n % 50}").release(200)
            own.append(perf() - started)

    workers = [threading.Thread(target=client, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        busy()
    stop.set()
    for worker in workers:
        worker.join()
    flat = [sample for own in latencies for sample in own]
    return (
        f"p50 {percentile(flat, 0.5) * 1e6:7.1f} µs   p99 {percentile(flat, 0.99) * 1e6:8.1f} µs"
        f"   max {max(flat) * 1e3:7.2f} ms   ({len(flat):,} admissions)"
    )


def measure(gk: GateKeeper, args: argparse.Namespace, label: str) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gatekeeper_wsgi.prometheus import register

    for index in range(args.keys):
        gk.admit("shop", f"api{index % WILDCARDS}", f"c{index}").release(200)
    held = [gk.admit("shop", f"api{index % WILDCARDS}", f"c{index}") for index in range(args.held)]
    registry = CollectorRegistry()
    collector = register(gk, registry, multiprocess=False)

    def status() -> None:
        json.dumps(status_payload(gk))

    def scrape() -> None:
        generate_latest(registry)

    tracked = sum(found.keys for path, found in (gk.totals() or {}).items() if path.endswith("/*"))
    print(f"-- {label}: {len(gk.config.limits)} limits, {tracked or args.keys:,} keys tracked")
    print(f"status JSON          {ms(timed(status, args.rounds))}")
    print(f"prometheus scrape    {ms(timed(scrape, args.rounds))}")
    if args.threads:
        idle = admissions(gk, args.threads, args.seconds, lambda: time.sleep(0.001))
        print(f"admit+release, alone          {idle}")
        busy = admissions(gk, args.threads, args.seconds, scrape)
        print(f"admit+release, during scrapes {busy}")
    for admission in held:
        admission.release(200)
    collector.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="distinct callers sprayed")
    parser.add_argument("--limits", type=int, default=200)
    parser.add_argument("--held", type=int, default=50, help="requests kept in flight")
    parser.add_argument("--rounds", type=int, default=10, help="reads timed")
    parser.add_argument("--threads", type=int, default=4, help="admitting threads (0: none)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per admission run")
    parser.add_argument(
        "--backend", default="memory", help="memory, shared:///path, redis or redis://…"
    )
    parser.add_argument("--fallback", action="store_true", help="also time the O(keys) path")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.backend == "redis":
            args.backend = stack.enter_context(redis_server())
        run(args)
    return 0


def run(args: argparse.Namespace) -> None:
    print(f"python {platform.python_version()} on {platform.machine()}, backend {args.backend}")
    config = settings(args.limits, args.keys, args.backend)
    gk = GateKeeper(config)
    try:
        measure(gk, args, "kept totals")
    finally:
        gk.close()
    if args.fallback:
        probe = GateKeeper(config)
        backend = untallied(args.backend, probe.config)
        probe.close()
        gk = GateKeeper(config, backend=backend)
        try:
            measure(gk, args, "O(keys) fallback (no totals)")
        finally:
            gk.close()


if __name__ == "__main__":
    sys.exit(main())
