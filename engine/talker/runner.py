"""Graphs built once and run many times, plus the graph-building cost accounting.

``BackendSet.execute`` allocates every graph afresh in the worker's one scheduler: right for
graphs that change shape (prefill, decoder chunks). The autoregressive steps repeat the *same*
graph thousands of times (the code predictor alone runs 15 graphs per 80 ms frame), and their
structure does not depend on the step because cache positions are inputs (``engine.talker.qwen3``).
A ``CachedGraph`` therefore builds its graph once, allocates it once in a scheduler of its own
(same backends, same CPU fallback, its own small compute buffer, so no other graph can move its
tensors), and each run only uploads inputs, computes and reads outputs. Runs take the
BackendSet's lock, like ``execute``, so compute on a backend stays serialised.

``BuildStats`` counts the Python time spent building graphs versus running them, so the
graph-building share per step can be reported (bench/talker.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend import BackendSet
from engine.errors import BackendError
from engine.ggml import NULL, Graph, ffi, lib
from engine.ggml.graph import numpy_dtype_of, shape_of


@dataclass
class BuildStats:
    """Seconds spent building graphs in Python and running them, with counts.

    ``run_s`` is the whole run (uploads, compute, downloads, lock); ``compute_s`` the part
    inside ggml's graph compute, measured for cached graphs only (``execute`` hides it).
    """

    build_s: float = 0.0
    builds: int = 0
    run_s: float = 0.0
    runs: int = 0
    compute_s: float = 0.0
    cached_run_s: float = 0.0

    def share(self) -> float:
        """Fraction of graph time that went into building."""
        total = self.build_s + self.run_s
        return self.build_s / total if total > 0 else 0.0

    def overhead_share(self) -> float:
        """Fraction of cached-graph run time spent outside compute (Python, transfers)."""
        return 1.0 - self.compute_s / self.cached_run_s if self.cached_run_s > 0 else 0.0

    def copy(self) -> BuildStats:
        """A snapshot (for deltas over one request)."""
        return BuildStats(**vars(self))

    def __sub__(self, other: BuildStats) -> BuildStats:
        return BuildStats(**{k: v - getattr(other, k) for k, v in vars(self).items()})


class CachedGraph:
    """A graph allocated once in its own scheduler and run many times.

    ``build`` fills a fresh ``Graph`` (inputs declared with ``g.input``, outputs with
    ``g.output``); it is called once, here.
    """

    def __init__(self, backends: BackendSet, build: Callable[[Graph], None],
                 max_nodes: int = 4096, stats: BuildStats | None = None) -> None:
        self.backends = backends
        self.stats = stats
        t0 = time.perf_counter()
        self.graph = Graph(max_nodes)
        build(self.graph)
        if stats is not None:
            stats.build_s += time.perf_counter() - t0
            stats.builds += 1
        g = self.graph
        arr = [backends.primary] if backends.cpu == backends.primary else [
            backends.primary, backends.cpu]
        self._backends = ffi.new("ggml_backend_t[]", arr)
        # The scheduler's hash set must hold every node and leaf (weights, inputs, views);
        # the graph's own capacity bounds both.
        self.sched = lib.ggml_backend_sched_new(self._backends, NULL, len(arr),
                                                2 * int(lib.ggml_graph_size(g.gf)) + 256,
                                                False, True)
        if self.sched == NULL:
            raise BackendError("cannot create a scheduler for a cached graph")
        with backends.lock:
            if not lib.ggml_backend_sched_alloc_graph(self.sched, g.gf):
                self.close()
                raise BackendError("the scheduler could not allocate a cached graph")
        self._in = {name: (t, int(lib.ggml_nbytes(t))) for name, t in g.inputs.items()}
        self._out = {name: (t, shape_of(t), numpy_dtype_of(t.type))
                     for name, t in g.outputs.items()}

    def run(self, uploads: Mapping[str, np.ndarray[Any, Any]],
            downloads: Sequence[str] | None = None) -> dict[str, np.ndarray[Any, Any]]:
        """Upload every input, compute, read ``downloads`` (default: every output)."""
        t0 = time.perf_counter()
        names = list(self._out) if downloads is None else downloads
        if len(uploads) != len(self._in):
            missing = sorted(set(self._in) - set(uploads))
            raise KeyError(f"no data for cached-graph input(s) {', '.join(missing)}")
        out: dict[str, np.ndarray[Any, Any]] = {}
        with self.backends.lock:
            for name, arr in uploads.items():
                t, n = self._in[name]
                src = np.ascontiguousarray(arr)
                if src.nbytes != n:
                    raise ValueError(f"input {name!r}: {src.nbytes} bytes for a tensor of {n}")
                lib.ggml_backend_tensor_set(t, ffi.from_buffer(src), 0, n)
            tc = time.perf_counter()
            status = lib.ggml_backend_sched_graph_compute(self.sched, self.graph.gf)
            compute = time.perf_counter() - tc
            if status != lib.GGML_STATUS_SUCCESS:
                raise BackendError(f"cached graph compute failed with status {status}")
            for name in names:
                t, shape, dtype = self._out[name]
                a = np.empty(shape, dtype=dtype)
                lib.ggml_backend_tensor_get(t, ffi.from_buffer(a), 0, a.nbytes)
                out[name] = a
        if self.stats is not None:
            dt = time.perf_counter() - t0
            self.stats.run_s += dt
            self.stats.cached_run_s += dt
            self.stats.compute_s += compute
            self.stats.runs += 1
        return out

    def close(self) -> None:
        """Free the scheduler (and its compute buffer) and the graph metadata."""
        if getattr(self, "sched", None) is not None and self.sched != NULL:
            lib.ggml_backend_sched_free(self.sched)
        self.sched = None
        if getattr(self, "graph", None) is not None:
            self.graph.close()

    def __del__(self) -> None:
        self.close()


def execute_timed(backends: BackendSet, build: Callable[[Graph], None],
                  uploads: Mapping[str, np.ndarray[Any, Any]], max_nodes: int = 8192,
                  stats: BuildStats | None = None) -> dict[str, np.ndarray[Any, Any]]:
    """Build a one-off graph and run it through ``BackendSet.execute``, counting build time."""
    t0 = time.perf_counter()
    with Graph(max_nodes) as g:
        build(g)
        t1 = time.perf_counter()
        out = backends.execute(g, uploads)
    if stats is not None:
        stats.build_s += t1 - t0
        stats.builds += 1
        stats.run_s += time.perf_counter() - t1
        stats.runs += 1
    return out
