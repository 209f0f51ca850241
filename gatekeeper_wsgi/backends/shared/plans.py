"""The per-request path of a shared table: admissions and releases that touch only the
bytes they change, at offsets worked out before.

Every process of a host queues for the one file lock, so what happens under it caps the
host's admissions per second (``benchmarks/shared.py``). A general admission looks each
key up, walks its LRU list and window, and saves what it may change as it goes. Once one
has admitted a tuple of slots, :meth:`Plans.look` reads and :meth:`Plans.remember` keeps
(once the lock is let go) its :class:`Plan`: the nodes
it counted on, their offsets, what each limit checks, the journal entries an admission of
it saves. While the table's key generation (``H_KEYGEN``, raised before any key leaves its
node) is unchanged the nodes still hold those keys, so the next admission of that tuple
(:meth:`Plans.admit`) is one read of the header, one of each node, one journal write of
the node heads, the header's lease counters and the lease, and the writes themselves.

A key with steady traffic has a window entry to expire on nearly every admission once its
first window has passed, and a new window chunk to take on every seventh: the plan drops
the expired entries of the first chunk, frees that chunk when all of its entries expired
and the next chunk's first one stays, and links a new last chunk (off the free list or
never used), saving each chunk link it changes first; any other expiry or a chunk that
is not at hand (or an empty window's first) goes to the windows' own purge and append, in
the same update. Whatever is not that plain case (a limit full or shadowed, a key to move
in its LRU list, a delayed release due, a queue with waiters, an adaptive limit, a lease
table that looks damaged) answers None before anything is written, and the general path
decides, under the same lock. A plan is never trusted past its map: a re-created table is
a new map with new plans.

:class:`Plans` works on the map, the layout and the journal it is given, nothing else:
it can be driven alone.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

from gatekeeper_wsgi.backends.shared.faults import NoRoom
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK, Journal, Saving, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    CHUNK_SIZE,
    CHUNK_STAMPS,
    H_HEAP_LEN,
    H_KEYGEN,
    H_LIVE,
    H_WAITING,
    HOT_HEADER,
    KEYGEN,
    LEASE,
    LEASE_COUNTERS,
    LEASE_HEAD,
    LEASE_SIZE,
    MAX_REFS,
    N_OFFSET,
    N_REG,
    NIL,
    NODE_HEAD,
    U32,
    Layout,
)
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.values import Slot

__all__ = ["Check", "Found", "Plan", "Plans"]

#: how many plans a map keeps (one per tuple of slots: a route and caller)
PLANS_CAP = 4096
#: the u32 fields of a node, as indexes from its first u32 (offsets N_FIRST ... N_NEXT / 4)
_FIRST, _LAST, _LEN, _REG, _NEXT = 2, 3, 4, 5, 7
#: f64s per window chunk
CHUNK_F64 = CHUNK_SIZE // 8
#: the f64 of a node when its window is empty, from its first f64 (N_IDLE / 8)
_IDLE = 4
#: the u32 fields of a lease (pid, serial, the first node or next free lease)
_PID, _SERIAL, _REFS = 0, 1, 5
#: header fields as u32 indexes: live leases, first free lease, delay heap entries,
#: queue waiters
_LIVE, _FREE, _HEAP, _WAITING = H_LIVE // 4, (H_LIVE + 4) // 4, H_HEAP_LEN // 4, H_WAITING // 4

#: a lease as a plan writes it: pid, serial, and the rest as the plan packed it
_LEASE_BY_PLAN = struct.Struct(f"<II{LEASE_SIZE - LEASE_HEAD.size}s")

#: per slot of a plan: node, its offset, the concurrency limit (None: none), the registry
#: entry + 1 its wildcard key must still be the newest key of (0: not wildcard), the
#: rate window's seconds (None: no rate), the rate limit
Check = tuple[int, int, int | None, int, float | None, int]
#: what a plan is made of: the key generation its nodes were found under, the checks
Found = tuple[int, tuple[Check, ...]]


class Plan:
    """What an admission of one tuple of slots counts on (:data:`Check` per slot, and
    the same sorted by what is checked), the journal entries of its node heads, and the
    key generation its nodes were found under."""

    __slots__ = (
        "blank",
        "checks",
        "counts",
        "gen",
        "limited",
        "listed",
        "mm",
        "nodes",
        "offsets",
        "plain",
        "rated",
        "saving",
        "slots",
        "stamped",
        "tail",
    )

    def __init__(
        self, mm: mmap.mmap, slots: Sequence[Slot], gen: int, checks: tuple[Check, ...]
    ) -> None:
        #: the map it was made on: a plan is worth nothing on another
        self.mm = mm
        self.slots = slots
        self.gen = gen
        self.checks = checks
        self.nodes = [check[0] for check in checks]
        self.offsets = tuple(check[1] for check in checks)
        #: the u32 index of each node's count (its first field)
        self.counts = tuple(offset >> 2 for offset in self.offsets)
        #: (count's index, concurrency limit) of the slots with one
        self.limited = tuple(
            (offset >> 2, limit) for _, offset, limit, _, _, _ in checks if limit is not None
        )
        #: (node's u32 index, registry entry + 1) of the wildcard slots
        self.listed = tuple(
            (offset >> 2, registry) for _, offset, _, registry, _, _ in checks if registry
        )
        #: (node, its u32 index, window seconds, rate limit) of the slots with a rate
        self.rated = tuple(
            (node, offset >> 2, seconds, most)
            for node, offset, _, _, seconds, most in checks
            if seconds is not None
        )
        #: a grant's window stamps: None but at the rated slots' indexes (``now`` there)
        self.blank: tuple[None, ...] = (None,) * len(checks)
        self.stamped = tuple(index for index, check in enumerate(checks) if check[4] is not None)
        #: what an admission or release of it saves first: the node heads, the header's
        #: mutable block (and the lease, whichever it is)
        self.saving = Saving(
            [*((offset, NODE_HEAD) for offset in self.offsets), HEADER_BLOCK], LEASE_SIZE
        )
        #: the lease's fields after its pid and serial (held: no expiry; the nodes, padded),
        #: packed once: a struct call with ten fields costs three times one with three
        self.tail = LEASE.pack(
            0, 0, 0.0, len(self.nodes), *self.nodes, *(0,) * (MAX_REFS - len(self.nodes))
        )[LEASE_HEAD.size :]
        #: whether a release never gives a window entry back (no ``count`` statuses)
        self.plain = all(slot.limit.count is None or slot.limit.rate is None for slot in slots)


class Plans(Structure):
    """The plans of one mapped table, and the admissions and releases made by them. It
    reads and writes single fields through u32 and f64 views of the map (a quarter of
    what ``struct`` calls cost): :meth:`close` lets them go before the map is closed."""

    __slots__ = (
        "_by_slots",
        "_capacity",
        "_chunk_base",
        "_chunks",
        "_f64",
        "_heap_at",
        "_leases_off",
        "_u32",
        "_whole",
        "_windows",
    )

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal, windows: Windows) -> None:
        super().__init__(mm, layout, journal)
        self._windows = windows
        self._leases_off = layout.leases_off
        #: f64 index of the delay heap's first expiry, of the first chunk's first entry
        self._heap_at = layout.heap_off >> 3
        self._chunk_base = (layout.chunks_off + 8) >> 3
        self._chunks = layout.chunks
        self._capacity = layout.leases
        #: whether every node's fields fall on whole u32s and f64s of the views: the
        #: regions start at multiples of 64 and this version sizes keys by 8 bytes, but
        #: the key size comes from the file's header (a file made otherwise gets no plan)
        self._whole = layout.node_size % 8 == 0
        self._u32 = memoryview(mm).cast("I")
        self._f64 = memoryview(mm).cast("d")
        #: id(slots) -> its plan (which keeps the slots alive, so the id is not reused)
        self._by_slots: dict[int, Plan] = {}

    def close(self) -> None:
        """Let the views of the map go, its own and its journal's (the map cannot be
        closed while they are held)."""
        self._u32.release()
        self._f64.release()
        self._journal.close()
        self._by_slots = {}

    def find(self, slots: Sequence[Slot]) -> Plan | None:
        """The plan of ``slots`` (this very tuple), None if there is none. No lock needed:
        :meth:`admit` checks it against the table."""
        plan = self._by_slots.get(id(slots))
        return plan if plan is not None and plan.slots is slots else None

    def look(self, slots: Sequence[Slot], nodes: Sequence[int]) -> Found | None:
        """What a plan of ``slots``, just admitted by the general path on ``nodes``, counts
        on, read under the lock before anything else changes it: the key generation and
        the checks (:meth:`remember` makes the plan of them once the lock is let go).
        None (no plan) when one of its limits is adaptive, or the nodes are not aligned
        for the views."""
        if not self._whole:
            return None
        mm = self._mm
        nodes_off, node_size = self._nodes_off, self._node_size
        checks: list[Check] = []
        for (_, limit, _), node in zip(slots, nodes, strict=True):
            if limit.adaptive is not None:
                return None
            offset = nodes_off + node * node_size
            registry = U32.unpack_from(mm, offset + N_REG)[0] if limit.wildcard else 0
            rate = limit.rate
            if rate is None:
                checks.append((node, offset, limit.concurrency, registry, None, 0))
            else:
                checks.append((node, offset, limit.concurrency, registry, rate.seconds, rate.limit))
        return KEYGEN.unpack_from(mm, H_KEYGEN)[0], tuple(checks)

    def remember(self, slots: Sequence[Slot], found: Found) -> Plan:
        """Keep the plan of ``slots`` made of what :meth:`look` found (no lock needed:
        :meth:`admit` checks the plan against the table)."""
        plan = Plan(self._mm, slots, *found)
        if len(self._by_slots) >= PLANS_CAP:
            self._by_slots = {}
        self._by_slots[id(slots)] = plan
        return plan

    def admit(self, plan: Plan, now: float, pid: int, slot_at: int) -> tuple[int, int] | None:
        """Admit by ``plan`` at ``now`` for process ``pid`` (registered in the process
        slot at ``slot_at``, -1: not yet): (lease, serial), committed; None, with nothing
        changed, when the general path must decide. Under the lock."""
        mm = self._mm
        u32 = self._u32
        if plan.mm is not mm or slot_at < 0 or u32[slot_at >> 2] != pid:
            return None  # made on another map, or this process must register (again)
        live, free, high, heap, serial, waiting, gen = HOT_HEADER.unpack_from(mm, H_LIVE)
        if gen != plan.gen or waiting or high > self._capacity:
            return None
        f64 = self._f64
        if heap and f64[self._heap_at] <= now:
            return None  # a delayed release is due: the general path matures it first
        for index, most in plan.limited:
            if u32[index] >= most:
                return None
        for index, registry in plan.listed:
            if u32[index + _REG] != registry or u32[index + _NEXT] != NIL:
                return None  # not the newest key of its limit's LRU list: moved there first
        if free != NIL:
            if free >= high:
                return None  # out of range: the general path finds the damage
            lease = free
            mark = high
        elif high < self._capacity:
            lease = high
            mark = high + 1
        else:
            return None  # every lease held: the general path refuses
        at = self._leases_off + lease * LEASE_SIZE
        if u32[(at >> 2) + _SERIAL]:
            return None  # a free lease in use: damage, which the general path names
        after = NIL if mark > high else u32[(at >> 2) + _REFS]
        journal = self._journal
        # Saved before the windows are looked at, so that each is written as soon as it
        # is found to have room (nearly always), in one pass; a full one gives the
        # update up, its saves dropped or what an earlier window took undone.
        journal.save_first(plan.saving, at)
        chunk_base = self._chunk_base
        written = False
        for node, index, seconds, most in plan.rated:
            length = u32[index + _LEN]
            position = 0
            expired = False
            start = -1  # the window's new first entry, when some expire within its chunk
            following = NIL  # the window's new first chunk, when its first one expired
            if length:
                oldest = chunk_base + u32[index + _FIRST] * CHUNK_F64
                first = mm[(index << 2) + N_OFFSET]
                cutoff = now - seconds
                if f64[oldest + first] <= cutoff:
                    # Entries to expire first, which a key with steady traffic has on
                    # nearly every admission once its first window has passed. Those of
                    # the first chunk are dropped here, and the chunk itself when the
                    # next one's first entry stays; the rest (more chunks to free, the
                    # window emptied) are the windows' own purge, in this update.
                    start = first + 1
                    while start < CHUNK_STAMPS and f64[oldest + start] <= cutoff:
                        start += 1
                    length -= start - first
                    if start == CHUNK_STAMPS and length > 0:
                        following = u32[(oldest - 1) << 1]  # the first chunk's link
                        if following >= self._chunks or (
                            f64[chunk_base + following * CHUNK_F64] <= cutoff
                        ):
                            following = NIL
                        else:
                            start = 0
                    if following == NIL and (start == CHUNK_STAMPS or length <= 0):
                        expired = True
                        start = -1
                    elif length >= most:
                        self._give_up(written)
                        return None  # still full: the general path refuses
                    else:
                        position = (start + length) % CHUNK_STAMPS
                elif length >= most:
                    self._give_up(written)
                    return None  # full: the general path refuses
                else:
                    position = (first + length) % CHUNK_STAMPS
            written = True
            if following != NIL:  # the first chunk expired whole: back to the free list
                self._free_first(index, following)
            if start >= 0:  # entries expired within the first chunk (its head is saved)
                mm[(index << 2) + N_OFFSET] = start
                u32[index + _LEN] = length
            if position:
                # The slot past the last entry is free space: no journal entry needed.
                f64[chunk_base + u32[index + _LAST] * CHUNK_F64 + position] = now
            else:
                try:
                    if expired or not length:  # a first chunk: the windows' own append
                        if expired and self._windows.purge(node, now - seconds)[0] >= most:
                            journal.rollback()
                            return None  # still full: the general path refuses
                        self._windows.append(node, now, seconds)
                        continue
                    # A new last chunk, its link NIL: the entry goes first in it.
                    last = self._windows.link_new(u32[index + _LAST], now)
                except NoRoom:
                    journal.rollback()
                    return None  # no chunk left: the general path reclaims or refuses
                u32[index + _LAST] = last
                f64[chunk_base + last * CHUNK_F64] = now
            u32[index + _LEN] = length + 1
            idle = (index >> 1) + _IDLE
            if f64[idle] < now + seconds:
                f64[idle] = now + seconds
        for index in plan.counts:
            u32[index] += 1
        serial = serial % 0xFFFFFFFF + 1
        LEASE_COUNTERS.pack_into(mm, H_LIVE, live + 1, after, mark, heap, serial)
        _LEASE_BY_PLAN.pack_into(mm, at, pid, serial, plan.tail)
        journal.commit()
        return lease, serial

    def _give_up(self, written: bool) -> None:
        """Leave an admission by plan to the general path after its first save: what it
        wrote is rolled back; if nothing, the saves are only dropped (the commit of an
        update that changed nothing, cheaper than writing the same bytes back)."""
        if written:
            self._journal.rollback()
        else:
            self._journal.commit()

    def _free_first(self, index: int, following: int) -> None:
        """Put the first window chunk of the node at u32 ``index``, all its entries
        expired, on the free list; ``following`` becomes the window's first chunk. Its
        node head is saved already (:attr:`Plan.saving`)."""
        u32 = self._u32
        chunk = u32[index + _FIRST]
        self._windows.free_chunks(chunk, chunk)
        u32[index + _FIRST] = following

    def release(self, plan: Plan, lease: int, pid: int, serial: int) -> bool:
        """Give back the slots of ``lease``, admitted by ``plan`` as (``pid``, ``serial``),
        and commit; nothing if the lease was reclaimed meanwhile. Whether delayed
        releases or queue waiters are pending (for the caller to see to). Under the lock."""
        u32 = self._u32
        pending = bool(u32[_HEAP] or u32[_WAITING])
        at = self._leases_off + lease * LEASE_SIZE
        index = at >> 2
        if u32[index + _SERIAL] != serial or u32[index + _PID] != pid:
            return pending  # reclaimed meanwhile (its owner was taken for dead)
        journal = self._journal
        journal.save_first(plan.saving, at)
        for count in plan.counts:
            inflight = u32[count]
            if inflight:
                u32[count] = inflight - 1
        u32[index + _PID] = u32[index + _SERIAL] = 0
        u32[index + _REFS] = u32[_FREE]
        u32[_FREE] = lease
        live = u32[_LIVE]
        if live:
            u32[_LIVE] = live - 1
        journal.commit()
        return pending
