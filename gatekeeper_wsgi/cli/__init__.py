"""The ``gatekeeper`` console script: ``check``, ``status`` and ``replay``.

::

    gatekeeper check gatekeeper.properties          # validate, print the effective limit tree
    gatekeeper status --backend shared:///run/gk.shm [--config FILE] [--json]
    gatekeeper replay rejected.log --to http://127.0.0.1:8000 [--rate 5/s] [--dry-run]

One module per command (:mod:`.check`, :mod:`.status`, :mod:`.replay`), each with its
reusable ``run_*`` function, and one option table (:mod:`.options`) from which this script
and ``manage.py gatekeeper`` build their argparse parsers and ``flask gatekeeper`` its
click commands. :func:`run_command` runs a parsed command for all three, with the
framework's settings standing in for a missing FILE. Each returns the exit status: 0 fine,
1 failed, 2 unusable input.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from gatekeeper_wsgi.cli.check import ConfigInput, limit_tree, run_check
from gatekeeper_wsgi.cli.options import COMMANDS, Command, Option, add_commands
from gatekeeper_wsgi.cli.replay import (
    ReplayRequest,
    parse_header,
    parse_rate,
    parse_timeout,
    run_replay,
)
from gatekeeper_wsgi.cli.status import run_status

__all__ = [
    "COMMANDS",
    "Command",
    "ConfigInput",
    "Option",
    "ReplayRequest",
    "add_commands",
    "build_parser",
    "limit_tree",
    "main",
    "parse_header",
    "parse_rate",
    "parse_timeout",
    "run_check",
    "run_command",
    "run_replay",
    "run_status",
]


def run_command(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    *,
    settings: ConfigInput | None = None,
) -> int:
    """Run a parsed ``check`` / ``status`` / ``replay``; returns the exit status.

    ``settings`` stand in for a missing FILE (``check``) and ``--config`` (``status``).
    """
    if args.command == "check":
        source = args.file if args.file is not None else settings
        if source is None:
            print("error: pass FILE", file=err)
            return 2
        return run_check(source, out, err=err)
    if args.command == "status":
        config = args.config if args.config is not None else settings
        if args.backend is None and config is None:
            print("error: pass --backend URL (or --config FILE naming one)", file=err)
            return 2
        return run_status(
            args.backend, as_json=args.json, out=out, err=err, config=config, show_all=args.all
        )
    return run_replay(
        args.log,
        args.to,
        rate=args.rate,
        dry_run=args.dry_run,
        out=out,
        err=err,
        headers=args.header,
        timeout=args.timeout,
        send_truncated=args.send_truncated,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``gatekeeper``."""
    from gatekeeper_wsgi import __version__

    parser = argparse.ArgumentParser(
        prog="gatekeeper", description="Operate gatekeeper-wsgi: check, status, replay."
    )
    parser.add_argument("--version", action="version", version=f"gatekeeper-wsgi {__version__}")
    add_commands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``gatekeeper`` with ``argv`` (default: the command line); returns the exit status."""
    args = build_parser().parse_args(argv)
    # Resolvers and renderers named in the config are imported from the project.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        status = run_command(args, sys.stdout, sys.stderr)
        sys.stdout.flush()  # here, where a reader gone away is caught
        return status
    except BrokenPipeError:
        # The reader went away (``gatekeeper check FILE | head``): no traceback, and no
        # second one when Python flushes stdout at exit (the Python docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
