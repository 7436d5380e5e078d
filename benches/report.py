#!/usr/bin/env python3
"""Run the benches (or read a pytest-benchmark json) and print markdown tables.

    python benches/report.py                      # run every bench, then print the tables
    python benches/report.py -k attention         # extra arguments go to pytest
    python benches/report.py --save out.json -k matmul
    python benches/report.py --json out.json      # only print the tables of an earlier run

Speed over time (benches/history/<machine key>/, committed; see "Tracking speed over time" in
docs/performance.md):

    python benches/report.py --record             # run the focused set, save it in the history
                                                  # (1 thread, CPU time; --threads N, --wall)
    python benches/report.py --compare            # latest saved run against the previous one
                                                  # of the same kind of machine; exit 1 on a flag
    python benches/report.py --compare A.json B.json  # two given runs (paths, or names in history)
    python benches/report.py --spread             # run-to-run spread of the ratios, all saved runs
    python benches/report.py --trend trend.png    # key ratios across saved runs, per kind of CPU
    python benches/report.py --plot gflops.png    # GFLOP/s against L, decode GB/s (latest run,
                                                  # or --json FILE); --trend/--plot need matplotlib

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
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
ORDER = ("pyattn", "numpy_ref", "numpy", "torch", "onnxruntime")


def run_benches(json_path: Path, pytest_args: list, keep_env: bool, paths: bool = True, env_add=None) -> int:
    env = dict(os.environ)
    env.update(env_add or {})
    if not keep_env:
        for var in OPENBLAS_VARS:
            env.pop(var, None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *([str(HERE)] if paths else []),
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
    if mi.get("bench_key"):
        lines.append(
            f"- machine key {mi['bench_key']}, {mi.get('timer', 'wall')} clock; commit "
            f"{(data.get('commit_info', {}).get('id') or '?')[:10]}"
            + (" with uncommitted library changes" if data.get("commit_info", {}).get("dirty") else "")
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


# ------------------------------------------------------------------ history and comparisons
#
# Wall time on these shared 2-core VMs moves by up to 2x between runs, and the CPU differs from
# machine to machine, so a run is never compared with another by its times. What is compared is
# what survives noise: ratios measured inside one run (a peer's median over pyattn's, pyattn's
# GFLOP/s over the sgemm peak measured in the same process, decode's GB/s over the same-run read
# bandwidth), and only between runs of the same machine key (CPU model, kernel set, threads).
HISTORY = HERE / "history"

# The focused set --record runs: a few minutes on 2 cores, and every kind of call whose speed
# matters (long, short batched, causal, decode with and without GQA, matmul).
FOCUS_FILES = ("bench_attention.py", "bench_matmul.py")
# The NumPy reference stays on the two short shapes only: on the long ones it takes seconds of
# CPU a call and torch and ONNX Runtime are the peers that matter.
FOCUS_K = (
    "(test_attention and (B1_H12_L512_D64 or B8_H12_L128_D64 or B1_H8_L2048_D64 or causal_B1_H32 "
    "or decode) and not (numpy_ref and (L2048 or causal or decode))) or (test_matmul and float32 and not 2048)"
)
# pytest-benchmark's default 1 s of rounds per item, halved: the fastest round of 0.5 s of
# rounds is as steady in CPU time, and the focused set stays a few minutes on a busy machine.
FOCUS_MAX_TIME = "0.5"

# Thresholds of --compare, from the spread measured on the Zen 5 dev VM (python benches/report.py
# --spread: 5 runs of the focused set, one build of one commit, 1 thread, CPU time, the 2 cores
# shared with other sessions' builds and tests at a load average of 7-18, 2026-11-30; see
# docs/performance.md). Over the 10 pairs of runs, a group's consensus change (the median of its
# ratios' changes, group_change) moved by up to 17.8% (90th percentile 9.9%), a single ratio by
# up to 21.6%, the median over all groups by up to 5.1%. A drop beyond these, rounded up, is
# flagged: smaller ones on a single group are within what pyattn's own time moves between runs
# of the same code (the peers cannot cancel that part), and show only as a trend.
GROUP_SPREAD = 0.20
RATIO_SPREAD = 0.30
RUN_SPREAD = 0.08
# Which of pytest-benchmark's statistics the ratios use, by the run's timer (--spread compares
# them). Wall time: the fastest round, since another process only ever adds time (a call that
# shares its core with a compiler takes 2-10x longer). CPU time (--record's default): the
# median; the fastest round of CPU time is itself an outlier (a round 30% below the first
# quartile was seen), and the median of CPU time hardly moves with the load.
STAT = {"cpu": "median", "wall": "min"}


def default_stat(data: dict) -> str:
    return STAT.get(data.get("machine_info", {}).get("timer", "wall"), "min")


def run_metrics(data: dict, stat: str = None) -> dict:
    """{group: {metric: value}}: the noise-proof figures of one run, all "higher is better for
    pyattn". ``x PEER`` = PEER time / pyattn time (``stat``, see STAT: the speed-up over a peer measured back to
    back in this run), ``% sgemm peak`` = pyattn GFLOP/s over the run's sgemm peak, ``% read bw``
    = a decode's GB/s over the run's read bandwidth. Rows of pyattn itself (``pyattn+f16cache``,
    ``pyattn_paged16``) are not peers and are left out."""
    mi = data.get("machine_info", {})
    peak, bw = mi.get("sgemm_peak_gflops"), mi.get("read_gbs")
    stat = stat or default_stat(data)
    out: dict = {}
    for name, benches in _groups(data).items():
        by_impl = {impl_of(b): b for b in benches}
        base = by_impl.get("pyattn")
        if base is None or base.get("extra_info", {}).get("kind") == "memory":
            continue
        t = _time(base, stat)
        if not t:
            continue
        m = {}
        for impl, b in by_impl.items():
            if impl.startswith("pyattn") or not _time(b, stat):
                continue
            m[f"x {impl}"] = _time(b, stat) / t
        ex = base.get("extra_info", {})
        decode = " Lq1 " in f" {ex.get('shape', name)} " or "decode" in name
        if ex.get("flops") and peak and not decode:
            m["% sgemm peak"] = 100 * ex["flops"] / t / 1e9 / peak
        if ex.get("bytes") and bw and decode:
            m["% read bw"] = 100 * ex["bytes"] / t / 1e9 / bw
        if m:
            out[name] = m
    return out


def _time(bench: dict, stat: str):
    st = bench.get("stats", bench)
    return st.get(stat)


def _median(bench: dict):
    return _time(bench, "median")


def _groups(data: dict) -> dict:
    groups: dict = {}
    for b in data.get("benchmarks", []):
        groups.setdefault(b.get("group") or b["name"], []).append(b)
    return groups


def run_key(data: dict, path=None) -> str:
    key = data.get("machine_info", {}).get("bench_key")
    if key:
        return key
    # Saved by pytest-benchmark as history/<key>/<its machine id>/NNNN_name.json
    if path is not None and HISTORY in Path(path).resolve().parents:
        return Path(path).resolve().relative_to(HISTORY).parts[0]
    return "?"


def run_label(data: dict, path) -> str:
    c = data.get("commit_info", {})
    sha = (c.get("id") or "")[:8] or "nogit"
    return f"{Path(path).stem} ({sha}{'+dirty' if c.get('dirty') else ''}, {str(data.get('datetime', '?'))[:16]})"


def history_runs(root: Path = HISTORY) -> list:
    """[(path, data)] of every saved run under root, oldest first (by the run's datetime)."""
    runs = []
    for path in sorted(root.rglob("*.json")) if root.exists() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        if "benchmarks" in data:
            runs.append((path, data))
    runs.sort(key=lambda r: (str(r[1].get("datetime", "")), str(r[0])))
    return runs


def find_run(spec: str, runs: list):
    """A run by path, or by a unique part of its file name under the history (``0003``, a commit)."""
    p = Path(spec)
    if p.is_file():
        return p, json.loads(p.read_text())
    hits = [r for r in runs if spec in r[0].name]
    if len(hits) != 1:
        raise SystemExit(f"--compare: {spec!r} matches {len(hits)} saved runs (give a path or a unique name)")
    return hits[0]


def _gmedian(vals) -> float:
    vals = sorted(vals)
    n = len(vals)
    return vals[n // 2] if n % 2 else math.sqrt(vals[n // 2 - 1] * vals[n // 2])


def run_change(mo: dict, mn: dict) -> float:
    """The median of the group consensus changes over every group both runs have: one number for
    a change that slows pyattn everywhere (the Python layer, threading, a shared kernel)."""
    meds = [group_change(mo[g], mn[g])[0] for g in mo if g in mn]
    meds = [m for m in meds if m is not None]
    return _gmedian(meds) if meds else None


def group_change(old: dict, new: dict) -> tuple:
    """(consensus, {metric: change}) for one group: each shared metric's new / old, and their
    median. A slower pyattn moves every ratio of its group the same way; a peer that happened to
    be slow in one run moves one of them. The median follows the first and ignores the second."""
    ch = {k: new[k] / old[k] for k in old if k in new and old[k] > 0}
    if not ch:
        return None, ch
    return _gmedian(ch.values()), ch


def compare(old_run, new_run, group_spread=GROUP_SPREAD, ratio_spread=RATIO_SPREAD, stat=None) -> tuple:
    """Markdown lines comparing two runs, and the groups flagged (a consensus drop beyond
    group_spread)."""
    (po, do), (pn, dn) = old_run, new_run
    ko, kn = run_key(do, po), run_key(dn, pn)
    lines = [
        f"# pyattn: {run_label(dn, pn)} against {run_label(do, po)}",
        "",
        f"- machine key: {kn}"
        + (
            ""
            if ko == kn
            else f" (the older run: **{ko}**; ratios of different machines are not comparable, read with care)"
        ),
        f"- ratios of each implementation's {stat or default_stat(dn)} time "
        f"({dn.get('machine_info', {}).get('timer', 'wall')} clock); change = new ratio / old ratio "
        "(below 1: pyattn lost ground); a group is **flagged** when the "
        f"median change of its ratios is below {1 - group_spread:.2f} (the run-to-run spread measured: "
        f"+-{group_spread:.0%}); `↓` marks a single ratio below {1 - ratio_spread:.2f} (one peer's or "
        "one moment's noise when its group is not flagged)",
        "",
        "| group | metric | old | new | change |",
        "|---|---|---|---|---|",
    ]
    mo, mn = run_metrics(do, stat), run_metrics(dn, stat)
    flagged = []
    for group in [g for g in mn if g in mo]:
        med, ch = group_change(mo[group], mn[group])
        if med is None:
            continue
        flag = med < 1 - group_spread
        if flag:
            flagged.append((group, med))
        for metric, c in ch.items():
            mark = " ↓" if c < 1 - ratio_spread else ""
            lines.append(f"| {group} | {metric} | {mo[group][metric]:.2f} | {mn[group][metric]:.2f} | {c:.2f}{mark} |")
        lines.append(
            f"| {group} | **median change** | | | **{med:.2f}**" + (" **FLAG: slower**" if flag else "") + " |"
        )
    overall = run_change(mo, mn)
    if overall is not None and overall < 1 - RUN_SPREAD:
        flagged.append(("every group (median over groups)", overall))
    if overall is not None:
        lines.append(
            f"| **all groups** | **median of the groups' changes** | | | **{overall:.2f}**"
            + (" **FLAG: slower**" if overall < 1 - RUN_SPREAD else "")
            + f" (flagged below {1 - RUN_SPREAD:.2f}) |"
        )
    only = sorted(set(mo) ^ set(mn))
    if only:
        lines += ["", f"- groups in only one of the runs (not compared): {', '.join(only)}"]
    lines.append("")
    if flagged:
        lines.append(f"**{len(flagged)} group(s) flagged**: " + "; ".join(f"{g} ({m:.2f}x)" for g, m in flagged))
    else:
        lines.append("No group flagged: every group's median change is within the run-to-run spread.")
    return lines, flagged


def spread(runs: list, stat=None) -> list:
    """The run-to-run spread of the ratios, over every pair of saved runs of the same key: per
    pair, each group's consensus change and each single ratio's change (|log| of new / old)."""
    by_key: dict = {}
    for path, data in runs:
        by_key.setdefault(run_key(data, path), []).append((path, data))
    lines = []
    for key, rs in by_key.items():
        if len(rs) < 2:
            lines.append(f"- {key}: {len(rs)} run, nothing to compare")
            continue
        gch, rch, runch = [], [], []
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                mo, mn = run_metrics(rs[i][1], stat), run_metrics(rs[j][1], stat)
                rc = run_change(mo, mn)
                if rc is not None:
                    runch.append((abs(math.log(rc)), rs[i][0].stem, rs[j][0].stem))
                for g in mo:
                    if g in mn:
                        med, ch = group_change(mo[g], mn[g])
                        if med is not None:
                            gch.append((abs(math.log(med)), g, rs[i][0].stem, rs[j][0].stem))
                            rch += [(abs(math.log(c)), f"{g} / {k}") for k, c in ch.items()]
        gch.sort()
        rch.sort()
        runch.sort()

        def q(xs, f):
            return math.exp(xs[min(len(xs) - 1, int(f * len(xs)))][0]) - 1

        lines += [
            f"- {key}, ratios of the {stat or default_stat(rs[-1][1])} times: {len(rs)} runs, "
            f"{len(gch)} group comparisons, "
            f"{len(rch)} ratio comparisons",
            f"  - group consensus change |new/old - 1|: median {q(gch, 0.5):.1%}, 90th percentile "
            f"{q(gch, 0.9):.1%}, max {q(gch, 1.0):.1%} ({gch[-1][1]}, {gch[-1][2]} -> {gch[-1][3]})",
            f"  - single ratio change: median {q(rch, 0.5):.1%}, 90th percentile {q(rch, 0.9):.1%}, "
            f"max {q(rch, 1.0):.1%} ({rch[-1][1]})",
            f"  - all groups' median change: median {q(runch, 0.5):.1%}, max {q(runch, 1.0):.1%} "
            f"({runch[-1][1]} -> {runch[-1][2]})",
        ]
    lines.append(
        f"- thresholds in use (report.py): group {GROUP_SPREAD:.0%}, single ratio {RATIO_SPREAD:.0%}, "
        f"all groups {RUN_SPREAD:.0%}"
    )
    return lines


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot / --trend need matplotlib: pip install 'pyattn[plot]' (or matplotlib)") from None
    return plt


TREND_PEERS = ("torch", "onnxruntime", "numpy")


def trend(runs: list, out: Path) -> None:
    """Per machine key, two panels across its saved runs: pyattn's speed-up over the best-known
    peer of each group (torch, else ONNX Runtime, else NumPy), and its share of the sgemm peak
    (or, for decode, of the read bandwidth)."""
    plt = _pyplot()
    by_key: dict = {}
    for path, data in runs:
        by_key.setdefault(run_key(data, path), []).append((path, data))
    if not by_key:
        raise SystemExit(f"--trend: no saved runs under {HISTORY}")
    fig, axes = plt.subplots(2, len(by_key), figsize=(7 * len(by_key), 8), squeeze=False)
    for col, (key, rs) in enumerate(sorted(by_key.items())):
        metrics = [run_metrics(d) for _, d in rs]
        labels = [f"{p.stem.split('_')[0]}\n{(d.get('commit_info', {}).get('id') or '')[:7]}" for p, d in rs]
        groups = sorted({g for m in metrics for g in m})
        for g in groups:
            peer = next((p for p in TREND_PEERS if any(f"x {p}" in m.get(g, {}) for m in metrics)), None)
            share = "% read bw" if any("% read bw" in m.get(g, {}) for m in metrics) else "% sgemm peak"
            short = g.replace("attention ", "").replace("matmul ", "mm ")
            if peer:
                ys = [m.get(g, {}).get(f"x {peer}") for m in metrics]
                axes[0][col].plot(range(len(rs)), ys, marker="o", label=f"{short} / {peer}")
            ys = [m.get(g, {}).get(share) for m in metrics]
            if any(y is not None for y in ys):
                axes[1][col].plot(range(len(rs)), ys, marker="o", label=f"{short} ({share[2:]})")
        titles = ("pyattn speed-up over the peer (same run)", "pyattn share of the same-run peak, %")
        for row, title in enumerate(titles):
            ax = axes[row][col]
            ax.set_title(f"{key}: {title}", fontsize=9)
            ax.set_xticks(range(len(rs)))
            ax.set_xticklabels(labels, fontsize=7)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="best")
        axes[0][col].axhline(1.0, color="k", lw=0.8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


_L_RE = re.compile(r"\bL(?:k)?(\d+)\b")


def plot_run(data: dict, out: Path, stat: str = "median") -> None:
    """Issue 12's picture of one run: attention GFLOP/s against the sequence length per
    implementation, beside the same-run sgemm peak; decode's GB/s per implementation beside the
    same-run read bandwidth (and the 80% target)."""
    plt = _pyplot()
    mi = data.get("machine_info", {})
    peak, bw = mi.get("sgemm_peak_gflops"), mi.get("read_gbs")
    series: dict = {}
    decode: dict = {}
    for name, benches in _groups(data).items():
        for b in benches:
            ex = b.get("extra_info", {})
            if ex.get("kind") != "attention" or not _time(b, stat):
                continue
            shape = ex.get("shape", name)
            impl = impl_of(b)
            t = _time(b, stat)
            if " Lq1 " in f" {shape} ":
                if ex.get("bytes"):
                    decode.setdefault(shape, {})[impl] = ex["bytes"] / t / 1e9
                continue
            m = _L_RE.findall(shape.replace("Lq", "Lq_"))
            if not m or not ex.get("flops"):
                continue
            kind = "causal" if "causal" in shape else "full"
            series.setdefault((impl, kind), []).append((int(m[-1]), ex["flops"] / t / 1e9, shape))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    colors = {}
    for (impl, kind), pts in sorted(series.items(), key=lambda kv: (_rank(kv[0][0]), kv[0][1])):
        pts.sort()
        c = colors.setdefault(impl, f"C{len(colors)}")
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o" if kind == "full" else "s",
            ls="-" if kind == "full" else "--",
            color=c,
            mfc=c if kind == "full" else "none",
            label=f"{impl}" + (" (causal: half the pairs)" if kind == "causal" else ""),
        )
        if impl == "pyattn":
            for L, g, shape in pts:
                ax.annotate(shape, (L, g), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if peak:
        ax.axhline(peak, color="k", ls=":", lw=1)
        ax.text(
            0.99,
            peak,
            f"sgemm peak, same run ({peak:.0f})",
            fontsize=7,
            va="bottom",
            ha="right",
            transform=ax.get_yaxis_transform(),
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length L (keys)")
    ax.set_ylabel("GFLOP/s (4*B*H*Lq*Lk*D, halved for causal)")
    ax.set_title(f"attention, float32 ({stat} times)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    shapes = sorted(decode)
    impls = sorted({i for d in decode.values() for i in d}, key=_rank)
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs = [i + j * width for i, s in enumerate(shapes) if impl in decode[s]]
        ys = [decode[s][impl] for s in shapes if impl in decode[s]]
        bx.bar(xs, ys, width, label=impl, color=colors.get(impl, f"C{len(colors) + j}"))
    if bw:
        bx.axhline(bw, color="k", ls=":", lw=1, label=f"read bandwidth, same run ({bw:.1f} GB/s)")
        bx.axhline(0.8 * bw, color="k", ls="--", lw=0.8, label="80% of it (the target)")
    bx.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    bx.set_xticklabels([s.replace(" Lq1", "\nLq1") for s in shapes], fontsize=7)
    bx.set_ylabel("GB/s (q, k, v and output bytes / time)")
    bx.set_title(f"decode ({stat} times)", fontsize=10)
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    bx.grid(alpha=0.3, axis="y")
    cpu = mi.get("cpu", {}).get("brand_raw", "?")
    fig.suptitle(
        f"pyattn {mi.get('pyattn', {}).get('version')} on {cpu} ({mi.get('bench_key', '?')}), "
        f"{str(data.get('datetime', '?'))[:16]}, commit {(data.get('commit_info', {}).get('id') or '?')[:8]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, help="read this pytest-benchmark json instead of running")
    ap.add_argument("--save", type=Path, help="keep the json of this run here")
    ap.add_argument(
        "--keep-openblas-env", action="store_true", help="do not unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for the run"
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="run the focused set (or the given pytest args) and save it in benches/history/<machine key>/",
    )
    ap.add_argument("--history", type=Path, default=HISTORY, help="the history folder (default: benches/history)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="--record: threads for pyattn, the peers and NumPy's BLAS (default 1: see --wall)",
    )
    ap.add_argument(
        "--wall",
        action="store_true",
        help="--record: time in wall-clock time, as the plain report does, instead of CPU time "
        "(process_time: what another process takes of the core is not counted)",
    )
    ap.add_argument(
        "--compare",
        nargs="*",
        metavar="RUN",
        help="compare two saved runs (OLD NEW), one run with the previous of its key, or (none "
        "given) the latest run with the previous of its key; exit status 1 when a group is flagged",
    )
    ap.add_argument("--spread", action="store_true", help="the run-to-run spread of the ratios in the history")
    ap.add_argument(
        "--stat",
        choices=("min", "median", "mean"),
        default=None,
        help="the times the ratios use (default: median for CPU-time runs, min for wall-time runs)",
    )
    ap.add_argument("--trend", type=Path, metavar="PNG", help="plot the key ratios across saved runs")
    ap.add_argument("--plot", type=Path, metavar="PNG", help="plot GFLOP/s against L and decode GB/s of one run")
    args, pytest_args = ap.parse_known_args(argv)

    if args.compare is not None or args.spread or args.trend or (args.plot and not args.record):
        return history_main(args)

    rc = 0
    env_add = {}
    if args.record:
        # One thread and CPU time by default: on a shared machine a call's wall time is mostly
        # other processes' time, and a team of threads loses whole time slices waiting at a
        # barrier for a descheduled member; the CPU time of one thread is the call's own work.
        n = str(args.threads)
        env_add = {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n}
        extra = [f"--bench-history={args.history.resolve()}"]
        if not args.wall and not any(a.startswith("--benchmark-timer") for a in pytest_args):
            extra.append("--benchmark-timer=time.process_time")
        if not any(a.startswith("--benchmark-max-time") for a in pytest_args):
            extra.append(f"--benchmark-max-time={FOCUS_MAX_TIME}")
        if not any(a == "-k" or a.startswith("-k") for a in pytest_args):
            extra += ["-k", FOCUS_K]
        if not any(a.endswith(".py") or "::" in a for a in pytest_args):
            pytest_args = [str(HERE / f) for f in FOCUS_FILES] + pytest_args
        pytest_args = extra + pytest_args
    if args.json:
        path = args.json
    else:
        path = args.save or Path(tempfile.mkdtemp(prefix="pyattn-bench-")) / "bench.json"
        rc = run_benches(path.resolve(), pytest_args, args.keep_openblas_env, paths=not args.record, env_add=env_add)
        if not path.exists():
            print(f"no benchmark json was written (pytest exit status {rc})", file=sys.stderr)
            return rc or 1
    data = json.loads(path.read_text())
    print(report(data))
    if args.plot:
        plot_run(data, args.plot, args.stat or "median")
    return rc


def history_main(args) -> int:
    runs = history_runs(args.history)
    rc = 0
    if args.spread:
        for stat in [args.stat] if args.stat else ["median", "min"]:
            print("\n".join(spread(runs, stat)))
    if args.compare is not None:
        if len(args.compare) > 2:
            raise SystemExit("--compare takes at most two runs")
        if len(args.compare) == 2:
            old, new = (find_run(s, runs) for s in args.compare)
        else:
            new = find_run(args.compare[0], runs) if args.compare else (runs[-1] if runs else None)
            if new is None:
                raise SystemExit(f"--compare: no saved runs under {args.history}")
            key = run_key(new[1], new[0])
            before = [r for r in runs if run_key(r[1], r[0]) == key and r[0] != new[0]]
            before = [r for r in before if str(r[1].get("datetime", "")) <= str(new[1].get("datetime", ""))]
            if not before:
                raise SystemExit(f"--compare: no earlier run of {key} than {new[0]}")
            old = before[-1]
        lines, flagged = compare(old, new, stat=args.stat)
        print("\n".join(lines))
        rc = 1 if flagged else 0
    if args.trend:
        trend(runs, args.trend)
    if args.plot:
        if args.json:
            data = json.loads(args.json.read_text())
        elif runs:
            print(f"plotting the latest saved run: {runs[-1][0]}")
            data = runs[-1][1]
        else:
            raise SystemExit("--plot: give --json FILE, or save a run first (--record)")
        plot_run(data, args.plot, args.stat or "median")
    return rc


if __name__ == "__main__":
    sys.exit(main())
