"""What every estimate of a run needs, as one object: the layer library (the profile), the cluster and the
calibration, built once per run (``tapp plan``, ``tapp simulate``, the experiment flow) and passed down to the
estimator (``tapp_core.cost.simulation.estimate``), the checks (``tapp_core.cost.checks``) and the planners.

The context owns what is cached per device: each device's ``DeviceTerms`` (the library it is costed from, its
slowdown and its kind's figures of the calibration), computed on first use and kept for the run, so that a
search that costs thousands of plans of one set-up derives them once.

Why here, on the cost floor: the calibration is the cost model's (``tapp_core.cost.calibration``), so a context
that holds it cannot sit lower. The checks that need the whole context (``validate``, ``check_memory``) live in
``tapp_core.cost.checks`` above it; the plan floor keeps the checks of one aspect each (``check_devices`` takes the
cluster, ``check_signatures`` the library), which need no calibration. The planners and the runtime, on the floor
above, import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from tapp_core.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tapp_core.cost.formulas import DeviceTerms
from tapp_core.model.workload import OptimizerConfig
from tapp_core.platform.cluster import Cluster
from tapp_core.profile.device_libraries import device_library
from tapp_core.profile.library import LayerLibrary


@dataclass(frozen=True, eq=False)
class CostContext:
    """The profile, the cluster and the calibration of one run, with the per-device terms derived from them."""

    library: LayerLibrary
    """The layer library of the model (with every kind's library: ``LayerLibrary.kinds``)."""
    cluster: Cluster
    calibration: Calibration = DEFAULT_CALIBRATION
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The workload's optimiser: the memory model counts its state (``optimizer_state``)."""

    @cached_property
    def optimizer_state(self) -> int:
        """The optimiser's state tensors per parameter (``OptimizerConfig.state_per_param``)."""
        return self.optimizer.state_per_param

    @cached_property
    def terms(self) -> Mapping[str, DeviceTerms]:
        """Per device of the cluster: its ``DeviceTerms`` (which library, its slowdown, its kind's figures)."""
        terms = {}
        for device in self.cluster.devices:
            chosen = device_library(self.library, self.cluster, device.name)
            slowdown = (1.0 / device.speed) ** self.calibration.slowdown_exponent if chosen.speed_applies else 1.0
            kind = chosen.kind.name
            terms[device.name] = DeviceTerms(
                device.name, chosen.library, kind, chosen.kind.is_cuda, slowdown, self.calibration.for_kind(kind)
            )
        return terms

    @cached_property
    def plan_memory(self) -> Mapping[str, int]:
        """Per device of the cluster: the memory a plan may use there, its ``memory`` less what its rank holds
        before the plan's first tensor (its kind's ``KindCalibration.runtime_memory_bytes``; 0 when ideal)."""
        return {
            name: max(0, self.cluster.device(name).memory - int(terms.figures.runtime_memory_bytes))
            for name, terms in self.terms.items()
        }

    def with_library(self, library: LayerLibrary) -> CostContext:
        """The same cluster and calibration with another library (a model's other profile)."""
        return CostContext(library, self.cluster, self.calibration, self.optimizer)

    def with_calibration(self, calibration: Calibration) -> CostContext:
        """The same library and cluster with another calibration (a what-if study, the ideal model)."""
        return CostContext(self.library, self.cluster, calibration, self.optimizer)
