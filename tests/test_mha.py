"""multi_head_attention and MultiHeadAttention: parity with the reference, per SIMD path."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import (
    DTYPES,
    assert_close,
    bool_mask,
    make_mask,
    make_state_dict,
    randn,
    relayout,
    weights_from_state_dict,
)

import pyattn
from pyattn import reference

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])


def make_weights(rng, e_q, h, d, e_k=None, e_v=None, hkv=None, e_out=None, bias=True, dtype=np.float64):
    e_k = e_q if e_k is None else e_k
    e_v = e_q if e_v is None else e_v
    hkv = h if hkv is None else hkv
    e_out = e_q if e_out is None else e_out
    w = dict(
        w_q=randn(rng, (e_q, h * d), dtype, e_q**-0.5),
        w_k=randn(rng, (e_k, hkv * d), dtype, e_k**-0.5),
        w_v=randn(rng, (e_v, hkv * d), dtype, e_v**-0.5),
        w_o=randn(rng, (h * d, e_out), dtype, (h * d) ** -0.5),
    )
    if bias:
        w.update(
            b_q=randn(rng, (h * d,), dtype, 0.5),
            b_k=randn(rng, (hkv * d,), dtype, 0.5),
            b_v=randn(rng, (hkv * d,), dtype, 0.5),
            b_o=randn(rng, (e_out,), dtype, 0.5),
        )
    return w


def assert_matches_reference(got, gw, args, dtype, **kw):
    """pyattn's (output, weights) against reference.multi_head_attention(*args, **kw)."""
    want, ww = reference.multi_head_attention(*args, **kw)
    assert_close(got, want, dtype, what="output")
    if kw.get("need_weights"):
        assert_close(gw, ww, dtype, what="weights")
    else:
        assert gw is None


def mha_check(q, k, v, h, w, dtype, **kw):
    args = (q, k, v, h, w["w_q"], w["w_k"], w["w_v"], w["w_o"], w.get("b_q"), w.get("b_k"), w.get("b_v"), w.get("b_o"))
    got, gw = pyattn.multi_head_attention(*args, **kw)
    assert_matches_reference(got, gw, args, dtype, **kw)
    return got, gw


# --------------------------------------------------------------------------- functional


@dtype_param
@pytest.mark.parametrize(
    "b,l,e,h",
    [(2, 9, 16, 4), (1, 1, 8, 2), (3, 33, 24, 3), (2, 65, 64, 8), (1, 128, 32, 1), (2, 17, 12, 12), (1, 257, 48, 4)],
)
@pytest.mark.parametrize("bias", [True, False])
def test_self_attention(isa, dtype, b, l, e, h, bias, rng):
    x = randn(rng, (b, l, e), dtype)
    w = make_weights(rng, e, h, e // h, bias=bias, dtype=dtype)
    mha_check(x, x, x, h, w, dtype)
    mha_check(x, x, x, h, w, dtype, need_weights=True)
    mha_check(x, x, x, h, w, dtype, need_weights=True, average_attn_weights=False)
    mha_check(x, x, x, h, w, dtype, is_causal=True, need_weights=True)


@dtype_param
def test_unbatched(isa, dtype, rng):
    x = randn(rng, (11, 16), dtype)
    w = make_weights(rng, 16, 4, 4, dtype=dtype)
    out, wts = mha_check(x, x, x, 4, w, dtype, need_weights=True)
    assert out.shape == (11, 16) and wts.shape == (11, 11)
    out, wts = mha_check(x, x, x, 4, w, dtype, need_weights=True, average_attn_weights=False)
    assert wts.shape == (4, 11, 11)
    mask = make_mask(rng, "bool", (11, 11))
    mha_check(x, x, x, 4, w, dtype, attn_mask=mask, key_padding_mask=np.arange(11) >= 9)
    # unbatched equals batch of one
    bo, bw = pyattn.multi_head_attention(
        x[None],
        x[None],
        x[None],
        4,
        w["w_q"],
        w["w_k"],
        w["w_v"],
        w["w_o"],
        w["b_q"],
        w["b_k"],
        w["b_v"],
        w["b_o"],
        need_weights=True,
    )
    uo, uw = pyattn.multi_head_attention(
        x, x, x, 4, w["w_q"], w["w_k"], w["w_v"], w["w_o"], w["b_q"], w["b_k"], w["b_v"], w["b_o"], need_weights=True
    )
    assert_close(uo, bo[0], dtype)
    assert_close(uw, bw[0], dtype)


@dtype_param
@pytest.mark.parametrize(
    "lq,lk,eq,ek,ev,h,d",
    [(5, 11, 12, 7, 9, 3, 4), (1, 300, 16, 16, 16, 4, 4), (33, 2, 8, 20, 6, 2, 8), (17, 17, 10, 10, 10, 5, 3)],
)
def test_cross_attention(isa, dtype, lq, lk, eq, ek, ev, h, d, rng):
    q = randn(rng, (2, lq, eq), dtype)
    k = randn(rng, (2, lk, ek), dtype)
    v = randn(rng, (2, lk, ev), dtype)
    w = make_weights(rng, eq, h, d, e_k=ek, e_v=ev, dtype=dtype)
    mha_check(q, k, v, h, w, dtype, need_weights=True)
    mha_check(q, k, v, h, w, dtype, is_causal=True, causal_align="bottom_right")
    mha_check(q, k, v, h, w, dtype, key_padding_mask=bool_mask(rng, (2, lk), p=0.3))


@dtype_param
def test_output_width_differs(isa, dtype, rng):
    """w_o may map H*D to a width other than E_q."""
    x = randn(rng, (2, 7, 12), dtype)
    w = make_weights(rng, 12, 3, 5, e_out=9, dtype=dtype)
    out, _ = mha_check(x, x, x, 3, w, dtype)
    assert out.shape == (2, 7, 9)


@dtype_param
@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 1), (8, 2), (6, 3), (4, 4)])
def test_gqa_heads(isa, dtype, h, hkv, rng):
    x = randn(rng, (2, 13, 24), dtype)
    w = make_weights(rng, 24, h, 4, hkv=hkv, dtype=dtype)
    mha_check(x, x, x, h, w, dtype, num_kv_heads=hkv, need_weights=True, average_attn_weights=False)
    mha_check(x, x, x, h, w, dtype, num_kv_heads=hkv, is_causal=True)


MASKS = {
    "2d_bool": lambda b, h, lq, lk: (lq, lk),
    "3d_torch": lambda b, h, lq, lk: (b * h, lq, lk),
    "4d": lambda b, h, lq, lk: (b, h, lq, lk),
    "4d_heads_broadcast": lambda b, h, lq, lk: (b, 1, lq, lk),
}


@dtype_param
@pytest.mark.parametrize("shape", list(MASKS))
@pytest.mark.parametrize("kind", ["bool", "float", "bool_full_rows"])
@pytest.mark.parametrize("padding", [False, True])
def test_masks(isa, dtype, shape, kind, padding, rng):
    b, h, lq, lk = 2, 3, 7, 10
    q = randn(rng, (b, lq, 12), dtype)
    kv = randn(rng, (b, lk, 12), dtype)
    w = make_weights(rng, 12, h, 4, dtype=dtype)
    mask = make_mask(rng, kind, MASKS[shape](b, h, lq, lk), dtype)
    kpm = None
    if padding:
        kpm = np.zeros((b, lk), bool)
        kpm[0, 6:] = True
        kpm[1, :] = True  # batch 1 entirely padding: its rows are zeros, output = b_o
    out, _ = mha_check(q, kv, kv, h, w, dtype, attn_mask=mask, key_padding_mask=kpm, need_weights=True)
    if padding:
        assert_close(out[1], np.broadcast_to(w["b_o"], (lq, 12)), dtype)
    assert not np.isnan(out).any()


@dtype_param
@pytest.mark.parametrize("how", ["seq_first", "fortran", "byteswapped", "row_slice"])
def test_noncontiguous_inputs(isa, dtype, how, rng):
    b, lq, lk, e, h = 3, 7, 9, 16, 4
    w = make_weights(rng, e, h, 4, dtype=dtype)
    q = randn(rng, (b, lq, e), dtype)
    kv = randn(rng, (b, lk, e), dtype)
    if how == "seq_first":  # torch's batch_first=False buffers, viewed batch first
        q2 = np.ascontiguousarray(q.swapaxes(0, 1)).swapaxes(0, 1)
        kv2 = np.ascontiguousarray(kv.swapaxes(0, 1)).swapaxes(0, 1)
    else:
        q2, kv2 = relayout(q, how), relayout(kv, how)
    w2 = {name: (None if a is None else (np.asfortranarray(a) if a.ndim == 2 else a)) for name, a in w.items()}
    args = (h, w2["w_q"], w2["w_k"], w2["w_v"], w2["w_o"], w2["b_q"], w2["b_k"], w2["b_v"], w2["b_o"])
    got, gw = pyattn.multi_head_attention(q2, kv2, kv2, *args, need_weights=True)
    want, ww = reference.multi_head_attention(q, kv, kv, *args, need_weights=True)
    assert_close(got, want, dtype)
    assert_close(gw, ww, dtype)


@dtype_param
def test_float_key_padding_mask(isa, dtype, rng):
    q = randn(rng, (2, 5, 8), dtype)
    w = make_weights(rng, 8, 2, 4, dtype=dtype)
    kpm = np.where(bool_mask(rng, (2, 5)), 0.0, -np.inf).astype(dtype)
    mha_check(q, q, q, 2, w, dtype, key_padding_mask=kpm, need_weights=True)


@dtype_param
@pytest.mark.parametrize("masks", ["attn_bool", "padding_bool", "both_bool", "bool_and_float_padding"])
def test_nan_key_hidden_by_masks(isa, dtype, masks, rng):
    """A NaN key token that the masks hide: bool masks (alone or together) replace its score, so
    every output stays finite, in pyattn and the reference alike; once a float mask joins, the
    masks are added and the NaN score spreads over its rows in both."""
    b, h, lq, lk, e = 2, 2, 5, 7, 8
    q = randn(rng, (b, lq, e), dtype)
    k = randn(rng, (b, lk, e), dtype)
    v = randn(rng, (b, lk, e), dtype)
    k[:, 3] = np.nan  # value finite: only its score can carry the NaN
    w = make_weights(rng, e, h, 4, dtype=dtype)
    hide = np.zeros((b, lk), bool)
    hide[:, 3] = True
    attn = np.broadcast_to(~hide[:, None, None, :], (b, h, lq, lk)).copy()
    attn[0, 1, 2, 0] = False  # more than the NaN token hidden
    kw = {
        "attn_bool": dict(attn_mask=attn),
        "padding_bool": dict(key_padding_mask=hide),
        "both_bool": dict(attn_mask=attn, key_padding_mask=hide),
        "bool_and_float_padding": dict(attn_mask=attn, key_padding_mask=np.where(hide, -np.inf, 0.0).astype(dtype)),
    }[masks]
    out, weights = mha_check(q, k, v, h, w, dtype, need_weights=True, average_attn_weights=False, **kw)
    if masks == "bool_and_float_padding":
        assert np.isnan(out).all() and np.isnan(weights).all()
    else:
        assert np.isfinite(out).all()
        assert (weights[..., 3] == 0).all()


def test_mixed_dtype_weights(isa, rng):
    x = randn(rng, (2, 5, 8), np.float32)
    w = make_weights(rng, 8, 2, 4, dtype=np.float64)
    mha_check(x, x, x, 2, w, np.float64)


# --------------------------------------------------------------------------- module


def test_module_state_dict_layout():
    e = 12
    m = pyattn.MultiHeadAttention(e, 3, rng=np.random.default_rng(1))
    sd = m.state_dict()
    assert set(sd) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    assert sd["in_proj_weight"].shape == (3 * e, e)
    assert sd["in_proj_bias"].shape == (3 * e,)
    assert sd["out_proj.weight"].shape == (e, e)
    assert sd["out_proj.bias"].shape == (e,)
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in sd.values())
    m2 = pyattn.MultiHeadAttention(e, 3, kdim=5, vdim=7, rng=np.random.default_rng(1))
    sd2 = m2.state_dict()
    assert {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"} <= set(sd2)
    assert "in_proj_weight" not in sd2
    assert sd2["q_proj_weight"].shape == (e, e)
    assert sd2["k_proj_weight"].shape == (e, 5)
    assert sd2["v_proj_weight"].shape == (e, 7)
    m3 = pyattn.MultiHeadAttention(e, 3, bias=False, rng=np.random.default_rng(1))
    assert set(m3.state_dict()) == {"in_proj_weight", "out_proj.weight"}
    m4 = pyattn.MultiHeadAttention(e, 3, dtype=np.float64, rng=np.random.default_rng(1))
    assert all(v.dtype == np.float64 for v in m4.state_dict().values())


def test_module_rng_determinism():
    a = pyattn.MultiHeadAttention(16, 4, rng=np.random.default_rng(7)).state_dict()
    b = pyattn.MultiHeadAttention(16, 4, rng=np.random.default_rng(7)).state_dict()
    c = pyattn.MultiHeadAttention(16, 4, rng=np.random.default_rng(8)).state_dict()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(a["in_proj_weight"], c["in_proj_weight"])
    # a sensible (non-degenerate) initialisation
    w = a["in_proj_weight"]
    assert np.isfinite(w).all() and w.std() > 0


def test_load_state_dict_copies(rng):
    """Like torch, load_state_dict copies: later changes to the mapping do not leak in."""
    sd = make_state_dict(rng, 8, dtype=np.float32)
    m = pyattn.MultiHeadAttention(8, 2)
    m.load_state_dict(sd)
    x = randn(rng, (1, 3, 8), np.float32)
    before, _ = m(x)
    for v in sd.values():
        v[...] = 0.0
    after, _ = m(x)
    np.testing.assert_array_equal(after, before)


def module_check(m, sd, embed_dim, dtype, q, k=None, v=None, num_heads=None, num_kv_heads=None, **kw):
    w = weights_from_state_dict(sd, embed_dim)
    got, gw = m(q, k, v, **kw)
    kk = q if k is None else k
    vv = q if v is None else v
    args = (q, kk, vv, num_heads, w["w_q"], w["w_k"], w["w_v"], w["w_o"], w["b_q"], w["b_k"], w["b_v"], w["b_o"])
    assert_matches_reference(got, gw, args, dtype, num_kv_heads=num_kv_heads, **kw)
    return got, gw


@dtype_param
@pytest.mark.parametrize("bias", [True, False])
def test_module_self_attention(isa, dtype, bias, rng):
    e, h = 32, 4
    m = pyattn.MultiHeadAttention(e, h, bias=bias, dtype=dtype, rng=np.random.default_rng(3))
    sd = m.state_dict()
    x = randn(rng, (2, 19, e), dtype)
    module_check(m, sd, e, dtype, x, num_heads=h)
    module_check(m, sd, e, dtype, x, x, x, num_heads=h, need_weights=True)
    module_check(m, sd, e, dtype, x, num_heads=h, need_weights=True, average_attn_weights=False)
    module_check(m, sd, e, dtype, x, num_heads=h, is_causal=True)
    module_check(
        m,
        sd,
        e,
        dtype,
        x,
        num_heads=h,
        attn_mask=make_mask(rng, "float", (19, 19), dtype),
        key_padding_mask=bool_mask(rng, (2, 19), p=0.2),
    )
    module_check(m, sd, e, dtype, x[0], num_heads=h, need_weights=True)  # unbatched


@dtype_param
def test_module_loaded_weights(isa, dtype, rng):
    e, h = 24, 3
    sd = make_state_dict(rng, e, dtype=dtype)
    m = pyattn.MultiHeadAttention(e, h, dtype=dtype)
    m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, sd[k])
    q = randn(rng, (2, 9, e), dtype)
    kv = randn(rng, (2, 14, e), dtype)
    module_check(m, sd, e, dtype, q, kv, kv, num_heads=h, need_weights=True)


@dtype_param
def test_module_kdim_vdim(isa, dtype, rng):
    e, h, kd, vd = 16, 4, 6, 10
    sd = make_state_dict(rng, e, kdim=kd, vdim=vd, dtype=dtype)
    m = pyattn.MultiHeadAttention(e, h, kdim=kd, vdim=vd, dtype=dtype)
    m.load_state_dict(sd)
    q = randn(rng, (3, 5, e), dtype)
    k = randn(rng, (3, 8, kd), dtype)
    v = randn(rng, (3, 8, vd), dtype)
    module_check(m, sd, e, dtype, q, k, v, num_heads=h, need_weights=True)
    module_check(m, sd, e, dtype, q, k, v, num_heads=h, key_padding_mask=bool_mask(rng, (3, 8)))


@dtype_param
@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 1), (6, 3)])
def test_module_gqa(isa, dtype, h, hkv, rng):
    e = 24
    m = pyattn.MultiHeadAttention(e, h, num_kv_heads=hkv, dtype=dtype, rng=np.random.default_rng(5))
    sd = m.state_dict()
    w = weights_from_state_dict(sd, e)
    assert w["w_q"].shape == (e, e)
    assert w["w_k"].shape == (e, hkv * (e // h)) and w["w_v"].shape == (e, hkv * (e // h))
    x = randn(rng, (2, 11, e), dtype)
    module_check(m, sd, e, dtype, x, num_heads=h, num_kv_heads=hkv, need_weights=True, average_attn_weights=False)
    module_check(m, sd, e, dtype, x, num_heads=h, num_kv_heads=hkv, is_causal=True)
    # round trip through another instance
    m2 = pyattn.MultiHeadAttention(e, h, num_kv_heads=hkv, dtype=dtype)
    m2.load_state_dict(sd)
    assert_close(m2(x)[0], m(x)[0], dtype)


def test_module_float32_and_float64_inputs(rng):
    m = pyattn.MultiHeadAttention(8, 2, rng=np.random.default_rng(0))  # float32 parameters
    x32 = randn(rng, (1, 5, 8), np.float32)
    out, _ = m(x32)
    assert out.dtype == np.float32
    out64, _ = m(x32.astype(np.float64))
    assert out64.dtype in (np.float32, np.float64)
    assert_close(out64, out.astype(np.float64), tol=1e-5)


def test_reference_broadcasts_a_batch_of_one(rng):
    """A query batch of 1 against keys of batch B: pyattn broadcasts it, and so does the oracle
    (it took the batch from the query alone and could not reshape the output)."""
    x1, kv = randn(rng, (1, 7, 12)), randn(rng, (2, 9, 12))
    w = [randn(rng, (12, 12)) for _ in range(4)]
    want, _ = reference.multi_head_attention(x1, kv, kv, 4, *w)
    got, _ = pyattn.multi_head_attention(x1, kv, kv, 4, *w)
    assert want.shape == got.shape == (2, 7, 12)
    assert_close(got, want, np.float64)


def test_value_batch_broadcasts_like_query_and_key(rng):
    """query and key of batch 1 with a value of batch B: the batch broadcasts (it was refused)."""
    x1, v = randn(rng, (1, 5, 8)), randn(rng, (3, 6, 8))
    k = randn(rng, (1, 6, 8))
    w = [randn(rng, (8, 8)) for _ in range(4)]
    got, _ = pyattn.multi_head_attention(x1, k, v, 2, *w)
    want, _ = reference.multi_head_attention(x1, k, v, 2, *w)
    assert got.shape == (3, 5, 8)
    assert_close(got, want, np.float64)


def test_torch_style_mask_of_the_wrong_shape_names_attn_mask(rng):
    x = randn(rng, (2, 3, 8))
    w = [randn(rng, (8, 8)) for _ in range(4)]
    with pytest.raises(ValueError, match=r"attn_mask has shape \(4, 3, 1\)"):
        pyattn.multi_head_attention(x, x, x, 2, *w, attn_mask=np.zeros((4, 3, 1)))


def test_load_state_dict_takes_none_for_absent_biases(rng):
    """A bias=False layer takes a state dict whose bias entries are None (as torch's may be)."""
    src = pyattn.MultiHeadAttention(8, 2, bias=False, dtype=np.float64, rng=rng)
    dst = pyattn.MultiHeadAttention(8, 2, bias=False, dtype=np.float64)
    dst.load_state_dict(dict(src.state_dict(), in_proj_bias=None, **{"out_proj.bias": None}))
    x = randn(rng, (1, 3, 8))
    np.testing.assert_array_equal(dst(x, x, x)[0], src(x, x, x)[0])


def test_bfloat16_masks(rng):
    """A bfloat16 float mask (ml_dtypes), attn_mask or key_padding_mask, is an additive mask here
    as everywhere else in pyattn (it was refused as 'not a bool or float array')."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q = randn(rng, (2, 5, 8), np.float32)
    w = make_weights(rng, 8, 2, 4, dtype=np.float32)
    add = np.where(bool_mask(rng, (5, 5)), 0.0, -np.inf).astype(ml_dtypes.bfloat16)
    kpm = np.where(bool_mask(rng, (2, 5)), 0.0, -np.inf).astype(ml_dtypes.bfloat16)
    args = (q, q, q, 2, w["w_q"], w["w_k"], w["w_v"], w["w_o"], w.get("b_q"), w.get("b_k"), w.get("b_v"), w.get("b_o"))
    for kw in (dict(attn_mask=add), dict(key_padding_mask=kpm), dict(attn_mask=add, key_padding_mask=kpm)):
        got, _ = pyattn.multi_head_attention(*args, **kw)
        want, _ = pyattn.multi_head_attention(*args, **{n: m.astype(np.float32) for n, m in kw.items()})
        np.testing.assert_array_equal(got, want)


def test_unbatched_key_padding_mask_shape_error(rng):
    """Unbatched inputs take a (Lk,) key_padding_mask; another shape is named as given."""
    x = randn(rng, (3, 8), np.float32)
    w = make_weights(rng, 8, 2, 4, dtype=np.float32)
    args = (x, x, x, 2, w["w_q"], w["w_k"], w["w_v"], w["w_o"])
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(1, 3\); expected \(Lk,\) = \(3,\)"):
        pyattn.multi_head_attention(*args, key_padding_mask=np.zeros((1, 3), bool))
    got, _ = pyattn.multi_head_attention(*args, key_padding_mask=np.array([False, False, True]))
    want, _ = pyattn.multi_head_attention(
        *[a[None] if i < 3 else a for i, a in enumerate(args)], key_padding_mask=np.array([[False, False, True]])
    )
    np.testing.assert_array_equal(got, want[0])


@pytest.mark.parametrize("bq,bkv", [(0, 1), (1, 0), (0, 0)])
def test_empty_batch_broadcasts_against_a_batch_of_one(rng, bq, bkv):
    """A batch of 0 against a batch of 1 is an empty batch, as NumPy broadcasts it and as the
    oracle gives (it was refused: "query has batch size 0; expected 1 (or 1)"); 0 against 3 is
    still an error."""
    w = [randn(rng, (8, 8)) for _ in range(4)]
    q, kv = randn(rng, (bq, 3, 8)), randn(rng, (bkv, 4, 8))
    want, _ = reference.multi_head_attention(q, kv, kv, 2, *w)
    got, _ = pyattn.multi_head_attention(q, kv, kv, 2, *w)
    assert want.shape == got.shape == (0, 3, 8)
    got, _ = pyattn.MultiHeadAttention(8, 2)(q, kv, kv)
    assert got.shape == (0, 3, 8)
    with pytest.raises(ValueError, match="batch size 3; expected 0"):
        pyattn.multi_head_attention(randn(rng, (0, 3, 8)), randn(rng, (3, 4, 8)), randn(rng, (3, 4, 8)), 2, *w)
