"""``tapp sweep`` and ``tapp report``: the section 5.2.2 sweep from the command line, its tables checked against the
runs in MLflow; an interrupted sweep resumed at its first unfinished configuration; one ``tapp run`` parsing its
cluster once and tracing its model once per kind.

Real components: Prefect's test server, a SQLite MLflow store, the cost model (estimate-only: no MPI runtime)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch.fx
from mlflow import MlflowClient
from typer.testing import CliRunner

import tapp_core.cost.calibration
import tapp_core.platform.cluster
from flows.cli import app
from reports import schema
from tests.test_flows import _flow_run_record

QUICK = ["--estimate-only", "--rounds", "2", "--samples-per-round", "4", "--methods", "tapp,single-cpu,bsp,pipetorch"]
LABELS = {"single-cpu": "SingleCPU", "pipetorch": "Pipe-Torch", "bsp": "BSP", "tapp": "TAPP"}
SHOWN_RATIO = 6e-3
"""BSP/TAPP is the speedup each experiment's result logged, to the 3 digits every view shows (``reports.numbers``)."""


def tapp(*args: str) -> str:
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return done.output


def evaluations(uri: str, experiment: str) -> dict[tuple[str, str, int, str], float]:
    """Every finished evaluation's step time, by (model, cluster, batch size, method)."""
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    query = f"tags.{schema.KIND} = '{schema.EVALUATION}' and attributes.status = 'FINISHED'"
    return {
        (r.data.tags["model"], r.data.tags["cluster"], int(r.data.tags["batch_size"]), r.data.tags["method"]): (
            r.data.metrics[schema.STEP_TIME]
        )
        for r in client.search_runs([found.experiment_id], query, max_results=1000)
    }


def test_the_sweep_of_section_522_is_reported_from_mlflow(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    """``tapp sweep --power 1 0.5 --batch-sizes 16 32``, then ``tapp report``: every row of the computing-power,
    batch-size and paper-comparison tables is the runs' metrics."""
    args = ["--experiment", experiment_name, "--model", "tiny_cnn", "--cluster", "hetero4", "--power", "1", "0.5"]
    output = tapp("sweep", *args, "--batch-sizes", "16", "32", *QUICK, "--out", "sweep")
    assert "benchmark_sweep: 4 experiments (estimated)" in output
    tapp("report", "--experiment", experiment_name, "--out", "report")
    for name in ("computing_power", "batch_size", "paper_comparison"):
        for suffix in ("csv", "md", "tex"):
            assert (work_dir / "report" / f"{name}.{suffix}").stat().st_size > 0, f"{name}.{suffix}"
            assert (work_dir / "sweep" / f"{name}.{suffix}").read_text() == (
                work_dir / "report" / f"{name}.{suffix}"
            ).read_text()  # the sweep's own report is the same
    runs = evaluations(tracking_uri, experiment_name)
    assert len(runs) == 4 * 4  # 2 powers x 2 batch sizes x 4 methods

    power = pd.read_csv(work_dir / "report" / "computing_power.csv")
    assert [(r.power, r.batch) for r in power.itertuples()] == [(1, 16), (1, 32), (0.5, 16), (0.5, 32)]
    for row in power.to_dict("records"):
        cluster = "hetero4" if row["power"] == 1 else "hetero4@0.5x"
        step = {m: runs[("tiny_cnn", cluster, row["batch"], m)] for m in LABELS}
        assert row["cluster"] == "hetero4" and row["model"] == "tiny_cnn"
        assert all(row[label] == step[m] for m, label in LABELS.items())
        assert row["TAPP over BSP"] == pytest.approx(step["bsp"] / step["tapp"], rel=SHOWN_RATIO)
        assert row["TAPP over Pipe-Torch"] == pytest.approx(step["pipetorch"] / step["tapp"], rel=SHOWN_RATIO)

    batch = pd.read_csv(work_dir / "report" / "batch_size.csv")
    assert len(batch) == 4
    for row in batch.to_dict("records"):
        for method, label in LABELS.items():
            seconds = runs[("tiny_cnn", row["cluster"], row["batch"], method)]
            assert row[label] == seconds and row[f"{label} img/s"] == pytest.approx(row["batch"] / seconds)

    paper = pd.read_csv(work_dir / "report" / "paper_comparison.csv")
    ours = paper[paper["model"] == "tiny_cnn"]
    assert len(ours) == 4 * 3 and len(paper) == 4 * 3 + 3 * 3  # and the paper's three models, not run here
    for row in ours.to_dict("records"):
        method = {label: m for m, label in LABELS.items()}[row["TAPP faster than"]]
        key = ("tiny_cnn", row["cluster"], int(row["batch"]))
        assert row["ours"] == pytest.approx(runs[(*key, method)] / runs[(*key, "tapp")], rel=SHOWN_RATIO)
        assert math.isnan(row["paper"]) and row["holds here"] in ("yes (estimated)", "no (estimated)")
    assert set(paper.loc[paper["model"] != "tiny_cnn", "holds here"]) == {"not run here"}
    assert (work_dir / "report" / "computing_power.png").stat().st_size > 0
    assert (work_dir / "report" / "batch_size.png").stat().st_size > 0


FLAKY = """
from pathlib import Path
from torch import nn

def model():
    if Path("broken").exists():
        raise RuntimeError("the model is broken today")
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 32), nn.ReLU(), nn.Linear(32, 10))
"""


def test_an_interrupted_sweep_resumes_at_its_first_unfinished_configuration(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    (work_dir / "flaky.py").write_text(textwrap.dedent(FLAKY))
    (work_dir / "broken").write_text("")
    models = ["--model", "mlp", f"{work_dir / 'flaky.py'}:model", "--model", "tiny_cnn"]
    args = ["sweep", "--experiment", experiment_name, *models, "--batch-sizes", "8", *QUICK, "--out", "sweep"]
    failed = CliRunner().invoke(app, args)
    assert failed.exit_code == 1 and "the sweep failed" in failed.output

    (work_dir / "broken").unlink()
    output = tapp("sweep", "--resume", "last", "--experiment", experiment_name, "--out", "sweep")
    assert "resuming sweep" in output and "2 configurations finished, 1 to run" in output

    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment_name).experiment_id
    sweeps = client.search_runs([experiment_id], f"tags.{schema.KIND} = '{schema.SWEEP}'", order_by=["start_time"])
    assert [s.info.status for s in sweeps] == ["FAILED", "FINISHED"]
    first, resumed = sweeps
    assert resumed.data.tags[schema.RESUMED_FROM] == first.info.run_id
    assert first.data.tags[schema.SWEEP_RUN] == resumed.data.tags[schema.SWEEP_RUN] == first.info.run_id
    experiments = client.search_runs([experiment_id], f"tags.{schema.KIND} = '{schema.EXPERIMENT}'")
    done = sorted((int(r.data.tags[schema.SWEEP_INDEX]), r.data.tags["model"]) for r in experiments)
    assert done == [(0, "mlp"), (1, f"{work_dir / 'flaky.py'}:model"), (2, "tiny_cnn")]  # each run once, finished
    assert all(r.info.status == "FINISHED" for r in experiments)
    table = pd.read_csv(work_dir / "sweep" / "step_time.csv")  # the whole sweep's report, both runs' experiments
    assert len(table) == 3


def test_one_run_parses_its_cluster_once_and_traces_its_model_once_per_kind(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster of two CPU kinds (1 and 2 threads): the first run profiles (traces) each kind once, the second finds
    both in the profile cache and traces nothing; each reads the cluster file once and looks it up once."""
    cluster = work_dir / "two_kinds.yaml"
    cluster.write_text(
        "devices:\n  - {name: one, threads: 1, memory: 2GiB}\n  - {name: two, threads: 2, memory: 2GiB}\n"
        "links: {bandwidth: 1Gbit/s, latency: 50us}\n"
    )
    counts = {"read": 0, "resolve": 0, "trace": 0}
    read_text, resolve, trace = Path.read_text, tapp_core.platform.cluster.resolve_cluster_path, torch.fx.symbolic_trace

    def counting_read(path: Path, *args: object, **kwargs: object) -> str:
        counts["read"] += path.resolve() == cluster.resolve()
        return read_text(path, *args, **kwargs)  # type: ignore[arg-type]

    def counting_resolve(name: object) -> Path:
        counts["resolve"] += 1
        return resolve(name)  # type: ignore[arg-type]

    def counting_trace(*args: object, **kwargs: object) -> object:
        counts["trace"] += 1
        return trace(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counting_read)
    monkeypatch.setattr(tapp_core.platform.cluster, "resolve_cluster_path", counting_resolve)
    monkeypatch.setattr(tapp_core.cost.calibration, "resolve_cluster_path", counting_resolve)
    monkeypatch.setattr(torch.fx, "symbolic_trace", counting_trace)
    args = ["run", "--model", "mlp", "--batch-size", "8", "--cluster", str(cluster), *QUICK]
    tapp(*args, "--experiment", experiment_name)
    assert counts == {"read": 1, "resolve": 1, "trace": 2}
    counts.update(read=0, resolve=0, trace=0)
    output = tapp(*args, "--experiment", experiment_name)
    assert counts == {"read": 1, "resolve": 1, "trace": 0}  # both kinds from the profile cache
    client = MlflowClient(tracking_uri)
    experiment_id = client.get_experiment_by_name(experiment_name).experiment_id
    parent = client.search_runs([experiment_id], f"tags.{schema.KIND} = '{schema.EXPERIMENT}'", max_results=1)[0]
    flow_run, _, _, _ = _flow_run_record(parent.data.tags["prefect.flow_run_id"])
    assert flow_run.parameters["config"]["cluster"]["source"] == str(cluster)  # the configuration, as it ran
    assert "not trained: estimate-only" in output
