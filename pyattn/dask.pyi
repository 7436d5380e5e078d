from typing import Any, Literal, Optional, Sequence, Tuple, Union, overload

import numpy as np
from numpy.typing import ArrayLike

# What the arguments take at run time: NumPy scalars as well as Python ones, a window as a list
_Float = Union[float, np.floating[Any], np.integer[Any]]
_Int = Union[int, np.integer[Any]]
_Bool = Union[bool, np.bool_]
_Window = Union[Tuple[Optional[_Int], Optional[_Int]], Sequence[Optional[_Int]]]

# Dask arrays in and out (typed Any: the stub does not make dask's types a requirement)
__all__ = ["scaled_dot_product_attention"]

@overload
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Optional[Any] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    out: None = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
    split_every: Optional[int] = ...,
) -> Any: ...
@overload
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Optional[Any] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    out: None = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
    split_every: Optional[int] = ...,
) -> Tuple[Any, Any]: ...
@overload
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Optional[Any] = ...,
    *,
    is_causal: _Bool = ...,
    causal_align: str = ...,
    scale: Optional[_Float] = ...,
    enable_gqa: _Bool = ...,
    return_weights: bool = ...,
    return_lse: bool = ...,
    out: None = ...,
    window: Optional[_Window] = ...,
    softcap: Optional[_Float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
    split_every: Optional[int] = ...,
) -> Any: ...
