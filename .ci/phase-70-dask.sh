# Sourced by .ci/run (shares begin/end, $py, $venv, $repo, $work; the current directory is $work).
# pyattn.dask (issue 13) against the installed package: the dask extra's requirements (read from
# pyproject.toml, so the phase installs what `pip install "pyattn[dask]"` would) into $venv, then
# tests/test_dask.py on a real distributed.LocalCluster (2 worker processes x 1 thread; a worker
# is killed and restarted in one test), the long-context example's quick mode (64K keys in 8
# chunks, checked against the single-process call) and the Dask bench's smoke. The main test
# phase ran before Dask was installed, so there these tests skipped: here they must not.

begin "dask: extra, tests on a LocalCluster, example --quick, bench smoke"
dask_reqs=$("$py" -c 'import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"].get("dask", [])))' "$repo/pyproject.toml")
if [ -z "$dask_reqs" ]; then
  echo "NOTE: pyproject.toml has no dask extra; installing dask[array,distributed] directly"
  dask_reqs="dask[array,distributed]"
fi
echo "the dask extra: $(echo "$dask_reqs" | tr '\n' ' ')"
echo "$dask_reqs" | xargs "$py" -m pip install --quiet
"$py" -c 'import dask, distributed, pyattn.dask; print("dask", dask.__version__, "distributed", distributed.__version__)'
# Each step under a timeout: a cluster that never comes up (once seen here, not reproduced) then
# fails the phase in minutes instead of holding CI.
timeout 900 "$py" -m pytest "$repo/tests/test_dask.py" -q -p no:cacheprovider --import-mode=append -rs 2>&1 | tee "$work/dask-tests.log"
if grep -qE "[0-9]+ skipped" "$work/dask-tests.log"; then
  echo "ERROR: Dask tests skipped with Dask installed"
  exit 1
fi
timeout 600 "$py" "$repo/examples/dask_long_context.py" --quick
timeout 600 "$py" -m pytest "$repo/benches/bench_dask.py" -q -p no:cacheprovider --import-mode=append --benchmark-disable
end
