"""``benchmark_sweep``: tapp_experiment over models x batch sizes x clusters, as subflows, then one report.

Experiments run one after another (their measurements must not share the cores). A failed experiment is
recorded in the sweep's MLflow run and the sweep goes on; the sweep fails at the end if any did.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from prefect import flow

from flows.experiment import DEFAULT_METHODS, DEFAULT_ROUNDS, check_inputs, tapp_experiment
from reports import runs
from reports.paper import write_report
from tasks import prefect_ui
from tasks.search import SearchBudget
from tasks.tracking import DEFAULT_EXPERIMENT, code_version, tracked_run


class SweepIncomplete(RuntimeError):
    """Some experiments of the sweep failed; the report holds the others."""


@dataclass
class SweepResult:
    run_id: str
    report_dir: Path
    step_time_table: str
    failed: list[str] = field(default_factory=list)


def sweep_run_name() -> str:
    """``sweep-MODELS-MODE``, e.g. ``sweep-alexnet-vgg16-measured``."""
    from prefect.runtime import flow_run

    parameters = flow_run.parameters
    models = "-".join(parameters.get("models", ("alexnet", "vgg16", "inception_v3")))
    return f"sweep-{models}-{'measured' if parameters.get('measure', True) else 'estimated'}"


@flow(name="benchmark-sweep", flow_run_name=sweep_run_name)
def benchmark_sweep(
    models: tuple[str, ...] = ("alexnet", "vgg16", "inception_v3"),
    batch_sizes: tuple[int, ...] = (64,),
    clusters: tuple[str, ...] = ("local",),
    dataset: str = "synthetic",
    data_dir: str | None = None,
    search_rounds: int = DEFAULT_ROUNDS,
    samples_per_round: int = SearchBudget.samples_per_round,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    measure: bool = True,
    seed: int = 0,
    experiment: str = DEFAULT_EXPERIMENT,
    out: str = "out/sweep",
    tracking_uri: str | None = None,
) -> SweepResult:
    """Every combination as a ``tapp_experiment`` subflow, all tagged with this sweep's run; one report at the end
    (also the sweep run's description in MLflow, and its ``tapp-sweep-result`` artifact in Prefect).
    ``search_rounds`` counts each search's rounds in all, as ``tapp_experiment`` does."""
    combinations = list(itertools.product(models, batch_sizes, clusters))
    uri = ""
    for model, batch_size, cluster in combinations:  # every input checked before any run exists
        uri = check_inputs(model, cluster, batch_size, dataset, data_dir, tuple(methods), tracking_uri)[1]
    tags = {runs.KIND: runs.SWEEP, runs.DATASET: dataset, runs.SEED: str(seed), runs.CODE_VERSION: code_version()}
    failed: list[str] = []
    with tracked_run("benchmark sweep", tags, experiment=experiment, uri=uri) as sweep:
        sweep.log_params(
            {
                "models": ",".join(models),
                "batch_sizes": ",".join(map(str, batch_sizes)),
                "clusters": ",".join(clusters),
                "search_rounds": search_rounds,
                "measure": measure,
            }
        )
        for model, batch_size, cluster in combinations:
            state = tapp_experiment(
                model=model,
                cluster=cluster,
                batch_size=batch_size,
                dataset=dataset,
                data_dir=data_dir,
                search_rounds=search_rounds,
                samples_per_round=samples_per_round,
                methods=methods,
                measure=measure,
                seed=seed,
                experiment=experiment,
                out=str(Path(out) / "experiments" / f"{model}_{cluster}_b{batch_size}"),
                tracking_uri=uri,
                sweep_run=sweep.run_id,
                return_state=True,
            )
            if not state.is_completed():
                failed.append(f"{model} on {cluster}, batch {batch_size}")
        sweep.log_metrics({"experiments": len(combinations), "failed_experiments": len(failed)})
        report = write_report(experiment, out, uri, within=sweep.run_id, tag=runs.SWEEP_RUN)
        for path in (*report.table_files, *report.figure_files):
            sweep.log_file(path, "report")
        table = report.tables.step_time.to_markdown()
        failures = f"\n\nFailed experiments: {'; '.join(failed)}." if failed else ""
        sweep.set_note(f"### Benchmark sweep: {len(combinations)} experiments\n\n{table}{failures}\n")
        prefect_ui.log(
            f"{len(combinations)} experiments reported; the step-time table is the artifact tapp-sweep-result."
        )
        prefect_ui.markdown_artifact("tapp-sweep-result", table + failures, "the sweep's step-time table")
        if failed:
            raise SweepIncomplete(f"failed experiments: {'; '.join(failed)}; report of the others in {out}")
    return SweepResult(sweep.run_id, report.folder, report.tables.step_time.to_markdown(), failed)
