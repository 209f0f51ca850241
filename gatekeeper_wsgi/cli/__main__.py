"""``python -m gatekeeper_wsgi.cli``: the ``gatekeeper`` console script."""

from __future__ import annotations

import sys

from gatekeeper_wsgi.cli import main

if __name__ == "__main__":  # importing this module (a scan of the package) runs nothing
    sys.exit(main())
