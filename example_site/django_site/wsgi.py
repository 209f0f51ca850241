"""The example Django site's WSGI app, stamped with the arrival time (for the queue-wait
header) outside Django and its gatekeeper middleware."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

from example_site.common import stamp_arrival

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_site.django_site.settings")

application = stamp_arrival(get_wsgi_application())
