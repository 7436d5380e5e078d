"""Exact merge of partial attentions computed over disjoint key sets (split-KV, chunked caches)."""

from __future__ import annotations

import numpy as np

from ._validate import check_out

__all__ = ["merge_attention_states"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _states(x, name: str, trailing: str):
    """The n states of ``outputs``/``lses`` as a list of arrays, and a description for errors."""
    if isinstance(x, (list, tuple)):
        states = [np.asarray(s) for s in x]
        seen = f"{name} (a sequence of {len(states)} arrays of shapes {[s.shape for s in states]})"
    else:
        a = np.asarray(x)
        if a.ndim == 0:
            raise ValueError(f"{name} must be an array (n, {trailing}) or a sequence of n arrays; got a scalar")
        states = [a[i] for i in range(a.shape[0])]
        seen = f"{name} (shape {a.shape})"
    for i, s in enumerate(states):
        if s.dtype.kind != "f" or s.dtype.itemsize > 8:
            raise TypeError(f"{name}[{i}] must be a float32 or float64 array; got dtype {s.dtype}")
    return states, seen


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
    ``-inf``. NaN propagates. With ``sinks``, give the sinks to one of the calls only: each sink
    must be counted once in the union.

    The weights and the sum are computed in float64; the results have the promoted dtype of the
    inputs (float32 stays float32, float16 computes as float32). ``out`` receives the output:
    exactly its shape and dtype, any strides. The lse is always newly allocated.
    """
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
        lead = tuple(np.broadcast_shapes(*(o.shape[:-2] for o in outs), *(x.shape[:-1] for x in ls)))
    except ValueError:
        raise ValueError(f"the leading axes of {seen_o} and {seen_l} are not broadcastable") from None
    dtype = _F64 if np.result_type(*outs, *ls) == _F64 else _F32
    shape = lead + (lq, ev)
    if out is not None:
        check_out(out, shape, dtype)

    lse_n = np.empty((n,) + lead + (lq,), _F64)
    for i, x in enumerate(ls):
        lse_n[i] = x
    with np.errstate(invalid="ignore"):  # NaN propagates quietly, as in the kernels
        lse = np.logaddexp.reduce(lse_n, axis=0)  # -inf when every state is -inf
    lse_safe = np.where(np.isneginf(lse), 0.0, lse)  # all empty: exp(-inf - 0) = 0, no NaN
    acc = np.zeros(shape, _F64)
    term = np.empty(shape, _F64) if n > 1 else acc
    for i, o in enumerate(outs):
        w = np.exp(lse_n[i] - lse_safe)[..., None]  # 0 for an empty state
        empty = np.isneginf(lse_n[i])[..., None]
        if empty.any():  # an empty state contributes nothing, even NaN or inf in its output
            term[...] = 0.0
            np.multiply(o, w, out=term, where=~empty)
        else:
            np.multiply(o, w, out=term)
        if term is not acc:
            acc += term

    if out is None:
        out = acc if dtype == _F64 else acc.astype(dtype)
    else:
        out[...] = acc
    return out, lse.astype(dtype, copy=False)
