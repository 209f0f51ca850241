"""Views of the example Django site; the limits are in ``settings.GATEKEEPER``."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.views.decorators.http import require_POST
from gatekeeper_wsgi.contrib.django import gatekeeper_exempt

from example_site.common import (
    PASSWORD,
    TIMEOUT_MARKER,
    Capacity,
    Work,
    index,
    queue_wait_header,
    search_answer,
)

#: what /slow and /partner do (tests replace it with one they can finish)
WORK = Work()
#: the backend /search calls
SEARCH = Capacity()


@gatekeeper_exempt
def home(request: Any) -> HttpResponse:
    port = int(request.get_port() or 8000)
    return HttpResponse(index("Django", port), content_type="text/plain")


def slow(request: Any) -> HttpResponse:
    waited = queue_wait_header(request.META)
    WORK.run()
    return HttpResponse("done: slow\n", headers=waited)


def flaky(request: Any) -> HttpResponse:
    # The backend behind this service timed out: the marker holds the slot `delay` s.
    return HttpResponse("backend timed out\n", headers=dict([TIMEOUT_MARKER]))


@require_POST
def login(request: Any) -> HttpResponse:
    if request.POST.get("password") == PASSWORD:
        return HttpResponse("welcome\n")
    return HttpResponse("wrong password\n", status=401)


def partner(request: Any) -> HttpResponse:
    WORK.run()
    caller = request.headers.get("X-Caller-Id", "anonymous")
    return HttpResponse(f"done: partner for {caller}\n")


def search(request: Any) -> HttpResponse:
    from gatekeeper_wsgi.contrib.django import get_gatekeeper

    SEARCH.call()
    return HttpResponse(search_answer(get_gatekeeper()))
