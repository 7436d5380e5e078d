"""Property-based tests (hypothesis): invariants that hold for any input, on every kernel set
(the ``isa`` fixture; the hypothesis profiles allow a function-scoped fixture)."""

from __future__ import annotations

import threading

import numpy as np
from _helpers import assert_close, randn
from hypothesis import given
from hypothesis import strategies as st

import pyattn
from pyattn import reference

sdpa = pyattn.scaled_dot_product_attention

dtypes = st.sampled_from([np.float32, np.float64])
seeds = st.integers(0, 2**32 - 1)


@st.composite
def problems(draw, max_l=70, max_e=40, causal=True, gqa=True):
    """A random attention problem: shapes, dtype, data, mask, causality, GQA."""
    dtype = draw(dtypes)
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 2, 4])) if gqa else 1
    lq = draw(st.integers(1, max_l))
    lk = draw(st.integers(1, max_l))
    e = draw(st.integers(1, max_e))
    ev = draw(st.integers(1, max_e))
    rng = np.random.default_rng(draw(seeds))
    q = randn(rng, (b, hkv * g, lq, e), dtype)
    k = randn(rng, (b, hkv, lk, e), dtype)
    v = randn(rng, (b, hkv, lk, ev), dtype)
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    mask = None
    if mask_kind is not None:
        p = draw(st.sampled_from([0.1, 0.5, 0.9]))
        allowed = rng.random((b, 1, lq, lk)) < p
        mask = (
            allowed
            if mask_kind == "bool"
            else np.where(allowed, rng.uniform(-1, 1, allowed.shape), -np.inf).astype(dtype)
        )
    kw = dict(enable_gqa=g > 1)
    if causal and draw(st.booleans()):
        kw.update(is_causal=True, causal_align=draw(st.sampled_from(["top_left", "bottom_right"])))
    return q, k, v, mask, kw


def allowed_of(mask, kw, shape):
    """Bool array (broadcast to `shape` = (..., Lq, Lk)): True where a key may be attended."""
    lq, lk = shape[-2], shape[-1]
    allowed = np.ones(shape, bool)
    if mask is not None:
        allowed &= mask if mask.dtype == bool else np.isfinite(mask)
    if kw.get("is_causal"):
        allowed &= reference.causal_mask(lq, lk, kw.get("causal_align", "top_left"))
    return allowed


@given(problems())
def test_weight_rows_sum_to_one(isa, prob):
    q, k, v, mask, kw = prob
    out, w = sdpa(q, k, v, mask, return_weights=True, **kw)
    allowed = allowed_of(mask, kw, w.shape)
    live = allowed.any(axis=-1)
    sums = w.astype(np.float64).sum(axis=-1)
    tol = 1e-5 if w.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(sums[live], 1.0, rtol=0, atol=tol * 4)
    assert np.all(sums[~live] == 0.0)
    assert np.all(w >= 0.0)


@given(problems())
def test_masked_keys_get_exactly_zero_weight(isa, prob):
    q, k, v, mask, kw = prob
    out, w, lse = sdpa(q, k, v, mask, return_weights=True, return_lse=True, **kw)
    allowed = allowed_of(mask, kw, w.shape)
    assert np.all(w[~allowed] == 0.0)
    dead = ~allowed.any(axis=-1)
    assert np.all(out[dead] == 0.0)
    assert np.all(np.isneginf(lse[dead]))
    assert np.isfinite(lse[~dead]).all()
    assert not np.isnan(out).any()


@given(problems())
def test_matches_reference(isa, prob):
    q, k, v, mask, kw = prob
    got = sdpa(q, k, v, mask, return_weights=True, return_lse=True, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, mask, return_weights=True, return_lse=True, **kw)
    for name, g, w in zip(["output", "weights", "lse"], got, want):
        assert_close(g, w, q.dtype, what=name)


@given(problems(causal=False))
def test_output_is_convex_combination_of_values(isa, prob):
    q, k, v, mask, kw = prob
    out = sdpa(q, k, v, mask, **kw).astype(np.float64)
    g = q.shape[-3] // k.shape[-3]
    vv = np.repeat(v, g, axis=-3).astype(np.float64)[..., None, :, :]  # (..., 1, Lk, Ev)
    allowed = allowed_of(mask, kw, out.shape[:-1] + (v.shape[-2],))[..., None]  # (..., Lq, Lk, 1)
    lo = np.where(allowed, vv, np.inf).min(axis=-2)
    hi = np.where(allowed, vv, -np.inf).max(axis=-2)
    live = allowed[..., 0].any(axis=-1)
    slack = 1e-5 if q.dtype == np.float32 else 1e-12
    scale = np.abs(v).max() * slack + slack
    assert np.all(out[live] >= lo[live] - scale)
    assert np.all(out[live] <= hi[live] + scale)


@given(st.integers(1, 60), st.integers(1, 32), st.integers(1, 32), dtypes, seeds, st.data())
def test_self_attention_is_permutation_equivariant(isa, n, e, ev, dtype, seed, data):
    """Without positions, permuting the tokens permutes the outputs (no causal, no mask)."""
    rng = np.random.default_rng(seed)
    x = randn(rng, (n, e), dtype)
    v = randn(rng, (n, ev), dtype)
    perm = np.array(data.draw(st.permutations(range(n))))
    out = sdpa(x, x, v)
    out_p = sdpa(x[perm], x[perm], v[perm])
    assert_close(out_p, out[perm], dtype, tol=4e-5 if dtype == np.float32 else 1e-12)
    # permuting keys and values alone leaves the output unchanged
    out_kv = sdpa(x, x[perm], v[perm])
    assert_close(out_kv, out, dtype, tol=4e-5 if dtype == np.float32 else 1e-12)


@given(st.integers(1, 40), st.integers(1, 24), dtypes, seeds)
def test_mha_permutation_equivariant(isa, n, seq_e, dtype, seed):
    rng = np.random.default_rng(seed)
    e, h = 4 * max(1, seq_e // 4), 4
    x = randn(rng, (1, n, e), dtype)
    m = pyattn.MultiHeadAttention(e, h, dtype=dtype, rng=rng)
    perm = rng.permutation(n)
    out, _ = m(x)
    out_p, _ = m(x[:, perm])
    assert_close(out_p, out[:, perm], dtype, tol=4e-5 if dtype == np.float32 else 1e-12)


@given(problems(max_l=200, max_e=64))
def test_one_and_two_threads_agree(isa, prob):
    q, k, v, mask, kw = prob
    with pyattn.num_threads(1):
        one = sdpa(q, k, v, mask, return_lse=True, **kw)
    with pyattn.num_threads(2):
        two = sdpa(q, k, v, mask, return_lse=True, **kw)
    tol = 1e-6 if q.dtype == np.float32 else 1e-13
    for a, b in zip(one, two):
        assert_close(a, b.astype(np.float64), tol=tol)


@given(st.integers(1, 16), st.integers(100, 3000), st.sampled_from([(8, 1), (8, 2), (4, 4)]), dtypes, seeds)
def test_decode_threads_agree(isa, lq, lk, heads, dtype, seed):
    """Decode shapes (few queries, long cache): split-K across threads must merge exactly."""
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    q = randn(rng, (1, hq, lq, 32), dtype)
    k = randn(rng, (1, hkv, lk, 32), dtype)
    v = randn(rng, (1, hkv, lk, 32), dtype)
    kw = dict(enable_gqa=hq != hkv, is_causal=True, causal_align="bottom_right")
    with pyattn.num_threads(1):
        one = sdpa(q, k, v, **kw)
    with pyattn.num_threads(2):
        two = sdpa(q, k, v, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, **kw)
    assert_close(one, want, dtype)
    assert_close(two, want, dtype)


@given(st.integers(1, 80), st.integers(1, 80), st.integers(1, 80), dtypes, seeds)
def test_matmul_threads_agree(isa, m, k, n, dtype, seed):
    rng = np.random.default_rng(seed)
    a, b = randn(rng, (2, m, k), dtype), randn(rng, (k, n), dtype)
    with pyattn.num_threads(1):
        one = pyattn.matmul(a, b)
    with pyattn.num_threads(2):
        two = pyattn.matmul(a, b)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert_close(one, want, dtype)
    assert_close(two, want, dtype)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), dtypes, seeds, st.data())
def test_softmax_properties(isa, shape, dtype, seed, data):
    rng = np.random.default_rng(seed)
    x = randn(rng, tuple(shape), dtype, scale=5.0)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    p = pyattn.softmax(x, axis=axis)
    assert p.dtype == dtype and p.shape == x.shape
    assert np.all(p >= 0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(p.astype(np.float64).sum(axis=axis), 1.0, atol=4 * tol)
    # shift invariance: softmax(x + c) == softmax(x)
    assert_close(pyattn.softmax(x + dtype(3.0), axis=axis), p.astype(np.float64), tol=4 * tol)
    assert_close(p, reference.softmax(x, axis=axis), dtype)


@given(problems(max_l=40, max_e=16, gqa=False))
def test_lse_consistent_with_weights(isa, prob):
    """weights == exp(scaled masked scores - lse) on the allowed keys."""
    q, k, v, mask, kw = prob
    out, w, lse = sdpa(q, k, v, mask, return_weights=True, return_lse=True, **kw)
    scores = reference.matmul(q, np.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + reference._additive(mask)
    allowed = allowed_of(mask, kw, w.shape)
    lse64 = lse.astype(np.float64)[..., None]
    with np.errstate(invalid="ignore"):
        recon = np.where(allowed, np.exp(scores - lse64), 0.0)
    tol = 1e-5 if q.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(w, recon, rtol=0, atol=20 * tol)


def test_concurrent_python_threads(isa):
    """Calls from several Python threads are safe and give the same results."""
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(8):
        q = randn(rng, (2, 4, 33 + i, 16), np.float32)
        k = randn(rng, (2, 4, 70, 16), np.float32)
        v = randn(rng, (2, 4, 70, 16), np.float32)
        jobs.append((q, k, v))
    expected = [sdpa(*job, is_causal=True, causal_align="bottom_right") for job in jobs]
    results = [None] * (len(jobs) * 3)
    errors = []

    def work(idx):
        try:
            for _ in range(3):
                j = idx % len(jobs)
                results[idx] = sdpa(*jobs[j], is_causal=True, causal_align="bottom_right")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, expected[i % len(jobs)])


def test_concurrent_threads_with_thread_setting(isa):
    """num_threads in one Python thread while another computes: results stay right."""
    rng = np.random.default_rng(1)
    q = randn(rng, (1, 8, 64, 32), np.float64)
    k = randn(rng, (1, 8, 300, 32), np.float64)
    v = randn(rng, (1, 8, 300, 32), np.float64)
    want = reference.scaled_dot_product_attention(q, k, v)
    out = [None, None]
    errors = []

    def a():
        try:
            with pyattn.num_threads(1):
                out[0] = sdpa(q, k, v)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    def b():
        try:
            out[1] = sdpa(q, k, v)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    old = pyattn.get_num_threads()
    ts = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert pyattn.get_num_threads() == old
    for r in out:
        assert_close(r, want, np.float64)
