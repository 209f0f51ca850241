"""Framework integrations, when this package is imported from a source checkout that is not
installed (``PYTHONPATH=<checkout>``): they live in the checkout's top-level ``contrib/``
(SPEC §9), which an installed wheel or an editable install maps to
``gatekeeper_wsgi.contrib`` (``[tool.setuptools.package-dir]`` in ``pyproject.toml``). This
file is never installed; it only points the package at that directory."""

from __future__ import annotations

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parent.parent.parent / "contrib")]
