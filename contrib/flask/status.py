"""The status JSON and dashboard as a Flask blueprint, served by the core
:class:`~gatekeeper_wsgi.status.StatusApp` after a Flask-side access check."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, current_app, request
from werkzeug.wrappers import Response

if TYPE_CHECKING:
    from .extension import GateKeeper

__all__ = ["status_blueprint"]


def _allow_all(environ: Any) -> bool:
    # The blueprint has already checked access; StatusApp only serves.
    return True


def _presented_token() -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.args.get("token") or None


def status_blueprint(
    extension: GateKeeper,
    *,
    url_prefix: str,
    auth: Callable[[], bool] | None,
    name: str,
) -> Blueprint:
    """Build the blueprint behind :meth:`GateKeeper.status_blueprint`."""
    blueprint = Blueprint(name, __name__, url_prefix=url_prefix)

    def allowed() -> bool:
        if auth is not None:
            return bool(auth())
        token = extension.gatekeeper.config.dashboard.token
        presented = _presented_token()
        if token is None or presented is None:
            return False
        return hmac.compare_digest(presented.encode("utf-8"), token.encode("utf-8"))

    def serve(sub_path: str) -> Response:
        if not allowed():
            abort(403)
        from gatekeeper_wsgi.status import StatusApp

        state = extension.state()
        status_app = state.status_app
        if status_app is None:
            status_app = state.status_app = StatusApp(state.gatekeeper, allow=_allow_all)
        environ = dict(request.environ)
        path = request.path
        environ["SCRIPT_NAME"] = request.script_root + path[: len(path) - len(sub_path)]
        environ["PATH_INFO"] = sub_path
        return current_app.response_class.from_app(status_app, environ)

    @blueprint.route("/")
    @extension.exempt
    def dashboard() -> Response:
        return serve("/")

    @blueprint.route("/status.json")
    @extension.exempt
    def status_json() -> Response:
        return serve("/status.json")

    return blueprint
