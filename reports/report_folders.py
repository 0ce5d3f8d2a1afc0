"""Where reports go, so that one experiment's report never replaces another's.

``tapp run`` writes its report to ``out/<experiment>/<parent run id>/`` unless told otherwise, and ``tapp report``
(and the paper-table flow) to ``out/<experiment>/report/``. Every report folder holds a small marker
(``MARKER``) naming the experiment and the runs it reports; a report is refused, in one line, in a folder whose
marker names another experiment (``check_report_folder``). The same experiment may rewrite its own report.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tapp_core.errors import TappError

OUT_ROOT = Path("out")
MARKER = ".tapp-report.json"
"""In a report folder: ``{"experiment": NAME, "runs": RUN_ID or "all"}``."""
ALL_RUNS = "all"


class ReportFolderTaken(TappError):
    """A report folder that holds another experiment's report."""


def experiment_folder(experiment: str, root: Path = OUT_ROOT) -> Path:
    """``root/<experiment>``, the experiment's name made safe as a folder name."""
    return root / (re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment).strip("._") or "experiment")


def run_report_folder(experiment: str, run_id: str, root: Path = OUT_ROOT) -> Path:
    """Where ``tapp run`` writes the report of its parent run ``run_id``: ``out/<experiment>/<run id>``."""
    return experiment_folder(experiment, root) / run_id


def experiment_report_folder(experiment: str, root: Path = OUT_ROOT) -> Path:
    """Where ``tapp report`` writes the report of a whole experiment: ``out/<experiment>/report``."""
    return experiment_folder(experiment, root) / "report"


def report_owner(folder: str | Path) -> tuple[str, str] | None:
    """(experiment, runs) of the report in ``folder``, None when it holds no marked report."""
    marker = Path(folder) / MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("experiment"), str):
        return None
    return str(data["experiment"]), str(data.get("runs", ALL_RUNS))


def check_report_folder(folder: str | Path, experiment: str) -> None:
    """Raise ``ReportFolderTaken`` when ``folder`` holds the report of another experiment than ``experiment``."""
    owner = report_owner(folder)
    if owner is not None and owner[0] != experiment:
        other, runs = owner
        scope = f"run {runs}" if runs != ALL_RUNS else "all its runs"
        raise ReportFolderTaken(
            f"report folder {folder} holds experiment {other!r}'s report ({scope}); not overwriting it with "
            f"experiment {experiment!r}'s: choose another --out"
        )


def claim_report_folder(folder: str | Path, experiment: str, runs: str | None = None) -> Path:
    """Make ``folder`` (checked with ``check_report_folder``) and mark it as ``experiment``'s report of ``runs``
    (a run id; None: all its runs)."""
    check_report_folder(folder, experiment)
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps({"experiment": experiment, "runs": runs or ALL_RUNS}) + "\n")
    return path
