"""Real server processes for the tests: redis-server, gunicorn. Started on free loopback
ports, waited for by polling their socket (a readiness check, not a timing assumption)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    """Block until something accepts connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.02)


class RedisServer:
    """A redis-server process the tests can stop and restart on the same port."""

    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


class ControlledRedis(RedisServer):
    """A redis-server with extra arguments that a test can also freeze (SIGSTOP: it accepts
    connections but never answers) and thaw, or shut down saving its data."""

    def __init__(
        self, binary: str, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        super().__init__(binary, workdir, port)
        self.extra = extra

    def start(self) -> None:
        options = {
            "--port": str(self.port),
            "--bind": "127.0.0.1",
            "--save": "",
            "--appendonly": "no",
            "--dir": str(self.workdir),
        }
        self.process = subprocess.Popen(
            [self.binary, *(part for pair in options.items() for part in pair), *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.resume()  # a frozen process cannot act on SIGTERM
        super().stop()


class Blackhole:
    """A TCP port whose accept queue is full: connecting to it times out (as a host that
    drops packets would), without any routing tricks."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = int(self.listener.getsockname()[1])
        # Linux queues backlog + 1 connections; this one fills the queue.
        self.filler = socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def close(self) -> None:
        self.filler.close()
        self.listener.close()
