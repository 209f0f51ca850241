"""The option table of the ``check``, ``status`` and ``replay`` commands: written once, and
turned into argparse subcommands (``gatekeeper``, ``manage.py gatekeeper``) here and into
click commands (``flask gatekeeper``) by the Flask plugin, so the three programs take the
same options with the same help, defaults and parsing.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gatekeeper_wsgi.cli.replay import REPLAY_EPILOG, parse_header, parse_rate, parse_timeout

__all__ = ["COMMANDS", "Command", "Option", "add_commands"]


@dataclass(frozen=True)
class Option:
    """One argument of a command: a positional (``name`` without dashes) or an option.

    ``parse`` converts the text given (raising ValueError with the message to show);
    ``flag`` takes no value; ``repeat`` collects every use into a list.
    """

    name: str
    help: str
    metavar: str | None = None
    #: the destination name (default: from ``name``)
    dest: str | None = None
    #: a second, short spelling (``-H``)
    short: str | None = None
    flag: bool = False
    required: bool = False
    repeat: bool = False
    parse: Callable[[str], Any] | None = None
    default: Any = None
    #: a positional that a framework's settings stand in for (``check`` without FILE)
    settings_default: str | None = None

    @property
    def positional(self) -> bool:
        return not self.name.startswith("-")

    @property
    def key(self) -> str:
        """The name the parsed value is stored under."""
        return self.dest or self.name.lstrip("-").replace("-", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.name,) if self.short is None else (self.name, self.short)


@dataclass(frozen=True)
class Command:
    """One command: its name, help texts and options. ``uses_settings``: a framework's
    settings stand in for what the command line leaves out (FILE, ``--config``)."""

    name: str
    help: str
    options: tuple[Option, ...]
    description: str | None = None
    epilog: str | None = None
    uses_settings: bool = True

    def needs_settings(self, values: Mapping[str, Any]) -> bool:
        """Whether a run with these parsed ``values`` reads the framework's settings."""
        if not self.uses_settings:
            return False
        return all(
            values.get(option.key) is None
            for option in self.options
            if option.settings_default is not None
        )


COMMANDS: tuple[Command, ...] = (
    Command(
        "check",
        "validate a config file and print the effective limit tree",
        (
            Option(
                "file",
                "a .toml or .properties file",
                metavar="FILE",
                settings_default="the settings",
            ),
        ),
    ),
    Command(
        "status",
        "live in-flight counts of a shared or Redis backend",
        (
            Option("--backend", "shared:///path or redis://host:port/db", metavar="URL"),
            Option("--config", "name each path's limit (and backend)", metavar="FILE"),
            Option("--json", "print JSON", flag=True),
            Option("--all", "also list paths at 0", flag=True),
        ),
    ),
    Command(
        "replay",
        "send logged rejected requests again",
        (
            Option("log", "a gatekeeper.rejected log file (JSON lines)", metavar="LOG"),
            Option("--to", "base URL to send them to", metavar="URL", required=True),
            Option("--rate", "at most N requests per second", metavar="N/s", parse=parse_rate),
            Option("--dry-run", "print, do not send", flag=True),
            Option(
                "--header",
                "add or replace a header (e.g. a redacted Authorization)",
                metavar="'Name: value'",
                short="-H",
                repeat=True,
                parse=parse_header,
                default=(),
            ),
            Option(
                "--timeout",
                "seconds per request (above 0, at most a day)",
                metavar="SECONDS",
                parse=parse_timeout,
                default=10.0,
            ),
            Option(
                "--send-truncated",
                "also send requests the log truncated (body, header, path or query)",
                flag=True,
            ),
        ),
        description="Send the requests of a gatekeeper.rejected log again.",
        epilog=REPLAY_EPILOG,
        uses_settings=False,
    ),
)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def add_commands(commands: Any, *, has_settings: bool = False) -> None:
    """Add the commands of :data:`COMMANDS` to an argparse subparsers object.

    ``has_settings``: a framework's settings are configured (Django, Flask), so ``check``
    needs no FILE and ``status`` defaults to the configured backend.
    """
    for command in COMMANDS:
        parser = commands.add_parser(
            command.name, help=command.help, description=command.description, epilog=command.epilog
        )
        for option in command.options:
            keywords: dict[str, Any] = {"help": option.help}
            if option.metavar is not None:
                keywords["metavar"] = option.metavar
            if option.positional:
                if has_settings and option.settings_default is not None:
                    keywords["nargs"] = "?"
                    keywords["help"] += f" (default: {option.settings_default})"
                parser.add_argument(option.name, **keywords)
                continue
            keywords["dest"] = option.key
            if option.flag:
                keywords["action"] = "store_true"
            else:
                if option.parse is not None:
                    keywords["type"] = _argparse_type(option.parse)
                keywords["required"] = option.required
                keywords["default"] = list(option.default) if option.repeat else option.default
                if option.repeat:
                    keywords["action"] = "append"
            parser.add_argument(*option.spellings, **keywords)
