from typing import Any, Literal, Optional, Tuple, overload

from numpy.typing import ArrayLike

# Dask arrays in and out (typed Any: the stub does not make dask's types a requirement)
__all__ = ["scaled_dot_product_attention"]

@overload
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Optional[Any] = ...,
    *,
    is_causal: bool = ...,
    causal_align: str = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[False] = ...,
    out: None = ...,
    window: Optional[Tuple[Optional[int], Optional[int]]] = ...,
    softcap: Optional[float] = ...,
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
    is_causal: bool = ...,
    causal_align: str = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    return_weights: Literal[False] = ...,
    return_lse: Literal[True],
    out: None = ...,
    window: Optional[Tuple[Optional[int], Optional[int]]] = ...,
    softcap: Optional[float] = ...,
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
    is_causal: bool = ...,
    causal_align: str = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    return_weights: bool = ...,
    return_lse: bool = ...,
    out: None = ...,
    window: Optional[Tuple[Optional[int], Optional[int]]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
    split_every: Optional[int] = ...,
) -> Any: ...
