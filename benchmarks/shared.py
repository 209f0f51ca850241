"""The shared (mmap file) backend's speed against the memory backend and its floor, with
the four targets of issue 18 checked side by side in one run.

Run ``python benchmarks/shared.py`` (``--help``; ``--floor`` prints the floor alone). The
sections, each against its target:

- **floor**: what the primitives an admission is made of cost in CPython here: a file
  lock + unlock pair (``flock`` by the GIL-holding call the backend makes, and by
  ``fcntl.flock``; the OFD ``fcntl`` and ``lockf`` locks for comparison), a ``struct``
  read-modify-write on an mmap, ``os.getpid()``, the
  clock. Their sum over what one admit + release must do is the path's floor.
- **engine**: ``GateKeeper.admit`` + ``release`` in a loop (concurrency limits on all three
  levels plus a per-caller rate limit, none ever hit), memory and shared, 1, 2 and 4
  processes. Memory counts per process; shared counts for the host. Target: host-wide
  admits/s with 2 processes >= 1.5 x one process (shared).
- **overhead**: a Flask app by direct WSGI calls, bare, on memory and on shared (3
  concurrency levels + 1 rate), 1 and 8 threads, interleaved. Targets: shared's cost over
  bare Flask <= 2.5 x memory's with 1 thread; shared with 8 threads <= 1.5 x 1 thread.
  ``--cpu`` times it by CPU time instead (the thread's; with 8 threads the process's): a
  loaded machine stretches wall time by its load, and 1 and 8 threads unequally.
- **throughput**: bare Flask and Flask + gatekeeper on shared under gunicorn driven by
  ``wrk`` (Python threads without it): two gunicorns of one worker x 4 threads, each with
  half of the 16 connections (``throughput.py``'s servers and load), and the workers' CPU
  per request, split: the thread CPU and wall time each request spends inside the app
  (middleware and Flask; the rest of the workers' CPU is gunicorn's), and the file lock
  found held by another process (waits per request, µs each). Target: >= 0.85 of bare.

``--loop N --backend B`` only runs N admit + release on backend B (``memory``,
``shared``) after a warm-up, ``--flask`` N requests to the Flask app (``bare`` or in the
middleware on B), for a count of the work itself, which load does not change: the
instructions of ``--loop 1200`` less those of ``--loop 200`` under ``valgrind
--tool=cachegrind --cache-sim=no``, divided by 1000, are one admit + release (one request).

Figures from a machine other work shares are noisy: quote them with the command and the
load average printed at the start. With ``--check`` the exit status is 1 when a target is
missed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import mmap
import multiprocessing
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import timeit
import urllib.request
from collections.abc import Iterable, Iterator
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import _common
import throughput

from gatekeeper_wsgi import GateKeeper

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 10_000},
        "shop/orders": {"concurrency": 10_000},
        "shop/orders/*": {"concurrency": 10_000, "rate": "1000000000/minute"},
    },
}
SECTIONS = ("floor", "engine", "overhead", "throughput")

#: issue 18's targets
OVERHEAD_RATIO = 2.5  # shared's cost over bare Flask ÷ memory's, 1 thread, at most
THREADS_RATIO = 1.5  # shared's cost over bare Flask, 8 threads ÷ 1 thread, at most
PROCESSES_GAIN = 1.5  # host-wide admits/s, 2 processes ÷ 1, at least
THROUGHPUT_SHARE = 0.85  # requests/s under gunicorn, shared ÷ bare, at least

#: What one admit + release of the benchmark's request must do at least: take and drop the
#: thread and file locks twice (admission, release), and about a dozen read-modify-writes
#: of the table (three counts up and down, a window entry, a lease taken and freed, the
#: header's counters and the journal's length), plus the clock of each side.
FLOOR_LOCK_ROUNDS = 2
FLOOR_RMWS = 12
FLOOR_CLOCKS = 2


def _tmpfs() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


@contextlib.contextmanager
def _scratch_map() -> Iterator[tuple[int, mmap.mmap]]:
    with tempfile.TemporaryDirectory(dir=_tmpfs()) as directory:
        fd = os.open(os.path.join(directory, "floor"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 1 << 16)
            with mmap.mmap(fd, 1 << 16) as mm:
                yield fd, mm
        finally:
            os.close(fd)


def floor(number: int) -> dict[str, float]:
    """ns per operation of the primitives (best of 5 runs of ``number``)."""
    record = struct.Struct("hhxxxxqqixxxx")  # struct flock, for the OFD lock
    lock = record.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    unlock = record.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 1, 0)
    u32 = struct.Struct("<I")
    libc = ctypes.PyDLL(None, use_errno=True)
    lock_buffer = ctypes.create_string_buffer(lock, len(lock))
    unlock_buffer = ctypes.create_string_buffer(unlock, len(unlock))
    thread_lock = threading.Lock()
    with _scratch_map() as (fd, mm):
        cases = {
            "fcntl.fcntl F_OFD_SETLKW + unlock": lambda: (
                fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, lock),
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, unlock),
            ),
            "ctypes.PyDLL fcntl F_OFD_SETLK + unlock (GIL held)": lambda: (
                libc.fcntl(fd, fcntl.F_OFD_SETLK, lock_buffer),
                libc.fcntl(fd, fcntl.F_OFD_SETLK, unlock_buffer),
            ),
            "ctypes.PyDLL flock LOCK_EX|LOCK_NB + LOCK_UN (GIL held)": lambda: (
                libc.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB),
                libc.flock(fd, fcntl.LOCK_UN),
            ),
            "fcntl.flock LOCK_EX + LOCK_UN": lambda: (
                fcntl.flock(fd, fcntl.LOCK_EX),
                fcntl.flock(fd, fcntl.LOCK_UN),
            ),
            "fcntl.lockf LOCK_EX + LOCK_UN": lambda: (
                fcntl.lockf(fd, fcntl.LOCK_EX, 1),
                fcntl.lockf(fd, fcntl.LOCK_UN, 1),
            ),
            "threading.Lock acquire + release": lambda: (
                thread_lock.acquire(),
                thread_lock.release(),
            ),
            "struct unpack_from + pack_into on the mmap": lambda: u32.pack_into(
                mm, 64, u32.unpack_from(mm, 64)[0] + 1
            ),
            "os.getpid()": os.getpid,
            "time.monotonic()": time.monotonic,
            "os.lseek(fd, 0, SEEK_END)": lambda: os.lseek(fd, 0, os.SEEK_END),
            "an empty lambda (the loop's own cost)": lambda: None,
        }
        return {
            name: min(timeit.repeat(case, number=number, repeat=5)) / number * 1e9
            for name, case in cases.items()
        }


def path_floor(costs: dict[str, float]) -> float:
    """µs that one admit + release cannot go below, from the primitives' costs."""
    empty = costs["an empty lambda (the loop's own cost)"]
    locks = min(  # the lock the table takes, by either call
        costs["ctypes.PyDLL flock LOCK_EX|LOCK_NB + LOCK_UN (GIL held)"],
        costs["fcntl.flock LOCK_EX + LOCK_UN"],
    )
    thread = costs["threading.Lock acquire + release"]
    rmw = costs["struct unpack_from + pack_into on the mmap"]
    clock = costs["time.monotonic()"]
    nanoseconds = (
        FLOOR_LOCK_ROUNDS * (locks + thread - 2 * empty)
        + FLOOR_RMWS * (rmw - empty)
        + FLOOR_CLOCKS * (clock - empty)
    )
    return nanoseconds / 1000


# --- engine: admit + release in 1, 2 and 4 processes --------------------------------------


def _worker(backend: str, iterations: int, barrier: Barrier, results: Any) -> None:
    gk = GateKeeper({**SETTINGS, "backend": backend})
    admit = gk.admit
    for _ in range(200):  # warm up: caches, first pages of the file
        admit("shop", "orders", "crm").release(200)
    barrier.wait()
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    started = time.perf_counter()
    for _ in range(iterations):
        admit("shop", "orders", "crm").release(200)
    elapsed = time.perf_counter() - started
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
    results.put((started, started + elapsed, elapsed / iterations * 1e6, switches / iterations))
    gk.close()


def loop(name: str, iterations: int, *, flask: bool = False) -> None:
    """``iterations`` admit + release on a fresh backend (``flask``: requests to the Flask
    app, bare or in the middleware on the backend), after 300 to warm up."""
    with tempfile.TemporaryDirectory(dir=_tmpfs()) as directory:
        backend = "memory" if name == "memory" else f"shared://{directory}/loop.shm"
        if flask:
            app = (
                _common.flask_app()
                if name == "bare"
                else _common.flask_gatekeeper_middleware(backend)
            )
            _common.run(app, 300 + iterations)
            return
        gk = GateKeeper({**SETTINGS, "backend": backend})
        admit = gk.admit
        for _ in range(300 + iterations):
            admit("shop", "orders", "crm").release(200)
        gk.close()


def measure(backend: str, processes: int, iterations: int) -> tuple[float, float, float]:
    """(mean µs per admit + release in one process, host-wide admissions per second,
    voluntary context switches per admit + release: waits for the file lock)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(backend, iterations, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    samples = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
        if worker.exitcode:
            raise RuntimeError(f"worker exited with {worker.exitcode}")
    per_op = statistics.mean(sample[2] for sample in samples)
    wall = max(sample[1] for sample in samples) - min(sample[0] for sample in samples)
    switches = statistics.mean(sample[3] for sample in samples)
    return per_op, processes * iterations / wall, switches


def engine(iterations: int, rounds: int) -> dict[tuple[str, int], tuple[float, float, float]]:
    """(backend, processes) -> medians of :func:`measure`'s figures; the cells take turns
    in every round, so noise from elsewhere hits all alike."""
    cells = [(name, processes) for processes in (1, 2, 4) for name in ("memory", "shared")]
    samples: dict[tuple[str, int], list[tuple[float, float, float]]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory(dir=_tmpfs()) as directory:
        for round_ in range(rounds):
            for name, processes in cells:
                backend = (
                    "memory"
                    if name == "memory"
                    else f"shared://{directory}/engine-{processes}-{round_}.shm"
                )
                samples[name, processes].append(measure(backend, processes, iterations))
    return {
        cell: (
            statistics.median(sample[0] for sample in values),
            statistics.median(sample[1] for sample in values),
            statistics.median(sample[2] for sample in values),
        )
        for cell, values in samples.items()
    }


def lock_share(iterations: int) -> tuple[float, float]:
    """(µs per admit + release, µs of it holding the file lock) in this process: what
    serialises the processes of a host, whose admits/s can grow at most by the ratio."""
    from gatekeeper_wsgi.backends.shared import table as module

    held = [0]
    clock = time.perf_counter_ns
    taken = [0]
    # The table makes filelock's GIL-holding try itself (its C_FLOCK) and falls back on
    # lock_file / unlock_file: all three are wrapped where the table looks them up.
    lock_file, unlock_file, c_flock = module.lock_file, module.unlock_file, module.C_FLOCK

    def timed_lock(fd: int) -> None:
        lock_file(fd)
        taken[0] = clock()

    def timed_unlock(fd: int) -> None:
        held[0] += clock() - taken[0]
        unlock_file(fd)

    def timed_c_flock(fd: int, operation: int) -> int:
        assert c_flock is not None
        if operation == module.LOCK_TRY:
            answer = c_flock(fd, operation)
            if answer == 0:
                taken[0] = clock()
            return answer
        held[0] += clock() - taken[0]
        answer = c_flock(fd, operation)
        if answer:  # unlock_file, called next, tries again: counted once
            taken[0] = clock()
        return answer

    with tempfile.TemporaryDirectory(dir=_tmpfs()) as directory:
        gk = GateKeeper({**SETTINGS, "backend": f"shared://{directory}/hold.shm"})
        admit = gk.admit
        for _ in range(200):
            admit("shop", "orders", "crm").release(200)
        module.lock_file, module.unlock_file = timed_lock, timed_unlock
        if c_flock is not None:
            module.C_FLOCK = timed_c_flock
        try:
            started = clock()
            for _ in range(iterations):
                admit("shop", "orders", "crm").release(200)
            elapsed = clock() - started
        finally:
            module.lock_file, module.unlock_file = lock_file, unlock_file
            module.C_FLOCK = c_flock
            gk.close()
    return elapsed / iterations / 1000, held[0] / iterations / 1000


# --- overhead: a Flask app by direct WSGI calls, 1 and 8 threads --------------------------

BARE = "bare Flask"
WAYS = ("memory", "shared")


def _threads_cpu(app: _common.WSGIApp, n: int, threads: int) -> float:
    """CPU µs of the whole process (every thread, user and system) per request with
    ``threads`` threads sharing ``n`` requests: what the lock and GIL hand-overs cost in
    work, without the waiting that other processes on the machine stretch."""
    share = max(1, n // threads)
    started = time.process_time()
    _common.threaded(threads, lambda _index: _common.run(app, share))
    return (time.process_time() - started) / (share * threads) * 1e6


def _threads_switches(app: _common.WSGIApp, n: int, threads: int) -> float:
    """Voluntary context switches of the process (all its threads, ended ones included)
    per request with ``threads`` threads sharing ``n`` requests: a thread that sleeps on
    a lock or waits for the GIL counts one, which load elsewhere barely changes."""
    share = max(1, n // threads)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    _common.threaded(threads, lambda _index: _common.run(app, share))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before) / (share * threads)


def overhead(rounds: int, requests: int, *, cpu: bool = False) -> dict[str, dict[str, float]]:
    """{"1": {way: µs}, "8": {way: µs}}: medians over interleaved rounds of bare Flask and
    Flask in the gatekeeper middleware (3 concurrency levels + 1 rate) on each backend.
    With ``cpu``, CPU time: the measuring thread's (1 thread), the process's (8 threads)."""
    with tempfile.TemporaryDirectory(dir=_tmpfs(), prefix="gk-bench-") as directory:
        apps: dict[str, _common.WSGIApp] = {BARE: _common.flask_app()}
        apps["memory"] = _common.flask_gatekeeper_middleware("memory")
        apps["shared"] = _common.flask_gatekeeper_middleware(f"shared://{directory}/o.shm")
        for app in apps.values():  # warm up: imports, first pages of the file
            _common.run(app, 300)
        clock = time.thread_time if cpu else time.perf_counter
        threads = _threads_cpu if cpu else _common.run_threads
        return {
            "1": _common.interleaved(
                apps, rounds, lambda app: _common.run(app, requests, clock=clock)
            ),
            "8": _common.interleaved(apps, rounds, lambda app: threads(app, requests, 8)),
            "switches": _common.interleaved(
                apps, rounds, lambda app: _threads_switches(app, requests, 8)
            ),
        }


# --- throughput under gunicorn ------------------------------------------------------------


#: what a gunicorn worker of the throughput section tallied (:func:`tallied_app`)
_TALLY = {"requests": 0.0, "cpu": 0.0, "wall": 0.0, "waits": 0.0, "waited": 0.0}
#: the path at which it answers its tally
TALLY_PATH = "/gatekeeper-bench-tally"


def tallied_app(framework: str, way: str, backend: str = "memory") -> _common.WSGIApp:
    """``_common.make_app(framework, way, backend)`` for gunicorn, in a wrapper that adds
    up in this worker each request's thread CPU and wall time inside the app (call,
    iteration, close) and the waits for a file lock another process held, and answers
    the sums as JSON at :data:`TALLY_PATH`: where a worker's CPU per request goes."""
    from gatekeeper_wsgi.backends.shared import filelock

    app = _common.make_app(framework, way, backend)
    wait = filelock._wait
    tally = _TALLY
    clock, cpu = time.perf_counter, time.thread_time

    def timed_wait(fd: int, yielding: bool) -> None:
        started = clock()
        try:
            wait(fd, yielding)
        finally:
            tally["waits"] += 1
            tally["waited"] += clock() - started

    filelock._wait = timed_wait

    def tallied(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ["PATH_INFO"] == TALLY_PATH:
            start_response("200 OK", [("Content-Type", "application/json")])
            return [json.dumps(tally).encode()]
        started, used = clock(), cpu()
        body = app(environ, start_response)
        try:
            chunks = list(body)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
        tally["cpu"] += cpu() - used
        tally["wall"] += clock() - started
        tally["requests"] += 1
        return chunks

    return tallied


def _tallies(servers: throughput.Servers) -> dict[str, float]:
    """The sums of the tallies of ``servers``' workers (one per gunicorn)."""
    sums = dict.fromkeys(_TALLY, 0.0)
    for port in servers.ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{TALLY_PATH}", timeout=10) as answer:
            for field, value in json.load(answer).items():
                sums[field] += value
    return sums


def _tallied_load(servers: throughput.Servers, generator: str, seconds: float) -> dict[str, float]:
    """One round of :func:`throughput.load` and the in-app split of its requests."""
    before = _tallies(servers)
    sample = throughput.load(servers, generator, seconds, 16)
    after = _tallies(servers)
    spent = {field: after[field] - before[field] for field in after}
    requests = max(1.0, spent["requests"])
    sample["app_cpu_us"] = spent["cpu"] / requests * 1e6
    sample["app_wall_us"] = spent["wall"] / requests * 1e6
    sample["waits"] = spent["waits"] / requests
    sample["wait_us"] = spent["waited"] / max(1.0, spent["waits"]) * 1e6
    return sample


#: the fields :func:`gunicorn_throughput` answers per app
THROUGHPUT_FIELDS = ("rps", "worker_cpu_us", "app_cpu_us", "app_wall_us", "waits", "wait_us")


def gunicorn_throughput(seconds: float, rounds: int) -> dict[str, dict[str, float]]:
    """Per app, bare Flask and Flask + gatekeeper on shared: requests/s, the workers'
    CPU µs per request and its in-app split (:func:`tallied_app`; medians of interleaved
    rounds) under 2 gunicorns of one worker x 4 threads, 16 connections split evenly, by
    ``throughput.py``'s servers and load (one gunicorn of 2 workers left the split to the
    workers' accept race: 16/0 to 11/5)."""
    generator = "wrk" if shutil.which("wrk") else "python"
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=_tmpfs())))
        specs = {
            BARE: "shared:tallied_app('flask', 'bare')",
            "shared": (
                f"shared:tallied_app('flask', 'gatekeeper-middleware', "
                f"'shared://{directory}/gunicorn.shm')"
            ),
        }
        servers: dict[str, throughput.Servers] = {}
        for name, spec in specs.items():
            servers[name] = throughput.Servers(spec, 2, 4)
            stack.callback(servers[name].stop)
        for each in servers.values():
            for port in each.ports:
                throughput.warm_up(port)
        samples = _common.take_turns(
            servers, rounds, lambda each: _tallied_load(each, generator, seconds)
        )
    return {
        name: {
            field: statistics.median(sample[field] for sample in values)
            for field in THROUGHPUT_FIELDS
        }
        for name, values in samples.items()
    }


# --- the report ---------------------------------------------------------------------------


def _target(what: str, value: float, target: float, *, at_least: bool) -> tuple[str, bool]:
    """The summary line of one target, and whether it is met."""
    met = value >= target if at_least else value <= target
    sign = ">=" if at_least else "<="
    return f"{what}: {value:.2f} (target {sign} {target}): {'met' if met else 'MISSED'}", met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", action="store_true", help="the floor section alone")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}"
    )
    parser.add_argument("--iterations", type=int, default=20_000, help="engine: per process")
    parser.add_argument("--rounds", type=int, default=5, help="engine and overhead")
    parser.add_argument("--requests", type=int, default=1000, help="overhead: per round")
    parser.add_argument("--seconds", type=float, default=2.0, help="throughput: per round")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="overhead by CPU time (a loaded machine stretches wall time, not CPU time)",
    )
    parser.add_argument("--loop", type=int, help="only run this many admit + release")
    parser.add_argument("--backend", choices=("memory", "shared", "bare"), default="shared")
    parser.add_argument("--flask", action="store_true", help="--loop: Flask requests")
    args = parser.parse_args(argv)
    if args.loop is not None:
        loop(args.backend, args.loop, flask=args.flask)
        return 0
    sections = {"floor"} if args.floor else set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; expected some of {SECTIONS}")
    load = os.getloadavg()[0]
    print(f"{_common.machine()}; load average {load:.2f} at the start")
    summary: list[tuple[str, bool]] = []  # (line, met)

    if "floor" in sections:
        costs = floor(100_000)
        print("\nfloor: ns per operation, best of 5")
        for name, ns in costs.items():
            print(f"  {name:54}{ns:8.0f}")
        lowest = path_floor(costs)
        print(
            f"  admit + release floor ({FLOOR_LOCK_ROUNDS} lock rounds, {FLOOR_RMWS} "
            f"read-modify-writes, {FLOOR_CLOCKS} clocks):{lowest:7.1f} µs"
        )
    if "engine" in sections:
        cells = engine(args.iterations, args.rounds)
        print(f"\nengine: admit + release, median of {args.rounds} rounds")
        print(
            f"  {'backend':<8} {'procs':>5} {'µs/admit+release':>17} {'host admits/s':>14}"
            f" {'switches/op':>12}"
        )
        for (name, processes), (us, rate, waits) in cells.items():
            print(f"  {name:<8} {processes:>5} {us:>17.1f} {rate:>14,.0f} {waits:>12.3f}")
        total, held = lock_share(args.iterations)
        print(
            f"  shared, 1 process: the file lock is held {held:.1f} µs of {total:.1f} µs per "
            f"admit + release ({held / total:.0%}): processes can add at most "
            f"{total / held:.2f} x one's admits/s"
        )
        one, two = cells["shared", 1], cells["shared", 2]
        summary.append(
            _target(
                "host admits/s, 2 processes ÷ 1 (shared)",
                two[1] / one[1],
                PROCESSES_GAIN,
                at_least=True,
            )
        )
        if "floor" in sections:
            summary.append(
                (
                    f"shared admit + release, 1 process: {one[0]:.1f} µs, "
                    f"{one[0] / lowest:.1f} x its floor of {lowest:.1f} µs",
                    True,
                )
            )
    if "overhead" in sections:
        results = overhead(args.rounds, args.requests, cpu=args.cpu)
        timing = "CPU time" if args.cpu else "wall time"
        print(f"\noverhead: Flask, direct WSGI calls, {timing}, median of {args.rounds} rounds")
        print(f"  {'':24}{'threads':>8}{'µs/request':>12}{'over bare':>11}")
        cost: dict[tuple[str, str], float] = {}
        switches = results.pop("switches")
        for threads, medians in results.items():
            for name, value in medians.items():
                cost[threads, name] = value - medians[BARE]
                label = name if name == BARE else f"gatekeeper on {name}"
                print(f"  {label:24}{threads:>8}{value:12.2f}{cost[threads, name]:11.2f}")
        print(
            "  voluntary context switches per request, 8 threads: "
            + ", ".join(f"{name} {value:.2f}" for name, value in switches.items())
        )
        summary.append(
            _target(
                "cost over bare Flask, shared ÷ memory, 1 thread",
                cost["1", "shared"] / cost["1", "memory"],
                OVERHEAD_RATIO,
                at_least=False,
            )
        )
        summary.append(
            _target(
                "cost over bare Flask on shared, 8 threads ÷ 1",
                cost["8", "shared"] / cost["1", "shared"],
                THREADS_RATIO,
                at_least=False,
            )
        )
    if "throughput" in sections:
        rates = gunicorn_throughput(args.seconds, args.throughput_rounds)
        print(
            f"\nthroughput: 2 gunicorns x 1 worker x 4 threads, 16 connections split "
            f"evenly, median of {args.throughput_rounds} rounds of {args.seconds:g} s"
        )
        for name, row in rates.items():
            label = name if name == BARE else f"gatekeeper on {name}"
            print(
                f"  {label:24}{row['rps']:>10,.0f} req/s"
                f"{row['worker_cpu_us']:>8,.0f} µs CPU/request (workers)"
            )
        print("  inside the app (middleware + Flask), per request:")
        for name, row in rates.items():
            label = name if name == BARE else f"gatekeeper on {name}"
            print(
                f"  {label:24}{row['app_cpu_us']:>8,.1f} µs thread CPU{row['app_wall_us']:>8,.1f}"
                f" µs wall; file lock found held {row['waits']:.3f} times, {row['wait_us']:,.0f}"
                f" µs each"
            )
        summary.append(
            _target(
                "gunicorn requests/s, Flask on shared ÷ bare",
                rates["shared"]["rps"] / rates[BARE]["rps"],
                THROUGHPUT_SHARE,
                at_least=True,
            )
        )
    if summary:
        print("\ntargets (issue 18):")
        cores = os.cpu_count() or 1
        if load > cores:
            # One thread gets a slice of a core, eight threads more slices: wall times
            # stretch unequally, and "8 threads ÷ 1" comes out too low.
            print(
                f"  (load average {load:.1f} on {cores} cores: wall-time figures are stretched "
                f"by other work, unequally; judge nothing by this run)"
            )
        for line, _ in summary:
            print(f"  {line}")
    missed = not all(met for _, met in summary)
    return 1 if missed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
