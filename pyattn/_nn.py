"""Layers built on the kernels: multi-head attention, positional encodings, Bahdanau attention."""

from __future__ import annotations

import math

import numpy as np

from ._api import matmul, scaled_dot_product_attention, softmax
from ._validate import (
    as_array,
    broadcast_lead,
    compute_dtype,
    dtype_arg,
    float_array,
    is_float_dtype,
    positive_int,
    real_float,
)

__all__ = [
    "multi_head_attention",
    "MultiHeadAttention",
    "sinusoidal_positional_encoding",
    "additive_attention",
]


def _linear(x, w, b):
    """``x @ w + b`` on pyattn's GEMM."""
    y = matmul(x, w)
    if b is not None:
        y += b
    return y


def _split_heads(x, heads):
    """(B, L, heads*d) -> (B, heads, L, d) as a strided view (no copy)."""
    B, L, D = x.shape
    return x.reshape(B, L, heads, D // heads).transpose(0, 2, 1, 3)


def _mha_mask(attn_mask, key_padding_mask, B, H, Lq, Lk, dtype):
    """One mask broadcastable to (B, H, Lq, Lk) from attn_mask and key_padding_mask."""
    mask = None
    if attn_mask is not None:
        mask = as_array(attn_mask, "attn_mask")
        if mask.dtype != np.bool_ and not is_float_dtype(mask.dtype):
            raise TypeError(f"attn_mask must be a bool or float array; got dtype {mask.dtype}")
        if mask.ndim == 3 and mask.shape[0] == B * H and B * H != 1 and mask.shape[1:] == (Lq, Lk):
            mask = mask.reshape(B, H, Lq, Lk)  # torch's (B*num_heads, Lq, Lk) layout
        try:
            np.broadcast_shapes(mask.shape, (B, H, Lq, Lk))
        except ValueError:
            raise ValueError(
                f"attn_mask has shape {mask.shape}; expected a shape broadcastable to {(B, H, Lq, Lk)} "
                f"or {(B * H, Lq, Lk)}"
            ) from None
    if key_padding_mask is not None:
        kpm = as_array(key_padding_mask, "key_padding_mask")
        if kpm.shape != (B, Lk):
            raise ValueError(f"key_padding_mask has shape {kpm.shape}; expected (batch, Lk) = {(B, Lk)}")
        if kpm.dtype == np.bool_:
            if mask is None or mask.dtype == np.bool_:
                keep = ~kpm[:, None, None, :]
                mask = keep if mask is None else (mask & keep)
            else:
                mask = mask + np.where(kpm, -np.inf, 0.0).astype(dtype)[:, None, None, :]
        elif is_float_dtype(kpm.dtype):  # additive padding mask, as torch accepts
            add = kpm.astype(dtype)[:, None, None, :]
            if mask is None:
                mask = add
            elif mask.dtype == np.bool_:
                mask = np.where(mask, 0.0, -np.inf).astype(dtype) + add
            else:
                mask = mask + add
        else:
            raise TypeError(f"key_padding_mask must be a bool or float array; got dtype {kpm.dtype}")
    return mask


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
    """Multi-head attention with row-vector projections (``Q = query @ w_q + b_q``).

    query ``(B, Lq, E_q)`` or unbatched ``(Lq, E_q)``; key ``(B, Lk, E_k)``, value ``(B, Lk, E_v)``.
    w_q ``(E_q, H*d)``, w_k ``(E_k, Hkv*d)``, w_v ``(E_v, Hkv*dv)``, w_o ``(H*dv, E_out)``; biases
    are 1-D. ``num_kv_heads`` (default ``num_heads``) < ``num_heads`` gives grouped-query attention.
    ``attn_mask`` broadcasts to ``(B, H, Lq, Lk)`` (or torch's ``(B*H, Lq, Lk)``), bool True = may
    attend; ``key_padding_mask`` ``(B, Lk)``, True = padding.

    The score variants are passed to :func:`scaled_dot_product_attention` (same semantics, with
    ``causal_align``): ``window=(left, right)``, ``softcap``, ``alibi_slopes`` ``(H,)``, ``sinks``
    ``(H,)`` and ``kv_lens`` ``(B,)`` (a scalar for unbatched input): only the first
    ``kv_lens[b]`` keys of sequence b exist.

    Returns ``(output, weights)`` like torch: output ``(B, Lq, E_out)``; weights ``None`` unless
    ``need_weights``, then ``(B, Lq, Lk)`` averaged over heads, or ``(B, H, Lq, Lk)``.
    """
    H = positive_int(num_heads, "num_heads")
    Hkv = H if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
    if H % Hkv:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv})")
    q_in = float_array(query, "query")
    k_in = q_in if key is query else float_array(key, "key")
    v_in = k_in if value is key else (q_in if value is query else float_array(value, "value"))
    unbatched = q_in.ndim == 2
    for a, name in ((q_in, "query"), (k_in, "key"), (v_in, "value")):
        if a.ndim != (2 if unbatched else 3):
            raise ValueError(f"{name} must be (batch, L, E), or (L, E) for all three unbatched; got shape {a.shape}")
    if unbatched:
        q_in, k_in, v_in = q_in[None], k_in[None], v_in[None]
        if key_padding_mask is not None:
            key_padding_mask = as_array(key_padding_mask, "key_padding_mask")
            if key_padding_mask.shape != k_in.shape[1:2]:  # (checked here: its shape as given)
                raise ValueError(
                    f"key_padding_mask has shape {key_padding_mask.shape}; expected (Lk,) = {k_in.shape[1:2]} "
                    "for unbatched inputs"
                )
            key_padding_mask = key_padding_mask[None]
    ws = [float_array(w, n) for w, n in ((w_q, "w_q"), (w_k, "w_k"), (w_v, "w_v"), (w_o, "w_o"))]
    bs = [None if b is None else float_array(b, n) for b, n in ((b_q, "b_q"), (b_k, "b_k"), (b_v, "b_v"), (b_o, "b_o"))]
    dtype = compute_dtype(q_in, k_in, v_in, *ws, *[b for b in bs if b is not None])
    wq, wk, wv, wo = ws
    for w, name in zip(ws, ("w_q", "w_k", "w_v", "w_o")):
        if w.ndim != 2:
            raise ValueError(f"{name} must be 2-D (in_features, out_features); got shape {w.shape}")
    # a batch of 1 broadcasts against any other, 0 included (as NumPy's broadcasting)
    B = next((a.shape[0] for a in (q_in, k_in, v_in) if a.shape[0] != 1), 1)
    for a, name in ((q_in, "query"), (k_in, "key"), (v_in, "value")):
        if a.shape[0] not in (1, B):
            raise ValueError(f"{name} has batch size {a.shape[0]}; expected {B} (or 1)")
    if k_in.shape[1] != v_in.shape[1]:
        raise ValueError(f"key has length {k_in.shape[1]} and value has length {v_in.shape[1]}; they must match")
    for x, w, name in ((q_in, wq, "w_q"), (k_in, wk, "w_k"), (v_in, wv, "w_v")):
        if w.shape[0] != x.shape[-1]:
            raise ValueError(f"{name} has shape {w.shape}; its first dimension must be the input width {x.shape[-1]}")
    if wq.shape[1] % H:
        raise ValueError(f"w_q has {wq.shape[1]} output columns, not divisible by num_heads={H}")
    d = wq.shape[1] // H
    if wk.shape[1] != Hkv * d:
        raise ValueError(f"w_k has shape {wk.shape}; expected {(wk.shape[0], Hkv * d)} (num_kv_heads * head_dim)")
    if wv.shape[1] % Hkv:
        raise ValueError(f"w_v has {wv.shape[1]} output columns, not divisible by num_kv_heads={Hkv}")
    dv = wv.shape[1] // Hkv
    if wo.shape[0] != H * dv:
        raise ValueError(f"w_o has shape {wo.shape}; expected {H * dv} input rows (num_heads * value head_dim)")
    for b, w, name in zip(bs, ws, ("b_q", "b_k", "b_v", "b_o")):
        if b is not None and b.shape != (w.shape[1],):
            raise ValueError(f"{name} has shape {b.shape}; expected {(w.shape[1],)}")

    Lq, Lk = q_in.shape[1], k_in.shape[1]
    q = _linear(q_in, wq.astype(dtype, copy=False), bs[0])
    k = _linear(k_in, wk.astype(dtype, copy=False), bs[1])
    v = _linear(v_in, wv.astype(dtype, copy=False), bs[2])
    if q.shape[0] != B:
        q = np.broadcast_to(q, (B,) + q.shape[1:])
    if k.shape[0] != B:
        k = np.broadcast_to(k, (B,) + k.shape[1:])
        v = np.broadcast_to(v, (B,) + v.shape[1:])
    mask = _mha_mask(attn_mask, key_padding_mask, B, H, Lq, Lk, dtype)
    ctx = np.empty((B, Lq, H * dv), dtype)
    res = scaled_dot_product_attention(
        _split_heads(q, H),
        _split_heads(k, Hkv),
        _split_heads(v, Hkv),
        mask,
        is_causal=is_causal,
        causal_align=causal_align,
        enable_gqa=Hkv != H,
        return_weights=need_weights,
        out=_split_heads(ctx, H),
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        sinks=sinks,
        kv_lens=kv_lens,
    )
    y = _linear(ctx, wo.astype(dtype, copy=False), bs[3])
    weights = None
    if need_weights:
        weights = res[1].mean(axis=1) if average_attn_weights else res[1]
    if unbatched:
        y = y[0]
        weights = None if weights is None else weights[0]
    return y, weights


class MultiHeadAttention:
    """Multi-head attention layer holding its projections; loads torch ``nn.MultiheadAttention``
    weights through :meth:`load_state_dict`.

    Parameters are kept in pyattn's row-vector convention: ``w_q`` is ``(embed_dim, H*d)`` (the
    transpose of torch's weight). ``__call__(query, key=None, value=None, ...)`` defaults key and
    value to query and returns ``(output, weights_or_None)`` as :func:`multi_head_attention`; the
    score variants (``window``, ``softcap``, ``alibi_slopes``, ``sinks``, ``kv_lens``) are passed
    through to it.
    """

    def __init__(self, embed_dim, num_heads, *, num_kv_heads=None, kdim=None, vdim=None, bias=True,
                 dtype=np.float32, rng=None):  # fmt: skip
        self.embed_dim = positive_int(embed_dim, "embed_dim")
        self.num_heads = positive_int(num_heads, "num_heads")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.kdim = self.embed_dim if kdim is None else positive_int(kdim, "kdim")
        self.vdim = self.embed_dim if vdim is None else positive_int(vdim, "vdim")
        self.dtype = dtype_arg(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64; got {self.dtype}")
        self.head_dim = self.embed_dim // self.num_heads
        self.bias = bool(bias)
        kv = self.num_kv_heads * self.head_dim
        rng = np.random.default_rng(rng)

        def xavier(fan_in, fan_out):  # torch's xavier_uniform_ on the (out, in) weight
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            return rng.uniform(-bound, bound, size=(fan_in, fan_out)).astype(self.dtype)

        E = self.embed_dim
        self.w_q, self.w_k, self.w_v = xavier(E, E), xavier(self.kdim, kv), xavier(self.vdim, kv)
        self.w_o = xavier(E, E)
        zeros = (lambda n: np.zeros(n, self.dtype)) if self.bias else (lambda n: None)
        self.b_q, self.b_k, self.b_v, self.b_o = zeros(E), zeros(kv), zeros(kv), zeros(E)

    @property
    def _packed(self) -> bool:
        """Whether torch stores the q/k/v weights as one ``in_proj_weight``."""
        return self.kdim == self.embed_dim and self.vdim == self.embed_dim and self.num_kv_heads == self.num_heads

    def num_parameters(self) -> int:
        """The number of weights and biases the layer holds (the sizes of its state_dict's arrays)."""
        return sum(int(v.size) for v in self.state_dict().values())

    def __call__(self, query, key=None, value=None, *, attn_mask=None, key_padding_mask=None, is_causal=False,
                 need_weights=False, average_attn_weights=True, window=None, softcap=None, alibi_slopes=None,
                 sinks=None, kv_lens=None):  # fmt: skip
        if key is None:
            key = query
        if value is None:
            value = key
        for x, width, name in ((query, self.embed_dim, "query"), (key, self.kdim, "key"), (value, self.vdim, "value")):
            shape = np.shape(x)
            if not shape or shape[-1] != width:
                raise ValueError(f"{name} has shape {shape}; expected (..., {width}) for this layer")
        return multi_head_attention(
            query, key, value, self.num_heads, self.w_q, self.w_k, self.w_v, self.w_o,
            self.b_q, self.b_k, self.b_v, self.b_o,
            num_kv_heads=self.num_kv_heads, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            is_causal=is_causal, need_weights=need_weights, average_attn_weights=average_attn_weights,
            window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, kv_lens=kv_lens,
        )  # fmt: skip

    def state_dict(self) -> dict:
        """Parameters under torch ``nn.MultiheadAttention``'s names and (out, in) layout."""
        sd = {}
        if self._packed:
            sd["in_proj_weight"] = np.concatenate([self.w_q.T, self.w_k.T, self.w_v.T], axis=0)
        else:
            sd["q_proj_weight"] = np.ascontiguousarray(self.w_q.T)
            sd["k_proj_weight"] = np.ascontiguousarray(self.w_k.T)
            sd["v_proj_weight"] = np.ascontiguousarray(self.w_v.T)
        if self.bias:
            sd["in_proj_bias"] = np.concatenate([self.b_q, self.b_k, self.b_v])
        sd["out_proj.weight"] = np.ascontiguousarray(self.w_o.T)
        if self.bias:
            sd["out_proj.bias"] = self.b_o.copy()
        return sd

    def load_state_dict(self, mapping) -> None:
        """Load torch ``nn.MultiheadAttention`` parameters given as NumPy arrays."""
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        sd = {k: as_array(v, k) for k, v in dict(mapping).items() if v is not None}  # None: no such parameter
        unsupported = {"bias_k", "bias_v"} & sd.keys()
        if unsupported:
            raise ValueError(f"load_state_dict: {sorted(unsupported)} (add_bias_kv) is not supported")

        def take(name, shape):
            if name not in sd:
                raise KeyError(f"load_state_dict: missing key {name!r}")
            a = sd.pop(name)
            if not is_float_dtype(a.dtype):
                raise TypeError(f"load_state_dict: {name!r} must be floating point; got dtype {a.dtype}")
            if a.shape != shape:
                raise ValueError(f"load_state_dict: {name!r} has shape {a.shape}; expected {shape}")
            return a.astype(self.dtype)

        if "in_proj_weight" in sd:
            if not self._packed:
                raise ValueError("load_state_dict: in_proj_weight given but kdim/vdim/num_kv_heads need separate "
                                 "q_proj_weight, k_proj_weight, v_proj_weight")  # fmt: skip
            w = take("in_proj_weight", (3 * E, E))
            wq, wk, wv = w[:E].T, w[E : 2 * E].T, w[2 * E :].T
        else:
            wq = take("q_proj_weight", (E, E)).T
            wk = take("k_proj_weight", (kv, self.kdim)).T
            wv = take("v_proj_weight", (kv, self.vdim)).T
        wo = take("out_proj.weight", (E, E)).T
        if self.bias:
            b = take("in_proj_bias", (E + 2 * kv,))
            bo = take("out_proj.bias", (E,))
        else:
            for name in ("in_proj_bias", "out_proj.bias"):
                if name in sd and sd.pop(name) is not None:
                    # an unexpected key, as the docs class it (KeyError), with the reason
                    raise KeyError(f"load_state_dict: unexpected key {name!r}: the layer has bias=False")
        if sd:
            raise KeyError(f"load_state_dict: unexpected keys {sorted(sd)}")
        self.w_q, self.w_k, self.w_v, self.w_o = (np.ascontiguousarray(x) for x in (wq, wk, wv, wo))
        if self.bias:
            self.b_q, self.b_k, self.b_v, self.b_o = b[:E].copy(), b[E : E + kv].copy(), b[E + kv :].copy(), bo

    def __repr__(self) -> str:
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, bias={self.bias}, "
                f"dtype={self.dtype.name})")  # fmt: skip


def sinusoidal_positional_encoding(num_positions, d_model, *, base=10000.0, dtype=np.float32):
    """``PE[pos, 2i] = sin(pos / base^(2i/d_model))``, ``PE[pos, 2i+1] = cos(...)``; shape
    ``(num_positions, d_model)``."""
    if isinstance(num_positions, (bool, np.bool_)) or not isinstance(num_positions, (int, np.integer)):
        raise TypeError(f"num_positions must be an int; got {type(num_positions).__name__}")
    if num_positions < 0:
        raise ValueError(f"num_positions must be >= 0; got {num_positions}")
    d_model = positive_int(d_model, "d_model")
    base = real_float(
        base, lambda: f"base must be a real number > 0; got {base!r}", lambda: f"base must fit a float64; got {base!r}"
    )
    if not base > 0:
        raise ValueError(f"base must be > 0; got {base}")
    dtype = dtype_arg(dtype)
    if not is_float_dtype(dtype):
        raise TypeError(f"dtype must be float16, bfloat16, float32 or float64; got {dtype}")
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    i2 = np.arange(0, d_model, 2, dtype=np.float64)
    angle = pos / np.power(base, i2 / d_model)
    pe = np.empty((num_positions, d_model), np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(dtype)


def additive_attention(query, keys, w_query, w_keys, v, *, values=None, mask=None, return_weights=False):
    """Bahdanau attention: ``e_ij = v^T tanh(query_i W_query + keys_j W_keys)``,
    ``weights = softmax_j(e)``, ``output = weights @ values`` (values default to keys).

    query ``(..., Lq, Dq)``, keys ``(..., Lk, Dk)``, w_query ``(Dq, A)``, w_keys ``(Dk, A)``,
    v ``(A,)``, values ``(..., Lk, Dv)``; mask broadcasts to ``(..., Lq, Lk)``, True = may attend.
    Returns the output ``(..., Lq, Dv)``, and the weights ``(..., Lq, Lk)`` if asked.
    """
    q = float_array(query, "query")
    k = float_array(keys, "keys")
    wq = float_array(w_query, "w_query")
    wk = float_array(w_keys, "w_keys")
    vv = float_array(v, "v")
    vals = k if values is None else float_array(values, "values")
    if q.ndim < 2 or k.ndim < 2 or vals.ndim < 2:
        raise ValueError(f"query, keys and values must be (..., L, D); got {q.shape}, {k.shape}, {vals.shape}")
    if wq.ndim != 2 or wq.shape[0] != q.shape[-1]:
        raise ValueError(f"w_query has shape {wq.shape}; expected ({q.shape[-1]}, A)")
    if wk.ndim != 2 or wk.shape[0] != k.shape[-1]:
        raise ValueError(f"w_keys has shape {wk.shape}; expected ({k.shape[-1]}, A)")
    if wk.shape[1] != wq.shape[1] or vv.shape != (wq.shape[1],):
        raise ValueError(f"w_query {wq.shape}, w_keys {wk.shape} and v {vv.shape} must share the attention size A")
    if vals.shape[-2] != k.shape[-2]:
        raise ValueError(f"values has length {vals.shape[-2]}; expected Lk = {k.shape[-2]} from keys")
    broadcast_lead((q.shape[:-2], k.shape[:-2], vals.shape[:-2]), ("query", "keys", "values"), "additive_attention")
    dtype = compute_dtype(q, k, wq, wk, vv, vals)
    qp = matmul(q, wq.astype(dtype, copy=False))  # (..., Lq, A)
    kp = matmul(k, wk.astype(dtype, copy=False))  # (..., Lk, A)
    e = np.tanh(qp[..., :, None, :] + kp[..., None, :, :]) @ vv.astype(dtype, copy=False)  # (..., Lq, Lk)
    if mask is not None:
        m = as_array(mask, "mask")
        if m.dtype != np.bool_:
            raise TypeError(f"mask must be a bool array (True = may attend); got dtype {m.dtype}")
        try:
            np.broadcast_shapes(m.shape, e.shape)
        except ValueError:
            raise ValueError(f"mask has shape {m.shape}; expected a shape broadcastable to {e.shape}") from None
        if np.broadcast_shapes(m.shape, e.shape) != e.shape:
            e = np.broadcast_to(e, np.broadcast_shapes(m.shape, e.shape))
    weights = softmax(e, axis=-1, mask=mask)
    out = matmul(weights, vals.astype(dtype, copy=False))
    return (out, weights) if return_weights else out
