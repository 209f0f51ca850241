"""Framework integrations.

``gatekeeper_wsgi.contrib.django`` and ``gatekeeper_wsgi.contrib.flask``.
"""
