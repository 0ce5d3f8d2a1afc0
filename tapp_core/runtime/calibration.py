"""The cost model's calibration fitted against this runtime (``bench/costmodel_error.py --fit`` writes it)."""

from __future__ import annotations

from pathlib import Path

from tapp_core.costs import Calibration

FITTED_CALIBRATION_PATH = Path(__file__).resolve().parents[1] / "calibration.json"


def load_fitted_calibration(path: Path = FITTED_CALIBRATION_PATH) -> Calibration:
    """The fitted calibration, or the ideal one when none has been fitted."""
    return Calibration.load(path) if path.is_file() else Calibration()
