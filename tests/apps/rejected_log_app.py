"""An app that rejects every request and writes the rejected-request log to the file named
by ``GK_TEST_REJECTED_LOG``, for tests that read what a real server's request left there
(``rejected_log_app:app``, importable through ``PYTHONPATH``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from gatekeeper_wsgi import GateKeeperMiddleware

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

_logger = logging.getLogger("gatekeeper.rejected")
_logger.setLevel(logging.INFO)
_logger.propagate = False
_logger.addHandler(logging.FileHandler(os.environ["GK_TEST_REJECTED_LOG"], encoding="utf-8"))


def _never_called(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    raise AssertionError("every request is rejected")


app = GateKeeperMiddleware(
    _never_called,
    {
        "project": "shop",
        "limits": {"shop": {"concurrency": 0}},
        "rejected_log": {"body_bytes": 64},
    },
)
