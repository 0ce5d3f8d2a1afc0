"""The accuracy table, as the TAPP paper's: test accuracy after training SingleCPU's, Pipe-Torch's, BSP's and TAPP's
plans, per model; and the curves of the time-to-accuracy figure. A language model's rows are a table of their own,
of test perplexity (``perplexity_table``), and its curves a figure of their own.

Every method's plan trains on the same number of training images (or the same epochs; a time budget, where one was
asked, gives a faster plan more, and the caption says so). Each accuracy carries its Wilson interval over the test
images it was measured on (``measure.stats.proportion_interval``). The caption names the dataset, the subset (the
steps each method took, the training images they drew and the test images the accuracy is measured on), the
optimiser, the chance level, and the schedule of every plan (with its staleness, for an asynchronous one). A
synchronous plan trains exactly as one device does: an experiment trains one and records it for the others
(``trained_as``), and the caption says whose training each such cell is.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from reports import numbers, schema
from reports.tables import (
    HIGH,
    LOW,
    MODEL_ORDER,
    ROW_LABELS,
    Table,
    labelled,
    method_order,
    model_label,
    percent,
    pivot,
)
from tapp_core.measure.stats import ACCURACY_CONFIDENCE, proportion_interval
from tapp_core.planners.base import method_label

DATASET_LABELS = {
    "cifar10": "CIFAR-10",
    "fashion-mnist": "Fashion-MNIST",
    "synthetic": "synthetic data",
    "fortunes": "Debian's fortunes (text)",
}
CHANCE: dict[str, float] = {"cifar10": 0.1, "fashion-mnist": 0.1, "synthetic": 0.1}
"""The accuracy of a guess, per dataset: one over its ten classes."""
ACCURACY_LOW, ACCURACY_HIGH = "test_accuracy_low", "test_accuracy_high"
NOT_TRAINED = "–"
"""The dataset cell of a row whose experiment trained nothing (the notes say why)."""


def accuracy_table(trainings: pd.DataFrame, untrained: Mapping[tuple[str, str, int], str] | None = None) -> Table:
    """One row per (model, cluster, batch size, dataset) of a classifier, a column per method; ``untrained`` (key ->
    why) adds a row, empty, for each experiment that trained nothing."""
    return _quality_table(trainings, untrained, perplexity=False)


def perplexity_table(trainings: pd.DataFrame, untrained: Mapping[tuple[str, str, int], str] | None = None) -> Table:
    """The accuracy table of the language models (``Workload.language_model``): their test perplexity, the
    exponential of the mean cross-entropy per predicted token (lower is better)."""
    return _quality_table(trainings, untrained, perplexity=True)


def language_model_rows(trainings: pd.DataFrame) -> pd.Series:
    """Which train runs are a language model's: those that logged a test perplexity instead of an accuracy."""
    if trainings.empty or schema.TEST_PERPLEXITY not in trainings:
        return pd.Series(False, index=trainings.index, dtype=bool)
    return trainings[schema.TEST_PERPLEXITY].notna()


def _quality_table(
    trainings: pd.DataFrame, untrained: Mapping[tuple[str, str, int], str] | None, perplexity: bool
) -> Table:
    quality = "perplexity" if perplexity else "accuracy"
    trainings = in_method_order(trainings[language_model_rows(trainings) == perplexity])
    keys = [*schema.KEY_COLUMNS, schema.DATASET]
    missing = {
        k: why
        for k, why in (untrained or {}).items()
        if not _trained(trainings, k) and language_model_named(k[0]) == perplexity
    }
    rows = pd.concat([trainings, _empty_rows(missing)], ignore_index=True) if missing else trainings
    if perplexity:
        wide, methods = pivot(rows, keys, schema.TEST_PERPLEXITY)
    else:
        wide, methods = pivot(rows, keys, schema.TEST_ACCURACY, {LOW: ACCURACY_LOW, HIGH: ACCURACY_HIGH})
    wide[schema.DATASET] = wide[schema.DATASET].map(lambda d: DATASET_LABELS.get(str(d), str(d)))
    return Table(
        name=quality,
        title=_title(trainings, quality),
        frame=labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats={method_label(m): numbers.perplexity if perplexity else percent for m in methods},
        notes=accuracy_notes(trainings, missing, quality),
    )


def language_model_named(model: str) -> bool:
    """Whether model spec ``model`` is a language model's (its workload, read afresh; False when it cannot be read
    here)."""
    from tapp_core.errors import TappError
    from tapp_core.model.workload import workload_of

    try:
        return workload_of(model).language_model
    except (TappError, OSError):
        return False


def in_method_order(trainings: pd.DataFrame) -> pd.DataFrame:
    """The train runs, methods in the tables' column order (the paper's first), each accuracy with its interval
    (``ACCURACY_LOW``, ``ACCURACY_HIGH``) over its test images."""
    if trainings.empty:
        return trainings.assign(**{ACCURACY_LOW: [], ACCURACY_HIGH: []})
    rank = {m: i for i, m in enumerate(method_order(trainings["method"]))}
    ordered = trainings.sort_values("method", key=lambda s: s.map(rank), kind="stable")
    intervals = [
        proportion_interval(float(value), int(tested)) if pd.notna(value) and pd.notna(tested) else None
        for value, tested in zip(ordered[schema.TEST_ACCURACY], ordered["test_samples"], strict=True)
    ]
    return ordered.assign(
        **{
            ACCURACY_LOW: [iv.low if iv else float("nan") for iv in intervals],
            ACCURACY_HIGH: [iv.high if iv else float("nan") for iv in intervals],
        }
    )


def _trained(trainings: pd.DataFrame, key: tuple[str, str, int]) -> bool:
    if trainings.empty:
        return False
    model, cluster, batch = key
    same = (trainings["model"] == model) & (trainings["cluster"] == cluster) & (trainings["batch_size"] == batch)
    return bool(same.any())


def _empty_rows(missing: Mapping[tuple[str, str, int], str]) -> pd.DataFrame:
    records = [
        {"model": m, "cluster": c, "batch_size": b, schema.DATASET: NOT_TRAINED, "method": "tapp"}
        for m, c, b in missing
    ]
    return pd.DataFrame(records).assign(**{schema.TEST_ACCURACY: float("nan"), schema.TEST_PERPLEXITY: float("nan")})


def _title(trainings: pd.DataFrame, quality: str = "accuracy") -> str:
    samples = {int(float(s)) for s in trainings.get("train_samples", pd.Series(dtype=str)) if _given(s)}
    if len(samples) == 1 and not any(_given(b) for b in trainings.get("train_budget_s", pd.Series(dtype=str))):
        unit = "training sequences" if quality == "perplexity" else "training images"
        return f"Test {quality} after {samples.pop():,} {unit} per method"
    budgets = {str(b) for b in trainings.get("train_budget_s", pd.Series(dtype=str)) if str(b) not in ("", "None")}
    if len(budgets) == 1:
        return f"Test {quality} after {float(budgets.pop()):g} s of training per method"
    epochs = {int(e) for e in trainings.get("epochs", pd.Series(dtype=float)).dropna()}
    if not budgets and len(epochs) == 1:
        count = epochs.pop()
        return f"Test {quality} after {count} epoch{'s' if count != 1 else ''} of training"
    return f"Test {quality} after training each method's plan"


def accuracy_notes(
    trainings: pd.DataFrame, missing: Mapping[tuple[str, str, int], str], quality: str = "accuracy"
) -> list[str]:
    """The caption: per row what was trained (steps, images, test subset, schedules), then why rows are empty."""
    notes = []
    order = ["model", "cluster", "batch_size", schema.DATASET]
    for key, group in trainings.groupby(order, sort=False) if not trainings.empty else []:
        notes.append(_row_note(tuple(key), group, quality))
    if quality == "perplexity" and not trainings.empty:
        notes.append("Perplexity: the exponential of the mean cross-entropy per predicted token; lower is better.")
    if quality == "accuracy" and not trainings.empty and (trainings[schema.DATASET] == "synthetic").any():
        notes.append("Rows on the synthetic dataset are random labels: their accuracy means nothing.")
    for (model, cluster, batch), why in sorted(missing.items(), key=lambda item: _key_order(item[0])):
        notes.append(f"{model_label(model)} on {cluster}, batch {batch}: no {quality}, nothing was trained ({why}).")
    if trainings.empty and not missing:
        notes.append("No training runs in this experiment.")
    return notes


def _given(value: object) -> bool:
    """Whether a param or tag holds a value (MLflow leaves a missing one NaN, None or empty)."""
    return str(value) not in ("", "None", "nan")


def _key_order(key: tuple[str, str, int]) -> tuple[int, str, str, int]:
    model, cluster, batch = key
    rank = MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER)
    return rank, model, cluster, batch


def _row_note(key: tuple[object, ...], group: pd.DataFrame, quality: str) -> str:
    model, cluster, batch, dataset = key
    parts = []
    for record in group.to_dict("records"):
        steps = record.get(schema.TRAIN_STEPS)
        seconds = record.get(schema.TRAIN_TIME)
        shape = f"{int(steps)} steps" if pd.notna(steps) else f"{int(record.get('epochs') or 0)} epoch(s)"
        if pd.notna(seconds):
            shape += f" in {float(seconds):.1f} s"
        trained_as = str(record.get(schema.TRAINED_AS) or "")
        if _given(trained_as) and trained_as != record["method"]:
            shape += f" ({method_label(trained_as)}'s training, its time scaled by the step times)"
        parts.append(f"{method_label(str(record['method']))} {shape}, {_schedule(record)}")
    tested = {int(t) for t in group["test_samples"].dropna()}
    what = "predicted tokens of its test text" if quality == "perplexity" else "test images"
    test = f"the first {tested.pop():,} {what}" if len(tested) == 1 else f"its {what}"
    name = DATASET_LABELS.get(str(dataset), str(dataset))
    return (
        f"{model_label(str(model))} on {cluster}, batch {batch}, {name} (training batches drawn in a seeded order"
        f"{_optimiser(group)}, {quality} on {test}): " + "; ".join(parts) + "." + _shared_note(group)
        + _chance_note(group, str(dataset))
    )  # fmt: skip


def _optimiser(group: pd.DataFrame) -> str:
    names = {(str(o), str(lr)) for o, lr in zip(group.get("optimizer", []), group.get("lr", []), strict=True)}
    names = {(o, lr) for o, lr in names if _given(o)}
    if len(names) != 1:
        return ""
    optimiser, lr = names.pop()
    named = {"adamw": "AdamW", "sgd": "SGD"}.get(optimiser, optimiser)  # runs before the class name was logged
    return f", {named} at lr {float(lr):g}"


def _shared_note(group: pd.DataFrame) -> str:
    """Which cells are another method's training, and why that is the same computation."""
    shared = [
        r
        for r in group.to_dict("records")
        if _given(r.get(schema.TRAINED_AS)) and r.get(schema.TRAINED_AS) != r["method"]
    ]
    if not shared:
        return ""
    return (
        " Every synchronous plan computes what one device computes (the runtime's correctness tests), so their "
        "training ran once and its accuracy is shared; only the time it takes differs."
    )


def _chance_note(group: pd.DataFrame, dataset: str) -> str:
    """The intervals' kind and the chance level, and the methods whose interval still holds chance."""
    chance = CHANCE.get(dataset)
    if chance is None:
        return ""
    at_chance = [
        method_label(str(r["method"]))
        for r in group.to_dict("records")
        if pd.notna(r.get(ACCURACY_LOW)) and r[ACCURACY_LOW] <= chance <= r[ACCURACY_HIGH]
    ]
    text = f" Intervals: {ACCURACY_CONFIDENCE:.0%} Wilson score over the test images; chance is {chance:.0%}."
    if at_chance:
        text += f" Not clear of chance: {', '.join(at_chance)} (no learning measured)."
    return text


def _schedule(record: Mapping[object, object]) -> str:
    """A plan's schedule, with its staleness when asynchronous."""
    schedule = str(record.get("plan_schedule") or "") or "schedule unknown"
    if schedule == "async":
        staleness = str(record.get("plan_staleness") or record.get(schema.STALENESS) or "")
        return f"async (staleness {staleness})" if staleness else "async (staleness as deep as the pipeline)"
    return schedule


def curve_frame(curves: Mapping[str, pd.DataFrame], trainings: pd.DataFrame) -> pd.DataFrame:
    """Every method's accuracy curve (``runs.accuracy_curve`` of its train run, by run id), one row per test
    evaluation, with the row's model, cluster, batch size, dataset and the method's label, each accuracy's interval
    over the run's test images (``ACCURACY_LOW``, ``ACCURACY_HIGH``) and the dataset's chance level (``chance``)."""
    frames = []
    for row in in_method_order(trainings).itertuples(index=False):
        curve = curves.get(str(row.run_id))
        if curve is None or curve.empty:
            continue
        tested = int(float(str(row.test_samples))) if _given(row.test_samples) else 0
        accuracies: list[float] = list(curve.get(schema.CURVE_ACCURACY, []))  # a language model's curve has none
        intervals = [proportion_interval(float(a), tested) for a in accuracies]
        lows = [iv.low for iv in intervals] if intervals else [float("nan")] * len(curve)
        highs = [iv.high for iv in intervals] if intervals else [float("nan")] * len(curve)
        frames.append(
            curve.assign(
                group=f"{model_label(str(row.model))} on {row.cluster}, batch {row.batch_size}, "
                f"{DATASET_LABELS.get(str(row.dataset), str(row.dataset))}",
                method=method_label(str(row.method)),
                chance=CHANCE.get(str(row.dataset), float("nan")),
                **{ACCURACY_LOW: lows, ACCURACY_HIGH: highs},
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
