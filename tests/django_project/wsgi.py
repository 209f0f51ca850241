"""The test project's WSGI app, for gunicorn (``DJANGO_SETTINGS_MODULE`` set by the test)."""

from __future__ import annotations

from django.core.wsgi import get_wsgi_application

application = get_wsgi_application()
