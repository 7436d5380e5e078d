"""Decode calls whose K/V exceed the 16 MiB the split-KV decode treats as cached, one query row
per K/V head, with their float64 references (tests/test_config.py runs them in subprocesses under
each PYATTN_DECODE_PREFETCH setting). Key rows of at most 128 bytes (float16 D64, int8 D128) take
several keys at a time under every setting; the longer ones (float32 D128, float16 D128, int8
D256) follow the setting."""

from __future__ import annotations

import numpy as np

import pyattn
import pyattn.reference as ref


def decode_cases():
    """{name: (pyattn call, reference call)} over data drawn from a fixed seed."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 1, 128), dtype=np.float32)
    # float32: 4 heads x 8200 keys x (128 + 128) x 4 B = 33.6 MB
    k, v = (rng.standard_normal((1, 4, 8200, 128), dtype=np.float32) for _ in range(2))
    lens = np.array([5000])
    # float16: twice the keys for the same bytes
    kh, vh = (rng.standard_normal((1, 4, 16400, 128), dtype=np.float32).astype(np.float16) for _ in range(2))
    # int8 with per-(token, head) scales: four times the keys
    ki, vi = (rng.integers(-127, 128, (1, 4, 32800, 128), dtype=np.int8) for _ in range(2))
    ks, vs = (rng.uniform(0.005, 0.02, (1, 4, 32800)).astype(np.float32) for _ in range(2))
    n8 = np.array([32800])
    # short rows: float16 D64 (128 B a row), and int8 D256 (256 B) for int8's key-by-key loop
    qs, ql = (rng.standard_normal((1, 4, 1, d), dtype=np.float32) for d in (64, 256))
    ks16, vs16 = (rng.standard_normal((1, 4, 32800, 64), dtype=np.float32).astype(np.float16) for _ in range(2))
    kl, vl = (rng.integers(-127, 128, (1, 4, 16400, 256), dtype=np.int8) for _ in range(2))
    ksl, vsl = (rng.uniform(0.005, 0.02, (1, 4, 16400)).astype(np.float32) for _ in range(2))
    nl = np.array([16400])

    def f64(x):
        return np.asarray(x, np.float64)

    return {
        "float32": (
            lambda: pyattn.scaled_dot_product_attention(q, k, v),
            lambda: ref.scaled_dot_product_attention(f64(q), f64(k), f64(v)),
        ),
        "float32 kv_lens": (
            lambda: pyattn.scaled_dot_product_attention(q, k, v, kv_lens=lens),
            lambda: ref.scaled_dot_product_attention(f64(q), f64(k), f64(v), kv_lens=lens),
        ),
        "float16": (
            lambda: pyattn.scaled_dot_product_attention(q, kh, vh),
            lambda: ref.scaled_dot_product_attention(f64(q), f64(kh), f64(vh)),
        ),
        "int8": (
            lambda: pyattn.kvcache_attention(q, ki, vi, n8, k_scale=ks, v_scale=vs),
            lambda: ref.scaled_dot_product_attention(f64(q), f64(ki) * ks[..., None], f64(vi) * vs[..., None]),
        ),
        "float16 D64": (
            lambda: pyattn.scaled_dot_product_attention(qs, ks16, vs16),
            lambda: ref.scaled_dot_product_attention(f64(qs), f64(ks16), f64(vs16)),
        ),
        "int8 D256": (
            lambda: pyattn.kvcache_attention(ql, kl, vl, nl, k_scale=ksl, v_scale=vsl),
            lambda: ref.scaled_dot_product_attention(f64(ql), f64(kl) * ksl[..., None], f64(vl) * vsl[..., None]),
        ),
    }
