"""pyattn as an attention implementation of Hugging Face ``transformers`` (CPU inference).

    import pyattn.integrations.transformers as pt
    pt.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="pyattn")

``register()`` adds two functions under the name ``"pyattn"``:

- to ``AttentionInterface``, the attention itself (:func:`attention_forward`): the query
  ``(B, Hq, Lq, D)`` and the key/value ``(B, Hkv, Lk, D)`` the model hands over (grouped-query
  heads are not repeated) are viewed as NumPy arrays without a copy and computed by
  :func:`pyattn.scaled_dot_product_attention`, which writes straight into the ``(B, Lq, Hq, D)``
  tensor the model expects. The model's ``scaling``, ``softcap`` (Gemma 2) and sinks (gpt-oss's
  ``s_aux`` per head; a ``sinks`` keyword per head or per head and query row, as Inkling2's) are
  passed through.
- to ``AttentionMaskInterface``, the mask (:func:`mask_function`). Without it transformers would
  hand the attention no mask at all and padding would be lost. It does not build the dense
  ``(B, 1, Lq, Lk)`` mask the other backends get: it recognises transformers' causal, sliding
  window and bidirectional patterns and returns a :class:`PyattnMask` holding what pyattn fuses
  in its kernels, the causal flag and its alignment, the window ``(left, right)``, and the
  padding as ``kv_lens`` (padding on the right) or a ``(B, 1, 1, Lk)`` key mask (on the left).
  So a sliding-window layer costs O(L x window) and a decode step reads only the cache. Any
  other pattern (packed sequences, chunked or block-wise attention, custom mask functions) gets
  the exact dense boolean mask, built by transformers' own ``sdpa_mask``.

Inference only: a dropout probability above zero (a model in training mode) raises
``ValueError``, tensors off the CPU raise ``ValueError``, and the output of a call made with
gradients enabled raises ``RuntimeError`` if anything tries to backpropagate through it.
float32 and float64 models compute in their dtype; float16 and bfloat16 models compute in
float32 with the keys and values read as they are (bfloat16 through ``ml_dtypes``), and the
output is cast back.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

import pyattn

try:
    import torch
    import transformers  # noqa: F401  (an ImportError here names what is missing)
    from transformers import masking_utils as _mu
    from transformers.modeling_utils import AttentionInterface
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "pyattn.integrations.transformers needs torch and transformers: pip install torch transformers "
        "(pyattn's 'transformers' extra: pip install '.[transformers]' in a checkout)"
    ) from exc

try:
    import ml_dtypes as _ml_dtypes
except ImportError:  # bfloat16 K/V are then upcast to float32 (a copy)
    _ml_dtypes = None

__all__ = ["NAME", "PyattnMask", "attention_forward", "mask_function", "register", "is_registered"]

NAME = "pyattn"


# ------------------------------------------------------------------------------------------ mask


_NOT_THROUGH_INTERFACE = (
    f"this model does torch operations on the attention mask that attn_implementation={NAME!r} hands it "
    "(it computes its attention itself, or changes the mask before it calls transformers' "
    "AttentionInterface), and that mask holds pyattn's fused keywords, not a tensor: load the model "
    "with attn_implementation='eager' (or 'sdpa' where the model supports it)"
)


class _NotThroughInterface(TypeError, AttributeError):
    """A tensor attribute asked of a PyattnMask: a TypeError saying why, and an AttributeError
    too, so that hasattr() and getattr() with a default still answer as for any object."""


class PyattnMask:
    """What :func:`mask_function` hands :func:`attention_forward`: the keywords of one
    :func:`pyattn.scaled_dot_product_attention` call that reproduce transformers' mask.

    ``attn_mask`` is a NumPy bool array (True = may attend) broadcastable to ``(B, 1, Lq, Lk)``
    or None; ``is_causal``, ``causal_align``, ``window`` and ``kv_lens`` are pyattn's keywords.
    ``dense`` says that ``attn_mask`` is the whole ``(B, 1, Lq, Lk)`` mask (a pattern pyattn
    cannot express with its flags). ``shape`` is the mask's logical shape ``(B, 1, Lq, Lk)``.
    """

    __slots__ = ("shape", "attn_mask", "is_causal", "causal_align", "window", "kv_lens", "dense")

    def __init__(
        self, shape, attn_mask=None, *, is_causal=False, causal_align="top_left", window=None, kv_lens=None, dense=False
    ):
        self.shape = tuple(int(s) for s in shape)
        self.attn_mask = attn_mask
        self.is_causal = bool(is_causal)
        self.causal_align = causal_align
        self.window = window
        self.kv_lens = kv_lens
        self.dense = bool(dense)

    @property
    def ndim(self) -> int:
        return 4

    # A model whose attention layers compute the attention themselves, not through
    # AttentionInterface (Bloom, for one), still gets this mask from transformers and does
    # torch arithmetic on it: every torch function and operator given one says why, instead of
    # "unsupported operand type(s) for +: 'Tensor' and 'PyattnMask'".
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(_NOT_THROUGH_INTERFACE)

    def _refuse(self, *_):
        raise TypeError(_NOT_THROUGH_INTERFACE)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _refuse
    __invert__ = __neg__ = __getitem__ = _refuse

    # ... and a tensor's methods and attributes (MPT's mask.to(...), XGLM's mask.size()), which
    # fell through to "'PyattnMask' object has no attribute 'to'"
    def __getattr__(self, name):
        if name.startswith("__") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise _NotThroughInterface(_NOT_THROUGH_INTERFACE)

    def keywords(self) -> dict:
        return {
            "attn_mask": self.attn_mask,
            "is_causal": self.is_causal,
            "causal_align": self.causal_align,
            "window": self.window,
            "kv_lens": self.kv_lens,
        }

    def to_bool(self) -> np.ndarray:
        """The mask as a dense ``(B, 1, Lq, Lk)`` bool array (True = may attend): for reading
        and debugging; the attention never builds it."""
        B, _, Lq, Lk = self.shape
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        lens = np.full(B, Lk) if self.kv_lens is None else np.broadcast_to(self.kv_lens, (B,))
        off = np.zeros(B, np.int64) if self.causal_align == "top_left" else (lens - Lq)
        out = np.ones((B, 1, Lq, Lk), bool)
        for b in range(B):
            ok = j < lens[b]
            if self.is_causal:
                ok = ok & (j <= i + off[b])
            if self.window is not None:
                left, right = self.window
                if left is not None:
                    ok = ok & (j >= i + off[b] - left)
                if right is not None:
                    ok = ok & (j <= i + off[b] + right)
            out[b, 0] = ok
        if self.attn_mask is not None:
            out &= np.broadcast_to(self.attn_mask, out.shape)
        return out

    def __repr__(self) -> str:
        pad = None if self.attn_mask is None else tuple(self.attn_mask.shape)
        return (
            f"PyattnMask(shape={self.shape}, is_causal={self.is_causal}, causal_align={self.causal_align!r}, "
            f"window={self.window}, kv_lens={None if self.kv_lens is None else self.kv_lens.tolist()}, "
            f"attn_mask={pad}, dense={self.dense})"
        )


def _closure_vars(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells)))


# The code objects of transformers' pattern closures, taken from the installed version: a mask
# function is recognised by its code and the values it closes over, never by its name.
_AND_CODE = _mu.and_masks(_mu.causal_mask_function).__code__
_SLIDING_CODE = _mu.sliding_window_overlay(1).__code__
_SLIDING_BIDI_CODE = getattr(_mu, "sliding_window_bidirectional_overlay", lambda w: None)(1)
_SLIDING_BIDI_CODE = getattr(_SLIDING_BIDI_CODE, "__code__", None)


def _pattern(fn) -> Optional[Tuple[bool, Optional[int]]]:
    """(causal, sliding_window or None) for transformers' standard mask functions, else None."""
    if fn is _mu.causal_mask_function:
        return True, None
    if fn is _mu.bidirectional_mask_function:
        return False, None
    if getattr(fn, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure_vars(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    overlay, base = parts
    code = getattr(overlay, "__code__", None)
    window = _closure_vars(overlay).get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    if base is _mu.causal_mask_function and code is _SLIDING_CODE:
        return True, window
    if base is _mu.bidirectional_mask_function and code is not None and code is _SLIDING_BIDI_CODE:
        return False, window
    return None


_VERIFIED: dict = {}


def _window_sides(causal: bool, window: Optional[int], keyword: bool = False):
    """pyattn's ``window=(left, right)`` for transformers' sliding patterns: the causal overlay
    keeps ``kv > q - W`` (the token and the W - 1 before it), the bidirectional one
    ``|q - kv| <= W``. ``keyword``: W is the ``sliding_window`` keyword a model passes to its
    attention function, which transformers reads as flash-attention's ``window_size``: ``(W - 1,
    W - 1)`` bidirectional (models that pass both, as ModernBERT, pass the overlay's W plus one)."""
    if window is None:
        return None
    if causal:
        return (window - 1, 0)
    return (window - 1, window - 1) if keyword else (window, window)


def _verified(fn, causal: bool, window: Optional[int]) -> bool:
    """Whether ``fn`` gives exactly the pattern (causal, window) says, checked once per pattern
    on the index pairs around the window's edges: guards the recognition against a release of
    transformers that changed what an overlay means while keeping its code."""
    key = (causal, window)
    if key not in _VERIFIED:
        w = window or 4
        pts = sorted({p for c in (0, 1, 2, w - 1, w, w + 1, 2 * w, 2 * w + 1) for p in (c - 1, c, c + 1) if p >= 0})
        idx = torch.tensor(pts)
        q, kv = idx[:, None], idx[None, :]
        zero = torch.zeros((), dtype=torch.long)
        try:
            got = fn(zero, zero, q, kv).expand(len(pts), len(pts))
        except Exception:  # an index-based function we cannot evaluate this way: not ours
            _VERIFIED[key] = False
            return False
        ok = torch.ones_like(got)
        if causal:
            ok &= kv <= q
        if window is not None:
            left, right = _window_sides(causal, window)
            ok &= (kv >= q - left) & (kv <= q + right)
        _VERIFIED[key] = bool(torch.equal(got.to(torch.bool), ok))
    return _VERIFIED[key]


def _numpy(t: "torch.Tensor") -> np.ndarray:
    """A CPU tensor as a NumPy array sharing its memory (bfloat16 through ml_dtypes, or upcast
    to float32 where ml_dtypes is missing)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        if _ml_dtypes is None:
            return t.float().numpy()
        return t.view(torch.int16).numpy().view(_ml_dtypes.bfloat16)
    return t.numpy()


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=_mu.causal_mask_function,
    attention_mask: Optional["torch.Tensor"] = None,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
) -> PyattnMask:
    """transformers' ``AttentionMaskInterface`` entry for ``"pyattn"``: the mask of ``mask_function``
    over queries ``q_offset + [0, q_length)`` and keys ``kv_offset + [0, kv_length)``, with the
    2-D padding ``attention_mask`` (True = a real token), as a :class:`PyattnMask`."""
    if isinstance(attention_mask, PyattnMask):
        # generate() builds the masks ahead with a static cache and hands them back to the model
        return attention_mask
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"pyattn attention runs on the CPU: the mask is asked for on device {device}; move the model to the CPU "
            "(model.to('cpu')) or use another attn_implementation on this device"
        )
    q_offset = int(q_offset)  # a 0-d tensor with static caches
    kv_offset = int(kv_offset)
    B, Lq, Lk = int(batch_size), int(q_length), int(kv_length)
    padding = _mu.prepare_padding_mask(attention_mask, Lk, kv_offset)
    pattern = _pattern(mask_function)
    if pattern is not None and not _verified(mask_function, *pattern):
        pattern = None
    if pattern is not None:
        fused = _fused(pattern, B, Lq, Lk, q_offset - kv_offset, padding, kv_offset)
        if fused is not None:
            return fused
    dense = _mu.sdpa_mask(
        batch_size=B,
        q_length=Lq,
        kv_length=Lk,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    return PyattnMask((B, 1, Lq, Lk), _numpy(dense.to(torch.bool)), dense=True)


def _fused(pattern, B: int, Lq: int, Lk: int, shift: int, padding, kv_offset: int) -> Optional[PyattnMask]:
    """The pattern as pyattn's flags, or None where they cannot express it. ``shift`` is the
    absolute position of query 0 minus that of key 0: query i sees key j <= i + shift."""
    causal, sliding = pattern
    shape = (B, 1, Lq, Lk)
    lengths = None  # right padding: the keys that exist per row
    key_mask = None  # any other padding: (B, 1, 1, Lk), True = a real token
    if padding is not None:
        pad = padding[:, kv_offset : kv_offset + Lk].to(torch.bool)
        if not bool(pad.all()):
            n = pad.sum(dim=1)
            if torch.equal(pad, torch.arange(Lk, device=pad.device)[None, :] < n[:, None]):
                lengths = n.cpu().numpy().astype(np.int64)
            else:
                key_mask = _numpy(pad.cpu())[:, None, None, :]
    window = _window_sides(causal, sliding)
    if window is not None:
        # A window that hides no key is left out (a decode step against a sliding cache, a
        # prompt shorter than the window), so that the call takes pyattn's plain path. Query i
        # sees keys from i + shift - left to i + shift + right.
        left, right = window
        cuts = Lq - 1 + shift - left > 0 or (not causal and shift + right < Lk - 1)
        window = window if cuts else None
    if shift == 0:
        # top_left: kv_lens only hides keys, the alignment does not move
        return PyattnMask(shape, key_mask, is_causal=causal, causal_align="top_left", window=window, kv_lens=lengths)
    if not causal and window is None:  # no position-dependent part: the offsets do not matter
        return PyattnMask(shape, key_mask, kv_lens=lengths)
    if lengths is not None and not (causal and shift + Lq <= lengths.min()):
        # kv_lens would move bottom_right's alignment: the padding as a key mask, unless it lies
        # wholly past the last query (a StaticCache's empty slots), where causality hides it
        key_mask = (np.arange(Lk)[None, :] < lengths[:, None])[:, None, None, :]
    if shift == Lk - Lq:
        return PyattnMask(shape, key_mask, is_causal=causal, causal_align="bottom_right", window=window)
    if causal and 0 <= shift + Lq <= Lk:
        # a cache longer than what it holds (StaticCache): the keys past the last query are
        # hidden by causality anyway, so kv_lens = shift + Lq aligns bottom_right on the last one
        lens = np.full(B, shift + Lq, np.int64)
        return PyattnMask(shape, key_mask, is_causal=True, causal_align="bottom_right", window=window, kv_lens=lens)
    return None


# ------------------------------------------------------------------------------------- attention


class _NoBackward(torch.autograd.Function):
    """Carries pyattn's output into the autograd graph so that a backward pass through it fails
    loudly instead of silently treating attention as a constant."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "pyattn's transformers attention is for inference: it has no backward pass. Run the model "
            "under torch.no_grad() / torch.inference_mode(), or train with attn_implementation='sdpa'."
        )


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"pyattn attention: {name} must be a torch.Tensor; got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(
            f"pyattn attention runs on the CPU: {name} is on device {t.device}; move the model to the CPU "
            "(model.to('cpu')) or use another attn_implementation on this device"
        )
    if not t.dtype.is_floating_point:
        raise TypeError(f"pyattn attention: {name} must be a floating-point tensor; got {t.dtype}")


def attention_forward(
    module,
    query: "torch.Tensor",
    key: "torch.Tensor",
    value: "torch.Tensor",
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional["torch.Tensor"] = None,
    **kwargs,
):
    """transformers' ``AttentionInterface`` entry for ``"pyattn"``.

    query ``(B, Hq, Lq, D)``, key ``(B, Hkv, Lk, D)``, value ``(B, Hkv, Lk, Dv)`` with Hq a
    multiple of Hkv; ``attention_mask`` a :class:`PyattnMask`, a 4-D bool or additive float
    tensor (taken as the whole mask, as ``sdpa`` does), or None (then causality comes from
    ``is_causal`` or ``module.is_causal``, aligned bottom-right, and a ``sliding_window`` from the
    model is applied as the window). Returns ``(output (B, Lq, Hq, Dv) contiguous, weights or
    None)``; the weights ``(B, Hq, Lq, Lk)`` only when ``output_attentions`` is asked for.
    """
    if dropout:
        raise ValueError(
            f"pyattn attention has no dropout: got dropout={dropout} (the module is in training mode?); "
            "call model.eval() for inference, or use another attn_implementation to train"
        )
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, name)
        if t.ndim != 4:
            raise ValueError(f"pyattn attention: {name} must be (B, H, L, D); got shape {tuple(t.shape)}")
    B, Hq, Lq, _ = query.shape
    Bk, Hkv, Lk, _ = key.shape
    Dv = value.shape[-1]
    if Bk != B or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"pyattn attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must share the batch, and key and value the heads and length"
        )

    kw = {}
    if isinstance(attention_mask, PyattnMask):
        if attention_mask.shape[0] not in (1, B) or attention_mask.shape[2:] != (Lq, Lk):
            raise ValueError(
                f"pyattn attention: the mask was made for (B, 1, Lq, Lk) = {attention_mask.shape}, but the "
                f"query is {tuple(query.shape)} and the key {tuple(key.shape)}"
            )
        kw.update(attention_mask.keywords())
    elif attention_mask is not None:  # a mask the caller built: the whole mask, as sdpa takes it
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 4:
            raise TypeError(
                "pyattn attention: attention_mask must be a PyattnMask, a 4-D torch.Tensor (bool, True = may "
                f"attend, or float, added) or None; got {type(attention_mask).__name__} of shape "
                f"{tuple(getattr(attention_mask, 'shape', ()))}"
            )
        if attention_mask.dtype != torch.bool:
            _check_tensor(attention_mask, "attention_mask")
        elif attention_mask.device.type != "cpu":
            raise ValueError(f"pyattn attention runs on the CPU: attention_mask is on device {attention_mask.device}")
        m = attention_mask.detach()
        if m.dtype not in (torch.bool, torch.float32, torch.float64):
            m = m.float()
        kw["attn_mask"] = m.numpy()
    else:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        kw["is_causal"] = bool(causal)
        kw["causal_align"] = "bottom_right"
        if sliding_window is not None:
            kw["window"] = _window_sides(bool(causal), int(sliding_window), keyword=True)
    dt = query.dtype
    compute = dt if dt in (torch.float32, torch.float64) else torch.float32
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # T5-style learned bias: added to the scores like a float mask
        bias = position_bias.detach().to(compute).numpy()  # (a float64 model's in float64)
        m = kw.get("attn_mask")
        if m is not None and m.dtype == np.bool_:
            bias = np.where(m, bias, bias.dtype.type(-np.inf))
        elif m is not None:
            bias = bias + m
        kw["attn_mask"] = bias

    q = _numpy(query if dt == compute else query.to(compute))
    if key.dtype == dt and dt in (torch.float16, torch.bfloat16) and compute == torch.float32:
        k, v = _numpy(key), _numpy(value)  # read as they are by the kernels
    else:
        k = _numpy(key if key.dtype == compute else key.to(compute))
        v = _numpy(value if value.dtype == compute else value.to(compute))
    if s_aux is not None:
        kw["sinks"] = s_aux.detach().to(compute).cpu().numpy()
    row_sinks = _row_sinks(kwargs.get("sinks"), s_aux, (B, Hq, Lq), compute, kw)
    if softcap is not None:
        kw["softcap"] = float(softcap)

    want_weights = bool(kwargs.get("output_attentions", False))
    scale = None if scaling is None else float(scaling)
    want_lse = row_sinks is not None
    if Lq == 1 and not want_weights:
        # A decode step: (B, Hq, 1, Dv) is already laid out as (B, 1, Hq, Dv), and without out=
        # pyattn's small-call path in C serves the call (no padding, no variant)
        res = pyattn.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=Hq != Hkv, return_lse=want_lse, **kw)
        res, lse = res if want_lse else (res, None)
        out_t, weights = torch.from_numpy(res).transpose(1, 2), None
    else:
        out_t = torch.empty((B, Lq, Hq, Dv), dtype=compute)
        res = pyattn.scaled_dot_product_attention(
            q,
            k,
            v,
            scale=scale,
            enable_gqa=Hq != Hkv,
            return_weights=want_weights,
            return_lse=want_lse,
            out=out_t.numpy().transpose(0, 2, 1, 3),  # (B, Hq, Lq, Dv) view: written in place, no copy
            **kw,
        )
        weights = torch.from_numpy(res[1]) if want_weights else None
        lse = res[-1] if want_lse else None
    if want_lse:  # per-row sinks: each row's share of the softmax that its sink leaves
        f = torch.from_numpy(_sink_factor(lse, row_sinks))  # (B, Hq, Lq)
        out_t.mul_(f.transpose(1, 2)[..., None])
        if weights is not None:
            weights.mul_(f[..., None])
    if compute != dt:
        out_t = out_t.to(dt)
        weights = weights.to(dt) if weights is not None else None
    # Every tensor the output depends on: the sinks, a learned position bias or a float mask may
    # be trained while the projections are frozen (the tie was on query, key and value only, and
    # a backward pass then left the sinks without a gradient instead of raising)
    inputs = [query, key, value, s_aux, kwargs.get("sinks"), position_bias, attention_mask]
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if torch.is_grad_enabled() and inputs:
        out_t = _NoBackward.apply(out_t, *inputs)
    return out_t, weights


def _row_sinks(sinks, s_aux, shape: tuple, compute, kw: dict) -> Optional[np.ndarray]:
    """A ``sinks`` keyword (Inkling2: one sink logit per head and query row, ``(B, Hq, Lq, 1)``;
    gpt-oss passes its per-head sinks as ``s_aux``): per head, it goes to pyattn's ``sinks`` (in
    ``kw``); per row, it is returned as a ``(B, Hq, Lq)`` array for :func:`_sink_factor`."""
    if sinks is None:
        return None
    if s_aux is not None:
        raise ValueError("pyattn attention: got both s_aux and sinks; a model passes its sinks as one of them")
    _check_tensor(sinks, "sinks")
    t = sinks.detach().to(compute).cpu()
    if t.ndim <= 1:  # one per head, as s_aux
        kw["sinks"] = t.numpy()
        return None
    B, Hq, Lq = shape
    bad = ValueError(
        f"pyattn attention: sinks has shape {tuple(sinks.shape)}; expected one per head (Hq,) = ({Hq},) "
        f"or one per head and query row, broadcastable to (B, Hq, Lq, 1) = {(B, Hq, Lq, 1)}"
    )
    if t.ndim != 4 or t.shape[-1] != 1:  # (B, Hq) would right-align as (Hq, Lq): refused
        raise bad
    try:
        return np.ascontiguousarray(np.broadcast_to(t[..., 0].numpy(), shape))
    except ValueError:
        raise bad from None


def _sink_factor(lse: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """A sink logit z beside a row's keys: softmax over (scores, z) drops the sink's share, so
    the row's output and weights are those without it times sum / (sum + e^z) = sigmoid(lse - z).
    A row that sees no key (lse -inf) stays zeros whatever its sink, -inf included, as pyattn's
    own sinks leave it (eager's softmax over only -inf logits gives NaN there)."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = 1.0 / (1.0 + np.exp(sinks - lse))
    return np.where(np.isneginf(lse), 0.0, f).astype(lse.dtype, copy=False)


# -------------------------------------------------------------------------------------- register


def register(name: str = NAME) -> None:
    """Register pyattn in transformers' ``AttentionInterface`` and ``AttentionMaskInterface``
    under ``name`` (default ``"pyattn"``), so that ``attn_implementation=name`` uses it.
    Calling it again is harmless."""
    AttentionInterface.register(name, attention_forward)
    _mu.AttentionMaskInterface.register(name, mask_function)


def is_registered(name: str = NAME) -> bool:
    """Whether both registries map ``name`` to pyattn's functions."""
    return (
        AttentionInterface._global_mapping.get(name) is attention_forward
        and _mu.AttentionMaskInterface._global_mapping.get(name) is mask_function
    )
