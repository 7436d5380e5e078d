"""``python -m pyattn``: the seeds' three-token walkthrough computed by pyattn, then a quick
benchmark of pyattn against the plain-NumPy reference."""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

import pyattn
from pyattn import reference


def _fmt(a) -> str:
    return np.array2string(np.asarray(a), precision=4, suppress_small=True, floatmode="fixed")


def walkthrough() -> None:
    print("== The three-token walkthrough ==")
    X = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    print("tokens X (Q = K = V = X), d = 2:\n" + _fmt(X))
    scores = pyattn.matmul(X, X.T)
    print("\nscores Q K^T:\n" + _fmt(scores))
    scaled = scores / np.sqrt(2.0)
    print("\nscaled scores Q K^T / sqrt(2):\n" + _fmt(scaled))
    out, w = pyattn.scaled_dot_product_attention(X, X, X, return_weights=True)
    print("\nattention weights softmax(scaled):\n" + _fmt(w))
    print("\noutputs weights @ V:\n" + _fmt(out))
    _, wc = pyattn.scaled_dot_product_attention(X, X, X, is_causal=True, return_weights=True)
    print("\ncausal weights (token 2 cannot see token 3):\n" + _fmt(wc))
    print("  row 2: " + _fmt(wc[1]))
    _, wu = pyattn.scaled_dot_product_attention(X, X, X, scale=1.0, return_weights=True)
    print("\nunscaled vs scaled, row 1: " + _fmt(wu[0]) + " vs " + _fmt(w[0]))
    W_V = np.array([[1.0, 0.0], [1.0, 1.0]])
    V = pyattn.matmul(X, W_V)
    out_v, w_v = pyattn.scaled_dot_product_attention(X, X, V, return_weights=True)
    print("\nwith W_V = [[1, 0], [1, 1]]: values\n" + _fmt(V) + "\noutputs\n" + _fmt(out_v))
    print("weights unchanged: " + str(bool(np.allclose(w_v, w))))
    pe = pyattn.sinusoidal_positional_encoding(3, 2, dtype=np.float64)
    print("\nsinusoidal PE(1) = " + _fmt(pe[1]) + ", PE(2) = " + _fmt(pe[2]))
    n = pyattn.MultiHeadAttention(512, 8, bias=False).num_parameters()
    print(f"attention parameters at d_model = 512: {n:,} = 4 * 512^2")


def _time(f, reps: int) -> float:
    f()
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best.append(time.perf_counter() - t)
    return float(np.median(best))


def benchmark(quick: bool = True) -> None:
    print("\n== pyattn against the NumPy reference (float32 in, median time) ==")
    print(f"kernel: {pyattn._core.isa()}, threads: {pyattn.get_num_threads()}")
    shapes = [(1, 8, 512, 64, False), (8, 12, 128, 64, False), (1, 8, 1024, 64, True), (1, 12, 1024, 64, False)]
    if not quick:
        shapes += [(1, 8, 2048, 64, False), (1, 8, 2048, 128, True)]
    rng = np.random.default_rng(0)
    print(f"{'shape':>28} {'causal':>6} {'numpy ms':>9} {'pyattn ms':>9} {'speed-up':>8} {'max err':>8}")
    for B, H, L, D, causal in shapes:
        q, k, v = (rng.standard_normal((B, H, L, D), dtype=np.float32) for _ in range(3))
        t_ref = _time(functools.partial(reference.scaled_dot_product_attention, q, k, v, is_causal=causal), 2)
        t_fast = _time(functools.partial(pyattn.scaled_dot_product_attention, q, k, v, is_causal=causal), 5)
        ref = reference.scaled_dot_product_attention(q, k, v, is_causal=causal)
        err = float(np.abs(pyattn.scaled_dot_product_attention(q, k, v, is_causal=causal) - ref).max())
        shape = f"B{B} H{H} L{L} D{D}"
        print(f"{shape:>28} {str(causal):>6} {t_ref * 1e3:9.2f} {t_fast * 1e3:9.2f} {t_ref / t_fast:7.1f}x {err:8.1e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pyattn", description=__doc__.replace("``", ""))
    which = p.add_mutually_exclusive_group()  # (--full with --no-bench was silently ignored)
    which.add_argument("--no-bench", action="store_true", help="only the walkthrough")
    which.add_argument("--full", action="store_true", help="a longer benchmark")
    args = p.parse_args(argv)
    pyattn.show_config()
    print()
    walkthrough()
    if not args.no_bench:
        benchmark(quick=not args.full)


if __name__ == "__main__":
    main()
