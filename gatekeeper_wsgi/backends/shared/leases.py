"""The lease table and the delay heap of a shared table.

Each admission holds a lease (layout: ``leases``, ``L x 40`` bytes): owner pid, serial
(0: free), expiry (0: held by its owner), the nodes whose counts it holds. A release frees
it (the nodes' in-flight counts drop, the lease goes on the free list through its first
node field); a delayed decrease makes it ownerless with an expiry and pushes
``(expiry, lease, serial)`` on the binary min-heap that follows the lease table, and
:meth:`Leases.mature` frees those that are due. The header's counters (live leases, free
list, bump mark, heap length, last serial) are in its journaled mutable block.

:class:`Leases` works on the map, the layout and the journal it is given, nothing else:
it can be driven alone (``tests/test_shared_structures.py``).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK, Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    F64,
    H_HEAP_LEN,
    H_LEASE_FREE,
    H_LEASE_HIGH,
    H_LIVE,
    H_SERIAL,
    HEAP,
    HEAP_SIZE,
    L_COUNT,
    L_EXPIRY,
    L_REFS,
    LEASE,
    LEASE_COUNTERS,
    LEASE_HEAD,
    LEASE_NODES,
    LEASE_SIZE,
    MAX_REFS,
    NIL,
    NODE_HEAD,
    U32,
    Layout,
)


class Leases(Structure):
    """The leases and delayed releases of one mapped table."""

    __slots__ = ("_base", "_capacity", "_heap")

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal) -> None:
        super().__init__(mm, layout, journal)
        self._base = layout.leases_off
        self._heap = layout.heap_off
        self._capacity = layout.leases

    # --- the lease table ------------------------------------------------------------------

    def new(self, pid: int, nodes: list[int]) -> tuple[int, int]:
        """(lease, serial) of a new lease of ``pid`` holding ``nodes`` (their counts are
        the caller's to raise). :class:`NoRoom` when every lease is held."""
        mm = self._mm
        live, free, high, _, serial = LEASE_COUNTERS.unpack_from(mm, H_LIVE)
        if high > self._capacity or (free != NIL and free >= high):
            raise Damaged("its lease counters are out of range")
        self._journal.save_header()
        if free != NIL:
            lease = free
            at = self._base + lease * LEASE_SIZE
            if LEASE_HEAD.unpack_from(mm, at)[1]:
                raise Damaged("its list of free leases holds a lease in use")
            self._save(at, LEASE_SIZE)
            U32.pack_into(mm, H_LEASE_FREE, U32.unpack_from(mm, at + L_REFS)[0])
        elif high < self._capacity:
            lease = high
            # Leases past the mark have never been written since the table was created.
            at = self._base + lease * LEASE_SIZE
            if LEASE_HEAD.unpack_from(mm, at)[1]:
                raise Damaged("its lease mark is below a lease in use")
            # Saved too: an update rolled back (a peek, a kill before the commit) lowers
            # the mark again, and must leave the lease past it unwritten, as that check
            # expects (it used to keep the lease's serial and so re-create the table).
            self._save(at, LEASE_SIZE)
            U32.pack_into(mm, H_LEASE_HIGH, high + 1)
        else:
            raise NoRoom(
                f"all {high} leases are held (one per request in flight on the host); give "
                f"the table more with ?leases=<n>",
                kind="concurrency",
            )
        serial = serial % 0xFFFFFFFF + 1
        U32.pack_into(mm, H_SERIAL, serial)
        U32.pack_into(mm, H_LIVE, live + 1)
        refs = (*nodes, *(0,) * (MAX_REFS - len(nodes)))
        LEASE.pack_into(mm, self._base + lease * LEASE_SIZE, pid, serial, 0.0, len(nodes), *refs)
        return lease, serial

    def holds(self, lease: int, pid: int, serial: int) -> bool:
        """Whether ``lease`` is still the one admitted as (``pid``, ``serial``): not
        reclaimed, freed or reused meanwhile."""
        at = self._base + lease * LEASE_SIZE
        held: bool = LEASE_HEAD.unpack_from(self._mm, at) == (pid, serial)
        return held

    def free(self, lease: int) -> None:
        """Give the lease's slots back and put it on the free list."""
        mm = self._mm
        at = self._base + lease * LEASE_SIZE
        count, *refs = LEASE_NODES.unpack_from(mm, at + L_COUNT)
        nodes_off, node_size = self._nodes_off, self._node_size
        offsets = [nodes_off + node * node_size for node in refs[:count]]
        ranges = [(offset, NODE_HEAD) for offset in offsets]
        ranges += (HEADER_BLOCK, (at, LEASE_SIZE))
        self._journal.save_all(ranges)
        for offset in offsets:
            inflight = U32.unpack_from(mm, offset)[0]
            U32.pack_into(mm, offset, inflight - 1 if inflight else 0)
        LEASE_HEAD.pack_into(mm, at, 0, 0)
        U32.pack_into(mm, at + L_REFS, U32.unpack_from(mm, H_LEASE_FREE)[0])
        U32.pack_into(mm, H_LEASE_FREE, lease)
        U32.pack_into(mm, H_LIVE, max(0, U32.unpack_from(mm, H_LIVE)[0] - 1))

    def delay(self, lease: int, serial: int, due: float) -> None:
        """Make a held lease ownerless until ``due`` (a delayed decrease): its slots stay
        counted until :meth:`mature` frees it."""
        mm = self._mm
        at = self._base + lease * LEASE_SIZE
        self._save(at, LEASE_SIZE)
        U32.pack_into(mm, at, 0)
        F64.pack_into(mm, at + L_EXPIRY, due)
        self.push(due, lease, serial)

    def _high(self) -> int:
        """Leases ever used (the bump mark), bounded by the table."""
        high: int = U32.unpack_from(self._mm, H_LEASE_HIGH)[0]
        return min(high, self._capacity)

    def _used(self) -> Iterator[tuple[int, int, int, tuple[int, ...]]]:
        """(lease, owner pid, serial, nodes) of every lease in use."""
        mm = self._mm
        high = self._high()
        leases = mm[self._base : self._base + high * LEASE_SIZE]
        for lease, (pid, serial, _, count, *refs) in enumerate(LEASE.iter_unpack(leases)):
            if serial:
                yield lease, pid, serial, tuple(refs[:count])

    def reclaim(self, pid: int) -> int:
        """Free the leases ``pid`` holds (not its delayed ones: those are ownerless), each
        in its own committed update; how many there were."""
        owned = [lease for lease, owner, _, _ in self._used() if owner == pid]
        for lease in owned:
            self.free(lease)
            self._journal.commit()
        return len(owned)

    def live(self) -> int:
        """Leases in use, counted from the table (not the header's count: garbage that made
        it too high would otherwise keep a table too small forever)."""
        return sum(1 for _ in self._used())

    def counted(self) -> int:
        """Leases in use as the header counts them: one read, for a choice that needs no
        exact count (:meth:`live` counts them from the table)."""
        counted: int = U32.unpack_from(self._mm, H_LIVE)[0]
        return counted

    def held_nodes(self) -> set[int]:
        """Every node a lease in use (held or delayed) counts on."""
        if U32.unpack_from(self._mm, H_LEASE_HIGH)[0] > self._capacity:
            raise Damaged("its lease counters are out of range")
        held: set[int] = set()
        for _, _, _, nodes in self._used():
            held.update(nodes)
        return held

    # --- the delay heap: (expiry, lease, serial), a binary min-heap by expiry ------------

    def pending(self) -> int:
        """Delayed releases not matured yet."""
        pending: int = U32.unpack_from(self._mm, H_HEAP_LEN)[0]
        return pending

    def next_due(self) -> float | None:
        """When the earliest delayed release matures, None if there is none."""
        if U32.unpack_from(self._mm, H_HEAP_LEN)[0]:
            due: float = F64.unpack_from(self._mm, self._heap)[0]
            return due
        return None

    def push(self, due: float, lease: int, serial: int) -> None:
        mm = self._mm
        base = self._heap
        save = self._save
        size = U32.unpack_from(mm, H_HEAP_LEN)[0]
        if size >= self._capacity:
            raise Damaged("its delay heap is longer than its leases")
        position = size
        while position:
            parent = (position - 1) >> 1
            entry = HEAP.unpack_from(mm, base + parent * HEAP_SIZE)
            if entry[0] <= due:
                break
            save(base + position * HEAP_SIZE, HEAP_SIZE)
            HEAP.pack_into(mm, base + position * HEAP_SIZE, *entry)
            position = parent
        save(base + position * HEAP_SIZE, HEAP_SIZE)
        HEAP.pack_into(mm, base + position * HEAP_SIZE, due, lease, serial)
        self._journal.save_header()
        U32.pack_into(mm, H_HEAP_LEN, size + 1)

    def pop(self) -> tuple[float, int, int]:
        """Take the earliest (expiry, lease, serial) off the heap (it holds one)."""
        mm = self._mm
        base = self._heap
        save = self._save
        size = U32.unpack_from(mm, H_HEAP_LEN)[0] - 1
        top: tuple[float, int, int] = HEAP.unpack_from(mm, base)
        _, lease, serial = top
        if size >= self._capacity or lease >= self._capacity or not serial:
            # Serial 0 marks a free lease: freeing one again would count its old slots
            # down twice (a heap length grown by garbage reads such entries).
            raise Damaged("its delay heap is out of range")
        self._journal.save_header()
        U32.pack_into(mm, H_HEAP_LEN, size)
        if size:
            last = HEAP.unpack_from(mm, base + size * HEAP_SIZE)
            position = 0
            while True:
                child = 2 * position + 1
                if child >= size:
                    break
                entry = HEAP.unpack_from(mm, base + child * HEAP_SIZE)
                if child + 1 < size:
                    right = HEAP.unpack_from(mm, base + (child + 1) * HEAP_SIZE)
                    if right[0] < entry[0]:
                        child, entry = child + 1, right
                if entry[0] >= last[0]:
                    break
                save(base + position * HEAP_SIZE, HEAP_SIZE)
                HEAP.pack_into(mm, base + position * HEAP_SIZE, *entry)
                position = child
            save(base + position * HEAP_SIZE, HEAP_SIZE)
            HEAP.pack_into(mm, base + position * HEAP_SIZE, *last)
        return top

    def due(self, now: float) -> bool:
        """Whether a delayed release is due at ``now`` (two reads: on every call)."""
        mm = self._mm
        return (
            bool(U32.unpack_from(mm, H_HEAP_LEN)[0]) and F64.unpack_from(mm, self._heap)[0] <= now
        )

    def mature(self, now: float) -> None:
        """Free the delayed releases due at ``now``; each one is its own committed update."""
        mm = self._mm
        base = self._base
        while self.due(now):
            _, lease, serial = self.pop()
            if LEASE_HEAD.unpack_from(mm, base + lease * LEASE_SIZE) == (0, serial):
                self.free(lease)
            self._journal.commit()

    def soonest(self, node: int, now: float) -> float:
        """Seconds until a delayed release holding ``node`` matures; 0 when none does
        (a request in flight may finish at any moment)."""
        mm = self._mm
        soonest = None
        for position in range(min(U32.unpack_from(mm, H_HEAP_LEN)[0], self._capacity)):
            due, lease, serial = HEAP.unpack_from(mm, self._heap + position * HEAP_SIZE)
            _, held, _, count, *refs = LEASE.unpack_from(mm, self._base + lease * LEASE_SIZE)
            if held == serial and node in refs[:count]:
                soonest = due if soonest is None else min(soonest, due)
        return 0.0 if soonest is None else max(0.0, soonest - now)
