"""Plain-NumPy reference implementation of pyattn (the oracle).

Every function here mirrors the public function of the same name in :mod:`pyattn`
and is written to read like the formulas::

    scores  = Q K^T * scale (+ mask)           (..., Lq, Lk)
    weights = softmax(scores, axis=-1)          (..., Lq, Lk)
    output  = weights V                         (..., Lq, Ev)

It always computes in float64 and returns float64, materialises the full
``Lq x Lk`` score matrix, and validates very little.  It is the oracle of the
parity tests and the baseline of the benchmarks; read it to see exactly what
the fast path computes.

Conventions (as in the API contract):

* a bool mask means ``True = may attend``; a float mask is *added* to the
  scaled scores (``-inf`` forbids);
* ``key_padding_mask`` (B, Lk) bool means ``True = padding`` (ignored);
* ``is_causal`` with ``causal_align="top_left"``: query i sees keys j <= i;
  ``causal_align="bottom_right"``: query i sees keys j <= i + Lk - Lq;
* a query row with no key it may attend to gives zeros (weights 0, lse -inf;
  with ``sinks``, lse = the sink).

Score variants (keywords of :func:`scaled_dot_product_attention`), applied in this
order, with ``off = 0`` (top_left) or ``Lk - Lq`` (bottom_right; ``kv_lens[b] - Lq``
with ``kv_lens``)::

    s  = scale * q_i . k_j
    s  = c * tanh(s / c)                          softcap=c
    s -= slope_h * |i + off - j|                  alibi_slopes
    s += float mask; bool mask, is_causal, window, kv_lens hide keys (s = -inf)
    p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))   sinks
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "scaled_dot_product_attention",
    "multi_head_attention",
    "softmax",
    "matmul",
    "sinusoidal_positional_encoding",
    "additive_attention",
    "causal_mask",
    "logsumexp",
    "merge_attention_states",
]


def _f64(x):
    """x as float64 (float16 and ml_dtypes.bfloat16 convert exactly)."""
    return np.asarray(x, dtype=np.float64)


def _additive(mask):
    """A mask as an additive float64 array: bool True -> 0, False -> -inf."""
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, 0.0, -np.inf)
    return mask.astype(np.float64)


def _masked(scores, mask, what="scores", grow=False):
    """scores with mask applied: a float mask is added; a bool one replaces each score where it
    is False by -inf (replaced, not added: a NaN score there does not survive, as in pyattn). The
    mask broadcasts to scores' shape and may not enlarge it, unless ``grow`` (additive
    attention's mask may add leading axes to its output)."""
    mask = np.asarray(mask)
    if not grow and np.broadcast_shapes(mask.shape, scores.shape) != scores.shape:
        raise ValueError(f"mask has shape {mask.shape}; expected a shape broadcastable to the {what}' {scores.shape}")
    if mask.dtype == np.bool_:
        return np.where(mask, scores, -np.inf)
    return scores + mask.astype(np.float64)


def causal_mask(lq, lk, causal_align="top_left"):
    """Bool (Lq, Lk) mask, True where query i may see key j.

    top_left:      j <= i
    bottom_right:  j <= i + Lk - Lq
    """
    if causal_align == "top_left":
        offset = 0
    elif causal_align == "bottom_right":
        offset = lk - lq
    else:
        raise ValueError(f"causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    return j <= i + offset


def _check_window(window):
    if window is None:
        return None
    if isinstance(window, (set, frozenset, dict)):  # two sides but no order between them
        raise TypeError(f"window must be an ordered pair (left, right), a tuple or list; got {window!r}")
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None; got {window!r}")
    sides = []
    for side in window:
        if side is not None:
            if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
                raise TypeError(f"window sides must be ints >= 0 or None; got {window!r}")
            if side < 0:
                raise ValueError(f"window sides must be >= 0 (or None); got {window!r}")
            side = int(side)
        sides.append(side)
    return tuple(sides)


def _per_head(x, name, lead):
    """alibi_slopes / sinks as float64 of shape ``lead`` (the output's leading axes)."""
    a = np.asarray(x)
    if not (a.dtype.kind in "fiu" or a.dtype.name == "bfloat16"):
        raise TypeError(f"{name} must be a float array; got dtype {a.dtype}")
    a = a.astype(np.float64)
    if lead == () and a.size == 1:
        return a.reshape(())
    try:
        return np.broadcast_to(a, lead)
    except ValueError:
        raise ValueError(f"{name} has shape {a.shape}; expected a shape broadcastable to {lead} (..., Hq)") from None


def _kv_lens(x, lead, lk):
    """kv_lens as int64 of shape ``lead[:-1]`` (the leading axes before the heads)."""
    a = np.asarray(x)
    # (NumPy keeps Python ints past int64 as objects: range-checked below like any other)
    ints = (
        a.dtype == object and a.size and all(isinstance(v, (int, np.integer)) and type(v) is not bool for v in a.flat)
    )
    if a.dtype.kind not in "iu" and not ints:
        raise TypeError(f"kv_lens must be an integer array; got dtype {a.dtype}")
    want = lead[:-1]
    if want == () and a.size == 1:
        a = a.reshape(())
    else:
        try:
            a = np.broadcast_to(a, want)
        except ValueError:
            raise ValueError(
                f"kv_lens has shape {a.shape}; expected a shape broadcastable to {want} "
                "(the leading axes before the heads)"
            ) from None
    if a.size and (a.min() < 0 or a.max() > lk):
        raise ValueError(f"kv_lens must be in [0, Lk={lk}]; got values in [{a.min()}, {a.max()}]")
    return a.astype(np.int64)


def logsumexp(scores, axis=-1):
    """log(sum(exp(scores))) along ``axis``; -inf for rows that are all -inf (or empty), +inf for
    rows holding +inf."""
    scores = _f64(scores)
    m = np.max(scores, axis=axis, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isinf(m), 0.0, m)
    with np.errstate(over="ignore"):  # beside a +inf score (a row whose sum is +inf anyway)
        s = np.sum(np.exp(scores - m_safe), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = m_safe + np.log(s)
    return np.squeeze(lse, axis=axis)


def _softmax_rows(scores, axis=-1, sink=None):
    """softmax(scores) along ``axis``; rows that are all -inf (or empty) give zeros.

    ``sink`` (broadcastable to the scores with ``axis`` of size 1): one more logit in each
    row's denominator, with no value: ``p_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))``.
    Returns (weights, lse); lse includes the sink.
    """
    m = np.max(scores, axis=axis, keepdims=True, initial=-np.inf)
    if sink is not None:
        m = np.maximum(m, sink)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # all-masked row: exp(-inf - 0) = 0
    with np.errstate(over="ignore"):  # a score past -max below the maximum: -inf, weight 0
        e = np.exp(scores - m_safe)
    s = np.sum(e, axis=axis, keepdims=True)
    if sink is not None:  # a +inf sink takes all the mass (its term exp(inf - inf) read as the limit, 1)
        with np.errstate(invalid="ignore"):
            s = s + np.where(np.isposinf(sink) & np.isposinf(m), 1.0, np.exp(sink - m_safe))
    with np.errstate(divide="ignore", invalid="ignore"):
        weights = np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)
        weights = np.where(np.isnan(s), np.nan, weights)  # NaN propagates
        lse = m_safe + np.log(s)
    return weights, np.squeeze(lse, axis=axis)


def softmax(x, axis=-1, *, scale=None, mask=None):
    """softmax(x * scale + mask) along ``axis``.

    x: any shape; mask: broadcastable to x (bool True = keep, float = added).
    Fully masked rows give zeros.  Returns float64 of x's shape.
    """
    x = _f64(x)
    z = x if scale is None else x * float(scale)
    if mask is not None:
        z = _masked(z, mask, "input")
    weights, _ = _softmax_rows(z, axis=axis)
    return weights


def matmul(a, b):
    """a @ b with np.matmul semantics, in float64."""
    return np.matmul(_f64(a), _f64(b))


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
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    kv_lens=None,
):
    """softmax(Q K^T * scale + mask) V, with the score variants.

    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev);
    attn_mask broadcastable to (..., Hq, Lq, Lk).  With enable_gqa, query head h
    uses kv head h // (Hq // Hkv).  key/value may be float16 or bfloat16: they are
    converted to float64 like everything else.

    With ``off`` = 0 (top_left) or Lk - Lq (bottom_right; kv_lens[b] - Lq with
    kv_lens), the score of query i and key j is, in this order:

    1. s = scale * q_i . k_j
    2. softcap=c > 0:   s = c * tanh(s / c)
    3. alibi_slopes:    s -= slope_h * |i + off - j|      (broadcastable to (..., Hq))
    4. attn_mask:       a float mask is added; a bool mask, is_causal, window and
                        kv_lens hide keys (s = -inf)
    5. window=(left, right): key j visible iff i + off - left <= j <= i + off + right
                        (None: that side unbounded; is_causal caps the right side at 0)
    6. sinks:           p_j = exp(s_j) / (exp(sink_h) + sum_k exp(s_k))  (broadcastable
                        to (..., Hq)); lse includes the sink
    7. kv_lens:         only keys j < kv_lens[b] exist (integer, broadcastable to the
                        leading axes before the heads; in [0, Lk])

    Returns output (..., Hq, Lq, Ev) and, in this order when asked, the weights
    (..., Hq, Lq, Lk) and the row log-sum-exp (..., Hq, Lq) of the final scores
    (with the sink).  A row with no visible key gives zeros, lse -inf (the sink
    with sinks).
    """
    q, k, v = _f64(query), _f64(key), _f64(value)
    lq, e = q.shape[-2], q.shape[-1]
    lk = k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(e) if e > 0 else 1.0
    if causal_align not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_align must be 'top_left' or 'bottom_right', got {causal_align!r}")
    window = _check_window(window)
    if softcap is not None:
        softcap = float(softcap)
        if not 0 < softcap < math.inf:  # also refuses NaN
            raise ValueError(f"softcap must be a finite number > 0; got {softcap}")

    if enable_gqa and q.ndim >= 3 and k.ndim >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hq != hkv:
            group = hq // hkv
            k = np.repeat(k, group, axis=-3)  # kv head h // group serves query head h
            v = np.repeat(v, group, axis=-3)

    # 1. the scaled scores
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale  # (..., Lq, Lk)
    # the output's leading axes (..., Hq): value's may add to those of q and k, and the lse, the
    # weights and the per-head / per-batch keywords are shaped by them, as the output is
    lead = np.broadcast_shapes(scores.shape[:-2], v.shape[:-2])
    scores = np.broadcast_to(scores, lead + scores.shape[-2:])  # a view: every step below makes a new array

    # where query i sits among the keys: rel = i + off - j (0 on the causal diagonal)
    off = 0
    n_keys = None  # keys that exist, (..., Hq, 1, 1)
    if kv_lens is not None:
        kv = _kv_lens(kv_lens, lead, lk)
        n_keys = (np.broadcast_to(kv[..., None], lead) if lead else kv)[..., None, None]
    if causal_align == "bottom_right":
        off = (lk if n_keys is None else n_keys) - lq
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    rel = i + off - j

    # 2. softcap
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    # 3. ALiBi
    if alibi_slopes is not None:
        slopes = _per_head(alibi_slopes, "alibi_slopes", lead)[..., None, None]
        scores = scores - slopes * np.abs(rel)
    # 4. the mask: a float mask is added (a bool one puts -inf where False)
    if attn_mask is not None:
        scores = _masked(scores, attn_mask)
    # 4, 5, 7. is_causal, window and kv_lens hide keys
    visible = np.ones(np.shape(rel), dtype=bool)
    if is_causal:
        visible = visible & (rel >= 0)  # j <= i + off
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (rel <= left)  # j >= i + off - left
        if right is not None:
            visible = visible & (rel >= -right)  # j <= i + off + right
    if n_keys is not None:
        visible = visible & (j < n_keys)
        # keys past kv_lens do not exist: their values are never read
        v = np.where(np.arange(lk)[:, None] < n_keys, v, 0.0)
    if is_causal or window is not None or n_keys is not None:
        scores = np.where(visible, scores, -np.inf)

    # 6. softmax, with the sink in the denominator
    sink = None if sinks is None else _per_head(sinks, "sinks", lead)[..., None, None]
    weights, lse = _softmax_rows(scores, axis=-1, sink=sink)
    out = np.matmul(weights, v)  # (..., Lq, Ev); Lk = 0 gives zeros
    if lk == 0 and sink is not None:  # 0 / exp(sink), as where keys exist but none is seen
        out = np.where(np.isnan(lse)[..., None], np.nan, out)
    if (is_causal or window is not None) and not np.isfinite(v).all():
        out = _hidden_values_left_out(weights, v, visible, out)

    if not (return_weights or return_lse):
        return out
    result = (out,)
    if return_weights:
        result += (weights,)
    if return_lse:
        result += (lse,)
    return result


def _hidden_values_left_out(weights, v, visible, out):
    """out = sum_j w[i, j] v[j] over the keys j that query i sees by position only: a value row
    hidden from a query (causal, window) is no part of its output, not even as 0 * inf = NaN.
    Only the rows whose matmul met a non-finite value are redone, query by query."""
    w, vis = np.broadcast_arrays(weights, visible)
    vb = np.broadcast_to(v, w.shape[:-2] + v.shape[-2:])
    out = np.array(out, copy=True)
    for idx in zip(*np.nonzero(~np.isfinite(out).all(axis=-1))):
        keep = vis[idx]
        out[idx] = w[idx][keep] @ vb[idx[:-1]][keep]
    return out


def merge_attention_states(outputs, lses):
    """Attention over the union of disjoint key sets from the partial results over each.

    outputs (n, ..., Lq, Ev) and lses (n, ..., Lq) (or sequences of n arrays), each pair from
    a call with return_lse=True (natural log)::

        lse    = log(sum_n exp(lse_n))
        output = sum_n exp(lse_n - lse) * output_n

    A state with lse_n = -inf (no visible key) contributes nothing; if all are empty the
    output is zeros and lse -inf. A state with lse_n = +inf (a +inf sink) takes all the weight,
    the formula's limit: its output (plus 0 times each other state with a finite lse, so that
    their NaN stays), lse +inf (two such states, or a NaN lse: NaN).  Returns (output, lse) in
    float64.
    """
    outs = [_f64(o) for o in outputs]
    ls = [_f64(x) for x in lses]
    # The weights exp(lse_n - lse), as exp(lse_n - top) over their sum (logsumexp's own terms):
    # lse itself rounds off the log of a sum of n terms where |lse| is large (1e16: equal states
    # each weighed 1, not 1/n)
    top = np.max(np.stack(np.broadcast_arrays(*ls)), axis=0)
    top_safe = np.where(np.isinf(top), 0.0, top)
    out, total = 0.0, 0.0
    for o, x in zip(outs, ls):
        # (invalid: inf - inf beside a +inf state, replaced below; 0 * inf in an empty state, discarded)
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.exp(x - top_safe)  # (0 for an empty state)
            out = out + np.where(np.isneginf(x)[..., None], 0.0, w[..., None] * o)  # empty: contributes nothing
            total = total + w
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = top_safe + np.log(total)  # = logsumexp over the states
        out = out / np.where(total == 0, 1.0, total)[..., None]  # every state empty: zeros
    n_inf = sum(np.isposinf(x).astype(np.int64) for x in ls)
    any_nan = sum(np.isnan(x).astype(np.int64) for x in ls) > 0
    for n, (o, x) in enumerate(zip(outs, ls)):
        # the +inf state's output, plus 0 times every other state that saw keys: their NaN stays
        others = sum(
            np.where(np.isfinite(y)[..., None], 0.0 * w, 0.0) for m, (w, y) in enumerate(zip(outs, ls)) if m != n
        )
        out = np.where((np.isposinf(x) & (n_inf == 1) & ~any_nan)[..., None], o + others, out)
    # the leading axes of outputs and lses broadcast together, the lse's too
    return out, np.broadcast_to(lse, out.shape[:-1]).copy()


def multi_head_attention(
    query,
    key,
    value,
    num_heads,
    w_q,
    w_k,
    w_v,
    w_o,
    b_q=None,
    b_k=None,
    b_v=None,
    b_o=None,
    *,
    num_kv_heads=None,
    attn_mask=None,
    key_padding_mask=None,
    is_causal=False,
    causal_align="top_left",
    need_weights=False,
    average_attn_weights=True,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    kv_lens=None,
):
    """Multi-head attention, row-vector convention, batch first.

    query (B, Lq, Eq), key (B, Lk, Ek), value (B, Lk, Ev), or unbatched (L, E).
    Q = query @ w_q + b_q   w_q (Eq, H*D)
    K = key   @ w_k + b_k   w_k (Ek, Hkv*D)
    V = value @ w_v + b_v   w_v (Ev, Hkv*Dv)
    heads attended, concatenated (B, Lq, H*Dv), then @ w_o + b_o.

    attn_mask broadcasts to (B, H, Lq, Lk) (torch's (B*H, Lq, Lk) is accepted);
    key_padding_mask (B, Lk) True = padding.
    window, softcap, alibi_slopes (H,), sinks (H,) and kv_lens (B,) (unbatched: a
    scalar) are passed to scaled_dot_product_attention.
    Returns (output, weights) where weights is None unless need_weights; then
    (B, Lq, Lk) averaged over heads, or (B, H, Lq, Lk).
    """
    q_in, k_in, v_in = _f64(query), _f64(key), _f64(value)
    unbatched = q_in.ndim == 2
    if unbatched:
        q_in, k_in, v_in = q_in[None], k_in[None], v_in[None]
    h = int(num_heads)
    hkv = h if num_kv_heads is None else int(num_kv_heads)
    w_q, w_k, w_v, w_o = _f64(w_q), _f64(w_k), _f64(w_v), _f64(w_o)
    d = w_q.shape[1] // h
    dv = w_v.shape[1] // hkv

    def project(x, w, b):
        y = x @ w
        return y if b is None else y + _f64(b)

    Q = project(q_in, w_q, b_q)  # (B, Lq, H*D)
    K = project(k_in, w_k, b_k)  # (B, Lk, Hkv*D)
    V = project(v_in, w_v, b_v)  # (B, Lk, Hkv*Dv)
    bsz = np.broadcast_shapes(Q.shape[:1], K.shape[:1], V.shape[:1])[0]  # a batch of 1 broadcasts
    lq, lk = Q.shape[1], K.shape[1]

    def split_heads(x, heads, dim):  # (B, L, heads*dim) -> (B, heads, L, dim)
        return x.reshape(x.shape[0], x.shape[1], heads, dim).transpose(0, 2, 1, 3)

    Qh, Kh, Vh = split_heads(Q, h, d), split_heads(K, hkv, d), split_heads(V, hkv, dv)

    # Two bool masks stay one bool mask (True = attend), so a hidden score is replaced, not added
    # to: a NaN key they hide does not reach the output. Any float mask makes the pair additive.
    mask = None
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype != np.bool_:
            m = m.astype(np.float64)
        if m.ndim == 3 and not unbatched and m.shape[0] == bsz * h and bsz * h != h:
            m = m.reshape(bsz, h, lq, lk)  # torch's (B*H, Lq, Lk)
        mask = m
    if key_padding_mask is not None:
        kpm = np.asarray(key_padding_mask)
        if unbatched:
            kpm = kpm[None]
        kpm = kpm[:, None, None, :]  # (B, 1, 1, Lk)
        if kpm.dtype == np.bool_ and (mask is None or mask.dtype == np.bool_):
            keep = ~kpm  # True = padding
            mask = keep if mask is None else mask & keep
        else:
            kpm = np.where(kpm, -np.inf, 0.0) if kpm.dtype == np.bool_ else kpm.astype(np.float64)
            mask = kpm if mask is None else _additive(mask) + kpm

    out, weights = scaled_dot_product_attention(
        Qh,
        Kh,
        Vh,
        mask,
        is_causal=is_causal,
        causal_align=causal_align,
        enable_gqa=hkv != h,
        return_weights=True,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        kv_lens=kv_lens,
    )  # (B, H, Lq, Dv), (B, H, Lq, Lk)
    concat = out.transpose(0, 2, 1, 3).reshape(bsz, lq, h * dv)
    output = project(concat, w_o, b_o)

    if need_weights:
        weights = np.broadcast_to(weights, (bsz, h, lq, lk))
        if average_attn_weights:
            weights = weights.mean(axis=1)
        weights = np.array(weights)
    else:
        weights = None
    if unbatched:
        output = output[0]
        if weights is not None:
            weights = weights[0]
    return output, weights


def sinusoidal_positional_encoding(num_positions, d_model, *, base=10000.0):
    """Sinusoidal positions (num_positions, d_model), float64.

    PE[pos, 2i]   = sin(pos / base^(2i / d_model))
    PE[pos, 2i+1] = cos(pos / base^(2i / d_model))
    (odd d_model: the last column is a sin).
    """
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    two_i = (np.arange(d_model) // 2 * 2).astype(np.float64)[None, :]
    angle = pos / np.power(float(base), two_i / d_model)
    pe = np.empty((num_positions, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle[:, 0::2])
    pe[:, 1::2] = np.cos(angle[:, 1::2])
    return pe


def additive_attention(query, keys, w_query, w_keys, v, *, values=None, mask=None, return_weights=False):
    """Bahdanau attention: e_ij = v^T tanh(query_i W_query + keys_j W_keys).

    query (..., Lq, Dq), keys (..., Lk, Dk), w_query (Dq, A), w_keys (Dk, A), v (A,);
    values (..., Lk, Dv) default to keys; mask broadcastable to (..., Lq, Lk),
    bool True = may attend.  weights = softmax_j(e), output = weights @ values.
    Returns output (..., Lq, Dv), or (output, weights).
    """
    q, k = _f64(query), _f64(keys)
    vals = k if values is None else _f64(values)
    qa = q @ _f64(w_query)  # (..., Lq, A)
    ka = k @ _f64(w_keys)  # (..., Lk, A)
    e = np.tanh(qa[..., :, None, :] + ka[..., None, :, :]) @ _f64(v)  # (..., Lq, Lk)
    if mask is not None:
        e = _masked(e, mask, grow=True)
    weights, _ = _softmax_rows(e, axis=-1)
    out = weights @ vals
    return (out, weights) if return_weights else out
