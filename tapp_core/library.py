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
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import SupportsFloat, SupportsInt

import pandas as pd

from tapp_core.errors import TappError

LAYERS_FILE = "layers.csv"
META_FILE = "library.json"


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

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def layer_time_sum_s(self) -> float:
        return sum(layer.forward_s + layer.backward_s for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def edges(self) -> list[tuple[int, int]]:
        return [(layer.index, succ) for layer in self.layers for succ in layer.successors]

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for layer in self.layers:
            row = asdict(layer)
            row["successors"] = " ".join(map(str, layer.successors))
            row["predecessors"] = " ".join(map(str, layer.predecessors))
            row["output_shape"] = "x".join(map(str, layer.output_shape))
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
            "extra": self.extra,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``layers.csv`` and ``library.json`` into ``directory``; returns the directory."""
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
            )
        except KeyError as exc:
            raise LibraryError(f"layer library {src} is corrupt: no {exc} field") from None
        except (ValueError, TypeError, AttributeError, SyntaxError) as exc:
            raise LibraryError(f"layer library {src} is corrupt: {exc}") from None


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
    )


__all__ = ["Layer", "LayerLibrary", "LibraryError"]
