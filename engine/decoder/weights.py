"""Decoder weights, laid out for the time-major graphs and allocated on a BackendSet.

Activations in the decoder graphs are time-major: a ggml tensor ne = [C, T] (numpy [T, C]), so
every conv tap, transposed-conv phase and linear layer is one ``mul_mat(W, x)`` with W = [out, in]
and its rows contiguous. This module turns the GGUF's PyTorch-layout tensors into that form once
at load and folds the constants:

* codebooks: ``E_q = embed_sum_q / max(usage_q, eps)``;
* SnakeBeta: ``exp(alpha)`` and ``1 / (exp(beta) + 1e-9)``;
* conv ``[O, I, K]`` -> taps ``[K, O, I]``; transposed conv ``[I, O, 2s]`` -> two phase matrices
  ``[s*O, I]``; depthwise ``[C, 1, K]`` -> taps ``[K, C]``.

On the CPU with qtts's native ops, convs, transposed convs (as 1-2 tap convs of their phases)
and linear layers (as 1-tap convs) are instead packed for the direct conv kernels.

Precision: ``exact`` keeps every weight F32 (parity mode); ``fast`` stores the weights of the
wave generator (decoder.0-6) and the upsampler's pointwise layers as BF16 (~2x the F32
throughput here), except the layers ``f32_layers`` keeps in F32 (by default the first ones,
whose rounding the rest amplifies: engine/decoder/precision.py); everything else stays F32.
Where qtts's convs run without their BF16 kernel (a CPU without AVX512-BF16), fast mode keeps
them in F32 (``rounds_to_bf16``) and runs the wave generator's 7-tap and transposed convs by
Winograd F(6,7) / F(6,2) in F32 where that kernel has its AVX2 path (``winograd_f32``): ~90-100
dB per conv against float64, 1.4-3.9x the direct F32 conv; without it, the samples of exact mode.
With the BF16 kernel but no AMX tiles, the layers kept in F32 take the same F32 Winograd path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from engine.backend import BackendSet, WeightStore
from engine.decoder.precision import default_f32
from engine.errors import ModelFileError
from engine.ggml import Tensor, custom_ops, lib
from engine.ggml.graph import set_name
from engine.gguf_schema import DecoderConfig

Precision = Literal["exact", "fast"]
PRECISIONS: tuple[str, ...] = ("exact", "fast")
SNAKE_EPS = 1e-9


def native_convs(backends: BackendSet) -> bool:
    """Whether the decoder runs qtts's direct conv kernels on these backends: they beat ggml's
    K mul_mats on the CPU (bench/kernels.py) and run on the CPU backend only, so accelerators
    keep the mul_mat form."""
    return backends.custom_ops and backends.name in ("cpu", "blas") and custom_ops.available()


def rounds_to_bf16(backends: BackendSet) -> bool:
    """Whether fast mode rounds the wave generator's weights and inputs to BF16 here: through
    qtts's BF16 conv kernel where it is built for this CPU (AVX512-BF16), or ggml's BF16
    mul_mats where qtts's convs do not run. Otherwise (qtts's convs without that kernel: its
    portable path is slower than F32) fast mode runs the F32 convs, bit for bit exact mode."""
    return not native_convs(backends) or custom_ops.bf16_available()


def winograd_f32(backends: BackendSet) -> bool:
    """Whether fast mode runs its F32 7-tap and transposed convs by qtts's F32 Winograd kernel
    here (those whose weight suits it: ``WINOGRAD_F32_MAX_BYTES``): qtts's convs run, the
    Winograd kernel has its SIMD path (the portable one is slower than the direct conv), and
    the layers fast mode keeps out of BF16 are not split BF16 products on AMX tiles. Without
    the BF16 kernel that is every such conv of the wave generator; with it, the ones kept in
    F32 (the transposed convs, layers the calibration promoted). ``QTTS_WINOGRAD=0`` turns it
    off."""
    return (native_convs(backends) and custom_ops.wino_f32_available()
            and backends.options.winograd and not split_kept(backends))


def split_kept(backends: BackendSet) -> bool:
    """Whether fast mode's layers kept out of BF16 run as split BF16 products here (``Conv``'s
    ``split``): qtts's convs with the BF16 kernel on AMX tiles (QTTS_AMX on; like loading the
    decoder, this applies that setting to the process). Elsewhere they run in F32."""
    return (native_convs(backends) and custom_ops.bf16_available()
            and custom_ops.set_amx(backends.options.amx))


@dataclass
class Conv:
    """A causal conv and its bias, in one of two forms.

    ``packed``: weights blocked for qtts's direct conv kernel (exact F32, CPU; see
    engine/ggml/custom_ops.py). Otherwise ``taps``: one [O, I] matrix per tap (views of one
    [K, O, I] tensor), each a ggml mul_mat (any backend, F32 or BF16).
    """

    taps: list[Tensor]
    packed: Tensor | None
    bias: Tensor
    kernel: int
    c_in: int
    c_out: int
    # packed for a Winograd kernel (fast mode): conv1d_wino_bf16 (K = 7 or 2; a BF16 packed
    # weight) or conv1d_wino_f32 (K = 7 or 2; an F32 one)
    winograd: bool = False
    # packed for conv1d_tm_bf16's split products (fast mode's layers kept out of BF16, on AMX)
    split: bool = False


@dataclass
class TConv:
    """A causal transposed conv (k = s or 2s) in polyphase form.

    Either phase matrices [s*O, I] for ggml mul_mats (``cur``; ``prev`` for k = 2s), or the
    same phases as a 1- or 2-tap causal conv [s*O, I, k/s] for the direct kernel (``conv``),
    whose bias is repeated per phase.
    """

    cur: Tensor | None
    prev: Tensor | None
    conv: Conv | None
    bias: Tensor | None  # the mul_mat form's bias; the conv form carries its own
    stride: int
    c_in: int
    c_out: int


@dataclass
class Snake:
    """SnakeBeta constants folded at load."""

    exp_alpha: Tensor
    inv_beta: Tensor


@dataclass
class Linear:
    """y = W x (+ b): a ggml mul_mat of ``weight``, or (``conv``) a 1-tap conv on qtts's direct
    kernel, faster than ggml's matmul at the decoder's few-dozen-row inputs (bench/kernels.py)."""

    weight: Tensor | None
    bias: Tensor | None
    conv: Conv | None = None


@dataclass
class PreTransformerLayer:
    """One pre-norm transformer layer of the pre-transformer."""

    attn_norm: Tensor
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    attn_scale: Tensor
    ffn_norm: Tensor
    gate: Linear
    up: Linear
    down: Linear
    ffn_scale: Tensor


@dataclass
class ConvNeXt:
    """Upsampler ConvNeXt block."""

    dw_taps: list[Tensor]
    dw_bias: Tensor
    norm_w: Tensor
    norm_b: Tensor
    pw1: Linear
    pw2: Linear
    gamma: Tensor


@dataclass
class ResidualUnit:
    """snake -> dilated conv k7 -> snake -> conv 1x1, plus the skip."""

    snake1: Snake
    conv1: Conv
    snake2: Snake
    conv2: Conv
    dilation: int


@dataclass
class DecoderBlock:
    """snake -> transposed conv (upsample by ``rate``) -> three residual units."""

    snake: Snake
    tconv: TConv
    res: list[ResidualUnit]


RES_DILATIONS = (1, 3, 9)
# Fast mode's F32 Winograd convs carry (K + 5)/K times the direct weight: above this size a
# chunk's products cost less than streaming the larger weight (the first conv and the first
# transposed conv at 0.6B: 0.38-1.0x the direct conv; bench/kernels.py --only wino_f32).
WINOGRAD_F32_MAX_BYTES = 48 << 20


class DecoderWeights:
    """Every decoder weight on one BackendSet, grouped by stage."""

    def __init__(self, model: Any, backends: BackendSet, precision: Precision = "fast",
                 f32_layers: frozenset[str] | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.model = model
        self.cfg: DecoderConfig = model.decoder_config
        self.precision = precision
        # Fast mode's layers kept in F32 (GGUF prefixes, e.g. "dec.blk.1.tconv"): the ones
        # whose BF16 rounding the rest of the stack amplifies (engine/decoder/precision.py).
        self.f32_layers = default_f32(model) if f32_layers is None else f32_layers
        self.backends = backends
        self.store: WeightStore = backends.weight_store()
        self.use_custom_ops = native_convs(backends)
        self._bf16_kernel = self.use_custom_ops and custom_ops.bf16_available()
        # QTTS_AMX=0 keeps the BF16 convs off the AMX tiles (a process-wide switch of
        # libqtts_ops; the packed weights are the same either way).
        amx = self.use_custom_ops and custom_ops.set_amx(backends.options.amx)
        # Fast mode: BF16 only in the wave generator (decoder.0-6, nearly all of the FLOPs). The
        # pre-transformer and upsampler are a few % of the time but, in BF16, cost SNR against
        # the F32 reference out of proportion (docs/performance.md, Figures behind the code).
        self._bulk_type = lib.GGML_TYPE_BF16 if precision == "fast" else lib.GGML_TYPE_F32
        # Fast mode's K = 7 convs by Winograd F(2,3) and K = 2 ones (the transposed convs'
        # polyphase form) by F(2,2): faster than the direct BF16 kernel for a little SNR per conv
        # (native/ops/conv1d_wino_bf16.c; docs/performance.md, Figures behind the code).
        # On AMX tiles the direct conv is ~4x faster than Winograd on AVX512-BF16 (and more
        # accurate), so Winograd is used only where the direct conv runs on AVX512.
        self._winograd = self._bf16_kernel and backends.options.winograd and not amx
        # Fast mode's F32 7-tap and transposed convs (all of them without the BF16 kernel, the
        # kept ones beside it, unless those are split products on AMX tiles) by Winograd
        # F(6,7) / F(6,2) in F32: 12 (7) products per six outputs instead of 42 (12), ~90-100
        # dB per conv (conv1d_wino_f32.c).
        self._winograd_f32 = precision == "fast" and winograd_f32(backends)
        # On AMX tiles, fast mode's layers kept out of BF16 run as split BF16 products (hi and
        # lo parts of weights and inputs: an error of F32's order, ~2x faster than the F32
        # conv here; docs/performance.md, Session 28). Without AMX the split products cost
        # more than the F32 conv.
        self._split = precision == "fast" and split_kept(backends)
        cfg = self.cfg
        eps = cfg.codebook_eps
        self.codebooks = []
        for q in range(cfg.num_quantizers):
            emb = model.tensor_f32(f"dec.rvq.cb.{q}.embed_sum")
            usage = model.tensor_f32(f"dec.rvq.cb.{q}.usage")
            with np.errstate(all="ignore"):  # a damaged file: refused below, not warned about
                table = emb / np.maximum(usage, eps)[:, None]
            if not np.isfinite(table).all():
                raise ModelFileError(str(model.path), f"codebook dec.rvq.cb.{q} holds NaN or "
                                     "infinite values: the file is damaged")  # fmt: skip
            self.codebooks.append(self._f32(f"dec.rvq.cb.{q}.table", table))
        self.first_proj = self._linear("dec.rvq.first_proj", bias=False)
        self.rest_proj = self._linear("dec.rvq.rest_proj", bias=False)
        self.pre_conv = self._conv("dec.pre_conv")
        self.in_proj = self._linear("dec.pretr.in_proj")
        self.layers = [self._pretr_layer(i) for i in range(cfg.num_hidden_layers)]
        self.final_norm = self._f32("dec.pretr.norm.weight",
                                    model.tensor_f32("dec.pretr.norm.weight"))
        self.out_proj = self._linear("dec.pretr.out_proj")
        self.upsample = [
            (self._tconv(f"dec.up.{i}.tconv", r), self._convnext(f"dec.up.{i}"))
            for i, r in enumerate(cfg.upsampling_ratios)
        ]
        self.conv_in = self._conv("dec.conv_in", wave=True)  # BF16 (or Winograd) in fast mode
        self.blocks = [self._block(b + 1, rate) for b, (_, _, rate) in
                       enumerate(cfg.block_channels())]
        self.snake_out = self._snake("dec.snake_out")
        self.conv_out = self._conv("dec.conv_out", wave=True)
        self.store.allocate()

    @property
    def winograd(self) -> bool:
        """Whether some conv runs on a Winograd kernel, whose tiles start where a chunk starts:
        then the same samples decoded in another chunking differ by rounding."""
        return self.precision == "fast" and (self._winograd or self._winograd_f32)

    # -- loading helpers -----------------------------------------------------------------------
    def _f32(self, name: str, array: np.ndarray[Any, Any]) -> Tensor:
        return self.store.add_array(name, np.ascontiguousarray(array, dtype=np.float32))

    def _w(self, name: str, array: np.ndarray[Any, Any], bulk: bool = False) -> Tensor:
        """A matmul weight: BF16 in fast mode for the wave generator, else F32."""
        a = np.ascontiguousarray(array, dtype=np.float32)
        return self.store.add_array(name, a, self._bulk_type if bulk else lib.GGML_TYPE_F32)

    def _taps(self, name: str, taps: np.ndarray[Any, Any], bulk: bool) -> list[Tensor]:
        """[K, O, I] -> one [O, I] view per tap."""
        t = self._w(name, taps, bulk)
        k, o, i = taps.shape
        # Views made before allocation are initialised by the store's allocator.
        return [set_name(lib.ggml_view_2d(self.store.ctx, t, i, o, t.nb[1], j * t.nb[2]),
                         f"{name}.{j}") for j in range(k)]

    def _bulk(self, prefix: str, bulk: bool) -> bool:
        """Whether layer ``prefix`` runs in BF16 in fast mode (not when kept in F32)."""
        return bulk and prefix not in self.f32_layers

    def _conv(self, prefix: str, wave: bool = False) -> Conv:
        w = self.model.tensor_f32(f"{prefix}.weight")
        bias = self._f32(f"{prefix}.bias", self.model.tensor_f32(f"{prefix}.bias"))
        return self._conv_from(prefix, w, bias, wave)

    def _conv_from(self, prefix: str, w: np.ndarray[Any, Any], bias: Tensor, wave: bool
                   ) -> Conv:
        """A conv from its PyTorch weight [O, I, K], in the fastest form this backend runs
        (``wave``: a layer of the wave generator, which fast mode may round to BF16 or run by
        F32 Winograd)."""
        o, i, k = w.shape
        bulk = self._bulk(prefix, wave)
        if self.use_custom_ops:
            winograd = False
            if bulk and self._bulk_type == lib.GGML_TYPE_BF16 and self._bf16_kernel:
                winograd = self._winograd and k in (7, 2)
                pack = (custom_ops.pack_conv_weight_wino_bf16 if winograd
                        else custom_ops.pack_conv_weight_bf16)
                packed = self.store.add_array(f"{prefix}.packed_bf16", pack(w),
                                              lib.GGML_TYPE_BF16)
            elif wave and self._split:
                packed = self.store.add_array(f"{prefix}.packed_split",
                                              custom_ops.pack_conv_weight_bf16_split(w),
                                              lib.GGML_TYPE_BF16)
                return Conv([], packed, bias, k, i, o, split=True)
            elif (wave and self._winograd_f32 and k in (7, 2)
                  and w.size * (k + 5) // k * 4 <= WINOGRAD_F32_MAX_BYTES):
                # F32 Winograd also on the layers kept out of BF16 (its error is F32 rounding's)
                winograd = True
                packed = self._f32(f"{prefix}.packed_wino",
                                   custom_ops.pack_conv_weight_wino_f32(w))
            else:
                packed = self._f32(f"{prefix}.packed", custom_ops.pack_conv_weight(w))
            return Conv([], packed, bias, k, i, o, winograd)
        taps = self._taps(f"{prefix}.taps", w.transpose(2, 0, 1), bulk)
        return Conv(taps, None, bias, k, i, o)

    def _tconv(self, prefix: str, stride: int, wave: bool = False) -> TConv:
        w: np.ndarray[Any, Any] = self.model.tensor_f32(f"{prefix}.weight")  # [I, O, K]
        i, o, k = w.shape
        if k not in (stride, 2 * stride):
            raise ModelFileError(str(self.model.path),
                                 f"{prefix}.weight: kernel {k} is neither stride {stride} nor 2x")

        def phase(sl: slice) -> np.ndarray[Any, Any]:
            return w[:, :, sl].transpose(2, 1, 0).reshape(stride * o, i)  # [s*O, I]

        cur = phase(slice(0, stride))
        prev = phase(slice(stride, 2 * stride)) if k == 2 * stride else None
        bias_np = self.model.tensor_f32(f"{prefix}.bias")
        if self.use_custom_ops:
            # y[t] (all s phases) = W_prev x[t-1] + W_cur x[t]: a causal conv with k/s taps.
            taps = [cur] if prev is None else [prev, cur]
            conv = self._conv_from(prefix, np.stack(taps, axis=2),
                                   self._f32(f"{prefix}.bias_phases", np.tile(bias_np, stride)),
                                   wave)
            return TConv(None, None, conv, None, stride, i, o)
        bulk = self._bulk(prefix, wave)
        return TConv(self._w(f"{prefix}.cur", cur, bulk),
                     self._w(f"{prefix}.prev", prev, bulk) if prev is not None else None,
                     None, self._f32(f"{prefix}.bias", bias_np), stride, i, o)

    def _snake(self, prefix: str) -> Snake:
        alpha = self.model.tensor_f32(f"{prefix}.alpha").astype(np.float64)
        beta = self.model.tensor_f32(f"{prefix}.beta").astype(np.float64)
        return Snake(self._f32(f"{prefix}.exp_alpha", np.exp(alpha)),
                     self._f32(f"{prefix}.inv_beta", 1.0 / (np.exp(beta) + SNAKE_EPS)))

    def _linear(self, prefix: str, bias: bool = True, wave: bool = False) -> Linear:
        w_np = self.model.tensor_f32(f"{prefix}.weight")
        b = self._f32(f"{prefix}.bias", self.model.tensor_f32(f"{prefix}.bias")) if bias else None
        if self.use_custom_ops:  # the kernel always adds a bias: zeros when the layer has none
            b_conv = b if b is not None else self._f32(f"{prefix}.zero_bias",
                                                       np.zeros(w_np.shape[0], np.float32))
            return Linear(None, b, self._conv_from(prefix, w_np[:, :, None], b_conv, wave))
        return Linear(self._w(f"{prefix}.weight", w_np, self._bulk(prefix, wave)), b)

    def _pretr_layer(self, i: int) -> PreTransformerLayer:
        p = f"dec.pretr.blk.{i}"

        def f(n: str) -> Tensor:
            return self._f32(f"{p}.{n}", self.model.tensor_f32(f"{p}.{n}"))

        def w(n: str) -> Linear:
            return self._linear(f"{p}.{n}", bias=False)

        return PreTransformerLayer(
            attn_norm=f("attn_norm.weight"), q=w("attn_q"), k=w("attn_k"), v=w("attn_v"),
            o=w("attn_out"), attn_scale=f("attn_scale"), ffn_norm=f("ffn_norm.weight"),
            gate=w("ffn_gate"), up=w("ffn_up"), down=w("ffn_down"), ffn_scale=f("ffn_scale"),
        )

    def _convnext(self, p: str) -> ConvNeXt:
        dw = self.model.tensor_f32(f"{p}.dwconv.weight")  # [C, 1, K]
        c, _, k = dw.shape
        dw_t = self._f32(f"{p}.dwconv.taps", dw[:, 0, :].T)  # [K, C]
        return ConvNeXt(
            dw_taps=[set_name(lib.ggml_view_1d(self.store.ctx, dw_t, c, j * dw_t.nb[1]),
                              f"{p}.dwconv.taps.{j}") for j in range(k)],
            dw_bias=self._f32(f"{p}.dwconv.bias", self.model.tensor_f32(f"{p}.dwconv.bias")),
            norm_w=self._f32(f"{p}.norm.weight", self.model.tensor_f32(f"{p}.norm.weight")),
            norm_b=self._f32(f"{p}.norm.bias", self.model.tensor_f32(f"{p}.norm.bias")),
            pw1=self._linear(f"{p}.pwconv1", wave=True),
            pw2=self._linear(f"{p}.pwconv2", wave=True),
            gamma=self._f32(f"{p}.gamma", self.model.tensor_f32(f"{p}.gamma")),
        )

    def _block(self, b: int, rate: int) -> DecoderBlock:
        p = f"dec.blk.{b}"
        res = []
        for r, d in enumerate(RES_DILATIONS):
            q = f"{p}.res.{r}"
            res.append(ResidualUnit(self._snake(f"{q}.snake1"), self._conv(f"{q}.conv1", True),
                                    self._snake(f"{q}.snake2"), self._conv(f"{q}.conv2", True), d))
        return DecoderBlock(self._snake(f"{p}.snake"), self._tconv(f"{p}.tconv", rate, True), res)

    def close(self) -> None:
        """Free the weight buffers."""
        self.store.close()
