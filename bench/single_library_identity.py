"""Every planner's plan, estimate and lower bound on the committed libraries and clusters, bit for bit: run it on
two checkouts and compare, to show that a change leaves one library with scalar speeds exactly as it was.

    .venv/bin/python bench/single_library_identity.py --out after.jsonl          # in each checkout
    .venv/bin/python bench/single_library_identity.py --compare before.jsonl after.jsonl

For alexnet, vgg16 and inception_v3 (``bench/libraries``) on local, hetero4, hetero8 and homo4, with the ideal
calibration and a calibration that exercises every constant, each planner (TAPP with 6 rounds, AutoDDL and the
oracle with budgets; the oracle not on Inception-V3 nor with the second calibration) plans, and a row records the
plan's id, its estimated step time and per-device compute and communication (as exact hex floats), the
``StepTimeBound`` of a contiguous plan, and the planner's notes except those that depend on the machine's speed (``WALL_TIMES``). ``--compare`` prints how many
rows differ, and the first ones.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tapp_core.cost.calibration import Calibration  # noqa: E402
from tapp_core.cost.context import CostContext  # noqa: E402
from tapp_core.cost.simulation import estimate  # noqa: E402
from tapp_core.plan.plan import Plan  # noqa: E402
from tapp_core.planners import get_planner  # noqa: E402
from tapp_core.planners.bounds import StepTimeBound  # noqa: E402
from tapp_core.platform.cluster import load_cluster  # noqa: E402
from tapp_core.profile.library import LayerLibrary  # noqa: E402

MODELS = ("alexnet", "vgg16", "inception_v3")
CLUSTERS = ("local", "hetero4", "hetero8", "homo4")
PLANNERS = ("single", "bsp", "even", "pipetorch", "pipedream", "autoddl", "oracle", "tapp")
CALIBRATIONS = {
    "ideal": Calibration(),
    "every-constant": Calibration(
        per_message_s=1.25e-4,
        per_step_s=0.189,
        update_s_per_param_byte=2.57e-10,
        compute_scale=0.912,
        per_micro_batch_s=1e-4,
        slowdown_exponent=1.1,
    ),
}
WALL_TIMES = ("search_wall_s", "search_rounds_s", "search_s", "polish_s", "warm_start_s", "evaluations")
"""Notes that depend on the machine's speed: wall times, and the evaluations of a search that met its deadline."""


def bound_of(plan: Plan, library: LayerLibrary, cluster_name: str, calibration: Calibration) -> str | None:
    stages = plan.stage_of_layer
    if any(a > b for a, b in itertools.pairwise(stages)):
        return None
    cuts = [i for i in range(1, len(stages)) if stages[i] != stages[i - 1]]
    cluster = load_cluster(cluster_name)
    bound = StepTimeBound(
        CostContext(library, cluster, calibration), plan.schedule, plan.micro_batches, plan.batch_size
    )
    if hasattr(bound, "group"):
        groups = [bound.group(g) for g in plan.stage_devices]
    else:  # a checkout from before device kinds
        from tapp_core.planners.bounds import device_group

        groups = [device_group(cluster, g, plan.micro_batch_size, calibration) for g in plan.stage_devices]
    return bound.bound(cuts, groups).hex()


def rows() -> list[dict[str, object]]:
    out = []
    for model in MODELS:
        library = LayerLibrary.load(ROOT / "bench" / "libraries" / f"{model}_b64")
        for cluster_name in CLUSTERS:
            cluster = load_cluster(cluster_name)
            for cal_name, calibration in CALIBRATIONS.items():
                for name in PLANNERS:
                    if name == "oracle" and (model == "inception_v3" or cal_name != "ideal"):
                        continue
                    options: dict[str, object] = {"seed": 0}
                    if name == "tapp":
                        options["rounds"] = 6
                    budget = {"autoddl": 300, "oracle": 3000}.get(name)
                    started = time.perf_counter()
                    plan = get_planner(name, **options).plan(CostContext(library, cluster, calibration), budget=budget)
                    predicted = estimate(plan, CostContext(library, cluster, calibration))
                    notes = {k: v for k, v in plan.notes.items() if k not in WALL_TIMES}
                    out.append(
                        {
                            "row": f"{model} {cluster_name} {cal_name} {name}",
                            "plan": plan.id,
                            "step": predicted.step_time_s.hex(),
                            "compute": {k: v.hex() for k, v in predicted.compute_s.items()},
                            "communication": {k: v.hex() for k, v in predicted.communication_s.items()},
                            "bound": bound_of(plan, library, cluster_name, calibration),
                            "notes": json.dumps(notes, sort_keys=True, default=str),
                        }
                    )
                    print(f"{out[-1]['row']}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return out


def without_wall_times(row: dict[str, object]) -> dict[str, object]:
    """``row`` with its notes' ``WALL_TIMES`` left out (a file written before they were all listed keeps them)."""
    notes = json.loads(str(row["notes"]))
    return {**row, "notes": json.dumps({k: v for k, v in notes.items() if k not in WALL_TIMES}, sort_keys=True)}


def compare(before: Path, after: Path) -> int:
    def load(path: Path) -> dict[str, dict[str, object]]:
        return {row["row"]: without_wall_times(row) for row in map(json.loads, path.read_text().splitlines())}

    a, b = load(before), load(after)
    common = sorted(set(a) & set(b))
    differ = [key for key in common if a[key] != b[key]]
    print(
        f"{len(common)} rows in both, {len(differ)} differ; only before {len(set(a) - set(b))}, after {len(set(b) - set(a))}"
    )
    for key in differ[:10]:
        print(key, {f: (a[key][f], b[key][f]) for f in a[key] if a[key][f] != b[key].get(f)})
    return 1 if differ or set(a) != set(b) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows (JSON lines) here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give --out FILE or --compare BEFORE AFTER")
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
