"""Prometheus metrics (SPEC §7, optional extra): counters by code and limit pattern, in-flight
gauges per configured limit, stage histograms; one process and gunicorn-style multiprocess
mode, where worker processes write into one directory and a scrape aggregates them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.prometheus import GateKeeperCollector, MultiProcessExporter, register
from tests.servers import ROOT, free_port, wait_until

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 50},
        "shop/checkout": {"concurrency": 1},
        "shop/login/*": {"concurrency": 2},
    },
}


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.fixture
def keeper() -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper with a wildcard limit."""
    gk = GateKeeper(SETTINGS)
    yield gk
    gk.close()


def test_counters_gauges_and_histograms_in_one_process(keeper: GateKeeper) -> None:
    """Scrapes show admitted, rejected by code/limit, in flight per limit, stage timings."""
    registry = CollectorRegistry()
    collector = register(keeper, registry, multiprocess=False)
    assert isinstance(collector, GateKeeperCollector)
    client = Client(GateKeeperMiddleware(ok_app, keeper))
    held = [keeper.admit("shop", "checkout", "crm")]
    held += [keeper.admit("shop", "login", f"user{n}") for n in range(3)]
    assert client.get("/checkout", buffered=True).status_code == 503
    assert client.get("/home", buffered=True).status_code == 200

    value = registry.get_sample_value
    assert value("gatekeeper_admitted_total") == 5
    assert (
        value(
            "gatekeeper_rejected_total", {"code": "GK-CONCURRENCY-LIMIT", "limit": "shop/checkout"}
        )
        == 1
    )
    assert value("gatekeeper_inflight", {"limit": "shop", "level": "project"}) == 4
    assert value("gatekeeper_inflight", {"limit": "shop/checkout", "level": "service"}) == 1
    assert value("gatekeeper_inflight", {"limit": "shop/login/*", "level": "caller"}) == 3
    assert value("gatekeeper_inflight_keys", {"limit": "shop/login/*"}) == 3
    assert (
        value("gatekeeper_limit_concurrency", {"limit": "shop/checkout", "level": "service"}) == 1
    )
    assert value("gatekeeper_backend_up") == 1
    decisions = value("gatekeeper_stage_duration_seconds_count", {"stage": "decide"})
    assert decisions == 6
    assert value("gatekeeper_stage_duration_seconds_bucket", {"stage": "decide", "le": "+Inf"}) == 6
    assert (value("gatekeeper_stage_duration_seconds_sum", {"stage": "decide"}) or 0) > 0

    for admission in held:
        admission.release(200)
    assert value("gatekeeper_inflight", {"limit": "shop/login/*", "level": "caller"}) == 0
    collector.close()
    assert value("gatekeeper_admitted_total") is None  # unregistered


def test_label_cardinality_does_not_grow_with_keys() -> None:
    """A thousand callers produce no per-caller series: labels are configured patterns."""
    keeper = GateKeeper(
        {**SETTINGS, "limits": {**SETTINGS["limits"], "shop": {"concurrency": 5000}}}
    )
    registry = CollectorRegistry()
    collector = register(keeper, registry, multiprocess=False)
    held = [keeper.admit("shop", "login", f"sprayed-{n}") for n in range(1000)]
    exposition = generate_latest(registry).decode("ascii")
    assert "sprayed" not in exposition
    inflight_series = [
        line for line in exposition.splitlines() if line.startswith("gatekeeper_inflight{")
    ]
    assert len(inflight_series) == len(SETTINGS["limits"])
    for admission in held:
        admission.release(200)
    collector.close()
    keeper.close()


def test_capacity_refusals_are_counted_for_alerts() -> None:
    """A wildcard limit whose keys are all busy refuses a new key: counted as
    gatekeeper_capacity_refused_total, as stats() counts it, so an operator can alert on
    max_keys running out; the rejected log's dropped records have their counter too."""
    keeper = GateKeeper(
        {"project": "shop", "limits": {"shop/login/*": {"concurrency": 1, "max_keys": 2}}}
    )
    registry = CollectorRegistry()
    collector = register(keeper, registry, multiprocess=False)
    held = [keeper.admit("shop", "login", name) for name in ("alice", "bob")]
    with pytest.raises(Rejected):
        keeper.admit("shop", "login", "carol")
    value = registry.get_sample_value
    assert value("gatekeeper_capacity_refused_total") == 1
    assert keeper.stats()["counters"]["capacity_refused"] == 1
    assert value("gatekeeper_rejected_log_dropped_total") == 0
    for admission in held:
        admission.release(200)
    collector.close()
    keeper.close()


def test_backend_down_is_a_gauge_not_a_scrape_error() -> None:
    """An unreachable backend sets gatekeeper_backend_up to 0; the scrape still works."""
    gk = GateKeeper({**SETTINGS, "backend": f"redis://127.0.0.1:{free_port()}/0"})
    registry = CollectorRegistry()
    collector = register(gk, registry, multiprocess=False)
    assert registry.get_sample_value("gatekeeper_backend_up") == 0
    assert registry.get_sample_value("gatekeeper_admitted_total") == 0
    collector.close()
    gk.close()


def test_missing_extra_names_it(keeper: GateKeeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without prometheus_client the error says which extra to install."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"gatekeeper-wsgi\[prometheus\]"):
        GateKeeperCollector(keeper)


def test_multiprocess_exporter_needs_the_directory(
    keeper: GateKeeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multiprocess mode without PROMETHEUS_MULTIPROC_DIR is refused with a reason."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    with pytest.raises(RuntimeError, match="PROMETHEUS_MULTIPROC_DIR"):
        MultiProcessExporter(keeper)


WORKER = textwrap.dedent(
    """
    import os, sys
    from werkzeug.test import Client
    from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected
    from gatekeeper_wsgi.prometheus import MultiProcessExporter, register

    def ok(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    settings = {SETTINGS!r}
    keeper = GateKeeper(settings)
    exporter = register(keeper, interval=None)
    assert isinstance(exporter, MultiProcessExporter), exporter
    client = Client(GateKeeperMiddleware(ok, keeper))
    for _ in range(3):
        assert client.get("/home", buffered=True).status_code == 200
    held = [
        keeper.admit("shop", "checkout", "crm"),
        keeper.admit("shop", "login", f"u{{os.getpid()}}"),
    ]
    assert client.get("/checkout", buffered=True).status_code == 503
    exporter.sync()
    print("ready", flush=True)
    sys.stdin.readline()
    for admission in held:
        admission.release(200)
    exporter.close()
    print("done", flush=True)
    """
).format(SETTINGS=SETTINGS)


def start_worker(script: str, directory: Path) -> subprocess.Popen[str]:
    """A Python process running ``script`` in the repository with PROMETHEUS_MULTIPROC_DIR
    set to ``directory``; its stdin and stdout are text pipes."""
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
        cwd=ROOT,
    )


def stop_worker(worker: subprocess.Popen[str]) -> None:
    """Kill ``worker`` if it still runs, reap it and close its pipes."""
    if worker.poll() is None:
        worker.kill()
    worker.wait(30)
    for stream in (worker.stdin, worker.stdout):
        if stream is not None:
            stream.close()


def scrape(directory: Path) -> CollectorRegistry:
    """What a gunicorn scrape endpoint serves: the workers' files aggregated."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


@pytest.mark.slow
def test_two_worker_processes_aggregate_in_multiprocess_mode(tmp_path: Path) -> None:
    """Two workers sharing PROMETHEUS_MULTIPROC_DIR scrape as one service, dead ones too."""
    directory = tmp_path / "prom"
    directory.mkdir()
    workers = [start_worker(WORKER, directory) for _ in range(2)]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
        value = scrape(directory).get_sample_value
        assert value("gatekeeper_admitted_total") == 10
        assert (
            value(
                "gatekeeper_rejected_total",
                {"code": "GK-CONCURRENCY-LIMIT", "limit": "shop/checkout"},
            )
            == 2
        )
        assert value("gatekeeper_inflight", {"limit": "shop", "level": "project"}) == 4
        assert value("gatekeeper_inflight", {"limit": "shop/checkout", "level": "service"}) == 2
        assert value("gatekeeper_inflight", {"limit": "shop/login/*", "level": "caller"}) == 2
        assert value("gatekeeper_stage_duration_seconds_count", {"stage": "decide"}) == 12
        exposition = generate_latest(scrape(directory)).decode("ascii")
        assert "shop/login/u" not in exposition

        for worker in workers:
            assert worker.stdin is not None and worker.stdout is not None
            worker.stdin.write("\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "done"
            assert worker.wait(30) == 0
            mark_process_dead(worker.pid, str(directory))
        value = scrape(directory).get_sample_value
        assert value("gatekeeper_admitted_total") == 10
        assert value("gatekeeper_inflight", {"limit": "shop", "level": "project"}) is None
    finally:
        for worker in workers:
            stop_worker(worker)


UWSGI_MASTER = textwrap.dedent(
    """
    import ctypes, os, sys
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector
    from werkzeug.test import Client
    from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
    from gatekeeper_wsgi.prometheus import register

    def ok(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    keeper = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 50}}})
    exporter = register(keeper, interval=0.05)
    client = Client(GateKeeperMiddleware(ok, keeper))
    pid = ctypes.PyDLL(None).fork()  # as uWSGI forks a worker: no Python fork hooks run
    if pid == 0:
        for _ in range(4):
            assert client.get("/home", buffered=True).status_code == 200
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
        for _ in range(400):  # the worker's own sync thread writes its counts (20 s at most)
            if registry.get_sample_value("gatekeeper_admitted_total") == 4:
                break
            exporter._stop.wait(0.05)
        os._exit(0 if registry.get_sample_value("gatekeeper_admitted_total") == 4 else 3)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
    """
)


@pytest.mark.slow
def test_a_worker_forked_without_fork_hooks_exports_its_own_counts(tmp_path: Path) -> None:
    """uWSGI's default mode loads the app (and its exporter) in the master and forks the
    workers in C, where Python's fork hooks do not run: a worker still starts its own
    sync thread and writes its counts under its own pid."""
    directory = tmp_path / "prom"
    directory.mkdir()
    master = start_worker(UWSGI_MASTER, directory)
    try:
        assert master.stdout is not None
        assert master.stdout.readline().strip() == "0"
        assert master.wait(30) == 0
        assert scrape(directory).get_sample_value("gatekeeper_admitted_total") == 4
    finally:
        stop_worker(master)


DELAYING_WORKER = textwrap.dedent(
    """
    import sys
    from gatekeeper_wsgi import GateKeeper
    from gatekeeper_wsgi.prometheus import register

    keeper = GateKeeper({{
        "project": "shop",
        "backend": {url!r},
        "limits": {{"shop": {{"concurrency": 10, "delay": 60}}}},
    }})
    exporter = register(keeper, interval=None)
    keeper.admit("shop", "api", "c").release(500, faulty=True)  # held for the delay
    exporter.sync()
    print("ready", flush=True)
    sys.stdin.readline()
    exporter.close()
    keeper.close()
    """
)


@pytest.mark.slow
@pytest.mark.redis
def test_delayed_releases_of_redis_workers_add_up(tmp_path: Path, prefixed: str) -> None:
    """On Redis a worker counts the delayed releases it placed: the multiprocess gauge adds
    the workers up (the most recent worker's alone said 1 of 2)."""
    directory = tmp_path / "prom"
    directory.mkdir()
    workers = [start_worker(DELAYING_WORKER.format(url=prefixed), directory) for _ in range(2)]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready"
        assert scrape(directory).get_sample_value("gatekeeper_delayed_pending") == 2
    finally:
        for worker in workers:
            if worker.stdin is not None:
                worker.stdin.write("\n")
                worker.stdin.close()
            worker.wait(30)
            if worker.stdout is not None:
                worker.stdout.close()


THREADED_WORKER = textwrap.dedent(
    """
    import sys
    from gatekeeper_wsgi import GateKeeper
    from gatekeeper_wsgi.prometheus import register

    keeper = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 5}}})
    exporter = register(keeper, interval=0.01)
    held = keeper.admit("shop", "home", "web")
    print("ready", flush=True)
    sys.stdin.readline()
    held.release(200)
    """
)


@pytest.mark.slow
def test_the_sync_thread_writes_without_being_asked(tmp_path: Path) -> None:
    """In a worker that never calls sync(), the exporter's thread publishes its values."""
    with start_worker(THREADED_WORKER, tmp_path) as worker:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().strip() == "ready"
        labels = {"limit": "shop", "level": "project"}
        wait_until(
            lambda: scrape(tmp_path).get_sample_value("gatekeeper_inflight", labels) == 1,
            what="the sync thread's first write of the gauge",
        )
        assert scrape(tmp_path).get_sample_value("gatekeeper_admitted_total") == 1
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.wait(30) == 0
