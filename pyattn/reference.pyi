from typing import Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "scaled_dot_product_attention",
    "multi_head_attention",
    "softmax",
    "matmul",
    "sinusoidal_positional_encoding",
    "additive_attention",
    "causal_mask",
    "logsumexp",
    "merge_attention_states",
]

def causal_mask(lq: int, lk: int, causal_align: str = ...) -> NDArray[np.bool_]: ...
def logsumexp(scores: ArrayLike, axis: int = ...) -> NDArray[np.float64]: ...
def softmax(
    x: ArrayLike, axis: int = ..., *, scale: Optional[float] = ..., mask: Optional[ArrayLike] = ...
) -> NDArray[np.float64]: ...
def matmul(a: ArrayLike, b: ArrayLike) -> Union[NDArray[np.float64], np.float64]: ...
def sinusoidal_positional_encoding(num_positions: int, d_model: int, *, base: float = ...) -> NDArray[np.float64]: ...
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = ...,
    *,
    is_causal: bool = ...,
    causal_align: str = ...,
    scale: Optional[float] = ...,
    enable_gqa: bool = ...,
    return_weights: bool = ...,
    return_lse: bool = ...,
    window: Optional[Tuple[Optional[int], Optional[int]]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Union[NDArray[np.float64], Tuple[NDArray[np.float64], ...]]: ...
def merge_attention_states(
    outputs: Union[ArrayLike, Sequence[ArrayLike]], lses: Union[ArrayLike, Sequence[ArrayLike]]
) -> Tuple[NDArray[np.float64], NDArray[np.float64]]: ...
def multi_head_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    num_heads: int,
    w_q: ArrayLike,
    w_k: ArrayLike,
    w_v: ArrayLike,
    w_o: ArrayLike,
    b_q: Optional[ArrayLike] = ...,
    b_k: Optional[ArrayLike] = ...,
    b_v: Optional[ArrayLike] = ...,
    b_o: Optional[ArrayLike] = ...,
    *,
    num_kv_heads: Optional[int] = ...,
    attn_mask: Optional[ArrayLike] = ...,
    key_padding_mask: Optional[ArrayLike] = ...,
    is_causal: bool = ...,
    causal_align: str = ...,
    need_weights: bool = ...,
    average_attn_weights: bool = ...,
    window: Optional[Tuple[Optional[int], Optional[int]]] = ...,
    softcap: Optional[float] = ...,
    alibi_slopes: Optional[ArrayLike] = ...,
    sinks: Optional[ArrayLike] = ...,
    kv_lens: Optional[ArrayLike] = ...,
) -> Tuple[NDArray[np.float64], Optional[NDArray[np.float64]]]: ...
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
) -> Union[NDArray[np.float64], Tuple[NDArray[np.float64], NDArray[np.float64]]]: ...
