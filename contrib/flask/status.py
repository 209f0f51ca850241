"""The status JSON and dashboard as a Flask blueprint, served by the core
:class:`~gatekeeper_wsgi.status.StatusApp` after a Flask-side access check."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Blueprint, abort, current_app, request
from werkzeug.wrappers import Response

if TYPE_CHECKING:
    from .extension import GateKeeper

__all__ = ["status_blueprint"]


#: environ key telling the StatusApp that the blueprint's auth hook allowed the request
_ALLOWED_KEY = "gatekeeper.flask.allowed"


def _allowed_by_hook(environ: Any) -> bool:
    return environ.get(_ALLOWED_KEY) is True


def status_blueprint(
    extension: GateKeeper,
    *,
    url_prefix: str,
    auth: Callable[[], bool] | None,
    name: str,
) -> Blueprint:
    """Build the blueprint behind :meth:`GateKeeper.status_blueprint`."""
    blueprint = Blueprint(name, __name__, url_prefix=url_prefix)

    def serve(sub_path: str) -> Response:
        # With an auth hook, it alone decides; without, the core StatusApp checks the
        # dashboard token (one check for every integration: bearer, or link -> cookie).
        if auth is not None and not auth():
            abort(403)
        from gatekeeper_wsgi.status import StatusApp

        state = extension.state()
        status_app = state.status_app
        if status_app is None:
            status_app = state.status_app = StatusApp(state.gatekeeper, allow=_allowed_by_hook)
        environ = dict(request.environ)
        environ[_ALLOWED_KEY] = auth is not None
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
