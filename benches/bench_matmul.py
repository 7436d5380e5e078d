"""pyattn.matmul beside np.matmul (OpenBLAS), float32 and a few float64 shapes.

The target (docs/performance.md): at least 85% of OpenBLAS's AVX-512 sgemm in the same run, so run
these with ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``. The check compares with a float64
product on (at most) the first 256 rows, computed once per shape outside the timing.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from benchutil import assert_close, normal, rng_for, run_timed

import pyattn

IMPLS = ("pyattn", "numpy")

# (M, K, N, dtype): square, then the projection shapes (QKV of a 768-wide layer on 128 tokens,
# an MLP up-projection on 2048 tokens, a decode step's 4096 x 4096 GEMV).
CASES = [(n, n, n, np.float32) for n in (256, 512, 1024, 2048)] + [
    (128, 768, 2304, np.float32),
    (2048, 1024, 4096, np.float32),
    (1, 4096, 4096, np.float32),
    (1024, 1024, 1024, np.float64),
    (128, 768, 2304, np.float64),
]
CHECK_ROWS = 256


def _name(case) -> str:
    m, k, n, dtype = case
    return f"({m},{k})@({k},{n}) {np.dtype(dtype).name}"


@functools.lru_cache(maxsize=1)
def inputs(case):
    m, k, n, dtype = case
    rng = rng_for("matmul", _name(case))
    return normal(rng, (m, k)).astype(dtype), normal(rng, (k, n)).astype(dtype)


@functools.lru_cache(maxsize=1)
def oracle(case) -> np.ndarray:
    a, b = inputs(case)
    return a[:CHECK_ROWS].astype(np.float64) @ b.astype(np.float64)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[_name(c).replace(" ", "-") for c in CASES])
def test_matmul(benchmark, case, impl):
    m, k, n, dtype = case
    benchmark.group = f"matmul {_name(case)}"
    benchmark.extra_info.update(
        kind="matmul", impl=impl, flops=2.0 * m * k * n, bytes=np.dtype(dtype).itemsize * (m * k + k * n + m * n)
    )
    a, b = inputs(case)
    fn = pyattn.matmul if impl == "pyattn" else np.matmul
    out = run_timed(benchmark, lambda: fn(a, b))
    assert out.shape == (m, n) and out.dtype == dtype, f"{impl}: {out.shape} {out.dtype}"
    rel = 1e-5 if dtype == np.float32 else 1e-12
    assert_close(out[:CHECK_ROWS], oracle(case), rel, f"{impl} matmul {_name(case)}")
