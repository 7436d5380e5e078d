"""Extra peak memory of one attention call, pyattn beside the NumPy reference and the peers.

The target (docs/performance.md): pyattn's scratch is bounded by threads x tile size,
independent of L (no L x L buffer unless the weights are asked for), where the reference
materialises the Lq x Lk scores.  Peak RSS is per process, so each measurement runs in a fresh
interpreter: make the inputs (and the peer's session / transposed copies), warm up on a tiny
problem, read the peak RSS, call once on the real shape, read it again (Linux: the peak is reset
to the current RSS through /proc/self/clear_refs first, so it is the call's own peak).
``extra_info["extra_peak_mib"]`` is the difference (the output included); the time
pytest-benchmark records here is the whole subprocess and means nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchutil import pyattn_threads, smoke_mode

HERE = Path(__file__).resolve().parent
IMPLS = ("pyattn", "numpy_ref", "torch", "onnxruntime")
H, D = 1, 64  # one head keeps the reference's float64 L x L temporaries to a few GiB at L=8192
FULL_LENGTHS = (4096, 8192)
SMOKE_LENGTHS = (512,)

CHILD = r"""
import json, resource, sys
import numpy as np
impl, L, H, D, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def setup(L):
    rng = np.random.default_rng(L)
    q, k, v = (rng.standard_normal((1, H, L, D), dtype=np.float32) for _ in range(3))
    if impl == "pyattn":
        import pyattn
        return lambda: pyattn.scaled_dot_product_attention(q, k, v)
    if impl == "numpy_ref":
        from pyattn import reference
        return lambda: reference.scaled_dot_product_attention(q, k, v)
    import peers
    try:
        p = peers.ATTENTION_PEERS[impl](q, k, v, is_causal=False, enable_gqa=False,
                                        num_threads=threads)
    except peers.Unsupported as exc:
        print(json.dumps({"skip": str(exc)}))
        sys.exit(0)
    return p.run

def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

setup(64)()  # load libraries, start thread pools
fn = setup(L)
try:  # Linux: reset the peak RSS (VmHWM) to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    out = fn()
    after = status_kib("VmHWM")
except OSError:  # peak of the whole process so far: may under-count
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = fn()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_peak_mib": (after - before) / 1024.0}))
"""


def measure(impl: str, L: int, threads: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, impl, str(L), str(H), str(D), str(threads)],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{impl} L={L} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pytest_generate_tests(metafunc):
    if "length" in metafunc.fixturenames:
        lengths = SMOKE_LENGTHS if smoke_mode(metafunc.config) else FULL_LENGTHS
        metafunc.parametrize("length", lengths, ids=[f"L{n}" for n in lengths])


@pytest.mark.parametrize("impl", IMPLS)
def test_peak_memory(benchmark, length, impl):
    benchmark.group = f"memory B1 H{H} L{length} D{D}"
    result = benchmark.pedantic(measure, args=(impl, length, pyattn_threads()), rounds=1)
    if "skip" in result:
        pytest.skip(f"{impl}: {result['skip']}")
    extra = result["extra_peak_mib"]
    benchmark.extra_info.update(kind="memory", impl=impl, extra_peak_mib=extra, output_mib=H * length * D * 4 / 2**20)
    assert extra >= 0
