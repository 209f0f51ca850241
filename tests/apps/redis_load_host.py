"""One "host" for the Redis chaos tests: its own process, GateKeeper and threads, hammering
one limit until told to stop, while the test stops, freezes and restarts Redis.

Run by ``multiprocessing`` (spawn). Every admitted request also enters an independent
observer (INCR / DECR on a key of another redis-server, which the test never stops), whose
count at entry is the number of requests inside across all hosts at that moment.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import uuid
from multiprocessing.synchronize import Barrier, Event
from typing import Any

import redis

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.redis import RedisBackend
from tests.apps.redis_host import inside_now
from tests.servers import wait_until


def run_load(
    backend_url: str,
    observer_url: str,
    observer_key: str,
    limit: int,
    threads: int,
    start: Barrier,
    stop: Event,
    progress: Any,
    outage: Any,
    results: Any,
    limits: dict[str, Any] | None = None,
    path: tuple[str, str] = ("work", "host"),
    faulty: int = 0,
) -> None:
    """Admit and release ``path`` (service, caller) of project shop under ``limits``
    (default ``shop/work``, concurrency ``limit``) in ``threads`` threads until ``stop``,
    every ``faulty``-th response of a thread faulty (0: none); count admissions into
    ``progress`` and GK-BACKEND-UNAVAILABLE refusals into ``outage`` (shared integers) as
    they happen; then report what happened and what the observer saw."""
    keeper = GateKeeper(
        {
            "project": "shop",
            "backend": backend_url,
            "on_backend_error": "reject",
            "limits": limits or {"shop/work": {"concurrency": limit}},
        }
    )
    service, caller = path
    backend = keeper.backend
    assert isinstance(backend, RedisBackend)
    observer = redis.Redis.from_url(observer_url)
    lock = threading.Lock()
    report: dict[str, Any] = {
        "admitted": 0,
        "asked": 0,
        "answered": 0,
        "codes": {},
        "errors": [],
        "max_inside": 0,
    }
    slowest = [0.0]
    #: the most releases (and give-backs) seen waiting for Redis while it was out
    stranded = [0]

    def worker() -> None:
        admitted = max_inside = asked = 0
        codes: dict[str, int] = {}
        while not stop.is_set():
            began = time.monotonic()
            asked += 1
            try:
                admission = keeper.admit("shop", service, caller)
            except Rejected as exc:
                codes[exc.code] = codes.get(exc.code, 0) + 1
                if exc.code == "GK-BACKEND-UNAVAILABLE":
                    with outage.get_lock():
                        outage.value += 1
                    stranded[0] = max(stranded[0], backend.pending_releases())
                continue
            except BaseException as exc:  # anything else would be a 500
                with lock:
                    report["errors"].append(repr(exc))
                return
            finally:
                took = time.monotonic() - began
                if took > slowest[0]:
                    slowest[0] = took
            admitted += 1
            failed = faulty > 0 and admitted % faulty == 0
            max_inside = max(max_inside, inside_now(observer, observer_key, admission, failed))
            with progress.get_lock():
                progress.value += 1
        with lock:
            report["admitted"] += admitted
            report["asked"] += asked
            report["answered"] += admitted + sum(codes.values())
            report["max_inside"] = max(report["max_inside"], max_inside)
            for code, count in codes.items():
                report["codes"][code] = report["codes"].get(code, 0) + count

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    start.wait()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    # Every release placed must reach Redis by itself (no help from later admissions).
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: not backend.pending_releases(), 30.0, "the releases to be sent")
    report["pending"] = backend.pending_releases()
    report["stranded"] = stranded[0]
    report["slowest"] = slowest[0]
    report["backend_errors"] = keeper.stats()["counters"]["backend_errors"]
    keeper.close()
    results.put(report)


class LoadHosts:
    """``hosts`` processes running :func:`run_load` against ``backend_url``, started
    together; the test drives the phases (:meth:`more`) and then gathers the
    :meth:`reports`. ``options`` go to :func:`run_load` (limits, path, faulty)."""

    def __init__(
        self,
        backend_url: str,
        observer_url: str,
        limit: int,
        hosts: int = 2,
        threads: int = 4,
        **options: Any,
    ) -> None:
        context = multiprocessing.get_context("spawn")
        start = context.Barrier(hosts + 1)
        self.stop = context.Event()
        self.progress = context.Value("i", 0)
        #: GK-BACKEND-UNAVAILABLE refusals so far
        self.outage = context.Value("i", 0)
        self.limit = limit
        self._results = context.Queue()
        observer_key = f"observer-{uuid.uuid4().hex}"
        self._processes = [
            context.Process(
                target=run_load,
                args=(backend_url, observer_url, observer_key, limit, threads, start),
                kwargs={
                    "stop": self.stop,
                    "progress": self.progress,
                    "outage": self.outage,
                    "results": self._results,
                    **options,
                },
            )
            for _ in range(hosts)
        ]
        for process in self._processes:
            process.start()
        start.wait(timeout=60)

    def more(self, count: int, counter: Any = None) -> None:
        """Wait until ``count`` more admissions (or, with ``counter``, of that) happened."""
        counted = self.progress if counter is None else counter
        target = counted.value + count
        wait_until(lambda: counted.value >= target, what=f"{count} more")

    def reports(self) -> list[dict[str, Any]]:
        """Stop the load; each host's report, once every host exited cleanly, checked: no
        error, every request answered by an admission or a ServiceFault, admissions bounded
        by the socket timeouts, every release sent, and the observer never saw more inside
        than the limit."""
        self.stop.set()
        reports = [self._results.get(timeout=120) for _ in self._processes]
        for process in self._processes:
            process.join(timeout=60)
            assert process.exitcode == 0
        for report in reports:
            assert report["errors"] == []
            assert report["answered"] == report["asked"]  # each an admission or a fault
            assert set(report["codes"]) <= {"GK-CONCURRENCY-LIMIT", "GK-BACKEND-UNAVAILABLE"}
            assert report["admitted"] > 0
            assert report["pending"] == 0
            # Bounded by connect + read timeout (0.25 + 0.2 s, one retry on a closed
            # connection); the rest is slack for a loaded machine.
            assert report["slowest"] < 3.0
        assert max(report["max_inside"] for report in reports) <= self.limit
        return reports
