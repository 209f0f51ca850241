"""Throughput of the FRS endpoint (``gatekeeper_wsgi.frs.FrequencyService``): requests/s.

Run ``python benchmarks/frs.py --backend shared:///tmp/gk-frs.shm`` (or ``memory``, or
``redis://127.0.0.1:6379/0``). Three operations, each on 1,000 keys taken in turn:

- ``query``: a key with room left (records nothing);
- ``update``: a use recorded (the limit is never reached);
- ``update-restricted``: a key whose window is full (answers 1, records nothing).

Two ways, both reported:

- ``wsgi``: the app called in this process by ``--threads`` threads, XML body parsed,
  answer rendered: the cost of the endpoint itself;
- ``http`` (``--http``): gunicorn with ``--workers`` x ``--server-threads`` serving it on
  127.0.0.1, driven by ``--threads`` keep-alive ``http.client`` connections. The Python
  client is part of what is measured; on a small machine it is often the bottleneck.
"""

from __future__ import annotations

import argparse
import http.client
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.frs import FrequencyService

ROOT = _common.ROOT
KEYS = 1000
# A rate never reached in a run, so every update records, and one always reached.
OPEN_RATE = "1000000000/hour"
FULL_RATE = "1/hour"
OPERATIONS = {
    "query": ("query", "open"),
    "update": ("update", "open"),
    "update-restricted": ("update", "full"),
}


def config_toml(backend: str) -> str:
    return (
        f'backend = "{backend}"\n'
        f'[limits."frs/open/*"]\nrate = "{OPEN_RATE}"\n'
        f'[limits."frs/full/*"]\nrate = "{FULL_RATE}"\n'
    )


def body(cmd_type: str, biz_id: str, index: int) -> bytes:
    return (
        f"<request><cmd_type>{cmd_type}</cmd_type><key>user-{index % KEYS}</key>"
        f"<biz_id>{biz_id}</biz_id></request>"
    ).encode()


def run_threads(threads: int, seconds: float, work: Callable[[int, int], None]) -> float:
    """Call ``work(thread, i)`` in ``threads`` threads for ``seconds``; requests/s."""
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def loop(thread: int) -> None:
        i = thread
        while time.perf_counter() < stop:
            work(thread, i)
            i += threads
            counts[thread] += 1

    seconds_taken = _common.threaded(threads, loop)
    return sum(counts) / seconds_taken


#: the endpoint is measured protected, as docs/frs.md says to run it
BENCH_TOKEN = "bench-token"
AUTHORIZATION = f"Bearer {BENCH_TOKEN}"


def fill(service: FrequencyService) -> None:
    """Exhaust every key of ``frs/full``."""
    for index in range(KEYS):
        service.update("full", f"user-{index}")


def bench_wsgi(backend: str, threads: int, seconds: float) -> dict[str, float]:
    settings = {
        "backend": backend,
        "limits": {"frs/open/*": {"rate": OPEN_RATE}, "frs/full/*": {"rate": FULL_RATE}},
    }
    service = FrequencyService(GateKeeper(settings), token=BENCH_TOKEN)
    fill(service)

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if not status.startswith("200"):
            raise RuntimeError(f"unexpected answer {status}")

    results = {}
    for name, (cmd_type, biz_id) in OPERATIONS.items():
        bodies = [body(cmd_type, biz_id, index) for index in range(KEYS)]

        def call(thread: int, i: int, bodies: list[bytes] = bodies) -> None:
            data = bodies[i % KEYS]
            environ = {
                "REQUEST_METHOD": "POST",
                "CONTENT_TYPE": "application/xml",
                "CONTENT_LENGTH": str(len(data)),
                "wsgi.input": io.BytesIO(data),
                "HTTP_AUTHORIZATION": AUTHORIZATION,
            }
            b"".join(service(environ, start_response))

        results[name] = run_threads(threads, seconds, call)
    service.gatekeeper.close()
    return results


def bench_http(
    backend: str, threads: int, seconds: float, workers: int, server_threads: int
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gatekeeper.toml"
        config.write_text(config_toml(backend))
        fill(FrequencyService(GateKeeper(str(config)), token=BENCH_TOKEN))
        port = _common.free_port()
        server = subprocess.Popen(
            [
                sys.executable, "-m", "gunicorn",
                "--workers", str(workers),
                "--threads", str(server_threads),
                "--bind", f"127.0.0.1:{port}",
                "--log-level", "warning",
                f'gatekeeper_wsgi.frs:FrequencyService("{config}", token="{BENCH_TOKEN}")',
            ],
            cwd=ROOT,
        )  # fmt: skip
        try:
            _common.wait_for_port(port)
            connections = [http.client.HTTPConnection("127.0.0.1", port) for _ in range(threads)]
            headers = {"Content-Type": "application/xml", "Authorization": AUTHORIZATION}
            results = {}
            for name, (cmd_type, biz_id) in OPERATIONS.items():
                bodies = [body(cmd_type, biz_id, index) for index in range(KEYS)]

                def call(thread: int, i: int, bodies: list[bytes] = bodies) -> None:
                    conn = connections[thread]
                    conn.request("POST", "/", body=bodies[i % KEYS], headers=headers)
                    response = conn.getresponse()
                    response.read()
                    if response.status != 200:
                        raise RuntimeError(f"unexpected answer {response.status}")

                results[name] = run_threads(threads, seconds, call)
            for conn in connections:
                conn.close()
            return results
        finally:
            server.terminate()
            server.wait(timeout=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="shared:///tmp/gatekeeper-frs-bench.shm")
    parser.add_argument("--seconds", type=float, default=3.0, help="per operation")
    parser.add_argument("--threads", type=int, default=4, help="client threads")
    parser.add_argument("--http", action="store_true", help="also measure through gunicorn")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument("--server-threads", type=int, default=4, help="threads per worker")
    args = parser.parse_args()
    if args.http and args.backend.startswith("memory") and args.workers > 1:
        parser.error("the memory backend counts per process: use --workers 1 with it")
    print(f"backend {args.backend}, {args.threads} client threads, {KEYS} keys")
    rows = [("wsgi", bench_wsgi(args.backend, args.threads, args.seconds))]
    if args.http:
        label = f"http ({args.workers}x{args.server_threads} gunicorn)"
        rows.append(
            (
                label,
                bench_http(
                    args.backend, args.threads, args.seconds, args.workers, args.server_threads
                ),
            )
        )
    print(f"{'':28}" + "".join(f"{name:>20}" for name in OPERATIONS))
    for label, results in rows:
        print(f"{label:28}" + "".join(f"{results[name]:>16,.0f} r/s" for name in OPERATIONS))


if __name__ == "__main__":
    main()
