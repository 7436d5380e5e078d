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
def _session(model_bytes: bytes, num_threads: int):
    ort = _ort()
    so = ort.SessionOptions()
    so.intra_op_num_threads = num_threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


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
    return _session(model.SerializeToString(), num_threads)


@functools.lru_cache(maxsize=16)
def _gqa_session(B, Hq, Hkv, past, D, num_threads):
    """One-node com.microsoft GroupQueryAttention model: 1 new token on a past KV cache."""
    _ort()
    from onnx import TensorProto, helper

    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info("query", f, [B, 1, Hq * D]),
        helper.make_tensor_value_info("key", f, [B, 1, Hkv * D]),
        helper.make_tensor_value_info("value", f, [B, 1, Hkv * D]),
        helper.make_tensor_value_info("past_key", f, [B, Hkv, past, D]),
        helper.make_tensor_value_info("past_value", f, [B, Hkv, past, D]),
        helper.make_tensor_value_info("seqlens_k", i32, [B]),
        helper.make_tensor_value_info("total_sequence_length", i32, []),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("output", "present_key", "present_value")]
    node = helper.make_node(
        "GroupQueryAttention",
        [t.name for t in inputs],
        [t.name for t in outputs],
        domain="com.microsoft",
        num_heads=Hq,
        kv_num_heads=Hkv,
    )
    model = helper.make_model(
        helper.make_graph([node], "gqa", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    return _session(model.SerializeToString(), num_threads)


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
    return _session(model.SerializeToString(), num_threads)


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
