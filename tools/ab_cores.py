"""Time two builds of pyattn's compiled core against each other, call by call, in one process.

On a shared machine the time of one call moves by 10-50% from one second to the next, so two
builds timed in separate processes (or one after the other) differ by more than most kernel
changes do. Here both cores are loaded into one interpreter and each case alternates between
them call by call (A B, B A, ...), so every drift in the machine's speed hits both alike; an
A/A run (one core against a copy of itself) reads 0.98-1.01 at 16-20 rounds, and 0.95-1.06 at 12
while other work shares the machine: take more rounds, and more than one run, then.

    . tools/core_package.sh && build_core_package /tmp/ab/base base -DCMAKE_BUILD_TYPE=Release
    (change the source)     && build_core_package /tmp/ab/new new -DCMAKE_BUILD_TYPE=Release
    PYATTN_ISA=avx2 python tools/ab_cores.py /tmp/ab/base/pkg/pyattn/_core*.so \\
        /tmp/ab/new/pkg/pyattn/_core*.so -k "L2048 D64" -k "variants B8" --shape 1,2,333,333,64,causal

The cases are the benches' own (benches/bench_attention.py's shapes, benches/bench_variants.py's
shapes times variants, with their inputs and keywords; benches/bench_kvcache.py's paged-decode
case, on its contiguous and its paged cache), chosen by -k substrings of the names the
report prints; --shape adds plain float32 ones, --decode that paged-decode case at any shape
(`--decode 1,32,8,32768,128` for B1 Hq32 Hkv8 Lk32768 D128, 16-row blocks).
It prints, per case, the median times and B's speed over A's (A's time / B's time) by medians,
fastest calls and first quartiles.

The Python layer is the one `import pyattn` finds; only the core changes between calls. Each core
is loaded under a module name of its own: loaded as `pyattn._core` a second time, the interpreter
hands back the first core, and the A/B then compares a build with itself.
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

import pyattn
import pyattn._api as api

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
import bench_attention  # noqa: E402
import bench_kvcache  # noqa: E402
import bench_variants  # noqa: E402


def _load(path: str, tag: str):
    name = f"_pyattn_ab_{tag}._core"  # the last part must stay `_core`: it names PyInit__core
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


# The Python layer's references into the core, module by module (every pyattn module that
# holds one: _api, _kvcache, _merge, the package itself): the core and any function of it bound
# to a name of its own (for speed, e.g. the small-call entry points); _use repoints every one.
_MODULES = tuple(
    m for n, m in sorted(sys.modules.items()) if n.split(".")[0] == "pyattn" and getattr(m, "_core", None) is api._core
)
_ALIASES = {
    mod: {
        name: fn.__name__
        for name, fn in vars(mod).items()
        if callable(fn) and getattr(api._core, getattr(fn, "__name__", ""), None) is fn
    }
    for mod in _MODULES
}


def _use(core) -> None:
    for mod in _MODULES:
        mod._core = core
        for name, fname in _ALIASES[mod].items():
            setattr(mod, name, getattr(core, fname))


def _paged_calls(c) -> dict:
    """{name: call}: the decode of bench_kvcache's paged case c on its contiguous cache and on
    the same tokens paged through a shuffled block table (bench_kvcache.paged_inputs)."""
    q, kc, vc, kp, vp, table, lens = bench_kvcache.paged_inputs(c)
    return {
        f"{c.name} contiguous": functools.partial(pyattn.kvcache_attention, q, kc, vc, lens),
        f"{c.name} paged": functools.partial(pyattn.kvcache_attention, q, kp, vp, lens, block_table=table),
    }


def _decode_case(spec: str) -> dict:
    """--decode B,Hq,Hkv,Lk,D[,block]: a bench_kvcache paged case of that shape (block 16 by
    default), Lk tokens held a sequence."""
    parts = [int(x) for x in spec.split(",")]
    return _paged_calls(bench_kvcache.PagedCase(*parts[:5], parts[5] if len(parts) > 5 else 16))


def _cases(keys: list[str], shapes: list[str]) -> dict:
    """name -> call, from the benches' shapes whose names contain one of keys, and --shape."""
    cases = {}
    for c in bench_attention.CASES:
        name = f"attention {c.name}"
        if any(k in name for k in keys):
            q, k, v = bench_attention.inputs(c)
            kw = {"is_causal": c.causal, **({"enable_gqa": True} if c.gqa else {})}
            cases[name] = functools.partial(pyattn.scaled_dot_product_attention, q, k, v, **kw)
    for c in bench_variants.VAR_CASES:
        for variant in bench_variants.VARIANTS:
            name = f"{c.name} {variant}"
            if any(k in name for k in keys):
                q = bench_variants.var_inputs(c)[0]
                k, v = bench_variants.variant_kv(c, variant)
                kw = bench_variants.variant_kwargs(c, variant)
                cases[name] = functools.partial(pyattn.scaled_dot_product_attention, q, k, v, **kw)
    for c in bench_kvcache.PAGED_CASES:  # the decode on a contiguous cache, and on the paged one
        names = [f"{c.name} {what}" for what in ("contiguous", "paged")]
        if not any(k in name for k in keys for name in names):
            continue
        cases.update((name, call) for name, call in _paged_calls(c).items() if any(k in name for k in keys))
    rng = np.random.default_rng(0)
    for s in shapes:
        parts = s.split(",")
        flags = set(parts[5:])
        b, h, lq, lk, d = (int(x) for x in parts[:5])
        q, k, v = (rng.standard_normal((b, h, n, d), dtype=np.float32) for n in (lq, lk, lk))
        kw = {"is_causal": "causal" in flags}
        if "alibi" in flags:  # BLOOM's slopes, 2^(-8h/H)
            kw["alibi_slopes"] = 2.0 ** (-8.0 * np.arange(1, h + 1) / h)
        if "softcap" in flags:
            kw["softcap"] = 50.0
        name = f"B{b} H{h} Lq{lq} Lk{lk} D{d}" + "".join(f" {x}" for x in parts[5:])
        cases[name] = functools.partial(pyattn.scaled_dot_product_attention, q, k, v, **kw)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("core_a")
    ap.add_argument("core_b")
    ap.add_argument("-k", dest="keys", action="append", default=[], help="a substring of the case names (repeatable)")
    ap.add_argument(
        "--shape", action="append", default=[], help="B,H,Lq,Lk,D[,causal][,alibi][,softcap]: a float32 case of its own"
    )
    ap.add_argument(
        "--decode",
        action="append",
        default=[],
        help="B,Hq,Hkv,Lk,D[,block]: a float32 decode step on a contiguous cache and on it paged (16-row blocks)",
    )
    ap.add_argument("--rounds", type=int, default=20, help="calls of each core per case")
    args = ap.parse_args()
    cases = _cases(args.keys, args.shape)
    for spec in args.decode:
        cases.update(_decode_case(spec))
    if not cases:
        raise SystemExit("no case: give -k (a substring of a bench shape's name), --shape or --decode")
    cores = [_load(args.core_a, "a"), _load(args.core_b, "b")]
    print(f"A {args.core_a}\nB {args.core_b}\nisa {cores[0].isa()}, threads {pyattn.get_num_threads()}")
    width = max(map(len, cases))
    for name, f in cases.items():
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
            f"{name:{width}s}  A {np.median(a) * 1e3:9.3f} ms  B {np.median(b) * 1e3:9.3f} ms  B's speed over A's:"
            f" median {np.median(a) / np.median(b):.3f}  fastest {a.min() / b.min():.3f}"
            f"  q25 {np.quantile(a, 0.25) / np.quantile(b, 0.25):.3f}"
        )


if __name__ == "__main__":
    main()
