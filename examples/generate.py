#!/usr/bin/env python3
"""Greedy generation with pyattn's KV cache: a small GPT-style decoder in NumPy.

The model has random weights drawn from a seed: token embedding, rotary positions (RoPE), N
pre-LayerNorm blocks, each a causal self-attention with grouped-query heads (Hq query heads share
Hkv key/value heads) and a GELU MLP, then a final LayerNorm and an LM head tied to the embedding.
Every layer keeps one ``pyattn.KVCache`` for the whole batch.

A ragged batch of prompts (lengths 17, 40, 5 and 64 by default) is prefilled with one call per
layer. The prompts are padded to the longest, and ``attend(q, k, v, new_lens=prompt_lens)``
appends only each row's real tokens (the padding queries return zeros, which are ignored). Then
each decode step feeds every row's last token (Lq = 1) at that row's own position and picks the
next token greedily (argmax).

    python examples/generate.py                      # contiguous float32 caches
    python examples/generate.py --paged 16           # paged caches, blocks of 16 tokens
    python examples/generate.py --dtype int8         # float16 | bfloat16 | int8 caches
    python examples/generate.py --torch              # the same model in torch beside it
    python examples/generate.py --check              # last step's logits vs a full recompute
    python examples/generate.py --matmul numpy       # np.matmul for the model (NumpyOps says why not)

``--torch`` runs the same model code (torch ops in place of NumPy's) with the same weights. Its
attention is ``F.scaled_dot_product_attention`` over a preallocated torch cache per layer, written
in place and read under an explicit mask for the ragged batch. It checks that the greedy tokens
are the same as pyattn's (float32 caches). ``--check`` recomputes the logits of the last step
without a cache: the whole model in float64 over every token so far, with attention by
``pyattn.reference``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import dataclass

import numpy as np

import pyattn
from pyattn import reference

CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")


@dataclass(frozen=True)
class Config:
    vocab: int = 4096
    d_model: int = 512
    n_layers: int = 4
    n_heads: int = 8  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    head_dim: int = 64
    d_ff: int = 2048
    max_pos: int = 2048  # length of the RoPE tables
    rope_base: float = 10000.0


def init_weights(cfg: Config, seed: int = 0) -> dict:
    """Random float32 weights, row-vector convention (``y = x @ w``). The projections keep the
    activations near unit size, except that q and k are twice that: the scores then spread (std
    about 4) and attention is selective. A random model with near-uniform attention only repeats
    a token, and its greedy tokens would test little."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    d, hd, depth = cfg.d_model, cfg.head_dim, 2 * cfg.n_layers
    nqk = (cfg.n_heads + cfg.n_kv_heads) * hd
    w = {"wte": normal((cfg.vocab, d), 0.02), "lnf.g": 1 + normal(d, 0.1), "lnf.b": normal(d, 0.1)}
    for i in range(cfg.n_layers):
        w |= {
            f"h{i}.ln1.g": 1 + normal(d, 0.1),
            f"h{i}.ln1.b": normal(d, 0.1),
            # the q, k and v projections side by side: one matmul
            f"h{i}.wqkv": np.concatenate([normal((d, nqk), 2 * d**-0.5), normal((d, cfg.n_kv_heads * hd), d**-0.5)], 1),
            f"h{i}.wo": normal((cfg.n_heads * hd, d), (cfg.n_heads * hd * depth) ** -0.5),
            f"h{i}.ln2.g": 1 + normal(d, 0.1),
            f"h{i}.ln2.b": normal(d, 0.1),
            f"h{i}.w1": normal((d, cfg.d_ff), d**-0.5),
            f"h{i}.b1": normal(cfg.d_ff, 0.1),
            f"h{i}.w2": normal((cfg.d_ff, d), (cfg.d_ff * depth) ** -0.5),
            f"h{i}.b2": normal(d, 0.02),
        }
    return w


def rope_tables(cfg: Config):
    """cos and sin of every position's rotation angles, (max_pos, head_dim / 2), float64."""
    inv_freq = cfg.rope_base ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    angles = np.arange(cfg.max_pos)[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


# ------------------------------------------------------------------------------------ backends
class NumpyOps:
    """The few operations that NumPy and torch spell differently. Everything else the model does
    (indexing, ``reshape``, ``swapaxes``, arithmetic) is written once for both.

    ``matmul``: ``pyattn.matmul`` (the default) or ``np.matmul``. pyattn's GEMM runs on the same
    OpenMP threads as its attention. NumPy's OpenBLAS keeps a second pool of threads, and on a
    machine with few cores the two pools, used in turn, wait for each other's spinning threads:
    the loop can get an order of magnitude slower (try ``--matmul numpy``)."""

    def __init__(self, dtype=np.float32, matmul=None):
        self.dtype = np.dtype(dtype)
        self.matmul = pyattn.matmul if matmul is None else matmul

    def linear(self, x, w):
        """``x @ w`` for x ``(..., n)``, w ``(n, m)``, as one 2-D product."""
        y = self.matmul(x.reshape(-1, x.shape[-1]), w)
        return y.reshape(x.shape[:-1] + (w.shape[-1],))

    def array(self, a):
        return np.ascontiguousarray(a, dtype=self.dtype)

    def index(self, a):
        return np.ascontiguousarray(a, dtype=np.int64)

    def numpy(self, x):
        return np.asarray(x)

    def context(self):
        return contextlib.nullcontext()

    def cat(self, xs, axis):
        return np.concatenate(xs, axis=axis)

    def layer_norm(self, x, g, b, eps=1e-5):
        xc = x - x.mean(axis=-1, keepdims=True)
        var = (xc * xc).mean(axis=-1, keepdims=True)
        return xc * (1.0 / np.sqrt(var + eps)) * g + b

    def gelu(self, x):  # the tanh approximation (GPT-2's)
        return 0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * (x * x * x))))

    def argmax(self, x):
        return np.argmax(x, axis=-1)


class TorchOps:
    """The same operations on torch tensors (float32)."""

    def __init__(self):
        import torch
        import torch.nn.functional as F

        self.torch, self.F = torch, F

    def array(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    def linear(self, x, w):
        return x @ w

    def index(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    def numpy(self, x):
        return x.numpy()

    def context(self):
        return self.torch.inference_mode()

    def cat(self, xs, axis):
        return self.torch.cat(xs, dim=axis)

    def layer_norm(self, x, g, b, eps=1e-5):
        return self.F.layer_norm(x, g.shape, g, b, eps)

    def gelu(self, x):
        return self.F.gelu(x, approximate="tanh")

    def argmax(self, x):
        return self.torch.argmax(x, dim=-1).numpy()


class TorchKVCache:
    """One layer's cache for the torch loop, with ``pyattn.KVCache.attend``'s semantics:
    preallocated ``(B, Hkv, max_len, D)`` tensors that each call writes in place at every row's
    current length, then ``F.scaled_dot_product_attention`` over the first ``max(lens)`` keys
    with an explicit bool mask (row b's query t sees keys ``j <= lens[b] + t`` of its own)."""

    def __init__(self, batch, num_kv_heads, head_dim, *, max_len):
        import torch
        import torch.nn.functional as F

        self.torch, self.sdpa = torch, F.scaled_dot_product_attention
        self.k = torch.zeros(batch, num_kv_heads, max_len, head_dim)
        self.v = torch.zeros(batch, num_kv_heads, max_len, head_dim)
        self.lens = np.zeros(batch, np.int64)
        self.rows = torch.arange(batch)

    @property
    def nbytes(self):
        return self.k.nbytes + self.v.nbytes

    def reset(self, rows=None):
        self.lens[slice(None) if rows is None else rows] = 0

    def attend(self, query, k_new, v_new, *, new_lens=None):
        B, _, Lq, _ = query.shape
        start = self.lens
        n = np.full(B, Lq) if new_lens is None else np.asarray(new_lens, dtype=np.int64)
        end = start + n
        if end.max() > self.k.shape[2]:
            raise ValueError(f"cache overflow: lengths {end.tolist()} > capacity {self.k.shape[2]}")
        if new_lens is None and Lq == 1:  # decode: one indexed write for the whole batch
            pos = self.torch.from_numpy(start)
            self.k[self.rows, :, pos] = k_new[:, :, 0]
            self.v[self.rows, :, pos] = v_new[:, :, 0]
        else:  # ragged append: row b writes its first n[b] new tokens
            for b in range(B):
                s, e, m = int(start[b]), int(end[b]), int(n[b])
                self.k[b, :, s:e] = k_new[b, :, :m]
                self.v[b, :, s:e] = v_new[b, :, :m]
        T = int(end.max())
        keys = np.arange(T)
        visible = (keys <= (start[:, None] + np.arange(Lq))[:, :, None]) & (keys < end[:, None, None])
        mask = self.torch.from_numpy(visible[:, None])  # (B, 1, Lq, T), True = may attend
        out = self.sdpa(query, self.k[:, :, :T], self.v[:, :, :T], attn_mask=mask, enable_gqa=True)
        self.lens = end
        return out


# --------------------------------------------------------------------------------------- model
class Decoder:
    """The model, written once: ``ops`` says whether it runs on NumPy arrays or torch tensors."""

    def __init__(self, cfg: Config, weights: dict, ops):
        self.cfg, self.ops = cfg, ops
        self.w = {name: ops.array(a) for name, a in weights.items()}
        cos, sin = rope_tables(cfg)
        self.cos, self.sin = ops.array(cos), ops.array(sin)

    def rope(self, x, cos, sin):
        """Rotate the pairs (x[i], x[i + D/2]) by each position's angles (GPT-NeoX / Llama)."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.ops.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    def hidden(self, tokens, positions, attention):
        """The residual stream after the last block, ``(B, L, d_model)``.

        tokens, positions: ``(B, L)`` index arrays of the backend; ``attention(layer, q, k, v)``
        takes ``q (B, Hq, L, D)``, ``k, v (B, Hkv, L, D)`` (RoPE applied to q and k) and returns
        ``(B, Hq, L, D)``: a cache's ``attend``, or a full causal attention."""
        c, w, ops = self.cfg, self.w, self.ops
        B, L = tokens.shape
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, L, D/2)
        x = w["wte"][tokens]
        for i in range(c.n_layers):
            p = f"h{i}."
            qkv = ops.linear(ops.layer_norm(x, w[p + "ln1.g"], w[p + "ln1.b"]), w[p + "wqkv"])
            q = qkv[..., :nq].reshape(B, L, c.n_heads, c.head_dim).swapaxes(1, 2)
            k = qkv[..., nq : nq + nkv].reshape(B, L, c.n_kv_heads, c.head_dim).swapaxes(1, 2)
            v = qkv[..., nq + nkv :].reshape(B, L, c.n_kv_heads, c.head_dim).swapaxes(1, 2)
            a = attention(i, self.rope(q, cos, sin), self.rope(k, cos, sin), v)
            x = x + ops.linear(a.swapaxes(1, 2).reshape(B, L, nq), w[p + "wo"])
            h = ops.layer_norm(x, w[p + "ln2.g"], w[p + "ln2.b"])
            x = x + ops.linear(ops.gelu(ops.linear(h, w[p + "w1"]) + w[p + "b1"]), w[p + "w2"]) + w[p + "b2"]
        return x

    def logits(self, x):
        """``(..., d_model)`` -> ``(..., vocab)``: final LayerNorm, LM head tied to the embedding."""
        return self.ops.linear(self.ops.layer_norm(x, self.w["lnf.g"], self.w["lnf.b"]), self.w["wte"].T)


@dataclass
class Generation:
    tokens: np.ndarray  # (B, n_new) int64, the greedy tokens
    logits: np.ndarray  # (B, vocab) float32, the last step's logits
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    decode_tokens: int

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_tokens else float("nan")


def generate(model: Decoder, caches: list, prompts: list, n_new: int) -> Generation:
    """Prefill the ragged ``prompts`` into the (empty) caches, one ``attend`` per layer with
    ``new_lens``, then decode greedily: ``n_new`` tokens per row, the first from the prefill's
    logits and each other from one Lq = 1 step."""
    ops = model.ops
    B = len(prompts)
    plens = np.array([len(p) for p in prompts], dtype=np.int64)
    padded = np.zeros((B, int(plens.max())), dtype=np.int64)  # token 0 as padding
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    positions = np.broadcast_to(np.arange(padded.shape[1]), padded.shape)
    with ops.context():
        t0 = time.perf_counter()
        h = model.hidden(
            ops.index(padded),
            ops.index(positions),
            lambda i, q, k, v: caches[i].attend(q, k, v, new_lens=plens),
        )
        logits = model.logits(h[ops.index(np.arange(B)), ops.index(plens - 1)])  # each row's last
        token = ops.argmax(logits)
        t1 = time.perf_counter()
        out = [token]
        for step in range(1, n_new):
            h = model.hidden(
                ops.index(token[:, None]),
                ops.index(plens[:, None] + (step - 1)),  # the fed token's position
                lambda i, q, k, v: caches[i].attend(q, k, v),
            )
            logits = model.logits(h[:, 0])
            token = ops.argmax(logits)
            out.append(token)
        t2 = time.perf_counter()
    return Generation(
        tokens=np.stack(out, axis=1).astype(np.int64),
        logits=np.array(ops.numpy(logits), dtype=np.float32),
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        prompt_tokens=int(plens.sum()),
        decode_tokens=B * (n_new - 1),
    )


def cache_dtype(name: str):
    """The cache dtype: NumPy's, or ml_dtypes' bfloat16 (NumPy has none of its own)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            sys.exit("--dtype bfloat16 needs ml_dtypes: pip install ml_dtypes")

        return ml_dtypes.bfloat16
    return np.dtype(name)


def pyattn_caches(cfg: Config, batch: int, max_len: int, *, block_size=None, dtype="float32") -> list:
    """One ``pyattn.KVCache`` per layer with room for ``max_len`` tokens a row: contiguous, or
    paged in blocks of ``block_size`` tokens that are handed to the rows as they grow (the pool
    is sized for ``max_len`` up front, so it never has to grow during the timed loop)."""
    return [
        pyattn.KVCache(
            batch, cfg.n_kv_heads, cfg.head_dim, max_len=max_len, block_size=block_size, dtype=cache_dtype(dtype)
        )
        for _ in range(cfg.n_layers)
    ]


def torch_caches(cfg: Config, batch: int, max_len: int) -> list:
    return [TorchKVCache(batch, cfg.n_kv_heads, cfg.head_dim, max_len=max_len) for _ in range(cfg.n_layers)]


def make_prompts(cfg: Config, lengths, seed: int = 0) -> list:
    rng = np.random.default_rng([seed, 1])
    return [rng.integers(0, cfg.vocab, size=n, dtype=np.int64) for n in lengths]


def timed_generation(model, caches, prompts, n_new) -> Generation:
    """A short warm-up generation (first-call costs: page faults, thread pools), an emptying of
    the caches, then the generation that is reported."""
    generate(model, caches, prompts, min(n_new, 2))
    for c in caches:
        c.reset()
    return generate(model, caches, prompts, n_new)


def full_recompute_logits(cfg: Config, weights: dict, prompts: list, tokens: np.ndarray) -> np.ndarray:
    """The last step's logits without a cache: per row, the model in float64 over the prompt and
    every generated token that was fed back (all but the last), attention by the reference."""

    def attention(i, q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    model = Decoder(cfg, weights, NumpyOps(np.float64, matmul=np.matmul))  # NumPy only
    rows = []
    for prompt, gen in zip(prompts, tokens):
        seq = np.concatenate([prompt, gen[:-1]])
        h = model.hidden(seq[None], np.arange(len(seq))[None], attention)
        rows.append(model.logits(h[0, -1]))
    return np.stack(rows)


def _at_least(low):
    def parse(text):
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}; got {n}")
        return n

    parse.__name__ = "int"  # argparse names the type in its message: "invalid int value"
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-lens", default="17,40,5,64", help="comma-separated prompt lengths")
    ap.add_argument("--new-tokens", type=_at_least(1), default=32, help="tokens to generate per row")
    ap.add_argument("--layers", type=_at_least(1), default=Config.n_layers)
    ap.add_argument("--paged", type=_at_least(1), metavar="BLOCK_SIZE", help="paged caches, blocks of this many tokens")
    ap.add_argument("--dtype", choices=CACHE_DTYPES, default="float32", help="cache dtype")
    ap.add_argument("--seed", type=_at_least(0), default=0)
    ap.add_argument(
        "--matmul", choices=("pyattn", "numpy"), default="pyattn", help="the NumPy model's matmul (see NumpyOps)"
    )
    ap.add_argument("--torch", action="store_true", help="run the same model in torch too, compare")
    ap.add_argument("--check", action="store_true", help="last step's logits vs a full recompute")
    args = ap.parse_args(argv)

    cfg = Config(n_layers=args.layers)
    try:
        lengths = [int(n) for n in args.prompt_lens.split(",") if n.strip()]  # a trailing comma is fine
    except ValueError:
        ap.error(f"--prompt-lens must be comma-separated integers; got {args.prompt_lens!r}")
    if not lengths or min(lengths) < 1:
        ap.error("prompt lengths must be >= 1")
    max_len = max(lengths) + args.new_tokens  # the most any row holds, with room to spare
    if max_len > cfg.max_pos:
        ap.error(f"prompt + new tokens must fit the RoPE table ({cfg.max_pos} positions)")
    weights = init_weights(cfg, args.seed)
    prompts = make_prompts(cfg, lengths, args.seed)
    B = len(prompts)

    caches = pyattn_caches(cfg, B, max_len, block_size=args.paged, dtype=args.dtype)
    ops = NumpyOps(matmul=np.matmul if args.matmul == "numpy" else pyattn.matmul)
    gen = timed_generation(Decoder(cfg, weights, ops), caches, prompts, args.new_tokens)
    results = {"pyattn": gen}
    layout = f"paged (block_size {args.paged}, max_len {max_len})" if args.paged else f"contiguous (max_len {max_len})"
    print(
        f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} query / {cfg.n_kv_heads} "
        f"key-value heads of {cfg.head_dim}, MLP {cfg.d_ff}, vocab {cfg.vocab} (random weights, seed {args.seed})"
    )
    print(f"batch: {B} prompts of {', '.join(map(str, lengths))} tokens, {args.new_tokens} new tokens each")
    print(
        f"pyattn caches: {layout}, {args.dtype}, {sum(c.nbytes for c in caches) / 2**20:.2f} MiB "
        f"over {cfg.n_layers} layers; lens {np.asarray(caches[0].lens).tolist()}; "
        f"{args.matmul} matmul; {pyattn.get_num_threads()} threads"
    )

    failures = []
    if args.torch:
        try:
            tops = TorchOps()
        except ImportError:
            sys.exit("--torch needs torch (pip install torch; its CPU build is enough)")
        tops.torch.set_num_threads(pyattn.get_num_threads())  # the same cores
        tcaches = torch_caches(cfg, B, max_len)
        results["torch"] = tgen = timed_generation(Decoder(cfg, weights, tops), tcaches, prompts, args.new_tokens)
        same = int((tgen.tokens == gen.tokens).sum())
        verdict = f"greedy tokens: {same} of {gen.tokens.size} the same as pyattn's"
        if args.dtype == "float32" and same != gen.tokens.size:
            failures.append(verdict)
        print(f"torch {tops.torch.__version__} caches: contiguous float32, SDPA with an explicit mask; {verdict}")

    print(f"\n{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, g in results.items():
        decode = f"{g.decode_tps:15,.0f}" if g.decode_tokens else f"{'-':>15}"
        print(f"{name:8}{g.prefill_tps:15,.0f}{decode}")
    print(
        f"(prefill: {gen.prompt_tokens} prompt tokens in one call per layer; decode: {B} rows x "
        f"{args.new_tokens - 1} steps)"
    )
    print()
    for b in range(B):
        print(
            f"row {b}: prompt {lengths[b]:3d} tokens -> {' '.join(map(str, gen.tokens[b, :12]))}"
            + (" ..." if args.new_tokens > 12 else "")
        )

    if args.check:
        ref = full_recompute_logits(cfg, weights, prompts, gen.tokens)
        err = float(np.max(np.abs(gen.logits - ref)))
        scale = float(np.max(np.abs(ref)))
        msg = (
            f"last step's logits vs a float64 full recompute (no cache): max abs error {err:.2e} "
            f"(max |logit| {scale:.2f})"
        )
        print("\ncheck: " + msg)
        if args.dtype == "float32" and not err <= 1e-4:
            failures.append(msg + " > 1e-4")
        elif args.dtype != "float32":
            print(f"       ({args.dtype} cache: reported, not asserted; the 1e-4 bound is for float32)")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
