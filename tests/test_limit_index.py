"""Which limit applies: the segment index gives exactly the brute-force rule, in O(segments)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, ValuesView

from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.config import Config, Limit, build_config
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.resolve import Route

# A small alphabet, so random limits and random request paths collide often.
SEGMENT = st.sampled_from(["a", "b", "c", "*"])
VALUE = st.sampled_from(["a", "b", "c", "d", "*"])
PATH = st.lists(SEGMENT, min_size=1, max_size=3).map("/".join)
LIMIT = st.fixed_dictionaries(
    {"concurrency": st.integers(0, 3)}, optional={"delay": st.sampled_from([0.5, 1.0])}
)
LIMITS = st.dictionaries(PATH, LIMIT | st.just({"delay": 2.0}), max_size=25)


def matches(limit: Limit, values: tuple[str, ...]) -> bool:
    """The rule's match: each given segment is ``*`` or equal to its value."""
    return all(
        seg == "*" or seg == value for seg, value in zip(limit.segments, values, strict=False)
    )


def in_rule_order(limits: list[Limit]) -> list[Limit]:
    """Exact beats ``*``, segments weighed from the left, then the path: best first."""
    return sorted(
        limits,
        key=lambda limit: (tuple(s != "*" for s in limit.segments), limit.path),
        reverse=True,
    )


def brute_force(config: Config, values: tuple[str, ...]) -> list[Limit]:
    """The rule as written, over every limit: those of that level matching ``values``."""
    return in_rule_order(
        [
            limit
            for limit in config.limits.values()
            if len(limit.segments) == len(values) and matches(limit, values)
        ]
    )


def brute_force_callers(config: Config, project: str, service: str) -> list[Limit]:
    """Caller-level limits whose first two segments match, in the rule's order."""
    return in_rule_order(
        [
            limit
            for limit in config.limits.values()
            if len(limit.segments) == 3 and matches(limit, (project, service))
        ]
    )


@settings(max_examples=300, deadline=None)
@given(limits=LIMITS, project=VALUE, service=VALUE)
def test_index_picks_what_the_brute_force_rule_picks(
    limits: dict[str, dict[str, float]], project: str, service: str
) -> None:
    """For random limits and paths, the index picks on each level the limit the rule picks."""
    config = build_config({"limits": limits})
    index = config.limit_index
    for values in ((project,), (project, service)):
        expected = brute_force(config, values)
        assert index.most_specific(values) is (expected[0] if expected else None)
    assert index.callers(project, service) == brute_force_callers(config, project, service)


@settings(max_examples=200, deadline=None)
@given(limits=LIMITS, project=VALUE, service=VALUE, caller=VALUE)
def test_route_admits_by_the_same_limits_as_the_rule(
    limits: dict[str, dict[str, float]], project: str, service: str, caller: str
) -> None:
    """A Route built through the index takes the slots and delay the brute-force rule gives."""
    config = build_config({"limits": limits})
    route = Route(config, project, service)
    expected_slots = []
    delay = 0.0
    for values in ((project,), (project, service)):
        found = brute_force(config, values)
        if not found:
            continue
        limit = found[0]
        if limit.delay is not None:
            delay = limit.delay
        if limit.concurrency is not None:
            expected_slots.append(("/".join(values), limit))
    assert [(slot.key, slot.limit) for slot in route.slots] == expected_slots
    # A delay holds concurrency slots: none without a level that counts concurrency.
    assert route.delay == (delay if expected_slots else 0.0)
    callers = brute_force_callers(config, project, service)
    assert [candidate.limit for candidate in route.caller_candidates] == callers
    slots, caller_delay = route.caller_level(caller, {}, None)
    chosen = next((lim for lim in callers if lim.segments[2] in ("*", caller)), None)
    if chosen is None:
        assert caller_delay is None
    else:
        holds = bool(expected_slots) or chosen.concurrency is not None
        own = delay if chosen.delay is None else chosen.delay
        assert caller_delay == (own if holds else 0.0)
    if chosen is not None and chosen.concurrency is not None:
        assert (slots[-1].key, slots[-1].limit) == (f"{project}/{service}/{caller}", chosen)


class CountingLimits(Mapping[str, Limit]):
    """The limits of a config, counting every time someone reads them all."""

    def __init__(self, limits: Mapping[str, Limit]) -> None:
        self.limits = dict(limits)
        self.scans = 0

    def __getitem__(self, path: str) -> Limit:
        return self.limits[path]

    def __iter__(self) -> Iterator[str]:
        self.scans += 1
        return iter(self.limits)

    def __len__(self) -> int:
        return len(self.limits)

    def values(self) -> ValuesView[Limit]:
        self.scans += 1
        return self.limits.values()


def test_never_seen_paths_do_not_scan_the_limits() -> None:
    """20 000 limits: 2 000 never-seen paths are resolved without reading the limit table again."""
    limits = {f"p{i}/s{i}": {"concurrency": 5} for i in range(10_000)}
    limits.update({f"p{i}/s{i}/*": {"concurrency": 1} for i in range(10_000)})
    counting = CountingLimits(build_config({"limits": limits}).limits)
    config = dataclasses.replace(build_config({}), limits=counting)
    for i in range(2_000):
        route = Route(config, f"p{i}", f"s{i}")
        assert [slot.key for slot in route.slots] == [f"p{i}/s{i}"]
        assert [c.limit.path for c in route.caller_candidates] == [f"p{i}/s{i}/*"]
        assert Route(config, "unknown", f"never-seen-{i}").slots == ()
    assert counting.scans == 1  # building the index, once


def test_never_seen_path_still_gets_its_wildcard_limits() -> None:
    """Among 20 000 exact limits, a never-seen path is still counted by the `*` limits."""
    limits: dict[str, dict[str, object]] = {f"shop/s{i}": {"concurrency": 5} for i in range(20_000)}
    limits["shop/*"] = {"concurrency": 1}
    limits["*/*/*"] = {"concurrency": 7}
    gk = GateKeeper({"project": "shop", "limits": limits})
    try:
        held = gk.admit("shop", "never-seen", "crm")
        assert gk.inflight()["shop/never-seen"] == 1
        assert gk.inflight()["shop/never-seen/crm"] == 1
        held.release(200)
    finally:
        gk.close()


KEYED_LIMIT = st.fixed_dictionaries(
    {"concurrency": st.integers(0, 3), "key": st.sampled_from(["caller", "ip", "header:X-K"])},
    optional={"delay": st.sampled_from([0.5, 1.0])},
)
CALLER_PATH = st.tuples(SEGMENT, SEGMENT, SEGMENT).map("/".join)
KEYED_LIMITS = st.dictionaries(CALLER_PATH, KEYED_LIMIT | st.just({"delay": 2.0}), max_size=25)
REQUEST_VALUE = st.sampled_from(["a", "b", "c", "d"])


def first_matching_candidate(route: Route, values: dict[str, str]) -> Limit | None:
    """The caller-level rule by a scan: the first candidate, in the rule's order, whose
    segment is `*` or the request's value for its key."""
    for candidate in route.caller_candidates:
        if candidate.segment in ("*", values[candidate.limit.key]):
            return candidate.limit
    return None


@settings(max_examples=300, deadline=None)
@given(
    limits=KEYED_LIMITS,
    project=VALUE,
    service=VALUE,
    caller=REQUEST_VALUE,
    address=REQUEST_VALUE,
    header=REQUEST_VALUE,
)
def test_indexed_caller_level_picks_what_a_scan_picks(
    limits: dict[str, dict[str, object]],
    project: str,
    service: str,
    caller: str,
    address: str,
    header: str,
) -> None:
    """With limits keyed by caller, address and header mixed, the indexed caller level
    takes the slot and delay of the first matching candidate in the rule's order."""
    route = Route(build_config({"limits": limits}), project, service)
    environ = {"REMOTE_ADDR": address, "HTTP_X_K": header}
    values = {"caller": caller, "ip": address, "header:X-K": header}
    chosen = first_matching_candidate(route, values)
    slots, delay = route.caller_level(caller, environ, None)
    if chosen is None:
        assert (slots, delay) == (route.slots, None)
        return
    # Only caller-level limits here: the chosen one's delay, held where it counts
    # concurrency (a delay-only limit holds nothing: limitindex.inherit).
    holds = chosen.concurrency is not None
    assert delay == ((chosen.delay or 0.0) if holds else 0.0)
    if chosen.concurrency is None:
        assert slots == route.slots
        return
    value = values[chosen.key]
    key = f"{project}/{service}/{value}"
    # A `*` limit's value spelling the segment of a counting exact limit that ranks above
    # it here (and reads another key) is counted apart: never on that limit's counter.
    ranked = [candidate.limit for candidate in route.caller_candidates]
    above = ranked[: ranked.index(chosen)]
    if chosen.segments[2] == "*" and any(
        limit.segments[2] == value and limit.concurrency is not None for limit in above
    ):
        assert slots[-1].key.startswith(f"{project}/{service}/~") and slots[-1].key != key
    else:
        assert slots[-1].key == key
    assert (slots[:-1], slots[-1].limit) == (route.slots, chosen)


def test_a_spray_of_new_callers_does_not_scan_per_caller_limits() -> None:
    """100 000 per-caller limits: a new caller is resolved by lookups, not by a scan, and
    the exact limits and the `*` one still apply to the callers they name."""
    limits: dict[str, dict[str, object]] = {
        f"shop/api/partner{i}": {"concurrency": 5} for i in range(100_000)
    }
    limits["shop/api/*"] = {"concurrency": 1}
    route = Route(build_config({"limits": limits}), "shop", "api")
    # The answers below cannot come from a scan of the candidates: there are none left.
    route.caller_candidates = ()
    for i in range(1_000):
        (slot,) = route.caller_level(f"new{i}", {}, None)[0]
        assert (slot.key, slot.limit.path) == (f"shop/api/new{i}", "shop/api/*")
    (slot,) = route.caller_level("partner77", {}, None)[0]
    assert slot.limit.path == "shop/api/partner77"
