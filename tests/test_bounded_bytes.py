"""Every cache a request can write is bounded in bytes (SPEC §4.5), a reload keeps nothing
of the previous configuration alive (SPEC §3), a hostile Accept is capped before it is
parsed, and request ids stay unique across forked workers (SPEC §3 request_id_header)."""

from __future__ import annotations

import gc
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import EnvironBuilder

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi import middleware as core_middleware
from gatekeeper_wsgi.identify import Identifier, request_id_from
from gatekeeper_wsgi.resolve import MEMO_KEY_CHARS
from tests.conftest import busy

MiB = 1024 * 1024


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def rss() -> int:
    """This process's resident set size in bytes, as the kernel counts it."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def call(app: Any, environ: dict[str, Any]) -> str:
    status: list[str] = []

    def start_response(line: str, headers: Any, exc_info: Any = None) -> None:
        status.append(line)

    result = app(environ, start_response)
    try:
        b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    return status[0]


def hostile_environ(n: int) -> dict[str, Any]:
    """A request with a 4 KiB path and 8 KiB caller, tenant, Accept and junk headers, all
    different from every other request's."""
    unique = f"{n:08x}"
    return {
        "REQUEST_METHOD": "GET",
        "SCRIPT_NAME": "",
        "PATH_INFO": f"/{unique}{'p' * 4086}",
        "QUERY_STRING": "",
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "REMOTE_ADDR": "10.0.0.1",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.url_scheme": "http",
        "HTTP_X_CALLER_ID": unique + "c" * 8184,
        "HTTP_X_TENANT": unique + "t" * 8184,
        "HTTP_ACCEPT": f"application/xml;q=0.{n % 9 + 1}, " + "text/x-junk, " * 630,
        "HTTP_X_JUNK": unique + "j" * 8184,
    }


SPRAYED_LIMITS = {
    "site": {"concurrency": 1000},
    # Refuses every request at the caller level: the fault path (Accept) runs too.
    "site/*/*": {"concurrency": 0, "key": "header:X-Tenant"},
}


def test_16000_hostile_requests_grow_rss_by_less_than_60_mib() -> None:
    """16 000 requests with 8 KiB headers and 4 KiB paths, each one new, through the
    middleware (a server would cap such request lines): RSS grows < 60 MiB."""
    app = GateKeeperMiddleware(ok_app, {"project": "site", "limits": SPRAYED_LIMITS})
    # The rejected log is bounded on its own (test_bounded_log.py); here pytest's log
    # capture would keep every record it is handed, so the log stays off.
    rejected_log = logging.getLogger("gatekeeper.rejected")
    level = rejected_log.level
    rejected_log.setLevel(logging.WARNING)
    try:
        for n in range(500):  # warm up: imports, first routes, allocator arenas
            call(app, hostile_environ(n))
        gc.collect()
        before = rss()
        statuses = [call(app, hostile_environ(n)) for n in range(500, 16_500)]
        gc.collect()
        grown = rss() - before
    finally:
        rejected_log.setLevel(level)
    assert statuses.count("503 Service Unavailable") == 16_000
    assert grown < 60 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"


def test_long_request_values_are_never_memoized() -> None:
    """Paths, caller and key headers, and status lines longer than MEMO_KEY_CHARS are
    computed afresh, not stored; short ones are remembered."""
    gk = GateKeeper(
        {"project": "site", "limits": {"site/*/*": {"concurrency": 5, "key": "header:X-Tenant"}}}
    )
    identifier = Identifier(gk.config)
    long_value = "v" * (MEMO_KEY_CHARS + 1)
    environ = {"PATH_INFO": "/" + long_value, "HTTP_X_CALLER_ID": long_value}
    assert identifier.service(environ).startswith("~")
    assert identifier.caller(environ) is None
    gk.admit("site", "svc", "crm", environ={"HTTP_X_TENANT": long_value}).release(200)
    core_middleware._status_code("200 " + long_value)
    assert identifier._services == {} and identifier._callers == {}
    assert gk.config.caller_memo == {}
    assert all(len(status) <= MEMO_KEY_CHARS for status in core_middleware._STATUS_CODES)
    short = {"PATH_INFO": "/orders", "HTTP_X_CALLER_ID": "crm"}
    assert identifier.service(short) == "orders" and identifier.caller(short) == "crm"
    gk.admit("site", "svc", "crm", environ={"HTTP_X_TENANT": "acme"}).release(200)
    assert "/orders" in identifier._services and "crm" in identifier._callers
    assert ("site", "svc", "acme") in gk.config.caller_memo
    gk.close()


def test_a_64_kib_accept_is_capped_before_parsing() -> None:
    """A 64 KiB Accept still picks the fault format from its first ranges, and 600
    different ones grow RSS by less than 8 MiB."""
    app = GateKeeperMiddleware(ok_app, {"limits": {"default": {"concurrency": 0}}})
    environ = EnvironBuilder(
        path="/x", headers={"Accept": "application/xml, " + "text/x-junk;q=0.1, " * 3500}
    ).get_environ()
    assert len(environ["HTTP_ACCEPT"]) > 64 * 1024
    captured: list[list[tuple[str, str]]] = []

    def start_response(line: str, headers: Any, exc_info: Any = None) -> None:
        captured.append(headers)

    b"".join(app(environ, start_response))
    assert dict(captured[0])["Content-Type"].startswith("application/xml")
    gc.collect()
    before = rss()
    for n in range(600):
        environ["HTTP_ACCEPT"] = f"application/json;q=0.{n % 9 + 1}, {n}/x, " + "a/b, " * 13_000
        b"".join(app(environ, start_response))
    gc.collect()
    grown = rss() - before
    # Without the cap the parse cache alone would keep 512 x 64 KiB = 32 MiB.
    assert grown < 8 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"


# --- reloads ------------------------------------------------------------------------------


def write_limits(path: Path, generation: int, count: int = 5000) -> None:
    """A TOML file of ``count`` limits, replaced atomically (rename)."""
    lines = ['project = "shop"', "[limits]"]
    lines += [f'"shop/s{index}" = {{ concurrency = {generation + 1} }}' for index in range(count)]
    lines.append('"shop/*/*" = { concurrency = 50, key = "header:X-Tenant" }')
    temporary = path.with_suffix(".tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def test_30_reloads_of_a_5000_limit_file_leave_one_live_config(tmp_path: Path) -> None:
    """After 30 reloads with traffic in between (routes, caller memo, identifier, faults),
    exactly one of the 31 configurations the engine had is alive: nothing keeps the old
    ones (weak references, counted after a full collection)."""
    path = tmp_path / "limits.toml"
    write_limits(path, 0)
    app = GateKeeperMiddleware(ok_app, str(path))
    gk = app.gatekeeper
    configs = [weakref.ref(gk.config)]
    for generation in range(1, 31):
        for n in range(20):
            # Inline: a request's environ (holding its Admission) ends with the request.
            headers = [("X-Tenant", f"t{n}"), ("X-Caller-Id", "crm")]
            assert call(app, EnvironBuilder(path=f"/s{n}", headers=headers).get_environ()) == (
                "200 OK"
            )
        write_limits(path, generation)
        assert gk.reload() is True
        configs.append(weakref.ref(gk.config))
    assert gk.config.limits["shop/s1"].concurrency == 31
    gc.collect()
    alive = [ref() for ref in configs if ref() is not None]
    assert alive == [gk.config]
    gk.close()


def test_a_response_in_flight_across_reloads_keeps_no_old_config_alive(tmp_path: Path) -> None:
    """A long response (a stream, an SSE feed) admitted before a reload holds its slots,
    not the configuration it was admitted under: once swapped, that one is gone while the
    response still streams, and the response still releases its slot exactly once."""
    path = tmp_path / "limits.toml"
    write_limits(path, 0)
    app = GateKeeperMiddleware(ok_app, str(path))
    gk = app.gatekeeper
    first = weakref.ref(gk.config)
    headers = [("X-Tenant", "t1"), ("X-Caller-Id", "crm")]
    streaming = app(EnvironBuilder(path="/s1", headers=headers).get_environ(), lambda *a: None)
    assert busy(gk) == {"shop/s1": 1, "shop/s1/t1": 1}
    write_limits(path, 1)
    assert gk.reload() is True
    gc.collect()
    assert first() is None
    b"".join(streaming)
    streaming.close()  # type: ignore[attr-defined]
    assert busy(gk) == {}
    gk.close()


# --- request ids across fork ---------------------------------------------------------------


def ids_from_a_fork(count: int) -> list[str]:
    """Request ids generated in a forked child, read back through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just ids and out
        try:
            os.close(read_end)
            ids = [request_id_from({}, "HTTP_X_REQUEST_ID") for _ in range(count)]
            os.write(write_end, json.dumps(ids).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    os.waitpid(pid, 0)
    return list(json.loads(b"".join(chunks)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_workers_generate_distinct_request_ids() -> None:
    """Two forked workers and their parent never generate the same request id (the
    per-process prefix is renewed after fork, as under gunicorn --preload)."""
    request_id_from({}, "HTTP_X_REQUEST_ID")  # the parent has started its sequence
    first, second = ids_from_a_fork(100), ids_from_a_fork(100)
    parent = [request_id_from({}, "HTTP_X_REQUEST_ID") for _ in range(100)]
    assert len(set(first) | set(second) | set(parent)) == 300
    prefixes = {ids[0].split("-")[0] for ids in (first, second, parent)}
    assert len(prefixes) == 3
