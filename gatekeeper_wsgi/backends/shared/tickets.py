"""The queues' lines of the shared table: one FIFO per concrete limit path for all the
worker processes of a host (SPEC §4.4).

A request that must wait takes a *waiter* (a ticket) at the end of the line of its queued
limit's concrete path. Only the first waiter of a line may take the slots; an admission
that is no waiter's (a newcomer) is refused by every enforced limit with a queue whose
line has waiters, so the engine makes it join the end of that line: nobody jumps the
line, in whatever process it runs. ``queue.size`` bounds a line host-wide. A waiter that
is admitted, times out or is refused leaves its line; one whose process died (SIGKILL)
is dropped by whoever meets it: the waiter behind it, a join that finds the line full,
the reclaim of its process's leases.

**Wake-ups** (no polling at ``poll_interval``): every waiter has a Unix datagram socket in
the abstract namespace, named by a random nonce kept in its waiter entry (the file is
private; the names are not secret, see ``_recv_own``: only datagrams of this user count).
A release that frees a slot of a line's path, or of the path that last refused the line's
first waiter, sends that first waiter one byte; a waiter that leaves sends one to the
waiter behind it. The waiter behind one of another process also watches that process
through a pidfd: a SIGKILL wakes it at once. What no message announces is bounded: a
first waiter looks again at least every :data:`FIRST_LOOK` seconds (a slot holder killed
by SIGKILL frees its slots only when looked for; delayed releases and rate windows are
waited for exactly by the engine), any other waiter every :data:`LOOK` (a wake-up that
could not be delivered, e.g. processes in different network namespaces).

Two parts: :class:`Lines`, the bytes (the ``waiters`` and ``lines`` regions and the
header's lines block of :mod:`.layout`), used under the table's lock with every write
journaled; :class:`SharedLine`, the engine's :class:`~gatekeeper_wsgi.backends.base.
WaitingLine` on top: sockets, pidfds and sleeping, outside the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from gatekeeper_wsgi.backends.base import Denial, Grant, Slot, WaitingLine
from gatekeeper_wsgi.backends.shared.layout import (
    H_WAITING,
    LINE,
    LINE_SIZE,
    LINES_HEAD,
    NIL,
    U32,
    WAITER,
    WAITER_SIZE,
    Layout,
)
from gatekeeper_wsgi.backends.shared.liveness import is_dead, proc_stat

if TYPE_CHECKING:
    import mmap

    from gatekeeper_wsgi.backends.shared.backend import SharedBackend
    from gatekeeper_wsgi.backends.shared.journal import Journal

__all__ = ["FIRST_LOOK", "LOOK", "Bell", "Lines", "SharedLine", "path_digest"]

#: seconds a line's first waiter sleeps at most before it looks again
FIRST_LOOK = 0.05
#: seconds any other waiter sleeps at most before it looks again
LOOK = 0.5
#: seconds between two sweeps of a full table for waiters of dead processes (per process)
SWEEP_EVERY = 1.0

_U64 = struct.Struct("<Q")
_CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid
_DIGESTS_KEPT = 8192


class Place(NamedTuple):
    """A waiter's place in a line, as the table knows it."""

    waiter: int  #: index of its waiter entry
    ticket: int  #: the entry's ticket (another ticket there: the place is gone)


class Turn(NamedTuple):
    """What a waiter learns when it looks: whether it is first of its line, and who waits
    just ahead of it (pid, start time), when another process."""

    first: bool
    ahead: tuple[int, int] | None


class _Line(NamedTuple):
    digest: int
    blocked: int  #: the path that last refused its first waiter (0: none)
    first: int
    last: int
    length: int


class _Waiter(NamedTuple):
    pid: int
    ticket: int
    start: int
    nonce: int
    prev: int
    next: int
    digest: int


def path_digest(path: str) -> int:
    """A line's name: 8 bytes of blake2b of the concrete path (never 0, a free entry)."""
    digest = hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


class Lines:
    """The lines of one mapped table. Every method runs under the table's lock and
    journals what it changes in the table's undo ``journal``: a process killed half-way
    leaves no half-linked waiter (dropping the dead commits after each waiter, so that the
    journal never holds more than one). ``ring`` wakes the waiters of nonces
    (:meth:`Bell.ring`)."""

    __slots__ = (
        "_digests",
        "_journal",
        "_lines",
        "_lines_off",
        "_mm",
        "_ring",
        "_swept",
        "_waiters",
        "_waiters_off",
    )

    def __init__(
        self, mm: mmap.mmap, layout: Layout, journal: Journal, ring: Callable[..., None]
    ) -> None:
        self._mm = mm
        self._journal = journal
        self._ring = ring
        self._waiters = layout.waiters
        self._lines = layout.lines
        self._waiters_off = layout.waiters_off
        self._lines_off = layout.lines_off
        self._digests: dict[str, int] = {}
        self._swept = -SWEEP_EVERY

    # --- reading and writing entries ------------------------------------------------------

    def _head(self) -> tuple[int, int, int, int, int]:
        """(waiters in line, last ticket, first free waiter + 1, waiters ever used, lines)."""
        head: tuple[int, int, int, int, int] = LINES_HEAD.unpack_from(self._mm, H_WAITING)
        return head

    def _write(self, layout: struct.Struct, at: int, values: tuple[int, ...]) -> None:
        """Journal the bytes at ``at``, then write ``values`` there."""
        self._journal.save(at, layout.size)
        layout.pack_into(self._mm, at, *values)

    def _set_head(self, waiting: int, ticket: int, free: int, high: int, used: int) -> None:
        self._write(LINES_HEAD, H_WAITING, (waiting, ticket, free, high, used))

    def _line(self, index: int) -> _Line:
        return _Line._make(LINE.unpack_from(self._mm, self._lines_off + index * LINE_SIZE))

    def _set_line(self, index: int, line: _Line) -> None:
        self._write(LINE, self._lines_off + index * LINE_SIZE, line)

    def _waiter(self, index: int) -> _Waiter:
        if index >= self._waiters:
            raise IndexError(f"waiter {index} out of range")
        return _Waiter._make(WAITER.unpack_from(self._mm, self._waiters_off + index * WAITER_SIZE))

    def _set_waiter(self, index: int, waiter: _Waiter) -> None:
        self._write(WAITER, self._waiters_off + index * WAITER_SIZE, waiter)

    def digest(self, path: str) -> int:
        """:func:`path_digest`, remembered for the paths this process asks about."""
        digests = self._digests
        digest = digests.get(path)
        if digest is None:
            if len(digests) >= _DIGESTS_KEPT:
                digests.clear()
            digest = digests[path] = path_digest(path)
        return digest

    def _line_of(self, digest: int) -> tuple[int, _Line]:
        """(index, entry) of the line of ``digest``, which has a waiter in use."""
        index = self._find(digest)
        if index < 0:
            raise IndexError("a waiter in use belongs to no line")
        return index, self._line(index)

    def _find(self, digest: int) -> int:
        """The index of the line of ``digest``, -1 if it has no waiter."""
        mm = self._mm
        base = self._lines_off
        used = self._head()[4]
        needle = _U64.pack(digest)
        start, end = base, base + used * LINE_SIZE
        while True:
            at = mm.find(needle, start, end)
            if at < 0:
                return -1
            if not (at - base) % LINE_SIZE:
                return (at - base) // LINE_SIZE
            start = at + 1  # the bytes matched inside another field

    # --- joining and leaving --------------------------------------------------------------

    def join(self, path: str, size: int, pid: int, start: int, nonce: int) -> Place | None:
        """A place at the end of ``path``'s line; None when the line holds ``size`` live
        waiters, or the table has no waiter or line left (dead waiters dropped first)."""
        digest = self.digest(path)
        index = self._find(digest)
        if index >= 0 and self._line(index).length >= size:
            # Who dies at the head or in the middle is dropped by the waiter behind it;
            # the last has nobody behind. O(1) per refusal, however long the line.
            self._drop_dead_tail(digest)
            index = self._find(digest)
            if index >= 0 and self._line(index).length >= size:
                return None
        waiting, ticket, free, high, used = self._head()
        if free:
            waiter = free - 1
            entry = self._waiter(waiter)
            if entry.ticket or entry.next > high:
                raise IndexError("its list of free waiters holds a waiter in use")
            free = entry.next
        elif high < self._waiters:
            waiter = high
            high += 1
        else:
            return self.join(path, size, pid, start, nonce) if self._sweep() else None
        if index < 0:
            if used >= self._lines:
                return self.join(path, size, pid, start, nonce) if self._sweep() else None
            index = used
            used += 1
            line = _Line(digest, 0, NIL, NIL, 0)
        else:
            line = self._line(index)
        ticket = ticket % 0xFFFFFFFF + 1
        self._set_waiter(waiter, _Waiter(pid, ticket, start, nonce, line.last, NIL, digest))
        if line.last != NIL:
            self._set_waiter(line.last, self._waiter(line.last)._replace(next=waiter))
        first = waiter if line.first == NIL else line.first
        self._set_line(index, line._replace(first=first, last=waiter, length=line.length + 1))
        self._set_head(waiting + 1, ticket, free, high, used)
        return Place(waiter, ticket)

    def _holds(self, place: Place) -> _Waiter | None:
        """The waiter entry of ``place``, None if the place is gone (left, dropped)."""
        waiter = self._waiter(place.waiter)
        return waiter if waiter.ticket == place.ticket and waiter.pid else None

    def leave(self, place: Place) -> None:
        """Take ``place`` out of its line (nothing if it is gone already); the waiter behind
        it is woken."""
        waiter = self._holds(place)
        if waiter is not None:
            self._ring(self._unlink(place.waiter, waiter))

    def _unlink(self, index: int, waiter: _Waiter) -> int:
        """Take waiter ``index`` out of its line and free it; the nonce of the waiter
        behind it (0: none), which now has someone else ahead."""
        at, line = self._line_of(waiter.digest)
        if waiter.prev != NIL:
            self._set_waiter(waiter.prev, self._waiter(waiter.prev)._replace(next=waiter.next))
            first = line.first
        else:
            first = waiter.next
        behind = 0
        if waiter.next != NIL:
            following = self._waiter(waiter.next)
            behind = following.nonce
            self._set_waiter(waiter.next, following._replace(prev=waiter.prev))
            last = line.last
        else:
            last = waiter.prev
        waiting, ticket, free, high, used = self._head()
        if line.length > 1:
            # A new first waiter has been refused by nothing yet.
            blocked = line.blocked if first == line.first else 0
            self._set_line(at, _Line(line.digest, blocked, first, last, line.length - 1))
        else:
            used -= 1
            if at != used:  # the last line in use takes the emptied one's place
                self._set_line(at, self._line(used))
            self._set_line(used, _Line(0, 0, 0, 0, 0))
        self._set_waiter(index, _Waiter(0, 0, 0, 0, NIL, free, 0))
        self._set_head(max(waiting - 1, 0), ticket, index + 1, high, used)
        return behind

    # --- dead waiters ---------------------------------------------------------------------

    def _drop_dead_tail(self, digest: int) -> None:
        """Drop the dead waiters at the end of the line of ``digest``."""
        while True:
            index = self._find(digest)
            if index < 0:
                return
            last = self._line(index).last
            waiter = self._waiter(last)
            if not _gone(waiter.pid, waiter.start):
                return
            self._drop(last, waiter)

    def _sweep(self) -> bool:
        """With every waiter or line of the table in use: drop the waiters of dead
        processes, all of them, at most every ``SWEEP_EVERY`` seconds in this process (a
        flood of requests to a full table must not pass over it each time); whether any
        was dropped."""
        now = time.monotonic()
        if now - self._swept < SWEEP_EVERY:
            return False
        self._swept = now
        verdicts: dict[tuple[int, int], bool] = {}
        dropped = False
        for index in range(self._head()[3]):
            waiter = self._waiter(index)
            if not waiter.ticket:
                continue
            owner = (waiter.pid, waiter.start)
            dead = verdicts.get(owner)
            if dead is None:
                dead = verdicts[owner] = _gone(*owner)
            if dead:
                self._drop(index, waiter)
                dropped = True
        return dropped

    def _drop(self, index: int, waiter: _Waiter) -> None:
        """Unlink a dead waiter, as its own update; wake the one behind it."""
        behind = self._unlink(index, waiter)
        self._journal.commit()
        self._ring(behind)

    def drop_pid(self, pid: int) -> None:
        """Drop every waiter of process ``pid``, found dead (its leases are reclaimed)."""
        high = self._head()[3]
        for index in range(high):
            waiter = self._waiter(index)
            if waiter.ticket and waiter.pid == pid:
                self._drop(index, waiter)

    # --- turns ----------------------------------------------------------------------------

    def turn(self, place: Place) -> Turn | None:
        """Whether ``place`` is first of its line, once the dead at the head of its line and
        just ahead of it are dropped; None if the place is gone."""
        waiter = self._holds(place)
        if waiter is None:
            return None
        while waiter.prev != NIL:
            ahead = self._waiter(waiter.prev)
            if not _gone(ahead.pid, ahead.start):
                break
            self._drop(waiter.prev, ahead)
            waiter = self._waiter(place.waiter)
        if waiter.prev == NIL:
            return Turn(True, None)
        while True:
            _, line = self._line_of(waiter.digest)
            head = self._waiter(line.first)
            if line.first == waiter.prev or not _gone(head.pid, head.start):
                break
            self._drop(line.first, head)
        ahead = self._waiter(waiter.prev)
        return Turn(False, None if ahead.pid == os.getpid() else (ahead.pid, ahead.start))

    def settle(self, place: Place, slots: Sequence[Slot], result: Grant | Denial) -> None:
        """After the first waiter ``place`` tried: a grant takes it out of its line; a
        refusal by another path is noted, so that a release there wakes it."""
        if not isinstance(result, Denial):
            self.leave(place)
            return
        waiter = self._holds(place)
        if waiter is None:
            return
        index, line = self._line_of(waiter.digest)
        refusing = self.digest(slots[result.at].key)
        blocked = 0 if refusing == line.digest else refusing
        if line.blocked != blocked:
            self._set_line(index, line._replace(blocked=blocked))

    def waiting(self) -> int:
        """Waiters in all lines (0: nothing to check; read by every admission)."""
        count: int = U32.unpack_from(self._mm, H_WAITING)[0]
        return count

    def barred(self, slots: Sequence[Slot]) -> Denial | None:
        """The refusal of a newcomer: the first enforced slot with a queue whose line has
        waiters (it joins that line), None if there is none."""
        for index, (key, limit, enforce) in enumerate(slots):
            if limit.queue is not None and enforce and self._find(self.digest(key)) >= 0:
                return Denial(index, "concurrency" if limit.concurrency is not None else "rate", 0)
        return None

    def announce(self, slots: Sequence[Slot]) -> None:
        """A release freed the slots of ``slots``: wake the first waiter of every line of
        one of their paths or refused by one of them last. The lines are searched by
        ``mmap.find`` (in C), however many there are."""
        mm = self._mm
        base = self._lines_off
        end = base + self._head()[4] * LINE_SIZE
        nonces = []
        for slot in slots:
            needle = _U64.pack(self.digest(slot.key))
            at = mm.find(needle, base, end)
            while at >= 0:
                # The digest of a line (at 0 of an entry) or what refused its first (at 8).
                if (at - base) % LINE_SIZE in (0, 8):
                    line = self._line((at - base) // LINE_SIZE)
                    nonces.append(self._waiter(line.first).nonce)
                at = mm.find(needle, at + 1, end)
        self._ring(*nonces)

    def refused_by(self, path: str) -> int:
        """The digest of the path that last refused the first waiter of ``path``'s line
        (0: none, or no line)."""
        index = self._find(self.digest(path))
        return 0 if index < 0 else self._line(index).blocked

    def places(self, path: str) -> list[tuple[int, int]]:
        """(pid, ticket) of the waiters in ``path``'s line, first first."""
        index = self._find(self.digest(path))
        if index < 0:
            return []
        line = self._line(index)
        found = []
        waiter_index = line.first
        for _ in range(line.length):
            waiter = self._waiter(waiter_index)
            found.append((waiter.pid, waiter.ticket))
            waiter_index = waiter.next
        return found


def _gone(pid: int, start: int) -> bool:
    """Whether a waiter's process is gone (exited, a zombie, its pid reused)."""
    return pid != os.getpid() and is_dead(pid, start, deep=True)


# --- wake-ups -----------------------------------------------------------------------------


def _address(nonce: int) -> bytes:
    return b"\0gatekeeper-wake-%016x" % nonce


class Bell:
    """Sends wake-ups: one unbound datagram socket, made on first use in each process
    (one inherited across fork is closed in the child, never shared with the parent)."""

    __slots__ = ("_pid", "_sender")

    def __init__(self) -> None:
        self._pid = 0
        self._sender: socket.socket | None = None

    def ring(self, *nonces: int) -> None:
        """Send one byte to the wake socket of each nonce (0: none). Never blocks, never
        fails: a full socket has wake-ups pending already, a missing one's waiter is gone."""
        nonces = tuple(nonce for nonce in nonces if nonce)
        if not nonces:
            return
        sender = self._sender
        if sender is None or self._pid != os.getpid():
            self.close()
            try:
                sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError:
                return  # the waiters look again by themselves (FIRST_LOOK, LOOK)
            sender.setblocking(False)
            self._sender, self._pid = sender, os.getpid()
        for nonce in nonces:
            with contextlib.suppress(OSError):
                sender.sendto(b"!", _address(nonce))

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None


class Ticket:
    """A waiter of this process: its place, its wake socket, the pidfd it watches."""

    __slots__ = ("ahead", "epoch", "first", "left", "place", "sock", "watched")

    def __init__(self, place: Place, epoch: int, sock: socket.socket | None) -> None:
        self.place = place
        self.epoch = epoch
        self.sock = sock
        self.first = False
        self.left = False
        #: (pid, start) of the waiter ahead when it is another process's
        self.ahead: tuple[int, int] | None = None
        #: (pid, pidfd) of the process watched
        self.watched: tuple[int, int] | None = None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._unwatch()

    def _unwatch(self) -> None:
        if self.watched is not None:
            os.close(self.watched[1])
            self.watched = None

    def pidfd(self) -> int | None:
        """A descriptor readable once the waiter ahead's process is gone (None: nobody
        to watch, or no pidfd here); -1 when it is gone already."""
        ahead = self.ahead
        if ahead is None:
            self._unwatch()
            return None
        if self.watched is not None and self.watched[0] == ahead[0]:
            return self.watched[1]
        self._unwatch()
        try:
            fd = os.pidfd_open(ahead[0])
        except ProcessLookupError:
            return -1
        except (AttributeError, OSError):
            return None  # no pidfd (Linux < 5.3): the waiter looks again every LOOK
        self.watched = (ahead[0], fd)
        # Opened after the pid may have been reused: it must be the process that waits.
        return -1 if is_dead(*ahead, deep=True) else fd


def _wake_socket() -> tuple[socket.socket | None, int]:
    """A bound wake socket and its nonce; (None, 0) where none can be made."""
    nonce = secrets.randbits(64) or 1
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    except OSError:
        return None, 0
    try:
        sock.bind(_address(nonce))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
    except OSError:
        sock.close()
        return None, 0
    return sock, nonce


def _recv_own(sock: socket.socket) -> bool:
    """Drain the socket; True if a datagram came from a process of this user. The names
    of abstract sockets are visible to every user (``/proc/net/unix``): another user's
    datagrams are read and ignored, never taken for a wake-up."""
    uid = os.geteuid()
    own = False
    space = socket.CMSG_SPACE(_CREDENTIALS.size)
    while True:
        try:
            _, ancillary, _, _ = sock.recvmsg(16, space)
        except (BlockingIOError, InterruptedError):
            return own
        except OSError:
            return True
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                own = own or _CREDENTIALS.unpack_from(data)[1] == uid


class SharedLine(WaitingLine[Ticket]):
    """The engine's line on a shared table: the line of the host (see the module)."""

    __slots__ = ("_backend", "_start", "bell")

    def __init__(self, backend: SharedBackend) -> None:
        self._backend = backend
        self._start: tuple[int, int] = (0, 0)  # (pid, its start time)
        #: the wake-ups this backend's releases and leaves send
        self.bell = Bell()

    def _own_start(self) -> int:
        pid = os.getpid()
        if self._start[0] != pid:
            stat = proc_stat(pid)
            self._start = (pid, stat[1] if stat is not None else 0)
        return self._start[1]

    def join(self, key: str, size: int) -> Ticket | None:
        sock, nonce = _wake_socket()
        start = self._own_start()
        with self._backend.lines() as (lines, epoch):
            place = lines.join(key, size, os.getpid(), start, nonce)
        if place is None:
            if sock is not None:
                sock.close()
            return None
        return Ticket(place, epoch, sock)

    def admit(self, ticket: Ticket, slots: Sequence[Slot], now: float) -> Grant | Denial | None:
        backend = self._backend
        if ticket.epoch:
            with backend.lines() as (lines, epoch):
                turn = lines.turn(ticket.place) if epoch == ticket.epoch else None
            if turn is None:
                # The table was re-created (damage) and its lines with it: no line to
                # keep; the waiter acquires as anyone would until its wait ends.
                ticket.epoch = 0
                ticket.close()
            elif not turn.first:
                ticket.first = False
                ticket.ahead = turn.ahead
                return None
        ticket.first = True
        ticket.ahead = None
        result = backend.acquire_turn(slots, now, ticket.place if ticket.epoch else None)
        if not isinstance(result, Denial):
            ticket.left = True
        return result

    def sleep(self, ticket: Ticket, timeout: float) -> None:
        timeout = min(timeout, FIRST_LOOK if ticket.first or ticket.sock is None else LOOK)
        poller = select.poll()
        sock = ticket.sock
        if sock is not None:
            poller.register(sock.fileno(), select.POLLIN)
        pidfd = ticket.pidfd()
        if pidfd == -1:
            return  # the waiter ahead is gone: look again now, which drops it
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while True:
            events = poller.poll(max(deadline - time.monotonic(), 0.0) * 1000)
            if not events or sock is None or any(fd == pidfd for fd, _ in events):
                return
            if _recv_own(sock):
                return
            # Only another user's datagrams: not a wake-up; sleep on until the deadline.

    def leave(self, ticket: Ticket) -> None:
        try:
            if ticket.epoch and not ticket.left:
                with self._backend.lines() as (lines, epoch):
                    if epoch == ticket.epoch:
                        lines.leave(ticket.place)
        finally:
            ticket.close()
