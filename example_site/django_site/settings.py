"""Settings of the example Django site: the gatekeeper middleware first, no database.

The backend comes from ``$GATEKEEPER_BACKEND`` (see :mod:`example_site.common`); the
dashboard at ``/gatekeeper/`` takes the token printed at start-up
(``?token=…`` or ``Authorization: Bearer …``).
"""

from __future__ import annotations

from example_site.common import gatekeeper_settings

SECRET_KEY = "example-site-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "example_site.django_site.urls"
WSGI_APPLICATION = "example_site.django_site.wsgi.application"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "gatekeeper_wsgi.contrib.django",
]
MIDDLEWARE = ["gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"]
DATABASES: dict[str, dict[str, str]] = {}

GATEKEEPER = gatekeeper_settings()
