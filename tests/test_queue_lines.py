"""The queues' lines of the shared table (``tickets.Lines``) against a plain model, a dict
of lists: random joins, leaves and looks by live and dead processes, and updates cut off
before their commit (rolled back from the journal, as after a kill mid-update). The
table always holds exactly the model's lines, in the model's order; capacities hold.
"""

from __future__ import annotations

import mmap
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.backends.shared import tickets
from gatekeeper_wsgi.backends.shared.journal import Journal
from gatekeeper_wsgi.backends.shared.layout import H_WAITING, U32, Layout
from gatekeeper_wsgi.backends.shared.tickets import Lines, Place

WAITERS = 8
LINES = 3
PATHS = ("shop/a", "shop/b", "shop/c", "shop/d")


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


#: owners: this process, its parent (alive, another process), one that is gone
OWNERS = (os.getpid(), os.getppid(), _dead_pid())


@dataclass
class Model:
    """path -> [(owner pid, nonce, place)], first first."""

    lines: dict[str, list[tuple[int, int, Place]]] = field(default_factory=dict)

    def dead(self, pid: int) -> bool:
        return pid == OWNERS[2]

    def count(self) -> int:
        return sum(len(line) for line in self.lines.values())

    def remove(self, path: str, position: int) -> None:
        line = self.lines[path]
        del line[position]
        if not line:
            del self.lines[path]

    def prune_tail(self, path: str) -> None:
        while path in self.lines and self.dead(self.lines[path][-1][0]):
            self.remove(path, len(self.lines[path]) - 1)

    def sweep(self) -> bool:
        dropped = False
        for path in list(self.lines):
            for position in reversed(range(len(self.lines.get(path, [])))):
                if self.dead(self.lines[path][position][0]):
                    self.remove(path, position)
                    dropped = True
        return dropped

    def join_allowed(self, path: str, size: int) -> bool:
        """What a join leaves in the model (the drops it commits) and whether it gets a
        place."""
        if len(self.lines.get(path, [])) >= size:
            self.prune_tail(path)
            if len(self.lines.get(path, [])) >= size:
                return False
        if self.count() >= WAITERS or (path not in self.lines and len(self.lines) >= LINES):
            return self.sweep() and self.join_allowed(path, size)
        return True

    def find(self, place: Place) -> tuple[str, int]:
        for path, line in self.lines.items():
            for position, (_, _, held) in enumerate(line):
                if held == place:
                    return path, position
        raise KeyError(place)

    def turn(self, place: Place) -> bool:
        path, position = self.find(place)
        while position and self.dead(self.lines[path][position - 1][0]):
            self.remove(path, position - 1)
            position -= 1
        while position > 1 and self.dead(self.lines[path][0][0]):
            self.remove(path, 0)
            position -= 1
        return position == 0


@pytest.fixture(autouse=True)
def sweep_always(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The sweep of a full table runs at most every SWEEP_EVERY: here, every time.
    monkeypatch.setattr(tickets, "SWEEP_EVERY", 0.0)
    yield


def make_lines() -> tuple[Lines, Journal, mmap.mmap, list[int]]:
    layout = Layout(
        key_size=64,
        buckets=1,
        leases=16,
        procs=4,
        registry=4,
        journal=65536,
        chunks=1,
        waiters=WAITERS,
        lines=LINES,
    )
    mm = mmap.mmap(-1, layout.total)
    journal = Journal(mm, layout, "test table")
    rung: list[int] = []
    return Lines(mm, layout, journal, lambda *nonces: rung.extend(nonces)), journal, mm, rung


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("join"),
            st.sampled_from(PATHS),
            st.integers(0, 2),  # owner
            st.integers(1, 4),  # size
            st.booleans(),  # cut off before its commit
        ),
        st.tuples(st.just("leave"), st.integers(0, 100)),
        st.tuples(st.just("turn"), st.integers(0, 100)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_lines_follow_the_model(ops: list[tuple[object, ...]]) -> None:
    """Whatever the joins, leaves, looks, deaths and cut-off updates, every line holds the
    model's waiters in the model's order, the first waiter is the model's, the waiter
    behind one that leaves is woken, and no line or waiter beyond capacity is handed out."""
    lines, journal, mm, rung = make_lines()
    model = Model()
    nonces = iter(range(1, 10_000))
    for op in ops:
        held = [place for line in model.lines.values() for _, _, place in line]
        if op[0] == "join":
            _, path, owner, size, cut = op
            assert isinstance(path, str) and isinstance(owner, int) and isinstance(size, int)
            nonce = next(nonces)
            allowed = model.join_allowed(path, size)
            place = lines.join(path, size, OWNERS[owner], 0, nonce)
            assert (place is not None) == allowed
            if cut:
                journal.rollback()  # killed before the commit: as if it never joined
            else:
                journal.commit()
                if place is not None:
                    model.lines.setdefault(path, []).append((OWNERS[owner], nonce, place))
        elif held:
            place = held[int(op[1]) % len(held)]  # type: ignore[call-overload]
            if op[0] == "leave":
                path, position = model.find(place)
                line = model.lines[path]
                behind = line[position + 1][1] if position + 1 < len(line) else None
                rung.clear()
                lines.leave(place)
                journal.commit()
                model.remove(path, position)
                assert rung == ([behind] if behind is not None else [0])
            else:
                turn = lines.turn(place)
                journal.commit()
                assert turn is not None
                assert turn.first == model.turn(place)
        for path in PATHS:
            expected = [(pid, place.ticket) for pid, _, place in model.lines.get(path, [])]
            assert lines.places(path) == expected
        assert U32.unpack_from(mm, H_WAITING)[0] == model.count() <= WAITERS
        assert len(model.lines) <= LINES
