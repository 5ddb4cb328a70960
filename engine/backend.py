"""BackendSet: the preloaded backend set of one worker.

A worker picks one primary backend (an accelerator when the build and the machine have one, else
the CPU), keeps the CPU backend as the fallback for ops the primary cannot run, allocates weights
in the primary's buffer type and runs every graph through one ``ggml_backend_sched`` whose
allocator is guarded by a mutex. ``execute`` is the one door to compute.

Its settings come from ``EngineOptions`` (engine/options.py, which lists the ``QTTS_*``
variables); the BackendSet keeps them as ``options`` for everything built on it.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from engine.debug_out import debug_line
from engine.diagnostics import (
    DeterminismError,
    EvalHook,
    OpLog,
    first_difference,
)
from engine.dtypes import f32_to_bf16
from engine.errors import BackendError
from engine.ggml import Tensor, ffi, lib, native_info
from engine.ggml.graph import (
    Graph,
    ggml_type_of,
    name_of,
    new_tensor,
    no_alloc_context,
    numpy_dtype_of,
    set_name,
)
from engine.options import MAX_THREADS, EngineOptions

# Our names for backends and the name their ggml registry reports.
REGISTRY_NAMES: dict[str, str] = {
    "cpu": "CPU",
    "blas": "BLAS",
    "rpc": "RPC",
    "cuda": "CUDA",
    "vulkan": "Vulkan",
    "metal": "MTL",
    "hexagon": "HTP",
}
ACCELERATORS = ("cuda", "vulkan", "metal", "hexagon")
DEFAULT_GRAPH_SIZE = 65536  # nodes per graph the scheduler accepts (row-split decoder graphs)
# Largest src1 row count a backend's MUL_MAT accepts. ggml exposes no such limit, so these come
# from the backends' own supports_op code: the Hexagon (HTP) backend refuses more than 1024.
MAX_MATMUL_ROWS: dict[str, int] = {"hexagon": 1024}


@lru_cache(maxsize=1)
def quiet_numpy_blas() -> None:
    """numpy's BLAS down to one thread, once per process. OpenBLAS's worker threads
    busy-wait after each call, so one numpy matmul between two graphs (the speaker encoder's
    mel filterbank) left threads spinning on the cores ggml's threads were about to use, and
    the next graphs ran slower and erratically. The compute threads of a process are ggml's."""
    threadpool_limits(1, user_api="blas")


@dataclass(frozen=True)
class DeviceInfo:
    """One device the loaded ggml sees."""

    backend: str  # our name, e.g. "cpu"
    index: int  # index among the devices of that backend
    name: str
    description: str
    handle: Any = field(repr=False, compare=False)


@lru_cache(maxsize=1)
def _registry_loaded() -> None:
    # Backends built as loadable modules (GGML_BACKEND_DL, the portable build) live beside
    # libggml; ggml loads the best-scoring CPU variant there. Once per process: each call would
    # open every variant again to score it. Statically registered backends are already there.
    lib_dir = native_info()["lib_dir"].encode()
    lib.ggml_backend_load_all_from_path(lib_dir)


def rpc_function(name: str, ctype: str) -> Any:
    """A function of ggml's RPC backend, through its registry: found whether the backend is
    linked into libggml (native build) or a module loaded at run time (portable build)."""
    _registry_loaded()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    fn = ffi.NULL if reg == ffi.NULL else lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if fn == ffi.NULL:
        raise BackendError(f"this ggml build has no rpc backend ({name} not found); rebuild "
                           "with QTTS_GGML_BACKENDS=blas,rpc make native")
    return ffi.cast(ctype, fn)


_RPC_REGISTERED: set[str] = set()


def register_rpc_servers(endpoints: str | None) -> None:
    """Add each ``host:port`` RPC server's devices to ggml's registry (once per process)."""
    for ep in (e.strip() for e in (endpoints or "").split(",")):
        if not ep or ep in _RPC_REGISTERED:
            continue
        if "rpc" not in built_backends():
            raise BackendError(f"QTTS_RPC_SERVERS={endpoints}: this ggml build has no rpc "
                               "backend; rebuild with QTTS_GGML_BACKENDS=blas,rpc make native")
        host, _, port = ep.rpartition(":")
        if not host or not port.isdigit():
            raise BackendError(f"QTTS_RPC_SERVERS: {ep!r} is not host:port")
        add_server = rpc_function("ggml_backend_rpc_add_server",
                                  "ggml_backend_reg_t (*)(const char *)")
        reg = add_server(ep.encode())
        if reg == ffi.NULL or lib.ggml_backend_reg_dev_count(reg) == 0:
            raise BackendError(f"QTTS_RPC_SERVERS: no ggml rpc server answers at {ep}")
        lib.ggml_backend_register(reg)
        _RPC_REGISTERED.add(ep)


def list_devices() -> list[DeviceInfo]:
    """Every device the build and the machine provide, grouped by our backend names."""
    _registry_loaded()
    by_reg: dict[str, str] = {v: k for k, v in REGISTRY_NAMES.items()}
    counts: Counter[str] = Counter()
    out: list[DeviceInfo] = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        reg = ffi.string(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))).decode()
        ours = "rpc" if reg.startswith("RPC[") else by_reg.get(reg, reg.lower())
        out.append(
            DeviceInfo(
                backend=ours,
                index=counts[ours],
                name=ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                description=ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                handle=dev,
            )
        )
        counts[ours] += 1
    return out


def built_backends() -> list[str]:
    """Backends compiled into the loaded ggml build (cpu first)."""
    return list(native_info()["backends"])


def _parse_int(var: str, raw: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise BackendError(f"{var}={raw!r} is not an integer") from None
    if value < minimum:
        raise BackendError(f"{var}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise BackendError(f"{var}={value} must be <= {maximum}")
    return value


def _named_backend(backend: str, where: str) -> str:
    """``QTTS_BACKEND`` lower-cased, refused when unknown (``where``: what is available)."""
    name = backend.strip().lower()
    if name != "auto" and name not in REGISTRY_NAMES:
        raise BackendError(
            f"QTTS_BACKEND={backend!r} is unknown; choose auto or one of: "
            f"{', '.join(REGISTRY_NAMES)} ({where})"
        )
    return name


def _fallback_order(fallback: str, where: str) -> list[str]:
    """``QTTS_BACKEND_FALLBACK`` as backend names, CPU last; refused when empty or unknown."""
    if fallback == "":
        raise BackendError(
            f"QTTS_BACKEND_FALLBACK is empty; give a comma list such as cuda,cpu ({where})")
    order = [b.strip().lower() for b in fallback.split(",") if b.strip()]
    if not order:
        raise BackendError(f"QTTS_BACKEND_FALLBACK={fallback!r} names no backend ({where})")
    unknown = [b for b in order if b not in REGISTRY_NAMES]
    if unknown:
        raise BackendError(
            f"QTTS_BACKEND_FALLBACK names unknown backend(s) {', '.join(unknown)}; "
            f"known: {', '.join(REGISTRY_NAMES)} ({where})"
        )
    if "cpu" not in order:
        order.append("cpu")  # the CPU is always the last resort of auto
    return order


def _threads(threads: str | None) -> int:
    if threads in (None, ""):
        return default_threads()
    return _parse_int("QTTS_THREADS", threads, 1, MAX_THREADS)


def _device_index(device: str | None) -> int:
    return _parse_int("QTTS_DEVICE", device, 0) if device not in (None, "") else 0


def check_backend_settings(o: EngineOptions) -> None:
    """What ``choose_backend`` refuses without asking the machine for its devices: an unknown
    backend, one this build lacks, thread and device numbers that are not numbers or out of
    range. ``qtts serve`` checks these before it starts a worker, which would otherwise fail
    to start again and again."""
    built = built_backends()
    where = f"built: {', '.join(built)}"
    name = _named_backend(o.backend, where)
    if name != "auto" and name not in built:
        raise BackendError(_not_built(name, built))
    if name == "auto" and o.backend_fallback is not None:
        _fallback_order(o.backend_fallback, where)
    _threads(o.threads)
    _device_index(o.device)


def _not_built(name: str, built: list[str]) -> str:
    return (f"QTTS_BACKEND={name}: this ggml build has no {name} backend "
            f"(built: {', '.join(built)}); rebuild with QTTS_GGML_BACKENDS={name} make native")


def default_threads() -> int:
    """CPUs this process may run on (at most ``MAX_THREADS``)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return min(MAX_THREADS, cpus)


@dataclass(frozen=True)
class BackendChoice:
    """The validated result of the QTTS_BACKEND* settings."""

    device: DeviceInfo
    threads: int


def choose_backend(
    backend: str = "auto",
    fallback: str | None = None,
    device: str | None = None,
    threads: str | None = None,
    rpc_servers: str | None = None,
) -> BackendChoice:
    """Validate the backend settings against the build and the machine.

    Every refusal is a one-line BackendError that names what is available.
    """
    register_rpc_servers(rpc_servers)
    devices = list_devices()
    built = built_backends()
    available = sorted({d.backend for d in devices}, key=lambda b: (b != "cpu", b))
    where = "available here: " + ", ".join(available)
    name = _named_backend(backend, where)
    n_threads = _threads(threads)
    dev_index = _device_index(device)

    if name == "auto":
        if fallback is None:
            order = [b for b in ACCELERATORS if b in built] + ["cpu"]
        else:
            order = _fallback_order(fallback, where)
        for cand in order:
            matches = [d for d in devices if d.backend == cand]
            if matches:
                if dev_index >= len(matches):
                    if cand == "cpu" or device in (None, ""):
                        return BackendChoice(matches[0], n_threads)
                    continue
                return BackendChoice(matches[dev_index], n_threads)
        raise AssertionError("the CPU backend is always present")

    matches = [d for d in devices if d.backend == name]
    if not matches:
        if name not in built:
            raise BackendError(_not_built(name, built))
        raise BackendError(
            f"QTTS_BACKEND={name}: the build has it but this machine has no {name} device "
            f"({where})"
        )
    if dev_index >= len(matches):
        raise BackendError(
            f"QTTS_DEVICE={dev_index} is out of range: {name} has {len(matches)} device(s) "
            f"(0..{len(matches) - 1})"
        )
    return BackendChoice(matches[dev_index], n_threads)


@dataclass
class Placement:
    """Where the scheduler put one graph's nodes."""

    nodes_per_backend: dict[str, int]
    cpu_fallback_ops: dict[str, int]
    n_splits: int
    max_matmul_rows: int = 0  # the most src1 rows of any MUL_MAT (row-limited accelerators)

    def line(self) -> str:
        """One human-readable line."""
        per = ", ".join(f"{k}={v}" for k, v in self.nodes_per_backend.items())
        fb = ", ".join(f"{k}x{v}" for k, v in sorted(self.cpu_fallback_ops.items()))
        return (f"nodes: {per}; splits={self.n_splits}; max matmul rows={self.max_matmul_rows}"
                + (f"; on CPU: {fb}" if fb else ""))


class WeightStore:
    """Weights of one model, allocated once in the primary backend's buffer type.

    Tensors come from two places: spans of a read-only memory map of the model file (bound
    without a copy when the primary buffer type is host memory, so CPU workers share pages), and
    arrays computed at load time (folded constants, converted precisions), uploaded once.
    """

    def __init__(self, backends: BackendSet, max_tensors: int = 4096) -> None:
        self._backends = backends
        self.ctx = no_alloc_context(max_tensors, what="a weight store")
        self._tensors: dict[str, Tensor] = {}
        self._mapped: list[tuple[Tensor, int]] = []  # (tensor, offset in the map)
        self._arrays: list[tuple[Tensor, np.ndarray[Any, Any]]] = []
        self._map: np.ndarray[Any, Any] | None = None
        self._buffers: list[Any] = []
        self.nbytes = 0

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        """Names of every tensor in the store."""
        return list(self._tensors)

    def add_mapped(
        self, name: str, ggml_type: int, shape: Sequence[int], file_map: np.ndarray[Any, Any],
        offset: int
    ) -> Tensor:
        """A weight whose bytes are ``file_map[offset:offset+nbytes]`` (numpy-order shape)."""
        if self._map is None:
            self._map = file_map
        elif self._map is not file_map:
            raise ValueError("one WeightStore maps one file")
        t = set_name(new_tensor(self.ctx, ggml_type, shape), name)
        self._tensors[name] = t
        self._mapped.append((t, offset))
        return t

    def add_array(self, name: str, array: np.ndarray[Any, Any], ggml_type: int | None = None
                  ) -> Tensor:
        """A weight computed at load time. ``ggml_type`` BF16 or F16 converts float32 data."""
        src = np.ascontiguousarray(array)
        if ggml_type == lib.GGML_TYPE_BF16:
            if src.dtype != np.float32:  # uint16 bits would be converted as numbers
                raise TypeError(f"{name}: BF16 weights are given as float32, got {src.dtype}")
            src = f32_to_bf16(src)
        elif ggml_type == lib.GGML_TYPE_F16 and src.dtype == np.float32:
            src = src.astype(np.float16)
        elif ggml_type is None:
            ggml_type = ggml_type_of(src.dtype)
        elif numpy_dtype_of(ggml_type) != src.dtype:
            raise TypeError(f"{name}: array dtype {src.dtype} does not hold ggml type {ggml_type}")
        assert ggml_type is not None
        t = set_name(new_tensor(self.ctx, ggml_type, array.shape), name)
        self._tensors[name] = t
        self._arrays.append((t, src))
        return t

    def allocate(self) -> None:
        """Allocate and fill every tensor added so far. Call once, after all add_* calls."""
        primary = self._backends.primary
        buft = lib.ggml_backend_get_default_buffer_type(primary)
        zero_copy = bool(lib.ggml_backend_buft_is_host(buft)) and self._map is not None
        if zero_copy:
            assert self._map is not None
            base = ffi.cast("char *", ffi.from_buffer(self._map, require_writable=False))
            buf = lib.ggml_backend_cpu_buffer_from_ptr(base, self._map.nbytes)
            if buf == ffi.NULL:
                raise BackendError("cannot wrap the model's memory map in a CPU buffer")
            self._buffers.append(buf)
            for t, offset in self._mapped:
                if lib.ggml_backend_tensor_alloc(buf, t, base + offset) != 0:
                    raise BackendError(f"cannot bind weight {name_of(t)} to the memory map")
                self.nbytes += lib.ggml_nbytes(t)
        # Allocates only tensors that have no data yet: the computed ones, or all when uploading.
        alloc_buf = lib.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, buft)
        if alloc_buf != ffi.NULL:
            self._buffers.append(alloc_buf)
            lib.ggml_backend_buffer_set_usage(alloc_buf, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        elif self._arrays or not zero_copy:
            raise BackendError("cannot allocate the weight buffer on the primary backend")
        if not zero_copy:
            for t, offset in self._mapped:
                n = lib.ggml_nbytes(t)
                assert self._map is not None
                view = self._map[offset : offset + n]
                lib.ggml_backend_tensor_set(t, ffi.from_buffer(view), 0, n)
                self.nbytes += n
        for t, arr in self._arrays:
            n = lib.ggml_nbytes(t)
            if n != arr.nbytes:
                raise BackendError(f"{name_of(t)}: {arr.nbytes} bytes given, tensor needs {n}")
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, n)
            self.nbytes += n
        self._arrays.clear()

    def close(self) -> None:
        """Free the weight buffers and the metadata context."""
        for buf in self._buffers:
            lib.ggml_backend_buffer_free(buf)
        self._buffers.clear()
        if self.ctx is not None:
            lib.ggml_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        self.close()


def _backend_name(b: Any) -> str:
    """A backend's name ("none" for a null handle)."""
    return str(ffi.string(lib.ggml_backend_name(b)).decode()) if b != ffi.NULL else "none"


class BackendSet:
    """Primary backend + CPU fallback, one scheduler, one locked allocator."""

    def __init__(self, choice: BackendChoice, options: EngineOptions | None = None,
                 graph_size: int = DEFAULT_GRAPH_SIZE) -> None:
        quiet_numpy_blas()
        self.choice = choice
        self.options = options if options is not None else EngineOptions()
        self.debug = self.options.debug_backend
        self.custom_ops = self.options.custom_ops
        self.diagnostics = self.options.diagnostics
        self.max_matmul_rows = (self.options.max_matmul_rows
                                if self.options.max_matmul_rows is not None
                                else MAX_MATMUL_ROWS.get(choice.device.backend))
        self.last_op_log: OpLog | None = None
        # When a list, every execute appends where its nodes ran (used by `qtts doctor`).
        self.placement_log: list[Placement] | None = None
        self.threads = choice.threads
        self.graph_size = graph_size
        self.name = choice.device.backend
        self.primary = lib.ggml_backend_dev_init(choice.device.handle, ffi.NULL)
        if self.primary == ffi.NULL:
            raise BackendError(f"cannot initialise {self.name} device {choice.device.name}")
        self._set_threads(self.primary, choice.device.handle)
        backends = [self.primary]
        if self.name == "cpu":
            self.cpu = self.primary
        else:
            cpu_dev = next(d for d in list_devices() if d.backend == "cpu")
            self.cpu = lib.ggml_backend_dev_init(cpu_dev.handle, ffi.NULL)
            self._set_threads(self.cpu, cpu_dev.handle)
            backends.append(self.cpu)
        self._backend_array = ffi.new("ggml_backend_t[]", backends)
        self.sched = lib.ggml_backend_sched_new(
            self._backend_array, ffi.NULL, len(backends), graph_size, False, True
        )
        self._lock = threading.Lock()
        self.last_placement: Placement | None = None

    @classmethod
    def from_options(cls, options: EngineOptions | None = None) -> BackendSet:
        """Choose and initialise the backends ``options`` name (defaults: an empty environment)."""
        o = options if options is not None else EngineOptions()
        choice = choose_backend(o.backend, o.backend_fallback, o.device, o.threads, o.rpc_servers)
        return cls(choice, o)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BackendSet:
        """From a mapping of ``QTTS_*`` variables (tests, benches): the same as
        ``from_options(EngineOptions.from_env(env))``."""
        return cls.from_options(EngineOptions.from_env(env))

    def _set_threads(self, backend: Any, dev: Any) -> None:
        reg = lib.ggml_backend_dev_backend_reg(dev)
        fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_set_n_threads")
        if fn != ffi.NULL:
            ffi.cast("ggml_backend_set_n_threads_t", fn)(backend, self.threads)

    @property
    def lock(self) -> threading.Lock:
        """The allocator's mutex: hold it to run graphs kept allocated outside ``execute``."""
        return self._lock

    def weight_store(self, max_tensors: int = 4096) -> WeightStore:
        """An empty store for one model's weights on this backend set."""
        return WeightStore(self, max_tensors)

    def execute(
        self,
        graph: Graph,
        uploads: Mapping[str, np.ndarray[Any, Any]] | None = None,
        downloads: Sequence[str] | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Allocate, fill inputs, compute and read back outputs of one graph.

        ``uploads`` maps input names to arrays (numpy shape must equal the input's);
        ``downloads`` names outputs to read (default: all outputs). Thread-safe: callers are
        serialised on the allocator's mutex.
        """
        uploads = uploads or {}
        names = list(graph.outputs) if downloads is None else list(downloads)
        for name, arr in uploads.items():
            t = graph.inputs.get(name)
            if t is None:
                raise KeyError(f"graph has no input {name!r}")
            if arr.nbytes != lib.ggml_nbytes(t):
                raise ValueError(
                    f"input {name!r}: {arr.nbytes} bytes for a tensor of {lib.ggml_nbytes(t)}"
                )
        missing = [n for n in graph.inputs if n not in uploads]
        if missing:
            raise KeyError(f"no data for graph input(s) {', '.join(missing)}")
        with self._lock:
            if graph.runs:
                graph.unplace()
            graph.runs += 1
            self._allocate(graph)
            self._upload(graph, uploads)
            if self.diagnostics.any_hook:
                self._compute_observed(graph, uploads)
            else:
                self._compute(graph)
            out: dict[str, np.ndarray[Any, Any]] = {}
            for name in names:
                t = graph.outputs[name]
                shape = tuple(int(t.ne[i]) for i in reversed(range(lib.ggml_n_dims(t))))
                arr = np.empty(shape, dtype=numpy_dtype_of(t.type))
                lib.ggml_backend_tensor_get(t, ffi.from_buffer(arr), 0, arr.nbytes)
                out[name] = arr
            if self.debug or self.placement_log is not None:
                self.last_placement = self._placement(graph)
                if self.placement_log is not None:
                    self.placement_log.append(self.last_placement)
                if self.debug:
                    debug_line(f"[qtts backend] {self.last_placement.line()}")
        return out

    def _allocate(self, graph: Graph) -> None:
        """Place and allocate ``graph`` in the scheduler's compute buffers.

        Reserved first, every time: ggml's allocator otherwise reuses the previous graph's
        placement whenever the node and leaf counts match and every node fits, without checking
        the leaves, so a graph whose inputs are bigger but only read through views (views
        always "fit") got inputs overlapping other tensors: garbage that depends on which graph
        ran before (tests/engine/test_custom_ops.py reproduces it). One-off graphs pay a second
        split of the graph for this; the per-step graphs are cached (engine/talker/runner.py).
        Only with one backend: with an accelerator beside the CPU the explicit reserve broke
        the input copies between backends (tests/engine/test_backend.py, RPC), so there the
        scheduler's own re-planning stands (the gap remains: an open issue).
        """
        lib.ggml_backend_sched_reset(self.sched)
        self._apply_op_filter(graph)
        if self.cpu == self.primary:
            if not lib.ggml_backend_sched_reserve(self.sched, graph.gf):
                raise BackendError("the scheduler could not reserve the graph")
            self._apply_op_filter(graph)
        if not lib.ggml_backend_sched_alloc_graph(self.sched, graph.gf):
            raise BackendError("the scheduler could not allocate the graph")

    def _upload(self, graph: Graph, uploads: Mapping[str, np.ndarray[Any, Any]]) -> None:
        for name, arr in uploads.items():
            t = graph.inputs[name]
            if t.buffer == ffi.NULL:  # an input no node reads (e.g. the mask of a fused attention)
                continue
            src = np.ascontiguousarray(arr)
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(src), 0, src.nbytes)

    def _compute(self, graph: Graph) -> None:
        status = lib.ggml_backend_sched_graph_compute(self.sched, graph.gf)
        if status != lib.GGML_STATUS_SUCCESS:
            raise BackendError(f"graph compute failed with status {status}")

    def _apply_op_filter(self, graph: Graph) -> None:
        """QTTS_OP_FILTER: pin the chosen op types to the CPU backend."""
        if not self.diagnostics.op_filter:
            return
        for node in graph.nodes():
            if ffi.string(lib.ggml_op_desc(node)).decode() in self.diagnostics.op_filter:
                lib.ggml_backend_sched_set_tensor_backend(self.sched, node, self.cpu)

    def _compute_observed(self, graph: Graph, uploads: Mapping[str, np.ndarray[Any, Any]]
                          ) -> None:
        """Compute node by node under the eval callback (op log and/or determinism check)."""
        d = self.diagnostics

        hook = EvalHook(self.sched, _backend_name, d.op_log, d.check_determinism, echo=d.op_log)
        hook.install()
        try:
            self._compute(graph)
            if d.check_determinism:
                again = EvalHook(self.sched, _backend_name, False, True, echo=False)
                again.install()
                self._upload(graph, uploads)  # the allocator may have reused input memory
                self._compute(graph)
                diff = first_difference(hook.log.hashes, again.log.hashes)
                if diff is not None:
                    raise DeterminismError(diff)
        finally:
            lib.ggml_backend_sched_set_eval_callback(self.sched, ffi.NULL, ffi.NULL)
        self.last_op_log = hook.log
        if d.op_log:
            debug_line(hook.log.report())

    def _placement(self, graph: Graph) -> Placement:
        per: Counter[str] = Counter()
        fallback: Counter[str] = Counter()
        rows = 0
        for node in graph.nodes():
            if node.op == lib.GGML_OP_MUL_MAT:
                rows = max(rows, int(node.src[1].ne[1]))
            b = lib.ggml_backend_sched_get_tensor_backend(self.sched, node)
            per[_backend_name(b)] += 1
            if b == self.cpu and self.cpu != self.primary:
                fallback[ffi.string(lib.ggml_op_desc(node)).decode()] += 1
        return Placement(dict(per), dict(fallback), lib.ggml_backend_sched_get_n_splits(self.sched),
                         rows)

    def placement(self, graph: Graph) -> Placement:
        """Place ``graph`` (without computing it) and report where each node went."""
        with self._lock:
            self._allocate(graph)
            return self._placement(graph)

    def compute_buffer_bytes(self) -> int:
        """Bytes of the scheduler's compute buffers (they grow to the largest graph run)."""
        with self._lock:
            return self._compute_buffer_bytes()

    def _compute_buffer_bytes(self) -> int:
        backends = [self.primary] if self.cpu == self.primary else [self.primary, self.cpu]
        return sum(int(lib.ggml_backend_sched_get_buffer_size(self.sched, b)) for b in backends)

    def trim_compute_buffers(self, keep_bytes: int) -> bool:
        """Give back compute buffers over ``keep_bytes`` (a new, empty scheduler); True if so.

        ggml's allocator only ever grows its buffers: one graph bigger than the steady ones
        (a long decode, an odd request) would otherwise keep its memory for the process's life.
        """
        with self._lock:
            if self._compute_buffer_bytes() <= keep_bytes:
                return False
            n = 1 if self.cpu == self.primary else 2
            lib.ggml_backend_sched_free(self.sched)
            self.sched = lib.ggml_backend_sched_new(self._backend_array, ffi.NULL, n,
                                                    self.graph_size, False, True)
            if self.sched == ffi.NULL:
                raise BackendError("cannot create a new scheduler")
            return True

    def close(self) -> None:
        """Free the scheduler and backends."""
        if getattr(self, "sched", None) is not None:
            lib.ggml_backend_sched_free(self.sched)
            self.sched = None
            if self.cpu != self.primary:
                lib.ggml_backend_free(self.cpu)
            lib.ggml_backend_free(self.primary)

    def __del__(self) -> None:
        self.close()
