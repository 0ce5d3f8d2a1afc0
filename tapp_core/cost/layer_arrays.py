"""A layer library's layers as numpy arrays, cached per library: the simulation and the split-layout timing
read them for every estimate, and a planner estimates thousands of plans of one library."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tapp_core.profile.library import Layer, LayerLibrary


@dataclass(frozen=True)
class LayerArrays:
    snapshot: tuple[Layer, ...]
    """The layers these arrays were read from."""
    forward_s: np.ndarray
    backward_s: np.ndarray
    forward_fixed_s: np.ndarray
    backward_fixed_s: np.ndarray
    trained_bytes: np.ndarray
    """The parameters that train (``Layer.trained_bytes``): what an update steps and a replicated stage sums."""
    activation_bytes: np.ndarray
    edges: np.ndarray
    """Shape (edges, 2): (producer, consumer) layer indices."""
    tensor_edges: np.ndarray
    """The edges whose value is a tensor (``LayerLibrary.tensor_edges``): what crosses cuts."""

    @property
    def edge_sources(self) -> np.ndarray:
        return self.edges[:, 0]

    @property
    def edge_targets(self) -> np.ndarray:
        return self.edges[:, 1]


_LAYER_ARRAYS_CACHE: dict[int, LayerArrays] = {}


_LAYER_ARRAYS_CACHE_SIZE = 8


def layer_arrays(library: LayerLibrary) -> LayerArrays:
    """The library's layers as arrays, cached: a planner estimates thousands of plans of one library."""
    snapshot = tuple(library.layers)
    cached = _LAYER_ARRAYS_CACHE.get(id(library.layers))
    # Comparing tuples of the same Layer objects is an identity check per element, so this is cheap and exact.
    if cached is not None and cached.snapshot == snapshot:
        return cached
    table = np.array(
        [
            (x.forward_s, x.backward_s, x.forward_fixed_s, x.backward_fixed_s, x.trained_bytes, x.activation_bytes)
            for x in snapshot
        ],
        dtype=float,
    ).reshape(-1, 6)
    edges = np.array([(x.index, succ) for x in snapshot for succ in x.successors], dtype=np.int64).reshape(-1, 2)
    tensors = np.array([x.outputs_tensor for x in snapshot], dtype=bool)
    forward_s, backward_s, forward_fixed_s, backward_fixed_s, trained_bytes, activation_bytes = table.T
    arrays = LayerArrays(
        snapshot,
        forward_s,
        backward_s,
        forward_fixed_s,
        backward_fixed_s,
        trained_bytes,
        activation_bytes,
        edges,
        edges[tensors[edges[:, 0]]],
    )
    if len(_LAYER_ARRAYS_CACHE) >= _LAYER_ARRAYS_CACHE_SIZE:
        del _LAYER_ARRAYS_CACHE[next(iter(_LAYER_ARRAYS_CACHE))]
    _LAYER_ARRAYS_CACHE[id(library.layers)] = arrays
    return arrays
