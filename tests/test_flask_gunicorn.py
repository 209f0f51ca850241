"""The Flask extension under a real gunicorn process with 8 threads and concurrent clients:
the app never sees more concurrent executions than the limit, streamed responses hold
their slot until closed, and every slot comes back (zero leaks)."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.servers import DEADLINE, Gunicorn, run_together

pytestmark = pytest.mark.slow

#: The app's observer and engine counters.
STATE = "/_test/state"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    """gunicorn serving tests/apps/flask_app.py: one worker process, 8 threads."""
    args = ("--workers", "1", "--threads", "8", "--pythonpath", "tests/apps")
    with Gunicorn(tmp_path_factory.mktemp("gunicorn"), *args, "flask_app:create_app()") as server:
        yield server


def no_leaks(current: dict[str, Any]) -> bool:
    """Every slot came back."""
    return all(count == 0 for count in current["inflight"].values())


def open_stream(server: Gunicorn, path: str) -> tuple[http.client.HTTPConnection, Any]:
    """Start a streamed request; its body is streaming now."""
    connection, response = server.open(path)
    assert response.status == 200
    return connection, response


def test_concurrent_clients_never_exceed_the_view_limit(server: Gunicorn) -> None:
    """8 simultaneous clients on a view limited to 2: exactly 2 run, 6 get the fault."""
    server.request("/_test/close/hold", "POST")
    results: list[tuple[int, bytes]] = []
    rejected = threading.Semaphore(0)

    def client(_: int) -> tuple[int, bytes]:
        result = server.request("/hold")
        if result[0] != 200:
            rejected.release()
        return result

    opener = threading.Thread(target=lambda: results.extend(run_together(8, client)), daemon=True)
    opener.start()
    for _ in range(6):
        assert rejected.acquire(timeout=DEADLINE)
    held = server.json_when(STATE, lambda current: current["current"].get("hold") == 2)
    assert held["inflight"]["demo/hold"] == 2
    server.request("/_test/open/hold", "POST")
    opener.join(DEADLINE)
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200] + [503] * 6
    assert all(b"GK-CONCURRENCY-LIMIT" in body for status, body in results if status == 503)
    final = server.json_when(STATE, no_leaks)
    assert final["peak"]["hold"] == 2


def test_blueprint_and_view_limits_hold_under_load(server: Gunicorn) -> None:
    """16 clients hammering two views: blueprint cap 4 and view caps 3 are never exceeded."""

    def client(index: int) -> list[tuple[int, bytes]]:
        return [server.request(f"/api/{'ab'[(index + i) % 2]}") for i in range(25)]

    results = [result for batch in run_together(16, client) for result in batch]
    assert {status for status, _ in results} <= {200, 503}
    assert all(b"GK-CONCURRENCY-LIMIT" in body for status, body in results if status == 503)
    assert any(status == 200 for status, _ in results)
    final = server.json_when(STATE, no_leaks)
    assert final["peak"]["api"] <= 4
    assert final["peak"]["api/a"] <= 3
    assert final["peak"]["api/b"] <= 3


def test_streamed_response_holds_its_slot_until_closed(server: Gunicorn) -> None:
    """A stream_with_context body keeps the slot after the view returned; closing frees it."""
    server.request("/_test/close/stream", "POST")
    connection, response = open_stream(server, "/stream?n=1")
    try:
        assert response.readline() == b"first 1\n"
        status, body = server.request("/stream?n=2")
        assert status == 503
        assert b"GK-CONCURRENCY-LIMIT" in body
        server.request("/_test/open/stream", "POST")
        assert response.read() == b"last\n"
    finally:
        connection.close()
    server.json_when(STATE, no_leaks)
    assert server.request("/stream?n=3") == (200, b"first 3\nlast\n")
    assert server.json_when(STATE, no_leaks)["peak"]["stream"] == 1


def test_client_disconnect_mid_stream_releases(server: Gunicorn) -> None:
    """A client that goes away in the middle of a stream does not leak its slot."""
    server.request("/_test/close/stream", "POST")
    connection, response = open_stream(server, "/stream?n=4")
    assert response.readline() == b"first 4\n"
    connection.close()
    server.request("/_test/open/stream", "POST")
    final = server.json_when(
        STATE, lambda current: no_leaks(current) and not current["current"]["stream"]
    )
    assert final["inflight"].get("demo/stream", 0) == 0
    assert server.request("/stream?n=5") == (200, b"first 5\nlast\n")


def test_error_inside_stream_releases_after_the_delay(server: Gunicorn) -> None:
    """A generator raising mid-stream is a faulty response: released after its delay."""
    before = server.json(STATE)["faulty_releases"]
    connection, response = open_stream(server, "/stream-fail")
    try:
        assert response.readline() == b"partial\n"
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            response.read()
    finally:
        connection.close()
    server.json_when(STATE, lambda current: current["faulty_releases"] > before)
    server.json_when(STATE, no_leaks)
    connection, response = open_stream(server, "/stream-fail")  # admitted again
    connection.close()
    server.json_when(STATE, no_leaks)
