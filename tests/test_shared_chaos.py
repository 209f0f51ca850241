"""The shared table under SIGKILL at any point: worker processes killed at random lines of
the backend (mid-journal, holding the lock, registering, reclaiming another's slots,
rolling back another's update), several at a time; afterwards, once the dead are reaped,
``inflight()`` is all zero and the full capacity can be admitted, every run.

The kill point is chosen inside the victim: a line tracer counts the lines it runs in
``backends/shared/`` and sends the process SIGKILL at the chosen one, so every run
lands where the backend's state is most fragile, not only between requests. A second
test walks the kill point over the lines of one scripted sequence of admissions,
refusals, delayed and plain releases, one process at a time.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import struct
import sys
import time
from collections.abc import Callable
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import gatekeeper_wsgi.backends.shared as shared_module
from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import SharedBackend
from tests.conftest import admits_exactly, busy

#: the package's directory: a line in any of its modules is a point to be killed at
SHARED_DIR = os.path.dirname(shared_module.__file__) + os.sep
LIMITS: dict[str, Any] = {
    "p": {"concurrency": 6, "delay": 0.05},
    "p/s": {"concurrency": 4},
    "p/s/*": {"concurrency": 2, "rate": "1000000/minute", "max_keys": 4},
    "p/t/*": {"rate": "1000000/minute", "count": [200], "max_keys": 3},
}
#: far enough ahead that every delayed release has matured
LATER = 3600.0


def settings(path: Path) -> dict[str, Any]:
    return {"project": "p", "backend": f"shared://{path}", "limits": LIMITS}


def trace_backend(on_line: Callable[[], None]) -> None:
    """Call ``on_line`` before each line this thread runs in backends/shared/."""

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            on_line()
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(SHARED_DIR) else None

    sys.settrace(calls)


def kill_after(lines: int) -> None:
    """SIGKILL this process when it has run ``lines`` more lines of backends/shared/."""
    left = [lines]

    def count_down() -> None:
        left[0] -= 1
        if left[0] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)

    trace_backend(count_down)


def _random_worker(path: str, seed: int) -> None:
    """Admit and release at random (statuses, faults with delays, refusals) until the
    tracer kills this process; sometimes it dies while still opening the table."""
    rng = random.Random(seed)
    if rng.random() < 0.1:
        kill_after(rng.randrange(1, 400))
    gk = GateKeeper(settings(Path(path)))
    kill_after(rng.randrange(1, 3000))
    held = []
    while True:
        if held and rng.random() < 0.45:
            status = rng.choice([200, 200, 401, 500])
            held.pop(rng.randrange(len(held))).release(status, faulty=status >= 500)
        else:
            with contextlib.suppress(Rejected):
                held.append(gk.admit("p", rng.choice("st"), f"c{rng.randrange(6)}"))


def check_all_given_back(path: Path) -> None:
    """Nothing is held once the dead are reaped and delays have passed, and the full
    capacity can be admitted: 6 at the project, the 7th refused."""
    observer = SharedBackend(path)
    assert busy(observer.inflight(time.monotonic() + LATER)) == {}
    usage = observer.usage()
    assert (usage["leases"], usage["delayed"]) == (0, 0)
    observer.close()
    gk = GateKeeper(settings(path))
    admits_exactly(gk, 6, "p", "u", "x")
    assert busy(gk) == {}
    gk.close()


@pytest.mark.slow
def test_hundreds_of_workers_killed_at_random_points(tmp_path: Path) -> None:
    """300 workers, 3 at a time, each SIGKILLed at a random line of the backend: after
    they are reaped, nothing is held and the full capacity is admitted."""
    path = tmp_path / "chaos.shm"
    context = get_context("fork")
    seed = random.randrange(1 << 30)
    running: list[Any] = []
    started = 0
    kills = 300
    while started < kills or running:
        while started < kills and len(running) < 3:
            process = context.Process(target=_random_worker, args=(str(path), seed + started))
            process.start()
            running.append(process)
            started += 1
        wait([process.sentinel for process in running], timeout=60)
        for process in [process for process in running if process.exitcode is not None]:
            process.join()
            assert process.exitcode == -signal.SIGKILL, (seed, process.exitcode)
            running.remove(process)
    check_all_given_back(path)


def scripted(gk: GateKeeper) -> None:
    """One of everything: admissions on three levels, a refusal, a faulty release with a
    delay, a plain release, a count reservation given back."""
    first = gk.admit("p", "s", "c1")
    second = gk.admit("p", "s", "c1")
    with pytest.raises(Rejected):
        gk.admit("p", "s", "c1")
    first.release(500, faulty=True)
    second.release(200)
    gk.admit("p", "t", "c2").release(401)


def _killed_at(path: str, line: int) -> None:
    gk = GateKeeper(settings(Path(path)))
    kill_after(line)
    scripted(gk)
    os._exit(0)


def lines_of(run: Callable[[], None]) -> int:
    """How many lines of backends/shared/ ``run`` executes."""
    count = [0]

    def count_up() -> None:
        count[0] += 1

    trace_backend(count_up)
    try:
        run()
    finally:
        sys.settrace(None)
    return count[0]


@pytest.mark.slow
def test_a_kill_at_any_line_of_a_request_leaves_nothing_behind(tmp_path: Path) -> None:
    """The kill point walked over the lines of one scripted sequence (every fifth line,
    a different offset each run): whatever line a worker dies on, nothing is held after."""
    path = tmp_path / "walk.shm"
    gk = GateKeeper(settings(path))
    total = lines_of(lambda: scripted(gk))
    gk.close()
    context = get_context("fork")
    for line in range(1 + random.randrange(5), total, 5):
        process = context.Process(target=_killed_at, args=(str(path), line))
        process.start()
        process.join(60)
        assert process.exitcode in (-signal.SIGKILL, 0), (line, process.exitcode)
        observer = SharedBackend(path)
        assert busy(observer.inflight(time.monotonic() + LATER)) == {}, line
        assert observer.usage()["leases"] == 0, line
        observer.close()
    check_all_given_back(path)


def _hold_two(path: str, conn: Any) -> None:
    """Take a slot at 'p' and 'p/s', report, and wait to be killed."""
    gk = GateKeeper(settings(Path(path)))
    held = gk.admit("p", "s", "c1")
    conn.send("held")
    conn.recv()
    del held


def test_a_dead_process_with_the_observers_pid_is_still_reclaimed(tmp_path: Path) -> None:
    """The leak once seen ('inflight {"p/s": 1, "p": 1}' with no worker left): pids are
    reused (32 768 of them here), and a process told its own registration from others by
    pid alone, so a process whose pid a dead worker had had, an observer above all (it
    never registers, so nothing else reclaims for it), skipped the dead worker and kept
    reporting its slots. Here the dead worker's registration and leases are given this
    process's pid, as a reused pid would have it: they are reclaimed all the same."""
    path = tmp_path / "reuse.shm"
    context = get_context("fork")
    parent, child = context.Pipe()
    worker = context.Process(target=_hold_two, args=(str(path), child))
    worker.start()
    assert parent.poll(60) and parent.recv() == "held"
    worker.kill()
    worker.join(60)
    observer = SharedBackend(path)
    mm, me = observer._mm, os.getpid()
    assert mm is not None
    layout = observer._layout
    assert layout is not None
    procs, leases = layout.procs_off, layout.leases_off
    # Rewrite the worker's pid in its registration and its lease to ours (offset 0 of
    # each): the worker had "our" pid.
    for offset in (procs, leases):
        assert struct.unpack_from("<I", mm, offset)[0] == worker.pid
        struct.pack_into("<I", mm, offset, me)
    assert busy(observer.inflight(time.monotonic())) == {}
    assert observer.usage()["leases"] == 0
    observer.close()
    check_all_given_back(path)
