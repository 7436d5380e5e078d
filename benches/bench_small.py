"""Small calls (issue 11): calls of a few to a few hundred microseconds, where per-call overhead
rather than the kernel decides, beside torch SDPA and the NumPy a user would write.

One pytest-benchmark group per shape, items ``pyattn``, ``torch`` and ``numpy``:

- ``small smallest call``: B1 H1 Lq1 Lk16 D64.
- ``small GPT-2 small decode``: B1 and B4, H12 Lq1 D64, contexts 128, 256, 512 and 1024.
- ``small Llama-3-8B decode``: B1 Hq32 Hkv8 Lq1 D128 (``enable_gqa``), contexts 512 and 4096.
- ``small prefill 32 tokens``: causal B1 H12 L32 D64, and Llama-shaped B1 Hq32 Hkv8 L32 D128.
- ``small kvcache_attention decode``: ``pyattn`` is ``kvcache_attention`` on a contiguous float32
  cache (B1 Hkv8 Lmax1024 D128) holding 512 tokens (``cache_lens`` = 512) with ``k_new`` /
  ``v_new`` one token, query B1 Hq32 Lq1: it writes the token at slot 512 and attends the 513
  keys. Every round rewrites the same slot, so the cache does not grow. ``torch``: SDPA
  (``enable_gqa``) on the slice ``cache[:, :, :513]`` already holding the token;
  ``torch_append``: the same after writing the token with ``copy_`` (the whole decode step);
  ``numpy``: writes the token, then the NumPy attention on the slice. No target of its own: it
  tracks the cache path's per-call cost, to be read beside the Llama decode group at context 512.
- ``small GPT-2 small decode, cold cache`` (B1 H12 Lq1 D64, contexts 512 and 1024) and ``small
  Llama-3-8B decode, cold cache`` (B1 Hq32 Hkv8 Lq1 D128, context 1024): the decode steps above
  as a model makes them. Between two steps of one layer the model's other layers (their weights
  and caches) pass through the CPU's caches, so a layer's K/V come from memory; the groups above
  time the same call again and again, with K/V in cache whenever they fit. Here every round is
  one call after ``EVICT_BYTES`` have been read outside the timing. No target of its own: read
  it beside the warm group of the same shape (docs/performance.md, "decode from a cold cache").

Peers. ``torch``: ``F.scaled_dot_product_attention`` on tensors made once outside the timing
with ``torch.from_numpy`` (zero-copy), ``torch.set_num_threads`` set to pyattn's thread count, the
timing loop run under one ``torch.no_grad()`` (as a decode loop is: entering it is not part of a
call). ``numpy``: ``s = q @ k.swapaxes(-1, -2) * scale``, minus its row maximum, ``np.exp``,
divided by the row sum, ``@ v``, in float32. With GQA the query is reshaped (a view) to (B, Hkv,
group * Lq, D), so each kv head's keys are read once and never repeated (exact for decode; for
the GQA prefill the causal mask is tiled over the group's rows). Causal prefill adds a -inf upper
triangle, made once outside the timing as a model keeps its mask buffer.

Targets (issue 11; ``peer / pyattn`` in the report, above 1: pyattn is faster):

- the smallest call: at most 0.5x torch's time (``torch / pyattn`` >= 2);
- every decode step (GPT-2 small, Llama-3-8B-shaped): at least 1.5x torch and 2x NumPy;
- the 32-token prefills: at least 1.5x torch.

They are also in each pyattn item's ``extra_info["targets"]`` ({peer: least peer / pyattn}).

Timing: a call of microseconds needs many iterations for a stable median, so every item runs
``ROUNDS`` rounds of at least ``MIN_ITERATIONS / ROUNDS`` calls each (more when a call is short:
a round lasts at least ``ROUND_S``; fewer only when that would take over ``ITEM_S`` in all, i.e.
calls of milliseconds, where one call's jitter matters less), after one warm-up round and
``SETTLE_S`` of quiet (a previous item's spinning thread pool slows the next one). Every item
checks its result (the last timed call's) against the float64 ``pyattn.reference``, computed once
per shape outside the timing. Under ``--benchmark-disable`` (smoke) the shapes shrink and every
item runs once.

Threads: pyattn's count (``OMP_NUM_THREADS``, or the cores), torch set to the same; NumPy's
OpenBLAS uses its own (``OPENBLAS_NUM_THREADS``). On a loaded machine two-thread runs of calls
this short measure mostly the scheduler (a thread team waits for a descheduled member); there
``OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1`` gives steadier ratios.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import time
from dataclasses import dataclass, field

import numpy as np
import peers
import pytest
from benchutil import SETTLE_S, SmokeCase, assert_close, attention_flops, normal, pyattn_threads, rng_for, smoke_mode

import pyattn
from pyattn import reference

IMPLS = ("pyattn", "torch", "numpy")
KVCACHE_IMPLS = ("pyattn", "torch", "torch_append", "numpy")
REL_TOL = 2e-5  # float32 result vs the float64 oracle, relative to max |oracle|

ROUNDS = 10  # the median is over rounds
MIN_ITERATIONS = 2000  # calls per item, over all rounds
ROUND_S = 0.05  # the least duration of a round: short calls get more iterations than the minimum
ITEM_S = 8.0  # but a slow call (milliseconds, or a loaded machine) gets no more than this in all

SMALLEST = {"torch": 2.0}
DECODE = {"torch": 1.5, "numpy": 2.0}
PREFILL = {"torch": 1.5}


@dataclass(frozen=True)
class Case(SmokeCase):
    what: str
    b: int
    hq: int
    lq: int
    lk: int  # keys attended; kvcache: tokens held before the new one
    d: int
    hkv: int = 0  # 0: same as hq
    causal: bool = False
    lmax: int = 0  # kvcache: the cache's capacity (0: not a cache case)
    targets: dict = field(default_factory=dict, compare=False, hash=False)
    smoke: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not self.hkv:
            object.__setattr__(self, "hkv", self.hq)

    @property
    def gqa(self) -> bool:
        return self.hkv != self.hq

    @property
    def keys(self) -> int:
        """Keys one call attends (kvcache: the held tokens and the new one)."""
        return self.lk + 1 if self.lmax else self.lk

    @property
    def name(self) -> str:
        heads = f"Hq{self.hq} Hkv{self.hkv}" if self.gqa else f"H{self.hq}"
        if self.lmax:
            return (
                f"small {self.what} B{self.b} {heads} Lq{self.lq} D{self.d} float32, "
                f"{self.lk} held + 1 new (Lmax {self.lmax})"
            )
        seq = f"L{self.lq}" if self.lq == self.lk else f"Lq{self.lq} Lk{self.lk}"
        return " ".join(
            ["small", self.what] + (["causal"] if self.causal else []) + [f"B{self.b}", heads, seq, f"D{self.d}"]
        )

    @property
    def flops(self) -> float:
        pairs = self.lq * self.keys
        return attention_flops(self.b, self.hq, pairs / 2 if self.causal else pairs, self.d)

    @property
    def bytes(self) -> int:
        """q, the K/V read and the output."""
        return 4 * self.b * (2 * self.hq * self.lq * self.d + 2 * self.hkv * self.keys * self.d)


def _gpt2(b: int, lk: int, smoke_lk: int) -> Case:
    return Case("GPT-2 small decode", b, 12, 1, lk, 64, targets=DECODE, smoke=dict(hq=3, hkv=3, lk=smoke_lk))


CASES = [
    Case("smallest call", 1, 1, 1, 16, 64, targets=SMALLEST, smoke=dict(lk=13, d=40)),
    *[_gpt2(b, lk, lk // 8 + 3) for b in (1, 4) for lk in (128, 256, 512, 1024)],
    *[
        Case("Llama-3-8B decode", 1, 32, 1, lk, 128, hkv=8, targets=DECODE, smoke=dict(hq=8, hkv=2, lk=lk // 6 + 1))
        for lk in (512, 4096)
    ],
    Case("prefill 32 tokens", 1, 12, 32, 32, 64, causal=True, targets=PREFILL, smoke=dict(hq=3, hkv=3, lq=19, lk=19)),
    Case(
        "prefill 32 tokens",
        1,
        32,
        32,
        32,
        128,
        hkv=8,
        causal=True,
        targets=PREFILL,
        smoke=dict(hq=8, hkv=2, lq=21, lk=21),
    ),
]
COLD_CASES = [
    *[
        Case("GPT-2 small decode, cold cache", 1, 12, 1, lk, 64, smoke=dict(hq=3, hkv=3, lk=lk // 8 + 3))
        for lk in (512, 1024)
    ],
    Case("Llama-3-8B decode, cold cache", 1, 32, 1, 1024, 128, hkv=8, smoke=dict(hq=8, hkv=2, lk=130)),
]
COLD_ROUNDS = 60  # one call a round
EVICT_BYTES = 96 << 20  # read before each call: three times a 32 MiB L3
KVCACHE_CASES = [
    Case("kvcache_attention decode", 1, 32, 1, 512, 128, hkv=8, lmax=1024, smoke=dict(hq=8, hkv=2, lk=77, lmax=130)),
]


@functools.lru_cache(maxsize=1)
def inputs(case: Case):
    """q (B, Hq, Lq, D), k and v (B, Hkv, Lk, D); for a cache case also the new token's k and v
    (B, Hkv, 1, D)."""
    rng = rng_for("small", case.name)
    q = normal(rng, (case.b, case.hq, case.lq, case.d))
    k, v = (normal(rng, (case.b, case.hkv, case.lk, case.d)) for _ in range(2))
    if not case.lmax:
        return q, k, v, None, None
    k_new, v_new = (normal(rng, (case.b, case.hkv, 1, case.d)) for _ in range(2))
    return q, k, v, k_new, v_new


@functools.lru_cache(maxsize=1)
def oracle(case: Case) -> np.ndarray:
    """float64 pyattn.reference over the keys one call attends (a cache case: held + new)."""
    q, k, v, k_new, v_new = inputs(case)
    if case.lmax:
        k, v = np.concatenate([k, k_new], axis=2), np.concatenate([v, v_new], axis=2)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    return reference.scaled_dot_product_attention(q64, k64, v64, is_causal=case.causal, enable_gqa=case.gqa)


def make_cache(case: Case, with_new: bool):
    """A fresh contiguous float32 cache pair (B, Hkv, Lmax, D) holding the case's tokens, and the
    new token at slot Lk when ``with_new`` (else zeros there: the call must write it)."""
    _, k, v, k_new, v_new = inputs(case)
    caches = []
    for held, new in ((k, k_new), (v, v_new)):
        c = np.zeros((case.b, case.hkv, case.lmax, case.d), np.float32)
        c[:, :, : case.lk] = held
        if with_new:
            c[:, :, case.lk : case.lk + 1] = new
        caches.append(c)
    return caches


def numpy_attention(case: Case):
    """The NumPy a careful user writes, as a function of (q, k, v): float32 throughout, GQA by
    reshaping q to (B, Hkv, group * Lq, D) (a view; k and v are never repeated), causal by adding
    a -inf upper triangle made here, once."""
    g = case.hq // case.hkv
    scale = np.float32(1.0 / math.sqrt(case.d))
    bias = None
    if case.causal:
        tri = np.triu(np.full((case.lq, case.keys), -np.inf, np.float32), 1)
        bias = np.tile(tri, (g, 1))  # row j * Lq + i of a kv head's block is query head j's row i
    shape_q = (case.b, case.hkv, g * case.lq, case.d)
    shape_o = (case.b, case.hq, case.lq, case.d)

    def attend(q, k, v):
        s = q.reshape(shape_q) @ k.swapaxes(-1, -2) * scale
        if bias is not None:
            s += bias
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        return (p @ v).reshape(shape_o)

    return attend


def _torch():
    try:
        return peers.torch_set_threads(pyattn_threads())
    except peers.Unsupported as exc:
        pytest.skip(f"torch: {exc}")


def time_small(benchmark, fn, grad_off=None):
    """Time fn over ``ROUNDS`` rounds of many iterations; return its last result. Under
    --benchmark-disable fn runs once. ``grad_off``: a context (torch.no_grad()) the whole timing
    loop runs under."""
    with grad_off if grad_off is not None else contextlib.nullcontext():
        if not benchmark.enabled:
            return benchmark.pedantic(fn)
        time.sleep(SETTLE_S)
        fn()
        t0, n = time.perf_counter(), 0
        while n < 20 or time.perf_counter() - t0 < 0.02:  # how long one call takes
            fn()
            n += 1
        once = (time.perf_counter() - t0) / n
        iterations = max(-(-MIN_ITERATIONS // ROUNDS), math.ceil(ROUND_S / once))
        iterations = max(1, min(iterations, int(ITEM_S / ROUNDS / once)))
        benchmark.extra_info.update(rounds=ROUNDS, iterations=iterations)
        return benchmark.pedantic(fn, rounds=ROUNDS, iterations=iterations, warmup_rounds=1)


@functools.lru_cache(maxsize=1)
def _evict_buffer() -> np.ndarray:
    return np.ones(EVICT_BYTES // 4, np.float32)


def time_cold(benchmark, fn, grad_off=None):
    """Time fn one call a round over ``COLD_ROUNDS`` rounds, each after ``EVICT_BYTES`` have been
    read (outside the timing); return its last result. Under --benchmark-disable fn runs once."""
    buf = _evict_buffer()

    def evict():  # returns None: pytest-benchmark takes a setup's result as fn's arguments
        buf.sum()

    with grad_off if grad_off is not None else contextlib.nullcontext():
        if not benchmark.enabled:
            return benchmark.pedantic(fn)
        time.sleep(SETTLE_S)
        fn()
        benchmark.extra_info.update(rounds=COLD_ROUNDS, iterations=1, evicted_bytes=EVICT_BYTES)
        return benchmark.pedantic(fn, setup=evict, rounds=COLD_ROUNDS, iterations=1, warmup_rounds=1)


def _info(benchmark, case: Case, impl: str) -> None:
    benchmark.group = case.name
    benchmark.extra_info.update(kind="attention", impl=impl, flops=case.flops, bytes=case.bytes, shape=case.name)
    if impl == "pyattn" and case.targets:
        benchmark.extra_info["targets"] = dict(case.targets)


def check(case: Case, out, impl: str) -> None:
    out = np.asarray(out)
    assert out.dtype == np.float32, f"{impl} on {case.name}: {out.dtype} result for float32 inputs"
    assert_close(out, oracle(case), REL_TOL, f"{impl} on {case.name}")


def attention_call(case: Case, impl: str):
    """(fn, grad_off): impl's attention over the case's q, k, v, and the context its timing loop
    runs under (torch.no_grad() for torch, else None)."""
    q, k, v, _, _ = inputs(case)
    grad_off = None
    if impl == "pyattn":
        kw = {"enable_gqa": True} if case.gqa else {}

        def fn():
            return pyattn.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **kw)
    elif impl == "torch":
        torch = _torch()
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kw = {"is_causal": True} if case.causal else {}
        if case.gqa:
            kw["enable_gqa"] = True
        grad_off = torch.no_grad()

        def fn():
            return sdpa(tq, tk, tv, **kw)
    else:
        attend = numpy_attention(case)

        def fn():
            return attend(q, k, v)

    return fn, grad_off


def test_small(benchmark, case: Case, impl: str):
    _info(benchmark, case, impl)
    oracle(case)
    out = time_small(benchmark, *attention_call(case, impl))
    check(case, out.numpy() if impl == "torch" else out, impl)


def test_small_cold(benchmark, cold_case: Case, impl: str):
    _info(benchmark, cold_case, impl)
    oracle(cold_case)
    out = time_cold(benchmark, *attention_call(cold_case, impl))
    check(cold_case, out.numpy() if impl == "torch" else out, impl)


def test_small_kvcache(benchmark, kv_case: Case, impl: str):
    case = kv_case
    _info(benchmark, case, impl)
    q, _, _, k_new, v_new = inputs(case)
    oracle(case)
    n = case.lk
    lens = np.full((case.b,), n, np.int64)
    kc, vc = make_cache(case, with_new=impl == "torch")
    grad_off = None
    if impl == "pyattn":

        def fn():
            return pyattn.kvcache_attention(q, kc, vc, lens, k_new=k_new, v_new=v_new)
    elif impl.startswith("torch"):
        torch = _torch()
        tq, tk, tv, tk_new, tv_new = (torch.from_numpy(x) for x in (q, kc, vc, k_new, v_new))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kw = {"enable_gqa": True} if case.gqa else {}
        grad_off = torch.no_grad()
        if impl == "torch":

            def fn():
                return sdpa(tq, tk[:, :, : n + 1], tv[:, :, : n + 1], **kw)
        else:

            def fn():
                tk[:, :, n : n + 1].copy_(tk_new)
                tv[:, :, n : n + 1].copy_(tv_new)
                return sdpa(tq, tk[:, :, : n + 1], tv[:, :, : n + 1], **kw)
    else:
        attend = numpy_attention(case)

        def fn():
            kc[:, :, n : n + 1] = k_new
            vc[:, :, n : n + 1] = v_new
            return attend(q, kc[:, :, : n + 1], vc[:, :, : n + 1])

    out = time_small(benchmark, fn, grad_off)
    assert np.array_equal(kc[:, :, n : n + 1], k_new) and np.array_equal(vc[:, :, n : n + 1], v_new), (
        f"{impl}: the new token is not in the cache at slot {n}"
    )
    assert not kc[:, :, n + 1 :].any() and not vc[:, :, n + 1 :].any(), f"{impl}: wrote past slot {n}"
    check(case, out.numpy() if impl.startswith("torch") else out, impl)


def _id(name: str) -> str:
    """A test id from a group name: spaces to '_', other punctuation dropped."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "", name.replace(" ", "_"))


PARAMS = {"case": (CASES, IMPLS), "cold_case": (COLD_CASES, IMPLS), "kv_case": (KVCACHE_CASES, KVCACHE_IMPLS)}


def pytest_generate_tests(metafunc):
    for argname, (cases, impls) in PARAMS.items():
        if {argname, "impl"} <= set(metafunc.fixturenames):
            small = smoke_mode(metafunc.config)
            cases = [c.small() if small else c for c in cases]
            metafunc.parametrize(
                (argname, "impl"),
                [pytest.param(c, impl, id=f"{_id(c.name)}-{impl}") for c in cases for impl in impls],
            )
