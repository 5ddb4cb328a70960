"""Graph metadata: a no_alloc ggml context plus one cgraph, and numpy <-> ggml type helpers.

A ``Graph`` holds tensor *descriptions* only; the BackendSet's scheduler places and allocates
them when the graph is executed. Shapes passed in and returned here are numpy order
(slowest dimension first); ggml's ``ne`` is the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engine.ggml.native import ffi, lib

Tensor = Any  # a cffi ``struct ggml_tensor *``; graph code calls lib.ggml_* on it directly

_NUMPY_TO_GGML: dict[np.dtype[Any], int] = {
    np.dtype(np.float32): lib.GGML_TYPE_F32,
    np.dtype(np.float16): lib.GGML_TYPE_F16,
    np.dtype(np.int32): lib.GGML_TYPE_I32,
    np.dtype(np.int8): lib.GGML_TYPE_I8,
}


def ggml_type_of(dtype: np.dtype[Any] | type) -> int:
    """The ggml type that holds numpy ``dtype`` element for element."""
    dt = np.dtype(dtype)
    if dt not in _NUMPY_TO_GGML:
        raise TypeError(f"no ggml type for numpy dtype {dt}")
    return _NUMPY_TO_GGML[dt]


def numpy_dtype_of(ggml_type: int) -> np.dtype[Any]:
    """The numpy dtype whose items are one ggml element (uint16 for BF16; uint8 for blocks)."""
    for dt, gt in _NUMPY_TO_GGML.items():
        if gt == ggml_type:
            return dt
    if ggml_type == lib.GGML_TYPE_BF16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint8)


def shape_of(t: Tensor) -> tuple[int, ...]:
    """numpy-order shape of a tensor (trailing ggml dims of size 1 dropped, at least 1-D)."""
    n = lib.ggml_n_dims(t)
    return tuple(int(t.ne[i]) for i in reversed(range(n)))


def new_tensor(ctx: Any, ggml_type: int, shape: Sequence[int]) -> Tensor:
    """A tensor of numpy-order ``shape`` in ``ctx`` (ne reversed)."""
    if not 1 <= len(shape) <= lib.GGML_MAX_DIMS:
        raise ValueError(f"ggml tensors have 1..{lib.GGML_MAX_DIMS} dims, got shape {shape}")
    ne = ffi.new("int64_t[]", [int(d) for d in reversed(shape)])
    return lib.ggml_new_tensor(ctx, ggml_type, len(shape), ne)


def set_name(t: Tensor, name: str) -> Tensor:
    """Name a tensor (shows up in placement reports and op logs); returns it for chaining."""
    lib.ggml_set_name(t, name.encode()[: lib.GGML_MAX_NAME - 1])
    return t


def name_of(t: Tensor) -> str:
    """The tensor's name."""
    return str(ffi.string(lib.ggml_get_name(t)).decode())


def no_alloc_context(n_tensors: int, graph_nodes: int = 0, what: str = "tensor metadata"
                     ) -> Any:
    """A ggml context that holds tensor descriptions only (their data lives in backend buffers):
    room for ``n_tensors`` tensors and, with ``graph_nodes``, one graph of that many nodes."""
    params = ffi.new("struct ggml_init_params *")
    params.mem_size = lib.ggml_tensor_overhead() * n_tensors
    if graph_nodes:
        params.mem_size += lib.ggml_graph_overhead_custom(graph_nodes, False)
    params.mem_buffer = ffi.NULL
    params.no_alloc = True
    ctx = lib.ggml_init(params[0])
    if ctx == ffi.NULL:
        raise MemoryError(f"ggml_init failed for {what}")
    return ctx


class Graph:
    """One compute graph under construction: its metadata context, inputs and outputs."""

    def __init__(self, max_nodes: int = 8192) -> None:
        self.max_nodes = max_nodes
        self.ctx = no_alloc_context(max_nodes, max_nodes, "a graph context")
        self.gf = lib.ggml_new_graph_custom(self.ctx, max_nodes, False)
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.runs = 0  # executions so far (engine.backend.BackendSet.execute)
        # memory the nodes point to outside ggml (a custom op's arguments): lives as long as
        # the graph
        self.keep: list[Any] = []

    def input(self, name: str, shape: Sequence[int], dtype: type | np.dtype[Any] = np.float32,
              ggml_type: int | None = None) -> Tensor:
        """A named graph input of numpy-order ``shape``; its data is uploaded at execute.

        ``ggml_type``: a type no numpy dtype holds element for element (BF16 given as uint16
        bits, a quantised matrix given as its blocks' bytes), instead of ``dtype``'s."""
        gt = ggml_type_of(dtype) if ggml_type is None else ggml_type
        t = set_name(new_tensor(self.ctx, gt, shape), name)
        lib.ggml_set_input(t)
        self.inputs[name] = t
        return t

    def output(self, t: Tensor, name: str) -> Tensor:
        """Mark ``t`` as a named output (kept intact by the allocator) and add it to the graph."""
        set_name(t, name)
        lib.ggml_set_output(t)
        lib.ggml_build_forward_expand(self.gf, t)
        self.outputs[name] = t
        return t

    def expand(self, t: Tensor) -> None:
        """Add ``t`` and everything it depends on to the graph (for side-effect nodes)."""
        lib.ggml_build_forward_expand(self.gf, t)

    @property
    def n_nodes(self) -> int:
        """Number of compute nodes in the graph."""
        return int(lib.ggml_graph_n_nodes(self.gf))

    def nodes(self) -> list[Tensor]:
        """The graph's compute nodes in execution order."""
        return [lib.ggml_graph_node(self.gf, i) for i in range(self.n_nodes)]

    def unplace(self) -> None:
        """Forget where an allocator put this graph's own tensors (inputs, nodes and views of
        them; views of weights keep their data), so that the next allocation places them anew.
        ggml's allocator leaves a tensor that has data where it is: after a run, that is the
        compute buffer of that run, which a bigger graph run since may have freed."""
        own: list[Tensor] = []
        t = lib.ggml_get_first_tensor(self.ctx)
        while t != ffi.NULL:
            own.append(t)
            t = lib.ggml_get_next_tensor(self.ctx, t)
        addresses = {int(ffi.cast("uintptr_t", t)) for t in own}
        for t in own:
            root = t
            while root.view_src != ffi.NULL:
                root = root.view_src
            if int(ffi.cast("uintptr_t", root)) in addresses:
                t.data = ffi.NULL
                t.buffer = ffi.NULL

    def close(self) -> None:
        """Free the metadata context (tensor descriptions only; no data lives here)."""
        if self.ctx is not None:
            lib.ggml_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
