"""The shared table (``backends/shared/table.py``, ``url.py``): an update and a look run in
one context manager; a look that fails passes its error on and leaves the table as it was,
both locks free; the reads that answer a default when the table cannot be reached do; a
fork while another thread holds the locks leaves the child a table it can use; any URL is
options in range or a ConfigError."""

from __future__ import annotations

import ast
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends.shared import SharedBackend
from gatekeeper_wsgi.backends.shared.table import Recreated
from gatekeeper_wsgi.backends.shared.url import parse_url
from gatekeeper_wsgi.errors import ConfigError
from tests.conftest import FakeClock
from tests.tablelock import lock_free

PACKAGE = Path(SharedBackend.__module__.replace(".", "/")).parent
#: where the locks are taken and dropped by hand: the transaction itself, and the table's
#: entry, which drops them again when the checks on the way in fail
LOCKING = {("journal.py", "Transaction.__enter__"), ("journal.py", "Transaction.__exit__")}
LOCKING |= {("table.py", "Table._enter")}

#: seconds a child may take to report: a bound against a hang, never a timing asserted
DEADLINE = 30.0


def _settings(path: Path, limits: dict[str, Any]) -> dict[str, Any]:
    return {"project": "shop", "backend": f"shared://{path}", "limits": limits}


def _admits_from_another_thread(gk: GateKeeper) -> bool:
    """Whether a thread of this process gets a slot (a thread lock left held would stop it;
    the join's bound only keeps a broken build from hanging the suite)."""
    admitted = threading.Event()

    def admit() -> None:
        gk.admit("shop", "api", "c").release(200)
        admitted.set()

    thread = threading.Thread(target=admit, daemon=True)
    thread.start()
    thread.join(30)
    return admitted.is_set()


@pytest.fixture
def keeper(tmp_path: Path, clock: FakeClock) -> Any:
    gk = GateKeeper(_settings(tmp_path / "t.shm", {"shop": {"concurrency": 5}}), clock=clock)
    yield gk
    gk.close()


@pytest.mark.parametrize("error", [ValueError, IndexError, KeyError])
def test_a_look_that_fails_passes_its_error_and_changes_nothing(
    keeper: GateKeeper, tmp_path: Path, caplog: pytest.LogCaptureFixture, error: type[Exception]
) -> None:
    """An exception inside a look leaves as it is: the table is not re-created (the slot in
    flight is still counted), and both the file lock and the thread lock are free again."""
    backend = keeper.backend
    assert isinstance(backend, SharedBackend)
    held = keeper.admit("shop", "api", "c")
    with (
        caplog.at_level(logging.ERROR, logger="gatekeeper"),
        pytest.raises(error),
        backend._reading,
    ):
        raise error("found while looking")
    assert "damaged" not in caplog.text
    assert keeper.inflight()["shop"] == 1
    assert lock_free(tmp_path / "t.shm")
    assert _admits_from_another_thread(keeper)
    held.release(200)
    assert keeper.inflight()["shop"] == 0


def test_an_update_that_fails_the_same_way_re_creates_the_table(
    keeper: GateKeeper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same value error inside an update means garbage in the table: it is re-created
    with one ERROR, and the locks are free again."""
    backend = keeper.backend
    assert isinstance(backend, SharedBackend)
    keeper.admit("shop", "api", "c")
    with (
        caplog.at_level(logging.ERROR, logger="gatekeeper"),
        pytest.raises(Recreated),
        backend._transaction,
    ):
        raise ValueError("an index out of range")
    assert "is damaged" in caplog.text
    assert keeper.inflight().get("shop", 0) == 0  # the new table does not count the old slot
    assert lock_free(tmp_path / "t.shm")
    assert _admits_from_another_thread(keeper)


def test_reads_of_a_closed_table_answer_their_defaults(tmp_path: Path, clock: FakeClock) -> None:
    """Closed, the table answers what nothing known means: nothing due, nothing pending,
    an adaptive limit's initial value."""
    gk = GateKeeper(
        _settings(tmp_path / "t.shm", {"shop": {"concurrency": "auto", "delay": 5.0}}), clock=clock
    )
    backend = gk.backend
    limit = gk.config.limits["shop"]
    assert limit.adaptive is not None
    gk.admit("shop", "api", "c").release(500, faulty=True)  # held back for 5 s
    assert backend.next_due() == clock.now + 5.0
    assert backend.delayed_pending(clock.now) == 1
    backend.close()
    assert backend.next_due() is None
    assert backend.delayed_pending(clock.now) == 0
    assert backend.adaptive_limit("shop", limit) == limit.adaptive.initial


def test_an_adaptive_limit_of_a_megabyte_key_is_the_initial_one(tmp_path: Path) -> None:
    """A key longer than any the table holds (1 MB) reads as untracked: the initial limit,
    and the look leaves the table as it was."""
    gk = GateKeeper(
        _settings(tmp_path / "a.shm", {"shop/api/*": {"concurrency": "auto"}}),
        clock=FakeClock(),
    )
    limit = gk.config.limits["shop/api/*"]
    assert limit.adaptive is not None
    before = (tmp_path / "a.shm").read_bytes()
    assert gk.backend.adaptive_limit("shop/api/" + "x" * (1 << 20), limit) == limit.adaptive.initial
    assert (tmp_path / "a.shm").read_bytes() == before
    assert lock_free(tmp_path / "a.shm")
    gk.close()


def _admit_inherited(gk: GateKeeper, conn: Connection) -> None:
    """In a forked child: report, admit through the parent's GateKeeper, report again."""
    conn.send("forked")
    admission = gk.admit("shop", "api", "child")
    conn.send(("admitted", gk.inflight()["shop"]))
    conn.recv()  # holds its slot until killed
    admission.release(200)


@pytest.mark.slow
def test_a_fork_while_another_thread_holds_the_locks_leaves_the_child_a_usable_table(
    tmp_path: Path,
) -> None:
    """Forked while a thread of the parent is inside an update (thread lock and file lock
    held), the child neither inherits the held thread lock nor shares the parent's file
    lock: it waits for the parent's update like any process, then counts with it."""
    gk = GateKeeper(_settings(tmp_path / "t.shm", {"shop": {"concurrency": 3}}))
    backend = gk.backend
    assert isinstance(backend, SharedBackend)
    held = gk.admit("shop", "api", "parent")
    inside, leave = threading.Event(), threading.Event()

    def hold_the_locks() -> None:
        with backend._transaction:
            inside.set()
            leave.wait()

    holder = threading.Thread(target=hold_the_locks)
    holder.start()
    assert inside.wait(DEADLINE)
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_admit_inherited, args=(gk, child), daemon=True)
    process.start()
    try:
        assert parent.poll(DEADLINE) and parent.recv() == "forked"
        assert not lock_free(tmp_path / "t.shm")  # the parent's update is still on
        leave.set()
        holder.join()
        assert parent.poll(DEADLINE)
        assert parent.recv() == ("admitted", 2)
        assert gk.inflight()["shop"] == 2
    finally:
        leave.set()
        holder.join()
        os.kill(process.pid, signal.SIGKILL)
        process.join()
    held.release(200)
    gk.admit("shop", "api", "parent").release(200)  # reclaims the killed child's slot
    assert gk.inflight()["shop"] == 0
    gk.close()


def test_a_5000_digit_size_is_refused_quoting_a_bounded_value(tmp_path: Path) -> None:
    """A 5000-digit option is refused, with a message of bounded length (at most 40
    characters of the value, 200 of the URL), and no file is made."""
    with pytest.raises(ConfigError, match="expected a positive integer") as info:
        SharedBackend.from_url(f"shared://{tmp_path}/t.shm?size={'9' * 5000}")
    assert len(str(info.value)) < 400
    assert not (tmp_path / "t.shm").exists()


@given(st.text(max_size=200))
def test_any_query_is_options_in_range_or_a_config_error(query: str) -> None:
    """Whatever follows the ``?``, the URL parses into known options with values in
    [1, 2**31), or it is a ConfigError: never another exception."""
    try:
        path, options = parse_url(f"shared:///run/gatekeeper/t.shm?{query}")
    except ConfigError:
        return
    assert path == "/run/gatekeeper/t.shm"
    assert set(options) <= {"size", "leases", "procs", "windows", "mode"}
    assert all(1 <= value < 1 << 31 for value in options.values())


def _lock_calls() -> set[tuple[str, str]]:
    """(file, Class.method) of every call of ``_enter()`` or ``_leave()`` in the package."""
    root = Path(__file__).resolve().parent.parent / PACKAGE
    found = set()
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for klass in [node for node in tree.body if isinstance(node, ast.ClassDef)]:
            for method in [node for node in klass.body if isinstance(node, ast.FunctionDef)]:
                for node in ast.walk(method):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("_enter", "_leave")
                    ):
                        found.add((path.name, f"{klass.name}.{method.name}"))
    return found


def test_every_locked_section_goes_through_the_transaction() -> None:
    """No method of the shared package takes or drops the table's locks by hand: every
    update and every look is a ``with`` of the one Transaction (issue 18)."""
    calls = _lock_calls()
    assert ("journal.py", "Transaction.__enter__") in calls  # the scan sees the calls
    assert calls <= LOCKING
