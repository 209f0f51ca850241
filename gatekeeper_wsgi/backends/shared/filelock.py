"""The table file's lock and size, the system calls every update of the table makes, made
without letting go of the GIL where they cannot block.

Every update happens between :func:`lock_file` and :func:`unlock_file` of an exclusive
open-file-description lock on byte 0 (``F_OFD_SETLK``): the kernel drops it when the last
descriptor of its open file description closes, so a killed process cannot leave it held.
:func:`file_size` (and :data:`lseek`, the same call for the table's own use) is the check
made before the map is touched (a file cut shorter than the map is SIGBUS). The
per-request path takes the lock twice.

**Why not plain** ``fcntl.fcntl`` **and** ``os.lseek``: they let go of the GIL around the
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
(``F_OFD_SETLKW``). The retries keep the GIL because a thread that lets it go there hands
it to another thread of its process, which keeps it until it blocks or its switch interval
ends, while the retrying thread waits for it holding the thread lock and, once a retry
succeeds, the file lock: every process of the host then waits for the GIL of one (issue
18: with 2 processes of 4 threads making direct calls, 30 to 70 µs per update that found
the lock held, against 8 µs with one thread each; under gunicorn, ``benchmarks/shared.py``'s
throughput section, 117-124 µs against 67-103 µs once the retries kept the GIL). A failed
GIL-holding unlock is made again by the plain call, which raises the error with its errno;
a lock that cannot be taken at all fails every retry, and the kernel wait raises its error.
Where ``ctypes`` cannot reach the C library every call is the plain one.

(An earlier try of the same calls, 8add9e8, was reverted for 0.5 µs more per update and
no fewer switches in a run where the convoy had not formed; see ``benchmarks/RESULTS.md``
for the interleaved figures that kept this one.)
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
from collections.abc import Callable
from typing import Any

__all__ = [
    "C_FCNTL",
    "C_LOCK",
    "C_UNLOCK",
    "SETLK",
    "file_size",
    "lock_file",
    "lseek",
    "unlock_file",
]

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
FLOCK = struct.Struct("hhxxxxqqixxxx")
LOCK = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
UNLOCK = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
SETLK = fcntl.F_OFD_SETLK
#: what a try answers while another process holds the lock
_HELD = (errno.EAGAIN, errno.EACCES)
#: tries before waiting in the kernel (each a system call of about 1 µs): a few critical
#: sections' worth, so a waiter whose holder was descheduled wastes little
SPINS = 20


def _c_calls() -> tuple[Callable[..., int], Callable[[int, int, int], int]] | None:
    """``fcntl`` and ``lseek`` of the C library as calls that keep the GIL, or None."""
    try:
        libc = ctypes.PyDLL(None)
        c_fcntl = libc.fcntl
        c_lseek = libc.lseek64
    except (AttributeError, OSError):  # pragma: no cover - no C library ctypes can open
        return None
    # No argtypes: converting through them costs more than the call (cachegrind, per
    # call: fcntl.fcntl 1 400 instructions, this fcntl 2 500; os.lseek 900, lseek64 with
    # argtypes 6 000, without 2 500). Ints go as C ints, which libffi widens to the
    # register (lseek64's 64-bit offset; the table passes 0), the buffers below by
    # pointer, as fcntl.fcntl passes LOCK. lseek's result is 64 bits: a table may be
    # larger than 4 GiB.
    c_lseek.restype = ctypes.c_int64
    return c_fcntl, c_lseek


_C = _c_calls()
#: the GIL-holding try itself, for a caller that makes it inline (the table, on every
#: update: a Python call less each way) and falls back on :func:`lock_file` /
#: :func:`unlock_file` when it answers non-zero or is None: ``C_FCNTL(fd, SETLK,
#: C_LOCK)``, ``C_FCNTL(fd, SETLK, C_UNLOCK)``
C_FCNTL: Callable[..., int] | None = _C[0] if _C else None
# The kernel only reads these for F_OFD_SETLK: one buffer each serves every thread.
C_LOCK: Any = ctypes.create_string_buffer(LOCK, len(LOCK))
C_UNLOCK: Any = ctypes.create_string_buffer(UNLOCK, len(UNLOCK))

#: ``lseek(fd, offset, whence)`` keeping the GIL, for an offset that fits a C int (the
#: table's is 0): the new offset, or -1 on an error (no exception, no errno:
#: :func:`file_size` says why); ``os.lseek`` without ``ctypes``
lseek: Callable[[int, int, int], int] = _C[1] if _C else os.lseek


def file_size(fd: int) -> int:
    """The size of the file open on ``fd`` (its end, by ``lseek``, cheaper than
    ``fstat``). OSError if the descriptor is not open."""
    size = lseek(fd, 0, os.SEEK_END)
    if size < 0:
        return os.lseek(fd, 0, os.SEEK_END)  # raises the error with its errno
    return size


def lock_file(fd: int) -> None:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it. OSError if the descriptor cannot be locked."""
    if C_FCNTL is not None and C_FCNTL(fd, SETLK, C_LOCK) == 0:
        return
    _wait(fd)


def _wait(fd: int) -> None:
    """Take the lock another process holds (or raise why it cannot be taken): a few more
    tries keeping the GIL (the holder runs on another core and lets go within
    microseconds), then wait in the kernel with the GIL let go."""
    c_fcntl = C_FCNTL
    if c_fcntl is not None:
        # No errno here: a lock that cannot be taken at all (a closed descriptor) fails
        # every try, and the kernel wait below raises its error.
        for _ in range(SPINS):
            if c_fcntl(fd, SETLK, C_LOCK) == 0:
                return
    else:
        for _ in range(SPINS):
            try:
                fcntl.fcntl(fd, SETLK, LOCK)
            except OSError as exc:
                if exc.errno not in _HELD:
                    raise
            else:
                return
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, LOCK)


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`lock_file` took."""
    if C_FCNTL is None or C_FCNTL(fd, SETLK, C_UNLOCK) != 0:
        fcntl.fcntl(fd, SETLK, UNLOCK)  # raises the error with its errno
