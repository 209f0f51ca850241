"""Each structure of the shared table on its own, against a plain model: the delay heap
against ``heapq``, the lease table against a dict of held leases, a rate window's log
against a deque of stamps, the key table and its LRU lists against a dict and an
OrderedDict, the undo journal against random kills.

The structures are driven on an anonymous map of a small layout (no file, no lock, no
backend): what they do to the bytes is all there is. The journal's kill test runs the
writes in a forked child that SIGKILLs itself at a random line of ``journal.py``, and
the next process to open the file must find exactly the bytes from before the update.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import mmap
import os
import random
import signal
import sys
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.backends.base import Grant, Slot
from gatekeeper_wsgi.backends.shared import SharedBackend
from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.journal import Journal
from gatekeeper_wsgi.backends.shared.keys import KeyTable
from gatekeeper_wsgi.backends.shared.layout import (
    CHAIN,
    CHUNK_SIZE,
    CHUNK_STAMPS,
    H_CHUNK_FREE,
    H_JLEN,
    H_LIVE,
    H_NODES_USED,
    HEADER,
    MUT_END,
    MUT_START,
    N_FIRST,
    N_INFLIGHT,
    N_LEN,
    NIL,
    NODE,
    R_COUNT,
    R_HEAD,
    R_TAIL,
    REG_SIZE,
    U32,
    Layout,
    clear_counters,
)
from gatekeeper_wsgi.backends.shared.leases import Leases
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.config import Limit, build_config


def table(
    *, buckets: int = 8, leases: int = 64, chunks: int = 16, registry: int = 4
) -> tuple[mmap.mmap, Layout, Journal]:
    """An empty table of a small layout on an anonymous map, and its journal."""
    layout = Layout(
        key_size=64,
        buckets=buckets,
        leases=leases,
        procs=4,
        registry=registry,
        journal=1 << 16,
        chunks=chunks,
    )
    mm = mmap.mmap(-1, layout.total)
    clear_counters(mm)
    return mm, layout, Journal(mm, layout, "test")


# --- the delay heap ---------------------------------------------------------------------

heap_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.floats(0.0, 100.0, allow_nan=False)),
        st.tuples(st.just("push"), st.sampled_from([1.0, 2.0, 3.0])),  # ties
        st.tuples(st.just("pop"), st.just(0.0)),
    ),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(heap_ops)
def test_delay_heap_pops_in_the_order_heapq_does(ops: list[tuple[str, float]]) -> None:
    """Pushes and pops of the table's delay heap give the expiries ``heapq`` gives, in
    order, whatever the ties; its length and head always agree with the model's."""
    mm, layout, journal = table(leases=64)
    heap = Leases(mm, layout, journal)
    model: list[tuple[float, int, int]] = []
    serial = 0
    for op, due in ops:
        if op == "push" and len(model) < layout.leases - 1:
            serial += 1
            entry = (due, serial % layout.leases, serial)
            heap.push(*entry)
            heapq.heappush(model, entry)
        elif op == "pop" and model:
            popped = heap.pop()
            # Ties may come out in another order than heapq's: the expiry is what counts,
            # and the entry must be one that was pushed.
            assert popped[0] == model[0][0]
            model.remove(popped)
            heapq.heapify(model)
        journal.commit()
        assert heap.pending() == len(model)
        assert heap.next_due() == (model[0][0] if model else None)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3), st.floats(0.0, 10.0, allow_nan=False)), max_size=40),
    st.floats(0.0, 12.0, allow_nan=False),
)
def test_maturing_frees_exactly_the_delayed_releases_due(
    releases: list[tuple[int, float]], now: float
) -> None:
    """Leases given a delay are freed by ``mature(now)`` exactly when their expiry is
    at or before ``now``; their nodes' in-flight counts drop then, not before."""
    mm, layout, journal = table(leases=64)
    leases = Leases(mm, layout, journal)
    inflight_at = layout.nodes_off + 1 * layout.node_size + N_INFLIGHT
    held: list[tuple[int, int, float]] = []
    for count, delay in releases:
        lease, serial = leases.new(1000 + count, [1])
        U32.pack_into(mm, inflight_at, U32.unpack_from(mm, inflight_at)[0] + 1)
        leases.delay(lease, serial, delay)
        journal.commit()
        held.append((lease, serial, delay))
    leases.mature(now)
    left = [lease for lease, _, due in held if due > now]
    assert leases.pending() == len(left)
    assert leases.live() == len(left)
    assert U32.unpack_from(mm, inflight_at)[0] == len(left)
    assert leases.next_due() == (min(due for _, _, due in held if due > now) if left else None)


lease_ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "new", "new", "free", "reclaim"]),
        st.integers(1, 3),  # owner pid
        st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),  # nodes
        st.integers(0, 10_000),  # which held lease
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(lease_ops)
def test_lease_table_matches_a_dict_of_held_leases(
    ops: list[tuple[str, int, list[int], int]],
) -> None:
    """New leases, releases and reclaims of a dead owner's leases on a table of 8 leases
    hold what a dict of held leases holds: never two live leases in one entry, a freed
    entry reused, all 8 held -> refused (no room), each node's in-flight count the number
    of live leases on it, a reclaim frees exactly that owner's leases."""
    mm, layout, journal = table(leases=8)
    leases = Leases(mm, layout, journal)
    held: dict[int, tuple[int, int, list[int]]] = {}  # lease -> (pid, serial, nodes)

    def inflight(node: int) -> int:
        return int(U32.unpack_from(mm, layout.nodes_off + node * layout.node_size)[0])

    for op, pid, nodes, pick in ops:
        if op == "new":
            if len(held) == layout.leases:
                with pytest.raises(NoRoom):
                    leases.new(pid, nodes)
                journal.rollback()
                continue
            lease, serial = leases.new(pid, nodes)
            assert lease not in held and serial not in {each[1] for each in held.values()}
            for node in nodes:  # the admission raises its nodes' counts
                at = layout.nodes_off + node * layout.node_size
                U32.pack_into(mm, at, inflight(node) + 1)
            held[lease] = (pid, serial, nodes)
        elif op == "free" and held:
            lease = sorted(held)[pick % len(held)]
            owner, serial, _ = held.pop(lease)
            assert leases.holds(lease, owner, serial)
            leases.free(lease)
            assert not leases.holds(lease, owner, serial)
        elif op == "reclaim":
            mine = [lease for lease, (owner, _, _) in held.items() if owner == pid]
            assert leases.reclaim(pid) == len(mine)
            for lease in mine:
                del held[lease]
        journal.commit()
        assert leases.live() == len(held) == U32.unpack_from(mm, H_LIVE)[0]
        for node in range(4):
            assert inflight(node) == sum(node in each[2] for each in held.values())
        assert leases.held_nodes() == {node for each in held.values() for node in each[2]}


# --- a rate window's log ----------------------------------------------------------------

window_ops = st.lists(
    st.tuples(
        st.sampled_from(["append"] * 5 + ["purge", "give_back", "give_back_missing"]),
        st.integers(0, 2),  # which of the keys
        st.floats(0.0, 3.0, allow_nan=False),  # time step / purge look-back
        st.integers(0, 1000),  # which entry to give back
        st.integers(0, 4).map(lambda n: n == 0),  # roll the update back (1 in 5)
    ),
    min_size=10,
    max_size=150,
)


def _fresh_node(mm: mmap.mmap, layout: Layout, node: int) -> None:
    NODE.pack_into(
        mm, layout.nodes_off + node * layout.node_size, 0, 0, 0, NIL, NIL, 0, 0, NIL, NIL, 0.0
    )


def _chunks_in_use(model: list[tuple[int, deque[float]]]) -> int:
    return sum(-(-(start + len(log)) // CHUNK_STAMPS) for start, log in model if log)


def _free_list_length(mm: mmap.mmap, layout: Layout) -> int:
    count, chunk = 0, U32.unpack_from(mm, H_CHUNK_FREE)[0]
    while chunk != NIL:
        count += 1
        chunk = U32.unpack_from(mm, layout.chunks_off + chunk * CHUNK_SIZE)[0]
    return count


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_ops)
def test_window_log_matches_a_deque_of_stamps(
    ops: list[tuple[str, int, float, int, bool]],
) -> None:
    """Appends, purges and give-backs on three windows sharing 3 chunks hold the stamps
    a deque would, in order, across chunk boundaries; a window that needs a chunk when
    all are in use is refused (and the update rolled back leaves nothing); no chunk is
    lost or handed to two windows (in use + free = ever used); a rolled-back update
    changes nothing."""
    mm, layout, journal = table(chunks=3, registry=1)
    windows = Windows(mm, layout, journal)
    seconds = 5.0
    # per key: (index of its oldest entry in its first chunk, its stamps)
    model: list[tuple[int, deque[float]]] = [(0, deque()) for _ in range(3)]
    for node in range(3):
        _fresh_node(mm, layout, node)
    now = 0.0
    for op, node, step, pick, rollback in ops:
        before = [(start, deque(log)) for start, log in model]
        start, log = model[node]
        try:
            if op == "append":
                now += step / 10  # purges look back up to 3.0: windows fill up
                needs_chunk = not log or (start + len(log)) % CHUNK_STAMPS == 0
                full = _chunks_in_use(model) == layout.chunks
                try:
                    windows.append(node, now, seconds)
                except NoRoom:
                    assert needs_chunk and full
                    journal.rollback()
                    continue
                assert not (needs_chunk and full)
                if not log:
                    start = 0
                log.append(now)
            elif op == "purge":
                cutoff = now - step
                expired = 0
                while log and log[0] <= cutoff:
                    log.popleft()
                    expired += 1
                start = 0 if not log else (start + expired) % CHUNK_STAMPS
                assert windows.purge(node, cutoff) == (len(log), log[0] if log else 0.0)
            elif log or op == "give_back_missing":
                stamp = log[pick % len(log)] if op == "give_back" else -1.0
                windows.give_back(node, stamp, seconds)
                if stamp in log:
                    log.remove(stamp)
                if not log:
                    start = 0
        finally:
            model[node] = (start, log)
        if rollback:
            journal.rollback()
            model = before
        else:
            journal.commit()
        for each, (_, expected) in enumerate(model):
            assert windows.stamps(each) == list(expected)
        _, high = windows.counters()
        assert _chunks_in_use(model) + _free_list_length(mm, layout) == high


# --- the key table and its LRU lists ----------------------------------------------------


def _wildcard(max_keys: int) -> Limit:
    config = build_config(
        {"project": "p", "limits": {"p/s/*": {"concurrency": 5, "max_keys": max_keys}}}
    )
    return config.limits["p/s/*"]


def _lru(mm: mmap.mmap, layout: Layout, keys: KeyTable, registry: int) -> list[str]:
    """The keys of a registry entry's LRU list, least recently used first; the backward
    links are checked on the way."""
    at = layout.registry_off + registry * REG_SIZE
    node, previous, found = U32.unpack_from(mm, at + R_HEAD)[0], NIL, []
    while node != NIL:
        view, key = keys.view(node)
        assert view.older == previous
        found.append(key)
        previous, node = node, view.newer
    assert U32.unpack_from(mm, at + R_TAIL)[0] == previous
    assert U32.unpack_from(mm, at + R_COUNT)[0] == len(found)
    return found


key_ops = st.lists(
    st.tuples(
        st.sampled_from(["use", "use", "busy", "busy", "idle"]),
        st.integers(0, 11),  # which key
    ),
    max_size=150,
)


@settings(max_examples=150, deadline=None)
@given(key_ops, st.integers(1, 8))
def test_key_table_and_lru_match_a_dict_and_an_ordered_dict(
    ops: list[tuple[str, int]], max_keys: int
) -> None:
    """Keys of a wildcard limit found, created and touched hold what a dict (the keys and
    their in-flight counts) and an OrderedDict (least recently used first) hold: at
    ``max_keys`` the least recently used idle key is evicted (the busy keys before it
    move to the end), a key in flight never; with every key busy the new key is refused
    and the rolled-back update leaves the table as it was."""
    limit = _wildcard(max_keys)
    mm, layout, journal = table(buckets=64)
    keys = KeyTable(mm, layout, journal, Windows(mm, layout, journal))
    inflight: dict[str, int] = {}
    order: OrderedDict[str, None] = OrderedDict()
    for op, which in ops:
        key = f"p/s/{which}"
        if op == "use":
            entry = keys.key(key)
            node = keys.find(entry)
            if node >= 0:
                keys.touch(node, limit, 0.0, [])
                order.move_to_end(key)
            else:
                if len(order) >= max_keys:
                    idle = [each for each in order if not inflight[each]]
                    if not idle:
                        with pytest.raises(NoRoom):
                            keys.create(entry, limit, 0.0, [])
                        journal.rollback()
                        assert _lru(mm, layout, keys, keys.registry(limit.path)) == list(order)
                        continue
                    victim = idle[0]
                    for each in list(order):
                        if each == victim:
                            break
                        order.move_to_end(each)
                    del order[victim], inflight[victim]
                keys.create(entry, limit, 0.0, [])
                order[key] = None
                inflight[key] = 0
        elif key in order:
            node = keys.find(keys.key(key))
            at = layout.nodes_off + node * layout.node_size + N_INFLIGHT
            inflight[key] = 1 if op == "busy" else 0
            U32.pack_into(mm, at, inflight[key])
        journal.commit()
        held = {key: view.inflight for view, key in map(keys.view, keys.in_use())}
        assert held == inflight
        assert U32.unpack_from(mm, H_NODES_USED)[0] == len(inflight)
        if order:
            assert _lru(mm, layout, keys, keys.registry(limit.path)) == list(order)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3).map(bool)), max_size=80))
def test_full_buckets_evict_only_an_idle_key(ops: list[tuple[int, bool]]) -> None:
    """With one bucket (8 nodes) and no ``max_keys`` in reach, a new key takes a free node,
    else the node of an idle key, never one in flight: with all 8 busy it is refused."""
    limit = _wildcard(10_000)
    mm, layout, journal = table(buckets=1)
    keys = KeyTable(mm, layout, journal, Windows(mm, layout, journal))
    inflight: dict[str, int] = {}
    for which, busy in ops:
        key = f"p/s/{which}"
        entry = keys.key(key)
        node = keys.find(entry)
        if node < 0:
            idle = [each for each, count in inflight.items() if not count]
            if len(inflight) == CHAIN and not idle:
                with pytest.raises(NoRoom):
                    keys.create(entry, limit, 0.0, [])
                journal.rollback()
                continue
            node = keys.create(entry, limit, 0.0, [])
            if len(inflight) == CHAIN:
                (gone,) = set(inflight) - {key for _, key in map(keys.view, keys.in_use())}
                assert gone in idle
                del inflight[gone]
        else:
            keys.touch(node, limit, 0.0, [])
        inflight[key] = int(busy)
        U32.pack_into(mm, layout.nodes_off + node * layout.node_size + N_INFLIGHT, int(busy))
        journal.commit()
        assert {key: view.inflight for view, key in map(keys.view, keys.in_use())} == inflight


# --- the undo journal against kills -----------------------------------------------------


def _sizes() -> dict[str, int]:
    return {"size": 64, "leases": 64, "procs": 8, "windows": 64}


def _outside_journal(path: Path, layout: Layout) -> bytes:
    data = path.read_bytes()[: layout.total]
    return data[: layout.journal_off] + data[layout.journal_off + layout.journal :]


def _writes(seed: int, layout: Layout) -> list[tuple[int, bytes]]:
    """Random writes anywhere an update may write: the header's counters (garbage
    included), the regions after the header, not the journal; overlapping now and then."""
    rng = random.Random(seed)
    regions = [
        (MUT_START, MUT_END),
        (HEADER, layout.journal_off),
        (layout.journal_off + layout.journal, min(layout.total, layout.chunks_off + 3 * 4096)),
    ]
    found = []
    for _ in range(rng.randint(1, 12)):
        low, high = rng.choice(regions)
        length = rng.randint(1, min(300, high - low))
        offset = rng.randint(low, high - length)
        found.append((offset, rng.randbytes(length)))
    return found


def _fork(target: Callable[[], object]) -> int:
    """Run ``target`` in a forked child (which is to SIGKILL itself); the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            target()
        finally:
            os._exit(1)
    return pid


def _wait_killed(pid: int) -> None:
    """Wait for a child forked by :func:`_fork`: it must have died of SIGKILL."""
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _update_then_die(path: Path, seed: int, kill_at: int) -> None:
    """In a forked child: start an update of random writes, each journaled first, and
    SIGKILL this process at line ``kill_at`` run in journal.py (or after the last write,
    before the commit)."""
    backend = SharedBackend(path, **_sizes())
    layout = backend._layout
    assert layout is not None
    writes = _writes(seed, layout)
    journal_file = sys.modules[Journal.__module__].__file__
    lines = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        if frame.f_code.co_filename != journal_file:
            return None
        if event == "line":
            lines += 1
            if lines >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    with backend._transaction as mm:  # never left: the process dies inside
        sys.settrace(tracer)
        for offset, data in writes:
            backend._journal.save(offset, len(data))
            mm[offset : offset + len(data)] = data
        sys.settrace(None)
        os.kill(os.getpid(), signal.SIGKILL)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.integers(0, 2**32), st.integers(1, 400))
def test_a_kill_anywhere_in_an_update_is_rolled_back_exactly(
    tmp_path: Path, seed: int, kill_at: int
) -> None:
    """A process SIGKILLed at any line of the journal's code (or after its last write,
    before the commit) leaves a table that the next process to open it rolls back to
    exactly the bytes it held before the update, journal aside."""
    path = tmp_path / f"kill-{seed}-{kill_at}.shm"
    first = SharedBackend(path, **_sizes())
    layout = first._layout
    assert layout is not None
    first.close()
    before = _outside_journal(path, layout)
    _wait_killed(_fork(lambda: _update_then_die(path, seed, kill_at)))
    after_kill = _outside_journal(path, layout)
    assert len(after_kill) == len(before)
    reopened = SharedBackend(path, **_sizes())  # the next process: it recovers on attach
    reopened.close()
    assert U32.unpack_from(path.read_bytes(), H_JLEN)[0] == 0
    assert _outside_journal(path, layout) == before
    path.unlink()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_a_rolled_back_update_leaves_the_before_image(seed: int, commit: bool) -> None:
    """Random journaled writes then a rollback give back every byte as it was; after a
    commit they all stay."""
    mm, layout, journal = table()
    rng = random.Random(seed)
    mm[MUT_START : layout.journal_off] = rng.randbytes(layout.journal_off - MUT_START)
    before = mm[: layout.journal_off]
    writes = _writes(seed, layout)
    for offset, data in writes:
        journal.save(offset, len(data))
        mm[offset : offset + len(data)] = data
    if commit:
        journal.commit()
        after = bytearray(before)
        for offset, data in writes:
            if offset + len(data) <= layout.journal_off:
                after[offset : offset + len(data)] = data
        assert mm[: layout.journal_off] == bytes(after)
    else:
        journal.rollback()
        assert mm[: layout.journal_off] == before
    assert U32.unpack_from(mm, H_JLEN)[0] == 0


def _admit_then_die_in_check_word(path: Path, ready: int, go: int) -> None:
    """In a forked child: admit a rate-limited request (its window needs a new chunk) and
    SIGKILL this process between writing the window chunk counters and their check
    word."""
    backend = SharedBackend(path, build_config(_RATED), **_sizes())
    code = Windows._set_counters.__code__
    check_line = next(
        number
        for number, text in enumerate(inspect.getsource(code).splitlines(), code.co_firstlineno)
        if "H_CHUNK_CHECK" in text
    )

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno == check_line:
            os.kill(os.getpid(), signal.SIGKILL)
        return tracer

    slots = _rated_slots()
    # Registered first (a committed update of its own), so that the parent's image of
    # the table is taken with this process in it.
    with backend._transaction:
        backend._procs.register()
        backend._journal.commit()
    os.write(ready, b"r")
    os.read(go, 1)
    sys.settrace(tracer)
    backend.acquire(slots, 1.0)
    sys.settrace(None)


_RATED: dict[str, Any] = {"project": "p", "limits": {"p": {"rate": "10/minute"}}}


def _rated_slots() -> list[Slot]:
    limit = build_config(_RATED).limits["p"]
    return [Slot("p", limit, True)]


def test_a_kill_between_the_chunk_counters_and_their_check_word_is_rolled_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A process killed after writing the window chunk counters but before their check
    word leaves a table the next process to open it rolls back (a WARNING), not one it
    takes for damaged and re-creates (which would forget every count): the counters are
    checked once the journal is undone."""
    path = tmp_path / "check-word.shm"
    first = SharedBackend(path, build_config(_RATED), **_sizes())
    # A chunk's worth of entries: the child's admission needs a new chunk.
    for _ in range(CHUNK_STAMPS):
        assert isinstance(first.acquire(_rated_slots(), 0.5), Grant)
    layout = first._layout
    assert layout is not None
    first.close()
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = _fork(lambda: _admit_then_die_in_check_word(path, ready_w, go_r))
    assert os.read(ready_r, 1) == b"r"
    before = _outside_journal(path, layout)
    os.write(go_w, b"g")
    for fd in (ready_r, ready_w, go_r, go_w):
        os.close(fd)
    _wait_killed(pid)
    assert U32.unpack_from(path.read_bytes(), H_JLEN)[0] != 0  # killed inside the update
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        reopened = SharedBackend(path, build_config(_RATED), **_sizes())
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert "rolled back" in caplog.text
    assert _outside_journal(path, layout) == before
    # The first process's admissions are all still counted.
    totals = reopened.totals([build_config(_RATED).limits["p"]], 1.0)
    assert totals["p"].top[0].used == CHUNK_STAMPS
    reopened.close()


@pytest.mark.parametrize(
    ("length", "self_linked"),
    [(0xFFFFFFFF, True), (3 * CHUNK_STAMPS + 1, True), (CHUNK_STAMPS + 1, False)],
    ids=["4e9 entries in a loop", "more entries than 3 chunks hold", "a link past the chunks"],
)
def test_a_window_no_table_holds_is_damage_not_a_walk(length: int, self_linked: bool) -> None:
    """Garbage in a rate window's node (an entry count no table holds, a chunk linked to
    itself or to no chunk): purging, reading or summing it raises Damaged (the table is
    re-created) at once, instead of walking it for hours under the file lock. (A loop
    within the entries the table holds is walked: bounded, and wrong counts at worst.)"""
    mm, layout, journal = table(chunks=3, registry=1)
    windows = Windows(mm, layout, journal)
    _fresh_node(mm, layout, 0)
    for stamp in range(CHUNK_STAMPS + 2):  # two chunks
        windows.append(0, float(stamp), 1000.0)
    journal.commit()
    offset = layout.nodes_off
    first = U32.unpack_from(mm, offset + N_FIRST)[0]
    U32.pack_into(mm, offset + N_LEN, length)
    link = first if self_linked else layout.chunks + 7
    U32.pack_into(mm, layout.chunks_off + first * CHUNK_SIZE, link)
    for read in (
        lambda: windows.purge(0, 1e9),
        lambda: windows.stamps(0),
        lambda: windows.usage(0, 1e9),
    ):
        with pytest.raises(Damaged):
            read()
