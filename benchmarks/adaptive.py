"""Adaptive concurrency (``concurrency = "auto"``) against a backend of fixed capacity, through
a real server, side by side with no limit and with static limits.

Run ``python benchmarks/adaptive.py`` (``--quick`` for a shorter run; ``--help``). The app
behind GateKeeper models a backend of capacity C (``example_site.common.Capacity``): a
request holds one of C slots for a service time S; beyond C concurrent requests they queue
for a slot, so latency grows by queueing (about clients / C times S with no limit). It
runs under gunicorn (gthread, one worker, memory backend) on 127.0.0.1; the load is many
more client threads than C, each on a keep-alive connection, each pausing ``PAUSE``
seconds after a refusal (a client that backs off a little, as a retrying client does).
Everything is bounded in time.

It prints, and writes to ``benchmarks/RESULTS.md`` (a section of its own):

1. steady state, per way (no limit, static limits around C, auto with each algorithm):
   goodput (admitted 2xx per second), p50/p99 latency of admitted requests and p99 as a
   multiple of the unloaded latency; auto's goodput as a share of the best static limit's;
2. the limit over time while the capacity halves mid-run and comes back, with the time
   until the limit is within 50 % of the new right value (C/2) and back near C;
3. a phase of faulty responses (a share of 5xx, with ``delay`` set): the limit falls, and
   the delayed decreases still hold slots (``delayed_pending`` > 0).

The machine is shared: figures are noisy, and the run says so.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
SECTION = "## Adaptive concurrency (benchmarks/adaptive.py)"

CAPACITY = 20  # C: slots of the modelled backend
SERVICE = 0.050  # S: seconds a request holds its slot
CLIENTS = 100  # many more than C
PAUSE = 0.050  # seconds a refused client waits before its next request
ALGORITHMS = ("gradient", "vegas", "aimd")

# --- the app under test (runs inside gunicorn) ------------------------------------------


def make_app() -> Any:
    """The WSGI app gunicorn serves: ``/work`` behind GateKeeper (the limit chosen by the
    ``GK_BENCH_LIMIT`` environment variable: ``none``, ``static:N`` or ``auto:ALGORITHM``),
    ``/control?capacity=N&faulty=P`` and ``/stats`` outside any limit."""
    from example_site.common import Capacity
    from gatekeeper_wsgi import GateKeeperMiddleware

    capacity = Capacity(CAPACITY, SERVICE)
    state = {"faulty": 0.0, "count": 0}
    lock = threading.Lock()

    def backend(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ["PATH_INFO"]
        if path == "/control":
            query = dict(
                part.split("=", 1) for part in environ.get("QUERY_STRING", "").split("&") if part
            )
            if "capacity" in query:
                capacity.resize(int(query["capacity"]))
            if "faulty" in query:
                state["faulty"] = float(query["faulty"])
            start_response("204 No Content", [])
            return []
        if path == "/stats":
            stats = app.gatekeeper.stats()
            body = json.dumps(
                {
                    "adaptive": stats["adaptive"],
                    "inflight": app.gatekeeper.inflight(),
                    "delayed_pending": stats["counters"]["delayed_pending"],
                }
            ).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        with lock:
            state["count"] += 1
            # A deterministic share: of every 100 requests, the first faulty x 100 fail.
            faulty = state["count"] % 100 < state["faulty"] * 100
        if faulty:
            # A failing backend answers fast: latency alone would say "grow".
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [b"failed"]
        capacity.call()
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    mode = os.environ.get("GK_BENCH_LIMIT", "none")
    limits: dict[str, Any] = {}
    if mode.startswith("static:"):
        limits["bench/work"] = {"concurrency": int(mode.split(":")[1])}
    elif mode.startswith("auto:"):
        limits["bench/work"] = {
            "concurrency": "auto",
            "adaptive": {"algorithm": mode.split(":")[1], "max": 1000},
        }
    if "bench/work" in limits and os.environ.get("GK_BENCH_DELAY"):
        limits["bench/work"]["delay"] = float(os.environ["GK_BENCH_DELAY"])
    app = GateKeeperMiddleware(backend, {"project": "bench", "limits": limits})
    return app


# --- the load -------------------------------------------------------------------------


@dataclass
class Load:
    """Client threads hammering ``/work``; they record (end time, latency, status)."""

    port: int
    clients: int
    stop: threading.Event = field(default_factory=threading.Event)
    records: list[tuple[float, float, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        mine: list[tuple[float, float, int]] = []
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("GET", "/work")
                response = connection.getresponse()
                response.read()
                status = response.status
            except (OSError, http.client.HTTPException):
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                status = 0
            ended = time.perf_counter()
            mine.append((ended, ended - started, status))
            if status != 200:
                self.stop.wait(PAUSE)
        connection.close()
        with self.lock:
            self.records.extend(mine)

    @contextmanager
    def running(self) -> Iterator[Load]:
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(timeout=60)


@contextmanager
def server(limit: str, *, delay: float | None = None) -> Iterator[int]:
    """gunicorn (gthread, 1 worker) serving the app under ``limit``; yields its port."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    env = {
        **os.environ,
        "GK_BENCH_LIMIT": limit,
        "PYTHONPATH": os.pathsep.join(
            [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    if delay is not None:
        env["GK_BENCH_DELAY"] = str(delay)
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
            str(CLIENTS + 28),
            "--bind",
            f"127.0.0.1:{port}",
            "--backlog",
            "512",
            "--log-level",
            "warning",
            "--keep-alive",
            "30",
            "adaptive:make_app()",
        ],
        env=env,
        cwd=HERE,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                get(port, "/stats")
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"gunicorn did not start for {limit}") from None
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def get(port: int, path: str) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        return connection.getresponse().read()
    finally:
        connection.close()


def stats(port: int) -> dict[str, Any]:
    return json.loads(get(port, "/stats"))  # type: ignore[no-any-return]


def current_limit(port: int) -> int | None:
    report = stats(port)["adaptive"].get("bench/work")
    return None if report is None else int(report["limit"])


# --- the measurements -----------------------------------------------------------------


def unloaded_latency(seconds: float) -> float:
    """Median latency of one client alone, through the same server (no limit)."""
    with server("none") as port:
        load = Load(port, 1)
        with load.running():
            time.sleep(seconds)
    return statistics.median(latency for _, latency, status in load.records if status == 200)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else float("nan")


@dataclass
class Steady:
    way: str
    goodput: float
    p50: float
    p99: float
    refused: float
    limit: int | None


def steady(limit: str, seconds: float, warmup: float) -> Steady:
    """Goodput and admitted latencies after ``warmup`` seconds under full load."""
    with server(limit) as port:
        load = Load(port, CLIENTS)
        with load.running():
            time.sleep(warmup)
            begin = time.perf_counter()
            time.sleep(seconds)
            end = time.perf_counter()
            final = current_limit(port)
    window = [(latency, status) for ended, latency, status in load.records if begin <= ended < end]
    admitted = [latency for latency, status in window if status == 200]
    refused = sum(1 for _, status in window if status != 200)
    return Steady(
        limit,
        len(admitted) / (end - begin),
        percentile(admitted, 0.50),
        percentile(admitted, 0.99),
        refused / (end - begin),
        final,
    )


def halving(algorithm: str, phase: float) -> list[tuple[float, int | None, int]]:
    """(seconds since start, limit, capacity) every 0.25 s: C for ``phase`` seconds, C/2
    for ``phase``, C again for ``phase``."""
    timeline: list[tuple[float, int | None, int]] = []
    with server(f"auto:{algorithm}") as port:
        load = Load(port, CLIENTS)
        with load.running():
            started = time.monotonic()
            for capacity, until in (
                (CAPACITY, phase),
                (CAPACITY // 2, 2 * phase),
                (CAPACITY, 3 * phase),
            ):
                get(port, f"/control?capacity={capacity}")
                while (now := time.monotonic() - started) < until:
                    timeline.append((round(now, 2), current_limit(port), capacity))
                    time.sleep(0.25)
    return timeline


def at(timeline: list[tuple[float, int | None, int]], moment: float) -> str:
    """The last limit polled at or before ``moment``, as text."""
    values = [limit for polled, limit, _ in timeline if polled <= moment]
    return "" if not values or values[-1] is None else str(values[-1])


def settle_time(
    timeline: list[tuple[float, int | None, int]], since: float, low: float, high: float
) -> float | None:
    """Seconds after ``since`` until the limit is first within [low, high]."""
    for moment, limit, _ in timeline:
        if moment >= since and limit is not None and low <= limit <= high:
            return round(moment - since, 2)
    return None


def faults(algorithm: str, phase: float) -> dict[str, Any]:
    """Limit before, during and after a phase where 30 % of responses are 5xx (delay 0.2 s)."""
    with server(f"auto:{algorithm}", delay=0.2) as port:
        load = Load(port, CLIENTS)
        with load.running():
            time.sleep(phase)
            before = current_limit(port)
            get(port, "/control?faulty=0.3")
            time.sleep(phase / 2)
            pending = stats(port)["delayed_pending"]
            time.sleep(phase / 2)
            during = current_limit(port)
            get(port, "/control?faulty=0")
            time.sleep(phase)
            after = current_limit(port)
    return {"before": before, "during": during, "after": after, "delayed_pending": pending}


# --- the report -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (about 2 minutes)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    seconds, warmup, phase = (5.0, 3.0, 6.0) if args.quick else (10.0, 5.0, 10.0)

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    base = unloaded_latency(2.0)
    say(
        f"Backend capacity C = {CAPACITY}, service time {SERVICE * 1000:.0f} ms, "
        f"{CLIENTS} clients (refused ones pause {PAUSE * 1000:.0f} ms), gunicorn gthread, "
        f"1 worker, memory backend, Python {platform.python_version()}; "
        f"unloaded latency {base * 1000:.1f} ms. Shared, loaded 2-core machine: noisy."
    )
    say()
    say("| way | goodput (2xx/s) | p50 ms | p99 ms | p99 ÷ unloaded | refused/s | final limit |")
    say("|---|---:|---:|---:|---:|---:|---:|")
    ways = ["none", *(f"static:{n}" for n in (CAPACITY // 2, CAPACITY, 2 * CAPACITY))]
    ways += [f"auto:{algorithm}" for algorithm in ALGORITHMS]
    results: dict[str, Steady] = {}
    for way in ways:
        result = results[way] = steady(way, seconds, warmup)
        say(
            f"| {way} | {result.goodput:.0f} | {result.p50 * 1000:.1f} | "
            f"{result.p99 * 1000:.1f} | {result.p99 / base:.2f} | {result.refused:.0f} | "
            f"{'—' if result.limit is None else result.limit} |"
        )
    statics = [results[way] for way in ways if way.startswith("static:")]
    best = max(statics, key=lambda result: result.goodput)
    exact = results[f"static:{CAPACITY}"]
    say()
    say(
        f"static:{CAPACITY} never queues at the backend, so its p99 "
        f"({exact.p99 / base:.2f} x unloaded) is what this machine adds by itself."
    )
    say(f"Best static limit by goodput: {best.way} ({best.goodput:.0f}/s).")
    for algorithm in ALGORITHMS:
        result = results[f"auto:{algorithm}"]
        say(
            f"- auto:{algorithm}: goodput {result.goodput / best.goodput * 100:.0f} % of the "
            f"best static (target >= 85 %), p99 {result.p99 / base:.2f} x unloaded "
            "(target <= 3)"
        )
    say()
    say(
        f"Capacity halving: C = {CAPACITY} for {phase:.0f} s, {CAPACITY // 2} for {phase:.0f} s, "
        f"{CAPACITY} again; the limit every 0.25 s (shown every 1 s)."
    )
    say()
    timelines = {algorithm: halving(algorithm, phase) for algorithm in ALGORITHMS}
    say("| t (s) | capacity | " + " | ".join(ALGORITHMS) + " |")
    say("|---:|---:|" + "---:|" * len(ALGORITHMS))
    for second in range(int(3 * phase)):
        # Each run polled on its own schedule: show each one's last value before the mark.
        row = [at(timelines[a], second + 0.9) for a in ALGORITHMS]
        capacity = CAPACITY if not phase <= second + 0.9 < 2 * phase else CAPACITY // 2
        say(f"| {second + 0.9:.1f} | {capacity} | " + " | ".join(row) + " |")
    say()
    half = CAPACITY / 2
    for algorithm in ALGORITHMS:
        down = settle_time(timelines[algorithm], phase, 0.5 * half, 1.5 * half)
        up = settle_time(timelines[algorithm], 2 * phase, 0.9 * CAPACITY, 2 * CAPACITY)
        say(
            f"- auto:{algorithm}: within 50 % of C/2 = {half:.0f} after "
            f"{'never' if down is None else f'{down} s'} (target <= 5 s); back to >= 0.9 C "
            f"after {'never' if up is None else f'{up} s'}"
        )
    say()
    say("Faulty responses: 30 % of responses are 500s (answered at once), `delay` 0.2 s.")
    say()
    say("| algorithm | limit before | limit during | limit after | delayed_pending during |")
    say("|---|---:|---:|---:|---:|")
    for algorithm in ALGORITHMS:
        outcome = faults(algorithm, phase)
        say(
            f"| {algorithm} | {outcome['before']} | {outcome['during']} | {outcome['after']} | "
            f"{outcome['delayed_pending']} |"
        )
    if not args.no_write:
        write_section(lines, " ".join(["python benchmarks/adaptive.py", *(argv or sys.argv[1:])]))
    return 0


def write_section(lines: list[str], command: str) -> None:
    """Replace (or append) this benchmark's section of RESULTS.md."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    body = "\n".join([SECTION, "", f"`{command.strip()}`", "", *lines, ""])
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
