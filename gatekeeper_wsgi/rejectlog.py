"""The rejected-request log: one JSON line per rejected request on ``gatekeeper.rejected``.

A record carries what ``gatekeeper replay`` needs to send the request again (method,
path, query, headers, body up to ``rejected_log.body_bytes``) with secrets redacted::

    {"time": "2024-05-01T12:00:00.123+00:00", "requestId": "9f1c-2a", "status": 503,
     "code": "GK-CONCURRENCY-LIMIT", "level": "service",
     "limit": {"path": "shop/checkout", "value": 10}, "method": "POST",
     "path": "/checkout", "query": "cart=7", "headers": {"Authorization": "[redacted]",
     "Content-Type": "application/json", ...}, "body": "{...}", "body_truncated": false}

``path`` is percent-encoded (exactly what goes on the request line); a body that is not
UTF-8 is written as ``body_b64`` instead of ``body``. A body is redacted in its own encoding
(UTF-16/UTF-32 too), everything but the secret values kept byte for byte. One whose secret
fields cannot be found with confidence (compressed with a ``Content-Encoding``, not
decoding in the charset it declares, holding secrets in two readings) is left out
(``"body_omitted": why``, ``"body_truncated": true``); so is one that cannot be read safely
(chunked, on a server that does not set ``wsgi.input_terminated``): never an empty body
claimed complete.

Secrets never reach the line (SPEC §4.8, rules in :mod:`gatekeeper_wsgi.redact`): the
values of secret headers and of secret form / JSON / XML / query fields are written as
``"[redacted]"``. Nothing a request sends can make a line long: a header value is cut at
1 KiB (``"headers_truncated": [names]``), path and query at 4 KiB each, and a record that
is still over 16 KiB loses its body, then its last headers (``"truncated": true``).

The request thread only builds the record and puts it on a queue (stdlib
:class:`~logging.handlers.QueueHandler`); a :class:`~logging.handlers.QueueListener`
thread hands it to the handlers of ``gatekeeper.rejected`` and its ancestors, with the
usual propagation rules. So a slow handler (a remote syslog, a full disk) costs the
request nothing. At most ``rejected_log.queue_size`` records wait for it; beyond that a
record is dropped (``log_rejected`` returns False and the caller counts
``counters.rejected_log_dropped``), so a handler that falls behind grows no memory.
Configure the logger as usual; it logs at INFO::

    logging.getLogger("gatekeeper.rejected").setLevel(logging.INFO)
    logging.getLogger("gatekeeper.rejected").addHandler(logging.FileHandler("rejected.log"))
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import logging
import logging.handlers
import os
import queue
import socket
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.fault import json_limit_value
from gatekeeper_wsgi.redact import (
    REDACTED,
    SECRET_FIELDS,
    BodyUnreadable,
    is_secret_header,
    redact_body,
    redact_query,
)
from gatekeeper_wsgi.requestvalues import content_length

__all__ = [
    "REDACTED",
    "REJECTED_LOGGER",
    "ReplayedBody",
    "flush",
    "log_rejected",
    "rejection_record",
]

REJECTED_LOGGER = "gatekeeper.rejected"
# Characters left as they are in a logged path: RFC 3986 pchar plus "/".
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
#: a request line longer than this is not looked at for the path as sent (the path
#: logged is cut at 4 KiB anyway)
_LOGGED_PATH_SCAN = 64 * 1024
#: a logged header value is cut after this many characters
HEADER_VALUE_CAP = 1024
#: a logged path or query string is cut after this many characters
URL_PART_CAP = 4096
#: the longest JSON line one record makes
RECORD_CAP = 16 * 1024
# Headers whose value is a URL: its query string can carry secret fields too.
_URL_HEADERS = frozenset({"referer", "origin", "location"})

logger = logging.getLogger(REJECTED_LOGGER)


class _Dispatcher(logging.Handler):
    """Runs in the listener thread: delivers a record to the logger's handlers as
    ``Logger.handle`` would (propagation, handler levels), or completes a flush."""

    def __init__(self, pipeline: _Pipeline) -> None:
        super().__init__()
        self.pipeline = pipeline

    def emit(self, record: logging.LogRecord) -> None:
        done = getattr(record, "gatekeeper_flush", None)
        if isinstance(done, threading.Event):
            done.set()
            return
        try:
            logger.callHandlers(record)
        except Exception:
            # A handler that raises (most catch their own errors, a custom one may not)
            # would end the listener thread, and with it the log for good: reported as
            # logging reports a handler's error, and the next record is delivered.
            self.handleError(record)
        finally:
            self.pipeline.taken()


class _Pipeline:
    """The queue, its handler and the listener thread of one process, and how many
    records wait in it (the queue is shared by every configuration of the process, each
    with its own ``queue_size``, so the bound is checked at ``offer``, not by the queue)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self.handler = logging.handlers.QueueHandler(self.records)
        self.pending = 0
        self._count_lock = threading.Lock()
        self.listener = logging.handlers.QueueListener(self.records, _Dispatcher(self))
        self.listener.start()

    def put(self, record: logging.LogRecord) -> None:
        self.handler.handle(record)

    def offer(self, record: logging.LogRecord, limit: int) -> bool:
        """Queue ``record`` unless ``limit`` records already wait; False when dropped."""
        with self._count_lock:
            if self.pending >= limit:
                return False
            self.pending += 1
        self.put(record)
        return True

    def taken(self) -> None:
        with self._count_lock:
            self.pending -= 1


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


def _cut(text: str, cap: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= cap else (text[:cap], True)


def _headers(
    environ: Mapping[str, Any], redact: frozenset[str], fields: frozenset[str]
) -> tuple[dict[str, str], list[str]]:
    """The request's headers as logged, and the names of those cut at the value cap."""
    headers = {}
    cut = []
    for key, value in environ.items():
        if key.startswith("HTTP_"):
            name = key[5:].replace("_", "-").title()
        elif key in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            name = key.replace("_", "-").title()
        else:
            continue
        if is_secret_header(name, redact):
            headers[name] = REDACTED
            continue
        # Cut before redacting: a hostile value costs the cap, not its own length.
        text, was_cut = _cut(str(value), HEADER_VALUE_CAP)
        if name.lower() in _URL_HEADERS and "?" in text:
            base, _, query = text.partition("?")
            text = f"{base}?{redact_query(query, fields)}"
        headers[name] = text
        if was_cut:
            cut.append(name)
    return headers, cut


#: The longest the log waits for each piece of a rejected request's body still on its way
#: (a socket timeout per read, not a deadline for the whole body: docs/deployment.md), in
#: seconds, where the server lets it tell (see :func:`_read_arrived`): a client that sent
#: its headers first (``Expect: 100-continue``) has its body there within a round trip
BODY_WAIT = 0.005
_NOT_ARRIVED = f"not sent within {BODY_WAIT * 1000:g} ms: not read"
_UNREADABLE = "the server failed to read it: not read"


def _read_arrived(environ: Mapping[str, Any], stream: Any, size: int) -> bytes | None:
    """:func:`_read`, waiting for the client at most :data:`BODY_WAIT` under gunicorn:
    None when the body had not arrived by then.

    gunicorn reads the body from the client's socket as the app asks, waiting for bytes
    the client may never send: a refused request that declares a body and holds it back
    would keep the worker (a gthread thread for good, a sync worker until the arbiter
    kills it), though the app, refusing it, never reads it. gunicorn hands the app that
    socket (``gunicorn.socket``), so this read gets a deadline; one missed leaves
    gunicorn's reader mid-body, so the socket is shut for reading: the response still
    goes out, and gunicorn ends the connection instead of reading the rest as a next
    request. Buffered bodies (waitress, test clients) are there at once; other servers
    stream as they do: werkzeug's development server with a thread per connection (a
    held-back body holds only its own), uWSGI within its ``socket-timeout``.
    """
    sock = environ.get("gunicorn.socket")
    if not isinstance(sock, socket.socket):
        # A server's own deadline (uWSGI's socket-timeout) or a client gone mid-body: what
        # had arrived is kept (and logged as cut), not dropped with the error.
        return _read(stream, size, keep_partial=True)
    try:
        previous = sock.gettimeout()
        sock.settimeout(BODY_WAIT)
    except OSError:  # closed meanwhile: the read below fails as it would
        return _read(stream, size)
    try:
        return _read(stream, size)
    except OSError:  # the deadline (or the client went away) mid-body
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        return None
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(previous)


def _read(stream: Any, size: int, *, keep_partial: bool = False) -> bytes:
    """Up to ``size`` bytes of ``stream`` (fewer only at its end; with ``keep_partial``,
    also those read before an OSError, which is raised only when nothing was)."""
    chunks = []
    try:
        while size > 0:
            chunk = stream.read(size)
            if not isinstance(chunk, bytes):
                raise TypeError(f"wsgi.input.read() returned {type(chunk).__name__}")
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
    except OSError:
        if not (keep_partial and chunks):
            raise
    return b"".join(chunks)


class ReplayedBody:
    """A request body stream that hands out ``head`` (bytes read from it already) first,
    then the rest of ``stream``: PEP 3333's ``wsgi.input`` (``read``, ``readline``,
    ``readlines``, iteration, ``close``), for whoever reads the body next. With
    ``record``, it keeps what it hands out, so :meth:`rewound` can hand it out again (a
    framework whose request object reads the body after the log did: Django's)."""

    __slots__ = ("_head", "_taken", "stream")

    def __init__(self, stream: Any, head: bytes = b"", *, record: bool = False) -> None:
        self._head = head
        self.stream = stream
        self._taken = bytearray() if record else None

    @property
    def read_any(self) -> bool:
        """Whether this stream (made with ``record``) handed anything out."""
        return bool(self._taken)

    def rewound(self) -> ReplayedBody:
        """A stream that hands out again what this one (made with ``record``) handed
        out, then what it did not."""
        if self._taken is None:
            raise ValueError("a ReplayedBody made without record=True cannot be rewound")
        return ReplayedBody(self.stream, bytes(self._taken) + self._head)

    def _took(self, data: bytes) -> bytes:
        if self._taken is not None:
            self._taken += data
        return data

    def read(self, size: int | None = -1) -> bytes:
        limit = -1 if size is None else size
        head = self._head
        if not head:
            return self._took(bytes(self.stream.read(limit)))
        if 0 <= limit <= len(head):
            self._head = head[limit:]
            return self._took(head[:limit])
        # The rest first: a stream that fails raises with the head still held, not lost.
        rest = bytes(self.stream.read(limit - len(head) if limit >= 0 else -1))
        self._head = b""
        return self._took(head + rest)

    def readline(self, size: int | None = -1) -> bytes:
        limit = -1 if size is None else size
        head = self._head
        if not head:
            return self._took(bytes(self.stream.readline(limit)))
        end = head.find(b"\n") + 1 or len(head)
        if limit >= 0:
            end = min(end, limit)
        line, left = head[:end], head[end:]
        if not left and not line.endswith(b"\n") and (limit < 0 or len(line) < limit):
            # As in read(): the rest first, so a failing stream loses nothing.
            line += bytes(self.stream.readline(limit - len(line) if limit >= 0 else -1))
        self._head = left
        return self._took(line)

    def readlines(self, hint: int = -1) -> list[bytes]:
        return list(iter(self.readline, b""))

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.readline, b"")

    def close(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()


def _body(environ: Mapping[str, Any], cap: int) -> tuple[bytes, bool, str | None]:
    """Up to ``cap`` bytes of the request body, whether there was more (or may have been),
    and why it was not read at all (None when it was).

    With a Content-Length, that many bytes are the body. Without one, the body ends where
    the server says the stream does (``wsgi.input_terminated``: gunicorn, waitress and
    werkzeug set it, for a chunked body too); a request with a Transfer-Encoding on a
    server that does not say so cannot be read safely (PEP 3333 forbids reading past the
    length), so it is logged as not captured, never as an empty body. With neither, HTTP
    says there is no body.
    """
    raw_length = str(environ.get("CONTENT_LENGTH") or "")
    if raw_length.strip():
        # At most 18 digits are read: a hostile one of thousands costs int() nothing.
        length = content_length(raw_length)
        if length is None:
            return b"", True, "its Content-Length is not a number: not read"
    elif environ.get("wsgi.input_terminated"):
        length = None
    elif environ.get("HTTP_TRANSFER_ENCODING"):
        return (
            b"",
            True,
            (
                "sent without Content-Length (Transfer-Encoding) to a server that does not "
                "mark where it ends (wsgi.input_terminated): not read"
            ),
        )
    else:
        return b"", False, None
    stream = environ.get("wsgi.input")
    if length == 0 or stream is None:
        return b"", bool(length), None
    if length is not None and cap <= 0:
        return b"", True, None
    try:
        # Without a length, read to the stream's end, one byte past the cap to know
        # whether it goes on.
        read = _read_arrived(environ, stream, cap + 1 if length is None else min(length, cap))
    except Exception:  # a client that went away must not break the fault
        return b"", True, _UNREADABLE
    if read is None:
        return b"", True, _NOT_ARRIVED
    if length is None:
        return read[:cap], len(read) > cap, None
    return read, len(read) < length, None


def _request_path(environ: Mapping[str, Any]) -> str:
    # PEP 3333 strings carry the URL-decoded bytes as latin-1; encode them back.
    raw = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
    try:
        data = raw.encode("latin-1")
    except UnicodeEncodeError:
        # Not PEP 3333's latin-1 (a server or framework that decoded the path): its text
        # as UTF-8 and escaped bytes as those bytes; a path with any other lone surrogate,
        # every surrogate as itself (logged, never raised).
        try:
            data = raw.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            data = raw.encode("utf-8", "surrogatepass")
    sent = _sent_path(environ, data)
    return sent if sent is not None else quote(data, safe=_PATH_SAFE) or "/"


def _sent_path(environ: Mapping[str, Any], decoded: bytes) -> str | None:
    """The path as the client wrote it on the request line, escapes and all, where the
    server hands that line over (gunicorn's and werkzeug's ``RAW_URI``, uWSGI's and
    werkzeug's ``REQUEST_URI``) and it decodes to the path the app got: ``%2F`` stays
    ``%2F``, not a ``/`` that names another resource when the request is replayed. None
    otherwise (the path is then encoded from PEP 3333's decoded one)."""
    for name in ("RAW_URI", "REQUEST_URI"):
        uri = environ.get(name)
        if not isinstance(uri, str) or not uri or len(uri) > _LOGGED_PATH_SCAN:
            continue
        target = uri.split("?", 1)[0].split("#", 1)[0]
        if not target.startswith("/"):  # absolute form: the path of the URL
            target = "/" + target.partition("://")[2].partition("/")[2]
        try:
            written = target.encode("latin-1")
        except UnicodeEncodeError:
            continue
        if unquote_to_bytes(written) == decoded:
            return quote(written, safe=_PATH_SAFE + "%") or "/"
    return None


def rejection_record(
    environ: Mapping[str, Any],
    rejected: Rejected,
    request_id: str,
    config: Config,
    status: int | None = None,
) -> dict[str, Any]:
    """The log record of one rejected request, as a JSON-ready dict (SPEC §7). ``status``
    is the one the client got, when not the rejection's own (a SOAP fault's 500).

    Reads up to ``rejected_log.body_bytes`` of the request body (the request is refused,
    so nobody else will read it). Secrets are redacted and long values cut (module doc).
    """
    settings = config.rejected_log
    redact = frozenset(name.lower() for name in settings.redact_headers)
    fields = SECRET_FIELDS | {name.lower() for name in settings.redact_fields}
    body, truncated, omitted = _body(environ, settings.body_bytes)
    encoding = str(environ.get("HTTP_CONTENT_ENCODING") or "").strip().lower()
    if omitted is None and body and encoding not in ("", "identity"):
        omitted = f"Content-Encoding {encoding[:32]!r}: its fields cannot be looked at"
    elif omitted is None:
        try:
            body = redact_body(body, str(environ.get("CONTENT_TYPE") or ""), fields)
        except BodyUnreadable as exc:
            omitted = str(exc)
        except Exception:  # bad input never breaks the fault (SPEC §4.8); nor logs it
            omitted = "its fields could not be looked at"
    path, path_cut = _cut(_request_path(environ), URL_PART_CAP)
    query, query_cut = _cut(str(environ.get("QUERY_STRING", "")), URL_PART_CAP)
    headers, headers_cut = _headers(environ, redact, fields)
    record: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "requestId": request_id,
        "status": rejected.status if status is None else status,
        "code": rejected.code,
        "level": rejected.level,
        "limit": {
            "path": rejected.limit_path,
            "value": None
            if rejected.limit_value is None
            else json_limit_value(rejected.limit_value),
        },
        "method": _cut(str(environ.get("REQUEST_METHOD", "GET")), 32)[0],
        "path": path,
        "query": redact_query(query, fields),
        "headers": headers,
    }
    if path_cut:
        record["path_truncated"] = True
    if query_cut:
        record["query_truncated"] = True
    if headers_cut:
        record["headers_truncated"] = headers_cut
    if omitted is not None:
        # Secrets never reach the log (SPEC §4.8): a body whose secret fields cannot be
        # found is left out, and replay skips the record as it skips a cut body.
        record["body_omitted"] = omitted
        record["body_truncated"] = True
        return record
    try:
        record["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        record["body_b64"] = base64.b64encode(body).decode("ascii")
    record["body_truncated"] = truncated
    return record


def _line(record: dict[str, Any]) -> str:
    """The record as one JSON line of at most RECORD_CAP characters: over the cap, the
    body goes first, then headers from the last one."""
    line = json.dumps(record, ensure_ascii=True)
    if len(line) <= RECORD_CAP:
        return line
    record.pop("body", None)
    record.pop("body_b64", None)
    record["body_truncated"] = True
    record["truncated"] = True
    line = json.dumps(record, ensure_ascii=True)
    headers: dict[str, str] = record["headers"]
    while len(line) > RECORD_CAP and headers:
        # Each header costs at most ~6 KiB escaped, so this loop runs a few times.
        excess = len(line) - RECORD_CAP
        while excess > 0 and headers:
            name, value = headers.popitem()
            excess -= len(json.dumps(name)) + len(json.dumps(value)) + 2
        line = json.dumps(record, ensure_ascii=True)
    if len(line) > RECORD_CAP:
        # Thousands of header names, or a path of characters that escape six-fold.
        record.pop("headers_truncated", None)
        record["path"] = record["path"][:1024]
        record["query"] = record["query"][:1024]
        line = json.dumps(record, ensure_ascii=True)
    return line


def log_rejected(
    environ: Mapping[str, Any],
    rejected: Rejected,
    request_id: str,
    config: Config,
    status: int | None = None,
) -> bool:
    """Log one rejected request as a JSON line, through the queue (never blocks on I/O).

    Nothing from the request is written raw: the line is JSON with non-ASCII escaped.
    Returns False when the record was dropped because ``rejected_log.queue_size`` records
    already wait for the listener (the caller counts ``rejected_log_dropped``).
    """
    if not logger.isEnabledFor(logging.INFO):
        return True
    line = _line(rejection_record(environ, rejected, request_id, config, status))
    record = logger.makeRecord(REJECTED_LOGGER, logging.INFO, __file__, 0, line, (), None)
    if not logger.filter(record):
        return True
    return _current_pipeline().offer(record, config.rejected_log.queue_size)
