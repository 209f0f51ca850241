"""Process-owned state renewed in a forked child, also where Python's fork hooks never run.

``os.register_at_fork`` hooks run after ``os.fork()``, but not in a worker that a server
forks in C without them: uWSGI's default mode loads the app in its master and forks the
workers so (unless ``--py-call-osafterfork``). What a process must own - its Redis lease ids,
its generated request ids - is then still the master's. A :class:`ForkWatch` runs its hook
at the fork where it can, and otherwise the first time its owner calls
:meth:`~ForkWatch.check` and it finds another process id (a ``getpid()``: called where the
state is about to be used, not on every request).
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["ForkWatch"]


class ForkWatch:
    """Runs ``hook`` in every forked child once, at the fork or at the child's first
    :meth:`check`."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook
        self._pid = os.getpid()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._pid = os.getpid()
        self._hook()

    def check(self) -> None:
        """Run the hook now if this is a child it has not run in yet."""
        if os.getpid() != self._pid:
            self._forked()
