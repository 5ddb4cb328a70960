"""Diagnostics for native faults, each off by default and free when off.

* ``QTTS_OP_LOG=1`` — after every node is computed (the scheduler's eval callback): op,
  backend, shape, type, max |x|, NaN and Inf counts. The first node whose output holds a NaN or
  Inf is reported with the stats of its inputs (``OpLog.first_bad``).
* ``QTTS_OP_FILTER=MUL_MAT,IM2COL`` — nodes of these op types are pinned to the CPU backend,
  to bisect a faulty accelerator kernel (visible in the placement report).
* ``QTTS_CHECK_DETERMINISM=1`` — every graph runs twice; per-node output hashes are compared and
  the first node that differs is reported.

They hook into ``BackendSet.execute``; nothing here runs unless its option is on
(``EngineOptions.diagnostics``, read from the variables at the edge).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.debug_out import debug_line
from engine.ggml import Tensor, ffi, lib
from engine.ggml.graph import name_of, numpy_dtype_of


@dataclass
class NodeStats:
    """What one computed node held."""

    index: int
    name: str
    op: str
    backend: str
    shape: tuple[int, ...]
    type: str
    max_abs: float
    nan: int
    inf: int

    def line(self) -> str:
        """One log line."""
        return (f"#{self.index} {self.op} {self.name!r} on {self.backend} {self.type}"
                f"{list(self.shape)} max|x|={self.max_abs:.4g} nan={self.nan} inf={self.inf}")


def tensor_values(t: Tensor) -> np.ndarray[Any, Any] | None:
    """A computed tensor's data as float64 (None for types we cannot read as numbers)."""
    if t.data == ffi.NULL and t.view_src == ffi.NULL:
        return None
    n = int(lib.ggml_nelements(t))
    if not lib.ggml_is_contiguous(t):
        return None
    dt = numpy_dtype_of(t.type)
    if t.type not in (lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_I32,
                      lib.GGML_TYPE_BF16):
        return None
    raw = np.empty(n, dtype=dt)
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(raw), 0, raw.nbytes)
    if t.type == lib.GGML_TYPE_BF16:
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def node_stats(index: int, t: Tensor, backend: str) -> NodeStats:
    """Stats of one computed node."""
    vals = tensor_values(t)
    if vals is None or vals.size == 0:
        mx, nan, inf = float("nan"), 0, 0
    else:
        finite = np.isfinite(vals)
        nan, inf = int(np.isnan(vals).sum()), int(np.isinf(vals).sum())
        mx = float(np.abs(vals[finite]).max()) if finite.any() else float("nan")
    shape = tuple(int(t.ne[i]) for i in reversed(range(lib.ggml_n_dims(t))))
    return NodeStats(index, name_of(t), ffi.string(lib.ggml_op_desc(t)).decode(), backend,
                     shape, ffi.string(lib.ggml_type_name(t.type)).decode(), mx, nan, inf)


@dataclass
class OpLog:
    """Per-node records of one graph execution (QTTS_OP_LOG)."""

    nodes: list[NodeStats] = field(default_factory=list)
    first_bad: tuple[NodeStats, list[NodeStats]] | None = None
    hashes: list[tuple[str, str]] = field(default_factory=list)

    def report(self) -> str:
        """The first NaN/Inf with its inputs, or a one-line all-clear."""
        if self.first_bad is None:
            return f"[qtts op-log] {len(self.nodes)} nodes, no NaN/Inf"
        node, inputs = self.first_bad
        lines = [f"[qtts op-log] first NaN/Inf: {node.line()}"]
        lines += [f"    input {s.line()}" for s in inputs]
        return "\n".join(lines)


class EvalHook:
    """An eval callback for ggml_backend_sched that logs stats and/or hashes every node."""

    def __init__(self, sched: Any, backend_name: Any, log_stats: bool, hash_outputs: bool,
                 echo: bool) -> None:
        self.sched = sched
        self.backend_name = backend_name
        self.log_stats = log_stats
        self.hash_outputs = hash_outputs
        self.echo = echo
        self.log = OpLog()
        self._index = 0
        # Stats taken when each node was computed: by the time a later node fails, the
        # allocator may already have reused its inputs' memory (in-place ops).
        self._seen: dict[int, NodeStats] = {}
        self._cb = ffi.callback("ggml_backend_sched_eval_callback", self._on_node)

    def install(self) -> None:
        """Make the scheduler call us for every node (it then computes node by node)."""
        lib.ggml_backend_sched_set_eval_callback(self.sched, self._cb, ffi.NULL)

    def remove(self) -> None:
        """Back to normal (batched) compute."""
        lib.ggml_backend_sched_set_eval_callback(self.sched, ffi.NULL, ffi.NULL)

    def _on_node(self, t: Any, ask: bool, _user: Any) -> bool:
        if ask:
            return True  # observe every node
        try:
            backend = self.backend_name(lib.ggml_backend_sched_get_tensor_backend(self.sched, t))
            if self.hash_outputs:
                vals = tensor_values(t)
                digest = hashlib.sha1(vals.tobytes()).hexdigest() if vals is not None else ""
                self.log.hashes.append((name_of(t), digest))
            if self.log_stats:
                st = node_stats(self._index, t, backend)
                self.log.nodes.append(st)
                self._seen[int(ffi.cast("uintptr_t", t))] = st
                if self.echo:
                    debug_line(f"[qtts op-log] {st.line()}")
                if (st.nan or st.inf) and self.log.first_bad is None:
                    inputs = []
                    for i in range(lib.GGML_MAX_SRC):
                        src = t.src[i]
                        if src != ffi.NULL:
                            seen = self._seen.get(int(ffi.cast("uintptr_t", src)))
                            inputs.append(seen or node_stats(-1, src, backend))
                    self.log.first_bad = (st, inputs)
        finally:
            self._index += 1
        return True  # keep computing


class DeterminismError(RuntimeError):
    """Two runs of the same graph on the same inputs differed."""


def first_difference(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> str | None:
    """The first node whose output hash differs between two runs, as a message."""
    for i, ((name_a, ha), (_, hb)) in enumerate(zip(a, b, strict=False)):
        if ha != hb:
            return f"node #{i} {name_a!r} differs between two runs of the same graph"
    if len(a) != len(b):
        return f"the two runs computed {len(a)} and {len(b)} nodes"
    return None
