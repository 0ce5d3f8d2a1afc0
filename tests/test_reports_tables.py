"""The paper's tables from runs written to a real MLflow store: values, order, formats, run selection."""

from __future__ import annotations

import io

import pandas as pd
import pytest
from mlflow import MlflowClient

from reports import runs, schema
from reports.paper import build_tables
from tapp_core.measure.stats import paired_ratio_interval
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
    cluster: str = "local",
    batch_size: int = 64,
    power: float | None = None,
    schedules: dict[str, str] | None = None,
) -> RunRef:
    family = {schema.BASE_CLUSTER: cluster, schema.POWER: f"{power:g}"} if power is not None else {}
    name = f"{cluster}@{power:g}x" if power not in (None, 1) else cluster
    tags = ExperimentTags(
        model=model, cluster=name, batch_size=batch_size, seed=0, dataset="synthetic", emulated=True,
        more=tuple(family.items()),
    )  # fmt: skip
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
                    child.log_params({"schedule": (schedules or {}).get(method, "1f1b")})
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

    markdown = tables.step_time.to_markdown()  # 4 significant digits, as every view shows a step time
    assert "| AlexNet | local | 64 | 0.8110 | 0.6750 | 0.8030 | 0.6020 | 1.33x | 0.6100 |" in markdown
    assert "| VGG-16 | local | 64 | 1.972 | 1.634 | 1.865 | 1.432 | 1.30x | – |" in markdown
    assert "measured on the MPI runtime" in markdown

    latex = tables.step_time.to_latex()
    assert "AlexNet & local & 64 & 0.8110 & 0.6750 & 0.8030 & 0.6020 & 1.33x & 0.6100 \\\\" in latex
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
    tables = ("step_time", "communication_share", "accuracy", "computing_power", "batch_size", "paper_comparison")
    assert names == sorted(f"{t}.{s}" for t in tables for s in ("md", "csv", "tex"))
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


def log_race(
    experiment: str, loads: tuple[float, float, float] = (0.05, 2.4, 3.1), best: dict[str, str] | None = None
) -> RunRef:
    """An experiment whose methods were raced: medians, intervals (here: the range of 5 rounds), rounds, load, and
    what the experiment's result stores on the parent run (``result.json``: each method's paired ratio over TAPP)
    and, given ``best``, each method's ``best_group`` tag."""
    tags = ExperimentTags(model="alexnet", cluster="local", batch_size=64, seed=0, dataset="synthetic", emulated=True)
    with tracked_run("alexnet", tags.as_tags(**{schema.KIND: schema.EXPERIMENT}), experiment=experiment) as parent:
        methods = []
        for method, rounds in RACE.items():
            ratio = paired_ratio_interval(dict(enumerate(rounds)), dict(enumerate(RACE["tapp"])))
            assert ratio is not None
            vs_tapp = {"vs_tapp": ratio.median, "vs_tapp_low": ratio.low, "vs_tapp_high": ratio.high}
            methods.append({"method": method, **vs_tapp, "vs_tapp_is": schema.RATIO_PAIRED})
        parent.log_dict({"methods": methods}, schema.RESULT_ARTIFACT)
        for method, rounds in RACE.items():
            extra = {schema.MEASUREMENT_FROM: "single-cpu"} if method == "oracle" else {}
            if best is not None:
                extra[schema.BEST_GROUP] = best.get(method, "false")
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
    row = (
        "| AlexNet | local | 64 | **0.3500 [0.3300, 0.3600]** | 0.4600 [0.4500, 0.4800] | 1.450 [1.400, 1.500] | "
        "**0.3600 [0.3400, 0.3800]** |"
    )
    assert row in markdown
    assert markdown.count("**0.3500 [0.3300, 0.3600]**") == 2  # SingleCPU and the oracle: one plan, one figure
    assert "Oracle chose a plan that runs the same as SingleCPU's; it was raced once" in markdown
    assert "\\textbf{0.3500 [0.3300, 0.3600]}" in latex and "0.4600 [0.4500, 0.4800] &" in latex
    # BSP/TAPP from the rounds paired: 1.40/0.36, 1.45/0.37, 1.50/0.34, 1.42/0.38, 1.46/0.36; median 4.06.
    ratios = sorted(b / t for b, t in zip(RACE["bsp"], RACE["tapp"], strict=True))
    assert table.frame.loc[0, "speedup BSP/TAPP"] == pytest.approx(ratios[2])
    assert table.frame.loc[0, "speedup BSP/TAPP low"] == pytest.approx(ratios[0])
    assert f"{ratios[2]:.3g}x [{ratios[0]:.3g}, {ratios[-1]:.3g}]" in markdown
    assert "WARNING" not in markdown

    csv = pd.read_csv(io.StringIO(table.to_csv()))
    assert list(csv.columns[3:11]) == [
        "SingleCPU", "SingleCPU low", "SingleCPU high", "SingleCPU best",
        "Pipe-Torch", "Pipe-Torch low", "Pipe-Torch high", "Pipe-Torch best",
    ]  # fmt: skip
    assert (csv.loc[0, "TAPP"], csv.loc[0, "TAPP low"], csv.loc[0, "TAPP high"]) == (0.36, 0.34, 0.38)
    assert csv.loc[0, "TAPP best"] and not csv.loc[0, "BSP best"]


def test_the_best_group_is_the_one_the_experiment_tagged(tracking_uri: str, experiment_name: str) -> None:
    """The report bolds what each evaluation run's ``best_group`` tag says (the experiment's result computed it
    once), not a group of its own."""
    log_race(experiment_name, best={"tapp": "true"})
    csv = pd.read_csv(io.StringIO(build_tables(experiment_name).step_time.to_csv()))
    assert csv.loc[0, "TAPP best"] and not csv.loc[0, "SingleCPU best"] and not csv.loc[0, "Oracle best"]


def test_a_race_on_an_overloaded_host_is_a_warning_in_the_table(tracking_uri: str, experiment_name: str) -> None:
    log_race(experiment_name, loads=(0.4, 3.5, 6.0))  # other processes took 40 % of the CPU time
    markdown = build_tables(experiment_name).step_time.to_markdown()
    assert "WARNING: the race for AlexNet on local, batch 64, ran on an overloaded host" in markdown
    assert "(other processes took 40% of its CPU time; 1-minute load average 3.5 before, 6.0 after;" in markdown


# --- Section 5.2.2, the paper beside us, accuracy --------------------------------------------------------------


def test_computing_power_rows_are_the_family_at_each_power(tracking_uri: str, experiment_name: str) -> None:
    """hetero4 at power 1 and 0.5 (its slow half at half speed): a row per power, full power first, and TAPP's
    speedups over BSP and Pipe-Torch."""
    log_experiment(experiment_name, "alexnet", {"tapp": 0.5, "bsp": 1.0, "pipetorch": 0.6}, cluster="hetero4", power=1)
    log_experiment(
        experiment_name, "alexnet", {"tapp": 0.7, "bsp": 2.1, "pipetorch": 0.7}, cluster="hetero4", power=0.5
    )

    table = build_tables(experiment_name).computing_power
    frame = table.frame
    assert list(frame["cluster"]) == ["hetero4", "hetero4"] and list(frame["power"]) == ["1", "0.5"]
    assert list(frame["TAPP"]) == [0.5, 0.7]
    assert list(frame["TAPP over BSP"]) == pytest.approx([2.0, 3.0])
    assert list(frame["TAPP over Pipe-Torch"]) == pytest.approx([1.2, 1.0])
    assert "| AlexNet | hetero4 | 0.5 | 64 | – | 0.7000 | 2.100 | 0.7000 |" in table.to_markdown()
    assert "estimated by the cost model" not in table.to_markdown()  # logged as measured, without races


def test_batch_sizes_give_step_time_and_images_per_second(tracking_uri: str, experiment_name: str) -> None:
    for batch, seconds in ((16, 0.2), (32, 0.32)):
        log_experiment(experiment_name, "vgg16", {"tapp": seconds, "bsp": 2 * seconds}, batch_size=batch)

    frame = build_tables(experiment_name).batch_size.frame
    assert list(frame["batch"]) == [16, 32]
    assert list(frame["TAPP img/s"]) == pytest.approx([80.0, 100.0])
    assert list(frame["BSP img/s"]) == pytest.approx([40.0, 50.0])
    assert list(frame["TAPP"]) == [0.2, 0.32]


def test_the_paper_beside_us_says_which_claims_hold(tracking_uri: str, experiment_name: str) -> None:
    """The race of ``log_race``: TAPP ties SingleCPU, beats Pipe-Torch and BSP beyond the noise; the paper's other
    models are there, not run here."""
    log_race(experiment_name)

    table = build_tables(experiment_name).paper_comparison
    rows = {(r["model"], r["TAPP faster than"]): r for r in table.frame.to_dict("records")}
    single, pipetorch, bsp = (rows[("AlexNet", label)] for label in ("SingleCPU", "Pipe-Torch", "BSP"))
    assert single["paper"] == pytest.approx(0.811 / 0.602) and bsp["paper"] == pytest.approx(0.803 / 0.602)
    paired = sorted(p / t for p, t in zip(RACE["pipetorch"], RACE["tapp"], strict=True))
    assert pipetorch["ours"] == pytest.approx(paired[2]) and pipetorch["ours low"] == pytest.approx(paired[0])
    assert pipetorch["ours / paper"] == pytest.approx(paired[2] / (0.675 / 0.602))
    assert (single["holds here"], pipetorch["holds here"], bsp["holds here"]) == (
        "no: a tie within the noise", "yes", "yes",
    )  # fmt: skip
    assert rows[("VGG-16", "BSP")]["holds here"] == "not run here"
    assert rows[("VGG-16", "BSP")]["paper"] == pytest.approx(1.865 / 1.432)
    assert len(table.frame) == 9  # AlexNet here; VGG-16 and Inception-V3 only in the paper


def log_training(
    experiment: str,
    parent: RunRef,
    method: str,
    curve: list[tuple[float, float]],
    steps: int,
    schedule: str,
    staleness: int | None = None,
    trained_as: str | None = None,
    samples: int | None = None,
) -> None:
    """A train run as ``tasks.train`` logs it: the accuracy curve (training time, accuracy) per test evaluation;
    ``samples``: trained on that many images (else a 20 s budget); ``trained_as``: another method's training."""
    tags = ExperimentTags(
        model="alexnet", cluster="local", batch_size=64, seed=0, dataset="fashion-mnist", emulated=True
    )
    with tracked_run(f"train {method}", tags.child(parent, schema.TRAIN, method=method), parent=parent) as run:
        budget = {"train_budget_s": 20.0} if samples is None else {"train_samples": samples, "optimizer": "adamw"}
        run.log_params({"plan_schedule": schedule, "epochs": len(curve), **budget})
        if samples is not None:
            run.log_params({"lr": 0.001})
        if staleness is not None:
            run.log_params({"plan_staleness": staleness})
        if trained_as is not None:
            run.set_tags({schema.TRAINED_AS: trained_as})
        for point, (seconds, accuracy) in enumerate(curve, start=1):
            run.log_metrics({schema.CURVE_TIME: seconds, schema.CURVE_ACCURACY: accuracy}, step=point)
        run.log_metrics(
            {
                schema.TEST_ACCURACY: curve[-1][1],
                schema.TRAIN_TIME: curve[-1][0],
                schema.TRAIN_STEPS: steps,
                "test_samples": 1000,
                "epochs": len(curve),
            }
        )


def test_accuracy_table_names_what_was_trained_and_why_a_row_is_empty(
    tracking_uri: str, experiment_name: str, tmp_path
) -> None:
    from reports.paper import write_report

    parent = log_experiment(experiment_name, "alexnet", {"single-cpu": 0.3, "bsp": 1.2})  # no Gantt chart to draw
    log_training(experiment_name, parent, "tapp", [(9.8, 0.41), (19.6, 0.62)], 64, "1f1b")
    log_training(experiment_name, parent, "bsp", [(9.6, 0.12), (19.2, 0.25)], 16, "gpipe")
    log_training(experiment_name, parent, "pipetorch", [(9.9, 0.3), (19.9, 0.5)], 50, "async", staleness=1)
    untrained = log_experiment(experiment_name, "vgg16", {"bsp": 1.0})
    MlflowClient().set_tag(untrained.run_id, schema.TRAINING_SKIPPED, "estimate-only: there is no runtime to train on")

    report = write_report(experiment_name, tmp_path)
    table = report.tables.accuracy
    assert list(table.frame["dataset"]) == ["Fashion-MNIST", "–"]
    assert (table.frame.loc[0, "TAPP"], table.frame.loc[0, "BSP"]) == (0.62, 0.25)
    markdown = table.to_markdown()
    assert markdown.startswith("**Test accuracy after 20 s of training per method**")
    assert (
        "Pipe-Torch 50 steps in 19.9 s, async (staleness 1); BSP 16 steps in 19.2 s, gpipe; TAPP 64 steps" in markdown
    )
    assert "accuracy on the first 1,000 test images" in markdown
    assert "VGG-16 on local, batch 64: no accuracy, nothing was trained (estimate-only" in markdown
    figure = tmp_path / "accuracy_vs_time.png"
    assert figure in report.figure_files and figure.stat().st_size > 0


def test_accuracy_cells_carry_their_interval_and_say_whose_training_and_whether_clear_of_chance(
    tracking_uri: str, experiment_name: str
) -> None:
    parent = log_experiment(experiment_name, "alexnet", {"single-cpu": 0.3, "bsp": 0.2})
    log_training(experiment_name, parent, "single-cpu", [(10.0, 0.55), (20.0, 0.70)], 100, "gpipe", samples=6400)
    log_training(
        experiment_name, parent, "bsp", [(6.7, 0.55), (13.3, 0.70)], 100, "gpipe", trained_as="single-cpu",
        samples=6400,
    )  # fmt: skip
    log_training(experiment_name, parent, "tapp", [(6.0, 0.09), (12.0, 0.11)], 100, "async", staleness=2, samples=6400)
    table = build_tables(experiment_name).accuracy
    assert table.title == "Test accuracy after 6,400 training images per method"
    row = table.frame.iloc[0]
    assert (row["SingleCPU low"], row["SingleCPU high"]) == pytest.approx((0.6709, 0.7276), abs=1e-4)  # 1,000 images
    markdown = table.to_markdown()
    assert "70.0% [67.1, 72.8]" in markdown and "11.0% [9.2, 13.1]" in markdown
    assert "BSP 100 steps in 13.3 s (SingleCPU's training, its time scaled by the step times)" in markdown
    assert "AdamW at lr 0.001" in markdown and "computes what one device computes" in markdown
    assert "chance is 10%" in markdown and "Not clear of chance: TAPP" in markdown


def test_the_step_time_tables_say_which_cells_are_asynchronous(tracking_uri: str, experiment_name: str) -> None:
    log_experiment(experiment_name, "alexnet", PAPER["alexnet"], schedules={"tapp": "async", "single-cpu": "gpipe"})
    log_experiment(experiment_name, "vgg16", PAPER["vgg16"])
    tables = build_tables(experiment_name)
    for table in (tables.step_time, tables.batch_size, tables.paper_comparison, tables.computing_power):
        (note,) = [n for n in table.notes if "Asynchronous plans" in n]
        assert "(AlexNet/TAPP)" in note, table.name


def test_a_synchronous_experiment_says_every_cell_is_a_step(tracking_uri: str, experiment_name: str) -> None:
    log_experiment(experiment_name, "vgg16", PAPER["vgg16"])
    (note,) = [n for n in build_tables(experiment_name).step_time.notes if "synchronous" in n]
    assert note.startswith("Every plan is synchronous")
