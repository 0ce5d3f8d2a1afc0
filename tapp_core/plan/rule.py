"""The one rule of what the runtime can run: ``check_runs``.

Every planner asks it of each candidate it costs (``tapp_core.planners.evaluation``), ``validate`` asks it
(``tapp_core.cost.checks``), and the runtime asks it before any rank starts (``tapp_core.runtime.launch``), each
with the same facts of the model (``ModelFacts``) read from where it stands: a layer library, or the traced model.
A plan it passes is one the runtime builds stages and programs for; what it cannot know without a cluster
(devices, memory) is ``validate``'s and the runtime's ``check_runnable``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tapp_core.model.graph import LayerSpec, SharedParameter
from tapp_core.plan.plan import (
    Plan,
    PlanError,
    check_edges,
    check_layers,
    check_shape,
    check_signatures,
    check_stages_used,
)
from tapp_core.plan.ties import plan_ties
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True)
class ModelFacts:
    """What the rule reads of a model: its layers' names, every edge between layers (a tensor's or not), the
    layers' specs and the parameters several layers share; ``source`` is what messages call the layers' origin."""

    source: str
    names: tuple[str, ...]
    edges: np.ndarray
    """(producer, consumer) pairs, shape (edges, 2)."""
    specs: tuple[LayerSpec, ...]
    shared: tuple[SharedParameter, ...]
    refusals: Mapping[int, str] = field(default_factory=dict)
    """The layers whose output cannot cross a cut, each with the reason (``tapp_core.model.crossing``: computed
    from weights alone, so without samples to split into micro-batches; or not packable into one tensor of
    samples)."""

    @classmethod
    def of_library(cls, library: LayerLibrary) -> ModelFacts:
        return cls(
            "the layer library",
            tuple(layer.name for layer in library.layers),
            _edge_array(library.edges()),
            library.specs(),
            library.shared,
            {layer.index: layer.cut_refusal for layer in library.layers if layer.cut_refusal},
        )

    @classmethod
    def of_layers(
        cls,
        specs: Sequence[LayerSpec],
        edges: Sequence[tuple[int, int]],
        shared: Sequence[SharedParameter],
        refusals: Mapping[int, str] | None = None,
        source: str = "the traced model",
    ) -> ModelFacts:
        names = tuple(spec.name for spec in specs)
        return cls(source, names, _edge_array(edges), tuple(specs), tuple(shared), dict(refusals or {}))


def _edge_array(edges: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.asarray(edges, dtype=np.int64).reshape(-1, 2)


def check_runs(plan: Plan, model: ModelFacts) -> None:
    """``PlanError`` naming the first reason the runtime would refuse ``plan`` on ``model``: the plan's shape, a
    stage for every layer and a layer on every stage, no edge running backward, every signature one its layer may
    run on its group, no value crossing a cut that cannot (``ModelFacts.refusals``), and every tied parameter's needs (``tapp_core.plan.ties``)."""
    check_shape(plan)
    check_layers(plan.stage_of_layer, plan.n_stages, len(model.names), model.names.__getitem__, model.source)
    check_stages_used(plan.stage_of_layer, plan.n_stages)
    check_edges(plan.stage_of_layer, model.edges, model.names.__getitem__)
    check_cut_values(plan, model)
    check_signatures(plan, model.specs)
    check_ties(plan, model.shared)


def check_ties(plan: Plan, shared: Sequence[SharedParameter]) -> None:
    """``PlanError`` unless every shared parameter is held whole by every layer that uses it (no split signature:
    a layer split by one would hold a share of it where another reads it whole), and every tie of ``plan`` can run
    (``tapp_core.plan.ties``: a synchronous schedule, holder stages that hold their weights whole)."""
    chosen = dict(plan.signatures)
    for parameter in shared:
        split = [layer for layer in parameter.layers if layer in chosen]
        if split:
            raise PlanError(
                f"layer {split[0]} runs signature {chosen[split[0]]!r}, but its parameter {parameter.name!r} is "
                f"shared by layers {', '.join(map(str, parameter.layers))}: a shared parameter is held whole"
            )
    for tie in plan_ties(plan.stage_of_layer, shared):
        where = f"parameter {tie.name!r} is used on stages {', '.join(map(str, tie.stages))}"
        if not plan.pipeline_schedule.synchronous:
            raise PlanError(
                f"{where}, and the {plan.schedule} schedule is asynchronous: a parameter held by several stages needs "
                "a synchronous schedule (gpipe or 1f1b), or its users on one stage"
            )
        split = [stage for stage in tie.stages if plan.runs_split(stage)]
        if split:
            raise PlanError(
                f"{where}, and stage {split[0]} runs split signatures: a parameter held by several stages needs "
                "stages that hold their weights whole, or its users on one stage"
            )


def check_cut_values(plan: Plan, model: ModelFacts) -> None:
    """``PlanError`` if the output of a layer that cannot cross a cut (``ModelFacts.refusals``) crosses one."""
    if not model.refusals:
        return
    stage = np.asarray(plan.stage_of_layer, dtype=np.int64)
    sources, targets = model.edges[:, 0], model.edges[:, 1]
    crossing = np.flatnonzero((stage[targets] != stage[sources]) & np.isin(sources, list(model.refusals)))
    if crossing.size:
        u, v = int(sources[crossing[0]]), int(targets[crossing[0]])
        raise PlanError(
            f"the output of layer {model.names[u]} cannot cross the cut from stage {stage[u]} to stage {stage[v]} "
            f"(to {model.names[v]}): {model.refusals[u]}; keep them on one stage"
        )
