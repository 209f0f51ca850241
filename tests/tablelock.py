"""The shared table's file lock as a test sees it: from an open file description of its
own, as another process would."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_free(path: Path) -> bool:
    """Whether another open file description may take the table's lock now (taken and let
    go at once when it may)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if not try_lock(fd):
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def try_lock(fd: int) -> bool:
    """Take the table's lock on ``fd`` without waiting: False while someone else holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
