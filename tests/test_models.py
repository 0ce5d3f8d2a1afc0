"""The CIFAR-10 models and the registry: tracing, shapes, architecture, seeding, user models and error messages."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from tapp_core.model.graph import layer_index, layer_nodes
from tapp_core.model.workload import build_traced_workload, build_workload_model, workload_of
from tapp_core.model.zoo import (
    INPUT_SHAPE,
    MODEL_NAMES,
    InceptionV3,
    ModelError,
    build_model,
    build_traced_model,
)
from tapp_core.model.zoo.inception import InceptionA, InceptionB, InceptionC, InceptionD, InceptionE
from tapp_core.model.zoo.vit import Block, ViT

SMALL_MODELS = ("mlp", "tiny_cnn", "tiny_branchy", "tiny_vit")
# Listed in the README; a change here is a change of architecture.
PARAMETER_COUNTS = {"alexnet": 23_272_266, "vgg16": 15_253_578, "inception_v3": 21_806_058, "vit": 6_350_602}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _modules_of(model: nn.Module, kind: type[nn.Module]) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, kind)]


def _unique_module_name() -> str:
    return f"tapp_test_user_model_{uuid.uuid4().hex[:10]}"


IMAGE_MODELS = tuple(name for name in MODEL_NAMES if name != "gpt")
"""The CIFAR-10 classifiers; the GPT, a language model, is tested in ``test_gpt.py``."""


def test_registry_lists_the_models_of_the_paper_and_the_small_ones() -> None:
    assert set(MODEL_NAMES) == {"alexnet", "vgg16", "inception_v3", "vit", "gpt", *SMALL_MODELS}
    assert INPUT_SHAPE == (3, 32, 32)


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_model_traces_and_the_traced_graph_computes_what_the_model_does(name: str) -> None:
    model = build_model(name).eval()
    traced = build_traced_model(name).eval()
    x = torch.randn(2, *INPUT_SHAPE)
    with torch.no_grad():
        expected = model(x)
        got = traced(x)
    assert got.shape == (2, 10)
    assert torch.equal(got, expected)  # same seed, same weights, same graph
    assert len(layer_nodes(traced)) >= 6


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_counts_are_those_in_the_readme(name: str) -> None:
    model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]


def test_alexnet_has_five_convolutions_three_linear_layers_and_dropout() -> None:
    model = build_model("alexnet")
    assert len(_modules_of(model, nn.Conv2d)) == 5
    assert len(_modules_of(model, nn.Linear)) == 3
    assert len(_modules_of(model, nn.MaxPool2d)) == 3
    assert len(_modules_of(model, nn.Dropout)) == 2


def test_vgg16_is_configuration_d_with_batchnorm() -> None:
    model = build_model("vgg16")
    convolutions = _modules_of(model, nn.Conv2d)
    assert [conv.out_channels for conv in convolutions] == [64, 64, 128, 128, 256, 256, 256] + [512] * 6
    assert all(conv.kernel_size == (3, 3) for conv in convolutions)
    assert len(_modules_of(model, nn.BatchNorm2d)) == 13
    assert len(_modules_of(model, nn.Linear)) == 3
    assert len(_modules_of(model, nn.MaxPool2d)) == 5


def test_inception_v3_has_the_block_sequence_and_no_auxiliary_head() -> None:
    model = build_model("inception_v3")
    assert isinstance(model, InceptionV3)
    blocks = [type(module) for module in model.children() if type(module).__name__.startswith("Inception")]
    assert blocks == [InceptionA] * 3 + [InceptionB] + [InceptionC] * 4 + [InceptionD] + [InceptionE] * 2
    assert not any("aux" in name.lower() for name, _ in model.named_modules())
    assert model.Conv2d_1a_3x3.conv.stride == (1, 1)
    assert len(_modules_of(model, nn.Dropout)) == 1


def test_inception_v3_graph_fans_out_and_joins_with_cat() -> None:
    traced = build_traced_model("inception_v3")
    cats = [node for node in layer_nodes(traced) if node.target is torch.cat]
    # 11 blocks join their branches, and each InceptionE also joins two pairs inside a branch.
    assert len(cats) == 11 + 2 * 2
    assert max(len(node.args[0]) for node in cats) == 4
    assert sum(1 for node in layer_nodes(traced) if len(node.users) >= 3) >= 11


@pytest.mark.parametrize("name", ["vit", "tiny_vit"])
def test_vit_is_written_as_such_models_usually_are(name: str) -> None:
    """Its own parameters read through get_attr, shapes read from the input, one Linear per projection, heads split
    with view + transpose, pre-norm blocks, no dropout: what the runtime and the integrator's split signatures
    must take as it is."""
    model = build_model(name)
    assert isinstance(model, ViT)
    traced = build_traced_model(name)
    attributes = {str(node.target) for node in traced.graph.nodes if node.op == "get_attr"}
    assert attributes == {"cls_token", "pos_embed"}
    assert isinstance(model.cls_token, nn.Parameter) and isinstance(model.pos_embed, nn.Parameter)
    assert model.pos_embed.shape == (1, (32 // 4) ** 2 + 1, model.cls_token.shape[-1])
    shape_reads = [node for node in traced.graph.nodes if node.target is getattr and node.args[1] == "shape"]
    # read from the input (the class token's batch) and from each tensor whose heads are split (q, k, v) or merged
    assert len(shape_reads) == 1 + 4 * len(model.blocks), "shapes must be read from the tensors they shape"
    for block in model.blocks:
        assert isinstance(block, Block)
        assert all(isinstance(getattr(block.attn, p), nn.Linear) for p in ("q", "k", "v", "proj"))
        assert [type(m) for m in block.mlp.children()] == [nn.Linear, nn.GELU, nn.Linear]
        assert isinstance(block.norm1, nn.LayerNorm) and isinstance(block.norm2, nn.LayerNorm)
    methods = {str(node.target) for node in traced.graph.nodes if node.op == "call_method"}
    assert {"view", "transpose", "softmax", "reshape"} <= methods
    assert not _modules_of(model, nn.Dropout)


def test_vit_has_the_size_of_a_small_cifar_transformer() -> None:
    model = build_model("vit")
    assert 5_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert len(model.blocks) == 8 and model.blocks[0].attn.heads == 8


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_small_models_have_no_dropout_or_batchnorm(name: str) -> None:
    model = build_model(name)
    assert not _modules_of(model, nn.Dropout)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_tiny_branchy_has_parallel_branches_and_a_skip_over_several_layers() -> None:
    traced = build_traced_model("tiny_branchy")
    index = layer_index(traced)
    cats = [node for node in index if node.target is torch.cat]
    assert len(cats) == 1 and len(cats[0].args[0]) == 2
    longest_edge = max(index[user] - index[node] for node in index for user in node.users if user in index)
    assert longest_edge >= 5, "the skip tensor must cross several layers, so a cut can fall in between"


def test_num_classes_sets_the_output_width() -> None:
    for name in ("alexnet", "tiny_branchy"):
        assert build_model(name, num_classes=100)(torch.randn(1, *INPUT_SHAPE)).shape == (1, 100)
    with pytest.raises(ModelError, match="num_classes must be a positive integer"):
        build_model("mlp", num_classes=0)


def test_same_seed_gives_identical_weights_and_another_seed_does_not() -> None:
    first, second = build_model("tiny_cnn", seed=7), build_model("tiny_cnn", seed=7)
    other = build_model("tiny_cnn", seed=8)
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key])
    assert not torch.equal(first.conv1.weight, other.conv1.weight)


def test_seed_none_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(123)
    first = build_model("mlp", seed=None)
    torch.manual_seed(123)
    second = build_model("mlp", seed=None)
    third = build_model("mlp", seed=None)
    assert torch.equal(first.fc1.weight, second.fc1.weight)
    assert not torch.equal(second.fc1.weight, third.fc1.weight)


USER_MODEL_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))

    def not_a_model():
        return 42

    def broken():
        raise RuntimeError("weights file gone")

    NOT_CALLABLE = 3

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3 * 32 * 32, 10)

        def forward(self, x):
            if x.sum() > 0:
                return self.linear(x.flatten(1))
            return -self.linear(x.flatten(1))
    """
)


@pytest.fixture
def user_model_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(USER_MODEL_SOURCE)
    return path


def test_user_model_from_a_file_path_is_built_seeded_and_traced(user_model_file: Path) -> None:
    model = build_model(f"{user_model_file}:build", seed=3)
    again = build_model(f"{user_model_file}:build", seed=3)
    assert isinstance(model, nn.Sequential)
    assert torch.equal(model[1].weight, again[1].weight)
    traced = build_traced_model(f"{user_model_file}:build")
    assert traced(torch.randn(2, *INPUT_SHAPE)).shape == (2, 10)


def test_user_model_from_a_relative_file_path(user_model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_model_file.parent.parent)
    relative = f"{user_model_file.parent.name}/{user_model_file.name}:build"
    assert isinstance(build_model(relative), nn.Sequential)


def test_user_model_from_module_and_callable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module_name = _unique_module_name()
    (tmp_path / f"{module_name}.py").write_text(USER_MODEL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model(f"{module_name}:build")
    assert isinstance(model, nn.Sequential)
    monkeypatch.delitem(sys.modules, module_name)


def test_module_in_the_current_directory_is_found_without_leaving_it_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module_name = _unique_module_name()
    (tmp_path / f"{module_name}.py").write_text(USER_MODEL_SOURCE)
    monkeypatch.chdir(tmp_path)
    assert isinstance(build_model(f"{module_name}:build"), nn.Sequential)
    assert str(tmp_path) not in sys.path
    monkeypatch.delitem(sys.modules, module_name)


def test_unknown_model_name_lists_the_known_names() -> None:
    with pytest.raises(ModelError) as caught:
        build_model("resnet50")
    message = str(caught.value)
    assert "unknown model 'resnet50'" in message
    assert all(name in message for name in MODEL_NAMES)
    assert "module:callable" in message


@pytest.mark.parametrize("spec", ["", "   ", ":build", "tiny_cnn:"])
def test_empty_or_half_specs_are_rejected(spec: str) -> None:
    with pytest.raises(ModelError, match="model spec"):
        build_model(spec)


def test_missing_model_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    with pytest.raises(ModelError, match=r"model file .*nowhere\.py.* does not exist"):
        build_model(f"{missing}:build")


def test_missing_module_is_named() -> None:
    with pytest.raises(ModelError, match=r"cannot import module 'no_such_pkg_tapp\.models'.*No module named"):
        build_model("no_such_pkg_tapp.models:build")


def test_model_file_that_fails_to_import_says_why(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("import torch\nraise ImportError('needs timm')\n")
    with pytest.raises(ModelError, match=r"importing model file .*bad\.py.* failed: ImportError: needs timm"):
        build_model(f"{path}:build")


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        ("missing", r"has no attribute 'missing'"),
        ("NOT_CALLABLE", r"'NOT_CALLABLE' in .* is a int, not callable"),
        ("not_a_model", r"returned int, not a torch\.nn\.Module"),
        ("broken", r"building model .* failed: RuntimeError: weights file gone"),
    ],
)
def test_bad_callable_is_named(user_model_file: Path, attribute: str, expected: str) -> None:
    with pytest.raises(ModelError, match=expected):
        build_model(f"{user_model_file}:{attribute}")


def test_data_dependent_model_fails_to_trace_with_the_reason(user_model_file: Path) -> None:
    spec = f"{user_model_file}:DataDependent"
    assert isinstance(build_model(spec), nn.Module)  # it builds; only tracing fails
    with pytest.raises(ModelError) as caught:
        build_traced_model(spec)
    message = str(caught.value)
    assert "cannot be traced by torch.fx" in message
    assert "control flow" in message
    assert spec in message


BRANCHING = '''
import torch
from torch import nn


class BranchesOnItsInput(nn.Module):
    """Written as model zoos write: Python that branches on what it was given, which torch.fx cannot trace."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 32 * 32, 10)

    def forward(self, images, labels=None):
        if images.dim() == 4:
            images = images.flatten(1)
        return self.head(images)


class DependsOnValues(BranchesOnItsInput):
    def forward(self, images, labels=None):
        return self.head(images.flatten(1)) if images.sum() > 0 else self.head(-images.flatten(1))
'''


def test_a_model_torch_fx_cannot_trace_is_exported_and_one_that_cannot_be_either_says_both(tmp_path: Path) -> None:
    path = tmp_path / "branching.py"
    path.write_text(BRANCHING)
    workload = workload_of(f"{path}:BranchesOnItsInput")
    with pytest.raises(ModelError, match=r"cannot be traced by torch\.fx"):
        build_traced_model(workload.model)
    traced = build_traced_workload(workload, seed=0)
    model = build_workload_model(workload, seed=0)
    images = workload.example(5)
    assert torch.allclose(traced(images), model(images))
    assert {name for name, _ in traced.named_parameters()} == {"head.weight", "head.bias"}
    with pytest.raises(ModelError, match=r"cannot be traced by torch\.fx, .*; nor by torch\.export: "):
        build_traced_workload(workload_of(f"{path}:DependsOnValues"), seed=0)


class _DeadAndInPlace(nn.Module):
    """A layer whose value nothing uses, an in-place update whose result nothing uses, and a weight never read."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.probe = nn.Linear(4, 2)
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.probe(y)  # computed and dropped
        y.add_(1.0)  # changes y: its unused result must not take the change with it
        return y * 2


@pytest.mark.parametrize("exported", [False, True], ids=["fx", "export"])
def test_tracing_drops_what_nothing_uses_and_keeps_what_changes_a_value(exported: bool) -> None:
    from tapp_core.model.graph import _traced_by_export, drop_dead_nodes

    model = _DeadAndInPlace()
    x = torch.randn(3, 4)
    traced = _traced_by_export(model, x, "dead", RuntimeError()) if exported else torch.fx.symbolic_trace(model)
    drop_dead_nodes(traced)
    assert torch.equal(traced(x), model(x))
    assert not any(name.startswith(("probe", "never")) for name in traced.state_dict())
