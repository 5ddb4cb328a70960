"""Native-fault diagnostics and the row-limit offload policy (engine/diagnostics.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backend import BackendSet, built_backends
from engine.decoder import DecoderModel, decode
from engine.diagnostics import first_difference
from engine.ggml import Graph, lib
from engine.gguf_model import open_model


def _env(**kw: str) -> dict[str, str]:
    return {f"QTTS_{k.upper()}": v for k, v in kw.items()}


def test_op_log_names_the_node_that_made_the_first_nan(capfd: pytest.CaptureFixture[str]) -> None:
    bs = BackendSet.from_env(_env(backend="cpu", threads="1", op_log="1"))
    g = Graph()
    x = g.input("x", (4, 8))
    shifted = lib.ggml_scale_bias(g.ctx, x, 1.0, -0.5)  # makes some values negative
    bad = lib.ggml_log(g.ctx, shifted)
    lib.ggml_set_name(bad, b"deliberate.log")
    g.output(lib.ggml_add(g.ctx, bad, x), "y")
    bs.execute(g, {"x": np.linspace(0, 1, 32, dtype=np.float32).reshape(4, 8)})
    log = bs.last_op_log
    assert log is not None and log.first_bad is not None
    node, inputs = log.first_bad
    assert node.op == "LOG" and node.name == "deliberate.log" and node.nan > 0
    assert inputs and inputs[0].op == "SCALE" and inputs[0].nan == 0  # stats from before reuse
    assert len(log.nodes) == 3  # scale, log, add: every node was observed
    err = capfd.readouterr().err
    assert "first NaN/Inf: #1 LOG 'deliberate.log'" in err


def test_op_log_all_clear_and_off_by_default() -> None:
    w = np.eye(16, dtype=np.float32)
    for env, expect_log in ((_env(backend="cpu", op_log="1"), True), (_env(backend="cpu"), False)):
        bs = BackendSet.from_env(env)
        g = Graph()
        g.output(lib.ggml_mul_mat(g.ctx, g.input("w", w.shape), g.input("x", (3, 16))), "y")
        bs.execute(g, {"w": w, "x": np.ones((3, 16), np.float32)})
        assert (bs.last_op_log is not None) == expect_log
        if expect_log:
            assert bs.last_op_log is not None and bs.last_op_log.first_bad is None


@pytest.mark.skipif("blas" not in built_backends(), reason="build has no BLAS backend")
def test_op_filter_cannot_pin_ops_away_from_blas() -> None:
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)

    def placement(env: dict[str, str]) -> dict[str, int]:
        bs = BackendSet.from_env(env)
        g = Graph()
        h = lib.ggml_mul_mat(g.ctx, g.input("w", w.shape), g.input("x", (64, 64)))
        g.output(lib.ggml_gelu_erf(g.ctx, h), "y")
        return bs.placement(g).nodes_per_backend

    # BLAS shares the CPU's buffer type, and ggml's scheduler (pass 3 of split_graph) moves a
    # node back to the higher-priority backend of the same buffer type: the filter cannot pin
    # ops away from BLAS. Backends with their own buffers (rpc, cuda, ...) honour it: see
    # test_backend.test_graph_split_across_rpc_and_cpu_equals_cpu.
    assert placement(_env(backend="blas")) == {"BLAS": 1, "CPU": 1}
    assert placement(_env(backend="blas", op_filter="MUL_MAT")) == {"BLAS": 1, "CPU": 1}


def test_determinism_check_passes_on_cpu() -> None:
    bs = BackendSet.from_env(_env(backend="cpu", threads="2", check_determinism="1"))
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 128)).astype(np.float32)
    g = Graph()
    h = lib.ggml_mul_mat(g.ctx, g.input("w", w.shape), g.input("x", (50, 128)))
    g.output(lib.ggml_soft_max(g.ctx, h), "y")
    bs.execute(g, {"w": w, "x": rng.standard_normal((50, 128)).astype(np.float32)})
    log = bs.last_op_log
    assert log is not None and len(log.hashes) == 2 and all(h for _, h in log.hashes)


def test_first_difference_reports_the_node() -> None:
    assert first_difference([("a", "1"), ("b", "2")], [("a", "1"), ("b", "2")]) is None
    assert first_difference([("a", "1"), ("b", "2")], [("a", "1"), ("b", "3")]) == (
        "node #1 'b' differs between two runs of the same graph")


def test_row_limited_matmuls_equal_unsplit(tiny_gguf: Path) -> None:
    model = open_model(tiny_gguf)
    codes = np.random.default_rng(2).integers(0, 2048, (16, 6))
    # stock ggml ops (as on an accelerator): every conv is matmuls, so the split is exercised
    full = BackendSet.from_env(_env(backend="cpu", threads="2", custom_ops="0"))
    split = BackendSet.from_env(_env(backend="cpu", threads="2", max_matmul_rows="1024",
                                     custom_ops="0"))
    assert split.max_matmul_rows == 1024
    dec_full, dec_split = (DecoderModel.load(model, bs, "exact") for bs in (full, split))
    assert not dec_split.use_custom_ops
    full.placement_log, split.placement_log = [], []
    a, _ = decode(dec_full, codes)
    b, _ = decode(dec_split, codes)
    # every matmul of the split decode fits the limit; the unsplit one does not
    assert max(p.max_matmul_rows for p in full.placement_log) == 6 * 1920
    assert max(p.max_matmul_rows for p in split.placement_log) <= 1024
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # and the split graph really has more matmuls than rows allow in one
    bs = BackendSet.from_env(_env(backend="cpu", max_matmul_rows="64"))
    from engine.decoder.blocks import StageGraph

    g = StageGraph([{}], max_matmul_rows=bs.max_matmul_rows)
    w = g.input("w", (8, 16))
    g.output(g.mul_mat(w, g.input("x", (200, 16))), "y")
    ops = [n for n in g.nodes() if lib.ggml_op_desc(n) and n.op == lib.GGML_OP_MUL_MAT]
    assert len(ops) == 4  # 64 + 64 + 64 + 8 rows
