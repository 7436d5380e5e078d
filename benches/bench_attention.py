"""scaled_dot_product_attention, float32: pyattn beside the NumPy reference, torch and ONNX Runtime.

One pytest-benchmark group per shape of docs/performance.md. Every item checks its output against
a float64 oracle (``pyattn.reference`` on float64 copies), computed once per shape outside the
timing; on the long shapes only on a few heads and rows, so that the check stays cheap.
``extra_info`` carries the FLOPs (2*B*H*Lq*Lk*(E+Ev), halved for causal) and the bytes of q, k, v
and the output, from which the report computes GFLOP/s and GB/s (the latter is what matters for
decode).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import peers
import pytest
from benchutil import SmokeCase, assert_close, normal, pyattn_threads, rng_for, run_timed, smoke_mode

import pyattn
from pyattn import reference

IMPLS = ("pyattn", "numpy_ref", "torch", "onnxruntime")
REL_TOL = 2e-5  # float32 result vs the float64 oracle, relative to max |oracle|


@dataclass(frozen=True)
class Case(SmokeCase):
    lead: tuple  # batch axes before the head axis, e.g. (1,) or (2, 1) for 5-D inputs
    hq: int
    lq: int
    lk: int
    e: int
    ev: int = 0  # 0: same as e
    hkv: int = 0  # 0: same as hq (no grouped-query)
    causal: bool = False
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.ev:
            object.__setattr__(self, "ev", self.e)
        if not self.hkv:
            object.__setattr__(self, "hkv", self.hq)

    @property
    def gqa(self) -> bool:
        return self.hkv != self.hq

    @property
    def name(self) -> str:
        tags = []
        if self.causal:
            tags.append("causal")
        if self.lq == 1:
            tags.append("decode")
        if self.gqa:
            tags.append("GQA")
        if len(self.lead) > 1:
            tags.append(f"{len(self.lead) + 3}-D")
        batch = "x".join(map(str, self.lead))
        heads = f"Hq{self.hq} Hkv{self.hkv}" if self.gqa else f"H{self.hq}"
        seq = f"L{self.lq}" if self.lq == self.lk else f"Lq{self.lq} Lk{self.lk}"
        dims = f"D{self.e}" if self.e == self.ev else f"E{self.e} Ev{self.ev}"
        cross = ["cross"] if self.lq not in (1, self.lk) else []
        return " ".join(tags + [f"B{batch}", heads, seq, dims] + cross)

    @property
    def batch(self) -> int:
        return int(np.prod(self.lead))

    @property
    def flops(self) -> float:
        f = 2.0 * self.batch * self.hq * self.lq * self.lk * (self.e + self.ev)
        return f / 2 if self.causal else f

    @property
    def bytes(self) -> int:
        per = self.hq * self.lq * (self.e + self.ev) + self.hkv * self.lk * (self.e + self.ev)
        return 4 * self.batch * per


# The full shapes; ``smoke`` gives the small version used under --benchmark-disable (same
# features: batch, cross, causal, E != Ev, 5-D, decode, GQA; lengths that are not tile multiples).
CASES = [
    Case((1,), 8, 2048, 2048, 64, smoke=dict(lq=200, lk=200)),
    Case((1,), 8, 4096, 4096, 128, smoke=dict(hq=2, hkv=2, lq=300, lk=300)),
    Case((1,), 12, 512, 512, 64, smoke=dict(lq=96, lk=96)),
    Case((8,), 12, 128, 128, 64, smoke=dict(lead=(3,), lq=64, lk=64)),
    Case((4,), 8, 128, 512, 64, smoke=dict(lead=(2,), lq=40, lk=136)),
    Case((1,), 32, 1024, 1024, 128, causal=True, smoke=dict(hq=4, hkv=4, lq=160, lk=160)),
    Case((1,), 8, 4096, 4096, 128, causal=True, smoke=dict(hq=2, hkv=2, lq=333, lk=333)),
    Case((1,), 8, 2048, 2048, 64, ev=128, smoke=dict(lq=150, lk=150)),
    Case((2, 1), 8, 1024, 1024, 64, smoke=dict(lq=100, lk=100)),
    Case((1,), 32, 1, 4096, 128, smoke=dict(hq=8, hkv=8, lk=1000)),
    Case((1,), 32, 1, 4096, 128, hkv=8, smoke=dict(hq=8, hkv=2, lk=1000)),
]


def pytest_generate_tests(metafunc):
    if {"case", "impl"} <= set(metafunc.fixturenames):
        small = smoke_mode(metafunc.config)
        cases = [c.small() if small else c for c in CASES]
        metafunc.parametrize(
            ("case", "impl"),
            [pytest.param(c, impl, id=f"{c.name.replace(' ', '_')}-{impl}") for c in cases for impl in IMPLS],
        )


@functools.lru_cache(maxsize=1)
def inputs(case: Case):
    rng = rng_for("attention", case.name)
    q = normal(rng, case.lead + (case.hq, case.lq, case.e))
    k = normal(rng, case.lead + (case.hkv, case.lk, case.e))
    v = normal(rng, case.lead + (case.hkv, case.lk, case.ev))
    return q, k, v


def _check_plan(case: Case):
    """Which part of the output the oracle covers: (index of the leading axes, query heads,
    key/value heads, query rows).  All of it when small; else the last batch entry, the last two
    kv groups of heads and 256 rows (the first 64, where causal rows are short, and the last 192)."""
    if case.batch * case.hq * case.lq * case.lk <= (1 << 22):
        return (), slice(None), slice(None), slice(None)
    lead = tuple(n - 1 for n in case.lead)
    g = case.hq // case.hkv
    nkv = min(2, case.hkv)
    qh = slice(case.hq - nkv * g, case.hq)
    kvh = slice(case.hkv - nkv, case.hkv)
    rows = slice(None) if case.lq <= 256 else np.r_[0:64, case.lq - 192 : case.lq]
    return lead, qh, kvh, rows


@functools.lru_cache(maxsize=1)
def oracle(case: Case) -> np.ndarray:
    """float64 pyattn.reference on (a part of) the case; see _check_plan."""
    q, k, v = inputs(case)
    lead, qh, kvh, rows = _check_plan(case)
    q64 = q[lead][..., qh, :, :][..., rows, :].astype(np.float64)
    k64 = k[lead][..., kvh, :, :].astype(np.float64)
    v64 = v[lead][..., kvh, :, :].astype(np.float64)
    kw = {"enable_gqa": True} if case.gqa else {}
    if isinstance(rows, slice):
        return reference.scaled_dot_product_attention(q64, k64, v64, is_causal=case.causal, **kw)
    mask = None
    if case.causal:  # top-left: query row i sees keys j <= i, on the chosen rows
        mask = np.arange(case.lk)[None, :] <= rows[:, None]
    return reference.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, **kw)


def check(case: Case, out, what: str) -> None:
    out = np.asarray(out)
    expected_shape = case.lead + (case.hq, case.lq, case.ev)
    assert out.shape == expected_shape, f"{what}: output shape {out.shape} != {expected_shape}"
    lead, qh, _, rows = _check_plan(case)
    assert_close(out[lead][..., qh, :, :][..., rows, :], oracle(case), REL_TOL, what)


def test_attention(benchmark, case: Case, impl: str):
    benchmark.group = f"attention {case.name}"
    benchmark.extra_info.update(kind="attention", impl=impl, flops=case.flops, bytes=case.bytes, shape=case.name)
    q, k, v = inputs(case)
    kw = {"enable_gqa": True} if case.gqa else {}
    finish = np.asarray

    if impl == "pyattn":

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **kw)
    elif impl == "numpy_ref":
        # pyattn.reference computes in float64 and materialises the Lq x Lk scores.
        def fn():
            return reference.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **kw)
    else:
        try:
            prepared = peers.ATTENTION_PEERS[impl](
                q, k, v, is_causal=case.causal, enable_gqa=case.gqa, num_threads=pyattn_threads()
            )
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
        benchmark.extra_info["peer"] = prepared.note

    out = finish(run_timed(benchmark, fn))
    if impl == "pyattn":
        assert out.dtype == np.float32, f"pyattn returned {out.dtype} for float32 inputs"
    check(case, out, f"{impl} on {case.name}")
