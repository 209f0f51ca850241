"""``manage.py gatekeeper check|status|replay``: the ``gatekeeper`` console script's
commands, defaulting to this project's ``settings.GATEKEEPER`` (``gatekeeper_wsgi.cli``
does the work)::

    manage.py gatekeeper check [FILE]             # validate; print the effective limit tree
    manage.py gatekeeper status [--backend URL] [--config FILE] [--json] [--all]
    manage.py gatekeeper replay LOG --to URL [--rate 5/s] [--dry-run] [-H 'Name: value']
"""

from __future__ import annotations

from argparse import SUPPRESS, Namespace
from importlib import import_module
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, OutputWrapper

from gatekeeper_wsgi.errors import ConfigError

# BaseCommand.create_parser's options: (flags, argparse keywords).
_COMMON_OPTIONS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (("-v", "--verbosity"), {"type": int, "choices": [0, 1, 2, 3]}),
    (("--settings",), {}),
    (("--pythonpath",), {}),
    (("--traceback",), {"action": "store_true"}),
    (("--no-color",), {"action": "store_true"}),
    (("--force-color",), {"action": "store_true"}),
    (("--skip-checks",), {"action": "store_true"}),
)


class _Out:
    """A text stream over Django's OutputWrapper, which would add a newline per write."""

    def __init__(self, wrapper: OutputWrapper) -> None:
        self._wrapper = wrapper

    def write(self, text: str) -> int:
        self._wrapper.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self._wrapper.flush()


class Command(BaseCommand):
    help = "Check the limits, watch live counters, replay rejected requests."

    def add_arguments(self, parser: CommandParser) -> None:
        cli = import_module("gatekeeper_wsgi.cli")
        # Django's parser raises CommandError itself; argparse subparsers need that class.
        commands = parser.add_subparsers(
            dest="command", required=True, metavar="ACTION", parser_class=type(parser)
        )
        cli.add_commands(commands, has_settings=True)
        # Django's common options after the action too (`manage.py gatekeeper check
        # --settings x`), as every Django command takes them; given there, they win.
        for action in commands.choices.values():
            for flags, kwargs in _COMMON_OPTIONS:
                action.add_argument(*flags, default=SUPPRESS, help=SUPPRESS, **kwargs)

    def handle(self, *args: Any, **options: Any) -> None:
        # Imported when a command runs: loading the command list costs nothing.
        cli = import_module("gatekeeper_wsgi.cli")
        from ...conf import gatekeeper_settings

        action = options["command"]
        try:
            code = cli.run_command(
                Namespace(**options),
                _Out(self.stdout),
                _Out(self.stderr),
                settings=gatekeeper_settings(),
            )
        except ConfigError as exc:  # settings.GATEKEEPER is not a dict
            raise CommandError(str(exc)) from None
        if code:
            raise CommandError(f"gatekeeper {action} failed (exit status {code})", returncode=code)
