"""``python -m example_site load``: fire concurrent requests at a running site and count
what the gatekeeper did with them.

Each answer is sorted into one of:

- **admitted**: the app answered (whatever its status) without waiting;
- **queued**: the app answered after the request waited in a gatekeeper queue (the
  example site's ``X-Queue-Wait-Ms`` header at least ``--queued-ms``, default 10 ms);
- **rejected**: a ServiceFault, counted by status and ``code`` (``503 GK-QUEUE-FULL``);
- **failed**: no HTTP answer (connection refused or reset, timeout).

An answer that tells an adaptive limit (``/search``: "adaptive limit now 5") is noted with
its time, and the report shows that limit second by second: how it settles under the load.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from example_site.common import QUEUE_WAIT_HEADER

DEFAULT_URL = "http://127.0.0.1:8000/slow"
_XML_CODE = re.compile(rb"<(?:\w+:)?code>\s*([A-Z-]+)\s*</(?:\w+:)?code>")
_LIMIT_NOW = re.compile(rb"adaptive limit now (\d{1,9})\b")


@dataclass
class Tally:
    """What happened to the requests of one load run."""

    admitted: Counter[int] = field(default_factory=Counter)  # by status
    queued: Counter[int] = field(default_factory=Counter)  # by status
    rejected: Counter[tuple[int, str]] = field(default_factory=Counter)  # by (status, code)
    failed: Counter[str] = field(default_factory=Counter)  # by exception type
    queue_wait_ms: list[float] = field(default_factory=list)
    #: (seconds since the start, adaptive limit) told by admitted answers
    limits: list[tuple[float, int]] = field(default_factory=list)
    seconds: float = 0.0

    def limit_per_second(self) -> list[int]:
        """The last adaptive limit told in each second of the run (seconds in which no
        answer told one repeat the one before)."""
        last: dict[int, int] = {}
        for moment, value in sorted(self.limits):
            last[int(moment)] = value
        if not last:
            return []
        shown, value = [], last[min(last)]
        for second in range(max(last) + 1):
            value = last.get(second, value)
            shown.append(value)
        return shown

    @property
    def total(self) -> int:
        return sum(
            sum(counter.values())
            for counter in (self.admitted, self.queued, self.rejected, self.failed)
        )


def fault_code(content_type: str, body: bytes) -> str | None:
    """The ServiceFault ``code`` of a response body (JSON problem details, XML or SOAP),
    None for anything else."""
    if "json" in content_type:
        try:
            code = json.loads(body).get("code")
        except (ValueError, AttributeError):
            return None
        return code if isinstance(code, str) and code.startswith("GK-") else None
    if "xml" in content_type and b"ServiceFault" in body:
        match = _XML_CODE.search(body)
        return match.group(1).decode("ascii") if match else None
    return None


def run(
    url: str,
    requests: int,
    concurrency: int,
    *,
    method: str = "GET",
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    queued_ms: float = 10.0,
) -> Tally:
    """Send ``requests`` requests, ``concurrency`` at a time (all at once when they are
    equal), and tally the answers."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection_class = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    sent_headers = dict(headers or {})
    if data is not None:
        sent_headers.setdefault("Content-Type", "application/x-www-form-urlencoded")
    tally = Tally()
    lock = threading.Lock()
    workers = min(concurrency, requests)
    start = threading.Barrier(workers)
    tickets = iter(range(requests))
    started = time.monotonic()

    def one() -> None:
        connection = connection_class(parts.hostname, parts.port, timeout=timeout)
        try:
            connection.request(method, target, body=data, headers=sent_headers)
            response = connection.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as exc:
            with lock:
                tally.failed[type(exc).__name__] += 1
            return
        finally:
            connection.close()
        code = fault_code(response.getheader("Content-Type", ""), body)
        waited = response.getheader(QUEUE_WAIT_HEADER)
        told = _LIMIT_NOW.search(body) if code is None else None
        with lock:
            if told is not None:
                tally.limits.append((time.monotonic() - started, int(told.group(1))))
            if code is not None:
                tally.rejected[(response.status, code)] += 1
            elif waited is not None and float(waited) >= queued_ms:
                tally.queued[response.status] += 1
                tally.queue_wait_ms.append(float(waited))
            else:
                tally.admitted[response.status] += 1

    def worker() -> None:
        start.wait()  # the first wave leaves together, as a burst would arrive
        while True:
            with lock:
                if next(tickets, None) is None:
                    return
            one()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tally.seconds = time.monotonic() - started
    return tally


def report(tally: Tally, url: str, concurrency: int) -> str:
    """The tally as the lines ``load`` prints."""

    def by_status(counter: Counter[int]) -> str:
        listed = ", ".join(f"{status}: {n}" for status, n in sorted(counter.items()))
        return f"  ({listed})" if listed else ""

    lines = [
        f"{tally.total} requests to {url}, {concurrency} at a time, in {tally.seconds:.2f} s",
        f"  admitted  {sum(tally.admitted.values()):5}{by_status(tally.admitted)}",
    ]
    queued = f"  queued    {sum(tally.queued.values()):5}{by_status(tally.queued)}"
    if tally.queue_wait_ms:
        queued += f", waited {min(tally.queue_wait_ms):.0f}-{max(tally.queue_wait_ms):.0f} ms"
    lines.append(queued)
    lines.append(f"  rejected  {sum(tally.rejected.values()):5}")
    for (status, code), n in sorted(tally.rejected.items()):
        lines.append(f"    {status} {code:<24}{n:5}")
    if tally.failed:
        lines.append(f"  failed    {sum(tally.failed.values()):5}")
        for name, n in sorted(tally.failed.items()):
            lines.append(f"    {name:<28}{n:5}")
    per_second = tally.limit_per_second()
    if per_second:
        lines.append(f"  adaptive limit, second by second: {' '.join(map(str, per_second))}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_site load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", default=DEFAULT_URL, help=f"default {DEFAULT_URL}")
    parser.add_argument("--requests", "-n", type=int, default=10, help="default 10")
    parser.add_argument("--concurrency", "-c", type=int, default=10, help="default 10")
    parser.add_argument("--method", "-X", default=None, help="default GET, POST with --data")
    parser.add_argument("--data", "-d", help="request body, e.g. password=guess")
    parser.add_argument(
        "--header", "-H", action="append", default=[], help="'Name: value', repeatable"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--queued-ms", type=float, default=10.0, help="default 10")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    headers = {}
    for header in args.header:
        name, colon, value = header.partition(":")
        if not colon or not name.strip():
            parser.error(f"--header expects 'Name: value', got {header!r}")
        headers[name.strip()] = value.strip()
    data = args.data.encode("utf-8") if args.data is not None else None
    method = args.method or ("POST" if data is not None else "GET")
    try:
        tally = run(
            args.url,
            args.requests,
            args.concurrency,
            method=method,
            data=data,
            headers=headers,
            timeout=args.timeout,
            queued_ms=args.queued_ms,
        )
    except ValueError as exc:
        parser.error(str(exc))
    print(report(tally, args.url, args.concurrency))
    return 1 if tally.failed else 0
