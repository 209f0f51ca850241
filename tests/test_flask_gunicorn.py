"""The Flask extension under a real gunicorn process with 8 threads and concurrent clients:
the app never sees more concurrent executions than the limit, streamed responses hold
their slot until closed, and every slot comes back (zero leaks)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import free_port, wait_for_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
APPS = ROOT / "tests" / "apps"
DEADLINE = 30.0


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    """gunicorn serving tests/apps/flask_app.py: one worker process, 8 threads."""
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn",
            "--workers", "1",
            "--threads", "8",
            "--bind", f"127.0.0.1:{port}",
            "--pythonpath", str(APPS),
            "--log-level", "critical",
            "flask_app:create_app()",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=20)


def request(port: int, method: str, path: str) -> tuple[int, bytes]:
    """One request on a fresh connection; (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def state(port: int) -> dict[str, Any]:
    """The app's observer and engine counters."""
    status, body = request(port, "GET", "/_test/state")
    assert status == 200
    result: dict[str, Any] = json.loads(body)
    return result


def eventually(port: int, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the app's state until ``condition`` holds; fail after the deadline."""
    deadline = time.monotonic() + DEADLINE
    while True:
        current = state(port)
        if condition(current):
            return current
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {DEADLINE}s: {current}")
        time.sleep(0.01)


def no_leaks(current: dict[str, Any]) -> bool:
    """Every slot came back."""
    return all(count == 0 for count in current["inflight"].values())


def run_concurrently(count: int, task: Callable[[int], Any]) -> list[Any]:
    """Run ``task(i)`` in ``count`` threads released together by a barrier."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = task(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE * 2)
    assert not errors, errors
    return results


def open_stream(port: int, path: str) -> tuple[http.client.HTTPConnection, Any]:
    """Start a streamed request and read its first line (the body is streaming now)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    connection.request("GET", path)
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def test_concurrent_clients_never_exceed_the_view_limit(server: int) -> None:
    """8 simultaneous clients on a view limited to 2: exactly 2 run, 6 get the fault."""
    request(server, "POST", "/_test/close/hold")
    results: list[tuple[int, bytes]] = []
    rejected = threading.Semaphore(0)

    def client(_: int) -> tuple[int, bytes]:
        result = request(server, "GET", "/hold")
        if result[0] != 200:
            rejected.release()
        return result

    opener = threading.Thread(
        target=lambda: results.extend(run_concurrently(8, client)), daemon=True
    )
    opener.start()
    for _ in range(6):
        assert rejected.acquire(timeout=DEADLINE)
    held = eventually(server, lambda current: current["current"].get("hold") == 2)
    assert held["inflight"]["demo/hold"] == 2
    request(server, "POST", "/_test/open/hold")
    opener.join(DEADLINE)
    statuses = sorted(status for status, _ in results)
    assert statuses == [200, 200] + [503] * 6
    assert all(b"GK-CONCURRENCY-LIMIT" in body for status, body in results if status == 503)
    final = eventually(server, no_leaks)
    assert final["peak"]["hold"] == 2


def test_blueprint_and_view_limits_hold_under_load(server: int) -> None:
    """16 clients hammering two views: blueprint cap 4 and view caps 3 are never exceeded."""

    def client(index: int) -> list[tuple[int, bytes]]:
        return [request(server, "GET", f"/api/{'ab'[(index + i) % 2]}") for i in range(25)]

    results = [result for batch in run_concurrently(16, client) for result in batch]
    assert {status for status, _ in results} <= {200, 503}
    assert all(b"GK-CONCURRENCY-LIMIT" in body for status, body in results if status == 503)
    assert any(status == 200 for status, _ in results)
    final = eventually(server, no_leaks)
    assert final["peak"]["api"] <= 4
    assert final["peak"]["api/a"] <= 3
    assert final["peak"]["api/b"] <= 3


def test_streamed_response_holds_its_slot_until_closed(server: int) -> None:
    """A stream_with_context body keeps the slot after the view returned; closing frees it."""
    request(server, "POST", "/_test/close/stream")
    connection, response = open_stream(server, "/stream?n=1")
    try:
        assert response.readline() == b"first 1\n"
        status, body = request(server, "GET", "/stream?n=2")
        assert status == 503
        assert b"GK-CONCURRENCY-LIMIT" in body
        request(server, "POST", "/_test/open/stream")
        assert response.read() == b"last\n"
    finally:
        connection.close()
    eventually(server, no_leaks)
    assert request(server, "GET", "/stream?n=3") == (200, b"first 3\nlast\n")
    assert eventually(server, no_leaks)["peak"]["stream"] == 1


def test_client_disconnect_mid_stream_releases(server: int) -> None:
    """A client that goes away in the middle of a stream does not leak its slot."""
    request(server, "POST", "/_test/close/stream")
    connection, response = open_stream(server, "/stream?n=4")
    assert response.readline() == b"first 4\n"
    connection.close()
    request(server, "POST", "/_test/open/stream")
    final = eventually(
        server, lambda current: no_leaks(current) and not current["current"]["stream"]
    )
    assert final["inflight"].get("demo/stream", 0) == 0
    assert request(server, "GET", "/stream?n=5") == (200, b"first 5\nlast\n")


def test_error_inside_stream_releases_after_the_delay(server: int) -> None:
    """A generator raising mid-stream is a faulty response: released after its delay."""
    before = state(server)["faulty_releases"]
    connection, response = open_stream(server, "/stream-fail")
    try:
        assert response.readline() == b"partial\n"
        with pytest.raises((http.client.IncompleteRead, ConnectionError)):
            response.read()
    finally:
        connection.close()
    eventually(server, lambda current: current["faulty_releases"] > before)
    eventually(server, no_leaks)
    connection, response = open_stream(server, "/stream-fail")  # admitted again
    connection.close()
    eventually(server, no_leaks)
