"""Settings of the test project: GateKeeper first, sessions and auth below it."""

from __future__ import annotations

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = "tests.django_project.urls"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "gatekeeper_wsgi.contrib.django",
]
MIDDLEWARE = [
    "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "tests.django_project.middleware.TestHooksMiddleware",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
LOGIN_URL = "/login/"
# The tests share one process with the rest of the suite: leave logging as pytest set it.
LOGGING_CONFIG = None

#: The gunicorn test's limits; in-process tests override GATEKEEPER per test.
GATEKEEPER = {
    "project": "site",
    "dashboard": {"token": "test-token"},
    "limits": {
        "site/hold": {"concurrency": 3},
        "site/observe": {"concurrency": 3},
        "site/file": {"concurrency": 1},
        "site/chunks": {"concurrency": 1},
    },
}
