"""Process- and thread-level robustness: a paged KVCache that fails while its pool grows (out of
memory, Ctrl-C), a fork while another thread is inside a cache, a daemon thread still in a call at
interpreter exit, a sub-interpreter import. Each test failed before its fix; the ones that need a
process of their own run a script in a subprocess, in a session of its own, with a timeout."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from _helpers import run_python

import pyattn
from pyattn import _kvcache


def _full_paged_cache(rng, dtype=np.float32):
    """A paged cache (blocks of 4, no max_len) whose pool of 4 blocks is full: the next token grows it."""
    cache = pyattn.KVCache(1, 1, 8, block_size=4, dtype=dtype)
    q = rng.standard_normal((1, 2, 16, 8)).astype(np.float32)
    cache.attend(q, rng.standard_normal((1, 1, 16, 8)), rng.standard_normal((1, 1, 16, 8)))
    assert not cache._free and cache.k.shape[0] == 4
    return cache


def _snapshot(cache):
    arrays = {
        n: getattr(cache, n).copy()
        for n in ("k", "v", "k_scale", "v_scale", "block_table")
        if getattr(cache, n) is not None
    }
    return cache.lens, list(cache._free), arrays


def _assert_unchanged(cache, snap):
    lens, free, arrays = snap
    assert np.array_equal(cache.lens, lens) and cache._free == free
    for n, x0 in arrays.items():
        x = getattr(cache, n)
        assert x.shape == x0.shape and np.array_equal(x.view(np.uint8), x0.view(np.uint8)), f"{n} changed"


class _Interrupting(np.ndarray):
    """An array whose writes raise KeyboardInterrupt: Ctrl-C while the grown pool is filled."""

    def __setitem__(self, key, value):
        raise KeyboardInterrupt


@pytest.mark.parametrize("failure", ["memory_error", "ctrl_c"])
@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_paged_pool_growth_that_fails_leaves_the_cache_as_it_was(failure, dtype, monkeypatch):
    """The pool's growth allocates K, then V (and the int8 scales), then copies the blocks held.
    It used to assign each new array to the cache as it went: a MemoryError at V left the cache
    with an empty K of the new size (every later attend raised), and Ctrl-C during the copy left V's
    new blocks zero under the old lens (later calls silently wrong). Now nothing changes."""
    rng = np.random.default_rng(0)
    cache = _full_paged_cache(rng, dtype)
    q1 = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    before = cache.attend(q1, None, None)
    snap = _snapshot(cache)
    real_zeros, calls = np.zeros, []

    def zeros(shape, dtype=float, *a, **kw):  # the second array of the grown pool fails
        calls.append(shape)
        if len(calls) == 2:
            if failure == "memory_error":
                raise MemoryError("test: no memory for the grown pool's V")
            return real_zeros(shape, dtype, *a, **kw).view(_Interrupting)
        return real_zeros(shape, dtype, *a, **kw)

    monkeypatch.setattr(_kvcache.np, "zeros", zeros)
    with pytest.raises(MemoryError if failure == "memory_error" else KeyboardInterrupt):
        cache.attend(q1, rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8)))
    monkeypatch.setattr(_kvcache.np, "zeros", real_zeros)
    assert calls and calls[0][0] == 8  # the pool did try to double
    _assert_unchanged(cache, snap)
    np.testing.assert_array_equal(cache.attend(q1, None, None), before)
    k1, v1 = rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8))
    cache.attend(q1, k1, v1)  # and it grows fine afterwards
    assert cache.lens[0] == 17 and cache.k.shape[0] == 8


def test_reset_takes_a_sequence_blocks_from_its_length(rng=None):
    """Entries past a sequence's length (left by a call that failed between writing them and
    clearing them) are never handed back to the free list twice."""
    rng = np.random.default_rng(1)
    cache = pyattn.KVCache(2, 1, 8, block_size=4, max_len=16)
    q = rng.standard_normal((2, 1, 5, 8)).astype(np.float32)
    cache.attend(q, rng.standard_normal((2, 1, 5, 8)), rng.standard_normal((2, 1, 5, 8)))
    stale = int(cache._free[0])
    cache.block_table[0, 3] = stale  # past sequence 0's two blocks, and still free
    cache.reset([0])
    assert sorted(cache._free) == sorted(set(cache._free)), "a block is in the free list twice"
    assert len(cache._free) == 8 - 2


def test_fork_while_another_thread_is_inside_attend():
    """A child forked while another thread held a KVCache's lock (inside attend) waited for ever on
    its first attend: the lock is inherited taken and that thread does not exist in the child."""
    code, out, err = run_python(
        """
        import os, threading, numpy as np, pyattn
        cache = pyattn.KVCache(1, 1, 8, max_len=64)
        q = np.ones((1, 1, 1, 8), np.float32)
        cache._lock.acquire()  # as another thread inside attend holds it
        pid = os.fork()
        if pid == 0:
            out = cache.attend(q, q, q)
            os._exit(0 if out.shape == (1, 1, 1, 8) else 3)
        cache._lock.release()
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert code == 0 and "child 0" in out, (code, out, err)


@pytest.mark.skipif(
    os.environ.get("PYATTN_SANITIZED") == "1",
    reason="ASan reports its own sigaltstack call (__asan_handle_no_return, stack-buffer-overflow in "
    "__interceptor_sigaltstack) while pthread_exit unwinds the thread: a report about the sanitizer's runtime",
)
@pytest.mark.parametrize("call", ["sdpa", "softmax", "matmul", "kvcache"])
def test_daemon_thread_in_a_call_at_exit(call):
    """A daemon thread inside a pyattn call when the interpreter exits: Python ends it with
    pthread_exit as the call takes the GIL back, and unwinding through pybind11's GIL guard (a
    noexcept destructor) aborted the process (134, 'terminate called without an active
    exception'). It now exits 0, as with NumPy's own calls."""
    code, out, err = run_python(
        f"""
        import threading, time, numpy as np, pyattn
        q = np.random.default_rng(0).standard_normal((1, 4, 256, 64)).astype(np.float32)
        a = np.random.default_rng(0).standard_normal((500, 500))
        cache = pyattn.KVCache(1, 4, 64, max_len=300)
        calls = dict(
            sdpa=lambda: pyattn.scaled_dot_product_attention(q, q, q),
            softmax=lambda: pyattn.softmax(q, axis=-2),
            matmul=lambda: pyattn.matmul(a, a),
            kvcache=lambda: (cache.reset(), cache.attend(q, q, q)),
        )
        f = calls["{call}"]
        def loop():
            while True:
                f()
        threading.Thread(target=loop, daemon=True).start()
        time.sleep(0.2)
        print("main returns", flush=True)
        """,
        timeout=120,
    )
    assert code == 0, (code, out, err[-2000:])


def test_import_in_a_sub_interpreter_raises():
    """Importing pyattn in a sub-interpreter hung for ever (the core's initialisation waited for
    a GIL its thread could not take); now ImportError."""
    si = pytest.importorskip("_xxsubinterpreters")
    del si
    code, out, err = run_python(
        """
        import _xxsubinterpreters as si
        iid = si.create()
        try:
            si.run_string(iid, "import pyattn")
        except Exception as exc:
            print("raised", type(exc).__name__, exc)
        """,
        timeout=60,
    )
    assert code == 0 and "ImportError" in out and "sub-interpreter" in out, (code, out, err)


def _held_blocks(cache):
    n = -(-cache.lens // cache.block_size)
    return [int(b) for r in range(cache.batch) for b in cache.block_table[r, : n[r]]]


@pytest.mark.parametrize("grow", [False, True])
def test_interrupt_at_any_line_of_the_commit_keeps_the_cache_usable(grow):
    """Ctrl-C (here raised by a trace function) at each line of KVCache's commit, with and without
    the pool growing: blocks may be lost, but none is both free and held, every free block lies in
    the pool, and the cache goes on taking tokens. Before, spare blocks of a grown pool joined the
    free list ahead of the pool itself: interrupted between, every later growth named blocks past
    the pool (ValueError for good)."""
    rng = np.random.default_rng(2)
    lines, line = [], 0
    while True:
        cache = pyattn.KVCache(1, 1, 8, block_size=4, max_len=None)
        held = 16 if grow else 13  # a full pool of 4 blocks, or room for the token in the last
        q = rng.standard_normal((1, 2, held, 8)).astype(np.float32)
        cache.attend(q, rng.standard_normal((1, 1, held, 8)), rng.standard_normal((1, 1, held, 8)))
        seen = []

        def tracer(frame, event, arg, seen=seen, at=line):
            if frame.f_code.co_name not in ("commit", "_commit_lens"):
                return None

            def local(frame, event, arg):
                if event == "line":
                    seen.append(frame.f_lineno)
                    if len(seen) == at + 1:
                        sys.settrace(None)
                        raise KeyboardInterrupt
                return local

            return local

        q1 = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
        sys.settrace(tracer)
        try:
            cache.attend(q1, rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8)))
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
        free, mine = set(cache._free), set(_held_blocks(cache))
        assert not free & mine, f"line {line}: blocks both free and held"
        assert all(0 <= b < cache.k.shape[0] for b in free), f"line {line}: free blocks past the pool"
        for _ in range(6):  # and it grows and takes tokens afterwards
            cache.attend(q1, rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8)))
        assert not set(cache._free) & set(_held_blocks(cache))
        if not interrupted:
            break
        lines.append(seen[-1])
        line += 1
    assert lines, "the commit was never interrupted"
