"""The shared backend's per-request path (admission and release) keeps every count exact
when an update is rolled back: by a peek, by an error, by a process killed at any line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper, Rejected
from tests.conftest import busy


def settings_for(path: Path, limits: dict[str, Any]) -> dict[str, Any]:
    return {"project": "shop", "backend": f"shared://{path}", "limits": limits}


def test_a_query_on_a_fresh_table_leaves_what_is_in_flight_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``query`` works an admission out and rolls it back; the lease it took past the
    table's mark must go with it, or the next admission that takes a new lease finds the
    table damaged and re-creates it, forgetting every request in flight."""
    limits = {"shop": {"concurrency": 3}}
    gk = GateKeeper(settings_for(tmp_path / "t.shm", limits))
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        held = [gk.admit("shop", "orders", "crm")]
        for _ in range(2):
            assert gk.query("shop", "orders", "crm") is None
            held.append(gk.admit("shop", "orders", "crm"))
        assert busy(gk) == {"shop": 3}
        with pytest.raises(Rejected):
            gk.admit("shop", "orders", "crm")
    assert not [record for record in caplog.records if "damaged" in record.getMessage()]
    for admission in held:
        admission.release(200)
    assert busy(gk) == {}
    gk.close()
