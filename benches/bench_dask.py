"""pyattn.dask (issue 13): attention sharded by keys over a distributed.LocalCluster, beside one
worker and beside the single-process call.

Group ``dask B1 H8 L8192 D64 keys/4`` (non-causal self-attention, the key axis in 4 chunks, the
queries whole; smoke: B1 H2 L512 D64):

- ``dask-2w``: 2 worker processes x 1 thread (each pyattn call on one core: the nanny sets
  OMP_NUM_THREADS=1); the 4 partial attentions and their merge tree run on the cluster;
- ``dask-1w``: the same graph on 1 worker x 1 thread (target: ``dask-1w / dask-2w`` >= 1.7);
- ``pyattn-2t``: ``pyattn.scaled_dot_product_attention`` in this process on 2 threads (target:
  ``pyattn-2t / dask-2w`` >= 0.85, the scheduler's and the merges' overhead);
- ``pyattn-1t``: the same on 1 thread (what one worker's tasks add up to, without Dask).

Q, K and V are persisted on each cluster before timing, so a timed call moves Q to the workers,
computes, merges and gathers the (B, H, L, D) output into this process, as a user's
``.compute()`` does. Every item checks its output against the single-process call. Needs dask
and distributed (the ``dask`` extra); skipped without them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
from benchutil import SmokeCase, assert_close, attention_flops, normal, rng_for, run_timed, smoke_mode

import pyattn

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import pyattn.dask  # noqa: E402


@dataclass(frozen=True)
class Case(SmokeCase):
    b: int = 1
    h: int = 8
    l: int = 8192
    d: int = 64
    key_chunks: int = 4
    smoke: dict = field(default_factory=lambda: {"h": 2, "l": 512})

    @property
    def name(self):
        return f"dask B{self.b} H{self.h} L{self.l} D{self.d} keys/{self.key_chunks}"


IMPLS = ["dask-2w", "dask-1w", "pyattn-2t", "pyattn-1t"]


@pytest.fixture(scope="module")
def case(request):
    return Case().small() if smoke_mode(request.config) else Case()


@pytest.fixture(scope="module")
def data(case):
    rng = rng_for("dask", case.name)
    shape = (case.b, case.h, case.l, case.d)
    q, k, v = normal(rng, shape), normal(rng, shape), normal(rng, shape)
    return q, k, v, pyattn.scaled_dot_product_attention(q, k, v)


@pytest.fixture(scope="module")
def clusters():
    """One LocalCluster per worker count, started on first use, closed at the end."""
    made = {}

    def get(n_workers):
        if n_workers not in made:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cluster = distributed.LocalCluster(
                    n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
                )
            made[n_workers] = (cluster, distributed.Client(cluster, set_as_default=False))
        return made[n_workers][1]

    yield get
    for cluster, client in made.values():
        client.close()
        cluster.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_dask_keys(benchmark, case, data, clusters, impl):
    q, k, v, expected = data
    benchmark.group = case.name
    benchmark.extra_info.update(
        kind="attention", impl=impl, shape=case.name, flops=attention_flops(case.b, case.h, case.l * case.l, case.d)
    )
    if impl.startswith("dask"):
        client = clusters(int(impl.split("-")[1][0]))
        kc = -(-case.l // case.key_chunks)
        dq = da.from_array(q, chunks=(case.b, case.h, case.l, case.d))
        dk = da.from_array(k, chunks=(case.b, case.h, kc, case.d))
        dv = da.from_array(v, chunks=(case.b, case.h, kc, case.d))
        dq, dk, dv = client.persist([dq, dk, dv])
        client.gather(distributed.futures_of([dq, dk, dv]))  # wait until they are on the workers
        out = pyattn.dask.scaled_dot_product_attention(dq, dk, dv)

        def fn():
            return client.compute(out, sync=True)
    else:
        threads = int(impl[-2])

        def fn():
            with pyattn.num_threads(threads):
                return pyattn.scaled_dot_product_attention(q, k, v)

    got = run_timed(benchmark, fn)
    assert_close(got, expected, 1e-5, impl)
