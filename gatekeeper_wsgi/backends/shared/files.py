"""Opening the shared table's file safely: created 0600 (``?mode=`` may add group
read/write) with ``O_CREAT|O_EXCL|O_NOFOLLOW``; an existing file is used only when
``fstat`` on the opened descriptor shows a regular file with one name, of this user (or of
the group with a group mode), that nobody else may write. Anything else is a ConfigError
naming the path and why (SPEC §4.10).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection

from gatekeeper_wsgi.errors import ConfigError

#: the file's mode when created; ``?mode=`` may add group read/write, nothing else
DEFAULT_MODE = 0o600
_MODES_ALLOWED = 0o660

# O_NOFOLLOW: a symlink planted at the path is refused, not followed to its target;
# O_NONBLOCK: opening a FIFO planted there does not wait for a writer.
_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def check_mode(path: str, mode: int) -> None:
    """ConfigError unless ``mode`` is 0600 plus at most group read/write."""
    if mode & ~_MODES_ALLOWED or mode & 0o600 != 0o600:
        raise ConfigError(
            "backend",
            f"mode {mode:04o} for the shared table {path!r}: expected 0600 plus at "
            f"most group read/write (e.g. 0660); others never get access",
        )


def open_private(path: str, mode: int) -> int:
    """Open (creating it with ``mode``) the table file, refusing anything another user
    could have planted or could write: see :func:`unfit`. ConfigError says why."""
    for _ in range(3):  # the file may vanish or appear between the two opens
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ConfigError(
                "backend", f"cannot open the shared table {path!r}: {exc.strerror}"
            ) from exc
        else:
            os.fchmod(fd, mode)  # the umask may have taken group bits ?mode= asked for
            return fd
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _unopenable(path, exc) from exc
        problem = unfit(os.fstat(fd), mode)
        if problem is None:
            return fd
        os.close(fd)
        raise ConfigError("backend", f"refusing the shared table {path!r}: {problem}")
    raise ConfigError("backend", f"cannot open the shared table {path!r}: it keeps changing")


def check_file(path: str, mode: int, magics: Collection[bytes]) -> None:
    """ConfigError for a file at ``path`` that :func:`open_private` would refuse, or whose
    first bytes are none of ``magics`` and not zeros (not a table: start-up would refuse
    to overwrite it). Nothing is created or changed: no file there is fine."""
    check_mode(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _unopenable(path, exc) from exc
    try:
        problem = unfit(os.fstat(fd), mode)
        if problem is not None:
            raise ConfigError("backend", f"refusing the shared table {path!r}: {problem}")
        head = os.pread(fd, max(map(len, magics)), 0)
        if head.strip(b"\0") and not head.startswith(tuple(magics)):
            raise ConfigError(
                "backend", f"{path!r} is not a gatekeeper shared table; it would not be used"
            )
    finally:
        os.close(fd)


def _unopenable(path: str, exc: OSError) -> ConfigError:
    reason = "it is a symbolic link (never followed)" if exc.errno == errno.ELOOP else exc.strerror
    return ConfigError("backend", f"cannot open the shared table {path!r}: {reason}")


def unfit(info: os.stat_result, mode: int) -> str | None:
    """Why an existing file must not be used as the table, None if it may: it must be a
    regular file with one name, owned by this process's user (or, when ``mode`` shares it
    with the group, by the group), writable by nobody else. Checked on the open
    descriptor (``fstat``), so the file cannot be swapped between the check and the use."""
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a socket"
            if stat.S_ISSOCK(info.st_mode)
            else "a directory"
            if stat.S_ISDIR(info.st_mode)
            else "a device"
        )
        return f"it is {kind}, not a regular file"
    euid = os.geteuid()
    group_shared = bool(mode & 0o060)
    if info.st_uid != euid and not (
        group_shared and info.st_gid in (os.getegid(), *os.getgroups())
    ):
        return f"it is owned by uid {info.st_uid}, not by this process's user (uid {euid})" + (
            "" if group_shared else "; ?mode=0660 shares a table within a group"
        )
    if info.st_nlink != 1:
        # Another name for the same file (a hard link someone made) could be anything.
        return f"it has {info.st_nlink} hard links; a table has exactly one name"
    writable = info.st_mode & 0o022 & ~mode
    if writable:
        who = "group and others" if writable == 0o022 else "group" if writable & 0o020 else "others"
        return (
            f"it is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}, this table "
            f"allows {mode:04o}; ?mode=0660 shares it within a group)"
        )
    return None
