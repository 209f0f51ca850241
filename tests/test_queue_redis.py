"""Queues on the Redis backend are one line per limit path for every process on the Redis
(SPEC §4.4): FIFO across processes, at most ``size`` waiters in all, and a waiter whose
process died does not hold its place.

Real processes (forked, each with its own engine and connections) wait in the line of one
limit on a real redis-server; Redis itself says who waits (the line's sorted set), and an
independent observer, a pipe every admitted request writes to while it holds the slot,
records what really got in and in which order.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from multiprocessing.process import BaseProcess
from typing import Any

import pytest

pytest.importorskip("redis")

import redis

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends import redis as redis_backend
from tests.servers import DEADLINE, wait_until
from tests.test_redis import outcome as admit_outcome

pytestmark = pytest.mark.redis

PATH = "shop/api"
FORK = multiprocessing.get_context("fork")


def settings(url: str, size: int = 10, wait: float = DEADLINE) -> dict[str, Any]:
    limits = {PATH: {"concurrency": 1, "queue": {"size": size, "wait": wait}}}
    return {"project": "shop", "backend": url, "limits": limits}


def line_length(url: str) -> int:
    """Waiters in the line of PATH, as Redis holds it."""
    prefix = url.rsplit("prefix=", 1)[1]
    client = redis.Redis.from_url(url.split("?", 1)[0])
    try:
        return int(client.zcard(f"{prefix}:{{shop}}:q:{PATH}"))
    finally:
        client.close()


def _waiter(url: str, name: str, size: int, wait: float, observed: int, results: Any) -> None:
    """A process of its own: queue for PATH, then tell the observer while holding it."""
    gk = GateKeeper(settings(url, size, wait))
    try:
        admission = gk.admit("shop", "api", name)
    except Rejected as rejected:
        results.put((name, rejected.code))
        return
    os.write(observed, f"{name}\n".encode())  # one small write: atomic
    admission.release(200)
    results.put((name, "admitted"))
    gk.close()


class Waiters:
    """Processes that join the line one after another (each only once the one before it
    has its place in Redis), and the observer pipe they write their admissions to."""

    def __init__(self, url: str, size: int = 10, wait: float = DEADLINE) -> None:
        self.url, self.size, self.wait = url, size, wait
        self.read_fd, self.write_fd = os.pipe()
        self.results: Any = FORK.Queue()
        self.processes: dict[str, BaseProcess] = {}

    def join(self, name: str, *, waits: bool = True) -> None:
        before = line_length(self.url)
        process = FORK.Process(
            target=_waiter,
            args=(self.url, name, self.size, self.wait, self.write_fd, self.results),
        )
        process.start()
        self.processes[name] = process
        if waits:
            wait_until(lambda: line_length(self.url) == before + 1, what=f"{name} in line")

    def admitted(self, count: int) -> list[str]:
        """The names of the next ``count`` admissions, in the order they got in."""
        data = b""
        while data.count(b"\n") < count:
            chunk = os.read(self.read_fd, 4096)
            assert chunk
            data += chunk
        return data.decode().split()

    def outcomes(self, count: int) -> dict[str, str]:
        return dict(self.results.get(timeout=DEADLINE) for _ in range(count))

    def close(self) -> None:
        for process in self.processes.values():
            process.join(DEADLINE)
            if process.is_alive():
                process.kill()
        os.close(self.read_fd)
        os.close(self.write_fd)


def test_waiters_of_several_processes_are_admitted_in_the_order_they_joined(
    prefixed: str,
) -> None:
    """Three processes queue behind a slot held here; freed, it goes to them one by one,
    in the order they joined, never two at once (concurrency 1)."""
    holder = GateKeeper(settings(prefixed))
    held = holder.admit("shop", "api", "holder")
    waiters = Waiters(prefixed)
    try:
        for name in ("X", "Y", "Z"):
            waiters.join(name)
        held.release(200)
        assert waiters.admitted(3) == ["X", "Y", "Z"]
        assert waiters.outcomes(3) == {"X": "admitted", "Y": "admitted", "Z": "admitted"}
        assert line_length(prefixed) == 0
        assert holder.inflight() == {}
    finally:
        waiters.close()
        holder.close()


def test_the_queue_size_bounds_the_line_of_all_processes(prefixed: str) -> None:
    """size 2: two waiters of two processes fill the line; a third process is refused
    at once with GK-QUEUE-FULL, and the two get in."""
    holder = GateKeeper(settings(prefixed, size=2))
    held = holder.admit("shop", "api", "holder")
    waiters = Waiters(prefixed, size=2)
    try:
        waiters.join("X")
        waiters.join("Y")
        waiters.join("Z", waits=False)
        assert waiters.outcomes(1) == {"Z": "GK-QUEUE-FULL"}
        assert line_length(prefixed) == 2
        held.release(200)
        assert waiters.admitted(2) == ["X", "Y"]
        assert waiters.outcomes(2) == {"X": "admitted", "Y": "admitted"}
    finally:
        waiters.close()
        holder.close()


def test_a_sigkilled_waiter_does_not_hold_its_place(prefixed: str) -> None:
    """The first waiter's process is killed: once it has not looked at the line for
    WAITER_GONE_AFTER, the next one gets the slot, and the line is empty afterwards."""
    holder = GateKeeper(settings(prefixed))
    held = holder.admit("shop", "api", "holder")
    waiters = Waiters(prefixed)
    try:
        waiters.join("X")
        waiters.join("Y")
        killed = waiters.processes["X"]
        assert killed.pid is not None
        os.kill(killed.pid, signal.SIGKILL)
        killed.join(DEADLINE)
        held.release(200)
        assert waiters.admitted(1) == ["Y"]
        assert waiters.outcomes(1) == {"Y": "admitted"}
        wait_until(lambda: line_length(prefixed) == 0, what="the line to empty")
    finally:
        waiters.close()
        holder.close()


def test_a_waiter_that_times_out_leaves_the_line(prefixed: str) -> None:
    """A waiter whose wait runs out gets GK-QUEUE-TIMEOUT and its place is given up at
    once, not when it counts as gone."""
    holder = GateKeeper(settings(prefixed, wait=0.2))
    held = holder.admit("shop", "api", "holder")
    try:
        with pytest.raises(Rejected) as info:
            holder.admit("shop", "api", "late")
        assert info.value.code == "GK-QUEUE-TIMEOUT"
        assert line_length(prefixed) == 0
    finally:
        held.release(200)
        holder.close()


def test_a_newcomer_lines_up_behind_the_waiters(prefixed: str, monkeypatch: Any) -> None:
    """A request that finds the slot free while the line has a waiter (one that has not
    looked yet) does not take it: it lines up behind, and gets in only once the waiter
    ahead has left."""
    monkeypatch.setattr(redis_backend, "WAITER_GONE_AFTER", 3600.0)  # the waiter stays live
    gk = GateKeeper(settings(prefixed))
    line = gk.backend.waiting_line()
    first = line.join(PATH, 10)  # a waiter of another process, in effect: it never looks
    assert first is not None
    admitted = threading.Event()
    outcome: list[str] = []

    def newcomer() -> None:
        outcome.append(admit_outcome(gk, "api", "newcomer"))
        admitted.set()

    thread = threading.Thread(target=newcomer)
    thread.start()
    try:
        wait_until(lambda: line_length(prefixed) == 2, what="the newcomer in line")
        assert not admitted.is_set()  # the slot is free, yet it waits behind the first
        line.leave(first)
        assert admitted.wait(DEADLINE)
        assert outcome == ["admitted"]
    finally:
        thread.join(DEADLINE)
        gk.close()
    assert line_length(prefixed) == 0


def test_a_waiter_in_a_frozen_redis_waits_one_timeout(own_redis: Any, caplog: Any) -> None:
    """Redis freezes while a request waits in a queue line: its next look times out (one
    socket_timeout) and it gets on_backend_error's answer; leaving the line then fails fast
    through the breaker (as admissions do) instead of waiting a second socket timeout."""
    url = f"{own_redis.url}?socket_timeout=0.2&breaker_cooldown=60&prefix=q"
    gk = GateKeeper({**settings(url), "on_backend_error": "reject"})
    held = gk.admit("shop", "api", "holder")
    outcome: list[str] = []

    def waiter() -> None:
        outcome.append(admit_outcome(gk, "api", "waiter"))

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        wait_until(lambda: line_length(url) == 1, what="the waiter in the line")
        own_redis.pause()
        try:
            thread.join(DEADLINE)
        finally:
            own_redis.resume()
        assert outcome == ["GK-BACKEND-UNAVAILABLE"]
        left = [r.getMessage() for r in caplog.records if "leaving a queue line" in r.getMessage()]
        assert len(left) == 1 and "failing fast" in left[0], left
    finally:
        thread.join(DEADLINE)
        held.release(200)  # the breaker is open: kept for the sender, never raised here
        gk.close()
