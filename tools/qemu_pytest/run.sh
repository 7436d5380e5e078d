#!/usr/bin/env bash
# Run pyattn's Python test suite on AArch64 under qemu-user, against a private Debian 12 arm64
# sysroot (nothing arm64 is installed into the host: no dpkg --add-architecture).
#   bash tools/qemu_pytest/run.sh [--fresh] [--no-tests] [--files "test_a.py test_b.py"] [--modes "neon generic"]
# Needs cmake, g++-aarch64-linux-gnu, qemu-user, dpkg-deb, curl, xz, and the network to a Debian
# mirror and PyPI (the arm64 packages and the test dependencies are downloaded, ~100 MiB). Slow:
# the whole suite takes hours under qemu; pass --files for a subset (docs/performance.md, AArch64).
# Stages (each skipped when its output exists, unless --fresh):
#   1. sysroot: arm64 .debs resolved from the mirror's Packages index (fetch_sysroot.py), dpkg-deb -x
#   2. pylib:   pytest + deps (pure wheels, host pip --target), hypothesis + ml_dtypes aarch64 wheels
#   3. build:   repo's CMakeLists.txt cross-compiled with aarch64-linux-gnu-g++ -> _core (aarch64)
#   4. tests:   each file, once with PYATTN_ISA unset (dispatch picks neon) and once with
#               PYATTN_ISA=generic; logs + junit xml under $W/logs, a summary in $W/logs/summary.txt
# Extra env: PYATTN_QEMU_SLICE=a:b:c (run items[a:b:c]), PYATTN_QEMU_TAG (log name suffix), PYATTN_QEMU_PYTEST_ARGS,
# PER_FILE_TIMEOUT (s).
# Note: the parity tests' `isa` fixture runs every available set (generic AND neon) in both modes;
# the mode changes the default dispatch only (the tests without the fixture).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)   # fetch_sysroot.py, summarize.py live beside this script
W=${W:-${TMPDIR:-/tmp}/pyattn-qemu}     # everything it makes: sysroot, clone, build, logs
SRC=${SRC:-$(cd "$HERE/../.." && pwd)}   # the checkout to test (cloned: its committed state)
HOSTPY=${HOSTPY:-python3}               # a host Python with pip and pybind11
MIRROR=http://deb.debian.org/debian
fresh=0; run_tests=1
FILES="test_seeds.py test_parity.py test_variants.py test_kvcache.py test_matmul_softmax.py test_mha.py test_errors.py test_properties.py test_config.py test_core_boundary.py test_defects.py test_kvcache_edges.py test_reference.py test_robustness.py test_small_calls.py test_reentrancy.py test_threadpool.py test_guard_page.py test_examples.py test_icount_gate.py"
MODES="neon generic"
PER_FILE_TIMEOUT=${PER_FILE_TIMEOUT:-1500}
while [ $# -gt 0 ]; do
  case "$1" in
    --fresh) fresh=1 ;;
    --no-tests) run_tests=0 ;;
    --files) FILES=$2; shift ;;
    --modes) MODES=$2; shift ;;
    *) echo "bad arg $1" >&2; exit 2 ;;
  esac; shift
done
R=$W/root
mkdir -p "$W"
if [ $fresh = 1 ]; then rm -rf "$W/repo" "$R" "$W/pylib" "$W/wheels" "$W/build-a64" "$W/pkg" "$W/logs"; fi
for t in aarch64-linux-gnu-g++ qemu-aarch64 cmake dpkg-deb curl xz; do command -v $t >/dev/null || { echo "need $t" >&2; exit 3; }; done

# 0. a private clone of the repo
[ -d "$W/repo/.git" ] || git clone -q "$SRC" "$W/repo"
echo "repo at $(git -C "$W/repo" rev-parse --short HEAD)"

# 1. the arm64 sysroot
if [ ! -x "$R/usr/bin/python3.11" ] || [ ! -d "$R/usr/lib/python3/dist-packages/numpy" ]; then
  curl -sS -o "$W/Packages.xz" $MIRROR/dists/bookworm/main/binary-arm64/Packages.xz
  xz -dc "$W/Packages.xz" > "$W/Packages"
  python3 "$HERE/fetch_sysroot.py" "$W/Packages" "$W/debs" "$R"
  # update-alternatives never ran: the BLAS/LAPACK links numpy loads by soname
  ln -sf blas/libblas.so.3 "$R/usr/lib/aarch64-linux-gnu/libblas.so.3"
  ln -sf lapack/liblapack.so.3 "$R/usr/lib/aarch64-linux-gnu/liblapack.so.3"
fi
# The interpreter as one executable (tests start sys.executable in subprocesses; there is no
# binfmt_misc entry for aarch64 here): a host sh script that execs qemu with argv[0] set to itself.
mkdir -p "$W/bin"
cat > "$W/bin/python3.11" <<'WRAP'
#!/bin/sh
R=${PYATTN_QEMU_ROOT:?}
export PYTHONHOME=${PYTHONHOME:-$R/usr}
exec qemu-aarch64 -L "$R" -0 "$0" "$R/usr/bin/python3.11" "$@"
WRAP
chmod +x "$W/bin/python3.11"
export PYATTN_QEMU_ROOT=$R
PY=("$W/bin/python3.11")

# 2. test dependencies: pure wheels with the host pip; hypothesis (has a compiled _native) and
#    ml_dtypes (0.5.1: the last line that takes NumPy 1.x; 0.7 needs numpy>=2) as aarch64 wheels
if [ ! -d "$W/pylib/ml_dtypes" ]; then
  rm -rf "$W/pylib" "$W/wheels"; mkdir -p "$W/wheels"
  "$HOSTPY" -m pip install -q --target "$W/pylib" --no-compile pytest hypothesis threadpoolctl
  rm -rf "$W/pylib/hypothesis" "$W"/pylib/hypothesis-*.dist-info "$W"/pylib/_hypothesis_* "$W/pylib/bin"
  plat=(--platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux_2_28_aarch64
        --python-version 3.11 --implementation cp --abi cp311 --only-binary=:all: --no-deps)
  "$HOSTPY" -m pip download -q -d "$W/wheels" "${plat[@]}" hypothesis
  "$HOSTPY" -m pip download -q -d "$W/wheels" "${plat[@]}" "ml_dtypes==0.5.1" || echo "ml_dtypes: no wheel (bfloat16 tests will skip)"
  for whl in "$W"/wheels/*.whl; do (cd "$W/pylib" && python3 -m zipfile -e "$whl" .); done
  # nothing compiled for x86 may be left in
  if find "$W/pylib" -name '*.so*' -exec file {} + | grep -v aarch64 | grep ELF; then echo "x86 binary in pylib" >&2; exit 4; fi
fi

# 3. the extension, cross-compiled with the repo's CMakeLists.txt
if [ ! -f "$W/pkg/pyattn/_core.cpython-311-aarch64-linux-gnu.so" ]; then
  PB=$("$HOSTPY" -c "import pybind11; print(pybind11.get_cmake_dir())")
  # Python found is the host's (for the Interpreter component; the SOABI it gives is x86_64's, so
  # the module is renamed below); the headers are the sysroot's (pyconfig.h via the multiarch dir).
  nice -n 19 cmake -S "$W/repo" -B "$W/build-a64" -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
    -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -Dpybind11_DIR="$PB" \
    -DPython_EXECUTABLE="$HOSTPY" -DPython_INCLUDE_DIR="$R/usr/include/python3.11" \
    -DCMAKE_CXX_FLAGS="-isystem $R/usr/include" >/dev/null
  nice -n 19 cmake --build "$W/build-a64" -j "$(nproc)"
  so=$(ls "$W"/build-a64/_core*.so)
  file "$so" | grep -q aarch64 || { echo "not an aarch64 module: $so" >&2; exit 5; }
  rm -rf "$W/pkg"; mkdir -p "$W/pkg"; cp -r "$W/repo/pyattn" "$W/pkg/"
  cp "$so" "$W/pkg/pyattn/_core.cpython-311-aarch64-linux-gnu.so"
fi
export PYTHONPATH=$W/pkg:$W/pylib:$HERE
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$W/work" "$W/logs"; cd "$W/work"
env -u PYATTN_ISA "${PY[@]}" -c "import pyattn, numpy; print(pyattn.__file__, numpy.__version__); pyattn.show_config()"
test "$(env -u PYATTN_ISA "${PY[@]}" -c 'import pyattn; print(pyattn._core.__file__)')" = "$W/pkg/pyattn/_core.cpython-311-aarch64-linux-gnu.so"
[ $run_tests = 1 ] || exit 0

# 4. the tests
for mode in $MODES; do
  for f in $FILES; do
    # PYATTN_QEMU_SLICE=a:b:c (qemu_isa_filter.py) runs items[a:b:c] only; PYATTN_QEMU_TAG names such a run
    tag=${f%.py}${PYATTN_QEMU_TAG:+.$PYATTN_QEMU_TAG}
    log=$W/logs/$mode.$tag.log
    echo "== $(date -u +%T) $mode $f"
    set +e
    # neon: everything. generic: only the tests that do not take the `isa` fixture (that fixture
    # runs both sets in-process, identically in both passes; see qemu_isa_filter.py).
    if [ $mode = neon ]; then envset=(env -u PYATTN_ISA PYATTN_QEMU_DROP_ISA_PARAM=0)
    else envset=(env PYATTN_ISA=$mode PYATTN_QEMU_DROP_ISA_PARAM=${PYATTN_QEMU_DROP_ISA_PARAM:-1}); fi
    "${envset[@]}" nice -n 19 timeout "$PER_FILE_TIMEOUT" "${PY[@]}" -m pytest -p no:cacheprovider -p qemu_isa_filter --import-mode=append \
      -q -rfEs --tb=short ${PYATTN_QEMU_PYTEST_ARGS:-} --junitxml="$W/logs/$mode.$tag.xml" "$W/repo/tests/$f" >"$log" 2>&1
    rc=$?
    set -e
    echo "rc=$rc $(tail -1 "$log")"
  done
done
python3 "$HERE/summarize.py" "$W/logs" | tee "$W/logs/summary.txt"
