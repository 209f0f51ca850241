"""Flask integration: ``from gatekeeper_wsgi.contrib.flask import GateKeeper``.

::

    from flask import Flask
    from gatekeeper_wsgi.contrib.flask import GateKeeper

    app = Flask(__name__)
    app.config["GATEKEEPER"] = {"project": "shop", "limits": {"shop": {"concurrency": 100}}}
    gk = GateKeeper(app)

    @app.route("/checkout")
    @gk.limit(concurrency=10, delay=2.0)
    def checkout() -> str:
        return "ok"

Requests are admitted and released by the core
:class:`~gatekeeper_wsgi.middleware.GateKeeperMiddleware` wrapped around ``app.wsgi_app``;
this package only names the request (blueprint -> project, endpoint -> service) and turns
decorators into limits.
"""

from __future__ import annotations

try:
    import flask  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "gatekeeper_wsgi.contrib.flask needs Flask; install the 'flask' extra: "
        "pip install 'gatekeeper-wsgi[flask]'"
    ) from exc

from .extension import UNRESOLVED_SERVICE, GateKeeper

__all__ = ["UNRESOLVED_SERVICE", "GateKeeper"]
