"""Helpers shared by the bench_*.py modules (not a test module).

The benches are pytest-benchmark tests.  Each parametrised item is one implementation on one
shape; items of one shape share a pytest-benchmark ``group`` so the table compares them side by
side.  Every item also checks its result against a float64 oracle computed once per shape,
outside the timed region.
"""

from __future__ import annotations

import functools
import io
import os
import time
import zlib
from dataclasses import replace

import numpy as np


def smoke_mode(config) -> bool:
    """Whether to use the small shape set.

    ``--bench-size=auto`` (the default) picks the small set under ``--benchmark-disable`` (every
    benchmark then runs once, as a correctness smoke test) and the full shapes otherwise.
    """
    size = config.getoption("bench_size", "auto")
    if size == "auto":
        return bool(config.getoption("benchmark_disable", False))
    return size == "smoke"


def rng_for(*key) -> np.random.Generator:
    """A generator seeded from a readable key, so every run sees the same data."""
    return np.random.default_rng(zlib.crc32("|".join(map(str, key)).encode()))


def normal(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal float32 samples."""
    return rng.standard_normal(shape, dtype=np.float32)


def assert_close(got, expected, rel: float, what: str) -> None:
    """max |got - expected| <= rel * max |expected| (a tolerance scaled to the output's size)."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    err = float(np.max(np.abs(got.astype(np.float64) - expected))) if expected.size else 0.0
    assert np.isfinite(err), f"{what}: non-finite values in the result"
    assert err <= rel * scale + 1e-30, f"{what}: max abs error {err:.3g} > {rel:g} * max|ref| ({scale:.3g})"


SETTLE_S = 0.3


def run_timed(benchmark, fn, *, slow_s: float = 1.0, slow_rounds: int = 3):
    """Time ``fn`` with pytest-benchmark and return its result.

    A call slower than ``slow_s`` (the NumPy reference on the long shapes takes seconds) is timed
    over ``slow_rounds`` rounds only, after one untimed warm-up call, instead of pytest-benchmark's
    default calibration (at least 5 rounds).  Under ``--benchmark-disable`` fn runs once.
    """
    if not benchmark.enabled:
        return benchmark(fn)
    # Let the previous item's thread pools go idle first: ONNX Runtime's and OpenMP's workers
    # spin for a while after a call, and a core they hold slowed the next item by up to 30%
    # (pyattn timed right after ONNX Runtime at B1 H12 L512: 0.69x of its own speed).
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    fn()  # warm-up, and a measure of how long one call takes
    if time.perf_counter() - t0 > slow_s:
        return benchmark.pedantic(fn, rounds=slow_rounds, iterations=1, warmup_rounds=0)
    return benchmark(fn)


@functools.lru_cache(maxsize=1)
def pyattn_threads() -> int:
    import pyattn

    return int(pyattn.get_num_threads())


class SmokeCase:
    """Mixin for a benchmark case, a frozen dataclass with a ``smoke`` dict field: ``small()`` is
    the case with those fields replaced (the shape run under --benchmark-disable)."""

    def small(self):
        return replace(self, **self.smoke, smoke={})


def attention_flops(b: int, h: int, pairs: float, d: int) -> float:
    """2 * (E + Ev) FLOPs per (query, key) pair computed, E = Ev = d."""
    return 4.0 * b * h * pairs * d


def decode_qkv(tag: str, name: str, hq: int, hkv: int, lk: int, d: int):
    """A decode step's float32 inputs, seeded by (tag, name): q (1, Hq, 1, D), k and v (1, Hkv, Lk, D)."""
    rng = rng_for(tag, name)
    return normal(rng, (1, hq, 1, d)), normal(rng, (1, hkv, lk, d)), normal(rng, (1, hkv, lk, d))


def paged_pool(cache: np.ndarray, table: np.ndarray, block: int) -> np.ndarray:
    """cache (B, H, L, D) as the pool (B * nb, H, block, D) that the block table ``table`` (B,
    nb), a permutation of the pool's blocks, reads it through: logical block j of sequence b lies
    in pool[table[b, j]]. Rows past L (the last block's tail) are zeros."""
    b, h, length, d = cache.shape
    nb = table.shape[1]
    n = min(length, nb * block)
    whole = np.zeros((b, h, nb * block, d), cache.dtype)
    whole[:, :, :n] = cache[:, :, :n]
    pool = np.empty((b * nb, h, block, d), cache.dtype)
    pool[table.reshape(-1)] = whole.reshape(b, h, nb, block, d).transpose(0, 2, 1, 3, 4).reshape(b * nb, h, block, d)
    return pool


def _cpu_ident() -> tuple:
    """(model name, family, model) of the first CPU in /proc/cpuinfo; ("", "", "") elsewhere.

    Family and model are kept beside the name because the name alone does not tell the machines
    apart: this VM's Zen 5 and a Zen 3 host both call themselves "AMD EPYC"."""
    name = fam = model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key, val = key.strip(), val.strip()
                if key == "model name" and not name:
                    name = val
                elif key == "cpu family" and not fam:
                    fam = val
                elif key == "model" and not model:
                    model = val
                elif not line.strip() and name:
                    break  # the first processor's block is enough
    except OSError:
        import platform

        name = platform.processor() or platform.machine()
    return name, fam, model


def machine_key(isa=None, threads=None) -> str:
    """The kind of machine a benchmark run belongs to: CPU model, pyattn's kernel set, threads.

    Runs are only compared with runs of the same key (benches/history/<key>/): ratios measured on
    a Zen 3 with the AVX2 kernels say nothing about a Zen 5 with AVX-512. e.g.
    ``amd-epyc-f26m2-avx512-t2``."""
    import re

    if isa is None or threads is None:
        import pyattn

        isa = pyattn.show_config(file=io.StringIO())["isa"] if isa is None else isa
        threads = int(pyattn.get_num_threads()) if threads is None else threads
    name, fam, model = _cpu_ident()
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(r\)|\(tm\)|processor|cpu @.*|\d+-core", "", name.lower())).strip("-")
    cpu = slug or "cpu"
    if fam or model:
        cpu += f"-f{fam}m{model}"
    return f"{cpu}-{isa}-t{threads}"


def repo_commit(path=None) -> dict:
    """The git commit of the repository holding ``path`` (default: this file): id, short id,
    whether the tree had uncommitted changes, branch, author time. Empty fields outside git."""
    import subprocess

    where = os.path.dirname(os.path.abspath(path or __file__))

    def git(*args):
        try:
            return subprocess.run(
                ["git", "-C", where, *args], capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "HEAD")
    return {
        "id": sha,
        "short": sha[:10],
        # Only the library's code and build decide what a benchmark measures; other sessions'
        # benches, notes or docs in the same tree should not mark a run dirty.
        "dirty": bool(
            git("status", "--porcelain", "--untracked-files=no", "--", ":/csrc", ":/pyattn", ":/CMakeLists.txt")
        ),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "time": git("show", "-s", "--format=%cI", "HEAD"),
    }
