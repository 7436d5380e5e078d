#!/usr/bin/env python3
"""Greedy generation with a Hugging Face transformers model whose attention is pyattn.

    import pyattn.integrations.transformers as pt
    pt.register()                                        # "pyattn" in both of transformers' registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation="pyattn")
    model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)

The model has random weights drawn from a seed (no download): a small Llama (grouped-query
heads), Mistral (sliding window), Gemma 2 (softcap, sliding and full layers), Qwen2, GPT-2 or
gpt-oss (sinks), built from a config. The same weights run three times, with
attn_implementation="eager" (transformers' own matmul + softmax), "sdpa" (torch's
scaled_dot_product_attention) and "pyattn", on a left-padded batch of prompts of different
lengths. generate() keeps transformers' DynamicCache: the prefill is one call per layer over the
padded batch (pyattn gets the padding as a (B, 1, 1, L) key mask and causality as a flag), every
decode step a Lq = 1 call against the cache, aligned bottom-right.

It prints tokens/s for each (the median of --repeats generations), how many attention calls
pyattn made, and exits with status 1 if pyattn's tokens differ from eager's anywhere.

    python examples/hf_generate.py                         # Llama, 4 prompts, 32 new tokens
    python examples/hf_generate.py --model mistral --prompt-lens 40,300,123 --new-tokens 64
    python examples/hf_generate.py --model gemma2 --dtype bfloat16
    python examples/hf_generate.py --quick                 # small and fast (what CI runs)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import copy  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

try:
    import torch
    import transformers
except ImportError:
    sys.exit("this example needs torch and transformers: pip install '.[transformers]' in pyattn's checkout")

import pyattn  # noqa: E402
import pyattn.integrations.transformers as pt  # noqa: E402

VOCAB = 4096


def make_config(family: str, layers: int, hidden: int, heads: int, kv_heads: int, window: int):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
    )
    head_dim = hidden // heads
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=window)
    if family == "qwen2":
        # max_window_layers: the layers from it on slide; its default (28) left every layer full
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=0)
    if family == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return transformers.Gemma2Config(
            **common, head_dim=head_dim, sliding_window=window, layer_types=types, query_pre_attn_scalar=head_dim
        )
    if family == "gpt_oss":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return transformers.GptOssConfig(
            **{**common, "intermediate_size": hidden},
            head_dim=head_dim,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=window,
            layer_types=types,
        )
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=8192)
    raise ValueError(f"unknown model family {family!r}")


def left_padded_prompts(lens, seed):
    """ids and attention_mask (B, max(lens)), each prompt right-aligned (padding on the left, as
    decoder-only generation needs)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    ids = torch.zeros(len(lens), L, dtype=torch.long)
    mask = torch.zeros(len(lens), L, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, L - n :] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, L - n :] = 1
    return ids, mask


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
    ap.add_argument("--model", default="llama", choices=["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "gpt2"])
    ap.add_argument("--layers", type=_at_least(1), default=4)
    ap.add_argument("--hidden", type=_at_least(1), default=512)
    ap.add_argument("--heads", type=_at_least(1), default=8)
    ap.add_argument("--kv-heads", type=_at_least(1), default=2)
    ap.add_argument("--window", type=_at_least(1), default=64, help="sliding window of mistral/qwen2/gemma2/gpt_oss")
    ap.add_argument("--prompt-lens", default="17,40,5,96", help="comma-separated (default: %(default)s)")
    ap.add_argument("--new-tokens", type=_at_least(1), default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=_at_least(1), default=None, help="torch's and pyattn's threads (default: as set)")
    ap.add_argument("--repeats", type=_at_least(1), default=3, help="timed generations per implementation (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 layers, hidden 128, 4 heads on 2 kv heads, window 16, 12 new tokens, one repeat (what is not given)",
    )
    if ap.parse_known_args(argv)[0].quick:  # new defaults: what is given on the command line still counts
        ap.set_defaults(layers=2, hidden=128, heads=4, kv_heads=2, new_tokens=12, repeats=1, window=16)
    args = ap.parse_args(argv)
    kv_heads = args.heads if args.model == "gpt2" else args.kv_heads  # GPT-2 has no grouped heads
    if args.heads % kv_heads or args.hidden % args.heads:
        ap.error(
            f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads}) "
            f"and divide --hidden ({args.hidden})"
        )
    try:
        lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]  # a trailing comma is fine
    except ValueError:
        ap.error(f"--prompt-lens must be comma-separated integers; got {args.prompt_lens!r}")
    if not lens or min(lens) < 1:
        ap.error("prompt lengths must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
        pyattn.set_num_threads(args.threads)

    pt.register()
    config = make_config(args.model, args.layers, args.hidden, args.heads, args.kv_heads, args.window)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    base = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    ids, mask = left_padded_prompts(lens, args.seed)
    gen = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    gen["pad_token_id"] = 0

    calls = [0]
    real_sdpa = pyattn.scaled_dot_product_attention

    def counted(*a, **kw):  # counts pyattn's calls: no silent fallback to another attention
        calls[0] += 1
        return real_sdpa(*a, **kw)

    pyattn.scaled_dot_product_attention = counted
    print(
        f"{args.model}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {kv_heads} KV heads, "
        f"{args.dtype}, random weights; prompts {lens} left-padded to {ids.shape[1]}, {args.new_tokens} new tokens; "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"pyattn {pyattn.__version__} ({pyattn.get_num_threads()} threads)"
    )
    tokens, rates = {}, {}
    for impl in ("eager", "sdpa", pt.NAME):
        model = copy.deepcopy(base)
        try:
            model.set_attn_implementation(impl)
        except ValueError:  # Gemma 2 and gpt-oss refuse sdpa (softcap, sinks)
            print(f"  {impl:>6}: not supported by {type(model).__name__}")
            continue
        times = []
        with torch.inference_mode():
            model.generate(
                ids[:, -8:], **{**gen, "attention_mask": mask[:, -8:], "max_new_tokens": 2, "min_new_tokens": 2}
            )
            for _ in range(args.repeats):
                calls[0] = 0
                t0 = time.perf_counter()
                out = model.generate(ids, **gen)
                times.append(time.perf_counter() - t0)
        tokens[impl] = out[:, ids.shape[1] :]
        rates[impl] = len(lens) * args.new_tokens / statistics.median(times)
        extra = f", {calls[0]} pyattn attention calls" if impl == pt.NAME else ""
        print(f"  {impl:>6}: {rates[impl]:7.1f} tokens/s (prefill + decode, median of {args.repeats}){extra}")
        if impl == pt.NAME and calls[0] != args.layers * args.new_tokens:
            print(f"ERROR: expected {args.layers} x {args.new_tokens} pyattn calls, got {calls[0]}")
            return 1
    pyattn.scaled_dot_product_attention = real_sdpa

    for b, n in enumerate(lens):
        print(f"  prompt of {n:>3} tokens -> {tokens[pt.NAME][b, :10].tolist()} ...")
    same = torch.equal(tokens[pt.NAME], tokens["eager"])
    agree = (tokens[pt.NAME] == tokens["eager"]).float().mean().item()
    line = f"pyattn vs eager: {'identical tokens' if same else f'tokens DIFFER ({100 * agree:.1f}% agree)'}"
    if "sdpa" in tokens:
        line += f"; sdpa vs eager: {'identical' if torch.equal(tokens['sdpa'], tokens['eager']) else 'differ'}"
    line += "; pyattn " + ", ".join(f"{rates[pt.NAME] / rates[k]:.2f}x {k}" for k in rates if k != pt.NAME)
    print(line)
    if not same and args.dtype == "float32":
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
