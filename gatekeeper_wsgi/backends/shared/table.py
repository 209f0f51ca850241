"""The table file of a shared backend: the file, its map and its locks, and the structures
of the map, from attaching to a file to re-creating a damaged one.

:class:`Table` owns what every call of :class:`~.backend.SharedBackend` passes through
before and after it touches the structures: taking the thread and file locks and checking
the table on the way in (:meth:`Table._enter`: size, magic, epoch, a killed process's
journal; at most every :data:`PATH_CHECK_EVERY`, whether the path still names the open
file), attaching and mapping the file (or initialising it, or re-creating it when
damaged), rolling an unfinished update back and turning what went wrong into what may
leave a backend (:meth:`Table._fail`), handling a fork, reclaiming dead processes'
leases, closing. ``with table._transaction as mm:`` is one update,
``with table._reading as mm:`` one look that changes nothing (both a
:class:`~.journal.Transaction`): no locked section of the backend is written by hand.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from os import SEEK_END
from typing import NoReturn

from gatekeeper_wsgi.backends.base import PASSING, Backend
from gatekeeper_wsgi.backends.shared.faults import Damaged
from gatekeeper_wsgi.backends.shared.filelock import (
    C_FLOCK,
    LOCK_TRY,
    UNLOCK,
    lock_file,
    lseek,
    unlock_file,
)
from gatekeeper_wsgi.backends.shared.files import check_mode, open_private, unfit
from gatekeeper_wsgi.backends.shared.gauges import Gauges
from gatekeeper_wsgi.backends.shared.journal import Journal, Transaction
from gatekeeper_wsgi.backends.shared.keys import KeyTable
from gatekeeper_wsgi.backends.shared.layout import (
    H_BOOT,
    H_CHECK,
    H_EPOCH,
    H_EPOCH_COPY,
    H_JLEN,
    H_LIVE,
    H_WAITING,
    HEADER,
    MAGIC,
    MAGIC_INIT,
    MAGIC_VERSION,
    STATE,
    U32,
    VERSION,
    Layout,
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
    mapped_elsewhere,
    proc_stat,
)
from gatekeeper_wsgi.backends.shared.plans import Plans
from gatekeeper_wsgi.backends.shared.tickets import Bell, Lines
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.errors import BackendError, ConfigError
from gatekeeper_wsgi.redact import Throttle
from gatekeeper_wsgi.turns import TurnLock

__all__ = ["LayoutMismatch", "Recreated", "Table"]

logger = logging.getLogger("gatekeeper")


class LayoutMismatch(BackendError):
    """The file holds a table of another layout version that live leases still use."""


class Recreated(BackendError):
    """An operation found the table damaged and re-created it; the operation may be run
    again on the new table."""


_INSTANCES: weakref.WeakSet[Table] = weakref.WeakSet()
#: the bytes of the table's first fields (:data:`STATE`), compared on every entry
_STATE_END = STATE.size
#: serialises noticing a fork that bypassed the at-fork hook (threads race to notice)
_FORK_LOCK = threading.Lock()
#: Seconds between two ERRORs of a table found damaged, deleted or replaced: whoever can
#: write the file can do it again and again, and every process logs each time.
INCIDENT_LOG_INTERVAL = 10.0
#: Seconds between two looks at whether the path still names the file a process has open
#: (deleted, or replaced by another file). A look is a ``stat`` (~1 µs) and every request
#: enters the table twice: at most one per interval keeps it off the hot path (a clock read
#: and a compare), and 0.1 s bounds how long a process that has not noticed yet counts in a
#: file the others no longer use; a file is replaced by an accident (an operator, a
#: tmpfiles cleaner), not once a second.
PATH_CHECK_EVERY = 0.1
#: Seconds between two looks, while a process counts in a table smaller than its
#: configuration wants (leases were live when it attached), whether none is live any more
#: and the table can be re-created bigger.
GROW_CHECK_EVERY = 1.0
_monotonic = time.monotonic


def _after_fork_in_child() -> None:
    global _FORK_LOCK
    _FORK_LOCK = threading.Lock()
    for backend in list(_INSTANCES):
        backend._drop_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Table(Backend):
    """The file, map and locks of one shared table, and the structures of its map
    (``_journal``, ``_keys``, ``_windows``, ``_leases``, ``_gauges``, ``_procs``,
    ``_lines``, each replaced when the file is mapped again).

    The base of :class:`~.backend.SharedBackend`, which implements the backend contract on
    it; a base class rather than a member because the admission and the release read the
    map and the structures as attributes of the backend, one load each (through a member
    they would be two, several times on every request).

    **Locking.** Every read and write of the table happens under one exclusive ``flock``
    of the file plus a thread lock (:class:`~gatekeeper_wsgi.turns.TurnLock`; a ``flock``
    belongs to the open file description, which the threads of a process share). The
    kernel drops it when the description's last descriptor closes, so a killed process
    cannot leave it held; each process opens the file itself (the descriptor inherited
    across ``fork`` is closed in the child at once). The system
    calls are :mod:`.filelock`'s; none of those made holding the thread lock lets go of
    the GIL unless another process holds the file lock through all of a few retries, so
    the other threads do not run up to the thread lock meanwhile.

    **The file is private.** It is created ``0600`` (``?mode=0660``: group too) with
    ``O_CREAT|O_EXCL|O_NOFOLLOW``; an existing file is used only when ``fstat`` on the opened
    descriptor shows a regular file of this user (or of the group, with ``?mode=0660``) that
    nobody else may write; anything else is a ConfigError naming the path and why
    (:mod:`.files`). At most every :data:`PATH_CHECK_EVERY` a process looks whether the
    path still names the file it has open; when the file was deleted or another put there,
    it logs one ERROR and opens the file now at the path with the same checks (creating it
    if there is none), so every process counts in one file again (:meth:`_follow_path`).

    **Damage.** Each lock acquisition checks the file size (one ``lseek``: the map is never
    touched past the end of a truncated file, which would be SIGBUS), the magic and the
    epoch. A new epoch is a table another process re-created only if the checksum of the
    fields written at creation (at 72) holds; another layout version only if this process
    holds no lease of the table (no version re-creates a table with live leases). Rolling a
    journal back checks every entry first. The header's counters are checked where they
    are used, also when garbage left them in range: a free or never used lease, heap entry
    or process slot must look free, the window chunk counters carry a check word (at 52).
    A damaged table is re-created with one ERROR and the operation runs again on it
    (:class:`Recreated`); anything else that goes wrong leaves as a BackendError. Not
    detected: in-range garbage in the live-lease count (read by ``usage()`` only) and the
    key count (shown only), and garbage in the key, lease or window regions (their values
    are range-checked where used, not checksummed).

    **Crash safety.** Each update is a transaction: before a byte range is changed, its old
    bytes go to the undo journal; the journal is emptied when the update is complete. The
    next process to take the lock after one was killed mid-update rolls the journal back,
    so the table never holds half an admission. Unexpected errors roll back the same way.

    Writes that other processes read concurrently need no special care: nobody reads
    without the lock. The file is sparse: pages of unused nodes and windows cost nothing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config | None,
        *,
        size: int | None,
        leases: int | None,
        procs: int | None,
        windows: int | None,
        mode: int,
        bell: Bell,
    ) -> None:
        self.path = os.fspath(path)
        check_mode(self.path, mode)
        self._mode = mode
        self._wanted = Layout.derive(config, size=size, leases=leases, procs=procs, windows=windows)
        #: no configuration: an observer that takes the table as it is
        self._adopt = config is None and (size, leases, procs, windows) == (None,) * 4
        #: rings the waiters a release or a leave wakes (the lines of every map ring it)
        self._bell = bell
        self._tlock = TurnLock()
        self._transaction = Transaction(self._enter, self._fail, self._leave)
        self._reading = Transaction.reading(self._enter, self._leave)
        self._pid = os.getpid()
        self._fd = -1
        self._mm: mmap.mmap | None = None
        #: the plans of the map (:mod:`.plans`), None while there is none
        self._plans: Plans | None = None
        self._closed = False
        #: (device, inode) of the file open as ``_fd``, and when to look next whether the
        #: path still names it (:meth:`_follow_path`)
        self._file: tuple[int, int] | None = None
        #: another table of this process has (or had) the same file open: see _use
        self._file_shared_here = False
        self._path_due = 0.0
        #: the path names nothing usable (said once): the open file is kept meanwhile
        self._unusable_path = False
        # The ERRORs of incidents (damaged, deleted, replaced): see INCIDENT_LOG_INTERVAL.
        self._incidents_logged = Throttle(INCIDENT_LOG_INTERVAL)
        #: the open file was made unfit to trust where it is (said once, see
        #: _check_loosened)
        self._loosened = False
        #: (until when, whether) another process was last found with the file mapped
        self._in_use_checked: tuple[float, bool] = (0.0, True)
        #: (device, inode) of the file last mapped as a valid table: garbage found there
        #: later is damage to re-create, not a foreign file to leave alone
        self._ours: tuple[int, int] | None = None
        #: while this process counts in a table smaller than it wants: when to look next
        #: whether it can be re-created bigger (None: it is as big as wanted, or adopted)
        self._grow_due: float | None = None
        self._last_layout: Layout | None = None
        self._total = 0
        self._reset_state()
        self._open()
        _INSTANCES.add(self)
        # Attach now, so a bad file is reported at start-up; a layout still in use by
        # live leases is retried on every call (BackendError meanwhile).
        try:
            with self._reading:
                pass
        except LayoutMismatch as exc:
            logger.error("gatekeeper: %s", exc)
        except BackendError as exc:
            self.close()
            raise ConfigError("backend", str(exc)) from exc

    @property
    def label(self) -> str:
        return f"shared table {self.path!r}"

    def _reset_state(self) -> None:
        self._layout: Layout | None = None
        self._epoch = 0
        #: the table's first bytes (:data:`STATE`) as :meth:`_enter` expects them: the
        #: magic, this version, an empty journal, the epoch attached (0: none, no table's)
        self._state = STATE.pack(MAGIC, VERSION, 0, 0)
        #: leases this process holds (admitted, not yet released) in the table of epoch
        #: ``_held_epoch``: while it holds any, no other layout version re-creates it
        self._held = 0
        self._held_epoch = 0
        self._start_time: int | None = None
        self._last_deep_check = -1.0

    def _open(self) -> None:
        self._use(open_private(self.path, self._mode))

    def _use(self, fd: int) -> None:
        """Make ``fd`` (opened by :func:`.files.open_private`) the table's descriptor."""
        self._fd = fd
        info = os.fstat(fd)
        file = self._file = (info.st_dev, info.st_ino)
        self._path_due = _monotonic() + PATH_CHECK_EVERY
        # Two keepers of this process on one path: a thread of the other may hold the
        # file lock, and needs the GIL to let go, which a waiter's yielding tries keep
        # (filelock). Both are marked, for good (a mark left after a close only costs
        # the yields).
        for other in list(_INSTANCES):
            if other is not self and other._file == file:
                other._file_shared_here = self._file_shared_here = True

    def _follow_path(self) -> None:
        """Open the file if none is open; if the path no longer names the open one (it was
        deleted, or another file put there), log one ERROR and open the file now at the
        path (created if there is none: as at start), so that this process counts in the
        file every other process uses. Nothing usable there (a directory, a FIFO, a
        symlink, a file another user owns or can write): this process keeps counting in
        the file it has open - its leases there must still be released there, or they
        would stay counted should that file come back - and says so once. Under the
        thread lock, before the file lock."""
        if self._fd < 0:
            self._use(open_private(self.path, self._mode))
            return
        now = _monotonic()
        self._path_due = now + PATH_CHECK_EVERY
        if self._grow_due is not None and now >= self._grow_due:
            self._state = b""  # _enter checks the table, under the file lock: see _check
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            what = "was deleted"
        else:
            if (info.st_dev, info.st_ino) == self._file:
                self._unusable_path = False
                self._check_loosened(info)
                return
            what = "was replaced by another file"
        try:
            fd = open_private(self.path, self._mode)  # refused as at start: never followed
        except ConfigError as exc:
            if not self._unusable_path:
                self._unusable_path = True
                logger.error(
                    "gatekeeper: shared table %s %s, which cannot be used (%s); this "
                    "process keeps counting in the file it has open until a usable one is "
                    "there",
                    self.path,
                    what,
                    exc.problem,
                )
            return
        self._unusable_path = False
        if incidents := self._incidents_logged.due():
            logger.error(
                "gatekeeper: shared table %s %s; opening the file now at the path (requests"
                " in flight in the old file are not counted in it; %d incidents since the"
                " last report)",
                self.path,
                what,
                incidents,
            )
        self.incidents += 1
        old = self._fd
        self._unmap()
        # The file at the path is not the one this process mapped: garbage there is no
        # damage to re-create, and an empty file is new.
        self._ours = None
        os.close(old)
        self._use(fd)

    def _check_loosened(self, info: os.stat_result) -> None:
        """The open file, still at the path, made unfit (``chmod o+w``, a new owner, a
        hard link): one ERROR until it is fit again. This process keeps counting in it
        (its leases are there), but a process starting now refuses it - the next worker a
        server starts would not boot."""
        problem = unfit(info, self._mode)
        if problem is None:
            self._loosened = False
        elif not self._loosened:
            self._loosened = True
            logger.error(
                "gatekeeper: shared table %s can no longer be trusted: %s; a process "
                "starting now refuses it - restore its mode and owner",
                self.path,
                problem,
            )

    def _unmap(self) -> None:
        if self._mm is not None:
            if self._plans is not None:
                self._plans.close()  # its views of the map first: they keep it open
            self._mm.close()
            self._mm = None
        self._plans = None
        self._layout = None
        self._epoch = 0

    def _drop_inherited(self) -> None:
        """In a forked child: the descriptor is the parent's open file description, whose
        lock the parent may hold. Close it now; the child opens its own on first use."""
        mm, fd, plans = self._mm, self._fd, self._plans
        self._mm = None
        self._plans = None
        self._fd = -1
        self._file = None
        self._file_shared_here = False  # marked again when the file is opened (_use)
        self._tlock = TurnLock()
        self._pid = os.getpid()
        self._reset_state()
        if mm is not None:
            with contextlib.suppress(BufferError, ValueError):
                if plans is not None:
                    plans.close()
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
        turns = self._tlock
        try:  # TurnLock.acquire inlined
            turns.token.pop()
        except IndexError:
            turns.wait()
        try:
            fd = self._fd
            # Whether the path still names the open file is looked at once per
            # PATH_CHECK_EVERY: a clock read and a compare on the common path.
            if fd < 0 or _monotonic() >= self._path_due:
                self._follow_path()
                fd = self._fd
            # filelock.lock_file's first try inlined (a call less on every update); it
            # waits, or raises why not, when that try fails.
            if C_FLOCK is None or C_FLOCK(fd, LOCK_TRY):
                lock_file(fd, not self._file_shared_here)
        except BaseException as exc:
            # Whatever it is (a bug, an interrupt in the wait), the file lock is not held
            # and the thread lock must go: kept, every thread of the process would wait
            # for it for good.
            turns.release()
            if isinstance(exc, Exception) and not isinstance(exc, PASSING):
                raise self.backend_error(exc) from exc
            raise
        try:
            try:
                # Touching the map of a file cut shorter than it is SIGBUS: its size is
                # read first (one lseek, ~0.3 µs, keeping the GIL: see filelock), under the
                # file lock, so a cut made while this process waited for the lock (for
                # milliseconds, under contention) is seen too; a process re-creating the
                # table cuts and grows the file under the lock, never below its old size.
                # Only a writer ignoring the lock can still cut it inside this update.
                # (filelock.file_size inlined: a call less on every update; -1, an error,
                # reads as too short below, where attaching raises the error.)
                size = lseek(fd, 0, SEEK_END)
                mm = self._mm
                # One comparison on the common path: the map is this process's table of
                # the epoch it attached, of this layout version, no journal left behind.
                if mm is None or size < self._total or mm[:_STATE_END] != self._state:
                    self._check(mm, size < self._total)
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

    def _check(self, mm: mmap.mmap | None, short: bool) -> None:
        """What :meth:`_enter` does when the table is not as it left it: attach the file
        (not mapped yet, cut shorter, another epoch, magic or version) or roll back the
        journal a killed process left. Under both locks."""
        if mm is None or short:
            self._attach()
        else:
            magic, version, jlen, epoch = STATE.unpack_from(mm, 0)
            if epoch != self._epoch or magic != MAGIC or version != VERSION:
                self._attach()
            elif jlen:
                self._recover(jlen)
            elif self._grow_due is not None:
                # Counting in a table smaller than wanted: re-created bigger once nothing
                # there would be lost (no request in flight, no rate window with entries),
                # else looked at again later.
                if self._in_use() is not None:
                    self._grow_due = _monotonic() + GROW_CHECK_EVERY
                else:
                    self._attach()
        self._state = STATE.pack(MAGIC, VERSION, 0, self._epoch)

    def _leave(self) -> None:
        try:
            fd = self._fd
            # filelock.unlock_file's try inlined, as above
            if fd >= 0 and (C_FLOCK is None or C_FLOCK(fd, UNLOCK)):
                unlock_file(fd)
        finally:
            turns = self._tlock
            turns.token.append(None)  # TurnLock.release inlined
            if turns.sleepers:
                turns.ring()

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
                self._grow_due = None
                return
            in_use = self._in_use()
            if in_use is not None:
                # Counted in as it is, not an outage (which on_backend_error = "allow"
                # would answer by admitting uncounted): what it cannot track is refused by
                # the limit that needed it, as in a table that filled (SPEC 4.5). Nor is it
                # re-created while that would forget a request in flight or a window.
                if self._grow_due is None:
                    logger.warning(
                        "gatekeeper: shared table %s holds %s, smaller than this "
                        "configuration wants (%s), and %s: counting in it as it is (what "
                        "it cannot track is refused by its limit, counted in "
                        "capacity_refused) until nothing is in use, then re-creating it "
                        "bigger",
                        self.path,
                        layout.describe(),
                        wanted.describe(),
                        in_use,
                    )
                self._grow_due = _monotonic() + GROW_CHECK_EVERY
                return
            self._grow_due = None
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
            # Its live leases count only while a process of that version is there to hold
            # them: one killed (kill -9, the OOM killer, a timeout) never gave its back,
            # and this version cannot read that version's process table to reclaim them.
            if live and self._in_use_elsewhere(info):
                raise LayoutMismatch(
                    f"shared table {self.path!r} has layout version {version} (this is "
                    f"{VERSION}) and {live} live leases; it is re-created as soon as none is"
                    f" (or no process of that version is left)"
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
        if incidents := self._incidents_logged.due():
            logger.error(
                "gatekeeper: shared table %s is damaged: %s; re-creating it (requests in"
                " flight now are not counted in the new table; %d incidents since the last"
                " report)",
                self.path,
                reason,
                incidents,
            )
        self.incidents += 1
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
        self._lines = Lines(mm, layout, journal, self._bell.ring)
        self._plans = Plans(mm, layout, journal, windows)

    def _initialise(self, layout: Layout, size: int) -> None:
        """Write an empty table of ``layout`` into the file (``size`` bytes now). Under the
        file lock, which every process holds to touch its map: none can meet the file
        while it is cut to nothing and grown back."""
        self._grow_due = None
        fd = self._fd
        if size:
            # All zero again, and its pages given back, in two calls: the checks of the
            # lease and process tables rely on nothing past their bump marks ever having
            # been written since the table was created.
            os.ftruncate(fd, 0)
        # Never shrink: another process may still map the old, larger size.
        os.ftruncate(fd, max(size, layout.total))
        self._warn_if_no_room(layout.total)
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

    def _in_use_elsewhere(self, info: os.stat_result) -> bool:
        """Whether another process has the file ``info`` describes mapped: a process of
        the other layout version, still there to hold its leases
        (:func:`.liveness.mapped_elsewhere`). Looked up at most once a second: a table of
        another version in use is retried on every call."""
        now = _monotonic()
        if now < self._in_use_checked[0]:
            return self._in_use_checked[1]
        found = mapped_elsewhere(info.st_dev, info.st_ino)
        self._in_use_checked = (now + 1.0, found)
        return found

    def _warn_if_no_room(self, total: int) -> None:
        """A WARNING when the file system holds less free space than the sparse table may
        come to use: the page a write first touches is given then, and with none left
        the kernel kills the writing process (SIGBUS), in every worker that grows the
        table - no error Python could catch. Reserving the whole table instead would take
        its full size (up to hundreds of MB) from a tmpfs at once."""
        try:
            info = os.fstatvfs(self._fd)
            used = os.fstat(self._fd).st_blocks * 512
        except OSError:
            return
        free = info.f_bavail * info.f_frsize
        if free < total - used:
            logger.warning(
                "gatekeeper: shared table %s may use up to %.0f MB, and its file system has "
                "%.0f MB free: when that runs out, a process writing the table is killed "
                "(SIGBUS); give it room, or smaller options (?size=, ?leases=, ?windows=)",
                self.path,
                total / 1e6,
                free / 1e6,
            )

    def close(self) -> None:
        """Unmap and close the file. Leases this process still holds stay in the table
        (they are reclaimed when the process exits)."""
        if self._closed:
            return
        with self._tlock:
            self._closed = True
            _INSTANCES.discard(self)
            mm, fd, plans = self._mm, self._fd, self._plans
            self._mm = None
            self._plans = None
            self._fd = -1
            if mm is not None:
                if plans is not None:
                    plans.close()
                mm.close()
            if fd >= 0:
                os.close(fd)
            self._bell.close()

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
            raise Recreated(
                f"shared table {self.path!r} was damaged ({exc}); it was re-created"
            ) from exc
        raise self.backend_error(exc) from exc

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

    def _in_use(self) -> str | None:
        """What re-creating the table would lose, said in words (live leases after those of
        dead processes are reclaimed, or a key's rate window with an entry not expired
        by the host's monotonic clock, which the engines' admissions stamp), else None.
        Under the lock; O(keys) for the windows, off the request path."""
        live = self._live_leases_after_reclaim()
        if live:
            return f"{live} leases are live"
        live_window = self._keys.window_live(time.monotonic())
        return "keys have rate window entries" if live_window else None
