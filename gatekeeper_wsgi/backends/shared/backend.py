"""The host-wide backend: every counter, lease and rate window of all worker processes of
one host in one memory-mapped file, guarded by an open-file-description lock.

``backend = "shared:///run/gatekeeper/shop.shm"``. Linux only (``F_OFD_SETLKW``). The
table is sized from the configuration when the file is created; ``?size=``, ``?leases=``,
``?procs=`` and ``?windows=`` in the URL override the derived sizes, ``?mode=0660`` lets the
processes of one group share it.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import heapq
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NoReturn, TypeVar
from urllib.parse import parse_qsl, urlsplit

from gatekeeper_wsgi.adaptive import ALGORITHMS, AdaptiveReport, AdaptiveSpec, Controller
from gatekeeper_wsgi.backends.base import (
    NO_WATCH,
    PASSING,
    TOP_KEYS,
    Backend,
    Census,
    Denial,
    Grant,
    KeyUsage,
    LimitTotals,
    Slot,
)
from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.filelock import file_size, lock_file, unlock_file
from gatekeeper_wsgi.backends.shared.files import (
    DEFAULT_MODE,
    check_mode,
    open_private,
)
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK, Journal, Transaction
from gatekeeper_wsgi.backends.shared.layout import (
    CHAIN,
    CHUNK_FMT,
    CHUNK_SIZE,
    CHUNK_STAMPS,
    CHUNK_STAMPS_FMT,
    F64,
    F_GAUGE,
    G_HOT,
    G_STATE,
    GAUGE_HEAD,
    GAUGE_HOT,
    GAUGE_SIZE,
    GAUGE_SPEC,
    GAUGE_STATE,
    H_BOOT,
    H_CHECK,
    H_CHUNK_CHECK,
    H_CHUNK_FREE,
    H_EPOCH,
    H_EPOCH_COPY,
    H_JLEN,
    H_LEASE_FREE,
    H_LIVE,
    H_NODES_USED,
    H_PROCS_HIGH,
    H_WAITING,
    HEADER,
    LRU_SCAN,
    MAGIC,
    MAGIC_INIT,
    MAGIC_VERSION,
    MAX_REFS,
    MUT_END,
    N_FIRST,
    N_FLAGS,
    N_IDLE,
    N_LAST,
    N_LEN,
    N_NEXT,
    N_OFFSET,
    N_PREV,
    N_REG,
    NIL,
    NODE,
    NODE_HEAD,
    PROC,
    PROC_SIZE,
    R_COUNT,
    R_HEAD,
    R_TAIL,
    REG,
    REG_SIZE,
    STATE,
    TAGS,
    U32,
    VERSION,
    Layout,
    chunk_check,
    fixed_digest,
    header_problem,
)
from gatekeeper_wsgi.backends.shared.leases import Leases
from gatekeeper_wsgi.backends.shared.liveness import (
    BOOT_ID,
    DEEP_CHECK_EVERY,
    is_dead,
    proc_stat,
)
from gatekeeper_wsgi.backends.shared.tickets import Lines, Place, SharedLine
from gatekeeper_wsgi.config import Config, Limit, Rate
from gatekeeper_wsgi.errors import BackendError, CapacityError, ConfigError

__all__ = ["LayoutMismatch", "SharedBackend"]

logger = logging.getLogger("gatekeeper")

_T = TypeVar("_T")
# A gauge's baseline (min_latency, a double of its state), read alone by the fast path.
_DOUBLE = struct.Struct("<d")
_BASELINE_OFF = _DOUBLE.size * Controller.STATE.index("min_latency")


class LayoutMismatch(BackendError):
    """The file holds a table of another layout that live leases still use."""


class _Recreated(BackendError):
    """An operation found the table damaged and re-created it; the operation may be run
    again on the new table."""


class _Untracked(Exception):
    """A key could not be tracked, found before anything was counted: what the request
    changed so far (keys found, created or touched, windows purged, busy keys moved down
    the LRU list) is what a Denial keeps too, so it is committed, not rolled back."""

    def __init__(self, error: CapacityError) -> None:
        super().__init__(error.what)
        self.error = error


def _path_digest(path: str) -> int:
    """The registry's name for a wildcard limit path (never 0, which marks a free entry)."""
    digest = hashlib.blake2b(path.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _idle(fields: tuple[Any, ...], now: float) -> bool:
    """Whether an unpacked node may be evicted: nothing in flight (a delayed release keeps
    its count) and nothing left in its rate window (its last entry has expired)."""
    return not fields[0] and (not fields[5] or fields[9] <= now)


def _lease_slot(slots: Sequence[Slot]) -> int:
    """The slot a request is refused by when the host-wide lease (or process) table is
    full, which no single limit owns: the most specific enforced concurrency limit (the
    request would hold a slot there), else the most specific enforced limit, else 0."""
    concurrency = enforced = 0
    for index, slot in enumerate(slots):
        if slot.enforce:
            enforced = index
            if slot.limit.concurrency is not None:
                concurrency = index
    if slots and slots[concurrency].enforce and slots[concurrency].limit.concurrency is not None:
        return concurrency
    return enforced


class _SharedGrant(Grant):
    __slots__ = ("admitted", "epoch", "lease", "nodes", "pid", "sample", "serial", "stamps")

    def __init__(
        self,
        slots: Sequence[Slot],
        shadowed: tuple[int, ...],
        epoch: int,
        pid: int,
        lease: int,
        serial: int,
        nodes: list[int],
        stamps: list[float | None],
    ) -> None:
        super().__init__(slots, shadowed)
        self.epoch = epoch
        self.pid = pid
        self.lease = lease
        self.serial = serial
        self.nodes = nodes
        #: per slot: the window entry reserved at admission (None: no rate / not recorded)
        self.stamps = stamps
        #: when it was admitted (an adaptive limit's latency runs from here)
        self.admitted = 0.0
        #: (faulty, now) of :meth:`SharedBackend.observe`: fed to the adaptive limits by
        #: the release, under the lock that release takes anyway
        self.sample: tuple[bool, float] | None = None


_INSTANCES: weakref.WeakSet[SharedBackend] = weakref.WeakSet()
#: serialises noticing a fork that bypassed the at-fork hook (threads race to notice)
_FORK_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()
    for backend in list(_INSTANCES):
        backend._drop_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SharedBackend(Backend):
    """Counters of all worker processes of a host in one memory-mapped file.

    Use it where a WSGI server runs several worker processes (gunicorn, uWSGI): the limits
    hold for the host, not per process::

        gk = GateKeeper({"backend": "shared:///run/gatekeeper/shop.shm",
                         "limits": {"shop": {"concurrency": 100}}})

    Put the file on a tmpfs, in a directory only the application's user may write
    (``/run/<app>/``, ``$XDG_RUNTIME_DIR``): it is scratch state, and on a disk filesystem
    the kernel would keep writing its pages back. Every process must count time
    by the same clock (the engine's default, ``time.monotonic``, is system-wide on Linux).
    Call :meth:`close` when done (``GateKeeper.close()`` does).

    **Semantics** are those of :class:`~gatekeeper_wsgi.backends.memory.MemoryBackend`:
    all-or-nothing admission, exact concurrency, an exact sliding log per rate key, ``count``
    reservations confirmed or given back at release, shadow slots, delayed decreases,
    ``max_keys`` evicting only idle keys (nothing in flight, nothing left in the rate
    window), looked for among the ``LRU_SCAN`` least recently used.

    **Capacity** is never an outage: when the table cannot track what a request needs (a
    key: both buckets or ``max_keys`` full of keys that are not idle; a lease; a window
    entry; a process slot) ``acquire`` raises :class:`~gatekeeper_wsgi.errors.CapacityError`
    for the slot that could not be tracked, having rolled the request back, and the engine
    refuses it by that limit. The lease and process tables belong to no limit: the most
    specific enforced concurrency slot is blamed (else the most specific enforced slot).

    **Locking.** Every read and write of the table happens under one exclusive Linux
    open-file-description lock (``F_OFD_SETLKW`` on byte 0) plus a ``threading.Lock`` (OFD
    locks belong to the open file description, which the threads of a process share). The
    kernel drops an OFD lock when its last descriptor closes, so a killed process cannot
    leave it held; each process opens the file itself (the descriptor inherited across
    ``fork`` is closed in the child at once). The lock is taken and dropped without letting
    go of the GIL while it is free (:mod:`.filelock`: a thread waiting for the GIL back
    while holding the locks stalled every other thread and process behind it).

    **The file is private.** It is created ``0600`` (``?mode=0660``: group too) with
    ``O_CREAT|O_EXCL|O_NOFOLLOW``; an existing file is used only when ``fstat`` on the opened
    descriptor shows a regular file of this user (or of the group, with ``?mode=0660``) that
    nobody else may write; anything else is a ConfigError naming the path and why.

    **Damage.** Each lock acquisition checks the file size (one ``lseek``: the map is never
    touched past the end of a truncated file, which would be SIGBUS), the magic and the
    epoch. A new epoch is a table another process re-created only if the checksum of the
    fields written at creation (at 72) holds; another layout version only if this process
    holds no lease of the table (no version re-creates a table with live leases). Rolling a
    journal back checks every entry first. The header's counters are checked where they
    are used, also when garbage left them in range: a free or never used lease, heap entry
    or process slot must look free, the window chunk counters carry a check word (at 52).
    A damaged table is re-created with one ERROR and the operation runs again on it;
    anything else that goes wrong leaves as a BackendError. Not detected: in-range garbage
    in the live-lease count (read by ``usage()`` only) and the key count (shown only), and
    garbage in the key, lease or window regions (their values are range-checked where
    used, not checksummed).

    **Crash safety.** Each update is a transaction: before a byte range is changed, its old
    bytes go to the undo journal; the journal is emptied when the update is complete. The
    next process to take the lock after one was killed mid-update rolls the journal back,
    so the table never holds half an admission. Unexpected errors roll back the same way.

    **Leases and reclaim.** Each admission holds a lease: (owner pid, serial, expiry, node
    references). Release deletes it; a delayed decrease makes it ownerless with an expiry
    (a min-heap by expiry matures them during later calls). Leases of processes that died
    are reclaimed whenever a request would be rejected (it is then decided again) and on
    ``inflight()``. *Reclaim time*: none once the dead process is reaped (``kill(pid, 0)``
    fails) - a SIGKILLed gunicorn worker's slots come back before any request is refused
    for lack of them; at most ``DEEP_CHECK_EVERY`` (10 ms) while it is an unreaped zombie,
    or when its pid was reused by a newer process (both are read from ``/proc``, at most
    that often per backend on the rejection path).

    **Totals** for the status page and Prometheus (:meth:`totals`) are read from the live
    leases (each request in flight, held or delayed, holds one) and the wildcard registry's
    key counts: O(limits + leases in use), never a pass over the key table.

    **Adaptive limits** (``concurrency = "auto"``): one ``adaptive.Controller`` per key,
    kept in the key's gauge next to its counters, so every process of the host feeds one
    window and enforces one limit. An admission reads the limit in force under the lock
    that counts the key (in flight never exceeds it; when it drops, nothing admitted is
    cut off). :meth:`observe` only notes the sample on the grant; :meth:`release` feeds it
    under the lock it takes anyway: in place while no window is due (the window's sums),
    through the whole controller (``Controller.restore``/``state``) when one is.

    **Queues** are FIFO across the processes of the host: one line per concrete limit
    path in the table (``queue.size`` bounds it host-wide), a newcomer refused while the
    line has waiters, only the first waiter admitted; waiters are woken by the release
    that frees their slot, not by polling (:mod:`.tickets`).

    **Layout**: the byte table is :mod:`gatekeeper_wsgi.backends.shared.layout`'s docstring.

    Writes that other processes read concurrently need no special care: nobody reads
    without the lock. The file is sparse: pages of unused nodes and windows cost nothing.
    """

    local = False
    adaptive_limits = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        size: int | None = None,
        leases: int | None = None,
        procs: int | None = None,
        windows: int | None = None,
        mode: int = DEFAULT_MODE,
    ) -> None:
        self.path = os.fspath(path)
        check_mode(self.path, mode)
        self._mode = mode
        self._wanted = Layout.derive(config, size=size, leases=leases, procs=procs, windows=windows)
        #: no configuration: an observer that takes the table as it is
        self._adopt = config is None and (size, leases, procs, windows) == (None,) * 4
        self._tlock = threading.Lock()
        self._transaction = Transaction(self._enter, self._fail, self._leave)
        self._line = SharedLine(self)
        self._pid = os.getpid()
        #: id(spec) -> (spec, its numbers in a gauge)
        self._prints: dict[int, tuple[AdaptiveSpec, tuple[int, int, int, int]]] = {}
        #: adds a sample to a window loaded from a gauge, reports a gauge (under the lock)
        self._scratch = Controller(AdaptiveSpec(), 0.0)
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._closed = False
        #: (device, inode) of the file last mapped as a valid table: garbage found there
        #: later is damage to re-create, not a foreign file to leave alone
        self._ours: tuple[int, int] | None = None
        self._last_layout: Layout | None = None
        self._total = 0
        self._reset_state()
        self._open()
        _INSTANCES.add(self)
        # Attach now, so a bad file is reported at start-up; a layout still in use by
        # live leases is retried on every call (BackendError meanwhile).
        try:
            self._enter()
        except LayoutMismatch as exc:
            logger.error("gatekeeper: %s", exc)
        except BackendError as exc:
            self.close()
            raise ConfigError("backend", str(exc)) from exc
        else:
            self._leave()

    @property
    def label(self) -> str:
        return f"shared table {self.path!r}"

    @classmethod
    def from_url(cls, url: str, config: Config | None = None) -> SharedBackend:
        """``shared:///absolute/path/file`` (or ``shared://relative/path``), with optional
        ``?size=<keys>&leases=<n>&procs=<n>&windows=<chunks>`` overriding the sizes derived
        from ``config`` (a chunk holds 7 rate window entries), and ``?mode=0660`` (octal)
        for a table shared by the processes of one group."""
        path, options = cls._parse_url(url)
        return cls(path, config, **options)

    @classmethod
    def check_url(cls, url: str) -> None:
        cls._parse_url(url)

    @staticmethod
    def _parse_url(url: str) -> tuple[str, dict[str, int]]:
        """The file path and options of a ``shared://`` URL; ConfigError if invalid."""
        parts = urlsplit(url)
        path = parts.netloc + parts.path
        if not path:
            raise ConfigError(
                "backend", f"expected 'shared:///path/to/file', got {url!r} (no file path)"
            )
        options: dict[str, int] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in ("size", "leases", "procs", "windows", "mode"):
                raise ConfigError(
                    "backend",
                    f"unknown option {name!r} in {url!r}; expected size, leases, procs, "
                    f"windows, mode",
                )
            try:
                number = int(value, 8 if name == "mode" else 10) if len(value) < 12 else 0
            except ValueError:
                number = 0
            if number < 1 or number >= 1 << 31:
                expected = "an octal mode such as 0660" if name == "mode" else "a positive integer"
                raise ConfigError(
                    "backend", f"option {name}={value[:40]!r} in {url[:200]!r}: expected {expected}"
                )
            options[name] = number
        if "mode" in options:
            check_mode(path, options["mode"])
        return path, options

    # --- file, map, lock ------------------------------------------------------------------

    def _reset_state(self) -> None:
        self._layout: Layout | None = None
        self._epoch = 0
        #: leases this process holds (admitted, not yet released) in the table of epoch
        #: ``_held_epoch``: while it holds any, no other layout version re-creates it
        self._held = 0
        self._held_epoch = 0
        self._keys: dict[str, tuple[bytes, int, int, int]] = {}
        #: key bytes -> the node they were last found in (checked before use)
        self._hints: dict[bytes, int] = {}
        self._regs: dict[str, tuple[int, int]] = {}
        self._proc_index = -1
        self._proc_epoch = 0
        self._start_time: int | None = None
        self._last_deep_check = -1.0

    def _open(self) -> None:
        self._fd = open_private(self.path, self._mode)

    def _unmap(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._layout = None
        self._epoch = 0

    def _drop_inherited(self) -> None:
        """In a forked child: the descriptor is the parent's open file description, whose
        lock the parent may hold. Close it now; the child opens its own on first use."""
        mm, fd = self._mm, self._fd
        self._mm = None
        self._fd = -1
        self._tlock = threading.Lock()
        self._pid = os.getpid()
        self._reset_state()
        if mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                mm.close()
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _enter(self) -> mmap.mmap:
        """Take the thread and file locks and return the attached map."""
        if self._closed:
            raise BackendError(f"the shared table {self.path!r} is closed")
        if os.getpid() != self._pid:
            with _FORK_LOCK:
                if os.getpid() != self._pid:
                    self._drop_inherited()
        self._tlock.acquire()
        try:
            if self._fd < 0:
                self._open()
            lock_file(self._fd)
        except (OSError, ConfigError) as exc:
            self._tlock.release()
            raise self.backend_error(exc) from exc
        try:
            try:
                mm = self._mm
                # Touching the map of a file cut shorter than it is SIGBUS: check the size
                # first (one lseek, ~0.3 µs). This catches a truncation between two updates;
                # a writer ignoring the lock can still cut the file inside one.
                if mm is None or file_size(self._fd) < self._total:
                    self._attach()
                else:
                    magic, version, jlen, epoch = STATE.unpack_from(mm, 0)
                    if epoch != self._epoch or magic != MAGIC or version != VERSION:
                        self._attach()
                    elif jlen:
                        self._recover(jlen)
            except Damaged as exc:
                self._recreate(str(exc))
            mm = self._mm
            assert mm is not None
            return mm
        except BaseException as exc:
            self._leave()
            if isinstance(exc, Exception) and not isinstance(exc, PASSING):
                raise self.backend_error(exc) from exc
            raise

    def _leave(self) -> None:
        try:
            if self._fd >= 0:
                unlock_file(self._fd)
        finally:
            self._tlock.release()

    def _attach(self) -> None:
        """Map the table the file holds, or (re)initialise it. Under the file lock. Reads
        the header with ``pread``, never through a map that could reach past the end."""
        previous = self._epoch
        held = self._held
        self._unmap()
        fd = self._fd
        info = os.fstat(fd)
        size = info.st_size
        ours = (info.st_dev, info.st_ino) == self._ours
        head = os.pread(fd, HEADER, 0) if size else b""
        head = head.ljust(HEADER, b"\0")
        magic, version = MAGIC_VERSION.unpack_from(head, 0)
        wanted = self._wanted
        if magic == MAGIC and version == VERSION:
            layout = Layout.read(head)
            problem = (
                "its geometry is invalid" if layout is None else header_problem(layout, head, size)
            )
            if problem is not None:
                self._recreate(problem)
                return
            assert layout is not None
            if head[H_BOOT : H_BOOT + 16] != BOOT_ID:
                # Written before a reboot: its processes are gone and its clock is void.
                self._initialise(layout.merged(wanted), size)
                return
            self._map(layout, head)
            jlen = U32.unpack_from(head, H_JLEN)[0]
            if jlen:
                self._recover(jlen)
            if self._adopt or layout.covers(wanted):
                return
            live = self._live_leases_after_reclaim()
            if live:
                self._unmap()
                raise LayoutMismatch(
                    f"shared table {self.path!r} holds {layout.describe()}, too small for "
                    f"this configuration ({wanted.describe()}), and {live} leases are live; "
                    f"it is re-created as soon as none is"
                )
            logger.warning(
                "gatekeeper: re-creating shared table %s for this configuration (%s)",
                self.path,
                wanted.describe(),
            )
            self._initialise(layout.merged(wanted), size)
        elif magic == MAGIC_INIT:
            self._initialise(wanted, size)  # a process died initialising it
        elif not head.strip(b"\0"):
            if ours:
                self._recreate(f"it was zeroed or cut to {size} bytes")
            else:
                self._initialise(wanted, size)  # new, or created empty by an operator
        elif (
            magic == MAGIC
            and ours
            and (held or previous in struct.unpack_from("<Q40xQ", head, H_EPOCH))
        ):
            # Another layout version re-creates the table only when it has no live leases
            # (the count at 24 is where every version keeps it), and with a new epoch: this
            # process holding leases of it, or the epoch unchanged, means it is ours with
            # its version field overwritten.
            self._recreate(f"its layout version was overwritten ({version})")
        elif magic == MAGIC:
            live = U32.unpack_from(head, H_LIVE)[0]
            if live:
                raise LayoutMismatch(
                    f"shared table {self.path!r} has layout version {version} (this is "
                    f"{VERSION}) and {live} live leases; it is re-created as soon as none is"
                )
            logger.warning(
                "gatekeeper: re-creating shared table %s (layout version %d -> %d)",
                self.path,
                version,
                VERSION,
            )
            self._initialise(wanted, size)
        elif ours:
            # The file this process has used as its table: garbage over its header.
            self._recreate(f"its header was overwritten (magic {magic!r})")
        else:
            raise BackendError(
                f"{self.path!r} is not a gatekeeper shared table (magic {magic!r}); "
                f"refusing to overwrite it"
            )

    def _recreate(self, reason: str) -> None:
        """Initialise a damaged table afresh, with one ERROR. Under the file lock. Requests
        in flight in the old table are not counted in the new one (their releases are
        ignored); every request from now on is."""
        logger.error(
            "gatekeeper: shared table %s is damaged: %s; re-creating it (requests in flight "
            "now are not counted in the new table)",
            self.path,
            reason,
        )
        last = self._last_layout
        self._unmap()
        layout = self._wanted if last is None else last.merged(self._wanted)
        self._initialise(layout, os.fstat(self._fd).st_size)

    def _map(self, layout: Layout, head: bytes) -> None:
        self._mm = mmap.mmap(self._fd, layout.total)
        self._layout = self._last_layout = layout
        self._total = layout.total
        info = os.fstat(self._fd)
        self._ours = (info.st_dev, info.st_ino)
        self._epoch = struct.unpack_from("<Q", head, H_EPOCH)[0]
        if self._epoch != self._held_epoch:
            self._held = 0
            self._held_epoch = self._epoch
        self._journal = Journal(self._mm, layout, self.path)
        self._leases = Leases(self._mm, layout, self._journal)
        self._keys = {}
        self._hints = {}
        self._regs = {}
        self._proc_index = -1
        g = layout
        self._buckets = g.buckets
        self._key_size = g.key_size
        self._node_size = g.node_size
        self._tags_off = g.tags_off
        self._nodes_off = g.nodes_off
        self._procs_off = g.procs_off
        self._registry_off = g.registry_off
        self._gauges_off = g.gauges_off
        self._journal_off = g.journal_off
        self._journal_cap = g.journal
        self._chunks_off = g.chunks_off
        self._chunks = g.chunks
        self._lines = Lines(self._mm, layout, self._journal, self._line.bell.ring)

    def _initialise(self, layout: Layout, size: int) -> None:
        """Write an empty table of ``layout`` into the file (``size`` bytes now). Under the
        file lock, which every process holds to touch its map: none can meet the file
        while it is cut to nothing and grown back."""
        fd = self._fd
        if size:
            # All zero again, and its pages given back, in two calls: the checks of the
            # lease and process tables rely on nothing past their bump marks ever having
            # been written since the table was created.
            os.ftruncate(fd, 0)
        # Never shrink: another process may still map the old, larger size.
        os.ftruncate(fd, max(size, layout.total))
        self._map(layout, bytes(HEADER))
        mm = self._mm
        assert mm is not None
        mm[0:8] = MAGIC_INIT
        U32.pack_into(mm, H_LEASE_FREE, NIL)
        mm[H_CHUNK_FREE:MUT_END] = U32.pack(NIL) + bytes(4)
        U32.pack_into(mm, H_CHUNK_CHECK, chunk_check(mm[H_CHUNK_FREE:MUT_END]))
        mm[H_BOOT : H_BOOT + 16] = BOOT_ID
        layout.write(mm)
        epoch = secrets.randbits(63) | 1
        struct.pack_into("<Q", mm, H_EPOCH_COPY, epoch)
        struct.pack_into("<Q", mm, H_EPOCH, epoch)
        head = bytearray(mm[0:HEADER])
        MAGIC_VERSION.pack_into(head, 0, MAGIC, VERSION)
        struct.pack_into("<Q", mm, H_CHECK, fixed_digest(head))
        MAGIC_VERSION.pack_into(mm, 0, MAGIC, VERSION)
        self._epoch = epoch
        logger.info("gatekeeper: initialised shared table %s: %s", self.path, layout.describe())

    def close(self) -> None:
        """Unmap and close the file. Leases this process still holds stay in the table
        (they are reclaimed when the process exits)."""
        if self._closed:
            return
        with self._tlock:
            self._closed = True
            _INSTANCES.discard(self)
            mm, fd = self._mm, self._fd
            self._mm = None
            self._fd = -1
            if mm is not None:
                mm.close()
            if fd >= 0:
                os.close(fd)
            self._line.bell.close()

    # --- the undo journal -----------------------------------------------------------------

    def _rollback(self) -> None:
        if self._mm is not None:
            self._journal.rollback()

    def _recover(self, jlen: int) -> None:
        self._journal.undo(jlen)
        logger.warning(
            "gatekeeper: a process died while updating shared table %s; its unfinished "
            "update was rolled back",
            self.path,
        )

    # --- public operations ----------------------------------------------------------------

    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        return self.acquire_turn(slots, now, None)

    def acquire_turn(self, slots: Sequence[Slot], now: float, turn: Place | None) -> Grant | Denial:
        """:meth:`acquire` for ``turn``, the place of the first waiter of a line
        (:mod:`.tickets`), which lines do not bar: a grant takes it out of its line. Errors
        leave as BackendError, as the transaction wraps them."""
        try:
            result, owners = self._locked(slots, now, keep=True, turn=turn)
        except _Recreated:  # decided again on the new table
            result, owners = self._locked(slots, now, keep=True)
        if owners and isinstance(result, Denial) and self._reap(owners):
            result, _ = self._locked(slots, now, keep=True, turn=turn)
        return result

    def waiting_line(self) -> SharedLine:
        return self._line

    @contextlib.contextmanager
    def lines(self) -> Iterator[tuple[Lines, int]]:
        """The queues' lines and the table's epoch, under the lock, for
        :class:`.tickets.SharedLine`; what it changed is committed at the end."""
        with self._transaction:
            yield self._lines, self._epoch
            self._journal.commit()

    def waiters(self, path: str) -> list[tuple[int, int]]:
        """(pid, ticket) of the waiters in the line of concrete path ``path``, first first:
        the host's queue of that path."""
        with self.lines() as (lines, _):
            return lines.places(path)

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """Whether ``acquire`` would admit now, read atomically: the admission is worked
        out under the lock and rolled back."""
        try:
            result, owners = self._locked(slots, now, keep=False)
        except _Recreated:
            result, owners = self._locked(slots, now, keep=False)
        if owners and isinstance(result, Denial) and self._reap(owners):
            result, _ = self._locked(slots, now, keep=False)
        return result if isinstance(result, Denial) else None

    def _locked(
        self, slots: Sequence[Slot], now: float, *, keep: bool, turn: Place | None = None
    ) -> tuple[Grant | Denial, list[tuple[int, int, int]]]:
        with self._transaction as mm:
            self._mature(now)
            if keep:
                try:
                    self._register()
                except NoRoom as exc:
                    raise self._capacity(_lease_slot(slots), exc) from None
                self._journal.commit()
                if turn is None and U32.unpack_from(mm, H_WAITING)[0]:
                    barred = self._lines.barred(slots)
                    if barred is not None:
                        return barred, []  # a newcomer joins the line instead
            try:
                result = self._admit(slots, now)
            except _Untracked as untracked:
                if keep:
                    self._journal.commit()
                else:
                    self._rollback()
                raise untracked.error from None
            owners = self._owners() if isinstance(result, Denial) else []
            if keep:
                if turn is not None:
                    self._lines.settle(turn, slots, result)
                self._journal.commit()
                self._held += isinstance(result, _SharedGrant)
            else:
                self._rollback()
            return result, owners

    def _fail(self, exc: BaseException) -> NoReturn:
        """Roll the unfinished update back and raise what may leave a backend: the
        exception itself when it is a CapacityError or BackendError (or not an Exception),
        else a BackendError wrapping it. Values no correct process writes (an index out of
        range, a corrupt journal) mean a damaged table: it is re-created first. Under the
        lock."""
        try:
            self._rollback()
        except Exception as undo_error:
            exc = Damaged(f"its journal cannot be rolled back ({undo_error})")
        if isinstance(exc, PASSING) or not isinstance(exc, Exception):
            raise exc
        if isinstance(exc, (Damaged, IndexError, ValueError, OverflowError, struct.error)):
            try:
                self._recreate(str(exc) or repr(exc))
            except Exception as again:
                raise self.backend_error(again) from exc
            raise _Recreated(
                f"shared table {self.path!r} was damaged ({exc}); it was re-created"
            ) from exc
        raise self.backend_error(exc) from exc

    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        assert isinstance(grant, _SharedGrant)
        if not grant.claim():
            return
        try:  # noqa: SIM105 - contextlib.suppress costs 0.4 µs on every release
            self._release_locked(grant, status, delay, now)
        except _Recreated:
            pass  # the new table does not hold the grant

    def _release_locked(
        self, grant: _SharedGrant, status: int | None, delay: float, now: float
    ) -> None:
        with self._transaction as mm:
            if grant.epoch == self._epoch:
                self._release(grant, status, delay, now)
                self._journal.commit()
                self._held = max(0, self._held - 1)
            self._mature(now)
            if U32.unpack_from(mm, H_WAITING)[0]:
                self._lines.announce(grant.slots)

    def inflight(self, now: float) -> dict[str, int]:
        return self._observed(now, self._read_inflight)

    def totals(
        self,
        limits: Sequence[Limit],
        now: float,
        *,
        top: int = TOP_KEYS,
        watch: Mapping[str, Collection[str]] = NO_WATCH,
    ) -> dict[str, LimitTotals]:
        """Per limit, from the live leases (every request in flight, held or delayed,
        holds one) and the wildcard registry's key counts: O(limits + leases in use +
        watched keys) under the lock, never a pass over the key table."""
        return self._observed(now, lambda: self._read_totals(limits, now, top, watch))

    def _observed(self, now: float, read: Callable[[], _T]) -> _T:
        """``read()`` under the lock, once due delays are applied and the leases of dead
        processes reclaimed (again on a table that had to be re-created)."""
        try:
            return self._observe(now, read)
        except _Recreated:
            return self._observe(now, read)

    def _observe(self, now: float, read: Callable[[], _T]) -> _T:
        with self._transaction:
            self._mature(now)
            owners = self._owners()
        self._reap(owners, deep=True)
        with self._transaction:
            return read()

    def next_due(self) -> float | None:
        try:
            self._enter()
        except BackendError:
            return None
        try:
            return self._leases.next_due()
        finally:
            self._leave()

    def delayed_pending(self) -> int:
        try:
            self._enter()
        except BackendError:
            return 0
        try:
            return self._leases.pending()
        finally:
            self._leave()

    def census(self, now: float) -> Census:
        self.inflight(now)  # matures due delays and reclaims dead processes' leases first
        usage = self.usage()
        # A live lease is a request in flight or a delayed release still holding its slots.
        return Census(usage["leases"] - usage["delayed"], usage["delayed"])

    def usage(self) -> dict[str, Any]:
        """How full the table is: keys, leases, delayed releases, processes, file size."""
        with self._transaction as mm:
            layout = self._layout
            assert layout is not None
            live, _, _, heap_len, _, _, nodes_used = struct.unpack_from("<7I", mm, H_LIVE)
            pids = [
                PROC.unpack_from(mm, self._procs_off + PROC_SIZE * i)[0]
                for i in range(self._procs_high())
            ]
            return {
                "path": self.path,
                "keys": nodes_used,
                "key_capacity": layout.nodes,
                "leases": live,
                "lease_capacity": layout.leases,
                "delayed": heap_len,
                "processes": sorted(pid for pid in pids if pid),
                "bytes": layout.total,
            }

    # --- admission ------------------------------------------------------------------------

    def _admit(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        mm = self._mm
        assert mm is not None
        nodes_off = self._nodes_off
        node_size = self._node_size
        nodes: list[int] = []
        shadowed: list[int] = []
        rate_full: list[int] = []
        adaptive = False
        for index, (key, limit, enforce) in enumerate(slots):
            try:
                entry = self._key(key)
                node = self._find(entry)
                if node < 0:
                    node = self._create(entry, limit, now, nodes)
                elif limit.wildcard:
                    self._touch(node, limit, now, nodes)
            except NoRoom as exc:
                raise _Untracked(self._capacity(index, exc)) from None
            offset = nodes_off + node * node_size
            concurrency: float | None = limit.concurrency
            if limit.adaptive is not None:
                # Read under the lock that counts the key: the limit in force, one for all
                # processes (it may have dropped below what is in flight: nothing is cut
                # off, nothing more is admitted until it is below).
                concurrency = self._gauge_limit(node, key, limit.adaptive, now)
                adaptive = True
            if concurrency is not None and U32.unpack_from(mm, offset)[0] >= concurrency:
                if enforce:
                    return Denial(index, "concurrency", self._leases.soonest(node, now))
                shadowed.append(index)
            rate = limit.rate
            if rate is not None:
                cutoff = now - rate.seconds
                length, oldest = self._purge(node, cutoff)
                if length >= rate.limit:
                    if enforce:
                        return Denial(index, "rate", oldest - cutoff)
                    if index not in shadowed:
                        shadowed.append(index)
                    rate_full.append(index)
            nodes.append(node)
        if len(nodes) > MAX_REFS:
            raise BackendError(f"a request may hold at most {MAX_REFS} slots, got {len(nodes)}")
        pid = self._pid
        stamps: list[float | None] = []
        # Every admission raises its nodes' counts and takes a lease (header counters).
        ranges = [(nodes_off + node * node_size, NODE_HEAD) for node in nodes]
        ranges.append(HEADER_BLOCK)
        self._journal.save_all(ranges)
        for index, node in enumerate(nodes):
            offset = nodes_off + node * node_size
            U32.pack_into(mm, offset, U32.unpack_from(mm, offset)[0] + 1)
            rate = slots[index].limit.rate
            # Shadow over concurrency still counts in the window; only a full window is
            # not extended (as enforce mode would not have admitted).
            if rate is not None and index not in rate_full:
                try:
                    self._append(node, now, rate)
                except NoRoom as exc:
                    raise self._capacity(index, exc) from None
                stamps.append(now)
            else:
                stamps.append(None)
        try:
            lease, serial = self._leases.new(pid, nodes)
        except NoRoom as exc:
            raise self._capacity(_lease_slot(slots), exc) from None
        grant = _SharedGrant(slots, tuple(shadowed), self._epoch, pid, lease, serial, nodes, stamps)
        if adaptive:
            grant.adaptive = True
            grant.admitted = now
        return grant

    def _capacity(self, index: int, exc: NoRoom) -> CapacityError:
        """The CapacityError for slot ``index`` (the caller rolls the update back)."""
        return CapacityError(
            index,
            f"shared table {self.path}: {exc.what}",
            retry_after=1.0 if exc.retry_after is None else max(exc.retry_after, 0.001),
            kind=exc.kind,
        )

    # --- adaptive limits: one controller per key, in its node's gauge ---------------------

    def _fingerprint(self, spec: AdaptiveSpec) -> tuple[int, int, int, int]:
        """The numbers a gauge stores of the ``adaptive`` table its state was made under."""
        cached = self._prints.get(id(spec))
        if cached is not None and cached[0] is spec:
            return cached[1]
        numbers = (ALGORITHMS.index(spec.algorithm) + 1, spec.min, spec.max, spec.initial)
        if len(self._prints) >= 1024:  # one per limit; reloads make new ones
            self._prints = {}
        self._prints[id(spec)] = (spec, numbers)
        return numbers

    def _gauge_limit(self, node: int, key: str, spec: AdaptiveSpec, now: float) -> float:
        """The enforced value of the adaptive limit of ``node`` (key ``key``): its gauge's,
        made first (the key's first admission) or brought under a reloaded ``spec``."""
        mm = self._mm
        assert mm is not None
        at = self._gauges_off + node * GAUGE_SIZE
        flags = self._nodes_off + node * self._node_size + N_FLAGS
        if mm[flags] & F_GAUGE:
            algorithm, low, high, initial, limit = GAUGE_HEAD.unpack_from(mm, at)
            if (algorithm, low, high, initial) == self._fingerprint(spec):
                return float(limit)
        controller = self._held_controller(node, key, spec, now)
        self._store(at, spec, controller)
        return float(controller.limit)

    def _held_controller(self, node: int, key: str, spec: AdaptiveSpec, now: float) -> Controller:
        """The controller of ``node``'s key under ``spec``: the one its gauge holds, else a
        new one (the caller stores it, and the node is marked as holding one)."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        if mm[offset + N_FLAGS] & F_GAUGE:
            return self._controller(self._gauges_off + node * GAUGE_SIZE, key, spec, now)
        self._journal.save(offset, NODE_HEAD)
        mm[offset + N_FLAGS] |= F_GAUGE
        return Controller(spec, now, key=key)

    def _controller(self, at: int, key: str, spec: AdaptiveSpec, now: float) -> Controller:
        """The controller the gauge at ``at`` holds (its node's ``F_GAUGE`` is set), under
        ``spec``: its state under the table it was made with, then ``respec``'d."""
        mm = self._mm
        assert mm is not None
        algorithm, low, high, initial = GAUGE_SPEC.unpack_from(mm, at)
        if not 0 < algorithm <= len(ALGORITHMS) or not low <= initial <= high:
            raise Damaged("its adaptive gauge holds no valid adaptive table")
        made = AdaptiveSpec(ALGORITHMS[algorithm - 1], low, high, initial)
        controller = Controller.restore(made, GAUGE_STATE.unpack_from(mm, at + G_STATE), key=key)
        controller.respec(spec)
        return controller

    def _store(self, at: int, spec: AdaptiveSpec, controller: Controller) -> None:
        mm = self._mm
        assert mm is not None
        self._journal.save(at, GAUGE_SIZE)
        GAUGE_SPEC.pack_into(mm, at, *self._fingerprint(spec))
        GAUGE_STATE.pack_into(mm, at + G_STATE, *controller.state())

    def _sample(
        self,
        node: int,
        key: str,
        spec: AdaptiveSpec,
        admitted: float,
        faulty: bool,
        now: float,
    ) -> None:
        """Feed one released request to the controller of ``node``, in the table: every
        process's samples go into one window, one latency statistic, one limit."""
        mm = self._mm
        assert mm is not None
        at = self._gauges_off + node * GAUGE_SIZE
        offset = self._nodes_off + node * self._node_size
        inflight = U32.unpack_from(mm, offset)[0]
        current = mm[offset + N_FLAGS] & F_GAUGE
        if current and GAUGE_SPEC.unpack_from(mm, at) == self._fingerprint(spec):
            due, count, total, drops, peak = GAUGE_HOT.unpack_from(mm, at + G_HOT)
            if now < due:
                # Nothing is due: the sample only adds to the window (Controller.sample's
                # first part), done on a scratch controller loaded with the window alone
                # instead of rebuilding the whole one (~20 µs) on every release.
                scratch = self._scratch
                baseline = _DOUBLE.unpack_from(mm, at + G_STATE + _BASELINE_OFF)[0]
                scratch.load_window((due, int(count), total, int(drops), int(peak)), baseline)
                scratch.sample(now - admitted, inflight, faulty, admitted, now)
                self._journal.save(at + G_HOT, GAUGE_HOT.size)
                GAUGE_HOT.pack_into(mm, at + G_HOT, *scratch.window())
                return
        controller = self._held_controller(node, key, spec, admitted)
        controller.sample(now - admitted, inflight, faulty, admitted, now)
        self._store(at, spec, controller)

    def observe(self, grant: Grant, faulty: bool, now: float) -> None:
        """Keep the sample on the grant: its release, which follows, feeds it under the
        lock it takes anyway (one lock round trip per release, not two)."""
        assert isinstance(grant, _SharedGrant)
        grant.sample = (faulty, now)

    def adaptive(self) -> dict[str, AdaptiveReport]:
        return self._observed(0.0, self._read_adaptive)

    def _read_adaptive(self) -> dict[str, AdaptiveReport]:
        """The report of every gauge in use, found through the key table's tags: the
        limit, latency and baseline (under the table the state was last made with)."""
        mm = self._mm
        layout = self._layout
        assert mm is not None and layout is not None
        tags = array.array("I")
        tags.frombytes(mm[self._tags_off : self._tags_off + layout.nodes * 4])
        reports = {}
        scratch = self._scratch
        state = Controller.STATE
        limit_at, latency_at, baseline_at = (
            state.index("limit"),
            state.index("latency"),
            state.index("min_latency"),
        )
        nodes_off, node_size = self._nodes_off, self._node_size
        for node, tag in enumerate(tags):
            if tag and mm[nodes_off + node * node_size + N_FLAGS] & F_GAUGE:
                at = self._gauges_off + node * GAUGE_SIZE
                numbers = GAUGE_STATE.unpack_from(mm, at + G_STATE)
                scratch.limit = int(numbers[limit_at])
                scratch.latency = numbers[latency_at]
                scratch.min_latency = numbers[baseline_at]
                reports[self._node_fields(node)[1]] = scratch.report()
        return reports

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        spec = limit.adaptive
        assert spec is not None
        try:
            self._enter()
        except BackendError:
            return spec.initial
        try:
            node = self._find(self._key(key))
            mm = self._mm
            assert mm is not None
            if node < 0 or not mm[self._nodes_off + node * self._node_size + N_FLAGS] & F_GAUGE:
                return spec.initial
            at = self._gauges_off + node * GAUGE_SIZE
            algorithm, low, high, initial, current = GAUGE_HEAD.unpack_from(mm, at)
            if (algorithm, low, high, initial) == self._fingerprint(spec):
                return int(current)
            # Made under another table (a reload): what its next admission will enforce.
            return self._controller(at, key, spec, 0.0).limit
        except (NoRoom, Damaged):
            return spec.initial
        finally:
            self._leave()

    # --- keys and nodes -------------------------------------------------------------------

    def _key(self, key: str) -> tuple[bytes, int, int, int]:
        """(key bytes + NUL, tag, first bucket, second bucket), cached per key."""
        entry = self._keys.get(key)
        if entry is None:
            raw = key.encode("utf-8", "surrogateescape")
            if len(raw) >= self._key_size:
                raise NoRoom(
                    f"key {key[:40]!r}... is longer than the {self._key_size - 1} bytes the "
                    f"table was sized for (the longest limit path of the configuration)"
                )
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

    def _find(self, entry: tuple[bytes, int, int, int]) -> int:
        mm = self._mm
        assert mm is not None
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

    def _create(
        self, entry: tuple[bytes, int, int, int], limit: Limit, now: float, pinned: list[int]
    ) -> int:
        """A node for a new key: a free one of its two buckets, else an idle one there
        (never one of ``pinned``, the nodes this request already counts on). A wildcard
        limit at ``max_keys`` makes room first: a refusal then leaves no node behind."""
        mm = self._mm
        assert mm is not None
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
            self._remove(node)
        offset = self._nodes_off + node * self._node_size
        self._journal.save(offset, NODE_HEAD + len(raw))
        NODE.pack_into(mm, offset, 0, len(raw) - 1, 0, NIL, NIL, 0, 0, NIL, NIL, 0.0)
        mm[offset + NODE_HEAD : offset + NODE_HEAD + len(raw)] = raw
        tag_at = tags_off + node * 4
        self._journal.save(tag_at, 4)
        U32.pack_into(mm, tag_at, tag)
        self._journal.save_header()
        U32.pack_into(mm, H_NODES_USED, U32.unpack_from(mm, H_NODES_USED)[0] + 1)
        if limit.wildcard:
            self._track(node, limit)
        return node

    def _make_room(self, limit: Limit, now: float, pinned: list[int]) -> None:
        """Before a key joins a wildcard limit: at ``max_keys``, evict an idle key of it."""
        registry = self._registry(limit.path)
        at = self._registry_off + registry * REG_SIZE + R_COUNT
        count = U32.unpack_from(self._mm, at)[0]  # type: ignore[arg-type]
        if count >= limit.max_keys:
            self._evict_lru(registry, limit.path, count, now, pinned)

    def _track(self, node: int, limit: Limit) -> None:
        """Count a node under a wildcard limit (``_make_room`` made room for it)."""
        mm = self._mm
        assert mm is not None
        registry = self._registry(limit.path)  # an eviction may have freed its entry
        at = self._registry_off + registry * REG_SIZE
        offset = self._nodes_off + node * self._node_size
        self._journal.save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_REG, registry + 1)
        self._lru_append(registry, node)
        U32.pack_into(mm, at + R_COUNT, U32.unpack_from(mm, at + R_COUNT)[0] + 1)

    def _untrack(self, registry: int, node: int) -> None:
        """Take a node out of its wildcard limit's list and count."""
        mm = self._mm
        assert mm is not None
        self._lru_unlink(registry, node)
        at = self._registry_off + registry * REG_SIZE
        count = U32.unpack_from(mm, at + R_COUNT)[0] - 1
        if count <= 0:
            mm[at : at + REG_SIZE] = bytes(REG_SIZE)
        else:
            U32.pack_into(mm, at + R_COUNT, count)
        offset = self._nodes_off + node * self._node_size
        self._journal.save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_REG, 0)

    def _chain_victim(self, first: int, second: int, now: float, pinned: list[int]) -> int:
        """An idle node of two full buckets to make room for a new key. Never a node with
        requests in flight or entries left in its rate window: evicting it would reset its
        limit (a spray of fresh keys could then free any caller), so without an idle one
        the new key is refused (``NoRoom``)."""
        mm = self._mm
        assert mm is not None
        soonest: float | None = None
        in_flight = False
        for bucket in (first, second):
            for position in range(CHAIN):
                node = bucket * CHAIN + position
                fields = NODE.unpack_from(mm, self._nodes_off + node * self._node_size)
                if node in pinned:
                    continue
                if _idle(fields, now):
                    return node
                in_flight = in_flight or bool(fields[0])
                if not fields[0]:
                    soonest = fields[9] if soonest is None else min(soonest, fields[9])
        raise NoRoom(
            f"both hash buckets of a new key are full of keys in use (in flight or inside "
            f"a rate window); give the table more room with ?size=<keys> (it holds "
            f"{self._buckets * CHAIN})",
            None if soonest is None else soonest - now,
            "concurrency" if in_flight else "rate",
        )

    def _remove(self, node: int) -> None:
        """Take a node (nothing in flight) out of the table: window, LRU list, tag."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        fields = NODE.unpack_from(mm, offset)
        if fields[5]:
            self._free_chunks(fields[3], fields[4])
        registry = fields[6]
        if registry:
            self._untrack(registry - 1, node)
        tag_at = self._tags_off + node * 4
        self._journal.save(tag_at, 4)
        U32.pack_into(mm, tag_at, 0)
        self._journal.save_header()
        U32.pack_into(mm, H_NODES_USED, U32.unpack_from(mm, H_NODES_USED)[0] - 1)

    # --- wildcard limits: the registry and least-recently-used lists ----------------------

    def _registry(self, path: str) -> int:
        mm = self._mm
        assert mm is not None
        base = self._registry_off
        cached = self._regs.get(path)
        if cached is not None:
            index, digest = cached
            if struct.unpack_from("<Q", mm, base + index * REG_SIZE)[0] == digest:
                return index
        else:
            digest = _path_digest(path)
        free = -1
        for index in range(self._layout.registry):  # type: ignore[union-attr]
            stored = struct.unpack_from("<Q", mm, base + index * REG_SIZE)[0]
            if stored == digest:
                self._regs[path] = (index, digest)
                return index
            if not stored and free < 0:
                free = index
        if free < 0:
            raise NoRoom(
                f"no room for wildcard limit {path!r} (the table tracks "
                f"{self._layout.registry} wildcard limits; a reload added more)"  # type: ignore[union-attr]
            )
        at = base + free * REG_SIZE
        self._journal.save(at, REG_SIZE)
        REG.pack_into(mm, at, digest, 0, NIL, NIL)
        self._regs[path] = (free, digest)
        return free

    def _evict_lru(
        self, registry: int, path: str, count: int, now: float, pinned: list[int]
    ) -> None:
        """Make room under a wildcard limit at ``max_keys``: evict the least recently used
        idle key among its ``LRU_SCAN`` least recently used. A key in flight or inside its
        rate window is never evicted (that would reset its limit): with none idle, the new
        key is refused (``NoRoom``), as nginx refuses when its zone cannot allocate. The
        busy keys looked at move to the end of the list, so that long requests at its head
        do not hide the idle keys behind them from the next new key."""
        mm = self._mm
        assert mm is not None
        at = self._registry_off + registry * REG_SIZE
        node = U32.unpack_from(mm, at + R_HEAD)[0]
        nodes_off, node_size = self._nodes_off, self._node_size
        soonest: float | None = None
        in_flight = False
        for _ in range(LRU_SCAN):
            if node == NIL:
                break
            fields = NODE.unpack_from(mm, nodes_off + node * node_size)
            if node in pinned:
                node = fields[8]
                continue
            if _idle(fields, now):
                self._remove(node)
                return
            in_flight = in_flight or bool(fields[0])
            if not fields[0]:
                soonest = fields[9] if soonest is None else min(soonest, fields[9])
            following = fields[8]
            if following != NIL:
                self._lru_unlink(registry, node)
                self._lru_append(registry, node)
            node = following
        raise NoRoom(
            f"wildcard limit {path!r} tracks max_keys={count} keys and its least recently "
            f"used are all in use (in flight or inside their rate window); raise its max_keys",
            None if soonest is None else soonest - now,
            "concurrency" if in_flight else "rate",
        )

    def _lru_append(self, registry: int, node: int) -> None:
        mm = self._mm
        assert mm is not None
        at = self._registry_off + registry * REG_SIZE
        nodes_off, node_size = self._nodes_off, self._node_size
        tail = U32.unpack_from(mm, at + R_TAIL)[0]
        self._journal.save(at, REG_SIZE)
        offset = nodes_off + node * node_size
        self._journal.save(offset, NODE_HEAD)
        U32.pack_into(mm, offset + N_PREV, tail)
        U32.pack_into(mm, offset + N_NEXT, NIL)
        if tail != NIL:
            self._journal.save(nodes_off + tail * node_size, NODE_HEAD)
            U32.pack_into(mm, nodes_off + tail * node_size + N_NEXT, node)
        else:
            U32.pack_into(mm, at + R_HEAD, node)
        U32.pack_into(mm, at + R_TAIL, node)

    def _lru_unlink(self, registry: int, node: int) -> None:
        mm = self._mm
        assert mm is not None
        at = self._registry_off + registry * REG_SIZE
        nodes_off, node_size = self._nodes_off, self._node_size
        offset = nodes_off + node * node_size
        prev = U32.unpack_from(mm, offset + N_PREV)[0]
        nxt = U32.unpack_from(mm, offset + N_NEXT)[0]
        self._journal.save(at, REG_SIZE)
        if prev != NIL:
            self._journal.save(nodes_off + prev * node_size, NODE_HEAD)
            U32.pack_into(mm, nodes_off + prev * node_size + N_NEXT, nxt)
        else:
            U32.pack_into(mm, at + R_HEAD, nxt)
        if nxt != NIL:
            self._journal.save(nodes_off + nxt * node_size, NODE_HEAD)
            U32.pack_into(mm, nodes_off + nxt * node_size + N_PREV, prev)
        else:
            U32.pack_into(mm, at + R_TAIL, prev)

    def _touch(self, node: int, limit: Limit, now: float, pinned: list[int]) -> None:
        """Mark a wildcard key most recently used in its limit's list. A key counted so far
        under another limit (an exact path a 'user' or 'header' value equals, or a pattern
        a reload replaced) moves to this limit's list, counted against its ``max_keys``."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        registry = self._registry(limit.path)
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

    # --- rate windows: a log of admission times in a chain of chunks -------------------

    def _chunk_at(self, chunk: int) -> int:
        return self._chunks_off + chunk * CHUNK_SIZE

    def _purge(self, node: int, cutoff: float) -> tuple[int, float]:
        """Drop window entries at or before ``cutoff``; return (entries left, oldest)."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        _, _, start, first, last, length, *_ = NODE.unpack_from(mm, offset)
        if not length:
            return 0, 0.0
        chunk = first
        stamps = CHUNK_STAMPS_FMT.unpack_from(mm, self._chunk_at(chunk) + 8)
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
                chunk, start = U32.unpack_from(mm, self._chunk_at(chunk))[0], 0
                stamps = CHUNK_STAMPS_FMT.unpack_from(mm, self._chunk_at(chunk) + 8)
            oldest = stamps[start]
        if left == length:
            return left, oldest
        self._journal.save(offset, NODE_HEAD)
        # Expired chunks go back as one chain: a journal entry or two, however many
        # thousand entries expired at once.
        if not left:
            self._free_chunks(first, last)
            self._clear_window(offset)
            return 0, 0.0
        if passed != NIL:
            self._free_chunks(first, passed)
        mm[offset + N_OFFSET] = start
        U32.pack_into(mm, offset + N_FIRST, chunk)
        U32.pack_into(mm, offset + N_LEN, left)
        return left, oldest

    def _clear_window(self, offset: int) -> None:
        mm = self._mm
        assert mm is not None
        mm[offset + N_OFFSET] = 0
        struct.pack_into("<III", mm, offset + N_FIRST, NIL, NIL, 0)

    def _append(self, node: int, now: float, rate: Rate) -> None:
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        _, _, start, first, last, length, _, _, _, idle = NODE.unpack_from(mm, offset)
        self._journal.save(offset, NODE_HEAD)
        position = (start + length) % CHUNK_STAMPS
        if not length:
            first = last = self._new_chunk(now)
            start = position = 0
            mm[offset + N_OFFSET] = 0
            struct.pack_into("<II", mm, offset + N_FIRST, first, last)
        elif not position:
            chunk = self._new_chunk(now)
            self._journal.save(self._chunk_at(last), 8)
            U32.pack_into(mm, self._chunk_at(last), chunk)
            last = chunk
            U32.pack_into(mm, offset + N_LAST, last)
        # The slot past the last entry is free space: no journal entry needed.
        F64.pack_into(mm, self._chunk_at(last) + 8 + 8 * position, now)
        U32.pack_into(mm, offset + N_LEN, length + 1)
        F64.pack_into(mm, offset + N_IDLE, max(idle, now + rate.seconds))

    def _give_back(self, node: int, stamp: float, seconds: float) -> None:
        """Remove the first window entry equal to ``stamp`` (it may have slid out): the
        entries after it move up one place, keeping the log in order; the time the window
        empties follows its newest entry left (``seconds``: the window's length)."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        _, _, start, first, last, length, *_ = NODE.unpack_from(mm, offset)
        if not length:
            return
        chunks: list[int] = []
        values: list[float] = []
        chunk = first
        for _ in range((start + length + CHUNK_STAMPS - 1) // CHUNK_STAMPS):
            following, *stamps = CHUNK_FMT.unpack_from(mm, self._chunk_at(chunk))
            chunks.append(chunk)
            values.extend(stamps)
            chunk = following
        try:
            at = values.index(stamp, start, start + length)
        except ValueError:
            return
        self._journal.save(offset, NODE_HEAD)
        if length == 1:
            self._free_chunks(first, last)
            self._clear_window(offset)
            return
        del values[at]
        values.append(0.0)
        used = (start + length - 1 + CHUNK_STAMPS - 1) // CHUNK_STAMPS
        for index in range(at // CHUNK_STAMPS, used):
            where = self._chunk_at(chunks[index]) + 8
            self._journal.save(where, 8 * CHUNK_STAMPS)
            part = values[index * CHUNK_STAMPS : (index + 1) * CHUNK_STAMPS]
            CHUNK_STAMPS_FMT.pack_into(mm, where, *part)
        if used < len(chunks):
            self._free_chunks(chunks[-1], chunks[-1])
            last = chunks[used - 1]
            self._journal.save(self._chunk_at(last), 8)
            U32.pack_into(mm, self._chunk_at(last), NIL)
            U32.pack_into(mm, offset + N_LAST, last)
        U32.pack_into(mm, offset + N_LEN, length - 1)
        F64.pack_into(mm, offset + N_IDLE, values[start + length - 2] + seconds)

    def _new_chunk(self, now: float) -> int:
        """A window chunk off the free list (or never used yet), its link set to NIL. When
        none is left, the chunks of wholly expired windows are reclaimed first."""
        mm = self._mm
        assert mm is not None
        free, high = self._chunk_counters()
        self._journal.save_header()
        chunk: int
        if free != NIL:
            chunk = free
            self._journal.save(self._chunk_at(chunk), 8)
            self._set_chunk_counters(U32.unpack_from(mm, self._chunk_at(chunk))[0], high)
        elif high < self._chunks:
            chunk = high
            self._set_chunk_counters(free, high + 1)
        elif self._reclaim_windows(now):
            return self._new_chunk(now)
        else:
            raise NoRoom(
                f"all {high * CHUNK_STAMPS} rate window entries are in use; give the table "
                f"more with ?windows=<chunks of {CHUNK_STAMPS} entries>",
                kind="rate",
            )
        U32.pack_into(mm, self._chunk_at(chunk), NIL)
        return chunk

    def _reclaim_windows(self, now: float) -> bool:
        """Free the chunks of windows that have wholly expired (their keys idle since) among
        the ``LRU_SCAN`` least recently used keys of each wildcard limit, where such stale
        windows collect; at most ``LRU_SCAN`` windows per call (a bounded journal). True if
        any was freed. A window still live is never touched."""
        mm = self._mm
        assert mm is not None
        base = self._registry_off
        nodes_off, node_size = self._nodes_off, self._node_size
        freed = 0
        for index in range(self._layout.registry):  # type: ignore[union-attr]
            digest, _, node, _ = REG.unpack_from(mm, base + index * REG_SIZE)
            if not digest:
                continue
            for _ in range(LRU_SCAN):
                if node == NIL or freed >= LRU_SCAN:
                    break
                offset = nodes_off + node * node_size
                fields = NODE.unpack_from(mm, offset)
                if fields[5] and fields[9] <= now:
                    self._journal.save(offset, NODE_HEAD)
                    self._free_chunks(fields[3], fields[4])
                    self._clear_window(offset)
                    freed += 1
                node = fields[8]
        return freed > 0

    def _free_chunks(self, first: int, last: int) -> None:
        """Put the chain of chunks ``first`` .. ``last`` on the free list."""
        mm = self._mm
        assert mm is not None
        free, high = self._chunk_counters()
        self._journal.save_header()
        self._journal.save(self._chunk_at(last), 8)
        U32.pack_into(mm, self._chunk_at(last), free)
        self._set_chunk_counters(first, high)

    def _chunk_counters(self) -> tuple[int, int]:
        """(first free chunk, chunks ever used), checked against their check word."""
        mm = self._mm
        assert mm is not None
        free, high = struct.unpack_from("<II", mm, H_CHUNK_FREE)
        if (
            high > self._chunks
            or (free != NIL and free >= high)
            or U32.unpack_from(mm, H_CHUNK_CHECK)[0] != chunk_check(mm[H_CHUNK_FREE:MUT_END])
        ):
            raise Damaged("its window chunk counters are out of range")
        return free, high

    def _set_chunk_counters(self, free: int, high: int) -> None:
        """Write the chunk counters and their check word (the header is journaled)."""
        mm = self._mm
        assert mm is not None
        counters = struct.pack("<II", free, high)
        mm[H_CHUNK_FREE:MUT_END] = counters
        U32.pack_into(mm, H_CHUNK_CHECK, chunk_check(counters))

    # --- leases ---------------------------------------------------------------------------

    def _release(self, grant: _SharedGrant, status: int | None, delay: float, now: float) -> None:
        leases = self._leases
        if not leases.holds(grant.lease, grant.pid, grant.serial):
            return  # reclaimed meanwhile (its owner was taken for dead)
        sample = grant.sample
        if sample is not None:
            # The lease still holds its nodes: none was evicted or reused meanwhile.
            for index, slot in enumerate(grant.slots):
                spec = slot.limit.adaptive
                if spec is not None:
                    self._sample(grant.nodes[index], slot.key, spec, grant.admitted, *sample)
        for index, stamp in enumerate(grant.stamps):
            if stamp is None:
                continue
            limit = grant.slots[index].limit
            if limit.count is not None and status not in limit.count and limit.rate is not None:
                self._give_back(grant.nodes[index], stamp, limit.rate.seconds)
        if delay > 0:
            leases.delay(grant.lease, grant.serial, now + delay)
        else:
            leases.free(grant.lease)

    def _mature(self, now: float) -> None:
        """Apply the delayed releases that are due; each one is its own transaction."""
        leases = self._leases
        if not leases.due(now):
            return
        started = time.perf_counter()
        leases.mature(now)
        if self.delay_stage is not None:
            self.delay_stage.record(time.perf_counter() - started)

    # --- processes: registration, liveness, reclaim ---------------------------------------

    def _own_start(self) -> int:
        if self._start_time is None:
            stat = proc_stat(os.getpid())
            if stat is None or not stat[1]:
                return 0  # unknown this time (e.g. out of descriptors): asked again next time
            self._start_time = stat[1]
        return self._start_time

    def _register(self) -> None:
        """Make sure this process has a slot in the process table, so that its leases are
        reclaimed if it dies."""
        mm = self._mm
        assert mm is not None
        base = self._procs_off
        pid = self._pid
        index = self._proc_index
        if index >= 0 and U32.unpack_from(mm, base + index * PROC_SIZE)[0] == pid:
            return
        start = self._own_start()
        high = self._procs_high()
        free = -1
        for index in range(high):
            entry_pid, _, entry_start = PROC.unpack_from(mm, base + index * PROC_SIZE)
            if entry_pid == pid:
                if entry_start and start and entry_start != start:
                    # A process that had our pid before us died: its leases are void.
                    self._leases.reclaim(pid)
                    self._journal.save(base + index * PROC_SIZE, PROC_SIZE)
                    PROC.pack_into(mm, base + index * PROC_SIZE, pid, 0, start)
                self._proc_index = index
                return
            if not entry_pid and free < 0:
                free = index
        if free < 0:
            for index, entry_pid, entry_start in self._owners():
                if is_dead(entry_pid, entry_start, deep=True):
                    self._drop_process(index, entry_pid, entry_start)
                    if free < 0:
                        free = index
        if free < 0:
            if high >= self._layout.procs:  # type: ignore[union-attr]
                raise NoRoom(
                    f"all {high} process slots are taken by live processes; give the table "
                    f"more with ?procs=<n>"
                )
            free = high
            if U32.unpack_from(mm, base + free * PROC_SIZE)[0]:
                # Slots past the mark have never been written since the table was created.
                raise Damaged("its process mark is below a registered process")
            self._journal.save_header()
            U32.pack_into(mm, H_PROCS_HIGH, high + 1)
        self._journal.save(base + free * PROC_SIZE, PROC_SIZE)
        PROC.pack_into(mm, base + free * PROC_SIZE, pid, 0, start)
        self._proc_index = free

    def _procs_high(self) -> int:
        high: int = U32.unpack_from(self._mm, H_PROCS_HIGH)[0]  # type: ignore[arg-type]
        if high > self._layout.procs:  # type: ignore[union-attr]
            raise Damaged("its process counter is out of range")
        return high

    def _owners(self) -> list[tuple[int, int, int]]:
        """(slot, pid, start time) of every registration in the table but this process's
        own. Ours is told by its slot, never by its pid: a dead process may have had the
        pid this one has now (pids are reused, from only 32 768 by default), and taking
        its registration for ours would keep its slots forever in this process's eyes
        (an observer, which never registers, would report them in flight)."""
        mm = self._mm
        assert mm is not None
        base = self._procs_off
        mine = self._proc_index
        owners = []
        for index in range(self._procs_high()):
            pid, _, start = PROC.unpack_from(mm, base + index * PROC_SIZE)
            if pid and (index != mine or pid != self._pid):
                owners.append((index, pid, start))
        return owners

    def _reap(self, owners: list[tuple[int, int, int]], *, deep: bool = False) -> bool:
        """Reclaim the leases of dead owners; True if there were any. Outside the lock."""
        clock = time.monotonic()
        # kill(pid, 0) is cheap; reading /proc (zombies, reused pids) is done at most
        # every DEEP_CHECK_EVERY on the rejection path.
        deep = deep or clock - self._last_deep_check >= DEEP_CHECK_EVERY
        if deep:
            self._last_deep_check = clock
        dead = [owner for owner in owners if is_dead(owner[1], owner[2], deep=deep)]
        if not dead:
            return False
        with self._transaction:
            for index, pid, start in dead:
                self._drop_process(index, pid, start)
            return True

    def _drop_process(self, index: int, pid: int, start: int) -> None:
        """Reclaim the leases of a dead process and free its slot. Under the lock."""
        mm = self._mm
        assert mm is not None
        at = self._procs_off + index * PROC_SIZE
        if PROC.unpack_from(mm, at) != (pid, 0, start):
            return  # the slot changed hands meanwhile
        if U32.unpack_from(mm, H_WAITING)[0]:
            self._lines.drop_pid(pid)
        if self._leases.reclaim(pid):
            logger.warning(
                "gatekeeper: process %d died holding slots of shared table %s; reclaimed them",
                pid,
                self.path,
            )
        self._journal.save(at, PROC_SIZE)
        mm[at : at + PROC_SIZE] = bytes(PROC_SIZE)
        self._journal.commit()

    def _live_leases_after_reclaim(self) -> int:
        """Live leases once those of dead processes are reclaimed. Under the lock."""
        mm = self._mm
        assert mm is not None
        for index, pid, start in self._owners():
            if is_dead(pid, start, deep=True):
                self._drop_process(index, pid, start)
        return self._leases.live()

    # --- observation ----------------------------------------------------------------------

    def _read_inflight(self) -> dict[str, int]:
        mm = self._mm
        assert mm is not None
        layout = self._layout
        assert layout is not None
        tags = array.array("I")
        tags.frombytes(mm[self._tags_off : self._tags_off + layout.nodes * 4])
        result = {}
        nodes_off, node_size = self._nodes_off, self._node_size
        for node, tag in enumerate(tags):
            if tag:
                offset = nodes_off + node * node_size
                count, key_length = struct.unpack_from("<IH", mm, offset)
                key = mm[offset + NODE_HEAD : offset + NODE_HEAD + key_length]
                result[key.decode("utf-8", "surrogateescape")] = count
        return result

    def _read_totals(
        self,
        limits: Sequence[Limit],
        now: float,
        top: int,
        watch: Mapping[str, Collection[str]],
    ) -> dict[str, LimitTotals]:
        mm = self._mm
        layout = self._layout
        assert mm is not None and layout is not None
        regs = mm[self._registry_off : self._registry_off + layout.registry * REG_SIZE]
        # registry entry -> keys it tracks, and digest -> entry
        tracked: dict[int, int] = {}
        entry_of: dict[int, int] = {}
        for index, (digest, count, _, _) in enumerate(REG.iter_unpack(regs)):
            if digest:
                tracked[index] = count
                entry_of[digest] = index
        held = self._leases.held_nodes()
        # registry entry -> its keys in flight: (key, node fields)
        busy: dict[int, list[tuple[str, tuple[Any, ...]]]] = {}
        for node in held:
            fields, key = self._node_fields(node)
            if fields[0] and fields[6]:
                busy.setdefault(fields[6] - 1, []).append((key, fields))
        totals = {}
        for limit in limits:
            path = limit.path
            entry = entry_of.get(_path_digest(path)) if limit.wildcard else None
            if limit.wildcard:
                held_keys = busy.get(entry, []) if entry is not None else []
                shown = heapq.nsmallest(top, held_keys, key=lambda item: (-item[1][0], item[0]))
                keys = tracked.get(entry, 0) if entry is not None else 0
            else:
                found = self._lookup(path)
                held_keys = shown = [] if found is None else [found]
                keys = len(shown)
            seen = {key for key, _ in shown}
            for key in watch.get(path, ()):
                found = self._lookup(key) if key not in seen else None
                if found is not None and (entry is None or found[1][6] == entry + 1):
                    seen.add(key)
                    shown.append(found)
            totals[path] = LimitTotals(
                inflight=sum(fields[0] for _, fields in held_keys),
                keys=keys,
                busy=sum(1 for _, fields in held_keys if fields[0]),
                top=tuple(self._key_usage(key, fields, limit, now) for key, fields in shown),
            )
        return totals

    def _node_fields(self, node: int) -> tuple[tuple[Any, ...], str]:
        """A node's fields (``NODE``) and key. Under the lock."""
        mm = self._mm
        assert mm is not None
        offset = self._nodes_off + node * self._node_size
        fields = NODE.unpack_from(mm, offset)
        raw = mm[offset + NODE_HEAD : offset + NODE_HEAD + fields[1]]
        return fields, raw.decode("utf-8", "surrogateescape")

    def _lookup(self, key: str) -> tuple[str, tuple[Any, ...]] | None:
        """(key, node fields) of a key the table holds, else None. Under the lock."""
        try:
            node = self._find(self._key(key))
        except NoRoom:  # longer than any key the table can hold
            return None
        return None if node < 0 else (key, self._node_fields(node)[0])

    def _key_usage(self, key: str, fields: tuple[Any, ...], limit: Limit, now: float) -> KeyUsage:
        """A key's requests in flight and its window's use now, read without changing it."""
        rate = limit.rate
        if rate is None:
            return KeyUsage(key, fields[0], None, 0.0)
        mm = self._mm
        assert mm is not None
        cutoff = now - rate.seconds
        start, chunk, left = fields[2], fields[3], fields[5]
        while left:
            stamps = CHUNK_STAMPS_FMT.unpack_from(mm, self._chunk_at(chunk) + 8)
            for stamp in stamps[start : start + left]:
                if stamp > cutoff:
                    return KeyUsage(key, fields[0], left, stamp - cutoff)
                left -= 1
            chunk, start = U32.unpack_from(mm, self._chunk_at(chunk))[0], 0
        return KeyUsage(key, fields[0], 0, 0.0)
