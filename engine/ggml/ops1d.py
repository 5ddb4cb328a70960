"""Channel-major 1-D building blocks on ggml for the cloning encoders (F32 throughout).

Layout: an activation is numpy ``[C, T]`` (ggml ``ne = [T, C]``): time is contiguous, so
reflect/zero padding and convolutions work along ``ne0``. ggml's own ``ggml_conv_1d`` builds an
F16 im2col, which costs the 1e-4 parity the encoders need; :func:`conv1d` keeps F32.
"""

from __future__ import annotations

from typing import Any

from engine.ggml import Tensor, lib


def conv1d(ctx: Any, w: Tensor, x: Tensor, stride: int = 1, dilation: int = 1) -> Tensor:
    """Valid (unpadded) conv of ``x`` [C_in, T] with ``w`` [C_out, C_in, K] -> [C_out, T_out]."""
    k, c_in, c_out = int(w.ne[0]), int(w.ne[1]), int(w.ne[2])
    if k == 1 and stride == 1:
        # a pointwise conv is one matrix product: [T, C_in] x [C_out, C_in]^T
        xt = lib.ggml_cont(ctx, lib.ggml_transpose(ctx, x))
        y = lib.ggml_mul_mat(ctx, xt, lib.ggml_reshape_2d(ctx, w, c_in, c_out))
        return y
    cols = lib.ggml_im2col(ctx, w, x, stride, 0, 0, 0, dilation, 0, False, lib.GGML_TYPE_F32)
    # cols: ne [C_in*K, T_out]; result ne [T_out, C_out]
    cols2 = lib.ggml_reshape_2d(ctx, cols, int(cols.ne[0]), int(cols.ne[1]) * int(cols.ne[2]))
    return lib.ggml_mul_mat(ctx, cols2, lib.ggml_reshape_2d(ctx, w, k * c_in, c_out))


def add_channel_bias(ctx: Any, x: Tensor, b: Tensor) -> Tensor:
    """``x`` [C, T] plus a per-channel bias ``b`` [C]."""
    return lib.ggml_add(ctx, x, lib.ggml_reshape_2d(ctx, b, 1, int(b.ne[0])))


def mul_channel(ctx: Any, x: Tensor, s: Tensor) -> Tensor:
    """``x`` [C, T] times a per-channel scale ``s`` [C]."""
    return lib.ggml_mul(ctx, x, lib.ggml_reshape_2d(ctx, s, 1, int(s.ne[0])))


def rows(ctx: Any, x: Tensor, start: int, n: int) -> Tensor:
    """Channels ``start .. start+n`` of ``x`` [C, T] (a view)."""
    return lib.ggml_view_2d(ctx, x, int(x.ne[0]), n, x.nb[1], start * x.nb[1])


def pad_reflect(ctx: Any, x: Tensor, left: int, right: int) -> Tensor:
    """Reflect padding along time (PyTorch ``mode="reflect"``)."""
    if left == 0 and right == 0:
        return x
    return lib.ggml_pad_reflect_1d(ctx, x, left, right)


def pad_zero(ctx: Any, x: Tensor, left: int, right: int) -> Tensor:
    """Zero padding along time."""
    if left == 0 and right == 0:
        return x
    return lib.ggml_pad_ext(ctx, x, left, right, 0, 0, 0, 0, 0, 0)


def pad_replicate_left(ctx: Any, x: Tensor, n: int) -> Tensor:
    """Repeat the first time step ``n`` times in front (PyTorch ``mode="replicate"``, left)."""
    if n == 0:
        return x
    first = lib.ggml_view_2d(ctx, x, 1, int(x.ne[1]), x.nb[1], 0)
    rep = lib.ggml_repeat_4d(ctx, first, n, int(x.ne[1]), 1, 1)
    return lib.ggml_concat(ctx, rep, x, 0)
