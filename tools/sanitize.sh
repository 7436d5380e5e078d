#!/usr/bin/env bash
# Build pyattn._core with AddressSanitizer + UBSan and run the test suite against it.
#   bash tools/sanitize.sh [pytest args...]     (default: the whole tests/ directory)
# Uses the current Python environment (needs numpy, pybind11, cmake, ninja, pytest, hypothesis).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${PYATTN_SANITIZE_DIR:-/tmp/pyattn-asan}
. "$repo/tools/core_package.sh"
build_core_package "$work" sanitized -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYATTN_SANITIZE=ON
asan=$(g++ -print-file-name=libasan.so)
ubsan=$(g++ -print-file-name=libubsan.so)
cd "$work/pkg"
# Python itself is not instrumented: leaks from the interpreter are not ours to report.
export LD_PRELOAD="$asan:$ubsan" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH="$work/pkg"
check_core "$work" sanitized
python -m pytest -q -p no:cacheprovider "${@:-$repo/tests}"
