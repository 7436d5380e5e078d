# Private extension module (csrc/bindings.cpp): pointers, sizes and strides only, all in elements.
# pyattn/_api.py validates and normalises every argument and calls these positionally; the
# kernels trust what they get (debug and sanitizer builds, where ``debug_checks`` is True, check
# each extent and stride against its array and raise IndexError). Use the pyattn package.
from typing import List, Optional

import numpy as np

__version__: str
compiler: str
debug_checks: bool

def gemm(
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    m: int,
    n: int,
    k: int,
    rsa: int,
    csa: int,
    rsb: int,
    csb: int,
    rsc: int,
    csc: int,
    batch: int,
    offa: Optional[np.ndarray],
    offb: Optional[np.ndarray],
    offc: Optional[np.ndarray],
) -> None:
    """c[i] = a[i] @ b[i], i < batch; matrix i of a starts at offa[i] (0 when None), m x k at
    strides (rsa, csa); likewise b (k x n) and c (m x n). c has a's and b's dtype."""

def merge(
    outs: List[np.ndarray],
    o_rs: List[int],
    lses: List[np.ndarray],
    l_s: List[int],
    out: np.ndarray,
    out_rs: int,
    out_lse: np.ndarray,
    rows: int,
    Ev: int,
) -> None:
    """Merge n attention states: state i's row r at outs[i] + r * o_rs[i] (unit element stride,
    out's dtype), its float64 lse at lses[i][r * l_s[i]]; out row r at r * out_rs, out_lse[r]
    (float64). Empty states (lse -inf) contribute nothing."""

def softmax(
    x: np.ndarray,
    out: np.ndarray,
    rows: int,
    n: int,
    xoff: np.ndarray,
    xcs: int,
    ooff: np.ndarray,
    ocs: int,
    mask_kind: int,
    mask: Optional[np.ndarray],
    moff: Optional[np.ndarray],
    mcs: int,
    scale: float,
) -> None:
    """out row r = softmax(x row r * scale + mask row r), r < rows; row r of x starts at xoff[r]
    with element stride xcs (likewise out, mask). mask_kind: 0 none, 1 bool (uint8 view), 2 additive."""

def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    bh: int,
    Lq: int,
    Lk: int,
    E: int,
    Ev: int,
    group: int,
    qoff: np.ndarray,
    q_rs: int,
    koff: np.ndarray,
    k_rs: int,
    voff: np.ndarray,
    v_rs: int,
    ooff: np.ndarray,
    o_rs: int,
    mask_kind: int,
    mask: Optional[np.ndarray],
    moff: Optional[np.ndarray],
    m_rs: int,
    m_cs: int,
    lse: Optional[np.ndarray],
    lseoff: Optional[np.ndarray],
    lse_s: int,
    weights: Optional[np.ndarray],
    woff: Optional[np.ndarray],
    w_rs: int,
    scale: float,
    causal: bool,
    bottom_right: bool,
    softcap: float,
    alibi: Optional[np.ndarray],
    sinks: Optional[np.ndarray],
    win_left: int,
    win_right: int,
    kv_lens: Optional[np.ndarray],
    kv_type: int,
    q_lens: Optional[np.ndarray],
    block_table: Optional[np.ndarray],
    bt_off: Optional[np.ndarray],
    block_size: int,
    k_ps: int,
    v_ps: int,
    k_scale: Optional[np.ndarray],
    ksoff: Optional[np.ndarray],
    ks_rs: int,
    ks_ps: int,
    v_scale: Optional[np.ndarray],
    vsoff: Optional[np.ndarray],
    vs_rs: int,
    vs_ps: int,
) -> None:
    """Attention over bh (batch, head) problems: problem i reads q[qoff[i]:] (Lq x E, row stride
    q_rs, unit feature stride), k[koff[i]:] (Lk x E), v[voff[i]:] (Lk x Ev) and writes
    out[ooff[i]:] (Lq x Ev); each run of `group` problems shares one K/V. bottom_right aligns
    causal, window and ALiBi at off = Lk_i - Lq. softcap: 0 for none; alibi, sinks: one value
    per problem (out's dtype) or None; win_left / win_right: window sides (2**50: unbounded);
    kv_lens: int64 keys per problem or None; kv_type: 0 K/V of out's dtype, 1 float16, 2 bfloat16,
    3 int8 (float32 out). q_lens: int64 queries per problem or None (no row past them is written).
    block_table (int32) / bt_off (int64 per problem) / block_size: a paged cache, key j of problem
    i at k[koff[i] + block_table[bt_off[i] + j // block_size] * k_ps + (j % block_size) * k_rs]
    (likewise v and the int8 scales, float32, at ksoff/ks_rs/ks_ps and vsoff/vs_rs/vs_ps).
    weights, if given, must be zero-filled."""

def kvcache_small(
    query: object,
    k_cache: object,
    v_cache: object,
    cache_lens: object,
    k_new: object,
    v_new: object,
    block_table: object,
    scale: object,
    is_causal: object,
    return_lse: object,
    k_scale: object,
    v_scale: object,
) -> object: ...
def sdpa_small(
    query: object,
    key: object,
    value: object,
    is_causal: object,
    causal_align: object,
    scale: object,
    enable_gqa: object,
    return_lse: object,
    window: object,
    softcap: object,
    alibi_slopes: object,
    sinks: object,
    kv_lens: object,
    out: object,
) -> object: ...
def isa() -> str: ...
def isa_reason() -> str: ...
def decode_prefetch_streams() -> bool: ...
def set_isa(name: str) -> bool: ...
def available_isas() -> list[str]: ...
def get_num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def thread_setting() -> int: ...
def default_num_threads() -> int: ...
def forked_after_team() -> bool: ...
