#!/usr/bin/env bash
# Throughput of the NEON kernel set's inner loops as llvm-mca models them, for cores this project
# cannot time (no AArch64 machine here): the 8 x 12 sgemm micro-kernel's k loop, and the two k
# loops of the attention tile (the scores S^T = K Q^T, which read K rows in place, and P V, which
# reads V^T), each as the compiler emits it for AArch64 from csrc/kernels/neon/neon_ops.h; then
# the whole attention tile of 8 keys x 12 queries for head sizes 64 and 128, the fused exp2
# epilogue included (its loop modelled the same way).
#   bash tools/mca_neon.sh [cpu ...]        default: neoverse-v1 neoverse-n2 apple-m1
# A small probe translation unit instantiates the register tile with the strides each caller
# passes (so the compiler folds them as it does in the kernels) and is compiled to assembly; the
# loop with the most fmla of each probe function is cut out and given to llvm-mca. The port
# limit is llvm-mca's own figure for a block of independent fmla on the same model, so the
# percentage compares like with like. Environment: CXX (default aarch64-linux-gnu-g++; a clang
# works with CXX="clang++ --target=aarch64-linux-gnu"), MCA (default: the newest llvm-mca found;
# LLVM 17 or later has the Neoverse V1 and N2 models).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cpus=("$@")
[ ${#cpus[@]} -gt 0 ] || cpus=(neoverse-v1 neoverse-n2 apple-m1)
CXX=${CXX:-aarch64-linux-gnu-g++}
if [ -z "${MCA:-}" ]; then
  for m in llvm-mca-22 llvm-mca-21 llvm-mca-20 llvm-mca-19 llvm-mca-18 llvm-mca-17 llvm-mca; do
    if command -v $m >/dev/null; then MCA=$m; break; fi
  done
fi
command -v "${MCA:-}" >/dev/null || { echo "no llvm-mca (Debian: apt-get install llvm-19)" >&2; exit 3; }
command -v ${CXX%% *} >/dev/null || { echo "no $CXX (Debian: apt-get install g++-aarch64-linux-gnu)" >&2; exit 3; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cat >"$work/probe.cpp" <<'CPP'
#include <arm_neon.h>

#include <utility>

#include "kernels/std_includes.h"

namespace pyattn {
namespace neon {
#include "frame/common.h"
#include "kernels/neon/neon_ops.h"
#include "kernels/x86_simd.h"
}  // namespace neon
}  // namespace pyattn

using pyattn::index_t;
using Ops = pyattn::neon::OpsF32;

template <class Acc>
static inline void put(float* c, Acc& acc) {
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) Ops::store(c + r * 12 + v * 4, acc[r][v]);
}
// GEMM: packed A panel (rsa 1, csa MR = 8) times a packed B panel (rows NR = 12 apart).
extern "C" void probe_sgemm(index_t k, const float* a, const float* b, float* c) {
  pyattn::neon::gemm_regtile<Ops, 3, 8>(k, a, 1, 8, b, 12, [&](auto& acc) { put(c, acc); });
}
// Attention scores: 8 K rows read in place (k_rs apart, unit stride) times the Q^T panel.
extern "C" void probe_scores(index_t E, const float* k, index_t k_rs, const float* qt, float* st) {
  pyattn::neon::gemm_regtile<Ops, 3, 8>(E, k, k_rs, 1, qt, 12, [&](auto& acc) { put(st, acc); });
}
// Attention P V: 8 value columns of V^T (unit stride across them, v_rs along the keys) times P^T.
extern "C" void probe_pv(index_t kb, const float* v, index_t v_rs, const float* pt, float* acc) {
  pyattn::neon::gemm_regtile<Ops, 3, 8>(kb, v, 1, v_rs, pt, 12, [&](auto& a) { put(acc, a); });
}
// The fused epilogue of the score tile (gemm_ukernel_exp2 without softcap or ALiBi), a whole tile
// of 8 rows x 3 vectors an iteration: x = s - m; column max; P = exp2(x) stored; column sum.
extern "C" void probe_exp2(float* c, index_t n, const float* sub, float* xmax, float* csum) {
  using V = Ops::V;
  V nsub[3], mx[3], sm[3];
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v)
    nsub[v] = Ops::sub(Ops::zero(), Ops::load(sub + 4 * v)), mx[v] = Ops::load(xmax + 4 * v),
    sm[v] = Ops::load(csum + 4 * v);
  for (index_t i = 0; i < n; i += 96) {
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r)
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) {
        float* p = c + i + 12 * r + 4 * v;
        const V x = Ops::add(Ops::load(p), nsub[v]);
        mx[v] = Ops::max(mx[v], x);
        const V e = Ops::exp2(x);
        sm[v] = Ops::add(sm[v], e);
        Ops::store(p, e);
      }
  }
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) Ops::store(xmax + 4 * v, mx[v]), Ops::store(csum + 4 * v, sm[v]);
}
CPP

# The probe calls no OpenMP, but the frame's headers declare its API: a compiler without an omp.h
# for the target (a plain clang) takes this one, searched last.
mkdir -p "$work/fallback"
printf 'extern "C" int omp_get_thread_num(void);\nextern "C" int omp_get_num_threads(void);\n' >"$work/fallback/omp.h"
# shellcheck disable=SC2086
$CXX -std=c++17 -O3 -fno-math-errno -fno-trapping-math -I"$repo/csrc" -idirafter "$work/fallback" -S "$work/probe.cpp" \
  -o "$work/probe.s"

# Cut the loop with the most fmla out of each probe function: a label and the last branch back to
# it; directives and labels dropped.
python3 - "$work" <<'PY'
import re, sys
work = sys.argv[1]
lines = open(f"{work}/probe.s").read().splitlines()
funcs, cur = {}, None
for ln in lines:
    m = re.match(r"^(_?probe_\w+):", ln)
    if m:
        cur = m.group(1).lstrip("_")
        funcs[cur] = []
    elif cur and re.match(r"^\s*\.size\s", ln):
        cur = None
    elif cur:
        funcs[cur].append(ln)
for name, body in funcs.items():
    labels = {}
    best = None
    for i, ln in enumerate(body):
        m = re.match(r"^(\.?L\w+):", ln)
        if m:
            labels[m.group(1)] = i
            continue
        m = re.match(r"^\s*(b\.\w+|b\w\w|cbn?z|tbn?z)\s.*?(\.?L\w+)\s*$", ln)
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            loop = [x.strip() for x in body[labels[m.group(2)] + 1 : i + 1]]
            loop = [x for x in loop if x and not x.startswith((".", "//", "#")) and not re.match(r"^\.?L\w+:", x)]
            n = sum(1 for x in loop if x.startswith("fmla"))
            if best is None or n > best[0]:
                best = (n, loop)
    if best is None:
        sys.exit(f"no loop found in {name}")
    open(f"{work}/{name}.s", "w").write("\n".join(best[1]) + "\n")
# The port limit: independent fmla by element, more than any core's latency x pipes in flight.
open(f"{work}/peak.s", "w").write(
    "\n".join(f"fmla v{i}.4s, v{24 + i % 4}.4s, v{28 + i % 4}.s[{i % 4}]" for i in range(24)) + "\n"
)
PY

cycles() {  # cycles per iteration of a block under llvm-mca for cpu $1
  "$MCA" -mtriple=aarch64 -mcpu="$1" -iterations=200 "$2" 2>/dev/null |
    awk '/^Iterations:/ { it = $2 } /^Total Cycles:/ { c = $3 } END { printf "%.3f", c / it }'
}
echo "llvm-mca: $("$MCA" --version | sed -n 's/.*LLVM version \([0-9.]*\).*/\1/p'), compiler: $($CXX --version | head -1)"
printf '%-12s %-8s %6s %9s %9s %11s %8s\n' cpu loop fmla cyc/iter FMA/cyc port-limit "% limit"
tile=()
for cpu in "${cpus[@]}"; do
  peak=$(awk -v c="$(cycles "$cpu" "$work/peak.s")" 'BEGIN { printf "%.2f", 24 / c }')
  for loop in sgemm scores pv; do
    n=$(grep -c '^fmla' "$work/probe_$loop.s")
    c=$(cycles "$cpu" "$work/probe_$loop.s")
    awk -v cpu="$cpu" -v l="$loop" -v n="$n" -v c="$c" -v p="$peak" \
      'BEGIN { printf "%-12s %-8s %6d %9.2f %9.2f %11.2f %7.1f%%\n", cpu, l, n, c, n / c, p, 100 * n / c / p }'
    eval "c_$loop=\$(awk -v n=$n -v c=$c 'BEGIN { print c / n }')"
  done
  # The attention tile of 8 keys x 12 queries: 24 E fmla for the scores, 24 Ev for P V (E = Ev =
  # D), and the fused exp2 epilogue on its 24 score vectors (an iteration of probe_exp2).
  c_exp2=$(awk -v c="$(cycles "$cpu" "$work/probe_exp2.s")" 'BEGIN { print c / 24 }')
  for d in 64 128; do
    tile+=("$(awk -v cpu="$cpu" -v d=$d -v cs="$c_scores" -v cp="$c_pv" -v ce="$c_exp2" -v p="$peak" 'BEGIN {
      t = 24 * d * cs + 24 * d * cp + 24 * ce
      printf "%-12s D=%-4d %10.2f %10.0f %9.1f%%", cpu, d, ce, t, 100 * (48 * d / p) / t }')")
  done
done
printf '\n%-12s %-6s %10s %10s %10s\n' cpu head exp2/vec tile-cyc "% limit"
printf '%s\n' "${tile[@]}"
if [ -n "${MCA_SHOW:-}" ]; then
  for loop in sgemm scores pv exp2; do
    printf '\n--- the %s loop\n' "$loop"
    cat "$work/probe_$loop.s"
  done
fi
