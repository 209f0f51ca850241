"""The Django middleware under a real gunicorn process (one worker, 8 threads) serving the
test project to concurrent clients: the concurrency limit is exact as the app itself
observes it, every in-flight count returns to zero, and a FileResponse read whole never
refuses the client's next request."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import DEADLINE, Gunicorn, run_together

pytestmark = pytest.mark.slow

LIMIT = 3  # site/hold and site/observe in tests/django_project/settings.py
TOKEN = "test-token"
#: The app's observer (an exempt view) and the engine's in-flight counts.
OBSERVED = "/observed/"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Gunicorn]:
    """gunicorn serving tests/django_project: one worker process, 8 threads."""
    settings = {"DJANGO_SETTINGS_MODULE": "tests.django_project.settings"}
    args = ("--workers", "1", "--threads", "8", "tests.django_project.wsgi:application")
    with Gunicorn(tmp_path, *args, env=settings) as server:
        yield server


def all_zero(current: dict[str, Any]) -> bool:
    """Every slot came back."""
    return all(count == 0 for count in current["inflight"].values())


def status_json(server: Gunicorn) -> Any:
    """The status JSON view, read with the token."""
    return server.json("/gk/status.json", headers={"Authorization": f"Bearer {TOKEN}"})


def test_full_limit_rejects_every_further_request(server: Gunicorn) -> None:
    """With the slots held by running views, every newcomer gets the fault; then all are 0."""
    holders = threading.Thread(
        target=lambda: run_together(LIMIT, lambda i: server.request("/hold/")), daemon=True
    )
    holders.start()
    server.json_when(OBSERVED, lambda current: current["active"] == LIMIT)
    results = run_together(5, lambda i: server.request("/hold/"))
    assert [status for status, _ in results] == [503] * 5
    fault = json.loads(results[0][1])
    assert fault["code"] == "GK-CONCURRENCY-LIMIT"
    assert fault["limit"] == {"path": "site/hold", "value": LIMIT}
    assert server.request("/open/")[0] == 200
    holders.join(DEADLINE)
    final = server.json_when(OBSERVED, all_zero)
    assert final["max_active"] == LIMIT
    assert final["executions"] == LIMIT


def test_app_never_sees_more_than_the_limit_under_load(server: Gunicorn) -> None:
    """8 hammering clients: the view never runs more than the limit at once; no slot leaks."""
    per_client = 25

    def client(index: int) -> list[int]:
        return [server.request("/observe/")[0] for _ in range(per_client)]

    statuses = [status for result in run_together(8, client) for status in result]
    assert set(statuses) <= {200, 503}
    final = server.json_when(OBSERVED, all_zero)
    assert 1 <= final["max_active"] <= LIMIT
    assert final["executions"] == statuses.count(200)


def test_status_view_reports_inflight_under_gunicorn(server: Gunicorn) -> None:
    """The status JSON view (token access) shows a held request in flight, then zero."""
    holder = threading.Thread(target=lambda: server.request("/hold/"), daemon=True)
    holder.start()
    server.json_when(OBSERVED, lambda current: current["active"] == 1)
    assert status_json(server)["inflight"]["site/hold"]["inflight"] == 1
    server.request("/open/")
    holder.join(DEADLINE)
    server.json_when(OBSERVED, all_zero)
    assert status_json(server)["stats"]["counters"]["admitted"] == 1


def test_a_file_response_read_whole_never_refuses_the_next_request(server: Gunicorn) -> None:
    """A FileResponse (concurrency 1) read to its end, then the next at once on a fresh
    connection, 100 times: every one is admitted. Its slot comes back as its last byte is
    handed out, not when gunicorn closes it after writing its access log."""
    bodies = [server.request("/file/") for _ in range(100)]
    assert bodies == [(200, b"file body " * 100)] * 100


def test_a_head_answered_never_refuses_the_next_request(server: Gunicorn) -> None:
    """A HEAD of a streamed body (concurrency 1): the client has the whole response with
    its headers while gunicorn still iterates the body it drops; the next request at once
    on a fresh connection, 50 times: every one is admitted."""
    statuses = []
    for _ in range(50):
        assert server.request("/chunks/", method="HEAD") == (200, b"")
        statuses.append(server.request("/chunks/")[0])
    assert statuses == [200] * 50, statuses
