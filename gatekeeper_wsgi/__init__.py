"""gatekeeper-wsgi: exact concurrency and rate limits for WSGI, Django and Flask."""

from __future__ import annotations

from gatekeeper_wsgi.errors import BackendError, ConfigError, Rejected

__all__ = ["BackendError", "ConfigError", "Rejected"]
__version__ = "0.1.0"
