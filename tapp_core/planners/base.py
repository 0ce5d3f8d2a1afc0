"""What every planner is: ``plan(context, budget) -> Plan``, its shared options, and the registry.

``context`` is the run's ``tapp_core.cost.context.CostContext`` (library, cluster, calibration).
A planner is a small dataclass whose fields are its options; ``get_planner(name, **options)`` builds one by
name and rejects an option it does not have with a message listing those it has. ``budget`` is the most
reward evaluations (cost-model estimates or runtime measurements) a searching planner may spend; constructive
planners (single-cpu, single-gpu, bsp, even, the DPs) ignore it. Searching planners report progress once per round
through ``progress``, a callable taking one ``SearchProgress``.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from tapp_core.cost.context import CostContext
from tapp_core.cost.simulation import estimate
from tapp_core.errors import TappError
from tapp_core.plan.plan import OutOfMemory, Plan, PlanError
from tapp_core.plan.schedules import SCHEDULES, UnknownScheduleError, parse_schedule_spec, schedule_spec
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class Space:
    """What a method searches: the schedules it chooses among by default, and whether its plans may have several
    stages (a pipeline), replicated stages, split layers (operator parallelism) and uneven shares of a group's work;
    ``exhaustive``: it proves the optimum over that space under the cost model."""

    schedules: tuple[str, ...] = ("1f1b",)
    stages: bool = True
    replicas: bool = True
    split_layers: bool = False
    uneven_shares: bool = False
    exhaustive: bool = False

    def describe(self) -> str:
        """The space in words: "optimal over pipelines of replicated stages (1f1b, async) without split layers"."""
        kind = "pipelines" if self.stages else "one stage" if self.replicas else "one device"
        kind += " of replicated stages" if self.replicas and self.stages else ""
        kind += " replicated on several devices" if self.replicas and not self.stages else ""
        parts = [f"{kind} ({', '.join(self.schedules)})"]
        with_ = [w for w, on in (("split layers", self.split_layers), ("uneven shares", self.uneven_shares)) if on]
        without = [
            w for w, on in (("split layers", self.split_layers), ("uneven shares", self.uneven_shares)) if not on
        ]
        parts += [f"with {' and '.join(with_)}"] if with_ else []
        parts += [f"without {' or '.join(without)}"] if without else []
        return ("optimal over " if self.exhaustive else "searches ") + " ".join(parts)

    def holds(self, plan: Plan) -> bool:
        """Whether ``plan`` lies in this space."""
        replicated = any(len(group) > 1 for group in plan.stage_devices)
        uneven = any(len(set(shares)) > 1 for shares in plan.stage_shares)
        return (
            plan.schedule.partition(":")[0] in self.schedules
            and (self.stages or plan.n_stages == 1)
            and (self.replicas or not replicated)
            and (self.split_layers or not plan.signatures)
            and (self.uneven_shares or not uneven)
        )


@dataclass(frozen=True)
class Method:
    """A planner as the experiments name it: its name (``tapp plan --planner``, ``tapp run --methods``, MLflow's
    ``method`` tag), the label the report gives it (the paper's, where the paper has one), what it is and what it
    searches (``space``)."""

    name: str
    target: str
    """``module:Class`` under tapp_core.planners, imported on first use: the DP planners never pay for torch's
    import."""
    label: str
    description: str
    space: Space = Space()
    builds_on: tuple[str, ...] = ()
    """The planners whose modules this one's import (its own sub-package's, for TAPP): a planner module imports
    another planner's only where this declares it (``tests/test_import_graph.py`` checks both ways)."""


_ONE_DEVICE = Space(stages=False, replicas=False)
_TAPP_SPACE = Space(("1f1b", "async"), split_layers=True, uneven_shares=True)
_TAPP_BUILDS_ON = ("bsp", "even", "pipedream", "autoddl", "oracle")
"""TAPP's sub-package: the warm start's planners, the polish's cuts (tapp-rl shares the module, not their use)."""


_METHODS: tuple[Method, ...] = (
    Method(
        "tapp",
        "tapp.planner:TappPlanner",
        "TAPP",
        "the reinforcement-learning search of the TAPP paper",
        _TAPP_SPACE,
        builds_on=_TAPP_BUILDS_ON,
    ),
    Method(
        "tapp-rl",
        "tapp.planner:TappRlPlanner",
        "TAPP (RL alone)",
        "TAPP's reinforcement learning alone: no warm start from the other planners' plans, no polish",
        _TAPP_SPACE,
        builds_on=_TAPP_BUILDS_ON,
    ),
    Method(
        "single-cpu",
        "single:SingleCpuPlanner",
        "SingleCPU",
        "the whole model on the fastest CPU whose memory holds it",
        _ONE_DEVICE,
    ),
    Method(
        "single-gpu",
        "single:SingleGpuPlanner",
        "SingleGPU",
        "the whole model on the fastest GPU whose memory holds it",
        _ONE_DEVICE,
    ),
    Method(
        "bsp",
        "bsp:BspPlanner",
        "BSP",
        "synchronous data parallelism over the devices that divide the batch",
        Space(stages=False),
    ),
    Method(
        "even",
        "even:EvenPlanner",
        "Even split",
        "GPipe-style split of the layers by count and time",
        Space(replicas=False),
    ),
    Method(
        "pipetorch",
        "pipetorch:PipeTorchPlanner",
        "Pipe-Torch",
        "Pipe-Torch's dynamic programming over device speeds and links",
        Space(replicas=False),
    ),
    Method(
        "pipedream",
        "pipedream:PipeDreamPlanner",
        "PipeDream/APapo",
        "the antichain DP of PipeDream and APapo",
        Space(("async",)),
    ),
    Method(
        "autoddl",
        "autoddl:AutoDdlPlanner",
        "AutoDDL",
        "coordinate descent over the cost model, with operator parallelism (SBP layouts) inside stages",
        Space(split_layers=True, uneven_shares=True),
        builds_on=("pipeline-cd",),  # its descent, with layouts added
    ),
    Method(
        "pipeline-cd",
        "pipeline_cd:PipelineCdPlanner",
        "Pipeline CD",
        "coordinate descent over the cost model, pipelines only (no operator parallelism)",
    ),
    Method(
        "oracle",
        "oracle:OraclePlanner",
        "Oracle",
        "exhaustive search: the optimum under the cost model, on small graphs",
        Space(("1f1b", "async"), exhaustive=True),
    ),
    Method(
        "single", "single:SinglePlanner", "Single", "the whole model on the fastest device of any kind", _ONE_DEVICE
    ),
)
_REGISTRY: dict[str, Method] = {method.name: method for method in _METHODS}
OLD_NAMES: tuple[str, ...] = ("single",)
"""Still accepted, not listed: ``single`` is the fastest device of any kind (a GPU first)."""
PLANNER_NAMES: tuple[str, ...] = tuple(name for name in _REGISTRY if name not in OLD_NAMES)
PAPER_METHODS: tuple[str, ...] = ("single-cpu", "pipetorch", "bsp", "tapp")
"""The TAPP paper's comparison, in its table's column order: SingleCPU, Pipe-Torch, BSP, TAPP."""


def registered_methods() -> tuple[Method, ...]:
    """Every method of the registry, the old names' included."""
    return _METHODS


def method_label(name: str) -> str:
    """The report's label of method ``name`` (the name itself for one the registry does not know)."""
    found = _REGISTRY.get(name)
    return found.label if found is not None else name


def method_space(name: str) -> Space | None:
    """What method ``name`` searches (None for one the registry does not know)."""
    found = _REGISTRY.get(name)
    return found.space if found is not None else None


def method_description(name: str) -> str:
    """What method ``name`` is, in a few words ("" for one the registry does not know)."""
    found = _REGISTRY.get(name)
    return found.description if found is not None else ""


DEFAULT_MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


class PlannerError(TappError):
    """A planner that cannot be built or cannot find a plan; the message says why."""


class DoesNotFit(PlannerError):
    """No plan of the planner's space fits the cluster's memory (every one it tried is ``OutOfMemory``): a fact of
    the model and the cluster, not a failure of the method, which an experiment reports as such."""


def no_plan_fits(problems: Sequence[PlanError], message: str) -> PlannerError:
    """The error of a planner that tried plans and kept none: ``DoesNotFit`` when each was out of memory."""
    text = f"{message}: {'; '.join(map(str, problems)) or 'it tried none'}"
    if problems and all(isinstance(p, OutOfMemory) for p in problems):
        return DoesNotFit(text)
    return PlannerError(text)


@dataclass(frozen=True)
class SearchProgress:
    """One round of a search, as reported to a ``progress`` callback."""

    planner: str
    round: int
    """Rounds completed, from 1."""
    total_rounds: int | None
    """Rounds the budget allows (None: not known in advance)."""
    evaluations: int
    """Distinct plans whose reward was evaluated so far (cost-model estimates or measurements)."""
    best_step_time_s: float
    """Best step time seen so far (inf until a valid plan is found)."""
    elapsed_s: float
    reward: float | None = None
    """Mean reward of the round's samples (TAPP)."""
    entropy: float | None = None
    """Mean policy entropy per decision this round (TAPP)."""
    phase: str = "search"
    """'simulated' or 'measured' for TAPP; 'search' for the others."""


ProgressCallback = Callable[[SearchProgress], None]


@runtime_checkable
class Planner(Protocol):
    name: ClassVar[str]

    def plan(
        self,
        context: CostContext,
        budget: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> Plan: ...


@dataclass
class PlannerBase:
    """Options every planner accepts."""

    name: ClassVar[str] = ""

    batch_size: int | None = None
    """Mini-batch size of the plan; None: the layer library's."""
    micro_batches: Sequence[int] | None = None
    """Micro-batch counts to choose from; None: those of ``DEFAULT_MICRO_BATCHES`` that divide the batch."""
    schedule: str = "1f1b"
    """The schedule of the plans a planner builds (a searching planner's default when ``schedules`` is None)."""
    schedules: Sequence[str] | None = None
    """The schedules a searching planner may choose among (each its best plan; the fastest wins); None: just
    ``schedule``."""
    staleness: int | None = None
    """The staleness bound of the asynchronous schedule (``tapp_core.plan.schedules``); None: the pipeline's depth."""
    seed: int = 0
    progress: ProgressCallback | None = field(default=None, repr=False)

    searches_schedules: ClassVar[bool] = False
    """Whether ``_plan`` chooses among ``schedule_specs`` itself; otherwise ``plan`` runs it once per schedule."""

    def __post_init__(self) -> None:
        if self.schedules is not None:
            self.schedules = tuple(dict.fromkeys(self.schedules))
            if not self.schedules:
                raise PlannerError("schedules must name at least one schedule")
        for name in self.schedules or (self.schedule,):
            if name not in SCHEDULES:
                raise PlannerError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
        if self.staleness is not None:
            try:
                parse_schedule_spec(schedule_spec("async", self.staleness))
            except UnknownScheduleError as exc:
                raise PlannerError(str(exc)) from None
        if self.batch_size is not None and self.batch_size <= 0:
            raise PlannerError(f"batch_size must be positive, got {self.batch_size}")
        if self.micro_batches is not None:
            self.micro_batches = tuple(int(m) for m in self.micro_batches)
            if not self.micro_batches or min(self.micro_batches) <= 0:
                raise PlannerError(f"micro_batches must be positive counts, got {self.micro_batches}")

    def plan(
        self,
        context: CostContext,
        budget: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> Plan:
        """Find a plan; ``progress`` (if given) overrides the option of the same name for this call."""
        if budget is not None and budget <= 0:
            raise PlannerError(f"budget must be a positive number of reward evaluations, got {budget}")
        started = time.perf_counter()
        found = self._plan_each_schedule(context, budget, progress or self.progress)
        wall = time.perf_counter() - started
        predicted = estimate(found, context).step_time_s
        notes = {"search_wall_s": wall, "evaluations": 0, **found.notes, "estimated_step_time_s": predicted}
        return dataclasses.replace(found, planner=self.name, notes=notes)

    def _plan(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        raise NotImplementedError

    def for_schedule(self, name: str, schedules: int) -> PlannerBase:
        """This planner on schedule ``name`` alone, one of the ``schedules`` it plans in turn
        (``_plan_each_schedule``)."""
        return dataclasses.replace(self, schedule=name, schedules=None)

    def _plan_each_schedule(self, context: CostContext, budget: int | None, progress: ProgressCallback | None) -> Plan:
        """``_plan``, once per schedule unless the planner chooses among them itself (each with its share of the
        budget, and of the time limit where the planner has one: the oracle's); the plan the cost model finds
        fastest, with every schedule's estimate in its notes."""
        names = self.schedules or (self.schedule,)
        if len(names) == 1 or self.searches_schedules:
            return self._plan(context, budget, progress)
        share = None if budget is None else max(1, budget // len(names))
        found: dict[str, tuple[float, Plan]] = {}
        for name in names:
            one = self.for_schedule(name, len(names))
            plan = one._plan(context, share, progress)
            found[name] = (estimate(plan, context).step_time_s, plan)
        best = min(found, key=lambda name: found[name][0])
        notes = {**found[best][1].notes, "schedule_estimates_s": {name: t for name, (t, _) in found.items()}}
        proofs = [plan.notes["proved_optimal"] for _, plan in found.values() if "proved_optimal" in plan.notes]
        if proofs:  # the optimum over every schedule is proved only where each schedule's search proved its own
            notes["proved_optimal"] = all(proofs)
        return dataclasses.replace(found[best][1], notes=notes)

    @property
    def schedule_spec(self) -> str:
        """``schedule`` with the staleness bound where it takes one (``tapp_core.plan.schedules.schedule_spec``)."""
        return schedule_spec(self.schedule, self.staleness)

    @property
    def schedule_specs(self) -> tuple[str, ...]:
        """Every schedule this planner may choose, each with its staleness bound."""
        return tuple(schedule_spec(name, self.staleness) for name in (self.schedules or (self.schedule,)))

    def resolved_batch_size(self, library: LayerLibrary) -> int:
        return self.batch_size or library.batch_size

    def micro_batch_choices(self, library: LayerLibrary) -> tuple[int, ...]:
        """The micro-batch counts that divide the batch, ascending; an error if none does."""
        batch = self.resolved_batch_size(library)
        wanted = self.micro_batches or DEFAULT_MICRO_BATCHES
        choices = tuple(sorted({m for m in wanted if batch % m == 0}))
        if not choices:
            raise PlannerError(f"none of the micro-batch counts {tuple(wanted)} divides the batch size {batch}")
        return choices


def _planner_class(name: str) -> type[PlannerBase]:
    if name not in _REGISTRY:
        raise PlannerError(f"unknown planner {name!r}; choose one of {', '.join(PLANNER_NAMES)}")
    module_name, class_name = _REGISTRY[name].target.split(":")
    module = importlib.import_module(f"tapp_core.planners.{module_name}")
    planner: type[PlannerBase] = getattr(module, class_name)
    return planner


def planner_options(name: str) -> dict[str, object]:
    """The options planner ``name`` accepts, with their defaults (for command lines and docs)."""
    cls = _planner_class(name)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = None
    return out


def get_planner(name: str, **options: Any) -> PlannerBase:
    """Build planner ``name`` with ``options``; an unknown name or option is a ``PlannerError``."""
    cls = _planner_class(name)
    accepted = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise PlannerError(
            f"planner {name!r} has no option(s) {', '.join(unknown)}; it accepts: {', '.join(sorted(accepted))}"
        )
    return cls(**options)
