"""What TAPP records in MLflow: tag keys, run kinds, metric and artifact names, and run names.

The one schema of the writers (``tasks``) and the readers (``reports``): a table is a query over runs by these
tags, so a UI filter such as ``tags.method = 'tapp' and tags.model = 'vgg16'`` and the paper's tables see the same
runs. Names only: tapp_core never imports mlflow.
"""

from __future__ import annotations

# Tag keys
KIND = "run_kind"
STAGE = "stage"
MODEL = "model"
METHOD = "method"
CLUSTER = "cluster"
BATCH_SIZE = "batch_size"
SEED = "seed"
DATASET = "dataset"
EMULATED = "emulated"
CODE_VERSION = "code_version"
EXPERIMENT_RUN = "experiment_run"
"""On every run of one tapp_experiment: the id of its parent run (so one experiment's runs are one filter)."""
SWEEP_RUN = "sweep_run"
STEP_TIME_SOURCE = "step_time_source"
"""``measured`` (runtime, median over race rounds) or ``estimated`` (cost model): where ``step_time_s`` came from."""
RACE_ID = "race_id"
"""The race an evaluation's measurement came from: runs of one race pair round by round."""
RACE_STOP = "race_stop"
HOST_OVERLOADED = "host_overloaded"
BEST_GROUP = "best_group"
"""``true`` on an evaluation whose interval overlaps the fastest method's in its race (``tapp_core.measure.stats``)."""
MEASUREMENT_FROM = "measurement_from"
"""Tag of an evaluation whose plan is an earlier method's: the method whose measurement it shares."""
ERROR = "error"
DOES_NOT_FIT = "does_not_fit"
"""On a method's evaluation run: why none of its plans fits the cluster's memory (the run has no step time)."""
TRAINED_AS = "trained_as"
"""Tag of a train run whose plan an earlier method of the experiment already trained: that method (the training is
recorded for both, run once)."""
BASE_CLUSTER = "base_cluster"
"""The cluster file's cluster when the experiment ran on a member of its computing-power family (``power``)."""
POWER = "power"
"""The factor by which the cluster's slow devices were scaled (``Cluster.scaled``): 1 for the cluster as written."""
SCHEDULE = "schedule"
"""The pipeline schedule the experiment asked its planners for (``gpipe``, ``1f1b``, ``async``)."""
STALENESS = "staleness"
"""The asynchronous schedule's staleness bound, when one was given."""
SWEEP_INDEX = "sweep_index"
"""On an experiment run of a sweep: its configuration's place in the sweep's list (from 0)."""
RESUMED_FROM = "resumed_from"
"""On a run that continues an interrupted one (an experiment or a sweep): that run's id."""

# Run kinds
EXPERIMENT = "experiment"
STAGE_RUN = "stage"
EVALUATION = "evaluation"
TRAIN = "train"
REPORT = "report"
SWEEP = "sweep"

# Metrics of an evaluation run
STEP_TIME = "step_time_s"
"""The step time every view shows: the measured median, else the estimate, rounded as shown (``reports.numbers``)."""
STEP_TIME_MS = "step_time_ms"
"""The same in milliseconds, for MLflow's bar chart (its labels keep two decimals)."""
MEASURED_STEP_TIME = "measured_step_time_s"
ESTIMATED_STEP_TIME = "estimated_step_time_s"
PLACE = "place_in_experiment"
"""The method's place in its experiment's result (``tasks.summary.Result.methods``): 1 the fastest; among equal step
times TAPP first, then by name. The MLflow runs view's sort key, so that a tie never puts TAPP below an equal run."""
COMMUNICATION_SHARE = "communication_share"
MEASURED_COMMUNICATION_SHARE = "measured_communication_share"
ESTIMATED_COMMUNICATION_SHARE = "estimated_communication_share"
STEP_TIME_LOW = "step_time_low_s"
STEP_TIME_HIGH = "step_time_high_s"
"""The confidence interval of the measured median (order statistics over the race's rounds)."""
STEP_TIME_COVERAGE = "step_time_coverage"
RACE_ROUNDS = "race_rounds"
ROUND_STEP_TIME = "race_round_step_time_s"
"""One value per race round (step = the round's number in its race)."""
LOAD_BEFORE = "host_load_before"
LOAD_AFTER = "host_load_after"
HOST_CPUS = "host_cpus"
HOST_RANKS = "host_ranks"
HOST_OTHER_CPU = "host_other_cpu_share"
"""The share of the host's CPU time other processes than the race's own took while it ran."""
# Metrics of an experiment run
SPEEDUP_PAIRED = "speedup_bsp_over_tapp_median_of_round_ratios"
"""The median of BSP/TAPP per-round step-time ratios in the evaluation race (``_low``, ``_high``: its interval);
only when both were raced."""
SPEEDUP_OF_STEP_TIMES = "speedup_bsp_over_tapp_ratio_of_step_times"
"""BSP's step time over TAPP's as shown (measured medians, or estimates)."""
# Metrics of a train run
TEST_ACCURACY = "test_accuracy"
"""A classifier's; a language model (``Workload.language_model``) logs its test loss and perplexity instead."""
TEST_LOSS = "test_loss"
"""The mean loss per prediction on the test samples (a language model's: cross-entropy per token, in nats)."""
TEST_PERPLEXITY = "test_perplexity"
"""A language model's: the exponential of its test loss."""
TRAIN_TIME = "train_time_s"
"""Wall-clock time of the training steps (test evaluations excluded)."""
TRAIN_STEPS = "train_steps"
CURVE_ACCURACY = "curve_test_accuracy"
CURVE_TIME = "curve_train_time_s"
CURVE_STEPS = "curve_train_steps"
CURVE_PERPLEXITY = "curve_test_perplexity"
"""The accuracy curve, one value per test evaluation (step = its number from 1): the test accuracy (a language
model's: its test perplexity), and the training time and steps spent until then."""
TRAINING_SKIPPED = "training_skipped"
"""On an experiment run that trained nothing: why (no real data, estimate-only, training off)."""
# Metrics of the search stages, one value per round (step = round)
BEST_ESTIMATED_SO_FAR = "best_so_far_estimated_step_time_s"
ROUND_BEST_ESTIMATED = "round_best_estimated_step_time_s"
"""A simulated round (the ``search`` stage): the cost model's best estimate so far, and the round's best."""
BEST_MEASURED_SO_FAR = "best_so_far_one_round_measured_step_time_s"
ROUND_BEST_MEASURED = "round_best_one_round_measured_step_time_s"
"""A measured round (the ``sampling`` stage): each sample measured in one race round; the best so far, the round's
best."""
ROUND_METRICS = (
    "reward_mean",
    BEST_ESTIMATED_SO_FAR,
    ROUND_BEST_ESTIMATED,
    BEST_MEASURED_SO_FAR,
    ROUND_BEST_MEASURED,
    "entropy",
)


def round_step_time_names(phase: str) -> tuple[str, str]:
    """(best so far, the round's best) step-time metric names of a search round in ``phase`` (``simulated`` or
    ``measured``): each name says whether it is an estimate or a measurement."""
    if phase == "measured":
        return BEST_MEASURED_SO_FAR, ROUND_BEST_MEASURED
    return BEST_ESTIMATED_SO_FAR, ROUND_BEST_ESTIMATED


# Artifacts
PLAN_ARTIFACT = "plan.json"
ESTIMATE_ARTIFACT = "estimate.json"
RESULT_ARTIFACT = "result.json"
RATIO_PAIRED = "median of per-round ratios"
"""Which ratio a stored ratio is (its ``is``): of two plans raced in one race, the median over the rounds of their
step-time ratio, round by round (it can differ from the ratio of their medians)..."""
RATIO_OF_STEP_TIMES = "ratio of step times"
"""... or the ratio of the two step times shown (medians, or estimates)."""
"""On an experiment's parent run: its result as plain data (``tasks.summary.result_record``), which the report reads."""
CONFIG_ARTIFACT = "config.json"
"""On an experiment's (or a sweep's) parent run: its whole configuration, which a resumed run reads back."""

KEY_COLUMNS = ("model", "cluster", "batch_size")


# Run names


def experiment_name(model: str, cluster: str, batch_size: int) -> str:
    """An experiment's parent run."""
    return f"{model} on {cluster}, batch {batch_size}"


def train_name(method: str) -> str:
    """The run that trains a method's plan."""
    return f"train {method}"


SWEEP_NAME = "benchmark sweep"
REPORT_NAME = "paper table"
