"""The Redis backend against real redis-server processes: round trips, scripts, failures.

Servers are stopped, frozen and restarted for real; where Redis time must pass (lease
expiry, delays, windows) the test polls until a deadline instead of assuming a duration.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing
import re
import threading
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from redis.crc import key_slot  # noqa: E402
from werkzeug.test import Client  # noqa: E402

from gatekeeper_wsgi import BackendError, GateKeeper, GateKeeperMiddleware, Rejected  # noqa: E402
from gatekeeper_wsgi.backends import backend_from_url  # noqa: E402
from gatekeeper_wsgi.backends.redis import CircuitOpen, RedisBackend  # noqa: E402
from gatekeeper_wsgi.cli import run_check  # noqa: E402
from gatekeeper_wsgi.errors import ConfigError  # noqa: E402
from gatekeeper_wsgi.resolve import resolve_route  # noqa: E402
from tests.conftest import redis_binary  # noqa: E402
from tests.servers import (  # noqa: E402
    Blackhole,
    ClusterRedis,
    ControlledRedis,
    free_port,
    gather,
    wait_until,
)

pytestmark = pytest.mark.redis


def keeper(url: str, limits: dict[str, Any], **settings: Any) -> GateKeeper:
    return GateKeeper({"project": "shop", "backend": url, "limits": limits, **settings})


def answers(gk: GateKeeper) -> bool:
    """Whether Redis answers a read (False while it fails, or the breaker fails fast)."""
    try:
        gk.inflight()
    except BackendError:
        return False
    return True


def outcome(gk: GateKeeper, service: str = "work", caller: str = "c") -> str:
    """Admit a request of project shop and release it at once: "admitted", or the code it
    was refused with."""
    try:
        gk.admit("shop", service, caller).release(200)
    except Rejected as refused:
        return refused.code
    return "admitted"


def admitted(gk: GateKeeper, service: str = "work", caller: str = "c") -> Any:
    """An admission that Redis granted (not one let through by on_backend_error)."""
    errors = gk.stats()["counters"]["backend_errors"]
    try:
        admission = gk.admit("shop", service, caller)
    except Rejected:
        return None
    if gk.stats()["counters"]["backend_errors"] != errors:
        admission.release(200)
        return None
    return admission


def client_commands(server_url: str, action: Callable[[], object]) -> list[str]:
    """The commands clients sent to the server while ``action`` ran (not those scripts ran)."""
    sentinel = redis.Redis.from_url(server_url)
    sentinel.ping()
    marker = f"end-{uuid.uuid4().hex}"
    commands: list[str] = []
    with redis.Redis.from_url(server_url).monitor() as monitor:
        action()
        sentinel.echo(marker)
        while True:
            seen = monitor.next_command()
            if marker in seen["command"]:
                break
            if seen["client_type"] != "lua":
                commands.append(seen["command"].split(" ", 1)[0].upper())
    sentinel.close()
    return commands


# --- round trips and scripts --------------------------------------------------------------


def test_one_round_trip_to_admit_and_the_release_is_not_waited_for(
    own_redis: ControlledRedis,
) -> None:
    """Three levels plus a counted rate are checked in one EVALSHA; the release sends
    nothing from the responding thread: it rides along with the next admission."""
    gk = keeper(
        own_redis.url,
        {
            "shop": {"concurrency": 50},
            "shop/work": {"concurrency": 10},
            "shop/work/*": {"concurrency": 2, "rate": "100/minute", "count": [401]},
        },
    )
    gk.admit("shop", "work", "alice").release(200)  # connect and load the script
    gk.inflight()  # and let that release settle
    holder: list[Any] = []
    assert client_commands(
        own_redis.url, lambda: holder.append(gk.admit("shop", "work", "bob"))
    ) == ["EVALSHA"]
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    own_redis.pause()  # a release that waited for Redis would now time out
    try:
        holder[0].release(200)
        assert gk.stats()["counters"]["backend_errors"] == 0
        assert backend.pending_releases() == 1
    finally:
        own_redis.resume()
    wait_until(lambda: backend.pending_releases() == 0, what="the release to be sent")
    assert gk.inflight() == {}


def test_scripts_reload_after_a_restart(own_redis: ControlledRedis) -> None:
    """A restarted Redis has no scripts (NOSCRIPT); the next request loads them and passes."""
    gk = keeper(own_redis.url, {"shop": {"concurrency": 1}})
    gk.admit("shop", "work", "c").release(200)
    source = (resources.files("gatekeeper_wsgi.backends") / "lua" / "gate.lua").read_bytes()
    sha = hashlib.sha1(source).hexdigest()
    own_redis.stop()
    own_redis.start()
    probe = redis.Redis.from_url(own_redis.url)
    assert probe.script_exists(sha) == [False]
    gk.admit("shop", "work", "c").release(200)
    assert gk.stats()["counters"]["backend_errors"] == 0
    assert probe.script_exists(sha) == [True]
    probe.close()


# --- semantics ----------------------------------------------------------------------------


def test_query_reads_in_one_round_trip_and_writes_nothing(own_redis: ControlledRedis) -> None:
    """A query (FRS 'query') answers what admit would, in one EVALSHA that writes nothing."""
    gk = keeper(
        own_redis.url, {"shop/work": {"concurrency": 1}, "shop/login/*": {"rate": "1/minute"}}
    )
    assert gk.query("shop", "work", "c") is None
    held = gk.admit("shop", "work", "c")
    gk.admit("shop", "login", "eve").release(200)
    gk.inflight()  # the release is applied (it would otherwise ride along with the query)
    probe = redis.Redis.from_url(own_redis.url)
    before = {key: probe.dump(key) for key in probe.scan_iter()}
    answers: list[Any] = []
    sent = client_commands(
        own_redis.url,
        lambda: answers.extend([gk.query("shop", "work", "c"), gk.query("shop", "login", "eve")]),
    )
    assert sent == ["EVALSHA", "EVALSHA"]
    assert [answer.code for answer in answers] == ["GK-CONCURRENCY-LIMIT", "GK-RATE-LIMIT"]
    assert {key: probe.dump(key) for key in probe.scan_iter()} == before
    held.release(200)
    assert gk.query("shop", "work", "c") is None
    probe.close()


def test_hash_tags_put_all_keys_of_a_project_in_one_cluster_slot(prefixed: str) -> None:
    """Every key carries its project as hash tag: one slot per project, under the prefix."""
    prefix = prefixed.rsplit("prefix=", 1)[1]
    gk = GateKeeper(
        {
            "project": "shop",
            "backend": prefixed,
            "limits": {
                "*": {"concurrency": 10},
                "*/login/*": {"rate": "5/minute", "key": "caller"},
                "*/*/batch": {"concurrency": 1},
            },
        }
    )
    held = [
        gk.admit(project, service, caller)
        for project, service, caller in [
            ("shop", "login", "alice"),
            ("shop", "x", "batch"),
            ("blog", "login", "bob:1"),
        ]
    ]
    raw = redis.Redis.from_url(prefixed.split("?", 1)[0])
    every = [key.decode() for key in raw.scan_iter(f"{prefix}:*")]
    keys = [key for key in every if ":z:" in key]
    assert len(keys) == 5  # one sorted set per concrete limit path
    for key in keys:
        match = re.fullmatch(rf"{re.escape(prefix)}:\{{([a-z]+)\}}:z:(\1(/.*)?)", key)
        assert match, key
    # and one totals set and one tracked set per configured wildcard limit and project
    wildcards = ["*", "*", "*/login/*", "*/login/*", "*/*/batch"]
    assert sorted(key.split("}", 1)[1] for key in every if ":z:" not in key) == sorted(
        [f":{kind}:{path}" for path in wildcards for kind in "tk"]
    )
    slots: dict[str, set[int]] = {}
    for key in every:
        slots.setdefault(key.split("{")[1].split("}")[0], set()).add(key_slot(key.encode()))
    assert {project: len(found) for project, found in slots.items()} == {"shop": 1, "blog": 1}
    assert gk.inflight() == {
        "shop": 2,
        "shop/login/alice": 1,
        "shop/x/batch": 1,
        "blog": 1,
        "blog/login/bob:1": 1,
    }
    for admission in held:
        admission.release(200)
    assert gk.inflight() == {}


def test_runs_on_redis_cluster(tmp_path: Path) -> None:
    """On a real (one-node) Redis Cluster, which refuses cross-slot scripts, all of it works."""
    node = ClusterRedis(redis_binary(), tmp_path)
    node.start()
    try:
        gk = keeper(
            node.url,
            {"shop": {"concurrency": 2}, "shop/work/*": {"rate": "2/minute"}},
            on_backend_error="reject",
        )
        first = gk.admit("shop", "work", "alice")
        second = gk.admit("shop", "work", "alice")
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "bob")
        assert refused.value.code == "GK-CONCURRENCY-LIMIT"
        assert gk.inflight() == {"shop": 2, "shop/work/alice": 2}
        first.release(200)
        second.release(200)
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "alice")
        assert refused.value.code == "GK-RATE-LIMIT"
        gk.close()
    finally:
        node.stop()


@pytest.mark.parametrize("on_backend_error", ["allow", "reject"])
def test_a_worker_starts_while_its_cluster_is_down(tmp_path: Path, on_backend_error: str) -> None:
    """A worker that starts during a Cluster outage (a restart, a deploy) comes up and
    answers by on_backend_error, as on a plain Redis; once the Cluster answers, it counts
    (the client asks for the slot map then, not at start, where it failed the boot)."""
    node = ClusterRedis(redis_binary(), tmp_path)  # not started yet: nothing answers
    gk = keeper(
        f"{node.url}&socket_connect_timeout=0.2&breaker_cooldown=0.01",
        {"shop": {"concurrency": 1}},
        on_backend_error=on_backend_error,
    )
    assert outcome(gk) == ("admitted" if on_backend_error == "allow" else "GK-BACKEND-UNAVAILABLE")
    assert gk.stats()["counters"]["backend_errors"] >= 1
    node.start()
    try:
        wait_until(lambda: answers(gk), what="the Cluster to answer")
        held = gk.admit("shop", "work", "c")
        assert outcome(gk) == "GK-CONCURRENCY-LIMIT"  # counted now
        held.release(200)
        assert wait_until(lambda: outcome(gk) == "admitted")
        gk.close()
    finally:
        node.stop()


def test_cluster_on_a_node_that_is_no_cluster_is_a_config_error(own_redis: ControlledRedis) -> None:
    """cluster=1 against a plain Redis that answers is a mistake in the URL, said at start
    (it was redis-py's own exception, no ConfigError)."""
    with pytest.raises(ConfigError, match="no Cluster node"):
        backend_from_url(f"{own_redis.url}?cluster=1")


def test_windows_run_on_redis_time_not_host_clocks(prefixed: str) -> None:
    """Hosts whose clocks are hours apart share one exact window, timed by Redis TIME."""
    clocks = [1000.0, 1000.0 + 7 * 3600]
    hosts = [
        GateKeeper(
            {"project": "shop", "backend": prefixed, "limits": {"shop/login": {"rate": "3/2s"}}},
            clock=lambda index=index: clocks[index],  # type: ignore[misc]
        )
        for index in range(2)
    ]
    for index in (0, 1, 0):
        hosts[index].admit("shop", "login", "c").release(200)
    for host in hosts:
        with pytest.raises(Rejected) as refused:
            host.admit("shop", "login", "c")
        assert refused.value.code == "GK-RATE-LIMIT"
        assert refused.value.rate is not None
        assert 0 < refused.value.rate.reset <= 2.0
    clocks[0] += 3600  # a host clock jumping ahead frees nothing
    with pytest.raises(Rejected):
        hosts[0].admit("shop", "login", "c")
    wait_until(lambda: admitted(hosts[1], "login"), what="the window to slide in Redis time")


def test_counted_statuses_confirm_or_return_the_reservation(prefixed: str) -> None:
    """With count=[401], admission reserves a place; other statuses give it back."""
    gk = keeper(prefixed, {"shop/login/*": {"rate": "2/minute", "count": [401]}})
    for _ in range(5):
        gk.admit("shop", "login", "eve").release(200)
    gk.admit("shop", "login", "eve").release(401)
    held = gk.admit("shop", "login", "eve")  # the second place, reserved
    with pytest.raises(Rejected):
        gk.admit("shop", "login", "eve")
    held.release(302)
    gk.admit("shop", "login", "eve").release(401)
    with pytest.raises(Rejected):
        gk.admit("shop", "login", "eve")


def test_delayed_decrease_holds_the_slot_until_it_matures(prefixed: str) -> None:
    """A faulty response keeps its slot for ``delay`` (Redis time), then frees it."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 1, "delay": 1.0}})
    gk.admit("shop", "work", "c").release(503, faulty=True)
    assert gk.inflight() == {"shop/work": 1}
    assert gk.stats()["counters"]["delayed_pending"] == 1
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "work", "c")
    assert refused.value.retry_after == 1  # the delayed lease matures within a second
    wait_until(lambda: admitted(gk), what="the delayed release to mature").release(200)
    assert gk.inflight() == {}


def test_retry_after_is_the_delay_even_when_a_lease_expires_sooner(prefixed: str) -> None:
    """A full limit with a request in flight and a slot held by a delay: Retry-After is
    when the delayed release matures, as on the other backends - also when the running
    request's lease (max_hold) would expire sooner than that."""
    url = prefixed + ("&" if "?" in prefixed else "?") + "max_hold=60"
    gk = keeper(url, {"shop/work": {"concurrency": 2, "delay": 120.0}})
    running = gk.admit("shop", "work", "c")
    gk.admit("shop", "work", "c").release(503, faulty=True)
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "work", "c")
    assert refused.value.code == "GK-CONCURRENCY-LIMIT"
    assert refused.value.retry_after is not None and 115 <= refused.value.retry_after <= 120
    running.release(200)
    gk.close()


def test_shadow_slots_are_reported_not_refused(prefixed: str) -> None:
    """A shadow limit over its concurrency admits and counts a shadow rejection."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 1, "mode": "shadow"}})
    held = [gk.admit("shop", "work", "c") for _ in range(3)]
    assert gk.stats()["counters"]["shadow_rejected"] == 2
    assert gk.inflight() == {"shop/work": 3}
    for admission in held:
        admission.release(200)


def test_crashed_holders_lease_expires(prefixed: str) -> None:
    """A slot whose holder never releases (a crashed worker) frees after max_hold."""
    crashed = keeper(f"{prefixed}&max_hold=1", {"shop/work": {"concurrency": 1}})
    crashed.admit("shop", "work", "c")  # never released
    crashed.close()
    gk = keeper(prefixed, {"shop/work": {"concurrency": 1}})
    with pytest.raises(Rejected):
        gk.admit("shop", "work", "c")
    wait_until(lambda: admitted(gk), what="the lease to expire").release(200)


def test_url_options_are_validated() -> None:
    """Bad backend options are a ConfigError naming the option."""
    for query, name in [
        ("prefix=a{b}", "prefix"),
        ("max_hold=0", "max_hold"),
        ("breaker_cooldown=x", "breaker_cooldown"),
        ("cluster=maybe", "cluster"),
        ("spin=-0.001", "spin"),
        ("spin=0.5", "spin"),
        ("spin=" + "9" * 5000, "spin"),
        # redis-py's own, which would fail at start-up with a LookupError, or on every
        # connection (failing open for good)
        ("encoding=bogus", "encoding"),
        ("encoding_errors=bogus", "encoding_errors"),
        ("client_name=web%201", "client_name"),
    ]:
        with pytest.raises(ConfigError, match=name):
            backend_from_url(f"redis://127.0.0.1:1/0?{query}")


@pytest.mark.parametrize(
    "password",
    ["Pa55/woRDsecret", "Pa55?woRDsecret", "Pa55#woRDsecret", "Pa55/woRD?secret", "Pa55/woRD#sec"],
)
def test_a_password_that_breaks_the_url_is_never_quoted(password: str) -> None:
    """A '/', '?' or '#' in a password not percent-encoded ends the host part early: what
    redis-py or the database check would quote is a piece of the password (a '/' then a
    '?' put a piece in the database's place, and the '@' in the query). The error says
    how to write it instead, and quotes none of it."""
    with pytest.raises(ConfigError) as raised:
        GateKeeper({"backend": f"redis://gk:{password}@127.0.0.1:1/0"})
    message = str(raised.value)
    assert "Pa55" not in message and "woRD" not in message and "sec" not in message
    assert "%2F" in message or "percent-encoded" in message


def test_a_mistyped_option_is_named_in_a_url_with_credentials() -> None:
    """Production URLs hold a password: a mistyped option is still named (it was "write
    the password percent-encoded", which was not the trouble), the password masked."""
    with pytest.raises(ConfigError, match="socket_timout") as raised:
        GateKeeper({"backend": "redis://gk:s3cret@127.0.0.1:1/0?socket_timout=1"})
    assert "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/notanumber",
        "redis://127.0.0.1:1/-5",
        "redis://127.0.0.1:1/" + "9" * 5000,
        "redis://127.0.0.1:1/\u0663",  # an Arabic-Indic three
        "redis://127.0.0.1:1/0?db=x",
        "unix:///tmp/gk-nowhere.sock?db=1a",
    ],
)
def test_a_database_that_is_not_a_number_is_a_config_error(url: str) -> None:
    """redis-py would read it as database 0 (or send -5 to a Redis that refuses it on
    every connection): the counters would be shared or lost without a word."""
    with pytest.raises(ConfigError, match="backend: db: expected a database number"):
        GateKeeper({"backend": url})


def test_a_database_redis_does_not_have_is_a_config_error(redis_server: str) -> None:
    """A server that answers that the database is out of range: a ConfigError at start
    (every request would fail open), not a note; a database it has works."""
    base = redis_server.rsplit("/", 1)[0]
    with pytest.raises(ConfigError, match="DB index is out of range"):
        GateKeeper({"backend": f"{base}/99999"})
    GateKeeper({"backend": f"{base}/3?prefix=gk-db-{uuid.uuid4().hex[:6]}"}).close()


def test_check_of_a_database_redis_does_not_have_fails_at_its_line(
    redis_server: str, tmp_path: Path
) -> None:
    """`gatekeeper check` asks the server before it calls anything OK: a database it lacks
    is an error at the file and line of ``backend``, and nothing is called OK."""
    base = redis_server.rsplit("/", 1)[0]
    path = tmp_path / "gk.properties"
    path.write_text(f"project = shop\nbackend = {base}/99999\n", encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    assert run_check(str(path), out, err=err) == 1
    assert err.getvalue().startswith(f"error: {path}:2: backend: ")
    assert "DB index is out of range" in err.getvalue()
    assert "OK" not in out.getvalue()


def test_valkey_scheme_talks_to_the_same_server(redis_server: str) -> None:
    """``valkey://`` URLs work (the protocol is Redis's)."""
    url = redis_server.replace("redis://", "valkey://") + f"?prefix=gk-v-{uuid.uuid4().hex[:6]}"
    gk = keeper(url, {"shop": {"concurrency": 1}}, on_backend_error="reject")
    held = gk.admit("shop", "work", "c")
    with pytest.raises(Rejected):
        gk.admit("shop", "work", "c")
    held.release(200)


# --- failures -----------------------------------------------------------------------------


def hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


@pytest.mark.parametrize(("policy", "status"), [("allow", 200), ("reject", 503)])
def test_redis_down_applies_on_backend_error(policy: str, status: int) -> None:
    """Connection refused: every request gets what on_backend_error says, never a 500."""
    app = GateKeeperMiddleware(
        hello,
        {
            "project": "shop",
            "backend": f"redis://127.0.0.1:{free_port()}/0?breaker_cooldown=0.01",
            "on_backend_error": policy,
            "limits": {"shop": {"concurrency": 1}},
        },
    )
    client = Client(app)
    for _ in range(5):
        response = client.get("/work")
        assert response.status_code == status
        if status == 503:
            assert json.loads(response.data)["code"] == "GK-BACKEND-UNAVAILABLE"
    assert app.gatekeeper.stats()["counters"]["backend_errors"] == 5


def test_a_redis_that_stalls_now_and_then_is_one_error_an_interval(
    own_redis: ControlledRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that stalls again and again (slow commands, fork pauses) opens and closes
    the breaker each time: one ERROR that it failed (and one WARNING that it is back) per
    10 s, not one per stall in every worker, which paged for a Redis that was serving."""
    url = f"{own_redis.url}?socket_timeout=0.1&breaker_cooldown=0.01"
    gk = keeper(url, {"shop": {"concurrency": 5}}, on_backend_error="allow")
    assert outcome(gk) == "admitted"
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        for _ in range(3):
            own_redis.pause()
            try:
                outcome(gk)  # times out: the breaker opens (allowed, uncounted)
            finally:
                own_redis.resume()
            # Until the probe after the cooldown gets through: the breaker closes.
            wait_until(lambda: answers(gk), what="Redis to answer again")
    opened = [r for r in caplog.records if "failing fast for" in r.getMessage()]
    closed = [r for r in caplog.records if "is back" in r.getMessage()]
    assert [r.levelname for r in opened] == ["ERROR"]
    assert "(1 failures since the last report)" in opened[0].getMessage()
    assert [r.levelname for r in closed] == ["WARNING"]
    gk.close()


def test_breaker_spares_requests_the_connect_timeout() -> None:
    """Redis hangs: one request pays the connect timeout, the rest fail fast without I/O."""
    hole = Blackhole()
    try:
        url = f"redis://127.0.0.1:{hole.port}/0?socket_connect_timeout=0.2&breaker_cooldown=60"
        gk = keeper(url, {"shop": {"concurrency": 1}}, on_backend_error="allow")
        backend = gk.backend
        slots = resolve_route(gk.config, "shop", "work").slots
        with pytest.raises(BackendError) as first:
            backend.acquire(slots, 0.0)
        assert isinstance(first.value.__cause__, redis.exceptions.TimeoutError)
        for _ in range(20):
            with pytest.raises(CircuitOpen) as fast:
                backend.acquire(slots, 0.0)
            assert fast.value.__cause__ is None  # refused before any network call
        for _ in range(20):
            gk.admit("shop", "work", "c").release(200)  # on_backend_error=allow applied
        assert gk.stats()["counters"]["backend_errors"] == 20
    finally:
        hole.close()


def test_hung_redis_then_recovery_is_automatic(own_redis: ControlledRedis) -> None:
    """A frozen Redis costs one read timeout; once it answers again, limits apply again."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05",
        {"shop/work": {"concurrency": 1}},
        on_backend_error="reject",
    )
    gk.admit("shop", "work", "c").release(200)
    own_redis.pause()
    try:
        for _ in range(10):
            with pytest.raises(Rejected) as refused:
                gk.admit("shop", "work", "c")
            assert refused.value.code == "GK-BACKEND-UNAVAILABLE"
    finally:
        own_redis.resume()
    held = wait_until(lambda: admitted(gk), what="recovery")
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "work", "c")
    assert refused.value.code == "GK-CONCURRENCY-LIMIT"
    held.release(200)


def test_a_frozen_redis_costs_one_timeout_not_a_second_connection(
    own_redis: ControlledRedis,
) -> None:
    """The request threads' connections are blocking sockets whose timeouts the kernel
    keeps (no poll before each send and receive): a frozen Redis still fails the call with
    a timeout, and a timeout is not sent again on a new connection (a retry would double
    the request's wait, and would show as one more connection once Redis thaws)."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05",
        {"shop/work": {"concurrency": 1}},
    )
    try:
        backend = gk.backend
        assert isinstance(backend, RedisBackend)
        gk.admit("shop", "work", "c").release(200)
        sock = backend._local.connection._sock
        assert sock.gettimeout() is None  # blocking: the kernel times it out
        slots = resolve_route(gk.config, "shop", "work").slots
        connections = backend.client.info("stats")["total_connections_received"]
        own_redis.pause()
        try:
            with pytest.raises(BackendError) as failed:
                backend.acquire(slots, 0.0)
        finally:
            own_redis.resume()
        assert isinstance(failed.value.__cause__, redis.exceptions.TimeoutError)
        # The info call itself is the one connection more: the timed-out call made none.
        assert backend.client.info("stats")["total_connections_received"] == connections
    finally:
        gk.close()


@pytest.mark.parametrize("timeout", [0.2, 0.0000001])
def test_the_kernel_keeps_socket_timeout(own_redis: ControlledRedis, timeout: float) -> None:
    """socket_timeout is what the kernel enforces on a request thread's connection, however
    small: never rounded down to 0, which the kernel reads as no timeout at all."""
    import socket
    import struct

    gk = keeper(f"{own_redis.url}?socket_timeout={timeout}", {"shop/work": {"concurrency": 1}})
    try:
        backend = gk.backend
        assert isinstance(backend, RedisBackend)
        connection = backend._connect()
        connection.connect()
        sock = connection._sock
        assert sock.gettimeout() is None
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            seconds, micros = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, option, 16))
            # The kernel keeps it in clock ticks: rounded up to one, at most.
            assert timeout <= seconds + micros / 1e6 < timeout + 0.011
    finally:
        gk.close()


def test_releases_failed_in_an_outage_are_replayed(own_redis: ControlledRedis) -> None:
    """Slots admitted before an outage and released during it come back right after,
    without waiting for their leases (max_hold 300 s) to expire."""
    gk = keeper(
        f"{own_redis.url}?breaker_cooldown=0.05",
        {"shop/work": {"concurrency": 2}},
        on_backend_error="reject",
    )
    held = [gk.admit("shop", "work", "c") for _ in range(2)]
    redis.Redis.from_url(own_redis.url).shutdown(save=True)  # the leases are persisted
    assert own_redis.process is not None
    own_redis.process.wait(timeout=10)
    for admission in held:
        admission.release(200)  # Redis is down: the sender fails, keeps them for replay
    assert gk.stats()["counters"]["backend_errors"] == 0  # no response waited for it
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    assert backend.pending_releases() == 2
    own_redis.start()
    # The lease set is back (the sender may replay the releases at once, so look at what
    # the restart loaded rather than at what is there now).
    loaded = redis.Redis.from_url(own_redis.url).info("persistence")
    # the lease set (a limit without a wildcard keeps its totals there: no totals set)
    assert loaded["rdb_last_load_keys_loaded"] == 1
    first = wait_until(lambda: admitted(gk), what="recovery")
    second = gk.admit("shop", "work", "c")
    with pytest.raises(Rejected):
        gk.admit("shop", "work", "c")
    first.release(200)
    second.release(200)
    assert gk.inflight() == {}


def test_restart_mid_load_never_raises(own_redis: ControlledRedis) -> None:
    """Threads hammer admit/release while Redis restarts: only ServiceFaults, then recovery."""
    gk = keeper(
        f"{own_redis.url}?breaker_cooldown=0.02",
        {"shop/work": {"concurrency": 3}},
        on_backend_error="reject",
    )
    stop = threading.Event()
    lock = threading.Lock()
    codes: dict[str, int] = {}
    granted = [0]
    unexpected: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                admission = gk.admit("shop", "work", "c")
            except Rejected as exc:
                with lock:
                    codes[exc.code] = codes.get(exc.code, 0) + 1
                continue
            except BaseException as exc:
                unexpected.append(exc)
                return
            admission.release(200)
            with lock:
                granted[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: granted[0] >= 100, what="load before the restart")
        own_redis.stop()
        wait_until(lambda: codes.get("GK-BACKEND-UNAVAILABLE", 0) >= 20, what="the outage to show")
        before = granted[0]
        own_redis.start()
        wait_until(lambda: granted[0] >= before + 100, what="recovery under load")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert unexpected == []
    assert set(codes) <= {"GK-BACKEND-UNAVAILABLE", "GK-CONCURRENCY-LIMIT"}
    assert gk.inflight() == {}


# --- many hosts ---------------------------------------------------------------------------


def two_hosts(backend_url: str, observer_url: str) -> None:
    """Two processes with their own GateKeeper on ``backend_url`` hammer one limit; an
    observer on ``observer_url`` never sees more requests inside than the limit."""
    from tests.apps.redis_host import run_host

    limit = 3
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    results = context.Queue()
    observer_key = f"observer-{uuid.uuid4().hex}"
    hosts = [
        context.Process(
            target=run_host,
            args=(backend_url, observer_url, observer_key, limit, 6, 150, start, results),
        )
        for _ in range(2)
    ]
    reports = gather(hosts, results)
    for report in reports:
        assert report["errors"] == []
        assert report["backend_errors"] == 0
        assert report["admitted"] > 0
    assert max(report["max_inside"] for report in reports) <= limit
    assert sum(report["rejected"] for report in reports) > 0  # the limit was contended
    assert sum(report["admitted"] + report["rejected"] for report in reports) == 2 * 6 * 150
    backend = backend_from_url(backend_url)
    assert backend.inflight(0.0) == {}
    backend.close()


def test_two_hosts_never_exceed_the_limit(prefixed: str, redis_server: str) -> None:
    """Two processes with their own GateKeeper share one Redis: an independent observer
    never sees more requests inside than the concurrency limit."""
    two_hosts(prefixed, redis_server)


def test_two_hosts_on_a_cluster_never_exceed_the_limit(tmp_path: Path, redis_server: str) -> None:
    """The same on a Redis Cluster: releases go one script per hash tag, and still an
    independent observer never sees more requests inside than the limit."""
    node = ClusterRedis(redis_binary(), tmp_path)
    node.start()
    try:
        two_hosts(node.url, redis_server)
    finally:
        node.stop()


def test_from_url_builds_a_redis_backend(prefixed: str) -> None:
    """The registry hands redis:// URLs to RedisBackend with the prefix from the URL."""
    backend = backend_from_url(prefixed)
    assert isinstance(backend, RedisBackend)
    assert backend.prefix == prefixed.rsplit("prefix=", 1)[1]
    assert not backend.local
    backend.close()


def test_a_key_of_another_type_fails_its_own_path_alone(
    prefixed: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone wrote a key of another type under one caller's path: that caller's requests
    fail (on_backend_error), while every other caller's are admitted and counted - the
    breaker stays closed (Redis answers), and the give-back that caller's failed admission
    leaves waiting (which rode along with every later admission of the process, failing
    each, for good) is dropped once Redis refuses it alone."""
    gk = keeper(prefixed, {"shop/work/*": {"concurrency": 2}}, on_backend_error="reject")
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    backend.client.set(backend.key_of("shop/work/mallory"), "not a sorted set")
    for _ in range(3):
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "work", "mallory")
        assert refused.value.code == "GK-BACKEND-UNAVAILABLE"
        held = [gk.admit("shop", "work", "alice") for _ in range(2)]
        with pytest.raises(Rejected) as full:  # counted: the limit holds
            gk.admit("shop", "work", "alice")
        assert full.value.code == "GK-CONCURRENCY-LIMIT"
        for admission in held:
            admission.release(200)
    assert gk.inflight() == {}  # the other key is no limit's: left out
    totals = gk.totals()
    assert totals is not None and totals["shop/work/*"].inflight == 0
    assert backend.releases_dropped >= 1
    dropped = [r for r in caplog.records if "redis refused a release" in r.getMessage()]
    assert len(dropped) == 1  # one WARNING an interval
