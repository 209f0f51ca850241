"""``manage.py gatekeeper check|status|replay``: the ``gatekeeper`` console script's
commands, defaulting to this project's ``settings.GATEKEEPER`` (``gatekeeper_wsgi.cli``
does the work)::

    manage.py gatekeeper check [FILE]             # validate; print the effective limit tree
    manage.py gatekeeper status [--backend URL] [--json] [--all]
    manage.py gatekeeper replay LOG --to URL [--rate 5/s] [--dry-run] [-H 'Name: value']
"""

# mypy: disable-error-code="import-untyped"
# mypy: allow-subclassing-any

from __future__ import annotations

from importlib import import_module
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from gatekeeper_wsgi.errors import ConfigError


class _Out:
    """A text stream over Django's OutputWrapper, which would add a newline per write."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper

    def write(self, text: str) -> int:
        self._wrapper.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self._wrapper.flush()


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"expected 'Name: value', got {text!r}")
    return name.strip(), value.strip()


class Command(BaseCommand):
    help = "Check the limits, watch live counters, replay rejected requests."

    def add_arguments(self, parser: Any) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        check = actions.add_parser(
            "check", help="validate FILE, or settings.GATEKEEPER; print the limit tree"
        )
        check.add_argument("file", nargs="?", metavar="FILE", help="a .toml or .properties file")
        status = actions.add_parser("status", help="live in-flight counts of the backend")
        status.add_argument("--backend", metavar="URL", help="default: the configured backend")
        status.add_argument("--json", action="store_true", dest="as_json", help="print JSON")
        status.add_argument("--all", action="store_true", dest="show_all", help="list 0s too")
        replay = actions.add_parser("replay", help="send logged rejected requests again")
        replay.add_argument("log", metavar="LOG", help="a gatekeeper.rejected log (JSON lines)")
        replay.add_argument("--to", required=True, metavar="URL", help="base URL to send to")
        replay.add_argument("--rate", metavar="N/s", help="at most N requests per second")
        replay.add_argument("--dry-run", action="store_true", help="print, do not send")
        replay.add_argument(
            "--header",
            "-H",
            type=_header,
            action="append",
            default=[],
            metavar="'Name: value'",
            help="add or replace a header (e.g. a redacted Authorization)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Imported when a command runs: loading the command list costs nothing.
        cli = import_module("gatekeeper_wsgi.cli")
        from ...conf import gatekeeper_settings

        out = _Out(self.stdout)
        action = options["action"]
        try:
            if action == "check":
                source: Any = options["file"] or gatekeeper_settings()
                code = cli.run_check(source, out, err=_Out(self.stderr))
            elif action == "status":
                code = cli.run_status(
                    options["backend"],
                    as_json=options["as_json"],
                    out=out,
                    config=gatekeeper_settings(),
                    show_all=options["show_all"],
                )
            else:
                code = cli.run_replay(
                    options["log"],
                    options["to"],
                    rate=options["rate"],
                    dry_run=options["dry_run"],
                    out=out,
                    headers=options["header"],
                )
        except ConfigError as exc:  # settings.GATEKEEPER is not a dict
            raise CommandError(str(exc)) from None
        if code:
            raise CommandError(f"gatekeeper {action} failed (exit status {code})", returncode=code)
