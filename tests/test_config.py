"""show_config, thread settings, SIMD selection."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _decode_cases import decode_cases
from _helpers import ISAS, run_python

import pyattn


def test_show_config(capsys):
    cfg = pyattn.show_config()
    printed = capsys.readouterr().out
    assert isinstance(cfg, dict)
    for key in ("version", "isa", "isas_available", "compiler", "threads"):
        assert key in cfg, key
    assert printed.strip(), "show_config() prints its configuration"
    assert str(cfg["version"]) in printed
    assert str(cfg["isa"]) in printed
    assert cfg["threads"] == pyattn.get_num_threads()
    assert cfg["isa"] in list(cfg["isas_available"])
    assert "generic" in list(cfg["isas_available"])
    assert cfg["version"] == pyattn.__version__


def test_show_config_follows_settings(capsys):
    with pyattn.num_threads(1):
        assert pyattn.show_config()["threads"] == 1
    capsys.readouterr()


def test_get_set_num_threads():
    old = pyattn.get_num_threads()
    assert isinstance(old, int) and old >= 1
    try:
        pyattn.set_num_threads(1)
        assert pyattn.get_num_threads() == 1
        pyattn.set_num_threads(3)
        assert pyattn.get_num_threads() == 3
    finally:
        pyattn.set_num_threads(old)
    assert pyattn.get_num_threads() == old


def test_num_threads_context_restores():
    old = pyattn.get_num_threads()
    with pyattn.num_threads(1):
        assert pyattn.get_num_threads() == 1
        with pyattn.num_threads(2):
            assert pyattn.get_num_threads() == 2
        assert pyattn.get_num_threads() == 1
    assert pyattn.get_num_threads() == old


def test_num_threads_context_restores_on_error():
    old = pyattn.get_num_threads()
    with pytest.raises(RuntimeError):
        with pyattn.num_threads(1):
            raise RuntimeError("boom")
    assert pyattn.get_num_threads() == old


def test_more_threads_than_work():
    q = np.ones((1, 1, 2, 4))
    with pyattn.num_threads(16):
        out = pyattn.scaled_dot_product_attention(q, q, q)
    np.testing.assert_allclose(out, q[..., :2, :])


def test_isa_switch():
    from pyattn import _core

    isas = list(_core.available_isas())
    assert "generic" in isas
    assert _core.isa() in isas
    old = _core.isa()
    try:
        for name in isas:
            _core.set_isa(name)
            assert _core.isa() == name
            assert pyattn.show_config()["isa"] == name
    finally:
        _core.set_isa(old)
    # an unknown name is refused: set_isa returns False (raises nothing) and changes nothing
    for name in ("not-an-isa", ""):
        assert _core.set_isa(name) is False, name
        assert _core.isa() == old


def test_isa_fixture_covers_all_paths():
    from pyattn import _core

    assert ISAS == list(_core.available_isas())


@pytest.mark.parametrize("name", ISAS)
def test_env_var_selects_isa(name):
    if name == "default":
        pytest.skip("pyattn._core not importable")
    env = dict(os.environ, PYATTN_ISA=name)
    code = "import pyattn, pyattn._core as c; print(c.isa()); print(pyattn.show_config()['isa'])"
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0] == name
    assert lines[-1] == name


def test_show_config_says_why_the_isa(capsys):
    """isa_reason names the CPU flags (or the architecture) behind the default choice, and says
    when PYATTN_ISA or set_isa() chose instead."""
    code = "import io, pyattn; c = pyattn.show_config(file=io.StringIO()); print(c['isa_forced_by'])\n"
    code += "print(c['isa_reason'])"
    here = os.path.dirname(os.path.abspath(__file__))
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=here, timeout=120
    )
    base = {k: v for k, v in os.environ.items() if k != "PYATTN_ISA"}
    default = run(base)
    assert default.returncode == 0, default.stderr
    flags = {"avx512": "AVX-512", "avx2": "AVX2", "neon": "AArch64", "generic": "portable"}
    assert flags[ISAS[-1]] in default.stdout and default.stdout.startswith("None\n"), default.stdout
    forced = run(dict(base, PYATTN_ISA="generic"))
    assert forced.stdout.split("\n")[:2] == ["PYATTN_ISA", "forced by PYATTN_ISA"], forced.stdout
    empty = run(dict(base, PYATTN_ISA=""))  # unset, for the C layer as for the Python one
    assert empty.stdout == default.stdout, (empty.stdout, default.stdout)
    bad = run(dict(base, PYATTN_ISA="no-such-set"))  # forces nothing: isa_forced_by None
    assert "PYATTN_ISA names no kernel set" in bad.stdout and flags[ISAS[-1]] in bad.stdout, bad.stdout
    assert bad.stdout.startswith("None\n"), bad.stdout
    core = pyattn._core
    old = core.isa()
    try:
        assert core.set_isa("generic")
        assert pyattn.show_config()["isa_reason"] == "set by set_isa()"
        assert pyattn.show_config()["isa_forced_by"] == "set_isa()"
        assert "set by set_isa()" in capsys.readouterr().out
    finally:
        core.set_isa(old)


def test_version():
    assert isinstance(pyattn.__version__, str) and pyattn.__version__


def test_public_names():
    for name in [
        "scaled_dot_product_attention",
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
    ]:
        assert hasattr(pyattn, name), name


def test_env_var_unknown_isa_still_imports():
    """An unknown PYATTN_ISA: pyattn imports, warns (RuntimeWarning naming PYATTN_ISA), falls back
    to the best kernel set this CPU has, and computes the right value."""
    env = dict(os.environ, PYATTN_ISA="not-an-isa")
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pyattn, numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        "q, k, v = (rng.standard_normal((2, 7, 5)) for _ in range(3))\n"
        "err = np.max(np.abs(pyattn.scaled_dot_product_attention(q, k, v)\n"
        "                    - pyattn.reference.scaled_dot_product_attention(q, k, v)))\n"
        "print(json.dumps({'isa': pyattn._core.isa(), 'err': float(err), 'warnings': [\n"
        "    [w.category.__name__, str(w.message)] for w in caught]}))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # available_isas() lists the kernel sets from the most portable to the fastest
    assert out["isa"] == ISAS[-1]
    assert out["err"] < 1e-12
    assert any(
        cat == "RuntimeWarning" and "PYATTN_ISA" in msg and "not-an-isa" in msg and "names no kernel set" in msg
        for cat, msg in out["warnings"]
    ), out["warnings"]


@pytest.mark.parametrize("value", ["false", "off", "2", " 1", "01"])
def test_env_var_decode_prefetch_other_values_warn(value):
    """PYATTN_DECODE_PREFETCH takes '0' or '1'; any other value leaves the default in place, and
    says so at import (a RuntimeWarning naming the variable and the value) instead of silently."""
    code = (
        "import io, json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pyattn\n"
        "flag = pyattn.show_config(file=io.StringIO())['decode_prefetch']\n"
        "print(json.dumps({'flag': flag, 'warnings': [[w.category.__name__, str(w.message)] for w in caught]}))\n"
    )

    def run(setting):
        env = {k: v for k, v in os.environ.items() if k != "PYATTN_DECODE_PREFETCH"}
        if setting is not None:
            env["PYATTN_DECODE_PREFETCH"] = setting
        rc, out, err = run_python(code, env=env, timeout=120)
        assert rc == 0, err
        return json.loads(out.strip().splitlines()[-1])

    got, unset = run(value), run(None)
    assert got["flag"] is unset["flag"]  # ignored: the CPU's default
    assert unset["warnings"] == []
    named = [msg for cat, msg in got["warnings"] if cat == "RuntimeWarning" and "PYATTN_DECODE_PREFETCH" in msg]
    assert any(repr(value) in msg for msg in named), got["warnings"]
    for ok in ("0", "1", ""):
        assert run(ok)["warnings"] == [], ok


def test_num_threads_restores_an_unset_count():
    """After ``with num_threads(k)`` an unset thread count is unset again, so OpenMP's count (and
    threadpoolctl's limits on it) reach pyattn as before; an explicit count comes back as it was."""
    code = (
        "import pyattn\n"
        "from threadpoolctl import threadpool_limits\n"
        "with pyattn.num_threads(1):\n"
        "    assert pyattn.get_num_threads() == 1\n"
        "assert pyattn._core.thread_setting() == 0\n"
        "with threadpool_limits(1):\n"
        "    assert pyattn.get_num_threads() == 1, pyattn.get_num_threads()\n"
        "pyattn.set_num_threads(3)\n"
        "with pyattn.num_threads(1):\n"
        "    pass\n"
        "assert pyattn.get_num_threads() == 3\n"
    )
    pytest.importorskip("threadpoolctl")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_default_thread_count_is_bounded():
    """OMP_NUM_THREADS=100000 became pyattn's count unchecked (a call started 190 threads), where
    set_num_threads refuses past max(16, 4 x CPUs): the default is held to the same bound."""
    code = (
        "import os, numpy as np, pyattn\n"
        "cpus = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()\n"
        "print(pyattn.get_num_threads(), max(16, 4 * cpus))\n"
        "q = np.ones((1, 2, 256, 16), np.float32)\n"
        "assert np.isfinite(pyattn.scaled_dot_product_attention(q, q, q)).all()\n"
    )
    for value, bounded in (("100000", True), ("3", False)):
        env = dict(os.environ, OMP_NUM_THREADS=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        got, bound = map(int, r.stdout.split())
        assert got == (bound if bounded else 3)


def test_decode_prefetch_choice():
    """PYATTN_DECODE_PREFETCH picks how the decode streams single K/V rows (key by key with
    prefetches, or several keys at a time without); show_config reports the choice, and both
    give the reference's result on every kernel set: float32 (with kv_lens), float16 and int8
    K/V, each past the 16 MiB the decode treats as cached, so that the choice applies (to rows
    past 128 bytes; the shorter float16 D64 and int8 D128 rows take several keys at a time under
    every setting). Under every setting, single rows through a paged copy of such a cache (which
    streams key by key) give bit for bit what the contiguous cache gives (tests/_decode_cases.py
    paged_twins)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import io, json, sys, numpy as np, pyattn, pyattn._core as c\n"
        # tests/ by path: under PYTHONSAFEPATH (the wheel builds' tests) -c adds no directory
        f"sys.path.insert(0, {here!r})\n"
        "from _decode_cases import decode_cases, paged_twins\n"
        "cases, twins = decode_cases(), paged_twins()\n"
        "out, differ = {}, []\n"
        "for isa in c.available_isas():\n"
        "    c.set_isa(isa)\n"
        "    for name, (fn, _) in cases.items():\n"
        "        out[f'{isa} {name}'] = fn().tolist()\n"
        "    for name, (flat, paged) in twins.items():\n"
        "        (o, l), (po, pl) = flat(), paged()\n"
        "        if not (np.array_equal(o, po) and np.array_equal(l, pl)):\n"
        "            differ.append(f'{isa} {name}')\n"
        "flag = pyattn.show_config(file=io.StringIO())['decode_prefetch']\n"
        "print(json.dumps({'flag': flag, 'out': out, 'paged_differs': differ}))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "PYATTN_DECODE_PREFETCH"}
    refs = {name: ref() for name, (_, ref) in decode_cases().items()}
    flags = {}
    for setting, flag in (("0", False), ("1", True), ("", None), ("yes", None)):
        res = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(base, PYATTN_DECODE_PREFETCH=setting),
            capture_output=True,
            text=True,
            cwd=here,
            timeout=600,
        )
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        flags[setting] = got["flag"]
        if flag is not None:
            assert got["flag"] is flag, (setting, got["flag"])
        assert len(got["out"]) == len(refs) * len(pyattn._core.available_isas())
        assert got["paged_differs"] == [], f"paged cache not bit-identical to contiguous ({setting!r})"
        for key, out in got["out"].items():
            name = key.split(" ", 1)[1]
            np.testing.assert_allclose(np.asarray(out), refs[name], rtol=0, atol=3e-6, err_msg=f"{key} {setting!r}")
    assert flags["yes"] is flags[""]  # anything but 0 or 1 leaves the choice to the CPU


def test_api_reference_table_lists_every_public_name():
    """docs/api.md's table "Public names (pyattn.__all__)" names each of them (it had left out
    kvcache_attention, KVCache and varlen_attention), and nothing else."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    table = text.split("Public names (`pyattn.__all__`):", 1)[1].split("\n\n", 2)[1]
    listed = {n for row in table.splitlines() for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert listed == set(pyattn.__all__), (sorted(set(pyattn.__all__) - listed), sorted(listed - set(pyattn.__all__)))
