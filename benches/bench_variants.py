"""The score variants of issue 9 (window, softcap, ALiBi, sinks, kv_lens, float16 / bfloat16 K/V):
pyattn with each variant beside the plain kernel and beside the peers, in four kinds of group.

1. ``variants B.. H.. L.. D..`` (the long and the short batched shape of docs/performance.md,
   non-causal): ``pyattn`` (plain), ``pyattn+softcap`` (50), ``pyattn+alibi`` (slopes
   2**(-8h/H), h = 1..H), ``pyattn+sinks``, ``pyattn+kv_lens`` (= L, all keys) and
   ``pyattn+all4`` (the four together), and ``pyattn+bf16kv`` (plain, bfloat16 K/V: the
   issue's bf16 prefill target, skipped without ml_dtypes); peers: plain torch SDPA and ONNX
   Runtime MultiHeadAttention, and ``torch+alibi`` (SDPA with the ALiBi bias as an explicit
   (1, H, L, L) float mask, as BLOOM / MPT do on torch).  Target: every variant >= 90% of the
   plain GFLOP/s, i.e. ``peer / pyattn`` <= 1.11 on the pyattn+ rows.
2. ``variants window ...``: causal sliding window (Mistral's sliding_window W = window (W-1, 0) +
   is_causal) at B1 H8 L16384 D64, W = 1024: ``pyattn`` with the window, ``pyattn_full_causal``
   (the plain causal kernel at the same L), torch SDPA with an explicit L x L bool mask, ONNX
   Runtime GroupQueryAttention with ``local_window_size``.  FLOPs are counted on the visible pairs
   (4*H*D*sum_i min(i+1, W)) for every item but ``pyattn_full_causal`` (its causal pairs), so the
   GFLOP/s column compares the kernels' efficiency (target: window >= 85% of full causal) and
   ``peer / pyattn`` the times (about 8x for the full causal kernel).
3. ``variants decode half K/V ...``: B1 H32 Lq1 Lk8192 D128 with float32, float16 and bfloat16
   K/V (ml_dtypes; skipped without it) and a float32 query; peers: torch SDPA float32, torch
   with bfloat16 q/k/v, ONNX Runtime float32.  ``bytes`` is the K/V bytes read (half for
   float16 / bfloat16), so the GB/s column is the streaming rate (target: bf16 >= 1.7x the
   float32 decode, >= 80% of the read bandwidth).
4. ``variants decode kv_lens ...``: a preallocated cache of Lmax = 16384 keys with kv_lens =
   4096 (``pyattn+kv_lens``) beside ``pyattn`` on a cache of exactly 4096 keys (target: within
   10%), and torch SDPA on the Lmax cache with a bool key-padding mask.  Bytes: the valid K/V.

Every item checks its result against the float64 ``pyattn.reference`` (with the same keywords),
computed once per shape outside the timing; on the long shapes only on some heads or rows
(window: the first and the last 64 queries of the last head, on the matching slice of keys with
bottom_right alignment).  ``smoke`` (under --benchmark-disable): small shapes, same features.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np
import peers
import pytest
from benchutil import (
    SmokeCase,
    assert_close,
    attention_flops,
    decode_qkv,
    normal,
    pyattn_threads,
    rng_for,
    run_timed,
    smoke_mode,
)

import pyattn
from pyattn import reference

try:
    import ml_dtypes
except ImportError:  # optional: the bfloat16 items skip
    ml_dtypes = None

REL_TOL = 2e-5  # float32 result vs the float64 oracle, relative to max |oracle|
BF16_REL_TOL = 1e-2  # torch with bfloat16 q/k/v and a bfloat16 output


def half_dtype(name: str):
    """float16, or ml_dtypes.bfloat16 (the item skips without ml_dtypes)."""
    if name == "float16":
        return np.dtype(np.float16)
    if ml_dtypes is None:
        pytest.skip("bfloat16 K/V need ml_dtypes (not installed)")
    return np.dtype(ml_dtypes.bfloat16)


def causal_window_pairs(lq: int, left) -> int:
    """(query, key) pairs visible with is_causal and window (left, 0), Lq == Lk: sum_i min(i+1, left+1)."""
    i = np.arange(lq, dtype=np.int64)
    return int(np.sum(i + 1 if left is None else np.minimum(i + 1, left + 1)))


# ----------------------------------------------------------------------------- 1. per variant
@dataclass(frozen=True)
class VarCase(SmokeCase):
    b: int
    h: int
    l: int
    d: int
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"variants B{self.b} H{self.h} L{self.l} D{self.d}"

    @property
    def flops(self) -> float:
        return attention_flops(self.b, self.h, self.l * self.l, self.d)

    def bytes(self, kv_itemsize: int = 4) -> int:
        return (2 * 4 + 2 * kv_itemsize) * self.b * self.h * self.l * self.d  # q, output; k, v


VAR_CASES = [
    VarCase(1, 8, 2048, 64, smoke=dict(l=200)),
    VarCase(8, 12, 128, 64, smoke=dict(b=3, l=72)),
]
VARIANTS = (
    "pyattn",
    "pyattn+softcap",
    "pyattn+alibi",
    "pyattn+sinks",
    "pyattn+kv_lens",
    "pyattn+all4",
    "pyattn+bf16kv",
)
VAR_IMPLS = VARIANTS + ("torch", "torch+alibi", "onnxruntime")
SOFTCAP = 50.0


@functools.lru_cache(maxsize=1)
def var_inputs(case: VarCase):
    rng = rng_for("variants", case.name)
    q = normal(rng, (case.b, case.h, case.l, case.d))
    k = normal(rng, (case.b, case.h, case.l, case.d))
    v = normal(rng, (case.b, case.h, case.l, case.d))
    slopes = (2.0 ** (-8.0 * np.arange(1, case.h + 1) / case.h)).astype(np.float32)
    sinks = normal(rng, (case.h,))
    kv_lens = np.full((case.b,), case.l, dtype=np.int32)
    return q, k, v, slopes, sinks, kv_lens


@functools.lru_cache(maxsize=1)
def var_bf16_kv(case: VarCase):
    _, k, v, _, _, _ = var_inputs(case)
    dt = half_dtype("bfloat16")
    return k.astype(dt), v.astype(dt)


def variant_kv(case: VarCase, variant: str):
    """The key and value of a variant: bfloat16 for pyattn+bf16kv, else the float32 ones."""
    if variant == "pyattn+bf16kv":
        return var_bf16_kv(case)
    _, k, v, _, _, _ = var_inputs(case)
    return k, v


def variant_kwargs(case: VarCase, variant: str) -> dict:
    _, _, _, slopes, sinks, kv_lens = var_inputs(case)
    every = {"softcap": SOFTCAP, "alibi_slopes": slopes, "sinks": sinks, "kv_lens": kv_lens}
    name = variant.partition("+")[2]
    if name in ("", "bf16kv"):
        return {}
    if name == "all4":
        return every
    if name == "alibi":
        return {"alibi_slopes": slopes}
    return {name: every[name]}


def var_check_plan(case: VarCase):
    """Batch entries and heads the oracle covers: all when small, else the last batch entry and
    the last two heads (every row: ALiBi depends on the row's position)."""
    if case.b * case.h * case.l * case.l <= (1 << 22):
        return slice(None), slice(None)
    return slice(case.b - 1, case.b), slice(case.h - 2, case.h)


@functools.lru_cache(maxsize=8)
def var_oracle(case: VarCase, variant: str) -> np.ndarray:
    q = var_inputs(case)[0]
    k, v = variant_kv(case, variant)  # bfloat16 converts exactly to float64
    bs, hs = var_check_plan(case)
    kw = variant_kwargs(case, variant)
    for key in ("alibi_slopes", "sinks"):  # per head: the checked heads' values
        if key in kw:
            kw[key] = kw[key][hs]
    if "kv_lens" in kw:
        kw["kv_lens"] = kw["kv_lens"][bs]
    q64, k64, v64 = (a[bs, hs].astype(np.float64) for a in (q, k, v))
    return reference.scaled_dot_product_attention(q64, k64, v64, **kw)


def alibi_bias(case: VarCase) -> np.ndarray:
    """The ALiBi bias as an explicit float32 (1, H, L, L) mask: -slope_h * |i - j|."""
    _, _, _, slopes, _, _ = var_inputs(case)
    dist = np.abs(np.arange(case.l)[:, None] - np.arange(case.l)[None, :]).astype(np.float32)
    return (-slopes[:, None, None] * dist)[None]


def test_variants(benchmark, var_case: VarCase, impl: str):
    case = var_case
    benchmark.group = case.name
    kv_size = 2 if impl == "pyattn+bf16kv" else 4
    benchmark.extra_info.update(
        kind="attention", impl=impl, flops=case.flops, bytes=case.bytes(kv_size), shape=case.name
    )
    q, k, v, _, _, _ = var_inputs(case)
    finish = np.asarray
    variant = impl if impl in VARIANTS else ("pyattn+alibi" if impl == "torch+alibi" else "pyattn")

    if impl in VARIANTS:
        k, v = variant_kv(case, impl)
        kw = variant_kwargs(case, impl)
        benchmark.extra_info["variant"] = {
            key: (val if np.isscalar(val) else f"{np.asarray(val).dtype} {np.shape(val)}") for key, val in kw.items()
        }

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, **kw)
    else:
        try:
            if impl == "torch+alibi":
                prepared = peers.prepare_torch_sdpa(q, k, v, attn_mask=alibi_bias(case), num_threads=pyattn_threads())
            else:
                prepared = peers.ATTENTION_PEERS[impl](
                    q, k, v, is_causal=False, enable_gqa=False, num_threads=pyattn_threads()
                )
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note

    out = finish(run_timed(benchmark, fn))
    if impl in VARIANTS:
        assert out.dtype == np.float32, f"pyattn returned {out.dtype} for float32 inputs"
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    bs, hs = var_check_plan(case)
    assert_close(out[bs, hs], var_oracle(case, variant), REL_TOL, f"{impl} on {case.name}")


# ------------------------------------------------------------------------ 2. sliding window
@dataclass(frozen=True)
class WinCase(SmokeCase):
    h: int
    l: int
    d: int
    left: int  # window (left, 0) with is_causal: Mistral's sliding_window = left + 1
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"variants window causal B1 H{self.h} L{self.l} D{self.d} window ({self.left}, 0)"

    def flops(self, left) -> float:
        return attention_flops(1, self.h, causal_window_pairs(self.l, left), self.d)

    @property
    def bytes(self) -> int:
        return 4 * 4 * self.h * self.l * self.d


WIN_CASES = [WinCase(8, 16384, 64, 1023, smoke=dict(h=2, l=700, left=127))]
WIN_IMPLS = ("pyattn", "pyattn_full_causal", "torch", "onnxruntime")
WIN_ROWS = 64  # the oracle covers the first and the last WIN_ROWS queries of the last head


@functools.lru_cache(maxsize=1)
def win_inputs(case: WinCase):
    rng = rng_for("variants-window", case.name)
    return tuple(normal(rng, (1, case.h, case.l, case.d)) for _ in range(3))


def win_blocks(case: WinCase):
    rows = min(WIN_ROWS, case.l)
    return ((0, rows), (case.l - rows, case.l)) if case.l > rows else ((0, case.l),)


@functools.lru_cache(maxsize=2)
def win_oracle(case: WinCase, left) -> np.ndarray:
    """float64 reference on the last head, rows of win_blocks, each on the keys its rows may see:
    keys [start, stop) for query rows [a, stop), causal bottom_right, window (left, 0)."""
    q, k, v = win_inputs(case)
    h = case.h - 1
    parts = []
    for a, stop in win_blocks(case):
        start = 0 if left is None else max(0, a - left)
        q64, k64, v64 = (x[0, h, lo:stop].astype(np.float64) for x, lo in ((q, a), (k, start), (v, start)))
        parts.append(
            reference.scaled_dot_product_attention(
                q64,
                k64,
                v64,
                is_causal=True,
                causal_align="bottom_right",
                window=None if left is None else (left, 0),
            )
        )
    return np.concatenate(parts, axis=0)


def test_window(benchmark, win_case: WinCase, impl: str):
    case = win_case
    benchmark.group = case.name
    left = None if impl == "pyattn_full_causal" else case.left
    benchmark.extra_info.update(
        kind="attention", impl=impl, flops=case.flops(left), bytes=case.bytes, shape=case.name, window=[left, 0]
    )
    q, k, v = win_inputs(case)
    finish = np.asarray

    if impl == "pyattn":

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, is_causal=True, window=(case.left, 0))
    elif impl == "pyattn_full_causal":

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        try:
            if impl == "torch":
                i = np.arange(case.l)
                mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - case.left)  # (L, L), True = keep
                prepared = peers.prepare_torch_sdpa(q, k, v, attn_mask=mask, num_threads=pyattn_threads())
                del mask  # torch holds it
            else:
                prepared = peers.prepare_ort_window_prefill(q, k, v, left=case.left, num_threads=pyattn_threads())
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note

    out = finish(run_timed(benchmark, fn))
    if impl.startswith("pyattn"):
        assert out.dtype == np.float32, f"pyattn returned {out.dtype} for float32 inputs"
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    got = np.concatenate([out[0, case.h - 1, a:stop] for a, stop in win_blocks(case)], axis=0)
    assert_close(got, win_oracle(case, left), REL_TOL, f"{impl} on {case.name}")


# ----------------------------------------------------------------------- 3. decode, half K/V
@dataclass(frozen=True)
class DecCase(SmokeCase):
    h: int
    lk: int
    d: int
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"variants decode half K/V B1 H{self.h} Lq1 Lk{self.lk} D{self.d}"

    @property
    def flops(self) -> float:
        return attention_flops(1, self.h, self.lk, self.d)

    def kv_bytes(self, itemsize: int) -> int:
        return 2 * self.h * self.lk * self.d * itemsize


DEC_CASES = [DecCase(32, 8192, 128, smoke=dict(h=8, lk=1000))]
DEC_IMPLS = ("pyattn", "pyattn+f16kv", "pyattn+bf16kv", "torch", "torch_bf16", "onnxruntime")


@functools.lru_cache(maxsize=1)
def dec_inputs(case: DecCase):
    return decode_qkv("variants-decode-half", case.name, case.h, case.h, case.lk, case.d)


@functools.lru_cache(maxsize=3)
def dec_kv(case: DecCase, kv_dtype: str):
    """K and V in ``kv_dtype`` (rounded once, outside the timing)."""
    _, k, v = dec_inputs(case)
    if kv_dtype == "float32":
        return k, v
    dt = half_dtype(kv_dtype)
    return k.astype(dt), v.astype(dt)


@functools.lru_cache(maxsize=3)
def dec_oracle(case: DecCase, kv_dtype: str) -> np.ndarray:
    """float64 reference on the K/V as given (half K/V convert exactly to float64)."""
    q, _, _ = dec_inputs(case)
    k, v = dec_kv(case, kv_dtype)
    return reference.scaled_dot_product_attention(q, k, v)


def test_decode_half_kv(benchmark, dec_case: DecCase, impl: str):
    case = dec_case
    benchmark.group = case.name
    kv_dtype = {"pyattn+f16kv": "float16", "pyattn+bf16kv": "bfloat16", "torch_bf16": "bfloat16"}.get(impl, "float32")
    itemsize = 4 if kv_dtype == "float32" else 2
    benchmark.extra_info.update(
        kind="attention",
        impl=impl,
        flops=case.flops,
        bytes=case.kv_bytes(itemsize),  # the K/V read: what bounds decode
        shape=case.name,
        kv_dtype=kv_dtype,
    )
    q, k32, v32 = dec_inputs(case)
    finish = np.asarray
    tol = REL_TOL

    if impl.startswith("pyattn"):
        k, v = dec_kv(case, kv_dtype)

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v)

        expected = dec_oracle(case, kv_dtype)
    else:
        try:
            if impl == "torch_bf16":
                prepared = peers.prepare_torch_sdpa(q, k32, v32, dtype="bfloat16", num_threads=pyattn_threads())
            else:
                prepared = peers.ATTENTION_PEERS[impl](
                    q, k32, v32, is_causal=False, enable_gqa=False, num_threads=pyattn_threads()
                )
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note
        if impl == "torch_bf16":  # oracle on the bfloat16-rounded q, k, v; bfloat16 output
            dt = half_dtype("bfloat16")
            k, v = dec_kv(case, "bfloat16")
            expected = reference.scaled_dot_product_attention(q.astype(dt), k, v)
            tol = BF16_REL_TOL
        else:
            expected = dec_oracle(case, "float32")

    out = finish(run_timed(benchmark, fn))
    if impl.startswith("pyattn"):
        assert out.dtype == np.float32, f"pyattn returned {out.dtype} for a float32 query and {kv_dtype} K/V"
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    assert_close(out, expected, tol, f"{impl} on {case.name}")


# ------------------------------------------------------------------------ 4. decode, kv_lens
@dataclass(frozen=True)
class KvCase(SmokeCase):
    h: int
    lmax: int
    n: int  # kv_lens: the valid keys of the cache
    d: int
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"variants decode kv_lens B1 H{self.h} Lq1 Lmax{self.lmax} kv_lens {self.n} D{self.d}"

    @property
    def flops(self) -> float:
        return attention_flops(1, self.h, self.n, self.d)

    @property
    def bytes(self) -> int:
        return 2 * 4 * self.h * self.n * self.d  # the valid K/V


KV_CASES = [KvCase(32, 16384, 4096, 128, smoke=dict(h=8, lmax=2000, n=501))]
KV_IMPLS = ("pyattn", "pyattn+kv_lens", "torch")


@functools.lru_cache(maxsize=1)
def kv_inputs(case: KvCase):
    """q, the (1, H, Lmax, D) K/V cache (random past kv_lens too), and a cache of exactly n keys."""
    rng = rng_for("variants-decode-kv_lens", case.name)
    q = normal(rng, (1, case.h, 1, case.d))
    k = normal(rng, (1, case.h, case.lmax, case.d))
    v = normal(rng, (1, case.h, case.lmax, case.d))
    k_n, v_n = (np.ascontiguousarray(a[:, :, : case.n]) for a in (k, v))
    return q, k, v, k_n, v_n


@functools.lru_cache(maxsize=1)
def kv_oracle(case: KvCase) -> np.ndarray:
    q, _, _, k_n, v_n = kv_inputs(case)
    return reference.scaled_dot_product_attention(q, k_n, v_n)


def test_decode_kv_lens(benchmark, kv_case: KvCase, impl: str):
    case = kv_case
    benchmark.group = case.name
    benchmark.extra_info.update(kind="attention", impl=impl, flops=case.flops, bytes=case.bytes, shape=case.name)
    q, k, v, k_n, v_n = kv_inputs(case)
    finish = np.asarray

    if impl == "pyattn":

        def fn():
            return pyattn.scaled_dot_product_attention(q, k_n, v_n)
    elif impl == "pyattn+kv_lens":
        kv_lens = np.array([case.n], dtype=np.int32)

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, kv_lens=kv_lens)
    else:
        keep = (np.arange(case.lmax) < case.n).reshape(1, 1, 1, case.lmax)  # key padding, True = keep
        try:
            prepared = peers.prepare_torch_sdpa(q, k, v, attn_mask=keep, num_threads=pyattn_threads())
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note + " on the Lmax cache"

    out = finish(run_timed(benchmark, fn))
    if impl.startswith("pyattn"):
        assert out.dtype == np.float32, f"pyattn returned {out.dtype} for float32 inputs"
    assert out.shape == q.shape, f"{impl}: output shape {out.shape} != {q.shape}"
    assert_close(out, kv_oracle(case), REL_TOL, f"{impl} on {case.name}")


# ------------------------------------------------------------------------------- parametrize
PARAMS = {
    "var_case": (VAR_CASES, VAR_IMPLS),
    "win_case": (WIN_CASES, WIN_IMPLS),
    "dec_case": (DEC_CASES, DEC_IMPLS),
    "kv_case": (KV_CASES, KV_IMPLS),
}


def _id(name: str) -> str:
    """A test id from a group name: spaces to '_', other punctuation dropped."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "", name.replace(" ", "_"))


def pytest_generate_tests(metafunc):
    for argname, (cases, impls) in PARAMS.items():
        if {argname, "impl"} <= set(metafunc.fixturenames):
            small = smoke_mode(metafunc.config)
            cases = [c.small() if small else c for c in cases]
            metafunc.parametrize(
                (argname, "impl"),
                [pytest.param(c, impl, id=f"{_id(c.name)}-{impl}") for c in cases for impl in impls],
            )
