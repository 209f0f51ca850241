"""The status JSON and the dashboard as Django views, served by the core
:class:`~gatekeeper_wsgi.status.StatusApp` after a Django-side access check.

Access: active staff users (``user.is_staff``; needs ``AuthenticationMiddleware``), or the
``dashboard.token`` setting presented as ``Authorization: Bearer <token>`` (for monitoring
scrapers) or by a ``?token=<token>`` link, exchanged for a cookie by a redirect that drops
it from the URL, staff users' links too (:func:`gatekeeper_wsgi.access.check_token`).
Anonymous browsers are sent to ``LOGIN_URL`` for the dashboard, logged-in non-staff users
get 403, anonymous clients of ``status.json`` 401 (403 when no token is configured). Pass
``allow`` in a pattern's kwargs to use another rule::

    path("ops/status.json", status_json, {"allow": lambda request: request.user.is_superuser})
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from io import BytesIO
from typing import TYPE_CHECKING

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden

from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.requestvalues import wsgi_string

from .conf import get_gatekeeper
from .decorators import gatekeeper_exempt

if TYPE_CHECKING:
    from _typeshed import OptExcInfo
    from _typeshed.wsgi import WSGIEnvironment

    from gatekeeper_wsgi.status import StatusApp

__all__ = ["dashboard", "is_staff", "status_json"]

#: environ key telling the StatusApp that Django already allowed the request
_ALLOWED_KEY = "gatekeeper.django.allowed"

Allow = Callable[[HttpRequest], bool]

_status_app: tuple[GateKeeper, StatusApp] | None = None


def is_staff(request: HttpRequest) -> bool:
    """The default access rule: an authenticated, active staff user."""
    user = getattr(request, "user", None)
    return bool(
        user is not None
        and user.is_authenticated
        and getattr(user, "is_active", False)
        and getattr(user, "is_staff", False)
    )


def _allowed_by_django(environ: WSGIEnvironment) -> bool:
    return environ.get(_ALLOWED_KEY) is True


def _status_app_for(keeper: GateKeeper) -> StatusApp:
    global _status_app
    current = _status_app
    if current is not None and current[0] is keeper:
        return current[1]
    from gatekeeper_wsgi.status import StatusApp

    app = StatusApp(keeper, allow=_allowed_by_django)
    _status_app = (keeper, app)
    return app


def _serve(request: HttpRequest, sub_path: str, allow: Allow) -> HttpResponse:
    from gatekeeper_wsgi.access import presents_token

    allowed = allow(request)
    if not allowed and not presents_token(request.META):
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return HttpResponseForbidden("forbidden: staff only\n", content_type="text/plain")
        if sub_path == "/":
            return redirect_to_login(request.get_full_path())
        # An anonymous API client: the StatusApp answers 401 with a Bearer challenge.
    path = request.path
    environ = {key: value for key, value in request.META.items() if isinstance(key, str)}
    environ.update(
        {
            _ALLOWED_KEY: allowed,
            "REQUEST_METHOD": request.method,
            # Django decoded the path: the status app reads PEP 3333's latin-1 form
            "SCRIPT_NAME": wsgi_string(
                path[: len(path) - len(sub_path)] if path.endswith(sub_path) else path
            ),
            "PATH_INFO": sub_path,
            "QUERY_STRING": request.META.get("QUERY_STRING", ""),
            "wsgi.input": BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": request.scheme,
        }
    )
    captured: list[tuple[str, list[tuple[str, str]]]] = []

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: OptExcInfo | None = None
    ) -> Callable[[bytes], object]:
        captured[:] = [(status, headers)]
        return lambda data: None

    result = _status_app_for(get_gatekeeper())(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()
    ((status, headers),) = captured
    code, _, reason = status.partition(" ")
    response = HttpResponse(body, status=int(code), reason=reason or None)
    for name, value in headers:
        if name.lower() == "set-cookie":
            # Into the response's cookies, where Django (and its test client, which
            # keeps nothing from a raw Set-Cookie header) looks for them.
            response.cookies.load(value)
        else:
            response[name] = value
    return response


@gatekeeper_exempt
def status_json(request: HttpRequest, allow: Allow = is_staff) -> HttpResponse:
    """Live counters, in-flight per limit and stage timings as JSON."""
    return _serve(request, "/status.json", allow)


@gatekeeper_exempt
def dashboard(request: HttpRequest, allow: Allow = is_staff) -> HttpResponse:
    """The live HTML dashboard (it polls ``status.json`` next to it)."""
    return _serve(request, "/", allow)
