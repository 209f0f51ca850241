"""The table file's lock and size, the system calls every update of the table makes, made
without letting go of the GIL where they cannot block.

Every update happens between :func:`lock_file` and :func:`unlock_file` of an exclusive
``flock`` on the table's open file description: the kernel drops it when the last
descriptor of that description closes, so a killed process cannot leave it held (as with
the open-file-description ``fcntl`` locks of layout versions up to 6, which this one
replaced: measured in ``benchmarks/shared.py``'s floor, a ``flock`` pair costs 1.2 µs
against ``F_OFD_SETLK``'s 1.8 µs through the same GIL-holding call, 2 µs less per request;
the two kinds of lock do not exclude each other, hence the layout version 7).
:func:`file_size` (and :data:`lseek`, the same call for the table's own use) is the check
made before the map is touched (a file cut shorter than the map is SIGBUS). The
per-request path takes the lock twice.

**Why not plain** ``fcntl.flock`` **and** ``os.lseek``: they let go of the GIL around the
system call, and with the threads of a busy process waiting for the GIL every let-go hands
it over. A call made holding the table's thread lock then lets every thread that runs
meanwhile up to that lock, to sleep there; measured with 8 threads making direct WSGI calls
(``strace -f -c``, ``benchmarks/shared.py``, issue 18): 4 ``fcntl`` and 2 ``lseek`` per
request, and 0.5 to 4 voluntary context switches per request depending on whether that
convoy formed, against the memory backend's 0.2. So the calls that cannot block, a lock
that is free, the unlock and the size, go through ``ctypes.PyDLL``, which keeps the GIL:
no thread runs while this one is in the kernel for a microsecond. A lock another process
holds is tried again ``SPINS`` times by :func:`_wait`, still keeping the GIL (the holder
runs on another core and lets go within microseconds, while a wait in the kernel costs the
waiter a sleep and a wake-up; with 2 processes on a 2-core machine that took host admits/s
from 0.78 to 1.22 x one process's), and only then waited for with the GIL let go
(``fcntl.flock(fd, LOCK_EX)``). The retries keep the GIL because a thread that lets it go
there hands it to another thread of its process, which keeps it until it blocks or its
switch interval ends, while the retrying thread waits for it holding the thread lock and,
once a retry succeeds, the file lock: every process of the host then waits for the GIL of
one (issue 18: with 2 processes of 4 threads making direct calls, 30 to 70 µs per update
that found the lock held, against 8 µs with one thread each; under gunicorn,
``benchmarks/shared.py``'s throughput section, 117-124 µs against 67-103 µs once the
retries kept the GIL). A failed GIL-holding unlock is made again by the plain call, which
raises the error with its errno; a lock that cannot be taken at all fails every retry, and
the kernel wait raises its error.

When the tries run out the holder is not running on another core. Waiting in the kernel
then costs more than the wait: the waiter sleeps, its CPU halts (a VM's, with the guest's
halt-polling off, as here), and the kernel wakes it on the holder's CPU, so the two
processes end up taking turns on one CPU, each wait a sleep again: with 2 processes, 0.55
waits in the kernel per admit + release and host admits/s at 0.74 x one process's. So,
before the kernel wait, more tries for ``YIELD_FOR`` (300 µs), each after a
``sched_yield`` that keeps the GIL (a holder sharing this CPU runs and lets go; the waiter
never sleeps, so stays on its own CPU): no wait in the kernel in the same runs, and
1.20-1.23 x one process's. The GIL is kept for the same reason as above, for at most
``YIELD_FOR`` and one time slice (a yield to a busy CPU may last one). Not when another
descriptor of the same file is open in this process (two keepers on one path): the holder
may be its thread, which needs the GIL to let go. Where ``ctypes`` cannot reach the C
library every call is the plain one.

``flock`` on NFS is emulated by the server with a lock per process, not per open file
description: a table belongs on a local file system (tmpfs, ``/run``, ``/dev/shm``).

(An earlier try of the same calls, 8add9e8, was reverted for 0.5 µs more per update and
no fewer switches in a run where the convoy had not formed; see ``benchmarks/RESULTS.md``
for the interleaved figures that kept this one.)
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import time
from collections.abc import Callable

__all__ = [
    "C_FLOCK",
    "LOCK_TRY",
    "UNLOCK",
    "file_size",
    "lock_file",
    "lseek",
    "unlock_file",
]

#: ``flock`` operations: take without waiting (fails while another description holds
#: it), and let go
LOCK_TRY = fcntl.LOCK_EX | fcntl.LOCK_NB
UNLOCK = fcntl.LOCK_UN
#: tries before waiting in the kernel (each a system call of about 1 µs): a few critical
#: sections' worth, so a waiter whose holder was descheduled wastes little
SPINS = 20
#: then tries after giving the CPU away (``sched_yield``, about 1 µs each when nothing
#: else wants the CPU) for this long (seconds), for a holder that shares this process's
#: CPU: bounded by time, not by count, as a yield to a busy CPU may last a time slice, and
#: the GIL is held all along
YIELD_FOR = 0.0003


def _c_calls() -> (
    tuple[Callable[[int, int], int], Callable[[int, int, int], int], Callable[[], int]] | None
):
    """``flock``, ``lseek`` and ``sched_yield`` of the C library as calls that keep the
    GIL, or None."""
    try:
        libc = ctypes.PyDLL(None)
        c_flock = libc.flock
        c_lseek = libc.lseek64
        c_yield = libc.sched_yield
    except (AttributeError, OSError):  # pragma: no cover - no C library ctypes can open
        return None
    # No argtypes: converting through them costs more than the call (cachegrind, per
    # call: os.lseek 900 instructions, lseek64 with argtypes 6 000, without 2 500). Ints
    # go as C ints, which libffi widens to the register (lseek64's 64-bit offset; the
    # table passes 0). lseek's result is 64 bits: a table may be larger than 4 GiB.
    c_lseek.restype = ctypes.c_int64
    return c_flock, c_lseek, c_yield


_C = _c_calls()
#: the GIL-holding ``flock`` itself, for a caller that makes the try inline (the table, on
#: every update: a Python call less each way) and falls back on :func:`lock_file` /
#: :func:`unlock_file` when it answers non-zero or is None: ``C_FLOCK(fd, LOCK_TRY)``,
#: ``C_FLOCK(fd, UNLOCK)``
C_FLOCK: Callable[[int, int], int] | None = _C[0] if _C else None

#: ``lseek(fd, offset, whence)`` keeping the GIL, for an offset that fits a C int (the
#: table's is 0): the new offset, or -1 on an error (no exception, no errno:
#: :func:`file_size` says why); ``os.lseek`` without ``ctypes``
lseek: Callable[[int, int, int], int] = _C[1] if _C else os.lseek
#: ``sched_yield()`` keeping the GIL (see :func:`_wait`)
_C_YIELD: Callable[[], int] | None = _C[2] if _C else None


def file_size(fd: int) -> int:
    """The size of the file open on ``fd`` (its end, by ``lseek``, cheaper than
    ``fstat``). OSError if the descriptor is not open."""
    size = lseek(fd, 0, os.SEEK_END)
    if size < 0:
        return os.lseek(fd, 0, os.SEEK_END)  # raises the error with its errno
    return size


def lock_file(fd: int, yielding: bool = True) -> None:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it. OSError if the descriptor cannot be locked. ``yielding=False`` when the
    holder may be a thread of this process (another descriptor of the same file): it
    needs the GIL to let go, which the yielding tries keep."""
    if C_FLOCK is not None and C_FLOCK(fd, LOCK_TRY) == 0:
        return
    _wait(fd, yielding)


def _wait(fd: int, yielding: bool) -> None:
    """Take the lock another process holds (or raise why it cannot be taken): a few more
    tries keeping the GIL (the holder runs on another core and lets go within
    microseconds), then more, each after ``sched_yield`` (the holder may share this
    process's CPU; unless not ``yielding``), then wait in the kernel with the GIL let go."""
    c_flock = C_FLOCK
    if c_flock is not None:
        # No errno here: a lock that cannot be taken at all (a closed descriptor) fails
        # every try, and the kernel wait below raises its error.
        for _ in range(SPINS):
            if c_flock(fd, LOCK_TRY) == 0:
                return
        c_yield = _C_YIELD
        if c_yield is not None and yielding:
            deadline = time.perf_counter() + YIELD_FOR
            while True:
                c_yield()
                if c_flock(fd, LOCK_TRY) == 0:
                    return
                if time.perf_counter() >= deadline:
                    break
    else:
        for _ in range(SPINS):
            try:
                fcntl.flock(fd, LOCK_TRY)
            except BlockingIOError:
                continue
            return
    fcntl.flock(fd, fcntl.LOCK_EX)


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`lock_file` took."""
    if C_FLOCK is None or C_FLOCK(fd, UNLOCK) != 0:
        fcntl.flock(fd, UNLOCK)  # raises the error with its errno
