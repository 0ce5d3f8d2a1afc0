"""The decisions of an elastic training (``runtime.elastic``), as pure functions of what was measured and estimated:
which device is slow, how fast it now is, whether moving to a new plan pays, and the cluster that is left.

The slow-device rule (``SlowRule``). Every step, each device's measured compute (forward, backward and update:
``RankRecord.compute_s``) is divided by the cost model's estimate of it for the running plan. The cost model is
not exact, and its error differs by device and stage (a 10-30 % bias on a quota-limited CPU is usual), so a ratio
is judged against the device's own *baseline*: the median ratio of the first segment of steps the plan ran (its
first step, which builds the stage and warms the caches, left out), and the noise is that segment's spread, the
median absolute deviation in relative terms scaled to a standard deviation (x 1.4826) and multiplied by
``spread_factor`` (3: a normal step passes it about once in 300), never below ``noise_floor`` (10 %: on two shared
cores the same plan varies by that much) nor below ``floor_s`` of absolute excess (2 ms). Why an absolute floor: a
step's timing carries jitter of a fixed size, not a fixed share: a preemption by another thread costs a scheduler
slice (Linux's least one is 0.75 ms x (1 + log2 of the cores, up to 8): 3 ms on a 16-core host), a timer wake-up or
a GPU's launch queue tens to hundreds of microseconds. On a millisecond step that is 20 % and more, and it comes in
runs (a busy neighbour for a second), so ten steps of a quiet baseline do not see it; a relative floor alone made a
0.75 ms step "1.21x slower". On steps of tens of milliseconds and more the absolute floor is below the relative
one and changes nothing. Nor may a step count as slow unless it is beyond every step of the baseline segment
(``Baseline.highest``): a quota-limited CPU's compute is bimodal (a step that overruns its quota waits for the
next period, 10 ms), and a baseline whose steps were mostly within quota has a small MAD but has shown that the
long steps are usual; for a normal spread the largest of nine steps is below 3 robust sigmas and changes nothing.

A device is judged beside the others (``beside_the_others``): each step's ratio is divided by the median slowdown
(ratio over baseline) of the plan's other devices in that step. A load they all share (another job on shared
cores, a busier host machine) is no device slowing, and since a plan weighs the devices' speeds against each other
it changes no plan; on two shared cores it made three of four devices "2.4-3x slower" at once. A device is slow
when each of its last ``steps`` steps (K) so judged exceeds its baseline by more than the noise. Why consecutive steps and the last ones: one slow step is a stray (a page fault,
another process); K in a row at the end of the segment is a device that is slow now, not one that was slow for a
while and recovered. Its slowdown is the median ratio of those K steps over the baseline, and its speed is
re-estimated as its speed over that slowdown (through the calibration's slowdown exponent).

The migration rule (``migration``): move to the new plan when its estimated gain over the steps left, (running
plan's step time - new plan's) x steps left, both estimated on the re-estimated cluster, exceeds the cost of the
move: a pool started for the new plan, and the checkpoint loaded into it, as measured so far in this training.
The gain is in the cost model's seconds and the cost in measured ones, so the gain is scaled by the running plan's
measured step over its estimate (the median of the steps that found the device slow): on a throttled or shared
host the model's absolute times run several times short (0.127 s estimated against 0.5-0.9 s measured), and an
unscaled gain would keep a plan whose real loss far exceeds the move.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tapp_core.platform.cluster import Cluster

MAD_TO_SIGMA = 1.4826
"""The median absolute deviation of a normal sample times this is its standard deviation."""


@dataclass(frozen=True)
class SlowRule:
    """When a device counts as slow (the module's doc says why)."""

    steps: int = 5
    """K: the consecutive last steps that must all be beyond the noise."""
    noise_floor: float = 0.10
    """The least relative excess over the baseline that counts."""
    spread_factor: float = 3.0
    """The noise is this many (robust) standard deviations of the baseline's ratios."""
    floor_s: float = 0.002
    """The least absolute excess over the baseline's compute that counts, in seconds."""


@dataclass(frozen=True)
class Baseline:
    """A device's usual measured over estimated compute, and how far above it a step may go and still be noise."""

    ratio: float
    noise: float
    highest: float = 0.0
    """The baseline segment's largest ratio."""

    @property
    def limit(self) -> float:
        """The ratio a step must exceed to count as slow."""
        return max(self.ratio * (1 + self.noise), self.highest)


def compute_ratios(measured_s: Sequence[float], estimated_s: float) -> list[float]:
    """Each step's measured compute over the estimate of it."""
    return [m / estimated_s for m in measured_s] if estimated_s > 0 else []


def baseline(ratios: Sequence[float], estimated_s: float, rule: SlowRule) -> Baseline | None:
    """The device's baseline from its ratios to ``estimated_s`` (the first step left out by the caller); None
    without two ratios."""
    if len(ratios) < 2 or estimated_s <= 0:
        return None
    middle = statistics.median(ratios)
    spread = statistics.median(abs(r - middle) for r in ratios) * MAD_TO_SIGMA / middle
    noise = max(rule.noise_floor, rule.spread_factor * spread, rule.floor_s / (middle * estimated_s))
    return Baseline(middle, noise, max(ratios))


def beside_the_others(ratios: Mapping[str, Sequence[float]], usual: Mapping[str, Baseline]) -> dict[str, list[float]]:
    """Each device's ratios (those with a baseline) over, step by step, the median slowdown (ratio over baseline) of
    the other devices: the load they share taken out; a device alone keeps its own."""
    ranked = {d: ratios[d] for d in ratios if d in usual}
    relative = {}
    for device, own in ranked.items():
        others = [[r / usual[d].ratio for r in series] for d, series in ranked.items() if d != device]
        if not others:
            relative[device] = list(own)
            continue
        relative[device] = [r / statistics.median(step) for r, *step in zip(own, *others, strict=False)]
    return relative


def slowdown(ratios: Sequence[float], usual: Baseline, rule: SlowRule) -> float | None:
    """The device's slowdown (median of its last K ratios over its baseline) when each of its last K steps is beyond
    the baseline by more than the noise; None when it is not slow."""
    last = list(ratios[-rule.steps :])
    if len(last) < rule.steps or any(r <= usual.limit for r in last):
        return None
    return statistics.median(last) / usual.ratio


def reestimated_speed(speed: float, slowed_by: float, slowdown_exponent: float = 1.0) -> float:
    """The speed of a device of ``speed`` whose compute now takes ``slowed_by`` times longer, where compute on a
    device of speed s takes (1/s) ** ``slowdown_exponent`` times the reference's."""
    return float(speed * slowed_by ** (-1.0 / slowdown_exponent))


@dataclass(frozen=True)
class Migration:
    """The estimated gain of moving to the new plan over the steps left, the cost of the move, and the verdict."""

    gain_s: float
    cost_s: float

    @property
    def migrate(self) -> bool:
        return self.gain_s > self.cost_s


def migration(
    running_step_s: float,
    new_step_s: float,
    steps_left: int,
    move_cost_s: float,
    measured_step_s: float | None = None,
) -> Migration:
    """Whether moving pays (the module's doc); ``measured_step_s``: the running plan's measured step, which puts the
    estimated gain in measured seconds."""
    scale = measured_step_s / running_step_s if measured_step_s and running_step_s > 0 else 1.0
    return Migration((running_step_s - new_step_s) * scale * max(steps_left, 0), move_cost_s)


def without(cluster: Cluster, lost: Iterable[str]) -> Cluster:
    """``cluster`` without the devices ``lost`` (and the link overrides that named fewer than two of the rest)."""
    gone = set(lost)
    data = cluster.model_dump()
    data["devices"] = [d for d in data["devices"] if d["name"] not in gone]
    overrides = []
    for override in data["links"]["overrides"]:
        between = [name for name in override["between"] if name not in gone]
        if len(between) >= 2:
            overrides.append({**override, "between": between})
    data["links"]["overrides"] = overrides
    return Cluster.model_validate(data).from_file(cluster.source)


def with_speeds(cluster: Cluster, speeds: Mapping[str, float]) -> Cluster:
    """``cluster`` with the given devices' speeds replaced."""
    data = cluster.model_dump()
    for device in data["devices"]:
        if device["name"] in speeds:
            device["speed"] = speeds[device["name"]]
    return Cluster.model_validate(data).from_file(cluster.source)
