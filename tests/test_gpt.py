"""The GPT of the registry and its workload: the model (nanoGPT's shape, causal, its head tied to the token
embedding), its text (Debian's fortunes, read as bytes), its training (perplexity falls) and what the views show
of it (perplexity where a classifier shows accuracy)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flows.cli import app
from tapp_core.model.data import FORTUNES_ROOT, ByteText, DataError, fortunes_installed, open_text, read_fortunes
from tapp_core.model.graph import layer_nodes, parameter_users
from tapp_core.model.workload import (
    OptimizerConfig,
    Workload,
    WorkloadError,
    build_traced_workload,
    build_workload_model,
    check_workload_data,
    open_workload_data,
    perplexity,
    workload_of,
)
from tapp_core.model.zoo import MODEL_NAMES
from tapp_core.model.zoo.gpt import CONTEXT, VOCABULARY
from tapp_core.runtime import WorkerPool
from tapp_core.runtime.optim import make_optimizer

GPT_PARAMETERS = 834_304
"""Listed in the README; a change here is a change of architecture."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fortunes() -> Path:
    """Debian's fortunes (``make data`` installs it where it can); without it, one line says how to install it."""
    if not fortunes_installed():
        pytest.skip(f"the fortunes text is not in {FORTUNES_ROOT}: `make data` as root (apt-get install fortunes)")
    return Path(FORTUNES_ROOT)


def fake_fortunes(folder: Path) -> Path:
    """A fortunes folder of two files (and the index and link the package puts beside each)."""
    folder.mkdir()
    quotes = [f"Quotation number {i}: all is well that ends well.\n\t\t-- Someone" for i in range(40)]
    (folder / "wisdom").write_text("\n%\n".join(quotes[:25]) + "\n%\n")
    (folder / "work").write_text("\n%\n".join(quotes[25:]) + "\n%\n")
    (folder / "wisdom.dat").write_bytes(b"\x00\x02binary index")
    (folder / "wisdom.u8").symlink_to("wisdom")
    return folder


def test_the_gpt_is_registered_with_its_own_workload() -> None:
    assert "gpt" in MODEL_NAMES
    workload = workload_of("gpt")
    assert workload.language_model and workload.quality == "perplexity" and workload.data == "fortunes"
    assert workload.inputs[0].shape == (CONTEXT,) and workload.inputs[0].high == VOCABULARY
    assert workload.optimizer.name == "AdamW"
    assert not workload_of("tiny_cnn").language_model and workload_of("tiny_cnn").quality == "accuracy"


def test_the_gpt_traces_computes_as_built_and_ties_its_head_to_the_token_embedding() -> None:
    workload = workload_of("gpt")
    model, traced = build_workload_model(workload).eval(), build_traced_workload(workload).eval()
    assert sum(p.numel() for p in model.parameters()) == GPT_PARAMETERS
    tokens = workload.example(2)
    with torch.no_grad():
        expected, got = model(tokens), traced(tokens)
    assert got.shape == (2, CONTEXT, VOCABULARY) and torch.equal(got, expected)
    layers = len(layer_nodes(traced))
    assert parameter_users(traced)["tokens.weight"] == (0, layers - 1)  # the first layer and the last
    attention = [n for n in traced.graph.nodes if n.op == "call_module" and n.target.endswith("attn.q")]
    assert len(attention) == 4  # one q projection per block: Megatron splits it by heads


def test_the_gpt_is_causal_a_position_sees_no_later_token() -> None:
    model = build_workload_model(workload_of("gpt")).eval()
    tokens = workload_of("gpt").example(1)
    changed = tokens.clone()
    changed[0, 40:] = (changed[0, 40:] + 1) % VOCABULARY
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.allclose(before[0, :40], after[0, :40], atol=1e-6)
    assert not torch.allclose(before[0, 40:], after[0, 40:])


def test_the_gpt_profiles_on_its_own_inputs() -> None:
    from tapp_core.profile.profiler import ProfileRequest, profile_model

    library = profile_model(ProfileRequest("gpt", batch_size=4, repeats=1, warmup=0, threads=1))
    assert len(library) == len(layer_nodes(build_traced_workload(workload_of("gpt"))))
    assert library.layers[-1].output_shape == (4, CONTEXT, VOCABULARY)
    assert sum(layer.flops for layer in library.layers) > 0 and all(layer.forward_s >= 0 for layer in library.layers)


def test_text_samples_are_byte_windows_whose_targets_are_the_next_bytes(tmp_path: Path) -> None:
    folder = fake_fortunes(tmp_path / "fortunes")
    train, test = read_fortunes(folder, train=True), read_fortunes(folder, train=False)
    assert b"%" not in bytes(train.tolist()) and b"binary index" not in bytes(train.tolist())
    assert bytes(test.tolist()).count(b"Quotation number") == 4  # every tenth quotation is held out
    assert b"Quotation number 0:" in bytes(test.tolist()) and b"Quotation number 0:" not in bytes(train.tolist())
    text = ByteText(train, context=8)
    tokens, targets = text.get_batch(torch.tensor([0, 3]))
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 8)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.equal(tokens[1], train[24:32].to(torch.int64)) and int(targets[1, -1]) == int(train[32])
    assert len(text) == (train.numel() - 1) // 8 and len(text.head(5)) == 5


def test_missing_text_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"apt-get install fortunes") as raised:
        open_text("fortunes", tmp_path / "nowhere", train=True, context=CONTEXT)
    assert "\n" not in str(raised.value)
    images = dataclasses.replace(workload_of("gpt"), data="fashion-mnist")
    with pytest.raises(WorkloadError, match="'fashion-mnist' does not give"):
        check_workload_data(images, str(tmp_path / "nowhere"))


def test_an_experiment_of_the_gpt_trains_on_its_own_text_or_says_what_to_install(tmp_path: Path) -> None:
    from tasks.config import NO_DATA, ExperimentConfig, found_dataset, no_data_reason

    assert found_dataset(str(fake_fortunes(tmp_path / "text")), "gpt") == ("fortunes", str(tmp_path / "text"))
    assert found_dataset(str(tmp_path / "empty"), "gpt")[0] == NO_DATA
    assert "apt-get install fortunes" in no_data_reason("gpt")
    config = ExperimentConfig(model="gpt", data_dir=str(tmp_path / "empty"))
    assert config.dataset == NO_DATA and "apt-get install fortunes" in (config.training_skipped or "")


def test_naming_absent_text_is_exit_status_2_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["train", "--model", "gpt", "--plan", str(tmp_path / "plan.json"), "--dataset", "fortunes",
              "--data-dir", str(tmp_path / "nowhere")],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "apt-get install fortunes" in result.output and "Traceback" not in result.output


def test_one_device_training_on_the_fortunes_lowers_the_perplexity(fortunes: Path) -> None:
    """The workload's own optimiser and loss on its own text, in this process: a few AdamW steps lower the test
    perplexity from about the vocabulary's (a uniform guess) well below it."""
    workload = workload_of("gpt")
    train = open_workload_data(workload, None, train=True)
    test = open_workload_data(workload, None, train=False).head(8)
    model = build_workload_model(workload)
    optimizer = make_optimizer(list(model.parameters()), workload.optimizer)
    test_tokens, test_targets = test.get_batch(torch.arange(len(test)))

    def test_perplexity() -> float:
        with torch.no_grad():
            return perplexity(float(workload.loss_of(model(test_tokens), test_targets, len(test))))

    before = test_perplexity()
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        tokens, targets = train.get_batch(torch.randint(0, len(train), (8,), generator=generator))
        optimizer.zero_grad()
        workload.loss_of(model(tokens), targets, 8).backward()
        optimizer.step()
    after = test_perplexity()
    assert before > 0.5 * VOCABULARY and after < 0.5 * before


def test_perplexity_is_the_exponential_of_the_mean_loss_per_token() -> None:
    assert perplexity(math.log(20.0)) == pytest.approx(20.0)
    assert math.isnan(perplexity(float("nan")))
    assert Workload("gpt", optimizer=OptimizerConfig(name="AdamW")).quality == "accuracy"  # drawn targets


def test_the_report_shows_a_language_models_perplexity_where_a_classifier_shows_accuracy(
    tracking_uri: str, experiment_name: str, tmp_path: Path
) -> None:
    from reports import schema
    from reports.paper import write_report
    from tapp_core.runtime.results import TrainResult
    from tasks.tracking import ExperimentTags, tracked_run
    from tasks.train import record_curve
    from tests.test_reports_tables import log_experiment

    parent = log_experiment(experiment_name, "gpt", {"single-cpu": 0.9, "bsp": 0.5})  # no Gantt chart to draw
    tags = ExperimentTags(model="gpt", cluster="local", batch_size=64, seed=0, dataset="fortunes", emulated=True)
    for method, losses in (("tapp", [3.6, 3.2, 3.0]), ("single-cpu", [3.7, 3.4])):
        result = TrainResult("p", "1f1b", "fortunes", False, len(losses), test_loss=losses[-1], test_samples=4096)
        result.epoch_losses, result.epoch_test_loss = [x + 0.1 for x in losses], losses
        result.epoch_times_s, result.epoch_test_accuracy = [4.0] * len(losses), [0.3] * len(losses)
        with tracked_run(f"train {method}", tags.child(parent, schema.TRAIN, method=method), parent=parent) as run:
            run.log_params({"plan_schedule": "1f1b", "train_budget_s": 12.0, "epochs": len(losses)})
            record_curve(run, result, 5, language_model=True)
    report = write_report(experiment_name, tmp_path)
    table = report.tables.perplexity
    assert table.frame.loc[0, "TAPP"] == pytest.approx(math.exp(3.0), rel=1e-4)
    markdown = table.to_markdown()
    assert markdown.startswith("**Test perplexity after 12 s of training per method**"), markdown
    assert "perplexity on the first 4,096 predicted tokens of its test text" in markdown
    assert "lower is better" in markdown
    assert report.tables.accuracy.frame.empty  # a language model has no row of accuracy
    figure = tmp_path / "perplexity_vs_time.png"
    assert figure in report.figure_files and not (tmp_path / "accuracy_vs_time.png").exists()


def test_the_experiments_result_names_the_trained_plans_perplexity() -> None:
    from tapp_core.measure.stats import proportion_interval
    from tasks import summary

    tested = proportion_interval(0.41, 4096)
    trained = summary.Accuracy("tapp", tested, 3200, perplexity=20.09)
    result = summary.Result("gpt on local", (), None, None, summary.Links("out"), accuracy=(trained,))
    said = " ".join(summary.sentences(result))
    assert "Test perplexity and next-token accuracy after 3,200 training sequences each" in said, said
    assert "over 4,096 predicted positions" in said and "tapp perplexity 20.09, accuracy 41.0 %" in said, said
    assert "tapp perplexity 20.09" in summary.markdown(result)
    assert summary.parent_metrics(result)["tapp_test_perplexity"] == pytest.approx(20.09)
    [record] = summary.result_record(result)["accuracy"]  # type: ignore[misc]
    assert record["test_perplexity"] == pytest.approx(20.09) and record["test_accuracy"] == pytest.approx(0.41)


def test_tapp_run_of_the_gpt_goes_end_to_end_on_the_cost_model(
    prefect_harness: None, tracking_uri: str, experiment_name: str, work_dir: Path
) -> None:
    """The front door on a small configuration: the workload named first, TAPP's search and every method's plan
    estimated, the report written; estimate-only trains nothing, and says so."""
    args = ["run", "--model", "gpt", "--batch-size", "8", "--estimate-only", "--rounds", "2", "--samples-per-round"]
    args += ["4", "--methods", "tapp,bsp,pipedream", "--experiment", experiment_name, "--tracking-uri", tracking_uri]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert "workload gpt: inputs int64[64] < 256 -> cross_entropy on next token, AdamW(" in done.output
    assert "not trained: estimate-only" in done.output and "Report:" in done.output


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_megatron_attention_and_mlp_splits_of_the_gpt_train_like_one_device(pool2: WorkerPool) -> None:
    """One stage on 2 ranks, every block's q, k, v (col) and projection (row) split by heads and its MLP (fc1 col,
    fc2 row): the parameters and per-step losses of 3 steps match one device's (its own next-token batches)."""
    from tapp_core.plan.plan import Plan
    from tapp_core.runtime.batches import SyntheticBatches
    from tapp_core.runtime.optim import micro_batch_loss
    from tapp_core.runtime.stage import ModelGraph
    from tests.test_runtime_correctness import BATCH, MICRO_BATCHES, OPTIMIZER, SEED, STEPS
    from tests.test_runtime_sbp import MEGATRON_BLOCK, run_and_compare

    workload = workload_of("gpt")
    net = build_workload_model(workload, seed=SEED)
    optimizer = make_optimizer(list(net.parameters()), OPTIMIZER)
    batches, size, losses = SyntheticBatches(BATCH, seed=SEED, workload=workload), BATCH // MICRO_BATCHES, []
    for step in range(STEPS):
        x, y = batches.get(step)
        total = 0.0
        for j in range(MICRO_BATCHES):
            part = slice(j * size, (j + 1) * size)
            loss = micro_batch_loss(net(x[part]), y[part], BATCH, workload)
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    want = {name: p.detach().clone() for name, p in net.named_parameters()}
    specs = ModelGraph.of(build_traced_workload(workload), workload.feed).specs
    split = {spec.index: spec.name.split("_", 2)[2] for spec in specs if spec.name.startswith("blocks_")}
    signatures = {index: MEGATRON_BLOCK[name] for index, name in split.items() if name in MEGATRON_BLOCK}
    assert len(signatures) == 24  # 4 blocks of 6 split layers
    n_layers = len(layer_nodes(build_traced_workload(workload)))
    plan = Plan("gpt", BATCH, MICRO_BATCHES, "gpipe", (0,) * n_layers, (("d0", "d1"),),
                signatures=tuple(signatures.items()))  # fmt: skip
    run_and_compare(pool2, plan, want, losses)
