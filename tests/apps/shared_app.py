"""A bare WSGI app behind GateKeeperMiddleware on the shared backend, served by gunicorn in
tests/test_shared.py as ``shared_app:create_app()`` (``--pythonpath tests/apps``).

``create_app()`` reads its environment: ``GK_SHARED_TABLE`` (the table file),
``GK_SHARED_OBSERVER`` (the observer file), ``GK_SHARED_LIMIT`` (the project's
concurrency). Paths:

- ``/work``: counts itself in the observer while it runs, until the limit is full or a
  few ms passed;
- ``/hold?until=<file>``: sends this worker's pid, then holds its slot until ``<file>``
  exists (or 30 s pass), so a test can kill the worker in mid-request.

The observer is independent of the gatekeeper: 8 bytes (current, highest number of
concurrent ``/work`` executions) in a file, updated under ``flock`` by every worker process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from gatekeeper_wsgi import GateKeeperMiddleware
from tests.servers import wait_until

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

_PAIR = struct.Struct("<ii")
HOLD_LIMIT = 30.0
WORK_LIMIT = 0.02


def observe(path: str, step: int) -> None:
    """Add ``step`` to the current count of executions and keep the highest count seen."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        current, highest = _PAIR.unpack(os.pread(fd, _PAIR.size, 0))
        current += step
        os.pwrite(fd, _PAIR.pack(current, max(highest, current)), 0)
    finally:
        os.close(fd)  # drops the flock


def read_observer(path: str) -> tuple[int, int]:
    """(current, highest) concurrent executions."""
    with open(path, "rb") as file:
        current, highest = _PAIR.unpack(file.read(_PAIR.size))
    return current, highest


def reset_observer(path: str) -> None:
    with open(path, "wb") as file:
        file.write(_PAIR.pack(0, 0))


def _hold(until: str) -> Iterator[bytes]:
    yield f"{os.getpid()}\n".encode()
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: os.path.exists(until), HOLD_LIMIT)
    yield b"released\n"


def inner(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "")
    if path == "/hold":
        until = parse_qs(environ.get("QUERY_STRING", "")).get("until", [""])[0]
        start_response("200 OK", [("Content-Type", "text/plain")])
        return _hold(until)
    observer, limit = os.environ["GK_SHARED_OBSERVER"], int(os.environ["GK_SHARED_LIMIT"])
    observe(observer, +1)
    try:
        # The work: it lasts until the limit is full (a newcomer would be turned away), or a
        # few ms at most, so requests really overlap however fast the machine is.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: read_observer(observer)[0] >= limit, WORK_LIMIT)
    finally:
        observe(observer, -1)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"done\n"]


def create_app() -> GateKeeperMiddleware:
    """The app wrapped in the middleware, configured from the environment."""
    return GateKeeperMiddleware(
        inner,
        {
            "project": "shop",
            "backend": f"shared://{os.environ['GK_SHARED_TABLE']}",
            "limits": {"shop": {"concurrency": int(os.environ["GK_SHARED_LIMIT"])}},
        },
    )
