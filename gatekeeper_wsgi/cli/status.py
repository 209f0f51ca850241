"""``gatekeeper status``: the live in-flight counts of a shared or Redis backend."""

from __future__ import annotations

import contextlib
import json
import re
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from gatekeeper_wsgi.backends import backend_from_url
from gatekeeper_wsgi.backends.shared.url import parse_url
from gatekeeper_wsgi.cli.check import ConfigInput
from gatekeeper_wsgi.config import Config, Limit, load_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.limitindex import counting_limit
from gatekeeper_wsgi.redact import mask_text
from gatekeeper_wsgi.status import public_backend_url

__all__ = ["printable", "run_status"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """Text from logs and backends, with control characters escaped for the terminal."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", str(text))


def run_status(
    backend_url: str | None,
    *,
    as_json: bool,
    out: TextIO,
    config: ConfigInput | None = None,
    show_all: bool = False,
    err: TextIO | None = None,
) -> int:
    """Print the live in-flight counts of a shared or Redis backend, from any process.

    ``config`` (settings or file) names the limit counting each path and supplies the
    backend URL when ``backend_url`` is None. The memory backend lives inside each
    process, so it cannot be read from here: that is explained and 2 returned. An error
    is an ``error: ...`` line on ``err`` (default ``out``), or with ``as_json`` a JSON
    document ``{"backend": ..., "error": ...}`` on ``out``.
    """
    errors = err if err is not None else out
    loaded: Config | None = None
    try:
        if config is not None:
            loaded = load_config(config)
        url = backend_url or (loaded.backend if loaded is not None else None)
        if not url:
            return _status_error(out, errors, as_json, None, "no backend: pass --backend URL", 2)
        shown_url = public_backend_url(url)
        scheme = url.split(":", 1)[0].lower() if ":" in url else url.strip().lower()
        if scheme == "memory":
            return _status_error(
                out,
                errors,
                as_json,
                shown_url,
                "the memory backend counts inside each process, so another process cannot "
                "read it: open the status endpoint (StatusApp / the dashboard) of the process "
                "you mean, or use a shared:///path or redis:// backend",
                2,
            )
        if scheme == "shared":
            path, _ = parse_url(url)  # as the backend reads it: shared://rel/t.shm is relative
            if not Path(path).exists():
                return _status_error(
                    out, errors, as_json, shown_url, f"no such backend file: {path or '(none)'}", 1
                )
        # Without the configuration: a reader takes the table as the servers made it. Given
        # one that needs a bigger shared table, the backend would re-create it whenever
        # nothing is in flight, and every rate window with it (SPEC 4.1).
        backend = backend_from_url(url)
    except ConfigError as exc:
        return _status_error(out, errors, as_json, None, mask_text(str(exc)), 2)
    try:
        now = time.monotonic()
        inflight = backend.inflight(now)
        census = backend.census(now)
    except Exception as exc:
        return _status_error(
            out, errors, as_json, shown_url, f"backend failed: {mask_text(str(exc))}", 1
        )
    finally:
        with contextlib.suppress(Exception):
            backend.close()
    entries = []
    for path, count in sorted(inflight.items()):
        limit = counting_limit(loaded.limit_index, path) if loaded is not None else None
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
        width = max(len(printable(entry.path)) for entry in busy)
        for entry in busy:
            line = f"  {printable(entry.path).ljust(width)}  {entry.inflight:>6}"
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


def _status_error(
    out: TextIO, err: TextIO, as_json: bool, backend: str | None, message: str, code: int
) -> int:
    if as_json:
        # What --json promises on stdout, for the script reading it; the exit code says failed.
        print(json.dumps({"backend": backend, "error": message}, indent=2), file=out)
    else:
        print(f"error: {message}", file=err)
    return code
