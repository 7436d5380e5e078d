#!/usr/bin/env python3
"""A context of 1M keys sharded over Dask workers: exact attention with pyattn.dask.

The last ``--lq`` tokens of a long context (a chunked prefill, causal, bottom-right aligned)
attend to all ``--lk`` keys (1,048,576 by default: 2 x 2 GiB of float32 K and V for 8 heads of
64). K and V are never held by one process: each chunk of ``--chunk`` keys is made on a worker
(here drawn from a seeded generator; in a real deployment read from storage or produced by the
previous layer), attended there by one pyattn call that returns its partial output and
log-sum-exp, and the partials are merged exactly, in a tree, by ``merge_attention_states``.
A worker's memory is bounded by its chunks, not by the context: the script reports each worker's
peak resident memory beside the bytes of one K/V chunk and of the whole K/V.

The cluster is a ``distributed.LocalCluster`` of ``--workers`` processes with one thread each
(the nanny sets OMP_NUM_THREADS=1, so each pyattn call runs on one core). The same code runs on
any Dask cluster: pass ``--scheduler tcp://host:8786`` for one started with ``dask-ssh``, the
Kubernetes operator or a cloud provider's deployment.

    python examples/dask_long_context.py                  # 1M keys, 32 chunks, 2 workers
    python examples/dask_long_context.py --quick          # 64K keys: the CI smoke (seconds)
    python examples/dask_long_context.py --check          # also the single-process call on the gathered K/V
    python examples/dask_long_context.py --scheduler tcp://10.0.0.5:8786 --lk 8388608

``--quick`` checks against the single-process ``pyattn.scaled_dot_product_attention`` by default
(``--check`` in the full mode gathers 4 GiB of K/V into this process to do the same). It exits
with status 1 if the largest difference exceeds 1e-5 of the output's largest value.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np


def _peak_rss_bytes():
    """This process's peak resident memory (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _at_least(low):
    def parse(text):
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}; got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64K keys in 8 chunks, checked (the CI smoke)")
    ap.add_argument("--lk", type=_at_least(1), help="keys in the context (default 1048576; --quick 65536)")
    ap.add_argument("--chunk", type=_at_least(1), help="keys per chunk (default 32768; --quick 8192)")
    ap.add_argument("--lq", type=_at_least(1), default=128, help="query tokens: the end of the context")
    ap.add_argument("--heads", type=_at_least(1), default=8)
    ap.add_argument("--head-dim", type=_at_least(1), default=64)
    ap.add_argument("--workers", type=_at_least(1), default=2)
    ap.add_argument("--split-every", type=_at_least(2), default=4, help="fan-in of the merge tree")
    ap.add_argument("--scheduler", default=None, help="address of an existing Dask scheduler (default: a LocalCluster)")
    ap.add_argument("--check", action="store_true", help="compare with the single-process call (default with --quick)")
    args = ap.parse_args(argv)

    try:
        import dask.array as da
        import distributed
    except ImportError as e:
        sys.exit(f"this example needs dask and distributed ({e}): pip install '.[dask]' in pyattn's checkout")

    import pyattn
    import pyattn.dask

    lk = args.lk if args.lk is not None else (65536 if args.quick else 1 << 20)
    chunk = args.chunk if args.chunk is not None else (8192 if args.quick else 32768)
    check = args.check or args.quick
    h, d, lq = args.heads, args.head_dim, args.lq

    if args.scheduler:
        client = distributed.Client(args.scheduler)
        cluster = None
    else:
        cluster = distributed.LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
        )
        client = distributed.Client(cluster)
    try:
        workers = client.run(lambda: (pyattn.get_num_threads(), _peak_rss_bytes()))
        base = {w: rss for w, (_, rss) in workers.items()}
        print(f"cluster: {len(workers)} workers, pyattn threads per worker {sorted({t for t, _ in workers.values()})}")

        # Q is small (the last lq tokens); K and V are made chunk by chunk on the workers.
        q = np.random.default_rng(0).standard_normal((1, h, lq, d), dtype=np.float32)
        rng = da.random.default_rng(1)
        k = rng.standard_normal((1, h, lk, d), chunks=(1, h, chunk, d), dtype=np.float32)
        v = rng.standard_normal((1, h, lk, d), chunks=(1, h, chunk, d), dtype=np.float32)
        dq = da.from_array(q, chunks=(1, h, lq, d))
        out, lse = pyattn.dask.scaled_dot_product_attention(
            dq, k, v, is_causal=True, causal_align="bottom_right", return_lse=True, split_every=args.split_every
        )
        layers = out.__dask_graph__().layers
        counts = {n.split("-")[2]: len(layer) for n, layer in layers.items() if n.startswith("pyattn-sdpa-")}
        n_chunks = len(k.chunks[2])
        depth = int(np.ceil(np.log(n_chunks) / np.log(args.split_every))) if n_chunks > 1 else 0
        kv_bytes = 2 * k.nbytes
        chunk_bytes = 2 * h * chunk * d * 4
        print(
            f"context: Lq {lq} x Lk {lk:,} keys, {h} heads of {d}; K+V {_gib(kv_bytes)} in {n_chunks} chunks of "
            f"{chunk:,} keys ({_gib(chunk_bytes)} of K+V each)"
        )
        print(
            f"graph: {counts.get('block', 0)} attention tasks, {counts.get('merge', 0)} merges "
            f"(tree depth {depth}, fan-in {args.split_every})"
        )

        t0 = time.perf_counter()
        o, l = client.compute([out, lse], sync=True)
        dt = time.perf_counter() - t0
        flops = 4 * h * lq * lk * d
        # K/V are generated inside the same compute (that is what keeps them off the client), so
        # this time includes drawing 2 x Lk x H x D normal numbers on the workers.
        print(f"compute: {dt:.2f} s for {flops / 1e9:.0f} GFLOP of attention, K/V generation on the workers included")

        peaks = client.run(_peak_rss_bytes)
        for w, peak in sorted(peaks.items()):
            print(f"  worker {w}: peak RSS {_gib(peak)} (at start {_gib(base.get(w, 0))})")
        worst = max(peaks.values()) - min(base.values())
        print(
            f"memory: the largest worker grew by {_gib(worst)} for {_gib(kv_bytes)} of K/V "
            f"({worst / chunk_bytes:.1f} x one K+V chunk)"
        )

        status = 0
        if check:
            kk, vv = client.compute([k, v], sync=True)
            t0 = time.perf_counter()
            ro, rl = pyattn.scaled_dot_product_attention(
                q, kk, vv, is_causal=True, causal_align="bottom_right", return_lse=True
            )
            t1 = time.perf_counter() - t0
            err = float(np.abs(o - ro).max() / np.abs(ro).max())
            lerr = float(np.abs(l - rl).max())
            ok = err <= 1e-5 and lerr <= 1e-4
            print(
                f"check: single-process call {t1:.2f} s; max |diff| / max |out| = {err:.2e}, "
                f"max |lse diff| = {lerr:.2e}: {'OK' if ok else 'FAILED'}"
            )
            status = 0 if ok else 1
        return status
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    sys.exit(main())
