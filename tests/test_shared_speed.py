"""The shared backend's fast paths keep their guarantees: the file lock excludes other
processes, a journal saved in one step undoes exactly what it covers, and a remembered
node is never used for another key."""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import random
import resource
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import SharedBackend, filelock
from gatekeeper_wsgi.backends.shared.journal import SPARES_KEPT, Journal, Saving
from gatekeeper_wsgi.backends.shared.layout import H_JLEN, U32, Layout
from tests.servers import wait_until

DEADLINE = 20.0


# --- the file lock --------------------------------------------------------------------------


def _hold_lock(path: str, conn: Connection) -> None:
    """In a child process: take the lock, write a mark under it, hold it until told."""
    fd = os.open(path, os.O_RDWR)
    filelock.lock_file(fd)
    os.pwrite(fd, b"child", 0)
    conn.send("held")
    conn.recv()
    os.pwrite(fd, b"done!", 0)
    filelock.unlock_file(fd)
    conn.send("released")
    conn.recv()
    os.close(fd)


def _blocked_on(inode: int) -> bool:
    with open("/proc/locks", encoding="ascii") as locks:
        return any("->" in line and f":{inode} " in line for line in locks)


def test_lock_excludes_another_process_until_it_unlocks(tmp_path: Path) -> None:
    """While another process holds the lock, lock_file() waits, and returns once that
    process unlocks, seeing what it wrote under the lock."""
    path = tmp_path / "lock"
    path.write_bytes(bytes(16))
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_hold_lock, args=(str(path), theirs))
    child.start()
    fd = os.open(path, os.O_RDWR)
    try:
        assert ours.poll(DEADLINE) and ours.recv() == "held"
        taken = threading.Event()
        seen: list[bytes] = []

        def take() -> None:
            filelock.lock_file(fd)
            seen.append(os.pread(fd, 5, 0))
            taken.set()

        taker = threading.Thread(target=take)
        taker.start()
        # The kernel lists a request blocked on a lock with "->": the taker waits for the
        # child.
        inode = os.stat(path).st_ino
        wait_until(lambda: _blocked_on(inode), what="the taker blocked on the lock")
        assert not taken.is_set()
        ours.send("release")
        assert taken.wait(DEADLINE)
        taker.join(DEADLINE)
        assert seen == [b"done!"]
        assert ours.poll(DEADLINE) and ours.recv() == "released"
        filelock.unlock_file(fd)
        ours.send("exit")
    finally:
        os.close(fd)
        child.join(DEADLINE)
    assert child.exitcode == 0


def test_file_size_reads_a_size_past_4_gib(tmp_path: Path) -> None:
    """file_size reads a sparse file's size past 32 bits (the table's geometry can ask
    for that much), as fstat does."""
    path = tmp_path / "big"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, (5 << 30) + 12345)
        assert filelock.file_size(fd) == os.fstat(fd).st_size == (5 << 30) + 12345
    finally:
        os.close(fd)


def test_a_descriptor_not_open_raises() -> None:
    """A descriptor that cannot be locked or unlocked raises OSError, not a silent no-op
    (the backend turns it into a BackendError). One at the process's limit, which no file
    can be open on: a number just closed may be handed to another thread's file while the
    wait tries it (a CI run saw the unlock succeed on it)."""
    fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with pytest.raises(OSError):
        filelock.file_size(fd)
    # Only "another process holds it" is tried again: the lock refused for another reason
    # raises its error (after the few retries, from the kernel wait), never a hang.
    with pytest.raises(OSError) as refused:
        filelock.lock_file(fd)
    assert refused.value.errno == errno.EBADF
    with pytest.raises(OSError) as refused:
        filelock.unlock_file(fd)
    assert refused.value.errno == errno.EBADF


# --- the journal saved in one step ----------------------------------------------------------


@pytest.fixture(scope="module")
def mapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[mmap.mmap, Layout]]:
    """A zeroed map of a small table's size (the journal needs only its geometry)."""
    layout = Layout.derive(None)
    path = tmp_path_factory.mktemp("journal") / "table"
    with open(path, "w+b") as file:
        file.truncate(layout.total)
        with mmap.mmap(file.fileno(), layout.total) as mm:
            yield mm, layout


#: byte ranges in the node region: (offset from its start, length), overlapping at will
RANGES = st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 64)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.booleans(), RANGES), min_size=1, max_size=6), seed=st.integers())
def test_save_all_undoes_exactly_what_it_covered(
    mapped: tuple[mmap.mmap, Layout], steps: list[tuple[bool, list[tuple[int, int]]]], seed: int
) -> None:
    """Ranges saved by save_all (or one by one by save), then overwritten, come back byte
    for byte on rollback and on the undo a process finding a killed one's journal does;
    saving a range twice costs nothing more."""
    mm, layout = mapped
    noise = random.Random(seed)
    base = layout.nodes_off
    mm[base : base + 4096] = noise.randbytes(4096)
    before = mm[base : base + 4096]
    for undo_as_survivor in (False, True):
        journal = Journal(mm, layout, "test")
        for together, ranges in steps:
            absolute = [(base + offset, length) for offset, length in ranges]
            if together:
                journal.save_all(absolute)
            else:
                for offset, length in absolute:
                    journal.save(offset, length)
            pending = journal.pending
            journal.save_all(absolute)  # already saved: no new entry
            assert journal.pending == pending
            assert U32.unpack_from(mm, H_JLEN)[0] == pending
            for offset, length in absolute:
                mm[offset : offset + length] = noise.randbytes(length)
        if undo_as_survivor:
            # Another process's view: only the map and the length in the header.
            Journal(mm, layout, "test").undo(U32.unpack_from(mm, H_JLEN)[0])
        else:
            journal.rollback()
        assert mm[base : base + 4096] == before
        assert U32.unpack_from(mm, H_JLEN)[0] == 0


@settings(max_examples=60, deadline=None)
@given(
    fixed=RANGES,
    spares=st.lists(st.integers(0, 2000), min_size=1, max_size=3 * SPARES_KEPT),
    seed=st.integers(),
)
def test_save_first_undoes_its_ranges_and_its_spare_at_any_offset(
    mapped: tuple[mmap.mmap, Layout],
    fixed: list[tuple[int, int]],
    spares: list[int],
    seed: int,
) -> None:
    """A first save of fixed ranges and a spare range at a different offset each time
    (more offsets than a Saving keeps, overlapping the fixed ranges at will), then
    overwritten, comes back byte for byte on rollback and on a survivor's undo; a
    committed one stays."""
    mm, layout = mapped
    noise = random.Random(seed)
    base = layout.nodes_off
    saving = Saving([(base + offset, length) for offset, length in fixed], 40)
    journals = [Journal(mm, layout, "test")]
    try:
        for turn, spare in enumerate(spares):
            mm[base : base + 4096] = noise.randbytes(4096)
            before = mm[base : base + 4096]
            journals[-1].save_first(saving, base + spare)
            # What it covers: each offset once (the Saving keeps one length per offset).
            for offset, length in [*saving.ranges, (base + spare, 40)]:
                mm[offset : offset + length] = noise.randbytes(length)
            if turn % 3 == 0:
                journals[-1].commit()
                assert mm[base : base + 4096] != before
                continue
            if turn % 3 == 1:
                journals[-1].rollback()
            else:  # a survivor's undo, with a journal of its own
                journals.append(Journal(mm, layout, "test"))
                journals[-1].undo(U32.unpack_from(mm, H_JLEN)[0])
            assert mm[base : base + 4096] == before
            assert U32.unpack_from(mm, H_JLEN)[0] == 0
        assert len(saving.by_offset) <= SPARES_KEPT
    finally:
        for journal in journals:
            journal.close()  # its views of the map, which the fixture closes


# --- a remembered node is checked before it is used -----------------------------------------


def test_node_hint_of_an_evicted_key_never_counts_on_its_successor(tmp_path: Path) -> None:
    """A process remembers the node a key was found in; when another process evicts that
    idle key and a new key takes the very same node, the first process's next request
    for the old key is decided on that key alone: here refused (max_keys reached, the new
    key in flight), never counted on the new key's node."""
    table = tmp_path / "t.shm"
    limits = {"shop/api/*": {"concurrency": 5, "max_keys": 1}}
    settings_ = {"project": "shop", "backend": f"shared://{table}", "limits": limits}
    first = GateKeeper(settings_)
    second = GateKeeper(settings_)
    backend = second.backend
    assert isinstance(backend, SharedBackend)
    # In an empty table a key takes slot 0 of its first bucket; a key with the same first
    # bucket then takes the node an evicted one left.
    first_bucket = backend._keys.key("shop/api/a")[2]
    successor = next(
        name
        for name in (f"b{i}" for i in range(10_000))
        if backend._keys.key(f"shop/api/{name}")[2] == first_bucket
    )
    for _ in range(2):  # created, then found: first remembers a's node
        first.admit("shop", "api", "a").release(200)
    held = second.admit("shop", "api", successor)  # evicts idle a, takes its node
    assert backend._keys.find(backend._keys.key(f"shop/api/{successor}")) == first_bucket * 8
    with pytest.raises(Rejected) as refusal:
        first.admit("shop", "api", "a")
    assert refusal.value.code == "GK-CONCURRENCY-LIMIT"
    assert {k: v for k, v in second.inflight().items() if v} == {f"shop/api/{successor}": 1}
    held.release(200)
    first.admit("shop", "api", "a").release(200)  # now a evicts the idle successor
    assert {k: v for k, v in first.inflight().items() if v} == {}
    first.close()
    second.close()
