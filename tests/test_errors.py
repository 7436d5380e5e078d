"""Every bad input raises TypeError/ValueError naming the argument; inputs are never modified."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import assert_unmodified, bool_mask, make_mask, make_state_dict, randn, snapshot

import pyattn

R = np.random.default_rng(1234)
Q = randn(R, (2, 3, 5, 8))
K = randn(R, (2, 3, 6, 8))
V = randn(R, (2, 3, 6, 4))

sdpa = pyattn.scaled_dot_product_attention
BAD_INPUT = (TypeError, ValueError)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("bad", ["int32", "int64", "complex64", "complex128", "bool", "uint8", "str"])
def test_sdpa_bad_dtype(which, bad):
    args = {"query": Q, "key": K, "value": V}
    x = args[which]
    if bad == "str":
        x = x.astype(str)
    else:
        x = x.astype(bad)
    args[which] = x
    with pytest.raises(TypeError, match=which):
        sdpa(args["query"], args["key"], args["value"])


def test_sdpa_float16_is_not_silently_wrong():
    """float16 is not computed natively: it computes (and returns) as float32, exactly so."""
    from pyattn import reference

    q, k, v = (x.astype(np.float16) for x in (Q, K, V))
    out = sdpa(q, k, v)
    assert out.dtype == np.float32
    want = reference.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # the same as float32 inputs holding the same values (float16 -> float32 is exact)
    np.testing.assert_array_equal(out, sdpa(*(x.astype(np.float32) for x in (q, k, v))))
    # mixed with float32 it is float32 too
    assert sdpa(q, K.astype(np.float32), V.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("bad", ["int64", "complex128", "uint8"])
def test_sdpa_bad_mask_dtype(bad):
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(Q, K, V, np.ones((5, 6), dtype=bad))


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "q,k,v,match",
    [
        (Q[0, 0, 0], K, V, "query"),  # 1-D query
        (np.float64(1.0), K, V, "query"),  # 0-D query
        (Q, K[0, 0, 0], V, "key"),  # 1-D key
        (Q, K, V[0, 0, 0], "value"),  # 1-D value
        (Q, randn(R, (2, 3, 6, 9)), V, "key"),  # E of key != E of query
        (randn(R, (2, 3, 5, 9)), K, V, "query|key"),  # E of query != E of key
        (Q, K, randn(R, (2, 3, 7, 4)), "value"),  # Lk of value != Lk of key
        (Q, randn(R, (4, 3, 6, 8)), randn(R, (4, 3, 6, 4)), "query|key"),  # batch 2 vs 4
        (Q, K, randn(R, (3, 3, 6, 4)), "key|value"),  # key batch 2 vs value batch 3
        (randn(R, (2, 4, 5, 8)), K, V, "query|key|head|enable_gqa"),  # Hq=4, Hkv=3
    ],
)
def test_sdpa_bad_shapes(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        sdpa(q, k, v)


@pytest.mark.parametrize("mshape", [(5, 7), (4, 6), (7,), (3, 5, 6, 1, 1), (4, 5, 6), (2, 2, 5, 6)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_bad_mask_shape(mshape, kind):
    mask = make_mask(R, kind, mshape)
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(Q, K, V, mask)


@pytest.mark.parametrize("hq,hkv", [(6, 4), (3, 2), (5, 3), (2, 4)])
def test_gqa_not_a_multiple(hq, hkv):
    q = randn(R, (1, hq, 5, 8))
    k = randn(R, (1, hkv, 6, 8))
    v = randn(R, (1, hkv, 6, 8))
    with pytest.raises(ValueError, match="(?i)head|gqa|key|query"):
        sdpa(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1)])
def test_heads_differ_without_gqa(hq, hkv):
    q = randn(R, (1, hq, 5, 8))
    k = randn(R, (1, hkv, 6, 8))
    v = randn(R, (1, hkv, 6, 8))
    if hkv == 1:
        # a size-1 head axis broadcasts by NumPy rules: the same as GQA with one kv head
        np.testing.assert_allclose(sdpa(q, k, v), sdpa(q, k, v, enable_gqa=True), rtol=1e-12, atol=1e-12)
        return
    with pytest.raises(ValueError, match="(?i)head|gqa|key|query"):
        sdpa(q, k, v)


@pytest.mark.parametrize("align", ["top-left", "bottom", "TOP_LEFT", "", "bottomright", None, 1])
def test_bad_causal_align(align):
    with pytest.raises(BAD_INPUT, match="causal_align"):
        sdpa(Q, K, V, is_causal=True, causal_align=align)


def test_bad_causal_align_even_without_causal():
    with pytest.raises(BAD_INPUT, match="causal_align"):
        sdpa(Q, K, V, causal_align="diagonal")


def test_is_causal_with_attn_mask_combines():
    """pyattn allows both: the mask and causality restrict together (torch refuses)."""
    from pyattn import reference

    mask = bool_mask(R, (5, 6))
    out, w = sdpa(Q, K, V, mask, is_causal=True, return_weights=True)
    want, ww = reference.scaled_dot_product_attention(Q, K, V, mask, is_causal=True, return_weights=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    causal = np.tril(np.ones((5, 6), bool))
    assert np.all(w[..., ~(mask & causal)] == 0.0)
    # differs from either restriction alone (so both are applied)
    assert not np.allclose(out, sdpa(Q, K, V, mask))
    assert not np.allclose(out, sdpa(Q, K, V, is_causal=True))


# --------------------------------------------------------------------------- out=


def test_out_wrong_shape():
    with pytest.raises(ValueError, match="out"):
        sdpa(Q, K, V, out=np.empty((2, 3, 5, 5)))
    with pytest.raises(ValueError, match="out"):
        sdpa(Q, K, V, out=np.empty((2, 3, 5 * 4)))


def test_out_wrong_dtype():
    with pytest.raises(BAD_INPUT, match="out"):
        sdpa(Q, K, V, out=np.empty((2, 3, 5, 4), np.float32))
    with pytest.raises(BAD_INPUT, match="out"):
        sdpa(Q.astype(np.float32), K.astype(np.float32), V.astype(np.float32), out=np.empty((2, 3, 5, 4), np.float64))
    with pytest.raises(BAD_INPUT, match="out"):
        sdpa(Q, K, V, out=np.empty((2, 3, 5, 4), np.int64))


def test_out_not_writeable():
    out = np.empty((2, 3, 5, 4))
    out.flags.writeable = False
    with pytest.raises(BAD_INPUT, match="out"):
        sdpa(Q, K, V, out=out)


def test_out_not_an_array():
    with pytest.raises(BAD_INPUT, match="out"):
        sdpa(Q, K, V, out=[[0.0] * 4] * 5)


def test_out_overlapping_input_is_safe():
    """out= aliasing an input computes correctly (as if out were a separate array)."""
    from pyattn import reference

    q = randn(R, (2, 3, 5, 8))
    v = randn(R, (2, 3, 5, 8))
    want = reference.scaled_dot_product_attention(q, q, v)
    q2 = q.copy()
    r = sdpa(q2, q2, v, out=q2)
    assert r is q2
    np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-12)
    # out is the value, and a view shifted by one row of the query buffer
    v2 = v.copy()
    np.testing.assert_allclose(sdpa(q, q, v2, out=v2), want, rtol=1e-12, atol=1e-12)
    buf = np.concatenate([q, q[..., :1, :]], axis=-2)
    r = sdpa(buf[..., :-1, :], q, v, out=buf[..., 1:, :])
    np.testing.assert_allclose(r, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- multi_head_attention

E, H = 8, 2
X = randn(R, (2, 5, E))
W = dict(w_q=randn(R, (E, E)), w_k=randn(R, (E, E)), w_v=randn(R, (E, E)), w_o=randn(R, (E, E)))


def mha(x=X, k=None, v=None, h=H, **kw):
    w = dict(W)
    for name in list(kw):
        if name in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
            w[name] = kw.pop(name)
    return pyattn.multi_head_attention(
        x,
        x if k is None else k,
        x if v is None else v,
        h,
        w["w_q"],
        w["w_k"],
        w["w_v"],
        w["w_o"],
        w.get("b_q"),
        w.get("b_k"),
        w.get("b_v"),
        w.get("b_o"),
        **kw,
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(h=3), "num_heads"),  # 8 columns, 3 heads
        (dict(h=0), "num_heads"),
        (dict(h=-2), "num_heads"),
        (dict(num_kv_heads=3, h=2), "num_kv_heads"),
        (dict(h=4, num_kv_heads=3), "num_kv_heads"),
        (dict(w_q=randn(R, (7, E))), "w_q|query"),  # rows != E of query
        (dict(w_k=randn(R, (E, 6))), "w_k"),  # columns != Hkv * head_dim
        (dict(w_v=randn(R, (E, 5))), "w_v"),  # 5 columns for 2 kv heads
        (dict(w_o=randn(R, (6, E))), "w_o"),  # rows != H * head_dim
        (dict(b_q=randn(R, (7,))), "b_q"),
        (dict(b_k=randn(R, (9,))), "b_k"),
        (dict(b_v=randn(R, (E, 1))), "b_v"),
        (dict(b_o=randn(R, (3,))), "b_o"),
        (dict(x=randn(R, (2, 3, 5, E))), "query"),  # 4-D input
        (dict(x=randn(R, (E,))), "query"),  # 1-D input
        (dict(k=randn(R, (3, 5, E)), v=randn(R, (3, 5, E))), "query|key"),  # batch 2 vs 3
        (dict(v=randn(R, (2, 6, E))), "key|value"),  # Lk 5 vs 6
        (dict(k=randn(R, (2, 5, 7))), "key|w_k"),  # key width != rows of w_k
        (dict(attn_mask=bool_mask(R, (5, 6))), "attn_mask"),
        (dict(attn_mask=bool_mask(R, (3, 5, 5))), "attn_mask"),  # neither H nor B*H
        (dict(key_padding_mask=bool_mask(R, (2, 6))), "key_padding_mask"),
        (dict(key_padding_mask=bool_mask(R, (3, 5))), "key_padding_mask"),
        (dict(causal_align="left"), "causal_align"),
    ],
)
def test_mha_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        mha(**kw)


@pytest.mark.parametrize("which", ["query", "key", "value", "w_q", "w_o"])
def test_mha_bad_dtype(which):
    kw = {}
    if which == "query":
        kw["x"] = X.astype(np.int64)
    elif which == "key":
        kw["k"] = X.astype(np.complex128)
    elif which == "value":
        kw["v"] = X.astype(bool)
    else:
        kw[which] = W[which].astype(np.int32)
    with pytest.raises(TypeError, match=which):
        mha(**kw)


# --------------------------------------------------------------------------- MultiHeadAttention


@pytest.mark.parametrize(
    "args,kw,match",
    [
        ((10, 3), {}, "num_heads"),
        ((8, 0), {}, "num_heads"),
        ((0, 1), {}, "embed_dim"),
        ((-8, 2), {}, "embed_dim"),
        ((8, 4), dict(num_kv_heads=3), "num_kv_heads"),
        ((8, 2), dict(num_kv_heads=0), "num_kv_heads"),
        ((8, 2), dict(kdim=0), "kdim"),
        ((8, 2), dict(vdim=-1), "vdim"),
    ],
)
def test_module_bad_construction(args, kw, match):
    with pytest.raises(ValueError, match=match):
        pyattn.MultiHeadAttention(*args, **kw)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.float16, bool])
def test_module_bad_dtype(dtype):
    with pytest.raises(BAD_INPUT, match="dtype"):
        pyattn.MultiHeadAttention(8, 2, dtype=dtype)


def test_module_bad_call():
    m = pyattn.MultiHeadAttention(8, 2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="query"):
        m(randn(R, (2, 5, 7)).astype(np.float32))
    with pytest.raises(ValueError, match="key"):
        m(X.astype(np.float32), randn(R, (2, 5, 7)).astype(np.float32), X.astype(np.float32))
    with pytest.raises(TypeError, match="query"):
        m(X.astype(np.int32))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(X.astype(np.float32), key_padding_mask=np.zeros((2, 4), bool))
    with pytest.raises(ValueError, match="attn_mask"):
        m(X.astype(np.float32), attn_mask=np.zeros((4, 5), bool))


@pytest.mark.parametrize("drop", ["in_proj_weight", "out_proj.weight", "in_proj_bias", "out_proj.bias"])
def test_load_state_dict_missing_key(drop):
    m = pyattn.MultiHeadAttention(8, 2, rng=np.random.default_rng(0))
    sd = make_state_dict(R, 8, dtype=np.float32)
    del sd[drop]
    # without in_proj_weight the separate q/k/v_proj_weight keys may be asked for instead
    match = "in_proj_weight|q_proj_weight" if drop == "in_proj_weight" else drop.replace(".", r"\.")
    with pytest.raises((KeyError, ValueError), match=match):
        m.load_state_dict(sd)


@pytest.mark.parametrize("key", ["in_proj_bias", "out_proj.bias", "foo"])
def test_load_state_dict_unexpected_key(key):
    """An unexpected key is a KeyError, as api.md says, a bias given to a bias=False layer too
    (it was a ValueError), and the layer keeps its weights."""
    m = pyattn.MultiHeadAttention(8, 2, bias=False, rng=np.random.default_rng(0))
    before = m.state_dict()
    sd = pyattn.MultiHeadAttention(8, 2, rng=np.random.default_rng(1)).state_dict()
    if key == "foo":
        sd = {k: v for k, v in sd.items() if "bias" not in k}
        sd["foo"] = np.zeros(3, np.float32)
    else:
        sd = {k: v for k, v in sd.items() if "bias" not in k or k == key}
    with pytest.raises(KeyError, match=key.replace(".", r"\.")):
        m.load_state_dict(sd)
    for name, w in m.state_dict().items():
        np.testing.assert_array_equal(w, before[name])


@pytest.mark.parametrize(
    "key,shape",
    [
        ("in_proj_weight", (24, 7)),
        ("in_proj_weight", (23, 8)),
        ("in_proj_bias", (23,)),
        ("out_proj.weight", (8, 9)),
        ("out_proj.bias", (8, 1)),
    ],
)
def test_load_state_dict_misshaped(key, shape):
    m = pyattn.MultiHeadAttention(8, 2, rng=np.random.default_rng(0))
    before = m.state_dict()
    sd = make_state_dict(R, 8, dtype=np.float32)
    sd[key] = randn(R, shape, np.float32)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        m.load_state_dict(sd)
    # a failed load leaves the module usable (and, ideally, unchanged)
    out, _ = m(X.astype(np.float32))
    assert np.isfinite(out).all()
    del before


def test_load_state_dict_missing_separate_projection():
    m = pyattn.MultiHeadAttention(8, 2, kdim=5, vdim=6, rng=np.random.default_rng(0))
    sd = make_state_dict(R, 8, kdim=5, vdim=6, dtype=np.float32)
    del sd["k_proj_weight"]
    with pytest.raises((KeyError, ValueError), match="k_proj_weight"):
        m.load_state_dict(sd)
    sd = make_state_dict(R, 8, kdim=5, vdim=6, dtype=np.float32)
    sd["v_proj_weight"] = sd["v_proj_weight"][:, :5]
    with pytest.raises(ValueError, match="v_proj_weight"):
        m.load_state_dict(sd)


# --------------------------------------------------------------------------- matmul, softmax, ...


@pytest.mark.parametrize(
    "a,b",
    [
        (np.ones((3, 4)), np.ones((5, 6))),
        (np.ones((3,)), np.ones((4,))),
        (np.ones((2, 3, 4)), np.ones((3, 4, 5))),  # batch 2 vs 3
        (np.float64(2.0), np.ones((2, 2))),  # 0-d operand
        (np.ones((2, 2)), np.float64(2.0)),
    ],
)
def test_matmul_bad_shapes(a, b):
    with pytest.raises(ValueError, match=r"\b(a|b)\b"):
        pyattn.matmul(a, b)


@pytest.mark.parametrize("bad", [np.int64, np.complex128, bool, np.int8])
def test_matmul_bad_dtypes(bad):
    with pytest.raises(TypeError, match=r"\ba\b"):
        pyattn.matmul(np.ones((2, 3), bad), np.ones((3, 4)))
    with pytest.raises(TypeError, match=r"\bb\b"):
        pyattn.matmul(np.ones((2, 3)), np.ones((3, 4), bad))


def test_matmul_bad_out():
    a, b = np.ones((2, 3)), np.ones((3, 4))
    with pytest.raises(ValueError, match="out"):
        pyattn.matmul(a, b, out=np.empty((2, 5)))
    with pytest.raises(BAD_INPUT, match="out"):
        pyattn.matmul(a, b, out=np.empty((2, 4), np.float32))
    ro = np.empty((2, 4))
    ro.flags.writeable = False
    with pytest.raises(BAD_INPUT, match="out"):
        pyattn.matmul(a, b, out=ro)


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_softmax_bad_axis(axis):
    with pytest.raises(BAD_INPUT, match="axis"):
        pyattn.softmax(np.ones((3, 4)), axis=axis)


def test_softmax_bad_inputs():
    with pytest.raises(TypeError, match=r"\bx\b"):
        pyattn.softmax(np.ones((3, 4), np.int32))
    with pytest.raises(TypeError, match=r"\bx\b"):
        pyattn.softmax(np.ones((3, 4), np.complex64))
    with pytest.raises(ValueError, match="mask"):
        pyattn.softmax(np.ones((3, 4)), mask=np.ones((3, 5), bool))
    with pytest.raises(TypeError, match="mask"):
        pyattn.softmax(np.ones((3, 4)), mask=np.ones((3, 4), np.complex64))
    with pytest.raises(ValueError, match="out"):
        pyattn.softmax(np.ones((3, 4)), out=np.empty((4, 3)))
    with pytest.raises(ValueError, match="(?i)axis|dimension|x"):
        pyattn.softmax(np.float64(1.0))


@pytest.mark.parametrize("n", [0, -1, -8])
def test_set_num_threads_bad(n):
    old = pyattn.get_num_threads()
    with pytest.raises(ValueError, match=r"\bn\b"):
        pyattn.set_num_threads(n)
    assert pyattn.get_num_threads() == old
    with pytest.raises(ValueError, match=r"\bn\b"):
        with pyattn.num_threads(n):
            pass
    assert pyattn.get_num_threads() == old


def test_set_num_threads_bad_type():
    with pytest.raises(TypeError, match=r"\bn\b"):
        pyattn.set_num_threads(1.5)
    with pytest.raises(TypeError, match=r"\bn\b"):
        pyattn.set_num_threads("2")


@pytest.mark.parametrize(
    "args,kw,match",
    [
        ((-1, 4), {}, "num_positions"),
        ((4, -2), {}, "d_model"),
        ((4, 4), dict(base=0.0), "base"),
        ((4, 4), dict(base=-10.0), "base"),
        ((4, 4), dict(base=float("nan")), "base"),
        ((4, 4), dict(base=10**400), "base must fit a float64"),  # not OverflowError
    ],
)
def test_sinusoidal_bad(args, kw, match):
    with pytest.raises(ValueError, match=match):
        pyattn.sinusoidal_positional_encoding(*args, **kw)


# np.complex128 is an np.number and compares by its real part: it was taken as its real part
@pytest.mark.parametrize("base", ["10", None, np.array([2.0, 3.0]), True, 2 + 5j, np.complex128(2 + 5j)])
def test_sinusoidal_bad_base_type(base):
    with pytest.raises(TypeError, match="base"):
        pyattn.sinusoidal_positional_encoding(4, 4, base=base)


@pytest.mark.parametrize("scale", [True, "abc", np.ones(2), 1j])
def test_softmax_bad_scale(scale):
    with pytest.raises(TypeError, match="scale must be a real number"):
        pyattn.softmax(np.ones((2, 3), np.float32), scale=scale)
    with pytest.raises(TypeError, match="scale must be a real number"):  # checked before an empty x returns
        pyattn.softmax(np.ones((0, 3), np.float32), scale=scale)


# A finite scale past the computation's range would round to inf there, and 0 * inf is NaN:
# refused, as attention refuses it. (x * scale may be finite: 1e-30 * 1e39.)
@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e39), (np.float16, 3.5e38), (np.float32, -1e39)])
def test_softmax_scale_past_the_dtype(dtype, scale):
    x = np.array([0.0, 1e-30, -1e-30], dtype)
    with pytest.raises(ValueError, match="overflows a float32 computation"):
        pyattn.softmax(x, scale=scale)
    with pytest.raises(ValueError, match="overflows a float32 computation"):
        pyattn.softmax(x[:0], scale=scale)
    # at the edge of the range, and inf itself, it is taken (inf propagates, as in attention)
    pyattn.softmax(x, scale=float(np.finfo(np.float32).max))
    assert np.isnan(pyattn.softmax(x, scale=float("inf"))).all()
    assert np.allclose(pyattn.softmax(x.astype(np.float64), scale=scale), pyattn.reference.softmax(x, scale=scale))


# np.longdouble is float64 itself on some platforms (Windows, macOS on arm64): taken there
WIDE_LONGDOUBLE = np.dtype(np.longdouble).itemsize > 8


@pytest.mark.parametrize("dtype", [np.int32, np.complex64] + ([np.longdouble] if WIDE_LONGDOUBLE else []))
def test_sinusoidal_bad_dtype(dtype):
    """The message names the dtypes taken (it said "a float dtype" to a refused np.longdouble)."""
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16, float32 or float64; got"):
        pyattn.sinusoidal_positional_encoding(4, 4, dtype=dtype)


AQ, AK = randn(R, (2, 4, 5)), randn(R, (2, 6, 3))
AWQ, AWK, AV = randn(R, (5, 7)), randn(R, (3, 7)), randn(R, (7,))


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(query=AQ.astype(np.int64)), TypeError, "query"),
        (dict(keys=AK.astype(np.complex128)), TypeError, "keys"),
        (dict(w_query=randn(R, (4, 7))), ValueError, "w_query|query"),
        (dict(w_keys=randn(R, (3, 6))), ValueError, "w_keys|w_query"),
        (dict(v=randn(R, (6,))), ValueError, r"\bv\b"),
        (dict(v=randn(R, (7, 1))), ValueError, r"\bv\b"),
        (dict(values=randn(R, (2, 5, 3))), ValueError, "values"),
        (dict(mask=np.ones((4, 5), bool)), ValueError, "mask"),
        (dict(keys=randn(R, (3, 6, 3))), ValueError, "query|keys"),
    ],
)
def test_additive_bad(kw, exc, match):
    args = dict(query=AQ, keys=AK, w_query=AWQ, w_keys=AWK, v=AV)
    extra = {}
    for name in ("values", "mask"):
        if name in kw:
            extra[name] = kw.pop(name)
    args.update(kw)
    with pytest.raises(exc, match=match):
        pyattn.additive_attention(args["query"], args["keys"], args["w_query"], args["w_keys"], args["v"], **extra)


# --------------------------------------------------------------------------- inputs unmodified


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inputs_not_modified(dtype):
    rng = np.random.default_rng(99)
    q, k, v = randn(rng, (2, 4, 9, 8), dtype), randn(rng, (2, 2, 11, 8), dtype), randn(rng, (2, 2, 11, 6), dtype)
    fm = make_mask(rng, "float_full_rows", (9, 11), dtype)
    bm = make_mask(rng, "bool_full_rows", (2, 1, 9, 11))
    k_view = np.swapaxes(np.ascontiguousarray(np.swapaxes(k, -1, -2)), -1, -2)
    calls = [
        (sdpa, (q, k, v, fm), dict(enable_gqa=True, is_causal=True, return_weights=True, return_lse=True)),
        (sdpa, (q, k_view, v, bm), dict(enable_gqa=True, causal_align="bottom_right", is_causal=True)),
        (pyattn.softmax, (q,), dict(axis=1, scale=0.3, mask=np.ones((9, 8), bool))),
        (pyattn.softmax, (q[0, 0],), dict(mask=fm[:, :8])),
        (pyattn.matmul, (q, np.swapaxes(q, -1, -2)), {}),
        (pyattn.matmul, (q[0, 0], k[0, 0].T), {}),
    ]
    x = randn(rng, (2, 9, 8), dtype)
    kv = randn(rng, (2, 11, 8), dtype)
    ws = [randn(rng, (8, 8), dtype) for _ in range(4)] + [randn(rng, (8,), dtype) for _ in range(4)]
    kpm = bool_mask(rng, (2, 11), p=0.2)
    calls.append(
        (pyattn.multi_head_attention, (x, kv, kv, 2, *ws), dict(attn_mask=fm, key_padding_mask=kpm, need_weights=True))
    )
    calls.append((pyattn.multi_head_attention, (x, x, x, 2, *ws), dict(is_causal=True, num_kv_heads=2)))
    aq, ak = randn(rng, (9, 5), dtype), randn(rng, (11, 3), dtype)
    awq, awk, av = randn(rng, (5, 7), dtype), randn(rng, (3, 7), dtype), randn(rng, (7,), dtype)
    avals = randn(rng, (11, 4), dtype)
    calls.append(
        (pyattn.additive_attention, (aq, ak, awq, awk, av), dict(values=avals, mask=bm[0, 0], return_weights=True))
    )
    for fn, args, kw in calls:
        arrays = list(args) + [a for a in kw.values() if isinstance(a, np.ndarray)]
        copies = snapshot(*[a if isinstance(a, np.ndarray) else None for a in arrays])
        fn(*args, **kw)
        assert_unmodified(arrays, copies)


def test_module_inputs_not_modified():
    rng = np.random.default_rng(5)
    m = pyattn.MultiHeadAttention(8, 2, rng=rng)
    sd = m.state_dict()
    x = randn(rng, (2, 7, 8), np.float32)
    kv = randn(rng, (2, 9, 8), np.float32)
    mask = make_mask(rng, "float", (7, 9), np.float32)
    kpm = bool_mask(rng, (2, 9), p=0.2)
    arrays = [x, kv, mask, kpm]
    copies = snapshot(*arrays)
    m(x, kv, kv, attn_mask=mask, key_padding_mask=kpm, need_weights=True)
    m(x, is_causal=True)
    assert_unmodified(arrays, copies)
    new = make_state_dict(rng, 8, dtype=np.float32)
    new_copies = {k: v.copy() for k, v in new.items()}
    m.load_state_dict(new)
    for k in new:
        np.testing.assert_array_equal(new[k], new_copies[k])
    del sd


def test_masked_arrays_with_masked_entries_are_refused():
    """np.asarray drops a masked array's mask: its masked values took part silently. Refused
    where an entry is masked, in every argument; without one the data is all there is."""
    x = np.ma.masked_array(np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 24, mask=False)
    plain = x.data.copy()
    np.testing.assert_array_equal(
        pyattn.scaled_dot_product_attention(x, x, x), pyattn.scaled_dot_product_attention(plain, plain, plain)
    )
    x[0, 1, 2] = np.ma.masked
    calls = {
        "query": lambda: pyattn.scaled_dot_product_attention(x, plain, plain),
        "value": lambda: pyattn.scaled_dot_product_attention(plain, plain, x),
        "attn_mask": lambda: pyattn.scaled_dot_product_attention(plain, plain, plain, attn_mask=x[0, :, :3]),
        "x": lambda: pyattn.softmax(x),
        "b": lambda: pyattn.matmul(plain[0], x[0].T),
        "k_new": lambda: pyattn.kvcache_attention(
            plain[None, :, :1], np.zeros((1, 2, 4, 4), np.float32), np.zeros((1, 2, 4, 4), np.float32),
            np.array([0]), k_new=x[None, :, 1:2], v_new=plain[None, :, :1]),
    }  # fmt: skip
    for name, call in calls.items():
        with pytest.raises(TypeError, match=rf"{name} is a masked array with masked entries.*{name}\.filled"):
            call()


@pytest.mark.skipif(not WIDE_LONGDOUBLE, reason="np.longdouble is float64 on this platform")
@pytest.mark.parametrize("arg", ["attn_mask", "alibi_slopes", "sinks", "softmax_mask", "key_padding_mask"])
def test_extended_precision_arguments_are_refused(arg):
    """np.longdouble is refused in every array argument, as api.md says for inputs (a longdouble
    mask, slope or sink was cast down silently)."""
    q = np.ones((1, 2, 4, 8), np.float32)
    ld = np.longdouble
    with pytest.raises(TypeError, match="float128|longdouble|float96"):
        if arg == "attn_mask":
            pyattn.scaled_dot_product_attention(q, q, q, np.zeros((4, 4), ld))
        elif arg == "softmax_mask":
            pyattn.softmax(q, mask=np.zeros(8, ld))
        elif arg == "key_padding_mask":
            mha = pyattn.MultiHeadAttention(8, 2)
            x = np.ones((1, 4, 8), np.float32)
            mha(x, key_padding_mask=np.zeros((1, 4), ld))
        else:
            pyattn.scaled_dot_product_attention(q, q, q, **{arg: np.zeros(2, ld)})


# --------------------------------------------------------------------------- ints past int64


@pytest.mark.parametrize("big", [2**70, -(2**70), [3, 2**70]])
def test_integer_arguments_past_int64_are_out_of_range(big):
    """NumPy stores Python ints past the int64 / uint64 range as objects: they are values out of
    range (ValueError, as 2**62 is), not a wrong dtype (an adversarial review found TypeError)."""
    from pyattn import reference

    kl = big if np.ndim(big) == 0 else np.array(big, dtype=object)
    for f in (sdpa, reference.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="kv_lens"):
            f(Q, K, V, kv_lens=kl)
    q1, c = np.ones((1, 1, 1, 4), np.float32), np.ones((2, 1, 4, 4), np.float32)
    bad = np.array([[big if np.ndim(big) == 0 else big[1]]], dtype=object)
    with pytest.raises(ValueError, match="block_table"):
        pyattn.kvcache_attention(q1, c, c, [1], block_table=bad)
    with pytest.raises(ValueError, match="cache_lens"):
        pyattn.kvcache_attention(q1, c[:1], c[:1], bad[0])
    t = np.ones((3, 1, 4), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pyattn.varlen_attention(t, t, t, [0, bad[0, 0]], [0, 3])


def test_dask_kv_lens_as_objects_are_range_checked():
    """pyattn.dask checks kv_lens itself: an object array of ints out of [0, Lk] (or past int64)
    is a ValueError, as in the NumPy call, not clamped in each task (a review found the range
    check skipped for object arrays)."""
    da = pytest.importorskip("dask.array")
    import pyattn.dask as pdask

    q, k = (da.from_array(x) for x in (Q, K))
    v = da.from_array(V)
    for bad in ([3, 70], [3, -5], [3, 2**70]):
        with pytest.raises(ValueError, match="kv_lens"):
            pdask.scaled_dot_product_attention(q, k, v, kv_lens=np.array(bad, dtype=object))
    got = pdask.scaled_dot_product_attention(q, k, v, kv_lens=np.array([3, 6], dtype=object)).compute(
        scheduler="synchronous"
    )
    np.testing.assert_allclose(got, sdpa(Q, K, V, kv_lens=np.array([3, 6])), rtol=1e-6, atol=1e-7)


def test_integer_arguments_as_objects_that_fit_are_taken():
    """An object array of ints that fit int64 is an integer array (as NumPy's own casts take it);
    bools and floats in one are not."""
    from pyattn import reference

    kl = np.array([4, 6], dtype=object)
    want = sdpa(Q, K, V, kv_lens=np.array([4, 6]))
    np.testing.assert_array_equal(sdpa(Q, K, V, kv_lens=kl), want)
    np.testing.assert_allclose(reference.scaled_dot_product_attention(Q, K, V, kv_lens=kl), want, rtol=1e-5, atol=1e-6)
    for bad in (np.array([True, False], dtype=object), np.array([4.0, 6.0], dtype=object)):
        with pytest.raises(TypeError, match="kv_lens must be an integer array"):
            sdpa(Q, K, V, kv_lens=bad)
