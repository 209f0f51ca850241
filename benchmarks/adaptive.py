"""Adaptive concurrency (``concurrency = "auto"``) against a backend of fixed capacity, through
a real server, side by side with no limit and with static limits.

Run ``python benchmarks/adaptive.py`` (``--quick`` for a shorter run; ``--help``). The app
behind GateKeeper models a backend of capacity C (``example_site.common.Capacity``): a
request holds one of C slots for a service time S; beyond C concurrent requests they queue
for a slot, so latency grows by queueing (about clients / C times S with no limit). It
runs under gunicorn (gthread, one worker, memory backend) on 127.0.0.1; the load is many
more clients than C, each on a keep-alive connection, each pausing ``PAUSE`` seconds after
a refusal (a client that backs off a little, as a retrying client does). The clients are
coroutines on one asyncio loop, so the load generator's own scheduling stays out of the
latencies; the server records each admitted request's latency too (from the call into
GateKeeper to its ``close()``), and both are reported. Everything is bounded in time.

It prints, and writes to ``benchmarks/RESULTS.md`` (a section of its own):

1. steady state, per way (no limit, static limits around C, auto with each algorithm),
   in interleaved rounds (every way once per round; figures are medians over rounds, so
   one stall of a shared machine does not decide them): goodput (admitted 2xx per
   second), p50/p99 latency of admitted requests as the clients and as the server saw
   them, p99 as a multiple of the unloaded latency, the adaptive limit's spread; auto's
   goodput as a share of the best static limit's;
2. the limit over time while the capacity halves mid-run and comes back, with the time
   until the limit is within 50 % of the new right value (C/2) and back near C;
3. a phase of faulty responses (a share of 5xx, with ``delay`` set): the limit falls, and
   the delayed decreases still hold slots (``delayed_pending`` > 0).

The machine is shared: figures are noisy, and the run says so.
"""

from __future__ import annotations

import argparse
import asyncio
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
            start_response("200 OK", _headers(body, "application/json"))
            return [body]
        with lock:
            state["count"] += 1
            # A deterministic share: of every 100 requests, the first faulty x 100 fail.
            faulty = state["count"] % 100 < state["faulty"] * 100
        if faulty:
            # A failing backend answers fast: latency alone would say "grow".
            start_response("500 Internal Server Error", _headers(b"failed", "text/plain"))
            return [b"failed"]
        capacity.call()
        start_response("200 OK", _headers(b"ok", "text/plain"))
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
    # The server's own record of each admitted /work request: from the call into
    # GateKeeper (admission included) to the close() after its body, as the release
    # sees it. What the clients measure on top of it is the sockets' and their own share.
    served: list[tuple[float, float]] = []

    def timed(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ["PATH_INFO"]
        if path == "/records":
            with lock:
                taken = served[:]
                del served[:]
            body = json.dumps(taken).encode()
            start_response("200 OK", _headers(body, "application/json"))
            return [body]
        if path != "/work":
            return app(environ, start_response)
        started = time.monotonic()
        statuses: list[str] = []

        def starting(status: str, headers: Any, exc_info: Any = None) -> Any:
            statuses.append(status)
            return start_response(status, headers, exc_info)

        return _recorded(app(environ, starting), started, statuses, served, lock)

    return timed


def _headers(body: bytes, kind: str) -> list[tuple[str, str]]:
    # The clients read a body by its length: never chunked.
    return [("Content-Type", kind), ("Content-Length", str(len(body)))]


def _recorded(
    body: Any,
    started: float,
    statuses: list[str],
    served: list[tuple[float, float]],
    lock: threading.Lock,
) -> Iterator[bytes]:
    try:
        yield from body
    finally:
        if hasattr(body, "close"):
            body.close()
        if statuses and statuses[-1].startswith("200"):
            ended = time.monotonic()
            with lock:
                served.append((ended, ended - started))


# --- the load -------------------------------------------------------------------------


@dataclass
class Load:
    """``clients`` keep-alive connections hammering ``/work``, each recording (end time,
    latency, status) of its requests.

    The clients are coroutines on one event loop in a thread of their own, not one OS
    thread each: a hundred Python threads fighting for the GIL in the load generator
    would add their own scheduling delays to the latencies they measure (the server's
    own record, ``/records``, is there to check that they do not).
    """

    port: int
    clients: int
    stop: threading.Event = field(default_factory=threading.Event)
    records: list[tuple[float, float, int]] = field(default_factory=list)

    async def client(self) -> None:
        request = b"GET /work HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        mine = self.records
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                # Every answer of the app under test (and every fault) has a length.
                found = _LENGTH.search(head)
                if found is None:
                    raise ValueError(f"no Content-Length: {head!r}")
                await reader.readexactly(int(found.group(1)))
            except (OSError, asyncio.IncompleteReadError, ValueError):
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                status = 0
            ended = time.monotonic()
            mine.append((ended, ended - started, status))
            if status != 200:
                await asyncio.sleep(PAUSE)
        writer.close()

    async def _all(self) -> None:
        await asyncio.gather(*(self.client() for _ in range(self.clients)))

    @contextmanager
    def running(self) -> Iterator[Load]:
        thread = threading.Thread(target=asyncio.run, args=(self._all(),), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            thread.join(timeout=60)


_LENGTH = re.compile(rb"(?i)\r\ncontent-length:\s*(\d+)")


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
class Round:
    """One measured stretch of one way under full load."""

    seconds: float
    admitted: list[float]  # latencies of admitted (200) requests, as the clients saw them
    served: list[float]  # the same requests' latencies as the server recorded them
    refused: int
    limits: list[int]  # the adaptive limit, polled every 0.25 s (empty for the others)


def measure(limit: str, seconds: float, warmup: float) -> Round:
    """One round: ``warmup`` seconds under full load, then ``seconds`` measured."""
    with server(limit) as port:
        load = Load(port, CLIENTS)
        limits: list[int] = []
        with load.running():
            time.sleep(warmup)
            get(port, "/records")  # the server's record starts now too
            begin = time.monotonic()
            while time.monotonic() - begin < seconds:
                value = current_limit(port)
                if value is not None:
                    limits.append(value)
                time.sleep(0.25)
            end = time.monotonic()
            served = json.loads(get(port, "/records"))
    window = [(latency, status) for ended, latency, status in load.records if begin <= ended < end]
    return Round(
        end - begin,
        [latency for latency, status in window if status == 200],
        [latency for ended, latency in served if begin <= ended < end],
        sum(1 for _, status in window if status != 200),
        limits,
    )


@dataclass
class Steady:
    """A way's rounds, summed up: medians over rounds, so one stall of the shared machine
    in one round does not decide a figure."""

    way: str
    rounds: list[Round]

    def _median(self, figure: Any) -> float:
        return statistics.median(figure(r) for r in self.rounds)

    @property
    def goodput(self) -> float:
        return self._median(lambda r: len(r.admitted) / r.seconds)

    @property
    def refused(self) -> float:
        return self._median(lambda r: r.refused / r.seconds)

    def latency(self, share: float, *, served: bool = False) -> float:
        return self._median(lambda r: percentile(r.served if served else r.admitted, share))

    @property
    def limits(self) -> list[int]:
        return [value for r in self.rounds for value in r.limits]


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
    """Limit before, during (the median of its polls) and after a phase where 30 % of
    responses are 5xx (delay 0.2 s), and the most delayed releases pending at one poll."""
    with server(f"auto:{algorithm}", delay=0.2) as port:
        load = Load(port, CLIENTS)
        with load.running():
            time.sleep(phase)
            before = current_limit(port)
            get(port, "/control?faulty=0.3")
            began = time.monotonic()
            during: list[int] = []
            pending = 0
            while time.monotonic() - began < phase:
                polled = stats(port)
                report = polled["adaptive"].get("bench/work")
                if report is not None:
                    during.append(int(report["limit"]))
                pending = max(pending, int(polled["delayed_pending"]))
                time.sleep(0.25)
            get(port, "/control?faulty=0")
            time.sleep(phase)
            after = current_limit(port)
    median = round(statistics.median(during)) if during else None
    return {"before": before, "during": median, "after": after, "delayed_pending": pending}


# --- the report -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (about 3 minutes)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds per way (5; --quick 2)"
    )
    parser.add_argument(
        "--ways", default=None, help="only these steady-state ways, comma-separated (a partial run)"
    )
    parser.add_argument(
        "--steady-only", action="store_true", help="skip the halving and fault phases"
    )
    args = parser.parse_args(argv)
    seconds, warmup, phase = (4.0, 3.0, 6.0) if args.quick else (6.0, 4.0, 10.0)
    rounds = args.rounds or (2 if args.quick else 5)

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    base = unloaded_latency(2.0)
    load_average = os.getloadavg()[0]
    say(
        f"Backend capacity C = {CAPACITY}, service time {SERVICE * 1000:.0f} ms, "
        f"{CLIENTS} clients (keep-alive connections on one asyncio loop; refused ones pause "
        f"{PAUSE * 1000:.0f} ms), gunicorn gthread, 1 worker, memory backend, Python "
        f"{platform.python_version()}; unloaded latency {base * 1000:.1f} ms. {rounds} "
        f"interleaved rounds per way of {warmup:.0f} s warm-up + {seconds:.0f} s measured; "
        "each figure is the median over the rounds. Shared 2-core machine (load average "
        f"{load_average:.1f} at the start): noisy."
    )
    say()
    ways = ["none", *(f"static:{n}" for n in (CAPACITY // 2, CAPACITY, 2 * CAPACITY))]
    ways += [f"auto:{algorithm}" for algorithm in ALGORITHMS]
    if args.ways:
        ways = args.ways.split(",")
    measured: dict[str, list[Round]] = {way: [] for way in ways}
    # Interleaved (every way once per round), so a slow stretch of the machine hits them
    # all alike instead of one way's whole measurement.
    for _ in range(rounds):
        for way in ways:
            measured[way].append(measure(way, seconds, warmup))
    results = {way: Steady(way, taken) for way, taken in measured.items()}
    say(
        "| way | goodput (2xx/s) | p50 ms | p99 ms | p99 ÷ unloaded | server p50 ms | "
        "server p99 ms | refused/s | limit min / median / max |"
    )
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for way, result in results.items():
        limits = sorted(result.limits)
        spread = f"{limits[0]} / {statistics.median(limits):.0f} / {limits[-1]}" if limits else "—"
        say(
            f"| {way} | {result.goodput:.0f} | {result.latency(0.5) * 1000:.1f} | "
            f"{result.latency(0.99) * 1000:.1f} | {result.latency(0.99) / base:.2f} | "
            f"{result.latency(0.5, served=True) * 1000:.1f} | "
            f"{result.latency(0.99, served=True) * 1000:.1f} | {result.refused:.0f} | {spread} |"
        )
    say()
    say(
        "p50/p99: admitted requests as the clients saw them; server p50/p99: the same "
        "requests from the call into GateKeeper to its close(), as the server recorded "
        "them (the difference is the sockets' and the load generator's share)."
    )
    statics = [results[way] for way in ways if way.startswith("static:")]
    if f"static:{CAPACITY}" in results:
        exact = results[f"static:{CAPACITY}"]
        say(
            f"static:{CAPACITY} never queues at the backend, so its p99 "
            f"({exact.latency(0.99) / base:.2f} x unloaded) is what this machine adds by itself."
        )
    best = max(statics, key=lambda result: result.goodput) if statics else None
    if best is not None:
        say(f"Best static limit by goodput: {best.way} ({best.goodput:.0f}/s).")
    exact_rounds = measured.get(f"static:{CAPACITY}")
    for algorithm in ALGORITHMS:
        result = results.get(f"auto:{algorithm}")
        if result is None:
            continue
        share = (
            ""
            if best is None
            else f"goodput {result.goodput / best.goodput * 100:.0f} % of "
            "the best static (target >= 85 %), "
        )
        paired = ""
        if exact_rounds:
            # Round by round against the limit that never queues, measured right next to
            # it: what the adaptive limit itself adds, whatever the machine did meanwhile.
            ratios = [
                percentile(auto.admitted, 0.99) / percentile(exact.admitted, 0.99)
                for auto, exact in zip(result.rounds, exact_rounds, strict=True)
            ]
            paired = (
                f"; p99 ÷ static:{CAPACITY}'s p99 in the same round: median "
                f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
            )
        say(
            f"- auto:{algorithm}: {share}p99 {result.latency(0.99) / base:.2f} x unloaded "
            f"(target <= 3; as the server saw it "
            f"{result.latency(0.99, served=True) / base:.2f} x){paired}"
        )
    if args.steady_only:
        return 0
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
    say(
        "| algorithm | limit before | limit during (median) | limit after | most "
        "delayed_pending during |"
    )
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
