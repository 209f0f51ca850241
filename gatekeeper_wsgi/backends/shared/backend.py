"""The host-wide backend: every counter, lease and rate window of all worker processes of
one host in one memory-mapped file, guarded by an open-file-description lock.

``backend = "shared:///run/gatekeeper/shop.shm"``. Linux only (``F_OFD_SETLKW``). The
table is sized from the configuration when the file is created; ``?size=``, ``?leases=``,
``?procs=`` and ``?windows=`` in the URL override the derived sizes, ``?mode=0660`` lets the
processes of one group share it.
"""

from __future__ import annotations

import contextlib
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

from gatekeeper_wsgi.adaptive import AdaptiveReport, Controller
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
from gatekeeper_wsgi.backends.shared.gauges import Gauges
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK, Journal, Transaction
from gatekeeper_wsgi.backends.shared.keys import KeyTable, path_digest
from gatekeeper_wsgi.backends.shared.layout import (
    H_BOOT,
    H_CHECK,
    H_EPOCH,
    H_EPOCH_COPY,
    H_HEAP_LEN,
    H_JLEN,
    H_LIVE,
    H_WAITING,
    HEADER,
    MAGIC,
    MAGIC_INIT,
    MAGIC_VERSION,
    MAX_REFS,
    NODE_HEAD,
    STATE,
    U32,
    VERSION,
    Layout,
    NodeView,
    clear_counters,
    counters_problem,
    fixed_digest,
    header_problem,
)
from gatekeeper_wsgi.backends.shared.leases import Leases
from gatekeeper_wsgi.backends.shared.liveness import (
    BOOT_ID,
    DEEP_CHECK_EVERY,
    Processes,
    is_dead,
    proc_stat,
)
from gatekeeper_wsgi.backends.shared.tickets import Lines, Place, SharedLine
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.config import Config, Limit
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


#: a key the totals show: (key, node, its fields)
_Held = tuple[str, int, NodeView]


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
    ``fork`` is closed in the child at once). The system calls are :mod:`.filelock`'s.

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
            mm = self._mm
            assert mm is not None
            # Checked once the journal is rolled back: an update cut short by a kill may
            # leave counters half written that its journal restores.
            problem = counters_problem(layout, mm[:HEADER])
            if problem is not None:
                self._recreate(problem)
                return
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
        # The structures of this map: each works on the map, the layout and the journal.
        mm = self._mm
        journal = self._journal = Journal(mm, layout, self.path)
        leases = self._leases = Leases(mm, layout, journal)
        windows = self._windows = Windows(mm, layout, journal)
        self._keys = KeyTable(mm, layout, journal, windows)
        self._gauges = Gauges(mm, layout, journal)
        self._procs = Processes(
            mm,
            layout,
            journal,
            leases,
            pid=self._pid,
            start=self._own_start,
            name=self.path,
            forget=self._forget_waiters,
        )
        self._nodes_off = layout.nodes_off
        self._node_size = layout.node_size
        self._lines = Lines(mm, layout, journal, self._line.bell.ring)

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
        clear_counters(mm)
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
            self._mature(mm, now)
            if keep:
                try:
                    self._procs.register()
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
            owners = self._procs.owners() if isinstance(result, Denial) else []
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
            self._mature(mm, now)
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
        with self._transaction as mm:
            self._mature(mm, now)
            owners = self._procs.owners()
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
        """How full the table is: keys, leases, delayed releases, queue waiters (of every
        line), processes, file size."""
        with self._transaction as mm:
            layout = self._layout
            assert layout is not None
            live, _, _, heap_len, _, _, nodes_used = struct.unpack_from("<7I", mm, H_LIVE)
            pids = self._procs.pids()
            return {
                "path": self.path,
                "keys": nodes_used,
                "key_capacity": layout.nodes,
                "leases": live,
                "lease_capacity": layout.leases,
                "delayed": heap_len,
                "waiting": U32.unpack_from(mm, H_WAITING)[0],
                "waiter_capacity": layout.waiters,
                "processes": sorted(pids),
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
        keys = self._keys
        for index, (key, limit, enforce) in enumerate(slots):
            try:
                entry = keys.key(key)
                node = keys.find(entry)
                if node < 0:
                    node = keys.create(entry, limit, now, nodes)
                elif limit.wildcard:
                    keys.touch(node, limit, now, nodes)
            except NoRoom as exc:
                raise _Untracked(self._capacity(index, exc)) from None
            offset = nodes_off + node * node_size
            concurrency: float | None = limit.concurrency
            if limit.adaptive is not None:
                # Read under the lock that counts the key: the limit in force, one for all
                # processes (it may have dropped below what is in flight: nothing is cut
                # off, nothing more is admitted until it is below).
                concurrency = self._gauges.limit(node, key, limit.adaptive, now)
                adaptive = True
            if concurrency is not None and U32.unpack_from(mm, offset)[0] >= concurrency:
                if enforce:
                    return Denial(index, "concurrency", self._leases.soonest(node, now))
                shadowed.append(index)
            rate = limit.rate
            if rate is not None:
                cutoff = now - rate.seconds
                length, oldest = self._windows.purge(node, cutoff)
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
                    self._windows.append(node, now, rate.seconds)
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
        reports = {}
        for node in self._keys.in_use():
            report = self._gauges.report(node)
            if report is not None:
                reports[self._keys.view(node)[1]] = report
        return reports

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        spec = limit.adaptive
        assert spec is not None
        try:
            self._enter()
        except BackendError:
            return spec.initial
        try:
            node = self._keys.find(self._keys.key(key))
            current = None if node < 0 else self._gauges.current(node, key, spec)
            return spec.initial if current is None else current
        except (NoRoom, Damaged):
            return spec.initial
        finally:
            self._leave()

    # --- leases ---------------------------------------------------------------------------

    def _release(self, grant: _SharedGrant, status: int | None, delay: float, now: float) -> None:
        leases = self._leases
        if not leases.holds(grant.lease, grant.pid, grant.serial):
            return  # reclaimed meanwhile (its owner was taken for dead)
        sample = grant.sample
        if sample is not None:
            gauges = self._gauges
            # The lease still holds its nodes: none was evicted or reused meanwhile.
            for index, slot in enumerate(grant.slots):
                spec = slot.limit.adaptive
                if spec is not None:
                    gauges.sample(grant.nodes[index], slot.key, spec, grant.admitted, *sample)
        for index, stamp in enumerate(grant.stamps):
            if stamp is None:
                continue
            limit = grant.slots[index].limit
            if limit.count is not None and status not in limit.count and limit.rate is not None:
                self._windows.give_back(grant.nodes[index], stamp, limit.rate.seconds)
        if delay > 0:
            leases.delay(grant.lease, grant.serial, now + delay)
        else:
            leases.free(grant.lease)

    def _mature(self, mm: mmap.mmap, now: float) -> None:
        """Apply the delayed releases that are due; each one is its own transaction."""
        # On every admission and release: the heap's length read here, at its offset in
        # the header, saves a call while nothing is delayed (the common case).
        if not U32.unpack_from(mm, H_HEAP_LEN)[0]:
            return
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
                self._procs.drop(index, pid, start)
            return True

    def _forget_waiters(self, pid: int) -> None:
        """Drop the waiters of dead process ``pid`` from the queues' lines. Under the lock."""
        mm = self._mm
        assert mm is not None
        if U32.unpack_from(mm, H_WAITING)[0]:
            self._lines.drop_pid(pid)

    def _live_leases_after_reclaim(self) -> int:
        """Live leases once those of dead processes are reclaimed. Under the lock."""
        self._procs.drop_dead()
        return self._leases.live()

    # --- observation ----------------------------------------------------------------------

    def _read_inflight(self) -> dict[str, int]:
        found = {}
        for node in self._keys.in_use():
            view, key = self._keys.view(node)
            found[key] = view.inflight
        return found

    def _read_totals(
        self,
        limits: Sequence[Limit],
        now: float,
        top: int,
        watch: Mapping[str, Collection[str]],
    ) -> dict[str, LimitTotals]:
        keys = self._keys
        # registry entry -> keys it tracks, and digest -> entry
        tracked: dict[int, int] = {}
        entry_of: dict[int, int] = {}
        for index, digest, count in keys.registries():
            tracked[index] = count
            entry_of[digest] = index
        # registry entry -> its keys in flight
        busy: dict[int, list[_Held]] = {}
        for node in self._leases.held_nodes():
            view, key = keys.view(node)
            if view.inflight and view.registry:
                busy.setdefault(view.registry - 1, []).append((key, node, view))
        totals = {}
        for limit in limits:
            path = limit.path
            entry = entry_of.get(path_digest(path)) if limit.wildcard else None
            if limit.wildcard:
                held_keys = busy.get(entry, []) if entry is not None else []
                shown = heapq.nsmallest(
                    top, held_keys, key=lambda item: (-item[2].inflight, item[0])
                )
                count = tracked.get(entry, 0) if entry is not None else 0
            else:
                found = self._lookup(path)
                held_keys = shown = [] if found is None else [found]
                count = len(shown)
            seen = {key for key, _, _ in shown}
            for key in watch.get(path, ()):
                found = self._lookup(key) if key not in seen else None
                if found is not None and (entry is None or found[2].registry == entry + 1):
                    seen.add(key)
                    shown.append(found)
            totals[path] = LimitTotals(
                inflight=sum(view.inflight for _, _, view in held_keys),
                keys=count,
                busy=sum(1 for _, _, view in held_keys if view.inflight),
                top=tuple(self._key_usage(held, limit, now) for held in shown),
            )
        return totals

    def _lookup(self, key: str) -> _Held | None:
        """(key, node, its fields) of a key the table holds, else None. Under the lock."""
        try:
            node = self._keys.find(self._keys.key(key))
        except NoRoom:  # longer than any key the table can hold
            return None
        return None if node < 0 else (key, node, self._keys.view(node)[0])

    def _key_usage(self, held: _Held, limit: Limit, now: float) -> KeyUsage:
        """A key's requests in flight and its window's use now, read without changing it."""
        key, node, view = held
        rate = limit.rate
        if rate is None:
            return KeyUsage(key, view.inflight, None, 0.0)
        left, until = self._windows.usage(node, now - rate.seconds)
        return KeyUsage(key, view.inflight, left, until)
