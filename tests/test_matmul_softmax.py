"""matmul, softmax, sinusoidal_positional_encoding, additive_attention vs the reference."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import DTYPES, assert_close, bool_mask, make_mask, randn, relayout, run_python

import pyattn
from pyattn import reference

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])

# --------------------------------------------------------------------------- matmul

# (m, k, n): every edge size appears in each slot, not the whole product
MKN = [
    (1, 1, 1),
    (2, 5, 7),
    (5, 7, 2),
    (7, 2, 5),
    (8, 8, 8),
    (9, 16, 17),
    (15, 17, 16),
    (16, 9, 15),
    (17, 31, 33),
    (31, 32, 47),
    (32, 33, 48),
    (33, 47, 49),
    (47, 48, 63),
    (48, 49, 64),
    (49, 63, 65),
    (63, 64, 127),
    (64, 65, 129),
    (65, 127, 255),
    (127, 129, 257),
    (129, 255, 300),
    (255, 257, 1),
    (257, 300, 2),
    (300, 1, 31),
    (1, 300, 257),
    (300, 255, 1),
    (2, 129, 300),
    (257, 8, 9),
]


def mm_check(a, b, dtype, **kw):
    got = pyattn.matmul(a, b, **kw)
    want = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    assert_close(got, want, dtype)
    assert_close(np.asarray(reference.matmul(a, b)), want, np.float64)
    return got


@dtype_param
@pytest.mark.parametrize("m,k,n", MKN)
def test_matmul_shapes(isa, dtype, m, k, n, rng):
    a, b = randn(rng, (m, k), dtype), randn(rng, (k, n), dtype)
    mm_check(a, b, dtype)


# Large enough for a thread team: one thread and two take different panel orders (columns or
# rows, A packed or read in place when n <= 64), k crosses the KC block (256), rows and columns
# end in partial tiles. (333, 517, 129) has enough column panels for a column split on AVX2,
# but they divide unevenly, so two threads split its rows.
@dtype_param
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "m,k,n", [(515, 300, 17), (515, 600, 64), (515, 257, 65), (97, 520, 400), (1030, 64, 48), (333, 517, 129)]
)
@pytest.mark.parametrize("a_layout", ["c", "strided", "transposed"])
def test_matmul_panel_orders(isa, dtype, threads, m, k, n, a_layout, rng):
    a, b = randn(rng, (m, k), dtype), randn(rng, (k, n), dtype)
    if a_layout == "strided":
        a = randn(rng, (m, 2 * k), dtype)[:, ::2]
    elif a_layout == "transposed":
        a = np.ascontiguousarray(a.T).T
    with pyattn.num_threads(threads):
        mm_check(a, b, dtype)


@dtype_param
@pytest.mark.parametrize("m,k,n", [(515, 600, 64), (333, 517, 129), (64, 2048, 96), (1, 4000, 300)])
def test_matmul_threads_give_identical_bits(isa, dtype, m, k, n, rng):
    """The product splits over rows and columns, never over k: 1, 2 and 3 threads give the same bits."""
    a, b = randn(rng, (m, k), dtype), randn(rng, (k, n), dtype)
    with pyattn.num_threads(1):
        want = pyattn.matmul(a, b)
    for t in (2, 3):
        with pyattn.num_threads(t):
            np.testing.assert_array_equal(pyattn.matmul(a, b), want, err_msg=f"{t} threads")


@dtype_param
@pytest.mark.parametrize("m,n", [(1, 1), (3, 5), (17, 33), (64, 1)])
def test_matmul_k0(isa, dtype, m, n):
    a, b = np.ones((m, 0), dtype), np.ones((0, n), dtype)
    got = pyattn.matmul(a, b)
    assert got.shape == (m, n) and got.dtype == dtype and np.all(got == 0.0)


@dtype_param
@pytest.mark.parametrize(
    "shape_a,shape_b",
    [
        ((7,), (7,)),
        ((33,), (33, 17)),
        ((17, 33), (33,)),
        ((2, 3, 33), (33,)),
        ((33,), (4, 33, 5)),
        ((2, 1, 9, 17), (3, 17, 5)),
        ((4, 9, 17), (17, 5)),
        ((9, 17), (4, 17, 5)),
        ((2, 3, 1, 5, 8), (1, 3, 4, 8, 6)),
        ((0, 3, 4), (4, 5)),
        ((3, 0, 4), (4, 5)),
        ((3, 4, 0), (0, 5)),
        ((5, 4), (4, 0)),
    ],
)
def test_matmul_broadcasting_and_1d(isa, dtype, shape_a, shape_b, rng):
    a, b = randn(rng, shape_a, dtype), randn(rng, shape_b, dtype)
    got = pyattn.matmul(a, b)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert np.shape(got) == want.shape
    assert np.asarray(got).dtype == dtype
    assert_close(np.asarray(got), want, dtype)


@dtype_param
@pytest.mark.parametrize(
    "how",
    [
        "a_T",
        "b_T",
        "both_T",
        "fortran",
        "strided",
        "reversed",
        "broadcast_view",
        "col_strided",
        "unaligned",
        "byteswapped",
    ],
)
def test_matmul_layouts(isa, dtype, how, rng):
    m, k, n = 37, 65, 33
    a, b = randn(rng, (m, k), dtype), randn(rng, (k, n), dtype)
    if how == "a_T":
        a2, b2 = np.ascontiguousarray(a.T).T, b
    elif how == "b_T":
        a2, b2 = a, np.ascontiguousarray(b.T).T
    elif how == "both_T":
        a2, b2 = np.ascontiguousarray(a.T).T, np.ascontiguousarray(b.T).T
    elif how == "fortran":
        a2, b2 = np.asfortranarray(a), np.asfortranarray(b)
    elif how == "strided":
        a2, b2 = randn(rng, (2 * m, 3 * k), dtype)[::2, ::3], randn(rng, (3 * k, 2 * n), dtype)[::3, ::2]
        a, b = a2.copy(), b2.copy()
    elif how == "reversed":
        a2, b2 = a[::-1, ::-1], b[::-1]
        a, b = a2.copy(), b2.copy()
    elif how == "broadcast_view":
        a2 = np.broadcast_to(randn(rng, (1, k), dtype), (m, k))
        b2 = np.broadcast_to(randn(rng, (k, 1), dtype), (k, n))
        a, b = a2.copy(), b2.copy()
    elif how in ("unaligned", "byteswapped"):
        a2, b2 = relayout(a, how), relayout(b, how)
    else:  # col_strided
        big = randn(rng, (m, 2 * k), dtype)
        a2, a = big[:, ::2], big[:, ::2].copy()
        b2 = b
    got = mm_check(a2, b2, dtype)
    assert_close(got, np.matmul(a.astype(np.float64), b.astype(np.float64)), dtype)


@dtype_param
def test_matmul_batched_layouts(isa, dtype, rng):
    a = randn(rng, (3, 17, 2, 24), dtype).swapaxes(1, 2)  # (3, 2, 17, 24) non-contiguous
    b = randn(rng, (2, 31, 24), dtype).swapaxes(-1, -2)  # (2, 24, 31)
    mm_check(a, b, dtype)


@dtype_param
def test_matmul_out(isa, dtype, rng):
    a, b = randn(rng, (2, 17, 33), dtype), randn(rng, (33, 9), dtype)
    out = np.full((2, 17, 9), np.nan, dtype)
    assert pyattn.matmul(a, b, out=out) is out
    assert_close(out, np.matmul(a.astype(np.float64), b), dtype)


@dtype_param
def test_matmul_out_views(isa, dtype, rng):
    a, b = randn(rng, (2, 17, 33), dtype), randn(rng, (33, 9), dtype)
    want = np.matmul(a.astype(np.float64), b)
    big = np.full((2, 17, 18), np.nan, dtype)
    out = big[..., ::2]
    assert pyattn.matmul(a, b, out=out) is out
    assert_close(out, want, dtype)
    assert np.isnan(big[..., 1::2]).all()  # nothing written between the view's columns
    out = np.full((2, 9, 17), np.nan, dtype).swapaxes(-1, -2)
    assert pyattn.matmul(a, b, out=out) is out
    assert_close(out, want, dtype)
    v = randn(rng, (33,), dtype)
    out = np.empty((2, 17), dtype)
    assert pyattn.matmul(a, v, out=out) is out
    assert_close(out, np.matmul(a.astype(np.float64), v), dtype)
    out = relayout(np.full((2, 17, 9), np.nan, dtype), "unaligned")  # written through a temporary
    assert pyattn.matmul(a, b, out=out) is out
    assert_close(out, want, dtype)
    out2 = relayout(np.full((17, 9), np.nan, dtype), "unaligned")  # the 2-D path
    assert pyattn.matmul(a[0], b, out=out2) is out2
    assert_close(out2, want[0], dtype)


def test_matmul_mixed_dtypes(isa, rng):
    a, b = randn(rng, (9, 17), np.float32), randn(rng, (17, 5), np.float64)
    got = pyattn.matmul(a, b)
    assert_close(got, np.matmul(a.astype(np.float64), b), np.float64)
    got = pyattn.matmul(b.T, a.T)
    assert_close(got, np.matmul(b.T, a.T.astype(np.float64)), np.float64)


@dtype_param
def test_matmul_large_k_accuracy(isa, dtype, rng):
    a, b = randn(rng, (16, 4000), dtype), randn(rng, (4000, 16), dtype)
    got = pyattn.matmul(a, b)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert_close(got, want, dtype, tol=5e-5 if dtype == np.float32 else 1e-12)


# --------------------------------------------------------------------------- softmax


@dtype_param
@pytest.mark.parametrize(
    "shape,axis",
    [
        ((7,), -1),
        ((7,), 0),
        ((3, 17), -1),
        ((3, 17), 0),
        ((2, 5, 33), 1),
        ((2, 5, 33), -3),
        ((4, 3, 5, 129), -1),
        ((4, 3, 5, 129), 2),
        ((1, 1), -1),
        ((300, 3), -1),
        ((3, 300), -1),
        ((2, 0, 5), -1),
        ((2, 5, 0), -1),
        ((2, 5, 0), 1),
    ],
)
def test_softmax_axes(isa, dtype, shape, axis, rng):
    x = randn(rng, shape, dtype, scale=3.0)
    got = pyattn.softmax(x, axis=axis)
    assert_close(got, reference.softmax(x, axis=axis), dtype)
    if x.size:  # the textbook formula, independent of the reference
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
        assert_close(got, e / e.sum(axis=axis, keepdims=True), dtype)


@dtype_param
@pytest.mark.parametrize("scale", [None, 0.125, 1.0, 3.0, 0.0])
@pytest.mark.parametrize("kind", [None, "bool", "float", "bool_full_rows", "float_full_rows"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_scale_mask(isa, dtype, scale, kind, axis, rng):
    x = randn(rng, (6, 37, 5), dtype, scale=2.0)
    moved = np.moveaxis(x, axis, -1)
    mask = make_mask(rng, kind, moved.shape, dtype)
    if mask is not None:
        mask = np.moveaxis(mask, -1, axis)
    got = pyattn.softmax(x, axis=axis, scale=scale, mask=mask)
    want = reference.softmax(x, axis=axis, scale=scale, mask=mask)
    assert_close(got, want, dtype)
    if mask is not None:
        allowed = mask if mask.dtype == bool else np.isfinite(mask)
        assert np.all(got[~allowed] == 0.0)
        dead = ~allowed.any(axis=axis)
        sums = got.sum(axis=axis)
        assert np.all(sums[dead] == 0.0)
        np.testing.assert_allclose(sums[~dead], 1.0, rtol=1e-5)


@dtype_param
def test_softmax_broadcast_mask(isa, dtype, rng):
    x = randn(rng, (2, 3, 9, 20), dtype)
    for mshape in [(20,), (9, 20), (2, 1, 1, 20), (1, 3, 9, 1)]:
        mask = bool_mask(rng, mshape)
        assert_close(pyattn.softmax(x, mask=mask), reference.softmax(x, mask=mask), dtype)
        fmask = make_mask(rng, "float", mshape, dtype)
        assert_close(pyattn.softmax(x, mask=fmask, scale=0.5), reference.softmax(x, mask=fmask, scale=0.5), dtype)


@dtype_param
def test_softmax_fully_masked(isa, dtype, rng):
    x = randn(rng, (4, 10), dtype)
    mask = np.ones((4, 10), bool)
    mask[1] = False
    got = pyattn.softmax(x, mask=mask)
    assert np.all(got[1] == 0.0) and not np.isnan(got).any()
    got = pyattn.softmax(np.full((3, 5), -np.inf, dtype))
    assert np.all(got == 0.0)


@dtype_param
def test_softmax_extreme_values(isa, dtype, rng):
    x = randn(rng, (5, 40), dtype) * (1000 if dtype == np.float64 else 80)
    assert_close(pyattn.softmax(x), reference.softmax(x), dtype)
    assert np.isfinite(pyattn.softmax(x)).all()


@dtype_param
@pytest.mark.parametrize("how", ["fortran", "strided", "reversed", "unaligned", "byteswapped"])
def test_softmax_layouts(isa, dtype, how, rng):
    x = randn(rng, (2, 40, 30), dtype)
    if how == "fortran":
        v = np.asfortranarray(x)
    elif how == "strided":
        v = randn(rng, (2, 80, 60), dtype)[:, ::2, ::2]
        x = v.copy()
    elif how == "reversed":
        v = x[:, ::-1, ::-1]
        x = v.copy()
    else:
        v = relayout(x, how)
    for axis in (-1, 1):
        assert_close(pyattn.softmax(v, axis=axis), reference.softmax(x, axis=axis), dtype)


@dtype_param
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_in_place(isa, dtype, axis, rng):
    x = randn(rng, (5, 33, 7), dtype)
    mask = bool_mask(rng, (5, 33, 7))
    want = reference.softmax(x, axis=axis, scale=0.7, mask=mask)
    y = x.copy()
    assert pyattn.softmax(y, axis=axis, scale=0.7, mask=mask, out=y) is y
    assert_close(y, want, dtype)


@dtype_param
def test_softmax_out_view(isa, dtype, rng):
    x = randn(rng, (4, 30), dtype)
    big = np.full((4, 60), np.nan, dtype)
    out = big[:, 1::2]
    assert pyattn.softmax(x, out=out, axis=0) is out
    assert_close(out, reference.softmax(x, axis=0), dtype)
    assert np.isnan(big[:, ::2]).all()
    out = relayout(np.full((4, 30), np.nan, dtype), "unaligned")
    assert pyattn.softmax(x, out=out) is out
    assert_close(out, reference.softmax(x), dtype)


@dtype_param
def test_softmax_out(isa, dtype, rng):
    x = randn(rng, (3, 17), dtype)
    out = np.full_like(x, np.nan)
    assert pyattn.softmax(x, out=out) is out
    assert_close(out, reference.softmax(x), dtype)


# --------------------------------------------------------------------------- positional encoding


@pytest.mark.parametrize("n,d", [(1, 1), (4, 8), (10, 7), (50, 64), (2048, 512), (0, 4), (3, 1)])
def test_sinusoidal(n, d):
    got = pyattn.sinusoidal_positional_encoding(n, d)
    assert got.dtype == np.float32 and got.shape == (n, d)
    want = reference.sinusoidal_positional_encoding(n, d)
    # float32 output of sin/cos with arguments up to n: absolute error ~ n * eps32
    assert_close(got, want, tol=max(1e-6, n * 1.2e-7) if n else 1e-6)
    got64 = pyattn.sinusoidal_positional_encoding(n, d, dtype=np.float64)
    assert_close(got64, want, np.float64)


def test_sinusoidal_takes_the_name_bfloat16():
    """dtype="bfloat16" in a fresh process, before anything imported ml_dtypes (NumPy knows the
    name only after that import: it raised "data type 'bfloat16' not understood")."""
    pytest.importorskip("ml_dtypes")
    rc, out, err = run_python(
        "import pyattn; pe = pyattn.sinusoidal_positional_encoding(4, 6, dtype='bfloat16'); "
        "print(pe.dtype, pe.shape, float(pe[1, 0]))"
    )
    assert rc == 0, err
    assert out.split()[:3] == ["bfloat16", "(4,", "6)"] and abs(float(out.split()[3]) - np.sin(1.0)) < 1e-2, out


def test_sinusoidal_base():
    got = pyattn.sinusoidal_positional_encoding(16, 6, base=100.0, dtype=np.float64)
    assert_close(got, reference.sinusoidal_positional_encoding(16, 6, base=100.0), np.float64)
    pos = 5  # columns 4 and 5: the pair i = 2
    assert abs(got[pos, 4] - np.sin(pos / 100.0 ** (4 / 6))) < 1e-12
    assert abs(got[pos, 5] - np.cos(pos / 100.0 ** (4 / 6))) < 1e-12


def test_sinusoidal_odd_last_column_is_sin():
    pe = reference.sinusoidal_positional_encoding(6, 5)
    pos = np.arange(6)
    np.testing.assert_allclose(pe[:, 4], np.sin(pos / 10000 ** (4 / 5)), rtol=0, atol=1e-15)
    got = pyattn.sinusoidal_positional_encoding(6, 5, dtype=np.float64)
    assert_close(got, pe, np.float64)


# --------------------------------------------------------------------------- additive attention


def _additive_loops(q, keys, wq, wk, v, values, mask):
    """Bahdanau attention with explicit loops (independent of the reference)."""
    lq, lk = q.shape[0], keys.shape[0]
    e = np.full((lq, lk), -np.inf)
    for i in range(lq):
        for j in range(lk):
            if mask is None or mask[i, j]:
                e[i, j] = v @ np.tanh(q[i] @ wq + keys[j] @ wk)
    out = np.zeros((lq, values.shape[1]))
    w = np.zeros((lq, lk))
    for i in range(lq):
        if np.isfinite(e[i]).any():
            p = np.exp(e[i] - e[i].max())
            w[i] = p / p.sum()
            out[i] = w[i] @ values
    return out, w


@pytest.mark.parametrize("lib", [pyattn, reference], ids=["pyattn", "reference"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_values", [False, True])
def test_additive_attention_loops(lib, masked, with_values, rng):
    lq, lk, dq, dk, a, dv = 4, 6, 5, 3, 7, 2
    q, keys = randn(rng, (lq, dq)), randn(rng, (lk, dk))
    wq, wk, v = randn(rng, (dq, a)), randn(rng, (dk, a)), randn(rng, (a,))
    values = randn(rng, (lk, dv)) if with_values else None
    mask = None
    if masked:
        mask = bool_mask(rng, (lq, lk))
        mask[2] = False
    out, w = lib.additive_attention(q, keys, wq, wk, v, values=values, mask=mask, return_weights=True)
    want_out, want_w = _additive_loops(q, keys, wq, wk, v, keys if values is None else values, mask)
    assert_close(out, want_out, np.float64)
    assert_close(w, want_w, np.float64)
    only = lib.additive_attention(q, keys, wq, wk, v, values=values, mask=mask)
    assert isinstance(only, np.ndarray)
    assert_close(only, want_out, np.float64)


@dtype_param
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_additive_attention_parity(isa, dtype, lead, rng):
    lq, lk, dq, dk, a, dv = 9, 17, 12, 10, 16, 6
    q, keys = randn(rng, lead + (lq, dq), dtype), randn(rng, lead + (lk, dk), dtype)
    wq, wk, v = randn(rng, (dq, a), dtype, 0.3), randn(rng, (dk, a), dtype, 0.3), randn(rng, (a,), dtype)
    values = randn(rng, lead + (lk, dv), dtype)
    mask = bool_mask(rng, (lq, lk), full_rows=True)
    for kw in (dict(), dict(values=values), dict(mask=mask), dict(values=values, mask=mask)):
        got, gw = pyattn.additive_attention(q, keys, wq, wk, v, return_weights=True, **kw)
        want, ww = reference.additive_attention(q, keys, wq, wk, v, return_weights=True, **kw)
        assert_close(got, want, dtype)
        assert_close(gw, ww, dtype)


@dtype_param
def test_matmul_vector_dot_is_a_numpy_scalar(dtype, rng):
    """1-D @ 1-D gives a NumPy scalar, as np.matmul does (it was a 0-d array)."""
    a, b = randn(rng, (17,), dtype), randn(rng, (17,), dtype)
    got, want = pyattn.matmul(a, b), np.matmul(a, b)
    assert type(got) is type(want) and np.ndim(got) == 0
    assert_close(np.asarray(got), np.asarray(np.matmul(a.astype(np.float64), b.astype(np.float64))), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_gives_zero_not_subnormal(isa, dtype):
    """exp(x - max) under the smallest normal number is 0 on every kernel set, where NumPy gives
    a subnormal (each instruction touching one takes a microcode assist on Intel cores); every
    normal one is exact as before, down to the smallest normal itself. (In a row with one
    maximum the sum is about 1, so the outputs are those values.)"""
    tiny = float(np.finfo(dtype).tiny)  # 2^-126 / 2^-1022
    ln_tiny = float(np.log(tiny))
    # natural-unit offsets from the max: log2 offsets -126.25 (a subnormal that the AVX2 and NEON
    # exp2 used to form), -130 and -140 (below), -125.5 and -100 (normal, kept)
    under = [ln_tiny - 0.25 * np.log(2), ln_tiny - 4 * np.log(2), ln_tiny - 14 * np.log(2)]
    over = [ln_tiny + 0.5 * np.log(2), ln_tiny + 26 * np.log(2)]
    x = np.array([0.0, *under, *over], dtype)
    y = pyattn.softmax(x)
    assert np.all(y[1:4] == 0), y[1:4]
    want = reference.softmax(x.astype(np.float64))
    # exp of an argument near 87 (708) carries its rounding, |x| eps, relative
    np.testing.assert_allclose(y[[0, 4, 5]], want[[0, 4, 5]], rtol=2e-5 if dtype == np.float32 else 1e-12)
    assert np.all((y == 0) | (np.abs(y) >= tiny))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_takes_any_finite_input(isa, dtype):
    """softmax multiplied by scale * log2(e) before subtracting the maximum: a row of -3e38 came
    out as zeros and [3e38, 0, -3e38] as NaN (float32; past 1.25e308 in float64), a mask of
    finfo.min gave zeros. In natural units up to the maximum it matches the reference."""
    big = float(np.finfo(dtype).max) * 0.9
    rows = [[-big, -big], [big, 0.0, -big], [-big, -big, -big, 1.0], [big, big * 0.5], [-big] * 37 + [0.0] * 3]
    # a maximum whose log2-unit shift is past the exact integers (its rounding once put every
    # exponent past exp2's range: [1e10, 0] gave NaN), with masked entries beside it
    mid = 1e10 if dtype == np.float32 else 1e20
    rows += [[mid, 0.0], [mid, mid * (1 - 1e-6), -mid], [-np.inf, mid, 1.0] * 7, [-mid, -mid * 1.5] * 9]
    for row in rows:
        x = np.array(row, dtype)
        np.testing.assert_allclose(pyattn.softmax(x), reference.softmax(x), rtol=1e-6, atol=1e-30)
    x = np.array([1.0, 0.5], dtype)
    np.testing.assert_allclose(pyattn.softmax(x, scale=1e11), [1.0, 0.0])
    np.testing.assert_allclose(pyattn.softmax(np.zeros(3, dtype), mask=np.array([0.0, 5e10, 1.0], dtype)), [0, 1, 0])
    x = np.zeros((3, 21), dtype)
    m = np.full((3, 21), np.finfo(dtype).min, dtype)
    m[1, 4] = 0.0  # row 1: one key left; rows 0 and 2: every entry at finfo.min, uniform weights
    np.testing.assert_allclose(pyattn.softmax(x, mask=m), reference.softmax(x, mask=m), rtol=1e-6, atol=0)
    np.testing.assert_allclose(pyattn.softmax(x, mask=m)[0], np.full(21, 1 / 21), rtol=1e-6)
    # scale applied before the maximum, as the reference does
    x = np.array([1e30, -1e30, 3.0], dtype)
    np.testing.assert_allclose(pyattn.softmax(x, scale=-1e-30), reference.softmax(x, scale=-1e-30), rtol=1e-6)


def test_out_whose_rows_overlap_is_written_through_a_temporary(isa, rng):
    """An out whose rows overlap each other (a writable as_strided view, rows 4 elements apart
    and 8 long) is written as NumPy assigns into it, from results computed on the inputs as
    given: softmax(x, out=x) on such an x took the in-place path, and each row then read
    entries that the row before had already overwritten."""
    from numpy.lib.stride_tricks import as_strided

    buf = randn(rng, (40,), np.float64)
    x = as_strided(buf, shape=(6, 8), strides=(32, 8))
    want_buf = buf.copy()
    as_strided(want_buf, shape=(6, 8), strides=(32, 8))[...] = pyattn.softmax(np.array(x))
    pyattn.softmax(x, out=x)
    np.testing.assert_allclose(buf, want_buf, rtol=1e-12, atol=0)

    q, k, v = (
        randn(rng, (1, 2, 6, 8), np.float32),
        randn(rng, (1, 2, 9, 8), np.float32),
        randn(rng, (1, 2, 9, 8), np.float32),
    )
    o_buf, want_buf = np.zeros(60, np.float32), np.zeros(60, np.float32)
    shape, strides = (1, 2, 6, 8), (0, 96, 16, 4)  # heads 24 elements apart, rows 4: they overlap
    as_strided(want_buf, shape=shape, strides=strides)[...] = pyattn.scaled_dot_product_attention(q, k, v)
    pyattn.scaled_dot_product_attention(q, k, v, out=as_strided(o_buf, shape=shape, strides=strides))
    np.testing.assert_array_equal(o_buf, want_buf)


def test_softmax_overflowing_scaled_input_is_nan():
    """x * scale + mask is formed in the computation's dtype (docs/api.md, softmax): past float32's
    range it is inf and the slice NaN, as in torch; float64 holds the same values."""
    x = np.array([[1e30, 0.0, 0.0], [3e38, 0.0, 1.0]], np.float32)
    got = pyattn.softmax(x, scale=np.float32(1e9))
    assert np.isnan(got[0]).all() and np.isnan(got[1]).all()
    np.testing.assert_array_equal(pyattn.softmax(x.astype(np.float64), scale=1e9), [[1, 0, 0], [1, 0, 0]])
    m = np.array([3e38, 0.0, 0.0], np.float32)
    assert np.isnan(pyattn.softmax(np.array([3e38, 0.0, 0.0], np.float32), mask=m)).all()
