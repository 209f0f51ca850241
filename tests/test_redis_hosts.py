"""Hosts on one Redis (issue 19 point 5), on the asynchronous release path: host processes
hammer a wildcard limit with a rate and delayed releases (marks, tombstones, totals and
delayed sets all in play) on one redis-server and on a Redis Cluster, through a freeze
(SIGSTOP) with releases waiting in the senders, on one redis-server a restart, and on a
Cluster a node SIGKILLed and started again. An independent observer (INCR / DECR on
another redis-server) counts what the app really runs at once: never more than the limit;
every request answered, by nothing but admissions and ServiceFaults, admissions bounded by
the socket timeouts, and once the load stopped and the delays matured, nothing held
(counts and totals), no delayed set left, and the full capacity admitted."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend  # noqa: E402
from tests.apps.redis_load_host import LoadHosts  # noqa: E402
from tests.conftest import redis_binary  # noqa: E402
from tests.servers import ClusterRedis, ControlledRedis, wait_until  # noqa: E402
from tests.test_redis_tidy import assert_admits_exactly, plain_releases  # noqa: E402

pytestmark = pytest.mark.redis

LIMIT = 3
#: Per caller: 3 at once and a rate never reached; a faulty response holds its slot 50 ms.
LIMITS: dict[str, Any] = {
    "shop/work/*": {"concurrency": LIMIT, "rate": "1000000/minute", "delay": 0.05},
}


class FrozenCluster(ClusterRedis, ControlledRedis):
    """A one-node Redis Cluster that a test can freeze (SIGSTOP) and thaw."""


#: A way Redis goes away mid-load and the way it comes back.
Outage = tuple[Callable[[], None], Callable[[], None]]


def run_hosts(url: str, observer_url: str, outages: Sequence[Outage]) -> list[dict[str, Any]]:
    """Two host processes of 4 threads on ``LIMITS`` (every 4th response faulty) through
    each of ``outages`` in turn mid-load (the hosts see it: refusals by
    ``on_backend_error``; then Redis comes back and they admit again); the hosts'
    reports, checked for what the observer and the hosts saw (``LoadHosts.reports``)."""
    hosts = LoadHosts(url, observer_url, LIMIT, limits=LIMITS, path=("work", "c"), faulty=4)
    try:
        hosts.more(300)
        for down, up in outages:
            down()
            try:
                hosts.more(20, hosts.outage)  # the hosts see the outage
            finally:
                up()
            hosts.more(300)
    finally:
        hosts.stop.set()
    reports = hosts.reports()
    assert sum(report["codes"].get("GK-CONCURRENCY-LIMIT", 0) for report in reports) > 0
    return reports


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
    # No persistence: the restart forgets every lease.
    run_hosts(
        url, redis_server, [(own_redis.pause, own_redis.resume), (own_redis.stop, own_redis.start)]
    )
    assert_nothing_leaked(url)


def test_hosts_on_a_cluster_through_a_freeze(tmp_path: Path, redis_server: str) -> None:
    """The same on a Redis Cluster (releases one script per hash tag), frozen mid-load."""
    node = FrozenCluster(redis_binary(), tmp_path)
    node.start()
    try:
        url = f"{node.url}&socket_timeout=0.2&breaker_cooldown=0.05"
        run_hosts(url, redis_server, [(node.pause, node.resume)])
        assert_nothing_leaked(url)
    finally:
        node.stop()


def test_hosts_on_a_cluster_through_a_node_killed_and_restarted(
    tmp_path: Path, redis_server: str
) -> None:
    """A Redis Cluster node SIGKILLed mid-load and started again on its port (its cluster
    config file brings its slots back, its AOF every write it acknowledged, so the leases
    of the requests in flight at the kill are still held): never over the limit, every
    request answered by an admission or a ServiceFault, and the releases that were waiting
    in the senders (or unanswered when it died) replayed, so no slot is leaked: nothing
    held once the delays matured, and the full concurrency admitted again."""
    node = ClusterRedis(redis_binary(), tmp_path, persistent=True)
    node.start()
    try:
        url = f"{node.url}&socket_timeout=0.2&breaker_cooldown=0.05"
        reports = run_hosts(url, redis_server, [(node.kill, node.start)])
        # Releases were caught in the asynchronous path by the kill, and all got through.
        assert sum(report["stranded"] for report in reports) > 0
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
        out = plain_releases(*held)
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
