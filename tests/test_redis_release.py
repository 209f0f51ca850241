"""The Redis backend's release path, against real redis-server processes: a response never
waits for its release, the release still always arrives (in order, exactly once, through
freezes and restarts), status reads count exactly, and keys go away when they are done.

Where Redis time must pass the tests poll up to a deadline; where a release must be caught
in flight, Redis is frozen (SIGSTOP) so it stays there.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

redis = pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper, Rejected  # noqa: E402
from gatekeeper_wsgi.backends import backend_from_url  # noqa: E402
from gatekeeper_wsgi.backends import redis as redis_backend  # noqa: E402
from gatekeeper_wsgi.backends.redis import RedisBackend  # noqa: E402
from gatekeeper_wsgi.engine import Admission  # noqa: E402
from tests.conftest import admits_exactly, redis_binary  # noqa: E402
from tests.servers import ControlledRedis, RedisServer, run_together, wait_until  # noqa: E402

pytestmark = pytest.mark.redis


def keeper(url: str, limits: dict[str, Any], **settings: Any) -> GateKeeper:
    return GateKeeper({"project": "shop", "backend": url, "limits": limits, **settings})


def backend_of(gk: GateKeeper) -> RedisBackend:
    backend = gk.backend
    assert isinstance(backend, RedisBackend)
    return backend


def sent_by_connection(server_url: str, action: Any) -> dict[str, list[str]]:
    """The commands clients sent while ``action`` ran, per client address (MONITOR)."""
    sentinel = redis.Redis.from_url(server_url)
    sentinel.ping()
    marker = f"end-{uuid.uuid4().hex}"
    seen: dict[str, list[str]] = {}
    with redis.Redis.from_url(server_url).monitor() as monitor:
        action()
        sentinel.echo(marker)
        while True:
            command = monitor.next_command()
            if marker in command["command"]:
                break
            if command["client_type"] != "lua":
                origin = f"{command['client_address']}:{command['client_port']}"
                seen.setdefault(origin, []).append(command["command"].split(" ", 1)[0].upper())
    sentinel.close()
    return seen


def own_address(backend: RedisBackend) -> str:
    """host:port of the calling thread's own connection to Redis."""
    host, port = backend._local.connection._sock.getsockname()[:2]
    return f"{host}:{port}"


# --- the responding thread ----------------------------------------------------------------


def test_a_request_thread_sends_one_command_per_request(own_redis: ControlledRedis) -> None:
    """Over 50 requests (3 levels + a counted rate) the request's own connection sends 50
    EVALSHAs, one per admission, and nothing else: the releases ride along or go by the
    sender; afterwards nothing is held."""
    gk = keeper(
        f"{own_redis.url}?flush_interval=0.005",
        {
            "shop": {"concurrency": 50},
            "shop/work": {"concurrency": 10},
            "shop/work/*": {"concurrency": 2, "rate": "1000/minute", "count": [401]},
        },
    )
    gk.admit("shop", "work", "alice").release(200)  # connect and load the script
    backend = backend_of(gk)
    mine = own_address(backend)
    # The sender sends that one by itself (no admission follows): its connection is made
    # now, not while MONITOR watches (a new connection's handshake is not a release).
    wait_until(lambda: backend.pending_releases() == 0, what="the sender to connect")

    def requests() -> None:
        for index in range(50):
            gk.admit("shop", "work", "alice").release(401 if index % 2 else 200)

    seen = sent_by_connection(own_redis.url, requests)
    assert seen[mine] == ["EVALSHA"] * 50
    assert all(set(commands) == {"EVALSHA"} for commands in seen.values())
    assert gk.inflight() == {}
    assert gk.stats()["counters"]["backend_errors"] == 0


def test_an_admission_looks_for_its_answer_and_the_sender_never_does(
    own_redis: ControlledRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request thread looks for its admission's answer awake (``spin``) before it sleeps
    on the socket; the release sender's calls, which no request waits for, do not look;
    ``spin=0`` never looks."""
    looks: list[float] = []
    look = redis_backend._await_answer

    def counted(sock: Any, spin: float) -> bool:
        looks.append(spin)
        look(sock, spin)
        return True  # as if in time, however loaded the machine (see the next test)

    monkeypatch.setattr(redis_backend, "_await_answer", counted)
    for query, expected in [("spin=0.0002", [0.0002] * 20), ("spin=0", [])]:
        gk = keeper(f"{own_redis.url}?{query}", {"shop/work": {"concurrency": 5}})
        gk.admit("shop", "work", "c").release(200)  # connects: its first answer is read as is
        looks.clear()
        for _ in range(20):
            gk.admit("shop", "work", "c").release(200)
        # A status read sends the waiting releases first, as the sender does: alone.
        assert gk.inflight() == {}
        assert looks == expected, query
        assert gk.stats()["counters"]["backend_errors"] == 0
        gk.close()


def test_an_admission_after_written_releases_looks_once_their_answers_are_read(
    own_redis: ControlledRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release written at once (its request took the last slot) has its answer read
    before the next admission's, on the same connection; then that admission looks for its
    own, unless it came along (held back here by ``CLIENT PAUSE``, so it did not)."""
    looks: list[float] = []
    look = redis_backend._await_answer

    def counted(sock: Any, spin: float) -> bool:
        looks.append(spin)
        look(sock, spin)
        return True

    monkeypatch.setattr(redis_backend, "_await_answer", counted)
    gk = keeper(f"{own_redis.url}?spin=0.0002", {"shop/work": {"concurrency": 2}})
    gk.admit("shop", "work", "c").release(200)  # connects
    connection = backend_of(gk)._local.connection
    held = gk.admit("shop", "work", "c")
    gk.admit("shop", "work", "c").release(200)  # the last slot: its release is written
    assert len(connection.gatekeeper_posted) == 1
    looks.clear()
    pauser = redis.Redis.from_url(own_redis.url)
    pauser.execute_command("CLIENT", "PAUSE", "50", "ALL")
    gk.admit("shop", "work", "c").release(200)
    assert looks == [0.0002]
    held.release(200)
    assert gk.inflight() == {}
    pauser.close()


def test_a_socket_a_python_timeout_came_back_to_is_not_looked_at(
    own_redis: ControlledRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's own parser (without hiredis) puts a Python timeout back on the socket
    in ``can_read``; CPython would then wait up to that timeout in each look, and a frozen
    Redis would cost a request twice its ``socket_timeout``. Such a socket is read as
    before, without looks."""
    looks: list[float] = []
    monkeypatch.setattr(redis_backend, "_await_answer", lambda sock, spin: looks.append(spin))
    # (A limit never full: a request that takes the last slot has its release written at
    # once, and the next admission reads that answer first, without a look.)
    gk = keeper(f"{own_redis.url}?spin=0.0002", {"shop/work": {"concurrency": 5}})
    gk.admit("shop", "work", "c").release(200)  # connects
    connection = backend_of(gk)._local.connection
    connection.gatekeeper_socket.settimeout(0.5)  # as redis-py's SocketBuffer leaves it
    looks.clear()
    held = [gk.admit("shop", "work", "c") for _ in range(2)]
    assert gk.inflight() == {"shop/work": 2}
    for admission in held:
        admission.release(200)
    assert looks == []
    connection.gatekeeper_socket.settimeout(None)
    gk.admit("shop", "work", "c").release(200)
    assert looks == [0.0002]
    assert gk.inflight() == {}


def test_answers_later_than_the_look_are_slept_on(own_redis: ControlledRedis) -> None:
    """Redis holds the admission's answers longer than the thread looks (``CLIENT PAUSE``,
    as a Redis on another host would): the requests are admitted all the same; after 8
    late looks in a row that thread sleeps on its next 63 answers, then looks once more,
    and one more late look puts it to sleep again: a far Redis costs a request a look once
    in 64. A look in time starts the count over."""
    gk = keeper(f"{own_redis.url}?spin=0.0002", {"shop/work": {"concurrency": 5}})
    gk.admit("shop", "work", "c").release(200)  # connects and loads the script
    connection = backend_of(gk)._local.connection
    pauser = redis.Redis.from_url(own_redis.url)

    def late_admission() -> None:
        pauser.execute_command("CLIENT", "PAUSE", "20", "ALL")
        held = gk.admit("shop", "work", "c")
        assert gk.inflight() == {"shop/work": 1}
        held.release(200)

    # (On a loaded machine even an unpaused look may run out: the count starts here.)
    connection.gatekeeper_sleeps = connection.gatekeeper_late = 0
    for late in range(1, 8):
        late_admission()
        assert (connection.gatekeeper_late, connection.gatekeeper_sleeps) == (late, 0)
    late_admission()
    assert (connection.gatekeeper_late, connection.gatekeeper_sleeps) == (7, 63)
    for remaining in range(62, -1, -1):
        gk.admit("shop", "work", "c").release(200)  # slept on, not looked at
        assert (connection.gatekeeper_late, connection.gatekeeper_sleeps) == (7, remaining)
    late_admission()
    assert (connection.gatekeeper_late, connection.gatekeeper_sleeps) == (7, 63)
    assert gk.inflight() == {}
    assert gk.stats()["counters"]["backend_errors"] == 0
    pauser.close()


def test_the_next_request_of_the_process_is_never_refused_by_its_own_previous(
    prefixed: str,
) -> None:
    """Concurrency 1, the release left waiting as long as allowed: the next request, on this
    thread or another, is admitted every time, and never two at once."""
    gk = keeper(
        f"{prefixed}&flush_interval=0.005",
        {"shop/work": {"concurrency": 1}},
        on_backend_error="reject",
    )
    for _ in range(100):
        gk.admit("shop", "work", "c").release(200)
    handed = threading.Event()
    taken = threading.Event()
    results: list[object] = []

    def other() -> None:
        for _ in range(50):
            handed.wait()
            handed.clear()
            try:
                results.append(gk.admit("shop", "work", "c"))
            except Rejected as exc:
                results.append(exc)
            taken.set()

    thread = threading.Thread(target=other)
    thread.start()
    for _ in range(50):
        gk.admit("shop", "work", "c").release(200)
        handed.set()  # the other thread admits right after this release
        taken.wait()
        taken.clear()
        admission = results[-1]
        assert isinstance(admission, Admission)
        with pytest.raises(Rejected):  # and holds the one slot
            gk.admit("shop", "work", "c")
        admission.release(200)
    thread.join()
    assert gk.inflight() == {}


def test_the_release_of_a_last_slot_reaches_redis_without_this_hosts_next_call(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrency 1, no release sender (nothing leaves the outbox but with an admission
    of this host): a finished request's slot is still free for another host, because the
    release of a last slot is written to Redis as the response ends, not left to ride
    along with this host's next admission (another host may have the client's next
    request first). The answer is read with this host's next command."""
    limits = {"shop/work": {"concurrency": 1}}
    one = keeper(prefixed, limits, on_backend_error="reject")
    two = keeper(prefixed, limits, on_backend_error="reject")
    outbox = backend_of(one)._outbox
    monkeypatch.setattr(outbox, "_arm", lambda: None)  # no sender thread
    try:
        for _ in range(20):
            mine = wait_until(lambda: admitted(one), what="the slot on this host")
            mine.release(200)
            other = wait_until(lambda: admitted(two), what="the slot, on the other host")
            with pytest.raises(Rejected):  # one slot, exactly
                one.admit("shop", "work", "c")
            other.release(200)
    finally:
        one.close()
        two.close()


def test_a_window_place_given_back_reaches_redis_without_this_hosts_next_call(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `count` limit's last window place, given back by a response it does not count
    (a login that succeeded), is free for the client's next request on another host
    without this host calling Redis again: its release is written as the response ends,
    as a last slot's is (no release sender here: nothing else would take it there).
    Written, not waited for: Redis may take the other host's admission, sent a moment
    later on another connection, first, so the other host looks until it fits."""
    limits = {"shop/login/*": {"rate": "1/minute", "count": [401]}}
    one = keeper(prefixed, limits, on_backend_error="reject")
    two = keeper(prefixed, limits, on_backend_error="reject")
    monkeypatch.setattr(backend_of(one)._outbox, "_arm", lambda: None)  # no sender thread
    monkeypatch.setattr(backend_of(two)._outbox, "_arm", lambda: None)

    def login(gk: GateKeeper) -> Any:
        try:
            return gk.admit("shop", "login", "alice")
        except Rejected:
            return None

    try:
        for _ in range(5):  # each host's give-back lets the other in
            wait_until(lambda: login(one), what="the place, on one host").release(200)
            wait_until(lambda: login(two), what="the place, on the other host").release(200)
        # The last give-back (two's) was written, not waited for: looked for until it fits.
        wait_until(lambda: login(one), what="the place, on one host").release(401)  # counted
        with pytest.raises(Rejected):
            two.admit("shop", "login", "alice")
    finally:
        one.close()
        two.close()


def test_a_written_release_never_answered_is_sent_again(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A last slot's release written to Redis whose answer no thread reads (its write was
    lost, and its thread does not call again) is sent again by the sender once stale:
    the slot comes back without waiting for max_hold."""
    monkeypatch.setattr(redis_backend, "_POSTED_STALE", 0.05)
    limits = {"shop/work": {"concurrency": 1}}
    gk = keeper(prefixed, limits)
    other = keeper(prefixed, limits, on_backend_error="reject")
    try:
        held = gk.admit("shop", "work", "c")  # the last slot: its release is written at once
        connection = backend_of(gk)._local.connection
        connection.send_packed_command = lambda *args, **kwargs: None  # the write is lost
        held.release(200)
        del connection.send_packed_command
        assert backend_of(gk).pending_releases() == 1  # written, not answered
        wait_until(lambda: admitted(other), what="the release sent again").release(200)
        assert other.inflight() == {}
    finally:
        gk.close()
        other.close()


def test_a_release_never_waits_for_redis_even_after_a_refusal(
    own_redis: ControlledRedis,
) -> None:
    """Once this host was refused (the slot is wanted: releases go at once), a response's
    release is still only written, never waited for: with Redis frozen it returns, and
    once Redis is back the slot is free."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=30",
        {"shop/work": {"concurrency": 1}},
        on_backend_error="reject",
    )
    held = gk.admit("shop", "work", "c")
    with pytest.raises(Rejected):
        gk.admit("shop", "work", "d")
    own_redis.pause()
    released = threading.Event()

    def release() -> None:
        held.release(200)
        released.set()

    try:
        # The admitting thread's own connection writes it: no thread to wait for it.
        threading.Thread(target=release, daemon=True).start()
        assert released.wait(timeout=20), "the release waited for a frozen Redis"
    finally:
        own_redis.resume()
    wait_until(lambda: admitted(gk), what="the slot").release(200)
    assert gk.inflight() == {}
    gk.close()


def test_a_release_in_flight_is_held_never_double_counted(own_redis: ControlledRedis) -> None:
    """Releases caught in the sender while Redis is frozen count as held; once Redis is back
    a status read counts them released: exactly once, nothing negative, nothing left."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=5",
        {"shop": {"concurrency": 10}, "shop/work": {"concurrency": 4}},
        on_backend_error="reject",
    )
    held = [gk.admit("shop", "work", "c") for _ in range(4)]
    backend = backend_of(gk)
    own_redis.pause()
    try:
        for admission in held[:3]:
            admission.release(200)
        # The sender has them out (or waiting): Redis cannot have applied them.
        wait_until(lambda: backend._outbox._sending, what="the sender to send")
        assert backend.pending_releases() == 3
    finally:
        own_redis.resume()
    assert gk.inflight() == {"shop": 1, "shop/work": 1}
    assert gk.inflight() == {"shop": 1, "shop/work": 1}
    held[3].release(200)
    assert gk.inflight() == {}
    wait_until(lambda: backend.pending_releases() == 0, what="the sender to finish")
    assert gk.inflight() == {}
    assert [gk.admit("shop", "work", "c") for _ in range(4)]  # the full capacity is back


def test_a_lingering_sender_is_woken_once_and_still_sends_a_lone_release(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under steady traffic no response wakes the sender (it looks once per flush interval
    while it lingers): over 100 requests it is woken once, by the first release, and a last
    release that no admission takes along still reaches Redis."""
    monkeypatch.setattr(redis_backend, "_LINGER", 3600.0)  # it lingers for the whole test
    gk = keeper(prefixed, {"shop/work": {"concurrency": 200}})
    outbox = backend_of(gk)._outbox
    wakes: list[None] = []
    arm = outbox._arm

    def counted() -> None:
        wakes.append(None)
        arm()

    monkeypatch.setattr(outbox, "_arm", counted)
    for _ in range(100):
        gk.admit("shop", "work", "c").release(200)
    assert len(wakes) == 1
    wait_until(lambda: len(outbox) == 0, what="the last release to be sent")
    probe = backend_from_url(prefixed)
    assert probe.inflight(0.0) == {}
    assert len(wakes) == 1
    probe.close()
    gk.close()


def test_a_sender_of_a_sub_millisecond_interval_waits_to_be_woken_instead_of_polling(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a flush interval under 1 ms the sender does not linger (it would look more often
    than the responses it spares a wake-up arrive): once its releases are sent it waits to
    be woken, and the next release wakes it and is sent."""
    monkeypatch.setattr(redis_backend, "_LINGER", 3600.0)
    gk = keeper(f"{prefixed}&flush_interval=0.0002", {"shop/work": {"concurrency": 200}})
    outbox = backend_of(gk)._outbox
    for _ in range(20):
        gk.admit("shop", "work", "c").release(200)
    wait_until(lambda: len(outbox) == 0 and not outbox._armed, what="the sender to stop looking")
    gk.admit("shop", "work", "c").release(200)
    wait_until(lambda: len(outbox) == 0, what="the next release to be sent")
    probe = backend_from_url(prefixed)
    assert probe.inflight(0.0) == {}
    probe.close()
    gk.close()


def test_close_sends_the_releases_still_waiting(prefixed: str) -> None:
    """A process that closes its gatekeeper right after its last responses leaves nothing
    held: close() sends what is waiting."""
    gk = keeper(f"{prefixed}&flush_interval=0.005", {"shop/work": {"concurrency": 200}})
    held = [gk.admit("shop", "work", "c") for _ in range(100)]
    for admission in held:
        admission.release(200)
    gk.close()
    other = backend_from_url(prefixed)
    assert other.inflight(0.0) == {}
    other.close()


def test_close_sends_the_releases_waiting_while_the_breaker_is_open(
    own_redis: ControlledRedis,
) -> None:
    """A moment's outage opened the breaker (for a minute here) with a release waiting;
    Redis is back when the process closes its gatekeeper (a graceful restart): close()
    tries once anyway, and the release is not left held until max_hold."""
    url = f"{own_redis.url}?breaker_cooldown=60&socket_timeout=0.2"
    gk = keeper(url, {"shop/work": {"concurrency": 200}})
    backend = backend_of(gk)
    gk.admit("shop", "work", "c").release(200)  # connects
    held = gk.admit("shop", "work", "c")
    own_redis.pause()
    try:
        held.release(200)  # the sender's send times out: the breaker opens
        wait_until(lambda: backend._breaker.open, what="the breaker to open")
    finally:
        own_redis.resume()
    assert backend.pending_releases() == 1
    gk.close()
    other = RedisBackend.from_url(url)
    assert other.inflight(0.0) == {}
    other.close()


def test_the_exit_flush_tries_once_per_process_and_skips_closed_backends(
    own_redis: ControlledRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Redis down at a process's exit, its waiting releases are tried once (the flush
    is registered with atexit and multiprocessing both), and a backend closed before
    (which tried at its close) is not tried again: an exit during an outage is not held
    up by one socket timeout per hook and backend."""
    url = f"{own_redis.url}?breaker_cooldown=60&socket_timeout=0.2"
    gk, closed = keeper(url, {"shop/work": {"concurrency": 200}}), keeper(url, {})
    backend = backend_of(gk)
    gk.admit("shop", "work", "c").release(200)  # connects
    held = gk.admit("shop", "work", "c")
    closed.close()
    assert backend_of(closed) not in redis_backend._BACKENDS
    sends: list[int] = []
    send = backend._send

    def counted(releases: list[Any]) -> None:
        sends.append(len(releases))
        send(releases)

    monkeypatch.setattr(backend, "_send", counted)
    monkeypatch.setattr(redis_backend, "_exit_flushed_pid", 0)
    own_redis.pause()
    try:
        held.release(200)
        wait_until(lambda: backend._breaker.open, what="the breaker to open")
        sends.clear()
        redis_backend._flush_at_exit()
        redis_backend._flush_at_exit()  # the second hook
        assert sends == [1]
    finally:
        own_redis.resume()
    gk.close()
    other = RedisBackend.from_url(url)
    assert other.inflight(0.0) == {}
    other.close()


def test_many_threads_release_exactly_once(prefixed: str) -> None:
    """Sixteen threads admit and release 200 times each against concurrency 4: an observer
    counting inside never sees more than 4, and at the end nothing is held."""
    gk = keeper(prefixed, {"shop/work": {"concurrency": 4}}, on_backend_error="reject")
    lock = threading.Lock()
    inside = [0, 0]  # now, most

    def task(_: int) -> int:
        admitted = 0
        for _ in range(200):
            try:
                admission = gk.admit("shop", "work", "c")
            except Rejected:
                continue
            with lock:
                inside[0] += 1
                inside[1] = max(inside[1], inside[0])
            with lock:
                inside[0] -= 1
            admission.release(200)
            admitted += 1
        return admitted

    admitted = run_together(16, task)
    assert inside[1] <= 4
    assert sum(admitted) > 0
    assert gk.stats()["counters"]["backend_errors"] == 0
    assert gk.inflight() == {}


def _forked_child(gk: GateKeeper, go: Any, results: Any) -> None:
    backend = backend_of(gk)
    outcome: dict[str, Any] = {"inherited": backend.pending_releases()}
    go.wait(60)
    for _ in range(20):
        wait_until(lambda: admitted(gk), what="a slot").release(200)
    outcome["own sender"] = backend._outbox._thread is not None
    outcome["inflight"] = gk.inflight()
    results.put(outcome)


def admitted(gk: GateKeeper) -> Any:
    try:
        return gk.admit("shop", "work", "c")
    except Rejected:
        return None


def test_a_forked_worker_starts_its_own_sender(own_redis: ControlledRedis) -> None:
    """gunicorn --preload: a worker forked while the master has releases waiting starts its
    own sender, does not take the master's releases over (the master sends them), and
    leaves nothing held."""
    gk = keeper(
        f"{own_redis.url}?socket_timeout=5",
        {"shop/work": {"concurrency": 1}},
        on_backend_error="reject",
    )
    held = gk.admit("shop", "work", "c")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    go = context.Event()
    own_redis.pause()
    try:
        held.release(200)  # waiting in the master's sender at fork time
        assert backend_of(gk).pending_releases() == 1
        child = context.Process(target=_forked_child, args=(gk, go, results))
        child.start()
    finally:
        own_redis.resume()
    # The master sends its release (inflight() flushes first) before the child asks: a
    # child refused meanwhile would send its releases itself for a second (the fairness
    # rule after a refusal) and might finish without ever needing its sender.
    assert gk.inflight() == {}
    go.set()
    outcome = results.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert outcome == {"inherited": 0, "own sender": True, "inflight": {}}
    assert gk.inflight() == {}


def test_releases_waiting_at_exit_are_sent(prefixed: str) -> None:
    """A worker process that exits right after its last responses, without closing its
    gatekeeper (a graceful restart): its waiting releases are sent at exit, nothing held."""
    script = (
        "import sys\n"
        "from gatekeeper_wsgi import GateKeeper\n"
        "gk = GateKeeper({'project': 'shop', 'backend': sys.argv[1],"
        " 'limits': {'shop/work': {'concurrency': 100}}})\n"
        "for _ in range(50):\n"
        "    gk.admit('shop', 'work', 'c').release(200)\n"
    )
    url = f"{prefixed}&flush_interval=0.005"
    subprocess.run([sys.executable, "-c", script, url], check=True, timeout=60)
    backend = backend_from_url(prefixed)
    assert backend.inflight(0.0) == {}
    backend.close()


def _admit_twice_and_return(url: str) -> None:
    """A multiprocessing child's work: two requests, then return at once (its releases
    still wait in its sender)."""
    gk = GateKeeper({"project": "shop", "backend": url, "limits": {"shop/w": {"concurrency": 50}}})
    for _ in range(2):
        gk.admit("shop", "w", "c").release(200)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_multiprocessing_child_that_returns_sends_its_releases(
    prefixed: str, method: str
) -> None:
    """A multiprocessing child started by fork or forkserver ends with os._exit, which
    skips atexit: its waiting releases are sent by multiprocessing's own exit, and nothing
    stays held until max_hold."""
    context = multiprocessing.get_context(method)
    children = [
        context.Process(target=_admit_twice_and_return, args=(prefixed,)) for _ in range(10)
    ]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    backend = backend_from_url(prefixed)
    try:
        assert backend.inflight(0.0) == {}
    finally:
        backend.close()


def test_a_release_placed_as_the_idle_sender_ends_is_still_sent(
    prefixed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender ends when idle and a release starts a new one: over 100 releases, each
    placed while the previous sender may be ending, every one reaches Redis by itself."""
    monkeypatch.setattr(redis_backend, "_SENDER_IDLE", 0.001)
    gk = keeper(f"{prefixed}&flush_interval=0", {"shop/work": {"concurrency": 100}})
    backend = backend_of(gk)
    probe = backend_from_url(prefixed)
    for _ in range(100):
        gk.admit("shop", "work", "c").release(200)
        wait_until(lambda: backend.pending_releases() == 0, what="the release to be sent")
    assert probe.inflight(0.0) == {}
    probe.close()


def test_a_unix_socket_url_works(tmp_path: Path) -> None:
    """``unix:///path.sock?db=0`` reaches a redis-server listening on that socket."""
    sock = tmp_path / "redis.sock"
    server = RedisServer(redis_binary(), tmp_path, extra=("--unixsocket", str(sock)))
    server.start()
    try:
        gk = keeper(f"unix://{sock}?db=0", {"shop": {"concurrency": 1}}, on_backend_error="reject")
        held = gk.admit("shop", "work", "c")
        with pytest.raises(Rejected):
            gk.admit("shop", "work", "c")
        held.release(200)
        assert gk.inflight() == {}
        gk.close()
    finally:
        server.stop()


# --- keys go away -------------------------------------------------------------------------


def lives_left(server_url: str, prefix: str, kind: str = "z") -> list[int]:
    """The milliseconds each key under ``prefix`` has left to live (PTTL): the sets of the
    concrete paths (``kind`` z), the totals sets of the limits (t) or their delayed sets (d)."""
    raw = redis.Redis.from_url(server_url)
    pipe = raw.pipeline(transaction=False)
    for key in raw.scan_iter(f"{prefix}:{{*}}:{kind}:*", count=1000):
        pipe.pttl(key)
    ttls = [int(ttl) for ttl in pipe.execute()]
    raw.close()
    return ttls


def test_a_delayed_release_leaves_no_key_past_its_delay(prefixed: str, redis_server: str) -> None:
    """A spray of 500 callers, each ending faulty with a 60 s delay: every key expires with
    its delay (+1 ms), not max_hold (300 s) later; keys of short delays are gone once they
    matured."""
    prefix = prefixed.rsplit("prefix=", 1)[1]
    gk = keeper(
        prefixed,
        {
            "shop/work/*": {"concurrency": 1, "delay": 60},
            "shop/quick/*": {"concurrency": 1, "delay": 0.05},
        },
    )
    for index in range(500):
        gk.admit("shop", "work", f"c{index}").release(503, faulty=True)
    assert gk.inflight() == {f"shop/work/c{index}": 1 for index in range(500)}
    ttls = lives_left(redis_server, prefix)
    assert len(ttls) == 500
    assert all(0 < ttl <= 60_001 for ttl in ttls)
    for index in range(20):
        gk.admit("shop", "quick", f"c{index}").release(503, faulty=True)
    wait_until(lambda: len(lives_left(redis_server, prefix)) == 500, what="quick keys to go")
    # Besides, per limit a delayed set for the totals, which lives as long as its latest
    # delayed release: the quick one goes as they mature; the totals sets, emptied, are gone.
    wait_until(lambda: len(lives_left(redis_server, prefix, "d")) == 1, what="quick set to go")
    assert all(0 < ttl <= 60_001 for ttl in lives_left(redis_server, prefix, "d"))
    assert lives_left(redis_server, prefix, "t") == []


def test_a_rate_key_lives_one_window_after_its_last_request(
    prefixed: str, redis_server: str
) -> None:
    """A spray of 300 callers on a 5/minute rate limit: once their requests end, every key
    expires within one window (60 s), not max_hold (300 s) after the admission."""
    prefix = prefixed.rsplit("prefix=", 1)[1]
    gk = keeper(prefixed, {"shop/login/*": {"rate": "5/minute"}})
    for index in range(300):
        gk.admit("shop", "login", f"c{index}").release(200)
    assert gk.inflight() == {}
    ttls = lives_left(redis_server, prefix)
    assert len(ttls) == 300
    assert all(0 < ttl <= 60_001 for ttl in ttls)
    assert len(lives_left(redis_server, prefix, "t")) == 1


# --- hosts, freezes and restarts ----------------------------------------------------------


def test_hosts_through_a_freeze_and_a_restart_hold_the_limit_and_leak_nothing(
    own_redis: ControlledRedis, redis_server: str
) -> None:
    """Two host processes hammer one limit while Redis is frozen (SIGSTOP) and later shut
    down with its leases saved and restarted, releases waiting in the senders both times:
    an observer never sees more inside than the limit, nothing but ServiceFaults reach the
    app, no admission waits much past the socket timeouts, and once load stops every
    release has arrived: nothing held, the full capacity admitted."""
    from tests.apps.redis_load_host import LoadHosts

    limit = 3
    url = f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=0.05"
    hosts = LoadHosts(url, redis_server, limit)
    try:
        hosts.more(300)
        own_redis.pause()
        hosts.more(20, hosts.outage)  # the hosts see the freeze
        own_redis.resume()
        hosts.more(300)
        redis.Redis.from_url(own_redis.url).shutdown(save=True)  # leases saved, then gone
        assert own_redis.process is not None
        own_redis.process.wait(timeout=10)
        hosts.more(20, hosts.outage)
        own_redis.start()
        hosts.more(300)
    finally:
        hosts.stop.set()
    hosts.reports()  # never over the limit, only ServiceFaults, bounded, every release sent
    gk = keeper(url, {"shop/work": {"concurrency": limit}}, on_backend_error="reject")
    assert gk.inflight() == {}
    admits_exactly(gk, limit, "shop", "work", "c")
    gk.close()
