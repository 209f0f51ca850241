"""One "host" for the multi-host adaptive Redis test: its own process, GateKeeper, threads.

Run by ``multiprocessing`` (spawn). Requests go to a modelled backend of fixed capacity
(beyond ``capacity`` requests inside, each takes longer in proportion: a queue). Every
admitted request enters an independent observer, a Lua script on keys the backend never
writes, which counts the requests inside across all hosts and compares the count with the
adaptive limit in force at that moment (read from the backend's hash in the same atomic
step). A limit that dropped may leave more inside than it allows (nothing admitted is cut
off): the observer logs every change it sees, and a request whose admission began before
a change (its ``time.time()``, the clock Redis ``TIME`` reads on this one machine) is
allowed the value before it. Anything above is a violation: a request admitted over the
limit in force.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.synchronize import Barrier
from typing import Any

import redis

from gatekeeper_wsgi import GateKeeper, Rejected

# KEYS[1]: the observer's hash, KEYS[2]: its log of changes (score: when seen, in us),
# KEYS[3]: the backend's adaptive hash. ARGV[1]: 1 to enter, -1 to leave; ARGV[2]: the
# limit before the backend wrote one; ARGV[3]: when the request's admission began (us).
OBSERVE = """
local inside = redis.call('HINCRBY', KEYS[1], 'inside', ARGV[1])
if ARGV[1] ~= '1' then
  return inside
end
local limit = tonumber(redis.call('HGET', KEYS[3], 'limit') or ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local seen = tonumber(redis.call('HGET', KEYS[1], 'limit') or ARGV[2])
if seen ~= limit then
  redis.call('ZADD', KEYS[2], now, seen .. ':' .. now)
end
redis.call('HSET', KEYS[1], 'limit', limit)
local allowed = limit
for _, change in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[3], '+inf')) do
  local before = tonumber(string.match(change, '^(%d+):'))
  if before > allowed then
    allowed = before
  end
end
if inside > allowed then
  redis.call('HINCRBY', KEYS[1], 'violations', 1)
end
if inside > tonumber(redis.call('HGET', KEYS[1], 'max') or 0) then
  redis.call('HSET', KEYS[1], 'max', inside)
end
return inside
"""


def run_host(
    backend_url: str,
    observer_url: str,
    observer_key: str,
    adaptive: dict[str, Any],
    capacity: int,
    threads: int,
    seconds: float,
    start: Barrier,
    results: Any,
) -> None:
    """Hammer ``shop/work`` (``concurrency = "auto"``) for ``seconds`` and report."""
    keeper = GateKeeper(
        {
            "project": "shop",
            "backend": backend_url,
            "on_backend_error": "reject",
            "limits": {"shop/work": {"concurrency": "auto", "adaptive": adaptive}},
        }
    )
    backend = keeper.backend
    hash_key = backend.adaptive_key("shop/work")  # type: ignore[attr-defined]
    observer = redis.Redis.from_url(observer_url)
    observe = observer.register_script(OBSERVE)
    keys = [observer_key, f"{observer_key}:changes", hash_key]
    initial = adaptive["initial"]
    lock = threading.Lock()
    report: dict[str, Any] = {"admitted": 0, "rejected": 0, "errors": []}
    ready = threading.Barrier(threads + 1)
    deadline: list[float] = []

    def worker() -> None:
        admitted = rejected = 0
        ready.wait()
        while time.monotonic() < deadline[0]:
            began = round(time.time() * 1_000_000)
            try:
                admission = keeper.admit("shop", "work", "host")
            except Rejected as exc:
                rejected += 1
                if exc.code != "GK-CONCURRENCY-LIMIT":
                    with lock:
                        report["errors"].append(exc.code)
                # The modelled client backs off a little, as a refused one would.
                time.sleep(0.001)
                continue
            try:
                inside = int(observe(keys=keys, args=[1, initial, began]))
                # The modelled backend: its latency grows with the queue past capacity.
                time.sleep(0.004 * max(1.0, inside / capacity))
                observe(keys=keys, args=[-1, initial, began])
            finally:
                admission.release(200)
            admitted += 1
        with lock:
            report["admitted"] += admitted
            report["rejected"] += rejected

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in workers:
        thread.start()
    start.wait()  # every host starts together
    deadline.append(time.monotonic() + seconds)
    ready.wait()
    for thread in workers:
        thread.join()
    report["backend_errors"] = keeper.stats()["counters"]["backend_errors"]
    report["adaptive"] = keeper.stats()["adaptive"]
    report["windows"] = backend.windows_computed  # type: ignore[attr-defined]
    keeper.close()
    results.put(report)
