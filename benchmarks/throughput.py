"""Throughput under gunicorn: requests/s and latency of the benchmark apps served by real
worker processes on 127.0.0.1, driven by a load generator on the same machine.

Run ``python benchmarks/throughput.py`` (``--help`` for options). Each app of
:func:`_common.make_app` that makes sense with several workers runs under ``gunicorn
--workers 2 --threads 4`` (gthread) for ``--seconds``: gatekeeper-wsgi on the shared
backend (one table for both workers) and on Redis, the peers on their in-process memory
(which, with 2 workers, counts each limit twice over) and on Redis. The load comes from
``wrk`` when it is installed (``apt-get install wrk``), else from Python threads with
keep-alive ``http.client`` connections, which on a small machine saturate before the
server does: compare rows of one run, not runs with different generators.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import _common

#: (label, framework, way, backend kind: "shared", "redis", "memory" or "")
CASES = [
    ("bare Flask", "flask", "bare", ""),
    ("gatekeeper middleware, shared", "flask", "gatekeeper-middleware", "shared"),
    ("gatekeeper Flask extension, shared", "flask", "gatekeeper-extension", "shared"),
    ("gatekeeper middleware, Redis", "flask", "gatekeeper-middleware", "redis"),
    ("Flask-Limiter, memory (per worker)", "flask", "flask-limiter", "memory"),
    ("Flask-Limiter, Redis", "flask", "flask-limiter", "redis"),
    ("bare Django", "django", "bare", ""),
    ("gatekeeper Django middleware, shared", "django", "gatekeeper", "shared"),
    ("gatekeeper Django middleware, Redis", "django", "gatekeeper", "redis"),
    ("django-ratelimit, local memory (per worker)", "django", "django-ratelimit", "memory"),
    ("django-ratelimit, Redis", "django", "django-ratelimit", "redis"),
]


def backend_url(framework: str, way: str, kind: str, redis_url: str, directory: Path) -> str:
    if kind == "shared":
        return f"shared://{directory}/{framework}-{way}.shm"
    if kind == "redis":
        return redis_url
    if way == "flask-limiter":
        return "memory://"
    return "memory"


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    server.wait(timeout=20)


def _tmpfs() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def serve(spec: str, workers: int, threads: int) -> tuple[subprocess.Popen[bytes], int]:
    port = _common.free_port()
    server = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn",
            "--workers", str(workers),
            "--threads", str(threads),
            "--worker-class", "gthread",
            "--bind", f"127.0.0.1:{port}",
            "--pythonpath", str(Path(__file__).resolve().parent),
            "--log-level", "warning",
            spec,
        ],
        cwd=_common.ROOT,
    )  # fmt: skip
    try:
        _common.wait_for_port(port)
    except BaseException:
        stop(server)
        raise
    return server, port


def warm_up(port: int, requests: int = 50) -> None:
    """A few requests through each worker's imports and connections; each must be a 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(requests):
            conn.request("GET", "/orders", headers={"X-Caller-Id": "crm"})
            response = conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"the app answered {response.status}: {body[:300]!r}")
    finally:
        conn.close()


_WRK_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_WRK_LATENCY = re.compile(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_WRK_ERRORS = re.compile(r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*")
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def load_wrk(port: int, seconds: float, connections: int, threads: int) -> dict[str, float]:
    output = subprocess.run(
        [
            "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency",
            "-H", "X-Caller-Id: crm", f"http://127.0.0.1:{port}/orders",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout  # fmt: skip
    rate = _WRK_RATE.search(output)
    if rate is None:
        raise RuntimeError(f"unexpected wrk output:\n{output}")
    latency = {p: float(v) * _UNIT_MS[unit] for p, v, unit in _WRK_LATENCY.findall(output)}
    errors = _WRK_ERRORS.search(output)
    if errors is not None:
        raise RuntimeError(f"the server refused or failed requests:\n{output}")
    return {"rps": float(rate.group(1)), "p50_ms": latency["50"], "p99_ms": latency["99"]}


def load_python(port: int, seconds: float, connections: int) -> dict[str, float]:
    latencies: list[list[float]] = [[] for _ in range(connections)]
    stop = time.perf_counter() + seconds
    failures: list[int] = []

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        mine = latencies[index]
        while time.perf_counter() < stop:
            started = time.perf_counter()
            conn.request("GET", "/orders", headers={"X-Caller-Id": "crm"})
            response = conn.getresponse()
            response.read()
            mine.append(time.perf_counter() - started)
            if response.status != 200:
                failures.append(response.status)
        conn.close()

    wall = _common.threaded(connections, client)
    if failures:
        raise RuntimeError(f"{len(failures)} requests answered {sorted(set(failures))}")
    every = sorted(value for per in latencies for value in per)
    return {
        "rps": len(every) / wall,
        "p50_ms": every[len(every) // 2] * 1000,
        "p99_ms": every[int(len(every) * 0.99)] * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per app and round")
    parser.add_argument("--rounds", type=int, default=3, help="the median is reported")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="per worker")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--redis-url", help="an existing Redis nobody else uses")
    parser.add_argument("--python-client", action="store_true", help="even if wrk exists")
    parser.add_argument("--only", help="run the cases whose label contains this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    generator = "wrk" if shutil.which("wrk") and not args.python_client else "python"
    cases = [case for case in CASES if args.only is None or args.only in case[0]]
    with ExitStack() as stack:
        redis_url = stack.enter_context(_common.redis_server(args.redis_url))
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=_tmpfs())))
        ports = {}
        for label, framework, way, kind in cases:  # all up at once, idle until their turn
            url = backend_url(framework, way, kind, redis_url, directory)
            cache = redis_url if framework == "django" and kind == "redis" else ""
            spec = f"_common:make_app({framework!r}, {way!r}, {url!r}, {cache!r})"
            server, ports[label] = serve(spec, args.workers, args.threads)
            stack.callback(stop, server)
        for port in ports.values():
            warm_up(port)
        samples: dict[str, list[dict[str, float]]] = {label: [] for label in ports}
        for _ in range(args.rounds):  # interleaved, so noise from elsewhere hits all alike
            for label, port in ports.items():
                if generator == "wrk":
                    sample = load_wrk(port, args.seconds, args.connections, 2)
                else:
                    sample = load_python(port, args.seconds, args.connections)
                samples[label].append(sample)
    results = []
    for label, framework, _way, _kind in cases:
        result = {
            name: statistics.median(sample[name] for sample in samples[label])
            for name in ("rps", "p50_ms", "p99_ms")
        }
        results.append({"label": label, "framework": framework, **result})
        print(
            f"{label:46}{result['rps']:>10,.0f} req/s  p50 {result['p50_ms']:6.2f} ms"
            f"  p99 {result['p99_ms']:6.2f} ms"
        )
    meta = {
        "generator": generator,
        "rounds": args.rounds,
        "workers": args.workers,
        "threads": args.threads,
        "connections": args.connections,
        "seconds": args.seconds,
    }
    print(
        f"gunicorn {args.workers} workers x {args.threads} threads (gthread), "
        f"{generator} with {args.connections} keep-alive connections, medians of "
        f"{args.rounds} rounds of {args.seconds:g} s per app"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
