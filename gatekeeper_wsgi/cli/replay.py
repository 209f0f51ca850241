"""``gatekeeper replay``: send the requests of a rejected-request log again."""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import os
import re
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote, urlsplit

from gatekeeper_wsgi.cli.status import printable
from gatekeeper_wsgi.fileformats import file_kind
from gatekeeper_wsgi.redact import REDACTED

__all__ = [
    "MAX_TIMEOUT",
    "REPLAY_EPILOG",
    "ReplayRequest",
    "parse_header",
    "parse_rate",
    "parse_timeout",
    "run_replay",
]

#: The longest ``--timeout`` per request, in seconds (a day): longer is a typo.
MAX_TIMEOUT = 86400.0

REPLAY_EPILOG = (
    "Secrets are never logged, so they are not replayed: a redacted header (Authorization, "
    "Cookie, X-Api-Key, ...) is left out (supply it with --header), and a redacted form, "
    "JSON or query field (password, token, api_key, ...) is sent with the literal value "
    f"{REDACTED!r}, so such a request (a login, say) is not the original one; --dry-run "
    "lists them."
)

# Headers that belong to the original connection, not to the request.
_CONNECTION_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    }
)
# Headers that frame the body: made for the body sent, never taken from --header.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})
# How a redacted value may be spelled in a body the log kept as bytes (body_b64).
_REDACTED_CODECS = ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
_RATE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|second|m|min|minute|h|hour))?\s*")
_RATE_UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}
_RATE_UNITS.update({"h": 3600.0, "hour": 3600.0})


def parse_rate(text: str | float) -> float:
    """Requests per second from ``"5/s"``, ``"30/m"``, ``"2.5"``; ValueError otherwise."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        match = _RATE_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"expected a rate like '5/s' or '30/m', got {text!r}")
        value = float(match.group(1)) / _RATE_UNITS[match.group(2) or "s"]
    if not value > 0:
        raise ValueError(f"the rate must be above 0, got {text!r}")
    return value


def parse_timeout(text: str | float) -> float:
    """Seconds per request from ``"2.5"``: above 0, at most :data:`MAX_TIMEOUT`;
    ValueError otherwise (``inf``, ``nan`` and ``1e400`` included)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(
                f"expected a number of seconds like '10' or '2.5', got {text!r}"
            ) from None
    # Written so that nan, which compares false with everything, is refused too.
    if not 0 < value <= MAX_TIMEOUT:
        raise ValueError(
            f"the timeout must be above 0 and at most {MAX_TIMEOUT:g} seconds (a day), got {text!r}"
        )
    return value


@dataclass
class ReplayRequest:
    """One logged rejected request, ready to send again."""

    line: int
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    original: Mapping[str, Any]
    notes: list[str] = field(default_factory=list)
    skip: str | None = None


def _open_log(path: Path) -> TextIO:
    """The log opened for reading; ValueError saying what is wrong with it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"no such log file: {printable(path)}") from None
    except OSError as exc:
        raise ValueError(f"cannot read log file {printable(path)}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        # /dev/zero would be read for ever, a FIFO would block.
        raise ValueError(f"not a regular file: {printable(path)} ({file_kind(mode)})")
    try:
        return path.open("r", encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ValueError(f"cannot read log file {printable(path)}: {exc.strerror}") from None


def _records(log: TextIO) -> Iterator[tuple[int, Mapping[str, Any] | None]]:
    with log as lines:
        for number, line in enumerate(lines, start=1):
            text = line.strip()
            if not text:
                continue
            record: Any = None
            # A handler's formatter may put a prefix (time, level) before the JSON.
            for start in (0, text.find("{")):
                if start < 0:
                    continue
                try:
                    record = json.loads(text[start:])
                    break
                except (ValueError, RecursionError):  # RecursionError: nested 5 000 deep
                    continue
            if isinstance(record, dict) and "method" in record and "path" in record:
                yield number, record
            else:
                yield number, None


def _prepare(
    number: int,
    record: Mapping[str, Any],
    base_path: str,
    overrides: Sequence[tuple[str, str]],
    send_truncated: bool,
) -> ReplayRequest:
    method = str(record.get("method") or "GET")
    path = str(record.get("path") or "/")
    if not path.startswith("/"):
        path = "/" + path
    query = str(record.get("query") or "")
    target = _ascii(base_path.rstrip("/") + path + (f"?{query}" if query else ""))
    notes: list[str] = []
    framing = [name for name, _ in overrides if name.lower() in _FRAMING_HEADERS]
    if framing:
        # The body sent is the one logged: its framing is made for it.
        notes.append(f"{', '.join(framing)} given with --header: not sent (made for the body)")
        overrides = [item for item in overrides if item[0].lower() not in _FRAMING_HEADERS]
    override_names = {name.lower() for name, _ in overrides}
    headers: list[tuple[str, str]] = []
    logged = record.get("headers") or {}
    if isinstance(logged, Mapping):
        for name, value in logged.items():
            lowered = str(name).lower()
            if lowered in _CONNECTION_HEADERS or lowered in override_names:
                continue
            if value == REDACTED:
                notes.append(f"{name} was redacted: not sent (use --header to supply it)")
                continue
            if REDACTED in str(value):  # a secret field in a URL header (Referer, Origin)
                notes.append(f"{name} holds redacted fields: sent with {REDACTED!r} in them")
            headers.append((str(name), str(value)))
    headers.extend(overrides)
    body = b""
    skip = None
    try:
        if "body_b64" in record:
            body = base64.b64decode(str(record["body_b64"]), validate=True)
        else:
            body = str(record.get("body") or "").encode("utf-8")
    except (binascii.Error, ValueError):
        skip = "the logged body_b64 is not valid base64"
    if REDACTED in query or any(REDACTED.encode(codec) in body for codec in _REDACTED_CODECS):
        # The log never holds the secret, so the replay cannot send it either.
        notes.append(
            f"fields were redacted in the log: sent with {REDACTED!r} as their values "
            "(supply credentials with --header; a form or JSON password cannot be restored)"
        )
    # What the log cut (the body at rejected_log.body_bytes; a header value at 1 KiB, the
    # path and the query at 4 KiB) is not the original request: skipped unless asked for.
    omitted = record.get("body_omitted")
    cut = ["body"] if record.get("body_truncated") and not omitted else []
    cut += [part for part in ("path", "query") if record.get(f"{part}_truncated")]
    headers_cut = record.get("headers_truncated")
    if isinstance(headers_cut, list) and headers_cut:
        cut.append("header " + ", ".join(map(str, headers_cut)))
    if omitted:
        # Not logged at all (why: the log says): an empty body in its place, framed as
        # one (its Content-Encoding would claim a gzip body that is not there).
        what = f"body not logged ({str(omitted)[:200]})"
        headers = [item for item in headers if item[0].lower() != "content-encoding"]
        if send_truncated:
            notes.append(f"{what}: sending no body")
        else:
            skip = f"{what}; --send-truncated sends the request without it"
    if cut:
        what = " and ".join(cut) + " truncated in the log"
        if send_truncated:
            notes.append(f"{what}: sending what was logged ({len(body)} bytes of body)")
        elif skip is None:
            skip = f"{what} (its caps: see rejected_log); --send-truncated sends it"
    return ReplayRequest(number, method, target, headers, body, record, notes, skip)


def _send(
    scheme: str, host: str, port: int | None, request: ReplayRequest, timeout: float
) -> tuple[int, str]:
    connection_class = (
        http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(host, port, timeout=timeout)
    try:
        # A Host given with --header (the logged one is never sent) replaces the one the
        # connection would make: two Host headers are a 400 (RFC 9112 3.2).
        given_host = any(name.lower() == "host" for name, _ in request.headers)
        connection.putrequest(
            request.method, request.target, skip_host=given_host, skip_accept_encoding=True
        )
        for name, value in request.headers:
            connection.putheader(name, value.encode("latin-1", "replace"))
        if request.body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            connection.putheader("Content-Length", str(len(request.body)))
        connection.endheaders(request.body or None)
        response = connection.getresponse()
        response.read()
        return response.status, response.reason
    finally:
        connection.close()


def run_replay(
    log_path: str | os.PathLike[str],
    to_url: str,
    *,
    rate: float | str | None = None,
    dry_run: bool = False,
    out: TextIO,
    err: TextIO | None = None,
    headers: Sequence[tuple[str, str]] = (),
    timeout: float | str = 10.0,
    send_truncated: bool = False,
) -> int:
    """Send the requests of a rejected-request log again to ``to_url``.

    Method, path, query, headers and body go out as logged; the connection's own headers
    (Host, Content-Length, ...) are made anew, redacted headers are left out unless
    ``headers`` supplies them. ``rate`` paces the requests (``"5/s"`` or a number per
    second). Prints one result line per request; returns 1 if any could not be sent.
    An unusable argument or log is an ``error: ...`` line on ``err`` (default ``out``)
    and 2.
    """
    errors = err if err is not None else out
    try:  # urlsplit and .port raise ValueError for a bad port or an unclosed "["
        target = urlsplit(to_url)
        host, port = target.hostname, target.port
    except ValueError:
        host = None
    if host is None or target.scheme not in ("http", "https"):
        print(f"error: --to must be an http:// or https:// URL, got {to_url!r}", file=errors)
        return 2
    try:
        per_second = None if rate is None else parse_rate(rate)
        timeout = parse_timeout(timeout)
        log = _open_log(Path(log_path))
    except ValueError as exc:
        print(f"error: {exc}", file=errors)
        return 2
    sent = failed = skipped = 0
    started = time.monotonic()
    for number, record in _records(log):
        if record is None:
            skipped += 1
            print(f"line {number}: skipped: not a rejected-request record", file=out)
            continue
        request = _prepare(number, record, target.path, headers, send_truncated)
        label = f"line {number}: {printable(request.method)} {printable(request.target)}"
        was = record.get("code")
        limit = record.get("limit") if isinstance(record.get("limit"), Mapping) else {}
        origin = f"was {printable(was)}" if was else "was rejected"
        if limit and limit.get("path"):
            origin += f" at {printable(limit.get('path'))}"
        if record.get("requestId"):
            origin += f", requestId {printable(record.get('requestId'))}"
        for note in request.notes:
            print(f"line {number}: note: {printable(note)}", file=out)
        if request.skip is not None:
            skipped += 1
            print(f"{label} -> skipped: {request.skip}", file=out)
            continue
        if dry_run:
            sent += 1
            names = ", ".join(printable(name) for name, _ in request.headers) or "no headers"
            print(
                f"{label} -> dry run: would send {len(request.body)} body bytes, "
                f"headers {names} ({origin})",
                file=out,
            )
            continue
        if per_second is not None:
            due = started + sent / per_second
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # pacing the replay, as asked
        sent += 1
        try:
            status, reason = _send(target.scheme, host, port, request, timeout)
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # ValueError: http.client refuses a logged path or header it cannot send.
            failed += 1
            print(f"{label} -> failed: {printable(exc)} ({origin})", file=out)
            continue
        print(f"{label} -> {status} {printable(reason)} ({origin})", file=out)
    verb = "would send" if dry_run else "sent"
    print(f"{verb} {sent - failed}, failed {failed}, skipped {skipped}", file=out)
    return 1 if failed else 0


def _ascii(target: str) -> str:
    """A logged request target as http.client sends it, in ASCII: any other character
    percent-encoded as the byte it stands for (PEP 3333 strings are latin-1; a character
    beyond latin-1, as its UTF-8 bytes)."""
    if target.isascii():
        return target
    # (A lone surrogate, which no log of ours holds but a hand-edited one may, as the
    # bytes Python would give it: never an error that ends the replay.)
    return "".join(
        char
        if char.isascii()
        else quote(
            char.encode("latin-1") if ord(char) < 256 else char.encode("utf-8", "surrogatepass")
        )
        for char in target
    )


def parse_header(text: str) -> tuple[str, str]:
    """``("Name", "value")`` from ``"Name: value"``; ValueError otherwise."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"expected 'Name: value', got {text!r}")
    if not _TOKEN.fullmatch(name.strip()):
        raise ValueError(
            f"{name.strip()[:100]!r} is no header name (letters, digits, !#$%&'*+-.^_`|~)"
        )
    return name.strip(), value.strip()


#: an HTTP field name (RFC 9110 5.1: a token)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
