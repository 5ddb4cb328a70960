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
        (chunk ``i`` then sees rows ``start .. start + len + extra``). The chunk results are
        joined by a balanced tree of concats, so each row is copied log2(chunks) times, not
        once per chunk.
        """
        t = int(x.ne[1]) if n_rows is None else n_rows
        extra = int(x.ne[1]) - t
        rows_max = self.max_matmul_rows
        if rows_max is None or t <= rows_max:
            return fn(x)
        parts = [fn(rows(self.ctx, x, start, min(rows_max, t - start) + extra))
                 for start in range(0, t, rows_max)]
        while len(parts) > 1:
            paired = [lib.ggml_concat(self.ctx, a, b, 1) for a, b in zip(parts[::2], parts[1::2],
                                                                         strict=False)]
            parts = paired + ([parts[-1]] if len(parts) % 2 else [])
        return parts[0]

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


def causal_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int = 1) -> Tensor:
    """Causal conv1d: left history (k-1)*d, no look-ahead."""
    ctx = g.ctx
    n_hist = (conv.kernel - 1) * dilation
    if conv.packed is not None:
        return _direct_conv(g, key, x, conv, dilation, n_hist)
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
        return lib.ggml_add(ctx, y, conv.bias)

    return g.by_rows(xp, taps, n_rows=int(x.ne[1]))


def _direct_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int, n_hist: int
                 ) -> Tensor:
    """qtts's direct conv kernels, reading the carried history as a second source (no concat)."""
    ctx, packed = g.ctx, conv.packed
    assert packed is not None
    op = custom_ops.conv1d_tm_bf16 if packed.type == lib.GGML_TYPE_BF16 else custom_ops.conv1d_tm
    if not n_hist:
        return op(ctx, x, packed, conv.bias, dilation)
    t = int(x.ne[1])
    prev = g.carried(key, (n_hist, int(x.ne[0])))
    if t >= n_hist:
        g.carry(key, rows(ctx, x, t - n_hist, n_hist))
    else:  # a chunk shorter than the history: the new history straddles both
        g.carry(key, rows(ctx, lib.ggml_concat(ctx, prev, x, 1), t, n_hist))
    return op(ctx, x, packed, conv.bias, dilation, hist=prev)


def causal_tconv(g: StageGraph, key: str, x: Tensor, tc: TConv) -> Tensor:
    """Transposed conv (k = s or 2s), right-trimmed: polyphase, so no interleave is needed.

    ``y[t*s + j] = W[:, :, j]^T x[t] + W[:, :, j+s]^T x[t-1]``: the [s*O, T] product already is
    the upsampled [O, s*T] signal in time-major memory order.
    """
    ctx = g.ctx
    t = int(x.ne[1])
    if tc.conv is not None:
        y = causal_conv(g, key, x, tc.conv)  # phases as taps (prev, cur); bias per phase
        return lib.ggml_reshape_2d(ctx, y, tc.c_out, tc.stride * t)
    assert tc.cur is not None and tc.bias is not None
    y = g.mul_mat(tc.cur, x)
    if tc.prev is not None:
        xp = with_history(g, key, x, 1)
        y = lib.ggml_add(ctx, y, g.mul_mat(tc.prev, rows(ctx, xp, 0, t)))
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
    y = g.mul_mat(lin.weight, x)
    return lib.ggml_add(g.ctx, y, lin.bias) if lin.bias is not None else y

