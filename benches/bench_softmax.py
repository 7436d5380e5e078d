"""pyattn.softmax beside a plain NumPy float32 softmax and torch.softmax, on the attention-score
shape of B8 H12 L512: (8*12*512, 512) float32, without a mask, with a bool causal mask (512, 512)
(True = keep) and with a float key-padding mask (8, 1, 1, 512) (added; -inf forbids) broadcast
over the scores viewed as (8, 12, 512, 512).  Memory-bound: the report shows GB/s (x read once,
the output written once).  The check uses float64 ``pyattn.reference.softmax`` on a slice.
"""

from __future__ import annotations

import functools

import numpy as np
import peers
import pytest
from benchutil import assert_close, normal, pyattn_threads, rng_for, run_timed

import pyattn
from pyattn import reference

B, H, L = 8, 12, 512
MASKS = ("none", "bool_causal", "float_padding")
IMPLS = ("pyattn", "numpy", "torch")


@functools.lru_cache(maxsize=1)
def scores() -> np.ndarray:
    return normal(rng_for("softmax", B, H, L), (B, H, L, L)) * np.float32(3.0)


@functools.lru_cache(maxsize=None)
def make_mask(kind: str):
    if kind == "none":
        return None
    if kind == "bool_causal":
        return np.tril(np.ones((L, L), dtype=bool))
    # batch b pads its last 32*b keys (never all of them)
    keep = np.arange(L)[None, :] < (L - 32 * np.arange(B))[:, None]
    return np.where(keep, 0.0, -np.inf).astype(np.float32).reshape(B, 1, 1, L)


def operands(kind: str):
    """x as the 2-D (B*H*L, L) array when unmasked, else as (B, H, L, L) with its mask."""
    x = scores()
    return (x.reshape(B * H * L, L), None) if kind == "none" else (x, make_mask(kind))


def numpy_softmax(x, mask=None):
    """The usual NumPy float32 softmax over the last axis."""
    if mask is not None:
        x = np.where(mask, x, np.float32(-np.inf)) if mask.dtype == np.bool_ else x + mask
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    e /= e.sum(axis=-1, keepdims=True)
    return e


CHECK = np.s_[B - 1, :2]  # the last batch entry (the most padding), two heads


@functools.lru_cache(maxsize=None)
def oracle(kind: str) -> np.ndarray:
    x = scores()[CHECK].astype(np.float64)
    mask = make_mask(kind)
    if mask is not None and mask.ndim == 4:
        mask = mask[B - 1]
    return reference.softmax(x, mask=mask)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", MASKS)
def test_softmax(benchmark, kind, impl):
    benchmark.group = f"softmax ({B}*{H}*{L}, {L}) float32 mask={kind}"
    benchmark.extra_info.update(kind="softmax", impl=impl, bytes=2 * 4 * B * H * L * L)
    x, mask = operands(kind)
    finish = np.asarray
    if impl == "pyattn":

        def fn():
            return pyattn.softmax(x, mask=mask)
    elif impl == "numpy":

        def fn():
            return numpy_softmax(x, mask)
    else:
        try:
            prepared = peers.prepare_torch_softmax(x, mask, num_threads=pyattn_threads())
        except peers.Unsupported as exc:
            pytest.skip(f"{impl}: {exc}")
        fn, finish = prepared.run, prepared.finish
    out = finish(run_timed(benchmark, fn))
    assert out.shape == x.shape and out.dtype == np.float32, f"{impl}: {out.shape} {out.dtype}"
    assert_close(out.reshape(B, H, L, L)[CHECK], oracle(kind), 1e-5, f"{impl} softmax {kind}")
