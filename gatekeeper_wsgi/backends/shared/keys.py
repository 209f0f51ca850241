"""The key table of a shared table: a two-choice hash table of nodes, the registry of
wildcard limits and their least-recently-used lists, eviction of idle keys.

A key's node lives in one of two buckets of 8 (``tags``: a 32-bit hash per node, 0 =
free), chosen by its blake2b digest, so a lookup reads 16 tags and compares at most a few
keys. Both buckets full: an idle node of the 16 is evicted, else the key is refused
(:class:`~.faults.NoRoom`). A wildcard limit has a registry entry (its path's digest, its
key count, the head and tail of its LRU list through the nodes' prev/next fields); at
``max_keys`` its least recently used idle key is evicted. An idle key has nothing in flight
and nothing left in its rate window: evicting any other would reset its limit.

:class:`KeyTable` works on the map, the layout, the journal and the windows (which free an
evicted key's chunks) it is given, nothing else: it can be driven alone
(``tests/test_shared_structures.py``).
"""

from __future__ import annotations

import array
import hashlib
import mmap
import struct
from collections.abc import Collection, Sequence
from itertools import compress

from gatekeeper_wsgi.backends.shared.faults import NoRoom
from gatekeeper_wsgi.backends.shared.journal import Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import (
    CHAIN,
    H_KEYGEN,
    H_NODES_USED,
    KEYGEN,
    LRU_SCAN,
    N_IDLE,
    N_INFLIGHT,
    N_KEY_LENGTH,
    N_LEN,
    N_NEXT,
    N_PREV,
    N_REG,
    NIL,
    NODE,
    NODE_HEAD,
    R_COUNT,
    R_HEAD,
    R_TAIL,
    REG,
    REG_SIZE,
    TAGS,
    U32,
    Layout,
    NodeView,
    node_view,
)
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.config import Limit

#: (key bytes + NUL, tag, first bucket, second bucket)
KeyEntry = tuple[bytes, int, int, int]
#: at a registry entry: the u64 digest of its limit path (0: free)
REG_DIGEST = struct.Struct("<Q")


def path_digest(path: str) -> int:
    """The registry's name for a wildcard limit path (never 0, which marks a free entry)."""
    digest = hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class KeyTable(Structure):
    """The keys of one mapped table: nodes, tags, the wildcard registry and LRU lists."""

    __slots__ = (
        "_buckets",
        "_hints",
        "_key_size",
        "_keys",
        "_nodes",
        "_registries",
        "_registry_off",
        "_regs",
        "_tags_off",
        "_windows",
    )

    def __init__(self, mm: mmap.mmap, layout: Layout, journal: Journal, windows: Windows) -> None:
        super().__init__(mm, layout, journal)
        self._windows = windows
        self._buckets = layout.buckets
        self._nodes = layout.nodes
        self._key_size = layout.key_size
        self._tags_off = layout.tags_off
        self._registry_off = layout.registry_off
        self._registries = layout.registry
        #: key -> its entry (a blake2b per key is ~1 µs)
        self._keys: dict[str, KeyEntry] = {}
        #: key bytes -> the node they were last found in (checked before use)
        self._hints: dict[bytes, int] = {}
        #: limit path -> (registry entry, digest), checked against the table at each use
        self._regs: dict[str, tuple[int, int]] = {}

    def key(self, key: str) -> KeyEntry:
        """(key bytes + NUL, tag, first bucket, second bucket), cached per key."""
        entry = self._keys.get(key)
        if entry is None:
            raw = key.encode("utf-8", "surrogateescape")
            if len(raw) >= self._key_size:
                # Longer than the table's keys (sized for the longest limit path when it
                # was made; a reload may add a longer one): stored as its first bytes and
                # a digest of the whole, as unique as the key, so a valid caller is never
                # refused for its length. Its node still counts under its own limit.
                whole = hashlib.blake2b(raw, digest_size=16).hexdigest().encode("ascii")
                raw = raw[: self._key_size - 2 - len(whole)] + b"~" + whole
            digest = int.from_bytes(hashlib.blake2b(raw, digest_size=16).digest(), "little")
            buckets = self._buckets
            first = (digest >> 32) % buckets
            second = (digest >> 80) % buckets
            if second == first and buckets > 1:
                second = (first + 1) % buckets
            entry = (raw + b"\0", (digest & 0xFFFFFFFF) or 1, first, second)
            if len(self._keys) >= 8192:
                self._keys = {}
            self._keys[key] = entry
        return entry

    def find(self, entry: KeyEntry) -> int:
        """The node holding the key of ``entry``, -1 if none does."""
        mm = self._mm
        raw, tag, first, second = entry
        tags_off = self._tags_off
        key_at = self._nodes_off + NODE_HEAD
        node_size = self._node_size
        size = len(raw)
        # Where the key was found last: still its node if the node's tag and key bytes say
        # so (a key is in one node at most; a freed node's tag is 0, never a key's tag).
        node = self._hints.get(raw, -1)
        if node >= 0:
            start = key_at + node * node_size
            if (
                U32.unpack_from(mm, tags_off + node * 4)[0] == tag
                and mm[start : start + size] == raw
            ):
                return node
        for bucket in (first, second):
            tags = TAGS.unpack_from(mm, tags_off + bucket * CHAIN * 4)
            if tag in tags:
                for position in range(CHAIN):
                    if tags[position] == tag:
                        node = bucket * CHAIN + position
                        start = key_at + node * node_size
                        if mm[start : start + size] == raw:
                            if len(self._hints) >= 8192:
                                self._hints = {}
                            self._hints[raw] = node
                            return node
        return -1

    def create(self, entry: KeyEntry, limit: Limit, now: float, pinned: list[int]) -> int:
        """A node for a new key: a free one of its two buckets, else an idle one there
        (never one of ``pinned``, the nodes this request already counts on). A wildcard
        limit at ``max_keys`` makes room first: a refusal then leaves no node behind."""
        mm = self._mm
        if limit.wildcard:
            self._make_room(limit, now, pinned)
        raw, tag, first, second = entry
        tags_off = self._tags_off
        tags1 = TAGS.unpack_from(mm, tags_off + first * CHAIN * 4)
        tags2 = TAGS.unpack_from(mm, tags_off + second * CHAIN * 4)
        free1, free2 = tags1.count(0), tags2.count(0)
        if free1 or free2:
            if free1 >= free2:
                node = first * CHAIN + tags1.index(0)
            else:
                node = second * CHAIN + tags2.index(0)
        else:
            node = self._chain_victim(first, second, now, pinned)
            self.remove(node)
        offset = self._nodes_off + node * self._node_size
        self._save(offset, NODE_HEAD + len(raw))
        NODE.pack_into(mm, offset, 0, len(raw) - 1, 0, NIL, NIL, 0, 0, NIL, NIL, 0.0)
        mm[offset + NODE_HEAD : offset + NODE_HEAD + len(raw)] = raw
        tag_at = tags_off + node * 4
        self._save(tag_at, 4)
        U32.pack_into(mm, tag_at, tag)
        self._journal.save_header()
        U32.pack_into(mm, H_NODES_USED, U32.unpack_from(mm, H_NODES_USED)[0] + 1)
        if limit.wildcard:
            self._track(node, limit)
        return node

    def _make_room(self, limit: Limit, now: float, pinned: list[int]) -> None:
        """Before a key joins a wildcard limit: at ``max_keys``, evict an idle key of it."""
        registry = self.registry(limit.path)
        at = self._registry_off + registry * REG_SIZE + R_COUNT
        count = U32.unpack_from(self._mm, at)[0]
        if count >= limit.max_keys:
            self._evict_lru(registry, limit, count, now, pinned)

    def _track(self, node: int, limit: Limit) -> None:
        """Count a node under a wildcard limit (``_make_room`` made room for it)."""
        mm = self._mm
        registry = self.registry(limit.path)  # an eviction may have freed its entry
        at = self._registry_off + registry * REG_SIZE
        offset = self._nodes_off + node * self._node_size
        self._save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_REG, registry + 1)
        self._lru_append(registry, node)
        U32.pack_into(mm, at + R_COUNT, U32.unpack_from(mm, at + R_COUNT)[0] + 1)

    def _untrack(self, registry: int, node: int) -> None:
        """Take a node out of its wildcard limit's list and count."""
        mm = self._mm
        self._lru_unlink(registry, node)
        at = self._registry_off + registry * REG_SIZE
        count = U32.unpack_from(mm, at + R_COUNT)[0] - 1
        if count <= 0:
            mm[at : at + REG_SIZE] = bytes(REG_SIZE)
        else:
            U32.pack_into(mm, at + R_COUNT, count)
        offset = self._nodes_off + node * self._node_size
        self._save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_REG, 0)

    def _chain_victim(self, first: int, second: int, now: float, pinned: list[int]) -> int:
        """An idle node of two full buckets to make room for a new key. Never a node with
        requests in flight or entries left in its rate window: evicting it would reset its
        limit (a spray of fresh keys could then free any caller), so without an idle one
        the new key is refused (``NoRoom``)."""
        mm = self._mm
        soonest: float | None = None
        for bucket in (first, second):
            for position in range(CHAIN):
                node = bucket * CHAIN + position
                view = node_view(mm, self._nodes_off + node * self._node_size)
                if node in pinned:
                    continue
                if view.idle(now):
                    return node
                if not view.inflight:
                    soonest = view.empty_at if soonest is None else min(soonest, view.empty_at)
        raise NoRoom(
            f"both hash buckets of a new key are full of keys in use (in flight or inside "
            f"a rate window); give the table more room with ?size=<keys> (it holds "
            f"{self._nodes})",
            None if soonest is None else soonest - now,
            "concurrency" if soonest is None else "rate",
        )

    def remove(self, node: int) -> None:
        """Take a node (nothing in flight) out of the table: window, LRU list, tag."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        view = node_view(mm, offset)
        if view.length:
            self._windows.free_chunks(view.first, view.last)
        registry = view.registry
        if registry:
            self._untrack(registry - 1, node)
        # Before the tag goes: a process that remembers this node for the key must look
        # again (raised, not journaled: a rollback that keeps the key costs a look only).
        KEYGEN.pack_into(mm, H_KEYGEN, KEYGEN.unpack_from(mm, H_KEYGEN)[0] + 1)
        tag_at = self._tags_off + node * 4
        self._save(tag_at, 4)
        U32.pack_into(mm, tag_at, 0)
        self._journal.save_header()
        U32.pack_into(mm, H_NODES_USED, U32.unpack_from(mm, H_NODES_USED)[0] - 1)

    # --- wildcard limits: the registry and least-recently-used lists ----------------------

    def registry(self, path: str) -> int:
        mm = self._mm
        base = self._registry_off
        cached = self._regs.get(path)
        if cached is not None:
            index, digest = cached
            if REG_DIGEST.unpack_from(mm, base + index * REG_SIZE)[0] == digest:
                return index
        else:
            digest = path_digest(path)
        free = -1
        for index in range(self._registries):
            stored = REG_DIGEST.unpack_from(mm, base + index * REG_SIZE)[0]
            if stored == digest:
                self._regs[path] = (index, digest)
                return index
            if not stored and free < 0:
                free = index
        if free < 0:
            raise NoRoom(
                f"no room for wildcard limit {path!r} (the table tracks "
                f"{self._registries} wildcard limits; a reload added more)"
            )
        at = base + free * REG_SIZE
        self._save(at, REG_SIZE)
        REG.pack_into(mm, at, digest, 0, NIL, NIL)
        self._regs[path] = (free, digest)
        return free

    def _evict_lru(
        self, registry: int, limit: Limit, count: int, now: float, pinned: list[int]
    ) -> None:
        """Make room under a wildcard limit at ``max_keys``: evict the least recently used
        idle key among its ``LRU_SCAN`` least recently used. A key in flight or inside its
        rate window is never evicted (that would reset its limit): with none idle, the new
        key is refused (``NoRoom``), as nginx refuses when its zone cannot allocate - by
        rate when some key is held by its window alone (its ``Retry-After``: until the
        first such window empties), else by concurrency, as the other backends refuse. The
        busy keys looked at move to the end of the list, so that long requests at its head
        do not hide the idle keys behind them from the next new key."""
        mm = self._mm
        at = self._registry_off + registry * REG_SIZE
        node = U32.unpack_from(mm, at + R_HEAD)[0]
        nodes_off, node_size = self._nodes_off, self._node_size
        soonest: float | None = None
        for _ in range(LRU_SCAN):
            if node == NIL:
                break
            view = node_view(mm, nodes_off + node * node_size)
            if node in pinned:
                node = view.newer
                continue
            if view.idle(now):
                self.remove(node)
                return
            if not view.inflight:
                soonest = view.empty_at if soonest is None else min(soonest, view.empty_at)
            following = view.newer
            if following != NIL:
                self._lru_unlink(registry, node)
                self._lru_append(registry, node)
            node = following
        raise NoRoom(
            f"wildcard limit {limit.path!r} tracks max_keys={count} keys and its least "
            "recently used are all in use (in flight or inside their rate window); raise "
            "its max_keys",
            None if soonest is None else soonest - now,
            "concurrency" if soonest is None else "rate",
        )

    def _lru_append(self, registry: int, node: int) -> None:
        """Put ``node`` at the end (most recently used) of the registry entry's list."""
        mm = self._mm
        at = self._registry_off + registry * REG_SIZE
        tail = U32.unpack_from(mm, at + R_TAIL)[0]
        self._save(at, REG_SIZE)
        offset = self._nodes_off + node * self._node_size
        self._save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_PREV, tail)
        U32.pack_into(mm, offset + N_NEXT, NIL)
        self._link(at, tail, N_NEXT, node, R_HEAD)
        U32.pack_into(mm, at + R_TAIL, node)

    def _lru_unlink(self, registry: int, node: int) -> None:
        """Take ``node`` out of the registry entry's list (its own links are left)."""
        mm = self._mm
        at = self._registry_off + registry * REG_SIZE
        offset = self._nodes_off + node * self._node_size
        prev = U32.unpack_from(mm, offset + N_PREV)[0]
        nxt = U32.unpack_from(mm, offset + N_NEXT)[0]
        self._save(at, REG_SIZE)
        self._link(at, prev, N_NEXT, nxt, R_HEAD)
        self._link(at, nxt, N_PREV, prev, R_TAIL)

    def _link(self, at: int, node: int, field: int, value: int, end: int) -> None:
        """Point ``node``'s link ``field`` (N_PREV, N_NEXT) at ``value``; with no node
        (NIL: the list's end) the registry entry's ``end`` (R_HEAD, R_TAIL) instead."""
        if node == NIL:
            U32.pack_into(self._mm, at + end, value)
            return
        offset = self._nodes_off + node * self._node_size
        self._save(offset, NODE_HEAD)
        U32.pack_into(self._mm, offset + field, value)

    def touch(self, node: int, limit: Limit, now: float, pinned: list[int]) -> None:
        """Mark a wildcard key most recently used in its limit's list. A key counted so far
        under another limit (an exact path a 'user' or 'header' value equals, or a pattern
        a reload replaced) moves to this limit's list, counted against its ``max_keys``."""
        mm = self._mm
        offset = self._nodes_off + node * self._node_size
        registry = self.registry(limit.path)
        current = U32.unpack_from(mm, offset + N_REG)[0] - 1
        if current == registry:
            if U32.unpack_from(mm, self._registry_off + registry * REG_SIZE + R_TAIL)[0] != node:
                self._lru_unlink(registry, node)
                self._lru_append(registry, node)
            return
        self._make_room(limit, now, [*pinned, node])
        if current >= 0:
            self._untrack(current, node)
        self._track(node, limit)

    # --- reading -------------------------------------------------------------------------

    def in_use(self) -> list[int]:
        """Every node holding a key, by one pass over the tags."""
        tags = array.array("I")
        tags.frombytes(self._mm[self._tags_off : self._tags_off + self._nodes * 4])
        return [node for node, tag in enumerate(tags) if tag]

    def window_live(self, now: float) -> bool:
        """Whether a key has a rate window entry not expired at ``now``: each node's
        window length and when it is empty, unpacked in C from the node column (a free
        node keeps them, and so counts too: the safe side). O(nodes)."""
        pick = struct.Struct(f"<{N_LEN}xI{N_IDLE - N_LEN - 4}xd{self._node_size - N_IDLE - 8}x")
        start = self._nodes_off
        with (
            memoryview(self._mm) as whole,
            whole[start : start + self._nodes * self._node_size] as column,
        ):
            return any(length and empty_at > now for length, empty_at in pick.iter_unpack(column))

    @property
    def capacity(self) -> int:
        """How many nodes (keys) the table has."""
        return self._nodes

    def held(
        self, among: Collection[int] | None = None, *, idle: bool = False
    ) -> tuple[list[int], list[int], list[int]]:
        """The nodes holding a key with requests in flight (held or delayed; with
        ``idle``, every node holding a key), of ``among`` or of the whole table: their
        indexes, counts and registry fields (entry + 1, 0: not a wildcard key), in node
        order.

        The whole table is read column by column, a strided slice of the map per field,
        never a struct per node: a status read with 100 000 keys in flight must not make
        100 000 objects (in one process holding those requests, their garbage collection
        alone took a second on every other read)."""
        mm = self._mm
        nodes_off, node_size = self._nodes_off, self._node_size
        if among is not None:  # a few nodes: field by field
            picked = sorted(among)
            at = [nodes_off + node * node_size for node in picked]
            counts = [U32.unpack_from(mm, offset + N_INFLIGHT)[0] for offset in at]
            registries = [U32.unpack_from(mm, offset + N_REG)[0] for offset in at]
            keep = [1] * len(picked) if idle else counts
            return (
                list(compress(picked, keep)),
                list(compress(counts, keep)),
                list(compress(registries, keep)),
            )
        count = self._nodes
        tags = array.array("I")
        tags.frombytes(mm[self._tags_off : self._tags_off + count * 4])
        if (count - tags.count(0)) * _SPARSE < count:
            # Few keys: only their nodes are read, whose pages their writes made. Every
            # node's column would read the holes of a sparse file too, and on tmpfs a
            # read of a hole through a shared map is a page taken (a status read of a
            # table of 2 keys took 28 MB).
            return self.held(list(compress(range(count), tags)), idle=idle)
        if nodes_off % 4 or node_size % 4:  # not this version's layout: field by field
            fields = [NODE.unpack_from(mm, nodes_off + node * node_size) for node in range(count)]
            counts = [field[0] for field in fields]
            return _picked(tags, counts, [field[6] for field in fields], idle)
        start, stride = nodes_off // 4, node_size // 4
        stop = start + count * stride
        with memoryview(mm) as whole, whole.cast("I") as words:
            counts = words[start + N_INFLIGHT // 4 : stop : stride].tolist()
            # The registry fields are read only for the nodes picked, through a view.
            with words[start + N_REG // 4 : stop : stride] as column:
                return _picked(tags, counts, column, idle)

    def raw_keys(self, nodes: list[int]) -> list[bytes]:
        """The keys of ``nodes`` as the table holds them (UTF-8, whose byte order is the
        keys' order), read without a struct per node."""
        mm = self._mm
        base, size = self._nodes_off, self._node_size
        head = base + NODE_HEAD
        if base % 2 or size % 2:  # not this version's layout: the u16 length byte by byte
            at = [base + node * size + N_KEY_LENGTH for node in nodes]
            lengths = [mm[start] | mm[start + 1] << 8 for start in at]
        else:
            # the key's length: the u16 at N_KEY_LENGTH (native order is little-endian
            # here, as the table is: see layout), through a strided view of that column
            first, stride = (base + N_KEY_LENGTH) // 2, size // 2
            with (
                memoryview(mm) as whole,
                whole.cast("H") as halves,
                halves[first : first + self._nodes * stride : stride] as column,
            ):
                lengths = [column[node] for node in nodes]
        return [
            mm[start : start + length]
            for start, length in zip([head + node * size for node in nodes], lengths, strict=True)
        ]

    def view(self, node: int) -> tuple[NodeView, str]:
        """A node's fields and key."""
        offset = self._nodes_off + node * self._node_size
        view = node_view(self._mm, offset)
        raw = self._mm[offset + NODE_HEAD : offset + NODE_HEAD + view.key_length]
        return view, raw.decode("utf-8", "surrogateescape")

    def lookup(self, key: str) -> tuple[str, NodeView] | None:
        """(key, node fields) of a key the table holds, else None."""
        try:
            node = self.find(self.key(key))
        except NoRoom:  # longer than any key the table can hold
            return None
        return None if node < 0 else (key, self.view(node)[0])

    def registries(self) -> list[tuple[int, int, int]]:
        """(entry, path digest, keys) of every wildcard limit the registry tracks."""
        base = self._registry_off
        regs = self._mm[base : base + self._registries * REG_SIZE]
        return [
            (index, digest, count)
            for index, (digest, count, _, _) in enumerate(REG.iter_unpack(regs))
            if digest
        ]


#: below one node in this many holding a key, KeyTable.held reads the keys' nodes alone
#: (at one in 8, with ~20 nodes a page, nearly every page holds a key: made already)
_SPARSE = 8


def _picked(
    tags: Sequence[int], counts: list[int], registries: Sequence[int], idle: bool
) -> tuple[list[int], list[int], list[int]]:
    """The nodes holding a key (their tag) and, unless ``idle``, something in flight,
    with their counts and registry fields: picked in C by the tags or the counts (a free
    node's count is not zero only in a damaged table), the other looked at only for the
    few picked."""
    if idle:
        nodes = list(compress(range(len(counts)), tags))
    else:
        nodes = [node for node in compress(range(len(counts)), counts) if tags[node]]
    return nodes, [counts[node] for node in nodes], [registries[node] for node in nodes]
