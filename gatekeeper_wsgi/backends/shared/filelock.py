"""The table file's lock, taken and dropped without letting go of the GIL.

Every update of the table happens between :func:`lock_file` and :func:`unlock_file` of an exclusive
open-file-description lock on byte 0 (``F_OFD_SETLK``: the kernel drops it when the last
descriptor of its open file description closes, so a killed process cannot leave it held).

Why not plain ``fcntl.fcntl``: it releases the GIL around the system call, as every
blocking call of the standard library does. A thread taking or dropping the lock then
waits for the GIL to come back, which another thread of the process may keep for the
whole switch interval (5 ms) while running its app, and all the while this thread holds
the thread lock and, after taking it, the file lock that every other process waits for.
Under a threaded server (gunicorn ``gthread``) that convoy, not the table's work, was what
a request cost. A lock that is free is taken at once, so the first attempt is a
non-blocking ``F_OFD_SETLK`` through ``ctypes.PyDLL`` (which keeps the GIL); only when
another process holds the lock is it waited for by ``fcntl.fcntl(F_OFD_SETLKW)`` with the
GIL released. Unlocking and reading the file size never block. Where ``ctypes`` cannot
reach the C library the calls fall back to ``fcntl.fcntl`` and ``os.lseek``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
from collections.abc import Callable
from typing import Any

__all__ = ["file_size", "lock_file", "unlock_file"]

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
FLOCK = struct.Struct("hhxxxxqqixxxx")
LOCK = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
UNLOCK = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
_SETLK = fcntl.F_OFD_SETLK
_SETLKW = fcntl.F_OFD_SETLKW
#: non-blocking attempts (about 0.5 µs each) before waiting in the kernel: another process
#: holds the lock for one update (microseconds), and going to sleep on it then being woken
#: costs a context switch each way, which is longer than the update itself
SPINS = 40

_fcntl: Callable[..., int] | None = None
_lseek: Callable[..., int] | None = None
try:
    _libc = ctypes.PyDLL(None)
    _fcntl = _libc.fcntl
    _lseek = _libc.lseek64
    _lseek.restype = ctypes.c_int64
    _lseek.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int)
except (AttributeError, OSError):  # no C library ctypes can open: the GIL-releasing calls
    _fcntl = _lseek = None
# ctypes passes the bytes of these buffers by pointer, as fcntl.fcntl passes LOCK.
_LOCK: Any = ctypes.create_string_buffer(LOCK, len(LOCK))
_UNLOCK: Any = ctypes.create_string_buffer(UNLOCK, len(UNLOCK))


def lock_file(fd: int) -> None:
    """Take the exclusive lock of the table open on ``fd``, waiting while another process
    holds it. OSError if the descriptor cannot be locked."""
    if _fcntl is not None:
        for _ in range(SPINS):
            if not _fcntl(fd, _SETLK, _LOCK):
                return
    # Held elsewhere for longer (or interrupted): wait with the GIL released. A real error,
    # such as a closed descriptor, is raised from here with its errno.
    fcntl.fcntl(fd, _SETLKW, LOCK)


def unlock_file(fd: int) -> None:
    """Drop the lock :func:`lock_file` took."""
    if _fcntl is None or _fcntl(fd, _SETLK, _UNLOCK) != 0:
        fcntl.fcntl(fd, _SETLK, UNLOCK)  # raises the error with its errno


def file_size(fd: int) -> int:
    """The size of the file open on ``fd`` (its end, by ``lseek``)."""
    if _lseek is not None:
        size = _lseek(fd, 0, os.SEEK_END)
        if size >= 0:
            return size
    return os.lseek(fd, 0, os.SEEK_END)
