"""One "host" for the multi-host Redis test: its own process, GateKeeper and threads.

Run by ``multiprocessing`` (spawn). Every admitted request also enters an independent
observer (INCR / DECR on a key the backend never touches), whose count at entry is the
number of requests inside across all hosts at that moment.
"""

from __future__ import annotations

import threading
from multiprocessing.synchronize import Barrier
from typing import Any

import redis

from gatekeeper_wsgi import GateKeeper, Rejected


def inside_now(observer: redis.Redis, key: str, admission: Any, faulty: bool = False) -> int:
    """Enter the observer's count, note how many are inside, leave, release ``admission``
    (as a faulty response: its delay applies)."""
    try:
        inside = int(observer.incr(key))
        observer.decr(key)
        return inside
    finally:
        admission.release(503 if faulty else 200, faulty=faulty)


def run_host(
    backend_url: str,
    observer_url: str,
    observer_key: str,
    limit: int,
    threads: int,
    requests: int,
    start: Barrier,
    results: Any,
) -> None:
    """Hammer ``shop/work`` (concurrency ``limit``) and report what the observer saw."""
    keeper = GateKeeper(
        {
            "project": "shop",
            "backend": backend_url,
            "on_backend_error": "reject",
            "limits": {"shop/work": {"concurrency": limit}},
        }
    )
    observer = redis.Redis.from_url(observer_url)
    lock = threading.Lock()
    report: dict[str, Any] = {"admitted": 0, "rejected": 0, "max_inside": 0, "errors": []}
    ready = threading.Barrier(threads + 1)

    def worker() -> None:
        admitted = rejected = max_inside = 0
        ready.wait()
        for _ in range(requests):
            try:
                admission = keeper.admit("shop", "work", "host")
            except Rejected as exc:
                rejected += 1
                if exc.code != "GK-CONCURRENCY-LIMIT":
                    with lock:
                        report["errors"].append(exc.code)
                continue
            max_inside = max(max_inside, inside_now(observer, observer_key, admission))
            admitted += 1
        with lock:
            report["admitted"] += admitted
            report["rejected"] += rejected
            report["max_inside"] = max(report["max_inside"], max_inside)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in workers:
        thread.start()
    start.wait()  # every host starts together
    ready.wait()
    for thread in workers:
        thread.join()
    report["backend_errors"] = keeper.stats()["counters"]["backend_errors"]
    keeper.close()
    results.put(report)
