"""Queues on the shared backend are FIFO across the processes of a host (SPEC §4.4).

Real worker processes (forked) wait in the line of one limit; the table says who waits in
which order (``SharedBackend.waiters``), and an independent observer, a pipe every
admitted request writes to while it holds the slot, records what really got in and when.
The children sleep with the look-again bounds of ``tickets`` set to an hour, so that only
the wake-ups (a release's message, the leave of the waiter ahead, a pidfd when it is
killed) can move the line: a lost wake-up shows as a queue timeout, never as a pass.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import threading
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import SharedBackend, filelock, tickets
from gatekeeper_wsgi.backends.shared.liveness import proc_stat
from gatekeeper_wsgi.backends.shared.tickets import path_digest
from gatekeeper_wsgi.engine import Admission
from tests.servers import wait_until
from tests.tablelock import try_lock

DEADLINE = 30.0
PATH = "shop/api"
#: the look-again bounds of the children: long enough that only wake-ups move a line
NEVER = 3600.0


def limits(size: int = 10, wait: float = DEADLINE) -> dict[str, Any]:
    return {PATH: {"concurrency": 1, "queue": {"size": size, "wait": wait}}}


def settings(table: Path, size: int = 10, wait: float = DEADLINE) -> dict[str, Any]:
    return {"project": "shop", "backend": f"shared://{table}", "limits": limits(size, wait)}


class Observer:
    """A pipe each admitted request writes ``+name`` to when it gets the slot and ``-name``
    to just before it gives it back: the order of admissions, and proof that they never
    overlapped, as the requests themselves saw them."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self._buffer = b""

    def write(self, event: str) -> None:
        os.write(self.write_fd, event.encode() + b"\n")  # one small write: atomic

    def events(self, count: int) -> list[str]:
        """The next ``count`` events (blocking, bounded by DEADLINE via the callers)."""
        while self._buffer.count(b"\n") < count:
            chunk = os.read(self.read_fd, 4096)
            assert chunk, "the observer pipe closed"
            self._buffer += chunk
        lines = self._buffer.split(b"\n")
        taken, rest = lines[:count], lines[count:]
        self._buffer = b"\n".join(rest)
        return [line.decode() for line in taken]

    def admissions(self, count: int) -> list[str]:
        """The names of the next ``count`` admissions, checking each left before the next
        got in (concurrency 1 held host-wide)."""
        events = self.events(2 * count)
        names = [event[1:] for event in events[0::2]]
        assert events == [event for name in names for event in (f"+{name}", f"-{name}")]
        return names

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def _wait_in_line(table: Path, size: int, wait: float, name: str, observer: Observer) -> None:
    """A worker process: one request that waits in the line, then reports."""
    tickets.FIRST_LOOK = tickets.LOOK = NEVER
    gk = GateKeeper(settings(table, size, wait))
    try:
        admission = gk.admit("shop", "api", name)
    except Rejected as exc:
        observer.write(f"!{name}:{exc.code}")
        os._exit(0)
    observer.write(f"+{name}")
    observer.write(f"-{name}")
    admission.release(200)
    gk.close()
    os._exit(0)


@pytest.fixture
def table(tmp_path: Path) -> Path:
    return tmp_path / "gatekeeper.shm"


@pytest.fixture
def observer() -> Iterator[Observer]:
    watching = Observer()
    yield watching
    watching.close()


@pytest.fixture
def workers() -> Iterator[list[BaseProcess]]:
    """Worker processes started by a test; killed and reaped after it, whatever happened."""
    started: list[BaseProcess] = []
    yield started
    for process in started:
        if process.is_alive():
            process.kill()
        process.join(DEADLINE)


def refused_by(backend: SharedBackend) -> int:
    """The digest of the path that last refused the first waiter of PATH (0: none)."""
    with backend.lines() as (lines, _):
        return lines.refused_by(PATH)


def line_of(backend: SharedBackend) -> list[int]:
    """The pids waiting in the line of PATH, first first."""
    return [pid for pid, _ in backend.waiters(PATH)]


def start_waiters(
    table: Path,
    backend: SharedBackend,
    observer: Observer,
    workers: list[BaseProcess],
    names: list[str],
    size: int = 10,
    wait: float = DEADLINE,
) -> None:
    """Start one worker per name, each once the one before it has taken its ticket: the
    ticket order is the order of ``names``."""
    context = multiprocessing.get_context("fork")
    for name in names:
        process = context.Process(
            target=_wait_in_line, args=(table, size, wait, name, observer), daemon=True
        )
        process.start()
        workers.append(process)
        wait_until(
            lambda pid=process.pid: pid in line_of(backend), DEADLINE, f"{name} to take a ticket"
        )


def in_a_thread(gk: GateKeeper, name: str, observer: Observer) -> threading.Thread:
    """A request of this process, in a thread of its own (see ``_admit_once``)."""
    thread = threading.Thread(target=_admit_once, args=(gk, "api", name, observer), daemon=True)
    thread.start()
    return thread


def shared(gk: GateKeeper) -> SharedBackend:
    backend = gk.backend
    assert isinstance(backend, SharedBackend)
    return backend


def test_waiters_of_several_processes_are_admitted_in_ticket_order(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """Six processes take tickets one after another; one release admits them one at a
    time, in ticket order, never two at once."""
    gk = GateKeeper(settings(table))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    names = [f"w{index}" for index in range(6)]
    start_waiters(table, backend, observer, workers, names)
    line = backend.waiters(PATH)
    assert [pid for pid, _ in line] == [process.pid for process in workers]
    assert [ticket for _, ticket in line] == sorted(ticket for _, ticket in line)
    holder.release(200)
    assert observer.admissions(len(names)) == names
    wait_until(lambda: not line_of(backend), DEADLINE, "the line to empty")
    for process in workers:
        process.join(DEADLINE)
    assert gk.inflight() == {PATH: 0}
    gk.close()


def test_a_newcomer_of_another_process_lines_up_behind_the_waiters(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """A request arriving while another process's requests wait joins the end of the
    line, even once a slot is free: it is admitted after them."""
    gk = GateKeeper(settings(table))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    start_waiters(table, backend, observer, workers, ["w0", "w1"])
    thread = in_a_thread(gk, "late", observer)
    wait_until(lambda: len(line_of(backend)) == 3, DEADLINE, "the newcomer to line up")
    assert line_of(backend)[2] == os.getpid()
    holder.release(200)
    assert observer.admissions(3) == ["w0", "w1", "late"]
    thread.join(DEADLINE)
    gk.close()


@pytest.mark.parametrize("killed", [0, 1], ids=["first", "middle"])
def test_a_sigkilled_waiter_does_not_stall_the_line(
    table: Path, observer: Observer, workers: list[BaseProcess], killed: int
) -> None:
    """A waiter killed by SIGKILL (left a zombie, not reaped) gives up its ticket: the
    others are admitted in order, woken by events alone."""
    gk = GateKeeper(settings(table))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    names = ["w0", "w1", "w2"]
    start_waiters(table, backend, observer, workers, names)
    victim = workers[killed]
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    # Dropped by the waiter behind it, woken by its pidfd: no release needed.
    wait_until(lambda: victim.pid not in line_of(backend), DEADLINE, "the dead waiter dropped")
    holder.release(200)
    survivors = [name for index, name in enumerate(names) if index != killed]
    assert observer.admissions(2) == survivors
    wait_until(lambda: not line_of(backend), DEADLINE, "the line to empty")
    gk.close()


def test_the_queue_size_bounds_the_line_of_the_host(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """``size`` counts the waiters of every process: with two waiting elsewhere, a third
    request is refused at once with GK-QUEUE-FULL; once the last of them is killed (a
    zombie nobody watches), a new request takes its place in the line."""
    gk = GateKeeper(settings(table, size=2))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    start_waiters(table, backend, observer, workers, ["w0", "w1"], size=2)
    with pytest.raises(Rejected) as full:
        gk.admit("shop", "api", "third")
    assert (full.value.code, full.value.limit_path) == ("GK-QUEUE-FULL", PATH)
    assert line_of(backend) == [process.pid for process in workers]
    victim = workers[1].pid
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    # Dead, not reaped (is_alive() would reap it): only the join that finds the line full
    # can drop its ticket.
    wait_until(lambda: (proc_stat(victim) or ("?",))[0] == "Z", DEADLINE, "the kill to land")
    assert victim in line_of(backend)
    thread = in_a_thread(gk, "fourth", observer)
    wait_until(lambda: os.getpid() in line_of(backend), DEADLINE, "the replacement in line")
    assert line_of(backend) == [workers[0].pid, os.getpid()]
    holder.release(200)
    assert observer.admissions(2) == ["w0", "fourth"]
    thread.join(DEADLINE)
    gk.close()


def test_a_waiter_that_times_out_leaves_the_line(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """A waiter whose ``wait`` runs out gets GK-QUEUE-TIMEOUT and gives its ticket up:
    the waiter behind it (another process, with a longer wait) becomes first and is
    admitted by the next release."""
    gk = GateKeeper(settings(table))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    start_waiters(table, backend, observer, workers, ["short"], wait=2.0)
    start_waiters(table, backend, observer, workers, ["long"])
    assert observer.events(1) == ["!short:GK-QUEUE-TIMEOUT"]
    wait_until(lambda: line_of(backend) == [workers[1].pid], DEADLINE, "the short one gone")
    holder.release(200)
    assert observer.admissions(1) == ["long"]
    gk.close()


def _admit_once(gk: GateKeeper, service: str, name: str, observer: Observer) -> None:
    """One request of a worker thread: admitted, observed, released (or its refusal)."""
    try:
        admission = gk.admit("shop", service, name)
    except Rejected as exc:
        observer.write(f"!{name}:{exc.code}")
        return
    observer.write(f"+{name}")
    observer.write(f"-{name}")
    admission.release(200)


def _threads_on_command(table: Path, observer: Observer, commands: int) -> None:
    """A worker process that starts a waiting thread per name read from ``commands`` and
    exits once an empty line came and its threads are done."""
    tickets.FIRST_LOOK = tickets.LOOK = NEVER
    gk = GateKeeper(settings(table))
    threads = []
    with os.fdopen(commands) as names:
        for line in names:
            name = line.strip()
            if not name:
                break
            thread = threading.Thread(target=_admit_once, args=(gk, "api", name, observer))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    gk.close()
    os._exit(0)


def test_threads_of_several_processes_share_one_line(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """Threads of two processes take tickets alternately (a, b, a, b, ...); they are
    admitted in that order, not grouped by process."""
    gk = GateKeeper(settings(table))
    backend = shared(gk)
    holder = gk.admit("shop", "api", "holder")
    context = multiprocessing.get_context("fork")
    pipes = [os.pipe() for _ in range(2)]
    for read_end, _ in pipes:
        process = context.Process(
            target=_threads_on_command, args=(table, observer, read_end), daemon=True
        )
        process.start()
        workers.append(process)
    names = [f"{'ab'[index % 2]}{index // 2}" for index in range(6)]
    for index, name in enumerate(names):
        os.write(pipes[index % 2][1], name.encode() + b"\n")
        wait_until(
            lambda count=index + 1: len(line_of(backend)) == count, DEADLINE, f"{name} in line"
        )
    assert line_of(backend) == [workers[index % 2].pid for index in range(6)]
    for _, write_end in pipes:
        os.write(write_end, b"\n")
        os.close(write_end)
    holder.release(200)
    assert observer.admissions(len(names)) == names
    for process in workers:
        process.join(DEADLINE)
        assert process.exitcode == 0
    gk.close()


class ProjectFull(NamedTuple):
    """The scene of a first waiter of ``shop/api`` whose turn comes while the project
    limit ``shop`` (2) is full: the keeper and the two requests of service ``other``
    that fill it."""

    gk: GateKeeper
    other: Admission
    again: Admission


def freeze_outside_the_lock(pid: int, table: Path) -> None:
    """SIGSTOP ``pid`` at a moment it does not hold the table's file lock (else every
    update of the table would wait for it forever): stopped, then the lock tried from an
    open file of its own; if the process held it, it is let go on and stopped again."""
    fd = os.open(table, os.O_RDWR)
    try:

        def stopped_without_the_lock() -> bool:
            os.kill(pid, signal.SIGSTOP)
            wait_until(lambda: (proc_stat(pid) or ("",))[0] == "T", DEADLINE, "the waiter stopped")
            if not try_lock(fd):  # it holds the lock: let it finish, and stop it again
                os.kill(pid, signal.SIGCONT)
                return False
            filelock.unlock_file(fd)
            return True

        wait_until(stopped_without_the_lock, DEADLINE, "the waiter stopped outside the lock")
    finally:
        os.close(fd)


def project_full_at_its_turn(
    table: Path, observer: Observer, workers: list[BaseProcess], shop: dict[str, Any]
) -> ProjectFull:
    """Set the scene: ``shop/api`` full (1) and a waiter of another process in its line;
    ``shop`` filled by service ``other``; the waiter frozen (SIGSTOP) while the ``shop/api``
    slot is released and ``shop`` filled again, so that its turn, when it thaws, finds
    ``shop`` full."""
    both = {"project": "shop", "backend": f"shared://{table}", "limits": {"shop": shop, **limits()}}
    gk = GateKeeper(both)
    backend = shared(gk)
    api_holder = gk.admit("shop", "api", "holder")  # shop 1/2, shop/api 1/1

    def waiter() -> None:
        tickets.FIRST_LOOK = tickets.LOOK = NEVER
        _admit_once(GateKeeper(both), "api", "w", observer)
        os._exit(0)

    process = multiprocessing.get_context("fork").Process(target=waiter, daemon=True)
    process.start()
    workers.append(process)
    assert process.pid is not None
    wait_until(lambda: process.pid in line_of(backend), DEADLINE, "the waiter in line")
    other = gk.admit("shop", "other", "x")  # shop 2/2
    freeze_outside_the_lock(process.pid, table)
    api_holder.release(200)  # shop 1/2, shop/api free: its wake-up waits in its socket
    again = gk.admit("shop", "other", "y")  # shop 2/2 before the waiter can look
    os.kill(process.pid, signal.SIGCONT)
    return ProjectFull(gk, other, again)


def test_a_first_waiter_refused_by_another_limit_is_woken_by_its_release(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """The first waiter of ``shop/api`` finds the project limit ``shop`` (with a queue)
    full when its turn comes: the release of a ``shop`` slot by a request of another
    service wakes it (nothing else would before its wait runs out)."""
    shop = {"concurrency": 2, "queue": {"size": 10, "wait": DEADLINE}}
    scene = project_full_at_its_turn(table, observer, workers, shop)
    backend = shared(scene.gk)
    wait_until(lambda: refused_by(backend) == path_digest("shop"), DEADLINE, "the refusal")
    scene.other.release(200)
    assert observer.admissions(1) == ["w"]
    scene.again.release(200)
    scene.gk.close()


def test_a_waiter_refused_by_a_limit_without_a_queue_gives_its_ticket_up(
    table: Path, observer: Observer, workers: list[BaseProcess]
) -> None:
    """The first waiter of ``shop/api`` whose turn comes while the project limit ``shop``
    (no queue) is full is refused by it, GK-CONCURRENCY-LIMIT, and leaves the line: the
    next request is admitted by the next free slot, not stuck behind a ticket."""
    scene = project_full_at_its_turn(table, observer, workers, {"concurrency": 2})
    assert observer.events(1) == ["!w:GK-CONCURRENCY-LIMIT"]
    assert line_of(shared(scene.gk)) == []
    scene.other.release(200)
    scene.gk.admit("shop", "api", "next").release(200)  # not queued behind a lost ticket
    scene.again.release(200)
    scene.gk.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_a_wake_up_sent_by_another_user_is_ignored() -> None:
    """Abstract socket names are listed for every user: a datagram another user sends to
    a waiter's wake socket is read and not taken for a wake-up; one of this user is."""
    sock, nonce = tickets._wake_socket()
    assert sock is not None
    context = multiprocessing.get_context("fork")

    def stranger() -> None:
        os.setgid(65534)
        os.setuid(65534)
        bell = tickets.Bell()
        bell.ring(nonce)
        bell.close()
        os._exit(0)

    process = context.Process(target=stranger)
    process.start()
    process.join(DEADLINE)
    assert process.exitcode == 0
    try:
        assert not tickets._recv_own(sock)
        bell = tickets.Bell()
        bell.ring(nonce)
        bell.close()
        assert tickets._recv_own(sock)
    finally:
        sock.close()


def _cycle(table: Path, seed: int, cycles: Any, index: int) -> None:
    """A worker process that queues, gets in, holds for a moment and leaves, again and
    again, until it is killed: joins, looks and leaves of the line all the time. Each
    round it completes is counted in ``cycles[index]`` (its own cell: written by this process
    only and without a lock, which a SIGKILL could leave held)."""
    rng = random.Random(seed)
    gk = GateKeeper(settings(table, size=50))
    while True:
        with contextlib.suppress(Rejected):
            admission = gk.admit("shop", "api", "cycle")
            sum(range(rng.randrange(20_000)))  # holding the slot for a random while: work
            admission.release(200)
        cycles[index] += 1


def test_workers_killed_at_random_moments_leave_the_line_consistent(
    table: Path, workers: list[BaseProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """Workers cycling through the line are SIGKILLed at random moments (some in the
    middle of an update of the line, which the journal rolls back) and replaced, 30 times:
    the table is never found damaged, a request afterwards is admitted at once past the
    dead tickets, and the line and the slots end empty."""
    rng = random.Random(18)
    context = multiprocessing.get_context("fork")

    cycles = context.RawArray("q", 64)  # rounds completed, per worker

    def spawn() -> BaseProcess:
        process = context.Process(
            target=_cycle, args=(table, rng.random(), cycles, len(workers)), daemon=True
        )
        process.start()
        workers.append(process)
        return process

    gk = GateKeeper(settings(table, size=50))
    backend = shared(gk)
    running = [spawn() for _ in range(3)]
    wait_until(lambda: line_of(backend), DEADLINE, "the workers to queue")
    for _ in range(30):
        # A random moment: after a random number of rounds, so inside whatever comes next.
        target = sum(cycles) + rng.randint(1, 6)
        wait_until(lambda goal=target: sum(cycles) >= goal, DEADLINE, "the workers to cycle")
        victim = running.pop(rng.randrange(len(running)))
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(DEADLINE)
        running.append(spawn())
    for process in running:
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(DEADLINE)
    gk.admit("shop", "api", "after").release(200)  # GK-QUEUE-TIMEOUT if a dead ticket stuck
    assert line_of(backend) == []
    assert backend.usage()["waiting"] == 0
    assert gk.inflight() == {PATH: 0}
    assert not [record for record in caplog.records if "damaged" in record.getMessage()]
    gk.close()
