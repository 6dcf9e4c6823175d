r"""The one warm-up (:class:`aml_ppl.inference.hmc.adaptation.WarmUp`) that every HMC sampler
runs: its hooks called at Stan's windows, its step size as dual averaging leaves it."""

from __future__ import annotations

import pytest

from aml_ppl.inference.hmc.adaptation import DualAveraging, WarmUp, WarmupWindows

TARGET = 0.8


class Recorded(WarmUp):
    r"""A warm-up with a scripted transition (its point: the iteration; its statistic: 0.6 or
    0.9 by parity) that records its hooks' calls; the search doubles the step size."""

    target_accept_prob = TARGET

    def __init__(self, warmup_steps: int) -> None:
        self.windows, self.step_size, self.current = WarmupWindows.of(warmup_steps), 0.5, None
        self.averaging = DualAveraging.start(TARGET, self.step_size)
        self.calls: list[tuple[str, int | None]] = []

    def _warmup_transition(self, iteration: int) -> tuple[int, float]:
        return iteration, 0.9 if iteration % 2 else 0.6

    def _gather(self, current: int) -> None:
        self.calls.append(("gather", current))

    def _end_window(self) -> None:
        self.calls.append(("end", None))

    def _search_step_size(self, current: int, step_size: float) -> float:
        self.calls.append(("search", current))
        return 2 * step_size


@pytest.mark.parametrize("warmup_steps", [10, 150, 500])
def test_the_warm_up_gathers_in_the_metric_windows_and_ends_on_the_averaged_step(warmup_steps):
    warm_up = Recorded(warmup_steps)
    for iteration in range(warmup_steps):
        warm_up.adapt(iteration)
    slow = warm_up.windows.bounds[1:-1]
    expected = []
    for first, last in slow:
        expected += [("gather", iteration) for iteration in range(first, last + 1)] + [("end", None), ("search", last)]
    assert warm_up.calls == expected
    # Stan's schedule: dual averaging over every transition's statistic, restarted about the
    # searched step at each metric window's end; the warm-up keeps the last scheme's average.
    ends = {last for _, last in slow}
    averaging = DualAveraging.start(TARGET, 0.5)
    for iteration in range(warmup_steps):
        averaging = averaging.update(0.9 if iteration % 2 else 0.6)
        if iteration in ends:
            averaging = DualAveraging.start(TARGET, 2 * averaging.step_size)
    assert warm_up.averaging == averaging
    assert warm_up.step_size == averaging.averaged_step_size


def test_a_sampler_without_its_hooks_fails_at_once():
    with pytest.raises(NotImplementedError):
        WarmUp().adapt(0)
