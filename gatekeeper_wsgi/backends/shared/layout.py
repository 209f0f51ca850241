"""The byte layout of a shared table (little-endian; the offsets of the regions follow
from the sizes in the header, each region aligned to 64 bytes, the window chunks to 4096)::

    header, 4096 bytes
      0   8  magic b"GKSHARED" (b"GKSHINIT" while being initialised)
      8   4  u32 layout version (7)
     12   4  u32 journal bytes in use; 0 = no update in progress (the commit point)
     16   8  u64 epoch: random, new at every initialisation; grants of another epoch
             are void
     24   4  u32 live leases, held or delayed (at this offset in every version)
     28   4  u32 first free lease, or 0xFFFFFFFF    |  the mutable block [24, 64),
     32   4  u32 leases ever used (bump mark)        |  saved to the journal as one
     36   4  u32 entries in the delay heap          |  range
     40   4  u32 last lease serial
     44   4  u32 process slots ever used (bump mark)
     48   4  u32 keys in the table
     52   4  u32 crc32 of the 8 bytes at 56 (they disagree: damaged)
     56   4  u32 first free window chunk, or 0xFFFFFFFF
     60   4  u32 window chunks ever used (bump mark)
     64   8  u64 a copy of the epoch (they differ: the header is damaged)
     72   8  u64 blake2b (8 bytes, little-endian) of bytes 0..12, 16..24, 64..72
             and 256..320 with the final magic: written once at creation
     80   4  u32 waiters in the queues' lines, all lines (0: no line; read by every
             admission, so it lives on the header's page)  |  the lines' block
     84   4  u32 last ticket                               |  [80, 100), saved to
     88   4  u32 first free waiter + 1 (0: none)           |  the journal as one
     92   4  u32 waiters ever used (bump mark)             |  range
     96   4  u32 lines in use (the first n line entries)   |
    104   8  u64 key generation: raised before a key leaves its node (an eviction,
             not journaled: an update rolled back leaves it raised). A process may
             count on the node it found a key in while this is unchanged
    256  16  boot id (/proc/sys/kernel/random/boot_id): another boot = stale table
    272   4  u32 key bytes per node (K, including a NUL terminator)
    276   4  u32 hash buckets (m)
    280   4  u32 nodes per bucket (8)
    284   4  u32 leases (L)
    288   4  u32 process slots (P)
    292   4  u32 registry entries (R)
    296   4  u32 journal bytes (J)
    300   4  u32 window chunks (W)
    304   8  u64 file bytes
    312   4  u32 waiters (Q)
    316   4  u32 lines (N)
    (the rest is zero)

    tags, m x 8 x u32: a node's 32-bit key hash, 0 = free slot. A key lives in one of
      two buckets (two-choice hashing on its blake2b digest), so a lookup reads 16
      tags and compares at most a few keys; both buckets full -> an idle node of the
      16 is evicted, else the new key is refused (CapacityError).
    nodes, m x 8 x (40 + K) bytes, node i belongs to tag i:
      0 u32 requests in flight       4 u16 key length
      6 u8  index of the oldest window entry in the first chunk
      7 u8  flags: 1 = its gauge holds the controller of its key (0 when created)
      8 u32 first window chunk      12 u32 last window chunk (0xFFFFFFFF: none)
     16 u32 window entries          20 u32 registry entry + 1 (0: not a wildcard key)
     24 u32 previous, 28 u32 next node in its limit's least-recently-used list
     32 f64 when its window is empty (last entry + window length)
     40 key bytes (UTF-8), NUL terminated
    leases, L x 40 bytes:
      0 u32 owner pid (0: ownerless, a delayed decrease)   4 u32 serial (0: free)
      8 f64 expiry (0: held by its owner)   16 u32 node count   20 5 x u32 nodes
      (a free lease keeps the next free lease in its first node field)
    delay heap, L x 16 bytes: f64 expiry, u32 lease, u32 serial; a binary min-heap
    processes, P x 16 bytes: u32 pid (0: free), 4 pad, u64 start time (clock ticks
      after boot, /proc/<pid>/stat field 22: tells a reused pid apart)
    registry, R x 24 bytes, one per wildcard limit path: u64 blake2b of the path
      (0: free), u32 keys, u32 least recently used node, u32 most recently used node,
      4 pad
    gauges, m x 8 x 144 bytes, gauge i belongs to node i (read only when its node's
      flag says so, so a gauge is touched only for keys of adaptive limits):
      0 4 x u32 the adaptive table its state was made under: algorithm (1 gradient,
        2 aimd, 3 vegas), min, max, initial (a reloaded table: respec'd at next use)
      16 16 x f64 adaptive.Controller.STATE: estimate, limit, latency, min_latency,
        next probe, window due, count, total, drops, peak, probing (NaN: no),
        slow start, probe count, probe total, drop baseline, probe drops
    journal, J bytes: entries of u64 offset, u32 length, the old bytes; a commit or a
      rollback zeroes the first entry's offset (0 is never journaled: an invalid entry)
    window chunks, W x 64 bytes: u32 next chunk of the same window (0xFFFFFFFF:
      last), 4 pad, 7 x f64 admission times. A rate key's sliding log is a chain of
      chunks, oldest entry first: appending and expiring are O(1), memory follows the
      entries actually held. Free chunks form a list through their first field.
    waiters, Q x 40 bytes, a waiter of a limit's queue (tickets.py):
      0 u32 owner pid (0: free)   4 u32 ticket (0: free)   8 u64 owner's start time
      (as in processes)   16 u64 wake nonce (its socket's name; 0: none)
      24 u32 previous, 28 u32 next waiter of its line (0xFFFFFFFF: none; a free waiter
      keeps the next free one in next)   32 u64 its line's key digest
    lines, N x 32 bytes, the first n in use (a line that empties takes the last's place):
      0 u64 blake2b of the concrete limit path   8 u64 digest of the path that last
      refused its first waiter (0: none)   16 u32 first, 20 u32 last waiter
      24 u32 waiters   28 pad

This module owns that layout: its constants and struct formats, :class:`Layout` (the sizes of
a table and the offsets that follow from them, derived from a configuration) and the checks
of a header read from a file. It knows nothing of locks or processes.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import zlib
from collections.abc import Iterable
from typing import NamedTuple

from gatekeeper_wsgi.adaptive import Controller
from gatekeeper_wsgi.config import Config, Limit

MAGIC = b"GKSHARED"
#: written first when a table is (re)initialised, replaced by MAGIC when done: a process
#: killed half-way leaves a file that is recognisably ours and unfinished.
MAGIC_INIT = b"GKSHINIT"
#: 2: the epoch's copy at 64; 3: the checksums at 52 and 72; 4: the adaptive gauges;
#: 5: the queues' lines (waiters, lines); 6: the key generation at 104; 7: the same bytes,
#: locked by ``flock`` instead of an OFD ``fcntl`` lock (which does not exclude it); 8:
#: gauges of 144 bytes (the controller's no-load share of faulty responses)
VERSION = 8
HEADER = 4096
CHAIN = 8  #: nodes per hash bucket
NIL = 0xFFFFFFFF
CHUNK_STAMPS = 7  #: admission times per window chunk (64 bytes)
#: window chunks reserved by default at most (128 MiB); ``?windows=`` overrides
DEFAULT_CHUNKS_CAP = 1 << 21
MAX_REFS = 5  #: slots per lease
#: how far an eviction for ``max_keys`` looks for an idle key (from the least recently
#: used) before the new key is refused
LRU_SCAN = 64
#: keys reserved by default at most (a wildcard limit asks for its ``max_keys``); ``?size=``
#: overrides. 2^20 keys of 64 key bytes: 100 MiB of sparse file, 1.5 M nodes.
DEFAULT_KEYS_CAP = 1 << 20
#: leases reserved by default at most (160 MiB with the delay heap); ``?leases=`` overrides
DEFAULT_LEASES_CAP = 1 << 22
#: leases reserved at least: requests in flight on a host beyond any concurrency limit
MIN_LEASES = 16384
#: waiters of queues reserved at least (room for a queue a reload adds) and at most
MIN_WAITERS = 256
DEFAULT_WAITERS_CAP = 1 << 16
#: lines (concrete paths with waiters at once) reserved at least and at most
MIN_LINES = 64
DEFAULT_LINES_CAP = 4096

U32 = struct.Struct("<I")
STATE = struct.Struct("<8sIIQ")  # at 0: magic, version, journal bytes, epoch
F64 = struct.Struct("<d")
MAGIC_VERSION = struct.Struct("<8sI")  # at 0
GEOMETRY = struct.Struct("<8I")  # at 272
QUEUE_GEOMETRY = struct.Struct("<2I")  # at 312
NODE = struct.Struct("<IHBxIIIIIId")
LEASE = struct.Struct("<IIdI5I")
LEASE_HEAD = struct.Struct("<II")  # pid, serial
#: at L_COUNT: the node count and the MAX_REFS node fields
LEASE_NODES = struct.Struct(f"<I{MAX_REFS}I")
#: at H_LIVE: live leases, first free lease, leases ever used, heap entries, last serial
LEASE_COUNTERS = struct.Struct("<5I")
HEAP = struct.Struct("<dII")
PROC = struct.Struct("<IIQ")
REG = struct.Struct("<QIII4x")
WAITER = struct.Struct("<IIQQIIQ")
WAITER_SIZE = WAITER.size  # 40
LINE = struct.Struct("<QQIII4x")
LINE_SIZE = LINE.size  # 32
TAGS = struct.Struct(f"<{CHAIN}I")
CHUNK_FMT = struct.Struct(f"<I4x{CHUNK_STAMPS}d")
CHUNK_STAMPS_FMT = struct.Struct(f"<{CHUNK_STAMPS}d")
JENTRY = struct.Struct("<QI")

# header fields
H_JLEN = 12
H_EPOCH = 16
H_LIVE = 24
H_LEASE_FREE = 28
H_LEASE_HIGH = 32
H_HEAP_LEN = 36
H_SERIAL = 40
H_PROCS_HIGH = 44
H_NODES_USED = 48
#: crc32 of the window chunk counters at 56..64: in-range garbage there would hand one
#: chunk to two windows (and so drop admission times), which no other check can see
H_CHUNK_CHECK = 52
H_CHUNK_FREE = 56
H_CHUNK_HIGH = 60
MUT_START, MUT_END = H_LIVE, 64
#: a copy of the epoch: a corrupted epoch would otherwise pass for a re-created table and
#: orphan every grant of the live one
H_EPOCH_COPY = 64
#: blake2b of the fields written once when the table is created (magic, version, epoch
#: and its copy, boot id, geometry, file size): a new epoch with a valid checksum is a
#: table another process re-created; any other change to them is damage
H_CHECK = 72
#: the queues' lines: waiters in line (all lines), last ticket, first free waiter, waiters
#: ever used, lines in use; journaled as one block
H_WAITING = 80
H_LINES_END = 100
#: the key generation (u64): raised before any key leaves its node
H_KEYGEN = 104
KEYGEN = struct.Struct("<Q")
#: at H_LIVE, what every admission and release reads first: the lease counters (live,
#: first free, bump mark, heap entries, last serial), the waiters at H_WAITING and the
#: key generation at H_KEYGEN, in one read
HOT_HEADER = struct.Struct("<5I36xI20xQ")
LINES_HEAD = struct.Struct("<5I")  # at H_WAITING
H_BOOT = 256
H_GEOMETRY = 272
H_FILE_BYTES = 304
H_QUEUE_GEOMETRY = 312
#: the end of the fields written once at creation
H_FIXED_END = 320

# node fields
NODE_HEAD = NODE.size  # 40: the key follows
N_INFLIGHT, N_KEY_LENGTH, N_OFFSET, N_FLAGS, N_FIRST, N_LAST, N_LEN = 0, 4, 6, 7, 8, 12, 16
#: at N_OFFSET: a node's window (oldest entry's index, first and last chunk, entries)
WINDOW = struct.Struct("<BxIII")
#: in a node's flags: its gauge holds its key's controller (a new node's flags are 0, so
#: a gauge left by the key a node held before is never read, nor its page touched)
F_GAUGE = 1
N_REG, N_PREV, N_NEXT, N_IDLE = 20, 24, 28, 32
LEASE_SIZE = LEASE.size  # 40
L_EXPIRY, L_COUNT, L_REFS = 8, 16, 20
HEAP_SIZE = HEAP.size
PROC_SIZE = PROC.size
REG_SIZE = REG.size
R_COUNT, R_HEAD, R_TAIL = 8, 12, 16
CHUNK_SIZE = CHUNK_FMT.size  # 64
JENTRY_SIZE = JENTRY.size  # 12

# gauges: the controller of an adaptive limit's key, one per node (same index)
GAUGE_SIZE = 144
#: at 0: algorithm (index in ALGORITHMS + 1; 0: no controller yet), min, max, initial of
#: the ``adaptive`` table the state was last made under (a reload changes them)
GAUGE_SPEC = struct.Struct("<4I")
G_STATE = GAUGE_SPEC.size  # 16: Controller.STATE as doubles
GAUGE_STATE = struct.Struct(f"<{len(Controller.STATE)}d")
#: what a sample changes while no window is due (Controller.sample before _due_now),
#: read and written in place so that most releases never rebuild the controller
HOT = ("_due", "_count", "_total", "_drops", "_peak")
HOT_INDEX = Controller.STATE.index(HOT[0])
if Controller.STATE[HOT_INDEX : HOT_INDEX + len(HOT)] != HOT:
    raise RuntimeError(f"Controller.STATE no longer holds {HOT} in a row")
G_HOT = G_STATE + 8 * HOT_INDEX
GAUGE_HOT = struct.Struct(f"<{len(HOT)}d")
#: the spec and the enforced limit, read by every admission of an adaptive limit
GAUGE_HEAD = struct.Struct(f"<4I{8 * Controller.STATE.index('limit')}xd")
if G_STATE + GAUGE_STATE.size > GAUGE_SIZE:
    raise RuntimeError("Controller.STATE no longer fits a gauge")


class NodeView(NamedTuple):
    """A node's fields (``NODE``) by name; read with :func:`node_view`, off the hot path
    (which reads single fields at the ``N_*`` offsets)."""

    inflight: int  #: requests in flight (held or delayed)
    key_length: int
    start: int  #: index of the oldest window entry in the first chunk
    first: int  #: first window chunk
    last: int  #: last window chunk (NIL: none)
    length: int  #: window entries
    registry: int  #: registry entry + 1 (0: not a wildcard key)
    older: int  #: previous node in its limit's least-recently-used list
    newer: int  #: next node in that list
    empty_at: float  #: when its window is empty (last entry + window length)

    def idle(self, now: float) -> bool:
        """Whether the node may be evicted: nothing in flight (a delayed release keeps its
        count) and nothing left in its rate window (its last entry has expired)."""
        return not self.inflight and (not self.length or self.empty_at <= now)


def node_view(buffer: mmap.mmap | bytes, offset: int) -> NodeView:
    """The fields of the node at ``offset``."""
    return NodeView._make(NODE.unpack_from(buffer, offset))


def align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


class Layout:
    """The sizes of a table and the offsets that follow from them."""

    __slots__ = (
        "buckets",
        "chunks",
        "chunks_off",
        "gauges_off",
        "heap_off",
        "journal",
        "journal_off",
        "key_size",
        "leases",
        "leases_off",
        "lines",
        "lines_off",
        "node_size",
        "nodes_off",
        "procs",
        "procs_off",
        "registry",
        "registry_off",
        "tags_off",
        "total",
        "waiters",
        "waiters_off",
    )

    def __init__(
        self,
        *,
        key_size: int,
        buckets: int,
        leases: int,
        procs: int,
        registry: int,
        journal: int,
        chunks: int,
        waiters: int = MIN_WAITERS,
        lines: int = MIN_LINES,
    ) -> None:
        self.key_size = key_size
        self.buckets = buckets
        self.leases = leases
        self.procs = procs
        self.registry = registry
        self.journal = journal
        self.chunks = chunks
        self.waiters = waiters
        self.lines = lines
        self.node_size = NODE_HEAD + key_size
        offset = self.tags_off = HEADER
        offset = self.nodes_off = align(offset + buckets * CHAIN * 4, 64)
        offset = self.leases_off = align(offset + buckets * CHAIN * self.node_size, 64)
        offset = self.heap_off = align(offset + leases * LEASE_SIZE, 64)
        offset = self.procs_off = align(offset + leases * HEAP_SIZE, 64)
        offset = self.registry_off = align(offset + procs * PROC_SIZE, 64)
        offset = self.gauges_off = align(offset + registry * REG_SIZE, 64)
        offset = self.journal_off = align(offset + buckets * CHAIN * GAUGE_SIZE, 64)
        offset = self.chunks_off = align(offset + journal, 4096)
        offset = self.waiters_off = align(offset + chunks * CHUNK_SIZE, 64)
        offset = self.lines_off = align(offset + waiters * WAITER_SIZE, 64)
        self.total = align(offset + lines * LINE_SIZE, 4096)

    @property
    def nodes(self) -> int:
        return self.buckets * CHAIN

    def _sizes(self) -> tuple[int, ...]:
        return (
            self.key_size,
            self.buckets,
            self.leases,
            self.procs,
            self.registry,
            self.journal,
            self.chunks,
            self.waiters,
            self.lines,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._sizes() == other._sizes()

    def __hash__(self) -> int:
        return hash(self._sizes())

    def covers(self, other: Layout) -> bool:
        """Whether this table holds at least what ``other`` asks for, in every respect."""
        return all(
            mine >= theirs for mine, theirs in zip(self._sizes(), other._sizes(), strict=True)
        )

    def merged(self, other: Layout) -> Layout:
        """The smallest layout covering both."""
        return Layout(
            key_size=max(self.key_size, other.key_size),
            buckets=max(self.buckets, other.buckets),
            leases=max(self.leases, other.leases),
            procs=max(self.procs, other.procs),
            registry=max(self.registry, other.registry),
            journal=max(self.journal, other.journal),
            chunks=max(self.chunks, other.chunks),
            waiters=max(self.waiters, other.waiters),
            lines=max(self.lines, other.lines),
        )

    def describe(self) -> str:
        return (
            f"{self.nodes} keys of <= {self.key_size - 1} bytes, {self.leases} leases, "
            f"{self.procs} processes, {self.chunks * CHUNK_STAMPS} rate window entries, "
            f"{self.waiters} queue waiters, {self.total} bytes"
        )

    def write(self, mm: mmap.mmap) -> None:
        GEOMETRY.pack_into(
            mm,
            H_GEOMETRY,
            self.key_size,
            self.buckets,
            CHAIN,
            self.leases,
            self.procs,
            self.registry,
            self.journal,
            self.chunks,
        )
        struct.pack_into("<Q", mm, H_FILE_BYTES, self.total)
        QUEUE_GEOMETRY.pack_into(mm, H_QUEUE_GEOMETRY, self.waiters, self.lines)

    @classmethod
    def read(cls, header: bytes) -> Layout | None:
        key_size, buckets, chain, leases, procs, registry, journal, chunks = GEOMETRY.unpack_from(
            header, H_GEOMETRY
        )
        waiters, lines = QUEUE_GEOMETRY.unpack_from(header, H_QUEUE_GEOMETRY)
        if chain != CHAIN or not (buckets and leases and procs and key_size and waiters and lines):
            return None
        return cls(
            key_size=key_size,
            buckets=buckets,
            leases=leases,
            procs=procs,
            registry=registry,
            journal=journal,
            chunks=chunks,
            waiters=waiters,
            lines=lines,
        )

    @classmethod
    def derive(
        cls,
        config: Config | None,
        *,
        size: int | None = None,
        leases: int | None = None,
        procs: int | None = None,
        windows: int | None = None,
    ) -> Layout:
        """The table a configuration needs (docs/deployment.md, "Sizing"): a node per key
        (``max_keys`` per wildcard limit; ``DEFAULT_KEYS_CAP`` keys in all at most), room
        for N admission times per key of an ``N/...`` limit (``DEFAULT_CHUNKS_CAP`` chunks
        at most), a lease per request in flight (twice the sum of the concurrency limits,
        a wildcard one counting ``concurrency x max_keys``; between ``MIN_LEASES`` and
        ``DEFAULT_LEASES_CAP``), a waiter per place in a queue (``queue.size`` per key,
        between ``MIN_WAITERS`` and ``DEFAULT_WAITERS_CAP``) and a line per key with a
        queue (between ``MIN_LINES`` and ``DEFAULT_LINES_CAP``), room for limits a reload
        may add."""
        keys = 0
        key_size = 64
        wildcards = 0
        concurrency = 0
        chunks = 0
        longest_count = 0
        waiters = 0
        lines = 0
        limits: Iterable[Limit] = config.limits.values() if config is not None else ()
        for limit in limits:
            if limit.concurrency is None and limit.rate is None:
                continue
            count = limit.max_keys if limit.wildcard else 1
            count = min(count, DEFAULT_KEYS_CAP if size is None else size)
            keys += count
            wildcards += limit.wildcard
            # A wildcard segment takes a request value: at most 128 characters.
            length = sum(128 if seg == "*" else len(seg) for seg in limit.segments)
            key_size = max(key_size, length + len(limit.segments))  # separators + NUL
            if isinstance(limit.concurrency, int):
                concurrency += limit.concurrency * count
            if limit.queue is not None:
                waiters += limit.queue.size * count
                lines += count
            rate = limit.rate
            if rate is not None:
                # A window of N entries spans at most this many chunks.
                chunks += count * ((rate.limit + 2 * CHUNK_STAMPS - 2) // CHUNK_STAMPS)
                if limit.count is not None:
                    longest_count = max(longest_count, rate.limit)
        keys = size if size is not None else min(keys, DEFAULT_KEYS_CAP)
        nodes = keys * 3 // 2 + 64  # load <= 2/3: two-choice buckets of 8 ~never overflow
        if windows is None:
            windows = min(chunks + 1024, DEFAULT_CHUNKS_CAP)
        # A give-back rewrites the chunks after the entry: journal room for that.
        rewrite = (longest_count // CHUNK_STAMPS + 2) * (CHUNK_SIZE + JENTRY.size)
        return cls(
            key_size=align(key_size, 8),
            buckets=-(-nodes // CHAIN),
            leases=(
                leases
                if leases is not None
                else min(max(MIN_LEASES, 2 * concurrency), DEFAULT_LEASES_CAP)
            ),
            procs=procs if procs is not None else 1024,
            registry=2 * wildcards + 64,
            journal=align(65536 + MAX_REFS * rewrite, 4096),
            chunks=windows,
            waiters=min(max(MIN_WAITERS, waiters), DEFAULT_WAITERS_CAP),
            lines=min(max(MIN_LINES, lines), DEFAULT_LINES_CAP),
        )


def clear_counters(mm: mmap.mmap) -> None:
    """Write the mutable block of an empty table (no lease, heap entry, process, key or
    window chunk in use) over a zeroed header."""
    U32.pack_into(mm, H_LEASE_FREE, NIL)
    mm[H_CHUNK_FREE:MUT_END] = U32.pack(NIL) + bytes(4)
    U32.pack_into(mm, H_CHUNK_CHECK, chunk_check(mm[H_CHUNK_FREE:MUT_END]))


def fixed_digest(head: bytes | bytearray) -> int:
    """The checksum of a header's fixed fields (stored at ``H_CHECK``)."""
    fixed = b"".join(
        (
            head[0:12],
            head[H_EPOCH : H_EPOCH + 8],
            head[H_EPOCH_COPY:H_CHECK],
            head[H_BOOT:H_FIXED_END],
        )
    )
    return int.from_bytes(hashlib.blake2b(fixed, digest_size=8).digest(), "little")


def chunk_check(counters: bytes) -> int:
    """The check word (at ``H_CHUNK_CHECK``) of the window chunk counters' 8 bytes."""
    return zlib.crc32(counters)


def header_problem(layout: Layout, head: bytes, size: int) -> str | None:
    """What in the fixed fields of a header of a valid magic no correct process writes,
    None if nothing (its counters: :func:`counters_problem`)."""
    if struct.unpack_from("<Q", head, H_CHECK)[0] != fixed_digest(head):
        return "its fixed fields fail their checksum"
    if size < layout.total:
        return f"it was cut to {size} bytes (its table needs {layout.total})"
    if struct.unpack_from("<Q", head, H_FILE_BYTES)[0] != layout.total:
        return "its size field disagrees with its geometry"
    if head[H_EPOCH : H_EPOCH + 8] != head[H_EPOCH_COPY : H_EPOCH_COPY + 8]:
        return "its epoch disagrees with its copy"
    jlen = U32.unpack_from(head, H_JLEN)[0]
    if jlen > layout.journal:
        return f"its journal length {jlen} exceeds the journal ({layout.journal} bytes)"
    return None


def counters_problem(layout: Layout, head: bytes) -> str | None:
    """What in a header's counters no correct process leaves once its update is complete,
    None if nothing. Read after the journal is rolled back: a process killed inside an
    update (between the window chunk counters and their check word, say) leaves counters
    that only its journal makes whole again."""
    live, lease_free, lease_high, heap_len, _, procs_high, nodes_used, _, chunk_free, chunk_high = (
        struct.unpack_from("<10I", head, H_LIVE)
    )
    if U32.unpack_from(head, H_CHUNK_CHECK)[0] != chunk_check(head[H_CHUNK_FREE:MUT_END]):
        return "its window chunk counters fail their check"
    waiting, _, waiter_free, waiter_high, lines_used = LINES_HEAD.unpack_from(head, H_WAITING)
    if (
        waiting > waiter_high
        or waiter_high > layout.waiters
        or waiter_free > waiter_high
        or lines_used > layout.lines
    ):
        return "its queue counters are out of range"
    if (
        max(live, lease_high, heap_len) > layout.leases
        or (lease_free != NIL and lease_free >= lease_high)
        or procs_high > layout.procs
        or nodes_used > layout.nodes
        or chunk_high > layout.chunks
        or (chunk_free != NIL and chunk_free >= chunk_high)
    ):
        return "its counters are out of range"
    return None
