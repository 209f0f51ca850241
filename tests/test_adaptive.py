"""The adaptive controllers against a modelled backend: deterministic, synthetic latencies.

The model: a backend of capacity C serves up to C requests at its base latency; beyond C
they queue, so latency grows as ``base x in_flight / C``. Clients are many more than C, so
the limiter alone decides the in-flight count. Time is simulated (no sleeps, no threads).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.adaptive import (
    ALGORITHMS,
    PROBE_EVERY,
    SAMPLE_CEILING,
    AdaptiveSpec,
    Controller,
)

BASE = 0.020  # seconds: the modelled backend's unloaded latency


@dataclass
class ModelledBackend:
    """Feeds a controller the samples a backend of ``capacity`` would produce."""

    capacity: float
    clients: int = 1000
    base: float = BASE
    faulty_share: float = 0.0
    faulty_latency: float | None = None  # None: as slow as a good response
    #: overload fails instead of queueing: latency stays ``base``, and of ``in_flight``
    #: requests all but ``capacity`` fail (a backend shedding load with quick 503s)
    sheds: bool = False
    noise: float = 0.1  # ± share of each latency, uniformly
    #: mean seconds between stalls of the host (0: none); a request finishing during one
    #: took up to 3 x ``stall`` seconds longer (a GC pause, a starved CPU)
    stall_every: float = 0.0
    stall: float = 0.15
    now: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(7))
    trace: list[int] = field(default_factory=list)
    _owed: float = 0.0

    def run(self, controller: Controller, seconds: float, step: float = 0.005) -> None:
        """Advance ``seconds``: in each step the in-flight count is the limit (or the
        clients, if fewer), and requests complete at in_flight / latency per second."""
        end = self.now + seconds
        stalled_until = -1.0
        while self.now < end:
            if self.stall_every and self.rng.random() < step / self.stall_every:
                stalled_until = self.now + self.stall
            inflight = min(controller.limit, self.clients)
            overload = max(1.0, inflight / self.capacity)
            latency = self.base if self.sheds else self.base * overload
            failing = 1.0 - 1.0 / overload if self.sheds else self.faulty_share
            self._owed += inflight * step / latency
            while self._owed >= 1.0:
                self._owed -= 1.0
                sampled = latency * (1.0 + self.noise * (2.0 * self.rng.random() - 1.0))
                faulty = self.rng.random() < failing
                if faulty and self.faulty_latency is not None:
                    sampled = self.faulty_latency
                if self.now < stalled_until:
                    sampled += 3.0 * self.stall * self.rng.random()
                controller.sample(sampled, inflight, faulty, self.now - sampled, self.now)
            self.now += step
            self.trace.append(controller.limit)


def settled(algorithm: str, capacity: float, **spec: int) -> tuple[Controller, ModelledBackend]:
    """A controller that ran 20 s against a backend of ``capacity``."""
    controller = Controller(AdaptiveSpec(algorithm, **spec), 0.0, key="shop")  # type: ignore[arg-type]
    backend = ModelledBackend(capacity)
    backend.run(controller, 20.0)
    return controller, backend


#: How far above the backend's capacity each algorithm may settle (its mean limit over
#: the last 5 s): the excess is a standing queue, latency every admitted request pays.
SETTLED_ABOVE = {"gradient": 1.15, "vegas": 1.2, "aimd": 1.2}


def settled_mean(backend: ModelledBackend, seconds: float = 5.0) -> float:
    """The mean limit over the last ``seconds`` the backend ran (one trace entry a step)."""
    tail = backend.trace[-int(seconds / 0.005) :]
    return sum(tail) / len(tail)


@pytest.mark.parametrize("capacity", [20, 100])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_converges_near_the_backends_capacity(algorithm: str, capacity: int) -> None:
    """Each algorithm settles between 0.9 C and 1.15-1.2 C (gradient, the default, within
    15 %), so the latency of admitted requests stays within 1.25 x base."""
    controller, backend = settled(algorithm, capacity)
    assert 0.9 * capacity <= settled_mean(backend) <= SETTLED_ABOVE[algorithm] * capacity
    assert controller.latency <= 1.25 * BASE
    assert controller.min_latency == pytest.approx(BASE, rel=0.1)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_noisy_latencies_are_not_mistaken_for_a_queue(algorithm: str) -> None:
    """Latencies ±30 % at random, C = 100: the limit still settles at 0.9 C or more (the
    lowest window of noise is not a baseline that makes every other window look queued)."""
    controller = Controller(AdaptiveSpec(algorithm), 0.0, key="shop")  # type: ignore[arg-type]
    backend = ModelledBackend(100, noise=0.3)
    backend.run(controller, 30.0)
    assert 0.9 * 100 <= settled_mean(backend) <= SETTLED_ABOVE[algorithm] * 100


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stalls_of_the_host_do_not_starve_the_backend(algorithm: str) -> None:
    """A 150 ms stall about every second, adding up to 450 ms to the requests finishing in
    it: each algorithm still settles at 0.85 C or more (the few stalled requests count at
    most twice the baseline, so they do not drag a window's mean, and the limit, down)."""
    controller = Controller(AdaptiveSpec(algorithm), 0.0, key="shop")  # type: ignore[arg-type]
    backend = ModelledBackend(20, stall_every=1.0)
    backend.run(controller, 40.0)
    assert settled_mean(backend, 30.0) >= 0.85 * 20


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_follows_a_capacity_halving_within_5_s_and_recovers(algorithm: str) -> None:
    """Capacity halves: within 5 s the limit is within 50 % of C/2; it regrows after."""
    capacity = 40
    controller, backend = settled(algorithm, capacity)
    backend.capacity = capacity / 2
    backend.run(controller, 5.0)
    assert 0.5 * capacity / 2 <= controller.limit <= 1.5 * capacity / 2
    backend.capacity = capacity
    backend.run(controller, 10.0)
    assert controller.limit >= 0.9 * capacity


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stays_within_min_and_max(algorithm: str) -> None:
    """A backend far bigger than max, then far smaller than min: the limit never leaves
    [min, max] at any moment, probes included (they pin it to min when min > 3)."""
    controller = Controller(AdaptiveSpec(algorithm, min=8, max=30, initial=10), 0.0)  # type: ignore[arg-type]
    backend = ModelledBackend(capacity=500)
    backend.run(controller, 20.0)
    assert controller.limit == 30
    backend.capacity = 1
    backend.run(controller, 2 * PROBE_EVERY)
    assert controller.limit < 30
    assert 8 == min(backend.trace) <= max(backend.trace) == 30


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_faulty_responses_lower_the_limit(algorithm: str) -> None:
    """Half the responses faulty (latency unchanged): within 2 s the limit is below half
    of what it had settled at."""
    controller, backend = settled(algorithm, 40)
    before = controller.limit
    backend.faulty_share = 0.5
    backend.run(controller, 2.0)
    assert controller.limit < before / 2


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_quick_failures_do_not_fake_a_lower_baseline(algorithm: str) -> None:
    """30 % of responses fail in 0.5 ms for 3 s: the baseline stays the backend's, and
    within 5 s of the failures ending the limit is back near capacity."""
    controller, backend = settled(algorithm, 40)
    backend.faulty_share, backend.faulty_latency = 0.3, 0.0005
    backend.run(controller, 3.0)
    assert controller.min_latency == pytest.approx(BASE, rel=0.1)
    backend.faulty_share = 0.0
    backend.run(controller, 5.0)
    assert controller.limit >= 0.8 * 40


@pytest.mark.parametrize("algorithm", ["gradient", "vegas"])
def test_a_trickle_of_errors_does_not_walk_the_limit_down(algorithm: str) -> None:
    """1 % faulty responses for a minute: gradient and vegas stay near capacity."""
    controller, backend = settled(algorithm, 40)
    backend.faulty_share = 0.01
    backend.run(controller, 60.0)
    assert controller.limit >= 0.8 * 40


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("share", [0.1, 0.2, 0.3])
def test_a_steady_share_of_errors_does_not_walk_the_limit_down(
    algorithm: str, share: float
) -> None:
    """Errors the backend gives whatever its load (a dependency failing for some keys,
    input that makes 500s), from the start, for a minute: the probes see them at no load
    too, so they are no sign of overload, and the limit stays near the capacity (a steady
    20 % walked gradient down to 16 and aimd to its minimum, window after window)."""
    controller = Controller(AdaptiveSpec(algorithm), 0.0, key="shop")  # type: ignore[arg-type]
    backend = ModelledBackend(40, faulty_share=share)
    backend.run(controller, 60.0)
    assert min(backend.trace[-1000:]) >= 0.8 * 40


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_errors_that_come_with_load_keep_the_limit_near_capacity(algorithm: str) -> None:
    """A backend that sheds its overload with quick errors (latency flat: only the errors
    say it is full): the probes see none at no load, so the errors above capacity lower
    the limit, which stays near the capacity for a minute, probes included."""
    controller = Controller(AdaptiveSpec(algorithm), 0.0, key="shop")  # type: ignore[arg-type]
    backend = ModelledBackend(40, sheds=True)
    backend.run(controller, 60.0)
    assert 0.8 * 40 <= min(backend.trace[-4000:]) <= max(backend.trace[-4000:]) <= 1.3 * 40


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_growth_without_a_signal(algorithm: str) -> None:
    """Five clients against a huge backend for two minutes: the limit does not climb
    towards max just because nothing pushes back."""
    controller = Controller(AdaptiveSpec(algorithm, max=1000), 0.0)  # type: ignore[arg-type]
    backend = ModelledBackend(capacity=1000, clients=5)
    backend.run(controller, 120.0)
    assert controller.limit <= 20


def test_no_samples_no_change() -> None:
    """A path nobody calls keeps its initial limit."""
    controller = Controller(AdaptiveSpec("gradient", initial=12), 0.0)
    assert controller.limit == 12
    assert controller.report() == {"limit": 12, "latency_ms": 0.0, "min_latency_ms": 0.0}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_slower_deploy_does_not_collapse_the_limit(algorithm: str) -> None:
    """The base latency doubles for good (same capacity): the baseline is re-measured,
    so after a probe period the limit is back near capacity instead of stuck at min."""
    controller, backend = settled(algorithm, 40)
    backend.base = 2 * BASE
    backend.run(controller, 1.5 * PROBE_EVERY)
    assert controller.limit >= 0.8 * 40
    assert controller.min_latency == pytest.approx(2 * BASE, rel=0.15)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic(algorithm: str) -> None:
    """The same samples give the same limits, step by step."""
    traces = []
    for _ in range(2):
        _, backend = settled(algorithm, 30)
        traces.append(backend.trace)
    assert traces[0] == traces[1]


def test_respec_keeps_what_was_learned_within_new_bounds() -> None:
    """A reload that lowers max clamps the learned limit; raising it keeps the value."""
    controller, _ = settled("gradient", 100)
    learned = controller.limit
    controller.respec(AdaptiveSpec("gradient", max=50))
    assert controller.limit == 50
    controller.respec(AdaptiveSpec("gradient", max=1000))
    assert controller.limit == 50 < learned


def test_requests_admitted_before_a_probe_do_not_count_as_probe_samples() -> None:
    """Samples of requests admitted under the old limit are ignored by a probe: its
    baseline comes only from requests admitted at the pinned concurrency."""
    controller = Controller(AdaptiveSpec("gradient"), 0.0)
    controller.sample(0.5, 50, False, -0.5, 0.0)  # starts the first probe at t=0
    for index in range(20):  # slow ones admitted before it began
        controller.sample(0.5, 50, False, -0.1, 0.01 * index)
    for index in range(10):
        controller.sample(0.02, 2, False, 0.2 + index * 0.02, 0.22 + index * 0.02)
    assert controller.min_latency == pytest.approx(0.02)


@settings(max_examples=200, deadline=None)
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    bounds=st.tuples(st.integers(1, 50), st.integers(0, 50), st.integers(0, 50)),
    samples=st.lists(
        st.tuples(
            st.floats(-1.0, 1e6, allow_nan=False),  # latency, a clock may even step back
            st.integers(0, 10_000),  # in flight
            st.booleans(),  # faulty
            st.floats(0.0, 100.0, allow_nan=False),  # seconds until this release
        ),
        max_size=300,
    ),
)
def test_any_samples_keep_the_limit_within_bounds(
    algorithm: str, bounds: tuple[int, int, int], samples: list[tuple[float, int, bool, float]]
) -> None:
    """Whatever the samples (zero, negative or huge latencies, bursts of failures, long
    silences), sampling never raises and the limit stays an int within [min, max]."""
    low, extra, start = bounds
    spec = AdaptiveSpec(algorithm, low, low + extra, low + min(start, extra))  # type: ignore[arg-type]
    controller = Controller(spec, 0.0)
    now = 0.0
    for latency, inflight, faulty, gap in samples:
        now += gap
        controller.sample(latency, inflight, faulty, now - latency, now)
        assert isinstance(controller.limit, int)
        assert spec.min <= controller.limit <= spec.max
        assert controller.min_latency >= 0.0


def test_a_clock_that_does_not_move_is_no_signal() -> None:
    """Latencies of exactly 0 (an injected clock nobody advances) change nothing."""
    controller = Controller(AdaptiveSpec("gradient", initial=10), 0.0)
    for _ in range(1000):
        controller.sample(0.0, 10, False, 0.0, 0.0)
    assert controller.limit == 10


@given(
    algorithm=st.sampled_from(ALGORITHMS),
    samples=st.lists(
        st.tuples(
            st.floats(0.0, 2.0),
            st.integers(0, 200),
            st.booleans(),
            st.floats(0.0, 0.5),
        ),
        max_size=60,
    ),
)
def test_a_restored_state_behaves_exactly_as_the_controller_it_came_from(
    algorithm: str, samples: list[tuple[float, int, bool, float]]
) -> None:
    """A controller rebuilt from its state after every sample (as a backend that shares it
    between processes does) makes the same decisions as one that was never stored."""
    spec = AdaptiveSpec(algorithm, min=2, max=300, initial=20)  # type: ignore[arg-type]
    kept = Controller(spec, 0.0, key="shop")
    stored = Controller(spec, 0.0, key="shop").state()
    now = 0.0
    for latency, inflight, faulty, step in samples:
        now += step
        kept.sample(latency, inflight, faulty, now - latency, now)
        shared = Controller.restore(spec, stored, key="shop")
        shared.sample(latency, inflight, faulty, now - latency, now)
        stored = shared.state()
        assert shared.limit == kept.limit
        assert shared.report() == kept.report()
    # repr, because NaN (no probe running) never equals itself
    assert repr(Controller.restore(spec, stored, key="shop").state()) == repr(kept.state())


def test_a_restored_state_takes_the_new_bounds() -> None:
    """Restored under a reloaded, narrower table, the limit is within its bounds at once."""
    controller, _backend = settled("gradient", capacity=40.0)
    narrow = AdaptiveSpec("gradient", min=1, max=5, initial=3)
    restored = Controller.restore(narrow, controller.state(), key="shop")
    assert 1 <= restored.limit <= 5


def test_a_state_of_the_wrong_length_is_refused() -> None:
    """A state from another version of the controller is an error, not a silent misread."""
    with pytest.raises(ValueError, match="numbers"):
        Controller.restore(AdaptiveSpec(), (1.0, 2.0))


@given(
    window=st.tuples(
        st.floats(0.0, 100.0),
        st.integers(0, 50),
        st.floats(0.0, 10.0),
        st.integers(0, 50),
        st.integers(0, 200),
    ),
    baseline=st.floats(0.0, 1.0),
    latency=st.floats(0.0, 5.0),
    inflight=st.integers(0, 200),
    faulty=st.booleans(),
)
def test_a_loaded_window_gathers_as_the_whole_controller(
    window: tuple[float, int, float, int, int],
    baseline: float,
    latency: float,
    inflight: int,
    faulty: bool,
) -> None:
    """A spare controller loaded with a window and its baseline (the shared file's fast
    path) adds a sample to it exactly as the controller the window belongs to, stalls
    capped at SAMPLE_CEILING x the baseline included."""
    spec = AdaptiveSpec("gradient", min=2, max=300, initial=20)
    # The window's own controller: a whole state holding that window and baseline.
    state = dict(zip(Controller.STATE, Controller(spec, 0.0).state(), strict=True))
    state.update(zip(("_due", "_count", "_total", "_drops", "_peak"), window, strict=True))
    state["min_latency"] = baseline
    whole = Controller.restore(spec, tuple(state.values()))
    spare = Controller(spec, 0.0)
    spare.load_window(window, baseline)
    now = window[0] - 1.0  # before the window is due: only gathered
    for controller in (whole, spare):
        controller.sample(latency, inflight, faulty, now - latency, now)
    assert spare.window() == whole.window()
    if baseline > 0.0 and not faulty:
        assert spare.window()[2] <= window[2] + SAMPLE_CEILING * baseline
