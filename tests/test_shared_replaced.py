"""The shared table's path deleted or given another file under running processes: each
process notices within ``PATH_CHECK_EVERY`` (the clock injected here), logs one ERROR and
counts in the file now at the path, so every process counts in one file again. Real files
and real forked processes, no mocks.

What must hold (SPEC §4.1, §4.6, §4.10): the in-flight count never exceeds the concurrency
once the replacement is noticed; a symlink or foreign file put at the path is refused as at
start, never followed nor overwritten.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper, Rejected
from gatekeeper_wsgi.backends.shared import table as table_module
from tests.conftest import FakeClock
from tests.test_shared_files import Worker


def settings_for(path: Path) -> dict[str, Any]:
    return {
        "project": "shop",
        "backend": f"shared://{path}",
        "on_backend_error": "reject",
        "limits": {"shop": {"concurrency": 1}},
    }


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """The path of a table file that does not exist yet."""
    return tmp_path / "x.shm"


@pytest.fixture
def path_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The clock the tables of this process (and of processes forked from it) time their
    looks at the path by: the interval passes when the test advances it."""
    clock = FakeClock()
    monkeypatch.setattr(table_module, "_monotonic", clock)
    return clock


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    """The workers a test starts, stopped at its end."""
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


def busy(path: Path) -> dict[str, int]:
    """What an observer process attaching to the file at ``path`` now counts in flight."""
    observer = GateKeeper(settings_for(path))
    try:
        return {key: count for key, count in observer.inflight().items() if count}
    finally:
        observer.close()


def refusal(gk: GateKeeper) -> str:
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "api", "a")
    return refused.value.code


def path_errors(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    """The ERRORs the table logged about ``path`` (not the engine's of a refusal)."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.ERROR
        and record.getMessage().startswith(f"gatekeeper: shared table {path}")
    ]


@pytest.mark.parametrize("release_first", [True, False], ids=["released", "still-held"])
def test_table_replaced_under_a_process_is_followed(
    table: Path,
    path_clock: FakeClock,
    workers: list[Worker],
    caplog: pytest.LogCaptureFixture,
    release_first: bool,
) -> None:
    """A holds the only slot; the file is deleted and B, starting, creates a new one and
    takes its slot. Once the interval has passed, A notices with one ERROR naming the path
    and counts in B's file: refused while B holds the slot, admitted once B releases; the
    release of A's lease from the old file leaves B's count alone."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    a = GateKeeper(settings_for(table))
    old = a.admit("shop", "api", "a")
    os.unlink(table)
    b = Worker(table, settings_for(table))
    workers.append(b)
    assert b("admit", "api", "b") == "admitted"
    if release_first:
        old.release(200)
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"
    errors = path_errors(caplog, table)
    assert len(errors) == 1, errors
    assert "was replaced by another file" in errors[0]
    if not release_first:
        old.release(200)
    assert busy(table) == {"shop": 1}
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"
    assert b("release") == "released"
    again = a.admit("shop", "api", "a")
    assert busy(table) == {"shop": 1}
    assert b("admit", "api", "b") == "GK-CONCURRENCY-LIMIT"
    again.release(200)
    assert busy(table) == {}
    assert len(path_errors(caplog, table)) == 1
    a.close()


@pytest.mark.parametrize("how", ["deleted", "cut short"])
def test_a_status_read_is_the_first_look_at_a_table_recreated_elsewhere(
    table: Path, path_clock: FakeClock, workers: list[Worker], how: str
) -> None:
    """B re-created the table (A's file deleted, or cut short) and holds its slot; A's
    first look at it is a status read (``gk.stats()``: a health check, a status view).
    It reads B's table: it once read the leases of A's old map, closed by then, took
    that for damage and re-created the table under B's counts, giving B's slot away."""
    a = GateKeeper(settings_for(table))
    a.admit("shop", "api", "a").release(200)
    if how == "deleted":
        os.unlink(table)
    else:
        os.truncate(table, 0)
    b = Worker(table, settings_for(table))
    workers.append(b)
    assert b("admit", "api", "b") == "admitted"
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert a.stats()["counters"]["delayed_pending"] == 0
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"
    assert busy(table) == {"shop": 1}
    assert b("release") == "released"
    a.admit("shop", "api", "a").release(200)
    a.close()


def test_a_table_damaged_again_and_again_is_one_error_an_interval(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever can write the file can cut it short again and again: each time it is
    re-created (nothing counted is lost that was not lost already), with one ERROR per
    interval and the count of incidents since, not one per incident in every process."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    gk = GateKeeper(settings_for(table))
    for _ in range(20):
        os.truncate(table, 100)
        # The admission that finds it damaged is a backend failure (re-created meanwhile);
        # the next ones count in the new table.
        assert refusal(gk) == "GK-BACKEND-UNAVAILABLE"
        held = gk.admit("shop", "api", "a")
        assert refusal(gk) == "GK-CONCURRENCY-LIMIT"
        held.release(200)
    errors = path_errors(caplog, table)
    assert len(errors) == 1, errors
    assert "is damaged" in errors[0] and "(requests in flight" in errors[0]
    gk.close()


def test_table_renamed_over_is_followed(
    table: Path, path_clock: FakeClock, workers: list[Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """A new table renamed over the path (the file A has open stays, unnamed): A notices
    it was replaced, with one ERROR, and counts in the new one with B."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    a = GateKeeper(settings_for(table))
    a.admit("shop", "api", "a").release(200)
    fresh = table.with_name("fresh.shm")
    GateKeeper(settings_for(fresh)).close()
    os.rename(fresh, table)
    b = Worker(table, settings_for(table))
    workers.append(b)
    assert b("admit", "api", "b") == "admitted"
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"
    errors = path_errors(caplog, table)
    assert len(errors) == 1, errors
    assert "was replaced by another file" in errors[0]
    a.close()


def test_deleted_table_is_created_again(
    table: Path, path_clock: FakeClock, workers: list[Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """The path deleted and nobody creating it again: A's next operation after the interval
    creates it (private, as at start), with one ERROR, and a process starting then counts
    in it with A. The admission that found it deleted is a backend failure: refused, as
    on_backend_error says here (SPEC 4.6)."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    a = GateKeeper(settings_for(table))
    old = a.admit("shop", "api", "a")
    os.unlink(table)
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert refusal(a) == "GK-BACKEND-UNAVAILABLE"
    assert a.stats()["counters"]["backend_errors"] == 1
    new = a.admit("shop", "api", "a")  # the old file's lease is not counted in the new one
    assert stat.S_IMODE(table.stat().st_mode) == 0o600
    errors = path_errors(caplog, table)
    assert len(errors) == 1, errors
    assert "was deleted" in errors[0]
    b = Worker(table, settings_for(table))
    workers.append(b)
    assert b("admit", "api", "b") == "GK-CONCURRENCY-LIMIT"
    old.release(200)
    assert b("admit", "api", "b") == "GK-CONCURRENCY-LIMIT"
    new.release(200)
    assert b("admit", "api", "b") == "admitted"
    assert busy(table) == {"shop": 1}
    a.close()


def test_symlink_put_at_the_path_is_never_followed(
    tmp_path: Path, table: Path, path_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A symlink put at the path of a running table is never followed: the process keeps
    counting in the file it has open (one ERROR says so), the target is untouched; once the
    symlink is gone, the table is created again at the path and counts."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    a = GateKeeper(settings_for(table))
    a.admit("shop", "api", "a").release(200)
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    target.chmod(0o600)
    os.unlink(table)
    table.symlink_to(target)
    for _ in range(3):
        path_clock.advance(table_module.PATH_CHECK_EVERY)
        held = a.admit("shop", "api", "a")
        assert refusal(a) == "GK-CONCURRENCY-LIMIT"  # counted, in the file it has open
        held.release(200)
    assert len(path_errors(caplog, table)) == 1
    assert target.read_bytes() == b"precious"
    assert table.is_symlink()
    table.unlink()
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert refusal(a) == "GK-BACKEND-UNAVAILABLE"  # the admission that found it deleted
    admission = a.admit("shop", "api", "a")
    assert table.is_file() and not table.is_symlink()
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"
    admission.release(200)
    assert target.read_bytes() == b"precious"
    a.close()


@pytest.mark.parametrize("blocker", ["directory", "fifo"])
def test_table_moved_away_and_back_loses_no_release(
    table: Path, path_clock: FakeClock, blocker: str
) -> None:
    """The file moved away, something unusable put at the path while a request is in
    flight, then the file moved back: the request's release still reaches the file it was
    admitted in, so once the file is back the limit admits again and nothing stays held."""
    a = GateKeeper(settings_for(table))
    held = a.admit("shop", "api", "a")
    away = table.with_name("moved-away.shm")
    os.rename(table, away)
    if blocker == "directory":
        table.mkdir()
    else:
        os.mkfifo(table)
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert refusal(a) == "GK-CONCURRENCY-LIMIT"  # still counting in the file it has open
    held.release(200)
    if blocker == "directory":
        table.rmdir()
    else:
        table.unlink()
    os.rename(away, table)
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    admission = a.admit("shop", "api", "a")
    assert busy(table) == {"shop": 1}
    admission.release(200)
    assert busy(table) == {}
    a.close()


def test_foreign_file_put_at_the_path_is_refused_untouched(
    table: Path, path_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Another file of this user put at the path is no table: refused (on_backend_error
    decides), never overwritten."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    a = GateKeeper(settings_for(table))
    a.admit("shop", "api", "a").release(200)
    os.unlink(table)
    table.write_bytes(b"somebody's data" * 100)
    table.chmod(0o600)
    path_clock.advance(table_module.PATH_CHECK_EVERY)
    assert [refusal(a) for _ in range(2)] == ["GK-BACKEND-UNAVAILABLE"] * 2
    assert table.read_bytes() == b"somebody's data" * 100
    assert any("not a gatekeeper shared table" in message for message in caplog.messages)
    a.close()


def test_a_table_made_writable_by_others_is_reported_at_once(
    table: Path, path_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The table in use made writable by others (chmod 0666): the processes using it log
    one ERROR naming why (a process starting now refuses it: the next worker a server
    starts would not boot), and go on counting in it; fixed, it is quiet again."""
    caplog.set_level(logging.ERROR, "gatekeeper")
    gk = GateKeeper(settings_for(table))
    try:
        os.chmod(table, 0o666)
        for _ in range(3):
            path_clock.advance(table_module.PATH_CHECK_EVERY)
            gk.admit("shop", "api", "a").release(200)
        (error,) = path_errors(caplog, table)
        assert "can no longer be trusted: it is writable by group and others" in error
        os.chmod(table, 0o600)
        path_clock.advance(table_module.PATH_CHECK_EVERY)
        gk.admit("shop", "api", "a").release(200)
        os.chmod(table, 0o606)  # loosened again: said again
        path_clock.advance(table_module.PATH_CHECK_EVERY)
        gk.admit("shop", "api", "a").release(200)
        assert len(path_errors(caplog, table)) == 2
    finally:
        gk.close()
