"""Issue 8, "Defects a user hits today": one named test per defect, run on every kernel set.

Each test here failed on main before the fixes. The ones that need a process of their own (a
fork, an address-space limit) run a script in a subprocess, in a session of its own so that a
hang or a forked child never outlives the test.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

import numpy as np
import pytest
from _helpers import DTYPES, assert_close, randn, run_python
from hypothesis import given
from hypothesis import strategies as st

import pyattn
from pyattn import reference

sdpa = pyattn.scaled_dot_product_attention
ref_sdpa = reference.scaled_dot_product_attention

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])


def last_json(out, err):
    lines = out.strip().splitlines()
    assert lines, f"no output; stderr:\n{err[-3000:]}"
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- 1. NaN weights

BR = dict(is_causal=True, causal_align="bottom_right")


@dtype_param
@pytest.mark.parametrize("with_lse", [False, True], ids=["weights", "weights+lse"])
def test_bottom_right_fully_masked_rows_have_zero_weights(isa, dtype, with_lse):
    """Defect 1: bottom_right causal, Lq >= Lk + 16: fully masked rows got NaN weights (stale Tile::sub)."""
    rng = np.random.default_rng(0)
    q, k = rng.random((1, 47, 1), dtype), rng.random((1, 7, 1), dtype)
    kw = dict(BR, return_weights=True, return_lse=with_lse)
    sdpa(q, k, rng.random((1, 7, 9), dtype), **kw)  # leaves this thread's scratch behind
    v = rng.random((1, 7, 7), dtype)
    got = sdpa(q, k, v, **kw)
    out, w = got[:2]
    dead = slice(0, 47 - 7)  # query i sees keys j <= i + Lk - Lq: none for i < Lq - Lk
    assert not np.isnan(w).any(), f"{int(np.isnan(w).sum())} NaN weights"
    assert np.all(w[:, dead] == 0.0)
    assert np.all(out[:, dead] == 0.0)
    if with_lse:
        assert np.all(np.isneginf(got[2][:, dead]))
    want = ref_sdpa(q, k, v, **kw)
    for name, g, r in zip(["output", "weights", "lse"], got, want):
        assert_close(g, r, dtype, what=name)


@st.composite
def _shapes(draw):
    """(b, hkv, g, lq, lk, e, ev) with Lq > Lk ("tall": the first Lq - Lk queries see no key;
    "tall16": whole query panels of them) or Lq < Lk ("wide")."""
    b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(["tall16", "tall16", "tall", "wide"]))
    if kind == "tall16":
        gap = draw(st.integers(16, 69))
        lk = draw(st.integers(1, 70 - gap))
        lq = lk + gap
    elif kind == "tall":
        lk = draw(st.integers(1, 69))
        lq = draw(st.integers(lk + 1, 70))
    else:
        lq = draw(st.integers(1, 69))
        lk = draw(st.integers(lq + 1, 70))
    return b, hkv, g, lq, lk, draw(st.integers(1, 20)), draw(st.integers(1, 20))


class _Call(tuple):
    """(q, k, v, mask, kwargs), shown by its shapes in hypothesis' reports."""

    def __repr__(self):
        q, k, v, mask, kw = self
        m = None if mask is None else f"bool{mask.shape}"
        return f"call(q{q.shape}, k{k.shape}, v{v.shape}, mask={m}, {q.dtype}, {kw})"


@st.composite
def _problem(draw, dtype, shapes, returns=None):
    b, hkv, g, lq, lk, e, ev = shapes
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    hq = hkv * g
    q = randn(rng, (b, hq, lq, e), dtype)
    k = randn(rng, (b, hkv, lk, e), dtype)
    v = randn(rng, (b, hkv, lk, ev), dtype)
    mask = None
    if draw(st.integers(0, 2)) == 0:  # a bool mask one time in three
        heads = draw(st.sampled_from([1, hq]))
        mask = rng.random((b, heads, lq, lk)) < draw(st.sampled_from([0.3, 0.8]))
    if returns is None:
        returns = draw(st.sampled_from([(True, True), (True, False), (False, True), (False, False)]))
    kw = dict(BR, enable_gqa=g > 1, return_weights=returns[0], return_lse=returns[1])
    return _Call((q, k, v, mask, kw))


def _nudge(x, d):
    """x + d, or x - d where x + d would be < 1."""
    return x + d if x + d >= 1 else x - d


@st.composite
def bottom_right_call_sequences(draw, ncalls=4):
    """Bottom-right causal problems of one dtype, to run one after the other (the last one asks
    for weights and lse). Each shape set is fresh one time in four; otherwise it is the previous
    one with the feature sizes a little off, as a model's next call: the per-thread scratch then
    holds the previous call's values a few elements from where this call keeps its own."""
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    shapes = [draw(_shapes())]
    while len(shapes) < ncalls:
        if draw(st.integers(0, 3)) == 0:
            shapes.append(draw(_shapes()))
            continue
        b, hkv, g, lq, lk, e, ev = shapes[-1]
        which = draw(st.sampled_from(["e", "ev", "both"]))
        steps = st.sampled_from([-1, 1] if which == "both" else [-2, -1, 1, 2])
        if which != "ev":
            e = _nudge(e, draw(steps))
        if which != "e":
            ev = _nudge(ev, draw(steps))
        shapes.append((b, hkv, g, lq, lk, e, ev))
    last = len(shapes) - 1
    return [draw(_problem(dtype, s, returns=(True, True) if i == last else None)) for i, s in enumerate(shapes)]


def _check_against_reference(prob, what):
    q, k, v, mask, kw = prob
    got = sdpa(q, k, v, mask, **kw)
    want = ref_sdpa(q, k, v, mask, **kw)
    if not isinstance(got, tuple):
        got, want = (got,), (want,)
    names = ["output"] + ["weights"] * kw["return_weights"] + ["lse"] * kw["return_lse"]
    tol = 1e-10 if q.dtype == np.float64 else 2e-5
    for name, g, w in zip(names, got, want):
        assert_close(g, w, q.dtype, tol=tol, what=f"{what} {name} (Lq={q.shape[-2]}, Lk={k.shape[-2]})")


@given(bottom_right_call_sequences())
def test_fuzz_bottom_right_causal_after_other_calls(isa, calls):
    """Defect 1 (fuzz): bottom_right causal, Lq > Lk or Lq < Lk, each call right after calls of other shapes."""
    for i, prob in enumerate(calls):
        _check_against_reference(prob, f"call {i + 1} of {len(calls)}")


# --------------------------------------------------------------------------- 2. fork

_FORK_PRELUDE = r"""
import json, multiprocessing, os, signal, sys
import numpy as np, pyattn
from pyattn import reference

rng = np.random.default_rng(0)
A = rng.standard_normal((512, 512)).astype(np.float32)
Q, K, V = (rng.standard_normal((1, 2, 512, 32)).astype(np.float32) for _ in range(3))
WANT_MM = reference.matmul(A, A)
WANT_AT = reference.scaled_dot_product_attention(Q, K, V, is_causal=True)

def compute():
    # Big enough to take 2 threads: a 512^3 matmul and an attention with L = 512.
    mm = pyattn.matmul(A, A)
    at = pyattn.scaled_dot_product_attention(Q, K, V, is_causal=True)
    err = lambda got, want: float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    return {"threads": pyattn.get_num_threads(), "err_mm": err(mm, WANT_MM), "err_at": err(at, WANT_AT)}

def in_forked_child():
    # os.fork(); the child reports through a pipe and is killed by SIGALRM if it hangs.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(20)
        code = 1
        try:
            os.write(w, json.dumps(compute()).encode())
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    _, status = os.waitpid(pid, 0)
    return {"status": status, "result": json.loads(data) if data else None}

def work(_):
    return compute()
"""

_FORK_AFTER = (
    _FORK_PRELUDE
    + r"""
with pyattn.num_threads(2):
    compute()  # the parent runs parallel regions (libgomp starts its pool)
threads = pyattn.get_num_threads()
res = {"threads_before": threads}
if sys.argv[1] == "os.fork":
    res["child"] = in_forked_child()
else:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        res["children"] = pool.map_async(work, range(2)).get(timeout=20)
with pyattn.num_threads(2):
    res["parent"] = compute()
res["threads_after"] = pyattn.get_num_threads()
print(json.dumps(res))
"""
)


def _assert_computed(r, threads, what):
    assert r is not None, f"{what}: no result"
    assert r["err_mm"] < 1e-4, f"{what}: matmul wrong (relative error {r['err_mm']})"
    assert r["err_at"] < 1e-4, f"{what}: attention wrong (relative error {r['err_at']})"
    assert r["threads"] == threads, f"{what}: get_num_threads() = {r['threads']}, expected {threads}"


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@needs_fork
@pytest.mark.parametrize("how", ["os.fork", "Pool"])
def test_fork_after_parallel_call_computes(how):
    """Defect 2: a child forked after a parallel call hung in GOMP_parallel; it must compute on one thread."""
    rc, out, err = run_python(_FORK_AFTER, argv=[sys.executable, "-c", _FORK_AFTER, how])
    assert rc == 0, f"exit {rc}\nstderr:\n{err[-3000:]}"
    res = last_json(out, err)
    if how == "os.fork":
        child = res["child"]
        assert child["status"] == 0, f"child ended with wait status {child['status']} (14 = SIGALRM: hung)"
        _assert_computed(child["result"], 1, "forked child")
    else:
        assert len(res["children"]) == 2
        for r in res["children"]:
            _assert_computed(r, 1, "Pool worker")
    # the parent is not affected
    _assert_computed(res["parent"], 2, "parent after the fork")
    assert res["threads_after"] == res["threads_before"]


_FORK_BEFORE = (
    _FORK_PRELUDE
    + r"""
pyattn.set_num_threads(3)
pyattn.softmax(np.ones(4))  # a call too small to go parallel
res = {"child": in_forked_child()}
with pyattn.num_threads(2):
    res["parent"] = compute()
print(json.dumps(res))
"""
)


@needs_fork
def test_fork_before_parallel_call_keeps_thread_count():
    """Defect 2: a child forked before any parallel pyattn call keeps the parent's thread count."""
    rc, out, err = run_python(_FORK_BEFORE)
    assert rc == 0, f"exit {rc}\nstderr:\n{err[-3000:]}"
    res = last_json(out, err)
    child = res["child"]
    assert child["status"] == 0, f"child ended with wait status {child['status']} (14 = SIGALRM: hung)"
    _assert_computed(child["result"], 3, "child forked before any parallel call")
    _assert_computed(res["parent"], 2, "parent after the fork")


_FORK_AFTER_FOREIGN = (
    _FORK_PRELUDE
    + r"""
import ctypes
if sys.argv[1] == "torch":  # torch's wheel ships a libgomp.so.1: one runtime, shared with pyattn
    import torch
    torch.set_num_threads(2)
    x = torch.rand(4_000_000)
    for _ in range(3):
        (x * 2 + 1).sum()  # teams in torch's parallel_for
else:  # any other library's team in pyattn's runtime
    import pyattn._core as core
    maps = open("/proc/self/maps").read().splitlines()
    gomp = sorted({l.split()[-1] for l in maps if "libgomp" in l.split()[-1]})
    if not gomp:
        print(json.dumps({"skip": "pyattn's core runs on no libgomp here"}))
        sys.exit(0)
    lib = ctypes.CDLL(gomp[0])
    body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
    lib.GOMP_parallel.argtypes = [type(body), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    lib.GOMP_parallel(body, None, 2, 0)  # a two-thread team: the runtime starts its pool
pyattn.set_num_threads(2)
res = {"child": in_forked_child()}
with pyattn.num_threads(2):
    res["parent"] = compute()
print(json.dumps(res))
"""
)


@needs_fork
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's pool: Linux")
@pytest.mark.parametrize("team", ["GOMP_parallel", "torch"])
def test_fork_after_another_librarys_team_computes(team):
    """A child forked after torch (or any library sharing pyattn's libgomp) ran a team hung in its
    first parallel pyattn call: it inherited a pool whose threads fork did not copy. pyattn never
    ran a team in the parent, so the child keeps the full thread count."""
    if team == "torch":
        pytest.importorskip("torch")
    rc, out, err = run_python(_FORK_AFTER_FOREIGN, argv=[sys.executable, "-c", _FORK_AFTER_FOREIGN, team])
    assert rc == 0, f"exit {rc}\nstderr:\n{err[-3000:]}"
    res = last_json(out, err)
    if "skip" in res:
        pytest.skip(res["skip"])
    child = res["child"]
    assert child["status"] == 0, f"child ended with wait status {child['status']} (14 = SIGALRM: hung)"
    _assert_computed(child["result"], 2, "child forked after another library's team")
    _assert_computed(res["parent"], 2, "parent after the fork")


# --------------------------------------------------------------------------- 3. out of memory


def _rlimit_as_enforced() -> bool:
    """Whether a soft RLIMIT_AS set here reads back as set: qemu-user (the suite's AArch64 run)
    takes the call and ignores it, so nothing could ever run out of memory under it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    probe = 1 << 46 if hard == resource.RLIM_INFINITY else hard  # 64 TiB: no cap in practice
    try:
        resource.setrlimit(resource.RLIMIT_AS, (probe, hard))
        return resource.getrlimit(resource.RLIMIT_AS)[0] == probe
    except (ValueError, OSError):
        return False
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


needs_rlimit = pytest.mark.skipif(
    os.environ.get("PYATTN_SANITIZED") == "1" or not sys.platform.startswith("linux") or not _rlimit_as_enforced(),
    reason="RLIMIT_AS tests need Linux, no ASan (its shadow memory needs huge address space) and a limit "
    "that takes effect (qemu-user ignores it)",
)

# In the subprocess: limit(margin) caps the address space at what the process maps now plus
# `margin`; unlimit() lifts the cap again (the soft limit back to the hard one). Every failing
# allocation below is far larger than 64 MiB (so not served from an arena glibc has already
# reserved) and than the margin (which leaves room for the call's small Python-side objects).
_RLIMIT_PRELUDE = r"""
import json, resource, sys
import numpy as np, pyattn
from pyattn import reference

MB = 1 << 20
SOFT, HARD = resource.getrlimit(resource.RLIMIT_AS)

def vmsize():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")

def limit(margin):
    resource.setrlimit(resource.RLIMIT_AS, (vmsize() + margin, HARD))

def unlimit():
    resource.setrlimit(resource.RLIMIT_AS, (SOFT, HARD))

def attempt(fn):
    # 'MemoryError', or 'ok' if the call went through.
    try:
        fn()
    except MemoryError:
        return "MemoryError"
    finally:
        unlimit()
    return "ok"

def err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))
"""


def _hard_as_limit_allows(nbytes):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    return hard == resource.RLIM_INFINITY or hard > nbytes


@needs_rlimit
def test_softmax_out_of_memory_issue_repro_does_not_abort():
    """Defect 3: the issue's command (ulimit -v 3000000, softmax of 2 x 150M) aborted with exit 134."""
    code = (
        "import numpy as np, pyattn; r = pyattn.softmax(np.zeros((2, 150_000_000), np.float32)); "
        "print('sum', float(r[0, :1000].sum(dtype=np.float64)) * 150_000)"
    )
    cmd = f"ulimit -v 3000000 && exec {shlex.quote(sys.executable)} -c {shlex.quote(code)}"
    rc, out, err = run_python(None, argv=["bash", "-c", cmd], timeout=120)
    # x and the output (2.4 GB) fit under the 3 GB limit, and a softmax written with unit stride
    # needs no row scratch: the command completes (the allocation failures inside a parallel
    # region that it used to hit are test_out_of_memory_in_parallel_region_raises_memoryerror's)
    assert rc == 0, f"exit {rc} (-6 / 134: SIGABRT, std::terminate)\nstderr:\n{err[-2000:]}"
    assert abs(float(out.split()[-1]) - 1.0) < 1e-3, out


_OOM_SCRIPTS = {
    # softmax along axis 0 of an (n, 2) array: rows of n elements written with stride 2 go
    # through an n-element per-thread buffer (128 MiB), allocated by each thread of the team.
    "softmax": r"""
n = 32 * MB
x = np.zeros((n, 2), np.float32)
o = np.empty_like(x)
with pyattn.num_threads(2):
    pyattn.softmax(np.zeros((60000, 2), np.float32), axis=0)  # starts the team
    limit(32 * MB)
    outcome = attempt(lambda: pyattn.softmax(x, axis=0, out=o))
    small = np.random.default_rng(0).standard_normal((20000, 3))
    after = err(pyattn.softmax(small, axis=0), reference.softmax(small, axis=0))
""",
    # prefill attention, 2 heads of 16 queries and E = Ev = 2^20 in float64: each thread's
    # query-tile scratch holds NP*NR*(E + Ev) elements (>= 128 MiB).
    "attention": r"""
E = 1 << 20
rng = np.random.default_rng(0)
q = rng.standard_normal((2, 16, E)) / 64
k = rng.standard_normal((2, 1, E)) / 64
v = rng.standard_normal((2, 1, E))
o = np.empty((2, 16, E))
wq, wk, wv = (rng.standard_normal(s) for s in [(2, 64, 64), (2, 200, 64), (2, 200, 64)])
with pyattn.num_threads(2):
    pyattn.scaled_dot_product_attention(wq, wk, wv)  # starts the team
    limit(32 * MB)
    outcome = attempt(lambda: pyattn.scaled_dot_product_attention(q, k, v, out=o))
    after = err(pyattn.scaled_dot_product_attention(wq, wk, wv),
                reference.scaled_dot_product_attention(wq, wk, wv))
""",
    # batched matmul (4 x (1 x 256) @ (256 x 65000), B not unit-stride by columns so not the
    # GEMV path): the batch path gives each thread its own packed copy of B (~133 MB).
    "matmul": r"""
rng = np.random.default_rng(0)
a = rng.standard_normal((4, 1, 256))
b = rng.standard_normal((65000, 256)).T
o = np.empty((4, 1, 65000))
wa, wb = rng.standard_normal((8, 64, 64)), rng.standard_normal((64, 64))
with pyattn.num_threads(2):
    pyattn.matmul(wa, wb)  # the same batch path, small: starts the team
    limit(32 * MB)
    outcome = attempt(lambda: pyattn.matmul(a, b, out=o))
    after = err(pyattn.matmul(a, b), np.matmul(a, b))
""",
}


@needs_rlimit
@pytest.mark.parametrize("what", list(_OOM_SCRIPTS))
def test_out_of_memory_in_parallel_region_raises_memoryerror(what):
    """Defect 3: bad_alloc of per-thread scratch inside an OpenMP region aborted (134), not MemoryError."""
    if not _hard_as_limit_allows(4 << 30):
        pytest.skip("the hard RLIMIT_AS is too low for this test")
    script = _RLIMIT_PRELUDE + _OOM_SCRIPTS[what] + "\nprint(json.dumps([outcome, after]))\n"
    rc, out, err = run_python(script, timeout=120)
    assert rc == 0, f"exit {rc} (-6 = SIGABRT, std::terminate)\nstderr:\n{err[-3000:]}"
    outcome, after = last_json(out, err)
    assert outcome == "MemoryError", f"{what}: the call under the limit gave {outcome!r}"
    assert after < 1e-10, f"{what}: wrong result after the MemoryError (relative error {after})"


_IN_PLACE_SOFTMAX = r"""
n = 16 * MB  # float64 rows of 128 MiB (float64: float32 sums over so long a row drift by ~1e-3)
x = np.empty((2, n))
x[:] = np.arange(n) % 5 * 0.5
with pyattn.num_threads(2):
    y = np.zeros((2, 60000))
    pyattn.softmax(y, out=y)  # starts the team
    limit(32 * MB)  # room for x (mapped already) and small objects, not for a row
    outcome = attempt(lambda: pyattn.softmax(x, out=x))
vals = np.arange(5) * 0.5
counts = np.array([np.count_nonzero(np.arange(n) % 5 == c) for c in range(5)])
p = np.exp(vals) / np.sum(counts * np.exp(vals))
sample = np.arange(0, n, 99991)
after = max(err(x[r, sample], p[sample % 5]) for r in range(2))
rowsum = [float(x[r].sum(dtype=np.float64)) for r in range(2)]
print(json.dumps([outcome, after, rowsum]))
"""


@needs_rlimit
def test_softmax_in_place_needs_no_row_scratch():
    """Defect 3: softmax(x, out=x) on unit-stride rows allocated an n-element scratch per thread."""
    if not _hard_as_limit_allows(2 << 30):
        pytest.skip("the hard RLIMIT_AS is too low for this test")
    rc, out, err = run_python(_RLIMIT_PRELUDE + _IN_PLACE_SOFTMAX, timeout=120)
    assert rc == 0, f"exit {rc} (-6 = SIGABRT, std::terminate)\nstderr:\n{err[-3000:]}"
    outcome, after, rowsum = last_json(out, err)
    assert outcome == "ok", "in-place softmax needed more memory than x itself"
    assert after < 1e-10, f"wrong values (relative error {after})"
    np.testing.assert_allclose(rowsum, 1.0, atol=1e-9)


# --------------------------------------------------------------------------- 4. set_num_threads


def thread_limit():
    """max(16, 4 * the CPUs this process may run on)."""
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return max(16, 4 * ncpu)


@pytest.mark.parametrize("api", ["set_num_threads", "num_threads"])
def test_thread_count_is_bounded(api):
    """Defect 4: set_num_threads(100000) was accepted and values >= 2**31 raised pybind11's TypeError."""
    limit = thread_limit()
    old = pyattn.get_num_threads()

    def use(n):
        if api == "set_num_threads":
            pyattn.set_num_threads(n)
        else:
            with pyattn.num_threads(n):
                assert pyattn.get_num_threads() == n

    try:
        for bad in (100000, limit + 1, 2**31 - 1, 2**31, 2**32 + 1, 2**63, 2**64, np.int64(2**40)):
            with pytest.raises(ValueError, match=rf"\b{limit}\b"):
                use(bad)
            assert pyattn.get_num_threads() == old, f"a refused {bad} changed the thread count"
        use(limit)  # the limit itself is accepted
        if api == "set_num_threads":
            assert pyattn.get_num_threads() == limit
    finally:
        pyattn.set_num_threads(old)
    assert pyattn.get_num_threads() == old


# --------------------------------------------------------------------------- 5. softmax


def _overlap_case(how, rng, dtype, n):
    """(x, out) where out shares memory with x without being x (or is x, for 'same')."""
    if how == "transpose":
        x = randn(rng, (n, n), dtype, 3.0)
        return x, x.T
    if how == "same":
        x = randn(rng, (n, n + 1), dtype, 3.0)
        return x, x
    buf = randn(rng, (n + 1, n + 1), dtype, 3.0)
    views = {
        "shift_left": (buf[:, 1:], buf[:, :-1]),  # out starts one column before x
        "shift_right": (buf[:, :-1], buf[:, 1:]),  # out starts one column after x
        "shift_up": (buf[1:], buf[:-1]),  # out starts one row before x
        "shift_down": (buf[:-1], buf[1:]),  # out starts one row after x
        "reversed_cols": (buf, buf[:, ::-1]),
        "reversed_rows": (buf, buf[::-1]),
    }
    return views[how]


SOFTMAX_OVERLAPS = [
    "transpose",
    "shift_left",
    "shift_right",
    "shift_up",
    "shift_down",
    "reversed_cols",
    "reversed_rows",
    "same",
]


@dtype_param
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("how", SOFTMAX_OVERLAPS)
@pytest.mark.parametrize("n", [7, 150])  # 150 x 150 takes 2 threads
def test_softmax_out_overlapping_input(isa, dtype, axis, how, n, rng):
    """Defect 5: softmax(x, out=y) with y overlapping x (x.T, shifted or reversed views) was wrong."""
    x, out = _overlap_case(how, rng, dtype, n)
    assert np.shares_memory(x, out)
    want = reference.softmax(x.copy(), axis=axis)
    got = pyattn.softmax(x, axis=axis, out=out)
    assert got is out
    assert_close(got, want, dtype)


@dtype_param
@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_nan_rows_and_nan_scale(isa, dtype, axis, rng):
    """Defect 5: an all-NaN row, or scale=nan, gave zeros instead of NaN; fully masked rows stay zeros."""
    x = randn(rng, (6, 40), dtype, 3.0)
    if axis == 0:
        x = np.ascontiguousarray(x.T)
    xr = np.moveaxis(x, axis, -1)  # a view: rows along `axis`
    xr[1] = np.nan  # all NaN
    xr[3, 5] = np.nan  # one NaN
    xr[4] = -np.inf  # all -inf: no finite entry
    got = pyattn.softmax(x, axis=axis)
    want = reference.softmax(x, axis=axis)
    assert np.isnan(np.moveaxis(got, axis, -1)[1]).all()
    assert_close(got, want, dtype, what="NaN rows")

    got = pyattn.softmax(x, axis=axis, scale=float("nan"))
    assert np.isnan(got).all(), "scale=nan must give NaN everywhere"

    mask = np.ones(x.shape, bool)
    np.moveaxis(mask, axis, -1)[2] = False  # row 2 fully masked
    clean = randn(rng, x.shape, dtype, 3.0)
    got = pyattn.softmax(clean, axis=axis, mask=mask)
    assert np.all(np.moveaxis(got, axis, -1)[2] == 0.0)
    assert_close(got, reference.softmax(clean, axis=axis, mask=mask), dtype, what="masked")


# --------------------------------------------------------------------------- found on the way


@pytest.mark.parametrize("n", [1_000_000, 4_000_000])
def test_float32_softmax_long_row_sums_to_one(isa, n):
    """A float32 row sum kept in one accumulator per lane drifted by 2e-4 at 1M, 5e-4 at 4M."""
    x = np.random.default_rng(n).standard_normal((1, n)).astype(np.float32) * 3
    got = pyattn.softmax(x)
    assert abs(float(got.sum(dtype=np.float64)) - 1.0) < 1e-6
    want = reference.softmax(x)
    assert float(np.max(np.abs(got - want) / want)) < 1e-5


@dtype_param
def test_weights_are_nan_where_the_output_is(isa, dtype, rng):
    """An inf key made its weights row NaN at that key and 0 elsewhere; the output row was NaN."""
    q = np.abs(randn(rng, (1, 2, 20, 8), dtype)) + 0.1
    k = randn(rng, (1, 2, 30, 8), dtype)
    v = randn(rng, (1, 2, 30, 8), dtype)
    k[0, 1, 7, 3] = np.inf
    out, w, lse = sdpa(q, k, v, return_weights=True, return_lse=True)
    ref = ref_sdpa(q, k, v, return_weights=True, return_lse=True)
    for name, g, r in zip(["output", "weights", "lse"], (out, w, lse), ref):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r), err_msg=name)
        assert_close(np.nan_to_num(g), np.nan_to_num(r), dtype, what=name)
    assert np.isnan(w[0, 1]).all() and not np.isnan(w[0, 0]).any()
