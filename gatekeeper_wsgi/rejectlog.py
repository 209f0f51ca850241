"""The rejected-request log: one JSON line per rejected request on ``gatekeeper.rejected``.

A record carries what ``gatekeeper replay`` needs to send the request again (method,
path, query, headers, body up to ``rejected_log.body_bytes``) with secrets redacted::

    {"time": "2024-05-01T12:00:00.123+00:00", "requestId": "9f1c-2a", "status": 503,
     "code": "GK-CONCURRENCY-LIMIT", "level": "service",
     "limit": {"path": "shop/checkout", "value": "10"}, "method": "POST",
     "path": "/checkout", "query": "cart=7", "headers": {"Authorization": "[redacted]",
     "Content-Type": "application/json", ...}, "body": "{...}", "body_truncated": false}

``path`` is percent-encoded (exactly what goes on the request line); a body that is not
UTF-8 is written as ``body_b64`` instead of ``body``.

The request thread only builds the record and puts it on a queue (stdlib
:class:`~logging.handlers.QueueHandler`); a :class:`~logging.handlers.QueueListener`
thread hands it to the handlers of ``gatekeeper.rejected`` and its ancestors, with the
usual propagation rules. So a slow handler (a remote syslog, a full disk) costs the
request nothing. Configure the logger as usual; it logs at INFO::

    logging.getLogger("gatekeeper.rejected").setLevel(logging.INFO)
    logging.getLogger("gatekeeper.rejected").addHandler(logging.FileHandler("rejected.log"))
"""

from __future__ import annotations

import atexit
import base64
import json
import logging
import logging.handlers
import os
import queue
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.errors import Rejected

__all__ = ["REDACTED", "REJECTED_LOGGER", "flush", "log_rejected", "rejection_record"]

REJECTED_LOGGER = "gatekeeper.rejected"
ALWAYS_REDACTED = frozenset({"authorization", "cookie", "proxy-authorization"})
#: the value written in place of a redacted header
REDACTED = "[redacted]"
# Characters left as they are in a logged path: RFC 3986 pchar plus "/".
_PATH_SAFE = "/:@!$&'()*+,;=-._~"

logger = logging.getLogger(REJECTED_LOGGER)


class _Dispatcher(logging.Handler):
    """Runs in the listener thread: delivers a record to the logger's handlers as
    ``Logger.handle`` would (propagation, handler levels), or completes a flush."""

    def emit(self, record: logging.LogRecord) -> None:
        done = getattr(record, "gatekeeper_flush", None)
        if isinstance(done, threading.Event):
            done.set()
            return
        logger.callHandlers(record)


class _Pipeline:
    """The queue, its handler and the listener thread of one process."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self.handler = logging.handlers.QueueHandler(self.records)
        self.listener = logging.handlers.QueueListener(self.records, _Dispatcher())
        self.listener.start()

    def put(self, record: logging.LogRecord) -> None:
        self.handler.handle(record)


_pipeline: _Pipeline | None = None
_pipeline_lock = threading.Lock()


def _current_pipeline() -> _Pipeline:
    global _pipeline
    pipeline = _pipeline
    # A forked worker inherits the queue but not the listener thread: start its own.
    if pipeline is None or pipeline.pid != os.getpid():
        with _pipeline_lock:
            pipeline = _pipeline
            if pipeline is None or pipeline.pid != os.getpid():
                pipeline = _pipeline = _Pipeline()
    return pipeline


def _after_fork_in_child() -> None:
    global _pipeline, _pipeline_lock
    _pipeline = None
    _pipeline_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def flush(timeout: float | None = 10.0) -> bool:
    """Wait until every record logged so far has been handled; False on timeout.

    For tests and orderly shutdown (it also runs at interpreter exit).
    """
    pipeline = _pipeline
    if pipeline is None or pipeline.pid != os.getpid():
        return True
    done = threading.Event()
    marker = logging.LogRecord(REJECTED_LOGGER, logging.INFO, __file__, 0, "", None, None)
    marker.gatekeeper_flush = done
    pipeline.put(marker)
    return done.wait(timeout)


# At exit, give queued records a moment to reach their handlers, but never hang on one.
atexit.register(flush, 2.0)


def _headers(environ: Mapping[str, Any], redact: frozenset[str]) -> dict[str, str]:
    headers = {}
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            name = key[5:].replace("_", "-").title()
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            name = key.replace("_", "-").title()
        else:
            continue
        headers[name] = REDACTED if name.lower() in redact else str(value)
    return headers


def _body(environ: Mapping[str, Any], cap: int) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of the request body, and whether there was more."""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return b"", False
    stream = environ.get("wsgi.input")
    if length <= 0 or stream is None:
        return b"", False
    if cap <= 0:
        return b"", True
    try:
        data = stream.read(min(length, cap))
    except Exception:  # a client that went away must not break the fault
        return b"", True
    if not isinstance(data, bytes):
        return b"", True
    return data, len(data) < length


def _request_path(environ: Mapping[str, Any]) -> str:
    # PEP 3333 strings carry the URL-decoded bytes as latin-1; encode them back.
    raw = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    try:
        data = raw.encode("latin-1")
    except UnicodeEncodeError:
        data = raw.encode("utf-8", "surrogateescape")
    return quote(data, safe=_PATH_SAFE) or "/"


def rejection_record(
    environ: Mapping[str, Any], rejected: Rejected, request_id: str, config: Config
) -> dict[str, Any]:
    """The log record of one rejected request, as a JSON-ready dict (SPEC §7).

    Reads up to ``rejected_log.body_bytes`` of the request body (the request is refused,
    so nobody else will read it).
    """
    redact = ALWAYS_REDACTED | {name.lower() for name in config.rejected_log.redact_headers}
    body, truncated = _body(environ, config.rejected_log.body_bytes)
    record: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "requestId": request_id,
        "status": rejected.status,
        "code": rejected.code,
        "level": rejected.level,
        "limit": {"path": rejected.limit_path, "value": rejected.limit_value},
        "method": str(environ.get("REQUEST_METHOD", "GET")),
        "path": _request_path(environ),
        "query": str(environ.get("QUERY_STRING", "")),
        "headers": _headers(environ, redact),
    }
    try:
        record["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        record["body_b64"] = base64.b64encode(body).decode("ascii")
    record["body_truncated"] = truncated
    return record


def log_rejected(
    environ: Mapping[str, Any], rejected: Rejected, request_id: str, config: Config
) -> None:
    """Log one rejected request as a JSON line, through the queue (never blocks on I/O).

    Nothing from the request is written raw: the line is JSON with non-ASCII escaped.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    line = json.dumps(rejection_record(environ, rejected, request_id, config), ensure_ascii=True)
    record = logger.makeRecord(REJECTED_LOGGER, logging.INFO, __file__, 0, line, (), None)
    if logger.filter(record):
        _current_pipeline().put(record)
