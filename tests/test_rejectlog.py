"""The rejected-request log (SPEC §7): one JSON line per rejection on ``gatekeeper.rejected``
with secrets redacted and the body up to a cap, written by a listener thread so a slow
handler never delays the response."""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.test import Client, EnvironBuilder

from gatekeeper_wsgi import GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.rejectlog import REDACTED, flush, rejection_record


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


class ListHandler(logging.Handler):
    """Collects the formatted lines it is given, and the thread that gave them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.threads: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.threads.append(threading.current_thread().name)


@pytest.fixture
def rejected_logger() -> Iterator[logging.Logger]:
    """The `gatekeeper.rejected` logger at INFO, restored afterwards."""
    logger = logging.getLogger("gatekeeper.rejected")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger
    finally:
        assert flush()
        logger.setLevel(level)
        logger.propagate = propagate
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


def environ(path: str = "/orders/7", **kwargs: Any) -> dict[str, Any]:
    return EnvironBuilder(path=path, **kwargs).get_environ()


def test_record_redacts_secrets_and_configured_headers() -> None:
    """Authorization, Cookie and configured headers are logged as [redacted]."""
    config = build_config({"rejected_log": {"redact_headers": ["X-Api-Key"]}})
    env = environ(
        headers={
            "Authorization": "Bearer s3cret",
            "Cookie": "a=s3cret",
            "X-API-KEY": "s3cret",
            "X-Caller-Id": "crm",
        }
    )
    record = rejection_record(env, Rejected("GK-CALLER-MISSING"), "rid-1", config)
    assert "s3cret" not in json.dumps(record)
    assert record["headers"]["Authorization"] == REDACTED
    assert record["headers"]["Cookie"] == REDACTED
    assert record["headers"]["X-Api-Key"] == REDACTED
    assert record["headers"]["X-Caller-Id"] == "crm"
    assert record["status"] == 400
    assert record["requestId"] == "rid-1"


def test_record_caps_the_body_and_says_so() -> None:
    """The body is captured up to rejected_log.body_bytes and marked truncated beyond."""
    config = build_config({"rejected_log": {"body_bytes": 4}})
    record = rejection_record(
        environ(method="POST", data=b"abcdefgh"), Rejected("GK-RATE-LIMIT"), "r", config
    )
    assert record["body"] == "abcd"
    assert record["body_truncated"] is True
    whole = rejection_record(
        environ(method="POST", data=b"abcd"), Rejected("GK-RATE-LIMIT"), "r", config
    )
    assert whole["body"] == "abcd"
    assert whole["body_truncated"] is False


def test_record_keeps_binary_bodies_and_odd_paths_exact() -> None:
    """A non-UTF-8 body is logged as base64; the path percent-encoded, the query raw."""
    config = build_config({})
    env = environ(method="PUT", data=b"\xff\x00\xfe", query_string="q=%20a&b")
    env["PATH_INFO"] = "/caf\xc3\xa9 x/\n"  # PEP 3333: the UTF-8 bytes as latin-1
    record = rejection_record(env, Rejected("GK-RATE-LIMIT"), "r", config)
    assert base64.b64decode(record["body_b64"]) == b"\xff\x00\xfe"
    assert "body" not in record
    assert record["path"] == "/caf%C3%A9%20x/%0A"
    assert record["query"] == "q=%20a&b"
    assert record["method"] == "PUT"


def test_each_rejection_is_one_json_line_from_the_listener_thread(
    rejected_logger: logging.Logger,
) -> None:
    """A rejected request produces one escaped JSON line, handled off the request thread."""
    handler = ListHandler()
    rejected_logger.addHandler(handler)
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    response = Client(app).post(
        "/orders?x=1",
        data="é\r\nnext",
        headers={"X-Request-Id": "req-9", "X-Note": "\x1b[31m"},
    )
    assert response.status_code == 503
    assert flush()
    assert len(handler.lines) == 1
    line = handler.lines[0]
    assert line.isascii() and "\n" not in line and "\x1b" not in line
    record = json.loads(line)
    assert record["requestId"] == "req-9"
    assert record["code"] == "GK-CONCURRENCY-LIMIT"
    assert record["limit"] == {"path": "shop", "value": 0}  # a number, as in the JSON fault
    assert record["body"] == "é\r\nnext"
    assert record["headers"]["X-Note"] == "\x1b[31m"
    assert handler.threads[0] != threading.current_thread().name


def test_a_blocked_handler_does_not_delay_the_response(rejected_logger: logging.Logger) -> None:
    """While a handler hangs, rejected requests still complete; the lines come after."""
    entered = threading.Event()
    release = threading.Event()
    written: list[str] = []

    class BlockingHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            entered.set()
            release.wait(30)
            written.append(record.getMessage())

    rejected_logger.addHandler(BlockingHandler())
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    client = Client(app)
    first = client.get("/a", headers={"X-Request-Id": "one"})
    assert first.status_code == 503
    assert entered.wait(10), "the listener thread never reached the handler"
    # The handler is stuck on the first record; more rejections still answer at once.
    second = client.get("/b", headers={"X-Request-Id": "two"})
    assert second.status_code == 503
    assert written == []
    release.set()
    assert flush()
    assert [json.loads(line)["requestId"] for line in written] == ["one", "two"]


def test_nothing_is_read_or_queued_when_the_logger_is_off() -> None:
    """With gatekeeper.rejected below INFO, a rejection leaves the body unread."""
    logger = logging.getLogger("gatekeeper.rejected")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        app = GateKeeperMiddleware(
            ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}}
        )
        env = environ(method="POST", data=b"payload")
        stream = io.BytesIO(b"payload")
        env["wsgi.input"] = stream
        chunks = app(env, lambda status, headers, exc_info=None: lambda data: None)
        assert b"".join(chunks)
        assert stream.tell() == 0
    finally:
        logger.setLevel(level)
