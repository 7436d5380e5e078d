"""The oracle checked against plain per-row loops (so the oracle is not its own judge)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import bool_mask, randn

from pyattn import reference


def loop_attention(q, k, v, allowed=None, bias=None, scale=None):
    """One head, query row by query row, key by key. Returns (out, weights, lse)."""
    lq, e = q.shape
    lk, ev = v.shape
    scale = 1 / math.sqrt(e) if scale is None else scale
    out = np.zeros((lq, ev))
    w = np.zeros((lq, lk))
    lse = np.full(lq, -np.inf)
    for i in range(lq):
        s = []
        for j in range(lk):
            if allowed is not None and not allowed[i, j]:
                continue
            sij = sum(q[i, t] * k[j, t] for t in range(e)) * scale
            if bias is not None:
                sij += bias[i, j]
            if sij == -np.inf:
                continue
            s.append((j, sij))
        if not s:
            continue
        m = max(x for _, x in s)
        z = sum(math.exp(x - m) for _, x in s)
        lse[i] = m + math.log(z)
        for j, x in s:
            w[i, j] = math.exp(x - m) / z
            out[i] += w[i, j] * v[j]
    return out, w, lse


@pytest.mark.parametrize("lq,lk,e,ev", [(3, 4, 2, 3), (5, 5, 4, 4), (1, 7, 3, 1), (6, 2, 1, 2)])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
def test_sdpa_against_loops(lq, lk, e, ev, mask, causal):
    rng = np.random.default_rng(lq * 100 + lk * 10 + e)
    q, k, v = randn(rng, (lq, e)), randn(rng, (lk, e)), randn(rng, (lk, ev))
    allowed = np.ones((lq, lk), bool)
    bias = None
    m = None
    if mask == "bool":
        m = bool_mask(rng, (lq, lk), full_rows=True)
        allowed &= m
    elif mask == "float":
        ok = bool_mask(rng, (lq, lk), full_rows=True)
        m = np.where(ok, rng.uniform(-1, 1, (lq, lk)), -np.inf)
        bias = m
    if causal == "top_left":
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None]
    elif causal == "bottom_right":
        allowed &= np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq
    want = loop_attention(q, k, v, allowed, bias)
    got = reference.scaled_dot_product_attention(
        q,
        k,
        v,
        m,
        is_causal=causal is not None,
        causal_align=causal or "top_left",
        return_weights=True,
        return_lse=True,
    )
    for g, w in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)


def test_reference_gqa_is_repeat_interleave():
    rng = np.random.default_rng(0)
    q, k, v = randn(rng, (2, 6, 4, 3)), randn(rng, (2, 2, 5, 3)), randn(rng, (2, 2, 5, 2))
    got = reference.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for b in range(2):
        for h in range(6):
            want, _, _ = loop_attention(q[b, h], k[b, h // 3], v[b, h // 3])
            np.testing.assert_allclose(got[b, h], want, rtol=1e-12, atol=1e-13)


def test_reference_empty():
    z = reference.scaled_dot_product_attention(
        np.ones((3, 4)), np.ones((0, 4)), np.ones((0, 2)), return_weights=True, return_lse=True
    )
    assert z[0].shape == (3, 2) and np.all(z[0] == 0)
    assert z[1].shape == (3, 0) and np.all(np.isneginf(z[2]))
    e = reference.scaled_dot_product_attention(np.ones((0, 4)), np.ones((5, 4)), np.ones((5, 2)))
    assert e.shape == (0, 2)


def test_reference_softmax_fully_masked_and_axis():
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = np.array([[True, True, True], [False, False, False]])
    s = reference.softmax(x, mask=m)
    np.testing.assert_allclose(s[0], np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum())
    assert np.all(s[1] == 0.0)
    s0 = reference.softmax(x, axis=0, scale=2.0)
    np.testing.assert_allclose(s0[:, 0], np.exp([2, 8]) / np.exp([2, 8]).sum())


def test_reference_mha_against_loops():
    rng = np.random.default_rng(1)
    b, l, e, h = 2, 4, 6, 3
    d = e // h
    x = randn(rng, (b, l, e))
    wq, wk, wv, wo = (randn(rng, (e, e)) for _ in range(4))
    bq, bk, bv, bo = (randn(rng, (e,)) for _ in range(4))
    kpm = np.array([[False, False, True, False], [False, False, False, False]])
    out, w = reference.multi_head_attention(
        x, x, x, h, wq, wk, wv, wo, bq, bk, bv, bo, key_padding_mask=kpm, need_weights=True, average_attn_weights=False
    )
    for bi in range(b):
        heads = []
        for hi in range(h):
            cols = slice(hi * d, (hi + 1) * d)
            Q = x[bi] @ wq[:, cols] + bq[cols]
            K = x[bi] @ wk[:, cols] + bk[cols]
            V = x[bi] @ wv[:, cols] + bv[cols]
            allowed = np.broadcast_to(~kpm[bi], (l, l))
            o, ww, _ = loop_attention(Q, K, V, allowed)
            np.testing.assert_allclose(w[bi, hi], ww, rtol=1e-12, atol=1e-13)
            heads.append(o)
        want = np.concatenate(heads, axis=-1) @ wo + bo
        np.testing.assert_allclose(out[bi], want, rtol=1e-12, atol=1e-12)


def test_reference_mha_torch_3d_mask_layout():
    """A (B*H, Lq, Lk) mask: entry b*H + h belongs to batch b, head h (torch's layout)."""
    rng = np.random.default_rng(2)
    b, l, e, h = 2, 3, 4, 2
    x = randn(rng, (b, l, e))
    ws = [randn(rng, (e, e)) for _ in range(4)]
    m3 = bool_mask(rng, (b * h, l, l))
    m3[..., 0] = True
    o3, w3 = reference.multi_head_attention(
        x, x, x, h, *ws, attn_mask=m3, need_weights=True, average_attn_weights=False
    )
    o4, w4 = reference.multi_head_attention(
        x, x, x, h, *ws, attn_mask=m3.reshape(b, h, l, l), need_weights=True, average_attn_weights=False
    )
    np.testing.assert_array_equal(o3, o4)
    assert np.all(w3[~m3.reshape(b, h, l, l)] == 0.0)


def test_reference_additive_single():
    q = np.array([[1.0, 0.0]])
    keys = np.array([[1.0, 0.0], [0.0, 1.0]])
    wq = np.eye(2)
    wk = np.eye(2)
    v = np.array([1.0, -1.0])
    out, w = reference.additive_attention(q, keys, wq, wk, v, return_weights=True)
    e = np.array([np.tanh(2.0) - np.tanh(0.0), np.tanh(1.0) - np.tanh(1.0)])
    p = np.exp(e) / np.exp(e).sum()
    np.testing.assert_allclose(w[0], p)
    np.testing.assert_allclose(out[0], p @ keys)


def test_reference_value_adds_leading_axes():
    """Where value's leading axes add to those of q and k, the lse, the weights and the per-head
    and per-batch keywords take the output's leading axes, in the oracle as in pyattn."""
    import pyattn

    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, 3, 4, 8))
    k = rng.standard_normal((2, 1, 1, 9, 8))
    v = rng.standard_normal((2, 2, 3, 9, 8))  # (B2, X2, H3)
    kw = dict(
        return_weights=True,
        return_lse=True,
        is_causal=True,
        causal_align="bottom_right",
        kv_lens=np.array([[7, 9], [0, 5]]),  # (B, X): the output's axes before the heads
        alibi_slopes=rng.uniform(0.1, 1.0, (2, 2, 3)),
        sinks=rng.standard_normal(3),
    )
    got = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    want = reference.scaled_dot_product_attention(q, k, v, **kw)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    # each (b, x) slice is the call on that slice alone
    lse = want[2]
    for b in range(2):
        for x in range(2):
            one = reference.scaled_dot_product_attention(
                q[b, 0],
                k[b, 0],
                v[b, x],
                return_lse=True,
                is_causal=True,
                causal_align="bottom_right",
                kv_lens=np.array(kw["kv_lens"][b, x]),
                alibi_slopes=kw["alibi_slopes"][b, x],
                sinks=kw["sinks"],
            )[1]
            np.testing.assert_allclose(lse[b, x], one, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_reference_bool_mask_replaces_a_hidden_score(bad):
    """A non-finite key hidden by a bool attn_mask does not reach the output: its score is
    replaced by -inf, not added to (NaN + -inf is NaN), in the oracle as in pyattn. The same for
    softmax's bool mask."""
    import pyattn

    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [bad, 0.0]])
    v = np.array([[1.0], [2.0], [3.0]])
    m = np.array([True, True, False])
    w = np.exp([1 / np.sqrt(2), 0.0])
    want = (w @ v[:2]) / w.sum()
    np.testing.assert_allclose(reference.scaled_dot_product_attention(q, k, v, m)[0], want, rtol=1e-15)
    np.testing.assert_allclose(pyattn.scaled_dot_product_attention(q, k, v, m)[0], want, rtol=1e-15)
    x = np.array([1.0, bad, 2.0])
    keep = np.array([True, False, True])
    want = np.array([1.0, 0.0, np.e]) / (1.0 + np.e)
    np.testing.assert_allclose(reference.softmax(x, mask=keep), want, rtol=1e-15)
    np.testing.assert_allclose(pyattn.softmax(x, mask=keep), want, rtol=1e-15)
    # a float mask is added: -inf added to NaN stays NaN, in both
    fm = np.where(m, 0.0, -np.inf)
    if np.isnan(bad):
        assert np.isnan(reference.scaled_dot_product_attention(q, k, v, fm)).all()
        assert np.isnan(pyattn.scaled_dot_product_attention(q, k, v, fm)).all()


def test_reference_mask_may_not_add_leading_axes():
    """A mask broadcasts to the scores of q, k and v; leading axes of its own are refused, by the
    oracle as by pyattn (it returned an output with the mask's batch)."""
    import pyattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, n, 4)) for n in (3, 5, 5))
    m = rng.standard_normal((4, 1, 3, 5))
    for f in (reference.scaled_dot_product_attention, pyattn.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="broadcastable"):
            f(q, k, v, m)
    with pytest.raises(ValueError, match="broadcastable"):
        reference.softmax(np.ones((2, 3)), mask=np.ones((4, 2, 3), bool))
    # a value with more batch than q and k makes room for it
    vb = rng.standard_normal((4, 2, 5, 4))
    want = reference.scaled_dot_product_attention(q, k, vb, m)
    np.testing.assert_allclose(pyattn.scaled_dot_product_attention(q, k, vb, m), want, rtol=1e-12)


def test_reference_additive_mask_may_add_leading_axes():
    """additive_attention's mask may add leading axes to the output, in pyattn as in the oracle."""
    import pyattn

    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    wq, wk, v = rng.standard_normal((4, 6)), rng.standard_normal((4, 6)), rng.standard_normal(6)
    m = rng.standard_normal((2, 3, 5)) > 0
    m[..., 0] = True  # no fully masked row
    want = reference.additive_attention(q, k, wq, wk, v, mask=m)
    assert want.shape == (2, 3, 4)
    np.testing.assert_allclose(pyattn.additive_attention(q, k, wq, wk, v, mask=m), want, rtol=1e-12, atol=1e-12)
