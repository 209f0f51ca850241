"""Workers forked without Python's fork hooks: uWSGI by default loads the app in its master
and forks the workers in C, so ``os.register_at_fork`` hooks never run in them (unless
``--py-call-osafterfork``). What each process must own - its request ids, its Redis lease
ids - is still its own: the code that needs it compares the process id.

The children here are forked the way uWSGI forks them, by libc's ``fork`` (``ctypes``)."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.identify import request_id_from

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")


def fork_without_hooks() -> int:
    """``os.fork()`` as uWSGI's master forks a worker: libc's fork, with the GIL held
    (``PyDLL``) and none of Python's at-fork hooks run in the child."""
    fork: Callable[[], int] = ctypes.PyDLL(None).fork
    return fork()


def in_children(count: int, work: Callable[[], tuple[bytes, Callable[[], Any]]]) -> list[bytes]:
    """Run ``work`` in ``count`` children forked without hooks, all at once: each reports
    the bytes it returns and holds on (its cleanup not yet run) until every child has
    reported; then each cleans up and exits. The reports, in fork order."""
    release_read, release_write = os.pipe()
    readers: list[int] = []
    pids: list[int] = []
    for _ in range(count):
        read, write = os.pipe()
        pid = fork_without_hooks()
        if pid == 0:  # the child: report a failure by its exit code, with its traceback
            code = 1
            try:
                os.close(read)
                os.close(release_write)
                report, cleanup = work()
                os.write(write, report)
                os.close(write)
                os.read(release_read, 1)  # end of file: the parent has every report
                cleanup()
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        os.close(write)
        readers.append(read)
        pids.append(pid)
    reports = []
    for read in readers:
        chunks = []
        while chunk := os.read(read, 4096):
            chunks.append(chunk)
        os.close(read)
        reports.append(b"".join(chunks))
    os.close(release_write)
    os.close(release_read)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    return reports


def test_generated_request_ids_are_unique_across_such_workers() -> None:
    """Ids made for requests without one (faults, logs) never repeat across workers that
    the master forked after it made some itself."""
    made = {request_id_from({}, "HTTP_X_REQUEST_ID") for _ in range(3)}

    def work() -> tuple[bytes, Callable[[], Any]]:
        ids = [request_id_from({}, "HTTP_X_REQUEST_ID") for _ in range(3)]
        return " ".join(ids).encode(), lambda: None

    reports = in_children(3, work)
    ids = [made_id for report in reports for made_id in report.decode().split()]
    assert len(ids) == 9
    assert len(set(ids) | made) == 12


@pytest.mark.redis
def test_redis_workers_forked_after_the_app_loaded_hold_their_own_leases(prefixed: str) -> None:
    """The app (and its Redis backend) made in the master, three workers forked from it,
    each admitting its first request at once: their lease ids are their own, so a
    concurrency of 2 admits exactly 2 (with the master's lease ids they were one lease,
    and all three got in)."""
    gk = GateKeeper(
        {"project": "shop", "backend": prefixed, "limits": {"shop/k": {"concurrency": 2}}}
    )
    gk.admit("shop", "warm", "c").release(200)  # the master used it: connection, scripts

    def work() -> tuple[bytes, Callable[[], Any]]:
        try:
            admission = gk.admit("shop", "k", "c")
        except Exception:
            return b"refused", gk.close

        def cleanup() -> None:
            admission.release(200)
            gk.close()

        return b"admitted", cleanup

    reports = in_children(3, work)
    assert sorted(reports) == [b"admitted", b"admitted", b"refused"]
    gk.close()
