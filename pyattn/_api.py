"""Public functions: validation here, computation in the C++ core (pyattn._core)."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
import warnings

import numpy as np

try:
    from numpy.lib.array_utils import normalize_axis_index
except ImportError:  # NumPy < 2
    from numpy.core.multiarray import normalize_axis_index

from . import _core
from ._validate import (
    F32,
    F64,
    alibi_span,
    broadcast,
    broadcast_lead,
    cast,
    check_gqa_heads,
    check_out,
    compute_dtype,
    elem_strides,
    float_array,
    kernel_factors,
    key_counts,
    lead_offsets,
    mask_array,
    overlaps,
    per_head,
    positive_int,
    same_layout,
    scale_value,
    softcap_value,
    strided_ok,
    unit_last,
    window_sides,
    writable_in_place,
    writes_in_place,
)

__all__ = [
    "scaled_dot_product_attention",
    "softmax",
    "matmul",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "show_config",
]

_CAUSAL_ALIGNS = ("top_left", "bottom_right")
_sdpa_small = _core.sdpa_small
_KV_TYPES = {"float16": 1, "bfloat16": 2}  # half-precision K/V the float32 kernels read as they are

_env_isa = os.environ.get("PYATTN_ISA")
if _env_isa and _env_isa not in _core.available_isas():
    _why = (
        "is not available on this CPU"
        if _env_isa in ("generic", "avx2", "avx512", "neon")
        else "names no kernel set (generic, avx2, avx512, neon)"
    )
    warnings.warn(
        f"PYATTN_ISA={_env_isa!r} {_why} (available: {_core.available_isas()}); using {_core.isa()!r}",
        RuntimeWarning,
        stacklevel=2,
    )
# The core reads exactly "0" or "1" and takes anything else as unset: say so rather than let
# "false" or "off" leave the default (prefetches on, off Intel) in place without a word.
_env_prefetch = os.environ.get("PYATTN_DECODE_PREFETCH")
if _env_prefetch and _env_prefetch not in ("0", "1"):
    warnings.warn(
        f"PYATTN_DECODE_PREFETCH={_env_prefetch!r} is neither '0' nor '1' and is ignored "
        "(show_config() reports the default in use)",
        RuntimeWarning,
        stacklevel=2,
    )


# ----------------------------------------------------------------------------- attention


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
):
    """Exact ``softmax(Q K^T * scale + mask) V`` without materialising the scores.

    Shapes: query ``(..., Hq, Lq, E)``, key ``(..., Hkv, Lk, E)``, value ``(..., Hkv, Lk, Ev)``;
    leading axes broadcast. ``attn_mask`` broadcasts to ``(..., Hq, Lq, Lk)``: bool True = may
    attend, float is added to the scaled scores. ``is_causal`` hides keys after the query
    (``causal_align="top_left"``: key j <= i; ``"bottom_right"``: j <= i + Lk - Lq) and combines
    with ``attn_mask``. ``enable_gqa`` lets Hq be a multiple of Hkv (query head h reads kv head
    ``h // (Hq // Hkv)``). ``scale`` defaults to ``1/sqrt(E)``.

    Score variants, applied in this order to the score of query i and key j, with ``off = 0``
    (top_left) or ``Lk - Lq`` (bottom_right; ``kv_lens[b] - Lq`` with kv_lens):
    ``softcap=c`` gives ``c * tanh(s / c)``; ``alibi_slopes`` (broadcastable to ``(..., Hq)``)
    subtracts ``slope * |i + off - j|``; the mask; ``window=(left, right)`` hides keys outside
    ``[i + off - left, i + off + right]`` (a side may be None; with is_causal, right <= 0), and
    only the blocks inside the window are computed; ``sinks`` (broadcastable to ``(..., Hq)``)
    add one logit without a value to every row's softmax denominator (and lse); ``kv_lens``
    (integers broadcastable to the axes before the heads) says how many keys exist per batch
    entry, so a preallocated cache is read only up to its valid length. key and value may be
    float16 or bfloat16 (``ml_dtypes.bfloat16``) with a float32 query: they are converted as the
    kernel reads them.

    Returns the output ``(..., Hq, Lq, Ev)``; with ``return_weights`` also the weights
    ``(..., Hq, Lq, Lk)``, with ``return_lse`` also the natural-log log-sum-exp ``(..., Hq, Lq)``
    of each row (``-inf`` where no key is visible, or the sink with sinks; such rows output zeros).
    """
    if attn_mask is None and return_weights is False:
        # The everyday call (plain float arrays, one leading shape, no mask, the variants in their
        # plain forms, an out it can write in place) in C: None when the arguments are anything
        # else, which the code below defines and checks.
        r = _sdpa_small(
            query, key, value, is_causal, causal_align, scale, enable_gqa, return_lse,
            window, softcap, alibi_slopes, sinks, kv_lens, out,
        )  # fmt: skip
        if r is not None:
            return r
    q = float_array(query, "query")
    k = float_array(key, "key")
    v = float_array(value, "value")
    for a, name in ((q, "query"), (k, "key"), (v, "value")):
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., L, E); got shape {a.shape}")
    dtype = compute_dtype(q, k, v)
    # float16 / bfloat16 keys and values with a float32 computation are read as they are
    # (in the machine's byte order: others are converted with the float32 copy)
    kv_type = _KV_TYPES.get(k.dtype.name, 0) if dtype == F32 and k.dtype == v.dtype and k.dtype.isnative else 0
    Lq, E = q.shape[-2:]
    Lk, Ek = k.shape[-2:]
    Lv, Ev = v.shape[-2:]
    if Ek != E:
        raise ValueError(f"key has feature size {Ek} (shape {k.shape}); expected E = {E} from query {q.shape}")
    if Lv != Lk:
        raise ValueError(f"value has length {Lv} (shape {v.shape}); expected Lk = {Lk} from key {k.shape}")
    if causal_align not in _CAUSAL_ALIGNS:
        raise ValueError(f"causal_align must be 'top_left' or 'bottom_right'; got {causal_align!r}")
    win_left, win_right = window_sides(window)
    cap = softcap_value(softcap)

    group = 1
    if enable_gqa:
        group = check_gqa_heads(q.shape, k.shape, v.shape)
        Hq, Hkv = q.shape[-3], k.shape[-3]
        outer = broadcast_lead(
            (q.shape[:-3], k.shape[:-3], v.shape[:-3]), ("query", "key", "value"), "scaled_dot_product_attention"
        )
        lead = outer + (Hq,)
        kv_lead = outer + (Hkv,)
    else:
        lead = broadcast_lead(
            (q.shape[:-2], k.shape[:-2], v.shape[:-2]), ("query", "key", "value"), "scaled_dot_product_attention"
        )
        kv_lead = lead

    out_shape = lead + (Lq, Ev)
    ov = check_out(out, out_shape, dtype)  # written through; out is returned
    scale = scale_value(scale, E)
    kernel_factors(scale, cap, dtype)

    mask_kind, m = 0, None
    if attn_mask is not None:
        mask_kind, m = mask_array(attn_mask, "attn_mask", dtype)
        try:
            m = broadcast(m, lead + (Lq, Lk))
        except ValueError:
            raise ValueError(
                f"attn_mask has shape {np.shape(attn_mask)}; expected a shape broadcastable to {lead + (Lq, Lk)}"
            ) from None
        m = strided_ok(m)

    slopes = per_head(alibi_slopes, "alibi_slopes", lead, dtype)
    alibi_span(slopes, Lq + Lk, dtype)
    sink = per_head(sinks, "sinks", lead, dtype)
    lens = key_counts(kv_lens, lead, Lk)

    nlead = len(lead)
    bh = math.prod(lead)
    result = ov if ov is not None else np.empty(out_shape, dtype)
    weights = np.zeros(lead + (Lq, Lk), dtype) if return_weights else None
    lse = np.empty(lead + (Lq,), dtype) if return_lse else None

    if bh and Lq:
        if Lk == 0:
            if lse is not None:  # no key: the sink alone, or -inf (taken before out, which may share its memory)
                lse[...] = -np.inf if sink is None else sink.reshape(lead + (1,))
            # 0 / (the sink's exp), as where keys exist but none is seen: NaN with a NaN sink
            result[...] = 0 if sink is None else np.where(np.isnan(sink).reshape(lead + (1, 1)), np.nan, 0)
        else:
            target = result if writes_in_place(result, q, k, v, m, slopes, sink, lens) else np.empty(out_shape, dtype)
            kv_dtype = k.dtype if kv_type else dtype
            qb = unit_last(broadcast(cast(q, dtype), lead + (Lq, E)))
            kb = unit_last(broadcast(cast(k, kv_dtype), kv_lead + (Lk, E)))
            vb = unit_last(broadcast(cast(v, kv_dtype), kv_lead + (Lk, Ev)))
            # query head h reads kv head h // group: each kv offset repeated group times
            koff, voff = lead_offsets(kb, nlead, group), lead_offsets(vb, nlead, group)
            ms = elem_strides(m)[-2:] if m is not None else (0, 0)
            # Positional, in _core.pyi's order, one line per group of its names: pybind11 takes
            # keywords at ~1.8 us a call (measured), a sixth of a small call. Debug and sanitizer
            # builds check every extent and stride against its array (tests/test_core_boundary.py).
            _core.attention(
                qb, kb, vb, target, bh, Lq, Lk, E, Ev, group,  # q, k, v, out, bh, Lq, Lk, E, Ev, group
                lead_offsets(qb, nlead), elem_strides(qb)[-2],  # qoff, q_rs
                koff, elem_strides(kb)[-2],  # koff, k_rs
                voff, elem_strides(vb)[-2],  # voff, v_rs
                lead_offsets(target, nlead), elem_strides(target)[-2],  # ooff, o_rs
                mask_kind, m, lead_offsets(m, nlead) if m is not None else None,  # mask_kind, mask, moff
                ms[0], ms[1],  # m_rs, m_cs
                lse, lead_offsets(lse, nlead) if lse is not None else None, 1,  # lse, lseoff, lse_s
                weights, lead_offsets(weights, nlead) if weights is not None else None, Lk,  # weights, woff, w_rs
                scale, bool(is_causal), causal_align == "bottom_right",  # scale, causal, bottom_right
                cap, slopes, sink, win_left, win_right,  # softcap, alibi, sinks, win_left, win_right
                lens, kv_type,  # kv_lens, kv_type
                None, None, None, 0, 0, 0,  # q_lens, block_table, bt_off, block_size, k_ps, v_ps
                None, None, 0, 0, None, None, 0, 0,  # k_scale, ksoff, ks_rs, ks_ps, v_scale, vsoff, vs_rs, vs_ps
            )  # fmt: skip
            if target is not result:
                result[...] = target
    if out is not None:
        result = out
    if not (return_weights or return_lse):
        return result
    extra = tuple(x for x in (weights, lse) if x is not None)
    return (result,) + extra


# ----------------------------------------------------------------------------- softmax


def softmax(x, axis=-1, *, scale=None, mask=None, out=None):
    """Numerically stable ``softmax(x * scale + mask)`` along ``axis``, fused in one pass.

    ``mask`` broadcasts to ``x.shape``: bool True = keep, float is added after scaling. A slice
    in which every entry is masked gives zeros.
    """
    a = float_array(x, "x")
    if a.ndim == 0:
        raise ValueError("x must have at least 1 dimension; got a scalar")
    ax = normalize_axis_index(axis, a.ndim, "axis")
    dtype = compute_dtype(a)
    result = np.empty(a.shape, dtype) if out is None else check_out(out, a.shape, dtype)
    mask_kind, m = 0, None
    if mask is not None:
        mask_kind, m = mask_array(mask, "mask", dtype)
        try:
            m = broadcast(m, a.shape)
        except ValueError:
            raise ValueError(f"mask has shape {np.shape(mask)}; expected a shape broadcastable to {a.shape}") from None
        m = strided_ok(np.moveaxis(m, ax, -1))
    sc = 1.0
    if scale is not None:
        sc = scale_value(scale, 1)
        if math.isfinite(sc) and abs(sc) > float(np.finfo(dtype).max):  # would round to inf: 0 * inf is NaN
            raise ValueError(f"scale {scale!r} overflows a {np.dtype(dtype).name} computation")
    if a.size == 0:
        return result if out is None else out
    target = result
    # Rows are computed one at a time, each read whole before it is written: out may be x itself
    # (same memory, same strides), but any other overlap would read rows already overwritten.
    if not writable_in_place(result) or (
        out is not None and (overlaps(result, m) or (overlaps(result, a) and not same_layout(result, a)))
    ):
        target = np.empty(a.shape, dtype)
    xs = strided_ok(np.moveaxis(cast(a, dtype), ax, -1))
    ts = np.moveaxis(target, ax, -1)
    nl = a.ndim - 1
    rows = math.prod(xs.shape[:-1])
    _core.softmax(  # positional, in _core.pyi's order (see scaled_dot_product_attention)
        xs, ts, rows, xs.shape[-1],  # x, out, rows, n
        lead_offsets(xs, nl), elem_strides(xs)[-1],  # xoff, xcs
        lead_offsets(ts, nl), elem_strides(ts)[-1],  # ooff, ocs
        mask_kind, m, lead_offsets(m, nl) if m is not None else None,  # mask_kind, mask, moff
        elem_strides(m)[-1] if m is not None else 0,  # mcs
        sc,  # scale
    )  # fmt: skip
    if target is not result:
        result[...] = target
    return result if out is None else out


# ----------------------------------------------------------------------------- matmul


def matmul(a, b, *, out=None):
    """``np.matmul`` semantics (1-D operands, broadcast batches) on pyattn's GEMM.

    float32 and float64 natively; mixed inputs promote as NumPy does.
    """
    if (
        out is None
        and type(a) is np.ndarray
        and type(b) is np.ndarray
        and a.ndim == 2
        and b.ndim == 2
        and a.dtype == b.dtype
        and (a.dtype == F32 or a.dtype == F64)
        and a.shape[1] == b.shape[0]
    ):
        # The common 2-D case without the general path's broadcasting bookkeeping (~20 us).
        isz = a.itemsize
        (ra, ca), (rb, cb) = a.strides, b.strides
        if a.flags.aligned and b.flags.aligned and not (ra % isz or ca % isz or rb % isz or cb % isz):
            (m, k), n = a.shape, b.shape[1]
            c = np.empty((m, n), a.dtype)
            _core.gemm(  # positional, in _core.pyi's order (see scaled_dot_product_attention)
                a, b, c, m, n, k,  # a, b, c, m, n, k
                ra // isz, ca // isz, rb // isz, cb // isz, n, 1,  # rsa, csa, rsb, csb, rsc, csc
                1, None, None, None,  # batch, offa, offb, offc
            )  # fmt: skip
            return c
    x = float_array(a, "a")
    y = float_array(b, "b")
    if x.ndim == 0 or y.ndim == 0:
        raise ValueError("matmul: operands must have at least 1 dimension (got a scalar)")
    dtype = compute_dtype(x, y)
    xa = x[None, :] if x.ndim == 1 else x
    yb = y[:, None] if y.ndim == 1 else y
    m, k = xa.shape[-2:]
    k2, n = yb.shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: a has shape {x.shape} and b has shape {y.shape}; inner sizes {k} and {k2} differ")
    batch = broadcast_lead((xa.shape[:-2], yb.shape[:-2]), ("a", "b"), "matmul")
    full = batch + (m, n)
    final = full
    if x.ndim == 1:
        final = final[:-2] + final[-1:]
    if y.ndim == 1:
        final = final[:-1]
    ov = check_out(out, final, dtype)  # written through; out is returned
    direct = ov is not None and ov.shape == full and writable_in_place(ov) and not overlaps(ov, x, y)
    c = ov if direct else np.empty(full, dtype)
    xa = strided_ok(broadcast(cast(xa, dtype), batch + (m, k)))
    yb = strided_ok(broadcast(cast(yb, dtype), batch + (k, n)))
    nl = len(batch)
    nb = math.prod(batch)
    sa, sb, sc = elem_strides(xa), elem_strides(yb), elem_strides(c)
    _core.gemm(  # positional, in _core.pyi's order (see scaled_dot_product_attention)
        xa, yb, c, m, n, k,  # a, b, c, m, n, k
        sa[-2], sa[-1], sb[-2], sb[-1], sc[-2], sc[-1],  # rsa, csa, rsb, csb, rsc, csc
        nb, lead_offsets(xa, nl) if nl else None,  # batch, offa
        lead_offsets(yb, nl) if nl else None, lead_offsets(c, nl) if nl else None,  # offb, offc
    )  # fmt: skip
    if out is not None:
        if not direct:
            ov[...] = c.reshape(final)
        return out
    return c.reshape(final)[()]  # 1-D @ 1-D: a NumPy scalar, as np.matmul gives


# ----------------------------------------------------------------------------- threads & config


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _thread_count(n) -> int:
    """``n`` checked as a thread count: 1 to 4 x the CPUs this process may run on (at least 16).
    More threads than cores only slows the kernels; far more exhausts the OS."""
    n = positive_int(n, "n")
    cpus = _usable_cpus()
    limit = max(16, 4 * cpus)
    if n > limit:
        raise ValueError(f"n must be <= {limit} (4 x the {cpus} CPUs this process may use, at least 16); got {n}")
    if n > 1 and _core.forked_after_team():
        warnings.warn(
            "pyattn runs on one thread in a process forked after a multi-threaded pyattn call (GNU OpenMP's "
            "thread pool cannot be used after fork); use the 'spawn' or 'forkserver' start method for "
            "multi-threaded workers",
            RuntimeWarning,
            stacklevel=3,
        )
    return n


def set_num_threads(n: int) -> None:
    """Threads used by every pyattn kernel from now on (process-wide): 1 to 4 x the CPUs (at least 16).

    A process forked after a multi-threaded pyattn call computes on one thread whatever this says
    (GNU OpenMP's pool does not survive fork); ``get_num_threads()`` reports 1 there.
    """
    _core.set_num_threads(_thread_count(n))


def get_num_threads() -> int:
    """Threads pyattn kernels use (default: OpenMP's, i.e. ``OMP_NUM_THREADS`` or the cores)."""
    return _core.get_num_threads()


@contextlib.contextmanager
def num_threads(n: int):
    """Context manager: run the block with ``n`` threads, then restore the previous count."""
    n = _thread_count(n)
    old = _core.thread_setting()  # 0 when unset: restored as unset, so threadpoolctl's limits reach pyattn again
    _core.set_num_threads(n)
    try:
        yield n
    finally:
        _core.set_num_threads(old)


def show_config(*, file=None) -> dict:
    """Print and return the build and run-time configuration."""
    from . import __version__

    reason = _core.isa_reason()
    # what chose the kernel set in use: not the variable's mere presence (an unknown name, or one
    # set after the choice was made, forces nothing)
    forced = "PYATTN_ISA" if reason == "forced by PYATTN_ISA" else "set_isa()" if reason == "set by set_isa()" else None
    cfg = {
        "version": __version__,
        "isa": _core.isa(),
        "isa_reason": reason,
        "isas_available": list(_core.available_isas()),
        "isa_forced_by": forced,
        # how the decode reads single K/V rows streamed from memory: key by key with software
        # prefetches (any CPU but Intel's) or several keys at a time without (Intel; the AVX2
        # set's rows of 512 bytes and more go key by key there too); see PYATTN_DECODE_PREFETCH
        "decode_prefetch": bool(_core.decode_prefetch_streams()),
        "threads": get_num_threads(),
        "compiler": _core.compiler,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    width = max(len(k) for k in cfg)
    for k, v in cfg.items():
        print(f"{k:>{width}} : {v}", file=file or sys.stdout)
    return cfg
