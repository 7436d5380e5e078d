# Sourced by .ci/run (shares begin/end, $py, $venv, $repo, $work). The NEON kernel set, which no
# CI machine runs natively: the C++ kernel test (tests/cpp/test_kernels.cpp) cross-compiled for
# AArch64 with the frame, the neon and the generic sets linked in, and run under qemu-user
# against its double-precision reference; the dispatch's choice is checked too (neon by itself,
# generic under PYATTN_ISA). tools/cross_aarch64.sh does it; the cross compiler and qemu come from
# Debian's packages when missing. Where they cannot be installed the phase says NOTE and skips.
begin "aarch64: NEON kernels under qemu"
aarch64_need=()
command -v aarch64-linux-gnu-g++ >/dev/null || aarch64_need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || aarch64_need+=(qemu-user)
if [ ${#aarch64_need[@]} -gt 0 ]; then
  echo "installing ${aarch64_need[*]}"
  if ! { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null &&
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${aarch64_need[@]}" >/dev/null; }; then
    echo "NOTE: could not install ${aarch64_need[*]}"
  fi
fi
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then
  # cmake from the CI venv (the sanitizer phase installs it), else from PyPI into it.
  [ -x "$venv/bin/cmake" ] || "$py" -m pip install --quiet "cmake>=3.18"
  PATH="$venv/bin:$PATH" bash "$repo/tools/cross_aarch64.sh" --build-dir "$work/cpp-aarch64"
else
  echo "NOTE: no AArch64 cross compiler or qemu-aarch64: the NEON kernel test is skipped"
fi
end
