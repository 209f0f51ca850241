"""Hosts on one Redis (issue 19 point 5), on the asynchronous release path: host processes
hammer a wildcard limit with a rate and delayed releases (marks, tombstones, totals and
delayed sets all in play) on one redis-server and on a Redis Cluster, through a freeze
(SIGSTOP) with releases waiting in the senders, and on one redis-server a restart. An
independent observer (INCR / DECR on another redis-server) counts what the app really runs
at once: never more than the limit; nothing but ServiceFaults, admissions bounded by the
socket timeouts, and once the load stopped and the delays matured, nothing held (counts and
totals), no delayed set left, and the full capacity admitted."""

from __future__ import annotations

import multiprocessing
import uuid
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend  # noqa: E402
from tests.conftest import redis_binary  # noqa: E402
from tests.servers import ClusterRedis, ControlledRedis, wait_until  # noqa: E402

pytestmark = pytest.mark.redis

LIMIT = 3
#: Per caller: 3 at once and a rate never reached; a faulty response holds its slot 50 ms.
LIMITS: dict[str, Any] = {
    "shop/work/*": {"concurrency": LIMIT, "rate": "1000000/minute", "delay": 0.05},
}


class FrozenCluster(ClusterRedis, ControlledRedis):
    """A one-node Redis Cluster that a test can freeze (SIGSTOP) and thaw."""


def run_hosts(url: str, server: ControlledRedis, observer_url: str, restart: bool) -> None:
    """Two host processes of 4 threads on ``LIMITS`` (every 4th response faulty) while
    ``server`` is frozen once mid-load, and with ``restart`` then stopped and started again
    (no persistence: it forgets every lease); checks what the observer and the hosts saw."""
    from tests.apps.redis_load_host import run_load

    context = multiprocessing.get_context("spawn")
    start = context.Barrier(3)
    stop = context.Event()
    progress = context.Value("i", 0)
    outage = context.Value("i", 0)
    results = context.Queue()
    observer_key = f"observer-{uuid.uuid4().hex}"
    hosts = [
        context.Process(
            target=run_load,
            args=(url, observer_url, observer_key, LIMIT, 4, start, stop, progress, outage),
            kwargs={"results": results, "limits": LIMITS, "path": ("work", "c"), "faulty": 4},
        )
        for _ in range(2)
    ]
    for host in hosts:
        host.start()

    def more(count: int, counter: Any = progress) -> None:
        target = counter.value + count
        wait_until(lambda: counter.value >= target, what=f"{count} more")

    try:
        start.wait(timeout=60)
        more(300)
        server.pause()
        try:
            more(20, outage)  # the hosts see the freeze
        finally:
            server.resume()
        more(300)
        if restart:
            server.stop()
            more(20, outage)
            server.start()
            more(300)
    finally:
        stop.set()
    reports = [results.get(timeout=120) for _ in hosts]
    for host in hosts:
        host.join(timeout=60)
        assert host.exitcode == 0
    for report in reports:
        assert report["errors"] == []
        assert set(report["codes"]) <= {"GK-CONCURRENCY-LIMIT", "GK-BACKEND-UNAVAILABLE"}
        assert report["admitted"] > 0
        assert report["pending"] == 0
        assert report["slowest"] < 3.0  # connect + read timeouts, and slack for the machine
    assert max(report["max_inside"] for report in reports) <= LIMIT
    assert sum(report["codes"].get("GK-CONCURRENCY-LIMIT", 0) for report in reports) > 0


def assert_nothing_leaked(url: str) -> None:
    """Once the delays matured: nothing in flight or delayed, in the counts and the
    totals, the delayed set gone, and the caller's full concurrency admitted."""
    gk = GateKeeper(
        {"project": "shop", "backend": url, "limits": LIMITS, "on_backend_error": "reject"}
    )
    try:

        def idle() -> bool:
            totals = gk.totals()
            assert totals is not None
            return gk.inflight() == {} and totals["shop/work/*"].inflight == 0

        wait_until(idle, what="every slot back")
        backend = gk.backend
        assert isinstance(backend, RedisBackend)
        assert list(backend.client.scan_iter(match=f"{backend.prefix}:*:d:*")) == []
        full = [gk.admit("shop", "work", "c") for _ in range(LIMIT)]
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "c")
        assert refused.value.code == "GK-CONCURRENCY-LIMIT"
        for admission in full:
            admission.release(200)
    finally:
        gk.close()


def test_hosts_on_one_redis_through_a_freeze_and_a_restart(
    own_redis: ControlledRedis, redis_server: str
) -> None:
    """Two hosts on one redis-server, frozen mid-load, then stopped and restarted: never
    over the limit, no leak."""
    url = f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05"
    run_hosts(url, own_redis, redis_server, restart=True)
    assert_nothing_leaked(url)


def test_hosts_on_a_cluster_through_a_freeze(tmp_path: Path, redis_server: str) -> None:
    """The same on a Redis Cluster (releases one script per hash tag), frozen mid-load."""
    node = FrozenCluster(redis_binary(), tmp_path)
    node.start()
    try:
        url = f"{node.url}&socket_timeout=0.2&breaker_cooldown=0.05"
        run_hosts(url, node, redis_server, restart=False)
        assert_nothing_leaked(url)
    finally:
        node.stop()
