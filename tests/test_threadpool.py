"""threadpoolctl sees pyattn's OpenMP runtime and its limits reach pyattn's kernels.

Each check runs in a fresh interpreter: pyattn's own thread setting (``set_num_threads``) takes
precedence over OpenMP's once made, and an OpenMP pool, once started, stays, so neither could be
observed cleanly inside a test session that has already run other tests.

Installed from a repaired wheel, the OpenMP runtime is the one vendored next to the package
(auditwheel and delvewheel: ``site-packages/pyattn.libs``; delocate: ``pyattn/.dylibs``), and
that copy must be the one threadpoolctl reports, and the only OpenMP runtime pyattn brings in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

threadpoolctl = pytest.importorskip("threadpoolctl")


def _run(code: str, tmp_path, **env) -> dict:
    """Run `code` in a fresh interpreter outside the source tree; it prints one JSON object."""
    full_env = dict(os.environ)
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,  # not the repository root, whose pyattn/ has no compiled core
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


_INFO = """
    import json, os
    import numpy
    import pyattn
    from threadpoolctl import threadpool_info
    path = lambda p: os.path.normcase(os.path.realpath(p))  # one spelling of each path
    pkg = os.path.dirname(path(pyattn.__file__))
    print(json.dumps({
        "pkg": pkg,
        "core": path(pyattn._core.__file__),
        "openmp": [dict(i, filepath=path(i["filepath"]))
                   for i in threadpool_info() if i["user_api"] == "openmp"],
    }))
"""


def _vendored_dirs(pkg: str) -> list[str]:
    return [
        d for d in (os.path.join(os.path.dirname(pkg), "pyattn.libs"), os.path.join(pkg, ".dylibs")) if os.path.isdir(d)
    ]


def test_one_openmp_runtime_and_threadpoolctl_finds_it(tmp_path):
    info = _run(_INFO, tmp_path)
    libs = info["openmp"]
    # NumPy's BLAS is not an OpenMP one in the wheels pyattn is tested with, so every OpenMP
    # runtime in this process came with pyattn: exactly one, or two would each run a pool.
    assert len(libs) == 1, libs
    assert libs[0]["num_threads"] >= 1
    vendored = _vendored_dirs(info["pkg"])
    if vendored:  # a repaired wheel: the runtime must be the vendored copy, not the system's
        assert any(libs[0]["filepath"].startswith(d + os.sep) for d in vendored), (libs, vendored)


def test_vendored_runtime_when_installed_from_a_repaired_wheel(tmp_path):
    """The wheel phase of CI (.ci/phase-50-wheel.sh) sets PYATTN_EXPECT_VENDORED_OPENMP=1: there
    a missing pyattn.libs (an unrepaired wheel) is a failure, not a skip."""
    if os.environ.get("PYATTN_EXPECT_VENDORED_OPENMP") != "1":
        pytest.skip("not testing an installed, repaired wheel")
    info = _run(_INFO, tmp_path)
    vendored = _vendored_dirs(info["pkg"])
    assert vendored, f"no pyattn.libs or .dylibs beside {info['pkg']}"
    names = sorted(os.path.normcase(f) for d in vendored for f in os.listdir(d) if "omp" in f.lower())
    assert len(names) == 1, names  # one OpenMP runtime, never two
    assert [os.path.basename(i["filepath"]) for i in info["openmp"]] == names


_LIMITS = """
    import json, os, sys
    import numpy as np
    import pyattn
    from threadpoolctl import threadpool_limits

    def os_threads():
        return len(os.listdir("/proc/self/task")) if sys.platform.startswith("linux") else -1

    rng = np.random.default_rng(0)
    # Work enough for any thread count to go parallel: 8 heads x 512 x 512 x 64.
    q, k, v = (rng.standard_normal((8, 512, 64), dtype=np.float32) for _ in range(3))
    res = {"default": pyattn.get_num_threads()}
    t0 = os_threads()
    with threadpool_limits(limits=1):
        res["limited"] = pyattn.get_num_threads()
        res["limited_cfg"] = pyattn.show_config(file=open(os.devnull, "w"))["threads"]
        out1 = pyattn.scaled_dot_product_attention(q, k, v)
        res["threads_added_limited"] = os_threads() - t0
    res["restored"] = pyattn.get_num_threads()
    out = pyattn.scaled_dot_product_attention(q, k, v)
    res["threads_added_unlimited"] = os_threads() - t0
    # One thread and a team split the rows, never the reduction over keys: the same bits.
    res["same"] = bool(np.array_equal(out1, out))
    print(json.dumps(res))
"""


def test_threadpool_limits_limits_pyattn(tmp_path):
    # Two OpenMP threads by default whatever the machine, and one BLAS thread, so that the only
    # threads a call can start are pyattn's OpenMP team.
    res = _run(_LIMITS, tmp_path, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    assert res["default"] == 2
    assert res["limited"] == 1
    assert res["limited_cfg"] == 1
    assert res["restored"] == 2
    assert res["same"]
    if sys.platform.startswith("linux"):
        # Under the limit the call ran on the calling thread alone: no OpenMP thread was
        # started. Without it the same call started the pool (so the first count could fail).
        assert res["threads_added_limited"] == 0, res
        assert res["threads_added_unlimited"] >= 1, res
