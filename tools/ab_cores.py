"""Time two builds of pyattn's compiled core against each other, call by call, in one process.

On a shared machine the time of one call moves by 10-50% from one second to the next, so two
builds timed in separate processes (or one after the other) differ by more than most kernel
changes do. Here both cores are loaded into one interpreter and each case alternates between
them call by call (A B, B A, ...), so every drift in the machine's speed hits both alike; an
A/A run (one core against a copy of itself) reads 0.99-1.01.

    . tools/core_package.sh && build_core_package /tmp/ab/base base -DCMAKE_BUILD_TYPE=Release
    (change the source)     && build_core_package /tmp/ab/new new -DCMAKE_BUILD_TYPE=Release
    PYATTN_ISA=avx2 python tools/ab_cores.py /tmp/ab/base/pkg/pyattn/_core*.so \\
        /tmp/ab/new/pkg/pyattn/_core*.so --cases long,short --rounds 20

prints, per case, the median times and B's speed over A's (A's time / B's time) by medians,
fastest calls and first quartiles. The Python layer is the one `import pyattn` finds; only the
core changes between calls. Each core is loaded under a module name of its own: loaded as
`pyattn._core` a second time, the interpreter hands back the first core, and the A/B then
compares a build with itself.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import time

import numpy as np

import pyattn
import pyattn._api as api


def _load(path: str, tag: str):
    name = f"_pyattn_ab_{tag}._core"  # the last part must stay `_core`: it names PyInit__core
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def _use(core) -> None:
    api._core = core
    api._sdpa_small = core.sdpa_small


def _sdpa(b, h, lq, lk, d, **kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, lq, d), dtype=np.float32)
    k = rng.standard_normal((b, h, lk, d), dtype=np.float32)
    v = rng.standard_normal((b, h, lk, d), dtype=np.float32)
    return lambda: pyattn.scaled_dot_product_attention(q, k, v, **kw)


def _cases(name: str) -> dict:
    h = 12
    slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
    sinks = np.linspace(-1, 1, h).astype(np.float32)
    sets = {
        "long": lambda: {
            "B1 H8 L2048 D64": _sdpa(1, 8, 2048, 2048, 64),
            "B1 H8 L4096 D128": _sdpa(1, 8, 4096, 4096, 128),
            "B1 H8 L4096 D128 causal": _sdpa(1, 8, 4096, 4096, 128, is_causal=True),
            "B1 H12 L512 D64": _sdpa(1, 12, 512, 512, 64),
        },
        "short": lambda: {
            "B8 H12 L128 D64": _sdpa(8, 12, 128, 128, 64),
            "  softcap": _sdpa(8, 12, 128, 128, 64, softcap=30.0),
            "  all four variants": _sdpa(
                8, 12, 128, 128, 64, softcap=30.0, alibi_slopes=slopes, sinks=sinks, kv_lens=np.full(8, 128)
            ),
        },
        "causal": lambda: {
            "B1 H2 L333 D64": _sdpa(1, 2, 333, 333, 64, is_causal=True),
            "B8 H12 L128 D64": _sdpa(8, 12, 128, 128, 64, is_causal=True),
            "B1 H12 L512 D64": _sdpa(1, 12, 512, 512, 64, is_causal=True),
            "B1 H32 L1024 D128": _sdpa(1, 32, 1024, 1024, 128, is_causal=True),
        },
        "decode": lambda: {
            "B1 H32 Lk4096 D128": _sdpa(1, 32, 1, 4096, 128),
            "B4 H12 Lk512 D64": _sdpa(4, 12, 1, 512, 64),
        },
    }
    if name not in sets:
        raise SystemExit(f"unknown case set {name!r}: one of {', '.join(sets)}")
    return sets[name]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("core_a")
    ap.add_argument("core_b")
    ap.add_argument("--cases", default="long,short", help="comma-separated: long, short, causal, decode")
    ap.add_argument("--rounds", type=int, default=20, help="calls of each core per case")
    args = ap.parse_args()
    cores = [_load(args.core_a, "a"), _load(args.core_b, "b")]
    print(f"A {args.core_a}\nB {args.core_b}\nisa {cores[0].isa()}, threads {pyattn.get_num_threads()}")
    for set_name in args.cases.split(","):
        for name, f in _cases(set_name).items():
            for c in cores:
                _use(c)
                f()
                f()
            ts: list[list[float]] = [[], []]
            for r in range(args.rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    _use(cores[i])
                    t0 = time.perf_counter()
                    f()
                    ts[i].append(time.perf_counter() - t0)
            a, b = np.array(ts[0]), np.array(ts[1])
            print(
                f"{name:26s} A {np.median(a) * 1e3:9.3f} ms  B {np.median(b) * 1e3:9.3f} ms  B's speed over A's:"
                f" median {np.median(a) / np.median(b):.3f}  fastest {a.min() / b.min():.3f}"
                f"  q25 {np.quantile(a, 0.25) / np.quantile(b, 0.25):.3f}"
            )


if __name__ == "__main__":
    main()
