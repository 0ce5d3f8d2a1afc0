"""The accuracy table, as the TAPP paper's: test accuracy after training SingleCPU's, Pipe-Torch's, BSP's and TAPP's
plans, per model; and the curves of the time-to-accuracy figure.

Each method's plan trains for the same wall-clock budget (or the same epochs), so a faster plan takes more steps:
the table's caption names the dataset, the subset (the steps each method took, the training images they drew and
the test images the accuracy is measured on), the epochs or the time budget, and the schedule of every plan
(with its staleness, for an asynchronous one). A synchronous plan trains exactly as one device does: its accuracy
after N steps is SingleCPU's, and only the time it takes differs.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from reports.tables import MODEL_ORDER, ROW_LABELS, Table, labelled, method_order, model_label, percent, pivot
from tapp_core import schema
from tapp_core.planners.base import method_label

DATASET_LABELS = {"cifar10": "CIFAR-10", "fashion-mnist": "Fashion-MNIST", "synthetic": "synthetic data"}
NOT_TRAINED = "–"
"""The dataset cell of a row whose experiment trained nothing (the notes say why)."""


def accuracy_table(trainings: pd.DataFrame, untrained: Mapping[tuple[str, str, int], str] | None = None) -> Table:
    """One row per (model, cluster, batch size, dataset), a column per method; ``untrained`` (key -> why) adds a row,
    empty, for each experiment that trained nothing."""
    trainings = in_method_order(trainings)
    keys = [*schema.KEY_COLUMNS, schema.DATASET]
    missing = {k: why for k, why in (untrained or {}).items() if not _trained(trainings, k)}
    rows = pd.concat([trainings, _empty_rows(missing)], ignore_index=True) if missing else trainings
    wide, methods = pivot(rows, keys, schema.TEST_ACCURACY)
    wide[schema.DATASET] = wide[schema.DATASET].map(lambda d: DATASET_LABELS.get(str(d), str(d)))
    return Table(
        name="accuracy",
        title=_title(trainings),
        frame=labelled(wide, keys, methods),
        label_columns=tuple(ROW_LABELS[k] for k in keys),
        formats={method_label(m): percent for m in methods},
        notes=accuracy_notes(trainings, missing),
    )


def in_method_order(trainings: pd.DataFrame) -> pd.DataFrame:
    """The train runs, methods in the tables' column order (the paper's first)."""
    if trainings.empty:
        return trainings
    rank = {m: i for i, m in enumerate(method_order(trainings["method"]))}
    return trainings.sort_values("method", key=lambda s: s.map(rank), kind="stable")


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
    return pd.DataFrame(records).assign(**{schema.TEST_ACCURACY: float("nan")})


def _title(trainings: pd.DataFrame) -> str:
    budgets = {str(b) for b in trainings.get("train_budget_s", pd.Series(dtype=str)) if str(b) not in ("", "None")}
    if len(budgets) == 1:
        return f"Test accuracy after {float(budgets.pop()):g} s of training per method"
    epochs = {int(e) for e in trainings.get("epochs", pd.Series(dtype=float)).dropna()}
    if not budgets and len(epochs) == 1:
        count = epochs.pop()
        return f"Test accuracy after {count} epoch{'s' if count != 1 else ''} of training"
    return "Test accuracy after training each method's plan"


def accuracy_notes(trainings: pd.DataFrame, missing: Mapping[tuple[str, str, int], str]) -> list[str]:
    """The caption: per row what was trained (steps, images, test subset, schedules), then why rows are empty."""
    notes = []
    order = ["model", "cluster", "batch_size", schema.DATASET]
    for key, group in trainings.groupby(order, sort=False) if not trainings.empty else []:
        notes.append(_row_note(tuple(key), group))
    if not trainings.empty and (trainings[schema.DATASET] == "synthetic").any():
        notes.append("Rows on the synthetic dataset are random labels: their accuracy means nothing.")
    for (model, cluster, batch), why in sorted(missing.items(), key=lambda item: _key_order(item[0])):
        notes.append(f"{model_label(model)} on {cluster}, batch {batch}: no accuracy, nothing was trained ({why}).")
    if trainings.empty and not missing:
        notes.append("No training runs in this experiment.")
    return notes


def _key_order(key: tuple[str, str, int]) -> tuple[int, str, str, int]:
    model, cluster, batch = key
    rank = MODEL_ORDER.index(model) if model in MODEL_ORDER else len(MODEL_ORDER)
    return rank, model, cluster, batch


def _row_note(key: tuple[object, ...], group: pd.DataFrame) -> str:
    model, cluster, batch, dataset = key
    parts = []
    for record in group.to_dict("records"):
        steps = record.get(schema.TRAIN_STEPS)
        seconds = record.get(schema.TRAIN_TIME)
        shape = f"{int(steps)} steps" if pd.notna(steps) else f"{int(record.get('epochs') or 0)} epoch(s)"
        if pd.notna(seconds):
            shape += f" in {float(seconds):.1f} s"
        parts.append(f"{method_label(str(record['method']))} {shape}, {_schedule(record)}")
    tested = {int(t) for t in group["test_samples"].dropna()}
    test = f"the first {tested.pop():,} test images" if len(tested) == 1 else "its test images"
    name = DATASET_LABELS.get(str(dataset), str(dataset))
    return (
        f"{model_label(str(model))} on {cluster}, batch {batch}, {name} (training batches drawn in a seeded order, "
        f"accuracy on {test}): " + "; ".join(parts) + "."
    )


def _schedule(record: Mapping[object, object]) -> str:
    """A plan's schedule, with its staleness when asynchronous."""
    schedule = str(record.get("plan_schedule") or "") or "schedule unknown"
    if schedule == "async":
        staleness = str(record.get("plan_staleness") or record.get(schema.STALENESS) or "")
        return f"async (staleness {staleness})" if staleness else "async (staleness as deep as the pipeline)"
    return schedule


def curve_frame(curves: Mapping[str, pd.DataFrame], trainings: pd.DataFrame) -> pd.DataFrame:
    """Every method's accuracy curve (``runs.accuracy_curve`` of its train run, by run id), one row per test
    evaluation, with the row's model, cluster, batch size, dataset and the method's label."""
    frames = []
    for row in in_method_order(trainings).itertuples(index=False):
        curve = curves.get(str(row.run_id))
        if curve is None or curve.empty:
            continue
        frames.append(
            curve.assign(
                group=f"{model_label(str(row.model))} on {row.cluster}, batch {row.batch_size}, "
                f"{DATASET_LABELS.get(str(row.dataset), str(row.dataset))}",
                method=method_label(str(row.method)),
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
