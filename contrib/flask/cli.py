"""``flask gatekeeper check|status|replay``: the ``gatekeeper`` console script's commands,
run against the app's configuration (``gatekeeper_wsgi.cli`` does the work).

``check`` without FILE and ``status`` use the app's settings *with* its view and blueprint
limits, so the tree and the limit names are the ones the running app enforces.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
from flask import current_app
from flask.cli import AppGroup

if TYPE_CHECKING:
    from .extension import AppState

__all__ = ["gatekeeper_cli"]

gatekeeper_cli = AppGroup(
    "gatekeeper", help="Check the limits, watch live counters, replay rejected requests."
)


def _state() -> AppState:
    from .extension import EXTENSION_KEY, AppState

    state = current_app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, AppState):
        raise click.UsageError(f"GateKeeper is not initialised on the app {current_app.name!r}")
    state.refresh(if_changed=True)
    return state


def _rate(context: click.Context, parameter: click.Parameter, value: str | None) -> float | None:
    from gatekeeper_wsgi.cli import parse_rate

    if value is None:
        return None
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _header(
    context: click.Context, parameter: click.Parameter, values: tuple[str, ...]
) -> list[tuple[str, str]]:
    headers = []
    for text in values:
        name, sep, value = text.partition(":")
        if not sep or not name.strip():
            raise click.BadParameter(f"expected 'Name: value', got {text!r}")
        headers.append((name.strip(), value.strip()))
    return headers


@gatekeeper_cli.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
def check(file: str | None) -> None:
    """Validate FILE, or the app's settings with its view limits; print the limit tree."""
    # Imported when a command runs: registering the group costs nothing.
    from gatekeeper_wsgi.cli import run_check

    source = file if file is not None else _state().effective_settings()
    sys.exit(run_check(source, sys.stdout, err=sys.stderr))


@gatekeeper_cli.command("status")
@click.option("--backend", "backend_url", metavar="URL", help="Default: the app's backend.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--all", "show_all", is_flag=True, help="Also list paths at 0.")
def status(backend_url: str | None, as_json: bool, show_all: bool) -> None:
    """Live in-flight counts of the app's shared or Redis backend."""
    from gatekeeper_wsgi.cli import run_status

    settings = _state().effective_settings()
    sys.exit(
        run_status(backend_url, as_json=as_json, out=sys.stdout, config=settings, show_all=show_all)
    )


@gatekeeper_cli.command("replay")
@click.argument("log_path", metavar="LOG", type=click.Path(dir_okay=False))
@click.option("--to", "to_url", required=True, metavar="URL", help="Base URL to send them to.")
@click.option("--rate", metavar="N/s", callback=_rate, help="At most N requests per second.")
@click.option("--dry-run", is_flag=True, help="Print, do not send.")
@click.option(
    "--header",
    "-H",
    "headers",
    multiple=True,
    callback=_header,
    metavar="'Name: value'",
    help="Add or replace a header (e.g. a redacted Authorization).",
)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds per request.")
@click.option("--send-truncated", is_flag=True, help="Also send bodies the log truncated.")
def replay(
    log_path: str,
    to_url: str,
    rate: float | None,
    dry_run: bool,
    headers: list[tuple[str, str]],
    timeout: float,
    send_truncated: bool,
) -> None:
    """Send the requests of a rejected-request LOG again."""
    from gatekeeper_wsgi.cli import run_replay

    sys.exit(
        run_replay(
            log_path,
            to_url,
            rate=rate,
            dry_run=dry_run,
            out=sys.stdout,
            headers=headers,
            timeout=timeout,
            send_truncated=send_truncated,
        )
    )
