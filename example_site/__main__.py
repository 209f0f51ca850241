"""``python -m example_site [PORT]``: serve the demo on 127.0.0.1."""

from __future__ import annotations

import sys

from example_site.wsgi_demo import serve

if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
