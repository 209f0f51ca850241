"""What the structures of a shared table raise when a request cannot be tracked or the
table holds values no correct process writes. The backend turns them into what leaves it:
:class:`NoRoom` into a ``CapacityError`` for the slot being worked on (:mod:`.backend`),
:class:`Damaged` into a re-created table (:mod:`.table`). Plain exceptions, no state of the
table: every structure module imports them without importing the backend.
"""

from __future__ import annotations

from gatekeeper_wsgi.errors import LimitKind


class NoRoom(Exception):
    """The table has no room for what a request needs (a key, a lease, a window entry).
    ``retry_after``: seconds until room is expected, None if unknown; ``kind``: the count
    that could not be kept ("concurrency", "rate"), None if either."""

    def __init__(
        self, what: str, retry_after: float | None = None, kind: LimitKind | None = None
    ) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after = retry_after
        self.kind = kind


class Damaged(Exception):
    """The table holds values no correct process writes (garbage, a corrupt journal, a
    truncated file): it is re-created."""
