"""The paper's tables from runs written to a real MLflow store: values, order, formats, run selection."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from mlflow import MlflowClient

from reports import runs
from reports.tables import build_tables
from tapp_core import schema
from tasks.tracking import ExperimentTags, RunRef, tracked_run

PAPER = {  # the TAPP paper's table, used here only as round numbers to log
    "alexnet": {"single-cpu": 0.811, "pipetorch": 0.675, "bsp": 0.803, "tapp": 0.602},
    "vgg16": {"single-cpu": 1.972, "pipetorch": 1.634, "bsp": 1.865, "tapp": 1.432},
}


def log_experiment(
    experiment: str,
    model: str,
    step_times: dict[str, float],
    shares: dict[str, float] | None = None,
    source: str = "measured",
    fail: set[str] = frozenset(),  # type: ignore[assignment]
) -> RunRef:
    tags = ExperimentTags(model=model, cluster="local", batch_size=64, seed=0, dataset="synthetic", emulated=True)
    with tracked_run(f"{model}", tags.as_tags(**{schema.KIND: schema.EXPERIMENT}), experiment=experiment) as parent:
        for method, seconds in step_times.items():
            child_tags = tags.as_tags(
                **{
                    schema.KIND: schema.EVALUATION,
                    schema.METHOD: method,
                    schema.EXPERIMENT_RUN: parent.run_id,
                    schema.STEP_TIME_SOURCE: source,
                }
            )
            try:
                with tracked_run(method, child_tags, parent=parent.ref) as child:
                    child.log_metrics(
                        {schema.STEP_TIME: seconds, schema.COMMUNICATION_SHARE: (shares or {}).get(method)}
                    )
                    if method in fail:
                        raise RuntimeError("measurement failed half way")
            except RuntimeError:
                pass
    return parent.ref


def test_step_time_table_holds_the_logged_metrics_in_paper_order(tracking_uri: str, experiment_name: str) -> None:
    log_experiment(experiment_name, "vgg16", PAPER["vgg16"], shares={"tapp": 0.125, "bsp": 0.5})
    log_experiment(experiment_name, "alexnet", {**PAPER["alexnet"], "pipedream": 0.61})

    tables = build_tables(experiment_name)
    step = tables.step_time.frame

    assert list(step["model"]) == ["AlexNet", "VGG-16"]
    assert list(step.columns) == [
        "model", "cluster", "batch", "SingleCPU", "Pipe-Torch", "BSP", "TAPP", "speedup BSP/TAPP", "PipeDream/APapo",
    ]  # fmt: skip
    assert step.loc[0, "TAPP"] == 0.602
    assert step.loc[1, "speedup BSP/TAPP"] == pytest.approx(1.865 / 1.432)
    assert pd.isna(step.loc[1, "PipeDream/APapo"])

    csv = pd.read_csv(io.StringIO(tables.step_time.to_csv()))
    assert csv.loc[1, "SingleCPU"] == 1.972  # exact: CSV keeps the metric unrounded

    markdown = tables.step_time.to_markdown()
    assert "| AlexNet | local | 64 | 0.811 | 0.675 | 0.803 | 0.602 | 1.33x | 0.610 |" in markdown
    assert "| VGG-16 | local | 64 | 1.972 | 1.634 | 1.865 | 1.432 | 1.30x | – |" in markdown
    assert "measured on the MPI runtime" in markdown

    latex = tables.step_time.to_latex()
    assert "AlexNet & local & 64 & 0.811 & 0.675 & 0.803 & 0.602 & 1.33x & 0.610 \\\\" in latex
    assert "\\begin{tabular}{lllrrrrrr}" in latex

    share = tables.communication_share.to_markdown()
    assert "| VGG-16 | local | 64 | – | – | 50.0% | 12.5% |" in share
    assert "12.5\\%" in tables.communication_share.to_latex()


def test_latest_finished_run_wins_and_failed_runs_are_ignored(tracking_uri: str, experiment_name: str) -> None:
    log_experiment(experiment_name, "alexnet", {"tapp": 0.9, "bsp": 0.8})
    log_experiment(experiment_name, "alexnet", {"tapp": 0.6, "bsp": 0.7}, fail={"bsp"})

    step = build_tables(experiment_name).step_time.frame

    assert step.loc[0, "TAPP"] == 0.6
    assert step.loc[0, "BSP"] == 0.8  # the FAILED newer run does not replace the finished older one
    failed = MlflowClient().search_runs(
        [MlflowClient().get_experiment_by_name(experiment_name).experiment_id],
        "attributes.status = 'FAILED'",
    )
    assert [r.data.tags["error"] for r in failed] == ["RuntimeError: measurement failed half way"]


def test_one_experiment_run_can_be_reported_alone(tracking_uri: str, experiment_name: str) -> None:
    log_experiment(experiment_name, "alexnet", {"tapp": 0.5})
    second = log_experiment(experiment_name, "vgg16", {"tapp": 1.5}, source="estimated")

    tables = build_tables(experiment_name, within=second.run_id)

    assert list(tables.step_time.frame["model"]) == ["VGG-16"]
    assert "estimated by the cost model (not measured) for: VGG-16/TAPP" in tables.step_time.to_markdown()


def test_written_files_in_three_formats(tracking_uri: str, experiment_name: str, tmp_path) -> None:
    log_experiment(experiment_name, "alexnet", PAPER["alexnet"])

    written = build_tables(experiment_name).write(tmp_path)

    names = sorted(p.name for p in written)
    assert names == sorted(
        f"{t}.{s}" for t in ("step_time", "communication_share", "accuracy") for s in ("md", "csv", "tex")
    )
    assert "No training runs" in (tmp_path / "accuracy.md").read_text()


def test_unknown_experiment_or_no_evaluations_is_a_clear_error(tracking_uri: str, experiment_name: str) -> None:
    with pytest.raises(runs.ReportError, match="no MLflow experiment named 'nope'"):
        build_tables("nope")
    MlflowClient().create_experiment(experiment_name)
    with pytest.raises(runs.ReportError, match="has no finished evaluation runs"):
        build_tables(experiment_name)


RACE = {  # method: per-round step times of one race (rounds 1-5); the oracle shares SingleCPU's plan
    "single-cpu": [0.34, 0.35, 0.36, 0.33, 0.35],
    "tapp": [0.36, 0.37, 0.34, 0.38, 0.36],
    "bsp": [1.40, 1.45, 1.50, 1.42, 1.46],
    "pipetorch": [0.45, 0.46, 0.47, 0.48, 0.46],
    "oracle": [0.34, 0.35, 0.36, 0.33, 0.35],
}


def log_race(experiment: str, loads: tuple[float, float, float] = (0.05, 2.4, 3.1)) -> RunRef:
    """An experiment whose methods were raced: medians, intervals (here: the range of 5 rounds), rounds, load."""
    tags = ExperimentTags(model="alexnet", cluster="local", batch_size=64, seed=0, dataset="synthetic", emulated=True)
    with tracked_run("alexnet", tags.as_tags(**{schema.KIND: schema.EXPERIMENT}), experiment=experiment) as parent:
        for method, rounds in RACE.items():
            extra = {schema.MEASUREMENT_FROM: "single-cpu"} if method == "oracle" else {}
            child_tags = tags.as_tags(
                **{
                    schema.KIND: schema.EVALUATION,
                    schema.METHOD: method,
                    schema.EXPERIMENT_RUN: parent.run_id,
                    schema.STEP_TIME_SOURCE: "measured",
                    schema.RACE_ID: "race-1",
                    **extra,
                }
            )
            with tracked_run(method, child_tags, parent=parent.ref) as child:
                ordered = sorted(rounds)
                child.log_metrics(
                    {
                        schema.STEP_TIME: ordered[2],
                        schema.STEP_TIME_LOW: ordered[0],
                        schema.STEP_TIME_HIGH: ordered[-1],
                        schema.RACE_ROUNDS: len(rounds),
                        schema.HOST_OTHER_CPU: loads[0],
                        schema.LOAD_BEFORE: loads[1],
                        schema.LOAD_AFTER: loads[2],
                        schema.HOST_CPUS: 2,
                        schema.HOST_RANKS: 3,
                    }
                )
                for number, seconds in enumerate(rounds, start=1):
                    child.log_metrics({schema.ROUND_STEP_TIME: seconds}, step=number)
    return parent.ref


def test_raced_cells_show_the_interval_and_mark_the_best_group(tracking_uri: str, experiment_name: str) -> None:
    log_race(experiment_name)

    table = build_tables(experiment_name).step_time
    markdown, latex = table.to_markdown(), table.to_latex()

    # SingleCPU 0.35 [0.33, 0.36], TAPP 0.36 [0.34, 0.38]: they overlap, so both are the best group; the oracle ran
    # SingleCPU's plan and shows the same figure; Pipe-Torch [0.45, 0.48] and BSP are out.
    row = "| AlexNet | local | 64 | **0.350 ± 0.015** | 0.460 ± 0.015 | 1.450 ± 0.050 | **0.360 ± 0.020** |"
    assert row in markdown
    assert markdown.count("**0.350 ± 0.015**") == 2  # SingleCPU and the oracle: one plan, one figure
    assert "Oracle chose the same plan as SingleCPU; it was raced once" in markdown
    assert "\\textbf{0.350 $\\pm$ 0.015}" in latex and "0.460 $\\pm$ 0.015 &" in latex
    # BSP/TAPP from the rounds paired: 1.40/0.36, 1.45/0.37, 1.50/0.34, 1.42/0.38, 1.46/0.36; median 4.06.
    ratios = sorted(b / t for b, t in zip(RACE["bsp"], RACE["tapp"], strict=True))
    assert table.frame.loc[0, "speedup BSP/TAPP"] == pytest.approx(ratios[2])
    assert table.frame.loc[0, "speedup BSP/TAPP low"] == pytest.approx(ratios[0])
    assert f"{ratios[2]:.2f}x ± {(ratios[-1] - ratios[0]) / 2:.2f}x" in markdown
    assert "WARNING" not in markdown

    csv = pd.read_csv(io.StringIO(table.to_csv()))
    assert list(csv.columns[3:11]) == [
        "SingleCPU", "SingleCPU low", "SingleCPU high", "SingleCPU best",
        "Pipe-Torch", "Pipe-Torch low", "Pipe-Torch high", "Pipe-Torch best",
    ]  # fmt: skip
    assert (csv.loc[0, "TAPP"], csv.loc[0, "TAPP low"], csv.loc[0, "TAPP high"]) == (0.36, 0.34, 0.38)
    assert csv.loc[0, "TAPP best"] and not csv.loc[0, "BSP best"]


def test_a_race_on_an_overloaded_host_is_a_warning_in_the_table(tracking_uri: str, experiment_name: str) -> None:
    log_race(experiment_name, loads=(0.4, 3.5, 6.0))  # other processes took 40 % of the CPU time
    markdown = build_tables(experiment_name).step_time.to_markdown()
    assert "WARNING: the race for AlexNet on local, batch 64, ran on an overloaded host" in markdown
    assert "(other processes took 40% of its CPU time; 1-minute load average 3.5 before, 6.0 after;" in markdown
