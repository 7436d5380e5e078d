#!/usr/bin/env python3
"""Run the benches (or read a pytest-benchmark json) and print markdown tables.

    python benches/report.py                      # run every bench, then print the tables
    python benches/report.py -k attention         # extra arguments go to pytest
    python benches/report.py --save out.json -k matmul
    python benches/report.py --json out.json      # only print the tables of an earlier run

When it runs the benches it removes OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE from the benchmark
process's environment (the fair NumPy peer is OpenBLAS's AVX-512 kernel, see
docs/performance.md), unless --keep-openblas-env is given, and runs pytest from an empty
temporary directory so that the
installed pyattn is imported (not the source tree).  Per group it prints the median time, GFLOP/s or GB/s, the ratio
peer_time / pyattn_time for every implementation (> 1: pyattn is faster) and, for attention and
matmul, the percentage of the NumPy float32 2048^3 sgemm rate measured in the benchmark process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
ORDER = ("pyattn", "numpy_ref", "numpy", "torch", "onnxruntime")


def run_benches(json_path: Path, pytest_args: list, keep_env: bool) -> int:
    env = dict(os.environ)
    if not keep_env:
        for var in OPENBLAS_VARS:
            env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(HERE),
        f"--benchmark-json={json_path}",
        "-p",
        "no:cacheprovider",
        "-q",
        *pytest_args,
    ]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    # From an empty directory: `python -m` puts the cwd on sys.path, so the installed pyattn is
    # imported, and pytest-benchmark's .benchmarks/ storage lands there, not in the tree.
    with tempfile.TemporaryDirectory(prefix="pyattn-bench-cwd-") as cwd:
        return subprocess.call(cmd, cwd=cwd, env=env)


def _fmt(x, spec):
    return "—" if x is None else format(x, spec)


def impl_of(bench: dict) -> str:
    return bench.get("extra_info", {}).get("impl") or bench.get("params", {}).get("impl", "?")


def header(data: dict) -> list:
    mi = data.get("machine_info", {})
    pa = mi.get("pyattn", {})
    lines = [
        f"- machine: {mi.get('cpu', {}).get('brand_raw', '?')}, "
        f"{mi.get('cpu', {}).get('count', '?')} logical CPUs; run {data.get('datetime', '?')}",
        f"- pyattn {pa.get('version')} ({pa.get('file')}), {pa.get('num_threads')} threads",
    ]
    cfg = [x.strip() for x in (pa.get("config") or "").splitlines() if x.strip()]
    keep = [x for x in cfg if x.split(":")[0].strip() in ("isa", "compiler", "threads")]
    if cfg:
        lines.append("- pyattn config: " + " | ".join(" ".join(x.split()) for x in keep or cfg))
    for blas in mi.get("blas", []):
        lines.append(
            f"- NumPy {mi.get('numpy')} BLAS: {blas.get('internal_api')} "
            f"{blas.get('version')}, core type **{blas.get('architecture')}**, "
            f"{blas.get('num_threads')} threads"
        )
    env = mi.get("openblas_env", {})
    set_vars = {k: v for k, v in env.items() if v is not None}
    if set_vars:
        lines.append(
            f"- WARNING: {set_vars} was set in the benchmark process: NumPy used an old "
            "kernel (rerun with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE`)"
        )
    peers = mi.get("peers", {})
    lines.append("- peers: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in peers.items()))
    peak = mi.get("sgemm_peak_gflops")
    lines.append(
        f"- sgemm peak (NumPy float32 2048^3, best of 7 at the start and at the end, in the "
        f"benchmark process): "
        f"{_fmt(peak, '.0f')} GFLOP/s"
    )
    bw = mi.get("read_gbs")
    lines.append(
        f"- memory read bandwidth (NumPy sums of a 512 MiB array in "
        f"{pa.get('num_threads')} threads, best of 5 at the start and at the end): "
        f"{_fmt(bw, '.1f')} GB/s"
    )
    load = mi.get("loadavg_end")
    if load:
        lines.append(
            f"- load average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / "
            f"{load[2]:.2f} (this run alone keeps it near the thread count; more means "
            "other work shared the cores and the times are noisier)"
        )
    return lines


def _rank(impl: str) -> tuple:
    """ORDER's position; a variant of a known impl (bench_variants.py: 'pyattn+alibi',
    'pyattn_full_causal', 'torch_bf16') right after it, in run order; the rest by name."""
    if impl in ORDER:
        return (ORDER.index(impl), 0, "")
    base = re.split(r"[+_]", impl, maxsplit=1)[0]
    if base in ORDER:
        return (ORDER.index(base), 1, "")
    return (len(ORDER), 1, impl)


def _impls(by_impl: dict) -> list:
    return sorted(by_impl, key=_rank)  # stable: variants keep the run's order


def memory_table(by_impl: dict) -> list:
    rows = ["| impl | extra peak RSS MiB | output MiB | peer / pyattn |", "|---|---|---|---|"]
    base = by_impl.get("pyattn", {}).get("extra_info", {}).get("extra_peak_mib")
    for impl in _impls(by_impl):
        ex = by_impl[impl]["extra_info"]
        ratio = ex["extra_peak_mib"] / base if base else None
        rows.append(f"| {impl} | {ex['extra_peak_mib']:.1f} | {ex.get('output_mib', 0):.1f} | {_fmt(ratio, '.1f')} |")
    return rows


def group_table(benches: list, peak) -> list:
    kind = benches[0].get("extra_info", {}).get("kind", "")
    by_impl = {impl_of(b): b for b in benches}
    if kind == "memory":
        return memory_table(by_impl)
    base = by_impl.get("pyattn")
    base_t = base["stats"]["median"] if base else None
    show_flops = kind in ("attention", "matmul")
    show_peak = show_flops and peak
    cols = ["impl", "median ms"] + (["GFLOP/s"] if show_flops else []) + ["GB/s"]
    cols += (["% sgemm peak"] if show_peak else []) + ["peer / pyattn"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for impl in _impls(by_impl):
        b = by_impl[impl]
        t = b["stats"]["median"]
        ex = b.get("extra_info", {})
        gflops = ex["flops"] / t / 1e9 if ex.get("flops") else None
        gbs = ex["bytes"] / t / 1e9 if ex.get("bytes") else None
        cells = [impl, f"{t * 1e3:.3f}"]
        if show_flops:
            cells.append(_fmt(gflops, ".1f"))
        cells.append(_fmt(gbs, ".1f"))
        if show_peak:
            cells.append(_fmt(None if gflops is None else 100 * gflops / peak, ".0f"))
        cells.append(_fmt(None if base_t is None else t / base_t, ".2f"))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def attention_summary(groups: dict, peak, bw=None) -> list:
    """One row per shape; `% read bw` (GB/s of q, k, v and the output over the measured read
    bandwidth) is the figure that matters for decode, `% sgemm peak` for the rest."""
    peers = ("numpy_ref", "torch", "onnxruntime")
    cols = ["shape", "pyattn ms", "GFLOP/s", "GB/s", "% sgemm peak", "% read bw"]
    cols += [f"x {p}" for p in peers]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, benches in groups.items():
        if benches[0].get("extra_info", {}).get("kind") != "attention":
            continue
        by_impl = {impl_of(b): b for b in benches}
        base = by_impl.get("pyattn")
        if base is None:
            continue
        t = base["stats"]["median"]
        ex = base["extra_info"]
        gflops = ex["flops"] / t / 1e9
        cells = [
            ex.get("shape", name),
            f"{t * 1e3:.3f}",
            f"{gflops:.1f}",
            f"{ex['bytes'] / t / 1e9:.1f}",
            _fmt(100 * gflops / peak if peak else None, ".0f"),
            _fmt(100 * ex["bytes"] / t / 1e9 / bw if bw else None, ".0f"),
        ]
        for p in peers:
            pb = by_impl.get(p)
            cells.append(_fmt(pb["stats"]["median"] / t if pb else None, ".2f"))
        rows.append("| " + " | ".join(cells) + " |")
    return rows if len(rows) > 2 else []


def report(data: dict) -> str:
    groups: dict = {}
    for b in data.get("benchmarks", []):
        groups.setdefault(b.get("group") or b["name"], []).append(b)
    peak = data.get("machine_info", {}).get("sgemm_peak_gflops")
    out = ["# pyattn benchmarks", ""] + header(data) + [""]
    out += [
        "Medians of pytest-benchmark; `peer / pyattn` = peer median / pyattn median "
        "(above 1: pyattn is faster); `—`: not run (skipped, see the pytest output). "
        "Rows `pyattn+…` / `pyattn_…` (bench_variants.py) are pyattn with a score variant, "
        "K/V dtype or cache layout: their `peer / pyattn` is their time over the plain `pyattn` "
        "row of the same group (below 1: faster than it).",
        "",
    ]
    summary = attention_summary(groups, peak, data.get("machine_info", {}).get("read_gbs"))
    if summary:
        out += ["## attention summary (pyattn, and its speed-up over each peer)", ""] + summary
        out.append("")
    for name, benches in groups.items():
        out += [f"## {name}", ""] + group_table(benches, peak) + [""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, help="read this pytest-benchmark json instead of running")
    ap.add_argument("--save", type=Path, help="keep the json of this run here")
    ap.add_argument(
        "--keep-openblas-env", action="store_true", help="do not unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for the run"
    )
    args, pytest_args = ap.parse_known_args(argv)

    rc = 0
    if args.json:
        path = args.json
    else:
        path = args.save or Path(tempfile.mkdtemp(prefix="pyattn-bench-")) / "bench.json"
        rc = run_benches(path.resolve(), pytest_args, args.keep_openblas_env)
        if not path.exists():
            print(f"no benchmark json was written (pytest exit status {rc})", file=sys.stderr)
            return rc or 1
    print(report(json.loads(path.read_text())))
    return rc


if __name__ == "__main__":
    sys.exit(main())
