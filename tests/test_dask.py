"""pyattn.dask on a real distributed.LocalCluster (2 worker processes x 1 thread): every chunking
equals the single-process pyattn call, the graph never hands a task more than one key chunk,
hidden blocks are not scheduled, a killed worker changes nothing, and bad inputs raise."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

import pyattn

pytestmark = pytest.mark.integration

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import pyattn.dask as pdask  # noqa: E402

TOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}


@pytest.fixture(scope="module")
def client():
    import cloudpickle

    # The workers are other processes: the helpers defined here travel by value, not by a module
    # name they could not import.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cluster's own start-up notices
        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=40
        )
    c = distributed.Client(cluster)
    try:
        yield c
    finally:
        c.close()
        cluster.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _rng(seed):
    return np.random.default_rng(seed)


def _close(actual, expected, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    fin = np.isfinite(expected)
    assert np.array_equal(fin, np.isfinite(actual)), f"{what}: non-finite entries differ"
    assert np.array_equal(actual[~fin], expected[~fin], equal_nan=True), f"{what}: -inf/inf/NaN entries differ"
    if fin.any():
        scale = max(np.abs(expected[fin]).max(), 1.0 if what.endswith("lse") else 1e-30)
        err = np.abs(actual[fin] - expected[fin]).max() / scale
        assert err <= TOL[expected.dtype], f"{what}: relative error {err:.3g} > {TOL[expected.dtype]}"


def _case(q, k, v, chunks_q, chunks_kv, mask=None, mask_chunks=None, **kw):
    """The lazy Dask call on chunked copies of q, k, v (and the mask), and the NumPy call."""
    dq = da.from_array(q, chunks=chunks_q)
    dk = da.from_array(k, chunks=chunks_kv)
    dv = da.from_array(v, chunks=chunks_kv[:-1] + (v.shape[-1],))
    dm = da.from_array(mask, chunks=mask_chunks) if mask_chunks is not None else mask
    out, lse = pdask.scaled_dot_product_attention(dq, dk, dv, dm, return_lse=True, **kw)
    assert isinstance(out, da.Array) and isinstance(lse, da.Array)
    kw.pop("split_every", None)
    ro, rl = pyattn.scaled_dot_product_attention(q, k, v, mask, return_lse=True, **kw)
    # the lazy arrays' metadata tell the truth before anything is computed
    assert out.shape == ro.shape and out.dtype == ro.dtype and lse.shape == rl.shape and lse.dtype == rl.dtype
    return out, lse, ro, rl


def _verify(client, cases: dict):
    """Computes every case in one go on the cluster (one round trip) and compares each."""
    lazy = [x for c in cases.values() for x in c[:2]]
    got = client.compute(lazy, sync=True)
    for t, (name, (_, _, ro, rl)) in enumerate(cases.items()):
        _close(got[2 * t], ro, f"{name}: output")
        _close(got[2 * t + 1], rl, f"{name}: lse")


def _check(client, *args, **kw):
    out, lse, ro, rl = case = _case(*args, **kw)
    _verify(client, {"case": case})
    return out


def _qkv(shape_q, shape_k, ev=None, dtype=np.float32, seed=0):
    rng = _rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (ev or shape_k[-1],)).astype(dtype)
    return q, k, v


B, H, LQ, LK, E = 2, 4, 48, 61, 16
# (query chunks, key/value chunks) over (B, H, L, E): batch, heads, Lk (2 to 8 uneven), Lq, mixed
CHUNKINGS = {
    "whole": ((B, H, LQ, E), (B, H, LK, E)),
    "batch": ((1, H, LQ, E), (1, H, LK, E)),
    "heads": ((B, (1, 3), LQ, E), (B, (1, 3), LK, E)),
    "lk2": ((B, H, LQ, E), (B, H, (30, 31), E)),
    "lk5-uneven": ((B, H, LQ, E), (B, H, (3, 20, 1, 30, 7), E)),
    "lk8": ((B, H, LQ, E), (B, H, (8,) * 7 + (5,), E)),
    "lq3": ((B, H, (16, 16, 16), E), (B, H, LK, E)),
    "lq-uneven": ((B, H, (5, 40, 3), E), (B, H, LK, E)),
    "mixed": ((1, (2, 2), (20, 28), E), (1, (2, 2), (17, 9, 35), E)),
    "mixed-fine": ((1, 1, (7,) * 6 + (6,), E), (1, 1, (11,) * 5 + (6,), E)),
}
VARIANTS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "causal-br": dict(is_causal=True, causal_align="bottom_right"),
    "window": dict(window=(6, 3)),
    "window-br-left": dict(window=(9, None), causal_align="bottom_right"),
    "sliding": dict(is_causal=True, window=(7, 0)),
    "alibi": dict(alibi_slopes=np.linspace(0.1, 0.8, H)),
    "alibi-causal-br": dict(alibi_slopes=np.linspace(0.1, 0.8, H), is_causal=True, causal_align="bottom_right"),
    "alibi-window": dict(alibi_slopes=np.linspace(0.1, 0.8, H), window=(5, 8)),
    "softcap-scale": dict(softcap=3.0, scale=0.4),
    "sinks": dict(sinks=np.linspace(-1.0, 2.0, H), is_causal=True),
    "all": dict(
        sinks=np.linspace(-1.0, 2.0, H), alibi_slopes=np.full((B, H), 0.25), softcap=4.0, window=(10, 0), is_causal=True
    ),
}


@pytest.mark.parametrize("variant", ["plain", "causal", "causal-br", "all"])
def test_chunkings(client, variant):
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), ev=24)
    cases = {name: _case(q, k, v, cq, ck, **VARIANTS[variant]) for name, (cq, ck) in CHUNKINGS.items()}
    _verify(client, cases)


def test_variants_lq_and_lk_chunked(client):
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), seed=1)
    cq, ck = (1, 2, (10, 25, 13), E), (1, 2, (14, 6, 20, 21), E)
    _verify(client, {name: _case(q, k, v, cq, ck, **kw) for name, kw in VARIANTS.items()})


@pytest.mark.parametrize("lq,lk", [(70, 20), (20, 70), (1, 50)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_both_alignments_lq_ne_lk(client, lq, lk, align):
    """Lq > Lk with bottom_right leaves the first query chunks with no key at all (zeros, -inf,
    or the sink); Lq = 1 is a decode step against a sharded cache."""
    q, k, v = _qkv((1, 2, lq, 8), (1, 2, lk, 8), seed=2)
    qc = tuple(c for c in (lq // 3, lq // 3, lq - 2 * (lq // 3)) if c) or (lq,)
    kc = (lk // 4, lk // 4, lk - 2 * (lk // 4))
    cases = {}
    for t, kw in enumerate(({}, dict(sinks=np.array([0.3, -0.7])), dict(alibi_slopes=np.array([0.2, 0.5])))):
        cases[f"variant {t}"] = _case(q, k, v, (1, 1, qc, 8), (1, 1, kc, 8), is_causal=True, causal_align=align, **kw)
    _verify(client, cases)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtypes(client, dtype):
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), dtype=dtype, seed=3)
    _check(client, q, k, v, (1, 2, (20, 28), E), (1, 2, (17, 9, 35), E), is_causal=True, alibi_slopes=np.ones(H) * 0.3)


def test_mixed_input_dtypes_promote(client):
    q, k, v = _qkv((1, 2, 20, 8), (1, 2, 30, 8), seed=4)
    _check(client, q, k.astype(np.float64), v, (1, 1, (10, 10), 8), (1, 1, (12, 18), 8), is_causal=True)


@pytest.mark.parametrize(
    "hq_chunks,hkv_chunks",
    [((8,), (2,)), ((4, 4), (1, 1)), ((3, 3, 2), (2,)), ((1,) * 8, (1, 1)), ((5, 3), (1, 1)), ((2, 6), (2,))],
)
def test_gqa_head_chunks(client, hq_chunks, hkv_chunks):
    """Query heads chunked anyhow against kv heads chunked anyhow: each task gathers the kv
    head blocks its query heads read (query head h reads kv head h // 4)."""
    q, k, v = _qkv((2, 8, 30, 8), (2, 2, 45, 8), ev=12, seed=5)
    kw = dict(enable_gqa=True, is_causal=True, alibi_slopes=np.linspace(0.1, 0.9, 8), sinks=np.linspace(0, 1, 8))
    cases = {
        "variants": _case(q, k, v, (1, hq_chunks, (10, 20), 8), (1, hkv_chunks, (15, 15, 15), 8), **kw),
        "plain": _case(q, k, v, (2, hq_chunks, 30, 8), (2, hkv_chunks, (20, 25), 8), enable_gqa=True),
    }
    _verify(client, cases)


@pytest.mark.parametrize("hq_chunks,hkv_chunks", [((1, 3), (2, 2)), ((4,), (1, 1, 1, 1)), ((1, 1, 2), (3, 1))])
def test_gqa_head_chunks_of_equal_head_counts(client, hq_chunks, hkv_chunks):
    """enable_gqa with Hq == Hkv: the query heads chunked freely too (a ValueError asking for a
    rechunk before); the kv heads follow the query's chunks."""
    q, k, v = _qkv((2, 4, 12, 8), (2, 4, 20, 8), seed=7)
    cases = {
        "gqa1": _case(q, k, v, (1, hq_chunks, 12, 8), (1, hkv_chunks, (8, 12), 8), enable_gqa=True, is_causal=True)
    }
    _verify(client, cases)


def test_broadcast_leading_axes(client):
    q, k, v = _qkv((3, 4, 24, 8), (1, 4, 40, 8), seed=6)
    k3, v3 = k.repeat(3, 0), v.repeat(3, 0)
    cases = {
        "key batch 1": _case(q, k, v, (1, 2, (12, 12), 8), (1, 2, (25, 15), 8), is_causal=True),
        "query heads 1": _case(q[:, :1], k3, v3, (2, 1, 24, 8), ((2, 1), 2, (25, 15), 8)),
        # 3-D (H, L, E) and 2-D (L, E) inputs
        "3-D": _case(
            q[0], k[0], v[0], (2, (12, 12), 8), (2, (25, 15), 8), window=(4, 4), alibi_slopes=0.3 * np.ones(4)
        ),
        "2-D": _case(q[0, 0], k[0, 0], v[0, 0], ((5, 19), 8), ((9, 31), 8), is_causal=True, sinks=0.5, kv_lens=33),
    }
    _verify(client, cases)


MASKS = {
    "bool-per-batch": (lambda r: r.random((B, 1, LQ, LK)) > 0.3, (1, 1, (10, 25, 13), (14, 6, 20, 21))),
    "float-per-head": (lambda r: r.standard_normal((1, H, LQ, LK)), (1, 2, (10, 25, 13), (14, 6, 20, 21))),
    "padding": (lambda r: np.arange(LK)[None, None, None, :] < np.array([LK, 35])[:, None, None, None], None),
    "padding-dask": (
        lambda r: np.arange(LK)[None, None, None, :] < np.array([LK, 35])[:, None, None, None],
        (1, 1, 1, (14, 6, 20, 21)),
    ),
    "2d-float-inf": (lambda r: np.where(r.random((LQ, LK)) > 0.8, -np.inf, 0.5), ((10, 25, 13), (14, 6, 20, 21))),
    "rows-all-masked": (lambda r: np.arange(LQ)[:, None] % 7 != 3, None),
}


@pytest.mark.parametrize("variant", ["plain", "causal-br", "alibi-causal-br", "window"])
def test_masks_chunked_like_the_scores(client, variant):
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), seed=7)
    cq, ck = (1, 2, (10, 25, 13), E), (1, 2, (14, 6, 20, 21), E)
    cases = {}
    for name, (make, chunks) in MASKS.items():
        cases[name] = _case(q, k, v, cq, ck, make(_rng(8)), chunks, **VARIANTS[variant])
    _verify(client, cases)


def test_kv_lens(client):
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), seed=9)
    cq, ck = (1, 2, (10, 38), E), (1, 2, (14, 6, 20, 21), E)
    cases = {}
    for t, kw in enumerate(({}, dict(is_causal=True, alibi_slopes=np.ones(H)), dict(window=(3, 3), sinks=np.zeros(H)))):
        for lens in ([19, 0], [61, 40]):
            cases[f"variant {t} kv_lens {lens}"] = _case(q, k, v, cq, ck, kv_lens=np.array(lens), **kw)
    _verify(client, cases)


def test_kv_lens_bottom_right(client):
    """Bottom-right with kv_lens aligns each sequence at its own kv_lens[b] - Lq: blocks carry one
    offset per sequence (causal, window, ALiBi; GQA; Lq and Lk chunked)."""
    q, k, v = _qkv((B, H, LQ, E), (B, H, LK, E), seed=10)
    cq, ck = (1, 2, (10, 38), E), (1, 2, (14, 6, 20, 21), E)
    cases = {}
    variants = (
        dict(is_causal=True),
        dict(is_causal=True, alibi_slopes=np.linspace(0.2, 0.9, H)),
        dict(window=(5, 2), sinks=np.zeros(H)),
        dict(window=(7, 0), alibi_slopes=np.ones(H), softcap=3.0),
    )
    for t, kw in enumerate(variants):
        for lens in ([LK, 30], [55, 49], [LQ, 0]):
            cases[f"variant {t} kv_lens {lens}"] = _case(
                q, k, v, cq, ck, kv_lens=np.array(lens), causal_align="bottom_right", **kw
            )
    qg, kg, vg = _qkv((B, 4, LQ, E), (B, 2, LK, E), seed=11)
    cases["gqa"] = _case(
        qg, kg, vg, (2, 4, (20, 28), E), (2, 1, (30, 31), E), kv_lens=np.array([61, 33]),
        causal_align="bottom_right", is_causal=True, enable_gqa=True,
    )  # fmt: skip
    _verify(client, cases)


def test_half_kv_empty_axes_and_1d_masks(client):
    """float16 K/V with a float32 query (read as they are, computed in float32); empty Lq, Lk or
    batch; masks with only a key axis, bool and float."""
    q, k, v = _qkv((1, 2, 20, 8), (1, 2, 30, 8), seed=18)
    kh, vh = k.astype(np.float16), v.astype(np.float16)
    cq, ck = (1, 1, (10, 10), 8), (1, 1, (15, 15), 8)
    cases = {
        "float16 K/V": _case(q, kh, vh, cq, ck, is_causal=True, alibi_slopes=np.array([0.2, 0.4])),
        "Lq = 0": _case(q[:, :, :0], k, v, (1, 1, 0, 8), ck, is_causal=True),
        "Lk = 0": _case(q, k[:, :, :0], v[:, :, :0], cq, (1, 1, 0, 8), sinks=np.array([0.1, 0.2])),
        "B = 0": _case(q[:0], k[:0], v[:0], (0, 1, (10, 10), 8), (0, 1, (15, 15), 8)),
        "1-D bool mask": _case(q, k, v, cq, ck, np.arange(30) < 20),
        "1-D float mask": _case(q, k, v, cq, ck, np.linspace(-1.0, 0.0, 30), window=(3, 3)),
    }
    _verify(client, cases)


def test_split_every_and_tree_depth(client):
    q, k, v = _qkv((1, 2, 16, 8), (1, 2, 64, 8), seed=10)
    for split_every, merges in ((2, 4 + 2 + 1), (3, 3 + 1), (4, 2 + 1), (8, 1)):
        out = _check(client, q, k, v, (1, 2, 16, 8), (1, 2, (8,) * 8, 8), split_every=split_every)
        layers = out.__dask_graph__().layers
        counts = {name.split("-")[2]: len(layer) for name, layer in layers.items() if name.startswith("pyattn-sdpa-")}
        assert counts["block"] == 8 and counts.get("merge", 0) == merges, counts


def test_feature_axis_rechunked_with_a_warning(client):
    q, k, v = _qkv((1, 2, 20, 16), (1, 2, 30, 16), seed=11)
    dq = da.from_array(q, chunks=(1, 1, 10, 8))
    dk = da.from_array(k, chunks=(1, 1, 15, 4))
    dv = da.from_array(v, chunks=(1, 1, 15, 16))
    with pytest.warns(da.core.PerformanceWarning, match="feature axis"):
        out = pdask.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    _close(client.compute(out, sync=True), pyattn.scaled_dot_product_attention(q, k, v, is_causal=True), "output")


# ----------------------------------------------------------------------------- the graph


def _deps(graph):
    """{key: set of keys it reads}, whatever the task representation of this dask version."""
    from dask.core import get_dependencies

    return {key: set(get_dependencies(graph, key)) for key in graph}


def _layer_keys(graph, prefix):
    return [key for key in graph if isinstance(key, tuple) and key[0].startswith(prefix)]


def test_no_task_reads_the_whole_key(client):
    """With Lk in 6 chunks, every task reads at most one chunk of K (and of V): the merge tree
    reads states, never keys."""
    rng = _rng(12)
    dq = da.from_array(rng.standard_normal((1, 4, 64, 16)).astype(np.float32), chunks=(1, 2, 32, 16))
    dk = da.random.default_rng(13).standard_normal((1, 4, 600, 16), chunks=(1, 2, 100, 16)).astype(np.float32)
    dv = da.random.default_rng(14).standard_normal((1, 4, 600, 16), chunks=(1, 2, 100, 16)).astype(np.float32)
    out, lse = pdask.scaled_dot_product_attention(dq, dk, dv, return_lse=True, split_every=2)
    graph = dict(dask.array.Array.__dask_optimize__(out.__dask_graph__(), out.__dask_keys__()))
    deps = _deps(graph)
    k_keys = {key for key in graph if key[0] == dk.name}
    v_keys = {key for key in graph if key[0] == dv.name}
    assert len(k_keys) == 12 and len(v_keys) == 12  # 6 Lk chunks x 2 head chunks
    readers = [key for key, d in deps.items() if d & k_keys]
    assert readers, "no task reads K"
    for key in readers:
        assert len(deps[key] & k_keys) == 1, f"{key} reads {len(deps[key] & k_keys)} key chunks"
        assert len(deps[key] & v_keys) == 1
    # no task anywhere gathers more than one key chunk (the merges read partial states only)
    assert max(len(d & k_keys) for d in deps.values()) == 1
    o, l = client.compute([out, lse], sync=True)
    ro, rl = pyattn.scaled_dot_product_attention(dq.compute(), dk.compute(), dv.compute(), return_lse=True)
    _close(o, ro, "output")
    _close(l, rl, "lse")


def _expected_blocks(qc, kc, off, left, right):
    qs = np.concatenate([[0], np.cumsum(qc)])
    ks = np.concatenate([[0], np.cumsum(kc)])
    n = 0
    for i in range(len(qc)):
        rows = np.arange(qs[i], qs[i + 1])[:, None]
        for j in range(len(kc)):
            cols = np.arange(ks[j], ks[j + 1])[None, :]
            vis = np.ones((rows.size, cols.size), bool)
            if right is not None:
                vis &= cols <= rows + off + right
            if left is not None:
                vis &= cols >= rows + off - left
            n += bool(vis.any())
    return n


@pytest.mark.parametrize(
    "kw,left,right",
    [
        (dict(is_causal=True), None, 0),
        (dict(is_causal=True, causal_align="bottom_right"), None, 0),
        (dict(is_causal=True, window=(15, 0)), 15, 0),
        (dict(window=(10, 4)), 10, 4),
        (dict(window=(0, None)), 0, None),
    ],
)
def test_hidden_blocks_are_not_scheduled(client, kw, left, right):
    """Blocks that causal or the window hide wholly are not in the graph, and the scheduler runs
    exactly the visible ones (counted in its task stream)."""
    qc, kc = (16, 16, 16, 16, 8), (16, 16, 16, 16, 16, 16)
    q, k, v = _qkv((1, 2, sum(qc), 8), (1, 2, sum(kc), 8), seed=15)
    off = sum(kc) - sum(qc) if kw.get("causal_align") == "bottom_right" else 0
    expected = _expected_blocks(qc, kc, off, left, right)
    assert expected < len(qc) * len(kc)
    dq = da.from_array(q, chunks=(1, 2, qc, 8))
    dk = da.from_array(k, chunks=(1, 2, kc, 8))
    out = pdask.scaled_dot_product_attention(dq, dk, dk, **kw)
    assert len(_layer_keys(dict(out.__dask_graph__()), "pyattn-sdpa-block-")) == expected
    with distributed.get_task_stream(client) as ts:
        o = client.compute(out, sync=True)
    ran = [t["key"] for t in ts.data if "pyattn-sdpa-block-" in str(t["key"])]
    assert len(ran) == expected, (len(ran), expected)
    _close(o, pyattn.scaled_dot_product_attention(q, k, k, **kw), "output")


def test_lazy_nothing_computed_at_call(client):
    """The call builds a graph only: a key whose chunks raise when computed does not raise."""

    def boom(x):
        raise RuntimeError("computed too early")

    q, k, v = _qkv((1, 2, 16, 8), (1, 2, 32, 8), seed=16)
    dk = da.from_array(k, chunks=(1, 2, 16, 8)).map_blocks(boom, dtype=k.dtype)
    out = pdask.scaled_dot_product_attention(da.from_array(q), dk, da.from_array(v, chunks=(1, 2, 16, 8)))
    assert out.shape == (1, 2, 16, 8)
    with pytest.raises(RuntimeError, match="computed too early"):
        client.compute(out, sync=True)


# ----------------------------------------------------------------------------- a worker dies


def _die_once(x, marker, block_id=None):
    """Kills its worker process the first time the third key chunk is computed (the marker file
    holds the pid it killed); the rerun on a live worker passes the chunk through."""
    if block_id[-2] == 2 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os._exit(1)
    return x


def test_worker_killed_mid_compute(client, tmp_path):
    marker = str(tmp_path / "killed")
    q, k, v = _qkv((1, 4, 64, 16), (1, 4, 256, 16), seed=17)
    pids_before = set(client.run(os.getpid).values())
    dk = da.from_array(k, chunks=(1, 2, 64, 16)).map_blocks(_die_once, marker, dtype=k.dtype)
    dq = da.from_array(q, chunks=(1, 2, 32, 16))
    dv = da.from_array(v, chunks=(1, 2, 64, 16))
    kw = dict(is_causal=True, causal_align="bottom_right", return_lse=True)  # every key chunk is visible
    out, lse = pdask.scaled_dot_product_attention(dq, dk, dv, **kw)
    o, l = client.compute([out, lse], sync=True)
    assert os.path.exists(marker), "no worker was killed"
    killed = int(open(marker).read())
    assert killed in pids_before
    ro, rl = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    _close(o, ro, "output")
    _close(l, rl, "lse")
    client.wait_for_workers(2, timeout=60)  # the nanny restarted it, for the tests after this one
    assert killed not in set(client.run(os.getpid).values())


# ----------------------------------------------------------------------------- errors


def _dq(shape=(1, 2, 16, 8), chunks=(1, 2, 8, 8)):
    return da.from_array(np.zeros(shape, np.float32), chunks=chunks)


def test_errors_non_dask_inputs():
    q = _dq()
    with pytest.raises(TypeError, match="key must be a dask.array.Array.*numpy"):
        pdask.scaled_dot_product_attention(q, np.zeros((1, 2, 16, 8), np.float32), q)
    with pytest.raises(TypeError, match="query must be a dask.array.Array"):
        pdask.scaled_dot_product_attention(np.zeros((1, 2, 16, 8)), q, q)
    with pytest.raises(TypeError, match="value must be a dask.array.Array.*list"):
        pdask.scaled_dot_product_attention(q, q, [[0.0]])


def test_errors_unsupported_keywords():
    q = _dq()
    with pytest.raises(ValueError, match="return_weights=True is not supported by pyattn.dask"):
        pdask.scaled_dot_product_attention(q, q, q, return_weights=True)
    with pytest.raises(ValueError, match="out= is not supported"):
        pdask.scaled_dot_product_attention(q, q, q, out=np.empty((1, 2, 16, 8), np.float32))
    with pytest.raises(TypeError):
        pdask.scaled_dot_product_attention(q, q, q, need_weights=True)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="split_every must be an int >= 2"):
            pdask.scaled_dot_product_attention(q, q, q, split_every=bad)


def test_errors_mismatched_chunks():
    q = _dq()
    k = _dq(chunks=(1, 2, 4, 8))
    with pytest.raises(
        ValueError, match=r"value is chunked \(8, 8\) along Lk .* output's Lk is chunked \(4, 4, 4, 4\)"
    ):
        pdask.scaled_dot_product_attention(q, k, q)
    with pytest.raises(ValueError, match=r"key is chunked \(1, 1\) along leading axis 1.*rechunk"):
        pdask.scaled_dot_product_attention(q, _dq(chunks=(1, 1, 8, 8)), _dq(chunks=(1, 1, 8, 8)))
    m = da.from_array(np.ones((16, 16), bool), chunks=(4, 8))
    with pytest.raises(ValueError, match=r"attn_mask is chunked \(4, 4, 4, 4\) along Lq"):
        pdask.scaled_dot_product_attention(q, q, q, m)
    m = da.from_array(np.ones((16, 16), bool), chunks=(8, 4))
    with pytest.raises(ValueError, match=r"attn_mask is chunked \(4, 4, 4, 4\) along Lk"):
        pdask.scaled_dot_product_attention(q, q, q, m)
    # GQA: key and value must agree on their heads chunks
    qg = _dq((1, 4, 16, 8), (1, 2, 8, 8))
    with pytest.raises(ValueError, match="key and value are chunked differently along their heads axis"):
        pdask.scaled_dot_product_attention(qg, _dq(chunks=(1, 1, 8, 8)), _dq(), enable_gqa=True)


def test_mismatched_chunks_message_names_the_callers_axis_and_its_fix(rng):
    """Arrays of fewer axes than the output (a 2-D mask, a 3-D value): the message gives the
    caller's shape and an axis of the caller's array, and the rechunk it suggests runs and fixes
    the call (it named the axis of the array aligned to the output's rank: AxisError, or another
    axis)."""
    import ast
    import re

    q = da.from_array(rng.random((2, 4, 10, 8), np.float32), chunks=(1, 2, 3, 8))
    k = da.from_array(rng.random((2, 4, 13, 8), np.float32), chunks=(1, 2, 4, 8))
    m = da.from_array(rng.random((10, 13)) > 0.3, chunks=(5, 4))
    v3 = da.from_array(rng.random((4, 13, 8), np.float32), chunks=(2, 7, 8))
    for args, name, shape in (((q, k, k, m), "attn_mask", "(10, 13)"), ((q, k, v3), "value", "(4, 13, 8)")):
        with pytest.raises(ValueError, match=re.escape(f"of shape {shape})")) as info:
            pdask.scaled_dot_product_attention(*args)
        fix = re.search(rf"{name}\.rechunk\((.*)\), so that", str(info.value)).group(1)
        fixed = [a.rechunk(ast.literal_eval(fix)) if a is args[3 if name == "attn_mask" else 2] else a for a in args]
        got = pdask.scaled_dot_product_attention(*fixed).compute()
        want = pyattn.scaled_dot_product_attention(*(np.asarray(a) for a in args))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_errors_unknown_chunks():
    q = _dq()
    keep = da.from_array(np.arange(16) % 3 != 0, chunks=8)
    k = q[:, :, keep]  # boolean indexing by a Dask array: the Lk chunk sizes are unknown
    assert any(np.isnan(c) for c in k.chunks[2])
    with pytest.raises(ValueError, match=r"key has unknown chunk sizes.*key.compute_chunk_sizes\(\)"):
        pdask.scaled_dot_product_attention(q, k, k)


def test_errors_unknown_mask_chunks():
    """A Dask mask with unknown chunk sizes gets the inputs' message (it read as a wrong shape)."""
    q = _dq()
    keep = da.from_array(np.ones(16, bool), chunks=8)
    m = da.from_array(np.ones((16, 16), bool), chunks=8)[keep]
    with pytest.raises(ValueError, match=r"attn_mask has unknown chunk sizes.*attn_mask.compute_chunk_sizes\(\)"):
        pdask.scaled_dot_product_attention(q, q, q, m)


def test_errors_name_the_real_shapes():
    """Shape errors name the arrays' shapes, as the NumPy function's do: they once showed the
    (..., 1, 1) stand-ins the graph is checked on."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 3, 6, 8)), rng.standard_normal((2, 2, 10, 8))
    dq, dk = da.from_array(q, chunks=(1, 1, 3, 8)), da.from_array(k, chunks=(1, 1, 5, 8))
    for call in (pyattn.scaled_dot_product_attention, pdask.scaled_dot_product_attention):
        args = (q, k, k) if call is pyattn.scaled_dot_product_attention else (dq, dk, dk)
        with pytest.raises(ValueError, match=r"query heads \(3, shape \(2, 3, 6, 8\)\).*\(2, shape \(2, 2, 10, 8\)\)"):
            call(*args, enable_gqa=True)
        mask = np.ones((3, 1, 6, 10), bool)
        with pytest.raises(ValueError, match=r"attn_mask has shape \(3, 1, 6, 10\); .* to \(2, 2, 6, 10\)"):
            call(args[0][:, :2], args[1], args[2], mask)


def test_errors_shapes_and_dtypes():
    q = _dq()
    with pytest.raises(ValueError, match="key has feature size 4"):
        pdask.scaled_dot_product_attention(q, _dq((1, 2, 16, 4), (1, 2, 8, 4)), q)
    with pytest.raises(ValueError, match="value has length 12"):
        pdask.scaled_dot_product_attention(q, q, _dq((1, 2, 12, 8), (1, 2, 6, 8)))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        pdask.scaled_dot_product_attention(da.zeros(8, chunks=4), q, q)
    with pytest.raises(TypeError, match="query"):
        pdask.scaled_dot_product_attention(da.zeros((1, 2, 16, 8), dtype=np.int32, chunks=8), q, q)
    with pytest.raises(ValueError, match="attn_mask has shape"):
        pdask.scaled_dot_product_attention(q, q, q, np.ones((3, 16), bool))
    with pytest.raises(TypeError, match="attn_mask"):
        pdask.scaled_dot_product_attention(q, q, q, np.ones((16, 16), np.int32))
    with pytest.raises(ValueError, match="enable_gqa"):
        pdask.scaled_dot_product_attention(_dq((1, 3, 16, 8), 8), q, q, enable_gqa=True)
    with pytest.raises(ValueError, match="causal_align"):
        pdask.scaled_dot_product_attention(q, q, q, is_causal=True, causal_align="middle")
    with pytest.raises(ValueError, match="window"):
        pdask.scaled_dot_product_attention(q, q, q, window=(-1, 0))
    with pytest.raises(ValueError, match="alibi_slopes"):
        pdask.scaled_dot_product_attention(q, q, q, alibi_slopes=np.ones(3))
    with pytest.raises(ValueError, match="kv_lens must be in"):
        pdask.scaled_dot_product_attention(q, q, q, kv_lens=np.array([17]))
    for bad in ("a", 1j, True, np.ones(2)):  # the NumPy function's check and message
        with pytest.raises(TypeError, match="scale must be a real number"):
            pdask.scaled_dot_product_attention(q, q, q, scale=bad)


def test_import_pyattn_without_dask():
    """pyattn imports without Dask; pyattn.dask then names the extra to install."""
    code = (
        "import sys; sys.modules['dask'] = None\n"
        "import pyattn\n"
        "try:\n    import pyattn.dask\nexcept ImportError as e:\n    print('ImportError:', e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert 'ImportError: pyattn.dask needs Dask: `pip install "dask[array]" distributed`' in res.stdout


def _random_case(rng):
    """A random problem, chunking and combination of variants (the sweep's one draw)."""
    gqa = rng.random() < 0.3
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.integers(2, 4)) if gqa else hkv
    lq, lk, e = int(rng.integers(1, 40)), int(rng.integers(1, 60)), int(rng.choice([4, 8]))

    def split(n):
        cuts = np.unique(rng.integers(1, n, size=int(rng.integers(0, 5)))) if n > 1 else []
        return tuple(int(c) for c in np.diff(np.concatenate([[0], cuts, [n]])))

    q, k, v = _qkv((2, hq, lq, e), (2, hkv, lk, e), ev=int(rng.choice([4, 6])), seed=int(rng.integers(1 << 30)))
    kw = {"is_causal": bool(rng.random() < 0.5), "causal_align": str(rng.choice(["top_left", "bottom_right"]))}
    if rng.random() < 0.4:
        kw["window"] = tuple(None if rng.random() < 0.3 else int(rng.integers(0, 12)) for _ in range(2))
    if rng.random() < 0.4:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, hq)
    if rng.random() < 0.3:
        kw["sinks"] = rng.standard_normal(hq)
    if rng.random() < 0.2:
        kw["softcap"] = 2.0
    if rng.random() < 0.2:
        kw["kv_lens"] = rng.integers(0, lk + 1, size=2)
    mask, mchunks = None, None
    qc, kc = split(lq), split(lk)
    if rng.random() < 0.3:
        mask = rng.random((2, 1, lq, lk)) > 0.2
        mchunks = (1, 1, qc, kc)
    hc = split(hq) if gqa else (hkv,)
    return _case(q, k, v, (1, hc, qc, e), (1, split(hkv) if gqa else hc, kc, e), mask, mchunks, enable_gqa=gqa, **kw)


def test_random_sweep(client):
    """60 random shapes, chunkings and variants (fixed seed), all against the NumPy call."""
    rng = _rng(2026)
    _verify(client, {f"draw {t}": _random_case(rng) for t in range(60)})


def test_infinite_sink_takes_all_the_weight_as_in_numpy():
    """A +inf sink: zeros and lse +inf, as the NumPy function gives, however the keys are chunked
    (the merge read exp(inf - inf) as NaN)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    kw = dict(sinks=np.array([np.inf, 0.0]), return_lse=True)
    o, l = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    for kc in (6, 3, 2):
        with dask.config.set(scheduler="synchronous"):
            do, dl = pdask.scaled_dot_product_attention(
                da.from_array(q, chunks=(1, 2, 3, 8)), da.from_array(k, chunks=(1, 2, kc, 8)),
                da.from_array(v, chunks=(1, 2, kc, 8)), **kw,
            )  # fmt: skip
            do, dl = do.compute(), dl.compute()
        assert not do[0, 0].any() and (dl[0, 0] == np.inf).all()
        np.testing.assert_allclose(do, o, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dl, l, rtol=1e-12)


@pytest.mark.parametrize("kc", [4, 3, 1])
def test_nan_value_hidden_only_by_the_mask_reaches_the_output(kc):
    """A non-finite value row hidden from a query only by attn_mask reaches that query's output
    (docs/api.md), also when every key of its chunk is hidden: such a chunk's state has lse -inf,
    and the merge dropped its NaN (finite numbers, or zeros for a row masked off every key)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 4, 8)) for _ in range(3))
    k, v = np.concatenate([k, k], axis=2), np.concatenate([v, v], axis=2)
    v[0, 0, 6, 2] = np.nan
    mask = np.ones((4, 8), bool)
    mask[1, 4:] = False  # row 1 sees keys 0..3
    mask[2] = False  # row 2 sees none
    want, wl = pyattn.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    assert np.isnan(want[0, 0, 1, 2]) and np.isnan(want[0, 0, 2, 2]) and not np.isnan(want[0, 0, 1, :2]).any()
    with dask.config.set(scheduler="synchronous"):
        got, gl = pdask.scaled_dot_product_attention(
            da.from_array(q, chunks=(1, 1, 2, 8)), da.from_array(k, chunks=(1, 1, kc, 8)),
            da.from_array(v, chunks=(1, 1, kc, 8)), mask, return_lse=True,
        )  # fmt: skip
        got, gl = dask.compute(got, gl)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-12, equal_nan=True)
    np.testing.assert_allclose(gl, wl, rtol=1e-12)


def test_state_pickles_lse_first():
    """A state sent between workers carries its lse as the first out-of-band buffer: Dask reads
    that one into the message's own buffer at an arbitrary offset, the output into one of its own
    (aligned), so the merge need not copy the output."""
    import pickle

    out = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    lse = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
    state = pdask._State((out, lse))
    buffers = []
    data = pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    assert [b.raw().nbytes for b in buffers] == [lse.nbytes, out.nbytes]
    back = pickle.loads(data, buffers=buffers)
    assert isinstance(back, pdask._State)
    assert back[0].dtype == np.float32 and np.array_equal(back[0], out)
    assert back[1].dtype == np.float64 and np.array_equal(back[1], lse)
    # and Dask's own serialisation of a task's result keeps that order
    from distributed.protocol import deserialize, serialize

    header, frames = serialize(state)
    assert [memoryview(f).nbytes for f in frames][-2:] == [lse.nbytes, out.nbytes]
    back = deserialize(header, frames)
    assert np.array_equal(back[0], out) and np.array_equal(back[1], lse)


@pytest.mark.parametrize("kc", [2, 3, 1])
def test_bool_mask_hides_non_finite_keys_under_alibi(kc):
    """A key the boolean mask hides has its score replaced (no NaN from a NaN or infinite key),
    also where a chunk's ALiBi offset is neither top-left nor bottom-right and the chunk's call
    takes the mask as a float mask of -inf; a value row hidden only by the mask still reaches the
    output as 0 * value, as in the NumPy call."""
    rng = np.random.default_rng(0)
    q = np.abs(rng.standard_normal((2, 2, 6, 8)))
    k, v = rng.standard_normal((2, 2, 6, 8)), rng.standard_normal((2, 2, 6, 8))
    k[0, 0, 0] = np.nan
    k[1, 1, 4] = np.inf
    v[1, 0, 5, 3] = np.nan
    mask = np.ones((6, 6), bool)
    mask[:, 0] = False  # the NaN key, hidden from every query
    mask[1:, 4] = False  # the inf key, seen by query 0 only
    mask[2, 5] = False  # the NaN value, hidden from query 2 only
    mask[3, :] = False  # query 3 sees no key
    kw = dict(alibi_slopes=np.array([0.5, 0.25]), return_lse=True)
    want = pyattn.scaled_dot_product_attention(q, k, v, mask, **kw)
    assert not np.isnan(want[0][0, 0]).any() and np.isnan(want[0][1, 0, 2, 3])
    for variant in ({}, dict(is_causal=True), dict(window=(2, 1))):
        want = pyattn.scaled_dot_product_attention(q, k, v, mask, **kw, **variant)
        with dask.config.set(scheduler="synchronous"):
            got = pdask.scaled_dot_product_attention(
                da.from_array(q, chunks=(1, 2, 2, 8)), da.from_array(k, chunks=(1, 2, kc, 8)),
                da.from_array(v, chunks=(1, 2, kc, 8)), mask, **kw, **variant,
            )  # fmt: skip
            got = dask.compute(*got)
        _close(got[0], want[0], f"{variant} output")
        _close(got[1], want[1], f"{variant} lse")


def test_infinite_sink_keeps_the_keys_nan():
    """With a +inf sink the NumPy call's output is 0 times the keys' output: NaN where that is
    NaN (a NaN value, query or score); the merge with the sink's state must keep it."""
    rng = np.random.default_rng(0)
    q = np.abs(rng.standard_normal((1, 2, 4, 4)))
    k, v = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    v[0, 0, 1, 0] = np.nan
    k[0, 1, 3] = np.inf
    q[0, 1, 2, 1] = np.nan
    kw = dict(sinks=np.array([np.inf, np.inf]), return_lse=True)
    want = pyattn.scaled_dot_product_attention(q, k, v, **kw)
    assert np.isnan(want[0][0, 0, :, 0]).all() and np.isnan(want[0][0, 1]).all()
    for kc in (5, 2):
        with dask.config.set(scheduler="synchronous"):
            got = pdask.scaled_dot_product_attention(
                da.from_array(q, chunks=(1, 2, 2, 4)), da.from_array(k, chunks=(1, 2, kc, 4)),
                da.from_array(v, chunks=(1, 2, kc, 4)), **kw,
            )  # fmt: skip
            got = dask.compute(*got)
        _close(got[0], want[0], f"kc {kc} output")
        _close(got[1], want[1], f"kc {kc} lse")


@pytest.mark.parametrize("shape", [(1,), ()])
def test_per_head_values_without_a_head_axis(shape):
    """2-D inputs (no head axis): one ALiBi slope or sink given as shape (1,) or (), as the NumPy
    call takes them; a wrong length is refused naming the argument."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((6, 4)).astype(np.float32) for _ in range(3))
    for name, value in (("alibi_slopes", 0.3), ("sinks", 0.5)):
        kw = {name: np.full(shape, value)}
        want = pyattn.scaled_dot_product_attention(q, k, v, **kw)
        with dask.config.set(scheduler="synchronous"):
            got = pdask.scaled_dot_product_attention(*(da.from_array(x, chunks=(3, 4)) for x in (q, k, v)), **kw)
            got = got.compute()
        _close(got, want, name)
        with pytest.raises(ValueError, match=name):
            pdask.scaled_dot_product_attention(
                *(da.from_array(x, chunks=(3, 4)) for x in (q, k, v)), **{name: np.ones(2)}
            )


@pytest.mark.parametrize("c", [0.0, -1e3, -1e4])
def test_large_lse_error_bounded_by_the_kernels_lse_rounding(c):
    """docs/dask.md, "Precision": each merge weight exp(lse_n - lse) carries the kernel's float32
    rounding of lse_n, a relative error of at most about |lse| * 6e-8; a constant float mask c
    (which softmax ignores) makes |lse| ~ |c|. The sharded result stays within that bound of the
    single call (measured: 3.7e-5 at c = -1e3, 4.1e-4 at -1e4), and at c = 0 within 1e-6."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in [(1, 2, 8, 16), (1, 2, 64, 16), (1, 2, 64, 16)])
    m = np.full((8, 64), c, np.float32)
    single = pyattn.scaled_dot_product_attention(q, k, v, m)
    with dask.config.set(scheduler="synchronous"):
        sharded = pdask.scaled_dot_product_attention(
            da.from_array(q), da.from_array(k, chunks=(1, 2, 16, 16)), da.from_array(v, chunks=(1, 2, 16, 16)), m
        ).compute()
    err = np.abs(sharded - single).max() / np.abs(single).max()
    lse = np.abs(c) + np.log(64) + 4.0  # |lse| bound: |c| plus log Lk plus the scores' size
    assert err <= max(1e-6, 2 * lse * 2.0**-24), (c, err)
