"""The cost model's calibration of an experiment: measured on first use and kept, unless the configuration says
not to (``--no-calibrate``) or there is no runtime to measure it on (``--estimate-only``)."""

from __future__ import annotations

from collections.abc import Callable

from tapp_core.cost.calibration import Calibration, calibration_phrase, cluster_calibration
from tapp_core.profile.library import LayerLibrary
from tapp_core.runtime.calibrator import calibration_on_first_use
from tasks.config import ExperimentConfig


def experiment_calibration(config: ExperimentConfig, library: LayerLibrary, log: Callable[[str], None]) -> Calibration:
    """The calibration the experiment's estimates use: the one given or kept for its cluster; where there is none
    and the experiment measures (and calibrates), measured now on its ranks with ``library`` and kept. Its note
    says which it is, and ``log`` says so once."""
    if config.calibrate and config.measure:
        calibration = calibration_on_first_use(config.cluster, config.target, library, log)
    else:
        calibration = cluster_calibration(config.cluster, config.target, library, kept=config.calibrate)
    log(f"calibration: {calibration_phrase(calibration, config.calibrate)}")
    return calibration
