"""gatekeeper-wsgi: exact concurrency and rate limits for WSGI, Django and Flask.

::

    from gatekeeper_wsgi import GateKeeperMiddleware

    app = GateKeeperMiddleware(app, {"project": "shop", "limits": {"shop": {"concurrency": 100}}})
"""

from __future__ import annotations

from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import BackendError, ConfigError, Rejected
from gatekeeper_wsgi.middleware import GateKeeperMiddleware

__all__ = [
    "Admission",
    "BackendError",
    "ConfigError",
    "GateKeeper",
    "GateKeeperMiddleware",
    "Rejected",
]
__version__ = "0.1.0"
