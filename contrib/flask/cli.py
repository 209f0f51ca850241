"""``flask gatekeeper check|status|replay``: the ``gatekeeper`` console script's commands,
run against the app's configuration (``gatekeeper_wsgi.cli`` does the work). The click
commands are generated from the console script's option table
(:data:`gatekeeper_wsgi.cli.COMMANDS`), so the options, their help and their parsing are
the same in all three programs.

``check`` without FILE and ``status`` use the app's settings *with* its view and blueprint
limits, so the tree and the limit names are the ones the running app enforces.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import click
from flask import current_app
from flask.cli import AppGroup, with_appcontext

from gatekeeper_wsgi.cli.options import COMMANDS, Command, Option

if TYPE_CHECKING:
    from gatekeeper_wsgi.engine import ConfigSource

__all__ = ["EXTENSION_KEY", "AppSettings", "gatekeeper_cli"]

#: ``app.extensions`` key of an app's state (the extension's ``AppState``). Defined here,
#: where the commands look it up, so that this module needs nothing of the extension's
#: (the extension imports this one to register the commands).
EXTENSION_KEY = "gatekeeper"


@runtime_checkable
class AppSettings(Protocol):
    """What the commands need of the extension's per-app state (``AppState``)."""

    def refresh(self, *, if_changed: bool = False, in_request: bool = False) -> None: ...

    def effective_settings(self) -> ConfigSource: ...


gatekeeper_cli = AppGroup(
    "gatekeeper", help="Check the limits, watch live counters, replay rejected requests."
)


def _state() -> AppSettings:
    state = current_app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, AppSettings):
        raise click.UsageError(f"GateKeeper is not initialised on the app {current_app.name!r}")
    state.refresh(if_changed=True)
    return state


def _click_parse(option: Option) -> Callable[[click.Context, click.Parameter, Any], Any] | None:
    """A click callback converting by the option's own ``parse``, errors as click's."""
    parse = option.parse
    if parse is None:
        return None

    def convert(context: click.Context, parameter: click.Parameter, value: Any) -> Any:
        try:
            if option.repeat:
                return [parse(item) for item in value]
            return value if value is None or not isinstance(value, str) else parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return convert


def _click_param(option: Option) -> click.Parameter:
    """The click parameter of one row of the option table."""
    if option.positional:
        # A framework's settings stand in for a positional that has a settings default.
        required = option.settings_default is None
        # click shows an explicit metavar as given: an optional one gets its brackets here.
        shown = option.metavar if required or option.metavar is None else f"[{option.metavar}]"
        return click.Argument([option.key], required=required, metavar=shown)
    help_text = option.help[:1].upper() + option.help[1:] + "."
    return click.Option(
        [*option.spellings, option.key],
        help=help_text,
        # The table's parse converts the text (its callback, below), not a type click would
        # guess from the default (FLOAT from 10.0 takes inf and nan, with its own message).
        type=None if option.parse is None or option.flag else click.STRING,
        metavar=option.metavar,
        is_flag=option.flag,
        multiple=option.repeat,
        required=option.required,
        default=False if option.flag else option.default,
        show_default=option.default not in (None, ()),
        callback=_click_parse(option),
    )


def _click_command(command: Command) -> click.Command:
    """``flask gatekeeper <command>``, built from the table ``gatekeeper`` uses."""

    def run(**values: Any) -> None:
        # Imported when a command runs: registering the group costs nothing.
        from gatekeeper_wsgi.cli import run_command

        args = Namespace(command=command.name, **values)
        settings = _state().effective_settings() if command.needs_settings(values) else None
        sys.exit(run_command(args, sys.stdout, sys.stderr, settings=settings))

    return click.Command(
        command.name,
        # As AppGroup.command would: the commands read the app's extension state.
        callback=with_appcontext(run),
        params=[_click_param(option) for option in command.options],
        help=command.description or command.help[:1].upper() + command.help[1:] + ".",
        short_help=command.help,
        epilog=command.epilog,
    )


for _command in COMMANDS:
    gatekeeper_cli.add_command(_click_command(_command))
