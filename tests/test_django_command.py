"""`manage.py gatekeeper check|status|replay` against the project's settings, real files,
a real redis-server and a real HTTP server to replay to."""

from __future__ import annotations

import http.server
import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.rejectlog import flush
from tests.django_project import configure

configure()


def run(*args: str) -> tuple[str, str]:
    """Run `manage.py gatekeeper ARGS`; its (stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    call_command("gatekeeper", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_check_without_file_checks_the_settings(settings: Any) -> None:
    """`check` validates settings.GATEKEEPER and prints its limit tree."""
    settings.GATEKEEPER = {
        "project": "shop",
        "limits": {"shop": {"concurrency": 100}, "shop/checkout": {"concurrency": 10}},
    }
    out, _ = run("check")
    assert "settings: OK" in out
    assert "shop/checkout" in out


def test_djangos_common_options_are_taken_after_the_action(settings: Any) -> None:
    """`manage.py gatekeeper check --settings x -v 0 --traceback`, as every Django command
    takes its common options; argparse's subcommand alone would refuse them there."""
    settings.GATEKEEPER = {"project": "shop", "limits": {"shop": {"concurrency": 100}}}
    out, _ = run("check", "--settings", "tests.django_project", "-v", "0", "--traceback")
    assert "settings: OK" in out


def test_check_reports_invalid_settings_and_fails(settings: Any) -> None:
    """An invalid setting makes `check` fail with the key named, exit status 1."""
    settings.GATEKEEPER = {"limits": {"shop": {"concurrency": -1}}}
    err = io.StringIO()
    with pytest.raises(CommandError) as failure:
        call_command("gatekeeper", "check", stdout=io.StringIO(), stderr=err)
    assert failure.value.returncode == 1
    assert "limits.shop.concurrency" in err.getvalue()


def test_check_file_validates_that_file(tmp_path: Path) -> None:
    """`check FILE` validates an operators' file instead of the settings."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text("project = ops\nlimits.ops/batch.concurrency = 1\n")
    out, _ = run("check", str(path))
    assert f"{path}: OK" in out
    assert "ops/batch" in out


def test_status_of_a_memory_backend_explains_and_fails(settings: Any) -> None:
    """The memory backend lives in each process: `status` says so on stderr, exit status 2."""
    settings.GATEKEEPER = {"backend": "memory"}
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(CommandError) as failure:
        call_command("gatekeeper", "status", stdout=out, stderr=err)
    assert failure.value.returncode == 2
    assert "memory backend" in err.getvalue()
    assert out.getvalue() == ""


@pytest.mark.redis
def test_status_reads_the_live_counts_of_the_configured_backend(
    settings: Any, redis_server: str
) -> None:
    """`status --json` shows what another GateKeeper holds in the configured Redis."""
    url = f"{redis_server}?prefix=gk-django-status"
    settings.GATEKEEPER = {
        "project": "shop",
        "backend": url,
        "limits": {"shop/checkout": {"concurrency": 5}},
    }
    keeper = GateKeeper(settings.GATEKEEPER)
    admission = keeper.admit("shop", "checkout", "crm")
    try:
        out, _ = run("status", "--json")
        assert json.loads(out)["inflight"]["shop/checkout"] == 1
    finally:
        admission.release(200)
        keeper.close()


@pytest.fixture
def rejected_log(tmp_path: Path, settings: Any) -> Iterator[Path]:
    """A real rejected-request log: one request refused by the Django middleware."""
    settings.GATEKEEPER = {"project": "site", "limits": {"site/body": {"concurrency": 0}}}
    path = tmp_path / "rejected.log"
    handler = logging.FileHandler(path)
    logger = logging.getLogger("gatekeeper.rejected")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        response = Client().post("/body/?text=again", data=b"payload", content_type="text/plain")
        assert response.status_code == 503
        assert flush()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()
    yield path


class Recorder(http.server.BaseHTTPRequestHandler):
    """Records what it is sent and answers 200."""

    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        Recorder.received.append(("POST", self.path, self.rfile.read(length)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_replay_dry_run_lists_the_logged_request(rejected_log: Path) -> None:
    """`replay --dry-run` prints the request it would send, sending nothing."""
    out, _ = run("replay", str(rejected_log), "--to", "http://127.0.0.1:9", "--dry-run")
    assert "POST" in out
    assert "/body/" in out


def test_replay_sends_the_logged_request_again(rejected_log: Path) -> None:
    """`replay --to URL` re-sends method, path, query and body to a real server."""
    Recorder.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        run("replay", str(rejected_log), "--to", f"http://127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()
    assert Recorder.received == [("POST", "/body/?text=again", b"payload")]
