"""Cost of the admission engine itself: admit + release, and reloading a large file.

Run ``python benchmarks/engine.py`` (``--help`` for options). Measures, on the memory
backend unless ``--backend`` names another:

- admit + release of one request under 1 concurrency limit, static and ``"auto"``
  (adaptive: its samples, windows and controller; target <= 1.5 x the static cost);
- admit + release under concurrency limits on all 3 levels plus 1 rate limit;
  both single-threaded and with 8 threads (wall time / total operations, so it shows
  what the GIL and the backend's lock leave of parallelism);
- ``GateKeeper.reload()`` of a changed 1 000-limit ``.properties`` file (parse, validate,
  compare, swap).

Limits are set high enough never to refuse: this is the price every admitted request pays.
Targets on the reference machine: <= 5 µs per admit+release single-threaded, reload <= 20 ms.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import threaded

from gatekeeper_wsgi.engine import GateKeeper

ONE_LEVEL = {"shop": {"concurrency": 1_000_000}}
# An adaptive limit whose min leaves room for every thread, even while it probes latency.
ONE_LEVEL_AUTO = {
    "shop": {
        "concurrency": "auto",
        "adaptive": {"min": 100, "max": 1_000_000, "initial": 100},
    }
}
THREE_LEVELS_AND_RATE = {
    "shop": {"concurrency": 1_000_000},
    "shop/checkout": {"concurrency": 1_000_000},
    "shop/checkout/*": {"concurrency": 1_000_000, "rate": "1000000000/minute"},
}


def keeper(limits: dict[str, Any], backend: str) -> GateKeeper:
    return GateKeeper({"project": "shop", "backend": backend, "limits": limits})


def admit_release(gk: GateKeeper, operations: int) -> None:
    admit = gk.admit
    for _ in range(operations):
        admit("shop", "checkout", "crm").release(200)


def single_threaded(gk: GateKeeper, operations: int) -> float:
    """µs per admit+release in one thread."""
    started = time.perf_counter()
    admit_release(gk, operations)
    return (time.perf_counter() - started) / operations * 1e6


def multi_threaded(gk: GateKeeper, operations: int, threads: int) -> float:
    """Wall-clock µs per admit+release with ``threads`` threads sharing the work."""
    share = operations // threads
    seconds = threaded(threads, lambda _index: admit_release(gk, share))
    return seconds / (share * threads) * 1e6


def properties_file(limits: int, variant: int) -> str:
    """A realistic operators' file: project limits, services with delays, markers,
    queues and rates, and per-caller limits; ``variant`` changes one value."""
    lines = ["project = shop", "reload.every_seconds = 5"]
    projects = max(1, limits // 100)
    written = 0
    for p in range(projects):
        project = f"proj{p}"
        lines += [f"limits.{project}.concurrency = {500 + variant}", f"limits.{project}.delay = 2"]
        written += 1
        for s in range(limits // projects - 1):
            if written >= limits:
                break
            path = f"{project}/svc{s}" if s % 4 else f"{project}/svc{s}/*"
            lines.append(f"limits.{path}.concurrency = {10 + s % 7}")
            if s % 4 == 1:
                lines.append(f"limits.{path}.queue = 20, 1.5")
                lines.append(f"limits.{path}.timeout_status = 502, 504")
            elif s % 4 == 2:
                lines.append(f"limits.{path}.timeout_header = X-Fault-Code: TIMEOUT")
                lines.append(f"limits.{path}.delay = 5")
            elif s % 4 == 0:
                lines.append(f"limits.{path}.rate = 100/10s")
                lines.append(f"limits.{path}.key = ip")
            written += 1
    return "\n".join(lines) + "\n"


def reload_ms(limits: int, rounds: int) -> tuple[float, float]:
    """Median ms of reload() of a changed file, and of the first load (for reference)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "gatekeeper.properties"
        texts = [properties_file(limits, variant) for variant in (0, 1)]
        path.write_text(texts[0], encoding="utf-8")
        started = time.perf_counter()
        gk = GateKeeper(path)
        first = (time.perf_counter() - started) * 1e3
        assert len(gk.config.limits) == limits, len(gk.config.limits)
        timings = []
        for round_ in range(rounds):
            path.write_text(texts[(round_ + 1) % 2], encoding="utf-8")
            started = time.perf_counter()
            changed = gk.reload()
            timings.append((time.perf_counter() - started) * 1e3)
            assert changed, "the file changed, so reload() must say so"
        gk.close()
        return statistics.median(timings), first


def auto_over_static(backend: str, rounds: int, operations: int) -> float:
    """The adaptive limit's admit+release cost as a share of the static one's, measured in
    alternating rounds (so a loaded machine's noise hits both alike), medians."""
    static, auto = keeper(ONE_LEVEL, backend), keeper(ONE_LEVEL_AUTO, backend)
    times: dict[GateKeeper, list[float]] = {static: [], auto: []}
    for gk in times:
        admit_release(gk, 10_000)
    for _ in range(rounds):
        for gk, samples in times.items():
            samples.append(single_threaded(gk, operations))
    static.close()
    auto.close()
    return statistics.median(times[auto]) / statistics.median(times[static])


def median_of(rounds: int, measure: Callable[[], float]) -> float:
    gc.collect()
    return statistics.median(measure() for _ in range(rounds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operations", type=int, default=200_000, help="per round")
    parser.add_argument("--rounds", type=int, default=5, help="the median is reported")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--limits", type=int, default=1000, help="limits in the reloaded file")
    parser.add_argument("--backend", default="memory", help="memory, shared:///path, redis://…")
    args = parser.parse_args(argv)

    print(
        f"gatekeeper-wsgi engine benchmark: Python {platform.python_version()}, "
        f"{platform.machine()}, backend {args.backend}, median of {args.rounds} rounds"
    )
    rows: list[tuple[str, str, str]] = []
    cases = (
        ("1 level", ONE_LEVEL),
        ("1 level, auto", ONE_LEVEL_AUTO),
        ("3 levels + 1 rate", THREE_LEVELS_AND_RATE),
    )
    for name, limits in cases:
        gk = keeper(limits, args.backend)
        admit_release(gk, 10_000)  # warm up caches and the route table
        single = median_of(args.rounds, lambda gk=gk: single_threaded(gk, args.operations))
        rows.append((f"admit+release, {name}", "1", f"{single:8.2f} µs/op"))
        threaded = median_of(
            args.rounds, lambda gk=gk: multi_threaded(gk, args.operations, args.threads)
        )
        rows.append((f"admit+release, {name}", str(args.threads), f"{threaded:8.2f} µs/op"))
        assert not any(gk.inflight().values()), "every slot must be back"
        gk.close()
    ratio = auto_over_static(args.backend, 3 * args.rounds, args.operations // 5)
    rows.append(("admit+release, 1 level: auto ÷ static, alternating", "1", f"{ratio:8.2f} x"))
    reload, first = reload_ms(args.limits, max(args.rounds, 11))
    rows.append((f"reload(), changed {args.limits}-limit .properties", "1", f"{reload:8.2f} ms"))
    rows.append((f"first load, {args.limits}-limit .properties", "1", f"{first:8.2f} ms"))

    width = max(len(row[0]) for row in rows)
    print(f"{'case':<{width}}  threads  {'cost':>14}")
    for case, threads, cost in rows:
        print(f"{case:<{width}}  {threads:>7}  {cost:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
