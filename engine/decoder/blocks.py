"""Graph blocks shared by the decoder stages, in the time-major layout (ne = [C, T]).

Every block that looks back in time reads its history from a *carried* tensor: the last
``(k-1)*d`` input rows of a causal conv, the previous input row of a transposed conv, the last
``window-1`` keys/values of an attention layer. A ``StageGraph`` declares each carried tensor
as an input (zeros at the start of an utterance, which is exactly the reference's zero padding)
and its continuation as an output, so one call per chunk equals one pass over the whole input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.decoder.weights import Conv, Linear, Snake, TConv
from engine.ggml import Graph, Tensor, custom_ops, lib
from engine.ggml.graph import set_name


class StageGraph(Graph):
    """A Graph plus the carried state it reads and writes."""

    def __init__(self, state: dict[str, np.ndarray[Any, Any]], use_custom_ops: bool = False,
                 capture: bool = False, max_matmul_rows: int | None = None,
                 max_nodes: int | None = None) -> None:
        # Row-limited backends split every matmul: room for many more nodes.
        super().__init__(max_nodes or (8192 if max_matmul_rows is None else 65536))
        self.state = state
        self.use_custom_ops = use_custom_ops
        self.capture = capture
        self.max_matmul_rows = max_matmul_rows

    def mul_mat(self, w: Tensor, x: Tensor) -> Tensor:
        """``W x`` for a time-major x, split into row chunks when the backend limits src1 rows.

        Each chunk is its own MUL_MAT, small enough to stay on a row-limited accelerator; the
        chunks are joined along time. On the CPU the result equals the unsplit product.
        """
        return self.by_rows(x, lambda xc: lib.ggml_mul_mat(self.ctx, w, xc))

    def by_rows(self, x: Tensor, fn: Callable[[Tensor], Tensor], n_rows: int | None = None
                ) -> Tensor:
        """``fn`` over row chunks of ``x`` (one chunk when the backend has no row limit).

        ``n_rows`` is the number of output rows when ``x`` carries extra history rows in front
        (chunk ``i`` then sees rows ``start .. start + len + extra``). The chunks are written
        into one full-size tensor by a chain of SET_ROWS (each writes into the result of the
        previous one), so every row is copied once; the full-size tensor itself comes from a
        REPEAT of one row (its values are all overwritten), the cheapest stock op that makes
        one (a PAD of the first chunk costs more on the CPU). A tree of concats copied each row
        log2(chunks) times (docs/performance.md, Figures behind the code). REPEAT and SET_ROWS
        are ops every backend with a row limit has, unlike SET.
        """
        t = int(x.ne[1]) if n_rows is None else n_rows
        extra = int(x.ne[1]) - t
        rows_max = self.max_matmul_rows
        if rows_max is None or t <= rows_max:
            return fn(x)
        ctx = self.ctx
        parts = [(start, fn(rows(ctx, x, start, min(rows_max, t - start) + extra)))
                 for start in range(0, t, rows_max)]
        first = parts[0][1]
        width = int(first.ne[0])
        out = lib.ggml_repeat_4d(ctx, lib.ggml_view_1d(ctx, first, width, 0), width, t, 1, 1)
        index = self._row_index(t)
        for start, part in parts:
            at = lib.ggml_view_1d(ctx, index, int(part.ne[1]), start * index.nb[0])
            out = lib.ggml_set_rows(ctx, out, part, at)
        return out

    def _row_index(self, n: int) -> Tensor:
        """The input holding 0 .. n-1 (the row numbers SET_ROWS writes), one per length."""
        name = f"row_index.{n}"
        if name not in self.inputs:
            self.input(name, (n,), np.int32)
        return self.inputs[name]

    def tap(self, t: Tensor, name: str) -> Tensor:
        """Name an intermediate; with ``capture`` on, also read it back (for parity checks)."""
        set_name(t, name)
        if self.capture:
            self.output(t, f"tap.{name}")
        return t

    def carried(self, key: str, shape: Sequence[int]) -> Tensor:
        """The carried tensor ``key`` (numpy-order ``shape``), zeros on first use."""
        if key not in self.state:
            self.state[key] = np.zeros(tuple(shape), dtype=np.float32)
        return self.input(f"in.{key}", shape)

    def carry(self, key: str, t: Tensor) -> None:
        """Declare ``t`` the continuation of carried tensor ``key`` (read back after compute)."""
        self.output(lib.ggml_cont(self.ctx, t), f"out.{key}")

    def uploads(self, **inputs: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        """Stage inputs plus every carried tensor, keyed by graph input name."""
        up = {f"in.{k}": v for k, v in self.state.items() if f"in.{k}" in self.inputs}
        for name, t in self.inputs.items():
            if name.startswith("row_index."):
                up[name] = np.arange(int(t.ne[0]), dtype=np.int32)
        up.update(inputs)
        return up

    def update_state(self, outputs: dict[str, np.ndarray[Any, Any]]) -> None:
        """Store the continuations computed by this graph."""
        for name, arr in outputs.items():
            if name.startswith("out."):
                self.state[name[4:]] = arr


def rows(ctx: Any, x: Tensor, start: int, n: int) -> Tensor:
    """Time steps ``start .. start+n`` of a time-major [C, T] tensor, as a view."""
    return lib.ggml_view_2d(ctx, x, x.ne[0], n, x.nb[1], start * x.nb[1])


def with_history(g: StageGraph, key: str, x: Tensor, n_hist: int) -> Tensor:
    """``x`` with its carried ``n_hist`` previous rows prepended; carries its own last rows."""
    prev = g.carried(key, (n_hist, int(x.ne[0])))
    xp = lib.ggml_concat(g.ctx, prev, x, 1)
    g.carry(key, rows(g.ctx, xp, int(x.ne[1]), n_hist))
    return xp


def causal_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int = 1,
                act: Snake | None = None, residual: Tensor | None = None) -> Tensor:
    """``residual + conv(act(x))``: causal conv1d (left history (k-1)*d, no look-ahead) of the
    SnakeBeta ``act`` of x, plus ``residual``; both optional.

    The BF16 and Winograd kernels apply the snake while staging their input and add the
    residual as they store their output, so neither is a pass over the activation of its own.
    """
    ctx = g.ctx
    n_hist = (conv.kernel - 1) * dilation
    if conv.packed is not None and (conv.packed.type == lib.GGML_TYPE_BF16 or conv.winograd):
        return _direct_conv(g, key, x, conv, dilation, n_hist, act, residual)
    if act is not None:
        x = snake(g, x, act)
    if conv.packed is not None:
        y = _direct_conv(g, key, x, conv, dilation, n_hist)
    else:
        y = _matmul_conv(g, key, x, conv, dilation, n_hist)
    return y if residual is None else lib.ggml_add(ctx, residual, y)


def _matmul_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int, n_hist: int
                 ) -> Tensor:
    """The conv as one MUL_MAT per tap on shifted row views (stock ggml ops only)."""
    ctx = g.ctx
    xp = with_history(g, key, x, n_hist) if n_hist else x
    if conv.taps[0].type != lib.GGML_TYPE_F32 and conv.kernel > 1:
        # Half-precision taps would each convert their (overlapping) input rows; convert once.
        xp = lib.ggml_cast(ctx, xp, conv.taps[0].type)

    def taps(xc: Tensor) -> Tensor:  # one row chunk: xc holds its history rows in front
        n = int(xc.ne[1]) - (conv.kernel - 1) * dilation
        y = None
        for j, tap in enumerate(conv.taps):
            part = lib.ggml_mul_mat(ctx, tap, rows(ctx, xc, j * dilation, n))
            y = part if y is None else lib.ggml_add(ctx, y, part)
        return y

    # the bias once on the joined rows: one node, not one per row chunk
    return lib.ggml_add(ctx, g.by_rows(xp, taps, n_rows=int(x.ne[1])), conv.bias)


def _direct_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int, n_hist: int,
                 act: Snake | None = None, residual: Tensor | None = None) -> Tensor:
    """qtts's direct conv kernels, reading the carried history as a second source (no concat).

    ``act`` and ``residual`` (fused) are for the BF16 and Winograd kernels only; the history
    they carry is then of the pre-snake input, which the kernel activates like the new rows.
    """
    ctx, packed = g.ctx, conv.packed
    assert packed is not None
    prev = None
    if n_hist:
        t = int(x.ne[1])
        prev = g.carried(key, (n_hist, int(x.ne[0])))
        if t >= n_hist:
            g.carry(key, rows(ctx, x, t - n_hist, n_hist))
        else:  # a chunk shorter than the history: the new history straddles both
            g.carry(key, rows(ctx, lib.ggml_concat(ctx, prev, x, 1), t, n_hist))
    if packed.type == lib.GGML_TYPE_BF16:
        fused = custom_ops.conv1d_wino_bf16 if conv.winograd else custom_ops.conv1d_tm_bf16
    elif conv.winograd:
        fused = custom_ops.conv1d_wino_f32
    else:
        assert act is None and residual is None
        return custom_ops.conv1d_tm(ctx, x, packed, conv.bias, dilation, hist=prev)
    return fused(
        ctx, x, packed, conv.bias, dilation, hist=prev,
        snake=(act.exp_alpha, act.inv_beta) if act is not None else None, residual=residual)


def causal_tconv(g: StageGraph, key: str, x: Tensor, tc: TConv, act: Snake | None = None
                 ) -> Tensor:
    """Transposed conv (k = s or 2s), right-trimmed, of ``act(x)``: polyphase, so no interleave
    is needed.

    ``y[t*s + j] = W[:, :, j]^T x[t] + W[:, :, j+s]^T x[t-1]``: the [s*O, T] product already is
    the upsampled [O, s*T] signal in time-major memory order.
    """
    ctx = g.ctx
    t = int(x.ne[1])
    if tc.conv is not None:
        y = causal_conv(g, key, x, tc.conv, act=act)  # phases as taps (prev, cur); bias per phase
        return lib.ggml_reshape_2d(ctx, y, tc.c_out, tc.stride * t)
    assert tc.cur is not None and tc.bias is not None
    if act is not None:
        x = snake(g, x, act)
    cur, prev = tc.cur, tc.prev
    if prev is None:
        y = g.mul_mat(cur, x)
    else:
        def phases(xc: Tensor) -> Tensor:  # one row chunk, its previous row in front
            n = int(xc.ne[1]) - 1
            return lib.ggml_add(ctx, lib.ggml_mul_mat(ctx, cur, rows(ctx, xc, 1, n)),
                                lib.ggml_mul_mat(ctx, prev, rows(ctx, xc, 0, n)))

        y = g.by_rows(with_history(g, key, x, 1), phases, n_rows=t)  # one join, not two
    y = lib.ggml_reshape_2d(ctx, y, tc.c_out, tc.stride * t)
    return lib.ggml_add(ctx, y, tc.bias)


def snake(g: StageGraph, x: Tensor, s: Snake) -> Tensor:
    """SnakeBeta: ``x + sin(exp(a) x)^2 / (exp(b) + 1e-9)`` with folded per-channel constants."""
    ctx = g.ctx
    if g.use_custom_ops:
        return custom_ops.snake_beta(ctx, x, s.exp_alpha, s.inv_beta)
    sin2 = lib.ggml_sqr(ctx, lib.ggml_sin(ctx, lib.ggml_mul(ctx, x, s.exp_alpha)))
    return lib.ggml_add(ctx, x, lib.ggml_mul(ctx, sin2, s.inv_beta))


def linear(g: StageGraph, x: Tensor, lin: Linear) -> Tensor:
    """``W x + b`` on a time-major [in, T] tensor."""
    if lin.conv is not None:
        return causal_conv(g, "", x, lin.conv)  # one tap: no history to carry
    y = g.mul_mat(lin.weight, x)
    return lib.ggml_add(g.ctx, y, lin.bias) if lin.bias is not None else y

