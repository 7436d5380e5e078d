# Sourced by tools/sanitize.sh and tools/profile.sh: builds pyattn._core with extra CMake options
# into a package directory of its own and checks that Python imports that build.
#   build_core_package WORK WHAT [cmake args...]   ->  $WORK/pkg/pyattn with the new core
# WHAT names the build in messages ("sanitized", "profiling"). Uses the current Python
# environment (numpy, pybind11, cmake, ninja).

build_core_package() {
  local work=$1 what=$2 repo
  shift 2
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  rm -rf "$work/pkg"
  mkdir -p "$work/build" "$work/pkg"
  # Quiet when it works; on a failure, the first errors (or the end of the log) and where the
  # rest is.
  if ! { cmake -S "$repo" -B "$work/build" -G Ninja "$@" \
           -DPython_EXECUTABLE="$(command -v python)" \
           -Dpybind11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')" &&
         cmake --build "$work/build"; } >"$work/build.log" 2>&1; then
    grep -E -m 10 -A 3 'error:|CMake Error' "$work/build.log" >&2 || tail -n 40 "$work/build.log" >&2
    echo "error: the $what build of pyattn._core failed; full log: $work/build.log" >&2
    return 1
  fi
  cp -r "$repo/pyattn" "$work/pkg/"
  cp "$work/build"/_core*.so "$work/pkg/pyattn/"
  # An editable install of pyattn redirects imports to its own build ahead of PYTHONPATH; drop
  # that redirection so this directory's pyattn, with the $what core, is the one imported.
  cat > "$work/pkg/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
PY
}

# Fails unless `python` (with the caller's environment, PYTHONPATH=$WORK/pkg) imports the core
# built by build_core_package.
check_core() {
  local work=$1 what=$2
  PYTHONPATH="$work/pkg" python -c "import pyattn._api as a; f = a._core.__file__; \
assert f.startswith('$work/pkg/'), f'imported {f}, not the $what build'; print('core:', f)"
}
