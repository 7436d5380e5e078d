"""No kernel reads past the end of K/V: rows that end against an unmapped page.

A partial vector at the end of a row (head sizes that are not a whole number of vectors) is read
with a masked load, or, where the ISA has none for 16-bit and 8-bit lanes (AVX2), by 32-bit masked
lanes and single bytes. These tests put the last K and V row of float32, float16, bfloat16 and
int8 caches right before a PROT_NONE page and run every kernel set over them, prefill and decode,
grouped heads and single ones, causal or not (short causal prefills read V in place as a GEMM
operand): a read of one byte too many is a segmentation fault. Each test runs
its cases in a child process, so that such a fault fails the test instead of the whole session.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mmap and mprotect through libc")

CHILD = textwrap.dedent(
    r"""
    import ctypes, itertools, mmap, sys
    import numpy as np
    import pyattn
    from pyattn import _core, reference

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    PAGE = mmap.PAGESIZE
    keep = []

    def at_page_end(a):
        # a copy of a whose last byte is the last one before a PROT_NONE page
        n = a.nbytes
        pages = (n + PAGE - 1) // PAGE + 1
        base = libc.mmap(None, pages * PAGE, 3, 0x22, -1, 0)  # read|write, private|anonymous
        assert base is not None and base != ctypes.c_void_p(-1).value, ctypes.get_errno()
        assert libc.mprotect(base + (pages - 1) * PAGE, PAGE, 0) == 0, ctypes.get_errno()
        buf = (ctypes.c_char * n).from_address(base + (pages - 1) * PAGE - n)
        keep.append(buf)
        out = np.frombuffer(buf, dtype=a.dtype).reshape(a.shape)
        out[...] = a
        return out

    def check(got, want, what):
        err = float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
        assert err < 1e-5, (what, err)

    kind = sys.argv[1]
    rng = np.random.default_rng(7)
    dtypes = {"float32": np.float32, "float16": np.float16}
    try:
        import ml_dtypes
        dtypes["bfloat16"] = ml_dtypes.bfloat16
    except ImportError:
        pass
    n = 0
    for isa in _core.available_isas():
        _core.set_isa(isa)
        for E in (1, 3, 5, 13, 16, 17, 32, 33):
            for Lk in (1, 7, 70):
                if kind == "float":
                    # causal: short prefills take a row per query, V read in place by the GEMM
                    for (name, dt), causal in itertools.product(dtypes.items(), (False, True)):
                        for hq, hkv, lq in ((4, 1, 1), (1, 1, 1), (2, 2, 9), (8, 2, 3)):
                            q = rng.standard_normal((1, hq, lq, E)).astype(np.float32)
                            k = at_page_end(rng.standard_normal((1, hkv, Lk, E)).astype(dt))
                            v = at_page_end(rng.standard_normal((1, hkv, Lk, E)).astype(dt))
                            kw = dict(enable_gqa=True, is_causal=causal)
                            got = pyattn.scaled_dot_product_attention(q, k, v, **kw)
                            want = reference.scaled_dot_product_attention(
                                q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw
                            )
                            check(got, want, (isa, name, E, Lk, hq, hkv, lq, causal))
                            n += 1
                else:  # an int8 cache, full: its last row ends at the page
                    for hq, hkv, lq in ((4, 1, 1), (1, 1, 1), (2, 2, 4)):
                        if Lk < lq:
                            continue
                        q = rng.standard_normal((1, hq, lq, E)).astype(np.float32)
                        k8 = at_page_end(rng.integers(-127, 128, (1, hkv, Lk, E)).astype(np.int8))
                        v8 = at_page_end(rng.integers(-127, 128, (1, hkv, Lk, E)).astype(np.int8))
                        ks = at_page_end(rng.uniform(0.001, 0.02, (1, hkv, Lk)).astype(np.float32))
                        vs = at_page_end(rng.uniform(0.001, 0.02, (1, hkv, Lk)).astype(np.float32))
                        lens = np.array([Lk], np.int64)  # every row held, the last at the page
                        got = pyattn.kvcache_attention(q, k8, v8, lens, k_scale=ks, v_scale=vs, is_causal=False)
                        kd = k8.astype(np.float64) * ks[..., None]
                        vd = v8.astype(np.float64) * vs[..., None]
                        want = reference.scaled_dot_product_attention(q.astype(np.float64), kd, vd, enable_gqa=True)
                        check(got, want, (isa, "int8", E, Lk, hq, hkv, lq))
                        n += 1
    print("cases", n)
    """
)


@pytest.mark.parametrize("kind", ["float", "int8"])
def test_rows_ending_at_an_unmapped_page(kind):
    r = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode} (-11: a read past the end of K/V)\n{r.stdout}\n{r.stderr}"
    assert int(r.stdout.split()[-1]) > 0
