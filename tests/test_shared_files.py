"""The shared table file as an attacker or an accident meets it: planted files, symlinks,
FIFOs, loose modes, and a live table truncated, zeroed, overwritten or given a corrupt
journal under running worker processes. Real files and real forked processes, no mocks.

What must hold (SPEC §4.6, §4.10): an unfit file is a ``ConfigError`` naming the path and
the reason, and is left untouched; a broken table is never a crash (no SIGBUS, no
``struct.error``, no 500): it is re-created with one ERROR log and counts exactly again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import os
import random
import stat
import struct
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.backends.shared import HEADER, NODE_HEAD, SharedBackend
from gatekeeper_wsgi.backends.shared.layout import node_view
from gatekeeper_wsgi.errors import ConfigError
from tests.conftest import admits_exactly
from tests.servers import wait_until
from tests.tablelock import try_lock

DEADLINE = 20.0
H_JLEN = 12
LIMITS: dict[str, Any] = {"shop": {"concurrency": 3}, "shop/login/*": {"rate": "2/hour"}}


def settings_for(path: Path, query: str = "", **options: Any) -> dict[str, Any]:
    return {"project": "shop", **options, "backend": f"shared://{path}{query}", "limits": LIMITS}


@pytest.fixture
def table(tmp_path: Path) -> Path:
    """The path of a table file that does not exist yet."""
    return tmp_path / "gatekeeper.shm"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def refusal(path: Path, query: str = "") -> str:
    """The ConfigError message a GateKeeper on ``path`` gives."""
    with pytest.raises(ConfigError) as info:
        GateKeeper(settings_for(path, query))
    message = str(info.value)
    assert str(path) in message
    return message


# --- who may own, write and be the file ---------------------------------------------------


def test_created_private_whatever_the_umask(table: Path) -> None:
    """A new table is mode 0600 even under umask 000."""
    with umask(0):
        GateKeeper(settings_for(table)).close()
    assert stat.S_IMODE(table.stat().st_mode) == 0o600


def test_mode_option_shares_with_the_group_whatever_the_umask(table: Path) -> None:
    """?mode=0660 creates the table group read/write even under umask 077."""
    with umask(0o077):
        GateKeeper(settings_for(table, "?mode=0660")).close()
    assert stat.S_IMODE(table.stat().st_mode) == 0o660
    GateKeeper(settings_for(table, "?mode=0660")).close()  # and reuses it


@pytest.mark.parametrize("mode", ["0666", "0777", "0644", "0400", "0", "9", "x", "1" * 5000])
def test_mode_option_never_opens_the_table_to_others(table: Path, mode: str) -> None:
    """?mode= refuses anything but 0600 plus group read/write, and numbers of any length."""
    with pytest.raises(ConfigError, match="mode"):
        SharedBackend.from_url(f"shared://{table}?mode={mode}")
    assert not table.exists()


@pytest.mark.parametrize(("mode", "who"), [(0o666, "group and others"), (0o602, "others")])
def test_planted_writable_table_is_refused_untouched(table: Path, mode: int, who: str) -> None:
    """A table file others may write (as a planted 0666 one) is refused, not adopted."""
    GateKeeper(settings_for(table)).close()
    table.chmod(mode)
    content = table.read_bytes()
    message = refusal(table)
    assert f"writable by {who}" in message
    assert table.read_bytes() == content


def test_group_writable_table_needs_the_mode_option(table: Path) -> None:
    """A 0660 table is refused by default and accepted with ?mode=0660."""
    GateKeeper(settings_for(table)).close()
    table.chmod(0o660)
    assert "writable by group" in refusal(table)
    gk = GateKeeper(settings_for(table, "?mode=0660"))
    gk.admit("shop", "api", "c").release(200)
    gk.close()


root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")


@root_only
def test_table_of_another_user_is_refused(table: Path) -> None:
    """A table owned by another user, even 0600 and full of their leases, is refused."""
    gk = GateKeeper(settings_for(table))
    held = [gk.admit("shop", "api", "c") for _ in range(3)]
    os.chown(table, 12345, 12345)
    message = refusal(table)
    assert "owned by uid 12345" in message
    del held
    gk.close()


@root_only
def test_group_shared_table_of_another_user_is_used_with_the_mode_option(table: Path) -> None:
    """With ?mode=0660 a table owned by another user of our group is used."""
    GateKeeper(settings_for(table, "?mode=0660")).close()
    os.chown(table, 12345, os.getegid())
    assert "owned by uid 12345" in refusal(table)
    gk = GateKeeper(settings_for(table, "?mode=0660"))
    gk.admit("shop", "api", "c").release(200)
    gk.close()


def test_symlink_at_the_path_is_never_followed(tmp_path: Path, table: Path) -> None:
    """A symlink at the path, to a file or dangling, is refused; its target is untouched."""
    target = tmp_path / "precious"
    target.write_bytes(b"precious")
    target.chmod(0o600)
    table.symlink_to(target)
    assert "symbolic link" in refusal(table)
    assert target.read_bytes() == b"precious"
    table.unlink()
    table.symlink_to(tmp_path / "nowhere")
    assert "symbolic link" in refusal(table)
    assert not (tmp_path / "nowhere").exists()


def test_hard_linked_table_is_refused(tmp_path: Path, table: Path) -> None:
    """A table file with a second name (a hard link planted elsewhere) is refused."""
    GateKeeper(settings_for(table)).close()
    os.link(table, tmp_path / "other-name")
    assert "2 hard links" in refusal(table)


def test_fifo_directory_and_device_are_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO, a directory or a device at the path: ConfigError at once, nothing opened."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    assert "a FIFO, not a regular file" in refusal(fifo)
    directory = tmp_path / "dir"
    directory.mkdir()
    assert "Is a directory" in refusal(directory)
    assert "a device, not a regular file" in refusal(Path("/dev/null"))


# --- a broken table under a running worker -------------------------------------------------


def _worker(path: str, conn: Connection, settings: dict[str, Any] | None = None) -> None:
    """A worker process: runs the commands the test sends, answers each, and reports the
    ERROR records it logged (``settings``: :func:`settings_for` the path, by default)."""
    errors: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.ERROR:
                errors.append(record.getMessage())

    logging.getLogger("gatekeeper").addHandler(Collect())
    gk = GateKeeper(settings or settings_for(Path(path)))
    held = []
    while True:
        command, *args = conn.recv()
        if command == "admit":
            try:
                held.append(gk.admit("shop", *args))
            except Rejected as rejection:
                conn.send(rejection.code)
            else:
                conn.send("admitted")
        elif command == "release":
            for admission in held:
                admission.release(200)
            held.clear()
            conn.send("released")
        elif command == "errors":
            conn.send(errors)
        elif command == "busy":
            conn.send({key: count for key, count in gk.inflight().items() if count})


class Worker:
    """A forked worker process driven through a pipe."""

    def __init__(self, path: Path, settings: dict[str, Any] | None = None) -> None:
        context = multiprocessing.get_context("fork")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker, args=(str(path), child, settings), daemon=True
        )
        self.process.start()

    def __call__(self, *command: str) -> Any:
        self.conn.send(command)
        if not self.conn.poll(DEADLINE):
            self.process.join(1.0)
            pytest.fail(f"the worker did not answer {command} (exit code {self.process.exitcode})")
        return self.conn.recv()

    def admit_all(self, count: int) -> list[str]:
        return [self("admit", "api", "c") for _ in range(count)]

    def stop(self) -> None:
        self.process.kill()
        self.process.join(DEADLINE)


@pytest.fixture
def worker(table: Path) -> Iterator[Worker]:
    """A running worker holding 2 of the project's 3 slots."""
    running = Worker(table)
    assert running.admit_all(2) == ["admitted"] * 2
    yield running
    running.stop()


def _damage_then_check(table: Path, worker: Worker, damage: Any) -> None:
    """Damage the table under the worker; then the worker still serves, logged one ERROR,
    and the new table counts exactly: 3 admitted, the 4th refused, a parent keeper agrees."""
    damage()
    assert worker.admit_all(3) == ["admitted"] * 3
    assert worker("admit", "api", "c") == "GK-CONCURRENCY-LIMIT"
    errors = worker("errors")
    assert len(errors) == 1, errors
    assert "is damaged" in errors[0]
    parent = GateKeeper(settings_for(table))
    assert {k: v for k, v in parent.inflight().items() if v} == {"shop": 3}
    with pytest.raises(Rejected):
        parent.admit("shop", "api", "c")
    assert worker("release") == "released"
    parent.admit("shop", "api", "c").release(200)
    parent.close()
    assert worker.process.exitcode is None  # alive: no SIGBUS


@pytest.mark.parametrize("size", [0, 100, HEADER, "half"])
def test_table_truncated_under_a_running_worker(table: Path, worker: Worker, size: Any) -> None:
    """Truncating the file under a worker (to nothing, mid-header, mid-table) costs it
    nothing but its old counts: no SIGBUS, one ERROR, exact limits at once."""
    length = table.stat().st_size // 2 if size == "half" else size
    _damage_then_check(table, worker, lambda: os.truncate(table, length))


def _waiting_for_a_lock(inode: int) -> bool:
    """Whether a process waits for a lock on the file of ``inode`` (a "->" line of
    /proc/locks: MAJOR:MINOR:INODE)."""
    with open("/proc/locks", encoding="ascii") as locks:
        return any("->" in line and f":{inode} " in line for line in locks)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="/proc/locks is Linux's")
@pytest.mark.parametrize("size", [0, HEADER, "half"])
def test_a_cut_made_while_a_worker_waits_for_the_lock_is_no_sigbus(
    table: Path, worker: Worker, size: Any
) -> None:
    """The file is cut while the worker waits for the table's lock (held here, as another
    process holds it under contention): the worker looks at the size once it has the
    lock, so it meets a damaged table (one ERROR, re-created, exact at once), not SIGBUS."""
    length = table.stat().st_size // 2 if size == "half" else size
    fd = os.open(table, os.O_RDWR)
    try:
        assert try_lock(fd)
        inode = os.fstat(fd).st_ino
        worker.conn.send(("admit", "api", "c"))
        wait_until(lambda: _waiting_for_a_lock(inode), what="the worker waiting for the lock")
        os.ftruncate(fd, length)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    assert worker.conn.poll(DEADLINE), f"no answer (exit code {worker.process.exitcode})"
    assert worker.conn.recv() == "admitted"
    errors = worker("errors")
    assert len(errors) == 1 and "is damaged" in errors[0], errors
    assert worker.admit_all(2) == ["admitted"] * 2  # 3 slots in the new table
    assert worker("admit", "api", "c") == "GK-CONCURRENCY-LIMIT"
    assert worker.process.exitcode is None  # alive: no SIGBUS


def test_a_key_counting_more_than_the_leases_held_is_damage(table: Path, worker: Worker) -> None:
    """Garbage in a key's in-flight count, past every lease the table holds (each request
    in flight holds one), would refuse its limit forever: the first admission that meets
    it finds the table damaged, which is re-created with one ERROR, exact at once."""

    def damage() -> None:
        data = table.read_bytes()
        found = []
        at = data.find(b"shop", NODE_HEAD)
        while at >= 0:
            if node_view(data, at - NODE_HEAD).key_length == 4:
                found.append(at - NODE_HEAD)
            at = data.find(b"shop", at + 1)
        assert len(found) == 1, found  # the node of key "shop"
        _write(table, found[0], struct.pack("<I", 0xFFFFFFFF))

    _damage_then_check(table, worker, damage)


def test_garbage_over_the_header_of_a_live_table(table: Path, worker: Worker) -> None:
    """Random bytes over the whole header of a live table: re-created, limits hold again
    (not 'every request admitted with no limit, permanently')."""
    noise = random.Random(14).randbytes(HEADER)
    _damage_then_check(table, worker, lambda: _write(table, 0, noise))


def test_garbage_over_the_counters_of_a_live_table(table: Path, worker: Worker) -> None:
    """Garbage over the lease, heap and chunk counters only (magic and epoch intact)."""
    _damage_then_check(table, worker, lambda: _write(table, 24, b"\xa5" * 40))


def test_zeroed_live_table(table: Path, worker: Worker) -> None:
    """A live table overwritten with zeros is re-created, with an ERROR."""
    _damage_then_check(table, worker, lambda: _write(table, 0, bytes(table.stat().st_size)))


@pytest.mark.parametrize(
    "journal",
    [
        struct.pack("<I", 0xFFFFFFF0),  # longer than the journal
        struct.pack("<I", 7),  # ends inside an entry
        struct.pack("<I", 12 + 8),  # an entry whose bytes are not all there
        struct.pack("<I", 52),  # over the entries a committed update left behind
    ],
    ids=["huge", "cut-entry", "short-bytes", "stale-entries"],
)
def test_corrupt_journal_length(table: Path, worker: Worker, journal: bytes) -> None:
    """A corrupt journal length is detected before anything is rolled back: no
    struct.error, no 500; the table is re-created."""
    _damage_then_check(table, worker, lambda: _write(table, H_JLEN, journal))


def test_journal_entry_aimed_at_the_header(table: Path, worker: Worker) -> None:
    """A journal entry that would write over the magic (or outside the table) is not
    applied: the table is re-created instead."""
    backend = SharedBackend(table)
    assert backend._layout is not None
    journal_off = backend._layout.journal_off
    backend.close()

    def damage() -> None:
        _write(table, journal_off, struct.pack("<QI", 0, 8) + b"EVILEVIL")
        _write(table, H_JLEN, struct.pack("<I", 20))

    _damage_then_check(table, worker, damage)
    assert table.read_bytes()[:8] == b"GKSHARED"


@pytest.mark.parametrize(
    "writes",
    [
        [(16, b"\x00"), (64, b"\x00")],  # the epoch and its copy, changed alike
        [(8, b"\x00"), (16, b"\x00"), (65, b"\x00")],  # the version and both epochs
        [(8, b"\x02")],  # an older layout version, the epochs intact
    ],
    ids=["epoch-pair", "version-and-epochs", "old-version"],
)
def test_garbage_that_looks_like_a_recreated_table(
    table: Path, worker: Worker, writes: list[tuple[int, bytes]]
) -> None:
    """Garbage that makes the header look like a table another process (or another layout
    version) re-created, under a worker holding leases, is damage: re-created with one
    ERROR, no grant left counted, exact at once (not refused or unlimited for good)."""

    def damage() -> None:
        for offset, data in writes:
            _write(table, offset, data)

    _damage_then_check(table, worker, damage)


@pytest.mark.parametrize(
    ("offset", "value"),
    [(28, 0), (32, 1), (36, 3)],
    ids=["free-list-at-a-held-lease", "lease-mark-below-a-held-lease", "heap-grown"],
)
def test_in_range_garbage_over_the_lease_counters(
    table: Path, worker: Worker, offset: int, value: int
) -> None:
    """A lease counter changed to a value still in range (the free list pointing at a
    held lease, the bump mark below one, a delay heap longer than its entries) is caught
    before a lease is handed out or freed twice: re-created, exact at once."""
    _damage_then_check(table, worker, lambda: _write(table, offset, struct.pack("<I", value)))


def test_in_range_garbage_over_the_window_chunk_counters(table: Path, worker: Worker) -> None:
    """The window chunk counters set back to a value in range (which would hand a chunk
    in use to a second window, dropping admission times) fail their check word: the
    next window to need a chunk re-creates the table, and rate limits are exact again."""
    assert worker("release") == "released"
    full = ["admitted", "admitted", "GK-RATE-LIMIT"]  # 2/hour
    assert [worker("admit", "login", "c") for _ in range(3)] == full
    assert worker("release") == "released"
    _write(table, 56, struct.pack("<II", 0xFFFFFFFF, 0))  # no chunk used, none free
    assert [worker("admit", "login", "d") for _ in range(3)] == full
    errors = worker("errors")
    assert len(errors) == 1 and "window chunk counters" in errors[0], errors


def test_in_range_garbage_over_the_process_mark(
    table: Path, worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """The process mark set below a registered worker would give its slot to the next
    process to register (the worker's leases then never reclaimed after it dies): the
    newcomer finds the slot taken and re-creates the table instead."""
    _write(table, 44, struct.pack("<I", 0))
    with caplog.at_level(logging.ERROR, "gatekeeper"):
        parent = GateKeeper(settings_for(table))
        admissions = [parent.admit("shop", "api", "c") for _ in range(3)]
    assert "process mark is below a registered process" in caplog.text
    assert worker("admit", "api", "c") == "GK-CONCURRENCY-LIMIT"
    assert worker("busy") == {"shop": 3}
    for admission in admissions:
        admission.release(200)
    parent.close()


def test_table_recreated_by_another_process_is_followed_not_recreated_again(
    table: Path, worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage a running worker does not read (the geometry) is found by the next process
    to attach, which re-creates the table with one ERROR; the worker, holding leases of
    the old table, takes the new one for what it is (its checksum is valid) and follows
    it without re-creating it again: both count on one table."""
    _write(table, 276, b"\xff\xff")
    with caplog.at_level(logging.ERROR, "gatekeeper"):
        parent = GateKeeper(settings_for(table))
        admission = parent.admit("shop", "api", "c")
    assert caplog.text.count("is damaged") == 1
    assert worker.admit_all(3) == ["admitted", "admitted", "GK-CONCURRENCY-LIMIT"]
    assert worker("errors") == []
    assert {k: v for k, v in parent.inflight().items() if v} == {"shop": 3}
    admission.release(200)
    parent.close()


def _write(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


@pytest.mark.parametrize("policy", ["allow", "reject"])
@pytest.mark.parametrize(
    "damage",
    [(0, bytes(HEADER)), (H_JLEN, struct.pack("<I", 0xFFFFFFF0))],
    ids=["zeroed header", "corrupt journal"],
)
def test_the_admission_that_meets_a_damaged_table_follows_on_backend_error(
    table: Path, policy: str, damage: tuple[int, bytes]
) -> None:
    """SPEC 4.6: a shared file found corrupted is a backend failure, counted in
    backend_errors, and ``on_backend_error`` decides the admission that meets it: refused
    with GK-BACKEND-UNAVAILABLE (its slots in the re-created table given back), or
    admitted, counted in the new table. The admissions after it are decided there."""
    gk = GateKeeper(settings_for(table, on_backend_error=policy))
    gk.admit("shop", "api", "c").release(200)
    _write(table, *damage)
    if policy == "reject":
        with pytest.raises(Rejected) as info:
            gk.admit("shop", "api", "c")
        assert info.value.code == "GK-BACKEND-UNAVAILABLE"
        assert not any(gk.inflight().values())
        held = [gk.admit("shop", "api", "c") for _ in range(3)]
    else:
        held = [gk.admit("shop", "api", "c") for _ in range(3)]  # the first met the damage
    with pytest.raises(Rejected) as info:
        gk.admit("shop", "api", "c")
    assert info.value.code == "GK-CONCURRENCY-LIMIT"  # all 3 counted in the new table
    assert gk.stats()["counters"]["backend_errors"] == 1
    for admission in held:
        admission.release(200)
    assert not any(gk.inflight().values())
    gk.close()


def test_middleware_answers_on_a_corrupt_journal(table: Path) -> None:
    """Through the middleware a corrupt journal is no 500: the request is served."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    middleware = GateKeeperMiddleware(app, settings_for(table))
    client = Client(middleware)
    assert client.get("/", headers={"X-Caller-Id": "c"}).status_code == 200
    _write(table, H_JLEN, struct.pack("<I", 0xFFFFFFF0))
    assert [client.get("/").status_code for _ in range(3)] == [200] * 3
    middleware.gatekeeper.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    writes=st.lists(
        st.tuples(
            # Any byte of the header, mostly where its fields are: the state and counters
            # (0..80) and the boot id, geometry and size (256..312).
            st.one_of(st.integers(0, 80), st.integers(256, 312), st.integers(0, HEADER - 1)),
            st.binary(min_size=1, max_size=64),
        ),
        min_size=1,
        max_size=4,
    )
)
@example(writes=[(11, b"\x00" * 6), (64, b"\x00")])
@example(writes=[(8, b"\x00"), (16, b"\x00"), (65, b"\x00")])
def test_any_garbage_in_the_header_is_never_a_crash(
    tmp_path_factory: pytest.TempPathFactory, writes: list[tuple[int, bytes]]
) -> None:
    """Whatever bytes land in the header of a live table, admitting, releasing and reading
    raise nothing but a refusal (no struct.error, no IndexError, no assertion), no grant
    is left counted, and afterwards a keeper on the file counts exactly."""
    table = tmp_path_factory.mktemp("garbage") / "t.shm"
    gk = GateKeeper(settings_for(table))
    held = [gk.admit("shop", "api", "c") for _ in range(2)]
    for offset, data in writes:
        _write(table, offset, data)
    with logging_disabled():
        with contextlib.suppress(Rejected):
            held.append(gk.admit("shop", "api", "c"))
        gk.inflight()
        gk.backend.usage()  # type: ignore[attr-defined]
        for admission in held:
            admission.release(200)
    assert {k: v for k, v in gk.inflight().items() if v} == {}
    fresh = GateKeeper(settings_for(table))
    admits_exactly(fresh, 3, "shop", "api", "c")
    fresh.close()
    gk.close()


@contextlib.contextmanager
def logging_disabled() -> Iterator[None]:
    logger = logging.getLogger("gatekeeper")
    old = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = old
