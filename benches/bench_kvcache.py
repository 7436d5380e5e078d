"""KV caches and packed batches (issue 10): ``kvcache_attention``, ``KVCache`` and
``varlen_attention`` beside the plain kernel and the peers, in four kinds of group.

1. ``kvcache paged vs contiguous ...``: decode, B4 Hq32 Hkv8 Lq1 D128, 4096 tokens in each
   sequence's float32 cache. ``pyattn`` is ``kvcache_attention`` on a contiguous cache (B, Hkv,
   Lmax = 4096 + 256, D) with ``cache_lens`` = 4096 and no ``k_new``. ``pyattn_paged16`` is the
   same call on a paged cache of 16-token blocks whose block table is a random permutation of
   the pool, so no sequence's blocks are adjacent. Peer: torch SDPA (``enable_gqa``) on the
   contiguous cache's slice ``cache[:, :, :4096]`` (a strided view). Target: paged >= 95% of
   the contiguous speed, i.e. ``peer / pyattn`` <= 1.05 on ``pyattn_paged16``.
2. ``kvcache decode cache dtype ...``: B1, Hq32 with Hkv8 and Hkv32, Lk 4096 and 32768, D128.
   ``kvcache_attention`` without ``k_new`` on a full cache (``cache_lens`` = Lk) of float32
   (``pyattn``), float16, bfloat16 (ml_dtypes; skipped without it) and int8 with per-(token,
   head) scales. The float16 / bfloat16 / int8 caches are written by ``kvcache_attention``
   itself (``k_new`` a chunk at a time; int8: its absmax quantisation), outside the timing.
   Peers: torch SDPA on the float32 cache slice, ONNX Runtime GroupQueryAttention with the
   float32 cache as past KV plus the last token as the new one (``onnxruntime``), and the same
   with an int8 past KV with static per-channel scales (``onnxruntime_int8``; its quantisation,
   see ``peers.quantize_per_channel``). ``bytes`` is the K/V bytes read (int8: with its
   float32 scales), so GB/s is the streaming rate and the summary's ``% read bw`` its share of
   the measured bandwidth. Targets: bf16 / f16 >= 1.7x and int8 >= 3x the float32 cache
   (``peer / pyattn`` <= 0.59 and <= 0.33), at >= 80% of the read bandwidth.
3. ``kvcache append one token ...``: B1 Hq32 Hkv8 Lq1 D128 float32, caches holding 1024, 8192
   and 32768 tokens, all in one group. Per length:

   - ``pyattn_attend_L*`` / ``pyattn_paged16_attend_L*``: ``KVCache.attend`` with one new
     token (contiguous / paged, 16-token blocks), as a decode loop calls it: every round
     appends (the cache grows by one token a round; a fixed number of rounds, so the length
     stays within ``APPEND_ROUNDS`` tokens of L; ``bytes`` counts the middle length).
   - ``pyattn_append_L*``: ``kvcache_attention`` with ``k_new`` / ``v_new`` at ``cache_lens``
     = L (each round rewrites slot L) and ``pyattn_noappend_L*``: the same call without them on
     the L + 1 tokens already there: the same attention, so the difference is the append's
     cost. With timing on, the append item also times the two calls interleaved and stores the
     median difference as ``extra_info["append_cost_us"]`` (it must not grow with L).
   - ``pyattn_append_only_L*``: ``kvcache_attention`` with ``k_new`` and ``window=(0, 0)``: the
     query sees only the new token, so this is the append alone (plus a one-key attention); its
     time must be flat across the three lengths (O(1): nothing already held is copied).
4. ``kvcache varlen ...``: 8 causal sequences of 64, 128, 256, 512, 768, 1024, 1536 and 2048
   tokens, H8 D64. ``pyattn``: ``varlen_attention`` on the packed tokens. ``pyattn_padded``:
   one ``scaled_dot_product_attention`` call on the batch padded to 2048 (queries, keys and
   values right-padded, ``kv_lens`` = the lengths, causal top-left: correct for every real
   row, the padded rows are computed and dropped), the usual padded batch.
   ``pyattn_padded_leftq``: the fastest padded call pyattn allows: queries left-padded, keys
   right-padded, ``kv_lens`` and ``causal_align="bottom_right"``, so a padded query row sees no
   key and its blocks are skipped. ``pyattn_per_seq``: one call per sequence, in a loop.
   FLOPs: the causal pairs of the real tokens for every item. Targets: varlen >= 1.3x the
   faster padded call and >= the per-sequence loop.

Every item checks its result against the float64 ``pyattn.reference`` (GQA through
``enable_gqa``; int8 / half caches on their stored values, dequantised), computed once per shape
outside the timing, on every head (decode: one kv head's group at a time, so that the float64
copies stay small) or, for varlen on the full shapes, on the first and the last head.
``smoke`` (under --benchmark-disable): small shapes, same items.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass, field

import numpy as np
import peers
import pytest
from benchutil import (
    SETTLE_S,
    SmokeCase,
    assert_close,
    attention_flops,
    decode_qkv,
    normal,
    paged_pool,
    pyattn_threads,
    rng_for,
    run_timed,
    smoke_mode,
)

import pyattn
from pyattn import reference

try:
    import ml_dtypes
except ImportError:  # optional: the bfloat16 items skip
    ml_dtypes = None

REL_TOL = 2e-5  # float32 result vs the float64 oracle, relative to max |oracle|
WRITE_CHUNK = 4096  # tokens per kvcache_attention call when a cache is filled


def cache_dtype(name: str) -> np.dtype:
    """float32, float16, int8, or ml_dtypes.bfloat16 (the item skips without ml_dtypes)."""
    if name == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 caches need ml_dtypes (not installed)")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def kv_bytes(b: int, hkv: int, tokens: float, d: int, dtype: str) -> int:
    """Bytes of K and V read for ``tokens`` tokens per sequence (int8: with the float32 scales)."""
    per = d * ITEMSIZE[dtype] + (4 if dtype == "int8" else 0)
    return int(2 * b * hkv * tokens * per)


def gqa_oracle(q, k, v, k_scale=None, v_scale=None) -> np.ndarray:
    """float64 reference of q (B, Hq, Lq, D) over k, v (B, Hkv, Lk, D) as stored (float16 /
    bfloat16 convert exactly to float64; int8 times its scales, broadcastable to (B, Hkv, Lk,
    D)), non-causal (decode: Lq = 1 sees every key), one kv head's group of query heads at a time
    so that only one head's keys are ever copied to float64."""
    B, Hq, _, _ = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv

    def head(x, scale, h):
        x64 = x[:, h : h + 1].astype(np.float64)
        return x64 if scale is None else x64 * np.asarray(scale[:, h : h + 1], np.float64)

    parts = [
        reference.scaled_dot_product_attention(
            q[:, h * g : (h + 1) * g], head(k, k_scale, h), head(v, v_scale, h), enable_gqa=True
        )
        for h in range(Hkv)
    ]
    return np.concatenate(parts, axis=1)


def write_cache(k: np.ndarray, v: np.ndarray, dtype: str):
    """A contiguous cache of ``dtype`` holding k, v (B, Hkv, L, D), written by
    ``kvcache_attention`` itself (its cast, or its int8 absmax quantisation per token and head),
    ``WRITE_CHUNK`` tokens a call; each call's query sees only its own token (``window=(0, 0)``),
    so filling costs O(L). Returns k_cache, v_cache, k_scale, v_scale (None unless int8)."""
    dt = cache_dtype(dtype)
    B, H, L, D = k.shape
    kc, vc = np.zeros(k.shape, dt), np.zeros(v.shape, dt)
    ks = np.zeros((B, H, L), np.float32) if dtype == "int8" else None
    vs = np.zeros((B, H, L), np.float32) if dtype == "int8" else None
    for a in range(0, L, WRITE_CHUNK):
        n = min(WRITE_CHUNK, L - a)
        pyattn.kvcache_attention(
            np.zeros((B, H, n, D), np.float32),
            kc,
            vc,
            np.full(B, a, np.int64),
            k_new=k[:, :, a : a + n],
            v_new=v[:, :, a : a + n],
            k_scale=ks,
            v_scale=vs,
            window=(0, 0),
        )
    return kc, vc, ks, vs


def check_out(impl: str, out, expected, tol: float, what: str) -> None:
    if impl.startswith("pyattn"):
        assert out.dtype == np.float32, f"{impl} returned {out.dtype} for a float32 query"
    assert_close(out, expected, tol, f"{impl} on {what}")


# -------------------------------------------------------------- 1. paged vs contiguous decode
@dataclass(frozen=True)
class PagedCase(SmokeCase):
    b: int
    hq: int
    hkv: int
    l: int  # tokens held by each sequence
    d: int
    block: int
    spare: int = 256  # the contiguous cache's room beyond l (Lmax = l + spare)
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return (
            f"kvcache paged vs contiguous decode B{self.b} Hq{self.hq} Hkv{self.hkv} Lq1 L{self.l} D{self.d} "
            f"block{self.block} float32"
        )

    @property
    def flops(self) -> float:
        return attention_flops(self.b, self.hq, self.l, self.d)

    @property
    def bytes(self) -> int:
        return kv_bytes(self.b, self.hkv, self.l, self.d, "float32")


PAGED_CASES = [PagedCase(4, 32, 8, 4096, 128, 16, smoke=dict(b=2, hq=8, hkv=2, l=100, d=64, spare=20))]
PAGED_IMPLS = ("pyattn", "pyattn_paged16", "torch")


@functools.lru_cache(maxsize=1)
def paged_inputs(case: PagedCase):
    """q; the contiguous cache (B, Hkv, l + spare, D) with l random tokens a sequence (zeros
    after); the paged pool (B * ceil(l / block), Hkv, block, D) holding the same tokens through
    a shuffled block table (B, ceil(l / block))."""
    rng = rng_for("kvcache-paged", case.name)
    B, H, L, D, bs = case.b, case.hkv, case.l, case.d, case.block
    q = normal(rng, (B, case.hq, 1, D))
    kc = np.zeros((B, H, L + case.spare, D), np.float32)
    vc = np.zeros((B, H, L + case.spare, D), np.float32)
    kc[:, :, :L] = normal(rng, (B, H, L, D))
    vc[:, :, :L] = normal(rng, (B, H, L, D))
    nb = -(-L // bs)
    assert nb * bs <= L + case.spare, "spare must cover the last block"
    table = rng.permutation(B * nb).astype(np.int32).reshape(B, nb)
    lens = np.full(B, L, np.int64)
    return q, kc, vc, paged_pool(kc, table, bs), paged_pool(vc, table, bs), table, lens


@functools.lru_cache(maxsize=1)
def paged_oracle(case: PagedCase) -> np.ndarray:
    q, kc, vc, _, _, _, _ = paged_inputs(case)
    return gqa_oracle(q, kc[:, :, : case.l], vc[:, :, : case.l])


def test_paged(benchmark, paged_case: PagedCase, impl: str):
    case = paged_case
    benchmark.group = case.name
    benchmark.extra_info.update(
        kind="attention", impl=impl, flops=case.flops, bytes=case.bytes, shape=case.name, cache_dtype="float32"
    )
    q, kc, vc, kp, vp, table, lens = paged_inputs(case)
    finish = np.asarray

    if impl == "pyattn":

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens)
    elif impl == "pyattn_paged16":
        benchmark.extra_info["block_size"] = case.block

        def fn():
            return pyattn.kvcache_attention(q, kp, vp, lens, block_table=table)
    else:
        try:
            prepared = peers.prepare_torch_cache_slice(q, kc, vc, case.l, num_threads=pyattn_threads())
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note

    out = finish(run_timed(benchmark, fn))
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    check_out(impl, out, paged_oracle(case), REL_TOL, case.name)


# ------------------------------------------------------------------- 2. decode per cache dtype
@dataclass(frozen=True)
class DtypeCase(SmokeCase):
    hq: int
    hkv: int
    lk: int
    d: int
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"kvcache decode cache dtype B1 Hq{self.hq} Hkv{self.hkv} Lq1 Lk{self.lk} D{self.d}"

    @property
    def flops(self) -> float:
        return attention_flops(1, self.hq, self.lk, self.d)

    def bytes(self, dtype: str) -> int:
        return kv_bytes(1, self.hkv, self.lk, self.d, dtype)


DTYPE_CASES = [
    DtypeCase(32, 8, 4096, 128, smoke=dict(hq=8, hkv=2, lk=300, d=64)),
    DtypeCase(32, 8, 32768, 128, smoke=dict(hq=8, hkv=2, lk=1100, d=64)),
    DtypeCase(32, 32, 4096, 128, smoke=dict(hq=8, hkv=8, lk=300, d=64)),
    DtypeCase(32, 32, 32768, 128, smoke=dict(hq=8, hkv=8, lk=1100, d=64)),
]
DTYPE_ITEMS = {  # impl -> cache dtype
    "pyattn": "float32",
    "pyattn+f16cache": "float16",
    "pyattn+bf16cache": "bfloat16",
    "pyattn+int8cache": "int8",
    "torch": "float32",
    "onnxruntime": "float32",
    "onnxruntime_int8": "int8",
}
DTYPE_IMPLS = tuple(DTYPE_ITEMS)


@functools.lru_cache(maxsize=1)
def dtype_inputs(case: DtypeCase):
    """q (1, Hq, 1, D) and the float32 K/V (1, Hkv, Lk, D): also the float32 cache (full)."""
    return decode_qkv("kvcache-dtype", case.name, case.hq, case.hkv, case.lk, case.d)


@functools.lru_cache(maxsize=1)
def dtype_cache(case: DtypeCase, dtype: str):
    """The pyattn cache of ``dtype`` (k, v, k_scale, v_scale), written by kvcache_attention."""
    _, k, v = dtype_inputs(case)
    if dtype == "float32":
        return k, v, None, None
    return write_cache(k, v, dtype)


@functools.lru_cache(maxsize=4)
def dtype_oracle(case: DtypeCase, dtype: str) -> np.ndarray:
    """float64 reference on what the pyattn cache of ``dtype`` holds (int8: dequantised)."""
    q, _, _ = dtype_inputs(case)
    kc, vc, ks, vs = dtype_cache(case, dtype)
    if ks is None:
        return gqa_oracle(q, kc, vc)
    return gqa_oracle(q, kc, vc, ks[..., None], vs[..., None])


def test_decode_dtype(benchmark, dtype_case: DtypeCase, impl: str):
    case = dtype_case
    benchmark.group = case.name
    dtype = DTYPE_ITEMS[impl]
    benchmark.extra_info.update(
        kind="attention",
        impl=impl,
        flops=case.flops,
        bytes=case.bytes(dtype),  # the K/V read: what bounds decode
        shape=case.name,
        cache_dtype=dtype,
    )
    q, k, v = dtype_inputs(case)
    finish = np.asarray
    lens = np.array([case.lk], np.int64)
    if impl.startswith("pyattn"):
        kc, vc, ks, vs = dtype_cache(case, dtype)
        expected = dtype_oracle(case, dtype)

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens, k_scale=ks, v_scale=vs)
    else:
        dtype_cache.cache_clear()  # free the half / int8 cache before the peer's own copies
        try:
            if impl == "torch":
                prepared = peers.prepare_torch_cache_slice(q, k, v, case.lk, num_threads=pyattn_threads())
                expected = dtype_oracle(case, "float32")
            elif impl == "onnxruntime":
                prepared = peers.prepare_ort_gqa_decode(q, k, v, num_threads=pyattn_threads())
                expected = dtype_oracle(case, "float32")
            else:  # its own int8 cache: static per-channel scales over the whole cache
                kq, ks = peers.quantize_per_channel(k)
                vq, vs = peers.quantize_per_channel(v)
                expected = gqa_oracle(q, kq, vq, ks, vs)
                prepared = peers.prepare_ort_gqa_decode(q, kq, vq, k_scale=ks, v_scale=vs, num_threads=pyattn_threads())
                del kq, vq  # the session's feeds hold the past KV
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note
        del prepared

    out = finish(run_timed(benchmark, fn))
    if impl.startswith("onnxruntime"):
        # Release the session: its arena keeps the last call's present KV (a copy of the cache).
        del fn
        peers._gqa_session.cache_clear()
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    check_out(impl, out, expected, REL_TOL, case.name)


# --------------------------------------------------------------------- 3. append one token
APPEND_ROUNDS = 20  # timed rounds of the KVCache.attend items (each appends one token)


@dataclass(frozen=True)
class AppendCase(SmokeCase):
    hq: int
    hkv: int
    d: int
    lens: tuple
    block: int = 16
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        held = " / ".join(map(str, self.lens))
        return f"kvcache append one token B1 Hq{self.hq} Hkv{self.hkv} Lq1 D{self.d} float32, {held} tokens held"

    @property
    def impls(self) -> list:
        kinds = ("attend", f"paged{self.block}_attend", "append", "noappend", "append_only")
        return [f"pyattn_{kind}_L{n}" for n in self.lens for kind in kinds]

    def flops(self, keys: float) -> float:
        return attention_flops(1, self.hq, keys, self.d)

    def bytes(self, keys: float) -> int:
        return kv_bytes(1, self.hkv, keys, self.d, "float32")


APPEND_CASES = [AppendCase(32, 8, 128, (1024, 8192, 32768), smoke=dict(hq=8, hkv=2, d=64, lens=(40, 200, 700)))]


@functools.lru_cache(maxsize=1)
def append_inputs(case: AppendCase, n: int):
    """q (1, Hq, 1, D), the n held tokens' K/V (1, Hkv, n, D) and the new token's (1, Hkv, 1, D)."""
    rng = rng_for("kvcache-append", case.name, n)
    q = normal(rng, (1, case.hq, 1, case.d))
    k, v = normal(rng, (1, case.hkv, n, case.d)), normal(rng, (1, case.hkv, n, case.d))
    k_new, v_new = normal(rng, (1, case.hkv, 1, case.d)), normal(rng, (1, case.hkv, 1, case.d))
    return q, k, v, k_new, v_new


@functools.lru_cache(maxsize=1)
def append_oracle(case: AppendCase, n: int) -> np.ndarray:
    """The query over the n held tokens and the new one (float64)."""
    q, k, v, k_new, v_new = append_inputs(case, n)
    return gqa_oracle(q, np.concatenate([k, k_new], axis=2), np.concatenate([v, v_new], axis=2))


@functools.lru_cache(maxsize=1)
def append_cache(case: AppendCase, n: int):
    """A contiguous float32 cache (1, Hkv, n + 1, D): the n held tokens, and the new one at n
    (the append items rewrite it there every call; the no-append item reads it)."""
    _, k, v, k_new, v_new = append_inputs(case, n)
    kc = np.concatenate([k, k_new], axis=2)
    vc = np.concatenate([v, v_new], axis=2)
    return kc, vc


def filled_kvcache(case: AppendCase, n: int, paged: bool) -> pyattn.KVCache:
    """A KVCache holding the n tokens, filled through KVCache.attend ``WRITE_CHUNK`` tokens a
    call with queries that see only their own token (``window=(0, 0)``: O(n) work), with room
    for the new tokens of the warm-up and the timed rounds."""
    _, k, v, _, _ = append_inputs(case, n)
    room = n + APPEND_ROUNDS + 8
    cache = pyattn.KVCache(
        1, case.hkv, case.d, max_len=room, block_size=case.block if paged else None, dtype=np.float32
    )
    for a in range(0, n, WRITE_CHUNK):
        m = min(WRITE_CHUNK, n - a)
        q0 = np.zeros((1, case.hkv, m, case.d), np.float32)
        cache.attend(q0, k[:, :, a : a + m], v[:, :, a : a + m], window=(0, 0))
    assert cache.lens.tolist() == [n], f"filled {cache.lens.tolist()} tokens, expected {n}"
    return cache


def paired_median_us(fn_a, fn_b, budget_s: float = 2.0) -> tuple:
    """Median of fn_a's time minus fn_b's over calls made in alternation (so that both see the
    same machine state), and fn_b's median, in microseconds."""
    t0 = time.perf_counter()
    fn_a(), fn_b()
    once = time.perf_counter() - t0
    pairs = int(min(400, max(10, budget_s / max(once, 1e-6))))
    diffs, tb = [], []
    for _ in range(pairs):
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        t2 = time.perf_counter()
        diffs.append((t1 - t0) - (t2 - t1))
        tb.append(t2 - t1)
    return float(np.median(diffs)) * 1e6, float(np.median(tb)) * 1e6, pairs


def test_append(benchmark, append_case: AppendCase, impl: str):
    case = append_case
    benchmark.group = case.name
    kind, _, n = impl.removeprefix("pyattn_").rpartition("_L")
    n = int(n)
    q, _, _, k_new, v_new = append_inputs(case, n)
    g = case.hq // case.hkv
    keys = n + 1  # what one call attends
    benchmark.extra_info.update(kind="attention", impl=impl, shape=case.name, held=n, cache_dtype="float32")
    expected = append_oracle(case, n)

    if kind.endswith("attend"):  # KVCache.attend: appends a token every call, as a decode loop
        cache = filled_kvcache(case, n, paged=kind != "attend")
        first = cache.attend(q, k_new, v_new)  # the first append: checked, and the warm-up
        check_out(impl, first, expected, REL_TOL, f"{case.name}, {n} held")
        assert cache.lens.tolist() == [n + 1]
        mid = n + 1 + (APPEND_ROUNDS + 1) / 2  # keys read in the middle of the timed rounds
        benchmark.extra_info.update(
            flops=case.flops(mid), bytes=case.bytes(mid), keys_read=[n + 2, n + 1 + APPEND_ROUNDS]
        )
        if benchmark.enabled:
            time.sleep(SETTLE_S)
        out = benchmark.pedantic(
            lambda: cache.attend(q, k_new, v_new), rounds=APPEND_ROUNDS, iterations=1, warmup_rounds=0
        )
        calls = APPEND_ROUNDS if benchmark.enabled else 1
        assert cache.lens.tolist() == [n + 1 + calls], f"{impl}: lens {cache.lens.tolist()} after {calls} appends"
        # The last call saw the n tokens and calls + 1 copies of the new one (outside the timing).
        _, k, v, _, _ = append_inputs(case, n)
        dup = lambda x, x_new: np.concatenate([x, np.repeat(x_new, calls + 1, axis=2)], axis=2)  # noqa: E731
        check_out(impl, out, gqa_oracle(q, dup(k, k_new), dup(v, v_new)), REL_TOL, f"{case.name}, after the appends")
        return

    kc, vc = append_cache(case, n)
    if kind == "append_only":  # the append alone: the query sees only the new token
        lens = np.array([n], np.int64)
        kc[:, :, n] = 0.0  # the call must write it back
        vc[:, :, n] = 0.0
        expected = np.repeat(v_new, g, axis=1).astype(np.float64)  # softmax over one key: its value
        benchmark.extra_info.update(flops=case.flops(1), bytes=case.bytes(1), window=[0, 0])

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new, window=(0, 0))
    elif kind == "append":
        lens = np.array([n], np.int64)
        kc[:, :, n] = 0.0
        vc[:, :, n] = 0.0
        benchmark.extra_info.update(flops=case.flops(keys), bytes=case.bytes(keys))

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new)
    else:  # noappend: the same attention over the n + 1 tokens already there
        lens = np.array([n + 1], np.int64)
        kc[:, :, n] = k_new[:, :, 0]
        vc[:, :, n] = v_new[:, :, 0]
        benchmark.extra_info.update(flops=case.flops(keys), bytes=case.bytes(keys))

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens)

    out = run_timed(benchmark, fn)
    if kind != "noappend":  # written in place, byte for byte
        assert np.array_equal(kc[:, :, n], k_new[:, :, 0]) and np.array_equal(vc[:, :, n], v_new[:, :, 0]), (
            f"{impl}: the new token is not in the cache at position {n}"
        )
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    check_out(impl, out, expected, REL_TOL, f"{case.name}, {n} held")

    if kind == "append" and benchmark.enabled:
        no_lens = np.array([n + 1], np.int64)
        cost, base, pairs = paired_median_us(fn, lambda: pyattn.kvcache_attention(q, kc, vc, no_lens))
        benchmark.extra_info.update(append_cost_us=cost, noappend_us=base, append_pairs=pairs)


# ----------------------------------------------------------------------------------- 4. varlen
@dataclass(frozen=True)
class VarlenCase(SmokeCase):
    lens: tuple
    h: int
    d: int
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return (
            f"kvcache varlen causal {len(self.lens)} seqs {min(self.lens)}..{max(self.lens)} "
            f"({sum(self.lens)} tokens) H{self.h} D{self.d}"
        )

    @property
    def flops(self) -> float:
        pairs = sum(n * (n + 1) // 2 for n in self.lens)  # the real tokens' causal pairs
        return attention_flops(1, self.h, pairs, self.d)

    @property
    def bytes(self) -> int:
        return 4 * 4 * sum(self.lens) * self.h * self.d  # q, k, v, output of the real tokens


VARLEN_CASES = [
    VarlenCase((64, 128, 256, 512, 768, 1024, 1536, 2048), 8, 64, smoke=dict(lens=(5, 17, 64, 100, 130, 1), h=3))
]
VARLEN_IMPLS = ("pyattn", "pyattn_padded", "pyattn_padded_leftq", "pyattn_per_seq")


@functools.lru_cache(maxsize=1)
def varlen_inputs(case: VarlenCase):
    """Packed q, k, v (total, H, D) and cu_seqlens (B + 1,)."""
    rng = rng_for("kvcache-varlen", case.name)
    total = sum(case.lens)
    q, k, v = (normal(rng, (total, case.h, case.d)) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(case.lens)]).astype(np.int32)
    return q, k, v, cu


def varlen_heads(case: VarlenCase) -> slice:
    """Heads the oracle covers: every head when small, else the first and the last."""
    small = sum(n * n for n in case.lens) * case.h <= (1 << 22)
    return slice(None) if small else slice(0, case.h, case.h - 1)


@functools.lru_cache(maxsize=1)
def varlen_oracle(case: VarlenCase) -> np.ndarray:
    """(total, heads checked, D): each sequence causal on its own, float64."""
    q, k, v, cu = varlen_inputs(case)
    hs = varlen_heads(case)
    parts = []
    for a, b in zip(cu[:-1], cu[1:]):
        q64, k64, v64 = (x[a:b, hs].transpose(1, 0, 2) for x in (q, k, v))
        parts.append(reference.scaled_dot_product_attention(q64, k64, v64, is_causal=True).transpose(1, 0, 2))
    return np.concatenate(parts, axis=0)


def padded_batch(case: VarlenCase, left_q: bool):
    """(B, H, Lmax, D) padded copies of q, k, v (k, v right-padded; q right- or left-padded)."""
    q, k, v, cu = varlen_inputs(case)
    B, L = len(case.lens), max(case.lens)
    out = [np.zeros((B, case.h, L, case.d), np.float32) for _ in range(3)]
    for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        n = e - a
        rows = slice(L - n, L) if left_q else slice(0, n)
        out[0][b, :, rows] = q[a:e].transpose(1, 0, 2)
        out[1][b, :, :n] = k[a:e].transpose(1, 0, 2)
        out[2][b, :, :n] = v[a:e].transpose(1, 0, 2)
    return out


def test_varlen(benchmark, varlen_case: VarlenCase, impl: str):
    case = varlen_case
    benchmark.group = case.name
    benchmark.extra_info.update(
        kind="attention", impl=impl, flops=case.flops, bytes=case.bytes, shape=case.name, lens=list(case.lens)
    )
    q, k, v, cu = varlen_inputs(case)
    L = max(case.lens)
    kv_lens = np.array(case.lens, np.int32)

    if impl == "pyattn":

        def fn():
            return pyattn.varlen_attention(q, k, v, cu, cu, is_causal=True)

        finish = np.asarray
    elif impl.startswith("pyattn_padded"):
        left = impl == "pyattn_padded_leftq"
        qp, kp, vp = padded_batch(case, left)
        align = "bottom_right" if left else "top_left"
        benchmark.extra_info["padded"] = f"(B{len(case.lens)}, H{case.h}, {L}, D{case.d}), kv_lens, causal {align}"

        def fn():
            return pyattn.scaled_dot_product_attention(qp, kp, vp, is_causal=True, causal_align=align, kv_lens=kv_lens)

        def finish(out):  # the real rows, packed
            rows = [out[b, :, L - n :] if left else out[b, :, :n] for b, n in enumerate(case.lens)]
            return np.concatenate([r.transpose(1, 0, 2) for r in rows], axis=0)
    else:  # one call per sequence, on contiguous (H, n, D) copies made outside the timing
        seqs = [
            tuple(np.ascontiguousarray(x[a:e].transpose(1, 0, 2)) for x in (q, k, v)) for a, e in zip(cu[:-1], cu[1:])
        ]

        def fn():
            return [pyattn.scaled_dot_product_attention(qs, ks, vs, is_causal=True) for qs, ks, vs in seqs]

        def finish(outs):
            return np.concatenate([o.transpose(1, 0, 2) for o in outs], axis=0)

    out = finish(run_timed(benchmark, fn))
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    check_out(impl, out[:, varlen_heads(case)], varlen_oracle(case), REL_TOL, case.name)


# ------------------------------------------------------------------------------- parametrize
PARAMS = {  # argname: (cases, the impls of a case)
    "paged_case": (PAGED_CASES, lambda c: PAGED_IMPLS),
    "dtype_case": (DTYPE_CASES, lambda c: DTYPE_IMPLS),
    "append_case": (APPEND_CASES, lambda c: c.impls),
    "varlen_case": (VARLEN_CASES, lambda c: VARLEN_IMPLS),
}


def _id(name: str) -> str:
    """A test id from a group name: spaces to '_', other punctuation dropped."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "", name.replace(" ", "_"))


def pytest_generate_tests(metafunc):
    for argname, (cases, impls) in PARAMS.items():
        if {argname, "impl"} <= set(metafunc.fixturenames):
            small = smoke_mode(metafunc.config)
            cases = [c.small() if small else c for c in cases]
            metafunc.parametrize(
                (argname, "impl"),
                [pytest.param(c, impl, id=f"{_id(c.name)}-{impl}") for c in cases for impl in impls(c)],
            )
