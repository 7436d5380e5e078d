#!/usr/bin/env bash
# Where attention's time goes, by phase: builds pyattn._core with the attention phases kept out
# of line (-DPYATTN_PROFILE=ON: scores, online_softmax, accumulate, ... stay functions of their
# own, the GEMM micro-kernels still inlined into them), runs one shape for a few seconds under
# `perf record` and prints the share of samples per function.
#   bash tools/profile.sh B H Lq Lk E [causal 0|1] [threads] [seconds]
#   bash tools/profile.sh 1 32 1024 1024 128 1 2        # causal B1 H32 L1024 D128, 2 threads
# PYATTN_PROFILE_KW adds keywords to the call, as a Python dict over H (the heads), e.g.
#   PYATTN_PROFILE_KW='dict(softcap=50.0, alibi_slopes=2.0 ** (-8 * np.arange(1, H + 1) / H))'
# Needs perf (sampling works in VMs without hardware counters: it falls back to cpu-clock).
# Uses the current Python environment (numpy, pybind11, cmake, ninja).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${PYATTN_PROFILE_DIR:-/tmp/pyattn-profile}
B=${1:-1} H=${2:-8} LQ=${3:-2048} LK=${4:-2048} E=${5:-64} CAUSAL=${6:-0} THREADS=${7:-2} SECS=${8:-4}
KW=${PYATTN_PROFILE_KW:-dict()}
. "$repo/tools/core_package.sh"
build_core_package "$work" profiling -DCMAKE_BUILD_TYPE=Release -DPYATTN_PROFILE=ON -DCMAKE_STRIP=/bin/true
check_core "$work" profiling
cd "$work/pkg"
cat > run.py <<PY
import time, numpy as np, pyattn
pyattn.set_num_threads($THREADS)
rng = np.random.default_rng(0)
q = rng.standard_normal(($B, $H, $LQ, $E), np.float32)
k = rng.standard_normal(($B, $H, $LK, $E), np.float32)
v = rng.standard_normal(($B, $H, $LK, $E), np.float32)
H = $H
kw = ${KW}
f = lambda: pyattn.scaled_dot_product_attention(q, k, v, is_causal=bool($CAUSAL), **kw)
f(); n = 0; t0 = time.perf_counter()
while time.perf_counter() - t0 < $SECS:
    f(); n += 1
dt = (time.perf_counter() - t0) / n
fl = 4 * $B * $H * $LQ * $LK * $E / (2 if $CAUSAL else 1)
print(f"B$B H$H Lq$LQ Lk$LK E$E causal=$CAUSAL threads=$THREADS: {dt*1e3:.2f} ms/call, {fl/dt/1e9:.0f} GFLOP/s (profiling build)")
PY
OPENBLAS_NUM_THREADS=1 PYTHONPATH="$work/pkg" perf record -q -F 2999 -o "$work/perf.data" -- python run.py 2>/dev/null
perf report -i "$work/perf.data" --stdio --sort symbol --percent-limit 0.5 2>/dev/null \
  | grep -v '^#' | grep -v '^$' | sed -E 's/pyattn::avx512::|pyattn::avx2::|pyattn::generic::|Attention<[a-z0-9_]+> ?::|\(anonymous namespace\)::|\[\.\] //' \
  | cut -c1-110 | head -20
