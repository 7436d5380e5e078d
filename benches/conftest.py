"""pytest configuration for benches/ (pytest-benchmark).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE pytest benches     # real timings, full shapes
    pytest benches --benchmark-disable                              # smoke: once each, small
    python benches/report.py -k attention                           # run, then markdown tables
    pytest benches --bench-history -k ...      # also save the run in benches/history/<machine key>/

Use an installed pyattn: ``python -m pytest`` puts the current directory on sys.path, so from
the repository root it would import the source ``pyattn/`` (no compiled core unless installed
editable); the ``pytest`` script, report.py (it runs pytest from a temporary directory) or any
other directory are fine.  ``--bench-size=full|smoke`` overrides the shape set.

``bench_*.py`` files are collected here even though pytest's default ``python_files`` is
``test_*.py``, so the test suite's command (``pytest tests``) never runs them.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import os
import time
from pathlib import Path

import numpy as np
import pytest

OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
HISTORY_DIR = Path(__file__).resolve().parent / "history"


def pytest_addoption(parser):
    parser.addoption(
        "--bench-size",
        choices=("auto", "full", "smoke"),
        default="auto",
        help="benches: 'full' = the measured shapes, 'smoke' = small shapes; 'auto' (default) = "
        "smoke under --benchmark-disable, full otherwise.",
    )
    parser.addoption(
        "--bench-history",
        nargs="?",
        const=str(HISTORY_DIR),
        default=None,
        metavar="DIR",
        help="benches: save this run with pytest-benchmark's storage under DIR/<machine key>/ (default "
        "DIR: benches/history, meant to be committed), named after the commit; nothing is saved under "
        "--benchmark-disable. The key is CPU model, pyattn kernel set and threads (benchutil.machine_key).",
    )


def pytest_configure(config):
    """--bench-history: point pytest-benchmark's --benchmark-storage / --benchmark-save at
    DIR/<machine key>, named after the commit. Runs before pytest-benchmark's own pytest_configure
    (trylast), which reads these two options to set up its storage."""
    where = config.getoption("bench_history", None)
    if not where or config.getoption("benchmark_disable", False):
        return
    key = history_key(config)
    commit = _commit()
    config.option.benchmark_storage = "file://" + os.path.join(os.path.abspath(where), key)
    config.option.benchmark_save = (commit["short"] or "nogit") + ("-dirty" if commit["dirty"] else "")


def pytest_collect_file(file_path, parent):
    """Collect benches/bench_*.py unless python_files already matches them."""
    if file_path.suffix != ".py" or not fnmatch.fnmatch(file_path.name, "bench_*.py"):
        return None
    if parent.session.isinitpath(file_path) or any(
        fnmatch.fnmatch(file_path.name, pat) for pat in parent.config.getini("python_files")
    ):
        return None  # the python plugin collects it already (named on the command line, or
        # matched by python_files)
    return pytest.Module.from_parent(parent, path=file_path)


def openblas_info() -> list:
    """threadpoolctl's view of the BLAS libraries loaded (NumPy's OpenBLAS core type)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    np.matmul(np.ones((2, 2)), np.ones((2, 2)))  # make sure NumPy's BLAS is loaded
    return [
        {k: d.get(k) for k in ("internal_api", "architecture", "num_threads", "version", "filepath")}
        for d in threadpool_info()
        if d.get("user_api") == "blas"
    ]


def pyattn_config() -> str:
    import pyattn

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ret = pyattn.show_config()
    text = buf.getvalue().strip()
    if ret is not None and not text:
        text = str(ret)
    return text


def measure_sgemm_gflops(n: int = 2048, reps: int = 7, clock=time.perf_counter) -> float:
    """NumPy float32 n x n matmul, GFLOP/s of the best of ``reps`` calls: the practical peak
    the report divides by (the best call, as a peak is; the machine is shared and noisy).
    ``clock``: the benchmarks' timer (CPU time in the history's --record runs, see cpu_clock)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(reps):
        t0 = clock()
        np.matmul(a, b, out=c)
        times.append(clock() - t0)
    return 2.0 * n**3 / min(times) / 1e9


def measure_read_gbs(threads: int, mib: int = 512, reps: int = 5, clock=time.perf_counter) -> float:
    """Memory read bandwidth with ``threads`` threads: NumPy sums equal parts of a ``mib`` MiB
    float32 array in Python threads (the reduction releases the GIL); GB/s of the best of
    ``reps``. What decode's K/V streaming is compared with, measured in the same run."""
    import threading

    x = np.ones((mib << 20) // 4, np.float32)
    parts = np.array_split(x, max(1, threads))
    best = 0.0
    for _ in range(reps):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = clock()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = clock() - t0
        if clock is not time.perf_counter:  # CPU time sums over the threads: per thread instead
            dt /= max(1, threads)
        best = max(best, x.nbytes / dt / 1e9)
    return best


_START_PEAKS: dict = {}


def cpu_clock(config):
    """time.process_time when the benchmarks are timed in CPU time (``--benchmark-timer
    time.process_time``, what ``report.py --record`` uses), else None (wall time).

    CPU time does not count the time another process holds the core, which on these shared VMs
    is most of the noise (wall-time ratios of the same code moved by 10x at a load average of 15,
    docs/performance.md); on one thread it is the call's own work. The peaks are then measured
    in CPU time too, so the "% of peak" ratios stay like for like."""
    timer = str(config.getoption("benchmark_timer", "") or "")
    return time.process_time if timer.endswith("process_time") else None


def history_key(config) -> str:
    """The history folder's key: benchutil.machine_key(), plus ``-cputime`` for CPU-time runs
    (never compared with wall-time runs)."""
    from benchutil import machine_key

    return machine_key() + ("-cputime" if cpu_clock(config) else "")


def pytest_sessionstart(session):
    """Measure the peaks once before the benchmarks too (see pytest_benchmark_update_machine_info)."""
    config = session.config
    if config.getoption("benchmark_disable", False) or not config.pluginmanager.hasplugin("benchmark"):
        return
    import pyattn

    clock = cpu_clock(config) or time.perf_counter
    _START_PEAKS["sgemm"] = measure_sgemm_gflops(clock=clock)
    _START_PEAKS["read"] = measure_read_gbs(int(pyattn.get_num_threads()), clock=clock)


def pytest_report_header(config):
    lines = []
    blas = openblas_info()
    if blas:
        lines.append(
            "benches: NumPy BLAS: "
            + "; ".join(
                f"{d['internal_api']} {d['version']} core={d['architecture']} threads={d['num_threads']}" for d in blas
            )
        )
    set_vars = [f"{v}={os.environ[v]}" for v in OPENBLAS_VARS if v in os.environ]
    if set_vars and not config.getoption("benchmark_disable", False):
        lines.append(
            "benches: WARNING " + " ".join(set_vars) + " is set: NumPy's OpenBLAS uses "
            "an old kernel; run with `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE` "
            "for a fair NumPy peer (docs/performance.md)"
        )
    return lines


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record what the report needs to read the numbers: BLAS core, threads, versions, peak."""
    from peers import versions

    import pyattn

    machine_info["pyattn"] = {
        "version": getattr(pyattn, "__version__", None),
        "file": pyattn.__file__,
        "num_threads": int(pyattn.get_num_threads()),
        "config": pyattn_config(),
    }
    machine_info["numpy"] = np.__version__
    machine_info["blas"] = openblas_info()
    machine_info["openblas_env"] = {v: os.environ.get(v) for v in OPENBLAS_VARS}
    machine_info["peers"] = versions()
    # Best of the session's start and end: a peak measured in one slow minute of this shared
    # machine would make every "% of peak" read high.
    start = _START_PEAKS or {}
    clock = cpu_clock(config) or time.perf_counter
    threads = int(pyattn.get_num_threads())
    machine_info["sgemm_peak_gflops"] = max(measure_sgemm_gflops(clock=clock), start.get("sgemm", 0.0))
    machine_info["read_gbs"] = max(measure_read_gbs(threads, clock=clock), start.get("read", 0.0))
    machine_info["timer"] = "cpu" if cpu_clock(config) else "wall"
    if hasattr(os, "getloadavg"):
        machine_info["loadavg_end"] = os.getloadavg()
    # The history folder's key, kept in the json too so that report.py can group runs read from
    # anywhere by the kind of machine they ran on.
    machine_info["bench_key"] = history_key(config)


@functools.lru_cache(maxsize=1)
def _commit() -> dict:
    """The repository's commit when the run started (the file name and the json agree even if a
    commit lands during the run)."""
    from benchutil import repo_commit

    return repo_commit()


def pytest_benchmark_update_commit_info(config, commit_info):
    """The commit of this repository, not of the directory pytest runs in (report.py runs it from
    an empty temporary directory, where pytest-benchmark finds no git repository)."""
    info = _commit()
    if info["id"]:
        commit_info.pop("error", None)
        commit_info.update(id=info["id"], dirty=info["dirty"], branch=info["branch"], time=info["time"])
        commit_info["project"] = "pyattn"
