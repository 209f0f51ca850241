"""``flask gatekeeper check|status|replay``: the ``gatekeeper`` console script's commands,
run against the app's configuration (``gatekeeper_wsgi.cli`` does the work)."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

import click
from flask import current_app
from flask.cli import AppGroup

__all__ = ["gatekeeper_cli"]

gatekeeper_cli = AppGroup(
    "gatekeeper", help="Check the limits, watch live counters, replay rejected requests."
)


def _core() -> Any:
    # Imported when a command runs, so registering the group costs nothing.
    return import_module("gatekeeper_wsgi.cli")


def _state() -> Any:
    from .extension import EXTENSION_KEY, AppState

    state = current_app.extensions.get(EXTENSION_KEY)
    if not isinstance(state, AppState):
        raise click.UsageError(f"GateKeeper is not initialised on the app {current_app.name!r}")
    return state


@gatekeeper_cli.command("check")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
def check(file: str | None) -> None:
    """Validate FILE, or the app's settings with its view limits; print the limit tree."""
    if file is None:
        state = _state()
        state.refresh()
        source = state.effective_settings()
    else:
        source = file
    sys.exit(_core().run_check(source, sys.stdout))


@gatekeeper_cli.command("status")
@click.option("--backend", "backend_url", help="Backend URL (default: the app's backend).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(backend_url: str | None, as_json: bool) -> None:
    """Live counters of a shared or Redis backend."""
    if backend_url is None:
        backend_url = _state().gatekeeper.config.backend
    sys.exit(_core().run_status(backend_url, as_json=as_json, out=sys.stdout))


@gatekeeper_cli.command("replay")
@click.argument("log_path", metavar="LOG", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "to_url", required=True, help="Base URL to re-send the requests to.")
@click.option("--rate", type=float, default=None, help="Requests per second (default: no pause).")
@click.option("--dry-run", is_flag=True, help="Print the requests instead of sending them.")
def replay(log_path: str, to_url: str, rate: float | None, dry_run: bool) -> None:
    """Re-send the requests of a rejected-request LOG."""
    sys.exit(_core().run_replay(log_path, to_url, rate=rate, dry_run=dry_run, out=sys.stdout))
