"""Parity with PyTorch (skipped when torch does not import)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from _helpers import assert_close, bool_mask, randn  # noqa: E402

import pyattn  # noqa: E402
from pyattn import reference  # noqa: E402

sdpa = pyattn.scaled_dot_product_attention

# torch and pyattn each round in float32: allow a bit more than against the float64 oracle
TORCH_TOL = {np.float32: 3e-5, np.float64: 1e-12}
dtype_param = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])


@pytest.fixture(autouse=True, scope="module")
def _torch_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def T(x):
    return None if x is None else torch.from_numpy(np.ascontiguousarray(x))


def N(t):
    return t.detach().numpy()


# --------------------------------------------------------------------------- SDPA


@dtype_param
@pytest.mark.parametrize(
    "lq,lk,e,ev",
    [(1, 1, 8, 8), (7, 7, 16, 16), (33, 65, 64, 64), (64, 17, 32, 48), (128, 128, 64, 32), (5, 300, 24, 8)],
)
def test_sdpa_plain(dtype, lq, lk, e, ev):
    rng = np.random.default_rng(lq * 1000 + lk)
    q, k, v = randn(rng, (2, 3, lq, e), dtype), randn(rng, (2, 3, lk, e), dtype), randn(rng, (2, 3, lk, ev), dtype)
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v)))
    assert_close(sdpa(q, k, v), want, dtype, tol=TORCH_TOL[dtype])


@dtype_param
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mshape", [(2, 3, 9, 14), (9, 14), (2, 1, 1, 14), (1, 3, 9, 14)])
def test_sdpa_masks(dtype, kind, mshape):
    rng = np.random.default_rng(len(mshape) * 7 + (kind == "bool"))
    q, k, v = randn(rng, (2, 3, 9, 16), dtype), randn(rng, (2, 3, 14, 16), dtype), randn(rng, (2, 3, 14, 16), dtype)
    allowed = rng.random(mshape) < 0.7
    allowed[..., 0] = True  # no fully masked rows: torch's behaviour there differs by backend
    if kind == "bool":
        mask = allowed  # both use True = may attend
    else:
        mask = np.where(allowed, rng.uniform(-1, 1, mshape), -np.inf).astype(dtype)
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(mask)))
    assert_close(sdpa(q, k, v, mask), want, dtype, tol=TORCH_TOL[dtype])


@dtype_param
@pytest.mark.parametrize("lq,lk", [(9, 9), (5, 12), (40, 40), (3, 2)])
def test_sdpa_causal_top_left(dtype, lq, lk):
    rng = np.random.default_rng(lq + lk)
    q, k, v = randn(rng, (1, 2, lq, 16), dtype), randn(rng, (1, 2, lk, 16), dtype), randn(rng, (1, 2, lk, 16), dtype)
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=True))
    assert_close(sdpa(q, k, v, is_causal=True), want, dtype, tol=TORCH_TOL[dtype])


@dtype_param
@pytest.mark.parametrize("lq,lk", [(5, 12), (1, 40), (12, 12), (8, 100)])
def test_sdpa_causal_bottom_right(dtype, lq, lk):
    rng = np.random.default_rng(lq * lk)
    q, k, v = randn(rng, (1, 2, lq, 16), dtype), randn(rng, (1, 2, lk, 16), dtype), randn(rng, (1, 2, lk, 16), dtype)
    try:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(lq, lk)
        want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=bias))
    except (ImportError, RuntimeError, NotImplementedError):
        lower_right = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=lower_right))
    got = sdpa(q, k, v, is_causal=True, causal_align="bottom_right")
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])


@dtype_param
@pytest.mark.parametrize("hq,hkv", [(4, 2), (8, 1), (6, 3), (4, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_gqa(dtype, hq, hkv, causal):
    rng = np.random.default_rng(hq * 10 + hkv)
    q = randn(rng, (2, hq, 11, 16), dtype)
    k = randn(rng, (2, hkv, 11, 16), dtype)
    v = randn(rng, (2, hkv, 11, 8), dtype)
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), is_causal=causal, enable_gqa=True))
    assert_close(sdpa(q, k, v, is_causal=causal, enable_gqa=True), want, dtype, tol=TORCH_TOL[dtype])


@dtype_param
@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_sdpa_scale(dtype, scale):
    rng = np.random.default_rng(int(scale * 100))
    q, k, v = randn(rng, (2, 2, 10, 32), dtype), randn(rng, (2, 2, 13, 32), dtype), randn(rng, (2, 2, 13, 32), dtype)
    mask = np.where(rng.random((10, 13)) < 0.8, 0.0, -np.inf).astype(dtype)
    mask[:, 0] = 0.0
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(mask), scale=scale))
    assert_close(sdpa(q, k, v, mask, scale=scale), want, dtype, tol=TORCH_TOL[dtype])


def test_reference_matches_torch():
    """The oracle itself agrees with torch (float64)."""
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 4, 9, 16)), randn(rng, (2, 2, 12, 16)), randn(rng, (2, 2, 12, 8))
    mask = rng.random((2, 1, 9, 12)) < 0.7
    mask[..., 0] = True
    want = N(F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=T(mask), enable_gqa=True, scale=0.3))
    got = reference.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, scale=0.3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- MultiheadAttention


def torch_mha(e, h, seed, dtype, **kw):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(e, h, batch_first=True, **kw)
    with torch.no_grad():
        for p in m.parameters():  # torch zero-initialises the biases: randomise everything
            p.normal_(0.0, 0.3)
    m = m.double() if dtype == np.float64 else m.float()
    return m.eval()


def to_numpy_sd(m):
    return {k: v.detach().numpy().copy() for k, v in m.state_dict().items()}


def run_torch(m, q, k, v, **kw):
    with torch.no_grad():
        out, w = m(T(q), T(k), T(v), **kw)
    return N(out), None if w is None else N(w)


@dtype_param
@pytest.mark.parametrize("avg", [True, False])
@pytest.mark.parametrize("e,h,lq,lk", [(16, 4, 7, 7), (32, 8, 5, 13), (12, 1, 9, 4), (24, 3, 1, 30)])
def test_mha_self_and_cross(dtype, avg, e, h, lq, lk):
    m = torch_mha(e, h, e + h, dtype)
    p = pyattn.MultiHeadAttention(e, h, dtype=dtype)
    p.load_state_dict(to_numpy_sd(m))
    rng = np.random.default_rng(e * h)
    q, kv = randn(rng, (2, lq, e), dtype), randn(rng, (2, lk, e), dtype)
    want, ww = run_torch(m, q, kv, kv, need_weights=True, average_attn_weights=avg)
    got, gw = p(q, kv, kv, need_weights=True, average_attn_weights=avg)
    tol = TORCH_TOL[dtype]
    assert_close(got, want, dtype, tol=tol)
    assert_close(gw, ww, dtype, tol=tol)
    if lq == lk:  # self-attention with key/value defaulting to query
        want, _ = run_torch(m, q, q, q, need_weights=False)
        got, gw = p(q)
        assert gw is None
        assert_close(got, want, dtype, tol=tol)


@dtype_param
@pytest.mark.parametrize("kind", ["bool", "float", "bool_3d"])
@pytest.mark.parametrize("padding", [False, True])
def test_mha_masks(dtype, kind, padding):
    e, h, b, lq, lk = 16, 4, 3, 6, 9
    m = torch_mha(e, h, 11, dtype)
    p = pyattn.MultiHeadAttention(e, h, dtype=dtype)
    p.load_state_dict(to_numpy_sd(m))
    rng = np.random.default_rng(17)
    q, kv = randn(rng, (b, lq, e), dtype), randn(rng, (b, lk, e), dtype)
    shape = (b * h, lq, lk) if kind == "bool_3d" else (lq, lk)
    allowed = rng.random(shape) < 0.6
    allowed[..., 0] = True
    if kind == "float":
        t_mask = p_mask = np.where(allowed, rng.uniform(-1, 1, shape), -np.inf).astype(dtype)
    else:
        t_mask = ~allowed  # torch MultiheadAttention: True = NOT allowed
        p_mask = allowed  # pyattn: True = may attend
    kpm = None
    if padding:
        kpm = np.zeros((b, lk), bool)
        kpm[1, 5:] = True
        kpm[2, 1:3] = True  # key 0 is always kept, so no row is fully masked
    want, ww = run_torch(m, q, kv, kv, attn_mask=T(t_mask), key_padding_mask=T(kpm), need_weights=True)
    got, gw = p(q, kv, kv, attn_mask=p_mask, key_padding_mask=kpm, need_weights=True)
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])
    assert_close(gw, ww, dtype, tol=TORCH_TOL[dtype])


@dtype_param
def test_mha_causal_mask_as_torch(dtype):
    """pyattn's is_causal equals torch with an explicit causal attn_mask."""
    e, h, l = 16, 2, 10
    m = torch_mha(e, h, 5, dtype)
    p = pyattn.MultiHeadAttention(e, h, dtype=dtype)
    p.load_state_dict(to_numpy_sd(m))
    x = randn(np.random.default_rng(5), (2, l, e), dtype)
    future = np.triu(np.ones((l, l), bool), k=1)  # torch: True = not allowed
    want, ww = run_torch(m, x, x, x, attn_mask=T(future), need_weights=True)
    got, gw = p(x, is_causal=True, need_weights=True)
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])
    assert_close(gw, ww, dtype, tol=TORCH_TOL[dtype])


@dtype_param
def test_mha_kdim_vdim(dtype):
    e, h, kd, vd = 16, 4, 6, 10
    m = torch_mha(e, h, 9, dtype, kdim=kd, vdim=vd)
    sd = to_numpy_sd(m)
    assert "q_proj_weight" in sd and "in_proj_weight" not in sd
    p = pyattn.MultiHeadAttention(e, h, kdim=kd, vdim=vd, dtype=dtype)
    p.load_state_dict(sd)
    rng = np.random.default_rng(9)
    q, k, v = randn(rng, (2, 5, e), dtype), randn(rng, (2, 7, kd), dtype), randn(rng, (2, 7, vd), dtype)
    kpm = bool_mask(rng, (2, 7), p=0.3)
    kpm[:, 0] = False
    want, ww = run_torch(m, q, k, v, key_padding_mask=T(kpm), need_weights=True)
    got, gw = p(q, k, v, key_padding_mask=kpm, need_weights=True)
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])
    assert_close(gw, ww, dtype, tol=TORCH_TOL[dtype])


@dtype_param
def test_mha_no_bias(dtype):
    e, h = 16, 2
    m = torch_mha(e, h, 3, dtype, bias=False)
    sd = to_numpy_sd(m)
    assert set(sd) == {"in_proj_weight", "out_proj.weight"}
    p = pyattn.MultiHeadAttention(e, h, bias=False, dtype=dtype)
    p.load_state_dict(sd)
    assert set(p.state_dict()) == set(sd)
    x = randn(np.random.default_rng(3), (2, 8, e), dtype)
    want, _ = run_torch(m, x, x, x, need_weights=False)
    got, _ = p(x)
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])
    assert sum(v.size for v in sd.values()) == 4 * e * e


@dtype_param
def test_mha_unbatched(dtype):
    e, h = 12, 3
    m = torch_mha(e, h, 4, dtype)
    p = pyattn.MultiHeadAttention(e, h, dtype=dtype)
    p.load_state_dict(to_numpy_sd(m))
    rng = np.random.default_rng(4)
    q, kv = randn(rng, (5, e), dtype), randn(rng, (8, e), dtype)
    want, ww = run_torch(m, q, kv, kv, need_weights=True)
    got, gw = p(q, kv, kv, need_weights=True)
    assert got.shape == (5, e) and gw.shape == (5, 8)
    assert_close(got, want, dtype, tol=TORCH_TOL[dtype])
    assert_close(gw, ww, dtype, tol=TORCH_TOL[dtype])


@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(kdim=5, vdim=7)])
def test_state_dict_round_trip(kw):
    e, h = 16, 4
    m = torch_mha(e, h, 21, np.float32, **kw)
    sd = to_numpy_sd(m)
    p = pyattn.MultiHeadAttention(e, h, **kw)
    p.load_state_dict(sd)
    back = p.state_dict()
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].shape == sd[k].shape
        np.testing.assert_array_equal(back[k], sd[k])
    # and a pyattn-initialised layer loads into torch and runs identically
    p2 = pyattn.MultiHeadAttention(e, h, rng=np.random.default_rng(2), **kw)
    m2 = torch.nn.MultiheadAttention(e, h, batch_first=True, **kw).eval()
    m2.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in p2.state_dict().items()})
    rng = np.random.default_rng(6)
    q = randn(rng, (2, 5, e), np.float32)
    k = randn(rng, (2, 6, kw.get("kdim", e)), np.float32)
    v = randn(rng, (2, 6, kw.get("vdim", e)), np.float32)
    want, ww = run_torch(m2, q, k, v, need_weights=True)
    got, gw = p2(q, k, v, need_weights=True)
    assert_close(got, want, np.float32, tol=TORCH_TOL[np.float32])
    assert_close(gw, ww, np.float32, tol=TORCH_TOL[np.float32])


def test_reference_mha_matches_torch():
    e, h = 16, 4
    m = torch_mha(e, h, 8, np.float64)
    sd = to_numpy_sd(m)
    from _helpers import weights_from_state_dict

    w = weights_from_state_dict(sd, e)
    rng = np.random.default_rng(8)
    q, kv = randn(rng, (2, 6, e)), randn(rng, (2, 9, e))
    kpm = np.zeros((2, 9), bool)
    kpm[0, 4:] = True
    want, ww = run_torch(m, q, kv, kv, key_padding_mask=T(kpm), need_weights=True, average_attn_weights=False)
    got, gw = reference.multi_head_attention(
        q,
        kv,
        kv,
        h,
        w["w_q"],
        w["w_k"],
        w["w_v"],
        w["w_o"],
        w["b_q"],
        w["b_k"],
        w["b_v"],
        w["b_o"],
        key_padding_mask=kpm,
        need_weights=True,
        average_attn_weights=False,
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gw, ww, rtol=1e-12, atol=1e-12)


def test_torch_tensors_numpy_cannot_read():
    """Torch tensors are read as np.asarray reads them; those it refuses get pyattn's own word:
    a CPU bfloat16 tensor is read through ml_dtypes (no copy), one that requires grad or lies off
    the CPU is refused naming the argument and the fix (torch's own error before)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3 + i, 8, generator=g) for i in (0, 2, 2))
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:  # bfloat16 is read through ml_dtypes
        pass
    else:
        got = pyattn.scaled_dot_product_attention(q, kb, vb)
        want = pyattn.scaled_dot_product_attention(q.numpy(), kb.float().numpy(), vb.float().numpy())
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match=r"key is a torch tensor that requires grad.*key.detach\(\)"):
        pyattn.scaled_dot_product_attention(q, k.clone().requires_grad_(True), v)
    with pytest.raises(ValueError, match=r"query is a torch tensor on meta.*query.cpu\(\)"):
        pyattn.scaled_dot_product_attention(torch.empty(1, 2, 3, 8, device="meta"), k, v)


def test_torch_tensors_as_masks_and_per_head_values():
    """attn_mask, sinks, alibi_slopes and kv_lens take torch tensors as query/key/value do: a
    bfloat16 tensor through ml_dtypes, one that requires grad (gpt-oss keeps its sinks as an
    nn.Parameter) or lies off the CPU refused naming the argument (torch's own error before)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (4, 6, 6))
    mask = torch.randn(1, 2, 4, 6, generator=g).to(torch.bfloat16)
    per_head = torch.tensor([0.5, -1.0]).to(torch.bfloat16)
    got = pyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, sinks=per_head, alibi_slopes=per_head)
    as_np = mask.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    ph = per_head.float().numpy()
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    want = pyattn.scaled_dot_product_attention(qn, kn, vn, attn_mask=as_np, sinks=ph, alibi_slopes=ph)
    np.testing.assert_array_equal(got, want)
    lens = torch.tensor([5])
    np.testing.assert_array_equal(
        pyattn.scaled_dot_product_attention(q, k, v, kv_lens=lens),
        pyattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), kv_lens=lens.numpy()),
    )
    sinks = torch.nn.Parameter(torch.zeros(2))
    grad_mask = torch.zeros(4, 6, requires_grad=True)
    for name, kw in (("sinks", dict(sinks=sinks)), ("attn_mask", dict(attn_mask=grad_mask))):
        with pytest.raises(TypeError, match=rf"{name} is a torch tensor that requires grad.*{name}.detach\(\)"):
            pyattn.scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(TypeError, match=r"sinks is a torch tensor that requires grad"):
        packed = [t[0].transpose(0, 1) for t in (q, k, v)]
        pyattn.varlen_attention(*packed, [0, 4], [0, 6], sinks=sinks)
    with pytest.raises(ValueError, match=r"alibi_slopes is a torch tensor on meta.*alibi_slopes.cpu\(\)"):
        pyattn.scaled_dot_product_attention(q, k, v, alibi_slopes=torch.empty(2, device="meta"))


def test_torch_tensors_in_merge_and_state_dicts():
    """merge_attention_states and MultiHeadAttention.load_state_dict take torch tensors as every
    other function does: one that requires grad or lies off the CPU is refused naming it and the
    fix, a bfloat16 one is read through ml_dtypes (torch's own errors before)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g = torch.Generator().manual_seed(2)
    outs, lses = (
        [torch.randn(2, 3, 4, generator=g) for _ in range(2)],
        [torch.randn(2, 3, generator=g) for _ in range(2)],
    )
    got = pyattn.merge_attention_states(outs, lses)
    want = pyattn.merge_attention_states([o.numpy() for o in outs], [x.numpy() for x in lses])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"outputs\[1\] is a torch tensor that requires grad.*outputs\[1\]\.detach\(\)"):
        pyattn.merge_attention_states([outs[0], outs[1].clone().requires_grad_(True)], lses)
    with pytest.raises(ValueError, match=r"lses is a torch tensor on meta.*lses\.cpu\(\)"):
        pyattn.merge_attention_states(torch.stack(outs), torch.empty(2, 2, 3, device="meta"))
    # bfloat16 computes as float32, as float16 does and as everywhere else (refused before)
    half = [o.to(torch.bfloat16) for o in outs]
    got = pyattn.merge_attention_states(half, [x.to(torch.bfloat16) for x in lses])
    want = pyattn.merge_attention_states(
        [o.float().numpy() for o in half], [x.to(torch.bfloat16).float().numpy() for x in lses]
    )
    assert got[0].dtype == np.float32 and got[1].dtype == np.float32
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(
        TypeError,
        match=r"outputs\[0\] must be a float array \(float16, bfloat16, float32 or float64\); got dtype int64",
    ):
        pyattn.merge_attention_states([o.to(torch.int64) for o in outs], lses)
    m = torch.nn.MultiheadAttention(8, 2).to(torch.bfloat16)
    p = pyattn.MultiHeadAttention(8, 2)
    p.load_state_dict(m.state_dict())
    w = m.in_proj_weight.detach().float().numpy()
    np.testing.assert_array_equal(p.state_dict()["in_proj_weight"], w.astype(np.float32))
    assert ml_dtypes.bfloat16 == pyattn.sinusoidal_positional_encoding(3, 4, dtype=ml_dtypes.bfloat16).dtype
