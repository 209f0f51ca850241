"""Throughput under gunicorn: requests/s and latency of the benchmark apps served by real
worker processes on 127.0.0.1, driven by a load generator on the same machine.

Run ``python benchmarks/throughput.py`` (``--help`` for options). Each app of
:func:`_common.make_app` that makes sense with several workers runs in ``--workers``
gthread worker processes of ``--threads`` threads for ``--seconds``: gatekeeper-wsgi on the
shared backend (one table for all workers) and on Redis, the peers on their in-process
memory (which, with 2 workers, counts each limit twice over) and on Redis. The load comes
from ``wrk`` when it is installed (``apt-get install wrk``), else from Python threads with
keep-alive ``http.client`` connections, which on a small machine saturate before the
server does: compare rows of one run, not runs with different generators.

Each worker is a gunicorn of its own (``--workers 1``) on its own port with its own share
of the connections (one ``wrk`` per worker, run together). One gunicorn with ``--workers
2`` would leave it to the workers' accept race which worker holds which keep-alive
connection: runs saw 16/0, 15/1 and 11/5 splits of 16 connections, so one case was served
by one process (one GIL, one core) and the next by two, whatever the app. The split is now
even, the same for every case.

Besides requests/s, each case's CPU per request: its worker processes' (user + system, from
``/proc``) and the Redis server's (``INFO cpu``), with Redis commands per request (``INFO
commandstats``). Those count the work itself, which a machine shared with other jobs
inflates far less than it inflates wall-time rates. Then the machine's idle CPU per request
during the case (``/proc/stat``): on a quiet machine, a case that is behind by requests/s
while ahead by CPU per request leaves that much unused, its requests waiting rather than
computing (another job's load fills it, so it reads 0 on a busy machine). With ``--only
Redis`` the run ends by saying whether gatekeeper-wsgi is ahead of each peer on the same
Redis, by both measures.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

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


def backend_url(
    framework: str, way: str, kind: str, redis_url: str, directory: Path, options: str = ""
) -> str:
    """The backend of a case; ``options``, a URL query, go to gatekeeper-wsgi's Redis."""
    if kind == "shared":
        return f"shared://{directory}/{framework}-{way}.shm"
    if kind == "redis":
        if options and way.startswith("gatekeeper"):
            return f"{redis_url}?{options}"
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


class Servers:
    """``workers`` gunicorns of one gthread worker of ``threads`` threads each, serving
    ``spec`` on a port of its own (see the module docstring for why not one gunicorn)."""

    def __init__(self, spec: str, workers: int, threads: int) -> None:
        self.servers: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        try:
            for _ in range(workers):
                server, port = serve(spec, 1, threads)
                self.servers.append(server)
                self.ports.append(port)
        except BaseException:
            self.stop()
            raise

    def cpu_seconds(self) -> float:
        """User + system CPU seconds their worker processes used so far (from /proc)."""
        masters = {server.pid for server in self.servers}
        ticks = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # After the command name: state, ppid, ... utime (the 12th), stime.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[1]) in masters:
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for server in self.servers:
            stop(server)


def redis_counters(url: str) -> tuple[float, int]:
    """The Redis server's CPU seconds (user + system) and the commands it ran so far
    (these INFO calls left out)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        info = client.info("all")
    finally:
        client.close()
    commands = sum(
        stats["calls"]
        for name, stats in info.items()
        if name.startswith("cmdstat_") and name not in ("cmdstat_info", "cmdstat_hello")
    )
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"]), commands


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
_WRK_COUNT = re.compile(r"(\d+) requests in ")
_WRK_LATENCY = re.compile(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", re.MULTILINE)
_WRK_ERRORS = re.compile(r"Non-2xx or 3xx responses: (\d+)|Socket errors: .*")
_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def load_wrk(
    port: int | list[int], seconds: float, connections: int, threads: int
) -> dict[str, float]:
    """wrk on ``port`` with ``connections`` and ``threads``; on a list of ports, one wrk
    per port, run together, each with its share of both: requests/s and requests summed,
    p50 the requests-weighted mean of theirs, p99 the worst."""
    ports = [port] if isinstance(port, int) else port
    options = [
        f"-t{max(1, threads // len(ports))}", f"-c{max(1, connections // len(ports))}",
        f"-d{seconds:g}s", "--latency", "-H", "X-Caller-Id: crm",
    ]  # fmt: skip
    runs = [
        subprocess.Popen(
            ["wrk", *options, f"http://127.0.0.1:{each}/orders"], stdout=subprocess.PIPE, text=True
        )
        for each in ports
    ]
    samples = []
    for run in runs:
        output, _ = run.communicate(timeout=seconds + 30)
        rate, count = _WRK_RATE.search(output), _WRK_COUNT.search(output)
        if run.returncode or rate is None or count is None:
            raise RuntimeError(f"unexpected wrk output:\n{output}")
        if _WRK_ERRORS.search(output) is not None:
            raise RuntimeError(f"the server refused or failed requests:\n{output}")
        latency = {p: float(v) * _UNIT_MS[unit] for p, v, unit in _WRK_LATENCY.findall(output)}
        samples.append((float(rate.group(1)), int(count.group(1)), latency))
    requests = sum(count for _, count, _ in samples)
    return {
        "rps": sum(rate for rate, _, _ in samples),
        "requests": float(requests),
        "p50_ms": sum(count * latency["50"] for _, count, latency in samples) / max(1, requests),
        "p99_ms": max(latency["99"] for _, _, latency in samples),
    }


def load_python(port: int | list[int], seconds: float, connections: int) -> dict[str, float]:
    """``connections`` keep-alive clients in Python threads, spread over the ports."""
    ports = [port] if isinstance(port, int) else port
    latencies: list[list[float]] = [[] for _ in range(connections)]
    stop = time.perf_counter() + seconds
    failures: list[int] = []

    def client(index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", ports[index % len(ports)], timeout=10)
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
        "requests": float(len(every)),
        "p50_ms": every[len(every) // 2] * 1000,
        "p99_ms": every[int(len(every) * 0.99)] * 1000,
    }


def idle_seconds() -> float:
    """CPU seconds the whole machine spent idle so far, every core summed (``/proc/stat``:
    idle + iowait); 0 where there is no such file."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return 0.0
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def load(servers: Servers, generator: str, seconds: float, connections: int) -> dict[str, float]:
    """One round of load on ``servers`` (``generator``: "wrk" or "python"), each worker
    with its share of ``connections``, its workers' CPU µs per request, and the machine's
    idle CPU µs per request meanwhile: on a quiet machine, what a case leaves unused while
    its requests wait (on Redis, on a lock, on each other) rather than compute; another
    job's load fills it, so it is 0 on a busy machine."""
    before = servers.cpu_seconds()
    idle_before = idle_seconds()
    if generator == "wrk":
        sample = load_wrk(servers.ports, seconds, connections, 2)
    else:
        sample = load_python(servers.ports, seconds, connections)
    requests = max(1.0, sample["requests"])
    sample["worker_cpu_us"] = (servers.cpu_seconds() - before) / requests * 1e6
    sample["idle_cpu_us"] = (idle_seconds() - idle_before) / requests * 1e6
    return sample


def measure(
    servers: Servers, redis_url: str, generator: str, args: argparse.Namespace
) -> dict[str, float]:
    """One round of load on ``servers``, with the CPU it cost per request: the workers',
    and the Redis server's (the other apps sit idle meanwhile), and Redis commands."""
    redis_before = redis_counters(redis_url)
    sample = load(servers, generator, args.seconds, args.connections)
    redis_after = redis_counters(redis_url)
    requests = max(1.0, sample["requests"])
    sample["redis_cpu_us"] = (redis_after[0] - redis_before[0]) / requests * 1e6
    sample["redis_commands"] = (redis_after[1] - redis_before[1]) / requests
    return sample


#: (ours, the peer's) rows compared at the end of a run that has both
VERSUS = [
    ("gatekeeper middleware, Redis", "Flask-Limiter, Redis"),
    ("gatekeeper Django middleware, Redis", "django-ratelimit, Redis"),
]


def verdicts(results: list[dict[str, Any]]) -> list[str]:
    """For each pair of :data:`VERSUS` in ``results``: whether ours serves at least the
    peer's requests/s, and whether it costs at most the peer's CPU per request (workers +
    Redis: the figure a shared machine distorts least)."""
    rows = {row["label"]: row for row in results}
    lines = []
    for ours, peer in VERSUS:
        if ours not in rows or peer not in rows:
            continue
        mine, theirs = rows[ours], rows[peer]
        cpu = mine["worker_cpu_us"] + mine["redis_cpu_us"]
        peer_cpu = theirs["worker_cpu_us"] + theirs["redis_cpu_us"]
        lines.append(
            f"{ours} vs {peer}: {mine['rps'] / theirs['rps']:.2f}x the requests/s "
            f"({'ahead' if mine['rps'] >= theirs['rps'] else 'BEHIND'}: "
            f"{mine['rps']:,.0f} vs {theirs['rps']:,.0f}); "
            f"{cpu / peer_cpu:.2f}x the CPU per request "
            f"({'ahead' if cpu <= peer_cpu else 'BEHIND'}: {cpu:,.0f} vs {peer_cpu:,.0f} µs)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per app and round")
    parser.add_argument("--rounds", type=int, default=3, help="the median is reported")
    parser.add_argument("--workers", type=int, default=2, help="gunicorns of one worker each")
    parser.add_argument("--threads", type=int, default=4, help="per worker")
    parser.add_argument("--connections", type=int, default=16, help="shared by the workers")
    parser.add_argument("--redis-url", help="an existing Redis nobody else uses")
    parser.add_argument("--python-client", action="store_true", help="even if wrk exists")
    parser.add_argument("--only", help="run the cases whose label contains this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--redis-options", default="", help="a query for gatekeeper-wsgi's Redis URL, e.g. "
        "flush_interval=0.005 (the peers' Redis is left as it is)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    generator = "wrk" if shutil.which("wrk") and not args.python_client else "python"
    cases = [case for case in CASES if args.only is None or args.only in case[0]]
    load_before = os.getloadavg()[0]
    with ExitStack() as stack:
        redis_url = stack.enter_context(_common.redis_server(args.redis_url))
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=_tmpfs())))
        servers: dict[str, Servers] = {}
        for label, framework, way, kind in cases:  # all up at once, idle until their turn
            url = backend_url(framework, way, kind, redis_url, directory, args.redis_options)
            cache = redis_url if framework == "django" and kind == "redis" else ""
            spec = f"_common:make_app({framework!r}, {way!r}, {url!r}, {cache!r})"
            servers[label] = Servers(spec, args.workers, args.threads)
            stack.callback(servers[label].stop)
        for each in servers.values():
            for port in each.ports:
                warm_up(port)
        samples: dict[str, list[dict[str, float]]] = {label: [] for label in servers}
        for _ in range(args.rounds):  # interleaved, so noise from elsewhere hits all alike
            for label, each in servers.items():
                samples[label].append(measure(each, redis_url, generator, args))
    load_after = os.getloadavg()[0]
    results = []
    for label, framework, _way, _kind in cases:
        result = {
            name: statistics.median(sample[name] for sample in samples[label])
            for name in ("rps", "p50_ms", "p99_ms", "worker_cpu_us", "redis_cpu_us", "idle_cpu_us")
        }
        result["redis_commands"] = statistics.median(
            sample["redis_commands"] for sample in samples[label]
        )
        results.append({"label": label, "framework": framework, **result})
        print(
            f"{label:46}{result['rps']:>8,.0f} req/s  p50 {result['p50_ms']:6.2f} ms"
            f"  p99 {result['p99_ms']:6.2f} ms  CPU/request: workers "
            f"{result['worker_cpu_us']:5,.0f} µs, Redis {result['redis_cpu_us']:4,.0f} µs "
            f"({result['redis_commands']:5.2f} commands); idle {result['idle_cpu_us']:4,.0f} µs"
        )
    meta = {
        "generator": generator,
        "rounds": args.rounds,
        "workers": args.workers,
        "threads": args.threads,
        "connections": args.connections,
        "seconds": args.seconds,
        "load_average": [load_before, load_after],
        "redis_options": args.redis_options,
    }
    print(
        f"{args.workers} gunicorns x 1 worker x {args.threads} threads (gthread), "
        f"{generator} with {args.connections} keep-alive connections split evenly, medians "
        f"of {args.rounds} rounds of {args.seconds:g} s per app; load average "
        f"{load_before:.2f} at the start, {load_after:.2f} at the end on "
        f"{os.cpu_count()} cores"
    )
    for line in verdicts(results):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
