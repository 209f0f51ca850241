"""A real gunicorn (threaded worker) on 127.0.0.1 serving ``tests/apps/wsgi_apps.py``:
clients that go away mid-stream still give their slots back (SPEC §4.2).

The app publishes ``inflight()`` on ``/_status`` (no limit applies there); the tests poll it
until the counters they expect show up, with a deadline, never assuming how long the server
takes to notice a closed connection.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Iterator

import pytest

from tests.apps.wsgi_apps import FILE_ENV
from tests.servers import DEADLINE, Gunicorn, wait_until

pytestmark = pytest.mark.slow

FILE_SIZE = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    """gunicorn, one gthread worker with enough threads for every stream a test holds."""
    workdir = tmp_path_factory.mktemp("gunicorn")
    big = workdir / "big.bin"
    with big.open("wb") as file:
        file.truncate(FILE_SIZE)
    args = ("--worker-class", "gthread", "--workers", "1", "--threads", "32")
    timeouts = ("--timeout", "120", "--graceful-timeout", "5")
    app = "tests.apps.wsgi_apps:app"
    with Gunicorn(workdir, *args, *timeouts, app, env={FILE_ENV: str(big)}) as server:
        yield server


def get(server: Gunicorn, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One complete request that asks the server to close the connection: (status, body)."""
    return server.request(path, headers={"Connection": "close", **(headers or {})})


def inflight(server: Gunicorn) -> dict[str, int]:
    status, body = get(server, "/_status")
    assert status == 200, body
    counts = {path: count for path, count in json.loads(body).items() if count}
    assert all(count >= 0 for count in counts.values()), counts
    return counts


def wait_for(server: Gunicorn, wanted: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The server's (non-zero) in-flight counters once ``wanted`` holds them."""
    return wait_until(lambda: counts if wanted(counts := inflight(server)) else None)


def idle(server: Gunicorn) -> None:
    """Wait until every slot came back."""
    wait_until(lambda: not inflight(server), what="every slot back")


def open_stream(server: Gunicorn, path: str, caller: str, read: int = 256 * 1024) -> socket.socket:
    """A raw client that sends a request and reads the first ``read`` bytes of the answer."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Caller-Id: {caller}\r\n\r\n"
    sock.sendall(request.encode("ascii"))
    received = b""
    while len(received) < read:
        data = sock.recv(65536)
        if not data:
            break
        received += data
    assert received.startswith(b"HTTP/1.1 200"), received[:200]
    return sock


def disconnect(sock: socket.socket, *, abort: bool) -> None:
    """Close a client socket: with a reset (client killed) or a normal FIN."""
    if abort:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_clients_leaving_mid_stream_give_their_slots_back(server: Gunicorn) -> None:
    """Streams whose clients disconnect midway free every slot they held."""
    idle(server)
    callers = [f"c{n}" for n in range(8)]
    socks = [open_stream(server, "/stream", caller) for caller in callers]
    counts = wait_for(server, lambda counts: counts.get("demo/stream") == 8)
    assert counts == {"demo/stream": 8, **{f"demo/stream/{caller}": 1 for caller in callers}}
    for index, sock in enumerate(socks):
        disconnect(sock, abort=index % 2 == 0)
    idle(server)


def test_held_slots_really_limit_and_come_back_after_disconnect(server: Gunicorn) -> None:
    """Held streams really limit the caller (503); once they leave it is served again."""
    idle(server)
    socks = [open_stream(server, "/stream", "limited") for _ in range(2)]
    wait_for(server, lambda counts: counts.get("demo/stream/limited") == 2)
    status, body = get(server, "/stream", {"X-Caller-Id": "limited"})
    assert status == 503
    problem = json.loads(body)
    assert problem["code"] == "GK-CONCURRENCY-LIMIT"
    assert problem["limit"] == {"path": "demo/stream/*", "value": 2}
    for sock in socks:
        disconnect(sock, abort=True)
    idle(server)
    sock = open_stream(server, "/stream", "limited")
    disconnect(sock, abort=False)
    idle(server)


def test_clients_leaving_a_file_download_give_their_slots_back(server: Gunicorn) -> None:
    """file_wrapper downloads free their slots when clients leave midway."""
    idle(server)
    socks = [open_stream(server, "/file", f"f{n}", read=512 * 1024) for n in range(4)]
    wait_for(server, lambda counts: counts.get("demo/file") == 4)
    for index, sock in enumerate(socks):
        disconnect(sock, abort=index % 2 == 1)
    idle(server)
    status, body = get(server, "/file")
    assert status == 200
    assert len(body) == FILE_SIZE
    idle(server)


def test_stream_failing_midway_gives_its_slot_back(server: Gunicorn) -> None:
    """A body that raises halfway ends the response early; its slot still comes back."""
    idle(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        received = b""
        while data := sock.recv(65536):
            received += data
    assert received.startswith(b"HTTP/1.1 200")
    idle(server)


def test_clients_leaving_before_reading_anything(server: Gunicorn) -> None:
    """Clients that send a request and vanish at once leave no slot behind."""
    idle(server)
    for round_ in range(3):
        socks = []
        for n in range(10):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE)
            sock.sendall(f"GET /stream HTTP/1.1\r\nHost: x\r\nX-Caller-Id: g{n}\r\n\r\n".encode())
            socks.append(sock)
        for sock in socks:
            disconnect(sock, abort=round_ != 1)
        idle(server)
