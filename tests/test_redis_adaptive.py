"""Adaptive limits on Redis (issue 20 point 3, SPEC §4.9): one limit for all hosts, stored
next to the counters and enforced exactly by the admission script; the algorithm runs in
``adaptive.Controller`` on the host that claims a due window. Against a real redis-server;
hosts are processes; an independent observer counts what the modelled backend sees."""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.adaptive import SAMPLE_CEILING, Controller  # noqa: E402
from gatekeeper_wsgi.backends.redis import _bulk, _Input, _number, _Release  # noqa: E402
from tests.conftest import redis_binary  # noqa: E402
from tests.servers import ClusterRedis, gather  # noqa: E402
from tests.test_redis import keeper  # noqa: E402
from tests.test_redis_tidy import redis_backend  # noqa: E402

pytestmark = pytest.mark.redis

AUTO = {"concurrency": "auto", "adaptive": {"algorithm": "gradient", "min": 2, "max": 40}}


def settled(gk: GateKeeper) -> dict[str, Any]:
    """The adaptive hash of shop/work once the releases and state writes waiting in this
    process were sent."""
    backend = redis_backend(gk)
    backend._outbox.flush()
    backend._outbox.flush()  # the writes the first flush's claims queued
    raw = backend.client.hgetall(backend.adaptive_key("shop/work"))
    return {key.decode(): value.decode() for key, value in raw.items()}


def test_redis_enforces_adaptive_limits_without_warning(
    prefixed: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis keeps adaptive limits: no start-up warning that only adaptive.max applies,
    and the first admission's release leaves a learned state in the path's hash."""
    with caplog.at_level("WARNING", logger="gatekeeper"):
        gk = keeper(prefixed, {"shop/work": AUTO})
    try:
        assert redis_backend(gk).adaptive_limits
        assert not any("adaptive.max" in record.getMessage() for record in caplog.records)
        gk.admit("shop", "work", "c").release(200)
        stored = settled(gk)
        # The first sample starts a probe of the no-load latency: the limit is pinned low.
        assert stored["limit"] == "3"
        assert len(stored["s"].split()) == len(Controller.STATE)
        assert "claim" not in stored
        report = gk.stats()["adaptive"]["shop/work"]
        assert report["limit"] == 3
    finally:
        gk.close()


def test_a_lowered_limit_admits_nothing_until_in_flight_is_below_it(prefixed: str) -> None:
    """The limit in force drops to 2 while 4 requests are in flight: they run on (nothing
    is cut off), every new request is refused with the new value in its fault until
    fewer than 2 are in flight, then one is admitted."""
    gk = keeper(prefixed, {"shop/work": {**AUTO, "adaptive": {**AUTO["adaptive"], "initial": 6}}})
    try:
        backend = redis_backend(gk)
        hash_key = backend.adaptive_key("shop/work")
        # No window comes due during the test: the limit is the one written here.
        backend.client.hset(hash_key, mapping={"limit": 6, "due": 1e18})
        held = [gk.admit("shop", "work", "c") for _ in range(4)]
        backend.client.hset(hash_key, "limit", 2)
        for _ in range(3):
            with pytest.raises(Rejected) as refused:
                gk.admit("shop", "work", "c")
            assert refused.value.code == "GK-CONCURRENCY-LIMIT"
            assert refused.value.limit_value == "2"
            held.pop().release(200)
        # One left in flight, below 2: admitted.
        held.append(gk.admit("shop", "work", "c"))
        with pytest.raises(Rejected):
            gk.admit("shop", "work", "c")
        for admission in held:
            admission.release(200)
    finally:
        gk.close()


def test_a_stale_state_write_is_ignored(prefixed: str) -> None:
    """A state write whose claim is not the hash's (another host claimed the window since,
    or it arrived after its claim lapsed) changes nothing."""
    gk = keeper(prefixed, {"shop/work": AUTO})
    try:
        gk.admit("shop", "work", "c").release(200)
        before = settled(gk)
        backend = redis_backend(gk)
        hash_key = backend.adaptive_key("shop/work")
        target = _Input([hash_key], [_bulk(hash_key.encode())], [], [], "", [], [])
        stale = "=not-the-claim 0 39 0 0 0 0 0 " + " ".join(["0"] * 14)
        backend._send([_Release("x", target, stale, 0.0, 0.0, write=True)])
        assert settled(gk) == before
    finally:
        gk.close()


def test_a_sample_adds_at_most_the_cap_as_the_controller_counts_it(prefixed: str) -> None:
    """The window the script gathers counts a good sample as ``adaptive.Controller.sample``
    does, at most SAMPLE_CEILING x the baseline (so a host stall that hits a few requests
    drags no limit down on Redis either); the cap comes with each written state."""
    gk = keeper(prefixed, {"shop/work": AUTO})
    try:
        backend = redis_backend(gk)
        hash_key = backend.adaptive_key("shop/work")
        gk.admit("shop", "work", "c").release(200)
        stored = settled(gk)
        min_latency = float(stored["s"].split()[Controller.STATE.index("min_latency")])
        assert float(stored["cap"]) == SAMPLE_CEILING * min_latency
        # A cap far below any real latency, and a claim out so every sample is gathered.
        backend.client.hset(
            hash_key, mapping={"claim": "elsewhere", "until": 1e18, "due": 0, "cap": 1e-6}
        )
        sum0 = float(backend.client.hget(hash_key, "sum") or 0)
        for _ in range(5):
            gk.admit("shop", "work", "c").release(200)
        assert float(settled(gk)["sum"]) == pytest.approx(sum0 + 5e-6, abs=1e-12)
    finally:
        gk.close()


def test_samples_released_during_a_claim_are_kept(prefixed: str) -> None:
    """Releases that arrive while a window is claimed add to it: after the claim's write,
    the hash's window holds them (none is lost to the write)."""
    gk = keeper(prefixed, {"shop/work": AUTO})
    try:
        backend = redis_backend(gk)
        hash_key = backend.adaptive_key("shop/work")
        gk.admit("shop", "work", "c").release(200)
        settled(gk)
        # A claim out that nobody will write back for a while: samples accumulate.
        backend.client.hset(hash_key, mapping={"claim": "elsewhere", "until": 1e18, "due": 0})
        n0 = int(backend.client.hget(hash_key, "n") or 0)
        for _ in range(5):
            gk.admit("shop", "work", "c").release(200)
        stored = settled(gk)
        assert int(stored["n"]) == n0 + 5
        assert stored["claim"] == "elsewhere"
    finally:
        gk.close()


def test_two_hosts_share_one_adaptive_limit(prefixed: str, redis_server: str) -> None:
    """Two processes standing for hosts hammer one auto limit on one redis-server, in front
    of a backend that queues past 6 requests: an independent observer never sees more
    requests inside than the one limit in force, both hosts compute its windows, and it
    moved off its initial value."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    results = context.Queue()
    observer_key = f"observer-{uuid.uuid4().hex}"
    adaptive = {"algorithm": "gradient", "min": 2, "max": 40, "initial": 20}
    from tests.apps.redis_adaptive_host import run_host

    hosts = [
        context.Process(
            target=run_host,
            args=(prefixed, redis_server, observer_key, adaptive, 6, 12, 3.0, start, results),
        )
        for _ in range(2)
    ]
    reports = gather(hosts, results)
    for report in reports:
        assert report["errors"] == []
        assert report["backend_errors"] == 0
        assert report["admitted"] > 0
    observed = redis.Redis.from_url(redis_server).hgetall(observer_key)
    assert int(observed.get(b"violations", 0)) == 0, observed
    assert int(observed[b"max"]) <= adaptive["max"]
    # Both hosts computed windows of the one state: whichever releases when one is due.
    assert all(report["windows"] > 0 for report in reports)
    assert all(2 <= report["adaptive"]["shop/work"]["limit"] <= 40 for report in reports)
    gk = keeper(prefixed, {"shop/work": {"concurrency": "auto", "adaptive": adaptive}})
    try:
        gk.admit("shop", "work", "c").release(200)
        stored = settled(gk)
        # Moved: the observer saw the limit in force change during the load (where it
        # ends may be the initial value again, by chance, on a loaded machine).
        changes = redis.Redis.from_url(redis_server).zcard(f"{observer_key}:changes")
        assert changes > 0 or int(stored["limit"]) != adaptive["initial"]
        assert 2 <= int(stored["limit"]) <= 40
        assert gk.inflight() == {}
    finally:
        gk.close()


def test_the_limit_in_force_reaches_stats_and_prometheus(prefixed: str) -> None:
    """A host that did not compute the current value (another host wrote it) still shows
    it: stats, the fault's value and the Prometheus gauge read it from Redis."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gatekeeper_wsgi.prometheus import register

    writer, reader = keeper(prefixed, {"shop/work": AUTO}), keeper(prefixed, {"shop/work": AUTO})
    try:
        registry = CollectorRegistry()
        collector = register(reader, registry, multiprocess=False)
        reader.admit("shop", "work", "c").release(200)  # the reader computed a window
        settled(reader)
        backend = redis_backend(writer)
        backend.client.hset(backend.adaptive_key("shop/work"), mapping={"limit": 7, "due": 1e18})
        redis_backend(reader)._seen.clear()  # as if the last read were long ago
        assert reader.stats()["adaptive"]["shop/work"]["limit"] == 7
        redis_backend(reader)._seen.clear()
        scrape = generate_latest(registry).decode()
        assert 'gatekeeper_adaptive_limit{limit="shop/work"} 7.0' in scrape
        collector.close()
    finally:
        writer.close()
        reader.close()


def test_stats_show_the_limit_of_paths_this_host_never_admitted_on(prefixed: str) -> None:
    """A host that has not admitted on an adaptive path (or whose bounded memo of them
    was emptied by traffic on 10 000 other routes) reports the limit other hosts moved,
    read from Redis, not its ``initial``: for a path without ``*``, and for the keys of a
    wildcard limit a status page asks about."""
    limits = {
        "shop/work": AUTO,
        "shop/api/*": {"concurrency": "auto", "adaptive": {"algorithm": "aimd", "max": 50}},
    }
    writer, reader = keeper(prefixed, limits), keeper(prefixed, limits)
    try:
        backend = redis_backend(writer)
        for path, value in (("shop/work", 7), ("shop/api/alice", 4), ("shop/api/bob", 9)):
            backend.client.hset(backend.adaptive_key(path), mapping={"limit": value, "due": 1e18})
        assert reader.stats()["adaptive"]["shop/work"]["limit"] == 7
        asked = reader.stats(adaptive_keys=["shop/api/alice", "shop/api/bob", "shop/work"])
        assert {path: report["limit"] for path, report in asked["adaptive"].items()} == {
            "shop/work": 7,
            "shop/api/alice": 4,
            "shop/api/bob": 9,
        }
        # With the controller's state another host wrote: its latencies too.
        spec = reader.config.limits["shop/work"].adaptive
        assert spec is not None
        controller = Controller(spec, 0.0, key="shop/work")
        for step in range(1, 400):
            controller.sample(0.02 + step % 3 / 100, 5, False, step * 0.05 - 0.02, step * 0.05)
        state = " ".join(_number(value) for value in controller.state())
        backend.client.hset(
            backend.adaptive_key("shop/work"), mapping={"s": state, "limit": controller.limit}
        )
        redis_backend(reader)._seen.clear()
        shown = reader.stats()["adaptive"]["shop/work"]
        assert shown == controller.report() and shown["latency_ms"] > 0
        reader.admit("shop", "api", "alice").release(200)
        redis_backend(reader)._adaptive.clear()  # what 10 000 other routes would do
        redis_backend(reader)._seen.clear()
        again = reader.stats(adaptive_keys=["shop/api/alice"])["adaptive"]
        assert again["shop/api/alice"]["limit"] == 4
    finally:
        writer.close()
        reader.close()


def test_a_key_refused_lately_is_shown_with_nothing_in_flight(prefixed: str) -> None:
    """The status page and Prometheus show a wildcard auto limit's key refused lately
    once its requests ended, as memory and the shared file do (Redis dropped every key
    with nothing in flight from the keys shown)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gatekeeper_wsgi.prometheus import register
    from gatekeeper_wsgi.status import status_payload

    spec = {"algorithm": "aimd", "initial": 4, "max": 50}
    gk = keeper(prefixed, {"shop/api/*": {"concurrency": "auto", "adaptive": spec}})
    try:
        registry = CollectorRegistry()
        collector = register(gk, registry, multiprocess=False)
        held = [gk.admit("shop", "api", "alice") for _ in range(4)]
        with pytest.raises(Rejected):
            gk.admit("shop", "api", "alice")
        for admission in held:
            admission.release(200)
        assert gk.inflight() == {}
        shown = status_payload(gk)["stats"]["adaptive"]
        assert set(shown) == {"shop/api/alice"}
        scrape = generate_latest(registry).decode()
        assert 'gatekeeper_adaptive_limit{key="shop/api/alice",limit="shop/api/*"}' in scrape
        collector.close()
    finally:
        gk.close()


def test_an_adaptive_limit_on_a_redis_cluster(tmp_path: Any) -> None:
    """On a Redis Cluster the adaptive hash shares its path's hash tag: admissions,
    samples, claims, state writes and the totals read run without CROSSSLOT, and the limit
    is enforced."""
    node = ClusterRedis(redis_binary(), tmp_path)
    node.start()
    try:
        gk = keeper(node.url, {"shop/work": AUTO})
        try:
            for _ in range(30):
                gk.admit("shop", "work", "c").release(200)
            assert gk.stats()["counters"]["backend_errors"] == 0
            backend = redis_backend(gk)
            backend._outbox.flush()
            backend._outbox.flush()
            assert backend.windows_computed > 0
            limit = gk.stats()["adaptive"]["shop/work"]["limit"]
            held = [gk.admit("shop", "work", "c") for _ in range(limit)]
            with pytest.raises(Rejected) as refused:
                gk.admit("shop", "work", "c")
            assert refused.value.limit_value == str(limit)
            totals = gk.totals()  # the totals script runs on the project's slot too
            assert totals is not None and totals["shop/work"].inflight == limit
            for admission in held:
                admission.release(200)
        finally:
            gk.close()
    finally:
        node.stop()


def test_a_tampered_state_starts_over(prefixed: str) -> None:
    """A hash whose fields do not parse (another version's, or tampered with): requests
    pass without a backend error, stats still report, and the next window starts over
    with a fresh controller."""
    gk = keeper(prefixed, {"shop/work": AUTO})
    try:
        gk.admit("shop", "work", "c").release(200)
        settled(gk)
        backend = redis_backend(gk)
        hash_key = backend.adaptive_key("shop/work")
        garbage = {"s": "not a state", "sum": "x", "n": "y", "until": "z", "limit": "w"}
        backend.client.hset(hash_key, mapping={**garbage, "claim": "old", "due": 0})
        assert 2 <= gk.stats()["adaptive"]["shop/work"]["limit"] <= 40
        for _ in range(5):
            gk.admit("shop", "work", "c").release(200)
        stored = settled(gk)
        assert len(stored["s"].split()) == len(Controller.STATE)
        assert stored["limit"].isdigit()
        assert gk.stats()["counters"]["backend_errors"] == 0
    finally:
        gk.close()


@pytest.mark.parametrize("how", ["reload", "restart"])
def test_a_lowered_max_holds_at_once(prefixed: str, tmp_path: Any, how: str) -> None:
    """A limit learned at 30 under max 40, then a reload (or a redeploy) lowers max to 8:
    the ninth request is refused at once, with the value 8 in its fault and in stats -
    not only once a window of samples was computed under the new bounds (on a quiet path,
    maybe never)."""
    file = tmp_path / "gk.properties"
    common = f"project = shop\nbackend = {prefixed}\nlimits.shop/work.concurrency = auto\n"
    file.write_text(common + "limits.shop/work.adaptive = min=2, max=40\n")
    gk = GateKeeper(str(file))
    try:
        gk.admit("shop", "work", "c").release(200)
        settled(gk)
        backend = redis_backend(gk)
        backend.client.hset(backend.adaptive_key("shop/work"), "limit", 30)  # learned
        file.write_text(common + "limits.shop/work.adaptive = min=2, max=8\n")
        if how == "reload":
            assert gk.reload()
        else:
            gk.close()
            gk = GateKeeper(str(file))
        held = [gk.admit("shop", "work", "c") for _ in range(8)]
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "c")
        assert (refused.value.code, refused.value.limit_value) == ("GK-CONCURRENCY-LIMIT", "8")
        assert gk.stats()["adaptive"]["shop/work"]["limit"] == 8
        for admission in held:
            admission.release(200)
    finally:
        gk.close()
