"""Proof of exactness: many threads, random limit mixes and reloads, an independent observer,
and a stateful model of the engine."""

from __future__ import annotations

import itertools
import math
import os
import random
import sys
import tempfile
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from gatekeeper_wsgi.engine import Admission, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from tests.conftest import FakeClock, replace_file

THREADS = 64
OPS = 30
SERVICES = ("checkout", "login", "search")
CALLERS = ("alice", "bob", "carol", "crm", "erp", "hr")
OUTCOMES = ("ok", "timeout", "error", "exception")


class LockedClock(FakeClock):
    """A FakeClock many threads may advance at once without ever going backwards."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def properties(settings: dict[str, Any]) -> str:
    """Write a settings dict of SPEC §3 shape as a .properties file."""
    lines = []
    for section, values in settings.items():
        if section == "limits":
            for path, limit in values.items():
                for name, value in limit.items():
                    if name == "queue":
                        value = f"{value['size']}, {value['wait']}"
                    elif isinstance(value, list):
                        value = ", ".join(str(item) for item in value)
                    lines.append(f"limits.{path}.{name} = {value}")
        elif isinstance(values, dict):
            lines += [f"{section}.{name} = {value}" for name, value in values.items()]
        else:
            lines.append(f"{section} = {values}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------- the threaded stress


def limit_mixes(project: str) -> st.SearchStrategy[dict[str, Any]]:
    """Concurrency at three levels, rates, delays and a queue, in random combinations."""
    delay = st.sampled_from([0.0, 0.005, 0.02])
    service = st.fixed_dictionaries(
        {"concurrency": st.integers(1, 6), "delay": delay},
        optional={"rate": st.sampled_from(["40/0.05s", "200/1s"])},
    )
    return st.fixed_dictionaries(
        {
            project: st.fixed_dictionaries({"concurrency": st.integers(3, 16), "delay": delay}),
            f"{project}/*/*": st.fixed_dictionaries({"concurrency": st.integers(1, 3)}),
        },
        optional={
            f"{project}/checkout": service,
            f"{project}/login": service,
            f"{project}/search": st.fixed_dictionaries(
                {
                    "concurrency": st.integers(1, 4),
                    "queue": st.fixed_dictionaries(
                        {"size": st.integers(1, 8), "wait": st.just(0.05)}
                    ),
                }
            ),
            f"{project}/checkout/crm": st.fixed_dictionaries(
                {"concurrency": st.integers(1, 2), "delay": delay}
            ),
        },
    )


class Observer:
    """Counts, independently of the engine, the requests inside the app per concrete path.

    A path may briefly hold more than a *lowered* limit after a reload (requests admitted
    under the old one stay), so each holder brings the limit it was admitted under, and the
    count may never exceed the largest limit among the current holders.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holders: dict[str, list[int]] = {}
        self.peak: Counter[str] = Counter()
        self.violations: list[str] = []

    def enter(self, limits: dict[str, int]) -> None:
        with self._lock:
            for path, limit in limits.items():
                holders = self.holders.setdefault(path, [])
                holders.append(limit)
                self.peak[path] = max(self.peak[path], len(holders))
                if len(holders) > max(holders):
                    self.violations.append(f"{path}: {len(holders)} inside, limits {holders}")

    def leave(self, limits: dict[str, int]) -> None:
        with self._lock:
            for path, limit in limits.items():
                self.holders[path].remove(limit)


def concurrency_limits(admission: Admission, caller: str) -> dict[str, int]:
    """The concurrency each concrete path of a request must respect: those of the
    configuration it was admitted under (reloads swap others in meanwhile), as its route
    holds them, the caller level's included (a route keeps its limits, not the whole
    configuration: SPEC 3)."""
    route = admission.route
    slots = route.caller_level(caller, {}, None)[0] if route.caller_candidates else route.slots
    return {key: limit.concurrency for key, limit, _ in slots if limit.concurrency is not None}


_PROJECTS = itertools.count()


def switches(service: str, caller: str) -> int:
    """How many thread switches a request stays inside the app (varied, reproducible)."""
    return 1 + (len(service) + len(caller)) % 4


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads far more often than CPython's default, to provoke interleavings."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_threads_never_exceed_any_limit(
    clocked_backend_url: str, tmp_path: Path, fast_switching: None, data: st.DataObject
) -> None:
    """64 threads with random limits, outcomes and reloads never exceed a concurrency
    limit, and every counter is back at zero once all delays have passed."""
    project = f"p{next(_PROJECTS)}"
    variants = [data.draw(limit_mixes(project), label=f"limits {i}") for i in range(2)]
    weights = data.draw(
        st.lists(st.integers(1, 5), min_size=4, max_size=4), label="ok/timeout/error/exception"
    )
    reload_chance = data.draw(st.sampled_from([0.0, 0.01, 0.05]), label="reload chance")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    path = tmp_path / f"{project}.properties"
    replace_file(path, properties({"limits": variants[0]}))
    clock = LockedClock()
    gk = GateKeeper(
        {
            "project": project,
            "backend": clocked_backend_url,
            "reload": {"file": str(path), "every_requests": 25, "every_seconds": 3600},
        },
        clock=clock,
    )
    observer = Observer()
    barrier = threading.Barrier(THREADS + 1)
    done = threading.Event()
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    outcomes_lock = threading.Lock()

    def worker(index: int) -> None:
        rng = random.Random(seed + index)
        barrier.wait()
        try:
            for _ in range(OPS):
                if rng.random() < reload_chance:
                    replace_file(path, properties({"limits": rng.choice(variants)}))
                    gk.reload()
                service, caller = rng.choice(SERVICES), rng.choice(CALLERS)
                outcome = rng.choices(OUTCOMES, weights)[0]
                try:
                    admission = gk.admit(project, service, caller)
                except Rejected:
                    outcome = "rejected"
                else:
                    serve(admission, service, caller, outcome)
                with outcomes_lock:
                    outcomes[outcome] += 1
        except BaseException:  # surfaced by the main thread, with its traceback
            failures.append(traceback.format_exc())

    def serve(admission: Admission, service: str, caller: str, outcome: str) -> None:
        limits = concurrency_limits(admission, caller)
        status: int | None = None
        try:
            observer.enter(limits)
            try:
                # Stay inside for a few thread switches, so requests really overlap.
                for _ in range(switches(service, caller)):
                    os.sched_yield()
                if outcome == "exception":
                    raise LookupError("the app failed")
                status = {"ok": 200, "timeout": 504, "error": 500}[outcome]
            finally:
                observer.leave(limits)
        except LookupError:
            pass
        finally:
            admission.release(status, faulty=outcome != "ok")

    def ticker() -> None:
        # Time passes while the workers run, so delays mature and queue waits expire.
        while not done.wait(0.0005):
            clock.advance(0.001)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    time_keeper = threading.Thread(target=ticker, daemon=True)
    time_keeper.start()
    barrier.wait()
    for thread in threads:
        thread.join(60)
    done.set()
    time_keeper.join()
    try:
        assert not failures, failures[0]
        assert not any(thread.is_alive() for thread in threads)
        assert observer.violations == []
        assert sum(outcomes.values()) == THREADS * OPS
        clock.advance(1.0)
        assert {key: n for key, n in gk.inflight().items() if n} == {}
        assert gk.stats()["counters"]["delayed_pending"] == 0
        assert gk.stats()["counters"]["admitted"] > 0
    finally:
        gk.close()


# ------------------------------------------------------------- the stateful reference model

PROJECT = "p"
MODEL_SERVICES = ("a", "b", "c")
MODEL_CALLERS = ("x", "y")
#: Patterns a generated configuration may use, and how the model resolves them.
PROJECT_PATTERNS = ("p",)
SERVICE_PATTERNS = ("p/a", "p/*")
CALLER_PATTERNS = ("p/a/x", "p/b/*", "p/*/y", "p/*/*")


@dataclass(frozen=True)
class ModelLimit:
    concurrency: int | None
    rate: tuple[int, float] | None
    count: frozenset[int] | None
    delay: float | None


def model_limits() -> st.SearchStrategy[dict[str, dict[str, Any]]]:
    rate = st.sampled_from(["1/1s", "2/5s", "3/10s"])
    extras = {"delay": st.sampled_from([0.5, 1.0, 2.5])}
    limit = st.one_of(
        st.fixed_dictionaries(
            {"concurrency": st.integers(0, 3)}, optional={"rate": rate, **extras}
        ),
        st.fixed_dictionaries(
            {"rate": rate},
            optional={"count": st.just([401]), **extras},
        ),
    )
    patterns = PROJECT_PATTERNS + SERVICE_PATTERNS + CALLER_PATTERNS
    return st.dictionaries(st.sampled_from(patterns), limit, max_size=len(patterns))


def parse_model(limits: dict[str, dict[str, Any]]) -> dict[str, ModelLimit]:
    parsed = {}
    for path, spec in limits.items():
        rate = None
        if "rate" in spec:
            number, _, seconds = spec["rate"].partition("/")
            rate = (int(number), float(seconds.rstrip("s")))
        parsed[path] = ModelLimit(
            concurrency=spec.get("concurrency"),
            rate=rate,
            count=frozenset(spec["count"]) if "count" in spec else None,
            delay=spec.get("delay"),
        )
    return parsed


@dataclass
class ModelAdmission:
    real: Admission
    #: concrete path -> (window stamp or None, count statuses or None)
    slots: dict[str, tuple[float | None, frozenset[int] | None]]
    delay: float
    released: bool = False


@dataclass
class Model:
    """A deliberately naive engine: lists and loops, no cleverness."""

    limits: dict[str, ModelLimit]
    inflight: Counter[str] = field(default_factory=Counter)
    windows: dict[str, list[float]] = field(default_factory=dict)
    pending: list[tuple[float, list[str]]] = field(default_factory=list)
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def mature(self, now: float) -> None:
        for due, paths in [item for item in self.pending if item[0] <= now]:
            self.pending.remove((due, paths))
            for path in paths:
                self.inflight[path] -= 1

    def resolve(self, service: str, caller: str) -> list[tuple[str, ModelLimit | None]]:
        """(concrete path, limit) per level: the most specific matching pattern."""

        def first(patterns: list[str]) -> ModelLimit | None:
            return next((self.limits[p] for p in patterns if p in self.limits), None)

        return [
            (PROJECT, first([PROJECT])),
            (f"{PROJECT}/{service}", first([f"p/{service}", "p/*"])),
            (
                f"{PROJECT}/{service}/{caller}",
                first([f"p/{service}/{caller}", f"p/{service}/*", f"p/*/{caller}", "p/*/*"]),
            ),
        ]

    def full(self, path: str, limit: ModelLimit) -> bool:
        """Whether ``path``'s concurrency is all taken."""
        return limit.concurrency is not None and self.inflight[path] >= limit.concurrency

    def window_wait(
        self, path: str, limit: ModelLimit, now: float, *, peek: bool = False
    ) -> float | None:
        """Seconds until ``path``'s full rate window admits again; None if it has room.
        The entries slid out are dropped, as an admission's check drops them, unless it
        is a ``peek`` (the engine peeks at the limits it looks at after a refusal): an
        entry slid out of a window a reload then lengthens is back in it until an
        admission's check drops it."""
        if limit.rate is None:
            return None
        number, seconds = limit.rate
        cutoff = now - seconds
        window = [t for t in self.windows.get(path, []) if t > cutoff]
        if not peek:
            self.windows[path] = window
        return window[0] - cutoff if len(window) >= number else None

    def admit(self, service: str, caller: str, now: float) -> tuple[Any, ...]:
        """("admitted", slots, delay) or ("rejected", code, limit, retry_after)."""
        self.mature(now)
        levels = self.resolve(service, caller)
        delay = 0.0
        for _, limit in levels:
            if limit is not None and limit.delay is not None:
                delay = limit.delay
        if not any(limit is not None and limit.concurrency is not None for _, limit in levels):
            delay = 0.0  # a delay holds concurrency slots: here there are none
        slots = [(path, limit) for path, limit in levels if limit is not None]
        for at, (path, limit) in enumerate(slots):
            if self.full(path, limit):
                # When a delayed release holding this path matures (any moment if none).
                soonest = min((due for due, paths in self.pending if path in paths), default=now)
                code, wait = "GK-CONCURRENCY-LIMIT", soonest - now
                # Its own window, full too, may keep the request out longer.
                own = self.window_wait(path, limit, now, peek=True)
                if own is not None and own > wait:
                    code, wait = "GK-RATE-LIMIT", own
            else:
                found = self.window_wait(path, limit, now)
                if found is None:
                    continue
                code, wait = "GK-RATE-LIMIT", found
            # Of the limits full now after it, one that waits longer answers: a full
            # concurrency limit for its soonest delayed release (0 without one), else a
            # full window.
            for later, other in slots[at + 1 :]:
                if self.full(later, other):
                    held = min((due for due, paths in self.pending if later in paths), default=now)
                    if held - now > wait:
                        code, path, wait = "GK-CONCURRENCY-LIMIT", later, held - now
                    continue
                longer = self.window_wait(later, other, now, peek=True)
                if longer is not None and longer > wait:
                    code, path, wait = "GK-RATE-LIMIT", later, longer
            self.rejected[code] += 1
            return ("rejected", code, path, wait)
        taken: dict[str, tuple[float | None, frozenset[int] | None]] = {}
        for path, limit in slots:
            self.inflight[path] += 1
            stamp = None
            if limit.rate is not None:
                self.windows[path].append(now)
                stamp = now
            taken[path] = (stamp, limit.count)
        self.admitted += 1
        return ("admitted", taken, delay)

    def release(
        self, admission: ModelAdmission, status: int | None, faulty: bool, now: float
    ) -> None:
        if admission.released:
            return
        admission.released = True
        for path, (stamp, count) in admission.slots.items():
            if stamp is not None and count is not None and status not in count:
                window = self.windows[path]
                if stamp in window:
                    window.remove(stamp)
        if faulty and admission.delay > 0:
            self.pending.append((now + admission.delay, list(admission.slots)))
        else:
            for path in admission.slots:
                self.inflight[path] -= 1

    def busy(self, now: float) -> dict[str, int]:
        self.mature(now)
        return {path: n for path, n in self.inflight.items() if n}


def retry_after(seconds: float) -> int:
    return max(1, math.ceil(seconds - 1e-9))


class EngineMachine(RuleBasedStateMachine):
    """The memory-backed engine against the naive model: admit, release, time, reload."""

    admissions = Bundle("admissions")
    released = Bundle("released")

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.TemporaryDirectory()
        self.path = Path(self.directory.name) / "gatekeeper.properties"
        self.clock = FakeClock()
        self.variants: list[dict[str, dict[str, Any]]] = []
        self.current = 0
        self.gk: GateKeeper | None = None
        self.model: Model | None = None
        self.outstanding: list[ModelAdmission] = []

    @initialize(variants=st.lists(model_limits(), min_size=2, max_size=2))
    def start(self, variants: list[dict[str, dict[str, Any]]]) -> None:
        self.variants = variants
        self.write(0)
        self.gk = GateKeeper(
            {
                "project": PROJECT,
                "reload": {
                    "file": str(self.path),
                    "every_seconds": 1e9,
                    "every_requests": 10**9,
                },
            },
            clock=self.clock,
        )
        self.model = Model(parse_model(variants[0]))

    def write(self, index: int) -> None:
        self.current = index
        text = properties({"project": PROJECT, "limits": self.variants[index]})
        before = self.path.stat().st_mtime_ns if self.path.exists() else 0
        self.path.write_text(text, encoding="utf-8")
        os.utime(self.path, ns=(before + 10**9, before + 10**9))

    @rule(
        target=admissions,
        service=st.sampled_from(MODEL_SERVICES),
        caller=st.sampled_from(MODEL_CALLERS),
    )
    def admit(self, service: str, caller: str) -> Any:
        assert self.gk is not None and self.model is not None
        expected = self.model.admit(service, caller, self.clock.now)
        try:
            real = self.gk.admit(PROJECT, service, caller)
        except Rejected as rejection:
            assert expected[0] == "rejected", f"engine refused, model admitted: {rejection}"
            _, code, path, seconds = expected
            assert rejection.code == code
            assert rejection.limit_path is not None
            assert concrete(rejection.limit_path, service, caller) == path
            assert rejection.retry_after == retry_after(seconds)
            return multiple()
        assert expected[0] == "admitted", f"engine admitted, model refused: {expected}"
        _, slots, delay = expected
        assert real.delay == delay
        admission = ModelAdmission(real, slots, delay)
        self.outstanding.append(admission)
        return admission

    @rule(
        target=released,
        admission=consumes(admissions),
        status=st.sampled_from([200, 401, 500, 504, None]),
        faulty=st.booleans(),
    )
    def release(self, admission: ModelAdmission, status: int | None, faulty: bool) -> Any:
        assert self.model is not None
        admission.real.release(status, faulty=faulty)
        self.model.release(admission, status, faulty, self.clock.now)
        return admission

    @rule(admission=released, status=st.sampled_from([200, 500]))
    def release_again(self, admission: ModelAdmission, status: int) -> None:
        assert self.model is not None
        admission.real.release(status, faulty=True)
        self.model.release(admission, status, True, self.clock.now)

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 2.5, 5.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(index=st.integers(0, 1))
    def reload(self, index: int) -> None:
        assert self.gk is not None and self.model is not None
        changed = parse_model(self.variants[index]) != parse_model(self.variants[self.current])
        self.write(index)
        assert self.gk.reload() is changed
        self.model.limits = parse_model(self.variants[index])

    @invariant()
    def counts_agree(self) -> None:
        if self.gk is None or self.model is None:
            return
        now = self.clock.now
        real = {path: n for path, n in self.gk.inflight().items() if n}
        assert real == self.model.busy(now)
        counters = self.gk.stats()["counters"]
        assert counters["admitted"] == self.model.admitted
        assert counters["rejected"] == dict(self.model.rejected)
        assert counters["delayed_pending"] == len(self.model.pending)

    def teardown(self) -> None:
        try:
            if self.gk is not None and self.model is not None:
                self.clock.advance(100.0)
                for admission in self.outstanding:
                    admission.real.release(200)
                assert {p: n for p, n in self.gk.inflight().items() if n} == {}
                self.gk.close()
        finally:
            self.directory.cleanup()


def concrete(pattern: str, service: str, caller: str) -> str:
    """The concrete path a limit pattern counts for this request."""
    values = (PROJECT, service, caller)
    return "/".join(values[index] for index in range(len(pattern.split("/"))))


EngineMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestEngineAgainstModel = EngineMachine.TestCase
TestEngineAgainstModel.__doc__ = (
    "The engine agrees with a naive model on every admission, rejection and count."
)
