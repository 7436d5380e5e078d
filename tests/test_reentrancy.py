"""Code an argument runs during a call (its ``__array__``, ``__float__``, ``__index__``): the Python
layer checks each argument and then hands the core pointers, sizes and strides it does not check
again, so what it checked must be what the core reads, whatever that code does to the caller's
arrays, and a cache must not be entered again from inside its own call. Each test failed before
its fix (an adversarial review, 2026-12-07): a reshaped ``out`` written past its end (a segfault
at larger sizes), slopes changed after their check (an all-NaN output), a cache whose ``lens``
disagreed with the rows written, a nested ``attend`` that waited for ever."""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import run_python

import pyattn
from pyattn import reference

L = 64  # the reshaped arrays: (1, L, 1) viewed as (1, 1, L) reads or writes L - 1 rows past a 1-row layout


def _float_that_runs(fn):
    """A float whose float() runs fn first (pyattn takes float(scale) after checking out)."""

    class Hook(float):
        def __float__(self):
            fn()
            return 1.0

    return Hook(1.0)


def _array_that_runs(fn, value):
    """An array-like whose __array__ runs fn first."""

    class Hook:
        def __array__(self, dtype=None, copy=None):
            fn()
            return value

    return Hook()


def _reshaper(a, shape):
    def fn():
        a.shape = shape

    return fn


def _guarded(shape, dtype=np.float32):
    """(buffer, view): an array of `shape` at the front of a zeroed buffer with a guard after it."""
    n = int(np.prod(shape))
    buf = np.zeros(n + 4 * L, dtype)
    return buf, buf[:n].reshape(shape)


def _assert_written(buf, shape, want):
    n = int(np.prod(shape))
    np.testing.assert_allclose(buf[:n].reshape(shape), want, rtol=2e-6, atol=1e-6)
    assert not buf[n:].any(), "the call wrote past out"


def test_sdpa_out_reshaped_after_its_check():
    q = np.ones((1, L, 1), np.float32)
    k = np.arange(4, dtype=np.float32).reshape(1, 4, 1)
    buf, out = _guarded((1, L, 1))
    r = pyattn.scaled_dot_product_attention(q, k, k, out=out, scale=_float_that_runs(_reshaper(out, (1, 1, L))))
    assert r is out
    _assert_written(buf, (1, L, 1), reference.scaled_dot_product_attention(q, k, k, scale=1.0))


def test_sdpa_mask_reshaped_after_its_check(rng):
    q = rng.standard_normal((1, L, 8)).astype(np.float32)
    k = rng.standard_normal((1, 4, 8)).astype(np.float32)
    mask = rng.standard_normal((1, L, 4)).astype(np.float32)
    want = reference.scaled_dot_product_attention(q, k, k, mask.copy())
    hook = _array_that_runs(_reshaper(mask, (1, 4, L)), np.zeros(1, np.float32))
    got = pyattn.scaled_dot_product_attention(q, k, k, mask, alibi_slopes=hook)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_softmax_out_reshaped_after_its_check(rng):
    x = rng.standard_normal((L, 3)).astype(np.float32)
    buf, out = _guarded((L, 3))
    keep = np.ones((L, 3), bool)
    r = pyattn.softmax(x, out=out, mask=_array_that_runs(_reshaper(out, (3, L)), keep))
    assert r is out
    _assert_written(buf, (L, 3), reference.softmax(x))


def test_varlen_out_and_key_reshaped_after_their_check(rng):
    q = rng.standard_normal((L, 1, 2)).astype(np.float32)
    k = rng.standard_normal((6, 1, 2)).astype(np.float32)
    cu_q, cu_k = np.array([0, L]), np.array([0, 6])
    want = reference.scaled_dot_product_attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), k.transpose(1, 0, 2))
    want = want.transpose(1, 0, 2)
    buf, out = _guarded((L, 1, 2))
    r = pyattn.varlen_attention(q, k, k, cu_q, cu_k, out=out, scale=_float_that_runs(_reshaper(out, (1, 2, L))))
    assert r is out
    _assert_written(buf, (L, 1, 2), reference.scaled_dot_product_attention(
        q.transpose(1, 0, 2), k.transpose(1, 0, 2), k.transpose(1, 0, 2), scale=1.0
    ).transpose(1, 0, 2))  # fmt: skip
    k2 = k.copy()
    got = pyattn.varlen_attention(q, k2, k2, cu_q, cu_k, scale=_float_that_runs(_reshaper(k2, (1, 6, 2))))
    np.testing.assert_allclose(got, reference.scaled_dot_product_attention(
        q.transpose(1, 0, 2), k.transpose(1, 0, 2), k.transpose(1, 0, 2), scale=1.0
    ).transpose(1, 0, 2), rtol=2e-6, atol=1e-6)  # fmt: skip
    assert want.shape == got.shape


def test_kvcache_out_reshaped_after_its_check(rng):
    q = rng.standard_normal((1, 1, L, 2)).astype(np.float32)
    kc, vc = np.zeros((1, 1, L, 2), np.float32), np.zeros((1, 1, L, 2), np.float32)
    buf, out = _guarded((1, 1, L, 2))
    r = pyattn.kvcache_attention(
        q, kc, vc, np.array([0]), k_new=q, v_new=q, out=out, scale=_float_that_runs(_reshaper(out, (1, 1, 2, L)))
    )
    assert r is out
    want = reference.scaled_dot_product_attention(q, q, q, scale=1.0, is_causal=True)
    _assert_written(buf, (1, 1, L, 2), want)


def test_sdpa_large_reshape_does_not_crash():
    """The helper's first repro at its size (4096 rows): a segfault before the fix, in a process of its own."""
    code, out, err = run_python(
        """
        import numpy as np, pyattn
        L = 4096
        class S(float):
            def __float__(self):
                out.shape = (1, 1, L)
                return 1.0
        q = np.ones((1, L, 1), np.float32); k = np.ones((1, 4, 1), np.float32)
        out = np.empty((1, L, 1), np.float32)
        r = pyattn.scaled_dot_product_attention(q, k, k, out=out, scale=S(1.0))
        print("ok", r is out, bool((r.reshape(-1) == 1).all()))
        """
    )
    assert code == 0 and "ok True True" in out, (code, out, err)


def test_alibi_slopes_changed_after_their_check(rng):
    """The slopes checked are the slopes the kernel reads (a value past float32 changed in after
    the check gave an all-NaN output)."""
    H = 2
    q = rng.standard_normal((1, H, 20, 8)).astype(np.float32)
    k = rng.standard_normal((1, H, 50, 8)).astype(np.float32)
    slopes = np.full(H, 0.5, np.float32)

    def spoil():
        slopes[:] = 3e38

    sinks = _array_that_runs(spoil, np.full(H, -np.inf, np.float32))
    got = pyattn.scaled_dot_product_attention(q, k, k, alibi_slopes=slopes, sinks=sinks)
    want = reference.scaled_dot_product_attention(q, k, k, alibi_slopes=np.full(H, 0.5))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_window_side_is_checked_as_used(rng):
    """An int subclass whose int() differs from its value: checked and used as one plain int."""

    class Side(int):
        def __int__(self):
            return -3

    q = rng.standard_normal((1, 30, 8)).astype(np.float32)
    k = rng.standard_normal((1, 30, 8)).astype(np.float32)
    got = pyattn.scaled_dot_product_attention(q, k, k, window=(Side(5), None), is_causal=True)
    want = pyattn.scaled_dot_product_attention(q, k, k, window=(5, None), is_causal=True)
    assert np.array_equal(got, want)


def test_kvcache_query_read_once():
    """lens advance by the tokens written: a query whose __array__ gave another shape on a later
    call was counted as one token and written as three."""
    cache = pyattn.KVCache(1, 1, 4, max_len=16)
    calls = [0]

    class Q:
        def __array__(self, dtype=None, copy=None):
            calls[0] += 1
            return np.ones((1, 1, 1 if calls[0] <= 1 else 3, 4), np.float32)

    kn = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4) + 1
    with pytest.raises(ValueError, match="k_new / v_new have shapes"):
        cache.attend(Q(), kn, kn)
    assert calls[0] == 1 and cache.lens.tolist() == [0] and not cache.k.any()
    # the same query given plainly, as three tokens
    r = cache.attend(np.ones((1, 1, 3, 4), np.float32), kn, kn)
    assert r.shape == (1, 1, 3, 4) and cache.lens.tolist() == [3]


@pytest.mark.parametrize("inner", ["attend", "reset", "pickle"])
def test_cache_entered_from_its_own_attend_raises(inner):
    """attend's argument calling back into the same cache waited for ever on its lock."""
    code, out, err = run_python(
        f"""
        import pickle, numpy as np, pyattn
        cache = pyattn.KVCache(1, 1, 4, max_len=16)
        kn = np.ones((1, 1, 1, 4), np.float32)
        seen = []
        class Q:
            def __array__(self, dtype=None, copy=None):
                try:
                    if {inner!r} == "attend":
                        cache.attend(kn, kn, kn)
                    elif {inner!r} == "reset":
                        cache.reset()
                    else:
                        pickle.dumps(cache)
                except RuntimeError as e:
                    seen.append(str(e))
                return np.ones((1, 1, 1, 4), np.float32)
        r = cache.attend(Q(), kn, kn)
        print("raised", len(seen), "nest" in seen[0] if seen else None, cache.lens.tolist(), r.shape)
        cache.reset()  # the cache is usable after
        print("after", cache.lens.tolist(), cache.attend(kn, kn, kn).shape, cache.lens.tolist())
        """,
        timeout=60,
    )
    assert code == 0, (code, out, err)
    assert "raised 1 True [1] (1, 1, 1, 4)" in out and "after [0] (1, 1, 1, 4) [1]" in out, (out, err)


def test_array_kept_by_its_wrapper_reshaped_after_its_check():
    """An __array__ that hands back an array it keeps (pandas, xarray): another argument's
    __array__ reshaped that array after its check (a write of 16 MB past a 16 KB output)."""
    code, out, err = run_python(
        """
        import numpy as np, pyattn
        class Held:
            def __init__(self, a): self.a = a
            def __array__(self, dtype=None, copy=None): return self.a
        x = Held(np.zeros((1, 4096), np.float32))
        class M:
            def __array__(self, dtype=None, copy=None):
                x.a.shape = (4096, 1)
                return np.ones((1, 1), bool)
        r = pyattn.softmax(x, axis=0, mask=M())
        print("ok", r.shape, bool((r == 1).all()))
        """
    )
    assert code == 0 and "ok (1, 4096) True" in out, (code, out, err)


def test_paged_cache_reshaped_by_cache_lens():
    """The block check read the reshaped pool's length while the core kept the strides taken
    before: a block far past the pool passed (a read 128 MB past it). The caches are views."""
    kc = np.zeros((2, 1, 1024, 16), np.float32)
    vc = np.zeros_like(kc)

    class Lens:
        def __array__(self, dtype=None, copy=None):
            kc.shape = vc.shape = (2048, 1, 1, 16)
            return np.array([1], np.int64)

    q = np.zeros((1, 1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=r"block_table names a block outside \[0, 2\)"):
        pyattn.kvcache_attention(q, kc, vc, Lens(), block_table=np.array([[2047]], np.int32))


class _LyingShape(np.ndarray):
    @property
    def shape(self):
        return self._said


@pytest.mark.parametrize("call", ["sdpa", "matmul", "merge", "kvcache_out", "kvcache_cache"])
def test_ndarray_subclass_whose_shape_lies(call):
    """An out (or cache) subclass answering another shape than its memory's: checked on its
    real shape now (the core wrote past the 8 floats it held)."""
    base = np.zeros(8192, np.float32)
    small = base[:8].reshape(1, 1, 1, 8).view(_LyingShape)
    q = np.ones((1, 4, 16, 8), np.float32)
    with pytest.raises(ValueError):
        if call == "sdpa":
            small._said = (1, 4, 16, 8)
            pyattn.scaled_dot_product_attention(q, q, q, out=small)
        elif call == "matmul":
            small._said = (4, 16, 16)
            a = np.ones((4, 16, 16), np.float32)
            pyattn.matmul(a, a, out=small)
        elif call == "merge":
            small._said = (4, 16, 8)
            pyattn.merge_attention_states(q, np.zeros((1, 4, 16), np.float32), out=small)
        elif call == "kvcache_out":
            small._said = (1, 4, 16, 8)
            cache = np.zeros((1, 4, 16, 8), np.float32)
            pyattn.kvcache_attention(q, cache, cache.copy(), np.array([16]), out=small, window=(4, 0))
        else:
            small._said = (1, 4, 64, 8)
            pyattn.kvcache_attention(q, small, np.zeros((1, 4, 64, 8), np.float32), np.array([0]), k_new=q, v_new=q)
    assert not base[8:].any()


def test_kvcache_is_causal_checked_before_the_write():
    """is_causal's bool() was taken after the new tokens were written."""
    kc = np.zeros((1, 1, 8, 4), np.float32)
    vc = np.zeros_like(kc)
    q = np.ones((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="truth value"):
        pyattn.kvcache_attention(q, kc, vc, np.array([0]), k_new=q, v_new=q, is_causal=np.array([True, True]))
    assert not kc.any() and not vc.any()
