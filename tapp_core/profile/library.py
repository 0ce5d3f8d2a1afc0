"""The layer library (TAPP section 3 step 1): one row per layer of the traced model.

A *layer* is one compute node of the model's torch.fx graph (a leaf module, a function or a method call),
numbered in topological order from 0. Times are measured at the library's batch size on one device kind and
scale to other batch sizes and devices in the cost model. Sizes are per *sample* so that any micro-batch size
can be costed: multiply by the number of samples.

A layer's time is affine in the samples it processes: a fixed part per call (reading a fully connected layer's
weights, dispatching an op) and a part per sample. On a CPU the fixed part dominates small micro-batches (AlexNet
at micro-batch 2 costs about 9x per sample what it costs at 64), so costing micro-batches by scaling the batch's
time linearly makes deep pipelines look far cheaper than they run. The profiler fits both parts from two batch
sizes; a library without the fit has fixed parts of 0, which is the linear model.

A library is timed on one *device kind* (``tapp_core.platform.kinds``: a CPU with its threads, a GPU with its model). A
cluster of several kinds is costed from one library per kind: ``LayerLibrary.with_kinds`` attaches the others to
one library (the *reference*: its layers, sizes and edges are every kind's, its times are its own kind's), so
that whatever takes a library (the cost model, every planner) takes them all. ``save_libraries`` and
``load_libraries`` write and read such a set as one folder per kind.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, SupportsFloat, SupportsInt

from tapp_core.errors import TappError
from tapp_core.model.crossing import SAMPLE_FREE_REFUSALS
from tapp_core.model.graph import MODEL_INPUT, LayerSpec, SharedParameter
from tapp_core.platform.kinds import DeviceKind

if TYPE_CHECKING:
    import pandas as pd

LAYERS_FILE = "layers.csv"
META_FILE = "library.json"
KINDS_FILE = "kinds.json"
PROFILE_VERSION = 3
"""The profiler's version, recorded in every library it writes (``extra["profile_version"]``): bumped when a
library's contents change meaning (2: fixed per-call parts fitted; 3: the GPU model and the host recorded, which
decide which devices a library is the library of); caches and calibrations key on it."""
"""In a folder of libraries, one per kind: the subfolders, the reference kind's first."""


_SPECS: dict[int, tuple[tuple[Layer, ...], tuple[LayerSpec, ...]]] = {}
_READ_BY_BACKWARD: dict[int, tuple[tuple[Layer, ...], tuple[bool, ...]]] = {}


class LibraryError(TappError):
    """A layer library that cannot be read or does not fit what it is used with."""


@dataclass(frozen=True)
class Layer:
    index: int
    name: str
    op: str
    """Operation type: the leaf module's class name (Conv2d, ReLU...) or the function's name (add, cat, flatten)."""
    successors: tuple[int, ...]
    predecessors: tuple[int, ...]
    flops: float
    """Forward FLOPs per sample (multiply-add = 2 FLOPs)."""
    param_bytes: int
    """Bytes of the parameters it uses (each charged to its first user)."""
    activation_bytes: int
    """Bytes of this layer's output per sample: what crosses a cut after this layer."""
    output_shape: tuple[int, ...]
    """Output shape at the library's batch size."""
    forward_s: float
    backward_s: float
    """Median forward / backward time at the library's batch size on the library's device, seconds."""
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    """The part of ``forward_s`` / ``backward_s`` that one call costs whatever its number of samples."""
    axes: tuple[int, ...] = ()
    """The dimensions the operation acts along, where the layout pass needs them (``graph.LayerSpec.axes``)."""
    cut_refusal: str = ""
    """Why this layer's output cannot cross a cut, "" where it can (``tapp_core.model.crossing``)."""
    sample_free: bool = False
    """Whether no sample's data reaches its output (``crossing.CutFacts.sample_free``): every device of a stage
    holds it whole (``LayerSpec.sample_free``)."""
    frozen_bytes: int = 0
    """Of ``param_bytes``, the frozen parameters' (``requires_grad`` False): held, but given no gradient, optimiser
    state, stash or reduction."""
    output_saved: bool | None = None
    """Whether autograd keeps its output for the backward (``tapp_core.profile.saved``); None: not measured (a
    library profiled before), read as ``LayerLibrary.read_by_backward`` says."""
    saved_bytes: int = 0
    """Bytes per sample that autograd keeps of what its forward made besides its output (a dropout's mask, a max
    pool's indices, a layer norm's statistics; ``tapp_core.profile.saved``)."""

    @property
    def trained_bytes(self) -> int:
        """Of ``param_bytes``, the parameters' that train."""
        return self.param_bytes - self.frozen_bytes

    @property
    def outputs_tensor(self) -> bool:
        """Whether the output holds a tensor (a 0-dimensional one has bytes). A layer that reads a shape (``x.shape``,
        ``x.size(0)``, arithmetic on those) outputs numbers: nothing of it crosses a cut, the consuming stage
        rebuilds it from its own micro-batch (``tapp_core.runtime.stage``)."""
        return bool(self.output_shape) or self.activation_bytes > 0


@dataclass
class LayerLibrary:
    model: str
    batch_size: int
    device: str
    """Device kind the times were measured on: 'cpu' or 'cuda'."""
    threads: int
    layers: list[Layer]
    input_bytes: int
    """Bytes of one input sample (what the first stage reads from the data source)."""
    whole_model_s: float
    """Measured forward + backward (+ loss) time of the whole model at ``batch_size``, seconds."""
    torch_version: str = ""
    date: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    gpu_model: str = ""
    """The GPU's model name when ``device`` is cuda."""
    host: str = ""
    """The machine it was profiled on (empty: not recorded)."""
    shared: tuple[SharedParameter, ...] = ()
    """The parameters several layers use (``graph.shared_parameters``): a plan that puts their users on several
    stages holds a copy on each (``tapp_core.plan.ties``)."""
    kinds: dict[str, LayerLibrary] = field(default_factory=dict, repr=False, compare=False)
    """Libraries of the same model, batch size and layers timed on other kinds, by kind name (``with_kinds``)."""

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def kind(self) -> DeviceKind:
        """The kind the times were measured on."""
        return DeviceKind(self.device, self.threads, self.gpu_model)

    @property
    def kind_libraries(self) -> dict[str, LayerLibrary]:
        """Every kind's library by kind name, this one's first (as itself, with its ``kinds``)."""
        return {self.kind.name: self, **{name: lib for name, lib in self.kinds.items() if name != self.kind.name}}

    def with_kinds(self, others: Iterable[LayerLibrary]) -> LayerLibrary:
        """This library (the reference) carrying ``others``, timed on other kinds; a library of a kind already
        given replaces it. They must be of this model and batch size with the same layers, sizes and edges."""
        kinds = {name: lib for name, lib in self.kinds.items()}
        for other in others:
            other = dataclasses.replace(other, kinds={})
            _check_same_layers(self, other)
            if other.kind.name != self.kind.name:
                kinds[other.kind.name] = other
        return dataclasses.replace(self, kinds=kinds)

    @property
    def layer_time_sum_s(self) -> float:
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def edges(self) -> list[tuple[int, int]]:
        return [(layer.index, succ) for layer in self.layers for succ in layer.successors]

    def tensor_edges(self) -> list[tuple[int, int]]:
        """The edges whose value is a tensor: those a cut value crosses when their ends are on two stages
        (``tapp_core.plan.program``); the runtime finds the same by running the model (``ModelGraph``)."""
        return [(layer.index, succ) for layer in self.layers if layer.outputs_tensor for succ in layer.successors]

    def specs(self) -> tuple[LayerSpec, ...]:
        """The layers as the layout pass of ``tapp_core.plan.placement`` reads them (cached while the layers stay)."""
        snapshot = tuple(self.layers)
        cached = _SPECS.get(id(self.layers))
        if cached is None or cached[0] != snapshot:
            specs = tuple(
                LayerSpec(
                    index=x.index,
                    name=x.name,
                    op=x.op,
                    inputs=x.predecessors or (MODEL_INPUT,),
                    shape=tuple(x.output_shape[1:]),
                    has_params=x.param_bytes > 0,
                    axes=x.axes,
                    sample_free=x.sample_free,
                )
                for x in snapshot
            )
            if len(_SPECS) > 16:
                _SPECS.clear()
            cached = _SPECS[id(self.layers)] = (snapshot, specs)
        return cached[1]

    def read_by_backward(self) -> tuple[bool, ...]:
        """Per layer, whether the backward pass reads its output: where its output needs a gradient (it has
        parameters that train, or the profile timed a backward of it, or a layer it reads needs one), or a layer
        reading it does (and keeps it for its weights' gradient). A frozen prefix (a fine-tuned model's backbone
        before its first trained layer) builds no autograd graph: its outputs are freed once used, and its
        backward, which the profile times at 0, never runs."""
        snapshot = tuple(self.layers)
        cached = _READ_BY_BACKWARD.get(id(self.layers))
        if cached is None or cached[0] != snapshot:
            needs = [False] * len(snapshot)
            for x in snapshot:  # in graph order: a layer's predecessors come before it
                timed = x.backward_s > 0 or x.backward_fixed_s > 0
                needs[x.index] = x.trained_bytes > 0 or timed or any(needs[p] for p in x.predecessors)
            reads = tuple(needs[x.index] or any(needs[s] for s in x.successors) for x in snapshot)
            if len(_READ_BY_BACKWARD) > 16:
                _READ_BY_BACKWARD.clear()
            cached = _READ_BY_BACKWARD[id(self.layers)] = (snapshot, reads)
        return cached[1]

    def to_frame(self) -> pd.DataFrame:
        import pandas as pd  # here: a rank, which never reads or writes a library file, starts without it

        rows = []
        for layer in self.layers:
            row = asdict(layer)
            row["successors"] = " ".join(map(str, layer.successors))
            row["predecessors"] = " ".join(map(str, layer.predecessors))
            row["output_shape"] = "x".join(map(str, layer.output_shape))
            row["axes"] = " ".join(map(str, layer.axes))
            rows.append(row)
        return pd.DataFrame(rows, columns=[f for f in Layer.__dataclass_fields__])

    def metadata(self) -> dict[str, object]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "device": self.device,
            "threads": self.threads,
            "input_bytes": self.input_bytes,
            "whole_model_s": self.whole_model_s,
            "layer_time_sum_s": self.layer_time_sum_s,
            "layers": len(self.layers),
            "torch_version": self.torch_version,
            "date": self.date,
            "gpu_model": self.gpu_model,
            "host": self.host,
            "shared_parameters": [
                {"name": p.name, "layers": list(p.layers), "nbytes": p.nbytes, "trained": p.trained}
                for p in self.shared
            ],
            "extra": self.extra,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``layers.csv`` and ``library.json`` into ``directory`` (this kind only: ``save_libraries`` writes
        every kind); returns the directory."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.to_frame().to_csv(out / LAYERS_FILE, index=False)
        (out / META_FILE).write_text(json.dumps(self.metadata(), indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> LayerLibrary:
        """Read a library that ``save`` wrote; a missing or malformed file raises ``LibraryError`` naming it."""
        src = Path(directory)
        for name in (LAYERS_FILE, META_FILE):
            if not (src / name).is_file():
                raise LibraryError(f"layer library {src} has no {name} (run `tapp profile` to make one)")
        try:
            import pandas as pd

            meta = json.loads((src / META_FILE).read_text())
            frame = pd.read_csv(src / LAYERS_FILE, keep_default_na=False)
            layers = [_layer_from_row(row) for row in frame.to_dict("records")]
            return cls(
                model=str(meta["model"]),
                batch_size=int(meta["batch_size"]),
                device=str(meta["device"]),
                threads=int(meta["threads"]),
                layers=layers,
                input_bytes=int(meta["input_bytes"]),
                whole_model_s=float(meta["whole_model_s"]),
                torch_version=str(meta.get("torch_version", "")),
                date=str(meta.get("date", "")),
                extra=dict(meta.get("extra", {})),
                gpu_model=str(meta.get("gpu_model", "")),
                host=str(meta.get("host", "")),
                shared=tuple(
                    SharedParameter(
                        str(p["name"]),
                        tuple(int(i) for i in p["layers"]),
                        int(p["nbytes"]),
                        bool(p.get("trained", True)),
                    )
                    for p in meta.get("shared_parameters", [])
                ),
            )
        except KeyError as exc:
            raise LibraryError(f"layer library {src} is corrupt: no {exc} field") from None
        except (ValueError, TypeError, AttributeError, SyntaxError) as exc:
            raise LibraryError(f"layer library {src} is corrupt: {exc}") from None


def _check_same_layers(reference: LayerLibrary, other: LayerLibrary) -> None:
    """``other`` can stand for ``reference`` on another kind: same model, batch size, layers, sizes and edges."""
    where = f"the {other.kind.name} library of {other.model} does not match the {reference.kind.name} one"
    if (other.model, other.batch_size) != (reference.model, reference.batch_size):
        raise LibraryError(
            f"{where}: model {other.model!r} at batch {other.batch_size}, "
            f"not {reference.model!r} at batch {reference.batch_size}"
        )
    if len(other.layers) != len(reference.layers):
        raise LibraryError(f"{where}: {len(other.layers)} layers, not {len(reference.layers)}")
    for mine, theirs in zip(reference.layers, other.layers, strict=True):
        shape = (mine.name, mine.successors, mine.param_bytes, mine.activation_bytes)
        if shape != (theirs.name, theirs.successors, theirs.param_bytes, theirs.activation_bytes):
            raise LibraryError(f"{where}: layer {mine.index} ({mine.name}) differs")


def save_libraries(library: LayerLibrary, directory: str | Path) -> Path:
    """Write every kind of ``library``: one library folder per kind (named by its label), the reference first in
    ``kinds.json``. A library of one kind is written as a plain library folder."""
    out = Path(directory)
    if not library.kinds:
        return library.save(out)
    out.mkdir(parents=True, exist_ok=True)
    folders = []
    for lib in library.kind_libraries.values():
        folders.append(lib.kind.label)
        lib.save(out / lib.kind.label)
    (out / KINDS_FILE).write_text(json.dumps({"kinds": folders}, indent=2) + "\n")
    return out


def load_libraries(directory: str | Path) -> LayerLibrary:
    """A library folder (``LayerLibrary.load``) or a folder of one library per kind (``save_libraries``)."""
    src = Path(directory)
    if not (src / KINDS_FILE).is_file():
        return LayerLibrary.load(src)
    try:
        folders = json.loads((src / KINDS_FILE).read_text())["kinds"]
        if not isinstance(folders, list) or not folders or not all(isinstance(f, str) for f in folders):
            raise ValueError("'kinds' must be a non-empty list of folder names")
    except (ValueError, KeyError, TypeError) as exc:
        raise LibraryError(f"layer libraries {src} have a corrupt {KINDS_FILE}: {exc}") from None
    reference, *others = (LayerLibrary.load(src / folder) for folder in folders)
    return reference.with_kinds(others)


def _ints(text: object, sep: str) -> tuple[int, ...]:
    text = str(text).strip()
    return tuple(int(part) for part in text.split(sep)) if text else ()


def _int(value: object) -> int:
    if isinstance(value, str | SupportsInt):
        return int(value)
    raise ValueError(f"{value!r} is not an integer")


def _float(value: object) -> float:
    if isinstance(value, str | SupportsFloat):
        return float(value)
    raise ValueError(f"{value!r} is not a number")


def _layer_from_row(row: Mapping[Hashable, object]) -> Layer:
    return Layer(
        index=_int(row["index"]),
        name=str(row["name"]),
        op=str(row["op"]),
        successors=_ints(row["successors"], " "),
        predecessors=_ints(row["predecessors"], " "),
        flops=_float(row["flops"]),
        param_bytes=_int(row["param_bytes"]),
        activation_bytes=_int(row["activation_bytes"]),
        output_shape=_ints(row["output_shape"], "x"),
        forward_s=_float(row["forward_s"]),
        backward_s=_float(row["backward_s"]),
        # Libraries written before the affine fit have no fixed parts: the linear model.
        forward_fixed_s=_float(row.get("forward_fixed_s") or 0.0),
        backward_fixed_s=_float(row.get("backward_fixed_s") or 0.0),
        # Libraries written before the layout pass read axes have none: their shape operations carry no split.
        axes=_ints(row.get("axes") or "", " "),
        # Libraries written before the cut facts were recorded refuse no cut: the runtime's own check still does.
        cut_refusal=str(row.get("cut_refusal") or ""),
        # Libraries written before frozen parameters were told apart train every parameter.
        frozen_bytes=_int(row.get("frozen_bytes") or 0),
        sample_free=_sample_free(row),
        # Libraries written before autograd's saved tensors were measured: None, the rule of what a backward reads.
        output_saved=_optional_bool(row.get("output_saved")),
        saved_bytes=_int(row.get("saved_bytes") or 0),
    )


def _missing(value: object) -> bool:
    """Whether a row has no value in that column (absent, or pandas' NaN)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _optional_bool(value: object) -> bool | None:
    if _missing(value) or value == "":
        return None
    return value is True or str(value).lower() == "true"


def _sample_free(row: Mapping[Hashable, object]) -> bool:
    """The row's ``sample_free``; a library written before that column tells it by its refusal."""
    given = row.get("sample_free")
    if _missing(given):
        return str(row.get("cut_refusal") or "") in SAMPLE_FREE_REFUSALS
    return _optional_bool(given) is True


__all__ = ["Layer", "LayerLibrary", "LibraryError", "load_libraries", "save_libraries"]
