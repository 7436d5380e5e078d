"""KV-cache inputs at the edges of their integer types, writes that must not half-happen, and
outputs that overlap the inputs (found by an adversarial pass over the cache API).

Each case failed before its fix: lengths near 2**63 or unsigned past it wrapped into writes out
of bounds (a crash in the C path), unsigned or narrow cu_seqlens wrapped in their differences,
int64 block ids past 2**31 were cut to int32 and named another block, read-only or oddly strided
int8 scales and a bad ``scale`` were found only after the new tokens were written, an ``out``
overlapping the query or the cache was written while still being read, a NaN written into an
int8 cache vanished, and empty caches or ``reset([])`` were refused. A second pass found
``KVCache.attend(q, None, None)`` advancing ``lens`` over slots it never wrote, a zero-stride
``out`` written by racing threads, a read-only call refusing a cache with a strided feature axis,
and NumPy warnings from a subnormal int8 row and from 0-token blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_close, randn

import pyattn
from pyattn import reference

I64_MAX = np.iinfo(np.int64).max


def rn(rng, shape):  # float32, so that the calls can take the C path
    return randn(rng, shape, np.float32)


def _caches(cdt, B=1, Hkv=1, L=8, D=4):
    kc, vc = np.zeros((B, Hkv, L, D), cdt), np.zeros((B, Hkv, L, D), cdt)
    scales = {}
    if np.dtype(cdt) == np.int8:
        scales = {"k_scale": np.zeros((B, Hkv, L), np.float32), "v_scale": np.zeros((B, Hkv, L), np.float32)}
    return kc, vc, scales


def _snapshot(*arrays):
    return [a.copy() for a in arrays if a is not None]


def _unchanged(before, *arrays):
    return all(np.array_equal(b, a, equal_nan=True) for b, a in zip(before, [a for a in arrays if a is not None]))


@pytest.mark.parametrize("lens", [np.array([I64_MAX]), np.array([I64_MAX - 1]), np.array([2**62])])
@pytest.mark.parametrize("Lq", [1, 2])  # Lq 1 takes the C path, 2 with a window the Python one
@pytest.mark.parametrize("paged", [False, True])
def test_lengths_near_int64_max_raise_overflow(lens, Lq, paged, rng):
    kc, vc, _ = _caches(np.float32, L=8)
    table = None
    if paged:
        kc, vc = kc.reshape(2, 1, 4, 4), vc.reshape(2, 1, 4, 4)
        table = np.array([[0, 1]], np.int32)
    q, kn, vn = rn(rng, (1, 1, Lq, 4)), rn(rng, (1, 1, Lq, 4)), rn(rng, (1, 1, Lq, 4))
    before = _snapshot(kc, vc)
    variant = {"window": (None, None)} if Lq == 2 else {}
    with pytest.raises(ValueError, match="cache overflow"):
        pyattn.kvcache_attention(q, kc, vc, lens, k_new=kn, v_new=vn, block_table=table, **variant)
    assert _unchanged(before, kc, vc)


@pytest.mark.parametrize("big", [2**63, 2**64 - 1])
def test_unsigned_lengths_past_int64_are_refused(big, rng):
    kc, vc, _ = _caches(np.float32)
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc)
    with pytest.raises(ValueError, match="cache_lens"):
        pyattn.kvcache_attention(q, kc, vc, np.array([big], np.uint64), k_new=kn, v_new=vn)
    assert _unchanged(before, kc, vc)
    cache = pyattn.KVCache(1, 1, 4, max_len=8)
    cache.attend(q, kn, vn)
    with pytest.raises(ValueError, match="new_lens"):
        cache.attend(q, kn, vn, new_lens=np.array([big], np.uint64))
    assert cache.lens.tolist() == [1]


def test_unsigned_lengths_within_range_are_taken(rng):
    kc, vc, _ = _caches(np.float32)
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    kc2, vc2 = kc.copy(), vc.copy()
    a = pyattn.kvcache_attention(q, kc, vc, np.array([3], np.uint64), k_new=kn, v_new=vn)
    b = pyattn.kvcache_attention(q, kc2, vc2, np.array([3], np.int64), k_new=kn, v_new=vn)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kc, kc2)


@pytest.mark.parametrize(
    "cu",
    [
        np.array([0, 40, 3], np.uint64),  # decreasing: np.diff wraps in unsigned types
        np.array([0, 40, 3], np.uint32),
        np.array([0, 100, -100, 3], np.int8),  # np.diff wraps in int8: [100, 56, 103]
        np.array([0, 2**63, 3], np.uint64),  # past int64
    ],
)
def test_varlen_cu_seqlens_that_wrap_are_refused(cu, rng):
    B = cu.size - 1
    q, k = rn(rng, (3, 2, 8)), rn(rng, (3, 2, 8))
    ok = np.minimum(np.arange(B + 1), 3)
    ok[-1] = 3
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pyattn.varlen_attention(q, k, k, cu, ok)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        pyattn.varlen_attention(q, k, k, ok, cu)


def test_varlen_unsigned_and_narrow_cu_seqlens_match_int64(rng):
    q, k, v = rn(rng, (10, 2, 8)), rn(rng, (10, 2, 8)), rn(rng, (10, 2, 8))
    want = pyattn.varlen_attention(q, k, v, np.array([0, 4, 10]), np.array([0, 4, 10]), is_causal=True)
    for dt in (np.uint8, np.uint64, np.int8, np.int16):
        cu = np.array([0, 4, 10], dt)
        np.testing.assert_array_equal(pyattn.varlen_attention(q, k, v, cu, cu, is_causal=True), want)


@pytest.mark.parametrize("bad", [2**32 + 1, 2**31, -(2**32) + 1])
def test_block_ids_past_int32_are_refused_not_cut(bad, rng):
    kc, vc = np.zeros((4, 1, 2, 4), np.float32), np.zeros((4, 1, 2, 4), np.float32)
    table = np.array([[0, bad]], np.int64)  # the second block holds the new token (cache_lens 2)
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc)
    with pytest.raises(ValueError, match="block_table"):
        pyattn.kvcache_attention(q, kc, vc, np.array([2]), k_new=kn, v_new=vn, block_table=table)
    assert _unchanged(before, kc, vc)


def test_block_table_entries_past_the_tokens_are_not_read(rng):
    kc, vc = rn(rng, (4, 1, 2, 4)), rn(rng, (4, 1, 2, 4))
    q = rn(rng, (1, 1, 1, 4))
    want = pyattn.kvcache_attention(q, kc, vc, np.array([3]), block_table=np.array([[2, 1, 0]], np.int32))
    wide = np.array([[2, 1, 2**40]], np.int64)  # the third entry is past the 3 tokens held
    np.testing.assert_array_equal(pyattn.kvcache_attention(q, kc, vc, np.array([3]), block_table=wide), want)


@pytest.mark.parametrize("layout", ["fortran", "transposed view", "column slice"])
@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_block_table_in_any_memory_order_is_read_by_rows(layout, itype, rng):
    """A table not in C order (Fortran, a transposed view, every other column) names the same
    blocks as its C copy. Its copy kept the caller's order, and the kernel read it as C order:
    wrong blocks, or, with padding entries past the tokens, memory past the cache (a segfault)."""
    kc, vc = rn(rng, (6, 1, 4, 4)), rn(rng, (6, 1, 4, 4))
    q = rn(rng, (2, 1, 1, 4))
    lens = np.array([7, 8])
    c = np.array([[3, 1, 10**8], [5, 2, 10**8]], itype)  # padding past the tokens is never read
    if layout == "fortran":
        t = np.asfortranarray(c)
    elif layout == "transposed view":
        t = np.ascontiguousarray(c.T).T
    else:
        t = np.repeat(c, 2, axis=1)[:, ::2]
    assert not t.flags.c_contiguous
    want = pyattn.kvcache_attention(q, kc, vc, lens, block_table=c)
    np.testing.assert_array_equal(pyattn.kvcache_attention(q, kc, vc, lens, block_table=t), want)
    kg = np.stack([np.concatenate([kc[i] for i in row[:2]], axis=1) for row in c])
    vg = np.stack([np.concatenate([vc[i] for i in row[:2]], axis=1) for row in c])
    assert_close(want, reference.scaled_dot_product_attention(q, kg, vg, kv_lens=lens), np.float32)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_read_only_int8_scales_leave_the_cache_unchanged(which, rng):
    kc, vc, sc = _caches(np.int8)
    sc[which].flags.writeable = False
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc, sc["k_scale"], sc["v_scale"])
    with pytest.raises(ValueError, match=which):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, **sc)
    assert _unchanged(before, kc, vc, sc["k_scale"], sc["v_scale"])


def test_int8_scales_with_odd_strides_leave_the_cache_unchanged(rng):
    kc, vc, _ = _caches(np.int8)
    ks = np.ndarray((1, 1, 8), np.float32, buffer=bytearray(64), strides=(40, 40, 5))  # 5 bytes: no whole float
    vs = np.zeros((1, 1, 8), np.float32)
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc, ks, vs)
    with pytest.raises(ValueError, match="k_scale"):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, k_scale=ks, v_scale=vs)
    assert _unchanged(before, kc, vc, ks, vs)


@pytest.mark.parametrize("scale", ["x", np.ones(2), [1.0], True, None])
@pytest.mark.parametrize("cdt", [np.float32, np.int8])
def test_bad_scale_raises_before_the_write(scale, cdt, rng):
    kc, vc, sc = _caches(cdt)
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    if scale is None:  # a scale object that float() refuses
        scale = object()
    before = _snapshot(kc, vc, *sc.values())
    with pytest.raises(TypeError, match="scale"):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, scale=scale, **sc)
    assert _unchanged(before, kc, vc, *sc.values())
    with pytest.raises(TypeError, match="scale"):
        pyattn.scaled_dot_product_attention(q, kn, vn, scale=scale)
    with pytest.raises(TypeError, match="scale"):
        pyattn.varlen_attention(q[0, 0][:, None], kn[0, 0][:, None], vn[0, 0][:, None], [0, 1], [0, 1], scale=scale)


def test_numpy_scalar_scales_are_taken(rng):
    q, k, v = rn(rng, (1, 1, 3, 4)), rn(rng, (1, 1, 5, 4)), rn(rng, (1, 1, 5, 4))
    want = pyattn.scaled_dot_product_attention(q, k, v, scale=0.5)
    for s in (np.float32(0.5), np.float64(0.5), np.array(0.5), 1 / 2):
        np.testing.assert_array_equal(pyattn.scaled_dot_product_attention(q, k, v, scale=s), want)


def test_out_overlapping_the_query_or_the_cache_is_safe(rng):
    B, Hq, Hkv, Lq, E, L = 1, 8, 2, 16, 16, 128
    kc, vc = rn(rng, (B, Hkv, L, E)), rn(rng, (B, Hkv, 512, E))
    q = rn(rng, (B, Hq, Lq, E))
    want = pyattn.kvcache_attention(q.copy(), kc, vc[:, :, :L].copy(), np.array([40]))
    q2 = q.copy()
    got = pyattn.kvcache_attention(q2, kc, vc[:, :, :L], np.array([40]), out=q2[:, ::-1])
    np.testing.assert_array_equal(got, want)
    kcb = np.zeros((B, Hkv, 512, E), np.float32)
    kcb[:, :, :L] = kc
    vc_in = vc.copy()
    want = pyattn.kvcache_attention(q, kcb, vc_in, np.array([40]))
    out = vc_in[0].reshape(8, 128, E)[None, :, :Lq]  # value rows, some of them among the keys read
    got = pyattn.kvcache_attention(q, kcb, vc_in, np.array([40]), out=out)
    assert got is out
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_cache_keeps_a_nan_or_inf_row_as_nan(bad, rng):
    kc, vc, sc = _caches(np.int8)
    q = np.ones((1, 1, 1, 4), np.float32)
    kn = np.ones((1, 1, 1, 4), np.float32)
    vn = np.array([bad, 0.25, 0.5, 0.75], np.float32).reshape(1, 1, 1, 4)
    out = pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, **sc)
    assert np.isnan(out).all()
    assert np.isnan(sc["v_scale"][0, 0, 0]) and (vc[0, 0, 0] == 0).all()
    assert sc["k_scale"][0, 0, 0] == np.float32(1 / 127)  # the finite row as before


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("lq, group", [(1, 1), (1, 4), (2, 1), (8, 1), (9, 1), (40, 2)])  # decode rows, then tiles
def test_int8_key_scale_not_finite_is_the_dequantised_key(isa, softcap, paged, bad, lq, group, rng):
    """A key scale of +-inf or NaN stands for the key row k * scale, as the reference reads it:
    a zero element makes it NaN, so every query that sees the key gets NaN. The decode rows
    scaled q . k by it instead, and +-inf there hid the key, or (softcapped) took it with a
    finite score (Lq <= 8), where the prefill, which dequantises first, gave NaN."""
    hkv, E, held = 2, 4, 6
    kc = rng.integers(-127, 128, (1, hkv, 64, E)).astype(np.int8)
    kc[0, :, 2, 0] = 0  # a zero element in the key whose scale goes bad
    vc = rng.integers(-127, 128, (1, hkv, 64, E)).astype(np.int8)
    ks = np.full((1, hkv, 64), 0.02, np.float32)
    vs = np.full((1, hkv, 64), 0.01, np.float32)
    ks[0, :, 2] = bad
    q = rn(rng, (1, hkv * group, lq, E))
    caches, table = (kc, vc, ks, vs), {}
    if paged:  # blocks of 4 rows in reverse order: pool[15 - j] holds rows 4j..4j+3
        caches = tuple(np.ascontiguousarray(x.reshape(hkv, 16, 4, *x.shape[3:]).swapaxes(0, 1)[::-1]) for x in caches)
        table = dict(block_table=np.arange(15, -1, -1, dtype=np.int32)[None])
    out, lse = pyattn.kvcache_attention(
        q, caches[0], caches[1], np.array([held]), k_scale=caches[2], v_scale=caches[3], is_causal=False,
        return_lse=True, softcap=softcap, **table,
    )  # fmt: skip
    with np.errstate(invalid="ignore"):  # 0 * inf, and NaN in the reference's products
        k = (kc[:, :, :held].astype(np.float64) * ks[:, :, :held, None]).repeat(group, axis=1)
        v = (vc[:, :, :held].astype(np.float64) * vs[:, :, :held, None]).repeat(group, axis=1)
        want, want_lse = reference.scaled_dot_product_attention(q, k, v, return_lse=True, softcap=softcap)
    assert np.isnan(want).all() and np.isnan(out).all()
    assert np.isnan(want_lse).all() and np.isnan(lse).all()


@pytest.mark.parametrize("cdt", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("lq, group", [(2, 1), (3, 4), (9, 1), (20, 2)])  # decode rows, then prefill tiles
def test_a_nan_new_value_reaches_only_the_queries_that_see_it(isa, cdt, lq, group, rng):
    """A NaN in the last new token's value row: bottom-right causal, only the last query sees it; the
    others match a call without it (api.md, "NaN and inf"). An int8 cache keeps it as a NaN scale (the decode path took
    it into every row through the scales, 0 * NaN)."""
    dt = pytest.importorskip("ml_dtypes").bfloat16 if cdt == "bfloat16" else np.dtype(cdt)
    hkv, E, held = 2, 16, 5
    q = rn(rng, (1, hkv * group, lq, E))
    kn, vn = rn(rng, (1, hkv, lq, E)), rn(rng, (1, hkv, lq, E))
    kh = rn(rng, (1, hkv, held, E)).astype(dt) if cdt != "int8" else 1
    outs = []
    for bad in (False, True):
        kc, vc = np.zeros((1, hkv, 64, E), dt), np.zeros((1, hkv, 64, E), dt)
        kc[:, :, :held] = kh
        vc[:, :, :held] = 1
        sc = {}
        if cdt == "int8":
            sc = dict(k_scale=np.full((1, hkv, 64), 0.01, np.float32), v_scale=np.full((1, hkv, 64), 0.01, np.float32))
        v = vn.copy()
        if bad:
            v[0, :, lq - 1, 3] = np.nan
        outs.append(pyattn.kvcache_attention(q, kc, vc, np.array([held]), k_new=kn, v_new=v, **sc))
    clean, got = outs
    assert np.isnan(got[0, :, lq - 1]).any(axis=-1).all()  # the last query of every head sees it
    # (to rounding: a block with the NaN row sums each visible query's products one at a time)
    np.testing.assert_allclose(got[0, :, : lq - 1], clean[0, :, : lq - 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 1, 8, 4), (1, 1, 0, 4)])
def test_empty_contiguous_caches_are_taken(shape, rng):
    B = shape[0]
    kc, vc = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    out, lse = pyattn.kvcache_attention(
        rn(rng, (B, 2, 1, 4)), kc, vc, np.zeros(B, np.int64), window=(None, None), return_lse=True
    )
    assert out.shape == (B, 2, 1, 4) and not out.any() and (lse == -np.inf).all()
    out = pyattn.kvcache_attention(rn(rng, (B, 2, 1, 4)), kc, vc, np.zeros(B, np.int64))
    assert out.shape == (B, 2, 1, 4) and not out.any()


def test_three_dimensional_cache_raises_value_error(rng):
    with pytest.raises(ValueError, match="k_cache must be 4-D"):
        pyattn.kvcache_attention(rn(rng, (1, 1, 1, 4)), np.zeros((1, 8, 4), np.float32),
                                 np.zeros((1, 8, 4), np.float32), np.array([0]))  # fmt: skip


def test_kvcache_reset_of_no_rows(rng):
    cache = pyattn.KVCache(2, 1, 4, block_size=2)
    cache.attend(rn(rng, (2, 1, 1, 4)), rn(rng, (2, 1, 1, 4)), rn(rng, (2, 1, 1, 4)))
    for rows in ([], (), np.array([], np.int64)):
        cache.reset(rows)
        assert cache.lens.tolist() == [1, 1]
    with pytest.raises(ValueError, match="rows"):
        cache.reset([0.5])


@pytest.mark.parametrize("pair", ["scales", "caches", "scale_and_cache"])
def test_written_arrays_that_share_memory_are_refused(pair, rng):
    """Two arrays a call writes into over the same memory: one write would land on the other's
    (the C path declined, and the Python path then wrote the value scales over the key scales)."""
    kc, vc, sc = _caches(np.int8)
    if pair == "scales":
        sc["v_scale"] = sc["k_scale"]
    elif pair == "caches":
        vc = kc
    else:
        sc["k_scale"] = np.ndarray((1, 1, 8), np.float32, buffer=kc, strides=(32, 32, 4))  # kc's bytes
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc, sc["k_scale"], sc["v_scale"])
    with pytest.raises(ValueError, match="share memory"):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, **sc)
    assert _unchanged(before, kc, vc, sc["k_scale"], sc["v_scale"])


def test_block_table_inside_written_memory_is_read_as_given(rng):
    """A block table that lies in the value cache's memory: the call reads the ids as given (it
    read them after v_new was written over them: blocks out of range, a segfault)."""
    kc = rn(rng, (4, 1, 2, 4))
    vbuf = np.zeros((4, 1, 2, 4), np.float32)
    table = vbuf[2, 0, 1].view(np.int32)[None, :2]  # the ids lie in block 2, row 1: where the token goes
    table[...] = [[1, 2]]
    q, kn, vn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4)), np.full((1, 1, 1, 4), 1e30, np.float32)
    want = pyattn.kvcache_attention(q, kc.copy(), vbuf.copy(), np.array([3]), k_new=kn, v_new=vn,
                                    block_table=np.array([[1, 2]], np.int32))  # fmt: skip
    got = pyattn.kvcache_attention(q, kc, vbuf, np.array([3]), k_new=kn, v_new=vn, block_table=table)
    np.testing.assert_array_equal(got, want)


def test_new_rows_that_are_views_of_the_cache(rng):
    """v_new a view of the very k_cache slots being written: V gets v_new's values as they were
    (K was written first and V then read k_new's values)."""
    kc, vc = np.zeros((1, 1, 4, 2), np.float32), np.zeros((1, 1, 4, 2), np.float32)
    kn = np.full((1, 1, 1, 2), 7.0, np.float32)
    vn = kc[:, :, 1:2]  # slot 1, where the token goes: zeros before the call
    q = np.ones((1, 1, 1, 2), np.float32)
    pyattn.kvcache_attention(q, kc, vc, np.array([1]), k_new=kn, v_new=vn)
    assert kc[0, 0, 1].tolist() == [7.0, 7.0] and vc[0, 0, 1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("cdt,bad", [(np.float16, 7e4), (np.int8, 1e-45)])
def test_a_cast_that_raises_under_errstate_writes_nothing(cdt, bad, rng):
    kc, vc, sc = _caches(cdt)
    q, kn = rn(rng, (1, 1, 2, 4)), rn(rng, (1, 1, 2, 4))
    vn = np.full((1, 1, 2, 4), bad, np.float32)
    before = _snapshot(kc, vc, *sc.values())
    with np.errstate(all="raise"), pytest.raises(FloatingPointError):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=vn, window=(None, None), **sc)
    assert _unchanged(before, kc, vc, *sc.values())


def test_big_endian_float64_query_reads_a_float64_cache(rng):
    kc, vc = randn(rng, (1, 1, 8, 4)), randn(rng, (1, 1, 8, 4))
    q = randn(rng, (1, 2, 1, 4))
    want = pyattn.kvcache_attention(q, kc, vc, np.array([5]))
    got = pyattn.kvcache_attention(q.astype(">f8"), kc, vc, np.array([5]))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- threads

import copy  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402


@pytest.mark.parametrize("block_size", [None, 4])
def test_kvcache_shared_by_threads(block_size, rng):
    """Two threads appending to one KVCache each read the lengths, ran the kernel without the GIL
    and stored their own lengths + 1: tokens were lost (6,403 of 8,400); a reset during an attend
    freed blocks the kernel was reading (a crash). The cache's lock runs them one at a time."""
    B, H, D, steps = 2, 8, 128, 60  # a kernel long enough that the threads' calls overlap
    cache = pyattn.KVCache(B, H, D, block_size=block_size, max_len=None if block_size else 4 * steps)
    q, k = rn(rng, (B, H, 1, D)), rn(rng, (B, H, 1, D))
    errors = []
    start = threading.Barrier(3)

    def appender():
        start.wait()
        try:
            for _ in range(steps):
                cache.attend(q, k, k)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=appender) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    np.testing.assert_array_equal(cache.lens, [3 * steps] * B)
    # every token was written once, at its own position: the keys held are 3 * steps copies of k
    got = cache.attend(q, k, k, return_lse=True)[1]
    want = pyattn.reference.scaled_dot_product_attention(
        q, np.repeat(k, 3 * steps + 1, axis=2), np.repeat(k, 3 * steps + 1, axis=2), return_lse=True
    )[1]
    np.testing.assert_allclose(got, want, rtol=1e-5)

    if block_size:  # resets racing appends: no crash, and every row's blocks are its own
        stop = threading.Event()

        def resetter():
            while not stop.is_set():
                cache.reset([0])

        t = threading.Thread(target=resetter)
        t.start()
        try:
            for _ in range(40):
                cache.attend(q, k, k)
        finally:
            stop.set()
            t.join()
        held = cache.block_table[cache.block_table >= 0]
        assert len(np.unique(held)) == held.size


def test_kvcache_copies_and_pickles(rng):
    """The lock is per cache: a deep copy or a pickled cache gets its own and keeps the tokens."""
    cache = pyattn.KVCache(1, 1, 4, block_size=2)
    q, k = rn(rng, (1, 1, 3, 4)), rn(rng, (1, 1, 3, 4))
    cache.attend(q, k, k)
    q1, k1 = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    twins = [copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))]
    want = cache.attend(q1, k1, k1)
    for twin in twins:
        assert twin._lock is not cache._lock
        np.testing.assert_array_equal(twin.lens, [3])
        np.testing.assert_array_equal(twin.attend(q1, k1, k1), want)  # the same tokens, its own blocks
        np.testing.assert_array_equal(twin.lens, [4])


def test_kvcache_refuses_a_foreign_byte_order():
    """KVCache(dtype='>f4') was made, and every attend then failed on the byte order."""
    with pytest.raises(TypeError, match="byte order"):
        pyattn.KVCache(1, 1, 4, max_len=8, dtype=">f4")
    assert pyattn.KVCache(1, 1, 4, max_len=8, dtype="<f4").dtype == np.float32


_TABLE_RACE = r"""
import threading, time, numpy as np, pyattn
rng = np.random.default_rng(0)
B, H, D, bs, nblk = 1, 4, 32, 16, 256
kc = rng.standard_normal((nblk, H, bs, D), dtype=np.float32)
lens = np.array([nblk * bs], np.int64)
table = np.arange(nblk, dtype=np.int32)[None, :].copy()
kv_lens = np.array([nblk * bs], np.int64)
stop = threading.Event()

def writer():  # another thread rewrites the caller's table and lengths while the kernels run
    while not stop.is_set():
        table[0, 10:] = -(1 << 30)
        kv_lens[0] = 1 << 40
        time.sleep(0.0002)
        table[0, 10:] = np.arange(10, nblk, dtype=np.int32)
        kv_lens[0] = nblk * bs
        time.sleep(0.0002)

t = threading.Thread(target=writer)
t.start()
try:
    for i in range(150):
        for lq in (1, 48):  # the C path and the general one
            q = rng.standard_normal((B, H, lq, D), dtype=np.float32)
            try:
                pyattn.kvcache_attention(q, kc, kc, lens, block_table=table)
            except ValueError:
                pass  # the snapshot held a bad entry: refused
            k = kc[:B].reshape(B, H, bs, D)
            try:
                pyattn.scaled_dot_product_attention(q, k, k, kv_lens=kv_lens)
            except ValueError:
                pass
finally:
    stop.set()
    t.join()
print("ok")
"""


def test_inputs_changed_by_another_thread_mid_call():
    """The C path checked the caller's block table and then read it in place without the GIL, and
    the general path checked the caller's table (and kv_lens) but the kernel read a copy taken
    apart from the check: a table or lengths rewritten by another thread meanwhile made the
    kernel read out of bounds (a crash, 3 runs of 3). What is checked is now what is read."""
    r = subprocess.run([sys.executable, "-c", _TABLE_RACE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, f"exit {r.returncode}\n{r.stderr[-2000:]}"


def _pool(x, table, bs):
    """A contiguous cache (B, Hkv, L, ...) as a pool of blocks (B * L / bs, Hkv, bs, ...), block i of
    sequence b at table[b, i]."""
    B, hkv, L = x.shape[:3]
    nb = L // bs
    blocks = x.reshape(B, hkv, nb, bs, *x.shape[3:]).swapaxes(1, 2).reshape(B * nb, hkv, bs, *x.shape[3:])
    out = np.empty_like(blocks)
    out[table.reshape(-1)] = blocks
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("group", [1, 4])  # single decode rows, grouped rows
def test_int8_scales_are_read_through_their_strides(isa, paged, group, rng):
    """Scales that are a strided view (every third float of a wider array) give the same bits as
    contiguous copies of them, written and read: the decode reads a block's scales by stepping
    through a contiguous cache, and through the block table of a paged one."""
    B, hkv, E, L, bs = 2, 2, 24, 256, 16
    lens = np.array([150, 197])  # past several 64-key decode blocks, ending mid-block
    q = rn(rng, (B, hkv * group, 1, E))
    kn, vn = rn(rng, (B, hkv, 1, E)), rn(rng, (B, hkv, 1, E))
    shape, table = (B, hkv, L), None
    kc = rng.integers(-127, 128, (B, hkv, L, E)).astype(np.int8)
    vc = rng.integers(-127, 128, (B, hkv, L, E)).astype(np.int8)
    ks = rng.uniform(0.001, 0.02, shape).astype(np.float32)
    vs = rng.uniform(0.001, 0.02, shape).astype(np.float32)
    if paged:  # the same tokens in a pool of blocks, in shuffled order
        table = rng.permutation(B * (L // bs)).astype(np.int32).reshape(B, L // bs)
        kc, vc, ks, vs = (_pool(x, table, bs) for x in (kc, vc, ks, vs))
    outs, written = [], []
    for strided in (False, True):
        k, v = kc.copy(), vc.copy()
        sk, sv = ks.copy(), vs.copy()
        if strided:
            wide_k, wide_v = np.zeros((*sk.shape, 3), np.float32), np.zeros((*sv.shape, 3), np.float32)
            wide_k[..., 1], wide_v[..., 1] = sk, sv
            sk, sv = wide_k[..., 1], wide_v[..., 1]
            assert sk.strides[-1] == 12
        outs.append(
            pyattn.kvcache_attention(q, k, v, lens, k_new=kn, v_new=vn, k_scale=sk, v_scale=sv, block_table=table)
        )
        written.append((k, v, np.array(sk), np.array(sv)))
    np.testing.assert_array_equal(outs[1], outs[0])
    for a, b in zip(written[1], written[0]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(written[0][2], ks)  # the new tokens' scales were written


@pytest.mark.parametrize("cdt", ["float32", "float16", "int8"])
@pytest.mark.parametrize(
    "B, hkv, group, lens",
    [
        (2, 8, 4, [700, 431]),  # 16 groups: tasks of several heads of one sequence
        (4, 1, 4, [900, 333, 900, 64]),  # one head per sequence: a task's heads span sequences
        (3, 2, 1, [517, 517, 80]),  # single rows
    ],
    ids=["hkv8", "hkv1", "hkv2_single"],
)
def test_paged_decode_reads_several_heads_per_task(isa, cdt, B, hkv, group, lens, rng):
    """Through a block table the decode reads a block's heads together (a task takes several
    groups over the same keys; groups whose keys differ, as sequences of other lengths, are run
    one after the other). Results: the same bits as the contiguous cache, for 1, 2 and 3
    threads (the groups a task takes follow the thread count)."""
    E, L, bs = 32, 1024, 16
    q = rn(rng, (B, hkv * group, 1, E))
    lens = np.array(lens)
    if cdt == "int8":
        kc = rng.integers(-127, 128, (B, hkv, L, E)).astype(np.int8)
        vc = rng.integers(-127, 128, (B, hkv, L, E)).astype(np.int8)
        scales = [rng.uniform(0.001, 0.02, (B, hkv, L)).astype(np.float32) for _ in range(2)]
    else:
        kc, vc = rn(rng, (B, hkv, L, E)).astype(cdt), rn(rng, (B, hkv, L, E)).astype(cdt)
        scales = [None, None]
    table = rng.permutation(B * (L // bs)).astype(np.int32).reshape(B, L // bs)
    want = pyattn.kvcache_attention(q, kc, vc, lens, k_scale=scales[0], v_scale=scales[1])
    pk, pv = _pool(kc, table, bs), _pool(vc, table, bs)
    ps = [None if x is None else _pool(x, table, bs) for x in scales]
    before = pyattn.get_num_threads()
    try:
        for threads in (1, 2, 3):
            pyattn.set_num_threads(threads)
            got = pyattn.kvcache_attention(q, pk, pv, lens, block_table=table, k_scale=ps[0], v_scale=ps[1])
            np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads")
    finally:
        pyattn.set_num_threads(before)


@pytest.mark.parametrize("block_size", [None, 4])
def test_attend_without_new_tokens_keeps_lens(block_size, rng):
    """KVCache.attend(query, None, None) appends nothing: lens stay, and the query attends the
    tokens held (it once advanced lens by Lq, so that every later step attended unwritten slots:
    zeros, or a freed block's tokens of another sequence)."""
    B, H, D = 2, 2, 8
    cache = pyattn.KVCache(B, H, D, max_len=None if block_size else 32, block_size=block_size)
    k1, v1 = rn(rng, (B, H, 3, D)), rn(rng, (B, H, 3, D))
    cache.attend(rn(rng, (B, H, 3, D)), k1, v1)
    q = rn(rng, (B, H, 2, D))
    got = cache.attend(q, None, None)
    np.testing.assert_array_equal(cache.lens, [3, 3])
    want = pyattn.reference.scaled_dot_product_attention(q, k1, v1, is_causal=True, causal_align="bottom_right")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="new_lens needs k_new / v_new"):
        cache.attend(q, None, None, new_lens=[1, 1])
    with pytest.raises(ValueError, match="k_new and v_new go together"):
        cache.attend(q, k1[:, :, :2], None)
    np.testing.assert_array_equal(cache.lens, [3, 3])
    # the next step sees exactly the tokens written
    q2, k2, v2 = rn(rng, (B, H, 1, D)), rn(rng, (B, H, 1, D)), rn(rng, (B, H, 1, D))
    got = cache.attend(q2, k2, v2)
    K, V = np.concatenate([k1, k2], axis=2), np.concatenate([v1, v2], axis=2)
    want = pyattn.reference.scaled_dot_product_attention(q2, K, V, is_causal=True, causal_align="bottom_right")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("via", ["function", "cache"])
def test_out_with_a_zero_stride_is_written_once(via, rng):
    """An out that reaches an element twice through a zero stride goes through a temporary and
    is then assigned as NumPy assigns (the last batch row's result lands), as
    scaled_dot_product_attention's does. The kernel's threads once wrote its rows directly: the
    row that finished last won, here the long first sequence (its 4000 keys against 1)."""
    from numpy.lib.stride_tricks import as_strided

    B, H, E, L = 2, 1, 64, 4000
    q, kc, vc = rn(rng, (B, H, 1, E)), rn(rng, (B, H, L, E)), rn(rng, (B, H, L, E))
    lens = np.array([L, 1])
    full = pyattn.kvcache_attention(q, kc, vc, lens)
    assert not np.array_equal(full[0], full[1])

    def zero_stride_out():
        buf = np.zeros((H, 1, E), np.float32)
        return as_strided(buf, shape=(B, H, 1, E), strides=(0,) + buf.strides, writeable=True)

    before = pyattn.get_num_threads()
    try:
        pyattn.set_num_threads(2)
        for _ in range(5):
            out = zero_stride_out()
            if via == "function":
                pyattn.kvcache_attention(q, kc, vc, lens, out=out)
            else:
                cache = pyattn.KVCache(B, H, E, max_len=L)
                cache.attend(np.zeros((B, H, L, E), np.float32), kc, vc, new_lens=lens)
                cache.attend(q, None, None, out=out)
            np.testing.assert_array_equal(out[0], full[1])
    finally:
        pyattn.set_num_threads(before)


@pytest.mark.parametrize("paged", [False, True])
def test_read_only_call_takes_a_cache_with_a_strided_feature_axis(paged, rng):
    """Without k_new / v_new nothing is written, so a cache whose feature axis is strided (a
    Fortran-ordered array, K taken every other feature of a packed buffer) is read through a copy
    as scaled_dot_product_attention reads it; it was refused as if it were written. A call that
    writes still needs that axis contiguous."""
    B, Hkv, L, D = 2, 2, 16, 8
    q = rn(rng, (B, 2 * Hkv, 1, D))
    packed = rn(rng, (B, Hkv, L, 2 * D))
    k, v = packed[..., ::2], np.asfortranarray(rn(rng, (B, Hkv, L, D)))
    lens = np.array([16, 9])
    table = None
    if paged:  # the same tokens in blocks of 4, in reverse order
        nb = L // 4
        k = np.ascontiguousarray(k).reshape(B, Hkv, nb, 4, D).transpose(0, 2, 1, 3, 4).reshape(B * nb, Hkv, 4, D)
        v = np.ascontiguousarray(v).reshape(B, Hkv, nb, 4, D).transpose(0, 2, 1, 3, 4).reshape(B * nb, Hkv, 4, D)
        order = np.arange(B * nb)[::-1]
        k, v = np.asfortranarray(k[order]), np.asfortranarray(v[order])
        table = np.argsort(order).reshape(B, nb).astype(np.int32)
    assert k.strides[-1] != k.itemsize and v.strides[-1] != v.itemsize
    got = pyattn.kvcache_attention(q, k, v, lens, block_table=table, window=(5, 0))
    want = pyattn.kvcache_attention(
        q, np.ascontiguousarray(k), np.ascontiguousarray(v), lens, block_table=table, window=(5, 0)
    )
    np.testing.assert_array_equal(got, want)
    if not paged:
        ref = pyattn.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, is_causal=True, causal_align="bottom_right", kv_lens=lens, window=(5, 0)
        )
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    kn, vn = rn(rng, (B, Hkv, 1, D)), rn(rng, (B, Hkv, 1, D))
    with pytest.raises(ValueError, match="k_cache: its last axis must be contiguous where new tokens are written"):
        pyattn.kvcache_attention(q, k, v, lens - 1, k_new=kn, v_new=vn, block_table=table)


def test_degenerate_inputs_warn_nothing():
    """A row of an int8 write whose largest value is subnormal (its scale rounds to 0) and a
    paged pool of 0-token blocks once let NumPy warn (divide by zero, floor_divide)."""
    import warnings

    q = np.ones((1, 1, 1, 4), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in ({}, {"window": (None, None)}):  # the C path and the Python one
            kc, vc = np.zeros((1, 1, 4, 4), np.int8), np.zeros((1, 1, 4, 4), np.int8)
            ks, vs = np.zeros((1, 1, 4), np.float32), np.zeros((1, 1, 4), np.float32)
            kn = np.array([1e-45, 0, 0, 0], np.float32).reshape(1, 1, 1, 4)
            out = pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=kn, k_scale=ks, v_scale=vs, **kw)
            np.testing.assert_array_equal(kc[0, 0, 0] * ks[0, 0, 0], 0)  # reads back as 0
            np.testing.assert_array_equal(out, 0)
        pool = np.zeros((2, 1, 0, 3), np.float32)
        out = pyattn.kvcache_attention(q[..., :3], pool, pool, np.array([0]), block_table=np.zeros((1, 2), np.int32))
        np.testing.assert_array_equal(out, 0)


def test_int8_row_at_the_float32_maximum_reads_back_finite():
    """max|x| = FLT_MAX: max / 127 rounded up, and 127 scale read back as +-inf. The scale is now
    the float below it where 127 scale would overflow, in the core's quantiser (kvcache_attention's
    writes) and in the Python one alike (same bytes)."""
    from pyattn import _kvcache

    m = np.finfo(np.float32).max
    v = np.array([m, 1, -m, 0], np.float32).reshape(1, 1, 1, 4)
    kc, vc = np.zeros((1, 1, 4, 4), np.int8), np.zeros((1, 1, 4, 4), np.int8)
    ks, vs = np.zeros((1, 1, 4), np.float32), np.zeros((1, 1, 4), np.float32)
    q = np.zeros((1, 1, 1, 4), np.float32)
    out = pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=np.zeros_like(v), v_new=v, k_scale=ks, v_scale=vs)
    assert np.isfinite(out).all() and out[0, 0, 0, 0] > 0.99999 * m and out[0, 0, 0, 2] < -0.99999 * m
    qp, sp = _kvcache._quantize(v)
    np.testing.assert_array_equal(qp, vc[:, :, :1])
    np.testing.assert_array_equal(sp, vs[:, :, :1])
    assert np.isfinite(np.float32(127) * sp).all()


@pytest.mark.parametrize("which", ["k_cache", "v_cache", "k_scale"])
def test_self_overlapping_written_cache_is_refused_unchanged(which, rng):
    """A cache (or scales) reaching one element through two indices: the core's writes and
    NumPy's land in different orders, so the stored token and the output depended on the path.
    Refused before any write; read-only use of such a view stays allowed."""
    kc, vc = np.zeros((1, 2, 4, 4), np.int8), np.zeros((1, 2, 4, 4), np.int8)
    ks, vs = np.zeros((1, 2, 4), np.float32), np.zeros((1, 2, 4), np.float32)
    arrays = dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
    a = arrays[which]
    # head 1 row r is head 0 row r + 1
    arrays[which] = np.lib.stride_tricks.as_strided(a, a.shape, (a.strides[0], a.strides[2]) + a.strides[2:])
    before = _snapshot(kc, vc, ks, vs)
    q, kn, vn = rn(rng, (1, 2, 2, 4)), rn(rng, (1, 2, 2, 4)), rn(rng, (1, 2, 2, 4))
    c = arrays
    with pytest.raises(ValueError, match=rf"{which} may reach one element through two indices"):
        pyattn.kvcache_attention(
            q, c["k_cache"], c["v_cache"], np.array([0]), k_new=kn, v_new=vn, k_scale=c["k_scale"], v_scale=c["v_scale"]
        )
    assert _unchanged(before, kc, vc, ks, vs)
    pyattn.kvcache_attention(q, c["k_cache"], c["v_cache"], np.array([2]), k_scale=c["k_scale"], v_scale=c["v_scale"])


class _ArrayLike:  # np.asarray takes it; it is no ndarray
    def __init__(self, a):
        self.a = a

    def __array__(self, dtype=None, copy=None):
        return self.a


@pytest.mark.parametrize("kind", ["array_like", "torch", "readonly"])
@pytest.mark.parametrize("cdt", [np.float32, np.int8])
def test_a_read_only_call_reads_any_array_like_cache(kind, cdt, rng):
    """A call that writes nothing takes its caches (and int8 scales) as anything np.asarray takes,
    as every other array argument; the same call with the caches as ndarrays gives the same bits.
    A call that writes still needs the caller's ndarray (TypeError naming it)."""
    B, Hkv, L, D = 2, 2, 9, 8
    kc, vc = rn(rng, (B, Hkv, L, D)), rn(rng, (B, Hkv, L, D))
    sc = {}
    if np.dtype(cdt) == np.int8:
        kc, vc = (np.clip(np.round(a * 40), -127, 127).astype(np.int8) for a in (kc, vc))
        sc = {"k_scale": np.abs(rn(rng, (B, Hkv, L))) + 0.01, "v_scale": np.abs(rn(rng, (B, Hkv, L))) + 0.01}
    q, lens = rn(rng, (B, 2 * Hkv, 1, D)), np.array([9, 4])
    want = pyattn.kvcache_attention(q, kc, vc, lens, **sc)
    if kind == "array_like":
        conv = _ArrayLike
    elif kind == "torch":
        torch = pytest.importorskip("torch")
        conv = lambda a: torch.from_numpy(a.copy())  # noqa: E731
    else:

        def conv(a):
            a = a.copy()
            a.flags.writeable = False
            return a

    got = pyattn.kvcache_attention(q, conv(kc), conv(vc), lens, **{n: conv(s) for n, s in sc.items()})
    np.testing.assert_array_equal(got, want)
    if sc:  # one array-like scale, the other missing: the error names the missing one
        with pytest.raises(ValueError, match="v_scale must be"):
            pyattn.kvcache_attention(q, kc, vc, lens, k_scale=conv(sc["k_scale"]))
    if kind != "readonly":
        kn = rn(rng, (B, Hkv, 1, D))
        with pytest.raises(TypeError, match="k_cache must be a numpy.ndarray"):
            pyattn.kvcache_attention(q, conv(kc), conv(vc), np.array([3, 4]), k_new=kn, v_new=kn, **sc)


def test_a_written_int8_scale_must_be_an_ndarray(rng):
    """The scales of a written int8 cache are written in place, as the cache is: a torch tensor or
    another array-like is a TypeError naming it (it was a ValueError about dtype and shape), and
    nothing is written."""
    torch = pytest.importorskip("torch")
    kc, vc, sc = _caches(np.int8)
    q, kn = rn(rng, (1, 1, 1, 4)), rn(rng, (1, 1, 1, 4))
    before = _snapshot(kc, vc, *sc.values())
    for bad in ("k_scale", "v_scale"):
        args = dict(sc, **{bad: torch.from_numpy(sc[bad])})
        with pytest.raises(TypeError, match=f"{bad} must be a numpy.ndarray"):
            pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=kn, v_new=kn, **args)
        assert _unchanged(before, kc, vc, *sc.values())


def test_kvcache_takes_the_name_bfloat16():
    """KVCache(dtype="bfloat16") works in a fresh process, before anything imported ml_dtypes
    (NumPy knows the name only after that import), and says what it needs without ml_dtypes."""
    import sys

    from _helpers import run_python

    pytest.importorskip("ml_dtypes")
    code = (
        "import sys\n"
        "if sys.argv[1] == 'hide':\n"
        "    sys.modules['ml_dtypes'] = None\n"
        "import pyattn\n"
        "try:\n"
        "    print(pyattn.KVCache(1, 1, 8, max_len=4, dtype='bfloat16').dtype)\n"
        "except TypeError as e:\n"
        "    print('TypeError', e)\n"
    )
    got = {m: run_python(None, argv=[sys.executable, "-c", code, m], timeout=120)[1].strip() for m in ("plain", "hide")}
    assert got["plain"] == "bfloat16", got
    assert got["hide"].startswith("TypeError a bfloat16 cache needs ml_dtypes"), got
