"""Talker and code-predictor weights, bound zero-copy to the GGUF's memory map.

Every stored type is usable by ggml as is: F32/F16/BF16/Q8_0/Q4_0 as ``mul_mat`` src0,
F32/F16/BF16 tables for ``get_rows``, F32 norms and biases. So nothing is converted at load:
the WeightStore binds each tensor to its span of the file (CPU workers share those pages; an
accelerator backend gets one upload). Names are the GGUF names (``engine.gguf_schema``).

One exception, on the CPU backend only: Q4_0 matrix weights are re-laid out at load for the
steps' kernels. With AVX512-VNNI and qtts's custom ops, into ``engine.ggml.gemv_q4``'s layout
(nibbles and scales in one stream per 16 rows; about twice ggml's GEMV on weights read from
memory, and a batched step reads them once; docs/performance.md): ``mul_mat`` then routes every
product with such a matrix through that op, for any number of rows, so one row and a batch of
rows get the same bits. Otherwise into ggml's ``CPU_REPACK`` buffer type (interleaved 8-row
blocks, ``q4_0_8x8``, for its AVX2 / AVX-512 GEMV). Either costs a private copy (the Q4_0
matrices of the talker and code predictor, ~0.3 GB for 0.6B) instead of shared file pages;
``repack=False`` keeps everything zero-copy.

And for the prefill of a quantised (Q8_0/Q4_0) talker on the CPU, an int8 copy of its layers'
seven matrices for ``engine.ggml.gemm_i8`` (W8A8 with AVX512-VNNI, several times ggml's Q4_0
GEMM at a prompt's rows; docs/performance.md): 1 byte per weight, made at load from the
dequantised weights. Steps (one row) keep the Q4_0/Q8_0 matrices, which read fewer bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backend import BackendSet, WeightStore
from engine.errors import BackendError
from engine.ggml import NULL, Tensor, ffi, gemm_i8, gemv_q4, lib
from engine.ggml.graph import new_tensor, no_alloc_context, set_name
from engine.gguf_schema import GGML_Q4_0, GGML_Q8_0, PART_TALKER, talker_tensor_specs

# Matrix weights (mul_mat src0) that may be re-laid out; never embedding tables.
_MATMUL_SUFFIXES = (
    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_out.weight", "ffn_gate.weight",
    "ffn_up.weight", "ffn_down.weight", "codec_head.weight", "fc1.weight", "fc2.weight",
    "mtp_proj.weight",
)
_CP_HEAD = "cp.head."  # the code predictor's 15 heads: one product per pass, like a layer's


# The matrices of a layer that a prefill multiplies by many rows: LayerWeights field -> GGUF name
I8_MATRICES = {"q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
               "o": "attn_out.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight",
               "down": "ffn_down.weight"}
I8_TYPES = (GGML_Q4_0, GGML_Q8_0)  # weight types whose talker prefill takes the int8 copies
# The int8 copies are packed per group of matrices that multiply the same input, side by side:
# one GEMM and one rounding of the input per group (packed key -> LayerWeights fields, in order)
I8_GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


@dataclass
class LayerWeights:
    """One Qwen3 decoder layer (talker or code predictor).

    ``i8``: int8 copies of the seven matrices for multi-row graphs, one ``gemm_i8.I8Matrix``
    per ``I8_GROUPS`` group (its matrices' output channels one after the other), or None.
    """

    attn_norm: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    q_norm: Tensor
    k_norm: Tensor
    ffn_norm: Tensor
    gate: Tensor
    up: Tensor
    down: Tensor
    i8: dict[str, gemm_i8.I8Matrix] | None = None


@dataclass(frozen=True)
class StackShape:
    """Hyper-parameters of one Qwen3 stack, as the block builder needs them."""

    prefix: str  # "talk" or "cp": the name prefix of every intermediate
    hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    eps: float
    rope_theta: float

    @property
    def q_dim(self) -> int:
        """Width of all query heads together."""
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key (or value) heads together."""
        return self.n_kv_head * self.head_dim


class TalkerWeights:
    """Every ``talk.*`` and ``cp.*`` tensor of a talker GGUF on one BackendSet."""

    def __init__(self, model: Any, backends: BackendSet, repack: bool = True,
                 int8_prefill: bool = True) -> None:
        model.require(PART_TALKER)
        t, cp = model.talker_config, model.code_predictor_config
        self.cfg = t
        self.cp_cfg = cp
        specs = talker_tensor_specs(t, cp)
        n_i8 = 3 * len(I8_GROUPS) * int(t.num_hidden_layers)
        self.store: WeightStore = backends.weight_store(
            max_tensors=2 * len(specs) + n_i8 + 16)
        self.types: dict[str, int] = {}
        # stored matrix (its tensor's address) -> its gemv_q4 layout
        self._q4: dict[int, Tensor] = {}
        # F16/F32 matrices of a quantised talker (the converter's fallback where a row length is
        # not a multiple of 32): multiplied one column at a time (see ``mul_mat``)
        self._rowwise: set[int] = set()
        quantised = any(model.tensor_info(s.name).ggml_type in I8_TYPES
                        for s in specs if _is_matrix(s.name))
        step_q4 = repack and gemv_q4_possible(backends)
        self.repacked = _Repacked(backends, len(specs)) if repack and not step_q4 else None
        if self.repacked is not None and self.repacked.buft is None:
            self.repacked = None
        mm = model.mmap
        tensors: dict[str, Tensor] = {}
        for spec in specs:
            info = model.tensor_info(spec.name)
            self.types[spec.name] = info.ggml_type
            q4_matrix = info.ggml_type == GGML_Q4_0 and _is_matrix(spec.name)
            if q4_matrix and self.repacked is not None and spec.shape[0] % 8 == 0:
                tensors[spec.name] = self.repacked.add(spec.name, info.ggml_type, spec.shape,
                                                       model.tensor(spec.name))
                continue
            bound = tensors[spec.name] = self.store.add_mapped(spec.name, info.ggml_type,
                                                           spec.shape, mm, info.offset)
            if quantised and info.ggml_type not in I8_TYPES and _is_matrix(spec.name):
                self._rowwise.add(_address(bound))
            if q4_matrix and step_q4 and gemv_q4.packable(*spec.shape):
                packed = gemv_q4.pack(model.tensor(spec.name), *spec.shape)
                self._q4[_address(bound)] = self.store.add_array(f"{spec.name}.q4", packed)
        w = tensors
        self.layers = [_layer(w, f"talk.blk.{i}.") for i in range(t.num_hidden_layers)]
        if int8_prefill and int8_prefill_possible(model, backends):
            for i, lw in enumerate(self.layers):
                lw.i8 = self._add_i8(model, f"talk.blk.{i}.")
        self.store.allocate()
        if self.repacked is not None:
            self.repacked.allocate()
        self.text_embd = w["talk.text_embd.weight"]
        self.text_fc1_w = w["talk.text_proj.fc1.weight"]
        self.text_fc1_b = w["talk.text_proj.fc1.bias"]
        self.text_fc2_w = w["talk.text_proj.fc2.weight"]
        self.text_fc2_b = w["talk.text_proj.fc2.bias"]
        self.codec_embd = w["talk.codec_embd.weight"]
        self.output_norm = w["talk.output_norm.weight"]
        self.codec_head = w["talk.codec_head.weight"]
        n_groups = t.num_code_groups - 1
        self.cp_embd = [w[f"cp.codec_embd.{j}.weight"] for j in range(n_groups)]
        self.cp_mtp_w: Tensor | None = w["cp.mtp_proj.weight"] if cp.has_mtp_projection else None
        self.cp_mtp_b: Tensor | None = w["cp.mtp_proj.bias"] if cp.has_mtp_projection else None
        self.cp_layers = [_layer(w, f"cp.blk.{i}.") for i in range(cp.num_hidden_layers)]
        self.cp_output_norm = w["cp.output_norm.weight"]
        self.cp_heads = [w[f"cp.head.{j}.weight"] for j in range(n_groups)]
        self.talker_shape = StackShape(
            "talk", t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.rms_norm_eps, t.rope_theta,
        )
        self.cp_shape = StackShape(
            "cp", cp.hidden_size, cp.num_attention_heads, cp.num_key_value_heads, cp.head_dim,
            cp.rms_norm_eps, cp.rope_theta,
        )

    def _add_i8(self, model: Any, prefix: str) -> dict[str, gemm_i8.I8Matrix]:
        # (each output channel is rounded and summed alone: a group's GEMM gives every matrix
        # the bits of a GEMM of its own)
        out: dict[str, gemm_i8.I8Matrix] = {}
        for group, fields in I8_GROUPS.items():
            p = gemm_i8.pack(np.concatenate(
                [model.tensor_f32(prefix + I8_MATRICES[f]) for f in fields], axis=0))
            name = prefix + group
            wq = self.store.add_array(f"{name}.i8q", p.wq)
            ws = self.store.add_array(f"{name}.i8s", p.ws)
            wc = self.store.add_array(f"{name}.i8c", p.wc)
            out[group] = gemm_i8.I8Matrix(p.n, p.k, wq, ws, wc)
        return out

    def mul_mat(self, ctx: Any, w: Tensor, x: Tensor) -> Tensor:
        """``W x`` (ggml's ``mul_mat`` shapes) for a weight ``w`` of this set: through
        ``gemv_q4`` when ``w`` has that layout (any number of rows), else ggml's ``mul_mat``."""
        packed = self._q4.get(_address(w)) if self._q4 else None
        if packed is not None:
            return gemv_q4.gemv_q4(ctx, x, packed)
        ncols = int(x.ne[1]) * int(x.ne[2]) * int(x.ne[3])
        if ncols > 1 and self._rowwise and _address(w) in self._rowwise:
            # ggml multiplies one F16/F32 column with a dot product and several with a tiled
            # GEMM that rounds differently: one column per batch entry (ne11 = 1) gives every
            # column the bits it gets alone, so a quantised talker's batched rows stay bit for
            # bit their rows alone even with the converter's F16 fallbacks
            xc = x if lib.ggml_is_contiguous(x) else lib.ggml_cont(ctx, x)
            y = lib.ggml_mul_mat(ctx, w, lib.ggml_reshape_3d(ctx, xc, int(x.ne[0]), 1, ncols))
            return lib.ggml_reshape_4d(ctx, y, int(w.ne[1]), int(x.ne[1]), int(x.ne[2]),
                                       int(x.ne[3]))
        return lib.ggml_mul_mat(ctx, w, x)

    @property
    def q4_matrices(self) -> int:
        """How many matrices multiply through ``gemv_q4``."""
        return len(self._q4)

    @property
    def int8_prefill(self) -> bool:
        """Whether the talker's layers have int8 copies for multi-row graphs."""
        return bool(self.layers) and self.layers[0].i8 is not None

    @property
    def i8_nbytes(self) -> int:
        """Bytes of the int8 copies (0 without them); part of ``nbytes``."""
        return sum(int(lib.ggml_nbytes(t)) for lw in self.layers if lw.i8 is not None
                   for m in lw.i8.values() for t in (m.wq, m.ws, m.wc))

    @property
    def nbytes(self) -> int:
        """Bytes of weight data bound, uploaded or repacked."""
        return int(self.store.nbytes) + (self.repacked.nbytes if self.repacked else 0)

    def close(self) -> None:
        """Release the weight buffers."""
        self.store.close()
        if self.repacked is not None:
            self.repacked.close()


class _Repacked:
    """Q4_0 matrices in the CPU backend's ``CPU_REPACK`` buffer (re-laid out at upload)."""

    def __init__(self, backends: BackendSet, max_tensors: int) -> None:
        self.buft = cpu_repack_buffer_type(backends)
        self.ctx = no_alloc_context(max_tensors + 4, what="repacked weights")
        self.buffer: Any = None
        self._pending: list[tuple[Tensor, Any]] = []
        self.nbytes = 0

    def add(self, name: str, ggml_type: int, shape: tuple[int, ...], data: Any) -> Tensor:
        t = set_name(new_tensor(self.ctx, ggml_type, shape), name)
        self._pending.append((t, data))
        return t

    def allocate(self) -> None:
        if not self._pending:
            return
        self.buffer = lib.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, self.buft)
        if self.buffer == NULL:
            raise BackendError("cannot allocate the CPU_REPACK weight buffer")
        lib.ggml_backend_buffer_set_usage(self.buffer, lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
        for t, data in self._pending:
            n = int(lib.ggml_nbytes(t))
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(data), 0, n)  # repacks
            self.nbytes += n
        self._pending.clear()

    def close(self) -> None:
        if self.buffer is not None and self.buffer != NULL:
            lib.ggml_backend_buffer_free(self.buffer)
        self.buffer = None
        if self.ctx is not None:
            lib.ggml_free(self.ctx)
            self.ctx = None


def cpu_repack_buffer_type(backends: BackendSet) -> Any | None:
    """The CPU backend's ``CPU_REPACK`` buffer type, or None (other primary, or not built)."""
    if backends.primary != backends.cpu:
        return None
    dev = backends.choice.device.handle
    reg = lib.ggml_backend_dev_backend_reg(dev)
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if fn == NULL:
        return None
    bufts = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(dev)
    i = 0
    while bufts != NULL and bufts[i] != NULL:
        if ffi.string(lib.ggml_backend_buft_name(bufts[i])) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


def gemv_q4_possible(backends: BackendSet) -> bool:
    """Whether Q4_0 matrices can take ``gemv_q4``'s layout: the primary backend is the CPU,
    qtts's custom ops are on (``QTTS_CUSTOM_OPS``) and libqtts_ops has the VNNI kernel (the
    portable one gives the same bits, slower than ggml's repacked GEMV)."""
    return (backends.primary == backends.cpu and backends.custom_ops
            and gemv_q4.fast_available())


def _is_matrix(name: str) -> bool:
    """A weight the talker multiplies by (``TalkerWeights.mul_mat``), not a norm or a table."""
    return name.endswith(_MATMUL_SUFFIXES) or name.startswith(_CP_HEAD)


def _address(t: Tensor) -> int:
    return int(ffi.cast("uintptr_t", t))


def int8_prefill_possible(model: Any, backends: BackendSet) -> bool:
    """Whether the talker's prefill can take int8 copies: its matrices are Q8_0/Q4_0 (already
    rounded by choice), the primary backend is the CPU and qtts's custom ops are on
    (``QTTS_CUSTOM_OPS``), as for the decoder's kernels, and libqtts_ops has the VNNI kernel
    (the portable one is exact but slower than ggml's GEMM)."""
    if (backends.primary != backends.cpu or not backends.custom_ops
            or not gemm_i8.fast_available()):
        return False
    name = "talk.blk.0.attn_q.weight"
    return name in model.tensor_names() and model.tensor_info(name).ggml_type in I8_TYPES


def _layer(w: dict[str, Tensor], g: str) -> LayerWeights:
    return LayerWeights(
        attn_norm=w[g + "attn_norm.weight"],
        q_norm=w[g + "attn_q_norm.weight"],
        k_norm=w[g + "attn_k_norm.weight"],
        ffn_norm=w[g + "ffn_norm.weight"],
        **{f: w[g + suffix] for f, suffix in I8_MATRICES.items()},
    )
