from contextlib import AbstractContextManager
from typing import Any, Literal, Mapping, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from . import _core as _core
from . import reference as reference

# What the arguments take at run time: NumPy scalars as well as Python ones, a window as a list
_Float = Union[float, np.floating[Any], np.integer[Any]]
_Int = Union[int, np.integer[Any]]
_Bool = Union[bool, np.bool_]
_Window = Union[Tuple[Optional[_Int], Optional[_Int]], Sequence[Optional[_Int]]]

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

__version__: str

@overload
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[NDArray[Any]] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> NDArray[np.floating]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[True],
    return_lse: Literal[False] = ...,
    out: Optional[NDArray[Any]] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    out: Optional[NDArray[Any]] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[True],
    return_lse: Literal[True],
    out: Optional[NDArray[Any]] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: bool = ...,
    return_lse: bool = ...,
    out: Optional[NDArray[Any]] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Union[NDArray[np.floating], Tuple[NDArray[np.floating], ...]]: ...
def merge_attention_states(
    outputs: Union[ArrayLike, Sequence[ArrayLike]],
    lses: Union[ArrayLike, Sequence[ArrayLike]],
    *,
    out: Optional[NDArray[Any]] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def kvcache_attention(
    query: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    cache_lens: ArrayLike,
    *,
    k_new: Optional[ArrayLike] = ...,
    v_new: Optional[ArrayLike] = ...,
    block_table: Optional[ArrayLike] = ...,
    k_scale: Optional[ArrayLike] = ...,
    v_scale: Optional[ArrayLike] = ...,
    scale: Optional[_Float] = ...,
    is_causal: _Bool = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[NDArray[Any]] = ...,
) -> NDArray[np.floating]: ...
@overload
def kvcache_attention(
    query: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    cache_lens: ArrayLike,
    *,
    k_new: Optional[ArrayLike] = ...,
    v_new: Optional[ArrayLike] = ...,
    block_table: Optional[ArrayLike] = ...,
    k_scale: Optional[ArrayLike] = ...,
    v_scale: Optional[ArrayLike] = ...,
    scale: Optional[_Float] = ...,
    is_causal: _Bool = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: Literal[True],
    out: Optional[NDArray[Any]] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def kvcache_attention(
    query: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    cache_lens: ArrayLike,
    *,
    k_new: Optional[ArrayLike] = ...,
    v_new: Optional[ArrayLike] = ...,
    block_table: Optional[ArrayLike] = ...,
    k_scale: Optional[ArrayLike] = ...,
    v_scale: Optional[ArrayLike] = ...,
    scale: Optional[_Float] = ...,
    is_causal: _Bool = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: bool = ...,
    out: Optional[NDArray[Any]] = ...,
) -> Union[NDArray[np.floating], Tuple[NDArray[np.floating], NDArray[np.floating]]]: ...

class KVCache:
    batch: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    max_len: Optional[int]
    block_size: Optional[int]
    dtype: np.dtype
    k: NDArray[Any]
    v: NDArray[Any]
    k_scale: Optional[NDArray[np.float32]]
    v_scale: Optional[NDArray[np.float32]]
    block_table: Optional[NDArray[np.int32]]
    def __init__(
        self,
        batch: _Int,
        num_kv_heads: _Int,
        head_dim: _Int,
        *,
        v_head_dim: Optional[_Int] = ...,
        max_len: Optional[_Int] = ...,
        block_size: Optional[_Int] = ...,
        dtype: Any = ...,
    ) -> None: ...
    @property
    def lens(self) -> NDArray[np.int64]: ...
    @property
    def nbytes(self) -> int: ...
    def reset(self, rows: Optional[ArrayLike] = ...) -> None: ...
    def attend(
        self,
        query: ArrayLike,
        k_new: Optional[ArrayLike],
        v_new: Optional[ArrayLike],
        *,
        new_lens: Optional[ArrayLike] = ...,
        **variants: Any,
    ) -> Any: ...

@overload
def varlen_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    is_causal: _Bool = ...,
    scale: Optional[_Float] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: Literal[False] = ...,
    out: Optional[NDArray[Any]] = ...,
) -> NDArray[np.floating]: ...
@overload
def varlen_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    is_causal: _Bool = ...,
    scale: Optional[_Float] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: Literal[True],
    out: Optional[NDArray[Any]] = ...,
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def varlen_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    is_causal: _Bool = ...,
    scale: Optional[_Float] = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    return_lse: bool = ...,
    out: Optional[NDArray[Any]] = ...,
) -> Union[NDArray[np.floating], Tuple[NDArray[np.floating], NDArray[np.floating]]]: ...
def multi_head_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    num_heads: _Int,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    b_q: Optional[ArrayLike] = ...,
    b_k: Optional[ArrayLike] = ...,
    b_v: Optional[ArrayLike] = ...,
    b_o: Optional[ArrayLike] = ...,
    *,
    num_kv_heads: Optional[_Int] = ...,
    attn_mask: Optional[ArrayLike] = ...,
    key_padding_mask: Optional[ArrayLike] = ...,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    need_weights: bool = ...,
    average_attn_weights: bool = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Tuple[NDArray[np.floating], Optional[NDArray[np.floating]]]: ...

class MultiHeadAttention:
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    kdim: int
    vdim: int
    head_dim: int
    bias: bool
    dtype: np.dtype
    w_q: NDArray[np.floating]
    w_k: NDArray[np.floating]
    w_v: NDArray[np.floating]
    w_o: NDArray[np.floating]
    b_q: Optional[NDArray[np.floating]]
    b_k: Optional[NDArray[np.floating]]
    b_v: Optional[NDArray[np.floating]]
    b_o: Optional[NDArray[np.floating]]
    def __init__(
        self,
        embed_dim: _Int,
        num_heads: _Int,
        *,
        num_kv_heads: Optional[_Int] = ...,
        kdim: Optional[_Int] = ...,
        vdim: Optional[_Int] = ...,
        bias: bool = ...,
        dtype: DTypeLike = ...,
        rng: Any = ...,
    ) -> None: ...
    def __call__(
        self,
        query: ArrayLike,
        key: Optional[ArrayLike] = ...,
        value: Optional[ArrayLike] = ...,
        *,
        attn_mask: Optional[ArrayLike] = ...,
        key_padding_mask: Optional[ArrayLike] = ...,
        is_causal: _Bool = ...,
        need_weights: bool = ...,
        average_attn_weights: bool = ...,
        window: Optional[_Window] = ...,
        softcap: Optional[_Float] = ...,
        alibi_slopes: Optional[ArrayLike] = ...,
        sinks: Optional[ArrayLike] = ...,
        kv_lens: Optional[ArrayLike] = ...,
    ) -> Tuple[NDArray[np.floating], Optional[NDArray[np.floating]]]: ...
    def state_dict(self) -> dict[str, NDArray[np.floating]]: ...
    def load_state_dict(self, mapping: Mapping[str, ArrayLike]) -> None: ...
    def num_parameters(self) -> int: ...

def softmax(
    x: ArrayLike,
    axis: _Int = ...,
    *,
    scale: Optional[_Float] = ...,
    mask: Optional[ArrayLike] = ...,
    out: Optional[NDArray[Any]] = ...,
) -> NDArray[np.floating]: ...

# (1-D @ 1-D gives a NumPy scalar, as np.matmul does)
def matmul(
    a: ArrayLike, b: ArrayLike, *, out: Optional[NDArray[Any]] = ...
) -> Union[NDArray[np.floating], np.floating]: ...
def sinusoidal_positional_encoding(
    num_positions: _Int, d_model: _Int, *, base: _Float = ..., dtype: DTypeLike = ...
) -> NDArray[np.floating]: ...
@overload
def additive_attention(
    query: ArrayLike,
    keys: ArrayLike,
    w_query: ArrayLike,
    w_keys: ArrayLike,
    v: ArrayLike,
    *,
    values: Optional[ArrayLike] = ...,
    mask: Optional[ArrayLike] = ...,
    return_weights: Literal[False] = ...,
) -> NDArray[np.floating]: ...
@overload
def additive_attention(
    query: ArrayLike,
    keys: ArrayLike,
    w_query: ArrayLike,
    w_keys: ArrayLike,
    v: ArrayLike,
    *,
    values: Optional[ArrayLike] = ...,
    mask: Optional[ArrayLike] = ...,
    return_weights: Literal[True],
) -> Tuple[NDArray[np.floating], NDArray[np.floating]]: ...
@overload
def additive_attention(
    query: ArrayLike,
    keys: ArrayLike,
    w_query: ArrayLike,
    w_keys: ArrayLike,
    v: ArrayLike,
    *,
    values: Optional[ArrayLike] = ...,
    mask: Optional[ArrayLike] = ...,
    return_weights: bool = ...,
) -> Union[NDArray[np.floating], Tuple[NDArray[np.floating], NDArray[np.floating]]]: ...
def set_num_threads(n: _Int) -> None: ...
def get_num_threads() -> int: ...
def num_threads(n: _Int) -> AbstractContextManager[int]: ...
def show_config(*, file: Any = ...) -> dict[str, Any]: ...
