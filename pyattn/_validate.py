"""Argument checking and normalisation shared by the public functions.

Everything the C++ core receives is prepared here: float32/float64 arrays whose feature axis
has unit stride, element strides, and per-matrix offsets for any leading (batch) axes, with
broadcast axes read at stride 0 and never materialised.
"""

from __future__ import annotations

import functools
import math
import operator
import sys

import numpy as np

F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


def as_array(x, name: str) -> np.ndarray:
    """``np.asarray(x)``; a torch tensor NumPy refuses (bfloat16, requiring grad, off the CPU)
    goes through ``_torch_array``, so every array argument takes torch tensors alike. A NumPy
    masked array with masked entries is refused: np.asarray would drop its mask silently."""
    if type(x) is not np.ndarray and isinstance(x, np.ndarray) and "numpy.ma" in sys.modules:
        ma = sys.modules["numpy.ma"]
        if isinstance(x, ma.MaskedArray) and ma.getmaskarray(x).any():
            raise TypeError(
                f"{name} is a masked array with masked entries, and pyattn reads only its data: "
                f"pass {name}.filled(value), and hide what its mask hid through the function's own mask "
                "arguments (attn_mask, kv_lens, ...)"
            )
    try:
        a = np.asarray(x)
    except (TypeError, RuntimeError, ValueError) as exc:
        if type(x).__module__.split(".")[0] != "torch":
            raise
        return _torch_array(x, name, exc)
    # Read through a view of its own: a shape checked here stays the shape the core is given,
    # though code the call runs later (another argument's __array__ or __float__) reshapes the
    # array in place (x.shape = ...): the caller's, or one its __array__ returned and kept.
    return a.view()


def base_view(a: np.ndarray) -> np.ndarray:
    """A plain-ndarray view of ``a`` (its memory, its real shape and strides: a subclass may
    answer ``shape`` otherwise), whose shape no other code holds to change."""
    return np.ndarray.view(a, np.ndarray)


def dtype_arg(dtype, what: str = "bfloat16") -> np.dtype:
    """np.dtype(dtype) of a ``dtype=`` argument, where the name "bfloat16" means ml_dtypes'
    bfloat16: NumPy knows that name only once ml_dtypes is imported, which pyattn does not do
    (``what``: what the error says needs ml_dtypes, where it is missing)."""
    if isinstance(dtype, str) and dtype.strip() == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{what} needs ml_dtypes (pip install ml_dtypes): NumPy has no bfloat16 of its own"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def is_float_dtype(dt: np.dtype) -> bool:
    """Real floating point of at most 8 bytes, bfloat16 included (ml_dtypes' bfloat16 has kind
    "V"); extended precision (np.longdouble) is not: no argument takes it."""
    return (dt.kind == "f" and dt.itemsize <= 8) or dt.name == "bfloat16"


def float_array(x, name: str) -> np.ndarray:
    """``np.asarray(x)``, refusing anything but real floating point (bfloat16 included)."""
    a = as_array(x, name)
    if a.dtype.kind == "f" and a.dtype.itemsize > 8:
        raise TypeError(f"{name}: dtype {a.dtype} is not supported (use float32 or float64)")
    if not is_float_dtype(a.dtype):
        raise TypeError(f"{name} must be a float32 or float64 array; got dtype {a.dtype}")
    return a


def _torch_array(t, name: str, exc: Exception) -> np.ndarray:
    """A torch tensor that np.asarray refused: a CPU bfloat16 tensor read as ml_dtypes.bfloat16
    (its memory shared, as np.asarray shares a float tensor's), else an error saying why."""
    device = str(getattr(t, "device", "cpu"))
    if device != "cpu":
        raise ValueError(
            f"{name} is a torch tensor on {device}; pyattn computes on the CPU: pass {name}.cpu()"
        ) from exc
    if getattr(t, "requires_grad", False):
        raise TypeError(
            f"{name} is a torch tensor that requires grad; pyattn computes no gradients: pass {name}.detach()"
        ) from exc
    if str(t.dtype) == "torch.bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{name} is a bfloat16 torch tensor: NumPy reads bfloat16 through ml_dtypes (pip install ml_dtypes)"
            ) from exc
        import torch

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    raise TypeError(f"{name}: NumPy cannot read this torch tensor ({exc})") from exc


def is_float64(dt: np.dtype) -> bool:
    """float64 in either byte order (``dt == F64`` is False for ``'>f8'``)."""
    return dt.kind == "f" and dt.itemsize == 8


def compute_dtype(*arrays: np.ndarray) -> np.dtype:
    """NumPy promotion of the inputs; float16 computes (and returns) as float32. float16 with
    bfloat16, which NumPy cannot promote together, computes as float32 too."""
    try:
        dt = np.result_type(*arrays)
    except TypeError:  # numpy's DTypePromotionError (float16 with ml_dtypes' bfloat16)
        return F64 if any(is_float64(a.dtype) for a in arrays) else F32
    return F64 if dt == F64 else F32


def cast(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``a`` as ``dtype``: copied when the type differs, or when the data is not aligned to its
    element size (the core reads whole elements, which such data would make undefined)."""
    if a.dtype == dtype and a.flags.aligned:
        return a
    return a.astype(dtype)


def writable_in_place(a: np.ndarray) -> bool:
    """Whether the core may write ``a`` directly: aligned, with strides of whole elements, no
    element reached twice (through a zero stride, or rows that overlap: its threads would race
    on it, or a row would read what an earlier one wrote; otherwise it writes a temporary that is
    then copied in)."""
    return bool(a.flags.aligned) and not any(s % a.itemsize for s in a.strides) and not may_self_overlap(a)


def writes_in_place(out: np.ndarray, *reads) -> bool:
    """Whether an attention kernel may write its output straight into ``out``: rows of unit
    stride, writable_in_place, and no memory shared with anything the call reads (``None``
    entries are skipped); else the call writes a temporary and copies it in."""
    return out.strides[-1] == out.itemsize and writable_in_place(out) and not overlaps(out, *reads)


def may_self_overlap(a: np.ndarray) -> bool:
    """Whether ``a`` may reach one element through two indices: False when its axes, taken by
    stride, each step past everything the smaller ones span (the sufficient test; a layout that
    fails it without overlapping only costs a temporary). A contiguous array is answered from
    its flags."""
    if a.flags.c_contiguous or a.flags.f_contiguous:
        return False
    span = a.itemsize
    for s, n in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if s < span:
            return True
        span += s * (n - 1)
    return False


def elem_strides(a: np.ndarray) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def strided_ok(a: np.ndarray) -> np.ndarray:
    """A view whose strides are whole elements (copies the rare view that is not)."""
    if any(s % a.itemsize for s in a.strides):
        return np.ascontiguousarray(a)
    return a


def unit_last(a: np.ndarray) -> np.ndarray:
    """A view with unit stride on the last axis (copies only when that axis is strided)."""
    if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        return np.ascontiguousarray(a)
    return strided_ok(a)


def lead_offsets(a: np.ndarray, nlead: int, repeat: int = 1) -> np.ndarray:
    """Element offset of every matrix over the first ``nlead`` axes, in C order (int64, read-only),
    each repeated ``repeat`` times in place along the last of those axes (grouped-query heads)."""
    isz = a.itemsize
    return strided_offsets(a.shape[:nlead], tuple(s // isz for s in a.strides[:nlead]), repeat)


@functools.lru_cache(maxsize=256)
def strided_offsets(shape: tuple, strides: tuple, repeat: int = 1) -> np.ndarray:
    """sum_i index_i * strides[i] over every index of ``shape`` in C order (int64, read-only), each
    repeated ``repeat`` times in place along the last axis. Cached: a model calls attention with
    the same few layouts over and over, and building these took a third of the ~80 us a small
    call spent in Python."""
    off = np.zeros((), np.int64)
    for n, s in zip(shape, strides):
        off = off[..., None] + np.arange(n, dtype=np.int64) * s
    if repeat > 1:
        off = np.repeat(off, repeat, axis=-1)
    off = np.ascontiguousarray(off.reshape(-1))
    off.flags.writeable = False
    return off


def broadcast(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``np.broadcast_to`` that returns ``a`` itself when it already has the shape."""
    return a if a.shape == shape else np.broadcast_to(a, shape)


def broadcast_shapes(*shapes) -> tuple:
    """``np.broadcast_shapes`` for shapes of any rank NumPy allows (its own stops at 32 axes,
    where an array may have 64: the compiled small-call path takes those, so this path must too)."""
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            d = int(d)
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {shapes} are not broadcastable")
                out[i] = d
    return tuple(out)


def broadcast_lead(shapes, names, what: str) -> tuple:
    try:
        return broadcast_shapes(*shapes)
    except ValueError:
        seen = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes))
        raise ValueError(f"{what}: batch dimensions are not broadcastable ({seen})") from None


def check_out(out, shape: tuple, dtype: np.dtype, name: str = "out"):
    """A plain-ndarray view of ``out``, checked (None for None): the call writes through it (and
    reads its shape and strides from it), so code run later in the call (an argument's __array__
    or __float__) reshaping the caller's array does not move what was checked, and a subclass's
    own ``shape`` is not what is checked; the call returns ``out`` itself."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray; got {type(out).__name__}")
    out = base_view(out)
    if out.shape != tuple(shape):
        raise ValueError(f"{name} has shape {out.shape}; expected {tuple(shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} has dtype {out.dtype}; expected {dtype}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return out


def _real(x) -> bool:
    """A real number: a Python or NumPy int or float, or a 0-d array of one (not a bool, a string
    or a complex)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 0 and x.dtype.kind in "iuf"
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def real_float(x, type_error, range_error) -> float:
    """A real number (``_real``) as a Python float: TypeError(type_error()) for anything else,
    ValueError(range_error()) for an int past float64 (OverflowError from float()). The messages
    are functions, formatted only on the way out (scale is read on every call)."""
    if not _real(x):
        raise TypeError(type_error())
    try:
        return float(x)
    except OverflowError:
        raise ValueError(range_error()) from None


def scale_value(scale, E: int) -> float:
    """The score scale as a Python float: ``1/sqrt(E)`` for None; a real number otherwise."""
    if scale is None:
        return 1.0 / math.sqrt(E) if E > 0 else 1.0
    return real_float(
        scale, lambda: f"scale must be a real number; got {scale!r}", lambda: f"scale must fit a float64; got {scale!r}"
    )


def integer_array(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` where its dtype is an integer type. NumPy stores Python ints past the int64 / uint64
    range as objects: an array of ints only is out of range (a ValueError, as any value out of
    range is), or, made as objects on purpose, holds ints that fit and comes back as int64.
    Anything else is a TypeError."""
    if a.dtype.kind in "iu":
        return a
    if a.dtype == object and a.size and all(isinstance(x, (int, np.integer)) and type(x) is not bool for x in a.flat):
        lo, hi = min(a.flat), max(a.flat)
        info = np.iinfo(np.int64)
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name} holds {hi if hi > info.max else lo}, outside the int64 range")
        return a.astype(np.int64)
    raise TypeError(f"{name} must be an integer array; got dtype {a.dtype}")


def int64_values(x, name: str) -> np.ndarray:
    """An integer array as int64, refusing what int64 cannot hold (unsigned values past 2**63 - 1)
    rather than letting the cast wrap them."""
    a = integer_array(as_array(x, name), name)
    if a.dtype.kind == "u" and a.size and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {a.max()}, past the largest int64")
    return a.astype(np.int64)


def overlaps(out: np.ndarray, *inputs) -> bool:
    return any(i is not None and np.may_share_memory(out, i) for i in inputs)


def same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape address exactly the same elements in the same order."""
    return (
        a.shape == b.shape
        and a.strides == b.strides
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def mask_array(mask, name: str, dtype: np.dtype):
    """(kind, array): kind 1 for bool masks (True = may attend), 2 for additive float masks."""
    m = as_array(mask, name)
    if m.dtype == np.bool_:
        return 1, m.view(np.uint8)
    if is_float_dtype(m.dtype):
        return 2, cast(m, dtype)
    raise TypeError(f"{name} must be a bool or float array (float16, bfloat16, float32, float64); got dtype {m.dtype}")


def positive_int(n, name: str) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1; got {n}")
    return int(n)


NO_LIMIT = 1 << 50  # a window side without a bound (csrc/frame/api.h's kNoLimit)


def window_sides(window) -> tuple:
    """``window=(left, right)`` as the core's two sides (``NO_LIMIT`` for None); None is no window."""
    if window is None:
        return NO_LIMIT, NO_LIMIT
    if isinstance(window, (set, frozenset, dict)):  # two sides but no order between them
        raise TypeError(f"window must be an ordered pair (left, right), a tuple or list; got {window!r}")
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= 0 or None; got {window!r}") from None
    sides = []
    for side in (left, right):
        if side is None:
            sides.append(NO_LIMIT)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window sides must be ints >= 0 or None; got {window!r}")
        side = int.__index__(operator.index(side))  # one plain int, checked and then used
        if side < 0:
            raise ValueError(f"window sides must be >= 0 or None; got {window!r}")
        sides.append(min(side, NO_LIMIT))
    return sides[0], sides[1]


def softcap_value(softcap) -> float:
    """``softcap`` as a float > 0, or 0.0 for None (its range in the computation's dtype:
    kernel_factors)."""
    if softcap is None:
        return 0.0
    c = real_float(
        softcap,
        lambda: f"softcap must be a number > 0 or None; got {type(softcap).__name__}",
        lambda: f"softcap must be a finite number > 0; got {softcap!r}",
    )
    if not (0.0 < c < float("inf")):
        raise ValueError(f"softcap must be a finite number > 0; got {softcap!r}")
    return c


def kernel_factors(scale: float, cap: float, dtype: np.dtype) -> None:
    """The kernels fold ``scale * log2(e)`` (over the cap in log2 units, with a softcap) into the
    query and hold the cap in log2 units, in the computation's dtype: a finite scale or a cap whose
    factor overflows there (or a cap that is not a normal number there) would give NaN, so it is
    refused (inf * tanh(0) or inf * 0 would be NaN). A NaN or infinite scale passes (it propagates)."""
    info, log2e = np.finfo(dtype), math.log2(math.e)
    if cap * log2e > float(info.max):
        raise ValueError(
            f"softcap must be at most {float(info.max) / log2e:.4g} in a {np.dtype(dtype).name} computation; "
            f"got {cap!r}"
        )
    if cap > 0 and cap * log2e < float(info.tiny):
        raise ValueError(
            f"softcap must be at least {float(info.tiny) / log2e:.4g} in a {np.dtype(dtype).name} computation; "
            f"got {cap!r}"
        )
    factor = scale * log2e / (cap * log2e if cap > 0 else 1.0)
    if math.isfinite(scale) and not abs(factor) <= float(info.max):
        raise ValueError(
            f"scale {scale!r}{f' over softcap {cap!r}' if cap > 0 else ''} overflows a "
            f"{np.dtype(dtype).name} computation"
        )


def alibi_span(slopes, span: int, dtype: np.dtype) -> None:
    """ALiBi biases reach ``|slope| * span`` (``span`` bounds the query-key distance). The kernels
    track each row's running maximum, bias included, in log2 units in the computation's dtype and
    rescale by powers of two computed from it; past 2**24 (float32; 2**53 in float64) those
    values are no longer exact integers and rows lose all their weight or overflow, so such
    slopes are refused (realistic slopes are at most 1: a float32 call takes slopes up to 11 at a
    million keys)."""
    if slopes is None or span <= 0:
        return
    s = np.abs(np.asarray(slopes, np.float64))
    s = s[np.isfinite(s)]
    if not s.size:
        return
    limit = 2.0 ** (np.finfo(dtype).nmant + 1)
    top = float(s.max())
    if top * span * math.log2(math.e) > limit:
        most = limit / (span * math.log2(math.e))
        raise ValueError(
            f"alibi_slopes holds {top!r}: over {span} key positions its bias passes what a "
            f"{np.dtype(dtype).name} computation holds exactly (|slope| at most {most:.4g} here)"
        )


def per_head(values, name: str, lead: tuple, dtype: np.dtype):
    """A per-(batch, head) quantity (ALiBi slopes, sinks) broadcast to ``lead`` = (..., Hq) and
    flattened in the core's problem order (contiguous, ``dtype``); None stays None."""
    if values is None:
        return None
    a = as_array(values, name)
    if a.dtype.kind not in "iu" and not is_float_dtype(a.dtype):
        raise TypeError(f"{name} must be a float array; got dtype {a.dtype}")
    b = broadcast_named(a, lead, name, "one per query head")
    given = np.asarray(b, np.float64).reshape(-1)
    with np.errstate(over="ignore"):  # finite as given, in the dtype and in log2 units there too
        # A copy (C order, aligned): what is checked here is what the kernel reads, though the
        # caller's array changes later in the call (another argument's __array__, another thread)
        flat = np.array(b, dtype, order="C").reshape(-1)
        past = np.isfinite(given) & ~np.isfinite(flat * flat.dtype.type(math.log2(math.e)))
    if past.any():
        raise ValueError(f"{name} holds {given[past][0]!r}, past what a {np.dtype(dtype).name} computation holds")
    return flat


def broadcast_named(a: np.ndarray, shape: tuple, name: str, what: str) -> np.ndarray:
    """``a`` broadcast to ``shape`` (a size-1 value fits an empty shape), or a ValueError naming it."""
    if not shape and a.size == 1:
        a = a.reshape(())
    try:
        return np.broadcast_to(a, shape)
    except ValueError:
        raise ValueError(f"{name} has shape {a.shape}; expected a shape broadcastable to {shape} ({what})") from None


def key_counts(kv_lens, lead: tuple, Lk: int):
    """``kv_lens`` (keys that exist per batch entry, broadcastable to the axes before the heads)
    as one int64 count per (batch, head) problem; None stays None."""
    if kv_lens is None:
        return None
    # a snapshot: what is checked here is what the kernel reads without the GIL
    a = integer_array(np.array(as_array(kv_lens, "kv_lens")), "kv_lens")
    batch = lead[:-1]
    b = broadcast_named(a, batch, "kv_lens", "the axes before the heads")
    if b.size and (b.min() < 0 or b.max() > Lk):
        raise ValueError(f"kv_lens must be in [0, Lk = {Lk}]; got values from {b.min()} to {b.max()}")
    per_problem = np.broadcast_to(b[..., None], lead) if lead else b  # repeated over the heads
    return np.require(per_problem, np.int64, "CA").reshape(-1)


def check_gqa_heads(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> int:
    """The group size of grouped-query attention (query heads per key/value head), after the
    checks of the heads axes (enable_gqa: the third-from-last axis of each input)."""
    for shape, name in ((q_shape, "query"), (k_shape, "key"), (v_shape, "value")):
        if len(shape) < 3:
            raise ValueError(f"enable_gqa needs a heads axis: {name} must be (..., H, L, E); got {shape}")
    Hq, Hkv = q_shape[-3], k_shape[-3]
    if v_shape[-3] != Hkv:
        raise ValueError(f"value has {v_shape[-3]} heads (shape {v_shape}); expected {Hkv} like key")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(
            f"enable_gqa: query heads ({Hq}, shape {q_shape}) must be a multiple of key/value heads "
            f"({Hkv}, shape {k_shape})"
        )
    return Hq // Hkv
