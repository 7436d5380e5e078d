"""Helpers shared by the test modules (imported as ``_helpers``; see conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = [np.float32, np.float64]


def _available_isas():
    """SIMD paths to run the parity tests on; ["default"] when pyattn._core is missing."""
    try:
        from pyattn import _core

        isas = [str(name) for name in _core.available_isas()]
    except Exception:
        return ["default"]
    return isas or ["default"]


#: the SIMD kernels this CPU can run (computed once, at collection)
ISAS = _available_isas()

#: relative tolerance (against max|reference|) for each output dtype
TOL = {F32: 1e-5, F64: 1e-12}


def tol_for(dtype):
    return TOL[np.dtype(dtype)]


def assert_close(actual, expected, dtype=None, *, tol=None, what="result"):
    """max|actual - expected| <= tol * scale, scale = max|expected| (or 1 if that is 0).

    Non-finite reference entries (-inf lse, NaN) must be matched exactly.
    ``dtype`` (if given) is the dtype ``actual`` must have; the tolerance follows it.
    """
    assert isinstance(actual, (np.ndarray, np.generic)), f"{what}: expected a NumPy array, got {type(actual).__name__}"
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    if dtype is not None:
        assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype} != expected {np.dtype(dtype)}"
    if tol is None:
        tol = TOL.get(actual.dtype, 1e-12)
    a = actual.astype(np.float64)
    fin = np.isfinite(expected)
    if (~fin).any():
        same = np.array_equal(a[~fin], expected[~fin], equal_nan=True)
        assert same, f"{what}: non-finite entries differ: got {a[~fin][:8]}, expected {expected[~fin][:8]}"
    if fin.any():
        scale = float(np.max(np.abs(expected[fin]))) or 1.0
        diff = np.abs(a[fin] - expected[fin])
        err = float(np.max(diff))
        if not err <= tol * scale:  # also catches NaN
            nan = np.isnan(diff)  # a NaN where a finite value was expected is the worst
            idx = np.argwhere(fin)[int(np.argmax(nan)) if nan.any() else int(np.argmax(diff))]
            raise AssertionError(
                f"{what}: max abs error {err:.3e} > {tol:.0e} * {scale:.3e} "
                f"(first worst at index {tuple(int(i) for i in idx)}: "
                f"got {a[tuple(idx)]!r}, expected {expected[tuple(idx)]!r})"
            )


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def bool_mask(rng, shape, p=0.7, full_rows=False):
    """Random bool mask (True = may attend); with full_rows, some rows are all False."""
    m = rng.random(shape) < p
    if full_rows and m.ndim >= 1 and m.shape[-1] > 0:
        rows = rng.random(shape[:-1]) < 0.3
        if m.ndim >= 2 and m.shape[-2] > 0:
            rows.reshape(-1)[0] = True  # at least one
        m[rows] = False
    return m


def float_mask(rng, shape, dtype=np.float64, p=0.7, full_rows=False):
    """Random additive mask: small finite biases, -inf where forbidden."""
    allowed = bool_mask(rng, shape, p=p, full_rows=full_rows)
    bias = rng.uniform(-2.0, 2.0, size=shape)
    return np.where(allowed, bias, -np.inf).astype(dtype)


def make_mask(rng, kind, shape, dtype=np.float64):
    if kind is None:
        return None
    if kind == "bool":
        return bool_mask(rng, shape)
    if kind == "bool_full_rows":
        return bool_mask(rng, shape, full_rows=True)
    if kind == "float":
        return float_mask(rng, shape, dtype)
    if kind == "float_full_rows":
        return float_mask(rng, shape, dtype, full_rows=True)
    if kind == "float_finite":
        return rng.uniform(-3.0, 3.0, size=shape).astype(dtype)
    raise ValueError(kind)


def relayout(x, how, rng=None):
    """The same values as x, laid out differently in memory."""
    if how == "contiguous":
        return x
    if how == "fortran":
        return np.asfortranarray(x)
    if how == "swapaxes":  # stored as (..., L, H, E), viewed as (..., H, L, E)
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -3, -2)), -3, -2)
    if how == "transposed_last":  # stored as (..., E, L)
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)
    if how == "row_slice":  # every other row of a bigger buffer
        big = np.zeros(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1]), x.dtype)
        big[..., ::2, :] = x
        return big[..., ::2, :]
    if how == "col_slice":  # last axis not unit stride
        big = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    if how == "reversed":  # negative strides
        return np.ascontiguousarray(x[..., ::-1, ::-1])[..., ::-1, ::-1]
    if how == "offset":  # misaligned start
        buf = np.zeros(x.size + 1, x.dtype)
        y = buf[1:].reshape(x.shape)
        y[...] = x
        return y
    if how == "unaligned":  # data pointer not a multiple of the itemsize
        buf = np.zeros(x.nbytes + 1, np.uint8)
        y = np.ndarray(x.shape, x.dtype, buffer=buf, offset=1)
        y[...] = x
        return y
    if how == "byteswapped":  # non-native byte order
        return x.astype(x.dtype.newbyteorder("S"))
    raise ValueError(how)


def snapshot(*arrays):
    """Copies of the array arguments, to check later that nothing was modified."""
    return [None if a is None else np.array(a, copy=True) for a in arrays]


def assert_unmodified(arrays, copies):
    for i, (a, c) in enumerate(zip(arrays, copies)):
        if a is None or c is None:
            continue
        assert np.array_equal(np.asarray(a), c, equal_nan=True), f"argument {i} was modified"


def weights_from_state_dict(sd, embed_dim):
    """Torch-layout state dict -> the reference's row-vector weights.

    torch computes y = x @ W.T + b, so w_q = W_q.T etc.
    Returns dict(w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o).
    """
    sd = {k: np.asarray(v) for k, v in sd.items()}
    if "in_proj_weight" in sd:
        w = sd["in_proj_weight"]
        rest = w.shape[0] - embed_dim
        wq, wk, wv = w[:embed_dim], w[embed_dim : embed_dim + rest // 2], w[embed_dim + rest // 2 :]
    else:
        wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
    bq = bk = bv = None
    if sd.get("in_proj_bias") is not None:
        b = sd["in_proj_bias"]
        nq, nk = wq.shape[0], wk.shape[0]
        bq, bk, bv = b[:nq], b[nq : nq + nk], b[nq + nk :]
    return dict(
        w_q=wq.T,
        w_k=wk.T,
        w_v=wv.T,
        w_o=sd["out_proj.weight"].T,
        b_q=bq,
        b_k=bk,
        b_v=bv,
        b_o=sd.get("out_proj.bias"),
    )


def make_state_dict(rng, embed_dim, kdim=None, vdim=None, bias=True, dtype=np.float64, kv_width=None):
    """A random torch-layout MultiheadAttention state dict (NumPy arrays)."""
    e = embed_dim
    kdim = e if kdim is None else kdim
    vdim = e if vdim is None else vdim
    kvw = e if kv_width is None else kv_width
    s = 1.0 / np.sqrt(e)
    sd = {}
    if kdim == e and vdim == e and kvw == e:
        sd["in_proj_weight"] = randn(rng, (3 * e, e), dtype, s)
    else:
        sd["q_proj_weight"] = randn(rng, (e, e), dtype, s)
        sd["k_proj_weight"] = randn(rng, (kvw, kdim), dtype, 1.0 / np.sqrt(kdim))
        sd["v_proj_weight"] = randn(rng, (kvw, vdim), dtype, 1.0 / np.sqrt(vdim))
    if bias:
        sd["in_proj_bias"] = randn(rng, (e + 2 * kvw,), dtype, 0.5)
    sd["out_proj.weight"] = randn(rng, (e, e), dtype, s)
    if bias:
        sd["out_proj.bias"] = randn(rng, (e,), dtype, 0.5)
    return sd


HERE = os.path.dirname(os.path.abspath(__file__))


def run_python(script, *, timeout=60, argv=None, env=None):
    """Run ``python -c script`` (dedented) or ``argv`` in a new session, from tests/ (``env``: its
    environment, else this one's); a hang fails the test: on timeout the whole process group is
    killed, forked children included. Returns (returncode, stdout, stderr)."""
    import pytest

    cmd = argv if argv is not None else [sys.executable, "-c", textwrap.dedent(script)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE, start_new_session=True, env=env
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the subprocess hung (killed after {timeout} s)\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    return proc.returncode, out, err
