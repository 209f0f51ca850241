"""The rejected-request log: one JSON line per rejected request on ``gatekeeper.rejected``.

A record carries what ``gatekeeper replay`` needs to send the request again (method,
path, query, headers, body up to a cap) with secrets redacted. Records are handed to a
:class:`logging.handlers.QueueHandler`; a listener thread does the writing, so a slow
handler never delays a response.
"""

from __future__ import annotations

import base64
import json
import logging
import logging.handlers
import queue
import threading
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.errors import Rejected

__all__ = ["REJECTED_LOGGER", "log_rejected", "rejection_record"]

REJECTED_LOGGER = "gatekeeper.rejected"
ALWAYS_REDACTED = frozenset({"authorization", "cookie", "proxy-authorization"})
REDACTED = "[redacted]"

logger = logging.getLogger(REJECTED_LOGGER)
_install_lock = threading.Lock()
_listener: logging.handlers.QueueListener | None = None


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


def _body(environ: Mapping[str, Any], cap: int) -> bytes:
    if cap <= 0:
        return b""
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return b""
    stream = environ.get("wsgi.input")
    if length <= 0 or stream is None:
        return b""
    try:
        data = stream.read(min(length, cap))
    except Exception:  # a client that went away must not break the fault
        return b""
    return data if isinstance(data, bytes) else b""


def rejection_record(
    environ: Mapping[str, Any], rejected: Rejected, request_id: str, config: Config
) -> dict[str, Any]:
    """The log record of one rejected request, as a JSON-ready dict."""
    redact = ALWAYS_REDACTED | {name.lower() for name in config.rejected_log.redact_headers}
    body = _body(environ, config.rejected_log.body_bytes)
    record: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "requestId": request_id,
        "code": rejected.code,
        "level": rejected.level,
        "limit": {"path": rejected.limit_path, "value": rejected.limit_value},
        "method": str(environ.get("REQUEST_METHOD", "GET")),
        "path": str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", "")),
        "query": str(environ.get("QUERY_STRING", "")),
        "headers": _headers(environ, redact),
    }
    try:
        record["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        record["body_b64"] = base64.b64encode(body).decode("ascii")
    return record


def _install_queue() -> None:
    """Move the handlers configured on ``gatekeeper.rejected`` behind a queue."""
    global _listener
    with _install_lock:
        if _listener is not None:
            return
        handlers = list(logger.handlers)
        records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        for handler in handlers:
            logger.removeHandler(handler)
        if handlers:
            logger.propagate = False
            logger.addHandler(logging.handlers.QueueHandler(records))
            _listener = logging.handlers.QueueListener(
                records, *handlers, respect_handler_level=True
            )
            _listener.start()


def log_rejected(
    environ: Mapping[str, Any], rejected: Rejected, request_id: str, config: Config
) -> None:
    """Log one rejected request as a JSON line (escaped: nothing from the request is raw)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    if _listener is None and logger.handlers:
        _install_queue()
    line = json.dumps(rejection_record(environ, rejected, request_id, config), ensure_ascii=True)
    logger.info(line)
