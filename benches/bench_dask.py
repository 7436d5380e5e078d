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

The workers keep freed memory for reuse (``WORKER_MALLOC``: glibc's ``MALLOC_MMAP_THRESHOLD_``
32 MiB, ``MALLOC_TRIM_THRESHOLD_`` 128 MiB, set through ``distributed.nanny.pre-spawn-environ``).
Dask's default (``MALLOC_TRIM_THRESHOLD_=65536``, which also turns off glibc's adaptive mmap
threshold) makes every array of a state's size a fresh ``mmap`` that faults in page by page; on a
VM whose balloon reports freed pages to the host, re-faulting them cost this bench a quarter to a
half of its time (docs/dask.md). ``--worker-malloc dask`` (or ``PYATTN_BENCH_DASK_MALLOC=dask``
under pytest) measures Dask's default.

Q, K and V are persisted on each cluster before timing, so a timed call moves Q to the workers,
computes, merges and gathers the (B, H, L, D) output into this process, as a user's
``.compute()`` does. Every item checks its output against the single-process call. Needs dask
and distributed (the ``dask`` extra); skipped without them.

pytest-benchmark times the items one after the other. On a machine shared with other jobs, run
the interleaved comparison instead (every item once per round, rotating the order, medians and
per-round ratios printed):

    python benches/bench_dask.py --rounds 11 --key-chunks 2,4 [--worker-malloc dask]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field

import pytest
from benchutil import SmokeCase, assert_close, attention_flops, normal, rng_for, run_timed, smoke_mode

import pyattn

if __name__ == "__main__":  # the interleaved comparison needs no pytest
    import dask
    import dask.array as da
    import distributed
else:
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


# glibc settings of the worker processes: arrays up to 32 MiB come from the heap, and up to 128 MiB
# of freed heap stays in each malloc arena, so a state's output, its merge and its receive buffers
# reuse memory that is already mapped
WORKER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": 32 << 20, "MALLOC_TRIM_THRESHOLD_": 128 << 20}


def _start(n_workers, worker_malloc="keep"):
    """A LocalCluster of n_workers processes x 1 thread and its client; worker_malloc "keep"
    (WORKER_MALLOC) or "dask" (Dask's own pre-spawn environment).

    glibc reads MALLOC_* once, as a process starts, so they go into the nanny's pre-spawn
    environment (kept by each nanny, so a restarted worker gets them again). A value in this
    process's os.environ would take precedence over that config, so these two are taken out of it
    while the cluster starts, and put back after: the nanny writes its pre-spawn variables into
    os.environ as it spawns a worker (a restart later writes them again; Dask's OMP_NUM_THREADS=1
    and PYTHONHASHSEED stay there too, which this process's OpenMP, started already, ignores)."""
    if worker_malloc not in ("keep", "dask"):
        raise ValueError(f"worker_malloc must be 'keep' or 'dask'; got {worker_malloc!r}")
    saved = {k: os.environ.pop(k, None) for k in WORKER_MALLOC}
    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    if worker_malloc == "keep":
        env.update(WORKER_MALLOC)
    try:
        with warnings.catch_warnings(), dask.config.set({"distributed.nanny.pre-spawn-environ": env}):
            warnings.simplefilter("ignore")
            cluster = distributed.LocalCluster(
                n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
            )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return cluster, distributed.Client(cluster, set_as_default=False)


@pytest.fixture(scope="module")
def clusters():
    """One LocalCluster per worker count, started on first use, closed at the end."""
    made = {}

    def get(n_workers):
        if n_workers not in made:
            made[n_workers] = _start(n_workers, os.environ.get("PYATTN_BENCH_DASK_MALLOC", "keep"))
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


def interleaved(rounds: int, key_chunks, case: Case, worker_malloc="keep"):
    """Every item once per round, the order rotating; returns {item: [seconds per round]}."""
    rng = rng_for("dask", case.name)
    shape = (case.b, case.h, case.l, case.d)
    q, k, v = normal(rng, shape), normal(rng, shape), normal(rng, shape)
    expected = pyattn.scaled_dot_product_attention(q, k, v)
    clusters = {n: _start(n, worker_malloc) for n in (2, 1)}
    items = {}
    try:
        for n, (_, client) in clusters.items():
            for nc in key_chunks:
                kc = -(-case.l // nc)
                arrays = [
                    da.from_array(x, chunks=(case.b, case.h, c, case.d)) for x, c in ((q, case.l), (k, kc), (v, kc))
                ]
                dq, dk, dv = client.persist(arrays)
                client.gather(distributed.futures_of([dq, dk, dv]))
                out = pyattn.dask.scaled_dot_product_attention(dq, dk, dv)
                items[f"dask-{n}w keys/{nc}"] = lambda client=client, out=out: client.compute(out, sync=True)
        for t in (2, 1):

            def single(t=t):
                with pyattn.num_threads(t):
                    return pyattn.scaled_dot_product_attention(q, k, v)

            items[f"pyattn-{t}t"] = single
        for name, fn in items.items():  # warm-up, and every item checked once
            assert_close(fn(), expected, 1e-5, name)
        times = {name: [] for name in items}
        names = list(items)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                time.sleep(0.2)
                t0 = time.perf_counter()
                items[name]()
                times[name].append(time.perf_counter() - t0)
        return times
    finally:
        for cluster, client in clusters.values():
            client.close()
            cluster.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description="pyattn.dask sharded by keys: 2 workers vs 1 vs one process, interleaved")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--key-chunks", default="2,4")
    ap.add_argument("--l", type=int, default=Case.l)
    ap.add_argument(
        "--worker-malloc",
        choices=["keep", "dask"],
        default="keep",
        help="the workers' glibc settings: keep freed memory (WORKER_MALLOC) or Dask's default",
    )
    args = ap.parse_args(argv)
    case = Case(l=args.l)
    chunks = [int(c) for c in args.key_chunks.split(",")]
    times = interleaved(args.rounds, chunks, case, args.worker_malloc)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    head = f"{case.name.replace('keys/4', '')}, worker malloc {args.worker_malloc!r}, {args.rounds} interleaved rounds"
    print(f"{head}, medians:")
    for name, m in med.items():
        print(f"  {name:16s} {m:7.3f} s")
    for nc in chunks:
        w2, w1 = times[f"dask-2w keys/{nc}"], times[f"dask-1w keys/{nc}"]
        r1 = [b / a for a, b in zip(w2, w1)]
        r2 = [p / a for a, p in zip(w2, times["pyattn-2t"])]
        print(
            f"keys/{nc}: 1 worker / 2 workers {med[f'dask-1w keys/{nc}'] / med[f'dask-2w keys/{nc}']:.2f} "
            f"(target >= 1.7; per round {min(r1):.2f}-{max(r1):.2f}), "
            f"pyattn 2 threads / 2 workers {med['pyattn-2t'] / med[f'dask-2w keys/{nc}']:.2f} "
            f"(target >= 0.85; per round {min(r2):.2f}-{max(r2):.2f})"
        )
    print(f"pyattn 1 thread / 2 threads {med['pyattn-1t'] / med['pyattn-2t']:.2f} (how much a second core gave)")


if __name__ == "__main__":
    main()
