"""The rate windows of a shared table: an exact sliding log of admission times per key.

A key's log is a chain of window chunks (layout: ``W x 64`` bytes, each a link to the next
chunk of the same window and 7 admission times), oldest entry first; its node holds the
index of the oldest entry in the first chunk, the first and last chunk, the number of
entries and when the window is empty. Appending and expiring are O(1); memory follows the
entries actually held. Free chunks form a list through their link; the header keeps its
head and the bump mark (at 56 and 60) with a crc32 check word at 52, as in-range garbage
there would hand one chunk to two windows.

:class:`Windows` works on the map, the layout and the journal it is given, nothing else:
it can be driven alone (``tests/test_shared_structures.py``).
"""

from __future__ import annotations

import mmap
import struct

from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.journal import Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    CHUNK_FMT,
    CHUNK_SIZE,
    CHUNK_STAMPS,
    CHUNK_STAMPS_FMT,
    F64,
    H_CHUNK_CHECK,
    H_CHUNK_FREE,
    LRU_SCAN,
    MUT_END,
    N_FIRST,
    N_IDLE,
    N_LAST,
    N_LEN,
    N_OFFSET,
    NIL,
    NODE_HEAD,
    REG,
    REG_SIZE,
    U32,
    WINDOW,
    Layout,
    chunk_check,
    node_view,
)

#: the chunk counters at H_CHUNK_FREE: first free chunk, chunks ever used
CHUNK_COUNTERS = struct.Struct("<II")
#: at N_FIRST when a window is emptied: no first, no last chunk, no entries
EMPTY_WINDOW = struct.Struct("<III")


class Windows(Structure):
    """The sliding logs of the rate keys of one mapped table."""

    __slots__ = ("_chunks", "_chunks_off", "_entries", "_registry", "_registry_off")

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal) -> None:
        super().__init__(mm, layout, journal)
        self._chunks_off = layout.chunks_off
        self._chunks = layout.chunks
        #: the most entries all windows together can hold
        self._entries = layout.chunks * CHUNK_STAMPS
        self._registry_off = layout.registry_off
        self._registry = layout.registry

    def _window(self, offset: int) -> tuple[int, int, int, int]:
        """(start, first, last, length) of the window of the node at ``offset``; Damaged
        for a length no table holds or a chunk out of range: walked as it says, garbage
        there (a chunk linked to itself, ~4e9 entries) would keep the file lock, and every
        process of the host waiting for it, for hours."""
        start, first, last, length = WINDOW.unpack_from(self._mm, offset + N_OFFSET)
        if length and (
            length > self._entries
            or first >= self._chunks
            or last >= self._chunks
            or start >= CHUNK_STAMPS
        ):
            raise Damaged(f"a rate window says it holds {length} entries from chunk {first}")
        return start, first, last, length

    def _next(self, chunk: int) -> int:
        """The chunk after ``chunk`` in its window; Damaged if the link leads nowhere."""
        following: int = U32.unpack_from(self._mm, self._chunks_off + chunk * CHUNK_SIZE)[0]
        if following >= self._chunks:
            raise Damaged(f"a rate window's chunk {chunk} links to chunk {following}")
        return following

    def chunk_at(self, chunk: int) -> int:
        """The offset of window chunk ``chunk``."""
        return self._chunks_off + chunk * CHUNK_SIZE

    def purge(self, node: int, cutoff: float) -> tuple[int, float]:
        """Drop ``node``'s window entries at or before ``cutoff``; return (entries left,
        the oldest entry left, 0.0 if none)."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        start, first, last, length = self._window(offset)
        if not length:
            return 0, 0.0
        chunk = first
        chunks_off = self._chunks_off
        stamps = CHUNK_STAMPS_FMT.unpack_from(mm, chunks_off + chunk * CHUNK_SIZE + 8)
        left = length
        oldest: float = stamps[start]
        passed = NIL  # the last chunk wholly expired
        while oldest <= cutoff:
            left -= 1
            start += 1
            if not left:
                break
            if start == CHUNK_STAMPS:
                passed = chunk
                chunk, start = self._next(chunk), 0
                stamps = CHUNK_STAMPS_FMT.unpack_from(mm, chunks_off + chunk * CHUNK_SIZE + 8)
            oldest = stamps[start]
        if left == length:
            return left, oldest
        self._save(offset, NODE_HEAD)
        # Expired chunks go back as one chain: a journal entry or two, however many
        # thousand entries expired at once.
        if not left:
            self.free_chunks(first, last)
            self.clear(node)
            return 0, 0.0
        if passed != NIL:
            self.free_chunks(first, passed)
        mm[offset + N_OFFSET] = start
        U32.pack_into(mm, offset + N_FIRST, chunk)
        U32.pack_into(mm, offset + N_LEN, left)
        return left, oldest

    def clear(self, node: int) -> None:
        """Mark ``node``'s window empty (its chunks freed already, its node saved)."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        mm[offset + N_OFFSET] = 0
        EMPTY_WINDOW.pack_into(mm, offset + N_FIRST, NIL, NIL, 0)

    def append(self, node: int, now: float, seconds: float) -> None:
        """Add the admission time ``now`` to ``node``'s window of ``seconds``."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        start, first, last, length = WINDOW.unpack_from(mm, offset + N_OFFSET)
        empty_at: float = F64.unpack_from(mm, offset + N_IDLE)[0]
        self._save(offset, NODE_HEAD)
        position = (start + length) % CHUNK_STAMPS
        if not length:
            first = last = self.new_chunk(now)
            start = position = 0
            mm[offset + N_OFFSET] = 0
            CHUNK_COUNTERS.pack_into(mm, offset + N_FIRST, first, last)
        elif not position:
            last = self.link_new(last, now)
            U32.pack_into(mm, offset + N_LAST, last)
        # The slot past the last entry is free space: no journal entry needed.
        F64.pack_into(mm, self.chunk_at(last) + 8 + 8 * position, now)
        U32.pack_into(mm, offset + N_LEN, length + 1)
        F64.pack_into(mm, offset + N_IDLE, max(empty_at, now + seconds))

    def give_back(self, node: int, stamp: float, seconds: float) -> None:
        """Remove the first window entry equal to ``stamp`` (it may have slid out): the
        entries after it move up one place, keeping the log in order; the time the window
        empties follows its newest entry left (``seconds``: the window's length)."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        start, first, last, length = WINDOW.unpack_from(mm, offset + N_OFFSET)
        if not length:
            return
        chunks: list[int] = []
        values: list[float] = []
        chunk = first
        for _ in range((start + length + CHUNK_STAMPS - 1) // CHUNK_STAMPS):
            following, *stamps = CHUNK_FMT.unpack_from(mm, self.chunk_at(chunk))
            chunks.append(chunk)
            values.extend(stamps)
            chunk = following
        try:
            at = values.index(stamp, start, start + length)
        except ValueError:
            return
        self._save(offset, NODE_HEAD)
        if length == 1:
            self.free_chunks(first, last)
            self.clear(node)
            return
        del values[at]
        values.append(0.0)
        used = (start + length - 1 + CHUNK_STAMPS - 1) // CHUNK_STAMPS
        for index in range(at // CHUNK_STAMPS, used):
            where = self.chunk_at(chunks[index]) + 8
            self._save(where, 8 * CHUNK_STAMPS)
            part = values[index * CHUNK_STAMPS : (index + 1) * CHUNK_STAMPS]
            CHUNK_STAMPS_FMT.pack_into(mm, where, *part)
        if used < len(chunks):
            self.free_chunks(chunks[-1], chunks[-1])
            last = chunks[used - 1]
            self._save(self.chunk_at(last), 8)
            U32.pack_into(mm, self.chunk_at(last), NIL)
            U32.pack_into(mm, offset + N_LAST, last)
        U32.pack_into(mm, offset + N_LEN, length - 1)
        F64.pack_into(mm, offset + N_IDLE, values[start + length - 2] + seconds)

    def stamps(self, node: int) -> list[float]:
        """``node``'s window entries, oldest first, read without changing anything."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        start, chunk, _, left = self._window(offset)
        found: list[float] = []
        while left:
            stamps = CHUNK_STAMPS_FMT.unpack_from(mm, self.chunk_at(chunk) + 8)
            part = stamps[start : start + left]
            found.extend(part)
            left -= len(part)
            if left:
                chunk, start = self._next(chunk), 0
        return found

    def usage(self, node: int, cutoff: float) -> tuple[int, float]:
        """(entries after ``cutoff``, seconds from ``cutoff`` to the oldest of them) of
        ``node``'s window, read without purging it; (0, 0.0) if none."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        start, chunk, _, left = self._window(offset)
        while left:
            stamps = CHUNK_STAMPS_FMT.unpack_from(mm, self.chunk_at(chunk) + 8)
            for stamp in stamps[start : start + left]:
                if stamp > cutoff:
                    return left, stamp - cutoff
                left -= 1
            if left:
                chunk, start = self._next(chunk), 0
        return 0, 0.0

    def new_chunk(self, now: float) -> int:
        """A window chunk off the free list (or never used yet), its link set to NIL. When
        none is left, the chunks of wholly expired windows are reclaimed first."""
        mm = self._mm
        free, high = self.counters()
        self._journal.save_header()
        chunk: int
        if free != NIL:
            chunk = free
            # The whole chunk, not only its link: it may have been freed by this very
            # update (a purge that emptied a window, then its first new entry), and a
            # rollback puts it back in its window with the stamps it held.
            self._save(self.chunk_at(chunk), CHUNK_SIZE)
            self._set_counters(U32.unpack_from(mm, self.chunk_at(chunk))[0], high)
        elif high < self._chunks:
            chunk = high
            self._set_counters(free, high + 1)
        else:
            freed, soonest = self.reclaim(now)
            if freed:
                return self.new_chunk(now)
            raise NoRoom(
                f"all {high * CHUNK_STAMPS} rate window entries are in use; give the table "
                f"more with ?windows=<chunks of {CHUNK_STAMPS} entries>",
                # when the soonest window looked at frees its chunks (not "a second")
                None if soonest == float("inf") else soonest - now,
                kind="rate",
            )
        U32.pack_into(mm, self.chunk_at(chunk), NIL)
        return chunk

    def link_new(self, last: int, now: float) -> int:
        """A new chunk (:meth:`new_chunk`) linked after chunk ``last``, the end of a
        window, and returned: the window's node is the caller's to point at it."""
        chunk = self.new_chunk(now)
        at = self.chunk_at(last)
        self._save(at, 8)
        U32.pack_into(self._mm, at, chunk)
        return chunk

    def reclaim(self, now: float) -> tuple[bool, float]:
        """Free the chunks of windows that have wholly expired (their keys idle since) among
        the ``LRU_SCAN`` least recently used keys of each wildcard limit, where such stale
        windows collect; at most ``LRU_SCAN`` windows per call (a bounded journal). Returns
        whether any was freed, and when the soonest window looked at and left empties (inf:
        none). A window still live is never touched."""
        mm = self._mm
        base = self._registry_off
        nodes_off, node_size = self._nodes_off, self._node_size
        freed = 0
        soonest = float("inf")
        for index in range(self._registry):
            digest, _, node, _ = REG.unpack_from(mm, base + index * REG_SIZE)
            if not digest:
                continue
            for _ in range(LRU_SCAN):
                if node == NIL or freed >= LRU_SCAN:
                    break
                offset = nodes_off + node * node_size
                view = node_view(mm, offset)
                if view.length and view.empty_at <= now:
                    self._save(offset, NODE_HEAD)
                    self.free_chunks(view.first, view.last)
                    self.clear(node)
                    freed += 1
                elif view.length:
                    soonest = min(soonest, view.empty_at)
                node = view.newer
        return freed > 0, soonest

    def free_chunks(self, first: int, last: int) -> None:
        """Put the chain of chunks ``first`` .. ``last`` on the free list."""
        mm = self._mm
        free, high = self.counters()
        self._journal.save_header()
        self._save(self.chunk_at(last), 8)
        U32.pack_into(mm, self.chunk_at(last), free)
        self._set_counters(first, high)

    def counters(self) -> tuple[int, int]:
        """(first free chunk, chunks ever used), checked against their check word."""
        mm = self._mm
        free, high = CHUNK_COUNTERS.unpack_from(mm, H_CHUNK_FREE)
        if (
            high > self._chunks
            or (free != NIL and free >= high)
            or U32.unpack_from(mm, H_CHUNK_CHECK)[0] != chunk_check(mm[H_CHUNK_FREE:MUT_END])
        ):
            raise Damaged("its window chunk counters are out of range")
        return free, high

    def _set_counters(self, free: int, high: int) -> None:
        """Write the chunk counters and their check word (the header is journaled)."""
        mm = self._mm
        counters = CHUNK_COUNTERS.pack(free, high)
        mm[H_CHUNK_FREE:MUT_END] = counters
        U32.pack_into(mm, H_CHUNK_CHECK, chunk_check(counters))
