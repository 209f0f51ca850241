"""The status endpoint and live dashboard: a framework-free WSGI app over a GateKeeper.

``/`` and ``/dashboard`` serve one self-contained HTML page (no CDN: its CSS and script
are inlined) that shows in-flight bars per limit against their limits, rejections over
time and the stage-timing table, refreshed by fetching ``status.json`` without reloading
the page. ``/status.json`` serves :func:`status_payload`.

Access: the token (``Authorization: Bearer <token>`` for scrapers; a ``?token=<token>``
link for browsers, exchanged by a redirect for an ``HttpOnly``, ``SameSite=Strict`` cookie
so the token leaves the URL at once, see :func:`~gatekeeper_wsgi.access.check_token`), or an
``allow(environ) -> bool`` callable with which the Django and Flask plugins plug in their
own authentication (staff users, login). With neither, everyone is denied::

    from werkzeug.middleware.dispatcher import DispatcherMiddleware
    from gatekeeper_wsgi.status import StatusApp

    app = GateKeeperMiddleware(app, settings)
    app = DispatcherMiddleware(app, {"/gatekeeper": StatusApp(app.gatekeeper, token="s3cret")})
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from gatekeeper_wsgi.access import check_token
from gatekeeper_wsgi.backends.base import KeyUsage, LimitTotals
from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.limitindex import counting_limit, counts
from gatekeeper_wsgi.redact import failure_without_message, mask_url
from gatekeeper_wsgi.values import Limit

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

    from gatekeeper_wsgi.engine import GateKeeper

__all__ = [
    "StatusApp",
    "inflight_by_limit",
    "limit_of",
    "limit_totals",
    "public_backend_url",
    "render_dashboard",
    "status_payload",
]

logger = logging.getLogger("gatekeeper")

#: concrete keys shown per wildcard limit (the busiest first, then those refused lately);
#: the totals count all of them
KEYS_SHOWN_PER_LIMIT = 50

Allow = Callable[["WSGIEnvironment"], bool]


# --- which configured limit counts a concrete path --------------------------------------


def limit_of(config: Config, path: str) -> Limit | None:
    """The configured limit a concrete path (``shop/login/alice``) is counted under: the
    one admission resolves for it (:func:`~gatekeeper_wsgi.limitindex.counting_limit`),
    if it counts. O(segments), however many limits are configured, so grouping a
    backend's keys (one that keeps no totals) costs O(keys), not O(keys x limits).
    """
    return counting_limit(config.limit_index, path)


def inflight_by_limit(
    config: Config, inflight: Mapping[str, int]
) -> dict[str | None, dict[str, int]]:
    """Concrete in-flight counts grouped by configured limit path (None: no longer
    configured, e.g. after a reload)."""
    grouped: dict[str | None, dict[str, int]] = {}
    for path, count in inflight.items():
        limit = limit_of(config, path)
        grouped.setdefault(None if limit is None else limit.path, {})[path] = count
    return grouped


def public_backend_url(url: str) -> str:
    """The backend URL with its credentials masked, fit to show (:func:`redact.mask_url`)."""
    return mask_url(url)


# --- the JSON payload -------------------------------------------------------------------


def _limit_summary(limit: Limit) -> dict[str, Any]:
    return {
        "path": limit.path,
        "level": limit.level,
        "concurrency": limit.concurrency,
        "rate": None if limit.rate is None else limit.rate.text,
        "key": limit.key if limit.level == "caller" else None,
        "queue": None
        if limit.queue is None
        else {"size": limit.queue.size, "wait": limit.queue.wait},
        "delay": limit.delay,
        "mode": limit.mode,
        "wildcard": limit.wildcard,
        # concurrency = "auto": "concurrency" is its max; stats.adaptive has the current value
        "adaptive": None
        if limit.adaptive is None
        else {
            "algorithm": limit.adaptive.algorithm,
            "min": limit.adaptive.min,
            "max": limit.adaptive.max,
            "initial": limit.adaptive.initial,
        },
    }


def limit_totals(
    gatekeeper: GateKeeper, *, top: int = KEYS_SHOWN_PER_LIMIT
) -> dict[str, LimitTotals]:
    """Per counting limit path: in flight summed over its keys, keys tracked and in
    flight, and details of up to ``top`` of its busiest keys plus those refused lately.

    Read from the totals the backend keeps (memory, shared, Redis: O(limits)); a backend
    that keeps none is read whole with ``inflight()`` and grouped here, O(tracked keys),
    without rate usage. Raises what the backend raises.
    """
    kept = gatekeeper.totals(top=top)
    if kept is not None:
        return kept
    config = gatekeeper.config
    grouped = inflight_by_limit(config, gatekeeper.inflight())
    totals: dict[str, LimitTotals] = {}
    for limit in config.limits.values():
        if not counts(limit):
            continue
        by_key = grouped.get(limit.path, {})
        busy = sorted(
            ((path, n) for path, n in by_key.items() if n > 0), key=lambda item: (-item[1], item[0])
        )
        details = [KeyUsage(path, n, None, 0.0) for path, n in busy[:top]]
        if not limit.wildcard and not details:
            details = [KeyUsage(limit.path, by_key.get(limit.path, 0), None, 0.0)]
        totals[limit.path] = LimitTotals(
            sum(by_key.values()), len(by_key), len(busy), tuple(details)
        )
    return totals


def status_payload(gatekeeper: GateKeeper) -> dict[str, Any]:
    """What ``/status.json`` serves: counters, stage timings, in-flight per limit and per
    concrete path (the busiest keys and those refused lately, with their rate window use)
    with the limit counting it, rejections per second of the last minutes
    (``rejections_recent``: seconds ago and counts by code), and a summary of the
    configuration.

    It costs O(limits) with backends that keep totals, however many keys they track (the
    adaptive limits reported are those of the paths shown). A
    failing backend never raises here: its message goes into the ``error`` member and the
    process-local counters are still reported.
    """
    config = gatekeeper.config
    payload: dict[str, Any] = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "pid": os.getpid(),
        "config": {
            "project": config.project,
            "backend": public_backend_url(config.backend),
            "mode": config.mode,
            "on_backend_error": config.on_backend_error,
            "reload_file": config.reload.file,
        },
    }
    errors = []
    try:
        totals = limit_totals(gatekeeper)
    except Exception as exc:
        errors.append(f"inflight: {type(exc).__name__}: {exc}")
        totals = {}
    try:
        # The adaptive limits of the paths shown: each exact one, and a wildcard's keys
        # listed (not one report per key it tracks, which may be 100 000).
        shown: list[str] = []
        for limit in config.limits.values():
            if limit.adaptive is not None:
                found = totals.get(limit.path) if limit.wildcard else None
                shown += [limit.path] if found is None else [usage.key for usage in found.top]
        payload["stats"] = gatekeeper.stats(adaptive_keys=shown)
    except Exception as exc:
        errors.append(f"stats: {type(exc).__name__}: {exc}")
        payload["stats"] = gatekeeper.monitor.snapshot(0)
    limits = []
    concrete: dict[str, dict[str, Any]] = {}
    for limit in sorted(config.limits.values(), key=lambda lim: lim.path):
        summary = _limit_summary(limit)
        counting = counts(limit)
        found = totals.get(limit.path)
        if found is None:
            details: tuple[KeyUsage, ...] = ()
            if counting and not limit.wildcard:
                details = (KeyUsage(limit.path, 0, None, 0.0),)
            found = LimitTotals(0, 0, 0, details)
        summary["inflight"] = found.inflight
        summary["keys"] = found.busy if limit.wildcard else len(found.top)
        summary["tracked"] = found.keys
        # of the keys in flight, how many are listed (the rest are counted in "keys")
        summary["keys_shown"] = sum(
            1 for usage in found.top if usage.inflight or not limit.wildcard
        )
        for usage in found.top:
            concrete[usage.key] = _key_entry(limit, usage)
        limits.append(summary)
    payload["config"]["limits"] = limits
    payload["inflight"] = concrete
    payload["rejections_recent"] = [
        {"ago": ago, "counts": counts} for ago, counts in gatekeeper.monitor.recent_rejections()
    ]
    if errors:
        payload["error"] = "; ".join(errors)
    return payload


def _key_entry(limit: Limit, usage: KeyUsage) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "inflight": usage.inflight,
        "limit": limit.path,
        "concurrency": limit.concurrency,
        "rate": None if limit.rate is None else limit.rate.text,
    }
    if limit.rate is not None:
        # None: the backend cannot tell (it keeps no totals).
        entry["used"] = usage.used
        entry["remaining"] = None if usage.used is None else max(0, limit.rate.limit - usage.used)
        entry["resets_in"] = round(usage.resets_in, 3)
    return entry


# --- the HTML page ----------------------------------------------------------------------


@cache
def _asset(name: str) -> str:
    return resources.files("gatekeeper_wsgi").joinpath("static").joinpath(name).read_text("utf-8")


def render_dashboard(json_url: str, *, nonce: str, refresh_seconds: float = 2.0) -> str:
    """The dashboard page; its script fetches ``json_url`` every ``refresh_seconds``.

    ``nonce`` must match the ``Content-Security-Policy`` sent with the page
    (see :func:`security_headers`).
    """
    values = {
        "nonce": html.escape(nonce, quote=True),
        "json_url": html.escape(json_url, quote=True),
        "refresh_ms": str(max(100, int(refresh_seconds * 1000))),
        "css": _asset("dashboard.css"),
        "js": _asset("dashboard.js"),
    }
    # In one pass over the template: a value holding a placeholder's text (a SCRIPT_NAME
    # a proxy header set to "/x{{js}}") is not replaced in its turn.
    return _PLACEHOLDER.sub(lambda found: values[found[1]], _asset("dashboard.html"))


_PLACEHOLDER = re.compile(r"\{\{(nonce|json_url|refresh_ms|css|js)\}\}")


def security_headers(nonce: str | None = None) -> list[tuple[str, str]]:
    """Headers every status response carries; with a nonce, the page's CSP."""
    headers = [
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("X-Frame-Options", "DENY"),
    ]
    if nonce is not None:
        headers.append(
            (
                "Content-Security-Policy",
                f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; "
                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
            )
        )
    return headers


class StatusApp:
    """A WSGI app serving the dashboard (``/``, ``/dashboard``) and ``/status.json``.

    ``token`` (default: the ``dashboard.token`` setting) is accepted as
    ``Authorization: Bearer <token>``, or from a ``?token=<token>`` link exchanged for a
    cookie (:func:`~gatekeeper_wsgi.access.check_token`). ``allow(environ) -> bool``
    admits requests the hosting framework has authenticated (Django staff, Flask login);
    a ``?token=`` in their URL is still taken out by the redirect.
    With neither, every request gets 403::

        status = StatusApp(gk, token="s3cret")
        status = StatusApp(gk, allow=lambda environ: environ.get("REMOTE_USER") == "ops")
    """

    def __init__(
        self,
        gatekeeper: GateKeeper,
        *,
        token: str | None = None,
        allow: Allow | None = None,
        refresh_seconds: float = 2.0,
    ) -> None:
        if token is not None and not token.strip():
            # token=os.environ.get("GK_TOKEN", "") with the variable unset: a "?token="
            # link would match it and let anyone in.
            raise ValueError(
                "StatusApp token must not be empty (None: the dashboard.token setting)"
            )
        self.gatekeeper = gatekeeper
        self._token = token
        self._allow = allow
        self.refresh_seconds = refresh_seconds

    @property
    def token(self) -> str | None:
        """The token in force: the constructor's, else the ``dashboard.token`` setting."""
        if self._token is not None:
            return self._token
        return self.gatekeeper.config.dashboard.token

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        path = path.rstrip("/") or "/"
        wants_json = path == "/status.json"
        if not wants_json and path not in ("/", "/dashboard"):
            return _respond(start_response, "404 Not Found", "not found", environ, json_=False)
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _respond(
                start_response,
                "405 Method Not Allowed",
                "method not allowed",
                environ,
                json_=wants_json,
                extra=[("Allow", "GET, HEAD")],
            )
        # A token rotated in the file must hold even when no other request came to
        # check it: a status read checks the file as a request does.
        self.gatekeeper.reload_if_due()
        denied = self._denied(environ)
        if denied is not None:
            status, message, extra = denied
            return _respond(start_response, status, message, environ, json_=wants_json, extra=extra)
        if wants_json:
            body = json.dumps(status_payload(self.gatekeeper), ensure_ascii=True).encode("ascii")
            headers = [("Content-Type", "application/json"), *security_headers()]
        else:
            script_name = environ.get("SCRIPT_NAME", "").rstrip("/")
            nonce = secrets.token_urlsafe(16)
            page = render_dashboard(
                script_name + "/status.json", nonce=nonce, refresh_seconds=self.refresh_seconds
            )
            body = page.encode("utf-8")
            headers = [("Content-Type", "text/html; charset=utf-8"), *security_headers(nonce)]
        headers.append(("Content-Length", str(len(body))))
        start_response("200 OK", headers)
        return [] if method == "HEAD" else [body]

    def _denied(self, environ: WSGIEnvironment) -> tuple[str, str, list[tuple[str, str]]] | None:
        """None when the request may see the status, else (status, message, headers)."""
        allowed = False
        if self._allow is not None:
            try:
                allowed = bool(self._allow(environ))
            except Exception as exc:
                logger.error(
                    "gatekeeper: the status endpoint's allow() raised; denied: %s",
                    failure_without_message(exc),
                )
        return check_token(environ, self.token, allowed=allowed)


def _respond(
    start_response: StartResponse,
    status: str,
    message: str,
    environ: Mapping[str, Any],
    *,
    json_: bool,
    extra: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    # Messages are fixed strings: nothing from the request is echoed.
    if json_:
        body = json.dumps({"error": message}).encode("ascii")
        content_type = "application/json"
    else:
        body = (message + "\n").encode("ascii")
        content_type = "text/plain; charset=utf-8"
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    headers += security_headers() + (extra or [])
    start_response(status, headers)
    return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]
