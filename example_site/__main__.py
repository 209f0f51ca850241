"""``python -m example_site [--django | --wsgi] [--port 8000] [--backend URL]``: serve the
example on 127.0.0.1 (Flask by default, on werkzeug's threaded dev server; ``--django``:
the Django site on Django's threaded ``runserver``; ``--wsgi``: the bare WSGI app).

``python -m example_site load [--url URL] [--requests N] [--concurrency C]``: fire
concurrent requests at the running site and count admitted / queued / rejected.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from example_site.common import BACKEND_ENV, banner, dashboard_token


def serve(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_site",
        description="Serve the gatekeeper-wsgi example on 127.0.0.1 "
        "(python -m example_site load --help: the load generator).",
    )
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--django", action="store_true", help="the Django site (runserver)")
    kind.add_argument("--wsgi", action="store_true", help="the bare WSGI app (werkzeug)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--backend",
        help=f"memory (default), shared:///path or redis://host:port/db; sets ${BACKEND_ENV}",
    )
    args = parser.parse_args(argv)
    if args.backend:
        os.environ[BACKEND_ENV] = args.backend
    dashboard_token()  # generated once here, so every part of the process sees the same one

    if args.django:
        os.environ["DJANGO_SETTINGS_MODULE"] = "example_site.django_site.settings"
        import django
        from django.core.management import call_command

        django.setup()
        print(banner("Django", args.port), flush=True)
        call_command("runserver", f"127.0.0.1:{args.port}", use_reloader=False, use_threading=True)
        return 0

    from werkzeug.serving import run_simple

    from gatekeeper_wsgi import ConfigError

    try:  # a backend URL the configuration refuses (or whose extra is missing): one line
        if args.wsgi:
            from example_site.wsgi_demo import ExampleWSGI

            app, server = ExampleWSGI(), "bare WSGI"
        else:
            from example_site.flask_app import create_app

            app, server = create_app(), "Flask"  # type: ignore[assignment]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(banner(server, args.port), flush=True)
    run_simple("127.0.0.1", args.port, app, threaded=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["load"]:
        from example_site.load import main as load

        return load(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
