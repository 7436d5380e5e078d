"""Decode time per cache dtype, the dtypes interleaved call by call in one process, so that a
noisy machine moves every dtype alike: the fastest and the median call of each and their ratios
over the float32 cache. bfloat16 needs ml_dtypes (skipped without it).

    python tools/decode_dtypes.py [--threads 2] [--seconds 8] B,Hq,Hkv,Lk,D [B,Hq,Hkv,Lk,D ...]
    python tools/decode_dtypes.py 1,32,8,32768,128 4,32,8,4096,128
    python tools/decode_dtypes.py --paged 16 4,32,8,4096,128    # + the float32 cache paged

With --paged N the float32 cache is also read from a pool of N-token blocks through a shuffled
block table (issue 10's paged target: at least 0.95 of the contiguous cache's speed). Called in
turn, the two caches evict each other, so both come from memory; pytest-benchmark's report times
the contiguous calls back to back, where part of a cache of L3's size stays there.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from _interleave import interleaved

import pyattn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from benchutil import paged_pool  # noqa: E402  (the benches' paged layout)

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None


def calls(b, hq, hkv, lk, d, rng, block=0):
    """{dtype name: a kvcache_attention call on a full cache of that dtype} (and "paged", the
    float32 cache in blocks of `block` tokens, where block > 0)."""
    q = rng.standard_normal((b, hq, 1, d), np.float32)
    k, v = (rng.standard_normal((b, hkv, lk, d), np.float32) for _ in range(2))
    lens = np.full(b, lk, np.int64)
    out = {"float32": lambda: pyattn.kvcache_attention(q, k, v, lens)}
    if block:
        nb = -(-lk // block)
        table = rng.permutation(b * nb).astype(np.int32).reshape(b, nb)
        kp, vp = paged_pool(k, table, block), paged_pool(v, table, block)
        out["paged"] = lambda: pyattn.kvcache_attention(q, kp, vp, lens, block_table=table)
        assert np.array_equal(out["paged"](), out["float32"]()), "paged and contiguous caches differ"
    halves = [("float16", np.float16)] + ([("bfloat16", ml_dtypes.bfloat16)] if ml_dtypes else [])
    for name, dt in halves:
        kh, vh = k.astype(dt), v.astype(dt)
        out[name] = lambda kh=kh, vh=vh: pyattn.kvcache_attention(q, kh, vh, lens)
    ki, vi = (rng.integers(-127, 128, (b, hkv, lk, d), dtype=np.int8) for _ in range(2))
    ks, vs = (rng.uniform(0.005, 0.02, (b, hkv, lk)).astype(np.float32) for _ in range(2))
    out["int8"] = lambda: pyattn.kvcache_attention(q, ki, vi, lens, k_scale=ks, v_scale=vs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="+", help="B,Hq,Hkv,Lk,D")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0, help="per shape")
    ap.add_argument("--paged", type=int, default=0, metavar="N", help="also the float32 cache in N-token blocks")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"pyattn {pyattn.__version__}, {pyattn.show_config(file=io.StringIO())['isa']}, {args.threads} threads")
    for shape in args.shapes:
        b, hq, hkv, lk, d = map(int, shape.split(","))
        fs = calls(b, hq, hkv, lk, d, rng, args.paged)
        with pyattn.num_threads(args.threads):
            ts = interleaved(fs, args.seconds)
        mn = {n: min(t) for n, t in ts.items()}
        md = {n: float(np.median(t)) for n, t in ts.items()}
        print(f"B{b} Hq{hq} Hkv{hkv} Lk{lk} D{d}, {len(ts['float32'])} rounds (fastest / median ms):")
        for n in fs:
            ratio = "" if n == "float32" else f"   {mn['float32'] / mn[n]:.2f}x / {md['float32'] / md[n]:.2f}x float32"
            print(f"  {n:9s} {mn[n] * 1e3:8.3f} / {md[n] * 1e3:8.3f}{ratio}")


if __name__ == "__main__":
    main()
