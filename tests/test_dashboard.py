"""The live dashboard in a real headless Chromium (Debian ``chromium`` driven by Playwright):
bars and numbers while requests are held in flight, updated in place as they finish; a
client locked out by a rate limit shown with its window use; rejections made before the
page was opened in its chart; queue waits timed apart from decisions."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.serving import make_server

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.status import StatusApp

#: the Chromium on the PATH (Debian's ``chromium``, elsewhere often ``chromium-browser``)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).parent / "artifacts"
TOKEN = "dash-token"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


#: true in the page once the chart's bars (their "CODE: n" titles) add up to `arg`
CHART_TOTAL_IS = """(expected) => Array.from(document.querySelectorAll("#chart rect title"))
    .reduce((total, title) => total + parseInt(title.textContent.split(": ")[1], 10), 0)
    === expected"""


def _chromium_or_skip() -> Any:
    """Playwright's sync API, or a skip (a failure when CI requires Chromium)."""
    required = os.environ.get("GATEKEEPER_REQUIRE_CHROMIUM") == "1"
    reason = None
    if CHROMIUM is None:
        reason = "no chromium on the PATH (apt-get install chromium)"
    try:
        from playwright import sync_api
    except ImportError:
        reason = "playwright is not installed (pip install playwright)"
    if reason is not None:
        if required:
            pytest.fail(f"GATEKEEPER_REQUIRE_CHROMIUM=1 but {reason}")
        pytest.skip(reason)
    return sync_api


class HeldApp:
    """A WSGI app whose requests wait for `release`; `entered` counts arrivals. /otp
    answers at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/otp":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"sent"]
        if environ["PATH_INFO"] not in ("/checkout", "/login"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found"]
        self.entered.release()
        assert self.release.wait(30), "the test never released the request"
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]


class Site:
    """The demo site on a real loopback server: the app under the middleware, the
    dashboard mounted at /gatekeeper."""

    def __init__(self, limits: dict[str, Any] | None = None) -> None:
        self.app = HeldApp()
        self.keeper = GateKeeper(
            {
                "project": "shop",
                "limits": limits
                or {
                    "shop": {"concurrency": 20},
                    "shop/checkout": {"concurrency": 2},
                    "shop/login/*": {"concurrency": 3, "rate": "100/minute"},
                    "shop/otp/*": {"rate": "2/minute"},
                },
            }
        )
        wsgi = DispatcherMiddleware(
            GateKeeperMiddleware(self.app, self.keeper),
            {"/gatekeeper": StatusApp(self.keeper, token=TOKEN, refresh_seconds=0.25)},
        )
        self.server = make_server("127.0.0.1", 0, wsgi, threaded=True)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.clients: list[threading.Thread] = []
        self.statuses: list[int] = []

    def request(self, path: str, caller: str = "web") -> int:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path, headers={"X-Caller-Id": caller})
            response = connection.getresponse()
            response.read()
            return response.status
        finally:
            connection.close()

    def hold(self, path: str, caller: str = "web") -> None:
        """Start a request that stays in flight until release; returns once it is inside."""
        thread = threading.Thread(
            target=lambda: self.statuses.append(self.request(path, caller)), daemon=True
        )
        thread.start()
        self.clients.append(thread)
        assert self.app.entered.acquire(timeout=30), f"{path} never reached the app"

    def finish(self) -> None:
        self.app.release.set()
        for thread in self.clients:
            thread.join(30)
        self.clients = []

    def close(self) -> None:
        self.finish()
        self.server.shutdown()
        self.thread.join(30)
        self.keeper.close()


@pytest.fixture
def site() -> Iterator[Site]:
    """A running demo site with the dashboard; released and stopped afterwards."""
    running = Site()
    try:
        yield running
    finally:
        running.close()


def test_dashboard_shows_live_inflight_and_updates_without_reload(site: Site) -> None:
    """Held requests show as bars against their limits; releasing them updates in place."""
    sync_api = _chromium_or_skip()
    expect = sync_api.expect
    site.hold("/checkout", "crm")
    site.hold("/checkout", "erp")
    site.hold("/login", "alice")
    assert site.request("/checkout", "late") == 503  # checkout is full
    # mallory uses up its two one-time passwords a minute, and is locked out
    assert [site.request("/otp", "mallory") for _ in range(3)] == [200, 200, 429]

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            url = f"http://127.0.0.1:{site.port}/gatekeeper/?token={TOKEN}"
            page.goto(url)
            # The link's token was exchanged for a cookie: it left the address bar.
            assert page.url == f"http://127.0.0.1:{site.port}/gatekeeper/"
            expect.set_options(timeout=20_000)
            checkout = page.locator('[data-limit="shop/checkout"]')
            expect(checkout.locator(".count")).to_have_text("2 / 2")
            expect(checkout.locator(".bar")).to_have_attribute("aria-valuenow", "2")
            expect(checkout.locator(".fill")).to_have_class("fill full")
            expect(page.locator('[data-limit="shop"] .count')).to_have_text("3 / 20")
            alice = page.locator('[data-key="shop/login/alice"]')
            # in flight against the concurrency, then the rate window's use
            expect(alice.locator(".count")).to_have_text(re.compile(r"^1 / 3 "))
            expect(alice.locator(".count small")).to_have_text("1/100 used · 99 left")
            expect(page.get_by_test_id("rejected")).to_have_text("2")
            # Rejections made before the page was opened are in its chart at once.
            expect(page.locator("#chart rect").first).to_be_visible()
            # A locked-out client of a rate limit is listed with its window use, though
            # it has nothing in flight.
            mallory = page.locator('[data-key="shop/otp/mallory"]')
            expect(mallory).to_have_attribute("data-remaining", "0")
            expect(mallory).to_have_class(re.compile(r"\blocked\b"))
            expect(mallory.locator(".count")).to_contain_text("2 / 2 used 0 left · frees in")
            expect(mallory.locator(".bar")).to_have_attribute("aria-valuenow", "2")
            expect(page.locator('[data-limit="shop/otp/*"] .count')).to_contain_text("tracked")
            # Queue waits are a stage of their own, apart from decisions.
            expect(page.locator('#stages tr[data-stage="queue_wait"]')).to_have_count(1)
            expect(page.get_by_test_id("admitted")).to_have_text("5")
            expect(page.get_by_test_id("state")).to_have_text("live")
            expect(page.locator('#stages tr[data-stage="decide"] td').nth(1)).not_to_have_text("0")
            expect(page.locator('#by-limit tr[data-limit="shop/checkout"] td').nth(1)).to_have_text(
                "1"
            )
            page.evaluate("window.__sameDocument = true")

            # A rejection while the page is open shows up in the chart.
            assert site.request("/checkout", "late") == 503
            expect(page.get_by_test_id("rejected")).to_have_text("3")
            # Every rejection is in the chart once: the bars add up to the three.
            page.wait_for_function(CHART_TOTAL_IS, arg=3, timeout=20_000)
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            site.finish()
            assert sorted(site.statuses) == [200, 200, 200]
            expect(checkout.locator(".count")).to_have_text("0 / 2")
            expect(checkout.locator(".bar")).to_have_attribute("aria-valuenow", "0")
            expect(page.locator('[data-key="shop/login/alice"]')).to_have_count(0)
            expect(page.get_by_test_id("admitted")).to_have_text("5")
            assert page.evaluate("window.__sameDocument") is True
            page.screenshot(path=str(ARTIFACTS / "dashboard-idle.png"), full_page=True)
        finally:
            browser.close()


def test_dashboard_reports_a_wrong_token_on_the_page(site: Site) -> None:
    """Opened with a wrong token, the page gets 403 and the browser shows no data."""
    sync_api = _chromium_or_skip()
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            response = page.goto(f"http://127.0.0.1:{site.port}/gatekeeper/?token=wrong")
            assert response is not None and response.status == 403
            assert "shop/checkout" not in page.content()
        finally:
            browser.close()
