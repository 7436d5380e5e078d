#!/usr/bin/env bash
# The C++ kernel test (tests/cpp/test_kernels.cpp) cross-compiled for AArch64 and run under
# qemu-user: the neon and generic kernel sets against the test's double-precision reference, and
# the dispatch's own choice (neon, or generic when PYATTN_ISA forces it). With --native, the same
# test built for this machine instead (avx512 / avx2 / generic on x86), which checks the test.
#   bash tools/cross_aarch64.sh [--native] [--quick] [--build-dir DIR]
# Needs cmake, g++-aarch64-linux-gnu and qemu-user (Debian: apt-get install g++-aarch64-linux-gnu
# qemu-user); the native build needs only cmake and g++.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
native=0
args=()
build=""
while [ $# -gt 0 ]; do
  case "$1" in
    --native) native=1 ;;
    --quick) args+=(--quick) ;;
    --build-dir) build=$2; shift ;;
    *) echo "usage: bash tools/cross_aarch64.sh [--native] [--quick] [--build-dir DIR]" >&2; exit 2 ;;
  esac
  shift
done
jobs=$(nproc 2>/dev/null || echo 2)

if [ $native = 1 ]; then
  build=${build:-$repo/build/cpp-native}
  cmake -S "$repo/tests/cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build "$build" -j "$jobs"
  run=("$build/test_kernels")
  # The dispatch: whatever this CPU's best set is (printed), generic when PYATTN_ISA asks for it.
  env -u PYATTN_ISA "${run[@]}" --dispatch-only
  PYATTN_ISA=generic "${run[@]}" --expect-default generic --dispatch-only
else
  for tool in aarch64-linux-gnu-g++ qemu-aarch64; do
    command -v $tool >/dev/null || { echo "$tool not found (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2; exit 3; }
  done
  build=${build:-$repo/build/cpp-aarch64}
  cmake -S "$repo/tests/cpp" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
    -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ >/dev/null
  cmake --build "$build" -j "$jobs"
  file "$build/test_kernels" 2>/dev/null || true
  run=(qemu-aarch64 -L /usr/aarch64-linux-gnu "$build/test_kernels")
  # The dispatch: neon by itself on any AArch64 CPU, generic when PYATTN_ISA asks for it.
  env -u PYATTN_ISA "${run[@]}" --expect-default neon --dispatch-only
  PYATTN_ISA=generic "${run[@]}" --expect-default generic --dispatch-only
fi
# Two OpenMP threads at most, whatever the machine: the test asks for one or two per call. A
# kernel that never returns fails here after 15 minutes (the whole run takes about one under
# qemu), not at CI's limit.
OMP_NUM_THREADS=2 timeout 900 "${run[@]}" ${args[@]+"${args[@]}"}
