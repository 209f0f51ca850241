"""How fast a slot freed in one process reaches a request queued in another (shared file).

Run ``python benchmarks/queue_handoff.py``. A holder process and a waiter process share a
``concurrency: 1`` limit with a queue. Each round the holder takes the slot, waits until the
waiter has its ticket, holds the slot ``--hold`` seconds, then releases it; the waiter,
woken by the release, is admitted, notes the time (``time.monotonic``, one clock for the
host) and gives the slot back. Prints the hand-off (release to admission) over the rounds
and the CPU the waiter burnt per second of waiting: a waiter that polled every 5 ms, as
before the host's line, looked 200 times a second; the first waiter of a line now looks
only when woken, or every ``tickets.FIRST_LOOK`` (50 ms) for what no release announces.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends.shared import SharedBackend


def _settings(table: str) -> dict[str, Any]:
    queue = {"size": 4, "wait": 60}
    return {
        "project": "shop",
        "backend": f"shared://{table}",
        "limits": {"shop/api": {"concurrency": 1, "queue": queue}},
    }


def _waiter(table: str, rounds: int, go: Connection, report: Connection) -> None:
    gk = GateKeeper(_settings(table))
    cpu = waited = 0.0
    for _ in range(rounds):
        go.recv()  # the holder has the slot: this request will queue
        started, cpu_started = time.monotonic(), time.process_time()
        admission = gk.admit("shop", "api", "waiter")
        admitted = time.monotonic()
        cpu += time.process_time() - cpu_started
        waited += admitted - started
        report.send(admitted)
        admission.release(200)
    report.send((cpu, waited))
    gk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--hold", type=float, default=0.05, help="seconds the holder holds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        table = os.path.join(directory, "handoff.shm")
        gk = GateKeeper(_settings(table))
        backend = gk.backend
        assert isinstance(backend, SharedBackend)
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        wait_for_go, go = context.Pipe(duplex=False)
        process = context.Process(target=_waiter, args=(table, args.rounds, wait_for_go, send))
        process.start()
        handoffs = []
        for _ in range(args.rounds):
            holder = gk.admit("shop", "api", "holder")
            go.send(True)
            # An older backend without a host's line cannot say: the hold covers it.
            while hasattr(backend, "waiters") and not backend.waiters("shop/api"):
                time.sleep(0.0005)
            time.sleep(args.hold)
            released = time.monotonic()
            holder.release(200)
            handoffs.append(receive.recv() - released)
        cpu, waited = receive.recv()
        process.join()
        gk.close()
    micros = sorted(handoff * 1e6 for handoff in handoffs)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.rounds} rounds")
    print(
        f"hand-off, release in one process -> admission in another: median "
        f"{statistics.median(micros):.0f} µs, p90 {micros[int(len(micros) * 0.9) - 1]:.0f} µs, "
        f"max {micros[-1]:.0f} µs"
    )
    print(f"waiter CPU while queued: {cpu / waited * 1000:.1f} ms per second of waiting")


if __name__ == "__main__":
    main()
