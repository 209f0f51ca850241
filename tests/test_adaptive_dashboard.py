"""Adaptive limits on the status JSON and the live dashboard (real loopback server, real
headless Chromium): the meter is drawn against the current limit, and a chart shows the
limit over time next to in-flight."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.serving import make_server

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.status import StatusApp
from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS, TOKEN, Site, _chromium_or_skip

LIMITS = {
    "shop": {"concurrency": 20},
    "shop/checkout": {"concurrency": "auto", "adaptive": {"algorithm": "vegas", "initial": 2}},
}


def get(site: Site, path: str) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{site.port}{path}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def site() -> Iterator[Site]:
    """The dashboard's test site with an adaptive limit; released and stopped afterwards."""
    running = Site(LIMITS)
    try:
        yield running
    finally:
        running.close()


def test_status_json_describes_the_adaptive_limit(site: Site) -> None:
    """status.json names the algorithm and bounds, and its stats carry the current limit."""
    site.hold("/checkout")
    payload = get(site, "/gatekeeper/status.json")
    summary = next(lim for lim in payload["config"]["limits"] if lim["path"] == "shop/checkout")
    assert summary["adaptive"] == {"algorithm": "vegas", "min": 1, "max": 1000, "initial": 2}
    assert payload["stats"]["adaptive"]["shop/checkout"]["limit"] == 2
    plain = next(lim for lim in payload["config"]["limits"] if lim["path"] == "shop")
    assert plain["adaptive"] is None


def test_dashboard_draws_the_current_limit_and_its_line(site: Site) -> None:
    """Two held requests fill the adaptive limit of 2: the meter says 2 / 2 (not / 1000)
    and the adaptive chart shows a limit line and an in-flight line with the values."""
    sync_api = _chromium_or_skip()
    expect = sync_api.expect
    site.hold("/checkout")
    site.hold("/checkout")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"http://127.0.0.1:{site.port}/gatekeeper/?token={TOKEN}")
            expect.set_options(timeout=20_000)
            row = page.locator('[data-limit="shop/checkout"]')
            expect(row.locator(".count")).to_have_text("2 / 2")
            expect(row.locator(".tag")).to_contain_text("auto vegas")
            expect(page.locator("#adaptive-panel")).to_be_visible()
            legend = page.locator('[data-adaptive="shop/checkout"]')
            expect(legend).to_have_text("shop/checkout: limit 2, in flight 2")
            chart = page.get_by_test_id("adaptive-chart")
            expect(chart.locator('polyline[data-series="limit"]')).to_have_count(1)
            expect(chart.locator('polyline[data-series="inflight"]')).to_have_count(1)
        finally:
            browser.close()


def test_dashboard_hides_the_adaptive_panel_without_adaptive_limits() -> None:
    """A configuration without "auto" shows no adaptive panel."""
    sync_api = _chromium_or_skip()
    expect = sync_api.expect
    keeper = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 3}}})
    server = make_server("127.0.0.1", 0, StatusApp(keeper, token=TOKEN), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.server_port}/?token={TOKEN}")
                expect(page.get_by_test_id("state")).to_have_text("live", timeout=20_000)
                expect(page.locator("#adaptive-panel")).to_be_hidden()
            finally:
                browser.close()
    finally:
        server.shutdown()
        thread.join(30)
        keeper.close()
