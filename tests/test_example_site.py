"""The example site: the Flask app, the Django site and the bare WSGI app each serve every
feature the README shows, and the ``load`` command counts them against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from django.test import Client as DjangoClient
from django.test import override_settings
from gatekeeper_wsgi.contrib.django import get_gatekeeper
from werkzeug.test import Client as WerkzeugClient

from example_site import common, load
from example_site.common import Work
from example_site.flask_app import create_app
from example_site.wsgi_demo import ExampleWSGI
from gatekeeper_wsgi.engine import GateKeeper
from tests.django_project import configure
from tests.servers import free_port, wait_for_port

configure()

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "example-test-token"
#: /slow and /partner hold their requests until the test finishes the work, at most this long
HOLD_SECONDS = 30.0


class JumpingClock:
    """Real monotonic time (queues time out as they would) that a test can move ahead."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def fault(self) -> dict[str, Any]:
        """The ServiceFault (RFC 9457 JSON) of a rejection."""
        assert self.headers["Content-Type"].startswith("application/problem+json"), self.body
        return dict(json.loads(self.body))


class Site:
    """One example app behind one interface: ``request()``, its engine and its work."""

    def __init__(
        self,
        kind: str,
        send: Callable[..., Answer],
        gatekeeper: Callable[[], GateKeeper],
        work: Work,
        clock: JumpingClock | None,
    ) -> None:
        self.kind = kind
        self.request = send
        self._gatekeeper = gatekeeper
        self.work = work
        #: the engine's clock when the test can move it (not for Django)
        self.clock = clock

    @property
    def gatekeeper(self) -> GateKeeper:
        return self._gatekeeper()

    def in_thread(self, *args: Any, **kwargs: Any) -> tuple[threading.Thread, list[Answer]]:
        """Send a request from another thread; its answer lands in the returned list."""
        answers: list[Answer] = []
        thread = threading.Thread(target=lambda: answers.append(self.request(*args, **kwargs)))
        thread.start()
        return thread, answers


def werkzeug_sender(app: Any) -> Callable[..., Answer]:
    def send(
        method: str, path: str, headers: dict[str, str] | None = None, data: Any = None
    ) -> Answer:
        # buffered: the response is read and closed, as a server would, so slots come back
        response = WerkzeugClient(app).open(
            path,
            method=method,
            headers=headers or {},
            data=data,
            content_type="application/x-www-form-urlencoded",
            buffered=True,
        )
        return Answer(response.status_code, dict(response.headers), response.get_data())

    return send


def django_sender() -> Callable[..., Answer]:
    def send(
        method: str, path: str, headers: dict[str, str] | None = None, data: Any = None
    ) -> Answer:
        client = DjangoClient()  # one per call: the test client is not shared across threads
        response = client.generic(
            method,
            path,
            data=data or "",
            content_type="application/x-www-form-urlencoded",
            headers=headers or {},
        )
        return Answer(response.status_code, dict(response.items()), response.content)

    return send


@pytest.fixture(params=["flask", "django", "wsgi"])
def site(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    """A fresh example app of each kind on the memory backend, its slow work held."""
    monkeypatch.setenv(common.BACKEND_ENV, "memory")  # restored after serve() sets it
    monkeypatch.setenv(common.TOKEN_ENV, TOKEN)
    work = Work(HOLD_SECONDS)
    try:
        if request.param == "flask":
            clock = JumpingClock()
            app = create_app(work=work, clock=clock)
            yield Site(
                "flask",
                werkzeug_sender(app),
                lambda: app.extensions["gatekeeper"].gatekeeper,
                work,
                clock,
            )
        elif request.param == "django":
            from example_site.django_site import views

            monkeypatch.setattr(views, "WORK", work)
            with override_settings(
                ROOT_URLCONF="example_site.django_site.urls",
                MIDDLEWARE=["gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"],
                GATEKEEPER=common.gatekeeper_settings(),
            ):
                yield Site("django", django_sender(), get_gatekeeper, work, None)
        else:
            wsgi = ExampleWSGI(work=work)
            yield Site("wsgi", werkzeug_sender(wsgi), lambda: wsgi.gatekeeper, work, None)
    finally:
        work.finish()


def test_example_apps_import_and_describe_themselves(site: Site) -> None:
    """Each app serves its start page (exempt from limits) naming the endpoints and the
    dashboard, never the dashboard's token (anyone can read that page)."""
    answer = site.request("GET", "/")
    assert answer.status == 200
    for endpoint in (b"/slow", b"/flaky", b"/login", b"/partner", b"/search", b"/gatekeeper/"):
        assert endpoint in answer.body
    assert TOKEN.encode() not in answer.body


def test_slow_endpoint_runs_two_and_its_queue_answers_503(site: Site) -> None:
    """/slow admits two at a time; a third waits in the queue and gets GK-QUEUE-TIMEOUT."""
    holders = [site.in_thread("GET", "/slow") for _ in range(2)]
    assert site.work.wait_running(2)
    assert site.gatekeeper.inflight()["demo/slow"] == 2

    answer = site.request("GET", "/slow")  # waits the queue's 1.5 s, then gives up

    assert answer.status == 503
    fault = answer.fault()
    assert fault["code"] == "GK-QUEUE-TIMEOUT"
    assert fault["limit"] == {"path": "demo/slow", "value": 2}
    assert int(answer.headers["Retry-After"]) >= 1
    site.work.finish()
    for thread, answers in holders:
        thread.join()
        assert [a.status for a in answers] == [200]
    assert site.gatekeeper.inflight().get("demo/slow", 0) == 0


def test_search_endpoint_has_an_adaptive_limit(site: Site) -> None:
    """/search is limited by concurrency "auto": it answers with the current limit, and
    stats report that limit, with its latencies, for demo/search."""
    answer = site.request("GET", "/search")
    assert answer.status == 200
    assert answer.body == b"done: search (adaptive limit now 10)\n"
    report = site.gatekeeper.stats()["adaptive"]["demo/search"]
    assert report["limit"] >= 1
    assert site.gatekeeper.inflight().get("demo/search", 0) == 0


def test_sixth_failed_login_gets_429(site: Site) -> None:
    """5 failed logins per minute per IP: the sixth is a 429 ServiceFault; a success is not
    counted."""
    statuses = [site.request("POST", "/login", data="password=guess").status for _ in range(4)]
    statuses.append(site.request("POST", "/login", data="password=secret").status)
    statuses.append(site.request("POST", "/login", data="password=guess").status)
    assert statuses == [401, 401, 401, 401, 200, 401]

    answer = site.request("POST", "/login", data="password=guess")

    assert answer.status == 429
    fault = answer.fault()
    assert fault["code"] == "GK-RATE-LIMIT"
    assert fault["limit"] == {"path": "demo/login/*", "value": "5/minute"}
    assert 1 <= int(answer.headers["Retry-After"]) <= 60
    assert "RateLimit-Policy" in answer.headers


def test_flaky_endpoint_holds_its_slot_after_a_timeout_marker(site: Site) -> None:
    """A response with the timeout marker keeps /flaky's only slot for the 5 s delay."""
    first = site.request("GET", "/flaky")
    assert first.status == 200
    assert first.headers["X-Fault-Code"] == "TIMEOUT"
    assert site.gatekeeper.inflight()["demo/flaky"] == 1
    assert site.gatekeeper.stats()["counters"]["delayed_pending"] == 1

    refused = site.request("GET", "/flaky", headers={"Accept": "application/xml"})

    assert refused.status == 503
    assert refused.headers["Content-Type"].startswith("application/xml")
    assert b"<code>GK-CONCURRENCY-LIMIT</code>" in refused.body
    if site.clock is not None:
        site.clock.advance(5.0)
        assert site.request("GET", "/flaky").status == 200


def test_partner_endpoint_limits_each_caller_separately(site: Site) -> None:
    """One request in flight per X-Caller-Id: a second from crm is refused, billing is not."""
    crm, crm_answers = site.in_thread("GET", "/partner", headers={"X-Caller-Id": "crm"})
    assert site.work.wait_running(1)

    refused = site.request("GET", "/partner", headers={"X-Caller-Id": "crm"})
    billing, billing_answers = site.in_thread("GET", "/partner", headers={"X-Caller-Id": "billing"})
    assert site.work.wait_running(2)
    site.work.finish()
    crm.join()
    billing.join()

    assert refused.status == 503
    fault = refused.fault()
    assert fault["code"] == "GK-CONCURRENCY-LIMIT"
    assert fault["level"] == "caller"
    assert fault["limit"] == {"path": "demo/partner/*", "value": 1}
    assert [a.status for a in crm_answers] == [200]
    assert [a.body for a in billing_answers] == [b"done: partner for billing\n"]


def test_dashboard_needs_the_token(site: Site) -> None:
    """The status JSON is served with the printed token and refused without it."""
    assert site.request("GET", "/gatekeeper/status.json").status in (401, 403)

    answer = site.request(
        "GET", "/gatekeeper/status.json", headers={"Authorization": f"Bearer {TOKEN}"}
    )

    assert answer.status == 200
    payload = json.loads(answer.body)
    assert payload["config"]["project"] == "demo"
    assert "demo/slow" in {limit["path"] for limit in payload["config"]["limits"]}


def test_fault_code_reads_json_and_xml_service_faults() -> None:
    """The load command recognises a ServiceFault in either format, and nothing else."""
    xml = b'<ServiceFault xmlns="urn:x"><code>GK-QUEUE-FULL</code></ServiceFault>'
    assert load.fault_code("application/problem+json", b'{"code": "GK-RATE-LIMIT"}') == (
        "GK-RATE-LIMIT"
    )
    assert load.fault_code("application/xml", xml) == "GK-QUEUE-FULL"
    assert load.fault_code("application/json", b'{"code": "E42"}') is None
    assert load.fault_code("text/plain", b"GK-RATE-LIMIT") is None


@pytest.fixture(params=["flask", "django"])
def served_site(request: pytest.FixtureRequest) -> Iterator[str]:
    """``python -m example_site`` (or ``--django``) on a free port; yields its base URL."""
    port = free_port()
    flags = ["--django"] if request.param == "django" else []
    env = {key: value for key, value in os.environ.items() if key != common.BACKEND_ENV}
    server = subprocess.Popen(
        [sys.executable, "-m", "example_site", "--port", str(port), *flags],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=20)


@pytest.mark.slow
def test_load_command_counts_admitted_queued_and_rejected(
    served_site: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """10 simultaneous requests at /slow: some run, some wait in the queue, the rest are
    refused with queue faults; the command prints each count."""
    warm_up = load.run(f"{served_site}/login", 1, 1, method="POST", data=b"password=secret")
    assert dict(warm_up.admitted) == {200: 1}  # the first request also loads views and engine

    status = load.main(["--url", f"{served_site}/slow", "--requests", "10", "--concurrency", "10"])

    printed = capsys.readouterr().out
    assert status == 0, printed
    assert printed.startswith(f"10 requests to {served_site}/slow, 10 at a time")
    counts = {
        line.split()[0]: int(line.split()[1])
        for line in printed.splitlines()
        if line.split()[0] in ("admitted", "queued", "rejected")
    }
    assert sum(counts.values()) == 10, printed
    # Which of the answered requests count as queued depends on timing; these do not.
    assert counts["admitted"] + counts["queued"] >= 2, printed
    assert counts["queued"] >= 1, printed  # slots free after 1 s, the queue waits 1.5 s
    assert "503 GK-QUEUE-FULL" in printed
    rejected = [line.split()[:2] for line in printed.splitlines() if line.startswith("    ")]
    assert all(code in ("GK-QUEUE-FULL", "GK-QUEUE-TIMEOUT") for _, code in rejected)


def test_banner_names_the_token_but_prints_no_url_carrying_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start-up banner tells the token and how to send it, but no URL with the token
    in it (a URL followed once lands in access logs)."""
    monkeypatch.setenv(common.TOKEN_ENV, TOKEN)
    text = common.banner("Flask", 8000)
    assert TOKEN in text
    assert "token=" + TOKEN not in text
    # the header command works pasted into another terminal (the variable is the demo's)
    assert f'-H "Authorization: Bearer {TOKEN}"' in text


def test_a_backend_the_demo_cannot_use_is_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m example_site --backend <bad URL>` says why in one line (exit 2), not in
    a traceback."""
    from example_site.__main__ import serve

    monkeypatch.setenv(common.BACKEND_ENV, "memory")  # restored after serve() sets it
    assert serve(["--backend", "memcached://127.0.0.1:11211", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: backend") and err.count("\n") == 1


def test_load_report_shows_the_adaptive_limit_second_by_second() -> None:
    """Answers that tell an adaptive limit become one line: the last value of each second,
    a silent second repeating the one before."""
    tally = load.Tally(limits=[(0.2, 10), (0.9, 3), (1.5, 5), (3.1, 5), (3.4, 4)])
    tally.admitted[200] = 5
    assert tally.limit_per_second() == [3, 5, 5, 4]
    assert "adaptive limit, second by second: 3 5 5 4" in load.report(tally, "u", 1)
    assert "adaptive limit" not in load.report(load.Tally(), "u", 1)


@pytest.mark.slow
def test_load_at_search_shows_its_adaptive_limit(
    served_site: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """3000 requests, 32 at a time, at /search (a backend of 4 slots): most are refused by
    the adaptive limit, and the report shows the limit over the run, within its bounds."""
    status = load.main(
        ["--url", f"{served_site}/search", "--requests", "3000", "--concurrency", "32"]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "503 GK-CONCURRENCY-LIMIT" in printed
    line = next(line for line in printed.splitlines() if "second by second" in line)
    values = [int(value) for value in line.split(":")[1].split()]
    assert values and all(1 <= value <= 50 for value in values), printed
