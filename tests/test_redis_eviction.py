"""Redis servers that may evict limit keys are pointed out (SPEC §6, issue 14 point 7): at
start, by a WARNING in the log, and by ``gatekeeper check``. Real redis-server processes
with the policies in question."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("redis")

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.cli import run_check
from tests.conftest import redis_binary
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


def server(tmp_path: Path, *extra: str) -> Iterator[str]:
    process = RedisServer(redis_binary(), tmp_path, extra=extra)
    process.start()
    try:
        yield process.url
    finally:
        process.stop()


@pytest.fixture
def evicting(tmp_path: Path) -> Iterator[str]:
    """A redis-server that evicts any key under memory pressure."""
    yield from server(tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")


@pytest.fixture
def config_disabled(tmp_path: Path) -> Iterator[str]:
    """A redis-server whose CONFIG command is disabled, as on many managed services."""
    yield from server(tmp_path, "--rename-command", "CONFIG", "")


def settings(url: str) -> dict[str, object]:
    return {"project": "shop", "backend": url, "limits": {"shop": {"concurrency": 5}}}


def check(url: str) -> tuple[int, str]:
    out = io.StringIO()
    code = run_check(settings(url), out)
    return code, out.getvalue()


def gatekeeper_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "gatekeeper"]


def test_an_evicting_policy_warns_at_start_and_in_check(
    evicting: str, caplog: pytest.LogCaptureFixture
) -> None:
    """allkeys-lru: starting a gatekeeper logs one WARNING naming the policy and the fix;
    `gatekeeper check` prints it too and still passes (the configuration is valid)."""
    with caplog.at_level(logging.INFO, logger="gatekeeper"):
        GateKeeper(settings(evicting)).close()
    warnings = [r for r in gatekeeper_records(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "allkeys-lru" in message
    assert "resets its limit" in message
    assert "noeviction" in message
    code, printed = check(evicting)
    assert code == 0
    assert "WARNING: redis at 127.0.0.1:" in printed
    assert "maxmemory-policy allkeys-lru" in printed


def test_noeviction_is_quiet(redis_server: str, caplog: pytest.LogCaptureFixture) -> None:
    """The default noeviction: nothing at WARNING or above, and check says it is fine."""
    with caplog.at_level(logging.DEBUG, logger="gatekeeper"):
        GateKeeper(settings(redis_server)).close()
    assert not [r for r in gatekeeper_records(caplog) if r.levelno >= logging.INFO]
    code, printed = check(redis_server)
    assert code == 0
    assert "ok: redis at 127.0.0.1:" in printed
    assert "maxmemory-policy noeviction" in printed


def test_cannot_tell_is_a_note_not_an_error(
    config_disabled: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIG disabled: an INFO note that the policy cannot be told, no WARNING or ERROR,
    and the gatekeeper works as usual."""
    with caplog.at_level(logging.DEBUG, logger="gatekeeper"):
        gk = GateKeeper(settings(config_disabled))
        gk.admit("shop", "work", "c").release(200)
        assert gk.stats()["counters"]["backend_errors"] == 0
        gk.close()
    records = gatekeeper_records(caplog)
    assert [r.levelno for r in records] == [logging.INFO]
    assert "cannot tell the maxmemory-policy" in records[0].getMessage()
    code, printed = check(config_disabled)
    assert code == 0
    assert "note: cannot tell the maxmemory-policy of redis at 127.0.0.1:" in printed
