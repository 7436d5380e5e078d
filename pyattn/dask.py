"""Exact attention over Dask arrays: sharded by batch, heads, queries and keys.

``pyattn.dask.scaled_dot_product_attention`` takes Dask arrays and returns a lazy Dask array (and
the lse with ``return_lse=True``) equal to :func:`pyattn.scaled_dot_product_attention` on the
whole arrays. Each task is one pyattn call on one (leading block, query chunk, key chunk); the
key chunks of a query chunk are merged exactly through their log-sum-exp
(:func:`pyattn.merge_attention_states`) in a tree of fan-in ``split_every``, so no task ever holds
all of K/V. Blocks that causal alignment or the window hide entirely are left out of the graph.

Needs dask[array] and distributed: ``pip install "dask[array]" distributed``, or pyattn's ``dask`` extra
(``pip install ".[dask]"`` in a checkout).
"""

from __future__ import annotations

try:
    import dask
    import dask.array as da
    from dask.array.core import PerformanceWarning
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test without dask
    raise ImportError(
        'pyattn.dask needs Dask: `pip install "dask[array]" distributed` (pyattn\'s "dask" extra, '
        f'`pip install ".[dask]"` in a checkout); the import failed with: {exc}'
    ) from exc

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ._api import scaled_dot_product_attention as _sdpa
from ._merge import merge_states_f64
from ._validate import (
    NO_LIMIT,
    alibi_span,
    broadcast_named,
    check_gqa_heads,
    integer_array,
    kernel_factors,
    scale_value,
    softcap_value,
    window_sides,
)

__all__ = ["scaled_dot_product_attention"]

_F64 = np.dtype(np.float64)
_ONE = "one per query head"  # (the NumPy call's words for a per-head value)


# ----------------------------------------------------------------------------- geometry
#
# Positions: query i and key j of a rectangle of the score matrix are local to it; ``d`` is the
# rectangle's offset, so that key j is visible to query i iff  i + d - L <= j <= i + d + R
# (L, R: the window's sides, None = unbounded; causal makes R at most 0). For a whole call,
# d = off (0 top-left, Lk - Lq bottom-right); for the chunk (qs.., ks..) it is qs + off - ks.


def _visible(n: int, nk: int, d: int, L: Optional[int], R: Optional[int]):
    """Rows [a, b) of an n x nk rectangle that see some key, and keys [c, e) that some row sees;
    None when nothing is visible (such a block is never scheduled)."""
    if n <= 0 or nk <= 0:
        return None
    a = 0 if R is None else max(0, -d - R)
    b = n if L is None else min(n, nk - d + L)
    if a >= b:
        return None
    c = 0 if L is None else max(0, a + d - L)
    e = nk if R is None else min(nk, b - 1 + d + R + 1)
    return a, b, c, e


def _window(n: int, nk: int, d: int, L, R, off: int = 0):
    """The ``window=`` that gives offset-d visibility to a pyattn call aligned at ``off`` (0 for
    top-left, nk - n for bottom-right), with None for a side that cuts nothing in the rectangle.
    Callers have sliced the rectangle to its visible part, so both sides are >= 0."""
    left = None if L is None else L - d + off
    right = None if R is None else R + d - off
    if left is not None and n - 1 + off - left <= 0:  # the last row's left edge is at key 0 or before
        left = None
    if right is not None and off + right >= nk - 1:  # the first row's right edge is at the last key or after
        right = None
    if left is None and right is None:
        return None
    assert (left is None or left >= 0) and (right is None or right >= 0), (n, nk, d, L, R, off)
    return (left, right)


@dataclass(frozen=True)
class _Piece:
    """What every task of one call shares (pickled once per task: small)."""

    scale: float
    softcap: Optional[float]
    L: Optional[int]
    R: Optional[int]
    dtype: np.dtype
    ev: int
    group: int  # GQA: query heads per key/value head (1 without GQA)


def _slice_axis(x, axis: int, start: int, stop: int):
    """``x[start:stop]`` along ``axis`` unless x is broadcast (size 1) there."""
    if x is None or x.shape[axis] == 1:
        return x
    idx = [slice(None)] * x.ndim
    idx[axis] = slice(start, stop)
    return x[tuple(idx)]


def _lead(q, k, v, p: "_Piece", gathered: bool = False) -> tuple:
    """The output's leading axes (heads included) of a call on these blocks (gathered: the kv
    head blocks a task's query heads read, as many heads or not)."""
    if p.group > 1 or gathered:
        return np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]) + (q.shape[-3],)
    return np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])


def _empty_state(lead: tuple, n: int, p: "_Piece"):
    return np.zeros(lead + (n, p.ev), p.dtype), np.full(lead + (n,), -np.inf, _F64)


def _merge(states, dtype):
    """Merge (output, lse) states; the lse stays float64 between tasks, so the tree rounds only
    the outputs (to the computation's dtype)."""
    if len(states) == 1:
        return states[0]
    # (a state of lse +inf, a +inf sink, takes all the weight there as in the NumPy function,
    # plus 0 times the other states' outputs, so that their NaN stays)
    out, lse = merge_states_f64([s[0] for s in states], [np.asarray(s[1]) for s in states], dtype)
    # A row that saw no key of a block (lse -inf) adds nothing, except the NaN of a value row that
    # only attn_mask hid from it (0 * NaN): the NumPy function's output holds that NaN, and so
    # must the merged one.
    for o, l in states:
        empty = np.broadcast_to(np.isneginf(l), lse.shape)
        if empty.any():
            carried = np.isnan(np.broadcast_to(o, out.shape)[empty])
            if carried.any():
                out[empty] = np.where(carried, np.nan, out[empty])
    return out, lse


def _attend(q, k, v, m, d, slopes, kv_lens, p: "_Piece"):
    """Attention of the rows of q over the keys of k at offset d: (output in p.dtype, lse in
    float64) for every row of q (a row that sees no key: zeros and -inf)."""
    n, nk = q.shape[-2], k.shape[-2]
    vis = _visible(n, nk, d, p.L, p.R)
    if vis is None:
        return _empty_state(_lead(q, k, v, p), n, p)
    a, b, c, e = vis
    qs, ks, vs = q[..., a:b, :], k[..., c:e, :], v[..., c:e, :]
    ms = _slice_axis(_slice_axis(m, -2, a, b), -1, c, e)
    kl = None if kv_lens is None else np.clip(kv_lens - c, 0, e - c)
    o, l = _attend_rect(qs, ks, vs, ms, d + a - c, slopes, kl, p)
    if (a, b) == (0, n):
        return o, l
    out, lse = _empty_state(o.shape[:-2], n, p)
    out[..., a:b, :] = o
    lse[..., a:b] = l
    return out, lse


def _call(q, k, v, m, window, slopes, kv_lens, p: "_Piece", bottom_right=False):
    o, l = _sdpa(
        q, k, v, m,
        is_causal=False, causal_align="bottom_right" if bottom_right else "top_left", scale=p.scale,
        enable_gqa=p.group > 1, window=window, softcap=p.softcap, alibi_slopes=slopes, kv_lens=kv_lens,
        return_lse=True,
    )  # fmt: skip
    return o, l.astype(_F64)


def _attend_rect(q, k, v, m, d, slopes, kv_lens, p: "_Piece"):
    """The same on a rectangle in which every row sees some key (offset d, window sides >= 0).

    pyattn aligns a call at offset 0 (top-left) or nk - n (bottom-right); a shifted window
    expresses any other offset for causal and window, but ALiBi's |i + d - j| needs the offset
    itself. So ALiBi at another offset is cut into rectangles on one side of the diagonal, where
    -slope * |i + d - j| is a column term (a float mask (..., 1, nk)) plus a row constant added
    to the lse, and a rectangle that starts on the diagonal (offset 0)."""
    n, nk = q.shape[-2], k.shape[-2]
    if slopes is None or d == 0:
        return _call(q, k, v, m, _window(n, nk, d, p.L, p.R), slopes, kv_lens, p)
    if kv_lens is None and d == nk - n:  # bottom-right's own offset: the window keeps its sides
        return _call(q, k, v, m, _window(n, nk, d, p.L, p.R, d), slopes, None, p, bottom_right=True)
    if d >= nk - 1 or d <= 1 - n:
        return _alibi_one_side(q, k, v, m, d, slopes, kv_lens, p)
    if d > 0:  # keys [0, d) lie wholly below the diagonal; keys [d, nk) start on it
        kl1 = None if kv_lens is None else np.minimum(kv_lens, d)
        kl2 = None if kv_lens is None else np.clip(kv_lens - d, 0, nk - d)
        s1 = _attend(q, k[..., :d, :], v[..., :d, :], _slice_axis(m, -1, 0, d), d, slopes, kl1, p)
        s2 = _attend(q, k[..., d:, :], v[..., d:, :], _slice_axis(m, -1, d, nk), 0, slopes, kl2, p)
        return _merge([s1, s2], p.dtype)
    # d < 0: rows [0, -d) lie wholly above the diagonal; rows [-d, n) start on it
    o1, l1 = _attend(q[..., :-d, :], k, v, _slice_axis(m, -2, 0, -d), d, slopes, kv_lens, p)
    o2, l2 = _attend(q[..., -d:, :], k, v, _slice_axis(m, -2, -d, n), 0, slopes, kv_lens, p)
    return np.concatenate([o1, o2], axis=-2), np.concatenate([l1, l2], axis=-1)


def _alibi_one_side(q, k, v, m, d, slopes, kv_lens, p: "_Piece"):
    """ALiBi where i + d - j has one sign over the rectangle: -slope * |i + d - j| is then
    slope * (j - ref) (a column mask, 0 at the reference key, which every row sees) plus a
    per-row constant, added to the lse in float64."""
    n, nk = q.shape[-2], k.shape[-2]
    s = np.asarray(slopes, _F64)  # (..., H): the block's leading axes
    j = np.arange(nk, dtype=_F64)
    i = np.arange(n, dtype=_F64)
    if d >= nk - 1:  # below the diagonal (i + d - j >= 0): the nearest key is the last that exists
        if kv_lens is None:
            ref = np.asarray(nk - 1.0)
        else:
            ref = np.clip(np.asarray(kv_lens, _F64), 1, nk) - 1
            ref = ref[..., None] if s.ndim else ref  # over the heads
        col = s[..., None, None] * (j - ref[..., None, None])
        row = -s[..., None] * (i + d - ref[..., None])
    else:  # above it (j - i - d >= 0): the nearest key is the first
        col = -s[..., None, None] * j
        row = s[..., None] * (i + d)
    col = col.astype(p.dtype)
    if m is None:
        mask = col
    elif m.dtype == np.bool_:
        mask = np.where(m, col, np.asarray(-np.inf, p.dtype))
    else:
        mask = m.astype(p.dtype, copy=False) + col
    o, l = _call(q, k, v, mask, _window(n, nk, d, p.L, p.R), None, kv_lens, p)
    l = l + row
    if m is not None and m.dtype == np.bool_:
        _redo_hidden_nan_rows(o, l, q, k, v, m, d, col, row, kv_lens, p)
    return o, l


def _redo_hidden_nan_rows(o, l, q, k, v, m, d, col, row, kv_lens, p: "_Piece"):
    """A key that the boolean mask hides has its score replaced, as the NumPy call does; the
    float mask of _alibi_one_side adds -inf instead, so a NaN or infinite score there (from a
    non-finite query or key) turns the row NaN. Rows that came out NaN (rare) are recomputed
    one at a time over the keys they see, with the column term as their float mask; a value
    row the mask alone hides still reaches the output as 0 * value (docs/api.md)."""
    bad = np.isnan(l) | np.isnan(o).any(axis=-1)
    if not bad.any():
        return
    n, nk = q.shape[-2], k.shape[-2]
    lead = l.shape[:-1]
    kv_lead = lead[:-1] + (k.shape[-3],) if p.group > 1 else lead
    qb = np.broadcast_to(q, lead + q.shape[-2:])
    kb = np.broadcast_to(k, kv_lead + k.shape[-2:])
    vb = np.broadcast_to(v, kv_lead + v.shape[-2:])
    mb = np.broadcast_to(m, lead + (n, nk))
    cb = np.broadcast_to(col, lead + (1, nk))
    rb = np.broadcast_to(row, lead + (n,))
    lens = None if kv_lens is None else np.broadcast_to(kv_lens, lead[:-1])
    j = np.arange(nk)
    for pos in zip(*np.nonzero(bad)):
        idx, i = tuple(int(x) for x in pos[:-1]), int(pos[-1])
        kidx = idx[:-1] + (idx[-1] // p.group,) if p.group > 1 else idx
        vis = _visible(1, nk, i + d, p.L, p.R)  # the keys [c, e) the row's position lets it see
        placed = (j >= vis[2]) & (j < vis[3]) if vis else np.zeros(nk, bool)
        if lens is not None:
            placed &= j < lens[idx[:-1]]
        seen = placed & mb[idx + (i,)]
        if seen.any():
            ro, rl = _sdpa(
                qb[idx + (i,)][None], kb[kidx][seen], vb[kidx][seen], cb[idx + (0,)][seen][None],
                scale=p.scale, softcap=p.softcap, return_lse=True,
            )  # fmt: skip
            o[idx + (i,)], l[idx + (i,)] = ro[0], float(rl[0]) + rb[idx + (i,)]
        else:
            o[idx + (i,)], l[idx + (i,)] = 0, -np.inf
        hidden = vb[kidx][placed & ~seen]
        if hidden.size:
            o[idx + (i,)][~np.isfinite(hidden).all(axis=0)] = np.nan


# ----------------------------------------------------------------------------- tasks


@dataclass(frozen=True)
class _Block:
    """One task: a query chunk against a key chunk at offset d. The per-head and per-sequence
    values are the block's own slices."""

    d: object  # the offset, or with kv_lens bottom-right one per sequence of the block (an array)
    q_heads: Optional[Tuple[int, int]]  # GQA: the query chunk's head range
    kv_base: int  # GQA: first kv head of the gathered kv blocks
    slopes: Optional[np.ndarray]
    sinks: Optional[np.ndarray]  # only in the one task of a row chunk that counts the sink
    kv_lens: Optional[np.ndarray]


def _gqa_runs(h0: int, h1: int, g: int):
    """Query heads [h0, h1) cut at group boundaries into runs that pyattn's GQA maps as the
    whole call does: runs of whole groups, or parts of one group."""
    runs, s = [], h0
    while s < h1:
        if s % g == 0 and h1 - s >= g:
            e = s + (h1 - s) // g * g
        else:
            e = min(h1, (s // g + 1) * g)
        runs.append((s, e))
        s = e
    return runs


def _with_sinks(state, sinks, dtype):
    out, lse = state
    zero = np.broadcast_to(np.zeros((), dtype), out.shape)
    sink = np.broadcast_to(np.asarray(sinks, _F64)[..., None], lse.shape)
    return _merge([(out, lse), (zero, sink)], dtype)


def _entry(x, b: tuple):
    """Sequence b (an index over the first len(b) axes) of x, kept as axes of size 1; an axis of
    size 1 (broadcast) is read at 0. None stays None."""
    if x is None:
        return None
    x = np.asarray(x)
    return x[tuple(slice(i, i + 1) if x.shape[t] != 1 else slice(None) for t, i in enumerate(b))]


class _State(tuple):
    """A task's (output, lse), pickled lse first. A message's first large buffer is read into
    the buffer that holds the message's header, at whatever offset that leaves (27, 55 and 59
    bytes in traces), and each later one into a buffer of its own: sent output first, every
    state that moved between workers arrived misaligned for its element size, and the merge
    copied its output (16 MiB at B1 H8 L8192 D64) before reading it. Now only the lse, a 64th
    of it at D64, is."""

    __slots__ = ()

    def __reduce__(self):
        return _state_of, (self[1], self[0])


def _state_of(lse, out):
    return _State((out, lse))


def _block_task(p: _Piece, blk: _Block, q, ks, vs, m):
    k = ks[0] if len(ks) == 1 else np.concatenate(ks, axis=-3)
    v = vs[0] if len(vs) == 1 else np.concatenate(vs, axis=-3)
    if isinstance(blk.d, np.ndarray):  # one offset per sequence: each sequence on its own
        lead = blk.d.shape + _lead(q, k, v, p, blk.q_heads is not None)[blk.d.ndim :]
        out, lse = _empty_state(lead, q.shape[-2], p)
        for b in np.ndindex(*blk.d.shape):
            one = _Block(int(blk.d[b]), blk.q_heads, blk.kv_base, _entry(blk.slopes, b), None, _entry(blk.kv_lens, b))
            o, l = _block_task(p, one, _entry(q, b), [_entry(k, b)], [_entry(v, b)], _entry(m, b))
            out[b] = o.reshape(out[b].shape)
            lse[b] = l.reshape(lse[b].shape)
        state = out, lse
    elif blk.q_heads is None:
        state = _attend(q, k, v, m, blk.d, blk.slopes, blk.kv_lens, p)
    else:
        h0, h1 = blk.q_heads
        g = p.group
        out, lse = _empty_state(_lead(q, k, v, p, True), q.shape[-2], p)
        for s, e in _gqa_runs(h0, h1, g):
            k0, k1 = s // g - blk.kv_base, (e - 1) // g + 1 - blk.kv_base
            mh = _slice_axis(m, -3, s - h0, e - h0) if m is not None and m.ndim >= 3 else m
            sl = None if blk.slopes is None else _slice_axis(blk.slopes, -1, s - h0, e - h0)
            o, l = _attend(q[..., s - h0 : e - h0, :, :], k[..., k0:k1, :, :], v[..., k0:k1, :, :], mh, blk.d, sl,
                           blk.kv_lens, p)  # fmt: skip
            out[..., s - h0 : e - h0, :, :] = o
            lse[..., s - h0 : e - h0, :] = l
        state = out, lse
    if blk.sinks is not None:
        state = _with_sinks(state, blk.sinks, p.dtype)
    return _State(state)


def _empty_task(p: _Piece, lead: tuple, n: int, sinks):
    """A query chunk that sees no key at all: zeros, and lse -inf (or the sink)."""
    state = _empty_state(lead, n, p)
    return _State(state if sinks is None else _with_sinks(state, sinks, p.dtype))


def _merge_task(dtype, states):
    return _State(_merge(list(states), dtype))


def _output_of(state):
    return state[0]


def _lse_of(dtype, state):
    return state[1].astype(dtype)


# ----------------------------------------------------------------------------- the graph


def _as_dask(x, name: str):
    if not isinstance(x, da.Array):
        raise TypeError(
            f"{name} must be a dask.array.Array (got {type(x).__module__}.{type(x).__name__}); "
            "wrap NumPy data with dask.array.from_array(x, chunks=...), or call "
            "pyattn.scaled_dot_product_attention for NumPy inputs"
        )
    if any(math.isnan(c) for cs in x.chunks for c in cs):
        raise ValueError(
            f"{name} has unknown chunk sizes (chunks {x.chunks}); call {name}.compute_chunk_sizes() first: "
            "the key and query offsets of every block must be known to build the graph"
        )
    return x


def _whole_last(x, name: str):
    """The feature axis in one chunk: each task needs whole feature vectors for its dot products."""
    if x.ndim and len(x.chunks[-1]) > 1:
        warnings.warn(
            f"pyattn.dask: rechunking {name}'s feature axis (chunks {x.chunks[-1]}) to one chunk; "
            "attention needs whole feature vectors per task (chunk the other axes instead)",
            PerformanceWarning,
            stacklevel=3,
        )
        x = x.rechunk({x.ndim - 1: -1})
    return x


def _align(x, ndim: int):
    return x if x.ndim == ndim else x[(None,) * (ndim - x.ndim)]


def _bounds(chunks):
    starts = np.concatenate([[0], np.cumsum(chunks)]).astype(int)
    return [(int(starts[t]), int(starts[t + 1])) for t in range(len(chunks))]


def _check_chunks(out_chunks, arrays, axis: int, what: str, shapes: dict):
    """Each array is broadcast (size 1) on this axis or chunked exactly as the output. The arrays
    are aligned to the output's rank; the message names the axis from the end, as it is in the
    caller's array (shapes: the caller's shape of each)."""
    size = sum(out_chunks)
    for name, x in arrays:
        if x is None or (x.shape[axis] == 1 and size != 1):
            continue
        if x.chunks[axis] != out_chunks:
            back = axis - x.ndim
            raise ValueError(
                f"{name} is chunked {x.chunks[axis]} along {what} (axis {back} of shape {shapes[name]}) but the "
                f"output's {what} is chunked {out_chunks}; rechunk it to match, e.g. "
                f"{name}.rechunk({{{back}: {out_chunks}}}), so that each task reads one block"
            )


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    *,
    is_causal=False,
    causal_align="top_left",
    scale=None,
    enable_gqa=False,
    return_weights=False,
    return_lse=False,
    out=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    kv_lens=None,
    split_every=None,
):
    """:func:`pyattn.scaled_dot_product_attention` on Dask arrays: a lazy Dask array out.

    ``query``, ``key`` and ``value`` are Dask arrays with pyattn's shapes (``(..., Hq, Lq, E)``,
    ``(..., Hkv, Lk, E)``, ``(..., Hkv, Lk, Ev)``); the keywords are those of the NumPy function
    and mean the same. The graph has one task per (leading block, query chunk, key chunk):

    * chunks along the leading axes (batch, heads) map block by block; with ``enable_gqa`` the
      query heads may be chunked freely, each task gathering the key/value head blocks its query
      heads read;
    * chunks along ``Lq`` split the queries, each with its own causal/window/ALiBi offset;
    * chunks along ``Lk`` give partial attentions merged exactly by their log-sum-exp
      (:func:`pyattn.merge_attention_states`) in a tree of fan-in ``split_every`` (default 4),
      so that no task holds more than one key chunk;
    * blocks that ``is_causal`` or ``window`` hide entirely are not in the graph at all.

    ``attn_mask`` (a Dask or NumPy array, bool or float, broadcastable to ``(..., Hq, Lq, Lk)``)
    is chunked like the scores: along each axis it has size 1 or the output's chunks (Lq chunks
    from ``query``, Lk chunks from ``key``). The feature axes are rechunked to one chunk (with a
    ``PerformanceWarning``); any other chunk mismatch raises ``ValueError``. ``alibi_slopes``,
    ``sinks`` and ``kv_lens`` are small NumPy arrays, sliced into each task.

    Returns the output ``(..., Hq, Lq, Ev)``, chunked like the query's leading and Lq axes, or
    ``(output, lse)`` with ``return_lse=True``. ``return_weights`` and ``out`` are not supported
    (they would materialise ``Lq x Lk`` weights or write into one NumPy array).
    """
    if return_weights:
        raise ValueError(
            "return_weights=True is not supported by pyattn.dask: the weights are (..., Lq, Lk), "
            "exactly what sharding avoids; use return_lse=True to get each row's normaliser"
        )
    if out is not None:
        raise ValueError(
            "out= is not supported by pyattn.dask: the result is a lazy Dask array (use .store() or .compute())"
        )
    q = _as_dask(query, "query")
    k = _as_dask(key, "key")
    v = _as_dask(value, "value")
    for x, name in ((q, "query"), (k, "key"), (v, "value")):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E); got shape {x.shape}")
    m = attn_mask
    if isinstance(m, da.Array):
        m = _as_dask(m, "attn_mask")  # (its chunk sizes known, as the inputs')
    elif m is not None:
        m = np.asarray(m)
    if split_every is None:
        split_every = 4
    if isinstance(split_every, bool) or not isinstance(split_every, (int, np.integer)) or split_every < 2:
        raise ValueError(f"split_every must be an int >= 2 (the merge tree's fan-in); got {split_every!r}")
    split_every = int(split_every)

    # The NumPy function validates everything it can (dtypes, keywords, the per-head values, the
    # mask's dtype, GQA heads, the leading axes) on stride-0 stand-ins of one query and key.
    Lq, E = q.shape[-2:]
    Lk = k.shape[-2]
    if k.shape[-1] != E:
        raise ValueError(f"key has feature size {k.shape[-1]} (shape {k.shape}); expected E = {E} from query {q.shape}")
    if v.shape[-2] != Lk:
        raise ValueError(f"value has length {v.shape[-2]} (shape {v.shape}); expected Lk = {Lk} from key {k.shape}")
    if kv_lens is not None:
        # (ints held as objects, as the NumPy function takes them: int64, or out of range)
        kv_lens = kl = integer_array(np.asarray(kv_lens), "kv_lens")
        if kl.size and (kl.min() < 0 or kl.max() > Lk):
            raise ValueError(f"kv_lens must be in [0, Lk = {Lk}]; got values from {kl.min()} to {kl.max()}")

    if enable_gqa:  # checked here on the real shapes: the stand-ins' (1, 1) would show in its errors
        check_gqa_heads(q.shape, k.shape, v.shape)

    def stand_in(x, shape):
        return np.broadcast_to(np.zeros((), x.dtype), shape)

    def meta(mask):
        return _sdpa(
            stand_in(q, q.shape[:-2] + (1, 1)), stand_in(k, k.shape[:-2] + (1, 1)), stand_in(v, v.shape[:-2] + (1, 1)),
            mask, is_causal=is_causal, causal_align=causal_align, scale=1.0, enable_gqa=enable_gqa,
            return_lse=True, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            kv_lens=None if kv_lens is None else np.zeros(np.shape(kv_lens), np.asarray(kv_lens).dtype),
        )  # fmt: skip

    o_meta, lse_meta = meta(None)
    dtype = o_meta.dtype
    lead = o_meta.shape[:-2]
    n = len(lead)
    Ev = v.shape[-1]
    if m is not None:
        # its shape against the real (Lq, Lk) first (the stand-ins' (1, 1) would show in the
        # NumPy function's message), then the rest of that function's checks of a mask
        if m.ndim > n + 2 or any(s not in (1, t) for s, t in zip(m.shape[::-1], (lead + (Lq, Lk))[::-1])):
            raise ValueError(f"attn_mask has shape {m.shape}; expected a shape broadcastable to {lead + (Lq, Lk)}")
        last = min(m.ndim, 2)  # its (Lq, Lk) axes, as many as it has, stand in as 1
        meta(stand_in(m, m.shape[: m.ndim - last] + (1,) * last))
        if not isinstance(m, da.Array):  # a small NumPy mask, chunked like the scores below
            m = np.broadcast_to(m, (1,) * (n + 2 - m.ndim) + m.shape)

    Hq, Hkv = (q.shape[-3], k.shape[-3]) if enable_gqa else (1, 1)
    group = Hq // Hkv if enable_gqa and Hkv and Hq != Hkv else 1
    # With enable_gqa the query heads are chunked freely and each task gathers the kv head blocks
    # they read, groups of one (Hq == Hkv) too
    gather = enable_gqa and Hkv > 0
    win_l, win_r = window_sides(window)
    L = None if win_l == NO_LIMIT else win_l
    R = None if win_r == NO_LIMIT else win_r
    if is_causal:
        R = 0 if R is None else min(R, 0)
    positional = is_causal or window is not None or alibi_slopes is not None
    # With kv_lens, bottom-right aligns each sequence at its own kv_lens[b] - Lq: the blocks then
    # carry one offset per sequence (below), and each task runs its sequences one at a time.
    per_seq = kv_lens is not None and positional and causal_align == "bottom_right"
    off = Lk - Lq if causal_align == "bottom_right" else 0

    shapes = {"query": q.shape, "key": k.shape, "value": v.shape, "attn_mask": None if m is None else m.shape}
    q = _whole_last(_align(q, n + 2), "query")
    k = _whole_last(_align(k, n + 2), "key")
    v = _whole_last(_align(v, n + 2), "value")

    # Output chunks: query's along its axes, key's along Lk, the others' where the query is broadcast.
    out_chunks = []
    for t in range(n):
        cands = [x for x in (q, k, v) if x.shape[t] == lead[t]]
        if gather and t == n - 1:
            cands = [q]
        if isinstance(m, da.Array) and _align(m, n + 2).shape[t] == lead[t]:
            cands.append(_align(m, n + 2))
        out_chunks.append(cands[0].chunks[t])
    q_chunks, k_chunks = q.chunks[n], k.chunks[n]
    if isinstance(m, np.ndarray):
        mc = tuple(c if m.shape[t] != 1 else (1,) for t, c in enumerate(tuple(out_chunks) + (q_chunks, k_chunks)))
        m = da.from_array(m, chunks=mc)
    if m is not None:
        m = _align(m, n + 2)
    names = (("query", q), ("key", k), ("value", v), ("attn_mask", m))
    for t in range(n):
        if gather and t == n - 1:
            _check_chunks(tuple(out_chunks[t]), [("query", q), ("attn_mask", m)], t, "the query heads", shapes)
            if k.chunks[t] != v.chunks[t]:
                raise ValueError(
                    f"key and value are chunked differently along their heads axis ({k.chunks[t]} and {v.chunks[t]}); "
                    "rechunk one to match the other"
                )
        else:
            _check_chunks(tuple(out_chunks[t]), names, t, f"leading axis {t}", shapes)
    _check_chunks(q_chunks, [("attn_mask", m)], n, "Lq", shapes)
    _check_chunks(k_chunks, [("value", v)], n, "Lk", shapes)
    _check_chunks(k_chunks, [("attn_mask", m)], n + 1, "Lk", shapes)

    scale = scale_value(scale, E)
    kernel_factors(scale, softcap_value(softcap), dtype)  # refused here as the NumPy calls would
    p = _Piece(
        scale=scale,
        softcap=softcap, L=L, R=R, dtype=np.dtype(dtype), ev=Ev, group=group,
    )  # fmt: skip
    slopes = (
        None if alibi_slopes is None else broadcast_named(np.asarray(alibi_slopes, _F64), lead, "alibi_slopes", _ONE)
    )
    with np.errstate(over="ignore"):  # checked as the blocks' calls take them: in the dtype
        alibi_span(None if slopes is None else slopes.astype(dtype), Lq + Lk, dtype)
    sink_v = None if sinks is None else broadcast_named(np.asarray(sinks, _F64), lead, "sinks", _ONE)
    lens = None
    if kv_lens is not None:
        kl = np.asarray(kv_lens).astype(np.int64)
        lens = np.broadcast_to(kl.reshape(()) if not lead[:-1] and kl.size == 1 else kl, lead[:-1])

    token = dask.base.tokenize(
        q.name, k.name, v.name, None if m is None else m.name, is_causal, causal_align, p, window,
        alibi_slopes, sinks, kv_lens, split_every,
    )  # fmt: skip
    bname = f"pyattn-sdpa-block-{token}"
    mname = f"pyattn-sdpa-merge-{token}"
    ename = f"pyattn-sdpa-empty-{token}"
    oname = f"pyattn-sdpa-{token}"
    lname = f"pyattn-sdpa-lse-{token}"
    block_dsk, merge_dsk, empty_dsk, out_dsk, lse_dsk = {}, {}, {}, {}, {}
    lead_bounds = [_bounds(c) for c in out_chunks]
    qb, kb = _bounds(q_chunks), _bounds(k_chunks)
    kv_head_bounds = _bounds(k.chunks[n - 1]) if gather else None
    merge_fn = functools.partial(_merge_task, np.dtype(dtype))

    def in_index(x, lidx, tail):
        return tuple(0 if x.shape[t] == 1 and lead[t] != 1 else lidx[t] for t in range(n)) + tail

    def kv_keys(x, lidx, j, kv_idx=None):
        if gather:  # the kv head blocks that the chunk's query heads read
            return [(x.name,) + in_index(x, lidx, ())[:-1] + (h, j, 0) for h in kv_idx]
        return [(x.name,) + in_index(x, lidx, (j, 0))]

    for lidx in np.ndindex(*(len(c) for c in out_chunks)):
        sl = tuple(slice(*lead_bounds[t][lidx[t]]) for t in range(n))
        blk_slopes = None if slopes is None else np.array(slopes[sl])
        blk_sinks = None if sink_v is None else np.array(sink_v[sl])
        blk_lens = None if lens is None else np.array(lens[sl[:-1]])
        blk_lead = tuple(b - a for a, b in (lead_bounds[t][lidx[t]] for t in range(n)))
        q_heads, kv_idx, kv_base = None, None, 0
        if gather:
            h0, h1 = lead_bounds[n - 1][lidx[n - 1]]
            q_heads = (h0, h1)
            lo, hi = h0 // group, (h1 - 1) // group + 1 if h1 > h0 else h0 // group + 1
            kv_idx = [t for t, (a, b) in enumerate(kv_head_bounds) if a < hi and b > lo] or [0]
            kv_base = kv_head_bounds[kv_idx[0]][0]
        for i, (qs, qe) in enumerate(qb):
            states = []
            for j, (ks, ke) in enumerate(kb):
                if per_seq:
                    d = qs + blk_lens.astype(np.int64) - Lq - ks
                    if all(_visible(qe - qs, ke - ks, int(x), L, R) is None for x in d.reshape(-1)):
                        continue
                else:
                    d = qs + off - ks
                    if _visible(qe - qs, ke - ks, d, L, R) is None:
                        continue
                if blk_lens is not None and blk_lens.size and ks >= int(blk_lens.max()):
                    continue  # no sequence of this block has keys this far
                kl = None if blk_lens is None else np.clip(blk_lens - ks, 0, ke - ks)
                blk = _Block(d, q_heads, kv_base, blk_slopes, blk_sinks if not states else None, kl)

                mi = 0 if m is None or m.shape[n] == 1 else i
                mj = 0 if m is None or m.shape[n + 1] == 1 else j
                mkey = None if m is None else (m.name,) + in_index(m, lidx, (mi, mj))
                key_ = (bname,) + lidx + (i, j)
                qkey = (q.name,) + in_index(q, lidx, (i, 0))
                kvs = kv_keys(k, lidx, j, kv_idx), kv_keys(v, lidx, j, kv_idx)
                block_dsk[key_] = (functools.partial(_block_task, p, blk), qkey, kvs[0], kvs[1], mkey)
                states.append(key_)
            if not states:
                key_ = (ename,) + lidx + (i,)
                empty_dsk[key_] = (_empty_task, p, blk_lead, qe - qs, blk_sinks)
                states = [key_]
            level = 0
            while len(states) > 1:
                nxt = []
                for t in range(0, len(states), split_every):
                    group_ = states[t : t + split_every]
                    if len(group_) == 1:
                        nxt.append(group_[0])
                        continue
                    key_ = (mname,) + lidx + (i, level, t // split_every)
                    merge_dsk[key_] = (merge_fn, group_)
                    nxt.append(key_)
                states, level = nxt, level + 1
            out_dsk[(oname,) + lidx + (i, 0)] = (_output_of, states[0])
            lse_dsk[(lname,) + lidx + (i,)] = (functools.partial(_lse_of, np.dtype(dtype)), states[0])

    inputs = [x for x in (q, k, v, m) if x is not None]
    layers, deps = {}, {}
    for x in inputs:
        hlg = x.__dask_graph__()
        if not isinstance(hlg, HighLevelGraph):
            hlg = HighLevelGraph.from_collections(x.name, hlg, dependencies=())
        layers.update(hlg.layers)
        deps.update(hlg.dependencies)
    in_layers = set().union(*(x.__dask_layers__() for x in inputs))
    layers[bname], deps[bname] = MaterializedLayer(block_dsk), set(in_layers)
    state_layers = {bname}
    if empty_dsk:
        layers[ename], deps[ename] = MaterializedLayer(empty_dsk), set()
        state_layers.add(ename)
    if merge_dsk:
        layers[mname], deps[mname] = MaterializedLayer(merge_dsk), {bname}
        state_layers.add(mname)
    layers[oname], deps[oname] = MaterializedLayer(out_dsk), set(state_layers)
    out_arr = da.Array(HighLevelGraph(layers, deps), oname, tuple(out_chunks) + (q_chunks, (Ev,)),
                       meta=np.empty((0,) * (n + 2), dtype))  # fmt: skip
    if not return_lse:
        return out_arr
    layers = dict(layers)
    deps = dict(deps)
    layers[lname], deps[lname] = MaterializedLayer(lse_dsk), set(state_layers)
    lse_arr = da.Array(HighLevelGraph(layers, deps), lname, tuple(out_chunks) + (q_chunks,),
                       meta=np.empty((0,) * (n + 1), dtype))  # fmt: skip
    return out_arr, lse_arr
