"""Greedy generation with a KV cache (issue 10): the decoder of examples/generate.py, pyattn's loop
beside the same loop in torch, same weights, same tokens.

One pytest-benchmark group, ``generate``. Each item times one whole generation: the prefill of a
ragged batch of prompts (17, 40, 5 and 64 tokens; one call per layer) and then the decode steps
(Lq = 1, every row at its own length). The caches are emptied before each call, outside the
timing.

- ``pyattn``: one contiguous float32 ``pyattn.KVCache`` per layer, the model's products by
  ``pyattn.matmul`` (the example's defaults);
- ``pyattn_paged16``: the same with paged caches of 16-token blocks;
- ``torch``: the same model code on torch tensors, with ``F.scaled_dot_product_attention`` over a
  preallocated torch cache per layer, written in place and read under an explicit bool mask (the
  example's ``TorchKVCache``); skipped without torch.

The model has 4 layers, d_model 512, Hq 8, Hkv 2, head_dim 64 and a 4096-token vocabulary, and
generates 32 new tokens a row. Under ``--benchmark-disable`` (smoke) it has 2 layers and
generates 8 tokens. ``extra_info`` has the best prefill and decode tokens/s over the rounds.

Checks, outside the timing: every item's tokens are the greedy choice of a float64 recompute
without a cache (teacher-forced: the model over the prompt and the tokens fed back, with
attention by ``pyattn.reference``; a token may differ from the float64 argmax only by a near
tie), and every item's tokens are identical to the other items' (torch only when it imports).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import peers
import pytest
from benchutil import pyattn_threads, run_timed, smoke_mode

from pyattn import reference

IMPLS = ("pyattn", "pyattn_paged16", "torch")
TIE_TOL = 1e-4  # a generated token's float64 logit may trail the float64 maximum by this much


def _load_example():
    """examples/generate.py as a module (the examples are not a package)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("pyattn_example_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ex = _load_example()


@dataclass(frozen=True)
class Case:
    layers: int
    new_tokens: int
    prompt_lens: tuple = (17, 40, 5, 64)
    seed: int = 0

    @property
    def cfg(self):
        return ex.Config(n_layers=self.layers)

    @property
    def max_len(self) -> int:
        return max(self.prompt_lens) + self.new_tokens

    @property
    def name(self) -> str:
        c = self.cfg
        return (
            f"B{len(self.prompt_lens)} layers{c.n_layers} d{c.d_model} Hq{c.n_heads} Hkv{c.n_kv_heads} "
            f"D{c.head_dim} prompts {','.join(map(str, self.prompt_lens))} new{self.new_tokens}"
        )


FULL = Case(layers=4, new_tokens=32)
SMOKE = Case(layers=2, new_tokens=8)


def pytest_generate_tests(metafunc):
    if {"case", "impl"} <= set(metafunc.fixturenames):
        case = SMOKE if smoke_mode(metafunc.config) else FULL
        metafunc.parametrize(
            ("case", "impl"),
            [pytest.param(case, impl, id=f"{case.name.replace(' ', '_')}-{impl}") for impl in IMPLS],
        )


@functools.lru_cache(maxsize=2)
def weights(case: Case) -> dict:
    return ex.init_weights(case.cfg, case.seed)


def prompts(case: Case) -> list:
    return ex.make_prompts(case.cfg, case.prompt_lens, case.seed)


def setup(case: Case, impl: str):
    """(model, caches) of one implementation; pytest.skip where it cannot run."""
    B = len(case.prompt_lens)
    if impl == "torch":
        try:
            peers.torch_set_threads(pyattn_threads())
        except peers.Unsupported as exc:
            pytest.skip(f"torch: {exc}")
        return ex.Decoder(case.cfg, weights(case), ex.TorchOps()), ex.torch_caches(case.cfg, B, case.max_len)
    block_size = 16 if impl == "pyattn_paged16" else None
    caches = ex.pyattn_caches(case.cfg, B, case.max_len, block_size=block_size)
    return ex.Decoder(case.cfg, weights(case), ex.NumpyOps()), caches


def run_once(model, caches, case: Case):
    for c in caches:
        c.reset()
    return ex.generate(model, caches, prompts(case), case.new_tokens)


@functools.lru_cache(maxsize=None)
def untimed_tokens(case: Case, impl: str) -> np.ndarray:
    """The tokens of one untimed generation (what the other items compare theirs with)."""
    model, caches = setup(case, impl)
    return run_once(model, caches, case).tokens


def check_greedy(case: Case, tokens: np.ndarray, what: str) -> None:
    """Teacher-forced float64 oracle: per row, the model without a cache over the prompt and the
    generated tokens fed back; at each generated position the token must be the argmax of the
    oracle's logits, or trail it by at most TIE_TOL (a near tie that float32 may break either way)."""
    model = ex.Decoder(case.cfg, weights(case), ex.NumpyOps(np.float64))

    def attention(i, q, k, v):
        return reference.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    for b, (prompt, gen) in enumerate(zip(prompts(case), tokens)):
        seq = np.concatenate([prompt, gen[:-1]])
        h = model.hidden(seq[None], np.arange(len(seq))[None], attention)
        logits = model.logits(h[0, len(prompt) - 1 :])  # (new_tokens, vocab)
        gap = logits.max(axis=-1) - logits[np.arange(len(gen)), gen]
        worst = int(np.argmax(gap))
        assert gap[worst] <= TIE_TOL, (
            f"{what}: row {b}, new token {worst}: generated {gen[worst]} but the float64 recompute's "
            f"argmax is {int(np.argmax(logits[worst]))} (logit {gap[worst]:.3g} higher)"
        )


def test_generate(benchmark, case: Case, impl: str):
    benchmark.group = "generate"
    B = len(case.prompt_lens)
    benchmark.extra_info.update(
        kind="generate",
        impl=impl,
        shape=case.name,
        prompt_tokens=int(sum(case.prompt_lens)),
        decode_tokens=B * (case.new_tokens - 1),
    )
    model, caches = setup(case, impl)
    gens = []

    def fn():
        gens.append(run_once(model, caches, case))
        return gens[-1]

    gen = run_timed(benchmark, fn)
    benchmark.extra_info["prefill_tok_s"] = max(g.prefill_tps for g in gens)
    benchmark.extra_info["decode_tok_s"] = max(g.decode_tps for g in gens)
    benchmark.extra_info["cache_bytes"] = int(sum(c.nbytes for c in caches))
    assert gen.tokens.shape == (B, case.new_tokens)

    check_greedy(case, gen.tokens, f"{impl} on {case.name}")
    for other in IMPLS:
        if other == impl:
            continue
        try:
            expected = untimed_tokens(case, other)
        except pytest.skip.Exception:
            continue  # torch not importable: nothing to compare with
        same = int((gen.tokens == expected).sum())
        assert same == gen.tokens.size, (
            f"{impl} on {case.name}: {gen.tokens.size - same} of {gen.tokens.size} greedy tokens differ from "
            f"{other}'s\n{impl}: {gen.tokens.tolist()}\n{other}: {expected.tolist()}"
        )
