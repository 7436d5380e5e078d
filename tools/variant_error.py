"""float32 error of each score variant against the float64 reference, beside the plain kernel's.

    python tools/variant_error.py [--l 4096] [--h 2] [--d 64] [--seed 0]

Run it once per kernel set (``PYATTN_ISA=avx2`` etc.). The error of the output is printed as
max |pyattn - ref| / max |ref| and normwise, the reference computed in float64 on the same
float32 inputs; half K/V are compared with the reference on the rounded K/V (as float64), so
only the kernel's arithmetic is measured, not the rounding of the inputs. Causal (bottom-right)
unless --full, as a decoder runs them; the window is (1023, 0), (1023, 1023) with --full.
"formula" is the textbook formula evaluated in float32 NumPy: the error any float32 result of
that variant carries.
"""

from __future__ import annotations

import argparse
import io

import numpy as np

import pyattn
from pyattn import reference


def _variants(h, rng, full=False):
    slopes = 2.0 ** (-8.0 * np.arange(1, h + 1) / h)
    sinks = rng.standard_normal(h).astype(np.float32)
    win = (1023, 1023) if full else (1023, 0)
    return {
        "plain": {},
        "softcap": dict(softcap=30.0),
        "alibi": dict(alibi_slopes=slopes.astype(np.float32)),
        "sinks": dict(sinks=sinks),
        "window": dict(window=win),
        "all": dict(softcap=30.0, alibi_slopes=slopes.astype(np.float32), sinks=sinks, window=win),
    }


def _formula_f32(q, k, v, causal, softcap=None, alibi_slopes=None, sinks=None, window=None):
    """The textbook formula in float32 NumPy (Lq == Lk), an L x L score matrix a head."""
    i, j = np.arange(q.shape[-2])[:, None], np.arange(k.shape[-2])[None, :]
    left, right = window or (None, None)
    hidden = (j > i) if causal else np.zeros((i.size, j.size), bool)
    if left is not None:
        hidden |= j < i - left
    if right is not None:
        hidden |= j > i + right
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(q.shape[-1] ** -0.5)
    if softcap:
        s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
    if alibi_slopes is not None:
        s = s - alibi_slopes[:, None, None] * np.abs(i - j).astype(np.float32)
    s = np.where(hidden, np.float32(-np.inf), s)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[:, None, None])
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks[:, None, None] - m)
    return np.matmul(p / den, v)


def _rel(out, ref):
    """max |err| / max |ref|"""
    return float(np.max(np.abs(out.astype(np.float64) - ref)) / np.max(np.abs(ref)))


def _rms(out, ref):
    """||err|| / ||ref|| (normwise: steadier from seed to seed than the largest error)"""
    return float(np.sqrt(np.mean((out.astype(np.float64) - ref) ** 2) / np.mean(ref**2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--l", type=int, default=4096)
    ap.add_argument("--h", type=int, default=2)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--full", action="store_true", help="no causal mask")
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    shape = (1, a.h, a.l, a.d)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    kw0 = {} if a.full else dict(is_causal=True, causal_align="bottom_right")
    isa = pyattn.show_config(file=io.StringIO())["isa"]
    print(f"kernel set {isa}, B1 H{a.h} L{a.l} D{a.d}, {'no mask' if a.full else 'causal'}")
    print(f"{'':<10} {'max |err| / max |ref|':^32} {'||err|| / ||ref||':^32}")
    hdr = f"{'pyattn':>9} {'vs plain':>9} {'formula':>12}"
    print(f"{'variant':<10} {hdr} {hdr}")
    plain = None
    for name, kw in _variants(a.h, rng, a.full).items():
        out = pyattn.scaled_dot_product_attention(q, k, v, **kw0, **kw)
        ref = reference.scaled_dot_product_attention(
            q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **kw0, **kw
        )
        # the same formula evaluated in float32 (NumPy): the error a float32 result carries
        # whatever the kernel, so variants that make the problem itself less well conditioned
        # are told apart from a kernel that adds error
        f32 = _formula_f32(q, k, v, not a.full, **kw)
        e = (_rel(out, ref), _rms(out, ref))
        ef = (_rel(f32, ref), _rms(f32, ref))
        plain = e if plain is None else plain
        cols = [f"{e[i]:>9.2e} {e[i] / plain[i]:>9.2f} {ef[i]:>12.2e}" for i in range(2)]
        print(f"{name:<10} {cols[0]} {cols[1]}")
    try:
        import ml_dtypes
    except ImportError:
        return
    for dt in (np.float16, ml_dtypes.bfloat16):
        kh, vh = k.astype(dt), v.astype(dt)
        out = pyattn.scaled_dot_product_attention(q, kh, vh, **kw0)
        ref = reference.scaled_dot_product_attention(
            q.astype(np.float64), kh.astype(np.float64), vh.astype(np.float64), **kw0
        )
        err = np.max(np.abs(out - ref))
        print(f"{np.dtype(dt).name + ' K/V':<12} max |err| {err:.2e}, relative {_rel(out, ref):.2e}")


if __name__ == "__main__":
    main()
