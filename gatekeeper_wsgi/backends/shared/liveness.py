"""Process liveness for the shared table: whether the owner of a lease is gone (exited,
a zombie, or its pid reused by a newer process), and this boot's id (a table written
before a reboot is stale). Reads /proc; Linux only, as the table is.
"""

from __future__ import annotations

import os

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
        return fields[0].decode("ascii", "replace"), int(fields[19])
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
