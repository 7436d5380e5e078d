"""scaled_dot_product_attention: parity with pyattn.reference, once per SIMD path (``isa``)."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import DTYPES, assert_close, bool_mask, make_mask, randn, relayout

import pyattn
from pyattn import reference

sdpa = pyattn.scaled_dot_product_attention
ref_sdpa = reference.scaled_dot_product_attention

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])


def check(args, kwargs=None, dtype=None, extras=("weights", "lse")):
    """Run pyattn and the reference on the same arguments and compare everything."""
    kwargs = dict(kwargs or {})
    kwargs.setdefault("return_weights", True)
    kwargs.setdefault("return_lse", True)
    got = sdpa(*args, **kwargs)
    want = ref_sdpa(*args, **kwargs)
    if not (kwargs["return_weights"] or kwargs["return_lse"]):
        got, want = (got,), (want,)
    assert isinstance(got, tuple) and len(got) == len(want)
    names = ["output"]
    if kwargs["return_weights"]:
        names.append("weights")
    if kwargs["return_lse"]:
        names.append("lse")
    for name, g, w in zip(names, got, want):
        assert_close(g, w, dtype, what=name)
    return got, want


# --------------------------------------------------------------------------- lengths

LENGTHS = [
    1,
    2,
    3,
    5,
    7,
    8,
    9,
    15,
    16,
    17,
    23,
    24,
    25,
    31,
    32,
    33,
    47,
    48,
    49,
    63,
    64,
    65,
    95,
    96,
    97,
    127,
    128,
    129,
    255,
    256,
    257,
    300,
    384,
    511,
]
HEAD_DIMS = [8, 16, 32, 64, 17, 48, 3, 1, 24, 7, 128]


@dtype_param
@pytest.mark.parametrize("L", LENGTHS)
def test_self_attention_lengths(isa, dtype, L, rng):
    e = HEAD_DIMS[LENGTHS.index(L) % len(HEAD_DIMS)]
    q, k, v = (randn(rng, (1, 2, L, e), dtype) for _ in range(3))
    check((q, k, v), dtype=dtype)


CROSS = [
    (1, 300),
    (300, 1),
    (2, 3),
    (3, 2),
    (7, 65),
    (65, 7),
    (33, 128),
    (129, 31),
    (17, 256),
    (256, 17),
    (96, 97),
    (1, 1),
    (8, 9),
    (9, 8),
    (47, 200),
    (250, 63),
]


@dtype_param
@pytest.mark.parametrize("lq,lk", CROSS)
def test_cross_attention_lengths(isa, dtype, lq, lk, rng):
    e, ev = 24, 40
    q = randn(rng, (2, 2, lq, e), dtype)
    k = randn(rng, (2, 2, lk, e), dtype)
    v = randn(rng, (2, 2, lk, ev), dtype)
    check((q, k, v), dtype=dtype)


@dtype_param
@pytest.mark.parametrize("lq,lk", [(0, 5), (0, 0), (0, 64), (3, 0), (17, 0)])
def test_empty_lengths(isa, dtype, lq, lk, rng):
    q = randn(rng, (2, 3, lq, 8), dtype)
    k = randn(rng, (2, 3, lk, 8), dtype)
    v = randn(rng, (2, 3, lk, 5), dtype)
    (out, w, lse), _ = check((q, k, v), dtype=dtype)
    assert out.shape == (2, 3, lq, 5) and w.shape == (2, 3, lq, lk) and lse.shape == (2, 3, lq)
    if lk == 0:
        assert np.all(out == 0.0)
        assert np.all(np.isneginf(lse))
    # with causal too (bottom_right with lk = 0 masks everything)
    for align in ("top_left", "bottom_right"):
        check((q, k, v), dict(is_causal=True, causal_align=align), dtype=dtype)


@dtype_param
def test_empty_batch(isa, dtype, rng):
    q = randn(rng, (0, 2, 5, 8), dtype)
    k = randn(rng, (0, 2, 7, 8), dtype)
    v = randn(rng, (0, 2, 7, 3), dtype)
    (out, w, lse), _ = check((q, k, v), dtype=dtype)
    assert out.shape == (0, 2, 5, 3)


# --------------------------------------------------------------------------- head dims

E_EV = [
    (1, 1),
    (1, 3),
    (2, 5),
    (3, 2),
    (4, 7),
    (7, 4),
    (8, 16),
    (15, 17),
    (16, 8),
    (17, 33),
    (31, 32),
    (32, 64),
    (33, 31),
    (48, 80),
    (63, 65),
    (64, 128),
    (96, 80),
    (127, 129),
    (128, 64),
    (129, 127),
    (200, 256),
    (256, 128),
    (256, 256),
    (512, 384),
    (1024, 1000),
    (0, 4),
    (4, 0),
    (0, 0),
]


@dtype_param
@pytest.mark.parametrize("e,ev", E_EV)
def test_head_dims(isa, dtype, e, ev, rng):
    q = randn(rng, (2, 2, 37, e), dtype)
    k = randn(rng, (2, 2, 45, e), dtype)
    v = randn(rng, (2, 2, 45, ev), dtype)
    check((q, k, v), dtype=dtype)
    check((q, k, v), dict(is_causal=True, causal_align="bottom_right"), dtype=dtype)


# --------------------------------------------------------------------------- broadcasting

BROADCAST = {
    # name: (query shape, key shape, value shape, mask shape or None)
    "key_batch1": ((3, 2, 9, 16), (1, 2, 13, 16), (1, 2, 13, 8), None),
    "query_batch1": ((1, 2, 9, 16), (3, 2, 13, 16), (3, 2, 13, 8), None),
    "query_2d_vs_4d_kv": ((9, 16), (2, 3, 13, 16), (2, 3, 13, 8), None),
    "kv_2d_vs_4d_query": ((2, 3, 9, 16), (13, 16), (13, 8), None),
    "3d": ((4, 9, 16), (4, 13, 16), (4, 13, 8), None),
    "2d": ((9, 16), (13, 16), (13, 8), None),
    "5d": ((2, 1, 3, 9, 16), (1, 2, 3, 13, 16), (1, 2, 3, 13, 8), None),
    "5d_value_broadcast": ((2, 2, 3, 9, 16), (2, 2, 3, 13, 16), (1, 1, 3, 13, 8), None),
    "6d": ((2, 1, 2, 2, 5, 8), (1, 3, 2, 2, 6, 8), (1, 3, 2, 2, 6, 4), (2, 1, 1, 1, 5, 6)),
    "mask_2d": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (9, 13)),
    "mask_1d": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (13,)),
    "mask_padding": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (2, 1, 1, 13)),
    "mask_heads": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (1, 3, 9, 13)),
    "mask_rows": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (2, 1, 9, 1)),
    "mask_full": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (2, 3, 9, 13)),
    "mask_3d_over_4d": ((2, 3, 9, 16), (2, 3, 13, 16), (2, 3, 13, 8), (3, 9, 13)),
    "mask_5d": ((2, 1, 3, 9, 16), (1, 2, 3, 13, 16), (1, 2, 3, 13, 8), (2, 2, 1, 9, 13)),
}


BROADCAST_PARAMS = [
    (case, kind)
    for case, shapes in BROADCAST.items()
    for kind in (["bool", "float"] if shapes[3] is not None else [None])
]


@dtype_param
@pytest.mark.parametrize("case,mask_kind", BROADCAST_PARAMS)
def test_broadcasting(isa, dtype, case, mask_kind, rng):
    qs, ks, vs, ms = BROADCAST[case]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    mask = None if ms is None else make_mask(rng, mask_kind, ms, dtype)
    (out, *_), (want, *_) = check((q, k, v, mask), dtype=dtype)
    assert out.shape == want.shape


# --------------------------------------------------------------------------- masks

MASK_KINDS = ["bool", "float", "bool_full_rows", "float_full_rows", "float_finite"]
MASK_SHAPES = {
    "full": lambda b, h, lq, lk: (b, h, lq, lk),
    "2d": lambda b, h, lq, lk: (lq, lk),
    "padding": lambda b, h, lq, lk: (b, 1, 1, lk),
    "heads": lambda b, h, lq, lk: (1, h, lq, lk),
}


@dtype_param
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_masks(isa, dtype, shape, kind, rng):
    b, h, lq, lk = 2, 3, 19, 33
    q = randn(rng, (b, h, lq, 16), dtype)
    k = randn(rng, (b, h, lk, 16), dtype)
    v = randn(rng, (b, h, lk, 12), dtype)
    mshape = MASK_SHAPES[shape](b, h, lq, lk)
    if shape == "padding" and "full_rows" in kind:
        mask = make_mask(rng, kind.replace("_full_rows", ""), mshape, dtype)
        mask[0, ..., :] = False if mask.dtype == bool else -np.inf  # batch 0 fully padded
    else:
        mask = make_mask(rng, kind, mshape, dtype)
    (out, w, lse), _ = check((q, k, v, mask), dtype=dtype)
    # forbidden keys get exactly zero weight; rows with no allowed key are exactly zero
    allowed = np.broadcast_to(mask if mask.dtype == bool else np.isfinite(mask), w.shape)
    assert np.all(w[~allowed] == 0.0)
    dead = ~allowed.any(axis=-1)
    if "full_rows" in kind:
        assert dead.any()
    assert np.all(out[dead] == 0.0)
    assert np.all(np.isneginf(lse[dead]))
    assert not np.isnan(out).any()


@dtype_param
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_all_masked(isa, dtype, kind, rng):
    q = randn(rng, (2, 2, 5, 8), dtype)
    k = randn(rng, (2, 2, 7, 8), dtype)
    v = randn(rng, (2, 2, 7, 8), dtype)
    mask = np.zeros((5, 7), bool) if kind == "bool" else np.full((5, 7), -np.inf, dtype)
    (out, w, lse), _ = check((q, k, v, mask), dtype=dtype)
    assert np.all(out == 0.0) and np.all(w == 0.0) and np.all(np.isneginf(lse))


@dtype_param
def test_mask_with_large_bias(isa, dtype, rng):
    """Additive masks of large magnitude (e.g. -1e4 instead of -inf, ALiBi-like slopes)."""
    q = randn(rng, (1, 2, 40, 16), dtype)
    k = randn(rng, (1, 2, 50, 16), dtype)
    v = randn(rng, (1, 2, 50, 16), dtype)
    i, j = np.arange(40)[:, None], np.arange(50)[None, :]
    alibi = (-0.5 * np.abs(i - j)).astype(dtype)
    check((q, k, v, alibi), dtype=dtype)
    big = np.where(bool_mask(rng, (40, 50)), 0.0, -1e4).astype(dtype)
    check((q, k, v, big), dtype=dtype)
    # a large positive bias on some keys dominates the row (the running max comes from the mask)
    pos = np.zeros((40, 50), dtype)
    pos[:, 7] = 30.0
    pos[::3, 41] = 29.0
    check((q, k, v, pos), dtype=dtype)


# --------------------------------------------------------------------------- causal

CAUSAL_SHAPES = [
    (1, 1),
    (5, 5),
    (17, 17),
    (64, 64),
    (129, 129),
    (7, 20),
    (20, 7),
    (1, 300),
    (16, 257),
    (257, 16),
    (33, 96),
    (96, 33),
    (2, 3),
    (3, 2),
]


@dtype_param
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", CAUSAL_SHAPES)
def test_causal(isa, dtype, align, lq, lk, rng):
    q = randn(rng, (2, 2, lq, 24), dtype)
    k = randn(rng, (2, 2, lk, 24), dtype)
    v = randn(rng, (2, 2, lk, 16), dtype)
    (out, w, lse), _ = check((q, k, v), dict(is_causal=True, causal_align=align), dtype=dtype)
    offset = 0 if align == "top_left" else lk - lq
    future = np.arange(lk)[None, :] > np.arange(lq)[:, None] + offset
    assert np.all(w[..., future] == 0.0)


@dtype_param
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("kind", ["bool", "float", "bool_full_rows"])
def test_causal_with_mask(isa, dtype, align, kind, rng):
    """is_causal and attn_mask together: both restrictions apply."""
    lq, lk = 23, 41
    q = randn(rng, (2, 2, lq, 16), dtype)
    k = randn(rng, (2, 2, lk, 16), dtype)
    v = randn(rng, (2, 2, lk, 16), dtype)
    mask = make_mask(rng, kind, (2, 1, lq, lk), dtype)
    check((q, k, v, mask), dict(is_causal=True, causal_align=align), dtype=dtype)


# --------------------------------------------------------------------------- GQA

GQA = [(2, 1), (4, 1), (8, 1), (4, 2), (8, 2), (8, 4), (6, 3), (6, 2), (3, 3)]


@dtype_param
@pytest.mark.parametrize("hq,hkv", GQA)
def test_gqa(isa, dtype, hq, hkv, rng):
    q = randn(rng, (2, hq, 13, 32), dtype)
    k = randn(rng, (2, hkv, 29, 32), dtype)
    v = randn(rng, (2, hkv, 29, 24), dtype)
    check((q, k, v), dict(enable_gqa=True), dtype=dtype)
    check((q, k, v), dict(enable_gqa=True, is_causal=True, causal_align="bottom_right"), dtype=dtype)
    mask = make_mask(rng, "bool_full_rows", (2, hq, 13, 29))
    check((q, k, v, mask), dict(enable_gqa=True), dtype=dtype)
    # query head h must use kv head h // (hq // hkv) (repeat_interleave, not tile)
    out = sdpa(q, k, v, enable_gqa=True)
    g = hq // hkv
    for h in range(hq):
        want = ref_sdpa(q[:, h], k[:, h // g], v[:, h // g])
        assert_close(out[:, h], want, dtype, what=f"head {h}")


@dtype_param
def test_gqa_5d(isa, dtype, rng):
    q = randn(rng, (2, 3, 8, 7, 16), dtype)
    k = randn(rng, (1, 3, 2, 9, 16), dtype)
    v = randn(rng, (2, 1, 2, 9, 8), dtype)
    check((q, k, v), dict(enable_gqa=True), dtype=dtype)


# --------------------------------------------------------------------------- layouts


LAYOUTS = [
    "fortran",
    "swapaxes",
    "transposed_last",
    "row_slice",
    "col_slice",
    "reversed",
    "offset",
    "unaligned",
    "byteswapped",
]


@dtype_param
@pytest.mark.parametrize("how", LAYOUTS)
def test_layouts(isa, dtype, how, rng):
    q = randn(rng, (2, 3, 17, 24), dtype)
    k = randn(rng, (2, 3, 21, 24), dtype)
    v = randn(rng, (2, 3, 21, 20), dtype)
    mask = make_mask(rng, "float", (2, 3, 17, 21), dtype)
    lq_, lk_, lv_, lm_ = (relayout(a, how, rng) for a in (q, k, v, mask))
    if how == "offset":
        assert lq_.ctypes.data % lq_.itemsize == 0 and lq_.ctypes.data % 16 != 0
    elif how == "unaligned":
        assert not lq_.flags.aligned
    elif how == "byteswapped":
        assert not lq_.dtype.isnative
    else:
        assert not (lq_.flags.c_contiguous and lk_.flags.c_contiguous)
    got = sdpa(lq_, lk_, lv_, lm_, return_weights=True, return_lse=True)
    want = ref_sdpa(q, k, v, mask, return_weights=True, return_lse=True)
    for name, g, w in zip(["output", "weights", "lse"], got, want):
        assert_close(g, w, dtype, what=name)
    # mixed: only one operand non-contiguous
    got = sdpa(q, lk_, v, mask)
    assert_close(got, want[0], dtype)
    got = sdpa(q, k, lv_, mask, is_causal=True)
    assert_close(got, ref_sdpa(q, k, v, mask, is_causal=True), dtype)


def check_same_bits(args, contiguous, kw, dtype):
    """sdpa on args gives bit for bit what it gives on their contiguous copies, and its output
    matches the reference."""
    got, same = sdpa(*args, **kw), sdpa(*contiguous, **kw)
    got, same = (got, same) if isinstance(got, tuple) else ((got,), (same,))
    for g, s in zip(got, same):
        np.testing.assert_array_equal(g, s)
    want = ref_sdpa(*contiguous, **kw)
    assert_close(got[0], want[0] if isinstance(want, tuple) else want, dtype)


@dtype_param
@pytest.mark.parametrize("fused_qkv", [False, True], ids=["blhd", "qkv"])
def test_rows_a_page_apart(isa, dtype, fused_qkv, rng):
    """K/V rows a whole number of 4 KiB apart ((B, L, H, D) views with H x D x itemsize a multiple
    of 4096, or slices of one fused QKV projection), which the kernels copy into a tile rather
    than read in place: the same values as contiguous copies, bit for bit, over several key
    blocks, with masks, windows and the weights."""
    H, D = 4096 // (64 * np.dtype(dtype).itemsize), 64
    B, Lq, Lk = 2, 37, 301
    if fused_qkv:  # (B, L, 3, H, D) as one buffer: the rows 3 x 4 KiB apart
        qkv = randn(rng, (B, Lk, 3, H, D), dtype)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        q = q[:, :, Lk - Lq :]
    else:
        q = randn(rng, (B, Lq, H, D), dtype).transpose(0, 2, 1, 3)
        k, v = (randn(rng, (B, Lk, H, D), dtype).transpose(0, 2, 1, 3) for _ in range(2))
    assert k.strides[2] % 4096 == 0 and not k.flags.c_contiguous
    qc, kc, vc = (np.ascontiguousarray(x) for x in (q, k, v))
    mask = make_mask(rng, "bool", (B, 1, Lq, Lk))
    for kw in (
        {"is_causal": True, "causal_align": "bottom_right"},
        {"attn_mask": mask, "return_weights": True, "return_lse": True},
        {"window": (100, 0), "is_causal": True, "causal_align": "bottom_right", "return_lse": True},
    ):
        check_same_bits((q, k, v), (qc, kc, vc), kw, dtype)
    # only one of K and V so laid out
    assert_close(sdpa(qc, k, vc, is_causal=True), ref_sdpa(qc, kc, vc, is_causal=True), dtype)
    assert_close(sdpa(qc, kc, v, is_causal=True), ref_sdpa(qc, kc, vc, is_causal=True), dtype)


@dtype_param
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_rows_copied_per_problem(isa, dtype, threads, rng):
    """K/V rows a few hundred bytes apart ((B, L, H, D) views, packed varlen tokens) read by 512
    queries or more, which a prefill copies into a contiguous copy of each problem's rows kept
    from one task to the next: the same values as contiguous copies, bit for bit, however the
    tasks' key ranges move (causal, a sliding window, ALiBi's outward order, kv_lens) and with
    the weights, and GQA heads sharing the rows; varlen with long and short sequences packed
    against per-sequence calls."""
    D = 256 // np.dtype(dtype).itemsize  # rows of 256 bytes: the widest copied
    B, H, L = 1, 2, 1100
    q = randn(rng, (B, L, H, D), dtype).transpose(0, 2, 1, 3)
    k, v = (randn(rng, (B, L, H, D), dtype).transpose(0, 2, 1, 3) for _ in range(2))
    qc, kc, vc = (np.ascontiguousarray(x) for x in (q, k, v))
    slopes = np.array([0.01, 0.3])
    with pyattn.num_threads(threads):
        for kw in (
            {"return_weights": True, "return_lse": True},
            {"is_causal": True},
            {"window": (600, 0), "is_causal": True, "return_lse": True},
            {"window": (700, 700)},
            {"alibi_slopes": slopes, "is_causal": True},
            {"alibi_slopes": slopes, "softcap": 5.0},
            {"kv_lens": np.array([900]), "return_lse": True},
        ):
            check_same_bits((q, k, v), (qc, kc, vc), kw, dtype)
        # only one of K and V strided; GQA query heads over one strided K/V head
        check_same_bits((qc, k, vc), (qc, kc, vc), {}, dtype)
        check_same_bits((qc, kc, v), (qc, kc, vc), {"is_causal": True}, dtype)
        q4 = randn(rng, (B, 4, L, D), dtype)
        check_same_bits((q4, k, v), (q4, kc, vc), {"enable_gqa": True, "is_causal": True}, dtype)
        # two sequences of GQA groups: a thread's copy passes from one query head of a group to
        # the next, and is made anew for the next group's K/V head (window: key ranges move)
        q8 = randn(rng, (2, 8, 800, D), dtype)
        k2, v2 = (randn(rng, (2, 800, 2, D), dtype).transpose(0, 2, 1, 3) for _ in range(2))
        k2c, v2c = np.ascontiguousarray(k2), np.ascontiguousarray(v2)
        for kw in ({"is_causal": True, "causal_align": "bottom_right"}, {"window": (500, 0), "is_causal": True}):
            check_same_bits((q8, k2, v2), (q8, k2c, v2c), {"enable_gqa": True, **kw}, dtype)
        # only one of them strided: the copy is kept by that operand's offsets alone
        check_same_bits((q8, k2, v2c), (q8, k2c, v2c), {"enable_gqa": True, "is_causal": True}, dtype)
        check_same_bits((q8, k2c, v2), (q8, k2c, v2c), {"enable_gqa": True, "is_causal": True}, dtype)
        # varlen: a long sequence (copied) between short ones (read in place)
        lens = [5, 1100, 70, 1030]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        qp, kp, vp = (randn(rng, (int(cu[-1]), H, D), dtype) for _ in range(3))
        for causal in (False, True):
            out = pyattn.varlen_attention(qp, kp, vp, cu, cu, is_causal=causal)
            for b in range(len(lens)):
                seq = [np.ascontiguousarray(x[cu[b] : cu[b + 1]].transpose(1, 0, 2)) for x in (qp, kp, vp)]
                one = sdpa(*seq, is_causal=causal)
                got = out[cu[b] : cu[b + 1]].transpose(1, 0, 2)
                assert_close(got, one, dtype, tol=2e-5 if dtype == np.float32 else 1e-10, what=f"sequence {b}")
                assert_close(got, ref_sdpa(*seq, is_causal=causal), dtype, what=f"sequence {b} vs reference")


@dtype_param
@pytest.mark.parametrize("hq,hkv,lq", [(8, 8, 1), (12, 4, 1), (6, 2, 3), (3, 3, 2)])
def test_decode_heads_interleaved(isa, dtype, hq, hkv, lq, rng):
    """Decode over K/V viewed as (B, L, H, D), whose heads' rows interleave (several heads a task,
    read side by side): the same values as over contiguous copies, bit for bit, with GQA, per-item
    key counts, variants and the lse."""
    B, Lk, D = 2, 700, 40
    q = randn(rng, (B, hq, lq, D), dtype)
    k, v = (randn(rng, (B, Lk, hkv, D), dtype).transpose(0, 2, 1, 3) for _ in range(2))
    kc, vc = np.ascontiguousarray(k), np.ascontiguousarray(v)
    kv_lens = np.array([Lk, 333])
    sinks = rng.standard_normal(hq).astype(dtype)
    for kw in (
        {"is_causal": True, "causal_align": "bottom_right", "return_lse": True},
        {"kv_lens": kv_lens, "softcap": 20.0, "sinks": sinks},
        {"window": (64, 0), "is_causal": True, "causal_align": "bottom_right"},
    ):
        kw["enable_gqa"] = hq != hkv
        check_same_bits((q, k, v), (q, kc, vc), kw, dtype)


@dtype_param
def test_broadcast_views(isa, dtype, rng):
    """Stride-0 views (np.broadcast_to) as inputs and masks."""
    q = randn(rng, (2, 3, 11, 16), dtype)
    k1 = randn(rng, (1, 1, 14, 16), dtype)
    v1 = randn(rng, (1, 1, 14, 8), dtype)
    k = np.broadcast_to(k1, (2, 3, 14, 16))
    v = np.broadcast_to(v1, (2, 3, 14, 8))
    row = make_mask(rng, "bool", (14,))
    mask = np.broadcast_to(row, (2, 3, 11, 14))
    check((q, k, v, mask), dtype=dtype)
    qb = np.broadcast_to(randn(rng, (11, 1), dtype), (11, 16))
    check((qb, k1[0, 0], v1[0, 0]), dtype=dtype)


# --------------------------------------------------------------------------- out=, returns


@dtype_param
@pytest.mark.parametrize("how", ["col_slice", "swapaxes", "fortran", "row_slice", "unaligned"])
def test_out_non_contiguous(isa, dtype, how, rng):
    q = randn(rng, (2, 3, 17, 24), dtype)
    k = randn(rng, (2, 3, 21, 24), dtype)
    v = randn(rng, (2, 3, 21, 20), dtype)
    out = relayout(np.full((2, 3, 17, 20), np.nan, dtype), how, rng)
    assert not (out.flags.c_contiguous and out.flags.aligned)
    assert sdpa(q, k, v, is_causal=True, out=out) is out
    assert_close(out, ref_sdpa(q, k, v, is_causal=True), dtype)


@dtype_param
@pytest.mark.parametrize("causal", [False, True])
def test_out(isa, dtype, causal, rng):
    q = randn(rng, (2, 3, 17, 24), dtype)
    k = randn(rng, (2, 3, 21, 24), dtype)
    v = randn(rng, (2, 3, 21, 20), dtype)
    out = np.full((2, 3, 17, 20), np.nan, dtype)
    r = sdpa(q, k, v, is_causal=causal, out=out)
    assert r is out
    assert_close(out, ref_sdpa(q, k, v, is_causal=causal), dtype)
    # out= together with return_weights / return_lse: output goes to out
    out2 = np.full((2, 3, 17, 20), np.nan, dtype)
    r = sdpa(q, k, v, is_causal=causal, out=out2, return_weights=True, return_lse=True)
    assert isinstance(r, tuple) and len(r) == 3 and r[0] is out2
    assert_close(out2, ref_sdpa(q, k, v, is_causal=causal), dtype)


@dtype_param
def test_out_broadcast_shape(isa, dtype, rng):
    q = randn(rng, (9, 16), dtype)
    k = randn(rng, (2, 3, 13, 16), dtype)
    v = randn(rng, (2, 3, 13, 8), dtype)
    out = np.empty((2, 3, 9, 8), dtype)
    assert sdpa(q, k, v, out=out) is out
    assert_close(out, ref_sdpa(q, k, v), dtype)


@dtype_param
@pytest.mark.parametrize("rw,rl", [(False, False), (True, False), (False, True), (True, True)])
def test_return_combinations(isa, dtype, rw, rl, rng):
    q = randn(rng, (2, 2, 10, 16), dtype)
    k = randn(rng, (2, 2, 12, 16), dtype)
    v = randn(rng, (2, 2, 12, 6), dtype)
    mask = make_mask(rng, "bool_full_rows", (10, 12))
    got = sdpa(q, k, v, mask, return_weights=rw, return_lse=rl)
    want = ref_sdpa(q, k, v, mask, return_weights=rw, return_lse=rl)
    if not (rw or rl):
        assert isinstance(got, np.ndarray)
        assert_close(got, want, dtype)
        return
    assert isinstance(got, tuple) and len(got) == 1 + rw + rl
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    if rl:
        lse = got[-1]
        assert lse.shape == (2, 2, 10)
        # the lse is the log-sum-exp of the scaled, masked scores
        scores = reference.matmul(q, np.swapaxes(k, -1, -2)) / 4.0
        scores = np.where(mask, scores, -np.inf)
        assert_close(lse, reference.logsumexp(scores), dtype, what="lse vs scores")


# --------------------------------------------------------------------------- scale


@dtype_param
@pytest.mark.parametrize("scale", [0.0, 0.1, 1.0, 2.5, -0.5])
def test_scale(isa, dtype, scale, rng):
    q = randn(rng, (2, 2, 15, 16), dtype)
    k = randn(rng, (2, 2, 18, 16), dtype)
    v = randn(rng, (2, 2, 18, 16), dtype)
    check((q, k, v), dict(scale=scale), dtype=dtype)
    check((q, k, v, make_mask(rng, "float", (15, 18), dtype)), dict(scale=scale, is_causal=True), dtype=dtype)


@dtype_param
def test_large_scores(isa, dtype, rng):
    """Scores of magnitude ~100: the max-subtraction must keep exp from overflowing."""
    q = randn(rng, (1, 2, 30, 16), dtype, scale=6.0)
    k = randn(rng, (1, 2, 40, 16), dtype, scale=6.0)
    v = randn(rng, (1, 2, 40, 16), dtype)
    (out, w, lse), _ = check((q, k, v), dtype=dtype)
    assert np.isfinite(out).all()
    if dtype == np.float64:  # scores ~ 1e4: exp would overflow without the max subtraction
        (out, w, lse), _ = check((q * 20, k * 20, v), dtype=dtype)
        assert np.isfinite(out).all()


@dtype_param
@pytest.mark.parametrize("pattern", ["rising", "spike", "falling"])
@pytest.mark.parametrize("causal", [False, True])
def test_row_max_moves_across_key_blocks(isa, dtype, pattern, causal, rng):
    """Row maxima that move by far more than the kernel's slack (2^8) from one key block to the
    next. The prefill keeps each query's softmax reference from its first key block and fuses
    the exp into the score kernel: a later block that beats it has to be redone against a new
    reference (a spike of ~180 in log2 units would overflow float32 otherwise), and masked
    (causal diagonal) blocks move the reference the two-pass way."""
    L, e = 600, 16
    q = randn(rng, (1, 2, L, e), dtype)
    k = randn(rng, (1, 2, L, e), dtype)
    v = randn(rng, (1, 2, L, e), dtype)
    q[..., 0] = 1.0
    if pattern == "rising":  # every row's max grows block after block
        k *= np.linspace(0.1, 12.0, L, dtype=dtype)[:, None]
    elif pattern == "falling":  # the first block holds the max; later P underflow
        k *= np.linspace(12.0, 0.1, L, dtype=dtype)[:, None]
    else:  # one late key scores ~125 for every query that sees it: exp(125) overflows float32
        k[..., 450, 0] = 500.0
    (out, _, lse), _ = check((q, k, v), dict(is_causal=causal), dtype=dtype)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    if pattern == "spike":  # the rows that see key 450 take (almost exactly) its value
        rows = slice(450, None) if causal else slice(None)
        np.testing.assert_allclose(
            out[..., rows, :], np.broadcast_to(v[..., 450:451, :], out[..., rows, :].shape), rtol=1e-5, atol=1e-5
        )


# --------------------------------------------------------------------------- decode

DECODE = [
    (1, 100, 8, 8),
    (1, 1000, 8, 2),
    (1, 2048, 32, 1),
    (1, 4096, 4, 4),
    (2, 513, 8, 2),
    (1, 3000, 1, 1),
    (3, 2500, 1, 1),
    (4, 777, 4, 1),
    (7, 1500, 8, 4),
    (16, 1024, 8, 2),
    (16, 301, 2, 2),
    (3, 64, 4, 2),
]


@dtype_param
@pytest.mark.parametrize("lq,lk,hq,hkv", DECODE)
def test_decode(isa, dtype, lq, lk, hq, hkv, rng):
    e = 64
    q = randn(rng, (1, hq, lq, e), dtype)
    k = randn(rng, (1, hkv, lk, e), dtype)
    v = randn(rng, (1, hkv, lk, e), dtype)
    kw = dict(enable_gqa=True, return_weights=False)
    check((q, k, v), kw, dtype=dtype)
    check((q, k, v), dict(kw, is_causal=True, causal_align="bottom_right"), dtype=dtype)
    # padded KV cache: only the first lk - 37 positions are valid
    pad = np.arange(lk) < max(lk - 37, 1)
    check((q, k, v, pad), kw, dtype=dtype)


@dtype_param
@pytest.mark.parametrize(
    "pattern",
    [
        "first_half_masked",
        "last_half_masked",
        "one_key_middle",
        "one_key_first",
        "one_key_last",
        "all_masked",
        "stripes",
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_masked_chunks(isa, dtype, pattern, threads, rng):
    """Split-K decode: chunks whose keys are all masked must merge without NaN."""
    lk = 2000
    q = randn(rng, (1, 1, 1, 64), dtype)
    k = randn(rng, (1, 1, lk, 64), dtype)
    v = randn(rng, (1, 1, lk, 64), dtype)
    allowed = np.ones(lk, bool)
    if pattern == "first_half_masked":
        allowed[: lk // 2 + 250] = False
    elif pattern == "last_half_masked":
        allowed[lk // 2 - 250 :] = False
    elif pattern.startswith("one_key"):
        allowed[:] = False
        allowed[{"one_key_middle": lk // 2 + 1, "one_key_first": 0, "one_key_last": lk - 1}[pattern]] = True
    elif pattern == "all_masked":
        allowed[:] = False
    else:
        allowed[(np.arange(lk) // 300) % 2 == 1] = False
    with pyattn.num_threads(threads):
        (out, w, lse), _ = check((q, k, v, allowed), dtype=dtype)
        check((q, k, v, np.where(allowed, 0.0, -np.inf).astype(dtype)), dtype=dtype)
        # the same pattern with several queries in a chunked-prefill (bottom_right causal)
        q4 = randn(rng, (1, 2, 4, 64), dtype)
        check((q4, k, v, allowed), dict(is_causal=True, causal_align="bottom_right", return_weights=False), dtype=dtype)
    assert not np.isnan(out).any()


@dtype_param
@pytest.mark.parametrize("hq, hkv", [(1, 1), (4, 1)])
def test_decode_block_max_every_position(isa, dtype, hq, hkv, rng):
    """Decode blocks take each row's maximum in vector lanes: one dominant key at every position
    of the first blocks (each lane, the tails), with scores large enough that a maximum missed
    anywhere would overflow exp2 and give inf or NaN."""
    e, lk = 64, 150
    q = randn(rng, (1, hq, 1, e), dtype)
    for j in list(range(0, 70)) + [127, 128, 149]:
        k = randn(rng, (1, hkv, lk, e), dtype) * 0.1
        k[:, :, j] = np.repeat(q[:, :1, 0], hkv, axis=0) * (200.0 if dtype == np.float32 else 2000.0) / np.sqrt(e)
        v = randn(rng, (1, hkv, lk, e), dtype)
        (out, _), _ = check((q, k, v), dict(enable_gqa=True, return_weights=False), dtype=dtype)
        assert np.isfinite(out).all(), j


@dtype_param
def test_many_small_heads(isa, dtype, rng):
    q = randn(rng, (32, 16, 5, 8), dtype)
    k = randn(rng, (32, 16, 7, 8), dtype)
    v = randn(rng, (32, 16, 7, 8), dtype)
    check((q, k, v), dtype=dtype)
    check((q, k, v, make_mask(rng, "bool_full_rows", (32, 1, 5, 7))), dict(is_causal=True), dtype=dtype)


@dtype_param
def test_decode_batched_padding(isa, dtype, rng):
    """A batch of decodes with different cache lengths (the padding is per batch)."""
    b, hq, hkv, lk = 3, 8, 2, 600
    q = randn(rng, (b, hq, 1, 64), dtype)
    k = randn(rng, (b, hkv, lk, 64), dtype)
    v = randn(rng, (b, hkv, lk, 64), dtype)
    lengths = np.array([600, 1, 333])
    mask = (np.arange(lk)[None, :] < lengths[:, None])[:, None, None, :]
    check((q, k, v, mask), dict(enable_gqa=True), dtype=dtype)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "dts",
    [
        (np.float32, np.float64, np.float32),
        (np.float64, np.float32, np.float32),
        (np.float32, np.float32, np.float64),
        (np.float64, np.float64, np.float64),
        (np.float32, np.float32, np.float32),
    ],
)
def test_mixed_dtypes(isa, dts, rng):
    q = randn(rng, (2, 2, 9, 16), dts[0])
    k = randn(rng, (2, 2, 11, 16), dts[1])
    v = randn(rng, (2, 2, 11, 8), dts[2])
    expected = np.result_type(*dts)
    check((q, k, v), dtype=expected)
    check((q, k, v), dict(is_causal=True), dtype=expected)


def test_mask_dtype_does_not_change_result_dtype(isa, rng):
    q = randn(rng, (2, 2, 9, 16), np.float32)
    k = randn(rng, (2, 2, 11, 16), np.float32)
    v = randn(rng, (2, 2, 11, 8), np.float32)
    for mask in (make_mask(rng, "float", (9, 11), np.float64), make_mask(rng, "bool", (9, 11))):
        out = sdpa(q, k, v, mask)
        assert_close(out, ref_sdpa(q, k, v, mask), np.float32)


def test_array_likes(isa):
    """Anything np.asarray accepts (nested lists) is taken; lists of floats are float64."""
    x = [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]
    out = sdpa(x, x, x)
    assert_close(out, ref_sdpa(x, x, x), np.float64)


# --------------------------------------------------------------------------- NaN / inf


@dtype_param
def test_nan_propagates(isa, dtype, rng):
    q = randn(rng, (1, 1, 6, 8), dtype)
    k = randn(rng, (1, 1, 9, 8), dtype)
    v = randn(rng, (1, 1, 9, 8), dtype)
    q[0, 0, 2, 3] = np.nan
    out = sdpa(q, k, v)
    assert np.isnan(out[0, 0, 2]).all()
    assert np.isfinite(np.delete(out[0, 0], 2, axis=0)).all()
    assert_close(out, ref_sdpa(q, k, v), dtype)
    # a NaN value only poisons the output column it is in
    v2 = v.copy()
    v2[0, 0, 4, 1] = np.nan
    out = sdpa(q[..., [0, 1, 3, 4, 5], :], k, v2)
    assert np.isnan(out[..., 1]).all()
    assert np.isfinite(np.delete(out, 1, axis=-1)).all()


@pytest.mark.parametrize("kv", ["f32", "f64", "f16", "bf16"])
@pytest.mark.parametrize(
    "lq, lk, group",
    [(1, 9, 1), (2, 7, 4), (3, 70, 2), (5, 1, 1), (16, 16, 1), (32, 32, 4), (40, 130, 1), (100, 77, 2)],
)
@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True),
        dict(is_causal=True, causal_align="bottom_right"),
        dict(window=(5, 0), is_causal=True, causal_align="bottom_right"),
        dict(window=(3, 2)),
        dict(kv_lens="half"),
    ],
    ids=["causal", "causal_br", "window_causal", "window", "kv_lens"],
)
def test_a_nan_value_hidden_by_position_stays_out(isa, kv, lq, lk, group, kw, rng):
    """api.md: keys a query cannot see by position are never part of its output, not even as 0 *
    NaN, on the decode path (few queries) and the prefill tiles alike, where an edge crosses a block
    (every query of a vector or tile of the kernel used to take the whole block's values)."""
    dtype = np.float64 if kv == "f64" else np.float32
    kvt = {"f32": np.float32, "f64": np.float64, "f16": np.float16}.get(kv)
    if kv == "bf16":
        kvt = pytest.importorskip("ml_dtypes").bfloat16
    kw = dict(kw)
    if kw.get("kv_lens") == "half":
        kw["kv_lens"] = np.array([max(1, lk // 2)])
    hkv = 2
    q = randn(rng, (1, hkv * group, lq, 16), dtype)
    k = randn(rng, (1, hkv, lk, 16), dtype).astype(kvt)
    v = randn(rng, (1, hkv, lk, 16), dtype).astype(kvt)
    clean = v.astype(dtype)
    _, w = ref_sdpa(q, k.astype(dtype), clean, enable_gqa=group > 1, return_weights=True, **kw)
    seen = w[0, ::group] > 0  # (hkv, lq, lk): which keys each query of the kv head's first query head sees
    for bad in (np.nan, np.inf):
        for j in {0, lk // 3, lk - 1}:
            v2 = v.copy()
            v2[0, :, j, 3] = bad
            got = sdpa(q, k, v2, enable_gqa=group > 1, **kw)
            want = ref_sdpa(q, k.astype(dtype), clean, enable_gqa=group > 1, **kw)
            for h in range(hkv * group):
                sees = seen[h // group, :, j]
                rows = got[0, h][~sees]
                assert_close(rows, want[0, h][~sees], dtype, what=f"head {h}, rows that cannot see key {j}")
                if np.isnan(bad):
                    assert np.isnan(got[0, h][sees, 3]).all()


@dtype_param
def test_inf_input_does_not_crash(isa, dtype, rng):
    """An inf in a key: NaN exactly in the rows where it makes the scores +inf (as the reference),
    the right values in the others."""
    q = randn(rng, (1, 1, 6, 8), dtype)
    k = randn(rng, (1, 1, 9, 8), dtype)
    v = randn(rng, (1, 1, 9, 8), dtype)
    q[0, 0, :, 0] = np.abs(q[0, 0, :, 0]) * np.array([1, -1, 1, -1, -1, 1])  # both signs
    k[0, 0, 3, 0] = np.inf
    kw = dict(return_lse=True)
    got = sdpa(q, k, v, **kw)
    with np.errstate(invalid="ignore"):
        want = ref_sdpa(q, k, v, **kw)
    nan_rows = q[0, 0, :, 0] > 0  # score +inf: inf - inf in the softmax
    assert np.isnan(want[0][0, 0][nan_rows]).all() and np.isfinite(want[0][0, 0][~nan_rows]).all()
    for name, g, w in zip(["output", "lse"], got, want):
        assert_close(g, w, dtype, what=name)


# --------------------------------------------------------------------------- threads, per path


@dtype_param
@pytest.mark.parametrize("lq,lk,hq,hkv", [(1, 1500, 8, 2), (4, 700, 2, 1), (64, 64, 4, 4), (129, 300, 2, 2)])
def test_threads_agree(isa, dtype, lq, lk, hq, hkv, rng):
    q = randn(rng, (1, hq, lq, 48), dtype)
    k = randn(rng, (1, hkv, lk, 48), dtype)
    v = randn(rng, (1, hkv, lk, 40), dtype)
    check_threads_agree(q, k, v, dtype, enable_gqa=True, is_causal=True, causal_align="bottom_right")


def check_threads_agree(q, k, v, dtype, **kw):
    """Output and lse close to the reference for 1, 2 and 3 threads, and the same bits for all."""
    kw = dict(kw, return_lse=True)
    want = ref_sdpa(q, k, v, **kw)
    first = None
    for n in (1, 2, 3):
        with pyattn.num_threads(n):
            got = sdpa(q, k, v, **kw)
        for name, g, w in zip(["output", "lse"], got, want):
            assert_close(g, w, dtype, what=f"{name} with {n} threads")
        first = got if first is None else first
        for name, g, g1 in zip(["output", "lse"], got, first):  # the work splits alike for any count
            np.testing.assert_array_equal(g, g1, err_msg=f"{name} with {n} threads differs from 1 thread's")


@pytest.mark.parametrize("kv_lens", [None, [40, 17, 33]], ids=["even", "uneven"])
def test_threads_agree_short_prefill(isa, kv_lens, rng):
    """A short GQA prefill, one query group per head: with every head's keys as many the threads
    take the heads in equal runs, with kv_lens of different lengths on demand; the same bits for
    any thread count either way."""
    q = randn(rng, (3, 8, 32, 64), np.float32)
    k = randn(rng, (3, 2, 40, 64), np.float32)
    v = randn(rng, (3, 2, 40, 64), np.float32)
    lens = None if kv_lens is None else np.array(kv_lens)
    check_threads_agree(q, k, v, np.float32, enable_gqa=True, is_causal=True, causal_align="bottom_right", kv_lens=lens)


# --------------------------------------------------------------------------- tiny weights


@dtype_param
@pytest.mark.parametrize("lq", [1, 37], ids=["decode", "prefill"])
def test_weights_below_the_normal_range_are_zero(isa, dtype, lq):
    """A weight under the smallest normal number (2^-126; float64 2^-1022) of its row's reference
    is 0, never a subnormal: on Intel each instruction touching one takes a microcode assist
    (ALiBi over 2048 keys ran 3.3x slower than plain attention, peaked scores 83x). One above it
    counts. Values of 2^116 / 2^96 (float64: 2^1012 / 2^992) make each such weight add 2^-20 to
    the output, far above the tolerance."""
    floor = -126 if dtype == np.float32 else -1022
    # log2-unit scores: the max (0) first, then one 10 under the floor and one 10 over it, then
    # keys that cannot count; the same after a first block of 300 keys that holds the row's
    # running maximum at a lower score (the online softmax's rescale keeps it too)
    scores = np.array([0.0, floor - 10, floor + 10] + [-1e4] * 40, dtype)
    vals = np.zeros(scores.size)
    vals[0] = 1.0
    vals[1] = 2.0 ** (-(floor - 10) - 20)  # weight 2^(floor - 10) x value = 2^-20: dropped
    vals[2] = 2.0 ** (-(floor + 10) - 20)  # weight 2^(floor + 10) x value = 2^-20: kept
    e = 4
    for lead in (0, 300):
        s = np.concatenate([np.full(lead, -1e4, dtype), scores]) if lead else scores
        if lead:
            s[0] = float(floor) + 5  # the first block's maximum, far under the row's
        lk = s.size
        q = np.zeros((1, 1, lq, e), dtype)
        q[..., 0] = 1.0
        k = np.zeros((1, 1, lk, e), dtype)
        k[0, 0, :, 0] = s * np.log(2.0)  # scale 1: q . k in log2 units is s
        v = np.zeros((1, 1, lk, e), dtype)
        v[0, 0, lead:, 0] = vals
        if lead:
            v[0, 0, 0, 0] = 2.0 ** (-(floor + 5) - 20)  # weight 2^(floor + 5): kept, adds 2^-20
        out = pyattn.scaled_dot_product_attention(q, k, v, scale=1.0)
        kept = 1.0 + 2.0**-20 + (2.0**-20 if lead else 0.0)
        np.testing.assert_allclose(out[..., 0], kept, rtol=2e-7 if dtype == np.float32 else 1e-12)
        assert np.all(out[..., 1:] == 0)


def _alibi_sink(slope, boost, L):
    """One early key scores `boost` (natural units) above the rest for every query, causal ALiBi:
    the running reference starts far above what later queries' visible scores reach."""
    q = np.zeros((1, 1, L, 2), np.float32)
    q[..., 0] = 1
    k = np.zeros((1, 1, L, 2), np.float32)
    k[0, 0, 0, 0] = boost
    v = np.zeros((1, 1, L, 2), np.float32)
    v[..., 0] = 1
    v[0, 0, 0, 1] = 1
    kw = dict(scale=1.0, alibi_slopes=np.array([slope], np.float32), is_causal=True, return_lse=True)
    got = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    want = reference.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    return got, want


@pytest.mark.parametrize("slope", [0.5, 0.25])
def test_alibi_with_a_far_sink_keeps_its_rows(isa, slope):
    """A review of the subnormal change found that a floor on the weights dropped whole rows here
    (inf outputs, zero rows with lse -inf; 1e-3 errors with the normal range's floor): ALiBi's
    reference for a block, its first keys' raw maximum plus the block's largest bias, can sit far
    above every score a later query sees, and the floor is taken against it. The reference now
    moves down where it exceeds every score taken in by over 64 binades (lower_reference)."""
    (o, lse), (wo, wl) = _alibi_sink(slope, 80.0, 320)
    np.testing.assert_allclose(o, wo, rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, wl, rtol=2e-6)


def _alibi_far_block(dtype, slope, lk=256, split=128):
    """Keys 0..split-1 score slope * (lk - split) (natural units), so key split-1 is the last
    query's best at 0 after its bias; the later keys score -10. The last row, both ways."""
    q = np.zeros((1, 1, lk, 2), dtype)
    q[..., 0] = 1
    k = np.zeros((1, 1, lk, 2), dtype)
    k[0, 0, :split, 0] = slope * (lk - split)
    k[0, 0, split:, 0] = -10.0
    v = np.zeros((1, 1, lk, 2), dtype)
    v[0, 0, split - 1, 0] = 1
    v[..., 1] = 1
    kw = dict(scale=1.0, alibi_slopes=np.array([slope], dtype), return_lse=True)
    o, lse = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    wo, wl = reference.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    return o[..., -1, :], wo[..., -1, :]


@pytest.mark.parametrize(
    "dtype, slope", [(np.float32, 0.5), (np.float32, 0.6), (np.float32, 0.8), (np.float64, 6.0)], ids=str
)
def test_alibi_raw_scores_that_fall_as_the_bias_rises(isa, dtype, slope):
    """The raw scores drop by slope * 128 + 10 where the bias rises by slope * 128: anticipate_bias
    used to raise the reference by the rise before the block, scaling what the earlier keys held
    by 2^-148 (float32, slope 0.8; 2^-1108 for float64, slope 6), which left nothing of them: the
    row came out as zeros in every kernel set. A rise past kRiseMax now takes the block the
    two-pass way, and a reference that ends far above every score moves down (lower_reference)."""
    got, want = _alibi_far_block(dtype, slope)
    # the float32 scores reach ~110 (log2 units), whose spacing is 7.6e-6: 3e-6 of the output is
    # rounding (the 8x32 AVX-512 tile's panel placement); the bug gave rows of zeros
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype, rise", [(np.float32, 99.0), (np.float64, 990.0)], ids=["f32", "f64"])
def test_alibi_rise_on_top_of_a_stale_reference(isa, dtype, rise):
    """Found by an adversarial pass over the change above: a block 60 binades under its
    reference (which lower_reference allows up to 64), then a bias rise just under kRiseMax taken
    ahead, put the earlier keys 159 binades down (float64: 1050), past the floor: half the weight
    was lost (float32 output error 0.71, lse off by ln 2) in every kernel set. The rise is now
    measured from the best score taken in, not from the reference."""
    bk, lq = 128, 16
    lk = 3 * bk + lq
    s = rise / np.log2(np.e) / bk  # the bias rises by `rise` binades a 128-key block
    x = 60 / np.log2(np.e)  # block 1 lies 60 binades under its reference
    raw = np.zeros(lk)
    raw[bk : 2 * bk] = -x
    raw[2 * bk : 3 * bk] = -x - s * bk  # block 2 scores as high as block 1 after its bias
    raw[3 * bk :] = -x - 2 * s * bk
    q = np.zeros((1, 1, lq, 2), dtype)
    q[..., 0] = 1
    k = np.zeros((1, 1, lk, 2), dtype)
    k[0, 0, :, 0] = raw
    v = np.random.default_rng(0).standard_normal((1, 1, lk, 2)).astype(dtype)
    kw = dict(
        scale=1.0, is_causal=True, causal_align="bottom_right", alibi_slopes=np.array([s], dtype), return_lse=True
    )
    o, lse = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    wo, wl = reference.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    tol = 1e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(o, wo, rtol=0, atol=tol * np.abs(wo).max())
    np.testing.assert_allclose(lse, wl, rtol=0, atol=1e-4 if dtype == np.float32 else 1e-9)


def test_alibi_negative_slope_with_a_sink(isa):
    """Found by the same pass: a negative slope (the bias grows with distance), non-causal, one
    key 140 above the rest: rows 18-30 lost the key's weight on the 128-key-block sets (output
    error 0.35, lse 34.9); the same bias as an additive mask was right."""
    rng = np.random.default_rng(5)
    lq, lk, slope = 300, 257, -0.48
    q = rng.standard_normal((1, 1, lq, 2))
    q[..., 0] = 1
    q[..., 1] *= 0.3
    k = rng.standard_normal((1, 1, lk, 2))
    k[0, 0, 0, 0] = 140.0
    v = rng.standard_normal((1, 1, lk, 2))
    q, k, v = (a.astype(np.float32) for a in (q, k, v))
    kw = dict(scale=1.0, alibi_slopes=np.array([slope], np.float32), return_lse=True)
    o, lse = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    wo, wl = reference.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)), **kw)
    np.testing.assert_allclose(o, wo, rtol=0, atol=1e-5 * np.abs(wo).max())
    np.testing.assert_allclose(lse, wl, rtol=1e-5)


# ------------------------------------------------ short prefills with an edge (query-row tiles)

# Shapes of the short-prefill path that takes a row per query (causal or a window, at most 128
# keys, at most 256 queries, Ev a whole number of vectors) and of its limits: 129 keys, 257
# queries and Ev = 40 (not whole AVX-512 vectors) take the panels.
SHORT_EDGE_SHAPES = [
    (32, 32, 32, 8, 128, 128),  # a 32-token Llama-shaped prefill
    (33, 33, 1, 1, 64, 64),
    (7, 128, 4, 2, 16, 32),
    (100, 77, 2, 1, 64, 64),
    (256, 100, 3, 3, 48, 64),
    (9, 9, 8, 8, 64, 48),
    (129, 129, 2, 1, 64, 64),
    (257, 128, 2, 2, 32, 32),
    (24, 24, 2, 2, 64, 40),
]
SHORT_EDGE_KW = {
    "causal": dict(is_causal=True),
    "causal_br": dict(is_causal=True, causal_align="bottom_right"),
    "window_causal": dict(is_causal=True, window=(5, 0)),
    "window": dict(window=(6, 3)),
    "variants": dict(is_causal=True, softcap=3.0, alibi="slopes", sinks="sinks", kv_lens="half"),
    "mask_causal": dict(is_causal=True, attn_mask="bool"),
}


def _short_edge_args(rng, dtype, lq, lk, hq, hkv, e, ev, kw):
    q = randn(rng, (2, hq, lq, e), dtype)
    k = randn(rng, (2, hkv, lk, e), dtype)
    v = randn(rng, (2, hkv, lk, ev), dtype)
    kw = dict(kw, enable_gqa=hq != hkv)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.5, hq)
    if kw.pop("sinks", None):
        kw["sinks"] = rng.uniform(-1.0, 2.0, hq)
    if kw.get("kv_lens") == "half":
        kw["kv_lens"] = np.array([lk, max(1, lk // 2)])
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = bool_mask(rng, (2, 1, lq, lk))
    return (q, k, v), kw


@dtype_param
@pytest.mark.parametrize("lq,lk,hq,hkv,e,ev", SHORT_EDGE_SHAPES)
@pytest.mark.parametrize("kw", list(SHORT_EDGE_KW.values()), ids=list(SHORT_EDGE_KW))
def test_short_prefill_with_an_edge(isa, dtype, lq, lk, hq, hkv, e, ev, kw, rng):
    """Output, weights and lse against the reference, every score variant and a mask through the
    row tiles; the same bits for 1, 2 and 3 threads (the rows are cut into runs by thread count)."""
    args, kw = _short_edge_args(rng, dtype, lq, lk, hq, hkv, e, ev, kw)
    check(args, kw, dtype)
    check_threads_agree(*args, dtype, **kw)


@pytest.mark.parametrize("lq,lk", [(12, 12), (60, 60), (9, 200)], ids=["rows", "panels", "long"])
def test_a_nan_score_makes_the_whole_weights_row_nan(isa, lq, lk, rng):
    """A row with a NaN score has NaN weights at every key, as in the reference, also at the keys
    outside its tiles (they kept the caller's zeros); its output and lse are NaN, the other rows
    are right."""
    q = randn(rng, (1, 1, lq, 8), np.float32)
    k = randn(rng, (1, 1, lk, 8), np.float32)
    v = randn(rng, (1, 1, lk, 16), np.float32)
    k[0, 0, 1, 0] = np.nan  # seen by every row from 1 on (top-left causal)
    kw = dict(is_causal=True, return_weights=True, return_lse=True)
    got = sdpa(q, k, v, **kw)
    want = ref_sdpa(q, k, v, **kw)
    for name, g, w in zip(["output", "weights", "lse"], got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"NaN pattern of the {name}")
        assert_close(np.nan_to_num(g), np.nan_to_num(w), np.float32, what=name)
    assert np.isnan(got[1][0, 0, 1:]).all()


@pytest.mark.parametrize("lq,lk", [(1, 9), (12, 12), (60, 60), (23, 8)], ids=["decode", "rows", "panels", "empty"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_mask_entry_at_a_key_hidden_by_position_changes_nothing(isa, lq, lk, bad, rng):
    """An additive mask's NaN or +-inf where the query cannot see the key by position (causal,
    kv_lens) is not added to anything (it was: -inf + NaN made the row NaN), on the decode, the
    row tiles and the panels; a row that sees no key stays zeros with lse -inf."""
    q = randn(rng, (1, 2, lq, 8), np.float32)
    k = randn(rng, (1, 2, lk, 8), np.float32)
    v = randn(rng, (1, 2, lk, 16), np.float32)
    kw = dict(is_causal=True, causal_align="bottom_right", kv_lens=np.array([lk - 1]), return_lse=True)
    mask = rng.uniform(-1.0, 1.0, (lq, lk)).astype(np.float32)
    mask[:, lk - 1] = bad  # past kv_lens: hidden from every query
    for i in range(lq):  # and the first key each query cannot see by causality, where there is one
        j = i + (lk - 1) - lq + 1
        if 0 <= j < lk:
            mask[i, j] = bad
    got = sdpa(q, k, v, mask, **kw)
    want = ref_sdpa(q, k, v, mask, **kw)
    assert np.isfinite(got[0]).all()
    for name, g, w in zip(["output", "lse"], got, want):
        assert_close(g, w, np.float32, what=name)


@pytest.mark.parametrize("ev", [32, 48, 36], ids=["rows", "rows48", "panels"])
def test_an_inf_value_with_a_heavy_sink_stays_inf(isa, ev):
    """Key 0 weighs e^-190 next to a sink of 120 (below float32's range once normalised) and its
    value is inf: queries 1-3 give inf, as the reference and the panels' acc / l do, not 0 * inf
    = NaN from a normalised weight that underflowed (the short rows scale the output when a sink
    is given). Query 0 sees key 0 alone and is NaN (inf - inf in its own output; not asserted)."""
    q = np.ones((1, 1, 12, 1), np.float32)
    k = np.zeros((1, 1, 12, 1), np.float32)
    k[0, 0, 1:, 0] = 70.0
    v = np.ones((1, 1, 12, ev), np.float32)
    v[0, 0, 0, 0] = np.inf
    kw = dict(is_causal=True, scale=1.0, sinks=np.array([120.0]))
    got = sdpa(q, k, v, **kw)
    with np.errstate(all="ignore"):
        want = ref_sdpa(q, k, v, **kw)
    np.testing.assert_array_equal(got[0, 0, 1:4, 0], want[0, 0, 1:4, 0])
    assert np.isinf(got[0, 0, 1:4, 0]).all()


# Decode rows: up to 32 query rows (Lq x group) share each K/V row read. Past 16 rows these
# calls used to take the prefill panels, one query head at a time (an MQA decode step, Hq32 Hkv1,
# ran 14x slower; a 5-token speculative verify of Hq32 Hkv8 2.7x slower than at 4 tokens).
@dtype_param
@pytest.mark.parametrize(
    "lq,hq,hkv", [(1, 32, 1), (2, 16, 1), (3, 64, 8), (4, 8, 1), (5, 8, 2), (8, 8, 2), (8, 4, 1), (9, 8, 2)]
)
@pytest.mark.parametrize(
    "kw", [dict(), dict(softcap=5.0, alibi="slopes", sinks="sinks", kv_lens="half")], ids=["plain", "variants"]
)
def test_decode_rows_of_large_groups(isa, dtype, lq, hq, hkv, kw, rng):
    """Output and lse against the reference for decode groups of 17-32 rows (and 36: the
    prefill), bottom-right causal over a longer cache; the same bits for 1, 2 and 3 threads."""
    args, kw = _short_edge_args(
        rng, dtype, lq, 300, hq, hkv, 64, 64, dict(kw, is_causal=True, causal_align="bottom_right")
    )
    check(args, dict(kw, return_weights=False), dtype)
    check_threads_agree(*args, dtype, **kw)


def test_long_decode_error_grows_slowly(isa):
    """A decode over 131072 keys (several heads per call, each head's keys one task) keeps
    float32's error near sqrt growth: each block's P V is summed from zero and then added to the
    output, as the prefill does. With the accumulator one chain of FMAs over every key the
    median error was 16 ulp (61 max) here; now ~3 (13 max). The same through kvcache_attention
    with grouped heads (its int8-free float32 cache path)."""
    H, D, Lk = 4, 32, 1 << 17
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, H, 1, D), dtype=np.float32)
    k = rng.standard_normal((1, H, Lk, D), dtype=np.float32)
    v = rng.random((1, H, Lk, D), dtype=np.float32)  # outputs ~0.5: no cancellation to hide behind
    s = np.einsum("hkd,hd->hk", k[0].astype(np.float64), q[0, :, 0].astype(np.float64)) / np.sqrt(D)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = np.einsum("hk,hkd->hd", p, v[0].astype(np.float64)) / p.sum(1)[:, None]
    eps = np.finfo(np.float32).eps
    for got in (
        pyattn.scaled_dot_product_attention(q, k, v)[0, :, 0],
        pyattn.kvcache_attention(np.repeat(q, 2, axis=1), k, v, [Lk])[0, ::2, 0],  # two query heads a kv head
    ):
        ulp = np.abs(got - ref) / (np.abs(ref) * eps)
        assert np.median(ulp) < 6 and ulp.max() < 30, (np.median(ulp), ulp.max())
