"""Real server processes for the tests (redis-server, gunicorn) on free loopback ports, and
the ways tests wait for them: polling a condition up to a deadline (a readiness check, never
a timing assumption) and releasing threads or processes together."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
#: How long a test waits for something that should happen at once: generous, it only
#: matters when the test fails.
DEADLINE = 30.0

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = DEADLINE, what: str = "") -> T:
    """Call ``predicate`` every few milliseconds until it returns something true, and return
    that; raise TimeoutError naming ``what`` if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout}s: {what or predicate}")
        time.sleep(0.005)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def answers_ping(port: int) -> bool:
    """Whether a redis-server on 127.0.0.1:port answers PING: its event loop runs, so every
    listener it was given (a unix socket too) is open, not only the TCP port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    """Block until something accepts connections on 127.0.0.1:port (TimeoutError if not)."""
    wait_until(lambda: listening(port), timeout, f"something listening on 127.0.0.1:{port}")


def run_together(count: int, task: Callable[[int], T], timeout: float = 2 * DEADLINE) -> list[T]:
    """Run ``task(i)`` in ``count`` threads released at once by a barrier; their results,
    in order. An exception in any thread fails the caller."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait()
            results[index] = task(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads), "a thread never finished"
    return results


def gather(processes: Sequence[BaseProcess], results: Any, timeout: float = 60.0) -> list[Any]:
    """Start ``processes``, take one result from each off the ``results`` queue, and check
    that every one of them exited cleanly."""
    for process in processes:
        process.start()
    reports = [results.get(timeout=timeout) for _ in processes]
    for process in processes:
        process.join(timeout=timeout)
        assert process.exitcode == 0
    return reports


class RedisServer:
    """A redis-server process (with ``extra`` arguments) that the tests can stop and restart
    on the same port."""

    def __init__(
        self, binary: str, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

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
        # The TCP port is open before the unix socket; a PONG means both are.
        wait_until(lambda: answers_ping(self.port), 20.0, f"redis-server on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        """SIGKILL: the server dies mid-whatever, with no chance to save or say goodbye."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a frozen one would stay a zombie
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


class ControlledRedis(RedisServer):
    """A redis-server that a test can also freeze (SIGSTOP: it accepts connections but never
    answers) and thaw."""

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


class ClusterRedis(RedisServer):
    """A one-node Redis Cluster owning all 16 384 slots: it refuses scripts whose keys span
    slots (CROSSSLOT), as a real cluster does. Started again on its port (after a stop or
    a kill), it comes back from its cluster config file owning them still; with
    ``persistent`` it also keeps every write it acknowledged (an AOF fsynced on each)."""

    def __init__(self, binary: str, workdir: Path, persistent: bool = False) -> None:
        port = free_port()
        durable = ("--appendonly", "yes", "--appendfsync", "always") if persistent else ()
        super().__init__(
            binary,
            workdir,
            port,
            (
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-port",
                str(free_port()),  # the default, port + 10000, may not exist
                *durable,  # after start()'s "--appendonly no": the last one counts
            ),
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0?cluster=1"

    def start(self) -> None:
        import redis

        super().start()
        admin = redis.Redis(port=self.port)
        if b"cluster_slots_assigned:0\r" in admin.execute_command("CLUSTER", "INFO"):
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        wait_until(
            lambda: b"cluster_state:ok" in admin.execute_command("CLUSTER", "INFO"),
            what="the cluster to be ok",
        )
        admin.close()


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


def own_control_socket(workdir: Path) -> list[str]:
    """gunicorn >= 25 opens a control socket in ~/.gunicorn by default; give each server its
    own so parallel servers never share one."""
    import gunicorn.config

    if any(setting.name == "control_socket" for setting in gunicorn.config.KNOWN_SETTINGS):
        return ["--control-socket", str(workdir / "gunicorn.ctl")]
    return []


class Gunicorn:
    """A real gunicorn started from the repository root with ``args`` (options, then the app)
    on a free loopback port, its log and control socket in ``workdir``::

        with Gunicorn(tmp_path, "--threads", "8", "flask_app:create_app()") as server:
            status, body = server.request("/")
    """

    def __init__(self, workdir: Path, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.args = args
        self.env = {**os.environ, **(env or {})}
        self.port = free_port()
        self.log = workdir / "gunicorn.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Gunicorn:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def command(self) -> list[str]:
        """The server's command line."""
        return [
            sys.executable, "-m", "gunicorn",
            "--bind", f"127.0.0.1:{self.port}",
            *own_control_socket(self.workdir),
            *self.args,
        ]  # fmt: skip

    def start(self) -> None:
        """Start the server and wait until it accepts connections; if it exits or never
        listens, stop it and fail with its log."""
        command = self.command()
        with self.log.open("wb") as output:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=output, stderr=subprocess.STDOUT
            )
        process = self.process
        try:
            wait_until(lambda: process.poll() is not None or listening(self.port))
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode}")
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            raise RuntimeError(f"{command} did not start:\n{self.log.read_text()}") from exc

    def stop(self) -> None:
        """Terminate gunicorn (gracefully, killed if it takes longer than the deadline)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(DEADLINE)
        self.process = None

    def open(
        self, path: str, method: str = "GET", headers: Mapping[str, str] | None = None
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request on a fresh connection and read its status line; the body is the
        caller's to read, and the connection to close."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=DEADLINE)
        connection.request(method, path, headers=dict(headers or {}))
        return connection, connection.getresponse()

    def request(
        self, path: str, method: str = "GET", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """One complete request on a fresh connection: (status, body)."""
        connection, response = self.open(path, method, headers)
        try:
            return response.status, response.read()
        finally:
            connection.close()

    def json(self, path: str, headers: Mapping[str, str] | None = None) -> Any:
        """GET ``path`` and parse its JSON answer, which must be a 200."""
        status, body = self.request(path, headers=headers)
        assert status == 200, body
        return json.loads(body)

    def json_when(self, path: str, condition: Callable[[Any], bool]) -> Any:
        """The JSON answer of ``path`` once ``condition`` holds for it (polled until the
        deadline)."""
        found = wait_until(lambda: (doc,) if condition(doc := self.json(path)) else None)
        return found[0]


class Waitress(Gunicorn):
    """A real waitress process, used like :class:`Gunicorn`; ``args`` are its options,
    then the app (``module:app``, importable through ``PYTHONPATH`` in ``env``)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "waitress", f"--listen=127.0.0.1:{self.port}", *self.args]


def uwsgi_binary() -> str | None:
    """The ``uwsgi`` of this interpreter's environment, if it is installed."""
    found = Path(sys.executable).parent / "uwsgi"
    return str(found) if found.exists() else None


class UWSGI(Gunicorn):
    """A real uWSGI speaking HTTP itself (``--http-socket``: no keep-alive, so it says
    ``Connection: close``), one process; ``args`` are its options (``--module``...)."""

    def command(self) -> list[str]:
        binary = uwsgi_binary()
        assert binary is not None, "uwsgi is not installed"
        return [
            binary, "--http-socket", f"127.0.0.1:{self.port}",
            "--add-header", "Connection: close",
            "--virtualenv", sys.prefix, "--chdir", str(ROOT),
            "--master", "--processes", "1", "--die-on-term", "--need-app",
            "--disable-logging", *self.args,
        ]  # fmt: skip
