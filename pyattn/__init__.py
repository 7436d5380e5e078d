"""pyattn: fast exact scaled dot-product attention for CPU inference, NumPy in and out.

The compute runs in a C++17 core (``pyattn._core``): a packed, cache-blocked, OpenMP-parallel
GEMM with per-ISA SIMD micro-kernels (AVX-512, AVX2+FMA, portable) chosen at import, a fused
softmax, and a flash-style fused attention kernel. ``pyattn.reference`` holds the same
functions in plain NumPy (float64), the oracle of the tests.
"""

from __future__ import annotations


def _refuse_subinterpreters():
    """ImportError in a sub-interpreter: the pybind11 core's initialisation takes the GIL through
    the PyGILState API, which a sub-interpreter's thread does not own, and waited there for ever."""
    import sys

    for name in ("_interpreters", "_xxsubinterpreters"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except ImportError:
                continue
        try:
            cur, main = mod.get_current(), mod.get_main()
        except Exception:  # an API this version does not have: assume the main interpreter
            return
        cur, main = (x[0] if isinstance(x, tuple) else x for x in (cur, main))
        if cur != main:
            raise ImportError(
                "pyattn cannot be imported in a sub-interpreter (its compiled core supports only the main one)"
            )
        return


_refuse_subinterpreters()


def _load_core():
    """Import the compiled core. From a source checkout (``python -m pyattn`` in the repository
    root after ``pip install .``) the local ``pyattn/`` has no extension; the installed build's
    is then used alongside these sources."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module("._core", __name__)
    except ImportError:
        here = os.path.dirname(os.path.abspath(__file__))
        for entry in sys.path:
            cand = os.path.join(os.path.abspath(entry or os.getcwd()), __name__)
            if os.path.abspath(cand) == here or not os.path.isdir(cand):
                continue
            if any(f.startswith("_core.") and f.endswith((".so", ".pyd")) for f in os.listdir(cand)):
                __path__.append(cand)
                return importlib.import_module("._core", __name__)
        raise


_core = _load_core()

from ._api import (
    get_num_threads,
    matmul,
    num_threads,
    scaled_dot_product_attention,
    set_num_threads,
    show_config,
    softmax,
)
from ._kvcache import KVCache, kvcache_attention, varlen_attention
from ._merge import merge_attention_states
from ._nn import (
    MultiHeadAttention,
    additive_attention,
    multi_head_attention,
    sinusoidal_positional_encoding,
)

try:
    from importlib.metadata import version as _version

    __version__ = _version("pyattn")
except Exception:  # pragma: no cover - running from a source tree without metadata
    __version__ = getattr(_core, "__version__", "0.0.0")

__all__ = [
    "scaled_dot_product_attention",
    "merge_attention_states",
    "kvcache_attention",
    "KVCache",
    "varlen_attention",
    "multi_head_attention",
    "MultiHeadAttention",
    "softmax",
    "matmul",
    "sinusoidal_positional_encoding",
    "additive_attention",
    "set_num_threads",
    "get_num_threads",
    "num_threads",
    "show_config",
    "reference",
]


def __getattr__(name):
    if name == "reference":  # imported on first use: plain NumPy, not needed by the fast path
        import importlib

        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'pyattn' has no attribute {name!r}")
