"""Graph blocks shared by the decoder stages, in the time-major layout (ne = [C, T]).

Every block that looks back in time reads its history from a *carried* tensor: the last
``(k-1)*d`` input rows of a causal conv, the previous input row of a transposed conv, the last
``window-1`` keys/values of an attention layer. A ``StageGraph`` declares each carried tensor
as an input (zeros at the start of an utterance, which is exactly the reference's zero padding)
and its continuation as an output, so one call per chunk equals one pass over the whole input.

One graph may push several streams' frames at once (``StageGraph(frames=...)``): their rows are
joined in time, stream after stream, so every weight is read once for all of them. Ops that do
not look back in time run on the joined rows as they are; the blocks that look back give each
stream its own carried rows (``history_rows``), and the attention its own window. On the CPU
kernels every row is summed in an order fixed by its own inputs, so a stream's rows are the
bits its own push gives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.decoder.weights import Conv, Linear, Snake, TConv
from engine.ggml import Graph, Tensor, custom_ops, lib
from engine.ggml.graph import set_name


class StageGraph(Graph):
    """A Graph plus the carried state it reads and writes: one stream's, or (``frames``, one
    count per state) several streams' whose new frames it computes together."""

    def __init__(self, states: Sequence[dict[str, np.ndarray[Any, Any]]],
                 use_custom_ops: bool = False, capture: bool = False,
                 max_matmul_rows: int | None = None, max_nodes: int | None = None,
                 frames: Sequence[int] | None = None) -> None:
        # Row-limited backends split every matmul: room for many more nodes.
        super().__init__(max_nodes or (8192 if max_matmul_rows is None else 65536))
        if len(states) > 1 and (frames is None or len(frames) != len(states)):
            raise ValueError("several streams' states need one frame count each")
        self.states = list(states)
        self.frames = list(frames) if frames is not None else []
        self.use_custom_ops = use_custom_ops
        self.capture = capture
        self.max_matmul_rows = max_matmul_rows

    @property
    def joint(self) -> bool:
        """Whether the graph computes several streams' rows together."""
        return len(self.states) > 1

    def segments(self, t: int) -> list[int]:
        """Each stream's rows among ``t`` joined rows (every stream has the same rows a frame)."""
        total = sum(self.frames)
        if t % total:
            raise ValueError(f"{t} joined rows are not a whole number of rows per frame")
        return [n * (t // total) for n in self.frames]

    def split(self, x: Tensor) -> list[Tensor]:
        """The streams' rows of a joined time-major [C, T] tensor, as views."""
        parts, start = [], 0
        for n in self.segments(int(x.ne[1])):
            parts.append(rows(self.ctx, x, start, n))
            start += n
        return parts

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
        (chunk ``i`` then sees rows ``start .. start + len + extra``). The chunks are joined
        in time (``join``).
        """
        t = int(x.ne[1]) if n_rows is None else n_rows
        extra = int(x.ne[1]) - t
        rows_max = self.max_matmul_rows
        if rows_max is None or t <= rows_max:
            return fn(x)
        return self.join([fn(rows(self.ctx, x, start, min(rows_max, t - start) + extra))
                          for start in range(0, t, rows_max)])

    def join(self, parts: Sequence[Tensor]) -> Tensor:
        """Time-major [C, T_i] tensors one after another in time: [C, sum T_i].

        With qtts's CPU ops: the native ``time_join`` (one memcpy a row, on every thread).
        Elsewhere the parts are written into one full-size tensor by a chain of SET_ROWS (each
        writes into the result of the previous one), so every row is copied once; the
        full-size tensor itself comes from a REPEAT of one row (its values are all
        overwritten), the cheapest stock op that makes one (a PAD of the first part costs more
        on the CPU). A tree of concats copied each row log2(parts) times (docs/performance.md,
        Figures behind the code). REPEAT and SET_ROWS are ops every backend with a row limit
        has, unlike SET.
        """
        if len(parts) == 1:
            return parts[0]
        if self.use_custom_ops:
            most = custom_ops.MAX_CUSTOM_SOURCES
            while len(parts) > most:
                parts = [custom_ops.time_join(self.ctx, parts[i : i + most])
                         for i in range(0, len(parts), most)]
            return custom_ops.time_join(self.ctx, parts)
        ctx, width = self.ctx, int(parts[0].ne[0])
        t = sum(int(p.ne[1]) for p in parts)
        out = lib.ggml_repeat_4d(ctx, lib.ggml_view_1d(ctx, parts[0], width, 0), width, t, 1, 1)
        index = self._row_index(t)
        start = 0
        for part in parts:
            n = int(part.ne[1])
            out = lib.ggml_set_rows(ctx, out, part, lib.ggml_view_1d(
                ctx, index, n, start * index.nb[0]))
            start += n
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

    def carried(self, key: str, shape: Sequence[int], stream: int = 0) -> Tensor:
        """Stream ``stream``'s carried tensor ``key`` (numpy-order ``shape``), zeros on first
        use."""
        state = self.states[stream]
        if key not in state:
            state[key] = zero_state(tuple(int(n) for n in shape))
        return self.input(f"in.{_stream_key(key, stream)}", shape)

    def carry(self, key: str, t: Tensor, stream: int = 0) -> None:
        """Declare ``t`` the continuation of stream ``stream``'s carried tensor ``key`` (read
        back after compute)."""
        self.output(lib.ggml_cont(self.ctx, t), f"out.{_stream_key(key, stream)}")

    def uploads(self, **inputs: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
        """Stage inputs plus every carried tensor, keyed by graph input name."""
        up = {}
        for stream, state in enumerate(self.states):
            for key, value in state.items():
                name = f"in.{_stream_key(key, stream)}"
                if name in self.inputs:
                    up[name] = value
        for name, t in self.inputs.items():
            if name.startswith("row_index."):
                up[name] = np.arange(int(t.ne[0]), dtype=np.int32)
        up.update(inputs)
        return up

    def update_state(self, outputs: dict[str, np.ndarray[Any, Any]]) -> None:
        """Store the continuations computed by this graph."""
        for name, arr in outputs.items():
            if name.startswith("out."):
                key, _, stream = name[4:].partition("@")
                self.states[int(stream or 0)][key] = arr


@functools.lru_cache(maxsize=512)
def zero_state(shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A fresh stream's carried tensor: zeros, one read-only array per shape for every stream
    (a stream's first push replaces it). Zeros of its own would cost a joining stream's first
    push fresh pages: the pre-transformer's windows are megabytes (docs/performance.md,
    Session 29)."""
    zeros = np.zeros(shape, dtype=np.float32)
    zeros.flags.writeable = False
    return zeros


def _stream_key(key: str, stream: int) -> str:
    """The graph name of a stream's carried tensor (the first stream's is the key itself)."""
    return f"{key}@{stream}" if stream else key


def rows(ctx: Any, x: Tensor, start: int, n: int) -> Tensor:
    """Time steps ``start .. start+n`` of a time-major [C, T] tensor, as a view."""
    return lib.ggml_view_2d(ctx, x, x.ne[0], n, x.nb[1], start * x.nb[1])


def history_rows(g: StageGraph, key: str, x: Tensor, n_hist: int,
                 fn: Callable[[Tensor, int], Tensor]) -> Tensor:
    """``fn(xp, n)``: n output rows from ``xp`` = [``n_hist`` carried rows | the new rows],
    output row i computed from xp rows i .. i + n_hist; carries the last ``n_hist`` rows.

    In a joint graph xp holds each stream's carried rows and new rows, stream after stream;
    ``fn`` also computes the rows that straddle two streams, which are left out.
    """
    ctx, c = g.ctx, int(x.ne[0])
    if not g.joint:
        prev = g.carried(key, (n_hist, c))
        xp = lib.ggml_concat(ctx, prev, x, 1)
        g.carry(key, rows(ctx, xp, int(x.ne[1]), n_hist))
        return fn(xp, int(x.ne[1]))
    parts, spans, start = [], [], 0
    for stream, xs in enumerate(g.split(x)):
        parts += [g.carried(key, (n_hist, c), stream), xs]
        spans.append((start, int(xs.ne[1])))
        start += n_hist + int(xs.ne[1])
    xp = g.join(parts)
    for stream, (start, t) in enumerate(spans):
        g.carry(key, rows(ctx, xp, start + t, n_hist), stream)
    y = fn(xp, int(xp.ne[1]) - n_hist)
    return g.join([rows(ctx, y, start, t) for start, t in spans])


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

    def taps(xc: Tensor) -> Tensor:  # one row chunk: xc holds its history rows in front
        n = int(xc.ne[1]) - n_hist
        y = None
        for j, tap in enumerate(conv.taps):
            part = lib.ggml_mul_mat(ctx, tap, rows(ctx, xc, j * dilation, n))
            y = part if y is None else lib.ggml_add(ctx, y, part)
        return y

    def product(xp: Tensor, n: int) -> Tensor:
        if conv.taps[0].type != lib.GGML_TYPE_F32 and conv.kernel > 1:
            # Half-precision taps would each convert their (overlapping) input rows; convert
            # once.
            xp = lib.ggml_cast(ctx, xp, conv.taps[0].type)
        return g.by_rows(xp, taps, n_rows=n)

    y = history_rows(g, key, x, n_hist, product) if n_hist else product(x, int(x.ne[1]))
    # the bias once on the joined rows: one node, not one per row chunk
    return lib.ggml_add(ctx, y, conv.bias)


def _direct_conv(g: StageGraph, key: str, x: Tensor, conv: Conv, dilation: int, n_hist: int,
                 act: Snake | None = None, residual: Tensor | None = None) -> Tensor:
    """qtts's direct conv kernels, reading the carried history as a second source (no concat).

    ``act`` and ``residual`` (fused) are for the BF16 and Winograd kernels only; the history
    they carry is then of the pre-snake input, which the kernel activates like the new rows.
    """
    ctx, packed = g.ctx, conv.packed
    assert packed is not None
    if g.joint and n_hist:
        # [history | rows] of every stream joined: the conv reads no history of its own, and
        # the residual (its rows joined already) is added to the rows kept
        y = history_rows(g, key, x, n_hist,
                         lambda xp, _n: _conv_kernel(g, xp, conv, dilation, None, act, None))
        return y if residual is None else lib.ggml_add(ctx, residual, y)
    prev = None
    if n_hist:
        t = int(x.ne[1])
        prev = g.carried(key, (n_hist, int(x.ne[0])))
        if t >= n_hist:
            g.carry(key, rows(ctx, x, t - n_hist, n_hist))
        else:  # a chunk shorter than the history: the new history straddles both
            g.carry(key, rows(ctx, lib.ggml_concat(ctx, prev, x, 1), t, n_hist))
    return _conv_kernel(g, x, conv, dilation, prev, act, residual)


def _conv_kernel(g: StageGraph, x: Tensor, conv: Conv, dilation: int, prev: Tensor | None,
                 act: Snake | None, residual: Tensor | None) -> Tensor:
    """The direct conv node of ``x`` after the history ``prev`` (None: x holds it in front)."""
    ctx, packed = g.ctx, conv.packed
    assert packed is not None
    if conv.split:
        return custom_ops.conv1d_tm_bf16(
            ctx, x, packed, conv.bias, dilation, hist=prev, split=True,
            snake=(act.exp_alpha, act.inv_beta) if act is not None else None, residual=residual)
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

        y = history_rows(g, key, x, 1, lambda xp, n: g.by_rows(xp, phases, n_rows=n))
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

