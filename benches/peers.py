"""Peers that the benchmarks compare pyattn with: torch and ONNX Runtime, each only when it imports.

Each ``prepare_*`` function does all the untimed work (building a session, transposing inputs)
and returns a :class:`Prepared`: ``run()`` is the call that is timed, ``finish(result)`` turns
its result back into pyattn's layout ``(..., Hq, Lq, Ev)`` outside the timing.  A peer that
cannot compute a case raises :class:`Unsupported` with the reason; the benchmark then skips.

What each peer can do (checked against a float64 oracle):

============================  ==========================  =====================================
case                          torch SDPA                  ONNX Runtime (com.microsoft)
============================  ==========================  =====================================
E == Ev, Lq == Lk or cross    yes                         MultiHeadAttention
E != Ev                       yes (unfused slow path)     MultiHeadAttention
causal, Lq == Lk              ``is_causal=True``          MultiHeadAttention ``unidirectional=1``
causal, Lq != Lk              yes (top-left)              no: its mask matches neither alignment
more than 4 dims              yes (unfused slow path)     leading dims folded into B (a view)
decode, Lq == 1               yes                         MultiHeadAttention
GQA (Hq = g * Hkv)            ``enable_gqa=True``         GroupQueryAttention, decode only (Lq=1,
                                                          E == Ev): past KV + 1 new token, the
                                                          op's ``present`` KV copy included
explicit mask (window, ALiBi  ``attn_mask=`` (bool or     no (bench_variants.py)
bias, key padding)            float; materialised)
causal sliding window         explicit bool mask          GroupQueryAttention prefill with
(left, 0), Lq == Lk                                       ``local_window_size`` (no past KV)
bfloat16 q, k, v              ``dtype=torch.bfloat16``    no
decode on a KV cache          ``cache[:, :, :n]`` (a      GroupQueryAttention, past KV + 1 token
(bench_kvcache.py)            view of a preallocated      (any Hq / Hkv); int8 past KV with
                              float32 cache)              static PER_CHANNEL scales
============================  ==========================  =====================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


class Unsupported(Exception):
    """The peer cannot compute this case (or is not installed); the message says why."""


@dataclass
class Prepared:
    run: Callable[[], Any]
    finish: Callable[[Any], np.ndarray]
    note: str = ""


@functools.lru_cache(maxsize=None)
def _torch():
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        raise Unsupported(f"torch is not importable: {exc}") from None
    return torch


@functools.lru_cache(maxsize=None)
def _ort():
    try:
        import onnx  # noqa: F401  (builds the one-node model)
        import onnxruntime
    except Exception as exc:
        raise Unsupported(f"onnxruntime/onnx not importable: {exc}") from None
    return onnxruntime


def versions() -> dict:
    """Versions of the peers that import (for the benchmark json's machine_info)."""
    out = {}
    for name, get in (("torch", _torch), ("onnxruntime", _ort)):
        try:
            out[name] = get().__version__
        except Unsupported:
            out[name] = None
    return out


# --------------------------------------------------------------------------------------- torch
def torch_set_threads(num_threads: int):
    torch = _torch()
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return torch


def prepare_torch_attention(q, k, v, *, is_causal, enable_gqa, num_threads) -> Prepared:
    """torch.nn.functional.scaled_dot_product_attention on the same (zero-copy) arrays."""
    torch = torch_set_threads(num_threads)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    kwargs = {"is_causal": bool(is_causal)}
    if enable_gqa:
        kwargs["enable_gqa"] = True
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.inference_mode():
            return sdpa(tq, tk, tv, **kwargs)

    return Prepared(run, lambda t: t.numpy(), "F.scaled_dot_product_attention")


def prepare_torch_sdpa(q, k, v, *, attn_mask=None, is_causal=False, dtype=None, num_threads) -> Prepared:
    """F.scaled_dot_product_attention with an explicit ``attn_mask`` (bool: True = keep, or float:
    added), built outside the timing as a user without pyattn's window / ALiBi / kv_lens
    keywords writes it (torch turns a bool mask into a float one inside the call, which is
    timed).  ``dtype`` (e.g. ``"bfloat16"``): q, k and v are converted to that torch dtype
    outside the timing, the result back to float32 NumPy in ``finish``."""
    torch = torch_set_threads(num_threads)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    if dtype is not None:
        tdt = getattr(torch, dtype)
        tq, tk, tv = (t.to(tdt) for t in (tq, tk, tv))
    kwargs = {"is_causal": bool(is_causal)}
    what = "F.scaled_dot_product_attention"
    if attn_mask is not None:
        kwargs["attn_mask"] = tm = torch.from_numpy(np.ascontiguousarray(attn_mask))
        if dtype is not None and tm.dtype != torch.bool:
            kwargs["attn_mask"] = tm.to(tq.dtype)
        what += f", explicit {attn_mask.dtype} mask {tuple(attn_mask.shape)} ({attn_mask.nbytes / 2**20:.0f} MiB)"
    if dtype is not None:
        what += f", {dtype} q/k/v"
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.inference_mode():
            return sdpa(tq, tk, tv, **kwargs)

    def finish(t):
        return (t.float() if dtype is not None else t).numpy()

    return Prepared(run, finish, what)


def prepare_torch_cache_slice(q, k_cache, v_cache, n, *, num_threads) -> Prepared:
    """F.scaled_dot_product_attention of q (B, Hq, Lq, E) over the first ``n`` tokens of a
    preallocated torch cache (B, Hkv, Lmax, E|Ev): the slice ``cache[:, :, :n]`` (a strided view,
    no copy) is taken inside the timed call, as a decode step does; ``enable_gqa`` when Hq !=
    Hkv. The caches are shared with NumPy (torch.from_numpy, zero-copy)."""
    torch = torch_set_threads(num_threads)
    for c in (k_cache, v_cache):
        if not (isinstance(c, np.ndarray) and c.dtype == np.float32 and c.flags.c_contiguous):
            raise Unsupported("the torch cache peer takes C-contiguous float32 caches")
    tq = torch.from_numpy(np.ascontiguousarray(q))
    tk, tv = torch.from_numpy(k_cache), torch.from_numpy(v_cache)
    kwargs = {"enable_gqa": True} if q.shape[-3] != k_cache.shape[-3] else {}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.inference_mode():
            return sdpa(tq, tk[:, :, :n], tv[:, :, :n], **kwargs)

    what = "F.scaled_dot_product_attention on cache[:, :, :n]" + (", enable_gqa" if kwargs else "")
    return Prepared(run, lambda t: t.numpy(), what)


def prepare_torch_softmax(x, mask, *, num_threads) -> Prepared:
    """torch.softmax; a bool mask (True = keep) through masked_fill, a float mask added."""
    torch = torch_set_threads(num_threads)
    tx = torch.from_numpy(x)
    if mask is None:

        def run():
            return torch.softmax(tx, dim=-1)
    elif mask.dtype == np.bool_:
        forbid = torch.from_numpy(~mask)

        def run():
            return torch.softmax(tx.masked_fill(forbid, float("-inf")), dim=-1)
    else:
        tm = torch.from_numpy(mask)

        def run():
            return torch.softmax(tx + tm, dim=-1)

    return Prepared(run, lambda t: t.numpy(), "torch.softmax")


# -------------------------------------------------------------------------------- onnxruntime
# The one-node models need nothing past IR version 10 (ONNX 1.16); an onnx newer than the installed
# onnxruntime stamps its own, which that runtime refuses ("Unsupported model IR version").
_IR_VERSION = 10


def _session(model, num_threads: int):
    ort = _ort()
    model.ir_version = min(model.ir_version, _IR_VERSION)
    so = ort.SessionOptions()
    so.intra_op_num_threads = num_threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=16)
def _mha_session(B, Lq, Lk, H, E, Ev, causal, num_threads):
    """One-node com.microsoft MultiHeadAttention model, query/key/value (B, L, H*D)."""
    _ort()
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("query", f, [B, Lq, H * E]),
        helper.make_tensor_value_info("key", f, [B, Lk, H * E]),
        helper.make_tensor_value_info("value", f, [B, Lk, H * Ev]),
    ]
    outputs = [helper.make_tensor_value_info("output", f, [B, Lq, H * Ev])]
    attrs = {"num_heads": H}
    if causal:
        attrs["unidirectional"] = 1
    node = helper.make_node(
        "MultiHeadAttention", ["query", "key", "value"], ["output"], domain="com.microsoft", **attrs
    )
    model = helper.make_model(
        helper.make_graph([node], "mha", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return _session(model, num_threads)


@functools.lru_cache(maxsize=16)
def _gqa_session(B, Hq, Hkv, past, D, num_threads, kv_int8=False):
    """One-node com.microsoft GroupQueryAttention model: 1 new token on a past KV cache.
    ``kv_int8``: the past/present KV are int8 with static per-channel scales ``k_scale`` /
    ``v_scale`` (1, Hkv, 1, D) (``k_quant_type="PER_CHANNEL"``, ``kv_cache_bit_width=8``); the
    new token comes in float32 and the op quantises it with those scales."""
    _ort()
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    cache = TensorProto.INT8 if kv_int8 else f
    inputs = [
        helper.make_tensor_value_info("query", f, [B, 1, Hq * D]),
        helper.make_tensor_value_info("key", f, [B, 1, Hkv * D]),
        helper.make_tensor_value_info("value", f, [B, 1, Hkv * D]),
        helper.make_tensor_value_info("past_key", cache, [B, Hkv, past, D]),
        helper.make_tensor_value_info("past_value", cache, [B, Hkv, past, D]),
        helper.make_tensor_value_info("seqlens_k", i32, [B]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    names = [t.name for t in inputs]
    attrs = {}
    if kv_int8:
        inputs += [helper.make_tensor_value_info(n, f, [1, Hkv, 1, D]) for n in ("k_scale", "v_scale")]
        # cos_cache, sin_cache, position_ids, attention_bias, head_sink: absent
        names += ["", "", "", "", "", "k_scale", "v_scale"]
        attrs = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
    outputs = [
        helper.make_tensor_value_info(n, t, None)
        for n, t in (("output", f), ("present_key", cache), ("present_value", cache))
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        [t.name for t in outputs],
        domain="com.microsoft",
        num_heads=Hq,
        kv_num_heads=Hkv,
        **attrs,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return _session(model, num_threads)


def quantize_per_channel(x: np.ndarray):
    """int8 values and float32 scales (1, H, 1, D) of x (B, H, L, D): symmetric absmax per head
    and channel over every batch entry and token (ONNX Runtime's PER_CHANNEL static KV scales),
    x ~ q * scale. One head at a time, so the temporaries stay small."""
    B, H, L, D = x.shape
    q = np.empty(x.shape, np.int8)
    scale = np.empty((1, H, 1, D), np.float32)
    for h in range(H):
        amax = np.max(np.abs(x[:, h]), axis=(0, 1)) if B * L else np.zeros(D, np.float32)
        s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q[:, h] = np.clip(np.rint(x[:, h] / s), -127, 127)
        scale[0, h, 0] = s
    return q, scale


def prepare_ort_gqa_decode(q, k, v, *, k_scale=None, v_scale=None, num_threads) -> Prepared:
    """ONNX Runtime GroupQueryAttention for one decode step, whatever Hq / Hkv (MHA too): q (B,
    Hq, 1, D) attends k, v (B, Hkv, Lk, D) given as a past KV cache of Lk - 1 tokens plus the
    last token as the new one (the op copies past + new into its ``present`` outputs in the
    call). int8 k, v with ``k_scale`` / ``v_scale`` (1, Hkv, 1, D) (see quantize_per_channel):
    an int8 past cache (PER_CHANNEL), the new token fed as its dequantised float32 values, which
    the op quantises back to the same int8. Inputs transposed / sliced outside the timing."""
    _ort()
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[0] != k.shape[0]:
        raise Unsupported("onnxruntime GroupQueryAttention decode needs q (B, Hq, 1, D), k and v (B, Hkv, Lk, D)")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if Lq != 1 or k.shape[3] != D or Lk < 2 or Hq % Hkv:
        raise Unsupported("onnxruntime GroupQueryAttention is benchmarked for decode only (Lq == 1, E == Ev)")
    kv_int8 = k.dtype == np.int8
    if kv_int8 != (v.dtype == np.int8) or kv_int8 != (k_scale is not None and v_scale is not None):
        raise Unsupported("int8 k and v go with k_scale and v_scale (and float32 k, v without them)")
    sess = _gqa_session(B, Hq, Hkv, Lk - 1, D, num_threads, kv_int8=kv_int8)
    if kv_int8:
        k_last = k[:, :, -1:].astype(np.float32) * k_scale
        v_last = v[:, :, -1:].astype(np.float32) * v_scale
    else:
        k_last, v_last = k[:, :, -1:], v[:, :, -1:]
    feeds = {
        "query": _to_blc(q),
        "key": _to_blc(k_last),
        "value": _to_blc(v_last),
        "past_key": np.ascontiguousarray(k[:, :, :-1]),
        "past_value": np.ascontiguousarray(v[:, :, :-1]),
        "seqlens_k": np.full((B,), Lk - 1, dtype=np.int32),  # total length - 1, per batch
        "total_sequence_length": np.array(Lk, dtype=np.int32),
    }
    note = "com.microsoft GroupQueryAttention (past KV + 1 token; writes present KV)"
    if kv_int8:
        feeds["k_scale"] = np.ascontiguousarray(k_scale, dtype=np.float32)
        feeds["v_scale"] = np.ascontiguousarray(v_scale, dtype=np.float32)
        note += ", int8 KV cache, PER_CHANNEL scales"

    def finish(out):  # (B, 1, Hq*D) -> (B, Hq, 1, D)
        return out.reshape(B, 1, Hq, D).transpose(0, 2, 1, 3)

    return Prepared(lambda: sess.run(["output"], feeds)[0], finish, note)


@functools.lru_cache(maxsize=4)
def _gqa_prefill_session(B, L, Hq, Hkv, D, local_window_size, num_threads):
    """One-node com.microsoft GroupQueryAttention model: causal prefill of L tokens, no past KV
    (its ``present`` KV outputs are a copy of key/value); ``local_window_size`` -1: no window."""
    _ort()
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info("query", f, [B, L, Hq * D]),
        helper.make_tensor_value_info("key", f, [B, L, Hkv * D]),
        helper.make_tensor_value_info("value", f, [B, L, Hkv * D]),
        helper.make_tensor_value_info("seqlens_k", i32, [B]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node(
        "GroupQueryAttention",
        ["query", "key", "value", "", "", "seqlens_k", "total_sequence_length"],  # no past KV
        [t.name for t in outputs],
        domain="com.microsoft",
        num_heads=Hq,
        kv_num_heads=Hkv,
        local_window_size=int(local_window_size),
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa_prefill", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return _session(model, num_threads)


def _gqa_prefill_feeds(q4, k4, v4) -> dict:
    B, L = q4.shape[0], q4.shape[2]
    return {
        "query": _to_blc(q4),
        "key": _to_blc(k4),
        "value": _to_blc(v4),
        "seqlens_k": np.full((B,), L - 1, dtype=np.int32),  # total length - 1, per batch
        "total_sequence_length": np.array(L, dtype=np.int32),
    }


def _causal_window_attention(q, k, v, left):
    """Plain NumPy float64 causal attention in which query i sees keys i - left .. i."""
    s = np.matmul(q.astype(np.float64), np.swapaxes(k.astype(np.float64), -1, -2)) / np.sqrt(q.shape[-1])
    i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    s = np.where((j <= i) & (j >= i - left), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.matmul(p / p.sum(axis=-1, keepdims=True), v.astype(np.float64))


@functools.lru_cache(maxsize=None)
def _ort_window_keys() -> int:
    """How many keys beyond ``local_window_size`` a query of ORT's GroupQueryAttention sees
    besides itself, probed once on a tiny problem: releases differ (1.32 lets a query see
    ``local_window_size`` keys, itself included, i.e. window (w - 1, 0); older code read
    ``w + 1`` keys).  Returns d such that local_window_size = left + d for window (left, 0)."""
    w, L, D = 3, 9, 8  # (the op wants D % 8 == 0)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, L, D), dtype=np.float32) for _ in range(3))
    sess = _gqa_prefill_session(1, L, 1, 1, D, w, 1)
    out = sess.run(["output"], _gqa_prefill_feeds(q, k, v))[0].reshape(1, L, 1, D).transpose(0, 2, 1, 3)
    for d in (1, 0):  # w keys including the query's own (left = w - 1), or w + 1 (left = w)
        if np.allclose(out, _causal_window_attention(q, k, v, w - d), atol=1e-5):
            return d
    raise Unsupported("onnxruntime GroupQueryAttention local_window_size matches no known semantics")


def prepare_ort_window_prefill(q, k, v, *, left, num_threads) -> Prepared:
    """ONNX Runtime GroupQueryAttention as a causal prefill (no past KV) with a sliding window:
    query i sees keys i - left .. i (``left`` None: the whole causal prefix).  q (B, Hq, L, D),
    k and v (B, Hkv, L, D); transposed to (B, L, H*D) outside the timing."""
    _ort()
    if q.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise Unsupported("onnxruntime GroupQueryAttention prefill needs 4-D q, k, v with Lq == Lk and E == Ev")
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    if left is None or left + 1 >= L:
        w = -1
    else:
        w = left + _ort_window_keys()
    sess = _gqa_prefill_session(B, L, Hq, Hkv, D, w, num_threads)
    feeds = _gqa_prefill_feeds(q, k, v)

    def finish(out):  # (B, L, Hq*D) -> (B, Hq, L, D)
        return out.reshape(B, L, Hq, D).transpose(0, 2, 1, 3)

    return Prepared(
        lambda: sess.run(["output"], feeds)[0],
        finish,
        f"com.microsoft GroupQueryAttention causal prefill, local_window_size={w} (writes present KV)",
    )


def _to_blc(x: np.ndarray) -> np.ndarray:
    """(B, H, L, D) -> contiguous (B, L, H*D)."""
    B, H, L, D = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, L, H * D))


def prepare_ort_attention(q, k, v, *, is_causal, enable_gqa, num_threads) -> Prepared:
    """ONNX Runtime's fused CPU attention, inputs transposed to (B, L, H*D) outside the timing."""
    _ort()
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or v.shape[:-3] != lead:
        raise Unsupported("onnxruntime needs equal leading dims on query, key and value")
    Hq, Lq, E = q.shape[-3:]
    Hkv, Lk, Ev = v.shape[-3:]
    B = int(np.prod(lead, dtype=np.int64))
    q4, k4, v4 = (a.reshape((B,) + a.shape[-3:]) for a in (q, k, v))

    def to_lead(out):  # (B, Lq, Hq*Ev) -> (*lead, Hq, Lq, Ev)
        return out.reshape(B, Lq, Hq, Ev).transpose(0, 2, 1, 3).reshape(lead + (Hq, Lq, Ev))

    if Hq == Hkv:
        if is_causal and Lq != Lk:
            raise Unsupported(
                "onnxruntime's unidirectional mask with Lq != Lk matches neither "
                "top-left nor bottom-right causal alignment"
            )
        sess = _mha_session(B, Lq, Lk, Hq, E, Ev, bool(is_causal), num_threads)
        feeds = {"query": _to_blc(q4), "key": _to_blc(k4), "value": _to_blc(v4)}
        return Prepared(lambda: sess.run(["output"], feeds)[0], to_lead, "com.microsoft MultiHeadAttention")

    # Grouped-query: only ORT's GroupQueryAttention takes Hq != Hkv; it is a causal KV-cache op,
    # so it computes our case exactly when one new query token attends the whole cache.
    if Lq != 1 or is_causal or E != Ev or Lk < 2:
        raise Unsupported(
            "onnxruntime GroupQueryAttention is benchmarked for decode only (Lq == 1, non-causal, E == Ev)"
        )
    sess = _gqa_session(B, Hq, Hkv, Lk - 1, E, num_threads)
    feeds = {
        "query": _to_blc(q4),
        "key": _to_blc(k4[:, :, -1:]),
        "value": _to_blc(v4[:, :, -1:]),
        "past_key": np.ascontiguousarray(k4[:, :, :-1]),
        "past_value": np.ascontiguousarray(v4[:, :, :-1]),
        "seqlens_k": np.full((B,), Lk - 1, dtype=np.int32),  # total length - 1, per batch
        "total_sequence_length": np.array(Lk, dtype=np.int32),
    }
    return Prepared(
        lambda: sess.run(["output"], feeds)[0],
        to_lead,
        "com.microsoft GroupQueryAttention (past KV + 1 token; writes present KV)",
    )


ATTENTION_PEERS = {
    "torch": prepare_torch_attention,
    "onnxruntime": prepare_ort_attention,
}
