"""Hugging Face transformers models with attn_implementation="pyattn" beside "sdpa" (issue 12).

Random-weight models (no download) of the shapes the issue names, float32, batch 1:

- ``llama``: 4 layers, hidden 512, 8 heads / 2 KV heads (head_dim 64), MLP 1536, vocabulary
  32000: the prefill of a 1024-token prompt, and one decode step at a context of 1024;
- ``mistral``: the same with a sliding window of 4096 tokens (Mistral 7B's): the prefill of an
  8192-token prompt, and a decode step at 8192 (the cache holds the last 4095 tokens).

One pytest-benchmark group per (model, phase), with the items ``pyattn`` and ``sdpa`` (torch's
``scaled_dot_product_attention`` through transformers' own integration), plus ``eager`` for the
llama prefill. The prefill item is ``model(prompt, cache=DynamicCache(), logits_to_keep=1)``
(what generate() runs first); the decode item one ``model(token, cache)`` step on a cache
prefilled outside the timing, a fixed number of rounds so that every item's cache grows alike.
torch and pyattn run on pyattn's thread count.

Checks, outside the timing: every item's logits against a float64 oracle (the same weights in
float64, eager where it fits in memory, sdpa at 8192), to 1e-3 of their largest magnitude; and
the pyattn items must have called pyattn (counted), the sliding ones with ``window``.

Under ``--benchmark-disable`` (the CI smoke) the models are 2 layers of hidden 64 with prompts of
64 tokens (window 16).

``python benches/bench_transformers.py`` measures the end-to-end figures instead: prefill and
decode tokens/s of pyattn and sdpa interleaved (median of --repeats), and the share of each
model's time spent in its attention function (timed around every call). ``--static N`` adds
the llama model on a StaticCache of N slots (sdpa then reads all N through a mask, pyattn only
the filled part through kv_lens).

On a machine whose cores are shared with other work, run it with ``OMP_WAIT_POLICY=passive``:
torch's and pyattn's OpenMP threads otherwise spin between the many short parallel regions of a
decode step, and on the 2-core development VM under a load of 5-20 that made every decode step
4-5x slower, for either attention (measured: 61-86 ms against 15-17 ms a token).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from benchutil import assert_close, pyattn_threads, run_timed, smoke_mode  # noqa: E402

import pyattn  # noqa: E402

pt = pytest.importorskip("pyattn.integrations.transformers")

DECODE_ROUNDS = 20
ORACLE_REL = 1e-3


@dataclass(frozen=True)
class Case:
    family: str  # llama | mistral
    length: int  # prompt tokens (prefill) or context (decode)
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1536
    vocab: int = 32000
    window: int = 4096

    def config(self):
        kw = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=max(self.length + 64, 256),
        )
        if self.family == "mistral":
            return transformers.MistralConfig(**kw, sliding_window=self.window)
        return transformers.LlamaConfig(**kw)

    @property
    def name(self) -> str:
        w = f" W{self.window}" if self.family == "mistral" else ""
        return f"{self.family} layers{self.layers} d{self.hidden} Hq{self.heads} Hkv{self.kv_heads}{w} L{self.length}"


FULL = [Case("llama", 1024), Case("mistral", 8192)]
SMOKE = [
    Case("llama", 64, layers=2, hidden=64, heads=4, intermediate=128, vocab=512),
    Case("mistral", 64, layers=2, hidden=64, heads=4, intermediate=128, vocab=512, window=16),
]


def pytest_generate_tests(metafunc):
    if {"case", "impl"} <= set(metafunc.fixturenames):
        cases = SMOKE if smoke_mode(metafunc.config) else FULL
        params = []
        for case in cases:
            impls = ["pyattn", "sdpa"]
            if metafunc.function.__name__ == "test_prefill" and case.length <= 1024:
                impls.append("eager")
            params += [pytest.param(case, impl, id=f"{case.name.replace(' ', '_')}-{impl}") for impl in impls]
        metafunc.parametrize(("case", "impl"), params)


@functools.lru_cache(maxsize=2)
def base_model(case: Case):
    pt.register()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(case.config()).eval()


def model_for(case: Case, impl: str, dtype=torch.float32):
    model = copy.deepcopy(base_model(case)).to(dtype)
    model.set_attn_implementation(impl)
    return model


def prompt(case: Case):
    g = torch.Generator().manual_seed(case.length)
    return torch.randint(1, case.vocab, (1, case.length), generator=g)


NEXT_TOKEN = torch.tensor([[7]])


def prefill(model, ids, static_len=None):
    """The prompt's forward into a fresh cache: a DynamicCache (what generate() uses by default),
    or a StaticCache of ``static_len`` slots."""
    if static_len:
        cache = transformers.StaticCache(config=model.config, max_cache_len=static_len)
    else:
        cache = transformers.DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1], cache


def decode(model, cache):
    return model(input_ids=NEXT_TOKEN, cache=cache, use_cache=True).logits[0, -1]


@functools.lru_cache(maxsize=4)
def oracle(case: Case):
    """(prefill logits, first decode step's logits) of the float64 model."""
    impl = "eager" if case.length <= 1024 else "sdpa"
    model = model_for(case, impl, torch.float64)
    with torch.inference_mode():
        last, cache = prefill(model, prompt(case))
        step = decode(model, cache)
    return last.numpy().copy(), step.numpy().copy()


class Counter:
    def __init__(self, monkeypatch):
        self.calls, self.windows = 0, 0
        real = pyattn.scaled_dot_product_attention

        def counted(*a, **kw):
            self.calls += 1
            self.windows += kw.get("window") is not None
            return real(*a, **kw)

        monkeypatch.setattr(pyattn, "scaled_dot_product_attention", counted)


def _check_calls(counter, case, impl, forwards=None):
    """pyattn items: one pyattn call per layer and forward (``forwards`` of them, or any number
    when the benchmark chose it; the prefill), the sliding model's prefill windowed (its decode
    step reads a cache no longer than the window: nothing to cut); the others: none."""
    if impl != "pyattn":
        assert counter.calls == 0
        return
    assert counter.calls and counter.calls % case.layers == 0, f"{counter.calls} pyattn calls, {case.layers} layers"
    if forwards is not None:
        assert counter.calls == forwards * case.layers
    if case.family == "mistral" and case.length > case.window and forwards is None:  # the prefill
        assert counter.windows == counter.calls


def test_prefill(benchmark, case, impl, monkeypatch):
    benchmark.group = f"hf prefill {case.name}"
    torch.set_num_threads(pyattn_threads())
    model = model_for(case, impl)
    ids = prompt(case)
    counter = Counter(monkeypatch)
    with torch.inference_mode():
        last, _ = run_timed(benchmark, lambda: prefill(model, ids))
    _check_calls(counter, case, impl)
    assert_close(last.numpy(), oracle(case)[0], ORACLE_REL, f"{impl} prefill logits")
    benchmark.extra_info["tokens"] = case.length


def test_decode(benchmark, case, impl, monkeypatch):
    benchmark.group = f"hf decode {case.name}"
    torch.set_num_threads(pyattn_threads())
    model = model_for(case, impl)
    ids = prompt(case)
    with torch.inference_mode():
        _, cache = prefill(model, ids)
        counter = Counter(monkeypatch)
        step = decode(model, cache)  # the checked step
        _check_calls(counter, case, impl, forwards=1)
        assert_close(step.numpy(), oracle(case)[1], ORACLE_REL, f"{impl} decode logits")
        _, cache = prefill(model, ids)
        if benchmark.enabled:
            benchmark.pedantic(lambda: decode(model, cache), rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=0)
        else:
            benchmark(lambda: decode(model, cache))
    benchmark.extra_info["context"] = case.length


# ------------------------------------------------------------------------- end-to-end measure


class AttentionTimer:
    """Times every call of the attention functions registered for "sdpa" and "pyattn"."""

    def __init__(self):
        from transformers.modeling_utils import AttentionInterface

        self.seconds = 0.0
        self.mapping = AttentionInterface._global_mapping
        self.saved = {k: self.mapping[k] for k in ("sdpa", pt.NAME)}
        for k, fn in self.saved.items():
            self.mapping[k] = self._wrap(fn)

    def _wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def restore(self):
        self.mapping.update(self.saved)


def measure(case: Case, repeats: int, steps: int, static_len=None) -> dict:
    """{impl: (prefill s, prefill attention s, decode s/token, decode attention s/token)}, the
    medians of ``repeats`` rounds, pyattn and sdpa interleaved (alternating which goes first);
    ``static_len``: a StaticCache of that many slots instead of a DynamicCache."""
    models = {impl: model_for(case, impl) for impl in ("sdpa", pt.NAME)}
    ids = prompt(case)
    timer = AttentionTimer()
    runs = {impl: [] for impl in models}
    try:
        with torch.inference_mode():
            for model in models.values():  # warm-up
                _, cache = prefill(model, ids[:, :256], static_len)
                decode(model, cache)
            for r in range(repeats):
                for impl in list(models)[:: 1 if r % 2 == 0 else -1]:
                    model = models[impl]
                    time.sleep(0.2)  # let the other implementation's threads go idle
                    timer.seconds = 0.0
                    t0 = time.perf_counter()
                    _, cache = prefill(model, ids, static_len)
                    tp, ap = time.perf_counter() - t0, timer.seconds
                    timer.seconds = 0.0
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        decode(model, cache)
                    td, ad = (time.perf_counter() - t0) / steps, timer.seconds / steps
                    runs[impl].append((tp, ap, td, ad))
    finally:
        timer.restore()
    return {impl: tuple(statistics.median(x) for x in zip(*rows)) for impl, rows in runs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="end-to-end: pyattn vs sdpa in transformers, interleaved medians")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per repeat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", default="4096,1024", help="the sliding model's windows (default: %(default)s)")
    ap.add_argument("--static", type=int, default=0, help="also the llama model with a StaticCache of this many slots")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    ap.add_argument("--quick", action="store_true", help="the smoke shapes, 2 repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pyattn.set_num_threads(args.threads)
    pt.register()
    if args.quick:
        cases, args.repeats, args.steps = SMOKE, 2, 8
    else:
        cases = [FULL[0]] + [Case("mistral", 8192, window=int(w)) for w in args.windows.split(",") if w]
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, pyattn {pyattn.__version__}; "
        f"{args.threads} threads each; medians of {args.repeats} interleaved repeats, {args.steps} decode steps each; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )
    runs = [(case, None) for case in cases]
    if args.static:
        runs.insert(1, (cases[0], args.static))
    for case, static_len in runs:
        label = case.name + (f", StaticCache({static_len})" if static_len else ", DynamicCache")
        if args.only not in label:
            continue
        res = measure(case, args.repeats, args.steps, static_len)
        print(f"{label}:", flush=True)
        for impl, (tp, ap_, td, ad) in res.items():
            print(
                f"  {impl:>6}: prefill {case.length / tp:8.0f} tok/s ({1e3 * tp:8.1f} ms, "
                f"attention {100 * ap_ / tp:4.1f}%)"
                f"   decode {1 / td:7.1f} tok/s ({1e3 * td:6.2f} ms, attention {100 * ad / td:4.1f}%)"
            )
        s, p = res["sdpa"], res[pt.NAME]
        print(
            f"  pyattn / sdpa: prefill {s[0] / p[0]:.2f}x, decode {s[2] / p[2]:.2f}x; attention alone: "
            f"prefill {s[1] / p[1]:.2f}x, decode {s[3] / p[3]:.2f}x",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
