#!/usr/bin/env python3
"""Instruction counts of a few key pyattn calls under callgrind: a gate that cannot flake.

    python tools/icount.py                 # count, compare with benches/icount_baseline.json
    python tools/icount.py --repeat 2      # ...twice, and fail if the two runs disagree
    python tools/icount.py --update        # rewrite the baseline (commit it with the reason)
    python tools/icount.py --json out.json # also keep this run's counts

Wall time on the shared development and CI machines moves by up to 2x; the number of
instructions a call executes does not move at all. Each region below runs its call on fixed
inputs (after two untimed warm-up calls, so lazy set-up and scratch allocation are left out)
between two callgrind client requests, and callgrind reports the instructions executed in
between: all of it ("total": the Python layer, NumPy, libc and the core) and the part inside
pyattn's compiled core ("core"). The gate fails when either grows more than --margin over the
committed baseline, per call, or when the core's count falls more than --margin under it (the
compiler deleting work, as GCC 12 once deleted the decode's and the prefill's prefetches).

Determinism, checked rather than assumed:
- valgrind emulates one synthetic CPU (no AVX-512), whatever the host: the dispatcher picks the
  AVX2 kernels on Zen 3 and Zen 5 alike. PYATTN_ISA=avx2 pins that anyway, and the run checks
  that pyattn reports isa 'avx2'.
- one thread everywhere (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, pyattn.set_num_threads(1)):
  no thread scheduling in the counts; PYTHONHASHSEED=0: the same dict layouts every run.
- measured on the development VM: the counts of every region were identical over repeated runs
  (0 instructions apart), so any margin only has to absorb changes of the toolchain (Python,
  NumPy, gcc), which the baseline records: when they differ from the baseline's, the counts are
  printed and the affected part is not gated, with a NOTE (the total when Python or NumPy
  differ, everything when the compiler or the kernel set does).

The margin (2% by default) is well above that 0 and well below what a real slowdown of the kernels
costs (a disabled fused exp2 path: +10-40% in the prefill regions), so it is about the size of a
change that deserves a look and a deliberate `--update` commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = REPO / "benches" / "icount_baseline.json"
MARGIN = 0.02

# The marker functions: callgrind's client requests (no-ops outside valgrind). start() zeroes the
# counters and switches collection on; stop(name) switches it off and writes the counts so far to
# a dump file whose header names the region.
HELPER_C = r"""
#include <valgrind/callgrind.h>
void icount_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void icount_stop(const char* name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
"""

# What runs under valgrind. Each region: (name, what, reps, make) where make() returns the call.
# Shapes are small (the whole run is about 40 s of CPU under callgrind) and their lengths are not
# multiples of the tile sizes, so the edge paths are counted too.
CHILD = r"""
import ctypes, json, sys
import numpy as np
import pyattn

helper = ctypes.CDLL(sys.argv[1])
helper.icount_stop.argtypes = [ctypes.c_char_p]
pyattn.set_num_threads(1)
cfg = pyattn.show_config(file=open("/dev/null", "w"))


def arrays(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32) for s in shapes]


def sdpa(seed, b, hq, hkv, lq, lk, d, causal=False):
    q, k, v = arrays(seed, (b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d))
    kw = {"enable_gqa": True} if hq != hkv else {}
    return lambda: pyattn.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)


def kvcache(seed, b, hq, hkv, lk, d, block):
    # a decode step over K/V past decode_cached's 16 MiB: rows streamed from memory, prefetched
    # ahead (through a block table with block, else contiguous), the calls GCC once dropped
    (q,) = arrays(seed, (b, hq, 1, d))
    if not block:
        k, v = arrays(seed + 1, (b, hkv, lk, d), (b, hkv, lk, d))
        table = None
    else:
        per = -(-lk // block)
        k, v = arrays(seed + 1, (b * per, hkv, block, d), (b * per, hkv, block, d))
        table = np.random.default_rng(seed).permutation(b * per).astype(np.int32).reshape(b, per)
    lens = np.full(b, lk, np.int64)  # int64: the compiled fast path's lengths, as KVCache passes them
    return lambda: pyattn.kvcache_attention(q, k, v, lens, block_table=table)


def matmul(seed, m, k, n):
    a, b = arrays(seed, (m, k), (k, n))
    return lambda: pyattn.matmul(a, b)


REGIONS = [
    ("prefill", "sdpa B1 H2 L300 D64: the prefill tile loop (fused exp2 path)", 1,
     lambda: sdpa(1, 1, 2, 2, 300, 300, 64)),
    ("prefill_causal", "sdpa causal B1 H2 L333 D64: masked tiles skipped", 1,
     lambda: sdpa(2, 1, 2, 2, 333, 333, 64, causal=True)),
    ("decode", "sdpa decode B1 Hq8 Hkv2 Lq1 Lk1000 D128 (GQA): one decode step", 2,
     lambda: sdpa(3, 1, 8, 2, 1, 1000, 128)),
    ("decode_streamed", "kvcache B1 Hq8 Hkv2 Lk16400 D128 contiguous: rows streamed, prefetched", 1,
     lambda: kvcache(6, 1, 8, 2, 16400, 128, 0)),
    ("decode_paged", "kvcache B1 Hq8 Hkv2 Lk16400 D128 block 16: prefetched through the table", 1,
     lambda: kvcache(7, 1, 8, 2, 16400, 128, 16)),
    ("gemm", "matmul (200, 256) @ (256, 330): a GEMM block with edges", 1, lambda: matmul(4, 200, 256, 330)),
    ("small_call", "sdpa B1 H1 Lq1 Lk16 D64: a small call's Python path", 20, lambda: sdpa(5, 1, 1, 1, 1, 16, 64)),
]
only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 and sys.argv[2] else None
meta = {"isa": cfg["isa"], "threads": pyattn.get_num_threads(), "numpy": np.__version__,
        "python": sys.version.split()[0], "compiler": cfg["compiler"], "regions": {}}
for name, what, reps, make in REGIONS:
    if only and name not in only:
        continue
    fn = make()
    fn(); fn()  # lazy set-up, scratch buffers, first-call caches
    helper.icount_start()
    for _ in range(reps):
        fn()
    helper.icount_stop(name.encode())
    meta["regions"][name] = {"what": what, "reps": reps}
print("ICOUNT-META " + json.dumps(meta))
"""


def build_helper(work: Path) -> Path:
    src, lib = work / "icount_marker.c", work / "icount_marker.so"
    src.write_text(HELPER_C)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    proc = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr.strip())
        print(
            "NOTE: could not build the marker helper (needs a C compiler and valgrind/callgrind.h, which "
            "Debian's valgrind package ships): the instruction-count gate did not run"
        )
        return None
    return lib


def parse_dump(path: Path) -> tuple:
    """(trigger, total Ir, Ir of the pyattn core) of one callgrind dump.

    Self cost lines are summed per object file; the cost line after a ``calls=`` line is the
    inclusive cost of that call, counted already in the callee's own lines, and skipped."""
    trigger, total, core = "", None, 0
    names: dict = {}
    ob = ""
    skip_next = False
    with open(path) as f:
        for line in f:
            if line.startswith("desc: Trigger:"):
                trigger = line.split("Trigger:", 1)[1].strip()
            elif line.startswith(("summary:", "totals:")):
                total = int(line.split()[1])
            elif line.startswith("ob="):
                ob = _name(names, "ob", line[3:].strip())
            elif line.startswith("calls="):
                skip_next = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                if skip_next:
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) >= 2 and "_core" in os.path.basename(ob) and ob.endswith(".so"):
                    core += int(parts[1])
            elif line.startswith(("cob=", "cfi=", "cfl=", "cfn=")):
                # the callee's context (compressed names are defined here too)
                kind = "ob" if line.startswith("cob=") else None
                if kind:
                    _name(names, "ob", line[4:].strip())
    m = re.search(r"Client Request: (.*)$", trigger)
    return (m.group(1) if m else trigger), total, core


def _name(names: dict, kind: str, text: str) -> str:
    """callgrind's name compression: "(n) name" defines n, "(n)" refers to it."""
    m = re.match(r"\((\d+)\)(?:\s+(.*))?$", text)
    if not m:
        return text
    if m.group(2) is not None:
        names[(kind, m.group(1))] = m.group(2)
    return names.get((kind, m.group(1)), text)


def count_once(work: Path, helper: Path, only: str = "") -> dict:
    out = work / "cg"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = dict(os.environ)
    env.update(
        PYATTN_ISA="avx2", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0"
    )
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}/callgrind.out",
        sys.executable,
        "-c",
        CHILD,
        str(helper),
        only,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    meta_line = [x for x in proc.stdout.splitlines() if x.startswith("ICOUNT-META ")]
    if proc.returncode or not meta_line:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the counted run failed (exit {proc.returncode})")
    meta = json.loads(meta_line[0].split(" ", 1)[1])
    for dump in sorted(out.glob("callgrind.out*")):
        name, total, core = parse_dump(dump)
        if name in meta["regions"]:
            reg = meta["regions"][name]
            reg["total"] = round(total / reg["reps"])
            reg["core"] = round(core / reg["reps"])
    missing = [n for n, r in meta["regions"].items() if "total" not in r]
    if missing:
        raise SystemExit(f"no callgrind dump for {missing}")
    return meta


def env_of(meta: dict) -> dict:
    return {k: meta.get(k) for k in ("isa", "threads", "python", "numpy", "compiler")}


def gate(run: dict, base: dict, margin: float) -> tuple:
    """(lines, failures): the per-call counts against the baseline."""
    lines, fails = [], []
    be, re_ = base.get("env", {}), env_of(run)
    core_ok = all(be.get(k) == re_.get(k) for k in ("isa", "threads", "compiler"))
    total_ok = core_ok and all(be.get(k) == re_.get(k) for k in ("python", "numpy"))
    for k in ("isa", "threads", "python", "numpy", "compiler"):
        if be.get(k) != re_.get(k):
            lines.append(f"NOTE: {k} is {re_.get(k)!r} here, {be.get(k)!r} in the baseline")
    if not core_ok:
        lines.append("NOTE: another compiler, kernel set or thread count than the baseline's: counts shown, not gated")
    elif not total_ok:
        lines.append("NOTE: another Python or NumPy than the baseline's: only the core's counts are gated")
    lines.append(f"{'region':<20}{'part':<7}{'baseline':>14}{'now':>14}{'change':>9}")
    for name, reg in run["regions"].items():
        b = base.get("regions", {}).get(name)
        for part in ("total", "core"):
            now = reg[part]
            if not b or not b.get(part):
                lines.append(f"{name:<20}{part:<7}{'-':>14}{now:>14,}{'new':>9}")
                continue
            ch = now / b[part] - 1
            gated = core_ok if part == "core" else total_ok
            # The core's count gates both ways: a fall past the margin is as unexplained as a
            # rise. GCC 12 deleted every call to the prefetch-only helpers without a word (until
            # 3bca3d5); with no prefetch at all, the streamed decodes' core counts fall 38% and
            # the causal prefill's 3.2%. The total may fall (a faster Python layer). Compared in
            # integers, so that a move of exactly the margin passes ("more than" the margin fails).
            grew = now - b[part] > margin * b[part]
            fell = part == "core" and b[part] - now > margin * b[part]
            bad = gated and (grew or fell)
            mark = "  FAIL" if bad else ("" if gated else "  (not gated)")
            lines.append(f"{name:<20}{part:<7}{b[part]:>14,}{now:>14,}{ch:>+8.2%}{mark}")
            if bad:
                fails.append(
                    f"{name} {part}: {b[part]:,} -> {now:,} instructions per call "
                    f"({ch:+.2%}, {'over' if grew else 'under'} the {margin:.0%} margin)"
                )
    # a region of the baseline that this run did not count (renamed or dropped from REGIONS):
    # the largest fall there is, so it fails until the baseline is updated
    for name in base.get("regions", {}):
        if name not in run["regions"]:
            lines.append(f"{name:<20}{'':<7}{'':>14}{'-':>14}{'missing':>9}  FAIL")
            fails.append(f"{name}: in the baseline, not counted by this run")
    return lines, fails


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", type=Path, default=BASELINE)
    ap.add_argument(
        "--margin", type=float, default=None, help=f"allowed change (default: the baseline's, else {MARGIN})"
    )
    ap.add_argument("--repeat", type=int, default=1, help="count N times; fail if the runs disagree")
    ap.add_argument("--update", action="store_true", help="write the counts as the new baseline")
    ap.add_argument("--json", type=Path, help="also write this run's counts here")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated regions, to look into one: printed, not gated (a region's count depends "
        "a little on what ran before it in the process: small_call alone counts ~9%% more)",
    )
    ap.add_argument(
        "--commit",
        default=None,
        help="--update: the commit the counted pyattn was built from (default: this repository's HEAD)",
    )
    args = ap.parse_args(argv)

    if not shutil.which("valgrind"):
        print("NOTE: valgrind is not installed; the instruction-count gate did not run")
        return 0
    with tempfile.TemporaryDirectory(prefix="pyattn-icount-") as tmp:
        work = Path(tmp)
        helper = build_helper(work)
        if helper is None:
            return 0
        runs = [count_once(work, helper, args.only) for _ in range(max(1, args.repeat))]
    run = runs[0]
    print(
        f"pyattn under callgrind: isa {run['isa']}, {run['threads']} thread(s), Python {run['python']}, "
        f"NumPy {run['numpy']}, {run['compiler']}"
    )
    if run["isa"] != "avx2" or run["threads"] != 1:
        print(f"error: expected the avx2 kernels on 1 thread under valgrind, got {run['isa']} / {run['threads']}")
        return 1
    rc = 0
    if len(runs) > 1:
        for other in runs[1:]:
            for name, reg in run["regions"].items():
                o = other["regions"][name]
                if (o["total"], o["core"]) != (reg["total"], reg["core"]):
                    print(
                        f"error: {name} counted {reg['total']:,} / {reg['core']:,} (total / core), then "
                        f"{o['total']:,} / {o['core']:,}: the counts are not deterministic"
                    )
                    rc = 1
        if not rc:
            print(f"{len(runs)} runs: identical counts in every region")
    if args.json:
        args.json.write_text(json.dumps(run, indent=2) + "\n")
    if args.only:
        for name, reg in run["regions"].items():
            print(f"{name:<20}total {reg['total']:>14,}  core {reg['core']:>14,}  ({reg['what']})")
        print("NOTE: --only: a partial run, not compared with the baseline")
        return rc
    if args.update:
        empty = [n for n, r in run["regions"].items() if not (r["total"] and r["core"])]
        if empty:  # a count of 0 is never gated (it reads as "new"): a broken parse, not a baseline
            print(f"error: no instructions counted in {empty}; the baseline was not written")
            return 1
        old = json.loads(args.baseline.read_text()) if args.baseline.exists() else {}
        margin = args.margin if args.margin is not None else old.get("margin", MARGIN)
        new = {
            "comment": "python tools/icount.py --update; per-call instruction counts under callgrind "
            "(PYATTN_ISA=avx2, 1 thread). Update deliberately, saying why in the commit.",
            "margin": margin,
            "env": env_of(run),
            "commit": args.commit or _git("rev-parse", "HEAD"),
            "regions": run["regions"],
        }
        args.baseline.write_text(json.dumps(new, indent=2) + "\n")
        for name, reg in run["regions"].items():
            print(f"{name:<20}total {reg['total']:>14,}  core {reg['core']:>14,}  ({reg['what']})")
        print(f"wrote {args.baseline}")
        return rc
    if not args.baseline.exists():
        print(f"error: no baseline at {args.baseline} (create it with --update)")
        return 1
    base = json.loads(args.baseline.read_text())
    margin = args.margin if args.margin is not None else base.get("margin", MARGIN)
    lines, fails = gate(run, base, margin)
    print("\n".join(lines))
    if fails:
        print(f"FAIL: instruction counts moved past the {margin:.0%} margin of {args.baseline.name}:")
        for f in fails:
            print("  " + f)
        print(
            "A rise past the margin, or the core's count falling past it (work the compiler may have dropped: "
            "check the disassembly), needs a look. If the change is intended, run `python tools/icount.py "
            "--update` and commit the baseline with the reason."
        )
        return 1
    print(f"ok: every gated count within {margin:.0%} of {args.baseline.name}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
