"""The undo journal of a shared table and the one context manager every locked section
(an update, or a look) runs in.

:class:`Journal` owns the journal region (``layout.journal_off``, ``layout.journal`` bytes)
and the journal length at ``H_JLEN``: before a byte range of the table changes, its old
bytes are appended as an entry (u64 offset, u32 length, the bytes) and only then is the
length raised to cover it; :meth:`Journal.commit` sets the length to 0 (the commit point);
:meth:`Journal.rollback` and :meth:`Journal.undo` write the old bytes back, newest first.
A process killed mid-update leaves a non-zero length: the next process to take the lock
undoes it (:meth:`Journal.undo`), having checked every entry first, so a corrupt journal
writes nowhere (:class:`~.faults.Damaged` instead).

:class:`Transaction` is ``with backend._transaction as mm:``: locks taken on entry, the
update rolled back on an exception, the locks released in every case. It holds no state
of its own (one serves every thread). :meth:`Transaction.reading` is the same section for a
look that changes nothing (``with backend._reading as mm:``).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable
from operator import itemgetter

from gatekeeper_wsgi.backends.shared.faults import Damaged
from gatekeeper_wsgi.backends.shared.layout import (
    H_JLEN,
    JENTRY,
    JENTRY_SIZE,
    MUT_END,
    MUT_START,
    U32,
    Layout,
)
from gatekeeper_wsgi.errors import BackendError

#: (offset, length) of the header's mutable block (its counters), for :meth:`Journal.save_all`
HEADER_BLOCK = (MUT_START, MUT_END - MUT_START)
#: the journal length as a u32 index of the map
_JLEN = H_JLEN // 4
#: the offsets of its spare range whose entries a :class:`Saving` keeps at most
SPARES_KEPT = 32


class Journal:
    """The undo journal of one mapped table (a new one per map: what it saved belongs to
    that map). ``name`` is the table's path, for messages."""

    __slots__ = (
        "_base",
        "_borrowed",
        "_cap",
        "_jlen",
        "_mm",
        "_name",
        "_saved",
        "_total",
        "_u32",
        "_u64",
        "_void",
    )

    def __init__(self, mm: mmap.mmap, layout: Layout, name: str) -> None:
        self._mm = mm
        self._base = layout.journal_off
        self._cap = layout.journal
        self._total = layout.total
        self._name = name
        self._jlen = 0
        #: offset -> bytes saved from there in this update (saving again is a no-op)
        self._saved: dict[int, int] = {}
        #: whether ``_saved`` is a plan's (:meth:`save_first`), to copy before a change
        self._borrowed = False
        #: u32 and u64 views of the map: a field written through one costs about half a
        #: ``struct`` call or a slice write (:meth:`close` lets them go)
        self._u32 = memoryview(mm).cast("I")
        self._u64 = memoryview(mm).cast("Q")
        #: the u64 index where :meth:`commit` voids the first entry (its offset)
        self._void = self._base >> 3

    def close(self) -> None:
        """Let the views of the map go (the map cannot be closed while they are held)."""
        self._u32.release()
        self._u64.release()

    @property
    def pending(self) -> int:
        """Journal bytes of the update in progress (0: none)."""
        return self._jlen

    def save(self, offset: int, length: int) -> None:
        """Put the current bytes at ``offset`` in the journal before they change."""
        saved = self._saved
        if saved.get(offset, 0) >= length:
            return
        if self._borrowed:  # a plan's record (save_first): this update's own copy now
            saved = self._saved = dict(saved)
            self._borrowed = False
        mm = self._mm
        start = self._jlen
        end = start + JENTRY_SIZE + length
        if end > self._cap:
            # The journal is sized for the largest update (see Layout.derive): a bug.
            raise BackendError(f"shared table {self._name!r}: update too large for its journal")
        at = self._base + start
        JENTRY.pack_into(mm, at, offset, length)
        mm.move(at + JENTRY_SIZE, offset, length)
        # Only now is the entry part of the journal.
        self._u32[_JLEN] = end
        self._jlen = end
        saved[offset] = length

    def save_all(self, ranges: Iterable[tuple[int, int]]) -> None:
        """:meth:`save` of each (offset, length) in one write, the journal length raised
        once for all: an update that knows what it will change saves it in one step."""
        mm = self._mm
        if self._borrowed:
            self._saved = dict(self._saved)
            self._borrowed = False
        saved = self._saved
        parts: list[bytes] = []
        for offset, length in ranges:
            if saved.get(offset, 0) < length:
                saved[offset] = length
                parts += (JENTRY.pack(offset, length), mm[offset : offset + length])
        if not parts:
            return
        entries = b"".join(parts)
        start = self._jlen
        end = start + len(entries)
        if end > self._cap:
            raise BackendError(f"shared table {self._name!r}: update too large for its journal")
        at = self._base + start
        mm[at : at + len(entries)] = entries
        # Only now are the entries part of the journal: nothing they cover changed yet.
        self._u32[_JLEN] = end
        self._jlen = end

    def save_first(self, saving: Saving, at: int) -> None:
        """The first save of an update that knows its ranges (:mod:`.plans`): those of
        ``saving``, and its spare range at ``at``. As :meth:`save_all`, in one write,
        without its per-range bookkeeping."""
        if self._jlen:
            self.save_all([*saving.ranges, (at, saving.spare)])
            return
        mm = self._mm
        # The entries in one C call: the heads are the format's own bytes, the saved
        # bytes its %s, read by one itemgetter (interleaving them in Python, chain(zip())
        # and a join, cost three times as much: ~5 600 instructions against ~2 000).
        found = saving.by_offset.get(at)
        entries, read = saving.add(at) if found is None else found
        entries %= read(mm)
        end = len(entries)
        if end > self._cap:
            raise BackendError(f"shared table {self._name!r}: update too large for its journal")
        base = self._base
        mm[base : base + end] = entries
        # Only now are the entries part of the journal: nothing they cover changed yet.
        self._u32[_JLEN] = end
        self._jlen = end
        # The plan's own record of what is saved, copied only if the update saves more
        # (the lease's range is left out of it: saving it again is only redundant).
        self._saved = saving.saved
        self._borrowed = True

    def save_header(self) -> None:
        """Save the header's mutable block (its counters), once per update."""
        self.save(*HEADER_BLOCK)

    def commit(self) -> None:
        """Make the update permanent: the journal length drops to 0."""
        if self._jlen:
            self._u32[_JLEN] = 0  # the commit point
            # The entries stay behind: void the first (offset 0 is never journaled), so
            # that a journal length corrupted later is found invalid instead of undoing
            # this committed update.
            self._u64[self._void] = 0
            self._jlen = 0
            self._saved = {}
            self._borrowed = False

    def rollback(self) -> None:
        """Undo the update in progress, if any."""
        if self._jlen:
            self.undo(self._jlen)
        self._jlen = 0
        self._saved = {}
        self._borrowed = False

    def undo(self, jlen: int) -> None:
        """Write back the ``jlen`` journal bytes' old contents, newest first (also those a
        killed process left). :class:`Damaged` if any entry is invalid, before anything
        is written."""
        mm = self._mm
        base = self._base
        if jlen > self._cap:
            raise Damaged(f"its journal length {jlen} exceeds the journal")
        # Every entry is checked before any is applied: a corrupt journal must not write
        # anywhere (the journal and the header's first fields are never journaled).
        journal_end = base + self._cap
        entries = []
        position = 0
        while position < jlen:
            if position + JENTRY_SIZE > jlen:
                raise Damaged("its journal ends inside an entry")
            offset, length = JENTRY.unpack_from(mm, base + position)
            start = base + position + JENTRY_SIZE
            position += JENTRY_SIZE + length
            end = offset + length
            if (
                position > jlen
                or offset < MUT_START
                or end > self._total
                or (offset < journal_end and end > base)
            ):
                raise Damaged(f"its journal holds an entry for bytes {offset}..{end}")
            entries.append((offset, mm[start : start + length]))
        for offset, old in reversed(entries):
            mm[offset : offset + len(old)] = old
        U32.pack_into(mm, H_JLEN, 0)
        JENTRY.pack_into(mm, base, 0, 0)
        self._jlen = 0
        self._saved = {}
        self._borrowed = False


class Saving:
    """What :meth:`Journal.save_first` saves of an update that knows its ranges ahead
    (the header's mutable block among them) and one more range of ``spare`` bytes known
    under the lock (a lease): per offset of that one, the entries as a bytes format
    and one call that reads all their bytes (:meth:`add`); the journal's bookkeeping of
    the fixed ranges (never changed: the journal copies it before it records more)."""

    __slots__ = ("_entries", "_spans", "by_offset", "ranges", "saved", "spare")

    def __init__(self, ranges: Iterable[tuple[int, int]], spare: int) -> None:
        #: (offset, length) of each range, once each (a range saved twice is undone twice)
        self.ranges = tuple(dict(ranges).items())
        self.spare = spare
        self._spans = [slice(offset, offset + length) for offset, length in self.ranges]
        self.saved = dict(self.ranges)
        #: the entries of the fixed ranges as a bytes format: each head as it is (a
        #: ``%`` in it doubled), a ``%s`` for its bytes
        heads = (JENTRY.pack(offset, length) for offset, length in self.ranges)
        self._entries = b"".join(head.replace(b"%", b"%%") + b"%s" for head in heads)
        #: spare range's offset -> what :meth:`add` made for it
        self.by_offset: dict[int, tuple[bytes, Callable[[mmap.mmap], tuple[bytes, ...]]]] = {}

    def add(self, offset: int) -> tuple[bytes, Callable[[mmap.mmap], tuple[bytes, ...]]]:
        """The entries with the spare range at ``offset`` as a bytes format, and the
        itemgetter of the bytes it formats, kept in :attr:`by_offset` (a few offsets, as
        freed leases are taken again first; :data:`SPARES_KEPT` at most)."""
        if len(self.by_offset) >= SPARES_KEPT:
            self.by_offset = {}
        head = JENTRY.pack(offset, self.spare).replace(b"%", b"%%")
        read = itemgetter(*self._spans, slice(offset, offset + self.spare))
        found = self.by_offset[offset] = (self._entries + head + b"%s", read)
        return found


class Structure:
    """A structure of one mapped table (the key table, the windows, the leases...): the
    map it works on, the journal it saves the bytes it changes to, and where the nodes
    are, which every structure reads or counts on. Nothing else of the backend: each can
    be driven alone on a map of its own."""

    __slots__ = ("_journal", "_mm", "_node_size", "_nodes_off", "_save")

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal) -> None:
        self._mm = mm
        self._journal = journal
        #: bound once: called several times on every admission and release
        self._save = journal.save
        self._nodes_off = layout.nodes_off
        self._node_size = layout.node_size


class Transaction:
    """``with transaction as mm:`` - one update of the table: ``enter()`` takes the thread
    and file locks (and checks, attaches or recovers the table) and returns the map; on an
    exception ``fail(exc)`` rolls the update back and raises what may leave a backend; the
    locks are released by ``leave()`` in every case. A class, not a
    ``contextlib.contextmanager``: it is on every admission and release (a generator
    costs about 1 µs more)."""

    __slots__ = ("_enter", "_fail", "_leave")

    def __init__(
        self,
        enter: Callable[[], mmap.mmap],
        fail: Callable[[BaseException], object],
        leave: Callable[[], None],
    ) -> None:
        self._enter = enter
        self._fail = fail
        self._leave = leave

    @classmethod
    def reading(cls, enter: Callable[[], mmap.mmap], leave: Callable[[], None]) -> Transaction:
        """The locked section of a look that changes nothing: the same locks, and an
        exception leaves as it is (nothing to roll back; what a damaged table means to a
        look, its caller decides)."""
        return cls(enter, _unchanged, leave)

    def __enter__(self) -> mmap.mmap:
        return self._enter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: object
    ) -> None:
        try:
            if exc is not None:
                self._fail(exc)
        finally:
            self._leave()


def _unchanged(exc: BaseException) -> None:
    """The ``fail`` of :meth:`Transaction.reading`: a look wrote nothing to undo."""
