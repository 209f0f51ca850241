"""One option table for the three command lines (issue 17 point 6): ``gatekeeper``,
``manage.py gatekeeper`` and ``flask gatekeeper`` take the same options, parse them the
same way and refuse the same bad values with the same message."""

from __future__ import annotations

import argparse
from typing import Any

import click
import pytest
from django.core.management.base import CommandError
from flask import Flask
from gatekeeper_wsgi.contrib.django.management.commands.gatekeeper import (
    Command as DjangoCommand,
)
from gatekeeper_wsgi.contrib.flask import GateKeeper
from gatekeeper_wsgi.contrib.flask.cli import gatekeeper_cli

from gatekeeper_wsgi.cli import COMMANDS, build_parser
from tests.django_project import configure

configure()

#: Command lines every program must read alike (the framework ones may omit FILE).
ARGV = [
    ["check", "gatekeeper.toml"],
    ["status", "--backend", "redis://127.0.0.1:6379/0", "--json", "--all"],
    ["status", "--config", "ops.properties"],
    ["replay", "rejected.log", "--to", "http://127.0.0.1:8000"],
    [
        "replay",
        "rejected.log",
        "--to",
        "http://127.0.0.1:8000",
        "--rate",
        "30/m",
        "--dry-run",
        "-H",
        "Authorization: Bearer x",
        "--header",
        "X-Trace: 1",
        "--timeout",
        "2.5",
        "--send-truncated",
    ],
]
FRAMEWORK_ARGV = [*ARGV, ["check"], ["status"]]


def _argparse(argv: list[str]) -> dict[str, Any]:
    values = vars(build_parser().parse_args(argv))
    del values["command"]
    return values


def _django_parser() -> argparse.ArgumentParser:
    return DjangoCommand().create_parser("manage.py", "gatekeeper")


def _django(argv: list[str]) -> dict[str, Any]:
    values = vars(_django_parser().parse_args(argv))
    # Django's own options (verbosity, settings, ...) come with every management command.
    return {key: values[key] for key in values if key in _table_keys(argv[0])}


def _click_command(name: str) -> click.Command:
    command = gatekeeper_cli.get_command(click.Context(gatekeeper_cli), name)
    assert command is not None
    return command


def _click(argv: list[str]) -> dict[str, Any]:
    command = _click_command(argv[0])
    with command.make_context(argv[0], argv[1:]) as context:
        return dict(context.params)


def _table_keys(name: str) -> set[str]:
    command = next(c for c in COMMANDS if c.name == name)
    return {option.key for option in command.options}


@pytest.mark.parametrize("argv", ARGV, ids=" ".join)
def test_the_three_programs_read_a_command_line_alike(argv: list[str]) -> None:
    """The console script, Django's and Flask's command parse one command line to the
    same values: the table's keys, with the same types and defaults."""
    expected = _argparse(argv)
    assert set(expected) == _table_keys(argv[0])
    assert _django(argv) == expected
    assert _click(argv) == expected


def test_a_replay_header_and_rate_are_parsed_by_the_table() -> None:
    """``-H`` collects (name, value) pairs and ``--rate`` becomes requests per second."""
    values = _argparse(ARGV[-1])
    assert values["header"] == [("Authorization", "Bearer x"), ("X-Trace", "1")]
    assert values["rate"] == 0.5
    assert values["timeout"] == 2.5


@pytest.mark.parametrize("argv", FRAMEWORK_ARGV, ids=" ".join)
def test_the_framework_commands_let_the_settings_stand_in_for_file(argv: list[str]) -> None:
    """Django's and Flask's ``check`` take no FILE (the settings stand in): both read
    ``check`` alone as FILE None, like every other line, the same."""
    assert _click(argv) == _django(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "x.log", "--to", "http://h", "--rate", "fast"], "expected a rate like"),
        (["replay", "x.log", "--to", "http://h", "-H", "no colon"], "expected 'Name: value'"),
        (["replay", "x.log", "--to", "http://h", "-H", "Bad Name: 1"], "is no header name"),
        (["replay", "x.log", "--to", "http://h", "--rate", "0/s"], "the rate must be above 0"),
        *(
            (["replay", "x.log", "--to", "http://h", "--timeout", bad], message)
            for bad, message in [
                ("inf", "the timeout must be above 0 and at most 86400 seconds"),
                ("1e400", "the timeout must be above 0 and at most 86400 seconds"),
                ("86401", "the timeout must be above 0 and at most 86400 seconds"),
                ("-1", "the timeout must be above 0 and at most 86400 seconds"),
                ("0", "the timeout must be above 0 and at most 86400 seconds"),
                ("nan", "the timeout must be above 0 and at most 86400 seconds"),
                ("soon", "expected a number of seconds like '10' or '2.5'"),
            ]
        ),
    ],
)
def test_a_bad_value_is_refused_alike(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is a usage error with the same message in all three programs."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    with pytest.raises(CommandError, match=message):
        _django_parser().parse_args(argv)
    with pytest.raises(click.BadParameter, match=message):
        _click(argv)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.name)
def test_every_option_of_the_table_is_in_each_programs_help(command: Any) -> None:
    """Each option and its help text appear in ``--help`` of all three programs."""
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    # Both wrap their help text: compared with the line breaks undone.
    script_help = " ".join(subparsers.choices[command.name].format_help().split())
    app = Flask(__name__)
    GateKeeper(app)
    result = app.test_cli_runner().invoke(args=["gatekeeper", command.name, "--help"])
    assert result.exit_code == 0, result.output
    flask_help = " ".join(result.output.split()).lower()
    for option in command.options:
        label = option.metavar if option.positional else option.name
        assert label is not None
        assert label in script_help
        assert label.lower() in flask_help
        assert option.help in script_help
        if not option.positional:  # click lists no help for arguments
            assert option.help.lower() in flask_help
        elif option.settings_default is not None:  # optional: the settings stand in
            assert f"[{label.lower()}]" in flask_help
