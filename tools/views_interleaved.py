"""Attention over heads viewed as (B, L, H, D) (torch's and flash-attn's layout: rows of one head
H * D apart) against the same values copied to contiguous (B, H, L, D) heads, and torch's SDPA on
the same views: every call interleaved with the others in one process, so that a noisy machine
moves them alike. Prints medians and their ratios over the view call; checks every result.

    python tools/views_interleaved.py [--threads 2] [--seconds 5] [--no-torch]
    PYATTN_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        python tools/views_interleaved.py          # the AVX2 kernels beside AVX2 torch
"""

from __future__ import annotations

import argparse
import io

import numpy as np
from _interleave import interleaved

import pyattn

# (name, B, Hq, Hkv, Lq, Lk, D, causal)
SHAPES = [
    ("prefill causal", 1, 8, 8, 2048, 2048, 64, True),
    ("prefill causal", 1, 16, 16, 1024, 1024, 64, True),
    ("prefill causal", 1, 32, 32, 1024, 1024, 128, True),
    ("prefill", 1, 8, 8, 2048, 2048, 128, False),
    ("prefill", 1, 12, 12, 512, 512, 64, False),
    ("decode", 1, 32, 32, 1, 4096, 128, False),
    ("decode GQA", 1, 32, 8, 1, 4096, 128, False),
    ("decode", 4, 12, 12, 1, 1024, 64, False),
    ("decode GQA", 1, 32, 8, 1, 512, 128, False),
    ("decode", 1, 8, 8, 1, 4096, 128, False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=5.0, help="per shape")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            pass
    if torch is not None:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"pyattn {pyattn.__version__}, {pyattn.show_config(file=io.StringIO())['isa']}, {args.threads} threads")
    sdpa = pyattn.scaled_dot_product_attention
    for name, b, hq, hkv, lq, lk, d, causal in SHAPES:
        q = rng.standard_normal((b, lq, hq, d), np.float32)
        k, v = (rng.standard_normal((b, lk, hkv, d), np.float32) for _ in range(2))
        views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
        cont = [np.ascontiguousarray(x) for x in views]
        kw = {"is_causal": causal, "enable_gqa": hq != hkv}
        fs = {
            "view": lambda views=views, kw=kw: sdpa(*views, **kw),
            "contiguous": lambda cont=cont, kw=kw: sdpa(*cont, **kw),
        }
        if torch is not None:
            tv = [torch.from_numpy(x).transpose(1, 2) for x in (q, k, v)]
            fs["torch_view"] = lambda tv=tv, kw=kw: torch.nn.functional.scaled_dot_product_attention(*tv, **kw).numpy()
        with pyattn.num_threads(args.threads):
            want = fs["contiguous"]()
            for n, f in fs.items():
                np.testing.assert_allclose(f(), want, rtol=1e-4, atol=1e-5, err_msg=n)
            ts = interleaved(fs, args.seconds)
        base = float(np.median(ts["view"]))
        ratios = ", ".join(f"{n} {np.median(t) / base:.3f}" for n, t in ts.items() if n != "view")
        print(f"{name} B{b} Hq{hq} Hkv{hkv} Lq{lq} Lk{lk} D{d}: view {base * 1e3:.3f} ms; time / view: {ratios}")


if __name__ == "__main__":
    main()
