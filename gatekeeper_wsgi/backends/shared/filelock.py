"""The table file's lock and size, the system calls every update of the table makes.

Every update happens between :func:`lock_file` and :func:`unlock_file` of an exclusive
open-file-description lock on byte 0 (``F_OFD_SETLKW``): the kernel drops it when the last
descriptor of its open file description closes, so a killed process cannot leave it held.
:func:`file_size` is the check made under it before the map is touched (a file cut
shorter than the map is SIGBUS).

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

__all__ = ["file_size", "lock_file", "unlock_file"]

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
FLOCK = struct.Struct("hhxxxxqqixxxx")
LOCK = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
UNLOCK = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)


def lock_file(fd: int) -> None:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it. OSError if the descriptor cannot be locked."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, LOCK)


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`lock_file` took."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, UNLOCK)


def file_size(fd: int) -> int:
    """The size of the file open on ``fd`` (its end, by ``lseek``)."""
    return os.lseek(fd, 0, os.SEEK_END)
