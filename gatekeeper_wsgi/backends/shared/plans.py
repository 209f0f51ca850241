"""The per-request path of a shared table: admissions and releases that touch only the
bytes they change, at offsets worked out before.

Every process of a host queues for the one file lock, so what happens under it caps the
host's admissions per second (``benchmarks/shared.py``). A general admission looks each
key up, walks its LRU list and window, and saves what it may change as it goes. Once one
has admitted a tuple of slots, :meth:`Plans.remember` keeps its :class:`Plan`: the nodes
it counted on, their offsets, what each limit checks, the journal entries an admission of
it saves. While the table's key generation (``H_KEYGEN``, raised before any key leaves its
node) is unchanged the nodes still hold those keys, so the next admission of that tuple
(:meth:`Plans.admit`) is one read of the header, one of each node, one journal write of
the node heads, the header's lease counters and the lease, and the writes themselves.

Whatever is not that plain case (a limit full or shadowed, a window to purge or a new
window chunk to take, a key to move in its LRU list, a delayed release due, a queue with
waiters, an adaptive limit, a lease table that looks damaged) answers None before
anything is written, and the general path decides, under the same lock. A plan is never
trusted past its map: a re-created table is a new map with new plans.

:class:`Plans` works on the map, the layout and the journal it is given, nothing else:
it can be driven alone.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

from gatekeeper_wsgi.backends.shared.faults import NoRoom
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK, Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    CHUNK_SIZE,
    CHUNK_STAMPS,
    F64,
    H_KEYGEN,
    H_LIVE,
    HOT_HEADER,
    JENTRY,
    KEYGEN,
    L_REFS,
    LEASE,
    LEASE_COUNTERS,
    LEASE_HEAD,
    LEASE_SIZE,
    MAX_REFS,
    N_IDLE,
    N_LEN,
    N_REG,
    NIL,
    NODE,
    NODE_HEAD,
    U32,
    Layout,
)
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.values import Slot

__all__ = ["Plan", "Plans"]

#: at H_LIVE: live leases, first free lease
_LIVE_FREE = struct.Struct("<II")
#: how many plans a map keeps (one per tuple of slots: a route and caller)
PLANS_CAP = 4096


#: per slot of a plan: node, its offset, the concurrency limit (None: none), the registry
#: entry + 1 its wildcard key must still be the newest key of (0: not wildcard), the
#: rate window's seconds (None: no rate), the rate limit
Check = tuple[int, int, int | None, int, float | None, int]


class Plan:
    """What an admission of one tuple of slots counts on (:data:`Check` per slot), the
    journal entries of its node heads, and the key generation its nodes were found
    under."""

    __slots__ = (
        "checks",
        "gen",
        "heads",
        "mm",
        "nodes",
        "offsets",
        "plain",
        "refs",
        "saved",
        "slots",
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
        #: the packed (offset, length) of the node heads' journal entries
        self.heads = tuple(JENTRY.pack(offset, NODE_HEAD) for offset in self.offsets)
        #: what those entries and the header's block save (the journal's bookkeeping)
        self.saved = {**dict.fromkeys(self.offsets, NODE_HEAD), HEADER_BLOCK[0]: HEADER_BLOCK[1]}
        #: the lease's node fields, padded
        self.refs = (*self.nodes, *(0,) * (MAX_REFS - len(self.nodes)))
        #: whether a release never gives a window entry back (no ``count`` statuses)
        self.plain = all(slot.limit.count is None or slot.limit.rate is None for slot in slots)


class Plans(Structure):
    """The plans of one mapped table, and the admissions and releases made by them."""

    __slots__ = ("_by_slots", "_capacity", "_chunks_off", "_heap_off", "_leases_off", "_windows")

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal, windows: Windows) -> None:
        super().__init__(mm, layout, journal)
        self._windows = windows
        self._leases_off = layout.leases_off
        self._heap_off = layout.heap_off
        self._capacity = layout.leases
        self._chunks_off = layout.chunks_off
        #: id(slots) -> its plan (which keeps the slots alive, so the id is not reused)
        self._by_slots: dict[int, Plan] = {}

    def find(self, slots: Sequence[Slot]) -> Plan | None:
        """The plan of ``slots`` (this very tuple), None if there is none. No lock needed:
        :meth:`admit` checks it against the table."""
        plan = self._by_slots.get(id(slots))
        return plan if plan is not None and plan.slots is slots else None

    def remember(self, slots: Sequence[Slot], nodes: Sequence[int]) -> Plan | None:
        """Keep the plan of ``slots``, just admitted by the general path on ``nodes``
        (under the lock, before anything else changes them); None (and no plan) when one
        of its limits is adaptive."""
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
        plan = Plan(mm, slots, KEYGEN.unpack_from(mm, H_KEYGEN)[0], tuple(checks))
        if len(self._by_slots) >= PLANS_CAP:
            self._by_slots = {}
        self._by_slots[id(slots)] = plan
        return plan

    def admit(self, plan: Plan, now: float, pid: int, slot_at: int) -> tuple[int, int] | None:
        """Admit by ``plan`` at ``now`` for process ``pid`` (registered in the process
        slot at ``slot_at``, -1: not yet): (lease, serial), committed; None, with nothing
        written, when the general path must decide. Under the lock."""
        mm = self._mm
        if plan.mm is not mm or slot_at < 0 or U32.unpack_from(mm, slot_at)[0] != pid:
            return None  # made on another map, or this process must register (again)
        live, free, high, heap, serial, waiting, gen = HOT_HEADER.unpack_from(mm, H_LIVE)
        if gen != plan.gen or waiting or high > self._capacity:
            return None
        if heap and F64.unpack_from(mm, self._heap_off)[0] <= now:
            return None  # a delayed release is due: the general path matures it first
        chunks_off = self._chunks_off
        appends = []
        for node, offset, concurrency, registry, seconds, most in plan.checks:
            inflight, _, start, first, last, length, reg, _, newer, empty_at = NODE.unpack_from(
                mm, offset
            )
            if concurrency is not None and inflight >= concurrency:
                return None
            if registry and (reg != registry or newer != NIL):
                return None  # not the newest key of its limit's LRU list: moved there first
            if seconds is not None:
                if length:
                    if length >= most:
                        return None
                    oldest = chunks_off + first * CHUNK_SIZE + 8 + 8 * start
                    if F64.unpack_from(mm, oldest)[0] <= now - seconds:
                        return None  # entries to expire first
                appends.append((node, offset, start, last, length, empty_at, seconds))
        leases_off = self._leases_off
        if free != NIL:
            if free >= high:
                return None  # out of range: the general path finds the damage
            lease = free
            at = leases_off + lease * LEASE_SIZE
            if LEASE_HEAD.unpack_from(mm, at)[1]:
                return None  # a lease in use on the free list: damage too
            after = U32.unpack_from(mm, at + L_REFS)[0]
            mark = high
        elif high < self._capacity:
            lease = high
            at = leases_off + lease * LEASE_SIZE
            if LEASE_HEAD.unpack_from(mm, at)[1]:
                return None  # a lease past the mark in use: damage
            after = NIL
            mark = high + 1
        else:
            return None  # every lease held: the general path refuses
        journal = self._journal
        journal.save_first(plan.heads, plan.offsets, NODE_HEAD, plan.saved, at, LEASE_SIZE)
        for offset in plan.offsets:
            U32.pack_into(mm, offset, U32.unpack_from(mm, offset)[0] + 1)
        for node, offset, start, last, length, empty_at, seconds in appends:
            position = (start + length) % CHUNK_STAMPS
            if length and position:
                # The slot past the last entry is free space: no journal entry needed.
                F64.pack_into(mm, chunks_off + last * CHUNK_SIZE + 8 + 8 * position, now)
                U32.pack_into(mm, offset + N_LEN, length + 1)
                F64.pack_into(mm, offset + N_IDLE, max(empty_at, now + seconds))
                continue
            try:  # the window's first chunk, or a new one: the windows' own append
                self._windows.append(node, now, seconds)
            except NoRoom:
                journal.rollback()
                return None  # no chunk left: the general path reclaims or refuses
        serial = serial % 0xFFFFFFFF + 1
        LEASE_COUNTERS.pack_into(mm, H_LIVE, live + 1, after, mark, heap, serial)
        LEASE.pack_into(mm, at, pid, serial, 0.0, len(plan.nodes), *plan.refs)
        journal.commit()
        return lease, serial

    def release(self, plan: Plan, lease: int, pid: int, serial: int) -> None:
        """Give back the slots of ``lease``, admitted by ``plan`` as (``pid``, ``serial``),
        and commit; nothing if the lease was reclaimed meanwhile. Under the lock."""
        mm = self._mm
        at = self._leases_off + lease * LEASE_SIZE
        if LEASE_HEAD.unpack_from(mm, at) != (pid, serial):
            return  # reclaimed meanwhile (its owner was taken for dead)
        offsets = plan.offsets
        journal = self._journal
        journal.save_first(plan.heads, offsets, NODE_HEAD, plan.saved, at, LEASE_SIZE)
        for offset in offsets:
            inflight = U32.unpack_from(mm, offset)[0]
            U32.pack_into(mm, offset, inflight - 1 if inflight else 0)
        live, free = _LIVE_FREE.unpack_from(mm, H_LIVE)
        LEASE_HEAD.pack_into(mm, at, 0, 0)
        U32.pack_into(mm, at + L_REFS, free)
        _LIVE_FREE.pack_into(mm, H_LIVE, live - 1 if live else 0, lease)
        journal.commit()
