"""Run every benchmark and write ``benchmarks/RESULTS.md``.

Run ``python benchmarks/run_all.py`` (about 2 minutes on 2 cores, a few more with
valgrind). It starts one private ``redis-server`` on a free loopback port when the binary
exists (Redis cells are skipped otherwise), then runs, each in its own process:

1. ``overhead.py`` for Flask and Django on the memory, shared and Redis backends: µs per
   request by direct WSGI calls, 1 and 8 threads, against the bare app and the peer;
2. ``throughput.py``: requests/s under gunicorn with ``wrk`` (or Python threads);
3. ``engine.py``, ``shared.py``, ``redis_backend.py``, ``queue_handoff.py``, ``frs.py``,
   ``limit_lookup.py``, ``memory_keys.py``, ``status_cost.py``, ``cold_cache.py`` and (when
   ``valgrind`` is installed, a few minutes more) ``instructions.py`` with shortened runs,
   their reports quoted as printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import _common

HERE = Path(__file__).resolve().parent
GROUPS = [
    (framework, backend)
    for framework in ("flask", "django")
    for backend in ("memory", "shared", "redis")
]
BARE = {"flask": "bare Flask", "django": "bare Django"}
PEER = {"flask": "Flask-Limiter (1 rate)", "django": "django-ratelimit (1 rate)"}
REPORTS = [
    ("Engine: admit + release, reload", "engine.py", ["--operations", "50000", "--rounds", "3"]),
    (
        "Shared backend: floor, engine, overhead and gunicorn against issue 18's targets",
        "shared.py",
        ["--iterations", "5000", "--rounds", "3"],
    ),
    ("Redis round trips per request", "redis_backend.py", ["--rounds", "5", "--requests", "300"]),
    ("Queue hand-off between processes (shared)", "queue_handoff.py", ["--rounds", "20"]),
    ("FRS endpoint", "frs.py", ["--seconds", "1", "--http"]),
    ("Never-seen path, 1 000 and 100 000 limits", "limit_lookup.py", ["--rounds", "3"]),
    ("Memory per key, 100 000 keys of a 5/minute wildcard limit", "memory_keys.py", []),
    (
        "Status JSON and Prometheus scrape, 100 000 keys and 200 limits",
        "status_cost.py",
        ["--rounds", "5", "--seconds", "1"],
    ),
    ("Instructions per request (callgrind)", "instructions.py", ["--requests", "500"]),
    ("The middleware's cost with cold caches", "cold_cache.py", ["--rounds", "11"]),
]


def script(name: str, *args: str) -> str:
    """Run a benchmark script; its stdout (stderr goes to ours)."""
    started = time.monotonic()
    print(f"-- {name} {' '.join(args)}", file=sys.stderr, flush=True)
    output = subprocess.run(
        [sys.executable, str(HERE / name), *args],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        cwd=_common.ROOT,
        timeout=600,
    ).stdout
    print(f"   {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return output


def versions() -> str:
    names = ["Django", "Flask", "Werkzeug", "Flask-Limiter", "django-ratelimit", "gunicorn"]
    parts = []
    for name in names:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    for binary in ("redis-server", "wrk"):
        path = shutil.which(binary)
        if path is not None:
            flag = "--version" if binary == "redis-server" else "-v"
            answer = subprocess.run([path, flag], capture_output=True, text=True)
            found = re.search(r"(\d+\.\d+(?:\.\d+)?)", answer.stdout + answer.stderr)
            parts.append(f"{binary} {found.group(1) if found else '(version unknown)'}")
    return ", ".join(parts)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}" if base > 0 else "—"


def overhead_table(groups: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| app | way (limits) | backend | 1 thread µs | x bare | cost µs | cost ÷ peer's "
        "| 8 threads µs | x bare | cost µs | cost ÷ peer's |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for group in groups:
        framework, backend = group["framework"], group["backend"]
        cells: dict[str, list[str]] = {}
        for threads in ("1", "8"):
            medians = group["results"][threads]
            base = medians[BARE[framework]]
            peer = medians.get(PEER[framework])
            peer_cost = peer - base if peer is not None else None
            for name, value in medians.items():
                cost = value - base
                versus = (
                    "—"
                    if peer_cost is None or name == BARE[framework]
                    else f"{cost / peer_cost:.2f}"
                )
                cells.setdefault(name, []).extend(
                    [f"{value:.1f}", _ratio(value, base), f"{cost:.1f}", versus]
                )
        for name, row in cells.items():
            lines.append(f"| {framework.title()} | {name} | {backend} | " + " | ".join(row) + " |")
    return lines


def throughput_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "| app | way, backend | requests/s | x bare | p50 ms | p99 ms | workers' CPU µs per "
        "request | Redis CPU µs per request |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    bare = {
        row["framework"]: row["rps"] for row in data["results"] if row["label"].startswith("bare")
    }
    for row in data["results"]:
        lines.append(
            f"| {row['framework'].title()} | {row['label']} | {row['rps']:,.0f} | "
            f"{_ratio(row['rps'], bare[row['framework']])} | {row['p50_ms']:.2f} | "
            f"{row['p99_ms']:.2f} | {row['worker_cpu_us']:,.0f} | {row['redis_cpu_us']:,.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--redis-url", help="an existing Redis nobody else uses")
    args = parser.parse_args(argv)
    started = time.monotonic()
    when = datetime.now(timezone.utc)
    load_before = os.getloadavg()
    have_redis = args.redis_url is not None or shutil.which("redis-server") is not None
    with ExitStack() as stack:
        redis_url = stack.enter_context(_common.redis_server(args.redis_url)) if have_redis else ""
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gk-run-all-")))
        groups = []
        for framework, backend in GROUPS:
            if backend == "redis" and not have_redis:
                continue
            target = workdir / f"overhead-{framework}-{backend}.json"
            extra = ["--redis-url", redis_url] if backend == "redis" else []
            script(
                "overhead.py",
                "--framework",
                framework,
                "--backend",
                backend,
                *extra,
                "--json",
                str(target),
            )
            groups.append(json.loads(target.read_text()))
        target = workdir / "throughput.json"
        extra = ["--redis-url", redis_url] if have_redis else []
        script("throughput.py", *extra, "--json", str(target))
        throughput = json.loads(target.read_text())
        reports = []
        for title, name, options in REPORTS:
            if name == "redis_backend.py":
                if not have_redis:
                    continue
                options = [*options, "--url", redis_url]
            if name == "instructions.py" and shutil.which("valgrind") is None:
                continue
            if name == "frs.py":
                tables = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=_tmpfs())))
                options = [*options, "--backend", f"shared://{tables}/frs.shm"]
            reports.append(
                (title, f"python benchmarks/{name} {' '.join(options)}", script(name, *options))
            )
    meta = throughput["meta"]
    lines = [
        "# Benchmark results",
        "",
        f"Written by `python benchmarks/run_all.py` on {when:%Y-%m-%d %H:%M} UTC in "
        f"{time.monotonic() - started:.0f} s.",
        "",
        f"- Machine: {_common.machine()}; load average {load_before[0]:.2f} at the start "
        "(other work on the machine shows up as noise).",
        f"- Software: {versions()}.",
        "- Every limit is set so high that it never refuses: this is the price every "
        "admitted request pays. gatekeeper-wsgi runs either the peers' policy (`1 rate`: "
        "one rate limit per client address) or concurrency limits on all three levels plus "
        "that rate (`3 conc + 1 rate`). Flask-Limiter uses its exact `moving-window` "
        "strategy; django-ratelimit has fixed windows only. Neither has a host-wide file "
        "store, so they sit out the `shared` backend.",
        "",
        "## Per-request cost, direct WSGI calls",
        "",
        "`python benchmarks/overhead.py --framework F --backend B`: median µs per request "
        "over interleaved rounds (call the app, iterate, close). *cost* = µs over the bare "
        "app of the same run; *cost ÷ peer's* below 1 means cheaper than Flask-Limiter / "
        "django-ratelimit on the same app and backend. 8 threads: wall time ÷ requests, "
        "8 threads calling one app.",
        "",
        *overhead_table(groups),
        "",
        "## Throughput under gunicorn",
        "",
        f"`python benchmarks/throughput.py`: {meta['workers']} gunicorns of one gthread "
        f"worker x {meta['threads']} threads on 127.0.0.1, load from {meta['generator']} "
        f"on the same machine with {meta['connections']} keep-alive connections split evenly "
        f"between the workers, median of {meta['rounds']} interleaved rounds of "
        f"{meta['seconds']:g} s per app. The server, "
        "Redis and the load generator share the cores, so this measures the whole host's "
        "work per request. The peers' in-process memory stores count per worker (each "
        "limit is enforced N times over with N workers); gatekeeper-wsgi runs on the "
        "host-wide `shared` file instead.",
        "",
        *throughput_table(throughput),
    ]
    for title, command, output in reports:
        lines += ["", f"## {title}", "", f"`{command}`", "", "```", output.rstrip(), "```"]
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(args.output.read_text(encoding="utf-8"))
    return 0


def _tmpfs() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


if __name__ == "__main__":
    sys.exit(main())
