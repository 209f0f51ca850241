"""The shared table's locks between threads: the file lock's calls that cannot block keep
the GIL, and the thread lock (turns.TurnLock) excludes while never being handed to a
thread that still waits for the GIL, so the threads of a process form no line on it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends.shared import SharedBackend, filelock
from gatekeeper_wsgi.turns import TurnLock
from tests.conftest import admits_exactly, busy
from tests.servers import wait_until

DEADLINE = 20.0


@contextlib.contextmanager
def switch_interval(seconds: float) -> Iterator[None]:
    """The interpreter's switch interval set to ``seconds`` for the block."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def all_finished(work: Callable[[], None], count: int, interval: float) -> bool:
    """Run ``work`` in ``count`` threads with the switch interval at ``interval`` (short:
    thread switches land inside every critical section); whether all of them ended."""
    with switch_interval(interval):
        threads = [threading.Thread(target=work) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE * 3)
    return not any(thread.is_alive() for thread in threads)


def _runs_while(calls: Callable[[], object], rounds: int) -> bool:
    """Whether a thread that wants the GIL gets it while this one makes ``calls``
    ``rounds`` times (stopping as soon as it did). The switch interval is made so long
    that only a call letting go of the GIL can let the other thread run."""
    ran = threading.Event()
    go = threading.Event()

    def other() -> None:
        go.wait()
        ran.set()

    thread = threading.Thread(target=other)
    # The interval is made long before the thread starts: a thread already waiting for the
    # GIL keeps the timeout it began with (5 ms by default) and then forces a switch. So
    # the thread runs up to go.wait(), where it lets the GIL go, before this one goes on.
    with switch_interval(1000.0):
        thread.start()
        go.set()  # from here on it runs only when this thread lets the GIL go
        for _ in range(rounds):
            calls()
            if ran.is_set():
                break
        seen = ran.is_set()
    thread.join(DEADLINE)
    return seen


def test_the_file_calls_that_cannot_block_keep_the_gil(tmp_path: Path) -> None:
    """A free lock taken, the unlock and the size read never let go of the GIL: no other
    thread of the process runs while they are in the kernel (one that did would run up
    to the table's thread lock and sleep there); the plain ``os.lseek`` does let go."""
    fd = os.open(tmp_path / "t", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 4096)

        def update() -> None:
            filelock.file_size(fd)
            filelock.lseek(fd, 0, os.SEEK_END)
            filelock.lock_file(fd)
            filelock.unlock_file(fd)

        assert not _runs_while(update, 5000)
        # The check can see a let-go: the GIL-releasing call hands it over, given time.
        assert _runs_while(lambda: os.lseek(fd, 0, os.SEEK_END), 10**8)
    finally:
        os.close(fd)


#: A process holding the table file's lock (argv: path, pid and thread id to watch) until
#: that thread has run 20 ms more of CPU (it spins for the lock meanwhile) or, failing that,
#: for DEADLINE; exit status 0 when the thread's CPU time let it go.
_HOLDER = """
import fcntl, os, sys, time
from gatekeeper_wsgi.backends.shared import filelock
path, pid, tid, deadline = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def ran():
    with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
        return int(stat.read().split()[0])
fd = os.open(path, os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
start = ran()
print("held", flush=True)
end = time.monotonic() + deadline
while ran() - start < 20_000_000 and time.monotonic() < end:
    os.sched_yield()
os.close(fd)
sys.exit(0 if time.monotonic() < end else 1)
"""


@pytest.mark.skipif(
    filelock.C_FLOCK is None or not Path(f"/proc/{os.getpid()}/schedstat").exists(),
    reason="needs ctypes' C library and /proc/<pid>/task/<tid>/schedstat",
)
def test_a_lock_another_process_holds_is_retried_keeping_the_gil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the file lock for a moment, the thread that wants it
    tries again without letting go of the GIL: no other thread of its process runs until
    it has the lock (one that did would keep the GIL while this thread waits for it
    holding the thread lock and then the file lock, which all other processes wait for)."""
    path = tmp_path / "t"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    # Enough tries for the holder's 20 ms: the kernel wait after them lets the GIL go.
    monkeypatch.setattr(filelock, "SPINS", 10**9)

    def update() -> None:
        filelock.lock_file(fd)
        filelock.unlock_file(fd)

    try:
        with subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path), str(os.getpid()),
             str(threading.get_native_id()), str(DEADLINE)],
            stdout=subprocess.PIPE, text=True,
        ) as holder:  # fmt: skip
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            assert not _runs_while(update, 1)
            assert holder.wait(DEADLINE) == 0  # it let go because this thread kept trying
    finally:
        os.close(fd)


def test_lseek_reads_a_size_past_4_gib_and_fails_as_minus_one(tmp_path: Path) -> None:
    """The GIL-keeping lseek reads an end past 32 bits (a table may pass 4 GiB), takes a
    negative offset as negative (its int is widened with its sign), and answers -1 on a
    closed descriptor, which the table reads as a file too short to use."""
    fd = os.open(tmp_path / "big", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, (5 << 30) + 7)
    assert filelock.lseek(fd, 0, os.SEEK_END) == (5 << 30) + 7
    assert filelock.lseek(fd, -7, os.SEEK_END) == 5 << 30
    assert filelock.lseek(fd, 12345, os.SEEK_SET) == 12345
    os.close(fd)
    if filelock.lseek is not os.lseek:
        assert filelock.lseek(fd, 0, os.SEEK_END) == -1


class CountedTurnLock(TurnLock):
    """A TurnLock counting the times a thread found it held (its slow path)."""

    __slots__ = ("waits",)

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1  # racy between threads, but only ever read as "some"
        super().wait()


def test_turn_lock_excludes_with_a_switch_at_every_bytecode() -> None:
    """16 threads each make 1 500 read-modify-writes of one counter under the lock while
    the interpreter switches threads as often as it can and every fifth holder yields
    the GIL inside: none is lost, threads did find it held, every thread finished (no
    wake-up lost), and afterwards nobody holds the lock or waits for it."""
    turns = CountedTurnLock()
    counter = [0]
    start = threading.Barrier(16)

    def work() -> None:
        start.wait()
        for step in range(1500):
            with turns:
                seen = counter[0]
                if step % 5 == 0:
                    os.sched_yield()  # lets go of the GIL holding the lock
                counter[0] = seen + 1

    assert all_finished(work, 16, 1e-6)  # no waiter left asleep
    assert counter[0] == 16 * 1500
    assert turns.waits > 0
    assert not turns.locked() and not turns.sleepers


def test_a_release_never_hands_the_lock_to_a_thread_still_waiting_for_the_gil() -> None:
    """A thread asleep on the lock is woken by the release but does not own the lock
    until it runs again: the releaser, keeping the GIL, takes the lock again at once
    instead of sleeping behind it (a plain threading.Lock's waiter owns it from its
    wake-up on, which is how a line of threads forms); the waiter gets it next."""
    turns = TurnLock()
    turns.acquire()
    got = threading.Event()

    def waiter() -> None:
        turns.acquire()
        got.set()
        turns.release()

    thread = threading.Thread(target=waiter)
    keep_gil = ctypes.PyDLL(None).usleep
    # A switch interval too long to end, from before the waiter starts: it runs until it
    # sleeps on the lock's bell and only then lets go of the GIL (counted as a sleeper but
    # not asleep yet, it could lose the GIL to a forced switch and later take the lock
    # back first), and once woken it cannot ask for the GIL back.
    with switch_interval(1000.0):
        thread.start()
        wait_until(lambda: len(turns.sleepers) == 1, what="the waiter asleep on the lock")
        turns.release()
        # Keep the GIL while the kernel wakes the waiter: whatever it does meanwhile it
        # cannot take the lock, which needs the GIL.
        keep_gil(20_000)
        taken_again = turns.try_acquire()
        waiter_had_it = got.is_set()
        if taken_again:
            turns.release()
    assert taken_again, "the woken waiter took the lock without the GIL"
    assert not waiter_had_it
    assert got.wait(DEADLINE)
    thread.join(DEADLINE)
    assert not turns.locked() and not turns.sleepers


def test_eight_threads_on_one_table_count_exactly(tmp_path: Path) -> None:
    """8 threads admitting and releasing through one table with thread switches forced
    often: an observer inside the app never sees more in flight than the limit, every
    admission is released, and the limit then admits exactly its capacity again."""
    settings = {
        "project": "shop",
        "backend": f"shared://{tmp_path / 't.shm'}",
        "limits": {"shop": {"concurrency": 3}},
    }
    gk = GateKeeper(settings)
    assert isinstance(gk.backend, SharedBackend)
    inside = [0]
    peak = [0]
    watch = threading.Lock()
    admitted = [0]
    start = threading.Barrier(8)

    def work() -> None:
        start.wait()
        for _ in range(300):
            try:
                admission = gk.admit("shop", "orders", "crm")
            except Exception:  # refused: the limit is full
                continue
            with watch:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
                admitted[0] += 1
            with watch:
                inside[0] -= 1
            admission.release(200)

    assert all_finished(work, 8, 1e-5)
    assert peak[0] <= 3 and admitted[0] > 0
    assert busy(gk) == {}
    admits_exactly(gk, 3, "shop", "orders", "crm")
    gk.close()
