"""The rejected-request log is bounded in bytes (SPEC §4.8): header values capped at 1 KiB,
a record at 16 KiB, and at most `rejected_log.queue_size` records waiting for a slow
handler; the rest are dropped and counted, never delaying a request."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.test import Client, EnvironBuilder

from gatekeeper_wsgi import GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.rejectlog import HEADER_VALUE_CAP, RECORD_CAP, flush, log_rejected
from tests.logs import Lines, captured, ok_app

BLOCKED = {"project": "site", "limits": {"site": {"concurrency": 0}}}


@pytest.fixture
def held_log() -> Iterator[Lines]:
    """A held (slow) handler on `gatekeeper.rejected` at INFO for the test."""
    with captured("gatekeeper.rejected", logging.INFO, held=True) as lines:
        yield lines


@pytest.fixture
def rejected_log() -> Iterator[Lines]:
    """The lines `gatekeeper.rejected` writes during the test."""
    with captured("gatekeeper.rejected", logging.INFO) as lines:
        yield lines


def logged_line(rejected_log: Lines, **builder: Any) -> str:
    env = EnvironBuilder(**{"path": "/x", **builder}).get_environ()
    assert log_rejected(env, Rejected("GK-CALLER-MISSING"), "rid", build_config({}))
    assert flush()
    (line,) = rejected_log.lines
    return line


def test_a_64_kib_header_is_logged_cut_at_1_kib(rejected_log: Lines) -> None:
    """A 64 KiB header value is logged as its first 1 KiB and named as truncated."""
    line = logged_line(rejected_log, headers={"X-Junk": "j" * 65536, "X-Caller-Id": "crm"})
    record = json.loads(line)
    assert record["headers"]["X-Junk"] == "j" * HEADER_VALUE_CAP
    assert record["headers_truncated"] == ["X-Junk"]
    assert record["headers"]["X-Caller-Id"] == "crm"


def test_a_record_never_exceeds_16_kib(rejected_log: Lines) -> None:
    """Sixty 8 KiB headers, a 60 KiB path, query and body: the line stays within 16 KiB."""
    headers = {f"X-H{index}": "\u00e9" * 8192 for index in range(60)}
    line = logged_line(
        rejected_log,
        path="/" + "p" * 60000,
        query_string="q=" + "v" * 60000,
        headers=headers,
        method="POST",
        data="b" * 60000,
    )
    assert len(line) <= RECORD_CAP
    record = json.loads(line)
    assert record["truncated"] is True
    assert record["path_truncated"] is True and record["query_truncated"] is True
    assert record["code"] == "GK-CALLER-MISSING"


def test_queue_size_is_validated() -> None:
    """`queue_size` is an integer from 1 to 1 000 000 (default 10 000)."""
    assert build_config({}).rejected_log.queue_size == 10_000
    assert build_config({"rejected_log": {"queue_size": "5"}}).rejected_log.queue_size == 5
    for bad in (0, -1, 10**7, "many", 1.5):
        with pytest.raises(ConfigError, match=r"rejected_log\.queue_size"):
            build_config({"rejected_log": {"queue_size": bad}})


def test_a_slow_handler_under_3000_rejections_drops_and_counts(held_log: Lines) -> None:
    """With the handler stuck, 3 000 refused requests all get their fault, at most
    queue_size records wait, and every other record is counted as dropped."""
    handler = held_log
    app = GateKeeperMiddleware(ok_app, {**BLOCKED, "rejected_log": {"queue_size": 100}})
    client = Client(app)
    # The first record reaches the handler and blocks the listener there.
    assert client.get("/", headers={"X-Pad": "x" * 8192}).status_code == 503
    assert handler.entered.wait(30)
    for _ in range(2999):
        # The handler is still stuck: a request that waited for it would never return.
        assert client.get("/", headers={"X-Pad": "x" * 8192}).status_code == 503
    dropped = app.gatekeeper.stats()["counters"]["rejected_log_dropped"]
    # One record in the handler, at most 100 queued behind it.
    assert dropped >= 3000 - 1 - 100
    handler.opened.set()
    assert flush()
    assert len(handler.lines) + dropped == 3000
    assert len(handler.lines) <= 101
