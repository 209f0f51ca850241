"""The table file's lock and size, the system calls every update of the table makes.

Every update happens between :func:`sized_lock` and :func:`unlock_file` of an exclusive
open-file-description lock on byte 0 (``F_OFD_SETLKW``): the kernel drops it when the last
descriptor of its open file description closes, so a killed process cannot leave it held.
:func:`sized_lock` reads the file's size first, the check made before the map is touched
(a file cut shorter than the map is SIGBUS), in the same call: the per-request path takes
the lock twice.

Plain ``fcntl.fcntl`` and ``os.lseek``, which let go of the GIL around the call. Measured
and dropped (issue 18, ``benchmarks/shared.py``): the same calls through ``ctypes.PyDLL``,
which keep the GIL so that no other thread runs while the locks are held, cost 0.5 µs more
per update and left as many voluntary context switches per request with 8 threads (0.53
against 0.46); non-blocking tries repeated before waiting in the kernel could not be shown
to save waits with 2 processes on the loaded machine they were measured on (0.019 against
0.029 context switches per admission, within the noise of a load average of 12 to 15).
"""

from __future__ import annotations

import fcntl
import os
import struct

__all__ = ["sized_lock", "unlock_file"]

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
FLOCK = struct.Struct("hhxxxxqqixxxx")
LOCK = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
UNLOCK = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)


def sized_lock(fd: int) -> int:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it, and return the file's size (its end, by ``lseek``) read just before: the
    check every update makes before it touches the map, in the same call. OSError if the
    descriptor cannot be locked."""
    size = os.lseek(fd, 0, os.SEEK_END)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, LOCK)
    return size


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`sized_lock` took."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, UNLOCK)
