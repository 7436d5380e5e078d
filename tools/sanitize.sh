#!/usr/bin/env bash
# Build pyattn._core with AddressSanitizer + UBSan (and the core's debug checks,
# PYATTN_DEBUG_CHECKS=1) and run the test suite against it.
#   bash tools/sanitize.sh [pytest args...]
#   bash tools/sanitize.sh                          # the whole tests/ directory
#   bash tools/sanitize.sh -k parity -x             # tests/, with these pytest args
#   bash tools/sanitize.sh tests/test_parity.py -x  # first argument a path: the args as given
# Uses the current Python environment (needs numpy, pybind11, cmake, ninja, pytest, hypothesis).
# Any ASan or UBSan report, in the test process or in any process it starts, fails the run; the
# reports are printed at the end. Tests see PYATTN_SANITIZED=1 (those that need RLIMIT_AS, which
# ASan's shadow memory defeats, skip).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${PYATTN_SANITIZE_DIR:-/tmp/pyattn-asan}

# pytest runs from $work/pkg (so that no source tree's pyattn/, which has no compiled core, is
# on sys.path ahead of the sanitized one), so paths given relative to the caller's directory are
# made absolute first: an argument that names an existing file or directory (a test path may
# carry a node id, tests/test_x.py::test_y; --opt=path too), unless it is the value of -k, -m,
# -p, -o or -W, which are expressions and names.
absolute() {  # absolute PATH[::node id]
  local p=${1%%::*}
  if [[ -d $p ]]; then
    printf '%s%s' "$(cd "$p" && pwd)" "${1:${#p}}"
  else
    printf '%s/%s%s' "$(cd "$(dirname "$p")" && pwd)" "$(basename "$p")" "${1:${#p}}"
  fi
}
args=()
prev=""
for a in "$@"; do
  v=${a#*=}
  if [[ $prev =~ ^-[kmpoW]$ ]]; then
    :
  elif [[ $a == --*=* && -e ${v%%::*} ]]; then
    a="${a%%=*}=$(absolute "$v")"
  elif [[ $a != -* && -e ${a%%::*} ]]; then
    a=$(absolute "$a")
  fi
  args+=("$a")
  prev=$a
done
# The first argument a path: the arguments as given; otherwise tests/ and then the arguments.
if [[ $# -eq 0 || $1 == -* || ! -e ${1%%::*} ]]; then
  args=("$repo/tests" ${args[@]+"${args[@]}"})
fi

# The AVX-512 kernel set only on a CPU that can run it (elsewhere its tests skip): with the
# sanitizers its file took over half of the build's 35 CPU minutes on a 2-core Zen 3, alone on
# one core for the last 13 of the 25 wall-clock minutes. The flags are the ones dispatch.cpp's
# cpu_has_avx512 asks for (the built core cannot be asked: it is what is being built).
avx512=ON
for f in avx512f avx512dq avx512bw avx512vl; do
  grep -qw "$f" /proc/cpuinfo 2>/dev/null || avx512=OFF
done
. "$repo/tools/core_package.sh"
# -O1 -g1: line tables only (the reports' stack traces keep file and line), and the level ASan's
# documentation suggests for usable speed. At -O2 -g the compiler spent most of the build
# optimising and describing instrumented code (the AVX2 file alone: 2.5 CPU minutes at -O1 -g1,
# 6 at -O2 -g1, more with -g); the tests take 1.15x as long (232 s against 201 s).
build_core_package "$work" sanitized -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
  -DPYATTN_SANITIZE=ON -DPYATTN_AVX512=$avx512
asan=$(g++ -print-file-name=libasan.so)
ubsan=$(g++ -print-file-name=libubsan.so)
cd "$work/pkg"
# Every report goes to a file of its own under $reports (one per process), so that a report from
# a subprocess or a forked child fails the run too, even where its test would have tolerated the
# child's exit; the reports are printed at the end. Each one also stops its process at once.
# Python itself is not instrumented: leaks from the interpreter are not ours to report.
# LD_PRELOAD is inherited by subprocesses the tests start (python under ASan again: fine).
reports="$work/reports"
rm -rf "$reports"
mkdir -p "$reports"
export LD_PRELOAD="$asan:$ubsan" PYTHONPATH="$work/pkg" PYATTN_SANITIZED=1 \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$reports/asan" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1:log_path=$reports/ubsan"
rc=0
check_core "$work" sanitized && python -m pytest -q -p no:cacheprovider "${args[@]}" || rc=$?
if compgen -G "$reports/*" >/dev/null; then
  for f in "$reports"/*; do
    printf '\n=== %s\n' "$f"
    cat "$f"
  done >&2
  echo "error: ASan/UBSan reported errors (above; the files are in $reports)" >&2
  exit 1
fi
exit "$rc"
