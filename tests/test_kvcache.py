"""KV caches and packed batches (issue 10): kvcache_attention, KVCache and varlen_attention.

Test names say what they exercise, for ``-k``:

* ``test_decode_*``: a ragged prefill then 50+ one-token steps through ``KVCache.attend``, checked
  against a full recompute by the float64 reference over every token so far, for every cache dtype,
  contiguous and paged, on every kernel set (``isa``).
* ``test_paged_*``: paged caches give results bit-identical to a contiguous one.
* ``test_direct_*``: ``kvcache_attention`` on hand-made caches (shuffled block tables, NaN where
  nothing may be read), with and without new tokens, the score variants, return_lse and out=.
* ``test_inplace_*``: the cache bytes after a call differ from those before exactly at the written
  positions.
* ``test_bad_*``: every bad input raises a ValueError/TypeError naming the problem and leaves every
  byte of the cache as it was.
* ``test_threads_*``: one and two threads give identical results (split-KV decode, chunked prefill).
* ``test_varlen_*``: ``varlen_attention`` against per-sequence calls, and its argument checks.
* ``test_kvcache_*``: the ``KVCache`` object: lens, reset and block reuse, nbytes, growth, overflow.
"""

from __future__ import annotations

import os
import re
import tracemalloc

import numpy as np
import pytest
from _helpers import assert_close, randn

import pyattn
from pyattn import reference

ref_sdpa = reference.scaled_dot_product_attention

#: relative tolerance (against max|reference|) of the output on the values as stored in the cache,
#: by cache dtype (the query is float32, or float64 with a float64 cache)
TOL = {"float32": 2e-5, "float64": 1e-10, "float16": 2e-5, "bfloat16": 2e-5, "int8": 2e-5}
#: int8 against the float64 values before quantisation, as a share of max|V|: each stored element is
#: off by at most half a step, max|row| / 254, and the outputs move by a step or so (the worst of 720
#: seeds between 1 and 1.5 steps; against max|output| a seed that a run under qemu drew took 2.4)
INT8_RAW_TOL = 2.0 / 127.0
CACHE_DTYPES = ["float32", "float64", "float16", "bfloat16", "int8"]
LAYOUTS = {"contiguous": None, "paged16": 16, "paged5": 5}


def cache_dtype(name):
    """The NumPy dtype of a cache dtype name (bfloat16 from ml_dtypes, skipped without it)."""
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def query_dtype(name):
    return np.float64 if name == "float64" else np.float32


def seq_rows(arr, table, b, n):
    """Rows 0..n-1 of sequence b of a cache (or of its int8 scales), through the block table when paged:
    (Hkv, n, D) for a cache, (Hkv, n) for scales."""
    if table is None:
        return arr[b, :, :n]
    bs = arr.shape[2]
    blocks = np.asarray(table)[b, : -(-n // bs)]
    if len(blocks) == 0:
        return arr[0, :, :0]
    return np.concatenate([arr[x] for x in blocks], axis=1)[:, :n]


def stored(cache, scale, table, b, n):
    """Sequence b's first n tokens as the kernel reads them, in float64 (int8: dequantised, q * scale)."""
    x = np.asarray(seq_rows(cache, table, b, n), np.float64)
    if scale is not None:
        x = x * np.asarray(seq_rows(scale, table, b, n), np.float64)[..., None]
    return x


def check_int8_rows(q, s, x, what):
    """int8 rows q (..., D) with scales s (...,) quantise x (..., D) by absmax: s = max|x| / 127 and
    |q * s - x| <= s / 2."""
    x = np.asarray(x, np.float64)
    amax = np.max(np.abs(x), axis=-1)
    want = np.where(amax > 0, amax / 127.0, 1.0)
    np.testing.assert_allclose(s, want, rtol=1e-6, err_msg=f"{what}: scales are not max|x| / 127")
    assert np.abs(q.astype(np.int64)).max(initial=0) <= 127, f"{what}: -128 used"
    err = np.abs(q.astype(np.float64) * np.asarray(s, np.float64)[..., None] - x)
    bound = (0.5 + 1e-4) * np.asarray(s, np.float64)[..., None]
    assert np.all(err <= bound), f"{what}: dequantised values off by {float(np.max(err / bound)) / 2:.3f} steps"


def check_stored(cache, b, n, hist_k, hist_v):
    """Sequence b's stored tokens equal what was appended (rounded to the cache dtype, or quantised)."""
    for arr, sc, hist, name in ((cache.k, cache.k_scale, hist_k, "k"), (cache.v, cache.v_scale, hist_v, "v")):
        rows = seq_rows(arr, cache.block_table, b, n)
        if sc is not None:
            check_int8_rows(rows, seq_rows(sc, cache.block_table, b, n), hist, f"{name} of sequence {b}")
        else:
            want = np.asarray(hist).astype(cache.dtype)
            assert np.array_equal(rows.view(np.uint8), want.view(np.uint8)), f"stored {name} of sequence {b} differ"


# ------------------------------------------------------------------------------------------------
# 1. step-by-step decode after a ragged prefill


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cdt", CACHE_DTYPES)
def test_decode_steps_match_full_recompute(isa, cdt, layout, rng):
    """Ragged prefill + 52 decode steps through KVCache.attend against the reference over all tokens so far."""
    dt, qdt = cache_dtype(cdt), query_dtype(cdt)
    B, Hkv, Hq, D, steps = 3, 2, 4, 24, 52
    plens = np.array([16, 37, 1])
    Lp = int(plens.max())
    bs = LAYOUTS[layout]
    cache = pyattn.KVCache(B, Hkv, D, max_len=None if bs else Lp + steps, block_size=bs, dtype=dt)
    hist_k = [np.zeros((Hkv, 0, D)) for _ in range(B)]
    hist_v = [np.zeros((Hkv, 0, D)) for _ in range(B)]

    def check(out, q, rows, step):
        lens = cache.lens
        for b in range(B):
            n, L = int(rows[b]), int(lens[b])
            check_stored(cache, b, L, hist_k[b], hist_v[b])
            kc = stored(cache.k, cache.k_scale, cache.block_table, b, L)
            vc = stored(cache.v, cache.v_scale, cache.block_table, b, L)
            kw = dict(is_causal=True, causal_align="bottom_right", enable_gqa=True)
            want = ref_sdpa(q[b, :, :n], kc, vc, **kw)
            what = f"step {step}, sequence {b} ({L} tokens)"
            assert_close(out[b, :, :n], want, qdt, tol=TOL[cdt], what=what)
            if cdt == "int8":
                # An output row is a weighted mean of value rows, often much smaller than they are
                # (a mean of 38 random rows): its quantisation error is measured on their scale
                raw = ref_sdpa(q[b, :, :n], hist_k[b], hist_v[b], **kw)
                err = float(np.max(np.abs(out[b, :, :n] - raw)))
                vmax = float(np.max(np.abs(hist_v[b])))
                bound = INT8_RAW_TOL * vmax
                assert err <= bound, f"{what} vs unquantised: error {err:.3e} > {INT8_RAW_TOL:.3e} * {vmax:.3e}"

    q = randn(rng, (B, Hq, Lp, D), qdt)
    kn, vn = randn(rng, (B, Hkv, Lp, D), qdt), randn(rng, (B, Hkv, Lp, D), qdt)
    out = cache.attend(q, kn, vn, new_lens=plens)
    assert out.shape == (B, Hq, Lp, D) and out.dtype == qdt
    assert np.array_equal(cache.lens, plens)
    for b in range(B):
        assert np.all(out[b, :, plens[b] :] == 0), f"padding rows of sequence {b} are not zeros"
        hist_k[b] = np.concatenate([hist_k[b], kn[b, :, : plens[b]]], axis=1)
        hist_v[b] = np.concatenate([hist_v[b], vn[b, :, : plens[b]]], axis=1)
    check(out, q, plens, "prefill")

    checked = {0, 1, 2, 13, 31, steps - 1}
    for step in range(steps):
        q1 = randn(rng, (B, Hq, 1, D), qdt)
        k1, v1 = randn(rng, (B, Hkv, 1, D), qdt), randn(rng, (B, Hkv, 1, D), qdt)
        o1 = cache.attend(q1, k1, v1)
        assert o1.shape == (B, Hq, 1, D) and o1.dtype == qdt
        for b in range(B):
            hist_k[b] = np.concatenate([hist_k[b], k1[b]], axis=1)
            hist_v[b] = np.concatenate([hist_v[b], v1[b]], axis=1)
        assert np.array_equal(cache.lens, plens + step + 1)
        if step in checked:
            check(o1, q1, np.ones(B, int), step)


# ------------------------------------------------------------------------------------------------
# 2. paged == contiguous, bit for bit


@pytest.mark.parametrize("cdt", CACHE_DTYPES)
def test_paged_bit_identical_to_contiguous(isa, cdt, rng):
    """The same calls on a contiguous and on paged caches (block_size 16 and 5) give identical bits."""
    dt, qdt = cache_dtype(cdt), query_dtype(cdt)
    B, Hkv, Hq, D = 2, 1, 4, 32  # two head groups: decode over 600 keys splits into chunks
    plens = np.array([600, 130])
    calls = [(randn(rng, (B, Hq, 600, D), qdt), plens, {})]
    variants = [{}, {"window": (100, None), "sinks": np.linspace(-1, 1, Hq)}, {"softcap": 5.0}]
    variants.append({"alibi_slopes": 2.0 ** -np.arange(1, Hq + 1)})
    for i in range(6):
        calls.append((randn(rng, (B, Hq, 1, D), qdt), None, variants[i % len(variants)]))
    calls.append((randn(rng, (B, Hq, 7, D), qdt), np.array([7, 3]), {"window": (50, None)}))  # chunked, ragged
    news = [(randn(rng, (B, Hkv, q.shape[2], D), qdt), randn(rng, (B, Hkv, q.shape[2], D), qdt)) for q, _, _ in calls]

    results = {}
    for layout, bs in LAYOUTS.items():
        cache = pyattn.KVCache(B, Hkv, D, max_len=None if bs else 700, block_size=bs, dtype=dt)
        outs = []
        for (q, nl, kw), (kn, vn) in zip(calls, news):
            outs.append(cache.attend(q, kn, vn, new_lens=nl, return_lse=True, **kw))
        results[layout] = outs
    for layout in ("paged16", "paged5"):
        for i, ((o, lse), (oc, lsec)) in enumerate(zip(results[layout], results["contiguous"])):
            assert np.array_equal(o, oc), f"{layout}: output of call {i} differs from the contiguous cache's"
            assert np.array_equal(lse, lsec), f"{layout}: lse of call {i} differs from the contiguous cache's"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("hq, hkv", [(2, 2), (4, 2)])
def test_paged_short_prefill_bit_identical(isa, dtype, hq, hkv, rng):
    """Short chunks over short caches (at most 128 keys, a causal edge: the kernels' row-per-query
    path) give the same bits on paged caches as on a contiguous one: the paged blocks are copied
    into the task's K^T and V copy (the contiguous cache took that path and the paged one the
    panels', whose sums differ in the last bit)."""
    E = 16
    k, v = randn(rng, (1, hkv, 128, E), dtype), randn(rng, (1, hkv, 128, E), dtype)
    variants = [{}, {"window": (6, None)}, {"sinks": np.linspace(-1, 1, hq)}]
    variants.append({"alibi_slopes": 2.0 ** -np.arange(1, hq + 1)})
    for bs in (16, 5):
        n = 128 // bs + 1
        order = rng.permutation(n)  # blocks out of order in the pool
        pool_k, pool_v = np.zeros((n, hkv, bs, E), dtype), np.zeros((n, hkv, bs, E), dtype)
        for b in range(n):
            s0 = b * bs
            m = max(0, min(bs, 128 - s0))
            pool_k[order[b], :, :m], pool_v[order[b], :, :m] = k[0, :, s0 : s0 + m], v[0, :, s0 : s0 + m]
        table = order.astype(np.int32)[None]
        for lq, lens in ((9, 3), (40, 50), (5, 0), (32, 96)):
            q = randn(rng, (1, hq, lq, E), dtype)
            for kw in variants:
                for new in (False, True):
                    extra = {}
                    if new:
                        kn, vn = randn(rng, (1, hkv, lq, E), dtype), randn(rng, (1, hkv, lq, E), dtype)
                        extra = dict(k_new=kn, v_new=vn)
                        if lens + lq > 128:
                            continue
                    kc, vc, pk, pv = k.copy(), v.copy(), pool_k.copy(), pool_v.copy()
                    kw2 = dict(return_lse=True, **kw, **extra)
                    oc, lc = pyattn.kvcache_attention(q, kc, vc, [lens], **kw2)
                    op, lp = pyattn.kvcache_attention(q, pk, pv, [lens], block_table=table, **kw2)
                    what = f"block {bs}, Lq {lq}, {lens} cached, {kw}, k_new {new}"
                    assert oc.tobytes() == op.tobytes(), what
                    assert lc.tobytes() == lp.tobytes(), what


def test_paged_short_prefill_bit_identical_rows_4k_apart(isa, rng):
    """Caches viewed as (B, L, H, D) whose token rows lie 4 KiB apart (H8 D128 float32), which
    the kernels copy before use: the paged one (blocks viewed as (n, bs, H, D)) gives the
    contiguous one's bits on a short causal chunk (the paged one took the row path, the
    contiguous one the panels)."""
    H, E, L, Lq, Lmax, bs = 8, 128, 100, 24, 128, 16
    k, v = randn(rng, (1, H, L, E), np.float32), randn(rng, (1, H, L, E), np.float32)
    q = randn(rng, (1, H, Lq, E), np.float32)
    kt, vt = (np.zeros((1, Lmax, H, E), np.float32).transpose(0, 2, 1, 3) for _ in range(2))
    kt[:, :, :L], vt[:, :, :L] = k, v
    kp, vp = (np.zeros((Lmax // bs, bs, H, E), np.float32).transpose(0, 2, 1, 3) for _ in range(2))
    for j in range(L):
        kp[j // bs, :, j % bs], vp[j // bs, :, j % bs] = k[0, :, j], v[0, :, j]
    table = np.arange(Lmax // bs, dtype=np.int32)[None]
    for kw in ({}, {"is_causal": False}, {"window": (30, 0)}):
        oc, lc = pyattn.kvcache_attention(q, kt, vt, [L], return_lse=True, **kw)
        op, lp = pyattn.kvcache_attention(q, kp, vp, [L], block_table=table, return_lse=True, **kw)
        assert oc.tobytes() == op.tobytes() and lc.tobytes() == lp.tobytes(), kw


# ------------------------------------------------------------------------------------------------
# 3. kvcache_attention directly: hand-made caches, float64

ALIBI6 = 2.0 ** (-8.0 * np.arange(1, 7) / 6)
DIRECT_VARIANTS = {
    "plain": {},
    "nocausal": {"is_causal": False},
    "window": {"window": (5, None)},
    "nocausal_window": {"is_causal": False, "window": (6, 2)},
    "softcap": {"softcap": 2.0},
    "alibi": {"alibi_slopes": ALIBI6},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0, 1.0, -0.5])},
    "all": {"window": (9, None), "softcap": 3.0, "alibi_slopes": ALIBI6, "sinks": np.linspace(-1, 1, 6)},
}


def quantize(x):
    """Absmax int8 of x (..., D): the test's own, for filling caches by hand."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=-1)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.rint(x / s[..., None]), -127, 127).astype(np.int8), s


def put(arr, sc, table, b, start, x):
    """Write x (Hkv, n, F) as tokens start .. start + n - 1 of sequence b (quantised when sc is given)."""
    pos = start + np.arange(x.shape[1])
    if table is None:
        blk, slot = np.full_like(pos, b), pos
    else:
        bs = arr.shape[2]
        blk, slot = np.asarray(table)[b, pos // bs], pos % bs
    rows = np.moveaxis(x, 1, 0)  # (n, Hkv, F)
    if sc is None:
        arr[blk, :, slot] = rows
    else:
        arr[blk, :, slot], sc[blk, :, slot] = quantize(rows)


def make_direct(rng, layout, cdt, lens, Lq, *, B=3, Hkv=2, E=16, Ev=8, extra=3, fill=np.nan):
    """A cache holding lens[b] random tokens per sequence (+ room for Lq more); `fill` everywhere else.

    Paged: block_size 5, blocks in a shuffled order, `extra` blocks no sequence uses, -1 past the
    blocks a sequence needs. Returns a dict of kvcache_attention's cache arguments."""
    dt = cache_dtype(cdt)
    int8 = cdt == "int8"
    lens = np.asarray(lens)
    cap = int(lens.max()) + Lq
    if layout == "contiguous":
        shape, table = (B, Hkv, cap + 2), None
    else:
        bs = 5
        need = -(-(lens + Lq) // bs)
        nblocks = int(need.sum()) + extra
        perm = rng.permutation(nblocks)
        table = np.full((B, int(need.max()) + 1), -1, np.int32)
        at = 0
        for b in range(B):
            table[b, : need[b]] = perm[at : at + need[b]]
            at += need[b]
        shape = (nblocks, Hkv, bs)
    c = {"block_table": table}
    for name, F in (("k", E), ("v", Ev)):
        arr = np.full(shape + (F,), 0 if int8 else fill, dt)
        sc = np.full(shape, fill, np.float32) if int8 else None
        for b in range(B):
            put(arr, sc, table, b, 0, rng.standard_normal((Hkv, int(lens[b]), F)))
        c[f"{name}_cache"] = arr
        c[f"{name}_scale"] = sc
    return c


@pytest.mark.parametrize("variant", list(DIRECT_VARIANTS))
@pytest.mark.parametrize("new", [True, False], ids=["new", "nonew"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_direct_float64_matches_reference(isa, layout, new, variant, rng):
    """kvcache_attention (float64 cache and query) with the variants, return_lse and out= against the reference."""
    B, Hkv, Hq, E, Ev = 3, 2, 6, 16, 8
    kw = DIRECT_VARIANTS[variant]
    lens = np.array([0, 9, 33])
    for Lq in (1, 4):
        c = make_direct(rng, layout, "float64", lens, Lq)
        table = c["block_table"]
        k0, v0 = c["k_cache"].copy(), c["v_cache"].copy()
        q = randn(rng, (B, Hq, Lq, E))
        kn = randn(rng, (B, Hkv, Lq, E)) if new else None
        vn = randn(rng, (B, Hkv, Lq, Ev)) if new else None
        args = (q, c["k_cache"], c["v_cache"], lens)
        out, lse = pyattn.kvcache_attention(*args, k_new=kn, v_new=vn, block_table=table, return_lse=True, **kw)
        assert out.dtype == np.float64 and out.shape == (B, Hq, Lq, Ev) and lse.shape == (B, Hq, Lq)
        keys = lens + (Lq if new else 0)
        for b in range(B):
            if new:  # the new tokens were written at lens[b] .. lens[b] + Lq - 1
                got_k = stored(c["k_cache"], None, table, b, int(keys[b]))[:, lens[b] :]
                got_v = stored(c["v_cache"], None, table, b, int(keys[b]))[:, lens[b] :]
                assert np.array_equal(got_k, kn[b]) and np.array_equal(got_v, vn[b])
            kc = stored(c["k_cache"], None, table, b, int(keys[b]))
            vc = stored(c["v_cache"], None, table, b, int(keys[b]))
            want, want_lse = ref_sdpa(
                q[b], kc, vc, causal_align="bottom_right", enable_gqa=True, return_lse=True,
                **{"is_causal": True, **kw},
            )  # fmt: skip
            what = f"Lq {Lq}, sequence {b} ({keys[b]} keys)"
            assert_close(out[b], want, np.float64, tol=1e-10, what=what)
            assert_close(lse[b], want_lse, np.float64, tol=1e-10, what=what + " lse")
        # out=: written in place and returned, the same bits (on a copy of the cache as it was)
        buf = np.full((B, Hq, Lq, Ev), np.nan)
        res = pyattn.kvcache_attention(q, k0, v0, lens, k_new=kn, v_new=vn, block_table=table, out=buf, **kw)
        assert res is buf
        assert np.array_equal(buf, out)
        assert np.array_equal(k0, c["k_cache"], equal_nan=True) and np.array_equal(v0, c["v_cache"], equal_nan=True)


@pytest.mark.parametrize("cdt", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_direct_float32_query_on_stored_values(isa, layout, cdt, rng):
    """kvcache_attention with a float32 query on float32/half/int8 caches (NaN where unused) vs the reference."""
    B, Hkv, Hq, E, Ev, Lq = 3, 2, 6, 16, 8, 3
    lens = np.array([0, 9, 70])
    c = make_direct(rng, layout, cdt, lens, Lq)
    table = c["block_table"]
    q = randn(rng, (B, Hq, Lq, E), np.float32)
    kn, vn = randn(rng, (B, Hkv, Lq, E), np.float32), randn(rng, (B, Hkv, Lq, Ev), np.float32)
    out, lse = pyattn.kvcache_attention(
        q, c["k_cache"], c["v_cache"], lens, k_new=kn, v_new=vn, block_table=table,
        k_scale=c["k_scale"], v_scale=c["v_scale"], return_lse=True, window=(40, None),
    )  # fmt: skip
    for b in range(B):
        n = int(lens[b]) + Lq
        kc = stored(c["k_cache"], c["k_scale"], table, b, n)
        vc = stored(c["v_cache"], c["v_scale"], table, b, n)
        want, want_lse = ref_sdpa(
            q[b], kc, vc, is_causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True,
            window=(40, None),
        )  # fmt: skip
        assert_close(out[b], want, np.float32, tol=TOL[cdt], what=f"sequence {b}")
        assert_close(lse[b], want_lse, np.float32, tol=TOL[cdt], what=f"sequence {b} lse")


@pytest.mark.parametrize("cdt", ["float32", "int8"])
@pytest.mark.parametrize(("group", "E"), [(2, 5), (3, 17), (5, 100), (6, 33), (7, 64)])
def test_grouped_decode_rows_and_tails(isa, cdt, group, E, rng):
    """Grouped query rows in the decode (a few keys at a time for four, two, then one row): every
    remainder of rows, a head size with a vector tail, key counts off the key-group size."""
    lens = np.array([1, 6, 37])
    c = make_direct(rng, "contiguous", cdt, lens, 1, E=E, Ev=E)
    q = randn(rng, (3, 2 * group, 1, E), np.float32)
    out = pyattn.kvcache_attention(q, c["k_cache"], c["v_cache"], lens, k_scale=c["k_scale"], v_scale=c["v_scale"])
    for b in range(3):
        n = int(lens[b])
        kc, vc = stored(c["k_cache"], c["k_scale"], None, b, n), stored(c["v_cache"], c["v_scale"], None, b, n)
        want = ref_sdpa(q[b], kc, vc, enable_gqa=True)
        assert_close(out[b], want, np.float32, tol=TOL[cdt], what=f"sequence {b}")


# ------------------------------------------------------------------------------------------------
# 4. in-place writes, byte by byte


def _written_rows(layout_table, lens, counts, bs):
    """(block or sequence, slot, batch row, token j) of every token written."""
    rows = []
    for b in range(len(lens)):
        for j in range(int(counts[b])):
            pos = int(lens[b]) + j
            if layout_table is None:
                rows.append((b, pos, b, j))
            else:
                rows.append((int(layout_table[b, pos // bs]), pos % bs, b, j))
    return rows


def check_inplace(before, after, table, lens, counts, kn, cdt, name, scale_before=None, scale_after=None):
    """after == before except at the written positions, which hold kn (rounded / quantised)."""
    bs = after.shape[2]
    written = _written_rows(table, lens, counts, bs)
    expect = before.copy()
    for blk, slot, _, _ in written:
        expect[blk, :, slot] = after[blk, :, slot]
    assert np.array_equal(expect.view(np.uint8), after.view(np.uint8)), f"{name}: bytes changed outside the writes"
    if scale_before is not None:
        es = scale_before.copy()
        for blk, slot, _, _ in written:
            es[blk, :, slot] = scale_after[blk, :, slot]
        assert np.array_equal(es.view(np.uint8), scale_after.view(np.uint8)), f"{name} scales changed elsewhere"
    for blk, slot, b, j in written:
        got, new = after[blk, :, slot], kn[b, :, j]
        if scale_after is not None:
            check_int8_rows(got, scale_after[blk, :, slot], new, f"{name}[{b}, :, {lens[b] + j}]")
        else:
            want = new.astype(after.dtype)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{name}[{b}, :, {lens[b] + j}] wrong"


def random_fill(rng, arr):
    """Random finite values in every element (positive for scales)."""
    if arr.dtype == np.int8:
        arr[...] = rng.integers(-127, 128, arr.shape)
    elif arr.ndim == 3:
        arr[...] = rng.uniform(0.001, 0.05, arr.shape)
    else:
        arr[...] = rng.standard_normal(arr.shape)


@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "paged"])
@pytest.mark.parametrize("cdt", CACHE_DTYPES)
def test_inplace_writes_exactly_the_new_positions(cdt, layout, rng):
    """After kvcache_attention only the (lens[b] + j) rows differ, holding k_new/v_new as stored."""
    dt, qdt = cache_dtype(cdt), query_dtype(cdt)
    int8 = cdt == "int8"
    B, Hkv, Hq, E, Ev, Lq = 3, 2, 4, 8, 6, 3
    lens = np.array([0, 4, 11])
    if layout == "paged":
        bs, nb = 5, 12
        table = np.array([[7, 2, 9, 3], [0, 11, -1, -1], [5, 1, 10, 8]], np.int32)
        kc, vc = np.empty((nb, Hkv, bs, E), dt), np.empty((nb, Hkv, bs, Ev), dt)
        ks, vs = (np.empty((nb, Hkv, bs), np.float32) for _ in range(2)) if int8 else (None, None)
        base = None
    elif layout == "interleaved":  # k and v share one buffer, tokens outermost: strided views
        L, table = 16, None
        base = np.empty((B, L, Hkv, 2, E), dt)
        kc, vc = base[:, :, :, 0, :].transpose(0, 2, 1, 3), base[:, :, :, 1, :Ev].transpose(0, 2, 1, 3)
        ks, vs = (np.empty((B, Hkv, L), np.float32) for _ in range(2)) if int8 else (None, None)
    else:
        L, table, base = 16, None, None
        kc, vc = np.empty((B, Hkv, L, E), dt), np.empty((B, Hkv, L, Ev), dt)
        ks, vs = (np.empty((B, Hkv, L), np.float32) for _ in range(2)) if int8 else (None, None)
    for a in (kc, vc, ks, vs) if base is None else (base, ks, vs):
        if a is not None:
            random_fill(rng, a)
    before = [None if a is None else a.copy() for a in (kc, vc, ks, vs, base)]
    tbefore = None if table is None else table.copy()
    q = randn(rng, (B, Hq, Lq, E), qdt)
    kn, vn = randn(rng, (B, Hkv, Lq, E), qdt), randn(rng, (B, Hkv, Lq, Ev), qdt)
    # nothing is written without k_new / v_new
    pyattn.kvcache_attention(q, kc, vc, lens, block_table=table, k_scale=ks, v_scale=vs)
    for a, a0 in zip((kc, vc, ks, vs, base), before):
        if a is not None:
            assert np.array_equal(a.view(np.uint8), a0.view(np.uint8)), "written without k_new / v_new"
    pyattn.kvcache_attention(q, kc, vc, lens, k_new=kn, v_new=vn, block_table=table, k_scale=ks, v_scale=vs)
    counts = np.full(B, Lq)
    if table is not None:
        assert np.array_equal(table, tbefore), "block_table modified"
    check_inplace(before[0], kc, table, lens, counts, kn, cdt, "k_cache", before[2], ks)
    check_inplace(before[1], vc, table, lens, counts, vn, cdt, "v_cache", before[3], vs)
    if base is not None:  # the interleaved buffer: v's unused tail of each row untouched too
        mask = np.zeros(base.shape, bool)
        for b in range(B):
            mask[b, lens[b] : lens[b] + Lq, :, 0, :] = True
            mask[b, lens[b] : lens[b] + Lq, :, 1, :Ev] = True
        a0 = before[4]
        assert np.array_equal(base[~mask].view(np.uint8), a0[~mask].view(np.uint8)), "bytes outside the writes"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cdt", ["float32", "bfloat16", "int8"])
def test_inplace_ragged_attend_writes_only_new_lens_tokens(cdt, layout, rng):
    """KVCache.attend with new_lens writes only each row's first new_lens[b] tokens; the padding is never stored."""
    dt = cache_dtype(cdt)
    B, Hkv, Hq, D, Lq = 3, 2, 4, 8, 9
    bs = LAYOUTS[layout]
    cache = pyattn.KVCache(B, Hkv, D, max_len=32, block_size=bs, dtype=dt)  # paged: the pool is made up front
    first = np.array([3, 0, 6])
    shapes = [(B, Hq, 6, D), (B, Hkv, 6, D), (B, Hkv, 6, D)]
    cache.attend(*(randn(rng, s, np.float32) for s in shapes), new_lens=first)
    arrays = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    for a in arrays:
        if a is not None:
            random_fill(rng, a)
    before = [None if a is None else a.copy() for a in arrays]
    held = None if cache.block_table is None else cache.block_table.copy()
    nl = np.array([9, 2, 0])
    q = randn(rng, (B, Hq, Lq, D), np.float32)
    kn, vn = randn(rng, (B, Hkv, Lq, D), np.float32), randn(rng, (B, Hkv, Lq, D), np.float32)
    out = np.full((B, Hq, Lq, D), np.nan, np.float32)
    res = cache.attend(q, kn, vn, new_lens=nl, out=out)
    assert res is out
    for b in range(B):
        assert np.all(out[b, :, nl[b] :] == 0), f"padding rows of sequence {b} are not zeros in out="
    assert np.array_equal(cache.lens, first + nl)
    assert all(x is y for x, y in zip(arrays, (cache.k, cache.v, cache.k_scale, cache.v_scale)))
    table = cache.block_table
    if table is not None:  # blocks already held stay where they were
        assert np.array_equal(table[held >= 0], held[held >= 0])
    check_inplace(before[0], cache.k, table, first, nl, kn, cdt, "k", before[2], cache.k_scale)
    check_inplace(before[1], cache.v, table, first, nl, vn, cdt, "v", before[3], cache.v_scale)


# ------------------------------------------------------------------------------------------------
# 5. bad input: an error naming the problem, and not a byte of the cache changed


def _base(layout, cdt, rng, Lq=2):
    """Valid kvcache_attention arguments: B 2, Hkv 2, Hq 4, E 8, capacity 12 tokens, lens (10, 3)."""
    B, Hkv, Hq, E = 2, 2, 4, 8
    dt = cache_dtype(cdt)
    int8 = cdt == "int8"
    if layout == "paged":  # block_size 4, 3 blocks per sequence, 7 blocks
        shape = (7, Hkv, 4)
        table = np.array([[4, 0, 6], [2, 5, -1]], np.int32)
    else:
        shape, table = (B, Hkv, 12), None
    a = dict(
        query=randn(rng, (B, Hq, Lq, E), np.float32),
        k_cache=np.zeros(shape + (E,), dt),
        v_cache=np.zeros(shape + (E,), dt),
        cache_lens=np.array([10, 3]),
        k_new=randn(rng, (B, Hkv, Lq, E), np.float32),
        v_new=randn(rng, (B, Hkv, Lq, E), np.float32),
        block_table=table,
        k_scale=np.zeros(shape, np.float32) if int8 else None,
        v_scale=np.zeros(shape, np.float32) if int8 else None,
    )
    for k in ("k_cache", "v_cache", "k_scale", "v_scale"):
        if a[k] is not None:
            random_fill(rng, a[k])
    return a


def _set(**kw):
    return lambda a: a.update(kw)


# fmt: off
BAD = [
    # (id, layout, cache dtype, change, exception, what the message must name)
    ("overflow", "contiguous", "float32", _set(cache_lens=np.array([11, 0])), ValueError, "overflow"),
    ("overflow_nonew", "contiguous", "float32", _set(cache_lens=np.array([13, 0]), k_new=None, v_new=None),
     ValueError, "overflow"),
    ("overflow_paged", "paged", "float32", _set(cache_lens=np.array([3, 11])), ValueError, "overflow"),
    ("overflow_paged_int8", "paged", "int8", _set(cache_lens=np.array([11, 3])), ValueError, "overflow"),
    ("block_out_of_range", "paged", "float32", lambda a: a["block_table"].__setitem__((1, 0), 7), ValueError,
     "block"),
    ("block_out_of_range_last", "paged", "float32", lambda a: a["block_table"].__setitem__((0, 2), 99), ValueError,
     "block"),
    ("block_minus_one_needed", "paged", "float32", lambda a: a["block_table"].__setitem__((0, 2), -1), ValueError,
     "block"),
    ("block_negative", "paged", "int8", lambda a: a["block_table"].__setitem__((1, 1), -5), ValueError, "block"),
    ("block_table_rows", "paged", "float32", lambda a: a.update(block_table=a["block_table"][:1]), ValueError,
     "block_table"),
    ("block_table_float", "paged", "float32", lambda a: a.update(block_table=a["block_table"].astype(float)),
     TypeError, "block_table"),
    ("dtype_mismatch", "contiguous", "float32", lambda a: a.update(v_cache=a["v_cache"].astype(np.float16)),
     TypeError, "dtype"),
    ("dtype_mismatch_paged", "paged", "float16", lambda a: a.update(v_cache=a["v_cache"].astype(np.float32)),
     TypeError, "dtype"),
    ("int8_without_scales", "contiguous", "int8", _set(k_scale=None, v_scale=None), ValueError, "scale"),
    ("int8_without_v_scale", "paged", "int8", _set(v_scale=None), ValueError, "v_scale"),
    ("int8_scales_float64", "contiguous", "int8", lambda a: a.update(k_scale=a["k_scale"].astype(np.float64)),
     ValueError, "k_scale"),
    ("int8_scales_shape", "contiguous", "int8", lambda a: a.update(k_scale=a["k_scale"][:, :, :-1]), ValueError,
     "k_scale"),
    ("scales_with_float_cache", "contiguous", "float32", lambda a: a.update(k_scale=np.ones((2, 2, 12), np.float32)),
     ValueError, "scale"),
    ("float64_cache_float32_query", "contiguous", "float64", _set(), TypeError, "float64"),
    ("int_cache", "contiguous", "float32", lambda a: a.update(k_cache=a["k_cache"].astype(np.int32),
                                                             v_cache=a["v_cache"].astype(np.int32)),
     TypeError, "k_cache"),
    ("k_new_wrong_Lq", "contiguous", "float32", lambda a: a.update(k_new=a["k_new"][:, :, :1]), ValueError, "k_new"),
    ("k_new_wrong_Hkv", "paged", "float32", lambda a: a.update(k_new=np.zeros((2, 1, 2, 8), np.float32)),
     ValueError, "k_new"),
    ("v_new_wrong_Ev", "contiguous", "int8", lambda a: a.update(v_new=np.zeros((2, 2, 2, 5), np.float32)),
     ValueError, "v_new"),
    ("k_new_without_v_new", "contiguous", "float32", _set(v_new=None), ValueError, "v_new"),
    ("k_new_int", "contiguous", "float32", lambda a: a.update(k_new=a["k_new"].astype(np.int32)), TypeError,
     "k_new"),
    ("cache_wrong_Hkv", "contiguous", "float32", lambda a: a.update(k_cache=np.zeros((2, 3, 12, 8), np.float32),
                                                                   v_cache=np.zeros((2, 3, 12, 8), np.float32)),
     ValueError, "heads"),
    ("v_cache_wrong_Hkv", "paged", "float32", lambda a: a.update(v_cache=np.zeros((7, 1, 4, 8), np.float32)),
     ValueError, "v_cache"),
    ("cache_wrong_E", "contiguous", "float32", lambda a: a.update(k_cache=np.zeros((2, 2, 12, 9), np.float32)),
     ValueError, "k_cache"),
    ("cache_wrong_B", "contiguous", "float32", lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
     ValueError, "k_cache"),
    ("negative_cache_lens", "contiguous", "float32", _set(cache_lens=np.array([-1, 3])), ValueError, "cache_lens"),
    ("negative_cache_lens_paged", "paged", "int8", _set(cache_lens=np.array([2, -3])), ValueError, "cache_lens"),
    ("cache_lens_float", "contiguous", "float32", _set(cache_lens=np.array([1.0, 3.0])), TypeError, "cache_lens"),
    ("cache_lens_shape", "contiguous", "float32", _set(cache_lens=np.array([1, 2, 3])), ValueError, "cache_lens"),
    ("read_only_k", "contiguous", "float32", lambda a: a["k_cache"].setflags(write=False), ValueError, "read-only"),
    ("read_only_v_paged", "paged", "bfloat16", lambda a: a["v_cache"].setflags(write=False), ValueError,
     "read-only"),
    ("query_3d", "contiguous", "float32", lambda a: a.update(query=a["query"][0]), ValueError, "query"),
    ("cache_list", "contiguous", "float32", lambda a: a.update(k_cache=a["k_cache"].tolist()), TypeError, "k_cache"),
    ("bad_window", "contiguous", "float32", _set(window=(-1, 0)), ValueError, "window"),
    ("bad_softcap", "paged", "float32", _set(softcap=-1.0), ValueError, "softcap"),
    ("bad_sinks", "contiguous", "float32", _set(sinks=np.zeros(3)), ValueError, "sinks"),
    ("bad_out", "contiguous", "float32", _set(out=np.zeros((2, 4, 2, 7), np.float32)), ValueError, "out"),
]
# fmt: on


@pytest.mark.parametrize(
    "layout,cdt,change,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BAD]
)  # fmt: skip
def test_bad_input_raises_and_leaves_cache_unchanged(layout, cdt, change, exc, match, rng):
    """Each bad input raises ValueError/TypeError naming the problem before a byte of the cache is written."""
    a = _base(layout, cdt, rng)
    change(a)
    watched = [a[k] for k in ("k_cache", "v_cache", "k_scale", "v_scale", "block_table")]
    watched = [x for x in watched if isinstance(x, np.ndarray)]
    before = [x.copy() for x in watched]
    with pytest.raises(exc, match=match):
        pyattn.kvcache_attention(**a)
    for x, x0 in zip(watched, before):
        assert np.array_equal(x.view(np.uint8), x0.view(np.uint8)), "the cache was modified by a failing call"


@pytest.mark.skipif(
    os.environ.get("PYATTN_SANITIZED") == "1", reason="ASan aborts on an allocation past its maximum size"
)
@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_output_that_cannot_be_allocated_leaves_cache_unchanged(layout, path, rng):
    """A call whose output cannot be allocated (a query broadcast to 2**40 heads: 32 TiB) raises
    MemoryError before it writes the new tokens, on the compiled path and the Python one (a
    window of (None, None) takes the latter)."""
    a = _base(layout, "float32", rng, Lq=1)
    a["query"] = np.broadcast_to(a["query"][:, :1], (2, 2**40, 1, 8))
    kw = {} if path == "fast" else {"window": (None, None)}
    before = [a[k].copy() for k in ("k_cache", "v_cache")]
    with pytest.raises(MemoryError):
        pyattn.kvcache_attention(**a, **kw)
    for k, x0 in zip(("k_cache", "v_cache"), before):
        assert np.array_equal(a[k].view(np.uint8), x0.view(np.uint8)), f"{k} written by a call that raised"


@pytest.mark.parametrize("path", ["fast", "general"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_query_viewing_the_written_slots_is_read_as_given(dtype, path, rng):
    """A query that is a view of the cache slots the call writes attends as the query it was
    when passed (the compiled path leaves such a call to the Python one, which reads a copy),
    not as the new tokens written over it."""
    B, H, E, Lq = 2, 2, 8, 3
    kc, vc = randn(rng, (B, H, 16, E), dtype), randn(rng, (B, H, 16, E), dtype)
    kn, vn = randn(rng, (B, H, Lq, E), dtype), randn(rng, (B, H, Lq, E), dtype)
    lens = np.array([4, 4])
    kw = {} if path == "fast" else {"window": (None, None)}
    want = pyattn.kvcache_attention(kc[:, :, 4:7].copy(), kc.copy(), vc.copy(), lens, k_new=kn, v_new=vn, **kw)
    got = pyattn.kvcache_attention(kc[:, :, 4:7], kc, vc, lens, k_new=kn, v_new=vn, **kw)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kc[:, :, 4:7], kn)  # and the new tokens were written


def test_bad_input_boundaries_are_accepted(rng):
    """Exactly full caches, -1 past the needed blocks and read-only caches without k_new are accepted."""
    a = _base("contiguous", "float32", rng)
    a["cache_lens"] = np.array([10, 10])  # 10 + 2 == capacity 12
    pyattn.kvcache_attention(**a)
    a = _base("paged", "float32", rng)
    a["cache_lens"] = np.array([10, 6])  # needs 3 and 2 blocks: sequence 1's -1 is not needed
    pyattn.kvcache_attention(**a)
    a = _base("contiguous", "float32", rng)
    a["k_cache"].setflags(write=False)
    a["v_cache"].setflags(write=False)
    a["k_new"] = a["v_new"] = None
    pyattn.kvcache_attention(**a)


KVCACHE_BAD = {
    "k_new_shape": (lambda q, k, v: (q, k[:, :, :1], v), {}, ValueError, "k_new"),
    "new_lens_too_big": (lambda q, k, v: (q, k, v), {"new_lens": np.array([3, 1])}, ValueError, "new_lens"),
    "new_lens_negative": (lambda q, k, v: (q, k, v), {"new_lens": np.array([-1, 1])}, ValueError, "new_lens"),
    "bad_window": (lambda q, k, v: (q, k, v), {"window": (-2, None)}, ValueError, "window"),
    "query_int": (lambda q, k, v: (q.astype(np.int32), k, v), {}, TypeError, "query"),
    "unknown_keyword": (lambda q, k, v: (q, k, v), {"windo": (3, None)}, TypeError, "windo"),
}


@pytest.mark.parametrize("bad", list(KVCACHE_BAD))
@pytest.mark.parametrize("layout", ["contiguous", "paged4"])
@pytest.mark.parametrize("cdt", ["float32", "int8"])
def test_bad_kvcache_attend_leaves_state_unchanged(cdt, layout, bad, rng):
    """A failing KVCache.attend changes neither lens, nor block_table, nor nbytes, nor a byte of K/V."""
    B, Hkv, Hq, D = 2, 1, 2, 8
    bs = 4 if layout == "paged4" else None
    cache = pyattn.KVCache(B, Hkv, D, max_len=None if bs else 16, block_size=bs, dtype=cache_dtype(cdt))
    cache.attend(randn(rng, (B, Hq, 3, D), np.float32), randn(rng, (B, Hkv, 3, D)), randn(rng, (B, Hkv, 3, D)))
    fn, kw, exc, match = KVCACHE_BAD[bad]
    args = fn(randn(rng, (B, Hq, 2, D), np.float32), randn(rng, (B, Hkv, 2, D)), randn(rng, (B, Hkv, 2, D)))
    names = ("k", "v", "k_scale", "v_scale", "block_table")
    before = {n: getattr(cache, n).copy() for n in names if getattr(cache, n) is not None}
    lens, nbytes = cache.lens, cache.nbytes
    with pytest.raises(exc, match=match):
        cache.attend(*args, **kw)
    assert np.array_equal(cache.lens, lens), "lens changed"
    assert cache.nbytes == nbytes, "nbytes changed"
    for n, x0 in before.items():
        x = getattr(cache, n)
        assert x.shape == x0.shape and np.array_equal(x.view(np.uint8), x0.view(np.uint8)), f"{n} changed"


# ------------------------------------------------------------------------------------------------
# 6. one thread and two give the same bits


THREAD_CASES = {
    "decode_f32": ("contiguous", "float32", 1, {}),
    "decode_paged16_bf16": ("paged16", "bfloat16", 1, {}),
    "decode_paged5_int8_variants": (
        "paged5", "int8", 1, {"window": (700, None), "softcap": 4.0, "alibi_slopes": 0.01, "sinks": 0.5}
    ),
    "decode_f16_lq2": ("contiguous", "float16", 2, {}),
    "prefill64_f32": ("contiguous", "float32", 64, {}),
    "prefill64_paged16_int8": ("paged16", "int8", 64, {"sinks": 1.0}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(THREAD_CASES))
def test_threads_1_and_2_identical(isa, case, rng):
    """num_threads(1) and num_threads(2) give identical outputs, lse and cache bytes (and match the reference)."""
    layout, cdt, Lq, kw = THREAD_CASES[case]
    dt = cache_dtype(cdt)
    B, Hkv, Hq, D = 2, 1, 4, 64  # two head groups: decode splits its 2000 keys into chunks
    lens = np.array([2000, 1500]) if Lq <= 2 else np.array([500, 300])
    bs = LAYOUTS[layout]
    cap = int(lens.max()) + Lq
    if bs:
        nblk = -(-cap // bs)
        table = rng.permutation(B * nblk).astype(np.int32).reshape(B, nblk)
        shape = (B * nblk, Hkv, bs)
    else:
        table, shape = None, (B, Hkv, cap)
    k, v = np.zeros(shape + (D,), dt), np.zeros(shape + (D,), dt)
    ks, vs = (np.zeros(shape, np.float32), np.zeros(shape, np.float32)) if cdt == "int8" else (None, None)
    full_k, full_v = randn(rng, (B, Hkv, cap, D), np.float32), randn(rng, (B, Hkv, cap, D), np.float32)
    for b in range(B):
        put(k, ks, table, b, 0, full_k[b, :, : lens[b]])
        put(v, vs, table, b, 0, full_v[b, :, : lens[b]])
    q = randn(rng, (B, Hq, Lq, D), np.float32)
    kn, vn = full_k[:, :, -Lq:], full_v[:, :, -Lq:]
    got = {}
    for n in (1, 2):
        kc, vc = k.copy(), v.copy()
        ksc, vsc = (None, None) if ks is None else (ks.copy(), vs.copy())
        with pyattn.num_threads(n):
            o, lse = pyattn.kvcache_attention(
                q,
                kc,
                vc,
                lens,
                k_new=kn,
                v_new=vn,
                block_table=table,
                k_scale=ksc,
                v_scale=vsc,
                return_lse=True,
                **kw,
            )
        got[n] = (o, lse, kc, vc, ksc, vsc)
    for name, x1, x2 in zip(("output", "lse", "k", "v", "k_scale", "v_scale"), got[1], got[2]):
        if x1 is not None:
            assert np.array_equal(x1.view(np.uint8), x2.view(np.uint8)), f"{name} differs between 1 and 2 threads"
    o, lse, kc, vc, ksc, vsc = got[2]
    for b in range(B):
        n = int(lens[b]) + Lq
        kk = stored(kc, ksc, table, b, n)
        vv = stored(vc, vsc, table, b, n)
        want, want_lse = ref_sdpa(
            q[b], kk, vv, is_causal=True, causal_align="bottom_right", enable_gqa=True, return_lse=True, **kw
        )
        assert_close(o[b], want, np.float32, tol=TOL[cdt], what=f"sequence {b}")
        assert_close(lse[b], want_lse, np.float32, tol=TOL[cdt], what=f"sequence {b} lse")


# ------------------------------------------------------------------------------------------------
# 7. varlen_attention

#: (Lq, Lk) per sequence: empty ones, single tokens, Lq > Lk (causal rows with no key), tile edges
#: (16, 32, 48, 64, 128 queries or keys) and one long sequence
VARLEN_LENS = [(1, 1), (0, 5), (3, 0), (16, 16), (17, 33), (33, 31), (0, 0), (48, 49), (64, 64), (65, 129),
               (128, 127), (1, 300), (8, 8), (500, 500)]  # fmt: skip
VARLEN_VARIANTS = {
    "plain": {},
    "window": {"window": (20, 3)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "sinks": {"sinks": np.array([1.0, -1.0, 0.0, 2.0])},
}


@pytest.mark.parametrize("variant", list(VARLEN_VARIANTS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_varlen_matches_per_sequence_calls(isa, dtype, causal, variant, rng):
    """varlen_attention on packed sequences equals per-sequence scaled_dot_product_attention (bottom-right, GQA)."""
    Hq, Hkv, E, Ev = 4, 2, 16, 8
    kw = VARLEN_VARIANTS[variant]
    lq, lk = np.array([x for x, _ in VARLEN_LENS]), np.array([y for _, y in VARLEN_LENS])
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = randn(rng, (cq[-1], Hq, E), dtype)
    k, v = randn(rng, (ck[-1], Hkv, E), dtype), randn(rng, (ck[-1], Hkv, Ev), dtype)
    out, lse = pyattn.varlen_attention(q, k, v, cq, ck, is_causal=causal, return_lse=True, **kw)
    assert out.shape == (cq[-1], Hq, Ev) and out.dtype == dtype and lse.shape == (cq[-1], Hq)
    tol = 2e-5 if dtype == np.float32 else 1e-10
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        qs = q[cq[b] : cq[b + 1]].transpose(1, 0, 2)
        ks, vs = k[ck[b] : ck[b + 1]].transpose(1, 0, 2), v[ck[b] : ck[b + 1]].transpose(1, 0, 2)
        args = dict(is_causal=causal, causal_align="bottom_right", enable_gqa=True, return_lse=True, **kw)
        want, want_lse = ref_sdpa(qs, ks, vs, **args)
        got, got_lse = out[cq[b] : cq[b + 1]].transpose(1, 0, 2), lse[cq[b] : cq[b + 1]].T
        what = f"sequence {b} (Lq {lq[b]}, Lk {lk[b]})"
        assert_close(got, want, dtype, tol=tol, what=what + " vs reference")
        assert_close(got_lse, want_lse, dtype, tol=tol, what=what + " lse vs reference")
        if lk[b] == 0:
            continue
        one, one_lse = pyattn.scaled_dot_product_attention(qs, ks, vs, **args)
        assert_close(got, one, dtype, tol=tol, what=what + " vs a per-sequence call")
        assert_close(got_lse, one_lse, dtype, tol=tol, what=what + " lse vs a per-sequence call")


def test_varlen_out_and_empty_batch(rng):
    """varlen_attention writes into out= and returns it; a batch of no sequences gives an empty result."""
    cq = ck = np.array([0, 3, 10], np.int32)
    q, k, v = randn(rng, (10, 2, 8)), randn(rng, (10, 2, 8)), randn(rng, (10, 2, 8))
    want = pyattn.varlen_attention(q, k, v, cq, ck, is_causal=True)
    buf = np.full((10, 2, 8), np.nan)
    assert pyattn.varlen_attention(q, k, v, cq, ck, is_causal=True, out=buf) is buf
    assert np.array_equal(buf, want)
    z = np.zeros((0, 2, 8))
    res = pyattn.varlen_attention(z, z, z, np.array([0], np.int32), np.array([0], np.int32))
    assert res.shape == (0, 2, 8)


VARLEN_OUT_LENS = {
    # keyless and query-less sequences, causal rows before the first key (Lq > Lk), tile edges
    "mixed": [(3, 0), (0, 4), (5, 5), (17, 40), (1, 1), (6, 2), (70, 70)],
    "keyless": [(30, 0), (50, 0)],  # no key at all: the core is called with Lk = 0
}


@pytest.mark.parametrize("lens", list(VARLEN_OUT_LENS))
@pytest.mark.parametrize("form", ["direct", "rows_apart", "strided_last", "aliases_keys"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_varlen_out_forms(isa, form, sinks, lens, rng):
    """Every form of out= gets every row of every sequence (keyless and empty ones too): written in
    place where the core can (its NaN fill must not survive, the rows around a view stay as they
    were, and no temporary of the output's size is made), through a temporary where not (a
    strided last axis, out sharing memory with the keys being read)."""
    seqs = VARLEN_OUT_LENS[lens]
    cq = np.concatenate([[0], np.cumsum([a for a, _ in seqs])]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum([b for _, b in seqs])]).astype(np.int32)
    if form == "aliases_keys" and ck[-1] < cq[-1]:
        pytest.skip("too few keys for an out inside them")
    H, E = 4, 32
    q, k, v = (randn(rng, (int(n), H, E), np.float32) for n in (cq[-1], ck[-1], ck[-1]))
    sink = np.array([1.0, -1.0, 0.0, 2.0], np.float32)
    kw = {"sinks": sink} if sinks else {}
    shape = (int(cq[-1]), H, E)
    want, want_lse = np.zeros(shape, np.float32), np.empty(shape[:2], np.float32)
    for b in range(len(seqs)):
        qs = q[cq[b] : cq[b + 1]].transpose(1, 0, 2)
        ks, vs = k[ck[b] : ck[b + 1]].transpose(1, 0, 2), v[ck[b] : ck[b + 1]].transpose(1, 0, 2)
        o, lse = ref_sdpa(qs, ks, vs, is_causal=True, causal_align="bottom_right", return_lse=True, **kw)
        want[cq[b] : cq[b + 1]], want_lse[cq[b] : cq[b + 1]] = o.transpose(1, 0, 2), lse.T
    parent = np.full((shape[0], H + 3, E), np.nan, np.float32)
    if form == "direct":
        buf = np.full(shape, np.nan, np.float32)
    elif form == "rows_apart":  # rows 3 heads wide, in place
        buf = parent[:, 1 : H + 1]
    elif form == "strided_last":
        buf = np.full(shape + (2,), np.nan, np.float32)[..., 0]
    else:
        k = k.copy()  # out shares the memory of the keys the call reads
        buf = k[: shape[0]]
    tracemalloc.start()
    try:
        got, lse = pyattn.varlen_attention(q, k, v, cq, ck, is_causal=True, return_lse=True, out=buf, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got is buf
    assert not np.isnan(got).any(), f"{form}: rows left unwritten"
    assert_close(got, want, np.float32, tol=2e-5, what=f"{form} output")
    assert_close(lse, want_lse, np.float32, tol=2e-5, what=f"{form} lse")
    if form in ("direct", "rows_apart"):  # in place: no temporary of out's size
        assert peak < buf.nbytes // 2, f"{form}: {peak} bytes allocated for an out of {buf.nbytes}"
    if form == "rows_apart":
        assert np.isnan(parent[:, 0]).all() and np.isnan(parent[:, H + 1 :]).all(), "written outside the view"


VARLEN_BAD = {
    "q_not_from_0": (np.array([1, 3, 6]), np.array([0, 3, 6]), "cu_seqlens_q"),
    "k_not_from_0": (np.array([0, 3, 6]), np.array([2, 3, 6]), "cu_seqlens_k"),
    "q_decreasing": (np.array([0, 4, 3, 6]), np.array([0, 2, 4, 6]), "cu_seqlens_q"),
    "k_decreasing": (np.array([0, 2, 4, 6]), np.array([0, 5, 4, 6]), "cu_seqlens_k"),
    "q_wrong_total": (np.array([0, 3, 5]), np.array([0, 3, 6]), "cu_seqlens_q"),
    "k_wrong_total": (np.array([0, 3, 6]), np.array([0, 3, 7]), "cu_seqlens_k"),
    "different_lengths": (np.array([0, 3, 6]), np.array([0, 2, 4, 6]), "same length"),
    "float": (np.array([0.0, 3.0, 6.0]), np.array([0, 3, 6]), "cu_seqlens_q"),
    "2d": (np.array([[0, 3, 6]]), np.array([0, 3, 6]), "cu_seqlens_q"),
    "empty": (np.array([], np.int32), np.array([0, 3, 6]), "cu_seqlens_q"),
}


@pytest.mark.parametrize("bad", list(VARLEN_BAD))
def test_varlen_bad_cu_seqlens_raise(bad, rng):
    """Bad cu_seqlens (not from 0, decreasing, wrong total, unequal lengths, not 1-D) raise
    ValueError; a non-integer dtype raises TypeError, as for cache_lens, kv_lens and block_table."""
    cq, ck, match = VARLEN_BAD[bad]
    q, k, v = randn(rng, (6, 2, 8)), randn(rng, (6, 1, 8)), randn(rng, (6, 1, 8))
    with pytest.raises(TypeError if bad == "float" else ValueError, match=match):
        pyattn.varlen_attention(q, k, v, cq, ck)


@pytest.mark.parametrize("name", ["sinks", "alibi_slopes"])
def test_varlen_per_head_shapes(name, rng):
    """alibi_slopes and sinks are one per query head for every sequence: (Hq,), or a scalar or
    (1,) for all heads, the same as (Hq,) filled; (1, Hq) and other shapes raise ValueError."""
    q, k, v = randn(rng, (6, 2, 8)), randn(rng, (6, 1, 8)), randn(rng, (6, 1, 8))
    cu = np.array([0, 2, 6])
    want = pyattn.varlen_attention(q, k, v, cu, cu, is_causal=True, **{name: np.full(2, 0.5)})
    for same in (0.5, np.array([0.5])):
        np.testing.assert_array_equal(pyattn.varlen_attention(q, k, v, cu, cu, is_causal=True, **{name: same}), want)
    for bad in (np.zeros((1, 2)), np.zeros(3)):
        with pytest.raises(ValueError, match=rf"{name} has shape {re.escape(str(bad.shape))}.*one per query head"):
            pyattn.varlen_attention(q, k, v, cu, cu, **{name: bad})


# ------------------------------------------------------------------------------------------------
# 8. the KVCache object


def test_kvcache_lens_is_a_copy_and_advances(rng):
    """lens starts at 0, advances by new_lens (or Lq), and is a copy."""
    cache = pyattn.KVCache(3, 1, 8, max_len=20)
    assert np.array_equal(cache.lens, [0, 0, 0])
    cache.attend(randn(rng, (3, 2, 4, 8), np.float32), randn(rng, (3, 1, 4, 8)), randn(rng, (3, 1, 4, 8)),
                 new_lens=np.array([4, 0, 2]))  # fmt: skip
    lens = cache.lens
    assert np.array_equal(lens, [4, 0, 2])
    lens[:] = 99
    assert np.array_equal(cache.lens, [4, 0, 2])
    cache.attend(randn(rng, (3, 2, 1, 8), np.float32), randn(rng, (3, 1, 1, 8)), randn(rng, (3, 1, 1, 8)))
    assert np.array_equal(cache.lens, [5, 1, 3])


@pytest.mark.parametrize("cdt", ["float32", "int8"])
def test_kvcache_reset_frees_and_reuses_blocks(isa, cdt, rng):
    """reset(rows) empties those rows; a paged cache hands their blocks to the next sequence, nbytes unchanged."""
    B, Hkv, Hq, D, bs = 3, 2, 4, 16, 8
    cache = pyattn.KVCache(B, Hkv, D, block_size=bs, dtype=cache_dtype(cdt))

    def attend(nl, Lq):
        q = randn(rng, (B, Hq, Lq, D), np.float32)
        kn, vn = randn(rng, (B, Hkv, Lq, D), np.float32), randn(rng, (B, Hkv, Lq, D), np.float32)
        return q, cache.attend(q, kn, vn, new_lens=np.array(nl))

    def held(r):
        return cache.block_table[r][cache.block_table[r] >= 0].tolist()

    attend([30, 20, 9], 30)
    # grow the pool to whatever it takes for 32 tokens each, then fill it: no block is free
    attend([2, 12, 23], 23)
    assert np.array_equal(cache.lens, [32, 32, 32])
    spare = set(range(cache.k.shape[0])) - set(held(0) + held(1) + held(2))  # blocks no row holds
    nbytes, shape = cache.nbytes, cache.k.shape
    freed = set(held(0)) | set(held(2))
    row1 = cache.block_table[1].copy()
    k1 = stored(cache.k, cache.k_scale, cache.block_table, 1, 32)
    cache.reset([0, 2])
    assert np.array_equal(cache.lens, [0, 32, 0])
    assert np.all(cache.block_table[0] == -1) and np.all(cache.block_table[2] == -1)
    assert np.array_equal(cache.block_table[1], row1)
    q, out = attend([32, 0, 24], 32)  # 7 blocks: the freed ones are reused (and no growth)
    new = set(held(0)) | set(held(2))
    assert len(held(0)) == 4 and len(held(2)) == 3 and len(new) == 7, "a block handed out twice"
    assert new <= freed | spare and len(new & freed) >= 7 - len(spare), "freed blocks not reused"
    assert cache.nbytes == nbytes and cache.k.shape == shape
    assert np.array_equal(cache.block_table[1], row1)
    assert np.array_equal(cache.lens, [32, 32, 24])
    assert np.array_equal(stored(cache.k, cache.k_scale, cache.block_table, 1, 32), k1), "row 1 disturbed"
    for b, n in ((0, 32), (2, 24)):
        kc = stored(cache.k, cache.k_scale, cache.block_table, b, n)
        vc = stored(cache.v, cache.v_scale, cache.block_table, b, n)
        want = ref_sdpa(q[b, :, :n], kc, vc, is_causal=True, causal_align="bottom_right", enable_gqa=True)
        assert_close(out[b, :, :n], want, np.float32, tol=TOL[cdt], what=f"sequence {b} in reused blocks")
    assert np.all(out[1] == 0)
    cache.reset()
    assert np.array_equal(cache.lens, [0, 0, 0]) and np.all(cache.block_table == -1)
    assert cache.nbytes == nbytes
    with pytest.raises(ValueError, match="rows"):
        cache.reset([3])


def test_kvcache_reset_contiguous(rng):
    """reset(rows) on a contiguous cache zeroes those lens; the next tokens start at position 0."""
    cache = pyattn.KVCache(2, 1, 8, max_len=10)
    cache.attend(randn(rng, (2, 1, 6, 8), np.float32), randn(rng, (2, 1, 6, 8)), randn(rng, (2, 1, 6, 8)))
    cache.reset(1)
    assert np.array_equal(cache.lens, [6, 0])
    q, kn, vn = randn(rng, (2, 1, 4, 8), np.float32), randn(rng, (2, 1, 4, 8)), randn(rng, (2, 1, 4, 8))
    out = cache.attend(q, kn, vn, new_lens=np.array([4, 4]))
    assert np.array_equal(cache.lens, [10, 4])
    assert np.array_equal(cache.k[1, :, :4], kn[1].astype(np.float32))
    want = ref_sdpa(q[1], kn[1].astype(np.float32), vn[1].astype(np.float32), is_causal=True)
    assert_close(out[1], want, np.float32, tol=TOL["float32"])


@pytest.mark.parametrize("cdt", ["float32", "float16", "int8"])
def test_kvcache_nbytes(cdt):
    """nbytes counts K, V, the int8 scales and the block table."""
    dt = cache_dtype(cdt)
    B, H, D, Dv, L = 3, 2, 16, 8, 40
    c = pyattn.KVCache(B, H, D, v_head_dim=Dv, max_len=L, dtype=dt)
    per_token = H * (D + Dv) * dt.itemsize + (2 * H * 4 if cdt == "int8" else 0)
    assert c.nbytes == B * L * per_token
    p = pyattn.KVCache(B, H, D, v_head_dim=Dv, max_len=L, block_size=16, dtype=dt)
    assert p.nbytes == B * 3 * 16 * per_token + p.block_table.nbytes
    if cdt == "int8":
        f32 = pyattn.KVCache(B, H, D, v_head_dim=Dv, max_len=L).nbytes
        assert 3 * c.nbytes <= f32


@pytest.mark.parametrize("cdt", ["float32", "bfloat16", "int8"])
def test_kvcache_paged_grows_without_max_len(isa, cdt, rng):
    """A paged cache without max_len grows past its first pool; old tokens survive and results stay correct."""
    B, Hkv, Hq, D, bs = 2, 1, 2, 16, 4
    cache = pyattn.KVCache(B, Hkv, D, block_size=bs, dtype=cache_dtype(cdt))
    n0 = cache.nbytes
    hist_k, hist_v = [np.zeros((Hkv, 0, D)) for _ in range(B)], [np.zeros((Hkv, 0, D)) for _ in range(B)]
    for Lq, nl in ((10, [10, 3]), (40, [40, 40]), (1, None), (25, [0, 25]), (1, None)):
        q = randn(rng, (B, Hq, Lq, D), np.float32)
        kn, vn = randn(rng, (B, Hkv, Lq, D), np.float32), randn(rng, (B, Hkv, Lq, D), np.float32)
        counts = np.full(B, Lq) if nl is None else np.array(nl)
        out = cache.attend(q, kn, vn, new_lens=None if nl is None else counts)
        for b in range(B):
            hist_k[b] = np.concatenate([hist_k[b], kn[b, :, : counts[b]]], axis=1)
            hist_v[b] = np.concatenate([hist_v[b], vn[b, :, : counts[b]]], axis=1)
            L = int(cache.lens[b])
            assert L == hist_k[b].shape[1]
            check_stored(cache, b, L, hist_k[b], hist_v[b])
            kc = stored(cache.k, cache.k_scale, cache.block_table, b, L)
            vc = stored(cache.v, cache.v_scale, cache.block_table, b, L)
            want = ref_sdpa(q[b, :, : counts[b]], kc, vc, is_causal=True, causal_align="bottom_right")
            assert_close(out[b, :, : counts[b]], want, np.float32, tol=TOL[cdt], what=f"sequence {b}")
    assert np.array_equal(cache.lens, [52, 70])
    assert cache.nbytes > n0
    used = cache.block_table[cache.block_table >= 0]
    assert len(np.unique(used)) == used.size, "a block is shared by two sequences"


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kvcache_overflow_with_max_len(layout, rng):
    """Appending past max_len raises ValueError and leaves lens, the block table and K/V unchanged."""
    B, Hkv, D = 2, 1, 8
    cache = pyattn.KVCache(B, Hkv, D, max_len=20, block_size=8 if layout == "paged" else None)
    cache.attend(randn(rng, (B, 1, 15, D), np.float32), randn(rng, (B, 1, 15, D)), randn(rng, (B, 1, 15, D)),
                 new_lens=np.array([15, 2]))  # fmt: skip
    names = ("k", "v", "block_table")
    before = {n: getattr(cache, n).copy() for n in names if getattr(cache, n) is not None}
    lens = cache.lens
    with pytest.raises(ValueError, match="overflow"):
        cache.attend(randn(rng, (B, 1, 6, D), np.float32), randn(rng, (B, 1, 6, D)), randn(rng, (B, 1, 6, D)))
    assert np.array_equal(cache.lens, lens)
    for n, x0 in before.items():
        assert np.array_equal(getattr(cache, n), x0), f"{n} changed"
    # exactly full is fine; one more token is not
    cache.attend(randn(rng, (B, 1, 5, D), np.float32), randn(rng, (B, 1, 5, D)), randn(rng, (B, 1, 5, D)))
    assert np.array_equal(cache.lens, [20, 7])
    with pytest.raises(ValueError, match="overflow"):
        cache.attend(randn(rng, (B, 1, 1, D), np.float32), randn(rng, (B, 1, 1, D)), randn(rng, (B, 1, 1, D)),
                     new_lens=np.array([1, 0]))  # fmt: skip
    assert np.array_equal(cache.lens, [20, 7])


@pytest.mark.parametrize("cdt", ["float32", "float16", "bfloat16"])
def test_cache_in_the_other_byte_order_is_refused(cdt, rng):
    """A cache is written and read in place, so one in the other byte order is an error, not
    bytes read the wrong way round."""
    dt = cache_dtype(cdt).newbyteorder("S")
    kc, vc = np.zeros((1, 2, 8, 4), dt), np.zeros((1, 2, 8, 4), dt)
    q, kn = randn(rng, (1, 2, 1, 4), np.float32), randn(rng, (1, 2, 1, 4), np.float32)
    with pytest.raises(TypeError, match="k_cache must be in the machine's byte order"):
        pyattn.kvcache_attention(q, kc, vc, np.zeros(1, np.int64), k_new=kn, v_new=kn)
    assert not kc.any() and not vc.any()


def test_kvcache_constructor_errors():
    """KVCache refuses a missing size, an unsupported dtype and non-positive sizes."""
    with pytest.raises(ValueError, match="max_len"):
        pyattn.KVCache(2, 1, 8)
    with pytest.raises(TypeError, match="dtype"):
        pyattn.KVCache(2, 1, 8, max_len=4, dtype=np.int32)
    with pytest.raises((ValueError, TypeError), match="batch"):
        pyattn.KVCache(0, 1, 8, max_len=4)
    with pytest.raises((ValueError, TypeError), match="block_size"):
        pyattn.KVCache(1, 1, 8, block_size=0)
