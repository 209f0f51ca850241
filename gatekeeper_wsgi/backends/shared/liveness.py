"""Processes of a shared table: whether the owner of a lease is gone (exited, a zombie,
or its pid reused by a newer process), whether another process maps the file (a table of
another layout version still in use), this boot's id (a table written before a reboot is
stale), and the table's process slots (:class:`Processes`: ``P x 16`` bytes of pid and
start time, a bump mark at 44), through which the leases of a dead process are found and
reclaimed. Reads /proc; Linux only, as the table is.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable

from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.journal import Journal, Structure
from gatekeeper_wsgi.backends.shared.layout import H_PROCS_HIGH, PROC, PROC_SIZE, U32, Layout
from gatekeeper_wsgi.backends.shared.leases import Leases

logger = logging.getLogger("gatekeeper")

#: in /proc/<pid>/stat after the command name: the state (field 3) and the start time
#: in clock ticks after boot (field 22)
_STATE, _START_TIME = 0, 19
#: how often (seconds) the rejection path reads /proc for zombies and reused pids
DEEP_CHECK_EVERY = 0.01


def _boot_id() -> bytes:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as file:
            return bytes.fromhex(file.read().decode("ascii").strip().replace("-", ""))[:16]
    except (OSError, ValueError):
        return bytes(16)


BOOT_ID = _boot_id()


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: it exited while being read
        return None
    except OSError:
        return ("?", 0)
    # The command name may hold spaces and parentheses: fields resume after the last ')'.
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[_STATE].decode("ascii", "replace"), int(fields[_START_TIME])
    except (IndexError, ValueError):
        return ("?", 0)


def is_dead(pid: int, start: int, *, deep: bool) -> bool:
    """Whether process ``pid`` (started at ``start`` ticks after boot, 0: unknown) is gone.
    ``deep`` also reads /proc: a zombie (killed, not yet reaped) or a process that reuses
    the pid counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, owned by another user
    if not deep:
        return False
    stat = proc_stat(pid)
    return stat is None or stat[0] in ("Z", "X") or bool(start and stat[1] and stat[1] != start)


class Processes(Structure):
    """The process slots of one mapped table, seen from process ``pid`` (``start``: its
    start time in clock ticks, 0 while unknown). ``name`` is the table's path, for
    messages; ``forget(pid)`` is called for a dead process before its leases are
    reclaimed (the queues' lines drop its waiters)."""

    __slots__ = (
        "_base",
        "_capacity",
        "_forget",
        "_leases",
        "_mine",
        "_name",
        "_pid",
        "_start",
        "slot_at",
    )

    def __init__(
        self,
        mm: mmap.mmap,
        layout: Layout,
        journal: Journal,
        leases: Leases,
        *,
        pid: int,
        start: Callable[[], int],
        name: str,
        forget: Callable[[int], None],
    ) -> None:
        super().__init__(mm, layout, journal)
        self._leases = leases
        self._base = layout.procs_off
        self._capacity = layout.procs
        self._pid = pid
        self._start = start
        self._name = name
        self._forget = forget
        #: this process's slot, -1 until registered
        self._mine = -1
        #: the offset of that slot once :meth:`register` gave it one, else -1 (whether it
        #: still holds this pid is for the caller to read, under the lock): an attribute,
        #: read on every admission by plan
        self.slot_at = -1

    def register(self) -> None:
        """Make sure this process has a slot in the process table, so that its leases are
        reclaimed if it dies. :class:`NoRoom` when every slot holds a live process."""
        mm = self._mm
        base = self._base
        pid = self._pid
        index = self._mine
        if index >= 0 and U32.unpack_from(mm, base + index * PROC_SIZE)[0] == pid:
            return
        start = self._start()
        high = self.high()
        free = -1
        for index in range(high):
            entry_pid, _, entry_start = PROC.unpack_from(mm, base + index * PROC_SIZE)
            if entry_pid == pid:
                if entry_start and start and entry_start != start:
                    # A process that had our pid before us died: its leases are void.
                    self._leases.reclaim(pid)
                    self._journal.save(base + index * PROC_SIZE, PROC_SIZE)
                    PROC.pack_into(mm, base + index * PROC_SIZE, pid, 0, start)
                self._own(index)
                return
            if not entry_pid and free < 0:
                free = index
        if free < 0:
            freed = self.drop_dead()
            if freed:
                free = freed[0]
        if free < 0:
            if high >= self._capacity:
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
        self._own(free)

    def _own(self, index: int) -> None:
        """Take slot ``index`` for this process (written already)."""
        self._mine = index
        self.slot_at = self._base + index * PROC_SIZE

    def high(self) -> int:
        """Process slots ever used (the bump mark); :class:`Damaged` if out of range."""
        high: int = U32.unpack_from(self._mm, H_PROCS_HIGH)[0]
        if high > self._capacity:
            raise Damaged("its process counter is out of range")
        return high

    def pids(self) -> list[int]:
        """The pids registered, in slot order."""
        base = self._base
        return [
            pid
            for pid, _, _ in (
                PROC.unpack_from(self._mm, base + index * PROC_SIZE) for index in range(self.high())
            )
            if pid
        ]

    def owners(self) -> list[tuple[int, int, int]]:
        """(slot, pid, start time) of every registration in the table but this process's
        own. Ours is told by its slot, never by its pid: a dead process may have had the
        pid this one has now (pids are reused, from only 32 768 by default), and taking
        its registration for ours would keep its slots forever in this process's eyes
        (an observer, which never registers, would report them in flight)."""
        mm = self._mm
        base = self._base
        mine = self._mine
        owners = []
        for index in range(self.high()):
            pid, _, start = PROC.unpack_from(mm, base + index * PROC_SIZE)
            if pid and (index != mine or pid != self._pid):
                owners.append((index, pid, start))
        return owners

    def drop(self, index: int, pid: int, start: int) -> None:
        """Reclaim the leases of dead process ``pid`` and free its slot ``index``, each in
        its own committed update."""
        mm = self._mm
        at = self._base + index * PROC_SIZE
        if PROC.unpack_from(mm, at) != (pid, 0, start):
            return  # the slot changed hands meanwhile
        self._forget(pid)
        if self._leases.reclaim(pid):
            logger.warning(
                "gatekeeper: process %d died holding slots of shared table %s; reclaimed them",
                pid,
                self._name,
            )
        self._journal.save(at, PROC_SIZE)
        mm[at : at + PROC_SIZE] = bytes(PROC_SIZE)
        self._journal.commit()

    def drop_dead(self) -> list[int]:
        """Drop every registered process found dead by /proc; the slots freed."""
        freed = []
        for index, pid, start in self.owners():
            if is_dead(pid, start, deep=True):
                self.drop(index, pid, start)
                freed.append(index)
        return freed


def mapped_elsewhere(device: int, inode: int) -> bool:
    """Whether a process other than this one has the file (``device``, ``inode``) mapped,
    by /proc/<pid>/maps (True when /proc cannot be read). A process of another layout
    version that uses the table has it mapped; one of this version facing that table has
    it open but not mapped (it unmapped it to attach), and a killed one has neither.
    This process's parent does not count: one that built the engine before it forked
    its workers (gunicorn ``--preload``, uWSGI) keeps the map it made for good, and runs
    this very version (counted, a table whose layout field was overwritten was refused
    for as long as the master lived)."""
    me = str(os.getpid())
    parent = str(os.getppid())
    wanted = (f"{os.major(device):02x}:{os.minor(device):02x}", str(inode))
    try:
        processes = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return True
    for pid in processes:
        if pid in (me, parent):
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) > 4 and (fields[3], fields[4]) == wanted:
                        return True
        except OSError:  # gone, or another user's
            continue
    return False
