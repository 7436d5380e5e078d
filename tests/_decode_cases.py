"""Decode calls whose K/V exceed the 16 MiB the split-KV decode treats as cached, one query row
per K/V head, with their float64 references (tests/test_config.py runs them in subprocesses under
each PYATTN_DECODE_PREFETCH setting). Key rows of at most 128 bytes (float16 D64, int8 D128) take
several keys at a time under every setting; the longer ones (float32 D128, float16 D128, int8
D256) follow the setting. "float32 / float16 / int8 grouped": six query rows per K/V head (four,
then two, a few keys at a time on AVX-512, key by key elsewhere), under every setting; the half and
int8 ones in blocks of 128 keys where the kernel set reads them a few keys at a time, the last
block partial (32800 keys)."""

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
    qg = rng.standard_normal((1, 24, 1, 128), dtype=np.float32)  # grouped: six rows per K/V head
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
        "float32 grouped": (
            lambda: pyattn.scaled_dot_product_attention(qg, k, v, enable_gqa=True),
            lambda: ref.scaled_dot_product_attention(f64(qg), f64(k), f64(v), enable_gqa=True),
        ),
        "float16 grouped": (
            lambda: pyattn.scaled_dot_product_attention(qg, kh, vh, enable_gqa=True),
            lambda: ref.scaled_dot_product_attention(f64(qg), f64(kh), f64(vh), enable_gqa=True),
        ),
        "int8": (
            lambda: pyattn.kvcache_attention(q, ki, vi, n8, k_scale=ks, v_scale=vs),
            lambda: ref.scaled_dot_product_attention(f64(q), f64(ki) * ks[..., None], f64(vi) * vs[..., None]),
        ),
        "float16 D64": (
            lambda: pyattn.scaled_dot_product_attention(qs, ks16, vs16),
            lambda: ref.scaled_dot_product_attention(f64(qs), f64(ks16), f64(vs16)),
        ),
        "int8 grouped": (
            lambda: pyattn.kvcache_attention(qg, ki, vi, n8, k_scale=ks, v_scale=vs),
            lambda: ref.scaled_dot_product_attention(
                f64(qg), f64(ki) * ks[..., None], f64(vi) * vs[..., None], enable_gqa=True
            ),
        ),
        "int8 D256": (
            lambda: pyattn.kvcache_attention(ql, kl, vl, nl, k_scale=ksl, v_scale=vsl),
            lambda: ref.scaled_dot_product_attention(f64(ql), f64(kl) * ksl[..., None], f64(vl) * vsl[..., None]),
        ),
    }


def paged_twins():
    """{name: (call on a contiguous cache, the same call on a paged copy)}: single query rows over
    K/V past the 16 MiB the decode treats as cached, where the two layouts may stream their keys
    through different loops (key by key, or several keys at a time); each pair must agree bit for
    bit (output and lse). Rows of 512 bytes (float32 D128: the loop follows
    PYATTN_DECODE_PREFETCH), 128 (float16 D64 and int8 D128: several keys at a time when
    contiguous) and 400 (float32 D100: a partial vector at the end of every row); and six query
    rows per K/V head over float16 and int8 D128 (grouped, a task reading several heads of a
    block; 128-key blocks on AVX-512)."""
    rng = np.random.default_rng(7)
    H, bs = 4, 16
    twins = {}
    for name, dt, D, L, group in (
        ("float32 D128", np.float32, 128, 8200, 1),
        ("float16 D64", np.float16, 64, 32800, 1),
        ("float32 D100", np.float32, 100, 5300, 1),
        ("int8 D128", np.int8, 128, 16400, 1),
        ("float16 D128 grouped", np.float16, 128, 16400, 6),
        ("int8 D128 grouped", np.int8, 128, 16400, 6),
    ):
        nb = -(-L // bs)
        q = rng.standard_normal((1, H * group, 1, D), dtype=np.float32)
        if dt == np.int8:
            k, v = (rng.integers(-127, 128, (1, H, nb * bs, D), dtype=np.int8) for _ in range(2))
            ks, vs = (rng.uniform(0.005, 0.02, (1, H, nb * bs)).astype(np.float32) for _ in range(2))
        else:
            k, v = (rng.standard_normal((1, H, nb * bs, D), dtype=np.float32).astype(dt) for _ in range(2))
            ks = vs = None
        perm = rng.permutation(nb)  # logical block i lies in physical block perm[i]

        def page(c, perm=perm, nb=nb):
            c = c[0].reshape((H, nb, bs) + c.shape[3:])
            p = np.empty((nb,) + c.shape[:1] + c.shape[2:], c.dtype)
            p[perm] = np.moveaxis(c, 1, 0)
            return p

        lens, table = np.array([L]), perm[None].astype(np.int32)
        paged = {"k_scale": page(ks), "v_scale": page(vs)} if ks is not None else {}
        flat = {"k_scale": ks, "v_scale": vs} if ks is not None else {}
        kp, vp = page(k), page(v)
        twins[name] = (
            lambda q=q, k=k, v=v, lens=lens, kw=flat: pyattn.kvcache_attention(q, k, v, lens, return_lse=True, **kw),
            lambda q=q, k=kp, v=vp, lens=lens, t=table, kw=paged: pyattn.kvcache_attention(
                q, k, v, lens, block_table=t, return_lse=True, **kw
            ),
        )
    return twins
