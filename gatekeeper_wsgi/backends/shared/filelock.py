"""The table file's lock and size, the system calls every update of the table makes.

Every update happens between :func:`lock_file` and :func:`unlock_file` of an exclusive
open-file-description lock on byte 0 (``F_OFD_SETLKW``): the kernel drops it when the last
descriptor of its open file description closes, so a killed process cannot leave it held.
:func:`file_size` is the check made before the map is touched (a file cut shorter than
the map is SIGBUS); the table reads it before it takes its thread lock, so that one fewer
system call lets go of the GIL while a thread holds that lock (every thread that runs
meanwhile would run up to the lock and sleep there). The per-request path takes the lock
twice.

Plain ``fcntl.fcntl`` and ``os.lseek``, which let go of the GIL around the call. A lock
another process holds is tried again ``SPINS`` times before waiting in the kernel: the
holder runs on another core and lets go within microseconds, while a wait in the kernel
costs the waiter a sleep and a wake-up. With 2 processes on this 2-core machine that took
host admits/s from 0.78 to 1.22 x one process's and the voluntary context switches per
admission from 1.86 to 0.11 (``benchmarks/shared.py``, issue 18; at load 12-15 earlier
it could not be shown: there the holder itself waits for a core). Measured and dropped:
the same calls through ``ctypes.PyDLL``, which keep the GIL so that no other thread runs
while the locks are held, cost 0.5 µs more per update and left as many voluntary context
switches per request with 8 threads (0.53 against 0.46).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

__all__ = ["file_size", "lock_file", "unlock_file"]

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
FLOCK = struct.Struct("hhxxxxqqixxxx")
LOCK = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
UNLOCK = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
#: what a try answers while another process holds the lock
_HELD = (errno.EAGAIN, errno.EACCES)
#: tries before waiting in the kernel (each a system call of about 1 µs): a few critical
#: sections' worth, so a waiter whose holder was descheduled wastes little
SPINS = 20


def file_size(fd: int) -> int:
    """The size of the file open on ``fd`` (its end, by ``lseek``, cheaper than
    ``fstat``). OSError if the descriptor is not open."""
    return os.lseek(fd, 0, os.SEEK_END)


def lock_file(fd: int) -> None:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it. OSError if the descriptor cannot be locked."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, LOCK)
    except OSError as exc:
        if exc.errno not in _HELD:
            raise
        _wait(fd)


def _wait(fd: int) -> None:
    """Take the lock another process holds: a few more tries first (the holder runs on
    another core and lets go within microseconds), then wait in the kernel."""
    for _ in range(SPINS):
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, LOCK)
        except OSError as exc:
            if exc.errno not in _HELD:
                raise
        else:
            return
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, LOCK)


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`lock_file` took."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, UNLOCK)
