"""Log capture for tests of what gatekeeper writes: a handler that collects lines (and can
be held shut to play a slow one), and a context that attaches it to a logger."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


class Lines(logging.Handler):
    """Collects the formatted lines it is given. With ``held=True`` each record waits
    until ``opened`` is set (a handler as slow as the test wants); ``entered`` is set
    when a record first arrives."""

    def __init__(self, *, held: bool = False) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.opened = threading.Event()
        self.entered = threading.Event()
        if not held:
            self.opened.set()

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.opened.wait(60)
        self.lines.append(record.getMessage())


@contextmanager
def captured(name: str, level: int, *, held: bool = False) -> Iterator[Lines]:
    """A Lines handler on logger ``name`` at ``level`` (not propagating, so nothing else
    sees the records), removed and the logger restored afterwards; a held handler is
    opened first, so nothing waits for it after the test."""
    logger = logging.getLogger(name)
    old_level, old_propagate = logger.level, logger.propagate
    handler = Lines(held=held)
    logger.setLevel(level)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        handler.opened.set()
        from gatekeeper_wsgi.rejectlog import flush

        assert flush()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
