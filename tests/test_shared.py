"""The shared backend (``shared:///path``): one mmap'd file holds the limits of every process
of a host. Real processes and real gunicorn workers, no mocks; processes report through
pipes and queues, never through sleeps.

The engine conformance suite (tests/test_engine.py) runs on this backend too, through the
backend table in conftest.py; these tests cover what only a multi-process backend has.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import logging
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier, Lock
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import (
    NODE_HEAD,
    VERSION,
    LayoutMismatch,
    SharedBackend,
)
from gatekeeper_wsgi.backends.shared import table as table_module
from gatekeeper_wsgi.errors import ConfigError
from tests.apps.shared_app import read_observer, reset_observer
from tests.conftest import FakeClock
from tests.servers import Gunicorn, gather, run_together, wait_until
from tests.tablelock import lock_free, try_lock

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 20.0


def config(path: Path, limits: dict[str, Any], query: str = "", **options: Any) -> dict[str, Any]:
    """Settings for a GateKeeper on the table at ``path``."""
    return {"project": "shop", **options, "backend": f"shared://{path}{query}", "limits": limits}


def busy(source: GateKeeper | SharedBackend) -> dict[str, int]:
    """In-flight counts without the paths at zero."""
    counts = (
        source.inflight() if isinstance(source, GateKeeper) else source.inflight(time.monotonic())
    )
    return {path: count for path, count in counts.items() if count}


def refused(gk: GateKeeper, service: str = "api", caller: str = "c") -> Rejected:
    with pytest.raises(Rejected) as info:
        gk.admit("shop", service, caller)
    return info.value


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """The path of a table file that does not exist yet."""
    return tmp_path / "gatekeeper.shm"


# --- one process -------------------------------------------------------------------------


def test_two_keepers_in_one_process_share_limits(table: Path, clock: FakeClock) -> None:
    """Two GateKeepers on one file count together: concurrency, rate and delays."""
    limits = {"shop": {"concurrency": 2, "delay": 5.0}, "shop/login/*": {"rate": "2/minute"}}
    first = GateKeeper(config(table, limits), clock=clock)
    second = GateKeeper(config(table, limits), clock=clock)
    held = first.admit("shop", "api", "c")
    second.admit("shop", "api", "c").release(200)
    other = second.admit("shop", "api", "c")
    assert refused(first).code == "GK-CONCURRENCY-LIMIT"
    assert busy(first) == busy(second) == {"shop": 2}
    other.release(500, faulty=True)  # held back for 5 s, seen by both
    held.release(200)
    assert busy(first) == {"shop": 1}
    assert first.stats()["counters"]["delayed_pending"] == 1
    clock.advance(5.0)
    assert busy(second) == {}
    first.admit("shop", "login", "alice").release(200)
    second.admit("shop", "login", "alice").release(200)
    assert refused(first, "login", "alice").code == "GK-RATE-LIMIT"
    first.close()
    second.close()


@pytest.mark.parametrize("keepers", [1, 2])
def test_a_waiter_yields_the_cpu_only_to_a_holder_of_another_process(
    table: Path, monkeypatch: pytest.MonkeyPatch, keepers: int
) -> None:
    """A request that finds the file lock held tries again yielding the CPU, keeping the
    GIL - unless another keeper of this process has the file open: its thread may be the
    holder, which needs the GIL to let go. (Held here from a descriptor of the test's
    own, as another process would hold it.)"""
    gks = [GateKeeper(config(table, {"shop": {"concurrency": 2}})) for _ in range(keepers)]
    asked: list[bool] = []
    real = table_module.lock_file

    def recorded(fd: int, yielding: bool = True) -> None:
        asked.append(yielding)
        real(fd, yielding)

    monkeypatch.setattr(table_module, "lock_file", recorded)
    results: list[object] = []
    fd = os.open(table, os.O_RDWR)
    try:
        assert try_lock(fd)
        admitting = threading.Thread(target=lambda: results.append(gks[0].admit("shop", "a", "c")))
        admitting.start()
        wait_until(lambda: bool(asked), what="the admission to find the lock held")
        fcntl.flock(fd, fcntl.LOCK_UN)
        admitting.join(DEADLINE)
    finally:
        os.close(fd)
    assert not admitting.is_alive() and len(results) == 1
    assert asked == [keepers == 1]
    assert busy(gks[-1]) == {"shop": 1}  # admitted, and counted where both keepers count
    for gk in gks:
        gk.close()


@pytest.mark.parametrize("raised", [RuntimeError("a bug"), KeyboardInterrupt()])
def test_anything_raised_while_waiting_for_the_file_lock_lets_the_thread_lock_go(
    table: Path, monkeypatch: pytest.MonkeyPatch, raised: BaseException
) -> None:
    """A wait for the file lock that raises something unforeseen (a bug, an interrupt)
    lets the process's thread lock go: kept, every later request of the process would
    wait for it for good. (Found when a benchmark's wrapper of the wait raised a
    TypeError: a gunicorn worker hung with all its threads there.)"""
    gk = GateKeeper(config(table, {"shop": {"concurrency": 2}}, on_backend_error="reject"))

    def broken(fd: int, yielding: bool = True) -> None:
        raise raised

    fd = os.open(table, os.O_RDWR)
    try:
        assert try_lock(fd)  # held, as by another process: the admission waits
        monkeypatch.setattr(table_module, "lock_file", broken)
        with pytest.raises((Rejected, KeyboardInterrupt)):
            gk.admit("shop", "a", "c")
        monkeypatch.undo()
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    results: list[object] = []
    later = threading.Thread(target=lambda: results.append(gk.admit("shop", "a", "c")), daemon=True)
    later.start()
    later.join(DEADLINE)
    assert not later.is_alive() and len(results) == 1
    assert busy(gk) == {"shop": 1}
    gk.close()


def test_threads_of_two_keepers_never_exceed_concurrency(table: Path) -> None:
    """8 threads on 2 keepers (2 descriptors, each shared by 4 threads) stay within 3."""
    limit = 3
    keepers = [GateKeeper(config(table, {"shop": {"concurrency": limit}})) for _ in range(2)]
    guard = threading.Lock()
    current = highest = admitted = rejected = 0

    def run(index: int) -> None:
        nonlocal current, highest, admitted, rejected
        keeper = keepers[index % 2]
        for _ in range(300):
            try:
                admission = keeper.admit("shop", "api", "c")
            except Rejected:
                with guard:
                    rejected += 1
                continue
            with guard:
                current += 1
                highest = max(highest, current)
                admitted += 1
            with guard:
                current -= 1
            admission.release(200)

    run_together(8, run)
    assert highest <= limit
    assert admitted + rejected == 8 * 300
    assert busy(keepers[0]) == {}
    for keeper in keepers:
        keeper.close()


def test_observer_sees_live_counters(table: Path) -> None:
    """A SharedBackend opened without a configuration reads another keeper's live counts."""
    gk = GateKeeper(config(table, {"shop": {"concurrency": 5}, "shop/api": {"concurrency": 5}}))
    held = [gk.admit("shop", "api", "c") for _ in range(3)]
    observer = SharedBackend.from_url(f"shared://{table}")
    assert busy(observer) == {"shop": 3, "shop/api": 3}
    usage = observer.usage()
    assert (usage["leases"], usage["keys"], usage["processes"]) == (3, 2, [os.getpid()])
    for admission in held:
        admission.release(200)
    assert busy(observer) == {}
    observer.close()
    gk.close()


def test_url_options_size_the_table(tmp_path: Path) -> None:
    """?size, ?leases, ?procs and ?windows set the sizes; unknown options are refused."""
    backend = SharedBackend.from_url(
        f"shared://{tmp_path}/a.shm?size=100&leases=7&procs=3&windows=50"
    )
    usage = backend.usage()
    assert usage["lease_capacity"] == 7
    assert usage["key_capacity"] >= 100
    backend.close()
    with pytest.raises(ConfigError, match="unknown option 'sise'"):
        SharedBackend.from_url(f"shared://{tmp_path}/b.shm?sise=100")
    # Only ASCII digits, as everywhere in the configuration (SPEC 4.10): int() alone
    # would take these.
    for value in ("-1", "1_000", "\u0661\u0660\u0660", " 5", "1" * 40):
        with pytest.raises(ConfigError, match="positive integer"):
            SharedBackend.from_url(f"shared://{tmp_path}/b.shm?size={value}")
    with pytest.raises(ConfigError, match="octal mode"):
        SharedBackend.from_url(f"shared://{tmp_path}/b.shm?mode=0680")
    with pytest.raises(ConfigError, match="no file path"):
        SharedBackend.from_url("shared://")
    with pytest.raises(ConfigError, match="cannot open"):
        SharedBackend.from_url(f"shared://{tmp_path}/missing/dir/c.shm")


# --- a full table: refused by the limit, never an outage (SPEC §4.5) ----------------------
# More in tests/test_shared_capacity.py.


def test_full_lease_table_refuses_by_the_limit(table: Path) -> None:
    """With every lease taken the next request is refused by its concurrency limit (not
    on_backend_error, even "reject"); nothing is corrupted."""
    gk = GateKeeper(
        config(table, {"shop": {"concurrency": 100}}, "?leases=3", on_backend_error="reject")
    )
    held = [gk.admit("shop", "api", "c") for _ in range(3)]
    assert refused(gk).code == "GK-CONCURRENCY-LIMIT"
    counters = gk.stats()["counters"]
    assert (counters["capacity_refused"], counters["backend_errors"]) == (1, 0)
    assert busy(gk) == {"shop": 3}
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}
    gk.admit("shop", "api", "c").release(200)
    gk.close()


def test_full_key_table_refuses_new_keys(table: Path) -> None:
    """Keys that fill their hash buckets with requests in flight: new keys are refused by
    their limit, counts stay exact, and after release the idle keys make room again."""
    gk = GateKeeper(config(table, {"shop/api/*": {"concurrency": 1}}, "?size=1&leases=500"))
    held = []
    callers = [f"c{number}" for number in range(300)]
    for caller in callers:
        try:
            held.append(gk.admit("shop", "api", caller))
        except Rejected as rejection:
            assert rejection.code == "GK-CONCURRENCY-LIMIT"
            break
    else:
        pytest.fail("the table never filled up")
    assert len(held) < len(callers)
    assert busy(gk) == {f"shop/api/c{number}": 1 for number in range(len(held))}
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}
    # Idle nodes are evicted for new keys now.
    for caller in callers[len(held) :]:
        gk.admit("shop", "api", caller).release(200)
    assert gk.stats()["counters"]["capacity_refused"] == 1
    assert gk.stats()["counters"]["backend_errors"] == 0
    gk.close()


def test_max_keys_all_in_flight_refuses_a_new_key(table: Path) -> None:
    """A wildcard limit tracking max_keys keys, all in flight, refuses a new key by its
    limit; an idle key is evicted first."""
    limits = {"shop/api/*": {"concurrency": 1, "max_keys": 2}}
    gk = GateKeeper(config(table, limits, on_backend_error="reject"))
    first = gk.admit("shop", "api", "a")
    second = gk.admit("shop", "api", "b")
    assert refused(gk, "api", "c").code == "GK-CONCURRENCY-LIMIT"
    first.release(200)
    third = gk.admit("shop", "api", "c")  # evicts idle 'a'
    assert busy(gk) == {"shop/api/b": 1, "shop/api/c": 1}
    assert set(gk.inflight()) == {"shop/api/b", "shop/api/c"}
    second.release(200)
    third.release(200)
    gk.close()


# --- files of another layout -------------------------------------------------------------


def test_smaller_table_is_counted_in_while_in_use_and_recreated_bigger_when_idle(
    table: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keeper whose configuration wants a bigger table than the one in use (leases are
    live) counts in it as it is, with one WARNING: no outage, which on_backend_error =
    "allow" would answer by admitting uncounted; what it cannot track is refused by its
    limit. Once no lease is live, it re-creates the table bigger (within a look's
    interval), and the other keeper follows onto the new table."""
    clock = FakeClock()
    monkeypatch.setattr(table_module, "_monotonic", clock)
    small = GateKeeper(config(table, {"shop": {"concurrency": 500}}))
    held = small.admit("shop", "api", "c")
    big_limits = {
        "shop": {"concurrency": 500},
        "shop/api/*": {"concurrency": 1, "max_keys": 500_000},
    }
    with caplog.at_level(logging.WARNING, "gatekeeper"):
        big = GateKeeper(config(table, big_limits))
    assert "smaller than this configuration wants" in caplog.text
    assert "re-creating" not in caplog.text.split("wants")[0]
    mine = big.admit("shop", "api", "c")  # counted in the table in use, with small's
    assert busy(small) == {"shop": 2, "shop/api/c": 1}
    assert refused(big).limit_path == "shop/api/*"
    sprayed: list[Any] = []
    with pytest.raises(Rejected) as full:  # busy keys past what the small table holds
        while len(sprayed) < 200:
            sprayed.append(big.admit("shop", "api", f"k{len(sprayed)}"))
    assert full.value.limit_path == "shop/api/*"
    counters = big.stats()["counters"]
    assert (counters["backend_errors"], counters["capacity_refused"]) == (0, 1)
    for admission in (held, mine, *sprayed):
        admission.release(200)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "gatekeeper"):
        big.admit("shop", "api", "c").release(200)
        assert "re-creating shared table" not in caplog.text  # not looked at again yet
        clock.advance(table_module.GROW_CHECK_EVERY)
        big.admit("shop", "api", "c").release(200)
    assert "re-creating shared table" in caplog.text
    assert busy(small) == {}  # small follows onto the new table
    admission = small.admit("shop", "api", "c")
    assert busy(big) == {"shop": 1}  # small counts its own limits, in the new table
    admission.release(200)
    small.close()
    big.close()


def test_a_smaller_table_with_live_windows_is_not_recreated(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing in flight, but a key has used its window: a keeper wanting a bigger table
    counts in this one rather than re-create it, which would forget the window and admit
    that key again inside it (SPEC 4.1)."""
    login = {"shop/login/*": {"rate": "2/minute"}}
    small = GateKeeper(config(table, login))
    for _ in range(2):
        small.admit("shop", "login", "bob").release(200)
    bigger = {**login, "shop/api/*": {"concurrency": 1, "max_keys": 500_000}}
    with caplog.at_level(logging.WARNING, "gatekeeper"):
        big = GateKeeper(config(table, bigger))
    assert "keys have rate window entries" in caplog.text
    assert "re-creating shared table" not in caplog.text
    assert refused(big, "login", "bob").code == "GK-RATE-LIMIT"
    assert refused(small, "login", "bob").code == "GK-RATE-LIMIT"
    small.close()
    big.close()


def test_a_status_read_takes_no_memory_of_a_sparse_table_on_tmpfs() -> None:
    """On tmpfs (where docs/deployment.md puts the table) a read of a hole of the sparse
    file through a shared map takes a page: a status read that read every node's column
    took 28 MB for a table of 2 keys. Only the nodes of keys are read, whose pages their
    writes made already."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        path = Path(directory) / "t.shm"
        limits = {"shop": {"concurrency": 100}, "shop/login/*": {"rate": "5/minute", "key": "ip"}}
        gk = GateKeeper(config(path, limits))
        gk.admit("shop", "login", "c", {"REMOTE_ADDR": "10.0.0.7"}).release(200)
        before = path.stat().st_blocks * 512
        assert busy(gk) == {}
        gk.stats()
        assert path.stat().st_blocks * 512 - before < 1 << 20
        assert gk.inflight() == {"shop": 0, "shop/login/10.0.0.7": 0}
        gk.close()


def newer_version_in_use(table: Path) -> None:
    """Make ``table`` a table of the next layout version with 2 live leases."""
    SharedBackend(table).close()
    with open(table, "r+b") as file:
        file.seek(8)
        file.write(struct.pack("<I", VERSION + 1))
        file.seek(24)
        file.write(struct.pack("<I", 2))  # live leases


@contextlib.contextmanager
def opened_elsewhere(path: Path, *, mapped: bool = True) -> Iterator[None]:
    """Another process has the file open until the block ends, and ``mapped``: a worker
    of the other layout version using it (standing for one); not mapped: a worker of
    this version facing that table (it unmapped it to attach)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_MAPPED if mapped else _HOLD_OPEN, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "open\n"
        yield
    finally:
        child.stdin.close()
        child.wait(30)
        child.stdout.close()


_HOLD_OPEN = "import sys; f = open(sys.argv[1], 'rb'); print('open', flush=True); sys.stdin.read()"
_HOLD_MAPPED = (
    "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0);"
    " print('open', flush=True); sys.stdin.read()"
)


def test_stats_answers_while_the_table_is_in_use_by_another_layout(table: Path) -> None:
    """stats() is SPEC §7's dict while the backend fails (a table of another layout
    version, its leases live): the backend's own figures as last read, the failures
    counted."""
    newer_version_in_use(table)
    with opened_elsewhere(table):
        keeper = GateKeeper(config(table, {"shop": {"concurrency": 5}}, on_backend_error="reject"))
        assert refused(keeper).code == "GK-BACKEND-UNAVAILABLE"
    stats = keeper.stats()
    assert set(stats) == {"counters", "stages", "adaptive"}
    assert stats["counters"]["backend_errors"] >= 1
    assert stats["counters"]["delayed_pending"] == 0 and stats["adaptive"] == {}
    keeper.close()


def test_other_layout_version_is_recreated_only_when_idle(table: Path) -> None:
    """A file of another layout version is re-created when it has no live leases, and
    reported (BackendError) while it has and a process of it is there."""
    newer_version_in_use(table)
    with opened_elsewhere(table):
        backend = SharedBackend(table)
        with pytest.raises(LayoutMismatch, match=f"layout version {VERSION + 1}"):
            backend.inflight(0.0)
        backend.close()
    with open(table, "r+b") as file:
        file.seek(24)
        file.write(struct.pack("<I", 0))
    backend = SharedBackend(table)
    assert backend.inflight(0.0) == {}
    backend.close()
    with open(table, "rb") as file:
        assert struct.unpack_from("<I", file.read(12), 8)[0] == VERSION


def _look_in_a_forked_worker(path: str, answer: Any) -> None:
    backend = SharedBackend(Path(path))
    try:
        answer.send(repr(backend.inflight(0.0)))
    except Exception as exc:
        answer.send(type(exc).__name__)
    finally:
        backend.close()


def test_a_preloading_master_does_not_pin_a_table_of_another_layout(table: Path) -> None:
    """The master built the engine before it forked its workers (gunicorn --preload) and
    keeps its map of the table for good: a table whose layout field says another version
    with live leases is re-created by a worker once no other process maps it, the master
    (its parent, running this very version) not counted - it was refused for as long as
    the master lived."""
    master = SharedBackend(table)
    master.inflight(0.0)  # mapped in this process, as the master's at import
    newer_version_in_use(table)
    context = multiprocessing.get_context("fork")
    answer, sent = context.Pipe(duplex=False)
    worker = context.Process(target=_look_in_a_forked_worker, args=(str(table), sent))
    worker.start()
    assert answer.recv() == "{}"
    worker.join(30)
    with open(table, "rb") as file:
        assert struct.unpack_from("<I", file.read(12), 8)[0] == VERSION
    master.close()


def test_other_layout_version_with_leases_of_dead_processes_is_recreated(
    table: Path,
) -> None:
    """A file of another layout version whose live leases belong to processes that are
    gone (killed: they never gave them back, and this version cannot read that version's
    process table to reclaim them) is re-created once no other process has it open - not
    left refusing every request for good (the workers of this version all have it open,
    none mapped)."""
    newer_version_in_use(table)
    # Another worker of this version has it open too (not mapped: it faces the same
    # table): no process of the other version is left.
    with opened_elsewhere(table, mapped=False):
        backend = SharedBackend(table)
        assert backend.inflight(0.0) == {}
        backend.close()
    with open(table, "rb") as file:
        assert struct.unpack_from("<I", file.read(12), 8)[0] == VERSION


def test_foreign_file_is_refused_untouched(table: Path) -> None:
    """A file that is not a gatekeeper table is never overwritten."""
    content = b"precious data, not a table\n" * 100
    table.write_bytes(content)
    with pytest.raises(ConfigError, match="not a gatekeeper shared table"):
        GateKeeper(config(table, {"shop": {"concurrency": 1}}))
    assert table.read_bytes() == content


# --- processes ---------------------------------------------------------------------------


def _hammer(
    path: str,
    limit: int,
    iterations: int,
    barrier: Barrier,
    lock: Lock,
    current: Synchronized[int],
    highest: Synchronized[int],
    outcomes: Any,
) -> None:
    gk = GateKeeper(config(Path(path), {"shop": {"concurrency": limit}}))
    admitted = rejected = 0
    barrier.wait()
    for _ in range(iterations):
        try:
            admission = gk.admit("shop", "api", "c")
        except Rejected:
            rejected += 1
            continue
        with lock:
            current.value += 1
            highest.value = max(highest.value, current.value)
        os.sched_yield()  # let another process run while this one holds its slot
        with lock:
            current.value -= 1
        admission.release(200)
        admitted += 1
    outcomes.put((admitted, rejected))
    gk.close()


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_processes_never_exceed_concurrency(table: Path, start_method: str) -> None:
    """4 processes hammering one table with a limit of 2: the in-flight count an observer
    outside the gatekeeper sees never exceeds 2, and nothing leaks."""
    context = (
        multiprocessing.get_context("spawn")
        if start_method == "spawn"
        else multiprocessing.get_context("fork")
    )
    limit, processes, iterations = 2, 4, 2000
    lock = context.Lock()
    current = context.Value("i", 0, lock=False)
    highest = context.Value("i", 0, lock=False)
    barrier = context.Barrier(processes)
    outcomes = context.Queue()
    workers = [
        context.Process(
            target=_hammer,
            args=(str(table), limit, iterations, barrier, lock, current, highest, outcomes),
        )
        for _ in range(processes)
    ]
    results = gather(workers, outcomes)
    assert highest.value <= limit
    assert sum(admitted + rejected for admitted, rejected in results) == processes * iterations
    assert sum(rejected for _, rejected in results) > 0  # they did contend
    reader = SharedBackend(table)
    assert busy(reader) == {}
    assert reader.usage()["leases"] == 0
    reader.close()


def _hold_then_wait(path: str, count: int, delay_release: bool, conn: Connection) -> None:
    """Take ``count`` slots (optionally release one with a delay), report, block forever."""
    clock = FakeClock()
    gk = GateKeeper(config(Path(path), {"shop": {"concurrency": 2, "delay": 3.0}}), clock=clock)
    held = [gk.admit("shop", "api", "c") for _ in range(count)]
    if delay_release:
        held.pop().release(500, faulty=True)
    conn.send("held")
    conn.recv()  # never comes: the test kills this process


def _start(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    """A forked child running ``target(*args, conn)``, once it has reported in."""
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    assert parent.poll(DEADLINE), "child did not report"
    assert parent.recv() in ("held", "inside")
    return process, parent


def _kill(process: Any) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=DEADLINE)
    assert process.exitcode == -signal.SIGKILL


@pytest.mark.slow
def test_sigkilled_holder_slots_come_back_when_a_request_would_be_rejected(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed with slots in hand: the next request that would be rejected for
    lack of them reclaims them and is admitted."""
    process, _ = _start(_hold_then_wait, str(table), 2, False)
    clock = FakeClock()
    gk = GateKeeper(config(table, {"shop": {"concurrency": 2, "delay": 3.0}}), clock=clock)
    assert refused(gk).code == "GK-CONCURRENCY-LIMIT"  # the child is alive: it holds both
    _kill(process)
    with caplog.at_level(logging.WARNING, "gatekeeper"):
        admissions = [gk.admit("shop", "api", "c") for _ in range(2)]
    assert f"process {process.pid} died holding slots" in caplog.text
    assert busy(gk) == {"shop": 2}
    for admission in admissions:
        admission.release(200)
    assert busy(gk) == {}
    gk.close()


@pytest.mark.slow
def test_delayed_release_outlives_its_process(table: Path) -> None:
    """A delayed decrease is an ownerless lease: it keeps the slot after its process died,
    until the delay has passed."""
    process, _ = _start(_hold_then_wait, str(table), 2, True)
    clock = FakeClock()  # the child's clock started at the same time
    gk = GateKeeper(config(table, {"shop": {"concurrency": 2, "delay": 3.0}}), clock=clock)
    _kill(process)
    assert busy(gk) == {"shop": 1}  # the live lease reclaimed, the delayed one kept
    assert gk.stats()["counters"]["delayed_pending"] == 1
    assert gk.backend.next_due() == clock.now + 3.0
    clock.advance(3.0)
    assert busy(gk) == {}
    gk.close()


def _die_inside_the_lock(path: str, conn: Connection) -> None:
    """Take 2 slots, then the table lock, start an update (add 5 to 'shop'), report, and
    block forever."""
    gk = GateKeeper(config(Path(path), {"shop": {"concurrency": 3}}))
    held = [gk.admit("shop", "api", "c") for _ in range(2)]
    backend = gk.backend
    assert isinstance(backend, SharedBackend)
    with backend._transaction as mm:  # never left: the process is killed inside
        node = backend._keys.find(backend._keys.key("shop"))
        offset = backend._nodes_off + node * backend._node_size
        backend._journal.save(offset, NODE_HEAD)
        struct.pack_into("<I", mm, offset, struct.unpack_from("<I", mm, offset)[0] + 5)
        conn.send("inside")
        conn.recv()  # never comes
    del held


@pytest.mark.slow
def test_sigkill_inside_the_lock_leaves_neither_lock_nor_half_an_update(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed mid-update, holding the table lock and 2 slots: the kernel drops
    the lock, the next process rolls the unfinished update back from the journal, and the
    slots come back when a request would be rejected for lack of them."""
    gk = GateKeeper(config(table, {"shop": {"concurrency": 3}}))
    held = gk.admit("shop", "api", "c")
    process, _ = _start(_die_inside_the_lock, str(table))
    assert not lock_free(table)
    _kill(process)
    assert lock_free(table)
    with caplog.at_level(logging.WARNING, "gatekeeper"):
        admission = gk.admit("shop", "api", "c")  # 3 in flight: would be rejected
    assert "its unfinished update was rolled back" in caplog.text
    assert f"process {process.pid} died holding slots" in caplog.text
    assert busy(gk) == {"shop": 2}  # not 7: no half update, no dead slots
    admission.release(200)
    held.release(200)
    assert busy(gk) == {}
    gk.close()


def _use_inherited(gk: GateKeeper, conn: Connection) -> None:
    """In a forked child: admit through the parent's GateKeeper object."""
    admission = gk.admit("shop", "api", "c")
    try:
        gk.admit("shop", "api", "c")
    except Rejected as rejection:
        conn.send(("rejected", rejection.code, busy(gk)))
    else:
        conn.send(("admitted",))
    conn.recv()  # holds its slot until killed
    admission.release(200)


@pytest.mark.slow
def test_forked_child_counts_in_the_same_table(table: Path) -> None:
    """A GateKeeper inherited across fork reopens the table in the child and counts with
    the parent (a child sharing the parent's descriptor would share its lock instead)."""
    gk = GateKeeper(config(table, {"shop": {"concurrency": 2}}))
    held = gk.admit("shop", "api", "c")
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_use_inherited, args=(gk, child), daemon=True)
    process.start()
    assert parent.poll(DEADLINE)
    assert parent.recv() == ("rejected", "GK-CONCURRENCY-LIMIT", {"shop": 2})
    assert busy(gk) == {"shop": 2}
    _kill(process)
    held.release(200)
    gk.admit("shop", "api", "c")  # reclaims the child's slot, if it must
    assert busy(gk) == {"shop": 1}
    gk.close()


# --- the same decisions as the memory backend --------------------------------------------

MIRROR_LIMITS: dict[str, Any] = {
    "shop": {"concurrency": 4, "delay": 2.0},
    "shop/a": {"concurrency": 2},
    "shop/b": {"rate": "3/10s"},
    "shop/c": {"concurrency": 1, "rate": "2/4s", "mode": "shadow"},
    # max_keys 2 of 3 callers: full wildcard limits are decided alike too (SPEC §4.5)
    "shop/a/*": {"rate": "2/5s", "count": [401], "max_keys": 2},
    "shop/b/*": {"concurrency": 1, "max_keys": 2},
}

_admit = st.tuples(st.just("admit"), st.sampled_from("abc"), st.sampled_from("xyz"))
_admit_often = st.tuples(st.just("admit"), st.sampled_from("ab"), st.sampled_from("xy"))
_release = st.tuples(st.just("release"), st.integers(0, 5), st.sampled_from([200, 401, 500]))
_advance = st.tuples(st.just("advance"), st.sampled_from([0.0, 0.5, 1.0, 2.5, 6.0]))


def _outcome(gk: GateKeeper, service: str, caller: str) -> tuple[Any, ...]:
    try:
        admission = gk.admit("shop", service, caller)
    except Rejected as rejection:
        return ("rejected", rejection.code, rejection.limit_path, rejection.retry_after), None
    return ("admitted",), admission


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.one_of(_admit, _admit_often, _admit_often, _release, _advance), min_size=1, max_size=60
    )
)
def test_same_decisions_as_memory(steps: list[tuple[Any, ...]]) -> None:
    """Random admits, releases (with statuses and faults) and clock moves: the shared
    backend decides and counts exactly as the memory backend does."""
    with tempfile.TemporaryDirectory() as directory:
        clock = FakeClock()
        memory = GateKeeper({"project": "shop", "limits": MIRROR_LIMITS}, clock=clock)
        shared = GateKeeper(config(Path(directory, "t.shm"), MIRROR_LIMITS), clock=clock)
        open_: dict[str, list[Any]] = {"memory": [], "shared": []}
        for step in steps:
            if step[0] == "admit":
                (expected, a), (got, b) = (_outcome(gk, *step[1:]) for gk in (memory, shared))
                assert got == expected, step
                if a is not None:
                    open_["memory"].append(a)
                    open_["shared"].append(b)
            elif step[0] == "release" and open_["memory"]:
                index = step[1] % len(open_["memory"])
                for name in ("memory", "shared"):
                    open_[name].pop(index).release(step[2], faulty=step[2] >= 500)
            elif step[0] == "advance":
                clock.advance(step[1])
            assert busy(shared) == busy(memory), step
            assert shared.stats()["counters"] == memory.stats()["counters"], step
        shared.close()


# --- real gunicorn workers ---------------------------------------------------------------


@contextlib.contextmanager
def gunicorn(
    tmp_path: Path, worker_class: str, preload: bool, limit: int
) -> Iterator[tuple[Gunicorn, Path, Path]]:
    """gunicorn serving tests/apps/shared_app.py with 4 workers; yields (server, table,
    observer). Held requests are let go before it stops."""
    table, observer = tmp_path / "gunicorn.shm", tmp_path / "observer"
    reset_observer(str(observer))
    env = {
        "GK_SHARED_TABLE": str(table),
        "GK_SHARED_OBSERVER": str(observer),
        "GK_SHARED_LIMIT": str(limit),
    }
    args = [
        "--workers", "4",
        "--worker-class", worker_class,
        # gthread: more threads than holds, so a held request never queues behind others
        "--threads", "4" if worker_class == "gthread" else "1",
        "--pythonpath", "tests/apps",
        *(["--preload"] if preload else []),
        "shared_app:create_app()",
    ]  # fmt: skip
    with Gunicorn(tmp_path, *args, env=env) as server:
        try:
            yield server, table, observer
        finally:
            (tmp_path / "release-holds").touch()


def get(server: Gunicorn, path: str) -> int:
    return server.request(path)[0]


def hold(server: Gunicorn, until: Path) -> tuple[http.client.HTTPConnection, int]:
    """Start a /hold request; (its connection, the pid of the worker that holds it)."""
    connection, response = server.open(f"/hold?until={until}")
    assert response.status == 200
    return connection, int(response.readline())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("worker_class", "preload"),
    [("sync", False), ("sync", True), ("gthread", False), ("gthread", True)],
)
def test_gunicorn_workers_share_the_limit(tmp_path: Path, worker_class: str, preload: bool) -> None:
    """4 gunicorn workers under 12 concurrent clients: the app never runs more than the
    limit at once across processes; workers killed with -9 in mid-request give their slots
    back to the next request that needs them; every counter ends at zero."""
    limit = 3
    with gunicorn(tmp_path, worker_class, preload, limit) as (server, table, observer):
        batches = run_together(12, lambda _: [get(server, "/work") for _ in range(30)])
        statuses = [status for batch in batches for status in batch]
        assert set(statuses) <= {200, 503}
        assert statuses.count(200) >= 15
        # Whether 4 sync workers ever ran 4 at once under this load is up to the
        # scheduler; that the limit bites is checked below, with the limit held.
        current, highest = read_observer(str(observer))
        assert current == 0
        assert 1 <= highest <= limit

        reader = SharedBackend(table)
        # A response is released when the server closes it, just after the client read it.
        wait_until(lambda: busy(reader) == {}, what="the load's slots released")

        # Fill the limit with held requests, then kill their workers in mid-request.
        flag = tmp_path / "release-holds"
        holds = [hold(server, flag) for _ in range(limit)]
        assert get(server, "/work") == 503
        for pid in {pid for _, pid in holds}:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: get(server, "/work") == 200, what="the killed workers' slots back")
        flag.touch()
        for connection, _ in holds:
            connection.close()
        wait_until(lambda: busy(reader) == {}, what="every slot released")
        usage = reader.usage()
        assert (usage["leases"], usage["delayed"]) == (0, 0)
        reader.close()
