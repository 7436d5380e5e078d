"""Exact merge of partial attentions computed over disjoint key sets (split-KV, chunked caches)."""

from __future__ import annotations

import numpy as np

from . import _core
from ._validate import as_array, broadcast_shapes, cast, check_out, compute_dtype, is_float_dtype, same_layout

__all__ = ["merge_attention_states"]

_F64 = np.dtype(np.float64)


def _states(x, name: str, trailing: str):
    """The n states of ``outputs``/``lses`` as a list of arrays, and a description for errors."""
    if isinstance(x, (list, tuple)):
        states = [as_array(s, f"{name}[{i}]") for i, s in enumerate(x)]
        seen = f"{name} (a sequence of {len(states)} arrays of shapes {[s.shape for s in states]})"
    else:
        a = as_array(x, name)
        if a.ndim == 0:
            raise ValueError(f"{name} must be an array (n, {trailing}) or a sequence of n arrays; got a scalar")
        states = [a[i] for i in range(a.shape[0])]
        seen = f"{name} (shape {a.shape})"
    for i, s in enumerate(states):
        if not is_float_dtype(s.dtype):
            raise TypeError(
                f"{name}[{i}] must be a float array (float16, bfloat16, float32 or float64); got dtype {s.dtype}"
            )
    return states, seen


def _rows(a: np.ndarray, rows: int, n: int):
    """a (..., n) as a (rows, n) array with unit element stride (a view where the strides allow,
    a broadcast row keeping stride 0; else a copy), and its row stride in elements."""
    if n > 1 and a.strides[-1] != a.itemsize:
        a = np.ascontiguousarray(a)
    r = a.reshape(rows, n)
    if r.strides[0] % r.itemsize:
        r = np.ascontiguousarray(r)
    return r, r.strides[0] // r.itemsize


def merge_attention_states(outputs, lses, *, out=None):
    """Merge attentions computed over disjoint key sets into the attention over their union.

    ``outputs`` ``(n, ..., Lq, Ev)`` and ``lses`` ``(n, ..., Lq)``, or sequences of n arrays
    ``(..., Lq, Ev)`` and ``(..., Lq)``: the results of n calls of
    :func:`scaled_dot_product_attention` with ``return_lse=True``, each over its own set of keys
    (a shard of the KV cache, a chunk of a long context). The leading axes broadcast together.
    Returns ``(output, lse)``, exactly the attention over all the keys::

        lse    = log(sum_n exp(lse_n))                 (logaddexp over the n states)
        output = sum_n exp(lse_n - lse) * output_n

    The lse is the **natural-log** log-sum-exp that pyattn returns (FlashAttention's
    ``softmax_lse`` is too); FlashInfer's ``merge_state`` works in base 2, so convert its lse with
    ``lse * np.log(2)`` first. A state with ``lse_n = -inf`` (no visible key) contributes nothing,
    whatever its output holds; when every state is empty the output is zeros and the lse
    ``-inf``. A state with ``lse_n = +inf`` (a ``+inf`` sink) takes all the weight: the row is its
    output and the lse ``+inf``, as the call over the union gives (plus 0 times the other states'
    outputs where their lse is finite, so that their NaN reaches the row; with two such states
    the row's output is NaN and its lse ``+inf`` (log of inf + inf), with a NaN lse both are NaN).
    NaN propagates. With ``sinks``, give the sinks to one of the calls
    only: each sink must be counted once in the union.

    The weights and the sum are computed in float64; the results have the promoted dtype of the
    inputs (float32 stays float32, float16 and bfloat16 compute as float32). ``out`` receives the output:
    exactly its shape and dtype, any strides. The lse is always newly allocated.
    """
    outs, ls, lead, lq, ev, dtype = _checked(outputs, lses)
    ov = check_out(out, lead + (lq, ev), dtype)  # written through; out is returned
    res, lse = _merge(outs, ls, lead, lq, ev, dtype, ov)
    return (res if out is None else out), lse.astype(dtype, copy=False)


def _checked(outputs, lses):
    """The states as lists of arrays, their broadcast leading axes, Lq, Ev and the result dtype;
    every error of merge_attention_states."""
    outs, seen_o = _states(outputs, "outputs", "..., Lq, Ev")
    ls, seen_l = _states(lses, "lses", "..., Lq")
    n = len(outs)
    if n == 0:
        raise ValueError(f"merge_attention_states needs at least one state; got {seen_o}")
    if len(ls) != n:
        raise ValueError(f"{seen_o} holds {n} states but {seen_l} holds {len(ls)}; they must match")
    for i, o in enumerate(outs):
        if o.ndim < 2:
            raise ValueError(f"outputs[{i}] has shape {o.shape}; expected (..., Lq, Ev), from {seen_o}")
    for i, x in enumerate(ls):
        if x.ndim < 1:
            raise ValueError(f"lses[{i}] has shape {x.shape}; expected (..., Lq), from {seen_l}")
    lq, ev = outs[0].shape[-2:]
    for i, o in enumerate(outs):
        if o.shape[-2:] != (lq, ev):
            raise ValueError(f"outputs[{i}] has shape {o.shape}; expected (..., {lq}, {ev}) like outputs[0] ({seen_o})")
    for i, x in enumerate(ls):
        if x.shape[-1] != lq:
            raise ValueError(
                f"lses[{i}] has shape {x.shape}; expected (..., {lq}), the Lq of the outputs ({seen_o}; {seen_l})"
            )
    try:
        lead = broadcast_shapes(*(o.shape[:-2] for o in outs), *(x.shape[:-1] for x in ls))
    except ValueError:
        raise ValueError(f"the leading axes of {seen_o} and {seen_l} are not broadcastable") from None
    dtype = compute_dtype(*outs, *ls)  # (float16 and bfloat16 compute as float32)
    return outs, ls, lead, lq, ev, dtype


def _merge(outs, ls, lead: tuple, lq: int, ev: int, dtype, out=None):
    """The merge in the core, in one pass with no float64 temporaries the size of the outputs:
    the output in dtype (into out when given), the lse in float64."""
    shape = lead + (lq, ev)
    rows = lq * int(np.prod(lead, dtype=np.int64))
    # (cast: a copy also where the data is not aligned to its element size, as an array that
    # Dask unpickled into a worker may be; the core reads whole elements)
    o_rows = [_rows(np.broadcast_to(cast(o, dtype), shape), rows, ev) for o in outs]
    l_rows = [_rows(np.broadcast_to(cast(np.asarray(x), _F64), lead + (lq,))[..., None], rows, 1) for x in ls]
    # An out= over memory the states also use is written row by row while they are read: safe
    # only where it is that very state, element for element; otherwise computed apart, copied in.
    infinite = _infinite_rows(outs, ls, lead, lq, ev)  # (read before an out= over a state is written)
    apart = out is not None and any(
        np.may_share_memory(out, x) and not (x.shape == shape and same_layout(out, x)) for x in (*outs, *ls)
    )
    res = out if out is not None and not apart else np.empty(shape, dtype)
    target, t_rs = _rows(res, rows, ev)
    lse = np.empty(lead + (lq,), _F64)
    _core.merge(
        [r for r, _ in o_rows], [s for _, s in o_rows], [r for r, _ in l_rows], [s for _, s in l_rows],
        target, t_rs, lse.reshape(rows), rows, ev,
    )  # fmt: skip
    if not np.may_share_memory(target, res):  # an out= whose layout needed a copy
        res[...] = target.reshape(shape)
    for take, rows in infinite:
        res[take] = rows
    if apart:
        out[...] = res
        res = out
    return res, lse


def _infinite_rows(outs, ls, lead: tuple, lq: int, ev: int) -> list:
    """[(rows, their output)]: where one state has lse +inf (a +inf sink: zeros, lse +inf) it
    takes all the weight, the formula's limit (its exp(inf - inf) is NaN): the row is its output
    plus 0 times the output of every state that saw keys (finite lse), so that a NaN there still
    reaches the row, as in the call over the union. With two or more such states, or a NaN lse,
    the weights are undefined and the row stays NaN."""
    inf = [np.isposinf(x) for x in ls]
    if not any(x.any() for x in inf):
        return []
    rows = lead + (lq,)
    one = np.broadcast_to(sum(x.astype(np.int64) for x in inf), rows) == 1
    for x in ls:
        one = one & ~np.isnan(x)
    taken = []
    for n, x in enumerate(inf):
        take = one & x
        if not take.any():
            continue
        row = np.broadcast_to(outs[n], rows + (ev,))[take].astype(np.float64)  # (a copy)
        for m, (o, lm) in enumerate(zip(outs, ls)):
            if m == n:
                continue
            seen = np.broadcast_to(np.isfinite(lm), rows)[take]
            if seen.any():
                row += np.where(seen[:, None], 0.0 * np.broadcast_to(o, rows + (ev,))[take], 0.0)
        taken.append((take, row))
    return taken


def merge_states_f64(outputs, lses, dtype):
    """merge_attention_states with the output in ``dtype`` and the lse kept in float64 (pyattn.dask's
    merge tree: float32 outputs with float64 lses would otherwise promote to float64)."""
    outs, ls, lead, lq, ev, _ = _checked(outputs, lses)
    return _merge(outs, ls, lead, lq, ev, np.dtype(dtype))
