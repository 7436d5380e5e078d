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
