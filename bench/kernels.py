#!/usr/bin/env python3
"""Micro-benchmarks of qtts's native kernels against the alternatives, side by side.

  conv: the time-major causal conv (K=7; --extra adds d=9, C=768 and the K=1 1x1 conv) as
        (a) ggml: K x ggml_mul_mat over shifted row views of xp + adds + bias (the baseline),
        (b) qtts_conv1d_tm (native/ops/conv1d_tm.c, a ggml custom op),
        (c) torch.nn.functional.conv1d F32 (channel-major, pre-padded input), if torch is here.
  snake: SnakeBeta on [T, C] as the stock-op composition (mul, sin, sqr, mul, add) vs the fused
        qtts_snake_beta op.
  bf16: fast mode's BF16 conv (K=7, d=1; --extra adds d=9 and the K=1 conv) as
        qtts_conv1d_tm_bf16 (native/ops/conv1d_tm_bf16.c) side by side with the exact-F32
        qtts_conv1d_tm, K x ggml_mul_mat with BF16 weights, and torch conv1d F32 / BF16.
  wino: the decoder's 7-tap and transposed (2-tap polyphase) convs as qtts_conv1d_wino_bf16
        (Winograd F(2,3) / F(2,2)) against the direct qtts_conv1d_tm_bf16, with the SNR of each
        against a float64 conv of the same data.
  wino_f32: the residual units' 7-tap convs, the first conv and the transposed convs as
        qtts_conv1d_wino_f32 (Winograd F(6,7) / F(6,2) in F32: fast mode without the BF16
        kernels) against the direct F32 qtts_conv1d_tm, at a long input and at one frame,
        with the same SNRs.
  gemm_i8: the talker prefill's projections (57 and 512 rows) as qtts_gemm_i8 (W8A8, VNNI)
        against ggml's mul_mat with the Q4_0 weight in the CPU_REPACK buffer (what the talker
        used before), with the cosine of each against the F32 product.
  gemv_q4: the steps' Q4_0 products (1 to 8 rows) as qtts_gemv_q4 against ggml's mul_mat on
        the CPU_REPACK copy, over 4 matrices of 3072 x 1024 (7 MB: from the cache), 14 (25 MB,
        a code-predictor pass's worth) and 140 (248 MB, a 0.6B talker's worth: from memory), as
        weight GB/s; with 1 and 2 threads.
  attn: a prefill's causal GQA attention over an F16 cache (16 query heads of 128 over 8 KV
        heads: 0.6B and 1.7B) as qtts_attn_causal (native/ops/attn_causal.c, one node) against
        ggml's four nodes (K.Q, masked softmax over the padded key range, the product with V,
        the head merge), one layer.
  attn_step: a decoding step's attention (the same heads) for 1 or 3 sessions at cache
        positions 64 to 1024, as qtts_attn_step (one node a layer: the K/V writes, scores,
        softmax and the product with V of every session), a 0.6B talker's 28 layers, with the
        cache rows read per second and the error against float64.

ggml timings are ``ggml_backend_sched_graph_compute`` alone (graph allocated and inputs set
beforehand; inputs re-set before each repetition, untimed). Each repetition also records how
much CPU *other* processes used during it (from /proc/stat); on a shared machine read the
"others' load" column: repetitions where others used more than --max-busy of the machine are
dropped when enough clean ones exist. Prints min and median wall ms and ratios (other_ms /
qtts_ms, > 1 means the qtts kernel is faster), then the same runs as min CPU time per thread,
which time-slicing by other processes does not inflate.

  .venv/bin/python bench/kernels.py [--threads 2] [--reps 7]
                                    [--only conv|snake|bf16|hist|wino|wino_f32|gemm_i8|gemv_q4|attn|
                                           attn_step]
                                    [--extra]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backend import BackendSet
from engine.ggml import Graph, ffi, lib
from engine.ggml import custom_ops as co

CONV_CASES = [  # (C, T, dilation, K)
    (96, 59520, 1, 7),
    (192, 19840, 1, 7),
    (384, 4960, 1, 7),
]
EXTRA_CONV_CASES = [(96, 59520, 9, 7), (768, 1240, 1, 7), (96, 59520, 1, 1), (768, 1240, 1, 1)]
BF16_CONV_CASES = [  # (C, T, dilation, K): the decoder's residual-unit convs, ~5 s of audio
    (96, 59520, 1, 7),
    (192, 19840, 1, 7),
    (384, 4960, 1, 7),
    (768, 1240, 1, 7),
]
EXTRA_BF16_CASES = [(96, 59520, 9, 7), (384, 4960, 9, 7), (96, 59520, 1, 1), (384, 4960, 1, 1)]
HIST_CASES = [(96, 59520, 1, 7)]  # (C, T, dilation, K)
EXTRA_HIST_CASES = [(96, 59520, 9, 7), (384, 4960, 1, 7)]
BF16 = lib.GGML_TYPE_BF16  # weight inputs uploaded as co.bf16_bits


def _cpu_ticks() -> tuple[int, int]:
    """(busy ticks of the whole machine, ticks of this process)."""
    with open("/proc/stat") as f:
        parts = [int(v) for v in f.readline().split()[1:]]
    busy = sum(parts) - parts[3] - parts[4]  # minus idle and iowait
    t = os.times()
    hz = os.sysconf("SC_CLK_TCK")
    return busy, int((t.user + t.system) * hz)


def timed(fn: Callable[[], None], reps: int, max_busy: float,
          prepare: Callable[[], None] | None = None, threads: int = 1) -> dict[str, float]:
    """Run fn until `reps` clean repetitions (or 4*reps in all); min/median wall ms, others'
    load, and the min of this process's CPU time / threads ("cpu"): preempted time does not
    count there (spinning threads do), so on a shared machine it is the steadier number."""
    ncpu = os.cpu_count() or 1
    hz = os.sysconf("SC_CLK_TCK")
    clean: list[float] = []
    every: list[tuple[float, float]] = []
    cpu_ms: list[float] = []
    if prepare:
        prepare()
    fn()  # warm-up
    while len(clean) < reps and len(every) < 4 * reps:
        if prepare:
            prepare()
        b0, s0 = _cpu_ticks()
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        cpu_ms.append((time.process_time() - c0) * 1e3 / threads)
        b1, s1 = _cpu_ticks()
        others = max(0, (b1 - b0) - (s1 - s0)) / hz / max(dt, 1e-9) / ncpu
        every.append((dt * 1e3, others))
        if others <= max_busy:
            clean.append(dt * 1e3)
    pool = clean if len(clean) >= max(3, reps // 2) else [e[0] for e in every]
    return {
        "min": min(pool),
        "median": statistics.median(pool),
        "busy": statistics.median(e[1] for e in every),
        "cpu": min(cpu_ms),
        "clean": float(len(clean)),
        "n": float(len(every)),
    }


class GraphRunner:
    """One graph allocated once on the CPU scheduler; run() times compute only."""

    def __init__(self, cpu: BackendSet, g: Graph, inputs: dict[str, np.ndarray[Any, Any]]):
        self.cpu, self.g, self.inputs = cpu, g, inputs
        lib.ggml_backend_sched_reset(cpu.sched)
        if not lib.ggml_backend_sched_alloc_graph(cpu.sched, g.gf):
            raise RuntimeError("cannot allocate the graph")
        self.set_inputs()

    def set_inputs(self) -> None:
        for name, arr in self.inputs.items():
            src = np.ascontiguousarray(arr)
            lib.ggml_backend_tensor_set(self.g.inputs[name], ffi.from_buffer(src), 0, src.nbytes)

    def run(self) -> None:
        if lib.ggml_backend_sched_graph_compute(self.cpu.sched, self.g.gf) != 0:
            raise RuntimeError("compute failed")

    def output(self, name: str) -> np.ndarray[Any, Any]:
        t = self.g.outputs[name]
        shape = tuple(int(t.ne[i]) for i in reversed(range(lib.ggml_n_dims(t))))
        arr = np.empty(shape, np.float32)
        lib.ggml_backend_tensor_get(t, ffi.from_buffer(arr), 0, arr.nbytes)
        return arr


def conv_graph_mulmat(c: int, t: int, d: int, k: int, bf16: bool = False) -> Graph:
    """Baseline: y = bias + sum_k mul_mat(W_k, xp[k*d : k*d + T]); ``bf16``: BF16 weights
    (ggml then converts xp to BF16 per mul_mat)."""
    g = Graph()
    xp = g.input("xp", (t + (k - 1) * d, c))
    # [K, C_out, C_in]: W_k is the k-th [C_out, C_in] slice
    w = g.input("w", (k, c, c), ggml_type=BF16 if bf16 else None)
    b = g.input("b", (c,))
    y = None
    for i in range(k):
        wk = lib.ggml_view_2d(g.ctx, w, c, c, w.nb[1], i * w.nb[2])
        xk = lib.ggml_view_2d(g.ctx, xp, c, t, xp.nb[1], i * d * xp.nb[1])
        m = lib.ggml_mul_mat(g.ctx, wk, xk)
        y = m if y is None else lib.ggml_add(g.ctx, y, m)
    g.output(lib.ggml_add(g.ctx, y, b), "y")
    return g


def conv_graph_custom(c: int, t: int, d: int, k: int) -> Graph:
    g = Graph()
    xp = g.input("xp", (t + (k - 1) * d, c))
    blk = co.conv_block()
    w = g.input("w", (-(-c // blk), k, c, blk))  # packed (pack_conv_weight)
    b = g.input("b", (c,))
    g.output(co.conv1d_tm(g.ctx, xp, w, b, d), "y")
    return g


def _torch(threads: int) -> Any | None:
    """torch set to ``threads`` threads, or None when it is not installed (no torch columns)."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


def bench_conv(cpu: BackendSet, cases: list[tuple[int, int, int, int]], reps: int,
               max_busy: float, threads: int) -> None:
    torch = _torch(threads)
    print(f"\n## causal conv1d time-major, F32, {threads} threads"
          + ("" if torch is not None else "  (torch not installed: no torch column)"))
    hdr = ("| case | GFLOP | ggml K x mul_mat ms (min/med) | qtts_conv1d_tm ms (min/med) | "
           "torch F32 ms (min/med) | custom vs mul_mat | custom vs torch | max|Δ|/max|y| | "
           "others' load |")
    print(hdr)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    cpu_rows: list[str] = []
    for c, t, d, k in cases:
        p = (k - 1) * d
        xp = rng.standard_normal((t + p, c)).astype(np.float32)
        w_t = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)  # torch
        b = rng.standard_normal(c).astype(np.float32)
        flop = 2.0 * c * c * k * t

        g1 = conv_graph_mulmat(c, t, d, k)
        r1 = GraphRunner(cpu, g1, {"xp": xp, "w": np.ascontiguousarray(
            np.transpose(w_t, (2, 0, 1))), "b": b})
        s1 = timed(r1.run, reps, max_busy, r1.set_inputs, threads)
        y1 = r1.output("y")

        g2 = conv_graph_custom(c, t, d, k)
        r2 = GraphRunner(cpu, g2, {"xp": xp, "w": co.pack_conv_weight(w_t), "b": b})
        s2 = timed(r2.run, reps, max_busy, r2.set_inputs, threads)
        y2 = r2.output("y")
        err = float(np.abs(y2 - y1).max() / np.abs(y1).max())

        if torch is not None:
            with torch.inference_mode():
                tx = torch.from_numpy(np.ascontiguousarray(xp.T))[None]
                tw, tb = torch.from_numpy(w_t), torch.from_numpy(b)

                def run_torch(tx: Any = tx, tw: Any = tw, tb: Any = tb, d: int = d) -> None:
                    torch.nn.functional.conv1d(tx, tw, tb, dilation=d)

                s3 = timed(run_torch, reps, max_busy, None, threads)
            tcol = f"{s3['min']:.1f} / {s3['median']:.1f}"
            vs_t = f"{s3['min'] / s2['min']:.2f}x"
            cpu_t = f"{s3['cpu']:.1f}"
            cvs_t = f"{s3['cpu'] / s2['cpu']:.2f}x"
        else:
            tcol, vs_t, cpu_t, cvs_t = "n/a", "n/a", "n/a", "n/a"
        busy = max(s1["busy"], s2["busy"])
        case = f"C={c} T={t} K={k} d={d}"
        print(f"| {case} | {flop / 1e9:.2f} | {s1['min']:.1f} / {s1['median']:.1f} | "
              f"{s2['min']:.1f} / {s2['median']:.1f} ({flop / s2['min'] / 1e6:.0f} GF/s) | "
              f"{tcol} | {s1['min'] / s2['min']:.2f}x | {vs_t} | {err:.1e} | {busy:.0%} |",
              flush=True)
        cpu_rows.append(f"| {case} | {s1['cpu']:.1f} | {s2['cpu']:.1f} | {cpu_t} | "
                        f"{s1['cpu'] / s2['cpu']:.2f}x | {cvs_t} |")
        g1.close()
        g2.close()
    print(f"\nSame runs, min CPU time per thread (process CPU time / {threads}; excludes time "
          "preempted by other processes, includes spin-waiting):")
    print("| case | ggml K x mul_mat cpu ms | qtts_conv1d_tm cpu ms | torch F32 cpu ms | "
          "custom vs mul_mat | custom vs torch |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(cpu_rows), flush=True)


def conv_graph_custom_bf16(c: int, t: int, d: int, k: int) -> Graph:
    g = Graph()
    xp = g.input("xp", (t + (k - 1) * d, c))
    blk = co.CONV_BF16_BLOCK
    w = g.input("w", (-(-c // blk), k, -(-c // 2), 2 * blk),  # pack_conv_weight_bf16
                ggml_type=BF16)
    b = g.input("b", (c,))
    g.output(co.conv1d_tm_bf16(g.ctx, xp, w, b, d), "y")
    return g


def bench_conv_bf16(cpu: BackendSet, cases: list[tuple[int, int, int, int]], reps: int,
                    max_busy: float, threads: int) -> None:
    torch = _torch(threads)
    print(f"\n## BF16 causal conv1d time-major, {threads} threads: min ms (GF/s); "
          f"qtts BF16 kernel: {'AVX512_BF16' if co.bf16_available() else 'portable C (slow)'}"
          + ("" if torch is not None else "  (torch not installed: no torch columns)"))
    print("| case | GFLOP | qtts_conv1d_tm F32 | qtts_conv1d_tm_bf16 | K x mul_mat BF16 | "
          "torch F32 | torch BF16 | bf16 vs F32 op | bf16 vs mul_mat BF16 | "
          "max|Δ|/max|y| vs F32 op | others' load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    cpu_rows: list[str] = []
    for c, t, d, k in cases:
        p = (k - 1) * d
        xp = rng.standard_normal((t + p, c)).astype(np.float32)
        w_t = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)  # torch
        b = rng.standard_normal(c).astype(np.float32)
        flop = 2.0 * c * c * k * t
        stats: dict[str, dict[str, float]] = {}
        outs: dict[str, np.ndarray[Any, Any]] = {}
        # one graph at a time: allocating a graph on the scheduler invalidates the previous one
        for name, graph, inputs in [
            ("f32", conv_graph_custom(c, t, d, k),
             {"xp": xp, "w": co.pack_conv_weight(w_t), "b": b}),
            ("bf16", conv_graph_custom_bf16(c, t, d, k),
             {"xp": xp, "w": co.bf16_bits(co.pack_conv_weight_bf16(w_t)), "b": b}),
            ("mm", conv_graph_mulmat(c, t, d, k, bf16=True),
             {"xp": xp, "w": co.bf16_bits(np.transpose(w_t, (2, 0, 1))), "b": b}),
        ]:
            r = GraphRunner(cpu, graph, inputs)
            stats[name] = timed(r.run, reps, max_busy, r.set_inputs, threads)
            outs[name] = r.output("y")
            graph.close()
        err = float(np.abs(outs["bf16"] - outs["f32"]).max() / np.abs(outs["f32"]).max())
        if torch is not None:
            with torch.inference_mode():
                for name, dt in [("tf32", torch.float32), ("tbf16", torch.bfloat16)]:
                    tx = torch.from_numpy(np.ascontiguousarray(xp.T))[None].to(dt)
                    tw, tb = torch.from_numpy(w_t).to(dt), torch.from_numpy(b).to(dt)

                    def run_torch(tx: Any = tx, tw: Any = tw, tb: Any = tb, d: int = d) -> None:
                        torch.nn.functional.conv1d(tx, tw, tb, dilation=d)

                    stats[name] = timed(run_torch, reps, max_busy, None, threads)

        def col(name: str, stats: dict[str, dict[str, float]] = stats,
                flop: float = flop) -> str:
            s = stats.get(name)
            return "n/a" if s is None else f"{s['min']:.1f} ({flop / s['min'] / 1e6:.0f})"

        def cpu_col(name: str, stats: dict[str, dict[str, float]] = stats) -> str:
            s = stats.get(name)
            return "n/a" if s is None else f"{s['cpu']:.1f}"

        busy = max(s["busy"] for s in stats.values())
        case = f"C={c} T={t} K={k} d={d}"
        print(f"| {case} | {flop / 1e9:.2f} | {col('f32')} | {col('bf16')} | {col('mm')} | "
              f"{col('tf32')} | {col('tbf16')} | "
              f"{stats['f32']['min'] / stats['bf16']['min']:.2f}x | "
              f"{stats['mm']['min'] / stats['bf16']['min']:.2f}x | {err:.1e} | {busy:.0%} |",
              flush=True)
        cpu_rows.append(f"| {case} | {cpu_col('f32')} | {cpu_col('bf16')} | {cpu_col('mm')} | "
                        f"{cpu_col('tf32')} | {cpu_col('tbf16')} | "
                        f"{stats['f32']['cpu'] / stats['bf16']['cpu']:.2f}x |")
    print(f"\nSame runs, min CPU ms per thread (process CPU time / {threads}):")
    print("| case | F32 op | BF16 op | K x mul_mat BF16 | torch F32 | torch BF16 | "
          "bf16 vs F32 op |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(cpu_rows), flush=True)


def conv_graph_hist(c: int, t: int, d: int, k: int, dtype: str, apart: bool) -> Graph:
    """The direct conv (dtype "f32" or "bf16") on [history | x]: ggml_concat(hist, x) then
    the op (apart=False), or the op with ``hist=`` (apart=True, no concat node)."""
    g = Graph()
    p = (k - 1) * d
    h, x = g.input("h", (p, c)), g.input("x", (t, c))
    b = g.input("b", (c,))
    if dtype == "bf16":
        blk = co.CONV_BF16_BLOCK
        w = g.input("w", (-(-c // blk), k, -(-c // 2), 2 * blk), ggml_type=BF16)
        fn = co.conv1d_tm_bf16
    else:
        blk = co.conv_block()
        w = g.input("w", (-(-c // blk), k, c, blk))
        fn = co.conv1d_tm
    if apart:
        y = fn(g.ctx, x, w, b, d, hist=h)
    else:
        y = fn(g.ctx, lib.ggml_concat(g.ctx, h, x, 1), w, b, d)
    g.output(y, "y")
    return g


def bench_hist(cpu: BackendSet, cases: list[tuple[int, int, int, int]], reps: int,
               max_busy: float, threads: int) -> None:
    print(f"\n## direct conv: concat(history, x) + conv vs the two-source conv (hist=), "
          f"{threads} threads: min / median ms")
    print("| case | op | concat + conv | conv(x, hist=) | saved (min) | bit-identical | "
          "cpu ms concat+conv / two-source | others' load |")
    print("|---|---|---:|---:|---:|---|---:|---:|")
    rng = np.random.default_rng(3)
    for c, t, d, k in cases:
        p = (k - 1) * d
        h = rng.standard_normal((p, c)).astype(np.float32)
        x = rng.standard_normal((t, c)).astype(np.float32)
        w_t = (rng.standard_normal((c, c, k)) / np.sqrt(c * k)).astype(np.float32)
        b = rng.standard_normal(c).astype(np.float32)
        for dtype in ("f32", "bf16"):
            wp = (co.bf16_bits(co.pack_conv_weight_bf16(w_t)) if dtype == "bf16"
                  else co.pack_conv_weight(w_t))
            stats: dict[bool, dict[str, float]] = {}
            outs: dict[bool, np.ndarray[Any, Any]] = {}
            for apart in (False, True):  # one graph at a time (see bench_conv_bf16)
                graph = conv_graph_hist(c, t, d, k, dtype, apart)
                r = GraphRunner(cpu, graph, {"h": h, "x": x, "w": wp, "b": b})
                stats[apart] = timed(r.run, reps, max_busy, r.set_inputs, threads)
                outs[apart] = r.output("y")
                graph.close()
            s0, s1 = stats[False], stats[True]
            same = np.array_equal(outs[False], outs[True])
            print(f"| C={c} T={t} K={k} d={d} | {dtype} | {s0['min']:.2f} / {s0['median']:.2f} "
                  f"| {s1['min']:.2f} / {s1['median']:.2f} | {s0['min'] - s1['min']:.2f} ms "
                  f"({1 - s1['min'] / s0['min']:.1%}) | {'yes' if same else 'NO'} | "
                  f"{s0['cpu']:.2f} / {s1['cpu']:.2f} | "
                  f"{max(s0['busy'], s1['busy']):.0%} |", flush=True)


def bench_snake(cpu: BackendSet, reps: int, max_busy: float) -> None:
    print("\n## SnakeBeta [T, C] F32")
    print("| case | stock ops (mul,sin,sqr,mul,add) ms (min/med) | fused ms (min/med) | "
          "speed-up | max|Δ|/max|y| | others' load |")
    print("|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(1)
    for c, t in [(96, 59520), (192, 19840), (1536, 124)]:
        x = rng.standard_normal((t, c)).astype(np.float32)
        ea = np.exp(rng.uniform(-1, 2, c)).astype(np.float32)
        ib = (1 / (np.exp(rng.uniform(-1, 1, c)) + 1e-9)).astype(np.float32)
        ins = {"x": x, "a": ea, "b": ib}

        def graph(fused: bool, t: int = t, c: int = c) -> Graph:
            g = Graph()
            tx, ta, tb = g.input("x", (t, c)), g.input("a", (c,)), g.input("b", (c,))
            if fused:
                y = co.snake_beta(g.ctx, tx, ta, tb)
            else:
                s = lib.ggml_sqr(g.ctx, lib.ggml_sin(g.ctx, lib.ggml_mul(g.ctx, tx, ta)))
                y = lib.ggml_add(g.ctx, tx, lib.ggml_mul(g.ctx, s, tb))
            g.output(y, "y")
            return g

        # one graph at a time: allocating a graph on the scheduler invalidates the previous one
        gs = graph(False)
        rs = GraphRunner(cpu, gs, ins)
        ss = timed(rs.run, reps, max_busy, rs.set_inputs, cpu.threads)
        ys = rs.output("y")
        gf = graph(True)
        rf = GraphRunner(cpu, gf, ins)
        sf = timed(rf.run, reps, max_busy, rf.set_inputs, cpu.threads)
        yf = rf.output("y")
        err = float(np.abs(yf - ys).max() / np.abs(ys).max())
        print(f"| C={c} T={t} | {ss['min']:.2f} / {ss['median']:.2f} | "
              f"{sf['min']:.2f} / {sf['median']:.2f} | {ss['min'] / sf['min']:.1f}x | "
              f"{err:.1e} | {max(ss['busy'], sf['busy']):.0%} |", flush=True)
        gs.close()
        gf.close()


WINO_CASES = [  # (C_in, C_out, T, K, d): ~2.5 s of audio; residual-unit convs, transposed convs
    (96, 96, 59520, 7, 1), (96, 96, 59520, 7, 9), (192, 192, 19840, 7, 3), (384, 384, 4960, 7, 1),
    (768, 768, 992, 7, 9), (1024, 1536, 124, 7, 1),
    (1536, 6144, 124, 2, 1), (768, 1920, 992, 2, 1), (384, 768, 4960, 2, 1),
    (192, 288, 19840, 2, 1),
]


def _snr_db(y: np.ndarray[Any, Any], ref: np.ndarray[Any, Any]) -> float:
    return float(10 * np.log10(np.sum(ref ** 2) / np.sum((y - ref) ** 2)))


WINO_F32_CASES = [  # (C_in, C_out, T, K, d): the residual units' 7-tap convs at ~2.5 s of
    # audio, then at one frame (the first chunk of a stream); the first conv and the transposed
    # convs (polyphase: K = 2) at a 16-frame chunk and at one frame
    (96, 96, 59520, 7, 1), (96, 96, 59520, 7, 9), (192, 192, 19840, 7, 3), (384, 384, 4960, 7, 1),
    (768, 768, 992, 7, 9), (96, 96, 1920, 7, 9), (192, 192, 640, 7, 3), (384, 384, 160, 7, 1),
    (768, 768, 32, 7, 9), (1024, 1536, 64, 7, 1), (1024, 1536, 4, 7, 1),
    (1536, 6144, 64, 2, 1), (768, 1920, 512, 2, 1), (384, 768, 2560, 2, 1),
    (192, 288, 10240, 2, 1), (1536, 6144, 4, 2, 1), (768, 1920, 32, 2, 1), (384, 768, 160, 2, 1),
]

Packer = Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]
ConvOp = tuple[str, Packer, Callable[..., Any], bool]  # name, pack, op, BF16 weight


def bench_wino(cpu: BackendSet, reps: int, max_busy: float, threads: int, bf16: bool) -> None:
    """A Winograd conv against the direct conv it stands in for: the BF16 pair (AVX512-BF16)
    or the F32 pair (fast mode without the BF16 kernels)."""
    ops_: list[ConvOp]
    if bf16:
        title, cases = "Winograd BF16 conv vs the direct BF16 conv", WINO_CASES
        ops_ = [("direct", co.pack_conv_weight_bf16, co.conv1d_tm_bf16, True),
                ("wino", co.pack_conv_weight_wino_bf16, co.conv1d_wino_bf16, True)]
    else:
        title, cases = "Winograd F(6,7) / F(6,2) F32 conv vs the direct F32 conv", WINO_F32_CASES
        ops_ = [("direct", co.pack_conv_weight, co.conv1d_tm, False),
                ("wino", co.pack_conv_weight_wino_f32, co.conv1d_wino_f32, False)]
    print(f"\n## {title}, {threads} threads: min ms (GFLOP/s of the direct form's multiplies)")
    print("| case | direct ms | winograd ms | speed-up | SNR direct dB | SNR winograd dB | "
          "others' load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for ci, c_out, t, k, d in cases:
        xp = rng.standard_normal((t + (k - 1) * d, ci)).astype(np.float32)
        w = (rng.standard_normal((c_out, ci, k)) / np.sqrt(ci * k)).astype(np.float32)
        b = np.zeros(c_out, np.float32)
        ref = np.zeros((t, c_out))  # float64 conv, on a prefix to keep it quick
        n_ref = min(t, 2048)
        for j in range(k):
            ref[:n_ref] += xp[j * d:j * d + n_ref].astype(np.float64) @ w[:, :, j].T
        flop = 2.0 * ci * c_out * k * t
        stats: dict[str, dict[str, float]] = {}
        snr: dict[str, float] = {}
        for name, pack, conv, half in ops_:
            wp = pack(w)
            g = Graph()
            tx, tb = g.input("xp", xp.shape), g.input("b", b.shape)
            if half:
                wp = co.bf16_bits(wp)
                tw = g.input("w", wp.shape, ggml_type=BF16)
            else:
                tw = g.input("w", wp.shape)
            g.output(conv(g.ctx, tx, tw, tb, d), "y")
            r = GraphRunner(cpu, g, {"xp": xp, "w": wp, "b": b})
            stats[name] = timed(r.run, reps, max_busy, r.set_inputs, threads)
            snr[name] = _snr_db(r.output("y")[:n_ref], ref[:n_ref])
            g.close()
        busy = max(v["busy"] for v in stats.values())
        dm, wm = stats["direct"]["min"], stats["wino"]["min"]
        print(f"| C_in={ci} C_out={c_out} T={t} K={k} d={d} | {dm:.2f} ({flop / dm / 1e6:.0f}) | "
              f"{wm:.2f} ({flop / wm / 1e6:.0f}) | {dm / wm:.2f}x | {snr['direct']:.1f} | "
              f"{snr['wino']:.1f} | {busy:.0%} |", flush=True)


GEMM_I8_CASES = [(3072, 1024, 57), (1024, 3072, 57), (2048, 1024, 57), (1024, 2048, 57),
                 (3072, 1024, 512)]  # (N, K, rows): gate/up, down, q, o; a warm-up batch


def bench_gemm_i8(cpu: BackendSet, reps: int, max_busy: float, threads: int) -> None:
    import gguf

    from engine.ggml import gemm_i8 as gi
    from engine.talker.weights import _Repacked

    print(f"\n## int8 GEMM (W8A8, {'VNNI' if gi.fast_available() else 'portable C'}) vs ggml "
          f"Q4_0 mul_mat (CPU_REPACK), {threads} threads: min ms (GFLOP/s)")
    print("| N x K, rows | ggml Q4_0 | qtts int8 | speed-up | cos vs F32: Q4_0 | cos: int8 | "
          "others' load |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n, k, t in GEMM_I8_CASES:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        x = rng.standard_normal((t, k)).astype(np.float32)
        f32 = x @ w.T
        stats: dict[str, dict[str, float]] = {}
        cos: dict[str, float] = {}
        rp = _Repacked(cpu, 4)
        wt = rp.add("w", lib.GGML_TYPE_Q4_0, (n, k),
                    gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0))
        rp.allocate()
        p = gi.pack(w)
        for name in ("q4_0", "int8"):
            g = Graph()
            tx = g.input("x", (t, k))
            inputs: dict[str, np.ndarray[Any, Any]] = {"x": x}
            if name == "q4_0":
                y = lib.ggml_mul_mat(g.ctx, wt, tx)
            else:
                m = gi.I8Matrix(n, k, g.input("wq", p.wq.shape, np.int8),
                                g.input("ws", p.ws.shape), g.input("wc", p.wc.shape, np.int32))
                y = gi.gemm_i8(g.ctx, tx, m)
                inputs.update(wq=p.wq, ws=p.ws, wc=p.wc)
            g.output(y, "y")
            r = GraphRunner(cpu, g, inputs)
            stats[name] = timed(r.run, reps, max_busy, r.set_inputs, threads)
            out = r.output("y")
            cos[name] = float(np.sum(out * f32) / np.linalg.norm(out) / np.linalg.norm(f32))
            g.close()
        rp.close()
        flop = 2.0 * n * k * t
        qm, im = stats["q4_0"]["min"], stats["int8"]["min"]
        busy = max(v["busy"] for v in stats.values())
        print(f"| {n} x {k}, {t} | {qm:.2f} ({flop / qm / 1e6:.0f}) | {im:.2f} "
              f"({flop / im / 1e6:.0f}) | {qm / im:.2f}x | {cos['q4_0']:.5f} | {cos['int8']:.5f} "
              f"| {busy:.0%} |", flush=True)


# (matrices of 3072 x 1024, rows): 14 is a code-predictor pass's weights (~25 MB, read from the
# cache), 140 a talker step's (248 MB, from memory); 4 and 8 rows are batched steps
GEMV_Q4_CASES = [(4, 1), (14, 1), (14, 4), (14, 8), (140, 1), (140, 2), (140, 4), (140, 8)]


def bench_gemv_q4(reps: int, max_busy: float, threads: int) -> None:
    import gguf

    from engine.ggml import gemv_q4 as gq
    from engine.talker.weights import _Repacked

    n, k = 3072, 1024
    print(f"\n## Q4_0 steps: qtts gemv_q4 ({co.kernel_paths()['gemv_q4']}) vs "
          "ggml mul_mat (CPU_REPACK): min ms (weight GB/s)")
    print("| matrices (MB), rows, threads | ggml Q4_0 | qtts gemv_q4 | speed-up | others' load |")
    print("|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    q4 = np.asarray(gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32),
                                         gguf.GGMLQuantizationType.Q4_0))
    packed = gq.pack(q4, n, k)
    for th in sorted({1, threads}):
        cpu = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(th)})
        for mats, t in GEMV_Q4_CASES:
            x = rng.standard_normal((t, k)).astype(np.float32)
            stats: dict[str, dict[str, float]] = {}
            for name in ("ggml", "qtts"):
                g = Graph(max_nodes=4 * mats + 16)
                tx = g.input("x", (t, k))
                inputs: dict[str, np.ndarray[Any, Any]] = {"x": x}
                rp = _Repacked(cpu, mats) if name == "ggml" else None
                for i in range(mats):
                    if rp is not None:
                        w = rp.add(f"w{i}", lib.GGML_TYPE_Q4_0, (n, k), q4)
                        y = lib.ggml_mul_mat(g.ctx, w, tx)
                    else:
                        w = g.input(f"w{i}", packed.shape, np.int8)
                        inputs[f"w{i}"] = packed
                        y = gq.gemv_q4(g.ctx, tx, w)
                    g.output(y, f"y{i}")
                if rp is not None:
                    rp.allocate()
                r = GraphRunner(cpu, g, inputs)
                # inputs once: re-setting 140 packed copies per repetition would warm the cache
                stats[name] = timed(r.run, reps, max_busy, None, th)
                g.close()
                if rp is not None:
                    rp.close()
            gm, qm = stats["ggml"]["min"], stats["qtts"]["min"]
            mb = mats * q4.nbytes / 1e6
            busy = max(v["busy"] for v in stats.values())
            print(f"| {mats} ({mb:.0f}), {t}, {th} | {gm:.2f} ({mb / gm:.1f}) | {qm:.2f} "
                  f"({mb / qm:.1f}) | {gm / qm:.2f}x | {busy:.0%} |", flush=True)


# (queries, cache rows before them): a cloned voice's request after its pinned prefix, a
# long first prefill, the last layer's one query
ATTN_CASES = [(87, 49), (134, 9), (512, 0), (1, 250)]


def bench_attn(cpu: BackendSet, reps: int, max_busy: float, threads: int) -> None:
    from engine.talker.qwen3 import KV_READ_PAD
    from engine.transformer import attend

    d, h, hkv = 128, 16, 8
    kv = d * hkv
    print(f"\n## Prefill attention, one layer ({h} heads of {d}, {hkv} KV heads, F16 cache), "
          f"{threads} threads: min ms")
    print("| queries after cached rows | ggml's nodes | qtts attn_causal | speed-up | "
          "max abs diff | others' load |")
    print("|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for t, pos0 in ATTN_CASES:
        n_kv = -(-(pos0 + t) // KV_READ_PAD) * KV_READ_PAD
        n_ctx = n_kv + 64
        q = rng.standard_normal((t, h, d)).astype(np.float32)
        k = rng.standard_normal((n_ctx, kv)).astype(np.float16)
        vt = rng.standard_normal((kv, n_ctx)).astype(np.float16)
        pos = np.arange(pos0, pos0 + t, dtype=np.int32)
        keys = np.arange(n_kv, dtype=np.int32)[None, :]
        mask = np.where(keys <= pos[:, None], 0.0, -np.inf).astype(np.float32)
        stats: dict[str, dict[str, float]] = {}
        outs: dict[str, np.ndarray[Any, Any]] = {}
        for name in ("ggml", "qtts"):
            g = Graph()
            tq = g.input("q", q.shape)
            tk, tv = g.input("k", k.shape, np.float16), g.input("v", vt.shape, np.float16)
            inputs: dict[str, np.ndarray[Any, Any]] = {"q": q, "k": k, "v": vt}
            if name == "qtts":
                kk = lib.ggml_view_2d(g.ctx, tk, kv, n_kv, tk.nb[1], 0)
                vv = lib.ggml_view_2d(g.ctx, tv, n_kv, kv, tv.nb[1], 0)
                y = co.attn_causal(g.ctx, tq, kk, vv, g.input("pos", pos.shape, np.int32))
                inputs["pos"] = pos
            else:
                es = 2
                kk = lib.ggml_permute(g.ctx, lib.ggml_view_3d(g.ctx, tk, d, hkv, n_kv, d * es,
                                                              kv * es, 0), 0, 2, 1, 3)
                vv = lib.ggml_view_3d(g.ctx, tv, n_kv, d, hkv, n_ctx * es, d * n_ctx * es, 0)
                y = attend(g.ctx, tq, kk, vv, g.input("mask", mask.shape))
                inputs["mask"] = mask
            g.output(y, "y")
            r = GraphRunner(cpu, g, inputs)
            stats[name] = timed(r.run, reps, max_busy, r.set_inputs, threads)
            outs[name] = r.output("y")
            g.close()
        gm, qm = stats["ggml"]["min"], stats["qtts"]["min"]
        diff = float(np.abs(outs["ggml"] - outs["qtts"]).max())
        busy = max(v["busy"] for v in stats.values())
        print(f"| {t} after {pos0} | {gm:.3f} | {qm:.3f} | {gm / qm:.2f}x | {diff:.1e} | "
              f"{busy:.0%} |", flush=True)


# (sessions, the position each writes and attends up to)
ATTN_STEP_CASES = [(1, 64), (1, 1024), (3, 64), (3, 256), (3, 512), (3, 1024)]
STEP_LAYERS = 28  # a 0.6B talker step's: each layer's caches apart, so they come from memory


def bench_attn_step(cpu: BackendSet, reps: int, max_busy: float, threads: int) -> None:
    from engine.talker.qwen3 import KVCache

    d, h, hkv = 128, 16, 8
    kv = d * hkv
    print(f"\n## Step attention of {STEP_LAYERS} layers ({h} heads of {d}, {hkv} KV heads, F16 "
          f"caches: a 0.6B talker step's), {threads} threads: min ms")
    print("| sessions, position | qtts attn_step | cache GB/s | max error / largest output | "
          "others' load |")
    print("|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n_sess, p in ATTN_STEP_CASES:
        n_ctx = p + 64
        q = rng.standard_normal((n_sess, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((n_sess, kv)).astype(np.float32) for _ in range(2))
        pos = np.full(n_sess, p, np.int32)
        caches = [KVCache(cpu, STEP_LAYERS, kv, n_ctx, lib.GGML_TYPE_F16, "bench")
                  for _ in range(n_sess)]
        rows = []
        for c in caches:
            kc = rng.standard_normal((n_ctx, kv)).astype(np.float16)
            vc = rng.standard_normal((kv, n_ctx)).astype(np.float16)
            for il in range(STEP_LAYERS):
                lib.ggml_backend_tensor_set(c.k[il], ffi.from_buffer(kc), 0, kc.nbytes)
                lib.ggml_backend_tensor_set(c.v[il], ffi.from_buffer(vc), 0, vc.nbytes)
            rows.append((kc, vc))
        g = Graph()
        tq, tk, tv = g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape)
        tp = g.input("pos", pos.shape, np.int32)
        for il in range(STEP_LAYERS):
            steps = [co.StepCache(c.k[il], c.v[il], 0, c.n_ctx) for c in caches]
            g.output(co.attn_step(g.ctx, tq, tk, tv, tp, steps, g.keep), f"y{il}")
        r = GraphRunner(cpu, g, {"q": q, "k": k, "v": v, "pos": pos})
        stats = timed(r.run, reps, max_busy, None, threads)
        y = r.output("y0").reshape(n_sess, h, d)
        err = 0.0
        for s, (kc, vc) in enumerate(rows):  # float64 over the rows the op wrote
            kr = kc[:p + 1].astype(np.float64)
            vr = vc[:, :p + 1].astype(np.float64)
            kr[p] = k[s].astype(np.float16)
            vr[:, p] = v[s].astype(np.float16)
            for head in range(h):
                kh = kr[:, (head // (h // hkv)) * d:][:, :d]
                sc = kh @ q[s, head].astype(np.float64) / np.sqrt(d)
                w = np.exp(sc - sc.max())
                want = (vr[(head // (h // hkv)) * d:][:d] @ w) / w.sum()
                err = max(err, float(np.abs(y[s, head] - want).max() / np.abs(want).max()))
        g.close()
        for c in caches:
            c.close()
        gb = STEP_LAYERS * n_sess * (p + 1) * 2 * kv * 2 / 1e9
        print(f"| {n_sess}, {p} | {stats['min']:.2f} | {gb / stats['min'] * 1e3:.1f} | "
              f"{err:.1e} | {stats['busy']:.0%} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--max-busy", type=float, default=0.05,
                    help="drop repetitions where other processes used more of the machine")
    ap.add_argument("--only", choices=["conv", "snake", "bf16", "hist", "wino", "wino_f32",
                                       "gemm_i8", "gemv_q4", "attn", "attn_step"],
                    default=None)
    ap.add_argument("--extra", action="store_true",
                    help=f"also {EXTRA_CONV_CASES} (conv), {EXTRA_BF16_CASES} (bf16) and "
                    f"{EXTRA_HIST_CASES} (hist)")
    args = ap.parse_args()
    cpu = BackendSet.from_env({"QTTS_BACKEND": "cpu", "QTTS_THREADS": str(args.threads)})
    print(f"qtts kernels: libqtts_ops {co.simd_isa()} path, {args.threads} threads, "
          f"{os.cpu_count()} CPUs visible; load average {os.getloadavg()[0]:.2f}")
    if args.only in (None, "snake"):
        bench_snake(cpu, args.reps, args.max_busy)
    if args.only in (None, "conv"):
        cases = CONV_CASES + (EXTRA_CONV_CASES if args.extra else [])
        bench_conv(cpu, cases, args.reps, args.max_busy, args.threads)
    if args.only in (None, "bf16"):
        cases = BF16_CONV_CASES + (EXTRA_BF16_CASES if args.extra else [])
        bench_conv_bf16(cpu, cases, args.reps, args.max_busy, args.threads)
    if args.only in (None, "hist"):
        cases = HIST_CASES + (EXTRA_HIST_CASES if args.extra else [])
        bench_hist(cpu, cases, args.reps, args.max_busy, args.threads)
    if args.only in (None, "wino"):
        bench_wino(cpu, args.reps, args.max_busy, args.threads, bf16=True)
    if args.only in (None, "wino_f32"):
        bench_wino(cpu, args.reps, args.max_busy, args.threads, bf16=False)
    if args.only in (None, "gemm_i8"):
        bench_gemm_i8(cpu, args.reps, args.max_busy, args.threads)
    if args.only in (None, "gemv_q4"):
        bench_gemv_q4(args.reps, args.max_busy, args.threads)
    if args.only in (None, "attn"):
        bench_attn(cpu, args.reps, args.max_busy, args.threads)
    if args.only in (None, "attn_step"):
        bench_attn_step(cpu, args.reps, args.max_busy, args.threads)


if __name__ == "__main__":
    main()
