"""The small-call fast path (``_core.sdpa_small``): the everyday call handled whole in C.

It must give bitwise what the general Python path gives, take every call it is meant for, and
decline (return None) everything else, so that the general path's checks and error messages stay
the only definition of the contract."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyattn
from pyattn import _api, _core, reference


def _general(monkeypatch, *args, **kwargs):
    """The public function with the fast path switched off."""
    with monkeypatch.context() as mp:
        mp.setattr(_api, "_sdpa_small", lambda *a: None)
        return pyattn.scaled_dot_product_attention(*args, **kwargs)


_NO_VARIANT = dict(window=None, softcap=None, alibi_slopes=None, sinks=None, kv_lens=None, out=None)


@contextlib.contextmanager
def _fast_path_off():
    """The public function with the fast path switched off, where a test has no monkeypatch
    (hypothesis runs many examples in one test function)."""
    real = _api._sdpa_small
    _api._sdpa_small = lambda *a: None
    try:
        yield
    finally:
        _api._sdpa_small = real


def _small(q, k, v, is_causal=False, causal_align="top_left", scale=None, enable_gqa=False, return_lse=False, **var):
    var = _NO_VARIANT | var
    return _core.sdpa_small(q, k, v, is_causal, causal_align, scale, enable_gqa, return_lse, *var.values())


def _qkv(rng, lead, Lq, Lk, E, Ev, dtype=np.float32, hkv=None):
    kv_lead = lead if hkv is None else lead[:-1] + (hkv,)
    q = rng.standard_normal(lead + (Lq, E)).astype(dtype)
    k = rng.standard_normal(kv_lead + (Lk, E)).astype(dtype)
    v = rng.standard_normal(kv_lead + (Lk, Ev)).astype(dtype)
    return q, k, v


SHAPES = [
    ((1, 1), 1, 16, 64, 64),  # the smallest decode step
    ((1, 12), 1, 128, 64, 64),  # GPT-2 small, one token
    ((4, 12), 1, 300, 64, 64),
    ((2, 3), 7, 33, 16, 24),  # odd sizes, E != Ev
    ((3,), 70, 129, 8, 8),  # tile edges, one leading axis
    ((), 5, 9, 4, 4),  # no leading axis
    ((2, 2, 3), 4, 17, 8, 5),  # 5-D
]


@pytest.mark.parametrize("lead, Lq, Lk, E, Ev", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal, align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_bitwise_equal_to_the_general_path(monkeypatch, isa, lead, Lq, Lk, E, Ev, dtype, causal, align):
    rng = np.random.default_rng(Lq * 1000 + Lk)
    q, k, v = _qkv(rng, lead, Lq, Lk, E, Ev, dtype)
    got = _small(q, k, v, causal, align, None, False, True)
    assert got is not None, "the fast path declined an everyday call"
    out, lse = got
    want_out, want_lse = _general(monkeypatch, q, k, v, is_causal=causal, causal_align=align, return_lse=True)
    assert out.dtype == want_out.dtype == dtype and out.shape == want_out.shape
    assert out.flags.c_contiguous and lse.flags.c_contiguous
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    ref = reference.scaled_dot_product_attention(q, k, v, is_causal=causal, causal_align=align)
    np.testing.assert_allclose(out, ref, rtol=1e-4 if dtype == np.float32 else 1e-10, atol=1e-5)


@pytest.mark.parametrize("nlead", [31, 33, 40, 62])
def test_more_batch_axes_than_numpy_broadcasts(monkeypatch, nlead):
    """Arrays may have 64 axes, np.broadcast_shapes takes 32: both paths take any rank NumPy
    allows, with the same result (the general path raised RuntimeError past 32), and a mask or
    the merge of two such states changes nothing."""
    if nlead + 2 > getattr(np, "MAXDIMS", 32 if np.lib.NumpyVersion(np.__version__) < "2.0.0" else 64):
        pytest.skip(f"NumPy {np.__version__} holds at most 32 axes")
    rng = np.random.default_rng(nlead)
    lead = (1,) * (nlead - 2) + (2, 3)
    q = rng.standard_normal(lead + (3, 8)).astype(np.float32)
    k = rng.standard_normal((1,) * (nlead - 1) + (3, 5, 8)).astype(np.float32)
    v = rng.standard_normal(lead + (5, 4)).astype(np.float32)
    out, lse = pyattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.shape == lead + (3, 4)
    want, want_lse = _general(monkeypatch, q, k, v, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    masked = pyattn.scaled_dot_product_attention(q, k, v, attn_mask=np.ones((3, 5), bool))
    np.testing.assert_array_equal(masked, out)
    merged, merged_lse = pyattn.merge_attention_states([out, out], [lse, lse])
    np.testing.assert_allclose(merged, out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(merged_lse, lse + np.log(2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="batch dimensions are not broadcastable"):
        _general(monkeypatch, q, k[..., :2, :, :], v)


@pytest.mark.parametrize("Hq, Hkv", [(8, 2), (32, 8), (4, 4), (6, 1)])
def test_grouped_query_heads(monkeypatch, Hq, Hkv):
    rng = np.random.default_rng(Hq + Hkv)
    q, k, v = _qkv(rng, (2, Hq), 1, 200, 32, 32, hkv=Hkv)
    out = _small(q, k, v, False, "top_left", 0.3, True, False)
    assert out is not None
    np.testing.assert_array_equal(out, _general(monkeypatch, q, k, v, scale=0.3, enable_gqa=True))
    # the public function takes the fast path and gives the same
    np.testing.assert_array_equal(pyattn.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True), out)


def test_strided_views_and_scales(monkeypatch):
    """Leading and row strides of any sign are the kernel's to read, as in the general path."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((6, 4, 120, 16)).astype(np.float32)
    q = base[::2, ::-1, 3:10]  # strided batch, reversed heads, a row slice
    k = base[1::2, :, 79::-2]  # reversed, strided rows
    k = np.ascontiguousarray(k.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)  # leading axes not in C order
    v = base[:6:2, :, ::3]  # strided rows
    for scale in (None, 0.25, 2, np.float64(0.5)):
        got = _small(q, k, v, True, "bottom_right", scale, False, False)
        assert got is not None, scale
        want = _general(monkeypatch, q, k, v, is_causal=True, causal_align="bottom_right", scale=scale)
        np.testing.assert_array_equal(got, want)


def _decline_cases():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, (2, 4), 3, 8, 16, 16)
    f16 = lambda a: a.astype(np.float16)  # noqa: E731
    cases = {
        "broadcast batch": (q, k[:1], v[:1], {}),
        "fewer axes": (q, k[0], v[0], {}),
        "mixed dtypes": (q, k.astype(np.float64), v, {}),
        "float16 query": (f16(q), k, v, {}),
        "float16 key, float32 value": (q, f16(k), v, {}),
        "strided feature axis": (q, np.repeat(k, 2, axis=-1)[..., ::2], v, {}),
        "big-endian": (q.astype(">f4"), k, v, {}),
        "a list": (q.tolist(), k, v, {}),
        "a subclass": (q.view(np.matrix) if q.ndim == 2 else q.view(_Sub), k, v, {}),
        "empty keys": (q, k[:, :, :0], v[:, :, :0], {}),
        "no queries": (q[:, :, :0], k, v, {}),
        "integer is_causal": (q, k, v, {"is_causal": 1}),
        "unknown causal_align": (q, k, v, {"causal_align": "diagonal"}),
        "float32 scale": (q, k, v, {"scale": np.float32(0.5)}),
        "huge int scale": (q, k, v, {"scale": 10**400}),
        # a float subclass whose __float__ says otherwise: float() (the general path) calls it
        "scale a float subclass": (q, k, v, {"scale": _OtherFloat(0.5)}),
        "softcap a float subclass": (q, k, v, {"softcap": _OtherFloat(30.0)}),
        # cap <= DBL_MAX / log2(e), but cap * log2(e) overflows: the general path refuses it (the
        # fast path took it, and every output was NaN)
        "softcap at float64's limit": (*(a.astype(np.float64) for a in (q, k, v)), {"softcap": 1.2460659279417838e308}),
        "string scale": (q, k, v, {"scale": "0.5"}),
        "gqa not a multiple": (q, k[:, :3], v[:, :3], {"enable_gqa": True}),
        "gqa without heads": (q[0, 0], k[0, 0], v[0, 0], {"enable_gqa": True}),
        "key feature size": (q, k[..., :8], v, {}),
        "value length": (q, k, v[:, :, :5], {}),
        "integer return_lse": (q, k, v, {"return_lse": 1}),
        # score variants in forms the Python layer defines (or rejects): it takes over
        "window as a list": (q, k, v, {"window": [2, 0]}),
        "window of three": (q, k, v, {"window": (2, 0, 1)}),
        "numpy window side": (q, k, v, {"window": (np.int64(2), 0)}),
        "bool window side": (q, k, v, {"window": (True, 0)}),
        "negative window side": (q, k, v, {"window": (-1, 0)}),
        "float window side": (q, k, v, {"window": (1.5, 0)}),
        "numpy float32 softcap": (q, k, v, {"softcap": np.float32(5.0)}),
        "bool softcap": (q, k, v, {"softcap": True}),
        "zero softcap": (q, k, v, {"softcap": 0.0}),
        "infinite softcap": (q, k, v, {"softcap": float("inf")}),
        "nan softcap": (q, k, v, {"softcap": float("nan")}),
        "huge int softcap": (q, k, v, {"softcap": 10**400}),
        "slopes as a list": (q, k, v, {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}),
        "integer slopes": (q, k, v, {"alibi_slopes": np.arange(4)}),
        "float16 slopes": (q, k, v, {"alibi_slopes": np.ones(4, np.float16)}),
        "big-endian slopes": (q, k, v, {"alibi_slopes": np.ones(4, ">f8")}),
        "slopes per batch and head": (q, k, v, {"alibi_slopes": np.ones((2, 4))}),
        "one slope": (q, k, v, {"alibi_slopes": np.ones(1)}),
        "slopes of the wrong length": (q, k, v, {"alibi_slopes": np.ones(3)}),
        "sinks as a scalar": (q, k, v, {"sinks": 0.5}),
        "sinks of the wrong length": (q, k, v, {"sinks": np.zeros(5)}),
        "kv_lens as a list": (q, k, v, {"kv_lens": [8, 5]}),
        "float kv_lens": (q, k, v, {"kv_lens": np.array([8.0, 5.0])}),
        "int16 kv_lens": (q, k, v, {"kv_lens": np.array([8, 5], np.int16)}),
        "kv_lens of one": (q, k, v, {"kv_lens": np.array([5])}),
        "kv_lens past Lk": (q, k, v, {"kv_lens": np.array([9, 5])}),
        "negative kv_lens": (q, k, v, {"kv_lens": np.array([-1, 5])}),
        "huge unsigned kv_lens": (q, k, v, {"kv_lens": np.array([2**63 + 1, 5], np.uint64)}),
        "kv_lens of a 3-D call": (q[0], k[0], v[0], {"kv_lens": np.array([8, 5, 3, 1])}),
        "slopes of a 2-D call": (q[0, 0], k[0, 0], v[0, 0], {"alibi_slopes": np.ones(1)}),
        # an out the kernel cannot write as it is (the general path copies in, or refuses it)
        "out of another dtype": (q, k, v, {"out": np.empty(q.shape, np.float64)}),
        "out of another shape": (q, k, v, {"out": np.empty((2, 4, 3, 8), np.float32)}),
        "out broadcasting": (q, k, v, {"out": np.empty((1, 4, 3, 16), np.float32)}),
        "out with fewer axes": (q, k, v, {"out": np.empty((8, 3, 16), np.float32)}),
        "out read-only": (q, k, v, {"out": np.broadcast_to(np.zeros(16, np.float32), q.shape)}),
        "out strided features": (q, k, v, {"out": np.empty(q.shape[:-1] + (32,), np.float32)[..., ::2]}),
        "out a list": (q, k, v, {"out": np.zeros(q.shape).tolist()}),
        "out a subclass": (q, k, v, {"out": np.empty(q.shape, np.float32).view(_Sub)}),
        "out big-endian": (q, k, v, {"out": np.empty(q.shape, ">f4")}),
    }
    cases["misaligned"] = (_misaligned(q), k, v, {})
    cases["out misaligned"] = (q, k, v, {"out": _misaligned(np.zeros_like(q))})
    # the same rows reached twice: threads would race on them, so the result goes through a copy
    rows = np.empty((2, 4, 1, 16), np.float32)
    cases["out with a zero stride"] = (
        q,
        k,
        v,
        {"out": np.lib.stride_tricks.as_strided(rows, q.shape, (256, 64, 0, 4))},
    )
    # rows that overlap (4 elements apart, 16 long): the same elements reached twice
    over = np.empty(2 * 4 * 3 * 4 + 12, np.float32)
    cases["out whose rows overlap"] = (
        q,
        k,
        v,
        {"out": np.lib.stride_tricks.as_strided(over, q.shape, (192, 48, 16, 4))},
    )
    with np.errstate(all="ignore"):
        warned = np.broadcast_arrays(np.empty((1, 4, 3, 16), np.float32), q)[0]
    cases["out from broadcast_arrays"] = (q, k, v, {"out": warned})
    return cases


def _misaligned(a):
    """A writable copy of `a` whose data is not aligned to its element size."""
    m = np.frombuffer(bytearray(a.nbytes + 1), np.uint8)[1:].view(a.dtype).reshape(a.shape)
    m[...] = a
    return m


class _Sub(np.ndarray):
    pass


class _OtherFloat(float):
    def __float__(self):
        return 2.0 * super().__float__()


# One case's out comes from broadcast_arrays: NumPy warns when its writeable flag is read and
# when it is written, as it would for any NumPy function given it as out
@pytest.mark.filterwarnings("ignore:future versions will not create a writeable array:FutureWarning")
@pytest.mark.filterwarnings("ignore:Numpy has detected that you:DeprecationWarning")
@pytest.mark.parametrize("name", sorted(_decline_cases()))
def test_declines_what_it_is_not_for(monkeypatch, name):
    """Every other call returns None from the fast path, and the public function gives what the
    general path gives: the same result or the same error."""
    q, k, v, kw = _decline_cases()[name]
    args = dict(is_causal=False, causal_align="top_left", scale=None, enable_gqa=False, return_lse=False)
    args = args | _NO_VARIANT | kw
    assert _core.sdpa_small(q, k, v, *args.values()) is None
    try:
        want = _general(monkeypatch, q, k, v, **kw)
    except Exception as e:  # noqa: BLE001 - the same error, whatever it is
        with pytest.raises(type(e), match=None) as got:
            pyattn.scaled_dot_product_attention(q, k, v, **kw)
        assert str(got.value) == str(e)
        return
    # copied: with out, both calls return (and write) the same array
    want = tuple(np.array(w) for w in want) if isinstance(want, tuple) else np.array(want)
    if "out" in kw:
        kw["out"][...] = np.nan
    got = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "kw",
    [
        {"attn_mask": np.ones((3, 8), bool)},
        {"return_weights": True},
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_keywords_outside_the_fast_path_reach_the_general_path(monkeypatch, kw):
    calls = []
    real = _api._sdpa_small
    monkeypatch.setattr(_api, "_sdpa_small", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, (2, 4), 3, 8, 16, 16)
    got = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    assert not calls
    ref = reference.scaled_dot_product_attention(q, k, v, **{n: x for n, x in kw.items() if n != "out"})
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_the_public_function_takes_it(monkeypatch):
    calls = []
    real = _api._sdpa_small
    monkeypatch.setattr(_api, "_sdpa_small", lambda *a: calls.append(a) or real(*a))
    q, k, v = _qkv(np.random.default_rng(2), (1, 12), 1, 128, 64, 64)
    pyattn.scaled_dot_product_attention(q, k, v)
    pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_align="bottom_right", return_lse=True)
    assert len(calls) == 2


def test_wrong_argument_count_is_a_type_error():
    with pytest.raises(TypeError, match="14 positional"):
        _core.sdpa_small(1, 2, 3)


def _split_heads_out(lead, Lq, Ev, dtype):
    """An output laid out (..., Lq, H, Ev) and viewed as (..., H, Lq, Ev), as the
    MultiHeadAttention layer hands it over (its context rows are tokens)."""
    base = np.full(lead[:-1] + (Lq, lead[-1], Ev), np.nan, dtype)
    return np.swapaxes(base, -2, -3)


@pytest.mark.parametrize("lead, Lq, Lk, E, Ev", [s for s in SHAPES if s[0]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "split heads", "reversed rows"])
def test_out_is_written_in_place(monkeypatch, isa, lead, Lq, Lk, E, Ev, dtype, layout):
    """An out the kernel can write is taken by the fast path and written in place, bitwise what
    the general path writes into the same layout (with lse, causal bottom-right)."""
    rng = np.random.default_rng(Lq + 31 * Lk)
    q, k, v = _qkv(rng, lead, Lq, Lk, E, Ev, dtype)

    def make():
        if layout == "contiguous":
            return np.full(lead + (Lq, Ev), np.nan, dtype)
        if layout == "split heads":
            return _split_heads_out(lead, Lq, Ev, dtype)
        return np.full(lead + (Lq, Ev), np.nan, dtype)[..., ::-1, :]

    out = make()
    got = _small(q, k, v, True, "bottom_right", None, False, True, out=out)
    assert got is not None, "the fast path declined an out it can write"
    assert got[0] is out
    want_out = make()
    want = _general(monkeypatch, q, k, v, is_causal=True, causal_align="bottom_right", return_lse=True, out=want_out)
    assert want[0] is want_out
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(got[1], want[1])
    # the public function takes it too
    calls = []
    real = _api._sdpa_small
    monkeypatch.setattr(_api, "_sdpa_small", lambda *a: calls.append(a) or real(*a))
    again = make()
    assert pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, causal_align="bottom_right", out=again) is again
    assert len(calls) == 1
    np.testing.assert_array_equal(again, want_out)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_out_sharing_memory_with_an_input_is_left_to_the_general_path(monkeypatch, which):
    """An out that overlaps an input: the fast path declines it, and the public function gives
    the result of the inputs as they were (the general path computes into a temporary)."""
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, (2, 3), 5, 5, 8, 8)
    inputs = {"query": q, "key": k, "value": v}
    out = inputs[which]
    want = reference.scaled_dot_product_attention(q.copy(), k.copy(), v.copy(), is_causal=True)
    assert _small(q, k, v, True, out=out) is None
    got = pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, out=out)
    assert got is out
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _variants(rng, B, Hq, Lk, dtype):
    """Every score variant in the plain forms the fast path takes, one of each input dtype."""
    other = np.float64 if dtype == np.float32 else np.float32
    return {
        "window": {"window": (3, None)},
        "window_both": {"window": (5, 2)},
        "window_huge": {"window": (10**30, 0)},
        "softcap": {"softcap": 2.5},
        "softcap_int": {"softcap": 3},
        "alibi": {"alibi_slopes": (2.0 ** -np.arange(1, Hq + 1)).astype(dtype)},
        "alibi_other_dtype": {"alibi_slopes": (2.0 ** -np.arange(1, Hq + 1)).astype(other)[::-1]},
        "sinks": {"sinks": rng.standard_normal(Hq).astype(other)},
        "kv_lens": {"kv_lens": rng.integers(0, Lk + 1, B).astype(np.int32)},
        "kv_lens_u64": {"kv_lens": np.full(B, Lk, np.uint64)},
        "all": {
            "window": (7, 1),
            "softcap": 4.0,
            "alibi_slopes": np.linspace(0.1, 0.9, Hq),
            "sinks": np.linspace(-1.0, 1.0, Hq).astype(dtype),
            "kv_lens": rng.integers(0, Lk + 1, B),
        },
    }


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Lq, Lk, gqa", [(1, 40, False), (1, 300, True), (9, 33, False), (70, 129, True)])
@pytest.mark.parametrize("causal, align", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_variants_bitwise_equal_to_the_general_path(monkeypatch, isa, dtype, Lq, Lk, gqa, causal, align):
    """The score variants through the fast path: taken, and bitwise what the general path gives
    (both decode and prefill kernels, grouped heads, the output and lse)."""
    rng = np.random.default_rng(Lq * 7 + Lk)
    B, Hq = 3, 4
    q, k, v = _qkv(rng, (B, Hq), Lq, Lk, 16, 12, dtype, hkv=2 if gqa else None)
    for name, var in _variants(rng, B, Hq, Lk, dtype).items():
        got = _small(q, k, v, causal, align, None, gqa, True, **var)
        assert got is not None, f"the fast path declined {name}"
        kw = dict(is_causal=causal, causal_align=align, enable_gqa=gqa, return_lse=True, **var)
        want = _general(monkeypatch, q, k, v, **kw)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w, err_msg=name)
        np.testing.assert_array_equal(pyattn.scaled_dot_product_attention(q, k, v, **kw)[0], got[0])


def test_threads_and_results_do_not_depend_on_the_thread_count():
    q, k, v = _qkv(np.random.default_rng(3), (2, 8), 1, 4096, 64, 64)
    with pyattn.num_threads(1):
        one = pyattn.scaled_dot_product_attention(q, k, v)
    with pyattn.num_threads(2):
        two = pyattn.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(one, two)


#: what every property test of the fast path draws besides its shapes
_CALL = dict(causal=st.booleans(), bottom_right=st.booleans(), f64=st.booleans(), seed=st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple),
    Lq=st.integers(1, 20),
    Lk=st.integers(1, 80),
    E=st.integers(1, 40),
    Ev=st.integers(1, 40),
    lse=st.booleans(),
    **_CALL,
)
def test_property_bitwise_equal(lead, Lq, Lk, E, Ev, causal, bottom_right, f64, lse, seed):
    dtype = np.float64 if f64 else np.float32
    q, k, v = _qkv(np.random.default_rng(seed), lead, Lq, Lk, E, Ev, dtype)
    align = "bottom_right" if bottom_right else "top_left"
    got = _small(q, k, v, causal, align, None, False, lse)
    assert got is not None
    with _fast_path_off():
        want = pyattn.scaled_dot_product_attention(q, k, v, is_causal=causal, causal_align=align, return_lse=lse)
    for g, w in zip(got if lse else (got,), want if lse else (want,)):
        np.testing.assert_array_equal(g, w)


@settings(max_examples=80, deadline=None)
@given(
    B=st.integers(1, 3),
    Hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    Lq=st.integers(1, 40),
    Lk=st.integers(1, 90),
    E=st.integers(1, 24),
    window=st.one_of(
        st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 50)), st.one_of(st.none(), st.integers(0, 50)))
    ),
    softcap=st.one_of(st.none(), st.floats(0.5, 60.0)),
    alibi=st.booleans(),
    sinks=st.booleans(),
    kv_lens=st.booleans(),
    **_CALL,
)
def test_property_variants_bitwise_equal(
    B, Hkv, group, Lq, Lk, E, causal, bottom_right, f64, window, softcap, alibi, sinks, kv_lens, seed
):
    """Any mix of variants the fast path takes gives bitwise the general path's output and lse."""
    dtype = np.float64 if f64 else np.float32
    rng = np.random.default_rng(seed)
    Hq = Hkv * group
    q, k, v = _qkv(rng, (B, Hq), Lq, Lk, E, E, dtype, hkv=Hkv if group > 1 else None)
    var = dict(
        window=window,
        softcap=softcap,
        alibi_slopes=rng.uniform(0.0, 1.0, Hq).astype(dtype) if alibi else None,
        sinks=rng.standard_normal(Hq) if sinks else None,
        kv_lens=rng.integers(0, Lk + 1, B) if kv_lens else None,
    )
    align = "bottom_right" if bottom_right else "top_left"
    got = _small(q, k, v, causal, align, None, group > 1, True, **var)
    assert got is not None
    with _fast_path_off():
        want = pyattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, causal_align=align, enable_gqa=group > 1, return_lse=True, **var
        )
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ----------------------------------------------------------------------------- kvcache_small

from pyattn import _kvcache  # noqa: E402


def _cache_case(rng, *, B=3, Hq=8, Hkv=2, Lq=1, E=16, Ev=12, Lmax=40, paged=False, dtype=np.float32, cdt=None):
    """Query and new tokens of `dtype`, the caches of `cdt` (default: `dtype`)."""
    cdt = dtype if cdt is None else cdt
    lens = rng.integers(0, Lmax - Lq, B).astype(np.int64)
    q = rng.standard_normal((B, Hq, Lq, E)).astype(dtype)
    kn = rng.standard_normal((B, Hkv, Lq, E)).astype(dtype)
    vn = rng.standard_normal((B, Hkv, Lq, Ev)).astype(dtype)
    if paged:
        bs, per = 8, -(-Lmax // 8)
        table = rng.permutation(B * per + 3)[: B * per].reshape(B, per).astype(np.int32)
        kc = rng.standard_normal((B * per + 3, Hkv, bs, E)).astype(cdt)
        vc = rng.standard_normal((B * per + 3, Hkv, bs, Ev)).astype(cdt)
    else:
        table = None
        kc = rng.standard_normal((B, Hkv, Lmax, E)).astype(cdt)
        vc = rng.standard_normal((B, Hkv, Lmax, Ev)).astype(cdt)
    return q, kc, vc, lens, kn, vn, table


def _half_types():
    """float16, and ml_dtypes.bfloat16 where ml_dtypes is installed."""
    try:
        import ml_dtypes
    except ImportError:
        return [np.dtype(np.float16)]
    return [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _scales(rng, kc, vc):
    """Positive float32 scales for an int8 cache pair (laid out like it without the feature axis)."""
    return [rng.uniform(0.001, 0.05, c.shape[:3]).astype(np.float32) for c in (kc, vc)]


def _general_cache(q, kc, vc, lens, kn, vn, table, *, scale=None, is_causal=True, return_lse=False, ks=None, vs=None):
    return _kvcache._cache_attention(
        q, kc, vc, lens, k_new=kn, v_new=vn, new_lens=None, block_table=table, k_scale=ks, v_scale=vs,
        scale=scale, is_causal=is_causal, window=None, softcap=None, alibi_slopes=None, sinks=None,
        return_lse=return_lse, out=None,
    )  # fmt: skip


_CACHE_TYPES = [(np.float32, None), (np.float64, None)] + [(np.float32, h) for h in _half_types() + [np.int8]]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("append", [True, False], ids=["append", "read"])
@pytest.mark.parametrize("dtype, cdt", _CACHE_TYPES)
@pytest.mark.parametrize("Lq, Hq, Hkv, causal", [(1, 8, 2, True), (3, 4, 4, True), (5, 6, 3, False), (1, 1, 1, True)])
def test_kvcache_bitwise_equal_to_the_general_path(isa, paged, append, dtype, cdt, Lq, Hq, Hkv, causal):
    """Float caches of the query's type, and float16 / bfloat16 caches (written by rounding to
    nearest even, as NumPy casts) and int8 ones (quantised as _kvcache._quantize does, with their
    scales) with a float32 query."""
    rng = np.random.default_rng(Lq * 100 + Hq + Hkv)
    case = _cache_case(rng, Hq=Hq, Hkv=Hkv, Lq=Lq, paged=paged, dtype=dtype, cdt=cdt)
    q, kc, vc, lens, kn, vn, table = case
    ks, vs = _scales(rng, kc, vc) if cdt == np.int8 else (None, None)
    if not append:
        kn = vn = None
    before = [None if a is None else a.copy() for a in (kc, vc, ks, vs)]
    got = _core.kvcache_small(q, kc, vc, lens, kn, vn, table, None, causal, True, ks, vs)
    assert got is not None, "the fast path declined an everyday call"
    kc2, vc2, ks2, vs2 = before
    want = _general_cache(q, kc2, vc2, lens, kn, vn, table, is_causal=causal, return_lse=True, ks=ks2, vs=vs2)
    for a, b in ((kc, kc2), (vc, vc2), (ks, ks2), (vs, vs2)):  # the same bytes in the same places
        if a is not None:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_kvcache_public_function_and_kvcache_class_take_it(monkeypatch):
    calls = []
    real = _kvcache._kvcache_small
    monkeypatch.setattr(_kvcache, "_kvcache_small", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(7)
    q, kc, vc, lens, kn, vn, _ = _cache_case(rng)
    pyattn.kvcache_attention(q, kc, vc, lens, k_new=kn, v_new=vn)
    assert len(calls) == 1
    for kw in ({"max_len": 64}, {"block_size": 4}):
        calls.clear()
        cache = pyattn.KVCache(3, 2, 16, v_head_dim=12, **kw)
        steps = [_cache_case(rng) for _ in range(6)]
        for q, _, _, _, kn, vn, _ in steps:
            out = cache.attend(q, kn, vn)
        assert len(calls) == 6, kw
        np.testing.assert_array_equal(cache.lens, [6, 6, 6])
        # the last step against the reference over every token appended
        keys = np.concatenate([s[4] for s in steps], axis=2)
        vals = np.concatenate([s[5] for s in steps], axis=2)
        ref = reference.scaled_dot_product_attention(
            steps[-1][0], keys, vals, is_causal=True, causal_align="bottom_right", enable_gqa=True
        )
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _kvcache_decline_cases():
    rng = np.random.default_rng(11)
    q, kc, vc, lens, kn, vn, table = _cache_case(rng, Lmax=40)
    _, pkc, pvc, _, _, _, ptable = _cache_case(rng, Lmax=40, paged=True)
    ro = kc.copy()
    ro.flags.writeable = False
    base = dict(query=q, k_cache=kc, v_cache=vc, cache_lens=lens, k_new=kn, v_new=vn, block_table=None)
    base |= dict(k_scale=None, v_scale=None)
    over = lens.copy()
    over[1] = 40
    bad_table = ptable.copy()
    bad_table[0, 0] = pkc.shape[0]
    h16 = dict(base, k_cache=kc.astype(np.float16), v_cache=vc.astype(np.float16))
    nan_new, big_new = kn.copy(), kn.copy()
    nan_new[0, 0, 0, 3] = np.nan
    big_new[1, 1, 0, 0] = -65504.0  # representable, but the fast path leaves the edge to NumPy
    i8 = dict(base, k_cache=kc.astype(np.int8), v_cache=vc.astype(np.int8))
    ks, vs = _scales(rng, kc, vc)
    ro_scales = ks.copy()
    ro_scales.flags.writeable = False
    inf_new = kn.copy()
    inf_new[2, 0, 0, 5] = np.inf
    tiny_new = kn.copy()
    tiny_new[1, 0, 0] = 1e-40  # max|x| / 127 is subnormal: NumPy's division decides (it may warn)
    # lengths and a block table that live inside memory the append writes (read while writing)
    ks_lens = ks.copy()
    lens_in_scales = ks_lens.reshape(-1)[: 2 * len(lens)].view(np.int64)
    lens_in_scales[:] = lens
    kc_lens = kc.copy()
    lens_in_cache = kc_lens.reshape(-1)[: 2 * len(lens)].view(np.int64)
    lens_in_cache[:] = lens
    pkc_t = pkc.copy()
    table_in_cache = pkc_t.reshape(-1)[: ptable.size].view(np.int32).reshape(ptable.shape)
    table_in_cache[:] = ptable
    cases = {
        "int8 cache without scales": i8,
        "int8 cache, one scale": dict(i8, k_scale=ks),
        "int8 cache, float64 scales": dict(i8, k_scale=ks.astype(np.float64), v_scale=vs),
        "int8 cache, scales of another shape": dict(i8, k_scale=ks[:, :, :-1], v_scale=vs),
        "int8 cache, read-only scales": dict(i8, k_scale=ro_scales, v_scale=vs),
        "int8 cache, one scales array for both": dict(i8, k_scale=ks, v_scale=ks),
        "NaN into an int8 cache": dict(i8, k_new=nan_new, k_scale=ks, v_scale=vs),
        "inf into an int8 cache": dict(i8, k_new=inf_new, k_scale=ks, v_scale=vs),
        "scales with a float cache": dict(base, k_scale=ks, v_scale=vs),
        "a row too small to scale into an int8 cache": dict(i8, k_new=tiny_new, k_scale=ks, v_scale=vs),
        "lens inside the scales": dict(i8, cache_lens=lens_in_scales, k_scale=ks_lens, v_scale=vs),
        "lens inside the cache": dict(base, k_cache=kc_lens, cache_lens=lens_in_cache),
        "block table inside the cache": dict(base, k_cache=pkc_t, v_cache=pvc, block_table=table_in_cache),
        "float16 cache, float64 query": dict(h16, query=q.astype(np.float64)),
        "float16 cache, float16 new tokens": dict(h16, k_new=kn.astype(np.float16), v_new=vn.astype(np.float16)),
        "float16 and float32 caches": dict(h16, v_cache=vc),
        "NaN into a float16 cache": dict(h16, k_new=nan_new),
        "65504 into a float16 cache": dict(h16, k_new=big_new),
        "float64 cache, float32 query": dict(base, k_cache=kc.astype(np.float64), v_cache=vc.astype(np.float64)),
        "float64 new tokens": dict(base, k_new=kn.astype(np.float64)),
        "only k_new": dict(base, v_new=None),
        "lens a list": dict(base, cache_lens=lens.tolist()),
        "lens int32": dict(base, cache_lens=lens.astype(np.int32)),
        "negative lens": dict(base, cache_lens=-lens - 1),
        "overflow": dict(base, cache_lens=over),
        "read-only cache": dict(base, k_cache=ro),
        "k_new inside the cache": dict(base, k_new=kc[:, :, 30:31]),
        "3-D query": dict(base, query=q[0]),
        "query heads not a multiple": dict(base, query=q[:, :3]),
        "block table int64": dict(base, k_cache=pkc, v_cache=pvc, block_table=ptable.astype(np.int64)),
        "block outside the cache": dict(base, k_cache=pkc, v_cache=pvc, block_table=bad_table),
        "strided new feature axis": dict(base, k_new=np.repeat(kn, 2, axis=-1)[..., ::2]),
        # one element reached through two indices (heads overlapping rows): the general path refuses it
        "self-overlapping cache": dict(
            base,
            k_cache=np.lib.stride_tricks.as_strided(
                kc, kc.shape, (kc.strides[0], kc.strides[2], kc.strides[2], kc.strides[3])
            ),
        ),
    }
    if len(_half_types()) > 1:
        bf = _half_types()[1]
        b16 = dict(base, k_cache=kc.astype(bf), v_cache=vc.astype(bf))
        cases["NaN into a bfloat16 cache"] = dict(b16, v_new=np.where(np.isnan(nan_new[..., :12]), np.nan, vn))
        cases["bfloat16 and float16 caches"] = dict(b16, v_cache=vc.astype(np.float16))
    return cases


@pytest.mark.parametrize("name", sorted(_kvcache_decline_cases()))
def test_kvcache_declines_and_writes_nothing(name):
    """Every other call returns None before writing anything (kvcache_attention then runs its
    general path, whose results and errors tests/test_kvcache.py covers)."""
    kw = _kvcache_decline_cases()[name]
    held = [kw[n] for n in ("k_cache", "v_cache", "k_scale", "v_scale") if kw[n] is not None]
    before = [a.copy() for a in held]
    r = _core.kvcache_small(
        kw["query"], kw["k_cache"], kw["v_cache"], kw["cache_lens"], kw["k_new"], kw["v_new"], kw["block_table"],
        None, True, False, kw["k_scale"], kw["v_scale"],
    )  # fmt: skip
    assert r is None
    for a, b in zip(held, before):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_kvcache_other_keywords_reach_the_general_path(monkeypatch):
    calls = []
    real = _kvcache._kvcache_small
    monkeypatch.setattr(_kvcache, "_kvcache_small", lambda *a: calls.append(a) or real(*a))
    rng = np.random.default_rng(3)
    q, kc, vc, lens, kn, vn, _ = _cache_case(rng)
    for kw in ({"window": (4, 0)}, {"softcap": 3.0}, {"sinks": np.zeros(8)}, {"alibi_slopes": np.ones(8)}):
        pyattn.kvcache_attention(q, kc.copy(), vc.copy(), lens, k_new=kn, v_new=vn, **kw)
    pyattn.kvcache_attention(q, kc.copy(), vc.copy(), lens, k_new=kn, v_new=vn, out=np.empty((3, 8, 1, 12), np.float32))
    assert not calls


def test_kvcache_small_argument_count():
    with pytest.raises(TypeError, match="12 positional"):
        _core.kvcache_small(1, 2)


@pytest.mark.parametrize("cdt", _half_types(), ids=str)
def test_half_cache_writes_round_as_numpy_casts(cdt):
    """Tokens written into a float16 / bfloat16 cache by the fast path hold the bytes NumPy's (or
    ml_dtypes') cast gives: random bit patterns over the whole range, and the rounding edges
    (ties, the subnormals, zero's sign, the largest values)."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, (4, 1024), dtype=np.uint64).astype(np.uint32).view(np.float32)
    x[1] = (x[1].view(np.uint32) & np.uint32(0x8FFFFFFF) | np.uint32(0x30000000)).view(np.float32)  # near half's range
    edges = [0.0, -0.0, 2.0**-25, -(2.0**-25), 2.0**-25 * 1.0000001, 2.0**-24, 2.0**-24 * 1.5, 2.0**-24 * 2.5,
             2.0**-14, 2.0**-14 * (1 - 2.0**-11), 65503.9, 65500.0, 1e-45, 1.17e-38, 3e38, -3e38, 1.0 + 2.0**-8,
             1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11]  # fmt: skip
    x[2, : len(edges)] = edges
    limit = 65504.0 if cdt == np.float16 else np.inf
    x[~(np.abs(x) < limit)] = 0.0  # NaN, inf and float16 overflow: declined (test above)
    E = 16
    new = x.reshape(1, 1, -1, E)
    L = new.shape[2]
    kc, vc = np.zeros((1, 1, L, E), cdt), np.zeros((1, 1, L, E), cdt)
    q = np.zeros((1, 1, L, E), np.float32)
    r = _core.kvcache_small(q, kc, vc, np.zeros(1, np.int64), new, new, None, None, True, False, None, None)
    assert r is not None
    np.testing.assert_array_equal(kc.view(np.uint16), new.astype(cdt).view(np.uint16))
    np.testing.assert_array_equal(vc.view(np.uint16), new.astype(cdt).view(np.uint16))


@pytest.mark.parametrize("cdt", _half_types(), ids=str)
@pytest.mark.parametrize("lead, Lq, Lk, E, Ev", SHAPES[:5])
@pytest.mark.parametrize("causal, align", [(False, "top_left"), (True, "bottom_right")])
def test_half_kv_bitwise_equal_to_the_general_path(monkeypatch, isa, cdt, lead, Lq, Lk, E, Ev, causal, align):
    """float16 / bfloat16 key and value with a float32 query: the fast path reads them as they
    are, as the general path does, with and without variants."""
    rng = np.random.default_rng(Lq + Lk)
    q, k, v = _qkv(rng, lead, Lq, Lk, E, Ev)
    k, v = k.astype(cdt), v.astype(cdt)
    for var in ({}, {"softcap": 20.0, "window": (7, None)}):
        got = _small(q, k, v, causal, align, return_lse=True, **var)
        assert got is not None, "the fast path declined half-precision K/V"
        want = _general(monkeypatch, q, k, v, is_causal=causal, causal_align=align, return_lse=True, **var)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == np.float32 and g.shape == w.shape
            np.testing.assert_array_equal(g, w)


def test_half_kv_declines_other_mixes():
    """Half K/V only as a pair of one type under a float32 query; the general path defines the
    rest (it upcasts)."""
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, (1, 2), 1, 8, 16, 16)
    halves = _half_types()
    h = halves[0]
    mixes = [(q, k.astype(h), v), (q, k, v.astype(h)), (q.astype(np.float64), k.astype(h), v.astype(h)),
             (q.astype(h), k.astype(h), v.astype(h))]  # fmt: skip
    if len(halves) > 1:
        mixes.append((q, k.astype(halves[0]), v.astype(halves[1])))
    for args in mixes:
        assert _small(*args) is None, [a.dtype for a in args]
