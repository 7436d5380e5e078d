#!/usr/bin/env bash
# Build pyattn._core with AddressSanitizer + UBSan and run the test suite against it.
#   bash tools/sanitize.sh [pytest args...]     (default: the whole tests/ directory)
# Uses the current Python environment (needs numpy, pybind11, cmake, ninja, pytest, hypothesis).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${PYATTN_SANITIZE_DIR:-/tmp/pyattn-asan}
rm -rf "$work/pkg"
mkdir -p "$work/build" "$work/pkg"
cmake -S "$repo" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPYATTN_SANITIZE=ON \
  -DPython_EXECUTABLE="$(command -v python)" \
  -Dpybind11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')" >/dev/null
cmake --build "$work/build"
cp -r "$repo/pyattn" "$work/pkg/"
cp "$work/build"/_core*.so "$work/pkg/pyattn/"
# An editable install of pyattn redirects imports to its own build ahead of PYTHONPATH; drop
# that redirection so this directory's pyattn, with the sanitized core, is the one imported.
cat > "$work/pkg/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
PY
asan=$(g++ -print-file-name=libasan.so)
ubsan=$(g++ -print-file-name=libubsan.so)
cd "$work/pkg"
# Python itself is not instrumented: leaks from the interpreter are not ours to report.
export LD_PRELOAD="$asan:$ubsan" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 PYTHONPATH="$work/pkg"
python -c "import pyattn._api as a; f = a._core.__file__; \
assert f.startswith('$work/pkg/'), f'imported {f}, not the sanitized build'; print('core:', f)"
python -m pytest -q -p no:cacheprovider "${@:-$repo/tests}"
