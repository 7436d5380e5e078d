"""The seeds' worked examples, checked to 4 decimals, by pyattn and by the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _helpers import assert_close

import pyattn
from pyattn import reference

IMPLS = [pytest.param(pyattn, id="pyattn"), pytest.param(reference, id="reference")]

X = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])


def close4(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, atol=5e-5, rtol=0)


# --------------------------------------------------------------------------- three tokens


@pytest.mark.parametrize("lib", IMPLS)
def test_three_token_scores(lib):
    scores = lib.matmul(X, X.T)
    close4(scores[0], [1.0, 0.0, 0.5])
    close4(scores, [[1, 0, 0.5], [0, 1, 0.5], [0.5, 0.5, 0.5]])


@pytest.mark.parametrize("lib", IMPLS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_three_token_attention(lib, dtype):
    x = X.astype(dtype)
    out, w = lib.scaled_dot_product_attention(x, x, x, return_weights=True)
    close4(w[0], [0.4555, 0.2246, 0.3199])
    close4(w.sum(axis=-1), [1, 1, 1])
    close4(out, [[0.6155, 0.3845], [0.3845, 0.6155], [0.5, 0.5]])
    # scale 1/sqrt(d) with d = 2 is the default; passing it explicitly changes nothing
    out2 = lib.scaled_dot_product_attention(x, x, x, scale=1 / np.sqrt(2))
    close4(out2, out)


@pytest.mark.parametrize("lib", IMPLS)
def test_three_token_weights_are_softmax_of_scaled_scores(lib):
    w = lib.softmax(lib.matmul(X, X.T), scale=1 / np.sqrt(2))
    close4(w[0], [0.4555, 0.2246, 0.3199])


@pytest.mark.parametrize("lib", IMPLS)
def test_three_token_causal(lib):
    out, w = lib.scaled_dot_product_attention(X, X, X, is_causal=True, return_weights=True)
    close4(w[0], [1.0, 0.0, 0.0])
    close4(w[1], [0.3302, 0.6698, 0.0])  # the seeds' [0.330, 0.670, 0] to 4 decimals
    np.testing.assert_allclose(w[1], [0.330, 0.670, 0.0], atol=5e-4)
    assert w[1, 2] == 0.0 and w[0, 1] == 0.0 and w[0, 2] == 0.0
    close4(out[0], [1.0, 0.0])
    close4(out[1], 0.3302 * X[0] + 0.6698 * X[1])


@pytest.mark.parametrize("lib", IMPLS)
def test_three_token_unscaled(lib):
    _, w = lib.scaled_dot_product_attention(X, X, X, scale=1.0, return_weights=True)
    close4(w[0], [0.5065, 0.1863, 0.3072])
    close4(lib.softmax(X @ X.T)[0], [0.5065, 0.1863, 0.3072])


@pytest.mark.parametrize("lib", IMPLS)
def test_three_token_value_projection(lib):
    w_v = np.array([[1.0, 0.0], [1.0, 1.0]])
    v = lib.matmul(X, w_v)
    close4(v, [[1.0, 0.0], [1.0, 1.0], [1.0, 0.5]])
    out, w = lib.scaled_dot_product_attention(X, X, v, return_weights=True)
    close4(w[0], [0.4555, 0.2246, 0.3199])  # weights unchanged: they depend on Q, K only
    close4(out[0], 0.4555 * v[0] + 0.2246 * v[1] + 0.3199 * v[2])
    close4(out[:, 0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize("lib", IMPLS)
def test_sinusoidal_d2(lib):
    pe = lib.sinusoidal_positional_encoding(3, 2)
    close4(pe[0], [0.0, 1.0])
    close4(pe[1], [0.8415, 0.5403])
    close4(pe[2], [0.9093, -0.4161])


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2}, {"kdim": 96, "vdim": 80}], ids=["packed", "gqa", "kdim_vdim"])
def test_attention_parameter_count(bias, kw):
    """The seeds' count: W_q, W_k, W_v, W_o of d_model x d_model (4 d_model^2, ~1M at 512),
    derived from the layer's shapes and checked against its state_dict and num_parameters()."""
    d_model, heads = 512, 8
    mha = pyattn.MultiHeadAttention(d_model, heads, bias=bias, rng=np.random.default_rng(0), **kw)
    kv = kw.get("num_kv_heads", heads) * (d_model // heads)  # width of the k and v projections
    kdim, vdim = kw.get("kdim", d_model), kw.get("vdim", d_model)
    if not kw:  # torch packs q, k, v into one in_proj_weight
        shapes = {"in_proj_weight": (3 * d_model, d_model)}
    else:
        shapes = {"q_proj_weight": (d_model, d_model), "k_proj_weight": (kv, kdim), "v_proj_weight": (kv, vdim)}
    shapes["out_proj.weight"] = (d_model, d_model)
    if bias:
        shapes["in_proj_bias"] = (d_model + 2 * kv,)
        shapes["out_proj.bias"] = (d_model,)
    sd = mha.state_dict()
    assert {k: np.shape(v) for k, v in sd.items()} == shapes
    count = sum(math.prod(s) for s in shapes.values())
    assert mha.num_parameters() == count
    assert sum(int(np.asarray(v).size) for v in sd.values()) == count
    if not kw and not bias:  # the seeds' figure
        assert count == 4 * d_model**2


# --------------------------------------------------------------------------- "The cat sat down"


def _np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _cat_sat_down():
    """The NumPy walkthrough, step by step, exactly as the seeds write it."""
    rng = np.random.default_rng(42)
    tokens = ["The", "cat", "sat", "down"]
    n, d_model = len(tokens), 8
    embeddings = rng.standard_normal((n, d_model))
    # positional encoding, written out
    pe = np.zeros((n, d_model))
    for pos in range(n):
        for i in range(0, d_model, 2):
            angle = pos / 10000 ** (i / d_model)
            pe[pos, i] = np.sin(angle)
            pe[pos, i + 1] = np.cos(angle)
    x = embeddings + pe
    W_q = rng.standard_normal((d_model, d_model)) * 0.1
    W_k = rng.standard_normal((d_model, d_model)) * 0.1
    W_v = rng.standard_normal((d_model, d_model)) * 0.1
    W_o = rng.standard_normal((d_model, d_model)) * 0.1
    Q, K, V = x @ W_q, x @ W_k, x @ W_v
    scores = Q @ K.T
    scaled = scores / np.sqrt(d_model)
    weights = _np_softmax(scaled)
    output = weights @ V
    # causal: mask the future with -inf before the softmax
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)
    c_weights = _np_softmax(np.where(causal, -np.inf, scaled))
    c_output = c_weights @ V
    # two heads of width 4, concatenated, then W_o
    heads, head_w = [], []
    for h in range(2):
        cols = slice(4 * h, 4 * h + 4)
        w_h = _np_softmax(Q[:, cols] @ K[:, cols].T / np.sqrt(4))
        head_w.append(w_h)
        heads.append(w_h @ V[:, cols])
    mh_output = np.concatenate(heads, axis=-1) @ W_o
    return dict(
        pe=pe,
        x=x,
        W_q=W_q,
        W_k=W_k,
        W_v=W_v,
        W_o=W_o,
        Q=Q,
        K=K,
        V=V,
        scores=scores,
        weights=weights,
        output=output,
        c_weights=c_weights,
        c_output=c_output,
        mh_output=mh_output,
        mh_weights=np.mean(head_w, axis=0),
        head_w=np.stack(head_w),
    )


CAT = _cat_sat_down()


def test_cat_sat_down_walkthrough_is_sane():
    w = CAT["weights"]
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    assert np.all(CAT["c_weights"][np.triu_indices(4, 1)] == 0.0)
    assert CAT["output"].shape == (4, 8) and CAT["mh_output"].shape == (4, 8)


@pytest.mark.parametrize("lib", IMPLS)
def test_cat_sat_down_positional_encoding(lib):
    assert_close(lib.sinusoidal_positional_encoding(4, 8), CAT["pe"], tol=1e-6)


@pytest.mark.parametrize("lib", IMPLS)
def test_cat_sat_down_projections_and_scores(lib):
    c = CAT
    assert_close(lib.matmul(c["x"], c["W_q"]), c["Q"], np.float64)
    assert_close(lib.matmul(c["Q"], c["K"].T), c["scores"], np.float64)
    assert_close(lib.softmax(c["scores"], scale=1 / np.sqrt(8)), c["weights"], np.float64)


@pytest.mark.parametrize("lib", IMPLS)
def test_cat_sat_down_attention(lib):
    c = CAT
    out, w = lib.scaled_dot_product_attention(c["Q"], c["K"], c["V"], return_weights=True)
    assert_close(w, c["weights"], np.float64)
    assert_close(out, c["output"], np.float64)
    out, w = lib.scaled_dot_product_attention(c["Q"], c["K"], c["V"], is_causal=True, return_weights=True)
    assert_close(w, c["c_weights"], np.float64)
    assert_close(out, c["c_output"], np.float64)
    out32 = lib.scaled_dot_product_attention(
        c["Q"].astype(np.float32), c["K"].astype(np.float32), c["V"].astype(np.float32)
    )
    assert_close(out32, c["output"], tol=1e-5)


@pytest.mark.parametrize("lib", IMPLS)
def test_cat_sat_down_multi_head(lib):
    c = CAT
    out, w = lib.multi_head_attention(
        c["x"], c["x"], c["x"], 2, c["W_q"], c["W_k"], c["W_v"], c["W_o"], need_weights=True
    )
    assert_close(out, c["mh_output"], np.float64)
    assert_close(w, c["mh_weights"], np.float64)
    out, w = lib.multi_head_attention(
        c["x"][None],
        c["x"][None],
        c["x"][None],
        2,
        c["W_q"],
        c["W_k"],
        c["W_v"],
        c["W_o"],
        need_weights=True,
        average_attn_weights=False,
    )
    assert_close(out, c["mh_output"][None], np.float64)
    assert_close(w, c["head_w"][None], np.float64)
    out, w = lib.multi_head_attention(c["x"], c["x"], c["x"], 2, c["W_q"], c["W_k"], c["W_v"], c["W_o"])
    assert w is None


def test_cat_sat_down_module():
    c = CAT
    mha = pyattn.MultiHeadAttention(8, 2, dtype=np.float64)
    mha.load_state_dict(
        {
            "in_proj_weight": np.concatenate([c["W_q"].T, c["W_k"].T, c["W_v"].T]),
            "in_proj_bias": np.zeros(24),
            "out_proj.weight": c["W_o"].T,
            "out_proj.bias": np.zeros(8),
        }
    )
    out, w = mha(c["x"], need_weights=True)
    assert_close(out, c["mh_output"], np.float64)
    assert_close(w, c["mh_weights"], np.float64)
    out, w = mha(c["x"][None], c["x"][None], c["x"][None])
    assert w is None
    assert_close(out, c["mh_output"][None], np.float64)


def test_main_walkthrough_and_its_flags(capsys):
    """`python -m pyattn --no-bench` prints the configuration and the walkthrough; --full with
    --no-bench was silently ignored and is now refused (argparse exits 2)."""
    from pyattn.__main__ import main

    main(["--no-bench"])
    printed = capsys.readouterr().out
    assert "isa" in printed and "0.4555" in printed, printed[-2000:]
    with pytest.raises(SystemExit) as e:
        main(["--no-bench", "--full"])
    assert e.value.code == 2
    assert "not allowed" in capsys.readouterr().err
