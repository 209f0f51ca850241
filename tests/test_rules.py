"""One rule, one home: what ``gatekeeper check`` prints is what the engine enforces.

For random configurations and random request paths, the limit tree names, on every level
of the path, the limit the engine's admission counts the request under (or none), and the
delay and timeout markers it prints are the ones the admission carries.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.cli import limit_tree
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.limitindex import Inherited, counting_limit, inherit
from tests.conftest import FakeClock

# A small alphabet, so random limits and random request paths collide often.
SEGMENT = st.sampled_from(["a", "b", "*"])
VALUE = st.sampled_from(["a", "b", "c"])
COUNTING = st.fixed_dictionaries(
    {},
    optional={
        "concurrency": st.integers(1, 3),
        "rate": st.just("5/minute"),
        "delay": st.sampled_from([0.0, 0.5, 2.0]),
    },
)
MARKERS = st.fixed_dictionaries(
    {},
    optional={
        "timeout_status": st.sampled_from([[504], [502, 504]]),
        "timeout_header": st.just("X-Fault: TIMEOUT"),
        "timeout_body": st.just("<timeout/>"),
    },
)
KEY = st.sampled_from(["caller", "ip", "user", "header:X-K"])


def _usable(spec: dict[str, Any]) -> bool:
    # A limit counts or sets something, as the configuration requires.
    return bool(spec)


UPPER = st.tuples(st.lists(SEGMENT, min_size=1, max_size=2).map("/".join), COUNTING, MARKERS)
UPPER_LIMITS = UPPER.map(lambda item: (item[0], {**item[1], **item[2]}))
CALLER_LIMITS = st.tuples(st.tuples(SEGMENT, SEGMENT, SEGMENT).map("/".join), COUNTING, KEY).map(
    lambda item: (item[0], {**item[1], **({"key": item[2]} if item[1] else {})})
)
LIMITS = st.lists(UPPER_LIMITS | CALLER_LIMITS, max_size=14).map(
    lambda items: {path: spec for path, spec in items if _usable(spec)}
)

# "label  details": tree drawing, the node's path (no spaces), a gap, the details.
_LINE = re.compile(r"^[│├└─ ]*(?P<path>\S+) {2,}(?P<details>.*)$")


def tree_lines(config: Any, path: str) -> dict[str, str]:
    """The details ``gatekeeper check`` prints per node, with ``path`` in the tree."""
    lines = {}
    for line in limit_tree(config, paths=[path]):
        match = _LINE.match(line)
        assert match is not None, line
        lines[match["path"]] = match["details"]
    return lines


def counted_under(node: str, details: str) -> str | None:
    """The limit path a tree line says the node is counted under (None: not counted)."""
    if details.startswith("counted under "):
        governing, _, own = details[len("counted under ") :].partition(": ")
        return None if own.startswith("no limit of its own") else governing
    return None if details.startswith("no limit of its own") else node


def printed(details: str, name: str) -> str | None:
    """The value a tree line prints for ``delay``/``timeout_*`` (without its source)."""
    for part in details.split("; "):
        if part.startswith(name + " "):
            return part[len(name) + 1 :].split(" (from ")[0]
    return None


@settings(max_examples=400, deadline=None)
@given(limits=LIMITS, project=VALUE, service=VALUE, caller=VALUE)
def test_the_tree_names_the_limits_the_engine_enforces(
    limits: dict[str, dict[str, Any]], project: str, service: str, caller: str
) -> None:
    """For every level of a request's path, the tree's limit is the one the admission
    counts it under; its printed delay and markers are the admission's."""
    config = build_config({"limits": limits})
    path = f"{project}/{service}/{caller}"
    lines = tree_lines(config, path)
    gk = GateKeeper({"limits": limits}, clock=FakeClock())
    try:
        # Every key source reads the same value, so the concrete path is the request's.
        environ = {"REMOTE_ADDR": caller, "HTTP_X_K": caller, "REMOTE_USER": caller}
        admission = gk.admit(project, service, caller, environ, caller)
        enforced = {slot.key: slot.limit.path for slot in admission.slots}
        nodes = [project, f"{project}/{service}", path]
        expected = {
            node: governing
            for node in nodes
            if (governing := counted_under(node, lines[node])) is not None
        }
        assert enforced == expected
        delay = printed(lines[path], "delay")
        assert admission.delay == (0.0 if delay is None else float(delay.rstrip("s")))
        route = admission.route
        statuses = printed(lines[path], "timeout_status")
        assert route.timeout_status == (
            None if statuses is None else frozenset(int(s) for s in statuses.split(","))
        )
        header = printed(lines[path], "timeout_header")
        assert (route.timeout_header is None) == (header is None)
        body = printed(lines[path], "timeout_body")
        assert (route.timeout_body is None) == (body is None)
        admission.release(200)
    finally:
        gk.close()


@settings(max_examples=200, deadline=None)
@given(limits=LIMITS, project=VALUE, service=VALUE, caller=VALUE)
def test_status_groups_each_key_under_the_limit_that_counted_it(
    limits: dict[str, dict[str, Any]], project: str, service: str, caller: str
) -> None:
    """The limit the status page (and Prometheus, through it) files a concrete key under
    is the limit whose slot the admission took for that key."""
    gk = GateKeeper({"limits": limits}, clock=FakeClock())
    try:
        environ = {"REMOTE_ADDR": caller, "HTTP_X_K": caller, "REMOTE_USER": caller}
        admission = gk.admit(project, service, caller, environ, caller)
        for slot in admission.slots:
            assert counting_limit(gk.config.limit_index, slot.key) is slot.limit
        admission.release(200)
    finally:
        gk.close()


def test_inherit_takes_the_most_specific_setting_and_markers_from_two_levels() -> None:
    """A caller-level delay beats the service's, which beats the project's; a marker set
    on the project level stays in force where the service sets none."""
    config = build_config(
        {
            "limits": {
                "shop": {"concurrency": 9, "delay": 1.0, "timeout_status": [504]},
                "shop/pay": {"concurrency": 5, "delay": 2.0},
                "shop/pay/*": {"concurrency": 1, "delay": 3.0},
            }
        }
    )
    limits = config.limits
    chain = config.limit_index.chain(("shop", "pay", "alice"))
    assert chain == (limits["shop"], limits["shop/pay"], limits["shop/pay/*"])
    assert inherit(chain) == Inherited(limits["shop/pay/*"], limits["shop"], None, None, True)
    assert inherit(chain).delay_seconds == 3.0
    assert inherit(chain[:1]).delay_seconds == 1.0
    assert inherit(()).delay_seconds == 0.0


def test_a_delay_holds_only_where_a_level_counts_concurrency() -> None:
    """A delay holds concurrency slots: under a chain where no limit counts concurrency
    (a rate alone) it is 0 - it would hold nothing but the backend's room."""
    config = build_config(
        {
            "limits": {
                "api": {"delay": 5.0},
                "api/feed": {"rate": "10/second"},
                "api/pay": {"concurrency": 2},
            }
        }
    )
    index = config.limit_index
    assert inherit(index.chain(("api", "feed"))).delay_seconds == 0.0
    assert inherit(index.chain(("api", "pay"))).delay_seconds == 5.0
