"""Each score variant's time over the plain kernel's, interleaved in one process (issue 9's target:
every variant, and all four together, within 1 / 0.9 = 1.11x the plain time).

pytest-benchmark (benches/bench_variants.py) times one item after the other, so the machine's
drift between items enters the ratios; here every item runs once per round, the order rotating,
each round a batch of calls long enough to time, and the ratios are of medians and of the fastest
rounds. The variants: softcap 50, ALiBi slopes 2^(-8h/H), sinks, and all four (with kv_lens = L,
every key). A kernel set is chosen with PYATTN_ISA or --isa.

    python tools/variants_interleaved.py [--isa avx2] [--rounds 15] [--shape 8,12,128,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pyattn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default=None, help="kernel set (avx512, avx2, neon, generic); default: the machine's")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shape", default="8,12,128,64", help="B,H,L,D (self-attention, non-causal)")
    args = ap.parse_args(argv)
    if args.isa:
        pyattn._core.set_isa(args.isa)
    B, H, L, D = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
    slopes = 2.0 ** (-8 * np.arange(1, H + 1) / H)
    sinks = rng.standard_normal(H).astype(np.float32)
    variants = {
        "plain": {},
        "softcap": {"softcap": 50.0},
        "alibi": {"alibi_slopes": slopes},
        "sinks": {"sinks": sinks},
        "all4": {"softcap": 50.0, "alibi_slopes": slopes, "sinks": sinks, "kv_lens": np.full(B, L)},
    }
    out = np.empty((B, H, L, D), np.float32)
    calls = {
        n: (lambda kw=kw: pyattn.scaled_dot_product_attention(q, k, v, out=out, **kw)) for n, kw in variants.items()
    }
    calls["plain"]()  # (the first call sets up the thread pool)
    t0 = time.perf_counter()
    for _ in range(3):
        calls["plain"]()
    reps = max(5, int(0.05 / max((time.perf_counter() - t0) / 3, 1e-7)))  # about 50 ms a round
    for f in calls.values():  # warm-up
        for _ in range(reps):
            f()
    names = list(calls)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(reps):
                calls[n]()
            times[n].append((time.perf_counter() - t0) / reps)
    med = {n: statistics.median(ts) for n, ts in times.items()}
    print(
        f"{pyattn._core.isa()}, B{B} H{H} L{L} D{D}, {pyattn.get_num_threads()} threads, {args.rounds} rounds of "
        f"{reps} calls: plain {med['plain'] * 1e3:.3f} ms a call"
    )
    print(f"{'variant':8} {'median / plain':>15} {'fastest / plain':>16}   (target <= 1.11)")
    for n in names[1:]:
        print(f"{n:8} {med[n] / med['plain']:15.3f} {min(times[n]) / min(times['plain']):16.3f}")


if __name__ == "__main__":
    main()
