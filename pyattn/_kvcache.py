"""KV caches and packed batches: kvcache_attention, KVCache, varlen_attention.

The caches are plain NumPy arrays that the C++ core reads where they lie: a contiguous cache
``(B, Hkv, Lmax, E)``, or a paged one ``(num_blocks, Hkv, block_size, E)`` with a block table
``(B, max_blocks)`` (vLLM's CPU layout). New tokens are written into them in place; nothing is
ever concatenated or gathered into a copy.
"""

from __future__ import annotations

import copy
import os
import threading
import weakref

import numpy as np

from . import _core
from ._validate import (
    F32,
    F64,
    alibi_span,
    as_array,
    base_view,
    check_out,
    compute_dtype,
    dtype_arg,
    float_array,
    int64_values,
    integer_array,
    is_float64,
    kernel_factors,
    lead_offsets,
    may_self_overlap,
    per_head,
    positive_int,
    scale_value,
    softcap_value,
    strided_offsets,
    unit_last,
    window_sides,
    writes_in_place,
)

_CACHE_KV_TYPES = {"float16": 1, "bfloat16": 2, "int8": 3}


_kvcache_small = _core.kvcache_small


def _plain(window, softcap, alibi_slopes, sinks) -> bool:
    return window is None and softcap is None and alibi_slopes is None and sinks is None


def _int_vector(x, name: str, n: int) -> np.ndarray:
    a = int64_values(x, name)
    if a.shape != (n,):
        raise ValueError(f"{name} has shape {a.shape}; expected ({n},)")
    if n and a.min() < 0:
        raise ValueError(f"{name} must be >= 0; got {a.min()}")
    return a


def _quantize(x: np.ndarray):
    """int8 values and float32 scales of x (..., D): symmetric absmax per row, x ~ q * scale."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=-1) if x.shape[-1] else np.zeros(x.shape[:-1], np.float32)
    # A row holding NaN or inf cannot be stored in int8: it gets a NaN scale (and zeros), so it
    # reads back as NaN and the NaN propagates as it would from a float cache.
    scale = np.where(np.isfinite(amax), np.where(amax > 0, amax / 127.0, 1.0), np.nan).astype(np.float32)
    # 127 scale stays finite: amax near the float32 maximum divided by 127 may round up, and the
    # row read back as 127 scale then overflowed (the values clip to 127 either way)
    with np.errstate(over="ignore"):
        scale = np.where(np.isinf(scale * np.float32(127)), np.nextafter(scale, np.float32(0)), scale)
    # (a row whose absolute maximum is under 127 times the smallest float has a scale of 0: its
    # values, +-inf after the division, clip to +-127 and read back as 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.clip(np.rint(x / scale[..., None]), -127, 127)
    return np.where(np.isnan(q), 0, q).astype(np.int8), scale


def _elem(a: np.ndarray, axis: int) -> int:
    return a.strides[axis] // a.itemsize


class _Layout:
    """Where each (batch, kv head) row of a cache lies: element offsets and strides for the core."""

    def __init__(self, cache: np.ndarray, block_table, batch: int, name: str):
        self.paged = block_table is not None
        if cache.ndim == 3:  # int8 scales: laid out like a cache without its feature axis
            cache = cache.reshape(cache.shape + (1,))
        if cache.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D ((B, Hkv, Lmax, D) or (num_blocks, Hkv, block_size, D)); got {cache.shape}"
            )
        if cache.size and cache.shape[-1] > 1 and cache.strides[-1] != cache.itemsize:
            raise ValueError(
                f"{name}: its last axis must be contiguous where new tokens are written (in place, never copied)"
            )
        if cache.size and any(s % cache.itemsize for s in cache.strides):
            raise ValueError(f"{name}: strides must be whole elements")
        self.rs = _elem(cache, 2)  # between the tokens of one (block or sequence, head)
        self.hs = _elem(cache, 1)
        self.bs = _elem(cache, 0)  # between sequences (contiguous) or blocks (paged)
        if self.paged:
            self.capacity = block_table.shape[1] * cache.shape[2]
            # blocks of 0 tokens hold no key (capacity 0, so no call reads or writes one): any
            # positive size addresses them, and the core takes sizes >= 1
            self.block_size = max(cache.shape[2], 1)
        else:
            if cache.shape[0] != batch:
                raise ValueError(f"{name} has {cache.shape[0]} sequences (shape {cache.shape}); expected B = {batch}")
            self.block_size = 0
            self.capacity = cache.shape[2]

    def offsets(self, batch: int, heads: int, group: int) -> np.ndarray:
        """Element offset of (sequence b, kv head h // group) for every query problem (b, h)."""
        return strided_offsets((batch, heads // group), (0 if self.paged else self.bs, self.hs), group)


def _stage(cache, scale, table, layout: _Layout, lens, new, counts):
    """What _commit writes for cache[b, :, lens[b] + j] = new[b, :, j], j < counts[b] (paged:
    through the table): the positions and the values already in the cache's dtype (quantised with
    their scales for int8). Staged for K and V before either is written, so that a cast that
    raises (under np.errstate) or a new row that is a view of the cache changes nothing."""
    B, _, Lq, _ = new.shape
    bsel, jsel = np.nonzero(np.arange(Lq)[None, :] < counts[:, None])
    if bsel.size == 0:
        return None
    pos = lens[bsel] + jsel
    rows = new[bsel, :, jsel]  # (n, Hkv, D), a copy
    if layout.paged:
        blk, at = table[bsel, pos // layout.block_size], pos % layout.block_size
    else:
        blk, at = bsel, pos
    if scale is not None:
        return (blk, at, *_quantize(rows))
    return blk, at, rows.astype(cache.dtype, copy=False), None  # rows is already a copy


def _commit(cache, scale, staged) -> None:
    if staged is None:
        return
    blk, at, values, s = staged
    cache[blk, :, at] = values
    if s is not None:
        scale[blk, :, at] = s


def _share_elements(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays address a common byte (exact, unlike bounds: K and V interleaved in one
    buffer do not); a layout too intricate to decide counts as shared."""
    try:
        return bool(np.shares_memory(a, b, max_work=1 << 20))
    except getattr(np, "exceptions", np).TooHardError:  # np.exceptions from NumPy 1.25
        return True


def _check_capacity(keys: np.ndarray, capacity: int) -> None:
    if keys.size and keys.max() > capacity:
        b = int(np.argmax(keys))
        raise ValueError(
            f"cache overflow: sequence {b} would hold {keys[b]} tokens; the cache holds {capacity} per sequence"
        )


def _check_written(cache, name):
    if not cache.flags.writeable:
        raise ValueError(f"{name} is read-only; new tokens are written into it in place")
    # one element reached through two indices: which write lands last would depend on the order
    # of the writes (the core's and NumPy's differ), and the kernel would read either
    if may_self_overlap(cache):
        raise ValueError(
            f"{name} may reach one element through two indices (shape {cache.shape}, strides {cache.strides}); "
            "new tokens are written into it in place, so each element must be its own"
        )


def _cache_attention(
    query,
    k_cache,
    v_cache,
    cache_lens,
    *,
    k_new,
    v_new,
    new_lens,
    block_table,
    k_scale,
    v_scale,
    scale,
    is_causal,
    window,
    softcap,
    alibi_slopes,
    sinks,
    return_lse,
    out,
):
    q = float_array(query, "query")
    if q.ndim != 4:
        raise ValueError(f"query must be (B, Hq, Lq, E); got shape {q.shape}")
    B, Hq, Lq, E = q.shape
    # A cache written in place must be the caller's ndarray; one only read may be anything
    # np.asarray takes (a torch tensor, a list), as every other array argument.
    writes = k_new is not None or v_new is not None
    if writes:
        for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
            if not isinstance(c, np.ndarray):
                raise TypeError(f"{name} must be a numpy.ndarray (written in place); got {type(c).__name__}")
    else:
        k_cache, v_cache = as_array(k_cache, "k_cache"), as_array(v_cache, "v_cache")
    # Written and read through views of their own (the caller's memory): the shapes checked below
    # stay those the core is given, though cache_lens' or k_new's __array__ reshapes the caches
    k_cache, v_cache = base_view(k_cache), base_view(v_cache)
    for c, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if c.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D ((B, Hkv, Lmax, D) or (num_blocks, Hkv, block_size, D)); got {c.shape}"
            )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must share a dtype; got {k_cache.dtype} and {v_cache.dtype}")
    cdt = k_cache.dtype
    if cdt.name not in ("float32", "float64", "float16", "bfloat16", "int8"):
        raise TypeError(f"k_cache must be float32, float64, float16, bfloat16 or int8; got {cdt}")
    if not cdt.isnative:  # written and read in place: never converted
        raise TypeError(f"k_cache must be in the machine's byte order; got {cdt.str}")
    dtype = F64 if (cdt == F64 and is_float64(q.dtype)) else F32
    kv_type = _CACHE_KV_TYPES.get(cdt.name, 0)
    if cdt == F64 and dtype == F32:
        raise TypeError("a float64 cache needs a float64 query (float32 queries read float32/half/int8 caches)")

    table = t = None
    if block_table is not None:
        t = integer_array(as_array(block_table, "block_table"), "block_table")
        if t.ndim != 2 or t.shape[0] != B:
            raise ValueError(f"block_table has shape {t.shape}; expected (B = {B}, max_blocks)")
        # A snapshot, checked below in t's own type (entries past those a call reads are never
        # read, so a wider type's cast of those does not matter) and then cast: the caller's
        # table may lie in memory the call writes, or change in another thread while the kernel
        # runs without the GIL; the kernel reads only what was checked. In C order: the kernel
        # finds row b at b * max_blocks (a Fortran-ordered table was read across its rows).
        t = np.array(t, order="C")
        table = t if t.dtype == np.int32 else t.astype(np.int32)
    if not writes:
        # Nothing is written: a cache whose feature axis is strided is read through a copy, as
        # scaled_dot_product_attention copies such an operand (a cache written in place must have
        # that axis contiguous, and _Layout says so).
        k_cache, v_cache = unit_last(k_cache), unit_last(v_cache)
    kl = _Layout(k_cache, table, B, "k_cache")
    vl = _Layout(v_cache, table, B, "v_cache")
    Hkv, Ek, Ev = k_cache.shape[1], k_cache.shape[3], v_cache.shape[3]
    if Ek != E:
        raise ValueError(f"k_cache has head size {Ek} (shape {k_cache.shape}); expected E = {E} from query {q.shape}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache has shape {v_cache.shape}; expected {k_cache.shape[:3]} + (Ev,) like k_cache")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of the cache's kv heads ({Hkv})")
    group = Hq // Hkv
    lens = _int_vector(cache_lens, "cache_lens", B)
    _check_capacity(lens, kl.capacity)  # before lens + counts, which could overflow

    ksl = vsl = None
    if kv_type == 3:
        # As the caches: written in place, the caller's ndarray; only read, any array-like; then
        # a view of its own. Each on its own, so a missing one is the one the error names.
        scales = []
        for s, c, name in ((k_scale, k_cache, "k_scale"), (v_scale, v_cache, "v_scale")):
            if s is None:
                raise ValueError(f"{name} must be a float32 array of shape {c.shape[:3]} for an int8 cache")
            if not writes:
                s = as_array(s, name)
            elif not isinstance(s, np.ndarray):
                raise TypeError(f"{name} must be a numpy.ndarray (written in place); got {type(s).__name__}")
            scales.append(base_view(s))
        k_scale, v_scale = scales
        for s, c, name in ((k_scale, k_cache, "k_scale"), (v_scale, v_cache, "v_scale")):
            if s.dtype != F32 or s.shape != c.shape[:3]:
                raise ValueError(f"{name} must be a float32 array of shape {c.shape[:3]} for an int8 cache")
        ksl = _Layout(k_scale, table, B, "k_scale")  # the scales are laid out like the cache without its last axis
        vsl = _Layout(v_scale, table, B, "v_scale")
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale / v_scale are only for an int8 cache")

    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: give both or neither")
    if k_new is not None:
        kn, vn = float_array(k_new, "k_new"), float_array(v_new, "v_new")
        if kn.shape != (B, Hkv, Lq, E) or vn.shape != (B, Hkv, Lq, Ev):
            raise ValueError(
                f"k_new / v_new have shapes {kn.shape} / {vn.shape}; expected {(B, Hkv, Lq, E)} / {(B, Hkv, Lq, Ev)}"
            )
        counts = np.full(B, Lq, np.int64) if new_lens is None else _int_vector(new_lens, "new_lens", B)
        if B and counts.max(initial=0) > Lq:
            raise ValueError(f"new_lens must be <= Lq = {Lq}; got {counts.max()}")
        keys = lens + counts
    else:
        if new_lens is not None:
            raise ValueError("new_lens needs k_new / v_new")
        counts = None
        keys = lens
    _check_capacity(keys, kl.capacity)
    if table is not None and B:
        need = (keys + kl.block_size - 1) // kl.block_size
        used = np.arange(table.shape[1])[None, :] < need[:, None]
        ids = t[used]
        if ids.size and (ids.min() < 0 or ids.max() >= k_cache.shape[0]):
            raise ValueError(f"block_table names a block outside [0, {k_cache.shape[0]}) for the tokens it must hold")
    win_left, win_right = window_sides(window)
    cap = softcap_value(softcap)
    causal = bool(is_causal)  # (before anything is written: an array's bool() raises)
    lead = (B, Hq)
    slopes = per_head(alibi_slopes, "alibi_slopes", lead, dtype)
    alibi_span(slopes, int(keys.max(initial=0)) + Lq, dtype)
    sink = per_head(sinks, "sinks", lead, dtype)
    ov = check_out(out, (B, Hq, Lq, Ev), dtype)  # written through; out is returned
    scale = scale_value(scale, E)
    kernel_factors(scale, cap, dtype)
    if counts is not None:
        written = [(k_cache, "k_cache"), (v_cache, "v_cache")]
        if kv_type == 3:
            written += [(k_scale, "k_scale"), (v_scale, "v_scale")]
        for i, (c, name) in enumerate(written):
            _check_written(c, name)
            for c2, name2 in written[:i]:  # one write would land on the other's (exactly: interleaved K/V are fine)
                if _share_elements(c, c2):
                    raise ValueError(f"{name} and {name2} share memory; new tokens are written into both")

    ragged = counts is not None and new_lens is not None

    # The kernel writes every query row it is given, output and lse (zeros and -inf, or the sink,
    # where a row sees no key), so only a ragged call, whose rows past new_lens the kernel never
    # visits, needs its results filled
    def alloc(shape, fill):
        return np.full(shape, fill, dtype) if ragged else np.empty(shape, dtype)

    result = alloc((B, Hq, Lq, Ev), 0) if (ragged or out is None) else None
    target = ov if result is None else result
    # an out laid out for the kernel (unit last stride, aligned, whole-element strides, no element
    # reached twice through a zero stride: the threads would race on it) and apart from every
    # input, else a temporary copied in
    reads = (q, k_cache, v_cache, k_scale, v_scale, table, slopes, sink) if target is ov else ()
    if not writes_in_place(target, *reads):
        target = alloc((B, Hq, Lq, Ev), 0)
    lse = alloc((B, Hq, Lq), -np.inf) if return_lse else None
    if counts is not None and any(np.may_share_memory(q, c) for c, _ in written):
        q = np.array(q)  # a query viewing the slots written: the call reads it as it was given

    # Every check is done and the results are allocated (a MemoryError leaves the cache as it
    # was): only now is anything written.
    if counts is not None:
        staged_k = _stage(k_cache, k_scale if kv_type == 3 else None, table, kl, lens, kn, counts)
        staged_v = _stage(v_cache, v_scale if kv_type == 3 else None, table, vl, lens, vn, counts)
        _commit(k_cache, k_scale, staged_k)
        _commit(v_cache, v_scale, staged_v)
    bh = B * Hq
    if bh and Lq:
        qb = unit_last(np.asarray(q, dtype))
        per = lambda v: np.ascontiguousarray(np.repeat(v, Hq)) if v is not None else None  # noqa: E731
        kv_lens = per(keys)
        q_lens = per(counts) if ragged else None
        Lk = int(keys.max(initial=0))
        qoff, ooff = lead_offsets(qb, 2), lead_offsets(target, 2)
        koff, voff = kl.offsets(B, Hq, group), vl.offsets(B, Hq, group)
        lseoff = lead_offsets(lse, 2) if lse is not None else None
        bt_off = strided_offsets((B, Hq), (table.shape[1], 0)) if table is not None else None
        if kv_type == 3:
            ksoff, ks = ksl.offsets(B, Hq, group), (ksl.rs, ksl.bs)
            vsoff, vs = vsl.offsets(B, Hq, group), (vsl.rs, vsl.bs)
        else:
            ksoff = vsoff = None
            ks = vs = (0, 0)
        _core.attention(  # positional, in _core.pyi's order (see _api.scaled_dot_product_attention)
            qb, k_cache, v_cache, target,  # q, k, v, out
            bh, Lq, Lk, E, Ev, group,  # bh, Lq, Lk, E, Ev, group
            qoff, _elem(qb, 2),  # qoff, q_rs
            koff, kl.rs,  # koff, k_rs
            voff, vl.rs,  # voff, v_rs
            ooff, _elem(target, 2),  # ooff, o_rs
            0, None, None,  # mask_kind, mask, moff
            0, 0,  # m_rs, m_cs
            lse, lseoff, 1,  # lse, lseoff, lse_s
            None, None, 0,  # weights, woff, w_rs
            scale, causal, True,  # scale, causal, bottom_right
            cap, slopes, sink, win_left, win_right,  # softcap, alibi, sinks, win_left, win_right
            kv_lens, kv_type,  # kv_lens, kv_type
            q_lens, table, bt_off,  # q_lens, block_table, bt_off
            kl.block_size, kl.bs, vl.bs,  # block_size, k_ps, v_ps
            k_scale if kv_type == 3 else None, ksoff, ks[0], ks[1],  # k_scale, ksoff, ks_rs, ks_ps
            v_scale if kv_type == 3 else None, vsoff, vs[0], vs[1],  # v_scale, vsoff, vs_rs, vs_ps
        )  # fmt: skip
    if out is not None:
        if target is not ov:
            ov[...] = target
        target = out
    return (target, lse) if return_lse else target


def kvcache_attention(
    query,
    k_cache,
    v_cache,
    cache_lens,
    *,
    k_new=None,
    v_new=None,
    block_table=None,
    k_scale=None,
    v_scale=None,
    scale=None,
    is_causal=True,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    out=None,
):
    """One decoder layer's attention against its KV cache (``flash_attn_with_kvcache``).

    query ``(B, Hq, Lq, E)``; ``cache_lens`` ``(B,)`` tokens already in each sequence's cache.
    ``k_new`` / ``v_new`` ``(B, Hkv, Lq, E|Ev)`` are written into the cache **in place** at
    positions ``cache_lens[b] .. + Lq - 1`` (the caller advances ``cache_lens``), then the query
    attends the ``cache_lens[b] + Lq`` keys, causal aligned bottom-right. Without them nothing is
    written and the query attends the ``cache_lens[b]`` keys there.

    Caches: contiguous ``(B, Hkv, Lmax, E)`` / ``(B, Hkv, Lmax, Ev)``, or paged ``(num_blocks,
    Hkv, block_size, E)`` with ``block_table`` ``(B, max_blocks)`` naming each sequence's blocks
    in order; read where they lie. float32, float16, bfloat16, or int8 with ``k_scale`` /
    ``v_scale`` float32 of the cache's shape without its last axis (x = q * scale; writing
    quantises each new token and head by its absolute maximum). A float64 cache needs a float64
    query and computes in float64; every other cache computes in float32. Every check (overflow
    past the capacity, a block outside the cache, a dtype or shape mismatch, negative lengths)
    raises before anything is written.

    The score variants (window, softcap, alibi_slopes, sinks) are those of
    scaled_dot_product_attention. Returns ``(B, Hq, Lq, Ev)`` (and the lse ``(B, Hq, Lq)``).
    """
    if out is None and _plain(window, softcap, alibi_slopes, sinks):
        # The everyday call in C (see _core.kvcache_small): None, with nothing written, for
        # anything else, which _cache_attention defines and checks.
        r = _kvcache_small(
            query, k_cache, v_cache, cache_lens, k_new, v_new, block_table, scale, is_causal, return_lse,
            k_scale, v_scale,
        )  # fmt: skip
        if r is not None:
            return r
    return _cache_attention(
        query, k_cache, v_cache, cache_lens, k_new=k_new, v_new=v_new, new_lens=None, block_table=block_table,
        k_scale=k_scale, v_scale=v_scale, scale=scale, is_causal=is_causal, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, out=out,
    )  # fmt: skip


# Every live cache, so that a child forked while another thread held one's lock (inside its
# attend) gets a fresh lock, as the logging module does for its handlers: the child has no such
# thread, and the inherited lock would stay taken for ever.
_CACHES: "weakref.WeakSet[KVCache]" = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    for cache in list(_CACHES):
        cache._lock = threading.RLock()
        cache._busy = False


def _nested(what: str) -> RuntimeError:
    return RuntimeError(
        f"KVCache.{what} was called on a cache from inside that cache's own attend or reset (code an "
        "argument runs, such as its __array__, or a signal handler): calls on one cache cannot nest"
    )


def _no_discard() -> None:
    pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


class KVCache:
    """One layer's KV cache for a batch of sequences of different lengths.

    Contiguous (``max_len`` tokens per sequence, allocated up front) or paged (``block_size``
    tokens per block, blocks allocated as sequences grow and reused once freed by ``reset``; with
    ``max_len`` the pool is sized for it up front, otherwise it doubles when it runs out, which
    copies the pool: amortised O(1) per token). Any cache dtype of ``kvcache_attention``.

    One cache may be shared by several threads: ``attend`` and ``reset`` hold its lock, so calls
    on one cache run one after the other (calls on different caches still run at once).
    """

    def __init__(
        self, batch, num_kv_heads, head_dim, *, v_head_dim=None, max_len=None, block_size=None, dtype=np.float32
    ):
        self.batch = positive_int(batch, "batch")
        self.num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.v_head_dim = self.head_dim if v_head_dim is None else positive_int(v_head_dim, "v_head_dim")
        self.dtype = dtype_arg(dtype, "a bfloat16 cache")
        if self.dtype.name not in ("float32", "float64", "float16", "bfloat16", "int8"):
            raise TypeError(f"dtype must be float32, float64, float16, bfloat16 or int8; got {self.dtype}")
        if not self.dtype.isnative:  # kvcache_attention refuses such a cache on every call
            raise TypeError(f"dtype must be in the machine's byte order; got {self.dtype.str!r}")
        if max_len is None and block_size is None:
            raise ValueError("give max_len (a contiguous cache) or block_size (a paged one)")
        self.max_len = None if max_len is None else positive_int(max_len, "max_len")
        self.block_size = None if block_size is None else positive_int(block_size, "block_size")
        self._lens = np.zeros(self.batch, np.int64)
        # attend reads the lengths and the block table, drops the GIL in the kernel and then
        # stores the new lengths: two threads at once would write the same rows (or a reset
        # would free blocks the kernel is reading). A call on the cache from inside its own
        # attend or reset (an argument's __array__, a signal handler) finds the lock its thread
        # holds (an RLock: a plain lock would wait for ever) and _busy set: a RuntimeError.
        self._lock = threading.RLock()
        self._busy = False
        _CACHES.add(self)
        if self.block_size is None:
            self.k, self.v, self.k_scale, self.v_scale = self._arrays(self.batch, self.max_len)
            self.block_table = None
        else:
            per_seq = -(-self.max_len // self.block_size) if self.max_len else 4
            self.k, self.v, self.k_scale, self.v_scale = self._arrays(self.batch * per_seq, self.block_size)
            self.block_table = np.full((self.batch, per_seq), -1, np.int32)
            self._free = list(range(self.batch * per_seq - 1, -1, -1))

    def _arrays(self, n: int, length: int) -> tuple:
        """New zeroed (k, v, k_scale, v_scale) for n rows (sequences, or a paged pool's blocks)."""
        H, D, Dv = self.num_kv_heads, self.head_dim, self.v_head_dim
        int8 = self.dtype.name == "int8"
        return (
            np.zeros((n, H, length, D), self.dtype),
            np.zeros((n, H, length, Dv), self.dtype),
            np.zeros((n, H, length), np.float32) if int8 else None,
            np.zeros((n, H, length), np.float32) if int8 else None,
        )

    @property
    def lens(self) -> np.ndarray:
        """Tokens held per sequence (a copy)."""
        return self._lens.copy()

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's arrays (K, V, int8 scales, block table)."""
        parts = [self.k, self.v, self.k_scale, self.v_scale, self.block_table]
        return int(sum(p.nbytes for p in parts if p is not None))

    def __getstate__(self):  # (under the lock: not a cache half-way through another thread's attend)
        with self._lock:  # copy.copy: the arrays and the free list as they are now, not shared
            if self._busy:  # (half-way through this thread's own attend)
                raise _nested("__getstate__")
            return {k: copy.copy(v) for k, v in self.__dict__.items() if k not in ("_lock", "_busy")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._busy = False
        _CACHES.add(self)

    def _exclusive(self, what: str, fn, *args):
        """fn(*args) under the cache's lock, refusing a call from inside this cache's own attend
        or reset (the RLock lets that thread in: _busy tells it apart)."""
        with self._lock:
            if self._busy:
                raise _nested(what)
            self._busy = True
            try:
                return fn(*args)
            finally:
                self._busy = False

    def reset(self, rows=None):
        """Empty the given sequences (all when None); a paged cache frees their blocks for reuse."""
        self._exclusive("reset", self._reset, rows)

    def _reset(self, rows):
        idx = np.arange(self.batch) if rows is None else np.atleast_1d(np.asarray(rows))
        if idx.size == 0:  # np.asarray([]) is float64: no rows, nothing to do
            return
        if idx.dtype.kind not in "iu" or (idx.size and (idx.min() < -self.batch or idx.max() >= self.batch)):
            raise ValueError(f"rows must be sequence indices in [0, {self.batch}); got {rows!r}")
        if self.block_table is None:
            self._lens[idx] = 0
            return
        # A sequence holds the blocks its length covers; the table past them may hold entries of
        # a call that failed (_reserve), never read. The lengths go to 0 before the blocks go back
        # to the free list: interrupted in between, blocks leak, but none is held and free at once.
        rows = np.unique(idx % self.batch)
        held = -(-self._lens[rows] // self.block_size)
        freed = [int(b) for r, n in zip(rows, held) for b in self.block_table[r, :n][::-1]]
        self._lens[rows] = 0
        self._free.extend(freed)
        self.block_table[rows] = -1

    def _reserve(self, needed: np.ndarray):
        """Blocks for `needed` tokens per sequence (paged), from the free list, growing the table and
        the pool when they run out. Returns (table, arrays, commit, discard): the block table and pool
        arrays the call is to use, a function that makes them the cache's once the call has
        succeeded and one that clears the entries it wrote into the cache's table (the call failed).
        Nothing of the cache changes before commit: a grown table or pool is a new array, filled
        here (a MemoryError or an interrupt while allocating or copying leaves the cache as it was),
        and the new blocks' entries go into table slots past every sequence's length, which no
        call reads (_reset and the next _reserve take a sequence's blocks from its length)."""
        bs = self.block_size
        want, have = -(-needed // bs), -(-self._lens // bs)  # sequences hold ceil(lens / bs) blocks
        table, arrays, free = self.block_table, (self.k, self.v, self.k_scale, self.v_scale), self._free
        count = np.maximum(want - have, 0)
        if not count.any():  # (most decode steps: every new token fits a block held)
            return table, arrays, self._commit_lens, _no_discard
        if want.max(initial=0) > table.shape[1]:
            grown = np.full((self.batch, max(int(want.max()), 2 * table.shape[1])), -1, np.int32)
            grown[:, : table.shape[1]] = table
            table = grown
        rows = np.repeat(np.arange(self.batch), count)  # sequence r takes table columns have[r]..want[r]
        cols = np.concatenate([np.arange(h, w) for h, w in zip(have, want) if w > h])
        n, extra = rows.size, []
        if n > len(free):
            old = arrays[0].shape[0]
            new = max(2 * old, old + n - len(free))
            grown_arrays = self._arrays(new, bs)
            for dst, src in zip(grown_arrays, arrays):
                if src is not None:
                    dst[:old] = src
            arrays, extra = grown_arrays, list(range(new - 1, old - 1, -1))
        # The blocks taken are the free list's last n (the grown pool's first): popped in turn
        from_old = max(0, n - len(extra))
        tail = free[len(free) - from_old :] + extra[len(extra) - (n - from_old) :]
        table[rows, cols] = tail[::-1]

        def commit(lens):
            # The blocks taken leave the free list first and a grown pool's spare ones join it
            # last (only one of the two happens: blocks come from the old list only once the
            # grown pool's are all taken), the table, pool and lengths in one step between: a
            # failure in between loses blocks, but no block is both free and held, nor free and
            # past the pool.
            if from_old:
                del free[len(free) - from_old :]
            k, v, ks, vs = arrays
            self.__dict__.update(block_table=table, k=k, v=v, k_scale=ks, v_scale=vs, _lens=lens)
            free.extend(extra[: len(extra) - (n - from_old)])

        def discard():  # the call failed: the entries written into the cache's own table go
            table[rows, cols] = -1

        return table, arrays, commit, discard

    def _commit_lens(self, lens):
        self._lens = lens

    def attend(self, query, k_new, v_new, *, new_lens=None, **variants):
        """Append ``k_new`` / ``v_new`` ``(B, Hkv, Lq, D)`` after each sequence's tokens, attend
        (bottom-right causal over everything held), and advance ``lens``. With both None nothing
        is appended and ``lens`` stay: the query attends the tokens held. With ``new_lens`` (B,)
        sequence b appends only its first ``new_lens[b]`` tokens (a ragged prefill in one padded
        call): its query rows past them are padding and come back as zeros. ``variants``: scale,
        is_causal, window, softcap, alibi_slopes, sinks, return_lse, out."""
        return self._exclusive("attend", self._attend, query, k_new, v_new, new_lens, variants)

    def _attend(self, query, k_new, v_new, new_lens, variants):
        # Converted once: the tokens counted here are those written (an array-like whose
        # __array__ gave another shape on a second call left lens apart from the cache's rows)
        query = as_array(query, "query")
        Lq = query.shape[-2] if query.ndim == 4 else 0
        if k_new is None and v_new is None:  # attend what is held, append nothing: lens stay
            if new_lens is not None:
                raise ValueError("new_lens needs k_new / v_new")
            counts = np.zeros(self.batch, np.int64)
        elif new_lens is None:
            counts = np.full(self.batch, Lq, np.int64)
        else:
            counts = _int_vector(new_lens, "new_lens", self.batch)
        if counts.max(initial=0) > Lq:
            raise ValueError(f"new_lens must be <= Lq = {Lq}; got {counts.max()}")
        needed = self._lens + counts
        if self.max_len is not None and needed.max(initial=0) > self.max_len:
            raise ValueError(f"cache overflow: a sequence would hold {needed.max()} tokens; max_len is {self.max_len}")
        known = ("scale", "is_causal", "window", "softcap", "alibi_slopes", "sinks", "return_lse", "out")
        unknown = sorted(set(variants) - set(known))
        if unknown:
            raise TypeError(f"attend() got unexpected keywords {unknown}")
        # A paged cache takes its blocks first (in a new table and pool where those grow); they
        # become the cache's only once the call has succeeded (_reserve).
        if self.block_table is None:
            table, (k, v, ks, vs) = None, (self.k, self.v, self.k_scale, self.v_scale)
            commit, discard = self._commit_lens, _no_discard
        else:
            table, (k, v, ks, vs), commit, discard = self._reserve(needed)
        res = None
        get = variants.get
        try:
            if new_lens is None and get("out") is None:
                if _plain(get("window"), get("softcap"), get("alibi_slopes"), get("sinks")):
                    res = _kvcache_small(
                        query, k, v, self._lens, k_new, v_new, table, get("scale"),
                        get("is_causal", True), get("return_lse", False), ks, vs,
                    )  # fmt: skip
            if res is None:
                res = _cache_attention(
                    query, k, v, self._lens, k_new=k_new, v_new=v_new, new_lens=new_lens,
                    block_table=table, k_scale=ks, v_scale=vs,
                    scale=get("scale"), is_causal=get("is_causal", True),
                    window=get("window"), softcap=get("softcap"),
                    alibi_slopes=get("alibi_slopes"), sinks=get("sinks"),
                    return_lse=get("return_lse", False), out=get("out"),
                )  # fmt: skip
        except BaseException:
            discard()
            raise
        commit(needed)
        return res

    def __repr__(self):
        kind = f"paged block_size={self.block_size}" if self.block_size else f"max_len={self.max_len}"
        return (
            f"KVCache(batch={self.batch}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, {kind}, "
            f"dtype={self.dtype}, lens={self._lens.tolist()})"
        )


def varlen_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal=False,
    scale=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    out=None,
):
    """Attention over a batch of sequences of different lengths packed without padding
    (``flash_attn_varlen_func``): query ``(total_q, Hq, E)``, key/value ``(total_k, Hkv, E|Ev)``,
    ``cu_seqlens_*`` ``(B + 1,)`` cumulative lengths from 0. Causal (and window, ALiBi) aligned
    bottom-right per sequence. The work is split over sequences and query blocks together, so a
    long sequence among short ones keeps every core busy. Returns ``(total_q, Hq, Ev)`` (and the
    lse ``(total_q, Hq)``)."""
    q, k, v = float_array(query, "query"), float_array(key, "key"), float_array(value, "value")
    for a, name in ((q, "query"), (k, "key"), (v, "value")):
        if a.ndim != 3:
            raise ValueError(f"{name} must be (total, heads, features); got shape {a.shape}")
    dtype = compute_dtype(q, k, v)
    Tq, Hq, E = q.shape
    Tk, Hkv, Ek = k.shape
    Ev = v.shape[2]
    if Ek != E or v.shape[:2] != (Tk, Hkv):
        raise ValueError(f"key {k.shape} / value {v.shape} do not fit query {q.shape}: expected (total_k, Hkv, E|Ev)")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    cu, lens = [], []
    for c, name, total in ((cu_seqlens_q, "cu_seqlens_q", Tq), (cu_seqlens_k, "cu_seqlens_k", Tk)):
        c = integer_array(as_array(c, name), name)
        if c.ndim != 1 or c.size < 1:
            raise ValueError(f"{name} must be a 1-D integer array (B + 1,); got {c.dtype} {c.shape}")
        c = int64_values(c, name)  # differences taken in int64: an unsigned or narrow type would wrap
        n = c[1:] - c[:-1]
        if c[0] != 0 or (n < 0).any() or c[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at {total}; got {c.tolist()}")
        cu.append(c)
        lens.append(n)
    cq, ck = cu
    ql, kl = lens
    if cq.size != ck.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length; got {cq.size} and {ck.size}")
    B, group = cq.size - 1, Hq // Hkv
    win_left, win_right = window_sides(window)
    cap = softcap_value(softcap)
    slopes = per_head(alibi_slopes, "alibi_slopes", (Hq,), dtype)
    if slopes is not None:
        alibi_span(slopes, int(np.max(ql + kl, initial=0)), dtype)
    sink = per_head(sinks, "sinks", (Hq,), dtype)
    ov = check_out(out, (Tq, Hq, Ev), dtype)  # written through; out is returned
    scale = scale_value(scale, E)
    kernel_factors(scale, cap, dtype)
    # The kernel writes every row of every sequence, output and lse (zeros and -inf, or the sink,
    # where a sequence has no key), so neither needs a fill, and the output goes straight into out
    # where the core can write that (a zero-filled temporary copied into out cost a call
    # 1.05-1.15x, 8 sequences of 64-2048)
    direct = ov is not None and writes_in_place(ov, q, k, v, slopes, sink)
    result = ov if direct else np.empty((Tq, Hq, Ev), dtype)
    lse = np.empty((Tq, Hq), dtype) if return_lse else None
    bh = B * Hq
    if bh and Tq:
        qb = unit_last(np.asarray(q, dtype))
        kb, vb = unit_last(np.asarray(k, dtype)), unit_last(np.asarray(v, dtype))
        hq = np.arange(Hq, dtype=np.int64)

        def offs(a, starts, heads):  # element offset of (sequence b, head) rows, int64
            return (starts[:-1, None] * _elem(a, 0) + heads * _elem(a, 1)).ravel()

        # q and out, k and v, usually share a layout, and then their offsets
        qoff, koff = offs(qb, cq, hq), offs(kb, ck, hq // group)
        voff = koff if vb.strides == kb.strides else offs(vb, ck, hq // group)
        ooff = qoff if result.strides == qb.strides else offs(result, cq, hq)

        tile = lambda x: np.ascontiguousarray(np.tile(x, B)) if x is not None else None  # noqa: E731
        _core.attention(  # positional, in _core.pyi's order (see _api.scaled_dot_product_attention)
            qb, kb, vb, result,  # q, k, v, out
            bh, int(ql.max()), int(kl.max()), E, Ev, group,  # bh, Lq, Lk, E, Ev, group
            qoff, _elem(qb, 0),  # qoff, q_rs
            koff, _elem(kb, 0),  # koff, k_rs
            voff, _elem(vb, 0),  # voff, v_rs
            ooff, _elem(result, 0),  # ooff, o_rs
            0, None, None,  # mask_kind, mask, moff
            0, 0,  # m_rs, m_cs
            lse, offs(lse[..., None], cq, hq) if lse is not None else None, Hq,  # lse, lseoff, lse_s
            None, None, 0,  # weights, woff, w_rs
            scale, bool(is_causal), True,  # scale, causal, bottom_right
            cap, tile(slopes), tile(sink), win_left, win_right,  # softcap, alibi, sinks, win_left, win_right
            np.repeat(kl, Hq), 0,  # kv_lens, kv_type
            np.repeat(ql, Hq), None, None, 0, 0, 0,  # q_lens, block_table, bt_off, block_size, k_ps, v_ps
            None, None, 0, 0, None, None, 0, 0,  # k_scale, ksoff, ks_rs, ks_ps, v_scale, vsoff, vs_rs, vs_ps
        )  # fmt: skip
    if out is not None:
        if not direct:
            ov[...] = result
        result = out
    return (result, lse) if return_lse else result
