"""The status JSON and dashboard as a Flask blueprint, served by the core
:class:`~gatekeeper_wsgi.status.StatusApp` after a Flask-side access check."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flask import Blueprint, current_app, request
from werkzeug.wrappers import Response

from gatekeeper_wsgi.redact import failure_without_message
from gatekeeper_wsgi.requestvalues import wsgi_string

if TYPE_CHECKING:
    from .extension import GateKeeper

__all__ = ["status_blueprint"]

logger = logging.getLogger("gatekeeper")


#: environ key telling the StatusApp that the blueprint's auth hook allowed the request
_ALLOWED_KEY = "gatekeeper.flask.allowed"


def _allowed_by_hook(environ: Any) -> bool:
    return environ.get(_ALLOWED_KEY) is True


def _vouched(auth: Callable[[], bool]) -> bool:
    """Whether the application's auth hook admits this request (a hook that raises does
    not: logged, and the token decides)."""
    try:
        return bool(auth())
    except Exception as exc:
        logger.error(
            "gatekeeper: the status blueprint's auth hook raised; the token decides: %s",
            failure_without_message(exc),
        )
        return False


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
        # The auth hook admits whom it vouches for; anyone else may still show the
        # dashboard token, which the core StatusApp checks (one check for every
        # integration: bearer, or link -> cookie), as Django admits staff or the token.
        from gatekeeper_wsgi.status import StatusApp

        state = extension.state()
        status_app = state.status_app
        if status_app is None:
            status_app = state.status_app = StatusApp(state.gatekeeper, allow=_allowed_by_hook)
        environ = dict(request.environ)
        environ[_ALLOWED_KEY] = auth is not None and _vouched(auth)
        path = request.path
        # werkzeug decoded the path: the status app reads PEP 3333's latin-1 form
        mount = request.script_root + path[: len(path) - len(sub_path)]
        environ["SCRIPT_NAME"] = wsgi_string(mount)
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
