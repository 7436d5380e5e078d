"""The Python / C++ boundary: pyattn._core's named arguments, its stub, and the extent checks
that debug and sanitizer builds make on every pointer, size and stride."""

from __future__ import annotations

import ast
import os
import re

import numpy as np
import pytest

import pyattn
from pyattn import _core

STUB = os.path.join(os.path.dirname(pyattn.__file__), "_core.pyi")


def _stub_signatures():
    tree = ast.parse(open(STUB).read())
    return {f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)}


def _core_signature(name):
    doc = getattr(_core, name).__doc__
    m = re.search(rf"^{name}\((.*?)\) ->", doc, re.M)
    assert m, doc
    return [p.split(":")[0].strip() for p in m.group(1).split(", ") if p]


@pytest.mark.parametrize("name", sorted(_stub_signatures()))
def test_stub_matches_the_extension(name):
    """Every function of _core.pyi exists with exactly the stub's argument names, in order."""
    assert _core_signature(name) == _stub_signatures()[name]


def test_every_extension_function_has_a_stub():
    public = {n for n in dir(_core) if not n.startswith("_") and callable(getattr(_core, n))}
    assert public == set(_stub_signatures())


def _attention_kwargs(q, k, v, out):
    bh, Lq, E = q.shape
    Lk, Ev = v.shape[1:]
    offs = lambda a: np.arange(a.shape[0], dtype=np.int64) * (a.strides[0] // a.itemsize)  # noqa: E731
    return dict(
        q=q, k=k, v=v, out=out, bh=bh, Lq=Lq, Lk=Lk, E=E, Ev=Ev, group=1,
        qoff=offs(q), q_rs=E, koff=offs(k), k_rs=E, voff=offs(v), v_rs=Ev, ooff=offs(out), o_rs=Ev,
        mask_kind=0, mask=None, moff=None, m_rs=0, m_cs=0, lse=None, lseoff=None, lse_s=1,
        weights=None, woff=None, w_rs=Lk, scale=1.0, causal=False, bottom_right=False,
        softcap=0.0, alibi=None, sinks=None, win_left=1 << 50, win_right=1 << 50, kv_lens=None, kv_type=0,
        q_lens=None, block_table=None, bt_off=None, block_size=0, k_ps=0, v_ps=0,
        k_scale=None, ksoff=None, ks_rs=0, ks_ps=0, v_scale=None, vsoff=None, vs_rs=0, vs_ps=0,
    )  # fmt: skip


def _qkvo(rng):
    q = rng.standard_normal((2, 5, 4))
    k = rng.standard_normal((2, 7, 4))
    v = rng.standard_normal((2, 7, 3))
    return q, k, v, np.empty((2, 5, 3))


def test_keywords_reach_the_kernel(rng):
    """Called by name, the core computes what the public function does."""
    q, k, v, out = _qkvo(rng)
    _core.attention(**_attention_kwargs(q, k, v, out))
    np.testing.assert_allclose(out, pyattn.reference.scaled_dot_product_attention(q, k, v, scale=1.0), rtol=1e-12)


needs_checks = pytest.mark.skipif(not _core.debug_checks, reason="a release build trusts its caller")


@needs_checks
@pytest.mark.parametrize(
    "change",
    [
        dict(Lq=6),  # one query row more than q and out hold
        dict(Lk=8),  # one key more than k and v hold
        dict(E=5),  # features past the row
        dict(k_rs=5),  # a row stride that walks past k
        dict(bh=3),  # more problems than offsets
        dict(w_rs=7),  # weights asked for without room
        dict(group=2, bh=3),  # bh not a multiple of group
    ],
)
def test_debug_build_refuses_out_of_range_arguments(change, rng):
    """Debug/sanitizer builds turn a wrong size or stride into IndexError before any kernel runs."""
    q, k, v, out = _qkvo(rng)
    kw = _attention_kwargs(q, k, v, out)
    if "w_rs" in change:
        kw.update(weights=np.zeros((2, 5, 6)), woff=np.arange(2, dtype=np.int64) * 30)
    kw.update(change)
    with pytest.raises(IndexError, match="pyattn._core"):
        _core.attention(**kw)


@needs_checks
def test_debug_build_refuses_a_short_gemm_operand(rng):
    a, b, c = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), np.empty((4, 5))
    kw = dict(a=a, b=b, c=c, m=4, n=5, k=3, rsa=3, csa=1, rsb=5, csb=1, rsc=5, csc=1, batch=1,
              offa=None, offb=None, offc=None)  # fmt: skip
    _core.gemm(**kw)
    np.testing.assert_allclose(c, a @ b)
    with pytest.raises(IndexError, match="pyattn._core: a"):
        _core.gemm(**dict(kw, k=4))  # a's rows are 3 long
    with pytest.raises(IndexError, match="pyattn._core: b"):
        _core.gemm(**dict(kw, n=6))  # b's rows are 5 long
    with pytest.raises(IndexError, match="pyattn._core: c"):
        _core.gemm(**dict(kw, rsc=6))


@needs_checks
def test_debug_build_refuses_a_softmax_row_past_the_end(rng):
    x, out = rng.standard_normal((3, 4)), np.empty((3, 4))
    offs = np.arange(3, dtype=np.int64) * 4
    kw = dict(x=x, out=out, rows=3, n=4, xoff=offs, xcs=1, ooff=offs, ocs=1, mask_kind=0, mask=None, moff=None,
              mcs=0, scale=1.0)  # fmt: skip
    _core.softmax(**kw)
    with pytest.raises(IndexError, match="pyattn._core: x"):
        _core.softmax(**dict(kw, n=5))


def _core_calls():
    """(function name, [(line's positional args, line's comment names)]) for every _core call in
    _api.py: the hot paths call positionally, each line commented with the names it passes."""
    calls = []
    for module in ("_api.py", "_kvcache.py"):
        calls += _core_calls_in(module)
    return calls


def _core_calls_in(module):
    path = os.path.join(os.path.dirname(pyattn.__file__), module)
    src = open(path).read()
    lines = src.splitlines()
    calls = []
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "_core"
            and node.func.attr in ("gemm", "softmax", "attention")
        ):
            assert not node.keywords, "call the core positionally (keywords cost ~1.8 us a call)"
            per_line = {}
            for a in node.args:
                per_line.setdefault(a.lineno, []).append(a)
            rows = []
            for ln, args in sorted(per_line.items()):
                comment = lines[ln - 1].split("#")[-1].strip()
                rows.append((len(args), [n.strip() for n in comment.split(",")]))
            calls.append((node.func.attr, rows))
    return calls


def test_positional_core_calls_follow_the_stub():
    """Each line of a positional _core call names (in a comment) exactly the stub's arguments it
    passes, in order: a swapped or missing argument shows up as a mismatch here."""
    calls = _core_calls()
    assert sorted({c[0] for c in calls}) == ["attention", "gemm", "softmax"]
    stub = _stub_signatures()
    for name, rows in calls:
        named = [n for _, names in rows for n in names]
        assert named == stub[name], (name, named)
        for nargs, names in rows:
            assert nargs == len(names), (name, names)
