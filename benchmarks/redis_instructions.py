"""Redis server instructions per request (callgrind), the Redis figure a loaded machine cannot blur.

Run ``python benchmarks/redis_instructions.py`` (needs ``valgrind`` and ``redis-server``; about
a minute). For each way a private ``redis-server`` runs under callgrind with instrumentation
off; after a warm-up it is switched on (``callgrind_control -i on``), the way serves
``--requests`` direct WSGI calls of ``GET /orders``, and the counts are dumped. Two figures per
way: every instruction redis-server ran (network, parsing, event loop, scripts), and those
inside ``EVALSHA`` alone (``--toggle-collect=evalShaCommand``: the scripts and the commands
they call). Ways: gatekeeper-wsgi's middleware on Redis (3 concurrency levels + 1 rate, as
``redis_backend.py``) and Flask-Limiter on Redis (one moving-window limit). Wall time on a
shared 2-core machine moves by tens of percent between runs; these counts move by a few.

``--threads N`` makes the calls from N threads at once, so requests overlap on their keys
as under gunicorn (a rate key then nearly always has another request in flight); each way
also prints the Redis commands per request (``INFO commandstats`` over the same calls).

Instructions are not time (system calls and cache misses weigh differently), but what a
change to ``lua/gate.lua`` removes from the server is measured exactly, e.g. the
``snprintf("%.17g")`` Redis 7.0 spends on every Lua number passed to ``redis.call``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import _common
import redis
from _common import WSGIApp

WAYS: dict[str, Callable[[str], WSGIApp]] = {
    "gatekeeper-wsgi (3 conc + 1 rate)": lambda url: _common.flask_gatekeeper_middleware(
        f"{url}?socket_timeout=30"  # a server under valgrind answers ~50x slower
    ),
    "Flask-Limiter (1 moving window)": _common.flask_limiter,
}


def serve(app: WSGIApp, requests: int, threads: int) -> None:
    """``requests`` direct calls of ``app``, made by ``threads`` threads started together."""
    start = threading.Barrier(threads)

    def run(share: int) -> None:
        start.wait()
        for _ in range(share):
            _common.call(app)

    shares = [requests // threads + (index < requests % threads) for index in range(threads)]
    workers = [threading.Thread(target=run, args=(share,)) for share in shares]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def commands(client: redis.Redis) -> int:
    """Commands the server ran since its statistics were reset, this INFO's and CONFIG's
    left out."""
    stats = client.info("commandstats")
    return sum(
        int(each["calls"])
        for name, each in stats.items()
        if not name.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_hello"))
    )


def count(way: str, requests: int, toggle: str | None, threads: int = 1) -> tuple[float, float]:
    """Instructions redis-server ran per request of ``way`` (only inside ``toggle``, a
    function name, when given), and Redis commands per request."""
    port = _common.free_port()
    with tempfile.TemporaryDirectory() as workdir:
        out = Path(workdir) / "callgrind.out"
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"]
        command += ["--instr-atstart=no"]
        if toggle:
            command.append(f"--toggle-collect={toggle}")
        command += ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--dir", workdir]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            _common.wait_for_port(port, timeout=60.0)
            client = redis.Redis.from_url(url, socket_timeout=30)
            client.ping()
            app = WAYS[way](url)
            serve(app, 50, threads)
            time.sleep(0.2)  # the warm-up's last releases, sent by the sender
            client.config_resetstat()
            control = ["callgrind_control"]
            subprocess.run([*control, "-i", "on", str(server.pid)], check=True, capture_output=True)
            serve(app, requests, threads)
            time.sleep(0.2)  # a release the sender sends by itself (none follows the last)
            subprocess.run([*control, "-d", str(server.pid)], check=True, capture_output=True)
            ran = commands(client)
            client.close()
        finally:
            server.terminate()
            server.wait()
        total = 0
        for dump in Path(workdir).glob("callgrind.out*"):
            for line in dump.read_text().splitlines():
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        return total / requests, ran / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="making the calls at once")
    args = parser.parse_args(argv)
    for tool in ("valgrind", "callgrind_control", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found")
    rows = []
    for way in WAYS:
        whole, ran = count(way, args.requests, None, args.threads)
        scripts, _ = count(way, args.requests, "evalShaCommand", args.threads)
        rows.append((way, whole, scripts, ran))
    print(
        f"redis-server instructions per request, {args.requests} requests from "
        f"{args.threads} thread{'s' if args.threads > 1 else ''}, callgrind"
    )
    print(f"{'':36s} {'whole server':>14s} {'inside EVALSHA':>16s} {'commands':>9s}")
    for way, whole, scripts, ran in rows:
        print(f"{way:36s} {whole:14,.0f} {scripts:16,.0f} {ran:9.2f}")
    (_, gk_whole, gk_scripts, _), (_, fl_whole, fl_scripts, _) = rows
    print(
        f"gatekeeper-wsgi / Flask-Limiter: {gk_whole / fl_whole:.2f}x the whole server's, "
        f"{gk_scripts / fl_scripts:.2f}x inside EVALSHA"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
