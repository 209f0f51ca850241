"""The ``gatekeeper`` console script: ``check``, ``status`` and ``replay``.

::

    gatekeeper check gatekeeper.properties          # validate, print the effective limit tree
    gatekeeper status --backend shared:///run/gk.shm [--config FILE] [--json]
    gatekeeper replay rejected.log --to http://127.0.0.1:8000 [--rate 5/s] [--dry-run]

The ``run_*`` functions are the reusable parts; the Django (``manage.py gatekeeper``) and
Flask (``flask gatekeeper``) commands call them with their own settings and streams.
Each returns the exit status: 0 fine, 1 failed, 2 unusable input.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import http.client
import json
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple, TextIO
from urllib.parse import urlsplit

from gatekeeper_wsgi.backends import backend_from_url, check_backend_url
from gatekeeper_wsgi.config import DEFAULT_MAX_KEYS, Config, Limit, load_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.redact import REDACTED, mask_text
from gatekeeper_wsgi.status import limit_of, public_backend_url

__all__ = ["add_commands", "main", "run_check", "run_command", "run_replay", "run_status"]

ConfigInput = Mapping[str, Any] | str | os.PathLike[str]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: object) -> str:
    """Text from logs and backends, with control characters escaped for the terminal."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", str(text))


def _number(value: float) -> str:
    return f"{value:g}"


# --- check ------------------------------------------------------------------------------


def _sort_key(segments: tuple[str, ...]) -> tuple[tuple[bool, str], ...]:
    # Exact names first, then the '*' that covers every other value.
    return tuple((segment == "*", segment) for segment in segments)


def _governing(config: Config, segments: tuple[str, ...]) -> Limit | None:
    """The limit of this exact level that applies to the node ``segments`` (the engine's
    own lookup, so what is printed is what is enforced)."""
    return config.limit_index.most_specific(segments)


def _own(limit: Limit | None) -> list[str]:
    if limit is None or (limit.concurrency is None and limit.rate is None):
        return ["no limit of its own"]
    parts = []
    adaptive = limit.adaptive
    if adaptive is not None:
        parts.append(
            f"concurrency auto ({adaptive.algorithm}, {adaptive.min}..{adaptive.max}, "
            f"starting at {adaptive.initial})"
        )
    elif limit.concurrency is not None:
        parts.append(
            "concurrency 0 (blocked)"
            if limit.concurrency == 0
            else f"concurrency {limit.concurrency}"
        )
    if limit.rate is not None:
        parts.append(f"rate {limit.rate.text}")
        if limit.count is not None:
            parts.append("counting " + ",".join(str(s) for s in sorted(limit.count)))
    if limit.wildcard:
        names = ["project", "service", limit.key]
        counted = [names[i] for i, segment in enumerate(limit.segments) if segment == "*"]
        parts.append("one counter per " + " and ".join(counted))
    elif limit.level == "caller" and limit.key != "caller":
        parts.append(f"key {limit.key}")
    if limit.queue is not None:
        parts.append(f"queue {limit.queue.size} waiting up to {_number(limit.queue.wait)}s")
    if limit.wildcard and limit.max_keys != DEFAULT_MAX_KEYS:
        parts.append(f"max_keys {limit.max_keys}")
    if limit.mode is not None:
        parts.append(f"mode {limit.mode}")
    return parts


def _inherited(config: Config, segments: tuple[str, ...]) -> list[str]:
    """Effective delay and timeout markers at a node: the most specific level that sets
    one wins; markers come from the project and service levels only."""
    chain = [_governing(config, segments[:depth]) for depth in range(1, len(segments) + 1)]
    here = "/".join(segments)
    parts = []

    def source(limit: Limit) -> str:
        return "" if limit.path == here else f" (from {limit.path})"

    delay = next(
        (lim for lim in reversed(chain) if lim is not None and lim.delay is not None), None
    )
    if delay is not None and delay.delay:
        parts.append(f"delay {_number(delay.delay or 0)}s{source(delay)}")
    markers = chain[:2]
    status = next((m for m in reversed(markers) if m is not None and m.timeout_status), None)
    if status is not None and status.timeout_status is not None:
        codes = ",".join(str(s) for s in sorted(status.timeout_status))
        parts.append(f"timeout_status {codes}{source(status)}")
    header = next((m for m in reversed(markers) if m is not None and m.timeout_header), None)
    if header is not None and header.timeout_header is not None:
        parts.append(f"timeout_header {header.timeout_header.text!r}{source(header)}")
    body = next((m for m in reversed(markers) if m is not None and m.timeout_body), None)
    if body is not None and body.timeout_body is not None:
        pattern = body.timeout_body.pattern.decode("utf-8", "replace")
        parts.append(f"timeout_body /{pattern}/{source(body)}")
    if (delay is None or not delay.delay) and any((status, header, body)):
        parts.append("delay 0s")
    return parts


def limit_tree(config: Config) -> list[str]:
    """The effective limit tree, one line per path (configured paths and their parents)."""
    nodes: set[tuple[str, ...]] = set()
    for limit in config.limits.values():
        for depth in range(1, len(limit.segments) + 1):
            nodes.add(limit.segments[:depth])
    ordered = sorted(nodes, key=_sort_key)
    last_child: dict[tuple[str, ...], tuple[str, ...]] = {}
    for node in ordered:
        last_child[node[:-1]] = node  # sorted, so the last one seen is the last sibling
    labels = []
    for node in ordered:
        prefix = "".join(
            "   " if last_child[node[: level - 1]] == node[:level] else "│  "
            for level in range(2, len(node))
        )
        if len(node) > 1:
            prefix += "└─ " if last_child[node[:-1]] == node else "├─ "
        labels.append(prefix + "/".join(node))
    width = max(len(label) for label in labels)
    lines = []
    for node, label in zip(ordered, labels, strict=True):
        path = "/".join(node)
        governing = _governing(config, node)
        if governing is None or governing.path == path:
            details = _own(governing)
        else:
            details = [f"counted under {governing.path}: " + ", ".join(_own(governing))]
        details += _inherited(config, node)
        lines.append(f"{label.ljust(width)}  " + "; ".join(details))
    return lines


def run_check(source: ConfigInput, out: TextIO, *, err: TextIO | None = None) -> int:
    """Validate a config file or settings dict and print its effective limit tree.

    Returns 0 when valid; 1 with the error (``file:line: key: problem``) written to
    ``err`` (default ``out``) otherwise.
    """
    errors = err if err is not None else out
    try:
        config = load_config(source)
        # The backend's own parsing, as at start-up: bad or unknown URL options fail here.
        check_backend_url(config.backend)
    except ConfigError as exc:
        print(f"error: {mask_text(str(exc))}", file=errors)
        return 1
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "settings"
    print(f"{name}: OK", file=out)
    print(
        f"project {config.project} · backend {public_backend_url(config.backend)} · "
        f"mode {config.mode} · on_backend_error {config.on_backend_error} · "
        f"caller header {config.caller.header}" + (" (required)" if config.caller.required else ""),
        file=out,
    )
    if config.backend.split(":", 1)[0].lower() in ("redis", "rediss", "unix", "valkey"):
        from gatekeeper_wsgi.backends.redis import check_report  # redis-py only when used

        try:
            print(check_report(config.backend, config), file=out)
        except ConfigError as exc:
            print(f"error: {mask_text(str(exc))}", file=errors)
            return 1
    if config.reload.file:
        print(f"limits file: {config.reload.file}", file=out)
    if not config.limits:
        print("no limits: every request is admitted", file=out)
        return 0
    print("", file=out)
    for line in limit_tree(config):
        print(line, file=out)
    return 0


# --- status -----------------------------------------------------------------------------


def run_status(
    backend_url: str | None,
    *,
    as_json: bool,
    out: TextIO,
    config: ConfigInput | None = None,
    show_all: bool = False,
) -> int:
    """Print the live in-flight counts of a shared or Redis backend, from any process.

    ``config`` (settings or file) names the limit counting each path and supplies the
    backend URL when ``backend_url`` is None. The memory backend lives inside each
    process, so it cannot be read from here: that is explained and 2 returned.
    """
    loaded: Config | None = None
    try:
        if config is not None:
            loaded = load_config(config)
        url = backend_url or (loaded.backend if loaded is not None else None)
        if not url:
            return _status_error(out, as_json, None, "no backend: pass --backend URL", 2)
        shown_url = public_backend_url(url)
        scheme = url.split(":", 1)[0].lower() if ":" in url else url.strip().lower()
        if scheme == "memory":
            return _status_error(
                out,
                as_json,
                shown_url,
                "the memory backend counts inside each process, so another process cannot "
                "read it: open the status endpoint (StatusApp / the dashboard) of the process "
                "you mean, or use a shared:///path or redis:// backend",
                2,
            )
        if scheme == "shared":
            path = urlsplit(url).path
            if not path or not Path(path).exists():
                return _status_error(
                    out, as_json, shown_url, f"no such backend file: {path or '(none)'}", 1
                )
        backend = backend_from_url(url, loaded)
    except ConfigError as exc:
        return _status_error(out, as_json, None, mask_text(str(exc)), 2)
    try:
        now = time.monotonic()
        inflight = backend.inflight(now)
        census = backend.census(now)
    except Exception as exc:
        return _status_error(out, as_json, shown_url, f"backend failed: {mask_text(str(exc))}", 1)
    finally:
        with contextlib.suppress(Exception):
            backend.close()
    entries = []
    for path, count in sorted(inflight.items()):
        limit = limit_of(loaded, path) if loaded is not None else None
        entries.append(_Entry(path, count, limit))
    if as_json:
        document: dict[str, Any] = {
            "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            "backend": shown_url,
            "inflight": {entry.path: entry.inflight for entry in entries},
            "requests": None if census is None else census.requests,
            "delayed_pending": None if census is None else census.delayed,
        }
        if loaded is not None:
            document["limits"] = {
                entry.path: {
                    "limit": None if entry.limit is None else entry.limit.path,
                    "concurrency": None if entry.limit is None else entry.limit.concurrency,
                }
                for entry in entries
            }
        print(json.dumps(document, indent=2, sort_keys=True), file=out)
        return 0
    busy = [entry for entry in entries if entry.inflight or show_all]
    # Requests, not slots: a request limited on three levels holds three slots.
    requests = "?" if census is None else str(census.requests)
    print(f"backend {shown_url}: {requests} in flight (slots per path below)", file=out)
    if busy:
        width = max(len(_printable(entry.path)) for entry in busy)
        for entry in busy:
            line = f"  {_printable(entry.path).ljust(width)}  {entry.inflight:>6}"
            if entry.limit is not None:
                if entry.limit.concurrency is not None:
                    line += f" / {entry.limit.concurrency}"
                if entry.limit.path != entry.path:
                    line += f"  ({entry.limit.path})"
            print(line, file=out)
    idle = len(entries) - len(busy)
    if idle:
        print(f"  {idle} tracked path(s) at 0 not shown (--all shows them)", file=out)
    delayed = "unknown" if census is None else str(census.delayed)
    print(f"delayed releases pending: {delayed}", file=out)
    return 0


class _Entry(NamedTuple):
    path: str
    inflight: int
    limit: Limit | None


def _status_error(out: TextIO, as_json: bool, backend: str | None, message: str, code: int) -> int:
    if as_json:
        print(json.dumps({"backend": backend, "error": message}, indent=2), file=out)
    else:
        print(f"error: {message}", file=out)
    return code


# --- replay -----------------------------------------------------------------------------

_REPLAY_EPILOG = (
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


def _records(path: Path) -> Iterator[tuple[int, Mapping[str, Any] | None]]:
    with path.open("r", encoding="utf-8", errors="replace") as lines:
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
                except ValueError:
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
    target = base_path.rstrip("/") + path + (f"?{query}" if query else "")
    override_names = {name.lower() for name, _ in overrides}
    headers: list[tuple[str, str]] = []
    notes: list[str] = []
    logged = record.get("headers") or {}
    if isinstance(logged, Mapping):
        for name, value in logged.items():
            lowered = str(name).lower()
            if lowered in _CONNECTION_HEADERS or lowered in override_names:
                continue
            if value == REDACTED:
                notes.append(f"{name} was redacted: not sent (use --header to supply it)")
                continue
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
    if REDACTED.encode() in body or REDACTED in query:
        # The log never holds the secret, so the replay cannot send it either.
        notes.append(
            f"fields were redacted in the log: sent with {REDACTED!r} as their values "
            "(supply credentials with --header; a form or JSON password cannot be restored)"
        )
    if record.get("body_truncated"):
        if send_truncated:
            notes.append(f"body truncated in the log: sending its first {len(body)} bytes")
        else:
            skip = "body truncated in the log (rejected_log.body_bytes); --send-truncated sends it"
    return ReplayRequest(number, method, target, headers, body, record, notes, skip)


def _send(
    scheme: str, host: str, port: int | None, request: ReplayRequest, timeout: float
) -> tuple[int, str]:
    connection_class = (
        http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(host, port, timeout=timeout)
    try:
        connection.putrequest(request.method, request.target, skip_accept_encoding=True)
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
    headers: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
    send_truncated: bool = False,
) -> int:
    """Send the requests of a rejected-request log again to ``to_url``.

    Method, path, query, headers and body go out as logged; the connection's own headers
    (Host, Content-Length, ...) are made anew, redacted headers are left out unless
    ``headers`` supplies them. ``rate`` paces the requests (``"5/s"`` or a number per
    second). Prints one result line per request; returns 1 if any could not be sent.
    """
    target = urlsplit(to_url)
    if target.scheme not in ("http", "https") or not target.hostname:
        print(f"error: --to must be an http:// or https:// URL, got {to_url!r}", file=out)
        return 2
    try:
        per_second = None if rate is None else parse_rate(rate)
    except ValueError as exc:
        print(f"error: {exc}", file=out)
        return 2
    path = Path(log_path)
    if not path.is_file():
        print(f"error: no such log file: {path}", file=out)
        return 2
    host = target.hostname
    port = target.port
    sent = failed = skipped = 0
    started = time.monotonic()
    for number, record in _records(path):
        if record is None:
            skipped += 1
            print(f"line {number}: skipped: not a rejected-request record", file=out)
            continue
        request = _prepare(number, record, target.path, headers, send_truncated)
        label = f"line {number}: {_printable(request.method)} {_printable(request.target)}"
        was = record.get("code")
        limit = record.get("limit") if isinstance(record.get("limit"), Mapping) else {}
        origin = f"was {_printable(was)}" if was else "was rejected"
        if limit and limit.get("path"):
            origin += f" at {_printable(limit.get('path'))}"
        if record.get("requestId"):
            origin += f", requestId {_printable(record.get('requestId'))}"
        for note in request.notes:
            print(f"line {number}: note: {_printable(note)}", file=out)
        if request.skip is not None:
            skipped += 1
            print(f"{label} -> skipped: {request.skip}", file=out)
            continue
        if dry_run:
            sent += 1
            names = ", ".join(_printable(name) for name, _ in request.headers) or "no headers"
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
            print(f"{label} -> failed: {_printable(exc)} ({origin})", file=out)
            continue
        print(f"{label} -> {status} {_printable(reason)} ({origin})", file=out)
    verb = "would send" if dry_run else "sent"
    print(f"{verb} {sent - failed}, failed {failed}, skipped {skipped}", file=out)
    return 1 if failed else 0


# --- the console script -----------------------------------------------------------------


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


def _rate(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_commands(commands: Any, *, has_settings: bool = False) -> None:
    """Add ``check``, ``status`` and ``replay`` to an argparse subparsers object.

    ``has_settings``: a framework's settings are configured (Django, Flask), so ``check``
    needs no FILE and ``status`` defaults to the configured backend.
    """
    check = commands.add_parser(
        "check", help="validate a config file and print the effective limit tree"
    )
    if not has_settings:
        check.add_argument("file", metavar="FILE", help="a .toml or .properties file")
    else:
        check.add_argument(
            "file",
            nargs="?",
            metavar="FILE",
            help="a .toml or .properties file (default: the settings)",
        )

    status = commands.add_parser(
        "status", help="live in-flight counts of a shared or Redis backend"
    )
    status.add_argument("--backend", metavar="URL", help="shared:///path or redis://host:port/db")
    status.add_argument("--config", metavar="FILE", help="name each path's limit (and backend)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--all", action="store_true", help="also list paths at 0")

    replay = commands.add_parser(
        "replay",
        help="send logged rejected requests again",
        description="Send the requests of a gatekeeper.rejected log again.",
        epilog=_REPLAY_EPILOG,
    )
    replay.add_argument("log", metavar="LOG", help="a gatekeeper.rejected log file (JSON lines)")
    replay.add_argument("--to", required=True, metavar="URL", help="base URL to send them to")
    replay.add_argument("--rate", type=_rate, metavar="N/s", help="at most N requests per second")
    replay.add_argument("--dry-run", action="store_true", help="print, do not send")
    replay.add_argument(
        "--header",
        "-H",
        type=_header,
        action="append",
        default=[],
        metavar="'Name: value'",
        help="add or replace a header (e.g. a redacted Authorization)",
    )
    replay.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    replay.add_argument(
        "--send-truncated", action="store_true", help="also send bodies the log truncated"
    )


def run_command(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    *,
    settings: ConfigInput | None = None,
) -> int:
    """Run a parsed ``check`` / ``status`` / ``replay``; returns the exit status.

    ``settings`` stand in for a missing FILE (``check``) and ``--config`` (``status``).
    """
    if args.command == "check":
        source = args.file if args.file is not None else settings
        if source is None:
            print("error: pass FILE", file=err)
            return 2
        return run_check(source, out, err=err)
    if args.command == "status":
        config = args.config if args.config is not None else settings
        if args.backend is None and config is None:
            print("error: pass --backend URL (or --config FILE naming one)", file=err)
            return 2
        return run_status(
            args.backend, as_json=args.json, out=out, config=config, show_all=args.all
        )
    return run_replay(
        args.log,
        args.to,
        rate=args.rate,
        dry_run=args.dry_run,
        out=out,
        headers=args.header,
        timeout=args.timeout,
        send_truncated=args.send_truncated,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gatekeeper``."""
    from gatekeeper_wsgi import __version__

    parser = argparse.ArgumentParser(
        prog="gatekeeper", description="Operate gatekeeper-wsgi: check, status, replay."
    )
    parser.add_argument("--version", action="version", version=f"gatekeeper-wsgi {__version__}")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``gatekeeper`` with ``argv`` (default: the command line); returns the exit status."""
    args = build_parser().parse_args(argv)
    # Resolvers and renderers named in the config are imported from the project.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return run_command(args, sys.stdout, sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
