"""Views of the test project: each reports what the gatekeeper counted while it ran."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.http import FileResponse, HttpResponse, JsonResponse, StreamingHttpResponse
from gatekeeper_wsgi.contrib.django import gatekeeper_exempt, get_gatekeeper


class Hold:
    """Server-side coordination for the concurrency tests: views that wait for a gate and
    an observer of how many run at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.lock = threading.Condition()
        self.active = 0
        self.max_active = 0
        self.executions = 0

    def enter(self) -> None:
        with self.lock:
            self.active += 1
            self.executions += 1
            self.max_active = max(self.max_active, self.active)
            self.lock.notify_all()

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def running(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` executions run at once; False if ``timeout`` passes first
        (woken by :meth:`enter`, no polling)."""
        with self.lock:
            return self.lock.wait_for(lambda: self.active >= count, timeout=timeout)

    def wait_for_company(self, count: int, deadline: float) -> None:
        """Wait until ``count`` executions run at once or the deadline passes (load shaping:
        it makes overlap likely, the tests assert nothing about it)."""
        with self.lock:
            self.lock.wait_for(
                lambda: self.active >= count, timeout=max(0.0, deadline - time.monotonic())
            )


HOLD = Hold()


def reset_hold() -> Hold:
    """A fresh Hold for the next test."""
    global HOLD
    HOLD = Hold()
    return HOLD


def inflight_now(request: Any) -> JsonResponse:
    """What the gatekeeper counts in flight while this view runs."""
    return JsonResponse({"inflight": get_gatekeeper().inflight()})


def unnamed(request: Any) -> JsonResponse:
    return JsonResponse({"inflight": get_gatekeeper().inflight()})


def status(request: Any, code: int) -> HttpResponse:
    response = HttpResponse(f"status {code}", status=code)
    if request.GET.get("header"):
        response["X-Fault-Code"] = request.GET["header"]
    return response


def body(request: Any) -> HttpResponse:
    return HttpResponse(request.GET.get("text", "ok"))


def boom(request: Any) -> HttpResponse:
    raise RuntimeError("the view failed")


def ending(request: Any) -> Iterator[bytes]:
    """A stream's last chunks: the timeout marker if ``?marker``, a failure if ``?fail``."""
    if request.GET.get("marker"):
        yield b" TIMEOUT"
    if request.GET.get("fail"):
        raise RuntimeError("the stream failed")
    yield b" last"


def stream(request: Any) -> StreamingHttpResponse:
    def chunks() -> Iterator[bytes]:
        yield b"first "
        yield str(get_gatekeeper().inflight().get("site/stream", 0)).encode()
        yield from ending(request)

    return StreamingHttpResponse(chunks())


def astream(request: Any) -> StreamingHttpResponse:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"first "
        for chunk in ending(request):
            yield chunk

    return StreamingHttpResponse(chunks())


def chunks(request: Any) -> StreamingHttpResponse:
    """A stream of a few pieces and no Content-Length (a HEAD's is dropped piece by piece
    by the server)."""
    return StreamingHttpResponse(f"chunk{index}\n".encode() for index in range(3))


def file(request: Any) -> FileResponse:
    return FileResponse(io.BytesIO(b"file body " * 100), filename="data.txt")


def whoami(request: Any) -> JsonResponse:
    return JsonResponse({"inflight": get_gatekeeper().inflight()})


async def async_view(request: Any) -> JsonResponse:
    return JsonResponse({"inflight": get_gatekeeper().inflight()})


def hold(request: Any) -> HttpResponse:
    """Runs until the test opens the gate."""
    current = HOLD
    current.enter()
    try:
        if not current.gate.wait(timeout=30):
            return HttpResponse("the gate never opened", status=500)
        return HttpResponse("held")
    finally:
        current.leave()


def observe(request: Any) -> HttpResponse:
    """Counts how many executions overlap; waits briefly for company to make overlap likely."""
    current = HOLD
    current.enter()
    try:
        current.wait_for_company(3, time.monotonic() + 0.05)
        return HttpResponse("observed")
    finally:
        current.leave()


async def ahold(request: Any) -> HttpResponse:
    """An async view that runs until it is cancelled (the client disconnects)."""
    current = HOLD
    current.enter()
    try:
        await asyncio.Event().wait()
        return HttpResponse("never")
    finally:
        current.leave()


@gatekeeper_exempt
def open_gate(request: Any) -> HttpResponse:
    HOLD.gate.set()
    return HttpResponse("open")


@gatekeeper_exempt
def observed(request: Any) -> JsonResponse:
    return JsonResponse(
        {
            "active": HOLD.active,
            "max_active": HOLD.max_active,
            "executions": HOLD.executions,
            "inflight": get_gatekeeper().inflight(),
        }
    )


@gatekeeper_exempt
def health(request: Any) -> JsonResponse:
    return JsonResponse({"inflight": get_gatekeeper().inflight()})
