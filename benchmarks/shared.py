"""Admit + release cost of the shared (mmap file) backend against the memory backend.

Run ``python benchmarks/shared.py``. Each worker process builds its own GateKeeper on the
backend under test and runs ``admit`` + ``release`` in a loop: concurrency limits on all
three levels plus a per-caller rate limit, none of them ever hit (the cost every admitted
request pays). With 4 processes the memory backend counts per process (it cannot share);
the shared backend counts for the host, all four contending for one file lock.

Prints, per backend and process count, the median over rounds of the mean µs per
admit + release seen by one process, and the host-wide throughput.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Barrier
from typing import Any

from gatekeeper_wsgi import GateKeeper

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 10_000},
        "shop/orders": {"concurrency": 10_000},
        "shop/orders/*": {"concurrency": 10_000, "rate": "1000000000/minute"},
    },
}

TARGET_US = 30.0


def _worker(backend: str, iterations: int, barrier: Barrier, results: Any) -> None:
    gk = GateKeeper({**SETTINGS, "backend": backend})
    admit = gk.admit
    for _ in range(200):  # warm up: caches, first pages of the file
        admit("shop", "orders", "crm").release(200)
    barrier.wait()
    started = time.perf_counter()
    for _ in range(iterations):
        admit("shop", "orders", "crm").release(200)
    elapsed = time.perf_counter() - started
    results.put((started, started + elapsed, elapsed / iterations * 1e6))
    gk.close()


def measure(backend: str, processes: int, iterations: int) -> tuple[float, float]:
    """(mean µs per admit + release in one process, host-wide admissions per second)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(backend, iterations, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    samples = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"worker exited with {worker.exitcode}")
    per_op = statistics.mean(sample[2] for sample in samples)
    wall = max(sample[1] for sample in samples) - min(sample[0] for sample in samples)
    return per_op, processes * iterations / wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20_000, help="per process per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
    print(f"{'backend':<8} {'procs':>5} {'µs/admit+release':>17} {'host admits/s':>14}")
    verdict = 0
    with tempfile.TemporaryDirectory() as directory:
        for processes in (1, 4):
            for name in ("memory", "shared"):
                per_op, rates = [], []
                for round_ in range(args.rounds):
                    backend = (
                        "memory"
                        if name == "memory"
                        else f"shared://{directory}/bench-{processes}-{round_}.shm"
                    )
                    us, rate = measure(backend, processes, args.iterations)
                    per_op.append(us)
                    rates.append(rate)
                us = statistics.median(per_op)
                print(f"{name:<8} {processes:>5} {us:>17.1f} {statistics.median(rates):>14,.0f}")
                if name == "shared" and processes == 1 and us > TARGET_US:
                    verdict = 1
    print(f"target: <= {TARGET_US:.0f} µs per admit+release (shared, 1 process)")
    return verdict


if __name__ == "__main__":
    sys.exit(main())
