"""The talker LLM and the code predictor on ggml: prefill, one step per frame, 15 code passes.

Graphs (all built from the shared block builder in ``engine.talker.qwen3``):

* **prefill** (one-off, through ``BackendSet.execute``): the text projection of every text id
  of the prompt *and* of the trailing text (plus ``tts_pad``) in one batch; the prompt
  embeddings ``T(text) + mask * C(codec)``; all talker layers over the whole prompt (batched,
  causal mask), writing the KV cache as one block per tensor; the last layer past its K/V, the
  final norm and ``codec_head`` at the last position only (nothing reads the others).
  Returns logits, the final-normed hidden state, and the projected trailing text / pad rows.
  The K/V rows of the prompt prefix (instruction, role, codec prefix, speaker) are kept and
  written back for the next request with the same prefix, which then prefills only its text.
* **talker step** (``CachedGraph``, one per 64-position bucket of the cache): the next input
  ``C(c0) + sum_j cp_embd[j](c_j) + text_add``, one position through every layer (reading the
  bucket's cache prefix with a mask for the positions not written yet), logits and hidden.
* **code predictor** (15 ``CachedGraph``s, built once): pass 0 feeds
  ``[h_last, C(c0)]`` (through ``small_to_mtp`` when present) at positions 0-1 and uses
  ``lm_head[0]``; pass j (1..14) feeds ``cp_embd[j-1](c_j)`` at position j+1 and uses
  ``lm_head[j]``. The 16-position cache is simply overwritten every frame ("fresh per frame").

Sampling is the caller's (``engine.talker.generate``): every graph returns float32 logits.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.backend import BackendSet
from engine.errors import InputError
from engine.ggml import Graph, Tensor, lib
from engine.talker.prompt import Prompt
from engine.talker.qwen3 import (
    Builder,
    KVCache,
    attn_inputs,
    attn_uploads,
    last_column,
    prefill_inputs,
    prefill_n_kv,
    stack,
)
from engine.talker.runner import BuildStats, CachedGraph, execute_timed
from engine.talker.weights import TalkerWeights
from engine.transformer import rms_norm

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

KV_TYPES: dict[str, int] = {"f32": lib.GGML_TYPE_F32, "f16": lib.GGML_TYPE_F16}
STEP_BUCKET = 64  # talker-step graphs are rebuilt when the cache prefix crosses a bucket
SHRINK_BYTES = 64 << 20  # a talker cache over this size shrinks when 4x bigger than needed
PREFIX_CACHE_ENTRIES = 32  # prompt prefixes (voice x language x instruction) kept, LRU
PREFIX_CACHE_BYTES = 64 << 20  # ... and at most this many bytes of them
# (prefixes pinned by ``pin_prefixes`` at warm-up are kept apart and never evicted)
# Prompt positions per prefill graph: a typical prompt (a sentence or a few) is one graph; a
# longer one is several, so the compute buffer is bounded by this, not by the prompt.
PREFILL_CHUNK = 256
# Talker cache positions reserved at warm-up and never given back: a 55-token sentence with its
# default frame budget needs ~770, so typical requests never allocate (an allocation is paid in
# the first request's time to first audio; docs/performance.md, Figures behind the code).
WARM_POSITIONS = 1024


class PrefillCancelled(Exception):
    """``cancel`` said stop between two prefill chunks (the cache holds a partial prompt)."""

    def __init__(self, done: int) -> None:
        super().__init__(f"prefill cancelled after {done} positions")
        self.done = done


@dataclass
class PrefillOut:
    """What the prefill returns (float32 numpy arrays)."""

    logits: F32  # [vocab]
    hidden: F32  # [hidden]: final-normed state at the last position (code-predictor input)
    trailing: F32  # [n_trailing, hidden]: projected trailing text rows, one per frame
    pad: F32  # [hidden]: projected tts_pad row (after the trailing text)
    taps: dict[str, F32] = field(default_factory=dict)  # capture=True: named intermediates


class TalkerModel:
    """Talker + code predictor weights, their KV caches and cached step graphs.

    One utterance at a time (the caches are shared state). ``kv_type``: "f16" (default; half
    the cache memory and bandwidth) or "f32" (parity with the F32 reference to ~1e-5).
    ``repack``: Q4_0 matrices re-laid out for the steps' kernels, qtts's ``gemv_q4`` or ggml's
    CPU_REPACK (see ``engine.talker.weights``).
    ``int8_prefill``: int8 copies of a Q8_0/Q4_0 talker's matrices for prefills (ibid.); None:
    as the BackendSet's options say (``EngineOptions.int8_prefill``). ``prefill_chunk``:
    prompt positions per prefill graph (see ``prefill``).
    """

    def __init__(self, model: Any, backends: BackendSet, kv_type: str = "f16",
                 repack: bool = True, int8_prefill: bool | None = None,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if int8_prefill is None:
            int8_prefill = backends.options.int8_prefill
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = int(prefill_chunk)
        self.backends = backends
        self.weights = TalkerWeights(model, backends, repack, int8_prefill)
        self.cfg = model.talker_config
        self.cp_cfg = model.code_predictor_config
        self.kv_type = KV_TYPES[kv_type]
        self.stats = BuildStats()
        self.n_groups = int(self.cfg.num_code_groups)
        w = self.weights
        self.cache: KVCache | None = None
        self._min_ctx = 0  # talker cache positions never given back (set by warm_up)
        self._step: tuple[int, CachedGraph] | None = None
        self.cp_cache = KVCache(backends, len(w.cp_layers), w.cp_shape.kv_dim, self.n_groups,
                                self.kv_type, "cp")
        self._cp_graphs: list[CachedGraph] = []
        self._cp_uploads: list[dict[str, np.ndarray[Any, Any]]] = []
        # prompt-prefix key -> (K rows, V rows) as [n_layers, P, kv_dim] in the cache's dtype
        self._pinned: dict[tuple[bytes, bytes, bytes],
                           tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        self._prefix: OrderedDict[tuple[bytes, bytes, bytes],
                                  tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = OrderedDict()
        self.last_prefill_positions = 0

    @property
    def hidden_size(self) -> int:
        """Talker width H."""
        return int(self.cfg.hidden_size)

    @property
    def eos_id(self) -> int:
        """The codec end-of-speech id."""
        return int(self.cfg.codec_eos_token_id)

    # -- talker cache ------------------------------------------------------------------------

    def reserve(self, n_positions: int) -> None:
        """Make the talker cache hold at least ``n_positions`` (bucket-rounded).

        The cache persists across utterances (allocated once per worker for typical lengths);
        it grows when needed and shrinks back only when it is both large and 4x oversized.
        """
        self._check_positions(n_positions)
        floor = self._min_ctx
        if self.cache is not None and self.cache.n_ctx >= n_positions:
            # Keep a big cache for the next long request, unless it is far bigger than
            # needed and worth giving back (one 4096-frame request at 0.6B holds ~0.5 GB).
            if (self.cache.n_ctx <= max(4 * n_positions, floor)
                    or self.cache.nbytes <= SHRINK_BYTES):
                return
        n_ctx = max(-(-n_positions // STEP_BUCKET) * STEP_BUCKET, floor)
        self._drop_step_graph()
        if self.cache is not None:
            self.cache.close()
        self.cache = self._talker_cache(n_ctx)

    def trim(self) -> None:
        """Give the talker cache back down to the size reserved at warm-up (after a request
        that needed more); nothing before ``warm_up``."""
        if self.cache is None or not self._min_ctx or self.cache.n_ctx <= self._min_ctx:
            return
        self._drop_step_graph()
        self.cache.close()
        self.cache = self._talker_cache(self._min_ctx)

    def _check_positions(self, n_positions: int) -> None:
        if n_positions > int(self.cfg.max_position_embeddings):
            raise InputError(
                "max_frames",
                f"prompt + frames = {n_positions} positions exceed the talker's "
                f"{self.cfg.max_position_embeddings}",
            )

    def _talker_cache(self, n_ctx: int) -> KVCache:
        w = self.weights
        return KVCache(self.backends, len(w.layers), w.talker_shape.kv_dim, n_ctx, self.kv_type,
                       "talk")

    def _drop_step_graph(self) -> None:
        if self._step is not None:
            self._step[1].close()
            self._step = None

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self, prompt: Prompt, capture: bool = False, reuse_prefix: bool = True,
                cancel: Callable[[], bool] | None = None) -> PrefillOut:
        """Run the prompt through the talker into the model's own cache (``prefill_chunks``)."""
        chunks = self.prefill_chunks(prompt, capture, reuse_prefix)
        while True:
            try:
                done = next(chunks)
            except StopIteration as stop:
                out: PrefillOut = stop.value
                return out
            if cancel is not None and cancel():
                chunks.close()
                raise PrefillCancelled(done)

    def new_cache(self, n_positions: int) -> KVCache:
        """A talker cache of its own for one session of a batch (``engine.talker.batch``):
        ``n_positions`` rounded up to the step bucket; freed by its ``close``."""
        self._check_positions(n_positions)
        return self._talker_cache(-(-n_positions // STEP_BUCKET) * STEP_BUCKET)

    def prefill_chunks(self, prompt: Prompt, capture: bool = False, reuse_prefix: bool = True,
                       cache: KVCache | None = None) -> Generator[int, None, PrefillOut]:
        """Run the prompt through the talker (positions 0..L-1) and project the trailing text.

        The prompt prefix (instruction, role, codec prefix, speaker: ``prompt.n_prefix``
        positions) is the same for every request with the same voice/language/instruction, so
        its K/V rows are kept (a small LRU of host arrays) and written back into the cache
        instead of recomputed: a repeat request prefills only its own text (about a quarter of
        the prefill for a short sentence). ``capture`` (parity taps) always runs the full prompt,
        every position through every layer (otherwise the last layer past its K/V runs only at
        the last position: the head reads nothing else).

        Prompts longer than ``prefill_chunk`` positions run as several graphs of at most that
        many positions, each attending to the cache (earlier chunks' rows included): the
        compute buffer holds a ``chunk x n_kv`` score matrix per head, never ``L x L``; the
        generator yields the positions done between two chunks (``prefill`` checks ``cancel``
        there; the batch scheduler runs other sessions' steps there). ``capture`` runs one
        graph. ``cache``: a session's own cache (``new_cache``) instead of the model's.
        """
        if cache is None:
            if self.cache is None or self.cache.n_ctx < prompt.length:
                self.reserve(prompt.length + 1)
            cache = self.cache
        elif cache.n_ctx < prompt.length + 1:
            raise InputError("max_frames", f"talker cache too small for a prompt of "
                             f"{prompt.length} positions")
        assert cache is not None
        n_all = prompt.length
        if reuse_prefix and not capture:
            n_pre, reuse = self.kept_prefix(prompt)
        else:
            n_pre, reuse = _prefix_positions(prompt), None
        key = _prefix_key(prompt, n_pre)
        start = n_pre if reuse is not None else 0
        chunk = max(1, n_all - start if capture else self.prefill_chunk)
        # a prefix longer than one chunk is not kept (only a long instruction makes one)
        snapshot = n_pre if (reuse is None and n_pre and not capture and n_pre <= chunk) else 0
        computed_from = start  # (the prefix graph below counts too)
        if snapshot and n_pre < n_all:
            # The prefix alone first, then the rest as a request that finds it kept runs it:
            # in one graph with the prefix, a one-row rest (a streaming-text opening) would
            # multiply the int8 copies (several rows) instead of the stored Q4_0 weights (one
            # row), and the first request of a voice would not sound as its repeats do.
            reuse = self._prefix_rows(prompt, cache, n_pre)
            self._keep_prefix(key, reuse)
            start, snapshot = n_pre, 0
            yield n_pre
        c0 = start
        while True:
            c1 = min(n_all, c0 + chunk)
            out = self._prefill_graph(prompt, cache, c0, c1, first=c0 == start,
                                      capture=capture,
                                      reuse=reuse if c0 == start else None,
                                      snapshot=snapshot if c0 == start else 0)
            if c0 == start and snapshot:
                self._keep_prefix(key, self._snapshot_rows(out))
            if c1 == n_all:
                break
            c0 = c1
            yield c0
        self.last_prefill_positions = n_all - computed_from
        n_trail = int(prompt.trailing_ids.shape[0])
        tail = out["text_tail"].reshape(n_trail + 1, -1)
        taps = {k[4:]: v for k, v in out.items() if k.startswith("tap.")}
        return PrefillOut(
            logits=out["logits"].reshape(-1),
            hidden=out["hidden"].reshape(-1),
            trailing=tail[:n_trail],
            pad=tail[n_trail],
            taps=taps,
        )

    def kept_prefix(self, prompt: Prompt
                    ) -> tuple[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None]:
        """(positions of ``prompt``'s prefix, its kept K/V rows or None): the rows a prefill
        writes back instead of computing them (pinned, or among the recent prefixes, which
        this marks as used)."""
        n_pre = _prefix_positions(prompt)
        if not n_pre:
            return 0, None
        key = _prefix_key(prompt, n_pre)
        reuse = self._pinned.get(key) or self._prefix.get(key)
        if reuse is not None and key in self._prefix:
            self._prefix.move_to_end(key)
        return n_pre, reuse

    def _prefix_rows(self, prompt: Prompt, cache: KVCache, n_pre: int
                     ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The K/V rows of ``prompt``'s first ``n_pre`` positions, computed alone: by a prefill
        that lacks them and by ``pin_prefixes`` alike, so the two keep the same bits."""
        return self._snapshot_rows(self._prefill_graph(
            prompt, cache, 0, n_pre, first=True, capture=False, reuse=None, snapshot=n_pre))

    def _prefill_graph(self, prompt: Prompt, cache: KVCache, c0: int, c1: int, *, first: bool,
                       capture: bool,
                       reuse: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None,
                       snapshot: int) -> dict[str, np.ndarray[Any, Any]]:
        """One prefill graph over prompt positions ``c0 .. c1-1``.

        The first graph writes the reused prefix rows (positions ``0 .. c0-1``) with its own;
        a later one (``first`` False) finds positions ``0 .. c0-1`` in the cache already. The
        last one (``c1`` = the prompt length) also projects the trailing text and runs the head.
        """
        w = self.weights
        n = c1 - c0
        last = c1 == prompt.length
        n_pre = c0 if reuse is not None else 0
        text_ids = prompt.text_ids[c0:c1]
        if last:
            text_ids = np.concatenate([text_ids, prompt.trailing_ids,
                                       np.asarray([prompt.pad_id], dtype=np.int32)])
        n_text = int(text_ids.shape[0])
        kv_np = self.kv_np
        n_layers = len(w.layers)
        n_kv = prefill_n_kv(c1, cache.n_ctx)
        row0 = 0 if first else c0

        def build(g: Graph) -> None:
            ctx = g.ctx
            b = Builder(g, w.talker_shape, capture, mul_mat=w.mul_mat)
            x, txt = self.prompt_embeddings(b, n, n_text, prompt.embed_add is not None)
            if last:
                hs = int(txt.ne[0])
                tail = lib.ggml_view_2d(ctx, txt, hs, n_text - n, txt.nb[1], n * txt.nb[1])
                g.output(lib.ggml_cont(ctx, tail), "text_tail")
            a = prefill_inputs(g, n, n_kv, row0)
            a.snapshot = snapshot
            if reuse is not None:
                kv = w.talker_shape.kv_dim
                a.prefix_k = _as_f32(ctx, g.input("prefix_k", (n_layers, n_pre, kv), kv_np))
                a.prefix_v = _as_f32(ctx, g.input("prefix_v", (n_layers, n_pre, kv), kv_np))
            # Only the last position feeds the head; capture keeps every position (taps).
            x = stack(b, w.layers, x, a, cache, last_only=not capture)
            if not last:
                g.expand(x)  # (the K/V writes are what an earlier chunk is for)
                return
            x = b.cb(rms_norm(ctx, last_column(b, x), w.output_norm, w.talker_shape.eps),
                     "out_norm")
            g.output(x, "hidden")
            g.output(w.mul_mat(ctx, w.codec_head, x), "logits")

        up: dict[str, np.ndarray[Any, Any]] = {
            "text_ids": text_ids,
            "codec_ids": prompt.codec_ids[c0:c1],
            "codec_mask": prompt.codec_mask[c0:c1].reshape(n, 1),
            **attn_uploads(cache, c0, n, n_kv, indices=False),
        }
        if prompt.embed_add is not None:
            up["embed_add"] = np.ascontiguousarray(prompt.embed_add[c0:c1], dtype=np.float32)
        if reuse is not None:
            up.update(prefix_k=reuse[0], prefix_v=reuse[1])
        return execute_timed(self.backends, build, up, max_nodes=_graph_nodes(n_layers, n),
                             stats=self.stats)

    def _keep_prefix(self, key: tuple[bytes, bytes, bytes],
                     rows: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> None:
        # LRU bounded by entries and by bytes: distinct long instructions cannot grow it
        self._prefix[key] = rows
        self._prefix.move_to_end(key)
        while self._prefix and (len(self._prefix) > PREFIX_CACHE_ENTRIES or sum(
                k.nbytes + v.nbytes for k, v in self._prefix.values()) > PREFIX_CACHE_BYTES):
            self._prefix.popitem(last=False)

    def project_text(self, ids: Sequence[int]) -> F32:
        """The projected text rows ``T(id)`` [n, hidden] of ``ids``: what a streaming-text
        frame adds to its talker input (prefill computes the same rows for the text it knows;
        live text arriving later is projected here)."""
        w = self.weights
        arr = np.asarray(list(ids), dtype=np.int32)
        n = int(arr.shape[0])

        def build(g: Graph) -> None:
            b = Builder(g, w.talker_shape, False, mul_mat=w.mul_mat)
            t = g.input("text_ids", (n,), np.int32)
            e = lib.ggml_get_rows(g.ctx, w.text_embd, t)
            h = lib.ggml_silu(g.ctx, b.linear(e, w.text_fc1_w, w.text_fc1_b))
            g.output(b.linear(h, w.text_fc2_w, w.text_fc2_b), "text")

        out = execute_timed(self.backends, build, {"text_ids": arr}, max_nodes=64,
                            stats=self.stats)
        return out["text"].reshape(n, -1)

    def prompt_embeddings(self, b: Builder, n: int, n_text: int, with_add: bool = False,
                          suffix: str = "") -> tuple[Tensor, Tensor]:
        """Declare inputs ``text_ids`` [n_text], ``codec_ids`` [n], ``codec_mask`` [n, 1]
        (and ``embed_add`` [n, H] when ``with_add``: voice-cloning rows), each name followed by
        ``suffix``; return the embeddings of the first n positions ``T(text) + mask *
        C(codec) (+ add)`` [H, n] and the projected text of all n_text ids [H, n_text]."""
        g, ctx, w = b.g, b.ctx, self.weights
        ids = g.input("text_ids" + suffix, (n_text,), np.int32)
        e = lib.ggml_get_rows(ctx, w.text_embd, ids)
        h = lib.ggml_silu(ctx, b.linear(e, w.text_fc1_w, w.text_fc1_b))
        txt = b.cb(b.linear(h, w.text_fc2_w, w.text_fc2_b), "text_proj")  # [H, n_text]
        t_prompt = lib.ggml_view_2d(ctx, txt, int(txt.ne[0]), n, txt.nb[1], 0)
        cid = g.input("codec_ids" + suffix, (n,), np.int32)
        cmask = g.input("codec_mask" + suffix, (n, 1))
        c = lib.ggml_mul(ctx, lib.ggml_get_rows(ctx, w.codec_embd, cid), cmask)
        if with_add:
            c = lib.ggml_add(ctx, c, g.input("embed_add" + suffix, (n, int(txt.ne[0]))))
        return b.cb(lib.ggml_add(ctx, t_prompt, c), "inp_embd"), txt

    def frame_embeddings(self, codes: I32) -> F32:
        """``C(c0) + sum_j cp_embd[j](c_j)`` of frames ``codes`` [T, 16]: the talker input a
        frame makes (voice cloning feeds the reference codes this way), [T, hidden]."""
        w, n_groups = self.weights, self.n_groups
        c = np.ascontiguousarray(codes, dtype=np.int32)
        if c.ndim != 2 or c.shape[1] != n_groups or c.shape[0] < 1:
            raise InputError("ref_codes", f"expected [frames, {n_groups}] codes, got {c.shape}")
        t = c.shape[0]

        def build(g: Graph) -> None:
            ctx = g.ctx
            ids = g.input("codes_t", (n_groups, t), np.int32)  # one row per codebook
            x = codes_embedding(ctx, w, ids, t, int(ids.nb[1]))
            g.output(_as_f32(ctx, x), "embd")

        out = execute_timed(self.backends, build, {"codes_t": np.ascontiguousarray(c.T)},
                            max_nodes=256, stats=self.stats)
        return out["embd"].reshape(t, -1).astype(np.float32)

    # -- pinned prompt prefixes --------------------------------------------------------------

    def pin_prefixes(self, prompts: Sequence[Prompt], pin: bool = True) -> int:
        """Compute the K/V rows of the prefixes of ``prompts`` now and keep them for the life of
        the model (not in the LRU): a later request with one of those voice/language/instruction
        prefixes prefills only its own text. Returns how many prefixes are pinned in all.
        ``pin=False``: keep them among the recent prefixes instead (the LRU a prefill fills),
        for a voice that is likely to speak soon but need not stay.

        Each prefix runs alone, as a request that finds it missing runs it first
        (``_prefix_rows``), so its rows have the bits that request would keep: a voice sounds the
        same for a seed whether its prefix was pinned at warm-up or computed by its first request
        (``QTTS_PIN_PREFIXES`` on or off). (One block-diagonal batch of many prefixes ran ggml's
        attention where a request runs the fused one, and cost as much here: short prefixes
        stream the weights.)
        """
        todo: dict[tuple[bytes, bytes, bytes], Prompt] = {}
        for p in prompts:
            if n := _prefix_positions(p):
                key = _prefix_key(p, n)
                if key not in self._pinned and (pin or key not in self._prefix):
                    todo.setdefault(key, p)
        for key, p in todo.items():
            n = p.n_prefix
            if self.cache is None or self.cache.n_ctx < n:
                self.reserve(n)
            assert self.cache is not None
            rows = self._prefix_rows(p, self.cache, n)
            if pin:
                self._pinned[key] = rows
                self._prefix.pop(key, None)
            else:
                self._keep_prefix(key, rows)
        return len(self._pinned)

    @property
    def kv_np(self) -> type[np.floating[Any]]:
        """The numpy type of the cache's K/V rows (kept prefixes are stored as it holds them)."""
        return np.float16 if self.kv_type == lib.GGML_TYPE_F16 else np.float32

    def _snapshot_rows(self, out: dict[str, np.ndarray[Any, Any]]
                       ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The ``snap_k.*`` / ``snap_v.*`` outputs of every layer as [n_layers, P, kv_dim]."""
        n_layers = len(self.weights.layers)
        pk = np.stack([out[f"snap_k.{il}"] for il in range(n_layers)]).astype(self.kv_np)
        pv = np.stack([out[f"snap_v.{il}"] for il in range(n_layers)]).astype(self.kv_np)
        return pk, pv

    # -- one talker step ---------------------------------------------------------------------

    def step(self, codes: I32, text_add: F32, pos: int) -> tuple[F32, F32]:
        """Feed frame codes [16] (+ the text row) at position ``pos``; return (logits, hidden)."""
        cache = self.cache
        if cache is None or pos >= cache.n_ctx:
            raise InputError("max_frames", f"talker cache too small for position {pos}")
        n_kv = min(-(-(pos + 1) // STEP_BUCKET) * STEP_BUCKET, cache.n_ctx)
        if self._step is None or self._step[0] != n_kv:
            self._drop_step_graph()
            self._step = (n_kv, CachedGraph(self.backends, self._step_builder(cache, n_kv),
                                            _graph_nodes(len(self.weights.layers), 1),
                                            self.stats))
        up = {
            "codes": np.ascontiguousarray(codes, dtype=np.int32),
            "text_add": np.ascontiguousarray(text_add, dtype=np.float32).reshape(1, -1),
            **attn_uploads(cache, pos, 1, n_kv),
        }
        out = self._step[1].run(up)
        return out["logits"].reshape(-1), out["hidden"].reshape(-1)

    def _step_builder(self, cache: KVCache, n_kv: int) -> Callable[[Graph], None]:
        w = self.weights
        n_groups = self.n_groups

        def build(g: Graph) -> None:
            ctx = g.ctx
            b = Builder(g, w.talker_shape, mul_mat=w.mul_mat)
            codes = g.input("codes", (n_groups,), np.int32)
            x = codes_embedding(ctx, w, codes, 1, int(codes.nb[0]))
            text_add = g.input("text_add", (1, w.talker_shape.hidden))
            x = b.cb(lib.ggml_add(ctx, x, text_add), "inp_embd")
            a = attn_inputs(g, cache, 1, n_kv, masked=True)
            x = stack(b, w.layers, x, a, cache)
            x = b.cb(rms_norm(b.ctx, x, w.output_norm, w.talker_shape.eps), "out_norm")
            g.output(x, "hidden")
            g.output(w.mul_mat(ctx, w.codec_head, x), "logits")

        return build

    # -- code predictor ----------------------------------------------------------------------

    def _build_cp_graphs(self) -> None:
        w = self.weights
        cache = self.cp_cache
        shape = w.cp_shape
        nodes = _graph_nodes(len(w.cp_layers), 2)

        def project(b: Builder, x: Tensor) -> Tensor:
            if w.cp_mtp_w is None:
                return x
            return b.cb(b.linear(x, w.cp_mtp_w, w.cp_mtp_b), "mtp_proj")

        def head(b: Builder, g: Graph, x: Tensor, j: int) -> None:
            x = b.cb(rms_norm(b.ctx, last_column(b, x), w.cp_output_norm, shape.eps), "out_norm")
            g.output(w.mul_mat(b.ctx, w.cp_heads[j], x), "logits")

        def first(g: Graph) -> None:
            b = Builder(g, shape, mul_mat=w.mul_mat)
            hidden = g.input("hidden", (1, w.talker_shape.hidden))
            c0 = g.input("code", (1,), np.int32)
            e0 = lib.ggml_get_rows(g.ctx, w.codec_embd, c0)
            x = project(b, b.cb(lib.ggml_concat(g.ctx, hidden, e0, 1), "inp_embd"))
            x = stack(b, w.cp_layers, x, attn_inputs(g, cache, 2, 2, masked=True), cache)
            head(b, g, x, 0)

        def nxt(j: int) -> Callable[[Graph], None]:
            def build(g: Graph) -> None:
                b = Builder(g, shape, mul_mat=w.mul_mat)
                code = g.input("code", (1,), np.int32)
                e = b.cb(lib.ggml_get_rows(g.ctx, w.cp_embd[j - 1], code), "inp_embd")
                x = project(b, e)
                # Position j+1 attends to every position 0..j+1 written this frame: no mask.
                a = attn_inputs(g, cache, 1, j + 2, masked=False)
                x = stack(b, w.cp_layers, x, a, cache)
                head(b, g, x, j)

            return build

        self._cp_graphs = [CachedGraph(self.backends, first, nodes, self.stats)]
        self._cp_uploads = [attn_uploads(cache, 0, 2, 2)]
        for j in range(1, self.n_groups - 1):
            self._cp_graphs.append(CachedGraph(self.backends, nxt(j), nodes, self.stats))
            self._cp_uploads.append(attn_uploads(cache, j + 1, 1, None))

    def predict(self, hidden: F32, c0: int, choose: Callable[[F32, int], int]) -> I32:
        """Codebooks 1..15 of one frame: ``choose(logits, j)`` picks code j+1 from pass j."""
        if not self._cp_graphs:
            self._build_cp_graphs()
        codes = np.empty(self.n_groups - 1, dtype=np.int32)
        prev = c0
        for j, graph in enumerate(self._cp_graphs):
            up = dict(self._cp_uploads[j])
            up["code"] = np.asarray([prev], dtype=np.int32)
            if j == 0:
                up["hidden"] = np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, -1)
            logits = graph.run(up)["logits"].reshape(-1)
            prev = choose(logits, j)
            codes[j] = prev
        return codes

    def forget_prefixes(self) -> None:
        """Drop every kept prompt prefix, pinned or not (the next prefill computes it all)."""
        self._pinned.clear()
        self._prefix.clear()

    @property
    def pinned_prefixes(self) -> int:
        """Number of prompt prefixes kept by ``pin_prefix``."""
        return len(self._pinned)

    def warm_up(self, reserve_positions: int = WARM_POSITIONS) -> float:
        """Build the cached code-predictor graphs and reserve ``reserve_positions`` of talker
        cache for good (load time, not the first request's); return the seconds spent."""
        t0 = time.perf_counter()
        if not self._cp_graphs:
            self._build_cp_graphs()
        limit = int(self.cfg.max_position_embeddings)
        self._min_ctx = min(-(-reserve_positions // STEP_BUCKET) * STEP_BUCKET, limit)
        self.reserve(self._min_ctx)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Free graphs, caches and weights."""
        self._drop_step_graph()
        for g in self._cp_graphs:
            g.close()
        self._cp_graphs = []
        if self.cache is not None:
            self.cache.close()
            self.cache = None
        self.cp_cache.close()
        self.weights.close()


def codes_embedding(ctx: Any, w: TalkerWeights, codes: Tensor, n: int, stride: int) -> Tensor:
    """``C(c0) + sum_j cp_embd[j](c_j)`` of ``n`` frames, the talker input their codes make:
    ``codes`` holds codebook j's ``n`` ids at byte offset ``j * stride``."""
    x = lib.ggml_get_rows(ctx, w.codec_embd, lib.ggml_view_1d(ctx, codes, n, 0))
    for j, table in enumerate(w.cp_embd):
        idx = lib.ggml_view_1d(ctx, codes, n, (j + 1) * stride)
        x = lib.ggml_add(ctx, x, lib.ggml_get_rows(ctx, table, idx))
    return x


def _prefix_positions(prompt: Prompt) -> int:
    # the prompt prefix a prefill may keep or reuse: none unless some text follows it
    return prompt.n_prefix if 0 < prompt.n_prefix < prompt.length else 0


def _prefix_key(prompt: Prompt, n_pre: int) -> tuple[bytes, bytes, bytes]:
    # what the first n_pre prefill positions are made of: equal keys, equal K/V rows
    mask = prompt.codec_mask[:n_pre].tobytes()
    if prompt.embed_add is not None:  # a cloned voice: its x-vector / reference rows count too
        mask += prompt.embed_add[:n_pre].tobytes()
    return (prompt.text_ids[:n_pre].tobytes(), prompt.codec_ids[:n_pre].tobytes(), mask)


def _as_f32(ctx: Any, t: Tensor) -> Tensor:
    # the prefill concatenates reused prefix rows with its own F32 rows (one cast per graph)
    return t if t.type == lib.GGML_TYPE_F32 else lib.ggml_cast(ctx, t, lib.GGML_TYPE_F32)


def _graph_nodes(n_layers: int, n_tokens: int) -> int:
    # ~45 nodes and ~12 leaves per layer plus embeddings/heads/capture; generous but bounded
    # (the per-graph scheduler sizes its tables from this).
    del n_tokens
    return 160 * n_layers + 512
