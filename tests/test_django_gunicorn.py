"""The Django middleware under a real gunicorn process (one worker, 8 threads) serving the
test project to concurrent clients: the concurrency limit is exact as the app itself
observes it, and every in-flight count returns to zero."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import free_port, wait_for_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 30.0
LIMIT = 3  # site/hold and site/observe in tests/django_project/settings.py
TOKEN = "test-token"


@pytest.fixture
def server() -> Iterator[int]:
    """gunicorn serving tests/django_project: one worker process, 8 threads."""
    port = free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.django_project.settings"}
    process = subprocess.Popen(
        [
            sys.executable, "-m", "gunicorn",
            "--workers", "1",
            "--threads", "8",
            "--bind", f"127.0.0.1:{port}",
            "--log-level", "critical",
            "tests.django_project.wsgi:application",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=20)


def request(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One GET on a fresh connection; (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def observed(port: int) -> dict[str, Any]:
    """The app's observer (an exempt view) and the engine's in-flight counts."""
    status, body = request(port, "/observed/")
    assert status == 200
    result: dict[str, Any] = json.loads(body)
    return result


def eventually(port: int, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the app's state until ``condition`` holds; fail after the deadline."""
    deadline = time.monotonic() + DEADLINE
    while True:
        current = observed(port)
        if condition(current):
            return current
        if time.monotonic() > deadline:
            pytest.fail(f"condition not reached within {DEADLINE}s: {current}")
        time.sleep(0.01)


def all_zero(current: dict[str, Any]) -> bool:
    """Every slot came back."""
    return all(count == 0 for count in current["inflight"].values())


def in_threads(count: int, task: Callable[[int], Any]) -> list[Any]:
    """Run ``task(i)`` in ``count`` threads released together by a barrier."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = task(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE * 2)
    assert not errors, errors
    return results


def test_full_limit_rejects_every_further_request(server: int) -> None:
    """With the slots held by running views, every newcomer gets the fault; then all are 0."""
    holders = threading.Thread(
        target=lambda: in_threads(LIMIT, lambda i: request(server, "/hold/")), daemon=True
    )
    holders.start()
    eventually(server, lambda current: current["active"] == LIMIT)
    results = in_threads(5, lambda i: request(server, "/hold/"))
    assert [status for status, _ in results] == [503] * 5
    fault = json.loads(results[0][1])
    assert fault["code"] == "GK-CONCURRENCY-LIMIT"
    assert fault["limit"] == {"path": "site/hold", "value": str(LIMIT)}
    assert request(server, "/open/")[0] == 200
    holders.join(DEADLINE)
    final = eventually(server, all_zero)
    assert final["max_active"] == LIMIT
    assert final["executions"] == LIMIT


def test_app_never_sees_more_than_the_limit_under_load(server: int) -> None:
    """8 hammering clients: the view never runs more than the limit at once; no slot leaks."""
    per_client = 25

    def client(index: int) -> list[int]:
        return [request(server, "/observe/")[0] for _ in range(per_client)]

    statuses = [status for result in in_threads(8, client) for status in result]
    assert set(statuses) <= {200, 503}
    final = eventually(server, all_zero)
    assert 1 <= final["max_active"] <= LIMIT
    assert final["executions"] == statuses.count(200)


def test_status_view_reports_inflight_under_gunicorn(server: int) -> None:
    """The status JSON view (token access) shows a held request in flight, then zero."""
    holder = threading.Thread(target=lambda: request(server, "/hold/"), daemon=True)
    holder.start()
    eventually(server, lambda current: current["active"] == 1)
    status, body = request(server, "/gk/status.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    assert json.loads(body)["inflight"]["site/hold"]["inflight"] == 1
    request(server, "/open/")
    holder.join(DEADLINE)
    eventually(server, all_zero)
    status, body = request(server, "/gk/status.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert json.loads(body)["stats"]["counters"]["admitted"] == 1
