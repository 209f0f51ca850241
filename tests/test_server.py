"""A real gunicorn (threaded worker) on 127.0.0.1 serving ``tests/apps/wsgi_apps.py``:
clients that go away mid-stream still give their slots back (SPEC §4.2).

The app publishes ``inflight()`` on ``/_status`` (no limit applies there); the tests poll it
until the counters they expect show up, with a deadline, never assuming how long the server
takes to notice a closed connection.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps.wsgi_apps import FILE_ENV
from tests.servers import free_port, wait_for_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FILE_SIZE = 64 * 1024 * 1024
DEADLINE = 30.0


@dataclass
class Server:
    port: int
    process: subprocess.Popen[bytes]
    log: Path


def own_control_socket(workdir: Path) -> list[str]:
    """gunicorn >= 25 opens a control socket in ~/.gunicorn by default; give this one its own
    so parallel servers (other tests) never share it."""
    import gunicorn.config

    if any(setting.name == "control_socket" for setting in gunicorn.config.KNOWN_SETTINGS):
        return ["--control-socket", str(workdir / "gunicorn.ctl")]
    return []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """gunicorn, one gthread worker with enough threads for every stream a test holds."""
    workdir = tmp_path_factory.mktemp("gunicorn")
    big = workdir / "big.bin"
    with big.open("wb") as file:
        file.truncate(FILE_SIZE)
    log = workdir / "gunicorn.log"
    port = free_port()
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--worker-class",
                "gthread",
                "--workers",
                "1",
                "--threads",
                "32",
                "--bind",
                f"127.0.0.1:{port}",
                "--chdir",
                str(ROOT),
                "--timeout",
                "120",
                "--graceful-timeout",
                "5",
                *own_control_socket(workdir),
                "tests.apps.wsgi_apps:app",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            env={**os.environ, FILE_ENV: str(big)},
        )
    try:
        try:
            wait_for_port(port)
        except TimeoutError:
            pytest.fail(f"gunicorn did not start:\n{log.read_text(errors='replace')}")
        yield Server(port, process, log)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(15)


def get(server: Server, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One complete request with http.client: (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
    try:
        connection.request("GET", path, headers={"Connection": "close", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def inflight(server: Server) -> dict[str, int]:
    status, body = get(server, "/_status")
    assert status == 200, body
    return {path: count for path, count in json.loads(body).items() if count}


def wait_for(server: Server, wanted: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """Poll the server's in-flight counters until ``wanted`` holds, or fail at a deadline."""
    deadline = time.monotonic() + DEADLINE
    while True:
        counts = inflight(server)
        assert all(count >= 0 for count in counts.values()), counts
        if wanted(counts):
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"in-flight counters stuck at {counts}")
        time.sleep(0.02)


def idle(server: Server) -> dict[str, int]:
    return wait_for(server, lambda counts: not counts)


def open_stream(server: Server, path: str, caller: str, read: int = 256 * 1024) -> socket.socket:
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


def test_clients_leaving_mid_stream_give_their_slots_back(server: Server) -> None:
    """Streams whose clients disconnect midway free every slot they held."""
    idle(server)
    callers = [f"c{n}" for n in range(8)]
    socks = [open_stream(server, "/stream", caller) for caller in callers]
    counts = wait_for(server, lambda counts: counts.get("demo/stream") == 8)
    assert counts == {"demo/stream": 8, **{f"demo/stream/{caller}": 1 for caller in callers}}
    for index, sock in enumerate(socks):
        disconnect(sock, abort=index % 2 == 0)
    idle(server)


def test_held_slots_really_limit_and_come_back_after_disconnect(server: Server) -> None:
    """Held streams really limit the caller (503); once they leave it is served again."""
    idle(server)
    socks = [open_stream(server, "/stream", "limited") for _ in range(2)]
    wait_for(server, lambda counts: counts.get("demo/stream/limited") == 2)
    status, body = get(server, "/stream", {"X-Caller-Id": "limited"})
    assert status == 503
    problem = json.loads(body)
    assert problem["code"] == "GK-CONCURRENCY-LIMIT"
    assert problem["limit"] == {"path": "demo/stream/*", "value": "2"}
    for sock in socks:
        disconnect(sock, abort=True)
    idle(server)
    sock = open_stream(server, "/stream", "limited")
    disconnect(sock, abort=False)
    idle(server)


def test_clients_leaving_a_file_download_give_their_slots_back(server: Server) -> None:
    """file_wrapper (sendfile) downloads free their slots when clients leave midway."""
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


def test_stream_failing_midway_gives_its_slot_back(server: Server) -> None:
    """A body that raises halfway ends the response early; its slot still comes back."""
    idle(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as sock:
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        received = b""
        while data := sock.recv(65536):
            received += data
    assert received.startswith(b"HTTP/1.1 200")
    idle(server)


def test_clients_leaving_before_reading_anything(server: Server) -> None:
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
