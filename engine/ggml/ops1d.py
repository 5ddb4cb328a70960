"""Time-major 1-D convolutions for the cloning encoders (F32, or split BF16).

Layout: the decoder's: an activation of numpy shape ``[T, C]`` is a ggml tensor ``ne = [C, T]``
(channels contiguous, one row per time step). Every conv runs on qtts's direct F32 conv kernel
(``conv1d_tm``, native/ops/conv1d_tm.c), which reads its input in place: no unfolded (im2col)
copy of the input is ever made, and the bias comes with the conv.

* Left padding never copies the activation: the kernel takes the rows before the input as a
  tensor of their own (``hist``), e.g. a view of a zero buffer.
* A strided conv is *folded* into a stride-1 conv: ``s`` consecutive time steps taken as one
  row of ``s * C`` channels is a free reshape of a time-major tensor, and a kernel of ``K`` taps
  with stride ``s`` becomes ``ceil(K / s)`` taps over those rows (``fold_weight``).
* ``winograd`` (the speech-tokenizer encoder): 2-tap (folded strided) and 3-tap convs run in
  Winograd groups on the same kernel, F32 throughout (:meth:`ConvForm.wino`).

Backends other than the CPU (and ``QTTS_CUSTOM_OPS=0``) run the same graphs with stock ops: one
``ggml_mul_mat`` per tap over row views (:class:`ConvForm`).

``split``: the convs as split BF16 products on AMX tiles (``conv1d_tm_bf16`` with ``split``:
hi(W) hi(x) + hi(W) lo(x) + lo(W) hi(x), ~16 significant bits of each operand, an error of
F32's order) where that kernel runs: about twice the exact kernel's speed on a CPU with AMX.
For the speaker encoder, whose x-vector is compared within a tolerance; never for the
speech-tokenizer encoder, whose codes come from nearest-entry decisions that F32 rounding
already brings to ties (docs/performance.md: the code-identity study).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.ggml import Tensor, lib
from engine.ggml import custom_ops as co


def fold_weight(w: npt.NDArray[np.float32], stride: int) -> npt.NDArray[np.float32]:
    """Conv weight ``[C_out, C_in, K]`` with stride ``s`` -> the stride-1 weight
    ``[C_out, s * C_in, ceil(K / s)]`` over folded rows: ``W'[o, r*C_in + c, m] = W[o, c, m*s + r]``
    (taps past ``K`` are zero)."""
    c_out, c_in, k = w.shape
    if stride == 1:
        return np.ascontiguousarray(w, dtype=np.float32)
    k2 = -(-k // stride)
    wp = np.zeros((c_out, c_in, k2 * stride), np.float32)
    wp[:, :, :k] = w
    folded = wp.reshape(c_out, c_in, k2, stride).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(folded.reshape(c_out, stride * c_in, k2))


def direct_available(backends: Any) -> bool:
    """Whether ``backends`` runs qtts's direct conv kernel (a CPU backend with the native ops
    built and not switched off by ``QTTS_CUSTOM_OPS=0``); accelerators keep the matmul form."""
    return bool(backends.custom_ops and backends.name in ("cpu", "blas") and co.available())


# folded C_in x C_out of the largest conv that runs in Winograd groups: 16 MB of packed F32
# weights for F(3, 2) (docs/performance.md, session 33: the last stage's 4M conv gained nothing,
# its time going to reading twice the weights from memory)
WINO_MAX_WEIGHTS = 1 << 20


class ConvForm:
    """How one encoder's convs run: ``direct`` on the native kernel (weights packed for it;
    ``split``: the split BF16 one; ``winograd``: the exact one with Winograd groups where
    :meth:`wino` says so), else as one ``ggml_mul_mat`` per tap over row views (stock ops, any
    backend)."""

    def __init__(self, direct: bool, split: bool = False, winograd: bool = False) -> None:
        self.direct = direct
        self.split = direct and split
        self.winograd = direct and not split and winograd

    @classmethod
    def split_where_fast(cls, direct: bool) -> ConvForm:
        """The split form where its kernel runs on AMX tiles, else the exact one."""
        return cls(direct, split=direct and co.amx())

    @property
    def weight_type(self) -> int:
        """The ggml type :meth:`pack`'s arrays are stored as (they are given as float32)."""
        return int(lib.GGML_TYPE_BF16 if self.split else lib.GGML_TYPE_F32)

    def pack(self, w: npt.NDArray[np.float32], stride: int = 1, dilation: int = 1
             ) -> npt.NDArray[np.float32]:  # fmt: skip
        """PyTorch conv weight ``[C_out, C_in, K]`` -> what :meth:`conv` takes (load time), for
        Winograd groups where :meth:`wino` says so."""
        f = fold_weight(w, stride)
        c_out, c_in, k = w.shape
        if self.wino(k, stride, c_in, c_out, dilation):
            return co.pack_conv_weight_winograd(f)
        if self.split:
            return co.pack_conv_weight_bf16_split(f)
        if self.direct:
            return co.pack_conv_weight(f)
        return np.ascontiguousarray(f.transpose(2, 0, 1))  # [K, C_out, C_in]: a matrix a tap

    def wino(self, kernel: int, stride: int, c_in: int, c_out: int, dilation: int = 1) -> bool:
        """Whether a conv ``c_in -> c_out`` of ``kernel`` taps, ``stride`` and ``dilation`` runs
        in Winograd groups on the exact direct kernel: a strided conv that folds to 2 taps
        (F(3, 2)) or a stride-1 conv of 3 taps and dilation 1 (F(2, 3)), four products over the
        input channels for every three or two outputs instead of six (the codes against the
        reference: docs/performance.md). The packed weight holds two taps more, so a conv whose
        weights already stream from memory (the encoder's last stage) stays direct."""
        taps = -(-kernel // stride)
        return (self.winograd and dilation == 1
                and (taps == 2 if stride > 1 else kernel == 3)
                and stride * c_in * c_out <= WINO_MAX_WEIGHTS)  # fmt: skip

    def taps(self, w: Tensor, wino: bool = False) -> int:
        """Taps of a packed (folded) weight (the split layout holds each tap's hi and lo, the
        Winograd one two more)."""
        if wino:
            return int(w.ne[2]) - 2
        return int(w.ne[2]) // 2 if self.split else int(w.ne[2])

    def conv(self, ctx: Any, w: Tensor, b: Tensor, x: Tensor, *, dilation: int = 1,
             hist: Tensor | None = None, wino: bool = False) -> Tensor:  # fmt: skip
        """Stride-1 conv of ``x`` [T, C_in] (plus the ``(K-1)*dilation`` rows of ``hist``
        before it, or already in front of ``x`` when ``hist`` is None) -> ``[T_out, C_out]``;
        ``b``: F32 [C_out]; ``wino``: ``w`` packed for Winograd groups (:meth:`wino`)."""
        k = self.taps(w, wino)
        if k == 1:
            hist = None
        if self.split:
            return co.conv1d_tm_bf16(ctx, x, w, b, dilation, hist=hist, split=True)
        if self.direct:
            return co.conv1d_tm(ctx, x, w, b, dilation, hist=hist, wino=wino)
        xp = x if hist is None else lib.ggml_concat(ctx, hist, x, 1)
        c_in, c_out = int(w.ne[0]), int(w.ne[1])
        t = int(xp.ne[1]) - (k - 1) * dilation
        y: Tensor | None = None
        for j in range(k):
            wj = lib.ggml_view_2d(ctx, w, c_in, c_out, w.nb[1], j * w.nb[2])
            xj = lib.ggml_view_2d(ctx, xp, c_in, t, xp.nb[1], j * dilation * xp.nb[1])
            p = lib.ggml_mul_mat(ctx, wj, xj)
            y = p if y is None else lib.ggml_add(ctx, y, p)
        assert y is not None
        return lib.ggml_add(ctx, y, b)

    def conv_strided(self, ctx: Any, w: Tensor, b: Tensor, xp: Tensor, stride: int,
                     hist: Tensor | None = None, wino: bool = False) -> Tensor:  # fmt: skip
        """A folded stride-``s`` conv: ``xp`` [L, C_in] (contiguous, ``L`` a multiple of ``s``)
        read as ``[L / s, s * C_in]``; ``hist``: folded rows before it (``[K' - 1, s * C_in]``);
        ``wino``: ``w`` packed for Winograd groups (:meth:`wino`)."""
        c, n = int(xp.ne[0]), int(xp.ne[1])
        if n % stride:
            raise ValueError(f"conv_strided: {n} rows are not a multiple of the stride {stride}")
        folded = lib.ggml_reshape_2d(ctx, xp, c * stride, n // stride)
        return self.conv(ctx, w, b, folded, hist=hist, wino=wino)

    def join(self, ctx: Any, parts: list[Tensor]) -> Tensor:
        """``[T, C_0 + C_1 + ...]`` from time-major parts (channel-range views too): the native
        join (a memcpy per part and row), or ggml's CONCAT two at a time."""
        if self.direct and len(parts) <= co.MAX_CUSTOM_SOURCES:
            return co.channel_join(ctx, parts)
        out = parts[0] if lib.ggml_is_contiguous(parts[0]) else lib.ggml_cont(ctx, parts[0])
        for p in parts[1:]:
            out = lib.ggml_concat(ctx, out, p, 0)
        return out

    def channel_major(self, ctx: Any, x: Tensor) -> Tensor:
        """Time-major ``x`` [T, C] (contiguous rows) -> channel-major (ne ``[T, C]``: each
        channel's T values contiguous): the native transposing copy (16 channels a load, each
        row filled in order), or ggml's copy of a transposed view (one strided element a step)."""
        if self.direct and int(x.nb[0]) == 4:
            dst = lib.ggml_new_tensor_2d(ctx, lib.GGML_TYPE_F32, int(x.ne[1]), int(x.ne[0]))
            return co.kv_write_transposed(ctx, dst, x)
        return lib.ggml_cont(ctx, lib.ggml_transpose(ctx, x))

    def elu(self, ctx: Any, x: Tensor) -> Tensor:
        """ELU: the vectorised native op, or ggml's."""
        return co.elu(ctx, x) if self.direct else lib.ggml_elu(ctx, x)

    def gelu_erf(self, ctx: Any, x: Tensor) -> Tensor:
        """GELU with the exact erf: the vectorised native op, or ggml's (libm per element)."""
        return co.gelu_erf(ctx, x) if self.direct else lib.ggml_gelu_erf(ctx, x)

    def argmax(self, ctx: Any, x: Tensor) -> Tensor:
        """Row argmax (I32): the native op (every thread; ties to the first index, as the
        reference's argmin), or ggml's (one thread; ties to the last)."""
        return co.argmax(ctx, x) if self.direct else lib.ggml_argmax(ctx, x)


def zeros(ctx: Any, buf: Tensor, c: int, n: int) -> Tensor:
    """``[n, c]`` zeros: a view of the zero buffer ``buf`` (F32, at least ``c * n`` values)."""
    if c * n > int(lib.ggml_nelements(buf)):
        raise ValueError(f"zero buffer of {int(lib.ggml_nelements(buf))} values < {c}x{n}")
    return lib.ggml_view_2d(ctx, buf, c, n, c * 4, 0)


def pad_zero(ctx: Any, x: Tensor, left: int, right: int) -> Tensor:
    """Zero padding along time (a copy)."""
    if left == 0 and right == 0:
        return x
    return lib.ggml_pad_ext(ctx, x, 0, 0, left, right, 0, 0, 0, 0)


def row(ctx: Any, x: Tensor, t: int) -> Tensor:
    """Time step ``t`` of ``x`` as ne ``[C, 1]`` (a view)."""
    return lib.ggml_view_2d(ctx, x, int(x.ne[0]), 1, x.nb[1], t * x.nb[1])


def repeat_row(ctx: Any, r: Tensor, n: int) -> Tensor:
    """One row ``[1, C]`` repeated ``n`` times: ``[n, C]``."""
    return lib.ggml_repeat_4d(ctx, r, int(r.ne[0]), n, 1, 1)


def channels(ctx: Any, x: Tensor, start: int, n: int) -> Tensor:
    """Channels ``start .. start+n`` of ``x`` [T, C] (a view; rows stay contiguous)."""
    return lib.ggml_view_2d(ctx, x, n, int(x.ne[1]), x.nb[1], start * x.nb[0])


def reflect_index(t: int, left: int, right: int) -> npt.NDArray[np.int32]:
    """Row indices of a PyTorch ``mode="reflect"`` padding of ``t`` rows (edge not repeated)."""
    if left >= t or right >= t:
        raise ValueError(f"reflect padding {left}/{right} needs more than {t} rows")
    idx = np.arange(-left, t + right)
    idx = np.where(idx < 0, -idx, idx)
    idx = np.where(idx >= t, 2 * (t - 1) - idx, idx)
    return idx.astype(np.int32)


def gather_rows(ctx: Any, x: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx`` (int32 [n]) of ``x`` [T, C] -> ``[n, C]`` (reflect padding in one copy)."""
    return lib.ggml_get_rows(ctx, x, idx)
