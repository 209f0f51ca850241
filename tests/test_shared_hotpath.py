"""The shared backend's per-request path (admission and release) keeps every count exact
when an update is rolled back: by a peek, by an error, by a process killed at any line."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi import Admission, GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import SharedBackend, filelock, journal, plans, table, windows
from gatekeeper_wsgi.backends.shared.layout import MUT_END, MUT_START
from gatekeeper_wsgi.backends.shared.reads import read_inflight
from tests.conftest import FakeClock, admits_exactly, busy


def settings_for(path: Path, limits: dict[str, Any]) -> dict[str, Any]:
    return {"project": "shop", "backend": f"shared://{path}", "limits": limits}


def test_a_query_on_a_fresh_table_leaves_what_is_in_flight_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``query`` works an admission out and rolls it back; the lease it took past the
    table's mark must go with it, or the next admission that takes a new lease finds the
    table damaged and re-creates it, forgetting every request in flight."""
    limits = {"shop": {"concurrency": 3}}
    gk = GateKeeper(settings_for(tmp_path / "t.shm", limits))
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        held = [gk.admit("shop", "orders", "crm")]
        for _ in range(2):
            assert gk.query("shop", "orders", "crm") is None
            held.append(gk.admit("shop", "orders", "crm"))
        assert busy(gk) == {"shop": 3}
        with pytest.raises(Rejected):
            gk.admit("shop", "orders", "crm")
    assert not [record for record in caplog.records if "damaged" in record.getMessage()]
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}
    gk.close()


# --- a process killed at any line of an admission or release by plan ------------------------

#: a caller-level key with a rate (its window) under two concurrency levels
PLANNED = {
    "shop": {"concurrency": 5},
    "shop/orders": {"concurrency": 4},
    "shop/orders/*": {"concurrency": 3, "rate": "100/minute"},
}
#: the modules that write the table on the way of a planned admission and release, and
#: the file lock's and the table's, which takes and drops it (a kill between the two included)
WRITERS = tuple(
    sys.modules[name].__file__
    for name in (
        plans.__name__,
        journal.__name__,
        windows.__name__,
        filelock.__name__,
        table.__name__,
    )
)


def _limits(rate: str) -> dict[str, Any]:
    """:data:`PLANNED` with the caller-level key's rate ``rate``."""
    return {**PLANNED, "shop/orders/*": {**PLANNED["shop/orders/*"], "rate": rate}}


def _admitted(
    path: Path, clock: FakeClock, warm: int, rate: str = "100/minute"
) -> tuple[GateKeeper, Admission]:
    """A table that admitted and released ``warm`` requests (one a second: a window of
    ``warm`` entries, up to a minute's), the next one admitted and held: its plan is made."""
    gk = GateKeeper(settings_for(path, _limits(rate)), clock=clock)
    for _ in range(warm):
        gk.admit("shop", "orders", "crm").release(200)
        clock.advance(1.0)
    held = gk.admit("shop", "orders", "crm")
    clock.advance(1.0)
    return gk, held


def _step(gk: GateKeeper, held: Admission, stage: str) -> None:
    """The update a child is killed in: a second admission by plan, or the release."""
    if stage == "admit":
        gk.admit("shop", "orders", "crm")
    else:
        held.release(200)


def _state(path: Path) -> tuple[object, ...]:
    """What a table counts, read as the next process to open it sees it (its journal
    rolled back first), nothing reclaimed: in flight and window entries per key, the
    live leases, the header's lease, key and window chunk counters."""
    backend = SharedBackend(path)
    try:
        with backend._reading as mm:
            keys = backend._keys
            windows = {
                keys.view(node)[1]: tuple(backend._windows.stamps(node)) for node in keys.in_use()
            }
            counters = bytes(mm[MUT_START:MUT_END])
            return read_inflight(keys), windows, backend._leases.live(), counters
    finally:
        backend.close()


def _step_then_die(
    path: Path, warm: int, rate: str, stage: str, kill_at: int, report: Connection
) -> None:
    """In a forked child: make the table, then SIGKILL this process at line ``kill_at``
    run in the writing modules during the step (or tell how many lines there were and
    die after it)."""
    gk, held = _admitted(path, FakeClock(), warm, rate)
    lines = 0

    def tracer(frame: FrameType, event: str, arg: object) -> object:
        nonlocal lines
        if frame.f_code.co_filename not in WRITERS:
            return None
        if event == "line":
            lines += 1
            if lines == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    sys.settrace(tracer)
    _step(gk, held, stage)
    sys.settrace(None)
    report.send(lines)
    os.kill(os.getpid(), signal.SIGKILL)


def _run_child(path: Path, warm: int, rate: str, stage: str, kill_at: int) -> int | None:
    """Fork :func:`_step_then_die`; the lines it counted if it lived through the step."""
    ours, theirs = multiprocessing.Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            _step_then_die(path, warm, rate, stage, kill_at, theirs)
        finally:
            os._exit(1)
    theirs.close()
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    try:
        lines: int | None = ours.recv()
    except EOFError:  # killed before it could tell
        lines = None
    ours.close()
    return lines


#: (stage, warm-up requests, rate) of the kill test: a window entry added, a new window
#: chunk taken, and (admissions only: a release gives no entry back here) once the first
#: window has passed at one request a second (60 entries in the window), an entry expired
#: within the first chunk (warm 61), an expiry that frees the window's first chunk (warm
#: 65), and a full window (60/minute) whose oldest entry expires, the append then taking a
#: new chunk (warm 62); the plan's own new last chunk never used before (warm 6), off the
#: free list (warm 69, the first chunk freed at 65), and the expired first chunk freed and
#: taken back as the last one in the same admission (a 64 s window, warm 69)
KILLED = [
    pytest.param("admit", 1, "100/minute", id="admit-window-entry"),
    pytest.param("admit", 5, "100/minute", id="admit-new-window-chunk"),
    pytest.param("release", 1, "100/minute", id="release-window-entry"),
    pytest.param("release", 5, "100/minute", id="release-new-window-chunk"),
    pytest.param("admit", 61, "100/minute", id="admit-expired-entry"),
    pytest.param("admit", 65, "100/minute", id="admit-expired-chunk"),
    pytest.param("admit", 62, "60/minute", id="admit-full-window-expired-entry"),
    pytest.param("admit", 6, "100/minute", id="admit-new-chunk-bumped"),
    pytest.param("admit", 69, "100/minute", id="admit-new-chunk-off-the-free-list"),
    pytest.param("admit", 69, "100/64s", id="admit-first-chunk-freed-and-taken-back"),
]


@pytest.mark.parametrize(("stage", "warm", "rate"), KILLED)
def test_a_kill_at_any_line_of_a_planned_update_leaves_before_or_after(
    tmp_path: Path,
    stage: str,
    warm: int,
    rate: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker SIGKILLed at any line the planned admission or release runs in the
    modules that write the table leaves it, once the next process rolls the journal
    back, exactly as before the update or as after it (in flight, window entries,
    leases, counters; never re-created); once its slots are reclaimed the limit admits
    exactly its capacity again."""
    # The look at whether the path still names the file is timed by the real clock: one
    # falling inside the step of some runs only would change the lines each run counts.
    monkeypatch.setattr(table, "PATH_CHECK_EVERY", math.inf)
    clock = FakeClock()
    reference = tmp_path / "reference.shm"
    gk, held = _admitted(reference, clock, warm, rate)
    before = _state(reference)
    _step(gk, held, stage)
    after = _state(reference)
    gk.close()
    assert before != after
    total = _run_child(tmp_path / "count.shm", warm, rate, stage, 0)
    assert total is not None and total > 20
    seen = set()
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        for kill_at in range(1, total + 1):
            path = tmp_path / f"kill-{kill_at}.shm"
            assert _run_child(path, warm, rate, stage, kill_at) is None
            state = _state(path)
            assert state in (before, after), f"killed at line {kill_at}"
            seen.add(state == after)
            if kill_at % 16 == 1:  # reclaim and capacity, on some of the tables
                survivor = GateKeeper(settings_for(path, _limits(rate)), clock=FakeClock(2000.0))
                assert busy(survivor) == {}
                admits_exactly(survivor, 3, "shop", "orders", "crm")
                survivor.close()
            path.unlink()
    assert seen == {False, True}  # killed both before and after the commit point
    assert not [record for record in caplog.records if "damaged" in record.getMessage()]


# --- steady traffic: past the first window, admissions by plan expire entries ---------------


def test_steady_traffic_past_the_first_window_goes_by_plan_and_decides_as_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller sending two requests a second against 100/minute: once its first window
    has passed, nearly every admission has an entry to expire. Each one still goes by its
    plan (the general path is no longer taken on every request), and every decision, over
    five windows, is the one the memory backend makes on the same clock."""
    planned = [0]
    admit = plans.Plans.admit

    def counting(self: plans.Plans, *args: Any) -> tuple[int, int] | None:
        taken = admit(self, *args)
        planned[0] += taken is not None
        return taken

    monkeypatch.setattr(plans.Plans, "admit", counting)
    clock = FakeClock()
    shared = GateKeeper(settings_for(tmp_path / "t.shm", PLANNED), clock=clock)
    memory = GateKeeper(
        {**settings_for(tmp_path / "unused", PLANNED), "backend": "memory"}, clock=clock
    )
    decisions: list[tuple[bool, bool]] = []
    for _ in range(600):  # 300 s at two a second
        verdicts = []
        for keeper in (shared, memory):
            try:
                keeper.admit("shop", "orders", "crm").release(200)
            except Rejected:
                verdicts.append(False)
            else:
                verdicts.append(True)
        decisions.append((verdicts[0], verdicts[1]))
        clock.advance(0.5)
    assert all(ours == model for ours, model in decisions)
    admitted = sum(ours for ours, _ in decisions)
    # 100 in the first minute, then as many as slide out: 100 + 4 minutes' worth.
    assert admitted == 100 + 4 * 100
    # Every admission but the first (which made the plan) went by plan, the refusals of a
    # full window with nothing to expire by the general path.
    assert planned[0] == admitted - 1
    shared.close()
    memory.close()


# --- the plan's own window chunks: any spacing of admissions --------------------------------

#: a rate key whose window of 7 seconds holds up to 15 entries (three chunks at most)
CHUNKY = {"shop": {"concurrency": 50}, "shop/orders/*": {"concurrency": 50, "rate": "15/7s"}}


def _chunks_in_use(backend: SharedBackend) -> tuple[list[int], list[int], int]:
    """The window chunks of every key's window (each chain followed to its last chunk),
    those on the free list, and how many were ever used: read under the lock."""
    with backend._reading as mm:
        windows_ = backend._windows
        chained: list[int] = []
        for node in backend._keys.in_use():
            view, _ = backend._keys.view(node)
            if view.length:
                chunk = view.first
                chained.append(chunk)
                while chunk != view.last:
                    chunk = int.from_bytes(
                        mm[windows_.chunk_at(chunk) : windows_.chunk_at(chunk) + 4], "little"
                    )
                    chained.append(chunk)
        free, high = windows_.counters()
        listed: list[int] = []
        while free != 0xFFFFFFFF and len(listed) <= high:
            listed.append(free)
            free = int.from_bytes(
                mm[windows_.chunk_at(free) : windows_.chunk_at(free) + 4], "little"
            )
        return chained, listed, high


#: seconds between admissions: mostly near the window's pace (entries expire one by one,
#: a chunk at a time), sometimes a burst, a pause or a whole window
GAPS = [0.0] * 3 + [0.3] * 5 + [0.45] * 10 + [0.5] * 10 + [1.0, 7.0]
#: callers: a steady one, and one whose sparse admissions leave chunks on the free list
CALLERS = ["crm"] * 5 + ["erp"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(GAPS), st.sampled_from(CALLERS), st.booleans()),
        min_size=40,
        max_size=150,
    )
)
def test_planned_windows_decide_as_memory_and_lose_no_chunk(
    tmp_path_factory: pytest.TempPathFactory, steps: list[tuple[float, str, bool]]
) -> None:
    """Admissions by plan at any spacing (entries expiring one by one or a chunk at a
    time, a chunk taken off the free list or new, whole windows passing) decide as the
    memory backend does, and every window chunk ever used is in exactly one window or on
    the free list, never both, never lost (a second, sparse caller's expired windows keep
    chunks on the free list)."""
    path = tmp_path_factory.mktemp("chunky") / "t.shm"
    clock = FakeClock()
    shared = GateKeeper(settings_for(path, CHUNKY), clock=clock)
    memory = GateKeeper({"project": "shop", "limits": CHUNKY}, clock=clock)
    held: list[tuple[Admission, Admission]] = []
    for gap, caller, hold in steps:
        clock.advance(gap)
        verdicts = []
        for keeper in (shared, memory):
            try:
                verdicts.append(keeper.admit("shop", "orders", caller))
            except Rejected:
                verdicts.append(None)
        ours, model = verdicts
        assert (ours is None) == (model is None)
        if ours is not None and model is not None:
            if hold:
                held.append((ours, model))
            else:
                ours.release(200)
                model.release(200)
        assert busy(shared) == busy(memory)
        chained, listed, high = _chunks_in_use(shared.backend)
        assert sorted(chained + listed) == list(range(high))
    for ours, model in held:
        ours.release(200)
        model.release(200)
    assert busy(shared) == busy(memory) == {}
    shared.close()
    memory.close()
