"""Hosts on one Redis (issue 19 point 5), on the asynchronous release path: host processes
hammer a wildcard limit with a rate and delayed releases (marks, tombstones, totals and
delayed sets all in play) on one redis-server and on a Redis Cluster, through a freeze
(SIGSTOP) with releases waiting in the senders, and on one redis-server a restart. An
independent observer (INCR / DECR on another redis-server) counts what the app really runs
at once: never more than the limit; nothing but ServiceFaults, admissions bounded by the
socket timeouts, and once the load stopped and the delays matured, nothing held (counts and
totals), no delayed set left, and the full capacity admitted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend, _RedisGrant, _Release  # noqa: E402
from tests.apps.redis_load_host import LoadHosts  # noqa: E402
from tests.conftest import redis_binary  # noqa: E402
from tests.servers import ClusterRedis, ControlledRedis, wait_until  # noqa: E402
from tests.test_redis_tidy import assert_admits_exactly  # noqa: E402

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
    hosts = LoadHosts(url, observer_url, LIMIT, limits=LIMITS, path=("work", "c"), faulty=4)
    try:
        hosts.more(300)
        server.pause()
        try:
            hosts.more(20, hosts.outage)  # the hosts see the freeze
        finally:
            server.resume()
        hosts.more(300)
        if restart:
            server.stop()
            hosts.more(20, hosts.outage)
            server.start()
            hosts.more(300)
    finally:
        hosts.stop.set()
    reports = hosts.reports()
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
        assert_admits_exactly(gk, LIMIT)
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


def test_a_cluster_admission_carries_only_its_own_projects_releases(tmp_path: Path) -> None:
    """On a Redis Cluster, while the sender's call with releases of two projects is out, an
    admission of one project carries only that project's (the other's keys live in another
    slot: the script would fail CROSSSLOT): it is admitted by Redis, and the copy it carried
    freed its project's slot."""
    node = ClusterRedis(redis_binary(), tmp_path)
    node.start()
    gk = GateKeeper(
        {
            "project": "shop",
            "backend": node.url,
            "on_backend_error": "reject",
            "limits": {"*": {"concurrency": 5}},
        }
    )
    try:
        backend = gk.backend
        assert isinstance(backend, RedisBackend)
        held = [gk.admit("shop", "work", "c"), gk.admit("blog", "work", "c")]
        grants = [admission._held[0] for admission in held]
        out = [
            _Release(grant.lease, grant.input, grant.input.codes, 0.0, 0.0)
            for grant in grants
            if isinstance(grant, _RedisGrant)
        ]
        backend._outbox._sending = out  # as if the sender's call with both were out
        again = gk.admit("shop", "work", "c")
        assert gk.stats()["counters"]["backend_errors"] == 0
        backend._outbox._sending = []
        assert gk.inflight() == {"shop": 1, "blog": 1}  # shop's first freed by the copy
        for admission in (*held, again):
            admission.release(200)
        assert gk.inflight() == {}
    finally:
        gk.close()
        node.stop()
