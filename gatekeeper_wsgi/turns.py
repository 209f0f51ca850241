"""The thread lock of the memory backend and of a shared table (which thread of a process
may take the file lock), taken only by a thread that holds the GIL, so threads do not queue
behind one that waits for it.

Why not a plain ``threading.Lock``: its release hands the lock to a sleeping waiter,
which owns it from then on but runs only once it also gets the GIL back. The releaser
keeps the GIL (nothing on the table's path lets go of it, see :mod:`.filelock`), runs the
rest of its request, comes back to the lock, finds it owned by the thread that waits for
the GIL and sleeps in turn: one sleep and one wake-up per update, with every thread of the
process in the line, and the line keeps itself going as long as two threads are in it (a
lock convoy). With 8 threads making direct WSGI calls that was 0.5 to 4 voluntary context
switches per request, depending on whether one had formed (``perf record -e
sched:sched_switch``: three quarters of them asleep in that lock's ``sem_wait``, the rest
waking from it to wait for the GIL; ``benchmarks/shared.py``, issue 18).

:class:`TurnLock` is taken with a non-blocking try, under the GIL, and that is all it
costs while no other thread holds it. The try is ``list.pop()`` of a one-token list, which
the interpreter runs as one C call holding the GIL, so only one thread can win it: a
fifth of what ``Lock.acquire(False)`` costs, which parses its arguments as keywords on
every call (callgrind: ~450 instructions per try; ``timeit``: 26 against 141 ns for a try
and a release). A thread that finds it held sleeps on a bell until
a release rings it, and then tries again with the GIL held, as the first time: the
releaser, meanwhile, takes it again without waiting for anybody, and a line never forms.
Threads only find it held when the holder lost the GIL inside its update: another process
held the file lock, or the interpreter's switch interval ended there.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["TurnLock"]


class TurnLock:
    """A mutual exclusion lock for the threads of one process that is never handed over
    to a sleeping thread: :meth:`acquire` and :meth:`release` (or ``with``)."""

    __slots__ = ("_bell", "sleepers", "token")

    def __init__(self) -> None:
        #: the exclusion itself: one token, taken by ``token.pop()`` (IndexError: another
        #: thread holds it) and given back by ``token.append(None)``. The table and the
        #: memory backend inline ``try: token.pop() except IndexError: wait()`` and the
        #: append, then ``ring()`` if ``sleepers``: a method call less on every update.
        #: Only its holder gives it back (two tokens would let two threads in).
        self.token: list[None] = [None]
        #: what waiters sleep on: held (armed) while nobody rang; a ring lets it go, which
        #: wakes one sleeper (who holds it again: armed) or, with none asleep yet, lets
        #: the next one through at once to try again. A plain lock, not a Condition: a
        #: wait and a ring are one C call each (a Condition is tens of bytecodes and a
        #: lock made per wait, which the threads of gunicorn's workers paid whenever the
        #: other worker held the file lock).
        self._bell = threading.Lock()
        self._bell.acquire()
        #: one entry per thread asleep on the bell or about to be (append and pop are one
        #: C call each, safe against a thread switch; a counter's ``+= 1`` is not)
        self.sleepers: list[None] = []

    def acquire(self) -> None:
        """Take the lock, waiting while another thread holds it."""
        if not self.try_acquire():
            self.wait()

    def try_acquire(self) -> bool:
        """Take the lock if no other thread holds it; whether it was taken."""
        try:
            self.token.pop()
        except IndexError:
            return False
        return True

    def wait(self) -> None:
        """Take the lock another thread holds: sleep until a release rings, then try
        again. (The slow part of :meth:`acquire`, which the table and the memory backend inline.)"""
        bell = self._bell
        sleepers = self.sleepers
        # Counted before the try: a release that came before the count let the lock go
        # before it, so the try takes it; one that comes after it rings. A ring that finds
        # the bell already let go (rung and not yet heard, or heard by a waiter still
        # waking) adds nothing: that waiter tries again, and whoever holds the lock then
        # rings when it lets go, as long as anybody sleeps.
        sleepers.append(None)
        try:
            while not self.try_acquire():
                bell.acquire()
        finally:
            sleepers.pop()

    def release(self) -> None:
        """Let the lock go (only its holder may), and ring a waiter if there is one."""
        self.token.append(None)
        if self.sleepers:
            self.ring()

    def ring(self) -> None:
        """Wake one waiter, to try again. (The slow part of :meth:`release`.)"""
        with contextlib.suppress(RuntimeError):  # already rung: one ring is enough
            self._bell.release()

    def locked(self) -> bool:
        """Whether some thread holds the lock."""
        return not self.token

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
