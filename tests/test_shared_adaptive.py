"""Adaptive limits (``concurrency = "auto"``) on the shared table: one controller per key
for all worker processes of a host, stored next to the key's counters and fed and
enforced under the same lock (SPEC §4.9, issue 20 point 3).

Real files and real forked processes; time is a clock the test sets (a shared double for
the processes), so every window and probe of the controllers is decided, not waited for.
"""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.adaptive import PROBE_CONCURRENCY, PROBE_SAMPLES, WINDOW_SAMPLES
from gatekeeper_wsgi.backends.shared import VERSION, LayoutMismatch, SharedBackend
from tests.conftest import FakeClock
from tests.test_shared import opened_elsewhere

DEADLINE = 20.0
AIMD = {"algorithm": "aimd", "min": 1, "max": 50, "initial": 20}


def settings_for(backend: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {"project": "shop", "backend": backend, "limits": limits}


def outcome(gk: GateKeeper, held: list[Any], caller: str) -> str:
    """Admit one request of ``caller`` (kept in ``held``); what happened, as a string."""
    try:
        held.append(gk.admit("shop", "a", caller))
    except Rejected as rejection:
        return f"{rejection.code} {rejection.limit_path}={rejection.limit_value}"
    return "admitted"


# --- the same controller as memory's, sample for sample ------------------------------------

STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(["x", "y", "z"])),
        st.tuples(st.just("release"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("advance"), st.floats(0.001, 0.4)),
    ),
    max_size=120,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(algorithm=st.sampled_from(["gradient", "aimd", "vegas"]), steps=STEPS)
def test_same_decisions_and_limits_as_memory(
    tmp_path_factory: pytest.TempPathFactory, algorithm: str, steps: list[tuple[Any, ...]]
) -> None:
    """For any sequence of admissions, releases (faulty or not) and clock moves, the
    controllers kept in the file decide exactly as memory's in-process ones: the same
    admissions and refusals (with the same current value in the fault) and the same
    ``stats()["adaptive"]`` after every step. (The file keeps a window's sums in place
    between two due samples: this is the proof that doing so loses nothing.)"""
    auto = {"concurrency": "auto", "adaptive": {"algorithm": algorithm, "max": 40}}
    # Room for every caller: which idle key makes room differs by design (memory: CLOCK,
    # the table: least recently used); test_evicted_keys_take_their_controllers_along
    # covers eviction.
    limits = {"shop": auto, "shop/a/*": auto}
    clock = FakeClock()
    table = tmp_path_factory.mktemp("adaptive") / "t.shm"
    memory = GateKeeper(settings_for("memory", limits), clock=clock)
    shared = GateKeeper(settings_for(f"shared://{table}", limits), clock=clock)
    held: dict[GateKeeper, list[Any]] = {memory: [], shared: []}
    for step in steps:
        if step[0] == "admit":
            assert outcome(memory, held[memory], step[1]) == outcome(shared, held[shared], step[1])
        elif step[0] == "release" and held[memory]:
            for gk in (memory, shared):
                held[gk].pop(step[1] % len(held[gk])).release(200, faulty=step[2])
        elif step[0] == "advance":
            clock.advance(step[1])
        assert shared.stats()["adaptive"] == memory.stats()["adaptive"]
    for gk in (memory, shared):
        for admission in held[gk]:
            admission.release(200)
    assert {k: v for k, v in shared.inflight().items() if v} == {}
    shared.close()


def test_evicted_keys_take_their_controllers_along(tmp_path: Path, clock: FakeClock) -> None:
    """2 000 callers on an adaptive wildcard limit with max_keys 50: at most 50 controllers
    are reported, and a key evicted and seen again starts from a new controller."""
    limits = {"shop/a/*": {"concurrency": "auto", "adaptive": AIMD, "max_keys": 50}}
    gk = GateKeeper(settings_for(f"shared://{tmp_path / 't.shm'}", limits), clock=clock)
    for _ in range(1 + PROBE_SAMPLES):  # spray0's probe ends: its limit is back at 20
        gk.admit("shop", "a", "spray0").release(200)
    for index in range(2000):
        admission = gk.admit("shop", "a", f"spray{index}")
        clock.advance(0.001)
        admission.release(200)
        if index % 100 == 0:
            assert len(gk.stats()["adaptive"]) <= 50
    assert len(gk.stats()["adaptive"]) <= 50
    gk.admit("shop", "a", "spray0").release(200)  # new again: its first sample probes
    assert gk.stats()["adaptive"]["shop/a/spray0"]["limit"] == PROBE_CONCURRENCY
    assert {k: v for k, v in gk.inflight().items() if v} == {}
    gk.close()


# --- processes sharing one limit -----------------------------------------------------------


def _worker(path: str, now: Synchronized[float], conn: Connection) -> None:
    """A worker process on the table, its clock the test's shared double: admits, releases
    and reports as the test asks through the pipe."""
    gk = GateKeeper(
        settings_for(f"shared://{path}", {"shop": {"concurrency": "auto", "adaptive": AIMD}}),
        clock=lambda: now.value,
    )
    held: list[Any] = []
    while True:
        command, *args = conn.recv()
        if command == "admit":
            conn.send([outcome(gk, held, "c") for _ in range(args[0])])
        elif command == "release":
            count, faulty = args
            for _ in range(count):
                held.pop().release(200, faulty=faulty)
            conn.send(len(held))
        elif command == "limit":
            conn.send(gk.stats()["adaptive"]["shop"]["limit"])


class Worker:
    """A forked worker process driven through a pipe."""

    def __init__(self, path: Path, now: Synchronized[float]) -> None:
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(str(path), now, child), daemon=True)
        self.process.start()

    def __call__(self, *command: Any) -> Any:
        self.conn.send(command)
        if not self.conn.poll(DEADLINE):
            pytest.fail(f"the worker did not answer {command} (exit code {self.process.exitcode})")
        return self.conn.recv()

    def cycle(self, count: int, *, faulty: bool) -> None:
        """``count`` requests one after the other, each released at once."""
        for _ in range(count):
            assert self("admit", 1) == ["admitted"]
            assert self("release", 1, faulty) == 0


@pytest.fixture
def now() -> Synchronized[float]:
    """The clock every process of a test reads (a double in shared memory)."""
    return multiprocessing.get_context("fork").Value("d", 1000.0)


@pytest.fixture
def workers(tmp_path: Path, now: Synchronized[float]) -> Iterator[list[Worker]]:
    """Two worker processes on one table."""
    running = [Worker(tmp_path / "t.shm", now) for _ in range(2)]
    yield running
    for worker in running:
        worker.process.kill()
        worker.process.join(DEADLINE)


def test_a_sample_in_one_process_moves_the_limit_another_enforces(
    tmp_path: Path, now: Synchronized[float], workers: list[Worker]
) -> None:
    """Worker A's samples make the one limit every process enforces: worker B holds
    exactly that many, and when one faulty release of B's closes the window A filled,
    the limit drops below what B holds - nothing of B's is cut off, and nobody (not
    even a third process) is admitted until in-flight is below the new limit."""
    driver, holder = workers
    # A's first sample starts a probe of the no-load latency; the probe's samples (good:
    # no errors at no load) end it (the limit back at its initial 20) and a window opens,
    # which A fills but one, with faulty responses.
    driver.cycle(1 + PROBE_SAMPLES, faulty=False)
    driver.cycle(WINDOW_SAMPLES - 1, faulty=True)
    assert driver("limit") == holder("limit") == 20
    assert holder("admit", 21) == ["admitted"] * 20 + ["GK-CONCURRENCY-LIMIT shop=20"]
    now.value += 1.0  # the window is due
    assert holder("release", 1, True) == 19  # its last sample, faulty: the limit drops
    dropped = driver("limit")
    assert dropped == holder("limit") and dropped < 19
    parent = GateKeeper(
        settings_for(
            f"shared://{tmp_path / 't.shm'}", {"shop": {"concurrency": "auto", "adaptive": AIMD}}
        ),
        clock=lambda: now.value,
    )
    mine: list[Any] = []
    in_flight = 19
    while in_flight >= dropped:
        assert outcome(parent, mine, "p") == f"GK-CONCURRENCY-LIMIT shop={dropped}"
        assert driver("admit", 1) == [f"GK-CONCURRENCY-LIMIT shop={dropped}"]
        in_flight = holder("release", 1, False)
    assert outcome(parent, mine, "p") == "admitted"
    mine.pop().release(200)
    assert holder("release", in_flight, False) == 0
    assert {k: v for k, v in parent.inflight().items() if v} == {}
    parent.close()


def _hammer(
    path: str,
    now: Synchronized[float],
    threads: int,
    rounds: int,
    start: Any,
    app: Any,
) -> None:
    """A worker process whose threads admit and release as fast as they can; the app
    counts what it really sees in flight (``app``: current, most seen, refused) under
    its own lock, independent of the backend."""
    gk = GateKeeper(
        settings_for(f"shared://{path}", {"shop": {"concurrency": "auto", "adaptive": AIMD}}),
        clock=lambda: now.value,
    )
    current, most, refused, lock = app

    def run() -> None:
        start.wait()
        for _ in range(rounds):
            try:
                admission = gk.admit("shop", "a", "c")
            except Rejected:
                with lock:
                    refused.value += 1
                continue
            with lock:
                current.value += 1
                most.value = max(most.value, current.value)
            for _ in range(20):  # stay a little: other threads and processes pile up
                os.sched_yield()
            with lock:
                current.value -= 1
            admission.release(200)

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    gk.close()


def test_observer_never_sees_more_in_flight_than_the_limit_in_force(
    tmp_path: Path, now: Synchronized[float], workers: list[Worker]
) -> None:
    """With the limit driven below its initial value by faulty windows, 4 processes of 6
    threads (24 clients) hammer it: the app never has more requests in flight than the
    limit in force, and refusals show the limit was really reached."""
    driver = workers[0]
    driver.cycle(1 + PROBE_SAMPLES, faulty=False)  # the first probe, then the limit is 20
    for _ in range(3):  # three windows of faulty samples: 20 -> 18 -> 16 -> 14 (AIMD x0.9)
        now.value += 1.0
        driver.cycle(WINDOW_SAMPLES, faulty=True)
    limit = driver("limit")
    assert limit < 20
    context = multiprocessing.get_context("fork")
    app = (context.Value("i", 0), context.Value("i", 0), context.Value("i", 0), context.Lock())
    start = context.Barrier(4 * 6)
    hammers = [
        context.Process(
            target=_hammer, args=(str(tmp_path / "t.shm"), now, 6, 60, start, app), daemon=True
        )
        for _ in range(4)
    ]
    for process in hammers:
        process.start()
    for process in hammers:
        process.join(120)
        assert process.exitcode == 0
    current, most, refused, _ = app
    assert current.value == 0
    assert 1 <= most.value <= limit
    assert refused.value > 0
    assert driver("limit") == limit  # the clock stood still: no window closed meanwhile
    observer = SharedBackend(tmp_path / "t.shm")
    assert {k: v for k, v in observer.inflight(now.value).items() if v} == {}
    observer.close()


def test_a_reloaded_adaptive_table_applies_to_every_process(
    tmp_path: Path, now: Synchronized[float], workers: list[Worker]
) -> None:
    """A reload that lowers ``adaptive.max`` below the current limit applies at the next
    admission: the stored limit is brought within the new bounds, which the other
    processes then report too."""
    table = tmp_path / "t.shm"
    config = tmp_path / "gatekeeper.toml"

    def write(maximum: int) -> None:
        staged = tmp_path / "staged.toml"
        staged.write_text(
            f'project = "shop"\nbackend = "shared://{table}"\n'
            f'[limits.shop]\nconcurrency = "auto"\n'
            f'adaptive = {{ algorithm = "aimd", min = 1, max = {maximum}, '
            f"initial = {min(maximum, 20)} }}\n"
        )
        os.replace(staged, config)

    driver = workers[0]
    driver.cycle(1 + PROBE_SAMPLES, faulty=True)
    assert driver("limit") == 20
    write(50)
    gk = GateKeeper(str(config), clock=lambda: now.value)
    write(5)
    assert gk.reload()
    held: list[Any] = []
    assert [outcome(gk, held, "c") for _ in range(6)] == ["admitted"] * 5 + [
        "GK-CONCURRENCY-LIMIT shop=5"
    ]
    assert driver("limit") == 5
    assert driver("admit", 1) == ["GK-CONCURRENCY-LIMIT shop=5"]
    for admission in held:
        admission.release(200)
    gk.close()


def test_a_table_of_the_previous_layout_is_reported_until_idle(tmp_path: Path) -> None:
    """A file of the layout before adaptive gauges (version 3) with live leases is a
    clear BackendError naming both versions; once idle it is re-created."""
    table = tmp_path / "t.shm"
    SharedBackend(table).close()
    with open(table, "r+b") as file:
        file.seek(8)
        file.write(struct.pack("<I", VERSION - 1))
        file.seek(24)
        file.write(struct.pack("<I", 1))
    with opened_elsewhere(table):
        backend = SharedBackend(table)
        with pytest.raises(
            LayoutMismatch, match=f"layout version {VERSION - 1} \\(this is {VERSION}\\)"
        ):
            backend.inflight(0.0)
        backend.close()
