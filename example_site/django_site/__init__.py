"""The example as a Django site (``python -m example_site --django``), limited by
``gatekeeper_wsgi.contrib.django.GateKeeperMiddleware``."""
