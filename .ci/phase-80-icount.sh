# Sourced by .ci/run (shares begin/end, $py, $venv, $repo, $work). The instruction-count gate
# (tools/icount.py): a prefill tile loop, a causal prefill, a decode step, two decode steps over
# streamed (prefetched) contiguous and paged caches, a GEMM block and a small call's Python path
# run under valgrind's callgrind on the installed pyattn (AVX2 kernels, one thread: the same
# counts on Zen 3 and Zen 5), and the phase fails when a count per call grows more than the
# baseline's margin (2%) over benches/icount_baseline.json, or the core's count falls more than
# that under it (work the compiler deleted, as GCC did the prefetches). Counted twice: the two
# runs must agree to the instruction. Wall time cannot gate on these shared machines; instruction
# counts can. About two minutes on the 2-core VM (each counted run ~40 s of CPU).
# A deliberate change of the counts is a commit of `python tools/icount.py --update` with its
# reason (README, "Tracking speed over time").

begin "instruction-count gate (callgrind)"
if ! command -v valgrind >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "valgrind is missing: installing it with apt-get"
    if ! { apt-get install -y -qq valgrind >/dev/null 2>&1 ||
           { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq valgrind >/dev/null 2>&1; }; }; then
      echo "NOTE: apt-get could not install valgrind"
    fi
  fi
fi
if command -v valgrind >/dev/null 2>&1; then
  valgrind --version
  "$py" "$repo/tools/icount.py" --repeat 2
else
  echo "NOTE: valgrind is not installed and could not be (needs root and apt-get):" \
    "the instruction-count gate was SKIPPED"
fi
end
