"""Runnable demos of gatekeeper-wsgi (``python -m example_site``)."""
