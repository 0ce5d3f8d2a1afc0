"""A model zoo's model through the front door: Hugging Face's GPT-2 (``examples/hf_gpt2.py``), which torch.fx
cannot trace, is exported, profiled, planned, measured and trained on ``local`` (real ``mpiexec``). Runs where the
zoo extra is installed (``pip install -e '.[zoo]'``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the zoo extra is not installed (pip install -e '.[zoo]')")

from safetensors.torch import load_file

from tapp_core.model.graph import ModelError, trace_model
from tapp_core.model.workload import build_traced_workload, build_workload_model, workload_of
from tapp_core.model.zoo import build_model
from tapp_core.plan.plan import Plan
from tests.test_examples import EXAMPLES, tapp

GPT2 = f"{EXAMPLES / 'hf_gpt2.py'}:build"


def test_torch_fx_cannot_trace_it_and_the_export_keeps_its_names_and_outputs() -> None:
    workload = workload_of(GPT2)
    model = build_workload_model(workload, seed=0)
    with pytest.raises(ModelError, match=r"cannot be traced by torch\.fx"):
        trace_model(model)
    traced = build_traced_workload(workload, seed=0)
    names = {name for name, _ in traced.named_parameters()}
    assert "transformer.h.0.attn.c_attn.weight" in names  # the model's own: it returns a dict, and its
    # workload names the output it trains on ("output": "logits"), without a wrapper to prefix the names
    ids = workload.example(3)  # another batch size than the export's
    assert torch.allclose(traced(ids), model(ids), atol=1e-5)
    assert torch.allclose(traced(ids), type(model).__mro__[1].forward(model, ids).logits, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_gpt2_profiles_plans_measures_and_trains(work_dir: Path) -> None:
    output = tapp("profile", "--model", GPT2, "--batch-size", "8", "--repeats", "1", "--threads", "1", "--out", "lib")
    assert output.startswith(f"workload {GPT2}: inputs int64[64] < 256"), output
    # Pipe-Torch searches its cuts (the even split may cut where a flattened (batch x position) tensor crosses)
    tapp("plan", "--model", GPT2, "--batch-size", "8", "--library", "lib", "--planner", "pipetorch",
         "--out", "hf_gpt2.json")  # fmt: skip
    assert Plan.load(work_dir / "hf_gpt2.json").n_stages >= 2
    output = tapp("measure", "--model", GPT2, "--plan", "hf_gpt2.json", "--steps", "3", "--warmup", "1",
                  "--min-rounds", "1", "--max-rounds", "1")  # fmt: skip
    measured = json.loads(output[output.index("{") :])
    assert measured["error"] is None and measured["step_time_s"] > 0
    output = tapp("train", "--model", GPT2, "--plan", "hf_gpt2.json", "--epochs", "2", "--steps-per-epoch", "12",
                  "--checkpoint-dir", "checkpoints", "--checkpoint-every", "12")  # fmt: skip
    losses = [float(line.split("train loss ")[1].split(",")[0]) for line in output.splitlines() if "train loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0], output
    weights = load_file(work_dir / "checkpoints" / "model.safetensors")
    fresh = build_model(GPT2)  # GPT2LMHeadModel as transformers builds it
    missing, unexpected = fresh.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"}, missing  # the head is tied to the embedding
    assert all(name.startswith("_tensor_constant") for name in unexpected), unexpected  # the export's constants
    assert torch.equal(fresh.transformer.wte.weight, weights["transformer.wte.weight"])
