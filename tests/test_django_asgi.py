"""The Django middleware under Django's ASGI handler: Django adapts it (it is synchronous),
counts and releases the same, and a client that disconnects frees its slot once the view
has stopped."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler
from django.test import AsyncClient
from gatekeeper_wsgi.contrib.django import get_gatekeeper

from tests.conftest import busy
from tests.django_project import configure, views

configure()

DEADLINE = 10.0


def configure_gatekeeper(settings: Any, limits: dict[str, Any]) -> None:
    """This test's GATEKEEPER."""
    settings.GATEKEEPER = {"project": "site", "limits": limits}


class Exchange:
    """One HTTP exchange with Django's ASGIHandler, the client side played by the test."""

    def __init__(self, path: str, query: bytes = b"", method: str = "GET") -> None:
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": [(b"host", b"testserver")],
            "client": ("127.0.0.1", 40000),
            "server": ("testserver", 80),
        }
        self.sent: list[dict[str, Any]] = []
        self.disconnect = asyncio.Event()
        self._request_sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._request_sent:
            self._request_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self) -> None:
        await ASGIHandler()(self.scope, self.receive, self.send)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


async def until(condition: Any, what: str) -> None:
    """Poll ``condition`` on the event loop until it holds; fail after the deadline. Only
    for what no event announces: a sync view's slot, released on its worker thread after
    the exchange the test awaited has ended."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {DEADLINE}s: {what}")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("view", ["work", "async"], ids=["sync-view", "async-view"])
def test_async_client_counts_and_releases(settings: Any, view: str) -> None:
    """Through AsyncClient a sync or `async def` view is counted while it runs, then freed."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {f"site/{view}": {"concurrency": 1}})
        response = await AsyncClient().get(f"/{view}/")
        assert response.status_code == 200
        assert busy(json.loads(response.content)["inflight"]) == {f"site/{view}": 1}
        assert busy(get_gatekeeper()) == {}

    asyncio.run(scenario())


@pytest.mark.filterwarnings("ignore:StreamingHttpResponse must consume synchronous:Warning")
@pytest.mark.parametrize("view", ["stream", "file", "astream", "work"])
def test_a_head_is_released_before_its_headers_go_out(settings: Any, view: str) -> None:
    """A HEAD's headers are its whole answer, and an ASGI server (uvicorn) writes them as
    Django sends them - before Django reads a sync stream's body, in a thread, while the
    event loop takes the client's next request: the slot is free by then, or that request
    is refused by its client's own previous one (SPEC 4.2; uvicorn: 7 in 2 000 HEAD-then-
    GET pairs at concurrency 1)."""
    seen: list[dict[str, int]] = []

    class Head(Exchange):
        async def send(self, message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                seen.append(busy(get_gatekeeper()))
            await super().send(message)

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site": {"concurrency": 1}})
        exchange = Head(f"/{view}/", method="HEAD")
        await exchange.run()
        assert exchange.status == 200  # (Django sends a body; the server drops it)

    asyncio.run(scenario())
    assert seen == [{}]
    assert busy(get_gatekeeper()) == {}


def test_rejection_under_asgi_is_a_service_fault(settings: Any) -> None:
    """Rejections render the same ServiceFault under ASGI."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
        response = await AsyncClient().get("/work/", headers={"X-Request-Id": "asgi-1"})
        assert response.status_code == 503
        assert response.json()["requestId"] == "asgi-1"

    asyncio.run(scenario())


def test_a_receiver_reads_the_whole_body_under_asgi(settings: Any) -> None:
    """Under ASGI too, what the log read of a rejected request's body is given back: a
    request_rejected receiver reads it whole."""
    from gatekeeper_wsgi.contrib.django.signals import request_rejected

    seen: list[bytes] = []

    def receiver(sender: Any, request: Any, **kwargs: Any) -> None:
        seen.append(request.body)

    body = b"<order>" + b"z" * 3000 + b"</order>"

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
        response = await AsyncClient().post("/work/", data=body, content_type="text/plain")
        assert response.status_code == 503

    logger = logging.getLogger("gatekeeper.rejected")
    level = logger.level
    logger.setLevel(logging.INFO)  # the log reads the body's start
    request_rejected.connect(receiver)
    try:
        asyncio.run(scenario())
    finally:
        request_rejected.disconnect(receiver)
        logger.setLevel(level)
    assert seen == [body]


def test_async_stream_is_released_when_sent(settings: Any) -> None:
    """An async StreamingHttpResponse holds its slot until the handler closes it."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/astream": {"concurrency": 1}})
        exchange = Exchange("/astream/")
        await exchange.run()
        assert exchange.status == 200
        assert exchange.body == b"first  last"
        assert busy(get_gatekeeper()) == {}

    asyncio.run(scenario())


# Django's ASGIHandler leaves its request body file unclosed when a stream raises.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_async_stream_error_is_faulty(settings: Any) -> None:
    """An async stream that raises is faulty (delayed), though ASGI never closes it."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/astream": {"concurrency": 1, "delay": 3600}})
        exchange = Exchange("/astream/", b"fail=1")
        with pytest.raises(RuntimeError, match="the stream failed"):
            await exchange.run()
        assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 1

    asyncio.run(scenario())
    gc.collect()  # that leaked file is collected here, under this test's filter


def test_async_stream_marker_is_faulty(settings: Any) -> None:
    """`timeout_body` is scanned in async streamed content."""

    async def scenario() -> None:
        configure_gatekeeper(
            settings, {"site/astream": {"concurrency": 1, "delay": 3600, "timeout_body": "TIMEOUT"}}
        )
        exchange = Exchange("/astream/", b"marker=1")
        await exchange.run()
        assert b"TIMEOUT" in exchange.body
        assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 1

    asyncio.run(scenario())


def test_concurrency_limit_is_exact_under_asgi(settings: Any) -> None:
    """Concurrent ASGI requests: holders run, the rest are rejected, all slots return."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/hold": {"concurrency": 2}})
        hold = views.reset_hold()
        try:
            holders = [Exchange("/hold/") for _ in range(2)]
            tasks = [asyncio.create_task(exchange.run()) for exchange in holders]
            assert await asyncio.to_thread(hold.running, 2, DEADLINE), "two views running"
            extra = [Exchange("/hold/") for _ in range(3)]
            await asyncio.gather(*(exchange.run() for exchange in extra))
            assert [exchange.status for exchange in extra] == [503, 503, 503]
        finally:
            hold.gate.set()
        await asyncio.gather(*tasks)
        assert [exchange.status for exchange in holders] == [200, 200]
        assert hold.max_active == 2
        assert busy(get_gatekeeper()) == {}

    asyncio.run(scenario())


def test_disconnect_frees_the_slot_when_the_view_stops(settings: Any) -> None:
    """A client gone during a sync view: its slot returns when the view ends, undelayed."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/hold": {"concurrency": 1, "delay": 3600}})
        hold = views.reset_hold()
        exchange = Exchange("/hold/")
        task = asyncio.create_task(exchange.run())
        try:
            assert await asyncio.to_thread(hold.running, 1, DEADLINE), "the view running"
            exchange.disconnect.set()
            assert busy(get_gatekeeper()) == {"site/hold": 1}
        finally:
            hold.gate.set()
        await task
        await until(lambda: not busy(get_gatekeeper()), "the slot back")
        assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 0

    asyncio.run(scenario())


def test_disconnect_cancels_an_async_view_and_frees_its_slot(settings: Any) -> None:
    """A client gone during an async view: the view is cancelled, the slot returns undelayed."""

    async def scenario() -> None:
        configure_gatekeeper(settings, {"site/ahold": {"concurrency": 1, "delay": 3600}})
        hold = views.reset_hold()
        exchange = Exchange("/ahold/")
        task = asyncio.create_task(exchange.run())
        assert await asyncio.to_thread(hold.running, 1, DEADLINE), "the view running"
        assert busy(get_gatekeeper()) == {"site/ahold": 1}
        exchange.disconnect.set()
        await task
        assert hold.active == 0
        assert exchange.sent == []
        assert busy(get_gatekeeper()) == {}
        assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 0

    asyncio.run(scenario())
