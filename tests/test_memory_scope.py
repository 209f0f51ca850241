"""The memory backend tells operators when its limits are per process."""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import pytest
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.backends import memory

LIMITS = {"project": "shop", "limits": {"shop": {"concurrency": 5}}}


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "per process" in record.getMessage()
    ]


def test_multiprocess_server_gets_one_warning_pointing_to_shared(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under a server that says wsgi.multiprocess, the memory backend warns once, naming shared://."""
    memory._WARNED.clear()
    client = Client(GateKeeperMiddleware(ok_app, LIMITS))
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        for _ in range(3):
            response = client.get("/", environ_overrides={"wsgi.multiprocess": True})
            response.close()
            assert response.status_code == 200
    (message,) = warnings_of(caplog)
    assert "shared:///path/file" in message


def test_single_process_server_gets_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A single-process server (wsgi.multiprocess false) hears nothing about shared://."""
    memory._WARNED.clear()
    client = Client(GateKeeperMiddleware(ok_app, LIMITS))
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        response = client.get("/", environ_overrides={"wsgi.multiprocess": False})
        response.close()
    assert warnings_of(caplog) == []


def _admit_in_child(keeper: GateKeeper, results: Any) -> None:
    caught: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    logging.getLogger("gatekeeper").addHandler(Collect(logging.WARNING))
    keeper.admit("shop", "orders", "crm").release(200)
    keeper.admit("shop", "orders", "crm").release(200)
    results.put(caught)


def test_forked_worker_gets_one_warning() -> None:
    """An engine created before fork (gunicorn --preload) warns once in the worker that uses it."""
    keeper = GateKeeper(LIMITS)
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    child = context.Process(target=_admit_in_child, args=(keeper, results))
    child.start()
    caught = results.get()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert len([m for m in caught if "per process" in m]) == 1
    assert "shared:///" in caught[0]
